"""fsck and gc: verify every block and reference; reclaim unreferenced blocks.

Blocks are referenced from three places: the live block map, the undo entries
of the journal (previous content that history needs), and pinned lower
entries. gc deletes only blocks that none of them names, in one write
transaction, so a crash leaves either the old or the new set, never a
dangling reference. Its scan (gc_plan) and thinning's merges (thin_plan,
merge_slice) read a snapshot in any thread; what they write (gc_apply,
apply_merge) is short and runs on the writer's thread (thin).
"""
from __future__ import annotations

import bisect
import dataclasses
import os

import blake3
import trio

from overlayckpt.core import groupfiles, history
from overlayckpt.core.journal import records
from overlayckpt.core.sweep import children_of, in_tree, named_of, sweep
from overlayckpt.core.validate import VALIDATED_TABLES, record_problem
from overlayckpt.core.workers import read_off_loop
from overlayckpt.messages import FsckReport, GcReply, GcReport
from overlayckpt.records import (
    T_BMAP,
    WHITEOUT,
    ZERO_BLOCK,
    Checkpoint,
    JournalRecord,
    block_size_problem,
    from_u64,
    u64,
    unpack_obj,
)
from overlayckpt.store.lmdbstore import MAX_FORK_DEPTH, Store, forks_of, parent_block, parent_of, store_at
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import (
    BLOCK_BYTES_KEY,
    BLOCKS,
    BMAP,
    CKPTS,
    DERIVED_KEYS,
    DIRENTS,
    GROUPFILES,
    JOURNAL,
    META,
    NAMES,
    NODES,
    PINNED,
    SEQ_KEY,
)


def referenced_blocks(r: ReadTxn, forks: bool = True) -> set[bytes]:
    """Every block the session refers to (forks: and each of its forks, theirs: what its
    gc keeps; a fork's own blocks are in its own store)."""
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
    for path in forks_of(r) if forks else ():  # (a fork dropped by hand: refers to nothing)
        if os.path.exists(os.path.join(path, "data.mdb")):
            refs |= store_at(path).read(referenced_blocks)
    refs.discard(ZERO_BLOCK)
    return refs


def fsck(store: Store) -> FsckReport:
    problems: list[str] = []

    def fn(r: ReadTxn) -> tuple[int, int, int, int]:
        """blocks, referenced, checkpoints, journal records; problems into problems"""
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
        problems.extend(record_problems(r, store.block_size))
        if problems:  # a malformed record may not decode where the checks below read it
            return nblocks, 0, r.count(CKPTS), r.count(JOURNAL)
        refs = referenced_blocks(r, forks=False)  # (each fork's fsck checks its own)
        for digest in sorted(refs):
            if r.get(BLOCKS, digest) is None and parent_block(r, digest) is None:
                problems.append(f"block {digest.hex()} is referenced but missing")
        named = named_of(children_of(r))  # (an unnamed directory's entries are gc's)
        for k, v in r.range_from(DIRENTS):
            if v != WHITEOUT and in_tree(k[:8], named) and r.get(NODES, v) is None:
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
        problems.extend(_history_problems(r))
        return nblocks, len(refs), len(ids), r.count(JOURNAL)
    blocks, referenced, checkpoints, journal = store.read(fn)
    return {"clean": not problems, "problems": problems, "blocks": blocks,
            "referenced": referenced, "checkpoints": checkpoints, "journal": journal}


_MAX_PROBLEMS = 100  # of malformed records: enough to say what is wrong, not a flood


def record_problems(r: ReadTxn, block_size: int) -> list[str]:
    """Every entry that does not fit its table's schema (what import refuses in a bundle,
    core/validate.py), and a fork chain that loops: a malformed node passes no check
    below and then fails apply or a view."""
    out: list[str] = []
    if (why := block_size_problem(block_size)) is not None:
        out.append(f"the store's {why}")
        return out
    for table in VALIDATED_TABLES:
        if table == BLOCKS:
            for key, _ in r.range_from(BLOCKS):  # (their content: decoded above)
                if len(key) != 32:
                    out.append(f"blocks entry {key[:40].hex()} has a digest that is not 32 bytes")
            continue
        for key, value in r.range_from(table):
            why = record_problem(table, key, value, block_size)
            if why is not None:
                out.append(why)
                if len(out) >= _MAX_PROBLEMS:
                    return out + ["(further malformed entries are not listed)"]
    if not out:
        out += _fork_loop(r)
    return out


def _fork_loop(r: ReadTxn) -> list[str]:
    """A parent chain that comes back to a store (a store its own parent, say)."""
    seen = {os.path.realpath(r.store.path)}
    parent = parent_of(r)
    while parent is not None:
        path = os.path.realpath(parent[0])
        if path in seen:
            return [f"the fork chain loops: {path} is its own ancestor"]
        seen.add(path)
        if len(seen) > MAX_FORK_DEPTH or not os.path.exists(os.path.join(path, "data.mdb")):
            return []
        try:
            parent = store_at(path).read(parent_of)
        except Exception:  # (a parent that cannot be read: the missing blocks say so)
            return []
    return []


def _history_problems(r: ReadTxn) -> list[str]:
    """Where the history index or the file rows disagree with the journal (missing ones
    are rebuilt at open)."""
    index, rows, starts = history.Expected(), groupfiles.Expected(), groupfiles.Starts(r)
    for start, rec in history.grouped_records(r, JournalRecord.unpack):  # (one pass for both)
        index.add(start, rec)
        rows.add(starts.of(rec, start), rec)
    expected = index.tables if history.is_built(r) else {}
    if groupfiles.is_built(r):
        expected[GROUPFILES] = rows.rows()
    out = []
    for table, want in expected.items():
        have = dict(r.range_from(table))
        if have != want:
            missing, extra = len(want.keys() - have.keys()), len(have.keys() - want.keys())
            wrong = sum(1 for k in want.keys() & have.keys() if want[k] != have[k])
            out.append(f"history index {table.decode()}: {missing} missing, {extra} extra and "
                       f"{wrong} wrong entries (fsck --repair rebuilds it)")
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class GcPlan:
    seq: int  # the journal position of the snapshot the plan was made in
    doomed: list[bytes]  # the blocks nothing referred to there


def gc_plan(r: ReadTxn) -> GcPlan:
    """The blocks nothing refers to, in a read view (the long part of gc: any thread)."""
    refs = referenced_blocks(r)
    return GcPlan(r.meta_int(SEQ_KEY, 1), [d for d, _ in r.range_from(BLOCKS) if d not in refs])


def gc_apply(w: WriteTxn, plan: GcPlan) -> GcReport:
    """Delete the plan's blocks that nothing has referred to since (a short write: the
    records since the plan's snapshot name every block written or replaced meanwhile)."""
    since: set[bytes] = set()
    for rec in records(w, plan.seq, w.meta_int(SEQ_KEY, 1)):
        for table, key, old in rec.undo:
            if table == T_BMAP:
                since.update(v for v in (old, w.get(BMAP, key)) if v)
    for _, v in w.range_from(PINNED):
        since.update(unpack_obj(v).get("blocks") or ())
    freed = removed = 0
    for digest in plan.doomed:
        raw = w.get(BLOCKS, digest)
        if raw is None or digest in since:
            continue
        freed += len(raw)
        removed += 1
        w.delete(BLOCKS, digest)
    w.set_meta_int(BLOCK_BYTES_KEY, max(0, w.meta_int(BLOCK_BYTES_KEY) - freed))
    return {"removed_blocks": removed, "freed_bytes": freed,
            "kept_blocks": w.count(BLOCKS)}


def gc(store: Store) -> GcReport:
    return store.write(lambda w: gc_apply(w, gc_plan(w)))


DEFAULT_BUDGET = 5 << 30  # bytes of stored blocks before the oldest automatic checkpoints thin
THIN_SLICE = 2000  # journal records merged in one write transaction, at most (about)


@dataclasses.dataclass(frozen=True, slots=True)
class Merge:
    """One slice of thinning: records lo <= seq < hi become one record at their first seq;
    the checkpoints strictly inside the range go, and those whose group began inside it
    (and ends at or after hi) begin at that record."""
    lo: int
    hi: int
    dropped: list[int]  # checkpoint ids
    moved: list[int]  # checkpoint ids


def thin_plan(r: ReadTxn, budget: int) -> list[Merge]:
    """Over budget: drop the older half of the automatic checkpoints, as slices that each
    merge the records between two checkpoints that stay (or the first part of them, up to
    a checkpoint that goes: its state stays exact until its own slice), so that the block
    versions only they needed become garbage for gc.

    Named and restore checkpoints, checkpoint 0, those a fork started from and the newest
    checkpoint stay. Merging
    keeps, per key, the oldest previous value, so every kept checkpoint restores exactly.
    """
    if r.meta_int(BLOCK_BYTES_KEY) <= budget:
        return []
    cks = [Checkpoint.unpack(from_u64(k), v) for k, v in r.range_from(CKPTS)]
    forked = set(forks_of(r).values())
    candidates = [c for c in cks[:-1] if c.kind == "auto" and c.id != 0 and c.id not in forked]
    dropped = {c.id for c in candidates[:max(1, len(candidates) // 2)]} if candidates else set()
    kept_seqs = sorted({c.seq for c in cks if c.id not in dropped})
    inside: dict[int, list[Checkpoint]] = {}  # a kept seq -> the dropped checkpoints after it
    for c in cks:
        if c.id in dropped and c.seq not in kept_seqs:
            lo = kept_seqs[bisect.bisect_right(kept_seqs, c.seq) - 1]
            inside.setdefault(lo, []).append(c)
    by_start = sorted((c.start_seq, c.seq, c.id) for c in cks if c.start_seq < c.seq)

    def moved(lo: int, hi: int) -> list[int]:
        out = []
        for start, seq, cid in by_start[bisect.bisect_left(by_start, (lo,)):]:
            if start >= hi:
                break
            if seq >= hi:
                out.append(cid)
        return out

    slices: list[Merge] = []
    for lo, drops in sorted(inside.items()):
        i = bisect.bisect_right(kept_seqs, lo)
        hi = kept_seqs[i] if i < len(kept_seqs) else 1 << 62
        start, ids = lo, list[int]()
        for c in sorted(drops, key=lambda c: c.seq):
            if c.seq - start >= THIN_SLICE:
                slices.append(Merge(lo, c.seq, ids, moved(lo, c.seq)))
                start, ids = c.seq, []
            ids.append(c.id)
        slices.append(Merge(lo, hi, ids, moved(lo, hi)))
    return slices


@dataclasses.dataclass(frozen=True, slots=True)
class Merged:
    """What a slice writes: its one record (None: it holds fewer than 2) and the file
    rows of the one group its groups become (groupfiles.py)."""
    record: JournalRecord | None
    rows: dict[str, str]


def merge_slice(r: ReadTxn, m: Merge) -> Merged:
    """What a slice becomes (read-only: any thread)."""
    return Merged(merge_records(r, m), groupfiles.rows_of(r, m.lo, m.hi))


def merge_records(r: ReadTxn, m: Merge) -> JournalRecord | None:
    """The one record a slice becomes, or None if it holds < 2."""
    recs = records(r, m.lo, m.hi)
    if len(recs) < 2:
        return None
    first: dict[tuple[int, bytes], bytes | None] = {}
    paths: list[str] = []
    changes: list[str] = []
    for rec in recs:
        for table, key, old in rec.undo:
            first.setdefault((table, key), old)
        paths += rec.paths
        changes += rec.changes
    head = recs[0]
    return JournalRecord(head.seq, recs[-1].time_ns, head.pid, head.comm, "merged",
                         tuple(paths), tuple(changes), tuple((t, k, v) for (t, k), v in first.items()))


def apply_merge(w: WriteTxn, m: Merge, done: Merged) -> int:
    """Write one slice: the merged record, the indexes, the checkpoints. Returns how many went."""
    merged = done.record
    groupfiles.replace(w, m.lo, m.hi, m.lo, done.rows)
    if merged is not None:
        for k, _ in list(w.range_from(JOURNAL, u64(m.lo))):
            if from_u64(k) >= m.hi:
                break
            w.delete(JOURNAL, k)
        w.put(JOURNAL, u64(merged.seq), merged.pack())
        history.merge(w, m.lo, m.hi, merged.seq, {(t, k): v for t, k, v in merged.undo})
    gone = 0
    for cid in m.dropped:
        if w.get(CKPTS, u64(cid)) is not None:
            w.delete(CKPTS, u64(cid))
            gone += 1
    for cid in m.moved if merged is not None else ():
        raw = w.get(CKPTS, u64(cid))
        if raw is not None:
            c = Checkpoint.unpack(cid, raw)
            w.put(CKPTS, u64(cid), dataclasses.replace(c, start_seq=merged.seq).pack())  # type: ignore[union-attr]  # m.moved is () when merged is None
    return gone


async def thin(store: Store, budget: int, then_gc: bool = False) -> GcReply:
    """thin (and gc) with every scan in a worker thread and each write a short slice on
    the calling (writer's) thread, so the requests of a mount are served in between."""
    thinned = 0
    for m in await read_off_loop(store, lambda r: thin_plan(r, budget)):
        done = await read_off_loop(store, lambda r: merge_slice(r, m))  # noqa: B023  (awaited here)
        thinned += store.write(lambda w: apply_merge(w, m, done))  # noqa: B023  (called at once)
        await trio.sleep(0)
    result: GcReply = {"thinned": thinned}
    if thinned or then_gc:
        result.update(await sweep(store))  # (what it deletes stays referenced by its record)
        plan = await read_off_loop(store, gc_plan)
        result.update(store.write(lambda w: gc_apply(w, plan)))
    return result


def repair(store: Store) -> list[str]:
    """Drop what cannot be trusted: corrupt blocks and names of missing checkpoints.

    A reference to a lost block stays (its file then reads as an I/O error at
    that block), so nothing that is still intact is thrown away.
    """
    def fn(w: WriteTxn) -> list[str]:
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
        if _history_problems(w):
            for key in DERIVED_KEYS:
                w.delete(META, key)
            history.ensure(w)
            groupfiles.ensure(w)
            dropped.append("the history index (rebuilt from the journal)")
        return dropped
    return store.write(fn)
