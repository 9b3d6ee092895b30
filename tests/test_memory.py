"""Expert-gradient memory: SonarAdamW keeps at most one layer's expert gradients alive
(plus its slot ring); the reference holds every layer's until step()."""

from __future__ import annotations

from typing import cast

import pytest
import torch

import sonar_moe
import tiny_moe as tm


@pytest.mark.parametrize("zero_copy", [True, False])
def test_peak_expert_gradient_bytes_is_one_layer(zero_copy: bool) -> None:
    layers = 6
    cfg = tm.MoEConfig(num_layers=layers, num_experts=8, hidden=64, intermediate=128)
    ref, mine = tm.build(cfg, 2), tm.build(cfg, 2)
    experts = tm.expert_param_names(ref)
    by_name = dict(ref.named_parameters())
    layer_bytes = sum(by_name[n].numel() * 4 for n in experts) // layers
    biggest = max(by_name[n].numel() * 4 for n in experts)

    x = next(tm.batches(tm.load_corpus(100_000), 4, 32, torch.Generator().manual_seed(0)))
    loss, _ = ref(x, labels=x)
    loss.backward()
    ref_alive = sum(cast(torch.Tensor, by_name[n].grad).numel() * 4 for n in experts)  # noqa: all held until step()
    assert ref_alive == layers * layer_bytes

    with sonar_moe.SonarAdamW(mine, zero_copy=zero_copy) as opt:
        for _ in range(3):
            loss, _ = mine(x, labels=x)
            loss.backward()
            assert all(p.grad is None for n, p in mine.named_parameters() if n in experts)
            opt.step()
            opt.zero_grad()
        st = opt.stats()
    ring = st["ring_bytes"]
    if zero_copy:
        # No ring: autograd's gradients wait for the server, one layer of them at most.
        assert ring == 0 and st["zero_copy"]
        assert biggest <= st["peak_expert_grad_bytes"] <= layer_bytes
        return
    # The ring is sized to one layer of expert gradients (plus page padding per slot).
    assert layer_bytes <= ring <= layer_bytes + 2 * 8192
    # Alive at once: the gradient autograd just produced plus what waits in the ring.
    assert st["peak_expert_grad_bytes"] <= ring + biggest
    assert st["peak_expert_grad_bytes"] >= biggest
    assert st["peak_expert_grad_bytes"] < ref_alive / 2
    print(f"reference holds {ref_alive} B of expert gradients; Sonar peak {st['peak_expert_grad_bytes']} B "
          f"(ring {ring} B, one layer {layer_bytes} B)")
