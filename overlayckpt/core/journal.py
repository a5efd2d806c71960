"""The journal and the automatic grouping of its records into checkpoints.

Every mutating operation appends one record (seq, time, pid, comm, op, paths,
undo entries) in the same write transaction that changes the live tables, so
a record and its change are committed together or not at all. Records are
grouped into automatic checkpoints: a group ends when another process writes,
or when its process has been idle for `window` seconds (0: every operation is
its own checkpoint), or when an agent's hook logs a tool call; while that call
runs, neither of the first two ends it. A checkpoint records the journal position after its
group, so restoring it gives the tree as it was after that group and before
the next one.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from overlayckpt.core import groupfiles, history
from overlayckpt.core.groups import open_groups as _open_groups
from overlayckpt.core.groups import put_groups as _put_groups
from overlayckpt.records import (
    FIRST_UPPER_INO,
    Checkpoint,
    JournalRecord,
    from_u64,
    u64,
)
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import (
    CKPTS,
    CONV_HEAD_KEY,
    JOURNAL,
    META,
    NAMES,
    NEXT_CKPT_KEY,
    NEXT_INO_KEY,
    SEQ_KEY,
    UNDER_KEY,
)

CALL_KEY = b"tool_call"  # in META while an agent's tool call runs (see hold_for_call)


@dataclass(slots=True)
class Caller:
    """The command an operation is journaled under (pid: its root process's).

    above: the processes the command runs under (its parent, theirs...); running: says
    whether a command's pid still runs. Given both (the FUSE adapter gives them), a
    group that another command's write finds open stays open while its own command
    still runs and neither command runs under the other: independent commands at once
    are a checkpoint each, not one per switch (issue 34)."""
    pid: int
    comm: str
    above: tuple[int, ...] = field(default=(), compare=False)
    running: Callable[[int], bool] | None = field(default=None, compare=False)


def now_ns() -> int:
    return time.time_ns()


def next_seq(r: ReadTxn) -> int:
    return r.meta_int(SEQ_KEY, 1)


def append(w: WriteTxn, caller: Caller, op: str, paths: tuple[str, ...],
           changes: tuple[str, ...], undo: list[tuple[int, bytes, bytes | None]],
           window: float) -> int:
    """Journal one operation and extend or close the open groups. Returns its seq.

    Several groups may be open at once (Caller): each closes when its command is found
    idle for `window` or done (another command wrote and it no longer runs, or runs
    above or below that one), always at the current position, so every checkpoint is
    where a group closed and the history index's boundary (the newest checkpoint) is
    all it needs."""
    t = now_ns()
    seq = next_seq(w)
    boundary, groups = _open_groups(w)
    held = w.get(META, CALL_KEY) is not None  # (while a call runs its group takes all)
    mine: list[Any] | None = None
    kept: list[list[Any]] = []
    for g in groups:
        start, pid, last, head, above = g
        idle = t - last > window * 1e9
        if window <= 0:
            pass  # every operation is a checkpoint of its own
        elif held and mine is None or not held and pid == caller.pid and not idle:
            mine = g
            continue
        elif held or not idle and _concurrent(caller, pid, above):
            kept.append(g)  # (while a call runs, groups from before it are left as they are)
            continue
        _close_group(w, seq, start, last, pid, head, above)
        boundary = seq
    if not groups:
        boundary = seq
    start = seq if mine is None else mine[0]
    rec = JournalRecord(seq, t, caller.pid, caller.comm, op, paths, changes, tuple(undo))
    w.put(JOURNAL, u64(seq), rec.pack(), append=True)
    history.record(w, boundary, seq, undo)
    groupfiles.record(w, start, paths, changes)
    w.set_meta_int(SEQ_KEY, seq + 1)
    # the conversation as it was at the group's latest change: what the agent said
    # after it (the call's result, the next call) is not part of this checkpoint
    head = w.meta_int(CONV_HEAD_KEY, 0)
    if window <= 0:  # (every group closed above)
        _close_group(w, seq + 1, start, t, caller.pid, head, caller.above)
        _put_groups(w, seq + 1, [])
        return seq
    kept.append([start, caller.pid, t, head, list(caller.above)])
    _put_groups(w, boundary, kept)
    return seq


def _concurrent(caller: Caller, pid: int, above: list[int]) -> bool:
    """Whether the open group of command pid (running under `above`) is another command
    that runs at the same time as caller's, not one that ended or that caller's runs
    under (an agent and the command it started) or that runs under caller's."""
    return (caller.running is not None and pid != caller.pid and pid not in caller.above
            and caller.pid not in above and caller.running(pid))


def _close_group(w: WriteTxn, end_seq: int, start: int, last_ns: int, pid: int,
                 conv_head: int | None, above: Sequence[int] = ()) -> Checkpoint:
    first = w.get(JOURNAL, u64(start))
    comm = JournalRecord.unpack_head(start, first).comm if first else ""
    ck = new_checkpoint(w, end_seq, start, "auto", None, None, pid, comm, time_ns=last_ns,
                        conv_head=conv_head)
    _note_under(w, ck, above)
    return ck


def _note_under(w: WriteTxn, ck: Checkpoint, above: Sequence[int]) -> None:
    """If ck's command ran under the command that made the automatic checkpoint just before
    it, or that one's own command ran under (an agent's `git add`, then its `git commit`,
    started after its edits' group had closed), note that command's pid (META UNDER_KEY +
    id): the log folds such a git-only checkpoint into the one before (core/folds.py).
    Only the open group knows the pids above its command."""
    if not above or ck.id < 1:
        return
    raw = w.get(CKPTS, u64(ck.id - 1))
    if raw is None:
        return
    prev = Checkpoint.unpack(ck.id - 1, raw)
    if prev.kind != "auto":
        return
    root = prev.pid if prev.pid != ck.pid and prev.pid in above else None
    if root is None:
        mark = w.get(META, UNDER_KEY + u64(prev.id))
        root = from_u64(mark) if mark is not None and from_u64(mark) in above else None
    if root is not None:
        w.put(META, UNDER_KEY + u64(ck.id), u64(root))


def close_open_group(w: WriteTxn) -> None:
    """Turn the pending groups (if any) into checkpoints, e.g. before a restore (the
    oldest first)."""
    _, groups = _open_groups(w)
    if groups:
        _put_groups(w, 0, [])
        for start, pid, last, head, above in sorted(groups, key=lambda g: g[0]):
            _close_group(w, next_seq(w), start, last, pid, head, above)


def hold_for_call(w: WriteTxn, running: bool) -> None:
    """While an agent's tool call runs (its hook logged the call, not yet its result),
    all that is written is that call's checkpoint: whatever processes it spawns (a
    `sed && rm`, a `make -j2`) and however long it is quiet."""
    if running:
        w.put(META, CALL_KEY, b"1")
    elif w.get(META, CALL_KEY) is not None:
        w.delete(META, CALL_KEY)


def new_checkpoint(w: WriteTxn, seq: int, start: int, kind: str, name: str | None,
                   message: str | None, pid: int, comm: str, time_ns: int | None = None,
                   restored_from: int | None = None, conv_head: int | None = None) -> Checkpoint:
    cid = w.next_counter(NEXT_CKPT_KEY, 1)
    if conv_head is None:
        conv_head = w.meta_int(CONV_HEAD_KEY, 0)
    ck = Checkpoint(cid, seq, start, time_ns or now_ns(), kind, name, message, pid, comm, restored_from,
                    conv_head, w.meta_int(NEXT_INO_KEY, FIRST_UPPER_INO))
    w.put(CKPTS, u64(cid), ck.pack(), append=True)
    if name:
        w.put(NAMES, name.encode(), u64(cid))
    w.made_checkpoint(kind)
    return ck


def ensure_origin_checkpoint(w: WriteTxn) -> None:
    """Checkpoint 0: the tree before the session's first change."""
    if w.get(CKPTS, u64(0)) is None:
        ck = Checkpoint(0, 1, 1, now_ns(), "auto", None, "session start", 0, "",
                        next_ino=w.meta_int(NEXT_INO_KEY, FIRST_UPPER_INO))
        w.put(CKPTS, u64(0), ck.pack())


def records(r: ReadTxn, start: int, end: int, undo: bool = True) -> list[JournalRecord]:
    """Journal records with start <= seq < end, oldest first (without undo entries: only
    who, what and where)."""
    unpack = JournalRecord.unpack if undo else JournalRecord.unpack_head
    out = []
    for k, v in r.range_from(JOURNAL, u64(start)):
        seq = from_u64(k)
        if seq >= end:
            break
        out.append(unpack(seq, v))
    return out


# A record's packed undo entries are kept under this size: LMDB finds room for a bigger
# value by merging its whole free list (1 MB: 250 ms in a store with 100k free pages),
# while one of two pages (~8 KB) is found at once.
RECORD_BYTES = 6000


def append_closed(w: WriteTxn, caller: Caller, op: str, undo: list[tuple[int, bytes, bytes | None]],
                  kind: str, restored_from: int | None = None,
                  newest: list[bytes | None] | None = None, paths: tuple[str, ...] = (),
                  changes: tuple[str, ...] = ()) -> Checkpoint:
    """Journal one operation as a checkpoint of its own (a restore, a backout), outside any
    group: as many records as keep each under RECORD_BYTES (newest: history.record), with
    the paths it changed shared out among them, if given (a restore lists its own later)."""
    close_open_group(w)
    start = seq = next_seq(w)
    t = now_ns()
    spans = _spans(undo)
    for i, (lo, hi) in enumerate(spans):
        part = undo[lo:hi]
        a, b = i * len(paths) // len(spans), (i + 1) * len(paths) // len(spans)
        rec = JournalRecord(seq, t, caller.pid, caller.comm, op, paths[a:b], changes[a:b],
                            tuple(part))
        w.put(JOURNAL, u64(seq), rec.pack(), append=True)
        history.record(w, start, seq, part, None if newest is None else newest[lo:hi])
        seq += 1
    if seq > start:
        groupfiles.record(w, start, paths, changes)
    w.set_meta_int(SEQ_KEY, seq)
    return new_checkpoint(w, seq, start, kind, None, None, caller.pid, caller.comm,
                          restored_from=restored_from)


def _spans(undo: list[tuple[int, bytes, bytes | None]]) -> list[tuple[int, int]]:
    """undo cut into runs of about RECORD_BYTES packed (none if it is empty)."""
    out, lo, size = [], 0, 0
    for i, (_, key, old) in enumerate(undo):
        n = len(key) + len(old or b"") + 8
        if size + n > RECORD_BYTES and i > lo:
            out.append((lo, i))
            lo, size = i, 0
        size += n
    if lo < len(undo):
        out.append((lo, len(undo)))
    return out
