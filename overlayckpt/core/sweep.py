"""Overlay inodes no name leads to any more: gc deletes them.

A restore leaves the inodes that did not exist at its target as they are
(delta.py's unborn_left), their entries too: no directory of the tree it
puts back names them, and the restore back names them again with one entry. An
entry counts only in a directory of the tree (named_of, for fsck too): one in
such a directory may name a repo file moved back out, without a record. gc
sweeps those left unnamed for good, journaled like any deletion (so every checkpoint that shows
them still does, and a restore can still bring them back, at the cost of their
keys), in slices of a few hundred inodes a transaction, each directory before
what it holds, so that no entry ever names a missing record. A slice goes only
if nothing else was journaled since the sweep looked: whatever changed meanwhile
(a restore back, a rename out of such a directory) waits for the next gc.
"""
from __future__ import annotations

import trio

from overlayckpt.core.journal import Caller, append, close_open_group, next_seq
from overlayckpt.core.workers import read_off_loop
from overlayckpt.messages import SweepReport
from overlayckpt.records import (
    FIRST_UPPER_KEY,
    T_BMAP,
    T_DIRENTS,
    T_NODES,
    T_XATTRS,
    TABLE_NAMES,
    WHITEOUT,
    Node,
)
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import DIRENTS, NODES

SLICE_INODES = 500
SWEEP_WINDOW = 3600.0  # seconds: the slices' records stay one group
GC_CALLER = Caller(0, "gc")
_BELOW = (T_BMAP, T_XATTRS, T_DIRENTS)  # the tables whose keys begin with the inode


def children_of(r: ReadTxn) -> dict[bytes, list[bytes]]:
    """Directory -> the inodes its entries name (keys of NODES), over every entry."""
    children: dict[bytes, list[bytes]] = {}
    for key, child in r.range_from(DIRENTS):
        if child != WHITEOUT:
            children.setdefault(key[:8], []).append(child)
    return children


def named_of(children: dict[bytes, list[bytes]]) -> set[bytes]:
    """The overlay inodes a directory of the tree can name. The repo's directories and the
    root count as in the tree (they may be): only what hangs from them through entries is
    named. Entries elsewhere (in a directory a restore left unnamed) name nothing."""
    named: set[bytes] = set()
    stack = [child for parent, kids in children.items() if parent < FIRST_UPPER_KEY for child in kids]
    while stack:
        ino = stack.pop()
        if ino >= FIRST_UPPER_KEY and ino not in named:
            named.add(ino)
            stack += children.get(ino, ())
    return named


def in_tree(parent: bytes, named: set[bytes]) -> bool:
    """Whether the entries of directory parent count (named_of)."""
    return parent < FIRST_UPPER_KEY or parent in named


def unnamed(r: ReadTxn) -> list[bytes]:
    """The overlay inodes (keys of NODES) that no directory of the tree can name
    (named_of), each after the directory that names it."""
    children = children_of(r)
    named = named_of(children)
    # nlink 0: unlinked while open; its handle's release deletes it, not a sweep
    left = {key for key, raw in r.range_from(NODES, FIRST_UPPER_KEY)
            if key not in named and Node.unpack(raw).nlink > 0}
    # each after every entry that names it is gone (a hard link may sit in two of them)
    naming = dict.fromkeys(left, 0)
    for parent in left:
        for child in children.get(parent, ()):
            if child in naming:
                naming[child] += 1
    order = [ino for ino, n in naming.items() if n == 0]
    i = 0
    while i < len(order):
        for child in children.get(order[i], ()):
            if child in naming:
                naming[child] -= 1
                if naming[child] == 0:
                    order.append(child)
        i += 1
    return order + sorted(ino for ino, n in naming.items() if n > 0)  # (none: no loops)


def _delete(w: WriteTxn, inodes: list[bytes]) -> int:
    """Delete every key of these inodes, journaled as one record. Returns the keys."""
    undo: list[tuple[int, bytes, bytes | None]] = []
    for ino in inodes:
        raw = w.get(NODES, ino)
        if raw is None:
            continue
        undo.append((T_NODES, ino, raw))
        for code in _BELOW:
            undo += [(code, key, value) for key, value in w.prefix(TABLE_NAMES[code], ino)]
    for code, key, _ in undo:
        w.delete(TABLE_NAMES[code], key)
    if undo:  # (one group for the whole sweep: sweep() closes it)
        append(w, GC_CALLER, "sweep", (), (), undo, window=SWEEP_WINDOW)
    return len(undo)


async def sweep(store: Store) -> SweepReport:
    """Delete the unnamed overlay inodes, slice by slice (the scan off the loop)."""
    seq, order = await read_off_loop(store, lambda r: (next_seq(r), unnamed(r)))
    swept = keys = 0
    for lo in range(0, len(order), SLICE_INODES):
        part, last = order[lo:lo + SLICE_INODES], lo + SLICE_INODES >= len(order)

        def fn(w: WriteTxn, part: list[bytes] = part, last: bool = last) -> tuple[int, int] | None:
            if next_seq(w) != seq:  # noqa: B023  (fn is called at once)
                return None  # something changed since the scan: the next gc looks again
            done = _delete(w, part)
            if last and keys + done:  # noqa: B023
                close_open_group(w)
            return done, next_seq(w)
        result = store.write(fn)
        if result is None:
            if keys:  # (what was swept is a group of its own all the same)
                store.write(close_open_group)
            break
        swept, keys, seq = swept + len(part), keys + result[0], result[1]
        await trio.sleep(0)
    return {"swept_inodes": swept, "swept_keys": keys}
