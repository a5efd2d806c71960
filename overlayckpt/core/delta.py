"""The keys that differ between a state and another, and what a restore writes of them.

A restore or a diff never reads the journal records between two positions: the
history index (history.py) lists the keys changed since a position, and each
key's value then is one lookup away. This module turns that into what a
restore writes (rows_since: the keys whose value at the target differs from
now, less those of the overlay inodes that did not exist then) and what a diff
compares (keys_between, differing).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from overlayckpt.core import history
from overlayckpt.core.journal import next_seq, records
from overlayckpt.records import FIRST_UPPER_INO, FIRST_UPPER_KEY, TABLE_NAMES, Checkpoint, from_u64, u64
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import CKPTS, DIRENTS, LIVE_TABLES, META, NODES, RESTORED_KEY, RESTORED_LEFT_MOST

TABLE_CODES = history.TABLE_CODES

Delta = dict[tuple[bytes, bytes], "bytes | None"]
# (table, key) -> (its value at the target, its value now, its newest version: history.record)
Rows = dict[tuple[bytes, bytes], "tuple[bytes | None, bytes | None, bytes | None]"]


# Between two positions this close, reading their journal records finds the changed keys
# faster than the index, which holds every key changed since the older one.
SCAN_RECORDS = 2048


def keys_between(r: ReadTxn, lo: int, hi: int | None) -> set[tuple[bytes, bytes]]:
    """Keys that may differ between positions lo and hi (None: live): a superset."""
    if hi is None or hi - lo > SCAN_RECORDS:
        return {(TABLE_NAMES[code], key) for code, key in history.changed_since(r, lo)}
    out: set[tuple[bytes, bytes]] = set()
    for rec in records(r, lo, hi):
        for table, key, _ in rec.undo:
            out.add((TABLE_NAMES[table], key))
    return out


def differing(a: Callable[[bytes, bytes], bytes | None], b: Callable[[bytes, bytes], bytes | None],
               keys: Iterable[tuple[bytes, bytes]]) -> tuple[Delta, set[int]]:
    """Of keys, those whose values differ between two states (a and b read them), with
    their value in b; and the inodes that have a node record in one of the two only."""
    out: Delta = {}
    one_sided: set[int] = set()
    for table, key in keys:
        va, vb = a(table, key), b(table, key)
        if va != vb:
            out[(table, key)] = vb
            if table == NODES and (va is None or vb is None):
                one_sided.add(from_u64(key))
    return out, one_sided


# A restore lists a directory once it has asked whether NAMES_BEFORE_LISTING of its names
# born since exist now, if it holds at most LISTING_SHARE entries per name asked (_NamesNow).
NAMES_BEFORE_LISTING = 64
LISTING_SHARE = 8


def _unborn(table: bytes, key: bytes, value: bytes | None) -> bool:
    """The record of an overlay inode that did not exist at the target."""
    return table == NODES and value is None and key >= FIRST_UPPER_KEY


def _left_alone(key: bytes, unborn: set[bytes]) -> bool:
    """A key the restore leaves as it is: one of an unborn inode's, its entries too (no name
    of the tree it puts back leads there: fsck and gc judge an entry by whether one does)."""
    return key[:8] in unborn


def unborn_left(rows: Rows, left: set[bytes] | None = None) -> Rows:
    """rows without those of the overlay inodes that did not exist at the target, which
    the restore leaves as they are (_left_alone): no name of the tree it puts back leads
    to them (each of its directories gets its entries then), so writing the entries of
    the names that led there is enough. A subtree created since the target goes with its
    one name, and comes back with it (restore @before-last) the same way. left: gets the
    inodes (8-byte keys) left."""
    unborn = {key for (table, key), (value, _, _) in rows.items() if _unborn(table, key, value)}
    if left is not None:
        left |= unborn
    if not unborn:
        return rows
    return {(table, key): row for (table, key), row in rows.items()
            if not _left_alone(key, unborn)}


class _NamesNow:
    """Whether names exist now, for a restore's names born since its target (absent then:
    a row only if there now). A directory where it asks about many of them (a build's
    output, made and removed since) is listed once instead, if that reads at most
    LISTING_SHARE entries per name asked so far (else it tries again LISTING_SHARE times
    as many names later): never more than a few times the entries of asking by name."""

    def __init__(self, r: ReadTxn) -> None:
        self.r = r
        self.asked: dict[bytes, int] = {}  # directory -> names asked about
        self.next_try: dict[bytes, int] = {}  # directory -> when to try listing it again
        self.listed: dict[bytes, dict[bytes, bytes]] = {}

    def get(self, key: bytes) -> bytes | None:
        d = key[:8]
        listing = self.listed.get(d)
        if listing is not None:
            return listing.get(key)
        asked = self.asked[d] = self.asked.get(d, 0) + 1
        if asked >= self.next_try.get(d, NAMES_BEFORE_LISTING):
            listing = self._list(d, LISTING_SHARE * asked)
            if listing is not None:
                self.listed[d] = listing
                return listing.get(key)
            self.next_try[d] = LISTING_SHARE * asked
        return self.r.get(DIRENTS, key)

    def _list(self, d: bytes, most: int) -> dict[bytes, bytes] | None:
        out: dict[bytes, bytes] = {}
        for k, v in self.r.prefix(DIRENTS, d):
            if len(out) >= most:
                return None
            out[k] = v
        return out


def rows_since(r: ReadTxn, seq: int, next_ino: int = 0, left: set[bytes] | None = None) -> Rows:
    """The rows of a restore of the whole tree to seq: the keys whose value then differs
    from now, less those unborn_left leaves out: an inode numbered from next_ino on (the
    counter then; 0: unknown) did not exist then, so its keys are not even read, and a key
    born since seq was absent then, known without reading its versions. Pages the host
    paged out are brought in by several threads first (history.warm_up). left: gets the
    inodes (8-byte keys) whose keys the restore leaves as they are."""
    history.warm_changed(r, seq)
    found = history.newest_since(r, seq, next_ino, left)
    history.warm_up(r, found, seq)
    node_code, get, at, names = TABLE_CODES[NODES], r.get, u64(seq), TABLE_NAMES
    dirents_code, names_now = TABLE_CODES[DIRENTS], _NamesNow(r)
    unborn: set[bytes] = set()
    rows: Rows = {}
    for k, born in found:  # (one pass, parsing each entry once: there may be 200,000)
        code, key = k[8], k[9:-1]
        table = names[code]
        if len(born) == 8 and born >= at:  # born since (history.born_since): absent then
            value = None
        else:
            value = history.value_then(r, code, key, seq)
        if code == node_code and _unborn(NODES, key, value):
            unborn.add(key)
            continue
        current = names_now.get(key) if value is None and code == dirents_code else get(table, key)
        if current != value:
            rows[(table, key)] = (value, current, k[:8] + born)
    if unborn:  # (their other keys were read in vain: few, but for an old store's restores)
        rows = {tk: row for tk, row in rows.items() if not _left_alone(tk[1], unborn)}
    if left is not None:
        left |= unborn
    return rows


def whole_restore(r: ReadTxn, target: Checkpoint) -> tuple[Rows, set[bytes]]:
    """The rows of a restore of the whole tree to target (rows_near's, else rows_since's),
    and the inodes whose keys it leaves as they are."""
    left: set[bytes] = set()
    rows = rows_near(r, target, left)
    return (rows if rows is not None else rows_since(r, target.seq, target.next_ino, left)), left


def note_restored(w: WriteTxn, restore: Checkpoint, target: Checkpoint, left: set[bytes] | None) -> None:
    """META restored after a restore of the code to target: the mark rows_near starts from
    after a whole one (left: what it left), none after one of some paths (left None)."""
    mark = restored_mark(restore, target, left)
    if mark is None:
        w.delete(META, RESTORED_KEY)
    else:
        w.put(META, RESTORED_KEY, mark)


def restored_mark(restore: Checkpoint, target: Checkpoint, left: set[bytes] | None) -> bytes | None:
    """META restored for a whole restore (its checkpoint) to target that left these inodes
    as they are (8-byte keys; None: not known); None: no mark. Of them it lists those
    target had made (gone by then): the others are known by number (rows_near). One that
    leaves more than RESTORED_LEFT_MOST of these leaves no mark."""
    if left is None or not target.next_ino:
        return None
    made = sorted(i for i in left if i < u64(target.next_ino))
    return u64(restore.id) + b"".join(made) if len(made) <= RESTORED_LEFT_MOST else None


def _checkpoint(r: ReadTxn, cid: int) -> Checkpoint | None:
    raw = r.get(CKPTS, u64(cid))
    return None if raw is None else Checkpoint.unpack(cid, raw)


def rows_near(r: ReadTxn, target: Checkpoint, left: set[bytes]) -> Rows | None:
    """rows_since's rows (and what it would leave, into left), from the journal records
    near the last whole restore instead of the index, which holds every key changed since
    target, those changed and restored back since included; None where that would not be
    cheaper (more than SCAN_RECORDS records) or cannot be known.

    After a whole restore to X, every key has its value at X but for the keys of the
    inodes it left as they are (those X had not made yet, and those gone at X: META
    restored lists these with its checkpoint) and of the records journaled since. So a
    key whose value now differs from its value at target is one of: a key of the records
    between X and target, of the records since the restore, of an inode it listed, or of
    an inode made between X and target (target after X: those target had made)."""
    mark = r.get(META, RESTORED_KEY)
    done = None if mark is None else _checkpoint(r, from_u64(mark[:8]))
    x = None if done is None or done.restored_from is None else _checkpoint(r, done.restored_from)
    if mark is None or done is None or done.kind != "restore" or x is None or not target.next_ino:
        return None
    lo, hi = sorted((x.seq, target.seq))
    now = next_seq(r)
    made = range(max(x.next_ino, FIRST_UPPER_INO), target.next_ino)  # (empty: target before X)
    if (hi - lo) + (now - done.seq) > SCAN_RECORDS or len(made) > RESTORED_LEFT_MOST or not x.next_ino:
        return None
    keys: set[tuple[bytes, bytes]] = set()
    for rec in records(r, lo, hi) + records(r, done.seq, now):
        keys.update((TABLE_NAMES[code], key) for code, key, _ in rec.undo)
    for table in LIVE_TABLES:
        for at in range(8, len(mark), 8):  # the inodes that restore listed
            keys.update((table, key) for key, _ in r.prefix(table, mark[at:at + 8]))
        if made:
            end = u64(made.stop)
            for key, _ in r.range_from(table, u64(made.start)):
                if key[:8] >= end:
                    break
                keys.add((table, key))
    then, limit, rows = history.AtCheckpoint(r, target.seq), u64(target.next_ino), {}
    for table, key in keys:
        if key >= FIRST_UPPER_KEY and key[:8] >= limit:  # (an inode target had not made:
            left.add(key[:8])                          # rows_since reads none of its keys)
            continue
        value, current = then.get(table, key), r.get(table, key)
        if value != current:
            rows[(table, key)] = (value, current, history.newest(r, TABLE_CODES[table], key))
    return unborn_left(rows, left)


def index_order(row: tuple[tuple[bytes, bytes], Any]) -> tuple[int, bytes]:
    """Rows in the index's key order (history.vkey), which is each table's key order."""
    (table, key), _ = row
    return TABLE_CODES[table], key
