"""Load the C library (_kcache.c) that answers the FUSE requests needing no Python
(opens, their releases, the security.capability lookup before every write) and asks
the kernel to keep pages and directory listings across opens.

It must be loaded before pyfuse3 is imported, because it stands in for libfuse's
fuse_session_new, which pyfuse3 binds when it is loaded. Without it (not built,
or pyfuse3 already imported) the mount works as before, only slower.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.machinery
import logging
import os
import sys
from typing import Any

from .records import CONTROL_INO_BASE

log = logging.getLogger(__name__)

# How long pyfuse3's loop waits for the next request in C before it waits in trio.
SPIN_NS = 30_000
WAIT_NS = 20_000_000
YIELD_EVERY = 64

_lib: ctypes.CDLL | None = None
_request_pid: ctypes.c_int | None = None


def _library_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        found = glob.glob(os.path.join(here, "_kcache" + suffix))
        if found:
            return found[0]
    return None


def preload() -> None:
    """Load the library ahead of pyfuse3, in the daemon process only."""
    global _lib
    if _lib is not None:
        return
    if "pyfuse3" in sys.modules:
        log.warning("pyfuse3 was imported before the kernel-cache library: directory "
                    "listings will not be cached by the kernel")
        return
    path = _library_path()
    if path is None:
        log.warning("kernel-cache library not built (run 'make install'): directory "
                    "listings will not be cached by the kernel")
        return
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as e:
        log.warning("kernel-cache library %s not loaded: %s", path, e)
        return
    lib.kcache_configure.argtypes = [ctypes.c_uint64]
    lib.kcache_configure(CONTROL_INO_BASE)
    global _request_pid
    _request_pid = ctypes.c_int.in_dll(lib, "kcache_request_pid")
    _lib = lib


def speed_up_loop(pyfuse3: Any) -> None:
    """Have pyfuse3's loop take a queued request without a trip through trio.

    pyfuse3 waits for each request in trio (a lock, epoll, a reschedule): that
    costs more than most of our handlers. Its loop looks the waiting function up
    by name at every request, so we put one in front that takes a request already
    queued, or one arriving within SPIN_NS (clients send their next request right
    after our reply), and lets trio wait otherwise, and at least every
    YIELD_EVERY requests so that timers, signals and threads still get their turn.
    """
    trio_wait = getattr(pyfuse3, "_wait_fuse_readable", None)
    if _lib is None or trio_wait is None or not active():
        return
    wait_queued = _lib.kcache_wait_queued
    wait_queued.argtypes = [ctypes.c_long, ctypes.c_long]
    wait_queued.restype = ctypes.c_int
    wait_ns = int(os.environ.get("OVERLAYCKPT_WAIT_NS", WAIT_NS))
    spin_ns = int(os.environ.get("OVERLAYCKPT_SPIN_NS", SPIN_NS))
    streak = 0

    async def wait_fuse_readable() -> bool:
        nonlocal streak
        if streak < YIELD_EVERY and wait_queued(spin_ns, wait_ns):
            streak += 1
            return True
        streak = 0
        return await trio_wait()

    pyfuse3._wait_fuse_readable = wait_fuse_readable


def active() -> bool:
    """Whether the mounted session's handlers go through the library."""
    return _lib is not None and _lib.kcache_sessions_wrapped() > 0


def request_pid() -> int:
    """The process of the write request being handled (0 for page writeback)."""
    return _request_pid.value if _request_pid is not None else 0
