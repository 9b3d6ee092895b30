"""The package's version: the repository's VERSION file (sonar_moe/VERSION links to it and the
wheel carries a copy), the one place it is written for sonard and sonar_moe alike."""

from importlib.resources import files

__version__ = files(__package__).joinpath("VERSION").read_text().strip()
