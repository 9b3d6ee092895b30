"""Opening a session: a private sonard started for this process, or a running one."""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile

import torch

from ._binary import find_sonard
from ._connection import Connection, SonarError
from ._cpus import usable_cores

# How a private server is spoken to (SONAR_TRANSPORT overrides): both ends on this machine.
PRIVATE_SCHEMES = {"unix": "unix://", "zmq": "ipc://"}
DEFAULT_TRANSPORT = "zmq"


def private_workers(torch_threads: int, cores: int) -> int | None:
    """The update workers of a private sonard: the cores torch's threads leave free, where they
    leave some; None (sonard's default, one per core) where torch takes them all. Measured
    (docs/benchmarks.md, "With a core to spare"): with torch on 1 thread of 2 cores, a
    one-worker sonard made the step 3.5-8% shorter than two workers (OLMoE and GraniteMoe, two
    runs), whose second worker preempts torch's thread; with torch on every core, one or two
    workers were within noise of each other."""
    return cores - torch_threads if 0 < torch_threads < cores else None


def private_scheme(transport: str | None = None) -> str:
    """The address scheme of a private server's transport: ``transport``, else
    ``SONAR_TRANSPORT``, else DEFAULT_TRANSPORT ("unix": sonard's own Unix socket; "zmq":
    ZeroMQ over ipc://)."""
    name = (transport or os.environ.get("SONAR_TRANSPORT") or DEFAULT_TRANSPORT).strip().lower()
    if name not in PRIVATE_SCHEMES:
        raise SonarError(f"SONAR_TRANSPORT={name!r}: want one of {sorted(PRIVATE_SCHEMES)}")
    return PRIVATE_SCHEMES[name]


def start_private_server(timeout: float, log_level: str = "warn", workers: int | None = None,
                         transport: str | None = None) -> Connection:
    """Start a sonard for this process on an ipc:// socket in a fresh 0700 directory, with
    ``workers`` update workers (None: sonard's default; ``SONAR_WORKERS`` in the environment
    wins over both), spoken to over ``transport`` (``private_scheme``).

    Nothing about this process's torch is passed on the command line: each client names its
    float32 sqrt in ``hello``, so the same plain server serves any client."""
    binary = find_sonard()
    rundir = tempfile.mkdtemp(prefix="sonar-")  # mode 0700
    address = private_scheme(transport) + os.path.join(rundir, "sonard.sock")
    log_path = os.path.join(rundir, "sonard.log")
    # Only this process may stop its server: shutdown carries this token (the file is 0600
    # in the 0700 run directory; never on the command line, which others can read).
    token = secrets.token_hex(32)
    token_path = os.path.join(rundir, "owner.token")
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    # --parent-pid: the server exits within a second of this process, however it ends, and
    # then removes this run directory (--run-dir), which this process can no longer do.
    args = [binary, "--listen", address, "--log-level", log_level,
            "--parent-pid", str(os.getpid()), "--admin-token-file", token_path, "--run-dir", rundir]
    if workers is not None and not os.environ.get("SONAR_WORKERS"):
        args += ["--workers", str(workers)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in the trainer reaches the trainer; close() stops the server
        )
    return Connection(address=address, timeout=timeout, process=proc, log_path=log_path, admin_token=token)


def connect(server: str | None, timeout: float) -> Connection:
    """A connection to ``server`` ("ipc://..." or "tcp://..."); for None, to this node's shared
    sonard when a launcher started several ranks here (``_node.py``), else to a new private one
    (with the cores torch leaves free as its workers, where it leaves some)."""
    if server is not None:
        return Connection(server, timeout)
    from ._node import node_connection, node_ranks  # _node imports this module
    if node_ranks() is not None:
        return node_connection(timeout)
    return start_private_server(timeout, workers=private_workers(torch.get_num_threads(), usable_cores()))
