"""The daemon's request threads get the scheduler's shortest slice, and nothing else of it
does (issue 16's stall: with the defaults, an agent's stat on a 2-core host waited for a
core behind our CLI's start-up and a command's work, a millisecond and more at p99).

The two threads that answer requests (C's reader of /dev/fuse and pyfuse3's loop) ask
Linux for a 0.1 ms slice (EEVDF: a thread of a shorter slice preempts a longer one when
it wakes); the threads and processes they start (trio's workers that run a command's
reading, the reader processes, the read-ahead) keep the default, so that a command's
work never takes a core first."""
from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading

import pytest

from conftest import Mount, daemon_pid, wait_for

PROMPT_SLICE_NS = 100_000  # queue.c
_libc = ctypes.CDLL(None, use_errno=True)
_SYS_sched_setattr, _SYS_sched_getattr = 314, 315
_ATTR = "IIQiIQQQ"  # struct sched_attr: size, policy, flags, nice, priority, runtime, ...


def slice_of(tid: int) -> int | None:
    """The thread's sched_runtime: its slice, if it asked for one (None: it has ended)."""
    buf = ctypes.create_string_buffer(48)
    if _libc.syscall(_SYS_sched_getattr, tid, buf, 48, 0) != 0:
        assert ctypes.get_errno() == errno.ESRCH, os.strerror(ctypes.get_errno())
        return None
    return struct.unpack(_ATTR, buf.raw)[5]


def kernel_keeps_slices() -> bool:
    """Whether this kernel keeps a fair thread's slice (Linux 6.12 on): tried on a thread
    of ours, which then ends."""
    got: list[int | None] = []

    def probe() -> None:
        attr = ctypes.create_string_buffer(struct.pack(_ATTR, 48, 0, 0, 0, 0, PROMPT_SLICE_NS, 0, 0), 48)
        if _libc.syscall(_SYS_sched_setattr, 0, attr, 0) == 0:
            got.append(slice_of(threading.get_native_id()))
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got == [PROMPT_SLICE_NS]


def wchan(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/wchan") as f:
            return f.read()
    except FileNotFoundError:
        return ""  # (the thread has ended)


def test_only_the_request_threads_get_the_short_slice(mounted: Mount) -> None:
    if not kernel_keeps_slices():
        pytest.skip("this kernel keeps no slice for fair threads (Linux 6.12 on does)")
    pid = daemon_pid(mounted.store)
    assert pid
    (mounted.mnt / "a.txt").write_text("one\n")
    mounted.ctl_ok({"cmd": "checkpoint", "name": "one"})
    # a command's reading: a trio worker thread and a reader process; the tree's read-ahead
    mounted.ctl_ok({"cmd": "log"})
    mounted.ctl_ok({"cmd": "diff", "a": "one", "stat": True})
    os.listdir(mounted.mnt)
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    reader: list[int] = []

    def reader_waits() -> bool:  # (C's reader thread waits in /dev/fuse when idle)
        reader[:] = [t for t in tids if t != pid and wchan(pid, t) == "fuse_dev_do_read"]
        return len(reader) == 1
    wait_for(reader_waits, "C's reader thread waiting for a request")
    prompt = {t for t in tids if slice_of(t) == PROMPT_SLICE_NS}
    assert prompt == {pid, reader[0]}, {t: (slice_of(t), wchan(pid, t)) for t in tids}
    assert len(tids) > 2, "no other thread: the test shows nothing"
    children = []
    for t in tids:  # (a child is listed under the thread that started it)
        with open(f"/proc/{pid}/task/{t}/children") as f:
            children += [int(c) for c in f.read().split()]
    assert children, "no reader process: the test shows nothing"
    assert all(slice_of(c) != PROMPT_SLICE_NS for c in children)
