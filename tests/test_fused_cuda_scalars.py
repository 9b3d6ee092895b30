"""The step scalars SonarAdamW(fused=True) sends for CUDA expert tensors (torch's fused CUDA
AdamW takes lr, the betas, weight_decay and eps and derives the rest on the device; see
docs/gpu.md). CPU only: the kernels themselves are checked by scripts/gpu-check."""

from __future__ import annotations

import torch

from sonar_moe import torch_fused_cuda_scalars, torch_scalars

GROUP = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True, "maximize": False}


def test_fused_cuda_scalars_carry_the_hyper_parameters() -> None:
    sc = torch_fused_cuda_scalars(GROUP, 7.0)
    assert sc["fused"] is True and sc["lanes"] == 0
    assert (sc["lr"], sc["beta1"], sc["weight_decay"], sc["beta2"], sc["eps"]) == (3e-4, 0.9, 0.1, 0.95, 1e-6)
    # What the server checks them against: the float64 values computed from the same numbers.
    assert sc["beta1_w"] == 1 - 0.9 and sc["decay"] == 1 - 3e-4 * 0.1
    assert sc["amsgrad"] is True and sc["maximize"] is False
    # The rest are the usual scalars of that step.
    plain = torch_scalars(GROUP, 7.0)
    for k in ("neg_step_size", "bc2_sqrt", "one_minus_beta2", "apply_decay"):
        assert sc[k] == plain[k], k


def test_fused_cuda_scalars_with_tensor_lr_and_betas() -> None:
    g = dict(GROUP, lr=torch.tensor(3e-4), betas=(torch.tensor(0.9), torch.tensor(0.95)))
    sc = torch_fused_cuda_scalars(g, 2.0)
    # torch's _fused_adam reads tensor betas with .item(); a float32 lr tensor reaches the kernel as that float.
    assert sc["lr"] == float(torch.tensor(3e-4).item())
    assert sc["beta1"] == float(torch.tensor(0.9).item()) and sc["beta2"] == float(torch.tensor(0.95).item())
    assert sc["beta1_w"] == 1 - sc["beta1"] and sc["decay"] == 1 - sc["lr"] * sc["weight_decay"]
    assert all(isinstance(v, (bool, int, float)) for v in sc.values())


def test_fused_cuda_needs_torch_2_11() -> None:
    from sonar_moe.optimizer import fused_cuda_supported

    for v, ok in [("2.10.0+cu128", False), ("2.9.1", False), ("2.8.0", False), ("1.13.1", False),
                  ("2.11.0+cu130", True), ("2.11.0a0+git70d99e9", True), ("2.15.0+cu132", True), ("3.0.0", True)]:
        assert fused_cuda_supported(v) is ok, v
