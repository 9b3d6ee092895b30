"""The step scalars SonarAdamW(fused=True) sends for CUDA expert tensors (torch's fused CUDA
AdamW takes lr, the betas, weight_decay and eps and derives the rest on the device; see
docs/gpu.md). CPU only: the kernels themselves are checked by scripts/gpu-check."""

from __future__ import annotations

import pytest
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


def test_fused_cuda_arithmetic_by_torch_version() -> None:
    from sonar_moe.optimizer import fused_cuda_arithmetic

    for v, want in [("2.10.0+cu128", "double"), ("2.9.1", "double"), ("2.8.0", "double"), ("2.7.1", None),
                    ("1.13.1", None), ("2.11.0+cu130", "float"), ("2.11.0a0+git70d99e9", "float"),
                    ("2.15.0+cu132", "float"), ("3.0.0", "float"), ("junk", None)]:
        assert fused_cuda_arithmetic(v) == want, v


def test_fused_cuda_scalars_say_which_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    import sonar_moe.optimizer as o

    assert "fused_double" not in torch_fused_cuda_scalars(GROUP, 1.0) or o.fused_cuda_arithmetic() == "double"
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    assert torch_fused_cuda_scalars(GROUP, 1.0)["fused_double"] is True
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert "fused_double" not in torch_fused_cuda_scalars(GROUP, 1.0)
