"""Step requests of one session: items queued per layer group and sent without waiting.

A layer's expert tensors (the MoE block of ``_detect.group_key``) go to the server in one
``step`` request once each of them has a gradient: with batched expert tensors, one request
per layer instead of one per tensor (measured in docs/benchmarks.md: each request costs the
trainer a round trip it waits for). A layer whose gradients stop coming (experts that got no
token) is sent when the next layer's first gradient arrives, so gradients of one layer at
most wait to be sent. Each request carries the staging tokens of its gradients (ring
offsets, CUDA gradient holders), released when its reply arrives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._connection import Connection, SonarError, in_requests

Item = dict[str, Any]


@dataclass
class _Group:
    size: int = 0
    items: list[Item] = field(default_factory=list)
    tokens: list[Any] = field(default_factory=list)
    names: set[str] = field(default_factory=set)  # the items' tensors (per-expert requests: hundreds)


class StepQueue:
    """Groups step items per layer and sends them; counts requests; collects refused updates."""

    def __init__(self, conn: Connection, release: Callable[[Any], None], body: Mapping[str, Any],
                 refused: Callable[[list[Item]], None],
                 norms: Callable[[list[float]], None] | None = None) -> None:
        self._conn = conn
        self._norms = norms  # told the squared gradient norms of each answered request (body "norms")
        self._release = release
        self._refused = refused  # told the items of every request the server refused
        self._body = dict(body)  # extra keys of every step request (CUDA: wait_event)
        self._groups: dict[str, _Group] = {}
        self._open: _Group | None = None  # the group gathering items (at most one)
        self._errors: list[str] = []
        self.step_requests = 0
        self.grads_sent = 0
        self.bytes_sent = 0

    def add_member(self, key: str) -> None:
        """One more tensor in group `key`: its request waits for one more item."""
        self._groups.setdefault(key, _Group()).size += 1

    def add(self, key: str, item: Item, token: Any) -> None:
        """Queue an item of group `key`; send the group once it is complete."""
        grp = self._groups[key]
        if self._open is not None and self._open is not grp and self._open.items:
            self._send_group(self._open)  # another layer's gradients arrive: that one is as complete as it gets
        if item["tensor"] in grp.names:
            self._send_group(grp)  # an earlier backward left this layer incomplete (experts without tokens)
        self._open = grp
        grp.items.append(item)
        grp.tokens.append(token)
        grp.names.add(item["tensor"])
        if len(grp.items) >= grp.size:
            self._send_group(grp)

    def send_each(self, items: list[Item], token: Any) -> None:
        """One request per item (expert slices); the token is released with the last one."""
        for i, it in enumerate(items):
            self.send([it], [token] if i == len(items) - 1 else [])

    def flush(self) -> bool:
        """Send every incomplete group (layers whose other experts got no gradient); whether any was."""
        sent = False
        for g in self._groups.values():
            if g.items:
                self._send_group(g)
                sent = True
        return sent

    def send(self, items: list[Item], tokens: list[Any]) -> None:
        """Send the items now, in one step request (several past MAX_ITEMS items); release
        `tokens` when the last is answered."""
        pieces = in_requests(items)
        for k, part in enumerate(pieces):
            self.step_requests += 1
            self.grads_sent += sum(1 for it in part if it["grad"]["seg"])
            self.bytes_sent += sum(it["grad"]["nbytes"] for it in part if it["grad"]["seg"])
            self._conn.send("step", {"items": part, **self._body},
                            functools.partial(self._on_reply, tokens if k == len(pieces) - 1 else [], part))

    def wait(self) -> None:
        """Wait for every reply; raise SonarError naming the updates the server refused."""
        self._conn.wait()
        if self._errors:
            errs, self._errors = self._errors, []
            raise SonarError("sonard could not apply expert updates: " + "; ".join(errs))

    def _send_group(self, grp: _Group) -> None:
        items, tokens = grp.items, grp.tokens
        grp.items, grp.tokens, grp.names = [], [], set()
        self.send(items, tokens)

    def _on_reply(self, tokens: list[Any], items: list[Item], rep: dict[str, Any]) -> None:
        for t in tokens:
            self._release(t)
        if not rep.get("ok"):
            self._errors.append(str(rep.get("error")))
            self._refused(items)
        elif self._norms is not None:
            self._norms(list((rep.get("body") or {}).get("sq_norms") or []))
