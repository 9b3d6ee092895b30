"""Probe of torch's fused CPU AdamW arithmetic (issue 14's starting point; see
docs/fused-adamw-cpu.md). One fused step of torch.optim.AdamW(fused=True) on random float32
tensors, compared element by element with candidate evaluation orders computed here
(float64 then one rounding stands in for a fused multiply-add). Prints, per candidate, how
many elements differ in the vectorized part and in the scalar tail.

    .venv/bin/python scripts/fused_probe.py [--numel N] [--tail T] [--seed S]
"""

from __future__ import annotations

import argparse
import math

import torch


def f(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def d(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=100_000)
    ap.add_argument("--tail", type=int, default=13, help="elements past a multiple of the vector width")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    n, t = args.numel + args.tail, args.tail
    p = torch.randn(n) * 0.1
    g = torch.randn(n) * torch.exp2(torch.randint(-12, 2, (n,)).float())
    m = torch.randn(n) * 1e-3
    v = torch.rand(n) * 1e-5
    lr, b1, b2, eps, wd, step = 1e-3, 0.9, 0.999, 1e-8, 0.01, 3.0
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    opt = torch.optim.AdamW([param], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, fused=True)
    opt.step()  # creates the state; then set it to known values
    st = opt.state[param]
    st["exp_avg"].copy_(m)
    st["exp_avg_sq"].copy_(v)
    st["step"].fill_(step - 1)
    param.data.copy_(p)
    opt.step()

    def F(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32)

    bc1, bc2 = 1 - b1**step, 1 - b2**step
    s, bc2s = F(-(lr / bc1)), F(math.sqrt(bc2))
    w, c, B2 = F(1 - b1), F(1 - b2), F(b2)
    M, V = st["exp_avg"], st["exp_avg_sq"]

    def report(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        print(f"{what:40s} vector {int((got[:-t] != want[:-t]).sum()):6d}   tail {int((got[-t:] != want[-t:]).sum()):3d}")

    report("exp_avg = fma(w, g-m, m)", f(d(w) * d(f(g - m)) + d(m)), M)
    report("exp_avg_sq = (v*b2) + (c*g)*g", f(f(v * B2) + f(f(c * g) * g)), V)
    report("exp_avg_sq = fma(c*g, g, v*b2)", f(d(f(c * g)) * d(g) + d(f(v * B2))), V)
    report("exp_avg_sq = fma(v, b2, (c*g)*g)", f(d(v) * d(B2) + d(f(f(c * g) * g))), V)
    den = f(f(torch.sqrt(V) / bc2s) + F(eps))
    pd = f(p * F(1 - lr * wd))
    report("param = p*decay + (s*m)/den", f(pd + f(f(s * M) / den)), param.data)
    report("param = p*decay + s*(m/den)", f(pd + f(s * f(M / den))), param.data)
    report("param = fma(p, decay, (s*m)/den)", f(d(p) * d(F(1 - lr * wd)) + d(f(f(s * M) / den))), param.data)


if __name__ == "__main__":
    main()
