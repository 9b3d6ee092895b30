__version__ = "0.1.0"  # keep equal to the repository's VERSION file (a test checks)
