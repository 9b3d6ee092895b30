"""Fork safety (issue 16, item 5): a forked child cannot change the parent's parameters,
stop its private server or remove its run directory; using the optimizer in the child fails
loudly; DataLoader workers (fork start method) keep working."""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Callable
from typing import cast

import pytest
import torch
from torch import nn

import sonar_moe


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(4, 8, 6, generator=g))
        self.lin = nn.Linear(8, 6)

    def expert_weight(self) -> torch.Tensor:
        """experts.gate_up_proj (a Parameter on a plain nn.Module, which mypy sees as Tensor | Module)."""
        return cast(torch.Tensor, self.experts.gate_up_proj)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bd,efd->bf", x, self.experts.gate_up_proj)
        return (self.lin(h) ** 2).mean()


def pair() -> tuple[Tiny, Tiny]:
    torch.manual_seed(1)
    a = Tiny()
    b = Tiny()
    b.load_state_dict(a.state_dict())
    return a, b


def child(fn: Callable[[], int]) -> int:
    """Run fn in a forked child that then exits as an interpreter does at a normal exit:
    weakref finalizers and atexit handlers run (sys.exit itself would unwind into pytest)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = fn()
            weakref.finalize._exitfunc()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
        except BaseException as e:  # noqa: BLE001
            print(f"child: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_forked_child_cannot_touch_the_parents_model_server_or_files() -> None:
    ref, mine = pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = sonar_moe.SonarAdamW(mine, lr=1e-2)
    assert opt.server_address is not None
    rundir = os.path.dirname(opt.server_address.split("://", 1)[1])
    x = torch.randn(3, 6)

    def train() -> None:
        for m, o in ((ref, ropt), (mine, opt)):
            m.loss(x).backward()
            o.step()
            o.zero_grad()

    train()
    before = mine.expert_weight().detach().clone()

    def write_in_place() -> int:
        with torch.no_grad():
            mine.expert_weight().add_(1.0)  # the child's own copy
        return 0 if mine.expert_weight()[0, 0, 0] == before[0, 0, 0] + 1 else 1

    assert child(write_in_place) == 0
    assert torch.equal(mine.expert_weight().detach(), before), "the child's write reached the parent"

    def use_optimizer() -> int:
        try:
            mine.loss(x).backward()  # the expert hook hands the gradient over: refused
            opt.step()
        except sonar_moe.SonarError as e:
            return 0 if "forked child" in str(e) else 2
        return 1

    assert child(use_optimizer) == 0

    def close_it() -> int:
        opt.close()  # and the finalizers at exit
        return 0

    assert child(close_it) == 0
    assert os.path.isdir(rundir) and os.path.exists(os.path.join(rundir, "sonard.sock"))
    assert opt.server_process is not None and opt.server_process.poll() is None
    for _ in range(3):
        train()
    for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        assert torch.equal(a, b), n
    opt.close()
    assert opt.server_process.wait(timeout=10) == 0


class Data(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(6, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_fork_workers_keep_working(persistent: bool) -> None:
    ref, mine = pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with sonar_moe.SonarAdamW(mine, lr=1e-2) as opt:
        assert opt.server_address is not None
        rundir = os.path.dirname(opt.server_address.split("://", 1)[1])
        loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2, multiprocessing_context="fork",
                                             persistent_workers=persistent)
        for _epoch in range(2):
            for x in loader:
                for m, o in ((ref, ropt), (mine, opt)):
                    m.loss(x).backward()
                    o.step()
                    o.zero_grad()
        del loader
        assert os.path.isdir(rundir) and opt.server_process is not None and opt.server_process.poll() is None
        for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
            assert torch.equal(a, b), n
