"""Each group's net file changes, kept as its records are written, so that the log lists
a checkpoint's files without reading its records (a `python` loop that creates 20,000
files makes one group of 40,000 records).

GROUPFILES: group start seq + path -> the path's net change in that group so far
(A M D R, or "gone": created and deleted again), updated in the write transaction of
each journal record. Beside them, group start seq + NUL (no path holds a NUL) -> how
many paths the group has of each net change, in the work tree and in git's internals,
kept with the rows (format 5), so that the log shows an entry of 20,000 files by reading
a few hundred of its rows. A group without that row (a format 4 store's) is counted
from its rows. The rows are derived from the journal, like the history index
(history.py): bundles and salvage leave them out, and a store without GROUPFILES_KEY
(new format, imported, recovered) has them rebuilt at open. Thinning, which merges
the records of several groups into one, rewrites the rows of the group that then
holds them (rows_of, computed in its snapshot).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from overlayckpt.core import history
from overlayckpt.core.groups import open_group_spans
from overlayckpt.messages import Change, FileChange
from overlayckpt.records import (
    Checkpoint,
    JournalRecord,
    from_u64,
    pack_obj,
    path_cut,
    path_key,
    u64,
    unpack_obj,
)
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import CKPTS, GROUPFILES, GROUPFILES_KEY, JOURNAL, META

GONE = Change.GONE
_COUNTS = b"\0"  # after the group's seq: the key of its counts row
Counts = dict[str, list[int]]  # net change -> [paths in the work tree, in git's internals]


def is_internal(path: str) -> bool:
    """A path in a .git directory (the repo's or a submodule's): git's bookkeeping."""
    return ".git" in path and (  # (the first test, in C, answers for almost every path)
        path.startswith(".git") and (len(path) == 4 or path[4] == "/")
        or "/.git/" in path or path.endswith("/.git"))


def _count(counts: Counts, path: str, before: str | None, after: str) -> None:
    """Move path's count from its net change before to after ("gone" is not counted)."""
    side = is_internal(path)
    if before is not None and before != GONE:
        counts[before][side] -= 1
        if counts[before] == [0, 0]:
            del counts[before]
    if after != GONE:
        counts.setdefault(after, [0, 0])[side] += 1


def _pack(counts: Counts) -> bytes:
    return pack_obj({change: counts[change] for change in sorted(counts)})  # (one byte string)


def _counted(rows: Iterable[tuple[str, str]]) -> Counts:
    counts: Counts = {}
    for path, change in rows:
        _count(counts, path, None, change)
    return counts


def fold(before: str | None, change: str) -> str:
    """A path's net change in a group, given its net change so far and the next one."""
    if change == Change.BEFORE:
        return Change.DELETED if before != Change.ADDED else GONE
    if before == Change.ADDED and change == Change.DELETED:
        return GONE
    if before == Change.ADDED and change in (Change.MODIFIED, Change.RENAMED):
        return Change.ADDED
    if before == Change.DELETED and change in (Change.ADDED, Change.RENAMED):
        return Change.MODIFIED
    if before == GONE and change == Change.ADDED:
        return Change.ADDED
    return change if before is None or change != Change.MODIFIED else before


def _encode(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


def _key(start: int, path: str) -> bytes:
    return path_key(u64(start), _encode(path))


# a path too long for a key is kept whole in its row's value, after its change and a NUL
def _value(key: bytes, path: str, change: str) -> bytes:
    return change.encode() + b"\0" + _encode(path) if path_cut(key, 8) else change.encode()


def _change(value: bytes) -> str:
    return value.split(b"\0", 1)[0].decode()


def _path(key: bytes, value: bytes) -> str:
    whole = value.split(b"\0", 1)[1] if b"\0" in value else key[8:]
    return whole.decode("utf-8", "surrogateescape")


def record(w: WriteTxn, group_start: int, paths: Iterable[str], changes: Iterable[str]) -> None:
    """Fold one journal record's paths into its group's rows and its counts row."""
    counts: Counts | None = None
    for path, change in zip(paths, changes):
        key = _key(group_start, path)
        raw = w.get(GROUPFILES, key)
        before = _change(raw) if raw is not None else None
        after = fold(before, change)
        if after != before:
            w.put(GROUPFILES, key, _value(key, path, after))
            if counts is None:
                counts = counts_of(w, group_start) or {}
            _count(counts, path, before, after)
    if counts is not None:
        w.put(GROUPFILES, u64(group_start) + _COUNTS, _pack(counts))


def counts_of(r: ReadTxn, start: int) -> Counts | None:
    """The counts row of the group that began at start (None: it has none)."""
    raw = r.get(GROUPFILES, u64(start) + _COUNTS)
    return None if raw is None else unpack_obj(raw)


def rows(r: ReadTxn, ck: Checkpoint) -> Iterator[tuple[str, str]]:
    """(path, net change) of checkpoint ck's group, by path ("gone" left out; a path too
    long for a key by its first 494 bytes and a digest): read as far as the caller goes."""
    if ck.seq <= ck.start_seq:  # (a named or before-restore checkpoint: no records of its own)
        return
    counts = u64(ck.start_seq) + _COUNTS
    for k, v in r.prefix(GROUPFILES, u64(ck.start_seq)):
        change = _change(v) if k != counts else GONE
        if change != GONE:
            yield _path(k, v), change


def counts(r: ReadTxn, ck: Checkpoint) -> Counts:
    """How many paths of each net change ck's group has (its counts row, else its rows)."""
    if ck.seq <= ck.start_seq:
        return {}
    return counts_of(r, ck.start_seq) or _counted(rows(r, ck))


def change_of(r: ReadTxn, ck: Checkpoint, path: str) -> str | None:
    """path's net change in ck's group (None: none)."""
    if ck.seq <= ck.start_seq:
        return None
    raw = r.get(GROUPFILES, _key(ck.start_seq, path))
    change = None if raw is None else _change(raw)
    return None if change == GONE else change


def files(r: ReadTxn, ck: Checkpoint) -> list[FileChange]:
    """The net file changes of checkpoint ck's group, by path (rows)."""
    return [{"path": path, "change": change} for path, change in rows(r, ck)]


# -- thinning ------------------------------------------------------------------------


def rows_of(r: ReadTxn, start: int, end: int) -> dict[str, str]:
    """The rows the group of records start <= seq < end has (read-only: any thread)."""
    out: dict[str, str] = {}
    for k, v in r.range_from(JOURNAL, u64(start)):
        seq = from_u64(k)
        if seq >= end:
            break
        rec = JournalRecord.unpack_head(seq, v)
        for path, change in zip(rec.paths, rec.changes):
            out[path] = fold(out.get(path), change)
    return out


def replace(w: WriteTxn, lo: int, hi: int, start: int, rows: dict[str, str]) -> None:
    """The groups that began at lo <= seq < hi are one now, beginning at start: its rows."""
    for k, _ in list(w.range_from(GROUPFILES, u64(lo))):
        if from_u64(k[:8]) >= hi:
            break
        w.delete(GROUPFILES, k)
    for path, change in sorted(rows.items()):
        key = _key(start, path)
        w.put(GROUPFILES, key, _value(key, path, change))
    if rows:
        w.put(GROUPFILES, u64(start) + _COUNTS, _pack(_counted(rows.items())))


# -- built, rebuilt, checked ---------------------------------------------------------


def is_built(r: ReadTxn) -> bool:
    return r.get(META, GROUPFILES_KEY) is not None


class Expected:
    """The rows the journal implies, record by record (fsck compares them with the
    stored ones; ensure writes them)."""

    def __init__(self) -> None:
        self._net: dict[bytes, tuple[str, str]] = {}  # key -> path, its net change

    def add(self, start: int, rec: JournalRecord) -> None:
        for path, change in zip(rec.paths, rec.changes):
            key = _key(start, path)
            before = self._net.get(key)
            self._net[key] = path, fold(before[1] if before else None, change)

    def rows(self) -> dict[bytes, bytes]:
        out = {k: _value(k, path, change) for k, (path, change) in self._net.items()}
        groups: dict[bytes, Counts] = {}
        for k, (path, change) in self._net.items():
            _count(groups.setdefault(k[:8], {}), path, None, change)
        out.update((start + _COUNTS, _pack(counts)) for start, counts in groups.items())
        return out


class Starts:
    """The start of the group each journal record is in, asked in journal order.

    Groups end at checkpoints, and most are the records between two; but independent
    commands at once make groups open together (journal.append), told apart by the
    command's pid that every record and checkpoint carries. A record in no group's span
    (thinned, salvaged) is in the one its boundary begins (`fallback`)."""

    def __init__(self, r: ReadTxn) -> None:
        spans = [(c.start_seq, c.seq, c.pid) for c in
                 (Checkpoint.unpack(from_u64(k), v) for k, v in r.range_from(CKPTS))
                 if c.start_seq < c.seq]
        spans += [(start, 1 << 63, pid) for start, pid in open_group_spans(r)]
        spans.sort()
        self._spans = spans
        self._next = 0
        self._active: list[tuple[int, int, int]] = []

    def of(self, rec: JournalRecord, fallback: int) -> int:
        while self._next < len(self._spans) and self._spans[self._next][0] <= rec.seq:
            self._active.append(self._spans[self._next])
            self._next += 1
        self._active = [s for s in self._active if s[1] > rec.seq]
        if not self._active:
            return fallback
        if len(self._active) > 1:
            for start, _, pid in self._active:
                if pid == rec.pid:
                    return start
        return self._active[-1][0]


def expected(r: ReadTxn) -> dict[bytes, bytes]:
    out = Expected()
    starts = Starts(r)
    for start, rec in history.grouped_records(r, JournalRecord.unpack_head):
        out.add(starts.of(rec, start), rec)
    return out.rows()


def ensure(w: WriteTxn) -> bool:
    """Rebuild the rows from the journal if they are missing. Returns whether they were."""
    if is_built(w):
        return False
    w.clear(GROUPFILES)
    for key, value in sorted(expected(w).items()):
        w.put(GROUPFILES, key, value, append=True)
    w.set_meta_int(GROUPFILES_KEY, 1)
    return True
