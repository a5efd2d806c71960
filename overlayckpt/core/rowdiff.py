"""What one log row changed, by content: each path of its checkpoint's group compared
at the previous checkpoint and at its own.

This is what tells a checkpoint that changed nothing (an mtime freshened by `touch`,
a temp file made and removed, a file rewritten with the same bytes) and counts the
lines a row added and removed. Its cost is bounded per row, whatever the session:
the group's paths (its groupfiles rows, at most ROW_PATHS of them looked at), each
resolved in the two states and read up to FILE_BYTES; never the journal, never the
keys changed since (the diff of two checkpoints, Timeline.changes, reads those).
Read-only: any thread, any snapshot.
"""
from __future__ import annotations

from dataclasses import dataclass

from overlayckpt.core import groupfiles
from overlayckpt.core.history import AtCheckpoint
from overlayckpt.core.patch import stat_lines
from overlayckpt.core.timeline import FileChange
from overlayckpt.core.tree import Tree
from overlayckpt.errors import FsError
from overlayckpt.messages import Change
from overlayckpt.records import Checkpoint, u64
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import CKPTS

# A group of more paths than this is taken to have changed something (a build, an
# install) without looking: one that changed many files back to what they were is rare,
# and looking would cost a read of each.
ROW_PATHS = 64
# Content compared and lines counted up to this many bytes of a file; a bigger file of
# the same size is taken as changed and its lines are not counted (as a binary's).
FILE_BYTES = 256 * 1024
# Lines are counted in at most this many files of a row (its first, by path).
LINE_FILES = 50

Seen = tuple[int, int, bytes | None] | None  # (kind and mode, size, content) or absent


@dataclass(frozen=True, slots=True)
class RowDiff:
    empty: bool  # every path of the group the same in both states (False: not looked)
    added: int
    removed: int
    changes: dict[str, str]  # counted path -> its change between the states (A M D)


def _seen(tree: Tree, state: AtCheckpoint, path: str) -> Seen:
    try:
        ino = tree.resolve(state, path)
        node = tree.node(state, ino)
        if node.is_link:
            return node.mode, node.size, tree.readlink(state, ino, node)
        if node.is_reg:
            data = tree.read(state, ino, node, 0, FILE_BYTES) if node.size <= FILE_BYTES else None
            return node.mode, node.size, data
        return node.mode, 0, b""  # a directory, a device: what it is, not what it holds
    except FsError:
        return None


def _same(a: Seen, b: Seen) -> bool:
    # (a file too big to read is never the same: that is what bounds the work)
    return a == b and (a is None or a[2] is not None)


def row_diff(tree: Tree, r: ReadTxn, before: Checkpoint, ck: Checkpoint,
             shown: list[str]) -> RowDiff:
    """ck's group's paths at before and at ck: whether all are the same, and the lines
    added and removed in the first LINE_FILES of the shown ones."""
    sa, sb = AtCheckpoint(r, before.seq), AtCheckpoint(r, ck.seq)
    counted = set(shown[:LINE_FILES])
    total = sum(n[0] + n[1] for n in groupfiles.counts(r, ck).values())
    empty = total <= ROW_PATHS
    changed: list[tuple[FileChange, bool]] = []
    looked: set[str] = set()
    if empty:
        for path, _ in groupfiles.rows(r, ck):
            looked.add(path)
            a, b = _seen(tree, sa, path), _seen(tree, sb, path)
            if _same(a, b):
                continue
            empty = False
            if path in counted:
                changed.append(_change(path, a, b))
    for path in sorted(counted - looked):
        a, b = _seen(tree, sa, path), _seen(tree, sb, path)
        if not _same(a, b):
            changed.append(_change(path, a, b))
    added = removed = 0
    whole = [c for c, read in changed if read]
    for _, _, plus, minus in stat_lines(whole):
        added += plus or 0
        removed += minus or 0
    return RowDiff(empty, added, removed, {c.path: c.change for c, _ in changed})


def base_of(r: ReadTxn, ck: Checkpoint, before: Checkpoint) -> Checkpoint:
    """The checkpoint ck's changes are compared with: the newest one at or before its
    group began. That is the one before it, unless commands wrote at once: then groups
    that closed while ck's was open are passed over (their state already holds some of
    ck's changes). Steps back once per such group."""
    while before.seq > ck.start_seq and before.id > 0:
        raw = r.get(CKPTS, u64(before.id - 1))
        if raw is None:
            break
        before = Checkpoint.unpack(before.id - 1, raw)
    return before


def _change(path: str, a: Seen, b: Seen) -> tuple[FileChange, bool]:
    """The change, and whether both sides were read whole (else no lines are counted)."""
    code = Change.ADDED if a is None else Change.DELETED if b is None else Change.MODIFIED
    read = all(side is None or side[2] is not None for side in (a, b))
    return FileChange(path, code, None if a is None else (a[0], a[2] or b""),
                      None if b is None else (b[0], b[2] or b"")), read
