"""fsck and gc: verify every block and reference; reclaim unreferenced blocks.

Blocks are referenced from three places: the live block map, the undo entries
of the journal (previous content that history needs), and pinned lower
entries. gc deletes only blocks that none of them names, in one write
transaction, so a crash leaves either the old or the new set, never a
dangling reference.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import blake3

from overlayckpt.core.journal import records
from overlayckpt.records import (
    T_BMAP, WHITEOUT, ZERO_BLOCK, Checkpoint, JournalRecord, from_u64, u64, unpack_obj,
)
from overlayckpt.store.lmdbstore import ReadTxn, Store, WriteTxn
from overlayckpt.tables import (
    BLOCKS, BLOCK_BYTES_KEY, BMAP, CKPTS, DIRENTS, JOURNAL, NAMES, NODES, PINNED, SEQ_KEY,
)


def referenced_blocks(r: ReadTxn) -> set[bytes]:
    refs: set[bytes] = set()
    for _, digest in r.range_from(BMAP):
        refs.add(digest)
    for k, v in r.range_from(JOURNAL):
        rec = JournalRecord.unpack(from_u64(k), v)
        for table, _, old in rec.undo:
            if table == T_BMAP and old:
                refs.add(old)
    for _, v in r.range_from(PINNED):
        refs.update(unpack_obj(v).get("blocks") or ())
    refs.discard(ZERO_BLOCK)
    return refs


def fsck(store: Store) -> dict[str, Any]:
    problems: list[str] = []

    def fn(r: ReadTxn) -> dict[str, Any]:
        nblocks = 0
        for digest, raw in r.range_from(BLOCKS):
            nblocks += 1
            try:
                data = store.decode_block(raw)
            except Exception as e:  # a corrupt frame is damage, whatever the codec says
                problems.append(f"block {digest.hex()} cannot be decoded: {e}")
                continue
            if blake3.blake3(data).digest() != digest:
                problems.append(f"block {digest.hex()} does not match its digest")
        refs = referenced_blocks(r)
        for digest in sorted(refs):
            if r.get(BLOCKS, digest) is None:
                problems.append(f"block {digest.hex()} is referenced but missing")
        for k, v in r.range_from(DIRENTS):
            if v != WHITEOUT and r.get(NODES, v) is None:
                problems.append(f"directory entry {k[8:]!r} in {from_u64(k[:8])} names "
                                f"inode {from_u64(v)} without a record")
        seq = r.meta_int(SEQ_KEY, 1)
        last = 0
        for k, _ in r.range_from(JOURNAL):
            last = from_u64(k)
        if last >= seq:
            problems.append(f"journal record {last} is beyond the journal position {seq}")
        ids = set()
        for k, v in r.range_from(CKPTS):
            ck = Checkpoint.unpack(from_u64(k), v)
            ids.add(ck.id)
            if ck.seq > seq:
                problems.append(f"checkpoint {ck.id} points beyond the journal ({ck.seq} > {seq})")
        for name, v in r.range_from(NAMES):
            if from_u64(v) not in ids:
                problems.append(f"name {name.decode(errors='replace')} points to missing checkpoint")
        return {"blocks": nblocks, "referenced": len(refs), "checkpoints": len(ids),
                "journal": r.count(JOURNAL)}
    result = store.read(fn)
    return {"clean": not problems, "problems": problems, **result}


def gc(store: Store) -> dict[str, Any]:
    def fn(w: WriteTxn) -> dict[str, Any]:
        refs = referenced_blocks(w)
        doomed = [d for d, _ in w.range_from(BLOCKS) if d not in refs]
        freed = 0
        for digest in doomed:
            raw = w.get(BLOCKS, digest)
            freed += len(raw or b"")
            w.delete(BLOCKS, digest)
        w.set_meta_int(BLOCK_BYTES_KEY, max(0, w.meta_int(BLOCK_BYTES_KEY) - freed))
        return {"removed_blocks": len(doomed), "freed_bytes": freed, "kept_blocks": len(refs)}
    return store.write(fn)


DEFAULT_BUDGET = 5 << 30  # bytes of stored blocks before the oldest automatic checkpoints thin


def thin(store: Store, budget: int) -> dict[str, Any]:
    """Over budget: drop the older half of the automatic checkpoints and merge their journal
    records, so the block versions only they needed become garbage for gc.

    Named and restore checkpoints, checkpoint 0 and the newest checkpoint stay. Merging
    keeps, per key, the oldest previous value, so every kept checkpoint restores exactly.
    """
    def fn(w: WriteTxn) -> dict[str, Any]:
        if w.meta_int(BLOCK_BYTES_KEY) <= budget:
            return {"thinned": 0}
        cks = [Checkpoint.unpack(from_u64(k), v) for k, v in w.range_from(CKPTS)]
        candidates = [c for c in cks[:-1] if c.kind == "auto" and c.id != 0]
        dropped = {c.id for c in candidates[:max(1, len(candidates) // 2)]} if candidates else set()
        if not dropped:
            return {"thinned": 0}
        kept = [c for c in cks if c.id not in dropped]
        bounds = sorted({c.seq for c in kept})
        dropped_seqs = sorted(c.seq for c in cks if c.id in dropped)
        merged_into: dict[int, int] = {}  # first seq of a merged segment -> its key
        for lo, hi in zip(bounds, bounds[1:] + [1 << 62]):
            if not any(lo < d < hi for d in dropped_seqs):
                continue
            recs = records(w, lo, hi)
            if len(recs) < 2:
                continue
            first: dict[tuple[int, bytes], bytes | None] = {}
            paths: list[str] = []
            changes: list[str] = []
            for rec in recs:
                for table, key, old in rec.undo:
                    first.setdefault((table, key), old)
                paths += rec.paths
                changes += rec.changes
                w.delete(JOURNAL, u64(rec.seq))
            head = recs[0]
            merged = JournalRecord(head.seq, recs[-1].time_ns, head.pid, head.comm, "merged",
                                   tuple(paths), tuple(changes),
                                   tuple((t, k, v) for (t, k), v in first.items()))
            w.put(JOURNAL, u64(head.seq), merged.pack())
            merged_into[lo] = head.seq
        for c in cks:
            if c.id in dropped:
                w.delete(CKPTS, u64(c.id))
            else:
                # a kept checkpoint's changes now start where its merged segment starts
                seg = max((lo for lo in merged_into if lo <= c.start_seq < c.seq), default=None)
                if seg is not None and c.start_seq != merged_into[seg]:
                    fixed = dataclasses.replace(c, start_seq=merged_into[seg])
                    w.put(CKPTS, u64(c.id), fixed.pack())
        return {"thinned": len(dropped)}
    result = store.write(fn)
    if result["thinned"]:
        result.update(gc(store))
    return result


def repair(store: Store) -> dict[str, Any]:
    """Drop what cannot be trusted: corrupt blocks and names of missing checkpoints.

    A reference to a lost block stays (its file then reads as an I/O error at
    that block), so nothing that is still intact is thrown away.
    """
    def fn(w: WriteTxn) -> dict[str, Any]:
        dropped = []
        for digest, raw in list(w.range_from(BLOCKS)):
            try:
                ok = blake3.blake3(store.decode_block(raw)).digest() == digest
            except Exception:
                ok = False
            if not ok:
                w.delete(BLOCKS, digest)
                dropped.append(f"block {digest.hex()}")
        for name, v in list(w.range_from(NAMES)):
            if w.get(CKPTS, v) is None:
                w.delete(NAMES, name)
                dropped.append(f"name {name.decode(errors='replace')}")
        return {"dropped": dropped}
    return store.write(fn)
