"""Zero-copy gradients on CPU: sonard reads each expert gradient where autograd left it.

The server reads this process's memory with ``process_vm_readv``; it learns our process id
from the connection (``SO_PEERCRED`` of the ipc:// or unix:// socket), never from us, and proves it can
read by finding a random probe at the address we name. The kernel allows that read to a
process that may ptrace this one: the same user and, where Yama's ``ptrace_scope`` is 1, a
process this one named with ``prctl(PR_SET_PTRACER)``, which we do for the private sonard we
started or connected to (the server we trust with our parameters anyway; its pid is in its
hello reply). A server that cannot read (another user, Yama 2 or 3, a tcp:// server, a seccomp
policy) refuses, and the client copies gradients through the shared-memory ring instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import sys

from ._connection import Connection, SonarRefused, is_local

log = logging.getLogger("sonar_moe")

PR_SET_PTRACER = 0x59616D61  # linux/prctl.h
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def allow_reads_by(pid: int) -> None:
    """Where Yama restricts ptrace to descendants (scope 1), let process `pid` read this one."""
    try:
        with open(YAMA_SCOPE) as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return  # no Yama: the same user may read
    if scope != 1 or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PTRACER, %d) failed: %s", pid, os.strerror(ctypes.get_errno()))


def attach_process(conn: Connection, server_pid: int) -> tuple[int | None, str]:
    """Ask the server (process `server_pid`, from its hello) to read gradients from this
    process: (segment id, "") when it can, (None, why not) when it cannot."""
    if not is_local(conn.address):
        return None, "a tcp:// server is on another machine"
    if server_pid > 0:
        allow_reads_by(server_pid)
    probe = secrets.token_bytes(64)
    buf = ctypes.create_string_buffer(probe, len(probe))
    try:
        rep = conn.call("attach_process", {"probe_addr": ctypes.addressof(buf), "probe": probe})
    except SonarRefused as e:
        return None, str(e)
    finally:
        del buf
    return int(rep["seg"]), ""
