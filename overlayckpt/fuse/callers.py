"""Who made a request: FUSE names the calling thread, the journal wants the command.

CallerCache turns a thread id into the Caller its writes are journaled under (its
process, then the command that process belongs to, from /proc); Writers remembers
each file's last writer, for the page writeback of a shared mmap, which carries no
process at all. fuse/ops.py asks both.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from overlayckpt.core.journal import Caller

# Page writeback (mmap) carries no process: its writes are journalled under the file's
# last writer (Writers), or as this one when it has none.
WRITEBACK = Caller(0, "writeback")


class Writers:
    """Inode -> the caller that last created, truncated or wrote it (the newest `size`).

    Page writeback of a shared mmap (SQLite's -shm in WAL mode) reaches us with no
    process; journalled as a writer of its own, it split its writer's group in three
    (issue 34). The process that dirtied the pages is the one that opened, sized or
    wrote the file: SQLite sizes its -shm with ftruncate and write before mapping it.
    """

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._last: OrderedDict[int, Caller] = OrderedDict()

    def wrote(self, ino: int, caller: Caller) -> None:
        if self._last.get(ino) is not caller:
            self._last[ino] = caller
            self._last.move_to_end(ino)
            if len(self._last) > self._size:
                self._last.popitem(last=False)

    def of(self, ino: int) -> Caller:
        return self._last.get(ino, WRITEBACK)


class CallerCache:
    """Thread id -> Caller, for the journal (a write request carries no pid).

    FUSE names the calling *thread*; a Caller is the command it belongs to (see
    _command_of), named by the command's process, so that one tool call written from a
    thread pool, or by a `make -j2` and its compilers, is one group. A thread gone by
    the time we look keeps its own id, named "?". (Writes that C acknowledged reach
    Python after their writer may have exited: those of a short-lived writer whose
    open C served are named "?".)
    """

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._cache: OrderedDict[int, Caller] = OrderedDict()
        me = _stat(os.getpid())
        self._mounted = me.started if me else 0
        self._runs: dict[int, tuple[bool, float]] = {}  # pid -> (it runs, when asked)

    def caller(self, tid: int) -> Caller:
        found = self._cache.get(tid)
        if found is not None:
            self._cache.move_to_end(tid)
            return found
        found = _process_of(tid)
        if found.comm != "?":  # a failed look is not kept: the number may come back alive
            found = _command_of(found, self._mounted)
            found.above, found.running = _above(found.pid), self.runs
            self._cache[tid] = found
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return found


    def runs(self, pid: int) -> bool:
        """Whether process pid still runs (not exited, not a zombie), asked of /proc at
        most once per RUNS_FOR seconds: with commands writing at once, every write asks
        it of each other command's open group."""
        now = time.monotonic()
        known = self._runs.get(pid)
        if known is not None and now - known[1] < RUNS_FOR:
            return known[0]
        try:
            me = _stat(pid)
        except ValueError:
            me = None
        alive = me is not None and me.state not in ("Z", "X")
        if len(self._runs) > self._size:
            self._runs.clear()
        self._runs[pid] = alive, now
        return alive


# how long CallerCache.runs trusts what /proc said
RUNS_FOR = 0.05


def _above(pid: int) -> tuple[int, ...]:
    """The processes pid runs under, its parent first (up to init, at most 64)."""
    out: list[int] = []
    me = _stat(pid)
    while me is not None and me.parent > 1 and len(out) < 64:
        out.append(me.parent)
        me = _stat(me.parent)
    return tuple(out)


def _process_of(tid: int) -> Caller:
    """The thread's process: its thread group id, named by the group's leader."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            status = f.read(4096)
    except OSError:
        return Caller(tid, "?")
    tgid, name = tid, b"?"
    for line in status.splitlines():
        if line.startswith(b"Name:"):
            name = line[5:].strip()
        elif line.startswith(b"Tgid:"):
            tgid = int(line[5:])
            break
    if tgid != tid:  # the thread's own name is not the process's
        try:
            with open(f"/proc/{tgid}/comm", "rb") as f:
                name = f.read().strip()
        except OSError:
            pass  # the leader exited before its thread: keep the thread's name
    return Caller(tgid, name.decode(errors="replace"))


@dataclass(slots=True)
class _Proc:
    parent: int
    group: int
    session: int
    started: int  # clock ticks after boot
    name: str
    state: str  # R, S, D...; Z: a zombie, X: dead


def _stat(pid: int) -> _Proc | None:
    """A process's parent, process group, session, start, name and state
    (/proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(1024)
    except OSError:
        return None
    close = raw.rindex(b")")  # the name may hold spaces and parentheses
    fields = raw[close + 2:].split()  # from field 3 (state) on
    return _Proc(int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]),
                 raw[raw.index(b"(") + 1:close].decode(errors="replace"), fields[0].decode())


def _command_of(process: Caller, mounted: int) -> Caller:
    """The command a process is part of, without hooks (mounted: when the daemon started).

    A command is a process tree started after the mount, within one process group
    (a shell's job). Its root is found walking up from the writer, within its group,
    stopping before the group's leader and before any process older than the mount:
    a leader that a shell started (an agent run at a prompt: its parent leads the
    session) runs its commands as children, so each child is a command of its own
    and the leader's own writes are its own; a harness older than the mount (a test
    runner) is no command either. A group that a program started for a command
    (setsid, as Node's `detached` does, or setpgid) is one command, leader and all.
    Not told apart: an agent that leads its own session (run directly by tmux, say)
    is taken for a command, and one behind a wrapper that forks (npx, `overlayckpt
    run`) for its commands' root: its writes and its commands' then share a key, and
    their groups end only at the window (hooks mark the steps exactly).
    """
    me = _stat(process.pid)
    if me is None or me.started < mounted:
        return process
    if process.pid == me.group:
        return process
    leader = _stat(me.group)
    if leader is not None and leader.started >= mounted and leader.parent != leader.session:
        return Caller(me.group, leader.name)  # not a shell's job: a command's group
    key, parent = process, me.parent
    for _ in range(64):  # (a chain this deep is not a shell's; stop somewhere)
        above = _stat(parent)
        if parent == me.group or above is None or above.group != me.group or above.started < mounted:
            return key
        key, parent = Caller(parent, above.name), above.parent
    return key
