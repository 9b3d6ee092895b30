"""One sonard per node when a launcher starts several ranks on it (torchrun, accelerate launch).

``SonarAdamW(server=None)`` in a process whose launcher says it is one of several local ranks
(``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` > 1, set by torchrun and by ``accelerate launch``)
shares one server with the other local ranks instead of starting its own: local rank 0 starts
it on first use (a private server: an ``ipc://`` socket in a fresh 0700 directory, stopped when
that process exits) and publishes its address in a 0600 file named after the launch (user,
launcher process, master port, run id, restart count, node rank); the other local ranks wait for
that file and connect, each in its own session. ``SONAR_NODE_SERVER=0`` turns this off (one
private server per rank, as before).

Failures: if local rank 0 dies, its server exits with it (``--parent-pid``), and every other
rank's next request fails with the server's death instead of waiting. A rank that dies is
released by the server alone; torchrun then stops the whole job. At exit, local rank 0 waits
(up to ``SONAR_NODE_EXIT_WAIT`` seconds, default 30) until the other ranks' sessions have ended
before it stops the server, so a rank that finishes first does not take the server from the
others' last step; when it exits with an uncaught exception it stops the server at once (the
others may be blocked in a collective waiting for it, and would never end their sessions). A
rank 0 stopped by SIGTERM or SIGKILL leaves its rendezvous file; the next local rank 0 on the
machine removes the files whose process is gone.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import weakref

from ._connection import Connection, SonarError
from ._launch import start_private_server

log = logging.getLogger("sonar_moe")

_LEADER: Connection | None = None  # local rank 0: the node's server, for the life of the process
_LOCAL: list[weakref.ref[Connection]] = []  # this process's sessions on it


def node_ranks() -> tuple[int, int] | None:
    """(local rank, local world size) from the launcher's environment, or None where this process
    is not one of several ranks of a launched job (or sharing is turned off)."""
    if os.environ.get("SONAR_NODE_SERVER", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if local_world < 2 or not 0 <= local_rank < local_world:
        return None
    return local_rank, local_world


def rendezvous_path() -> str:
    """Where local rank 0 publishes the node server's address: one name per launch and node."""
    parts = [str(os.getuid()), str(os.getppid())] + [os.environ.get(k, "") for k in (
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK")]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    return os.path.join(tempfile.gettempdir(), f"sonar-node-{key}.json")


def node_connection(timeout: float) -> Connection:
    """A session on this node's shared sonard (started here on local rank 0)."""
    ranks = node_ranks()
    assert ranks is not None
    address = _leader_address(timeout) if ranks[0] == 0 else _wait_for_address(timeout)
    conn = Connection(address, timeout)
    _LOCAL[:] = [r for r in _LOCAL if r() is not None] + [weakref.ref(conn)]
    return conn


def _leader_address(timeout: float) -> str:
    global _LEADER
    if _LEADER is None:
        path = rendezvous_path()
        _remove_stale_rendezvous(os.path.dirname(path))
        conn = start_private_server(timeout)
        conn.call("hello", {"client": "sonar_moe.node", "pid": os.getpid()}, timeout=max(timeout, 10.0))
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"address": conn.address, "pid": os.getpid()}, f)
        os.replace(tmp, path)
        _LEADER = conn
        atexit.register(_stop_leader, path)
        log.info("local rank 0 started the node's sonard at %s for %s local ranks", conn.address,
                 os.environ.get("LOCAL_WORLD_SIZE"))
    return _LEADER.address


def _remove_stale_rendezvous(directory: str) -> None:
    """Remove this user's rendezvous files whose local rank 0 is gone. Its atexit removes its own,
    but a rank 0 that a launcher stops with SIGTERM (torchrun, after another rank failed) or
    SIGKILL never runs it, and each such launch left a file in the temporary directory. A file
    whose process lives (or cannot be asked: another user's) is left alone."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith("sonar-node-") and n.endswith(".json")]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            _published_address(path)
        except ProcessLookupError:
            try:
                os.unlink(path)
                log.debug("removed %s: its local rank 0 is gone", path)
            except FileNotFoundError:
                pass
        except (OSError, ValueError, KeyError, TypeError):  # unreadable, half written, not ours: left alone
            continue


def _published_address(path: str) -> str:
    """The address a rendezvous file publishes; ProcessLookupError if the local rank 0 that
    wrote it is gone (its pid is checked before the address is read)."""
    with open(path) as f:
        info = json.load(f)
    os.kill(int(info["pid"]), 0)
    return str(info["address"])


def _wait_for_address(timeout: float) -> str:
    path = rendezvous_path()
    limit = max(timeout, float(os.environ.get("SONAR_NODE_WAIT", "120")))
    deadline = time.monotonic() + limit
    while True:
        try:
            return _published_address(path)  # the leader still runs
        except (FileNotFoundError, json.JSONDecodeError, ProcessLookupError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SonarError(
                f"local rank 0 did not start this node's sonard within {limit:.0f} s ({path}): every local rank "
                "must build its SonarAdamW (local rank 0 starts the shared server). Set SONAR_NODE_SERVER=0 for one "
                "private server per rank, or SONAR_NODE_WAIT=<seconds> to wait longer")
        time.sleep(0.05)


def _stop_leader(path: str) -> None:
    """At exit on local rank 0: end this process's own sessions, wait for the other ranks'
    sessions to end (bounded), then stop the node's server."""
    global _LEADER
    conn, _LEADER = _LEADER, None
    if conn is None:
        return
    for ref in _LOCAL:
        c = ref()
        if c is not None:
            c.end_session()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        # This rank dies of an exception: the others may be waiting for it in a collective, and
        # would never end their sessions. Stop the server now: their next request reports it.
        log.error("local rank 0 is failing: stopping the node's sonard now (the other local ranks' next "
                  "request to it fails)")
        conn.end_session()
        return
    deadline = time.monotonic() + float(os.environ.get("SONAR_NODE_EXIT_WAIT", "30"))
    try:
        while conn.server_alive and time.monotonic() < deadline:
            if int(conn.call("stats", {}, timeout=5.0).get("sessions", 0)) <= 1:
                break
            time.sleep(0.1)
    except SonarError as e:
        log.warning("the node's sonard: %s", e)
    conn.end_session()
