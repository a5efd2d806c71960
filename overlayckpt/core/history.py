"""The history index: every journaled key's value at any checkpoint, without the journal.

A checkpoint is a journal position, and a key's value there is the value it had
just before its first change at or after that position (or its live value if
it has not changed since). The index keeps exactly those values, so the state
at a checkpoint costs a lookup per key read, and a restore or diff costs the
keys that changed since, never the journal records in between:

- VERSIONS: vkey + seq -> the key's value just before record seq changed it.
  Only a key's first change in each group (the records between two
  checkpoints) is kept: checkpoints sit at group boundaries only, so a later
  change in the same group is never any checkpoint's value.
- CHANGED: layer + seq + vkey -> born, one entry per key: the record of its
  newest version, so the keys changed at or after a position are one range in
  each layer (0: of the repo's inodes, 1: of the overlay's own; a restore to a
  point where the overlay had made no inode reads none of the overlay's). (The
  newest version is the last of the key's VERSIONS entries: that is how its
  CHANGED entry is found to move it.) born (format 5) is the seq of the key's
  oldest version when the key was absent before it (a name or block the session
  made), else b"": a key born at or after a position was absent there, known
  without a lookup in VERSIONS (a restore across 100,000 names made and removed
  since reads none of their versions).

vkey is the table code, the key and a NUL: names hold no NUL and the other
keys have a fixed length, so one key's versions are contiguous and sorted by
seq, and a directory's names share a prefix. Every change is indexed in the
write transaction of its journal record. The index is derived data: bundles
and salvage leave it out, and a store without HISTORY_KEY (upgraded from
format 1, imported, recovered) has it rebuilt from the journal at open.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import takewhile

from overlayckpt.records import (
    FIRST_UPPER_INO,
    FIRST_UPPER_KEY,
    TABLE_NAMES,
    Checkpoint,
    JournalRecord,
    from_u64,
    u64,
)
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import CHANGED, CKPTS, HISTORY_BORN, HISTORY_KEY, JOURNAL, META, VERSIONS

Key = tuple[int, bytes]  # (table code, key)
Undo = Iterable[tuple[int, bytes, "bytes | None"]]

TABLE_CODES = {name: code for code, name in TABLE_NAMES.items()}
_ABSENT = b"\0"
_PRESENT = b"\1"
_AFTER_ALL = b"\xff" * 8  # above every seq: skips past one key's versions
_LOWER, _UPPER = b"\0", b"\1"  # the layers of CHANGED's keys (the overlay's are the tail)
# A key's newest version as restores carry it ("token"): its seq (8 bytes), then its
# CHANGED value (born: 8 bytes or none)


# record(): from this many keys of a table on, one seek may tell that none has a version
RUN_KEYS = 8


def vkey(code: int, key: bytes) -> bytes:
    return bytes((code,)) + key + b"\0"


def _ck(at: bytes, vk: bytes) -> bytes:
    """The CHANGED key of vk's newest version, at seq at (every key begins with its inode)."""
    return (_UPPER if vk[1:9] >= FIRST_UPPER_KEY else _LOWER) + at + vk


def _tag(value: bytes | None) -> bytes:
    return _ABSENT if value is None else _PRESENT + value


def _untag(raw: bytes) -> bytes | None:
    return None if raw[:1] == _ABSENT else raw[1:]


# -- writing ---------------------------------------------------------------------


def record(w: WriteTxn, group_start: int, seq: int, undo: Undo,
           newest: Sequence[bytes | None] | None = None) -> None:
    """Index the changes of journal record seq, in the group that began at group_start.

    newest: each undo entry's newest version (its seq, 8 bytes; None: it has none), when
    the caller knows them (a restore, from its snapshot) and seq begins its group."""
    if newest is not None:
        _record_known(w, seq, undo, newest)
        return
    at, start = u64(seq), u64(group_start)
    versions: list[tuple[bytes, bytes]] = []
    changed: list[tuple[bytes, bytes]] = []
    seen: set[bytes] = set()  # (a record's keys are distinct, but for an imported one)
    vks = [vkey(code, key) for code, key, _ in undo]
    by_table: dict[int, list[bytes]] = {}
    for (code, _, _), vk in zip(undo, vks):
        by_table.setdefault(code, []).append(vk)
    unversioned = {code for code, keys in by_table.items()
                   if len(keys) >= RUN_KEYS and not _any_version(w, min(keys), max(keys))}
    for (code, _, old), vk in zip(undo, vks):
        if vk in seen:
            continue  # its first entry is the version, as if put before this _newest
        seen.add(vk)
        last = None if code in unversioned else _newest(w, vk)
        if last is not None:
            if last >= start:  # (big-endian: bytes order is number order)
                continue  # already versioned in this group
            born = w.pop(CHANGED, _ck(last, vk)) or b""
        else:
            born = at if old is None else b""
        versions.append((vk + at, _tag(old)))
        changed.append((_ck(at, vk), born))
    # in key order, in one call each: a big write's 256 blocks a record
    w.put_many(VERSIONS, sorted(versions))
    w.put_many(CHANGED, sorted(changed))


def _record_known(w: WriteTxn, seq: int, undo: Undo, newest: Sequence[bytes | None]) -> None:
    """record() without a lookup: every key gets a version, written in key order (puts in
    order touch the same pages); the new CHANGED entries share seq, above every other of
    their layer (the overlay's: the table's tail)."""
    at, up = u64(seq), FIRST_UPPER_KEY
    # (vkey, its layer as _ck finds it, once per row: a restore may write 20,000)
    rows: list[tuple[bytes, bytes, bytes | None, bytes | None]] = []
    for (code, key, old), last in zip(undo, newest):
        vk = vkey(code, key)
        rows.append((vk, _UPPER if vk[1:9] >= up else _LOWER, old, last))
    rows.sort()  # (vkeys are distinct: the tuples compare by them alone)
    w.put_many(VERSIONS, [(vk + at, _tag(old)) for vk, _, old, _ in rows])
    w.delete_many(CHANGED, sorted(layer + last[:8] + vk for vk, layer, _, last in rows
                                  if last is not None))
    for layer in (_LOWER, _UPPER):
        w.put_many(CHANGED, [(layer + at + vk, (at if old is None else b"") if last is None
                              else last[8:]) for vk, mine, old, last in rows if mine == layer],
                   append=layer == _UPPER)  # (the overlay's layer is the table's tail)


def born_since(token: bytes, at: bytes) -> bool:
    """Whether the key of this token (newest_since's) was absent at position at (8 bytes)
    because it was born at or after it."""
    return len(token) == 16 and token[8:] >= at


def newest(r: ReadTxn, code: int, key: bytes) -> bytes | None:
    """The token of the key's newest version, or None if it has none."""
    vk = vkey(code, key)
    last = _newest(r, vk)
    return None if last is None else last + (r.get(CHANGED, _ck(last, vk)) or b"")


def _any_version(r: ReadTxn, first: bytes, last: bytes) -> bool:
    """Whether any key from vkey first to vkey last has a version: if none does (a new
    file's blocks), record() need not look for each one's newest."""
    hit = r.seek(VERSIONS, first)
    return hit is not None and hit[0] <= last + _AFTER_ALL


def _newest(r: ReadTxn, vk: bytes) -> bytes | None:
    """The seq (8 bytes) of the newest version of vk: the last of its VERSIONS entries."""
    hit = r.seek_before(VERSIONS, vk + _AFTER_ALL)
    return hit[0][-8:] if hit is not None and hit[0].startswith(vk) else None


def merge(w: WriteTxn, lo: int, hi: int, into: int, first: dict[Key, bytes | None]) -> None:
    """Records lo <= seq < hi became one record `into` whose undo is `first` (thinning)."""
    for (code, key), old in first.items():
        vk = vkey(code, key)
        last = _newest(w, vk)
        for k, _ in list(w.range_from(VERSIONS, vk + u64(lo))):
            if not k.startswith(vk) or from_u64(k[-8:]) >= hi:
                break
            w.delete(VERSIONS, k)
        w.put(VERSIONS, vk + u64(into), _tag(old))
        if last is None:
            continue
        born = w.get(CHANGED, _ck(last, vk)) or b""
        moved = born and lo <= from_u64(born) < hi  # (its oldest version is the merged one)
        if lo <= from_u64(last) < hi:  # the newest version moved
            w.delete(CHANGED, _ck(last, vk))
            w.put(CHANGED, _ck(u64(into), vk), u64(into) if moved else born)
        elif moved:
            w.put(CHANGED, _ck(last, vk), u64(into))


def is_built(r: ReadTxn) -> bool:
    return r.get(META, HISTORY_KEY) is not None


def ensure(w: WriteTxn) -> bool:
    """Rebuild the index from the journal if it is missing (and give a format 4 one its
    layers and born values). Returns whether it was missing."""
    if is_built(w):
        if w.meta_int(HISTORY_KEY) < HISTORY_BORN:
            _add_born(w)
        return False
    for table in (VERSIONS, CHANGED):
        w.clear(table)
    for start, rec in grouped_records(w, JournalRecord.unpack):
        record(w, start, rec.seq, rec.undo)
    w.set_meta_int(HISTORY_KEY, HISTORY_BORN)
    return True


def _add_born(w: WriteTxn) -> None:
    """CHANGED as format 5 has it, from format 4's (seq + vkey -> b""): each entry under
    its layer, with its born value from the key's oldest version."""
    entries = []
    for k in list(w.keys_from(CHANGED, b"")):
        vk = k[8:]
        oldest = w.seek(VERSIONS, vk)
        born = oldest is not None and oldest[0][:-8] == vk and oldest[1][:1] == _ABSENT
        entries.append((_ck(k[:8], vk), oldest[0][-8:] if born else b""))  # type: ignore[index]  # born: oldest is set
    w.clear(CHANGED)
    w.put_many(CHANGED, sorted(entries))
    w.set_meta_int(HISTORY_KEY, HISTORY_BORN)


def grouped_records(r: ReadTxn, unpack: Callable[[int, bytes], JournalRecord]
                    ) -> Iterator[tuple[int, JournalRecord]]:
    """Every journal record (unpack: with or without its undo entries) with the start of
    its group: groups end at checkpoints."""
    bounds = sorted({Checkpoint.unpack(from_u64(k), v).seq for k, v in r.range_from(CKPTS)})
    i, start = 0, 1
    for k, v in r.range_from(JOURNAL):
        seq = from_u64(k)
        while i < len(bounds) and bounds[i] <= seq:
            start = bounds[i]
            i += 1
        yield start, unpack(seq, v)


class Expected:
    """The index the journal implies, table by table, record by record (fsck compares it
    with the stored one, in the same pass over the journal as groupfiles.Expected)."""

    def __init__(self) -> None:
        self.tables: dict[bytes, dict[bytes, bytes]] = {VERSIONS: {}, CHANGED: {}}
        self._latest: dict[bytes, bytes] = {}

    def add(self, start: int, rec: JournalRecord) -> None:
        versions, changed = self.tables[VERSIONS], self.tables[CHANGED]
        for code, key, old in rec.undo:
            vk = vkey(code, key)
            last = self._latest.get(vk)
            at = u64(rec.seq)
            if last is not None:
                if last >= u64(start):
                    continue
                born = changed.pop(_ck(last, vk))
            else:
                born = at if old is None else b""
            versions[vk + at] = _tag(old)
            changed[_ck(at, vk)] = born
            self._latest[vk] = at


# -- reading ---------------------------------------------------------------------


def value_at(r: ReadTxn, code: int, key: bytes, seq: int) -> tuple[bool, bytes | None]:
    """(True, value) if the key changed at or after seq, with its value at seq; else (False, None)."""
    vk = vkey(code, key)
    hit = r.seek(VERSIONS, vk + u64(seq))
    if hit is None or not hit[0].startswith(vk):
        return False, None
    return True, _untag(hit[1])


def changed_since(r: ReadTxn, seq: int) -> Iterator[Key]:
    """Every key whose value changed at or after journal position seq (once each)."""
    for layer in (_LOWER, _UPPER):
        for k, _ in _entries(r, layer, seq):
            yield k[9], k[10:-1]


def _entries(r: ReadTxn, layer: bytes, seq: int) -> Iterator[tuple[bytes, bytes]]:
    """The CHANGED entries of one layer from seq on, as stored (layer + seq + vkey, born)."""
    entries = r.items_from(CHANGED, layer + u64(seq))
    if layer == _UPPER:  # (the tail: nothing after it)
        return entries
    return takewhile(lambda e: e[0][:1] == _LOWER, entries)


def newest_since(r: ReadTxn, seq: int, below: int = 0,
                 left_out: set[bytes] | None = None) -> list[tuple[bytes, bytes]]:
    """The CHANGED entries (seq of the newest version + vkey, born) of every key changed at
    or after seq, but for the keys of the inodes numbered from below on (0: none left out).
    Every key begins with its inode, so those are left out by a byte compare, before the
    entry is sliced; entries stay as stored (a restore across 200,000 keys parses each
    once: code k[8], key k[9:-1], token k[:8] + born). left_out: gets the inodes (8-byte
    keys) left out."""
    out = [(k[1:], v) for k, v in _entries(r, _LOWER, seq)]  # (few: repo files' keys)
    if not below:
        out += [(k[1:], v) for k, v in _entries(r, _UPPER, seq)]
    elif below > FIRST_UPPER_INO:
        limit = u64(below)
        if left_out is None:
            out += [(k[1:], v) for k, v in _entries(r, _UPPER, seq) if k[10:18] < limit]
        else:
            for k, v in _entries(r, _UPPER, seq):
                if k[10:18] < limit:
                    out.append((k[1:], v))
                else:
                    left_out.add(k[10:18])
    return out


# A whole restore reads a version of each key it writes and the pages its write changes,
# one page each for thousands of keys. This host pages idle page cache out within
# minutes: read from disk one at a time they cost a restore seconds (1.85 s for 16,000
# keys, measured). Several threads at once wait for the disk together (0.7 s); warm,
# that costs more than it saves, so a sample of the keys decides.
WARM_THREADS = 8
WARM_MIN = 4096  # keys (changed entries) below which the disk costs a restore little
WARM_SAMPLE = 64  # lookups timed, spread over the keys
COLD_S = 20e-6  # a sampled lookup slower than this on average: the pages are on disk


def _cold(r: ReadTxn, table: bytes, keys: list[bytes]) -> bool:
    """Whether seeking these keys (a sample) says the table's pages are on disk."""
    t0 = time.perf_counter()
    for key in keys:
        r.seek(table, key)
    return time.perf_counter() - t0 > len(keys) * COLD_S


def _in_threads(r: ReadTxn, fn: Callable[[ReadTxn, int], None]) -> None:
    """fn(view, i) for i < WARM_THREADS at once, each in a read view of its own (what it
    reads is thrown away: only the pages it brought into the page cache stay)."""
    with ThreadPoolExecutor(WARM_THREADS, thread_name_prefix="warm-up") as pool:
        list(pool.map(lambda i: r.store.read(lambda view: fn(view, i)), range(WARM_THREADS)))


def warm_changed(r: ReadTxn, seq: int) -> bool:
    """Bring the CHANGED entries from seq on into the page cache, a slice of them per
    thread, if a sample says they are not there. Returns whether it did."""
    if r.count(CHANGED) < WARM_MIN:
        return False
    top = max(_top(r, layer) for layer in (_LOWER, _UPPER))
    if top <= seq:
        return False
    sample = [(_LOWER, _UPPER)[i % 2] + u64(seq + (top - seq) * i // WARM_SAMPLE)
              for i in range(WARM_SAMPLE)]
    if not _cold(r, CHANGED, sample):
        return False
    cuts = [seq + (top - seq) * i // WARM_THREADS for i in range(WARM_THREADS + 1)]

    def scan(view: ReadTxn, i: int) -> None:
        for layer in (_LOWER, _UPPER):
            end = layer + u64(cuts[i + 1])
            for k in view.keys_from(CHANGED, layer + u64(cuts[i])):
                if k >= end:
                    break
    _in_threads(r, scan)
    return True


def _top(r: ReadTxn, layer: bytes) -> int:
    """1 + the newest seq of a layer's CHANGED entries (0: it has none)."""
    hit = r.seek_before(CHANGED, layer + _AFTER_ALL)
    return from_u64(hit[0][1:9]) + 1 if hit is not None and hit[0][:1] == layer else 0


def warm_up(r: ReadTxn, found: list[tuple[bytes, bytes]], seq: int) -> bool:
    """Bring into the page cache, with several threads, the pages that restoring the keys
    found (newest_since's) to seq reads and writes, when a sample of them says they are
    not there. Returns whether it did."""
    if len(found) < max(WARM_MIN, WARM_SAMPLE):
        return False
    at = u64(seq)
    sample = [k[8:] + at for k, born in found[::len(found) // WARM_SAMPLE]
              if not born_since(k[:8] + born, at)]
    if not sample or not _cold(r, VERSIONS, sample):
        return False
    _in_threads(r, lambda view, i: _touch(view, found[i::WARM_THREADS], seq))
    return True


def _touch(r: ReadTxn, part: list[tuple[bytes, bytes]], seq: int) -> None:
    at = u64(seq)
    for k, born in part:
        vk = k[8:]
        now = r.get(TABLE_NAMES[k[8]], k[9:-1])  # the value now
        if born_since(k[:8] + born, at):  # absent then: written only if present now
            if now is None:
                continue
        else:
            r.seek(VERSIONS, vk + at)  # the value then
        r.seek(VERSIONS, vk + k[:8])  # where the restore's version goes
        r.get(CHANGED, _ck(k[:8], vk))  # the entry it moves


def value_then(r: ReadTxn, code: int, key: bytes, seq: int, token: bytes = b"") -> bytes | None:
    """The value at seq of a key that changed at or after seq (one of newest_since's,
    with its token: one born since was absent)."""
    at = u64(seq)
    if born_since(token, at):
        return None
    return _untag(r.seek(VERSIONS, vkey(code, key) + at)[1])  # type: ignore[index]  # not born since: a version is there


def values_since(r: ReadTxn, seq: int) -> Iterator[tuple[int, bytes, bytes | None, bytes]]:
    """(code, key, value at seq, token of its newest version) of every key changed at or
    after seq."""
    for k, born in newest_since(r, seq):
        code, key, last = k[8], k[9:-1], k[:8] + born
        yield code, key, value_then(r, code, key, seq, last), last


def versions_under(r: ReadTxn, code: int, prefix: bytes, seq: int) -> Iterator[tuple[bytes, bytes | None]]:
    """(key, value at seq) of every key starting with prefix that changed at or after seq."""
    start = bytes((code,)) + prefix
    at = u64(seq)
    hit = r.seek(VERSIONS, start)
    while hit is not None and hit[0].startswith(start):
        vk = hit[0][:-8]
        if hit[0][-8:] >= at:
            yield vk[1:-1], _untag(hit[1])
            hit = r.seek(VERSIONS, vk + _AFTER_ALL)
        else:
            hit = r.seek(VERSIONS, vk + at)


def laid_over(entries: Iterable[tuple[bytes, bytes]], values: Iterable[tuple[bytes, bytes | None]]
              ) -> Iterator[tuple[bytes, bytes]]:
    """entries with other values for some keys (None: absent), in key order."""
    items = dict(entries)
    for key, value in values:
        if value is None:
            items.pop(key, None)
        else:
            items[key] = value
    return iter(sorted(items.items()))


class AtCheckpoint:
    """The tables as they were at journal position seq: the history index over a live view.

    Opening one costs nothing; each read costs one index lookup more than a live read.
    """

    def __init__(self, r: ReadTxn, seq: int) -> None:
        self.r = r
        self.seq = seq

    def get(self, table: bytes, key: bytes) -> bytes | None:
        code = TABLE_CODES.get(table)
        if code is not None:
            found, value = value_at(self.r, code, key, self.seq)
            if found:
                return value
        return self.r.get(table, key)

    def prefix(self, table: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        code = TABLE_CODES.get(table)
        if code is None:
            return self.r.prefix(table, prefix)
        return laid_over(self.r.prefix(table, prefix),
                         versions_under(self.r, code, prefix, self.seq))

    def block(self, digest: bytes) -> bytes:
        return self.r.block(digest)
