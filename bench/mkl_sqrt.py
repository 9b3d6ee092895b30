"""How often torch's float32 sqrt (MKL's vmsSqrt where torch has MKL) differs from the correctly
rounded square root, over every non-negative float32 value up to +inf (one by one, in chunks).

The reference is sqrt in float64 rounded to float32, which is correctly rounded (float64 carries
more than 2 x 24 + 2 bits). This is why sonard calls the client's own vmsSqrt for float32
(optimizer/vml): where this count is not 0, the IEEE root would change the bits.

Run: .venv/bin/python bench/mkl_sqrt.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import json
import time

import torch

CHUNK = 1 << 26
LAST = 0x7F800000  # +inf


def main() -> None:
    t0 = time.perf_counter()
    checked = differ = 0
    for lo in range(0, LAST + 1, CHUNK):
        bits = torch.arange(lo, min(lo + CHUNK, LAST + 1), dtype=torch.int64).to(torch.int32)
        x = bits.view(torch.float32)
        got = torch.sqrt(x).view(torch.int32)
        want = x.double().sqrt().float().view(torch.int32)
        differ += int((got != want).sum())
        checked += x.numel()
    print(json.dumps({"torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
                      "mkl": torch.backends.mkl.is_available(), "checked": checked, "differ": differ,
                      "share": differ / checked, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
