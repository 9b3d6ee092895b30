"""The platform wheel brings a working sonard: built here, installed into a fresh venv
outside the repository, it trains a small MoE bit for bit like torch.optim.AdamW with no
environment variable, no Go and no repository on the path."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import os, subprocess, sys
    import torch, sonar_moe
    from sonar_moe import find_sonard
    assert "sonar_moe" not in os.environ.get("PYTHONPATH", "")
    binary = find_sonard()
    assert binary.startswith(sys.prefix), (binary, sys.prefix)
    assert sonar_moe.__file__.startswith(sys.prefix), sonar_moe.__file__
    assert "sonar_moe.libs" in subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    assert sonar_moe.__version__ in version, (version, sonar_moe.__version__)

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(16, 4)
            self.experts = torch.nn.Module()
            self.experts.up = torch.nn.Parameter(torch.randn(4, 32, 16) * 0.1)
            self.experts.down = torch.nn.Parameter(torch.randn(4, 16, 32) * 0.1)
            self.head = torch.nn.Linear(16, 3)
        def forward(self, x):
            w = self.router(x).softmax(-1)
            h = torch.einsum("bh,eih->bei", x, self.experts.up).relu()
            y = torch.einsum("bei,ehi->beh", h, self.experts.down)
            return self.head((w.unsqueeze(-1) * y).sum(1))

    torch.manual_seed(0); ref = MoE()
    torch.manual_seed(0); mine = MoE()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dense = [p for n, p in ref.named_parameters() if "experts" not in n]
    with sonar_moe.SonarAdamW(mine, lr=1e-2, max_grad_norm=0.5) as opt:
        assert len(opt.named_expert_parameters()) == 2
        for step in range(5):
            x = torch.randn(8, 16); y = torch.randint(0, 3, (8,))
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            torch.nn.utils.clip_grad_norm_(dense, 0.5); ropt.step(); ropt.zero_grad()
            torch.nn.functional.cross_entropy(mine(x), y).backward()
            opt.step(); opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mine.parameters()))
    print("WHEEL OK", binary)
''')


def test_wheel_installs_and_trains(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SONARD", "PYTHONPATH")}
    subprocess.run(["scripts/build-wheel", sys.executable], cwd=ROOT, check=True, env=env,
                   stdout=subprocess.DEVNULL)
    wheels = glob.glob(str(ROOT / "dist" / "sonar_moe-*-manylinux*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheels[0]], check=True)
    # torch, pyzmq and msgpack come from the test's environment (a plain path entry: its
    # .pth files, such as the repository's editable install of sonar_moe, are not processed).
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env["PATH"] = "/usr/bin:/bin"
    out = subprocess.run([py, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "WHEEL OK" in out.stdout, out.stdout + out.stderr
