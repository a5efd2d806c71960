"""Forks: a new session that starts from a checkpoint of another, sharing its blocks.

A fork's store holds a copy of the parent's live tables as they were at the
checkpoint (nodes, dirents, bmap, xattrs: only what the session changed over
the repo, so the copy costs the changed entries, never the repo nor the
history), its pins and apply fingerprints, and the conversation up to there;
its journal starts empty, so its checkpoint 0 is the fork point. No block is
copied: the fork's store names its parent (META PARENT_KEY) and reads a block
it does not hold from the parent's store (lmdbstore.parent_block), a chain,
since a fork can be forked. The parent lists its forks (META FORK_KEY + path),
so that its gc keeps the blocks they refer to (maintenance.referenced_blocks)
and its thinning keeps the checkpoints they forked from.

Two states of two sessions of one repo compare exactly (changes_between): the
keys of their live tables are compared one by one, and the files whose keys
differ are read, each from its own session's store chain.
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

from overlayckpt.core.conversation import chain
from overlayckpt.core.delta import differing
from overlayckpt.core.history import AtCheckpoint
from overlayckpt.core.statediff import FileChange, StateDiff
from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import UserError
from overlayckpt.messages import ForkMade, ForksReply
from overlayckpt.records import FIRST_UPPER_INO, Checkpoint, pack_obj, u64
from overlayckpt.store.lmdbstore import Store, forks_of, parent_of
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import (
    CKPTS,
    CONV,
    CONV_HEAD_KEY,
    CONV_NEXT_KEY,
    FORK_KEY,
    LIVE_TABLES,
    META,
    NEXT_INO_KEY,
    PARENT_KEY,
    PINNED,
    REPO_KEY,
    SEEN,
)

COPIED = (PINNED, SEEN)  # as they are now: pins only grow, and apply checks only what it writes
BATCH = 50_000  # entries per write transaction of the copy


def entries_at(r: ReadTxn, seq: int | None, table: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Every entry of a live table at journal position seq (None: live), in key order."""
    if seq is None:
        return r.range_from(table)
    return AtCheckpoint(r, seq).prefix(table, b"")


def record_fork(w: WriteTxn, path: str, cid: int) -> None:
    """In the parent, before the copy: its gc and thinning keep what the fork needs."""
    w.set_meta_int(FORK_KEY + os.fsencode(path), cid)


def forget_fork(w: WriteTxn, path: str) -> bool:
    key = FORK_KEY + os.fsencode(path)
    if w.get(META, key) is None:
        return False
    w.delete(META, key)
    return True


def make_fork(r: ReadTxn, ck: Checkpoint, path: str) -> ForkMade:
    """Create the fork's store at path from checkpoint ck of r's store (a read view of
    the parent, recorded as forked already: record_fork). No block is copied."""
    parent = r.store
    if os.path.exists(os.path.join(path, "data.mdb")):
        raise UserError(f"{path} holds a session already: pick another store for the fork")
    dst = Store.open(path, create=True, block_size=parent.block_size)
    copied = 0
    try:
        for table in LIVE_TABLES + COPIED:
            rows = entries_at(r, ck.seq, table) if table in LIVE_TABLES else r.range_from(table)
            batch: list[tuple[bytes, bytes]] = []
            for row in rows:
                batch.append(row)
                if len(batch) >= BATCH:
                    copied += _put(dst, table, batch)
            copied += _put(dst, table, batch)
        lines = _conversation(r, ck.conv_head)
        repo, next_ino = r.get(META, REPO_KEY), r.get(META, NEXT_INO_KEY)

        def finish(w: WriteTxn) -> None:
            w.put_many(CONV, lines)
            w.set_meta_int(CONV_HEAD_KEY, ck.conv_head)
            w.set_meta_int(CONV_NEXT_KEY, r.meta_int(CONV_NEXT_KEY, 1))
            for key, value in ((REPO_KEY, repo), (NEXT_INO_KEY, next_ino)):
                if value is not None:  # (the parent's next inodes: apart from the parent's)
                    w.put(META, key, value)
            w.put(META, PARENT_KEY, pack_obj([os.path.realpath(parent.path), ck.id]))
            # the counter the fork numbers from: no inode of its tree then is numbered so far
            origin = Checkpoint(0, 1, 1, time.time_ns(), "auto", None,
                                f"fork of checkpoint {ck.id}", 0, "", None, ck.conv_head,
                                w.meta_int(NEXT_INO_KEY, FIRST_UPPER_INO))
            w.put(CKPTS, u64(0), origin.pack())
        dst.write(finish)
    except BaseException:
        dst.close()
        shutil.rmtree(path, ignore_errors=True)
        raise
    dst.close()
    return {"store": path, "checkpoint": ck.id, "entries": copied}


def _put(dst: Store, table: bytes, batch: list[tuple[bytes, bytes]]) -> int:
    n = len(batch)
    if batch:
        dst.write(lambda w: w.put_many(table, batch))
        batch.clear()
    return n


def _conversation(r: ReadTxn, head: int) -> list[tuple[bytes, bytes]]:
    """The live branch up to head, each line before the fork's journal (its _seq 0: the
    fork's own lines come after it, whatever the parent's journal position was)."""
    return sorted((u64(key), pack_obj({**entry, "_seq": 0})) for key, entry in chain(r, head))


def fork_info(r: ReadTxn) -> ForksReply:
    """Where a session forked from (None) and its forks (store -> checkpoint)."""
    parent = parent_of(r)
    return {"parent": None if parent is None else {"store": parent[0], "checkpoint": parent[1]},
            "forks": forks_of(r)}


# -- two states of two sessions ----------------------------------------------------

def changes_between(tl: Timeline, ra: ReadTxn, a: Checkpoint | None, rb: ReadTxn,
                    b: Checkpoint | None, only: list[str] | None = None) -> list[FileChange]:
    """What differs between the tree at a of ra's session and at b of rb's (None: live),
    file by file. Both are sessions of one repo: what neither changed is the repo's."""
    sa, sb = tl.state(ra, a), tl.state(rb, b)
    keys = set()
    for table in LIVE_TABLES:
        for state, ck in ((ra, a), (rb, b)):
            for k, _ in entries_at(state, ck.seq if ck else None, table):
                keys.add((table, k))
    differ, one_sided = differing(sa.get, sb.get, keys)
    out = StateDiff(tl.ov).file_changes(sa, sb, set(differ), one_sided, content=True)
    if only:
        wanted = [p.strip("/") for p in only]
        out = [c for c in out if any(c.path == w or c.path.startswith(w + "/") for w in wanted)]
    return out
