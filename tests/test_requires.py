"""The torch releases sonar_moe accepts (pyclient/sonar_moe/_requires.py). Which releases step
bit for bit as their own AdamW is measured by scripts/torch-versions (docs/versions.md);
these tests check that an older torch is refused at import with what to do, and a newer one is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sonar_moe._requires import MIN_TORCH, check_torch, torch_release

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version,release,refused", [
    ("1.13.1", (1, 13), True),
    ("2.1.2", (2, 1), True),
    ("2.6.0+cu124", (2, 6), True),
    ("2.7.0", (2, 7), False),
    ("2.7.1+cpu", (2, 7), False),
    ("2.10.0", (2, 10), False),  # compared as numbers, not as text ("2.10" < "2.7")
    ("2.16.0a0+git1234abc", (2, 16), False),
    ("3.0.0", (3, 0), False),
    ("unknown", None, False),  # a source build may call itself anything: let it through
])
def test_check_torch(version: str, release: tuple[int, int] | None, refused: bool) -> None:
    assert torch_release(version) == release
    if refused:
        with pytest.raises(ImportError, match=r"needs torch >= 2\.7, and this is torch .*pip install 'torch>=2\.7'"):
            check_torch(version)
    else:
        check_torch(version)


@pytest.mark.parametrize("version,ok", [("2.6.0", False), (".".join(map(str, MIN_TORCH)) + ".0", True)])
def test_import_checks_this_torch(version: str, ok: bool) -> None:
    """`import sonar_moe` in a process whose torch reports an older release fails at once, before
    anything builds on that torch's AdamW, and names the release it needs."""
    code = f"import torch; torch.__version__ = {version!r}; import sonar_moe; print('imported')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "pyclient", capture_output=True, text=True,
                       timeout=120)
    if ok:
        assert r.returncode == 0 and "imported" in r.stdout, r.stderr
    else:
        assert r.returncode != 0 and "imported" not in r.stdout
        assert f"ImportError: sonar_moe needs torch >= 2.7, and this is torch {version}" in r.stderr, r.stderr
