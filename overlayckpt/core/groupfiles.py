"""Each group's net file changes, kept as its records are written, so that the log lists
a checkpoint's files without reading its records (a `python` loop that creates 20,000
files makes one group of 40,000 records).

GROUPFILES: group start seq + path -> the path's net change in that group so far
(A M D R, or "gone": created and deleted again), updated in the write transaction of
each journal record. The rows are derived from the journal, like the history index
(history.py): bundles and salvage leave them out, and a store without GROUPFILES_KEY
(new format, imported, recovered) has them rebuilt at open. Thinning, which merges
the records of several groups into one, rewrites the rows of the group that then
holds them (rows_of, computed in its snapshot).
"""
from __future__ import annotations

from collections.abc import Iterable

from overlayckpt.core import history
from overlayckpt.records import Checkpoint, JournalRecord, from_u64, path_cut, path_key, u64
from overlayckpt.store.lmdbstore import ReadTxn, WriteTxn
from overlayckpt.tables import GROUPFILES, GROUPFILES_KEY, JOURNAL, META

GONE = "gone"


def fold(before: str | None, change: str) -> str:
    """A path's net change in a group, given its net change so far and the next one."""
    if change == "<":
        return "D" if before != "A" else GONE
    if before == "A" and change == "D":
        return GONE
    if before == "A" and change in ("M", "R"):
        return "A"
    if before == "D" and change in ("A", "R"):
        return "M"
    if before == GONE and change == "A":
        return "A"
    return change if before is None or change != "M" else before


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
    """Fold one journal record's paths into its group's rows."""
    for path, change in zip(paths, changes):
        key = _key(group_start, path)
        raw = w.get(GROUPFILES, key)
        before = _change(raw) if raw is not None else None
        after = fold(before, change)
        if after != before:
            w.put(GROUPFILES, key, _value(key, path, after))


def files(r: ReadTxn, ck: Checkpoint) -> list[dict[str, str]]:
    """The net file changes of checkpoint ck's group, sorted by path."""
    if ck.seq <= ck.start_seq:  # (a named or before-restore checkpoint: no records of its own)
        return []
    rows = list(r.prefix(GROUPFILES, u64(ck.start_seq)))
    out = [{"path": _path(k, v), "change": _change(v)} for k, v in rows if _change(v) != GONE]
    if any(path_cut(k, 8) for k, _ in rows):  # (then it sorts by its digest)
        out.sort(key=lambda f: _encode(f["path"]))
    return out


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


# -- built, rebuilt, checked ---------------------------------------------------------


def is_built(r: ReadTxn) -> bool:
    return r.get(META, GROUPFILES_KEY) is not None


class Expected:
    """The rows the journal implies, record by record (fsck compares them with the
    stored ones; ensure writes them)."""

    def __init__(self) -> None:
        self._net: dict[bytes, tuple[str, str]] = {}  # key -> path, its change

    def add(self, start: int, rec: JournalRecord) -> None:
        for path, change in zip(rec.paths, rec.changes):
            key = _key(start, path)
            before = self._net.get(key)
            self._net[key] = path, fold(before[1] if before else None, change)

    def rows(self) -> dict[bytes, bytes]:
        return {k: _value(k, path, change) for k, (path, change) in self._net.items()}


def expected(r: ReadTxn) -> dict[bytes, bytes]:
    out = Expected()
    for start, rec in history.grouped_records(r, JournalRecord.unpack_head):
        out.add(start, rec)
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
