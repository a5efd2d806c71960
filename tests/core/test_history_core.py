"""The history index against what it replaces: every checkpoint's tree, recorded when it was
made, must be what the index shows later, after more groups, restores and thinning; the diff
between any two checkpoints must be what their recorded trees say; a store of an older
format (no index, no file rows, no inode counters) is upgraded at open to the same
answers; and fsck (run at every teardown) finds the stored index equal to the one the
journal implies."""
from __future__ import annotations

import random
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import blake3
import lmdb
import pytest

from overlayckpt.core import groupfiles, history
from overlayckpt.core.journal import Caller
from overlayckpt.core.maintenance import fsck, thin
from overlayckpt.core.timeline import Timeline
from overlayckpt.records import ROOT_INO, from_u64, pack_obj, u64, unpack_obj
from overlayckpt.service.session import Session
from overlayckpt.store.format import FORMAT_VERSION
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import (
    CHANGED,
    CKPTS,
    FORMAT_KEY,
    GROUPFILES,
    GROUPFILES_KEY,
    HISTORY_KEY,
    HISTORY_TABLES,
    META,
    NEXT_INO_KEY,
    SEQ_KEY,
)

from .helpers_core import ME, OTHER, ino, tree_of

REG = stat.S_IFREG | 0o644
NAMES = [b"a", b"b", b"c", b"d"]
CALLERS = [ME, OTHER, Caller(4444, "third")]


DIRS = [b"n1", b"n2"]  # made and removed at the top: subtrees that come and go


def _dirs(ov) -> list[int]:
    out = [ROOT_INO, ino(ov, "docs")]
    for name in DIRS:
        try:
            child = ov.live(lambda r: ov.lookup(r, ROOT_INO, name))
        except Exception:
            continue
        if ov.live(lambda r: ov.node(r, child)).is_dir:
            out.append(child)
    return out


def _step(rng: random.Random, s: Session) -> None:
    """One operation on the files at the top, in docs/ and in the directories made at the
    top, by one of three callers (groups)."""
    ov = s.overlay
    who = rng.choice(CALLERS)
    dirs = _dirs(ov)
    parent = rng.choice(dirs)
    name = rng.choice(NAMES + [b"README.md", b"guide.txt"])
    try:
        child = ov.live(lambda r: ov.lookup(r, parent, name))
    except Exception:
        child = None
    kind = rng.choice(["create", "write", "write", "truncate", "unlink", "rename", "mkdir", "rmdir"])
    try:
        if kind == "mkdir":
            ov.create(who, ROOT_INO, rng.choice(DIRS), stat.S_IFDIR | 0o755, 0, 0)
        elif kind == "rmdir":
            ov.remove(who, ROOT_INO, rng.choice(DIRS), True)
        elif child is None or kind == "create":
            ov.create(who, parent, name, REG, 0, 0)
        elif kind == "write":
            ov.write(who, child, rng.choice([0, 100, 4096, 9000]), rng.randbytes(rng.choice([5, 5000])))
        elif kind == "truncate":
            ov.setattr(who, child, size=rng.choice([0, 10, 6000]))
        elif kind == "unlink":
            ov.remove(who, parent, name, False)
        else:
            ov.rename(who, parent, name, rng.choice(dirs), rng.choice(NAMES), 0)
    except Exception as e:  # EEXIST, EISDIR, ENOTEMPTY...: the native semantics are test_differential's job
        assert getattr(e, "errno", None), e


def _trees(s: Session) -> dict[int, dict[str, tuple]]:
    tl = Timeline(s.ctx)
    cks = s.store.read(tl.all)
    return {ck.id: tree_of(s.overlay, lambda r: tl.state(r, ck)) for ck in cks}


async def _random_history(s: Session, seed: int, steps: int = 300) -> dict[int, dict[str, tuple]]:
    """Random groups, restores and thinning; returns every checkpoint's tree as it was made."""
    rng = random.Random(seed)
    tl = Timeline(s.ctx)
    recorded: dict[int, dict[str, tuple]] = {0: tree_of(s.overlay)}

    def record(before: dict[str, tuple]) -> None:
        # a checkpoint at the journal's end is the tree now; one an operation closed (its
        # group ended as the operation began) is the tree before it
        end = s.store.read(lambda r: r.meta_int(SEQ_KEY))
        now = tree_of(s.overlay)
        for ck in s.store.read(tl.all):
            if ck.id not in recorded:
                recorded[ck.id] = now if ck.seq == end else before
    for i in range(steps):
        before = tree_of(s.overlay)
        _step(rng, s)
        record(before)
        if rng.random() < 0.04:
            before = tree_of(s.overlay)
            cks = s.store.read(tl.all)
            await tl.restore(rng.choice(cks).id, ME)
            record(before)
        if i == steps // 2:
            await thin(s.store, 0)
    tl.seal()
    for ck in s.store.read(tl.all):
        recorded.setdefault(ck.id, tree_of(s.overlay))
    return recorded


async def test_every_checkpoint_shows_its_tree_after_groups_restores_and_thinning(
        open_session: Callable[..., Session], repo: Path) -> None:
    for seed in range(4):
        s = open_session(repo, store=repo.parent / f"store-{seed}")
        recorded = await _random_history(s, seed)
        shown = _trees(s)
        assert len(shown) > 20
        for cid, tree in shown.items():
            assert tree == recorded[cid], f"seed {seed}: checkpoint {cid}"
        assert fsck(s.store)["clean"], fsck(s.store)["problems"]


async def test_diff_between_any_two_checkpoints_matches_their_trees(
        open_session: Callable[..., Session], repo: Path) -> None:
    s = open_session(repo)
    recorded = await _random_history(s, 7, steps=200)
    tl = Timeline(s.ctx)
    cks = s.store.read(tl.all)
    rng = random.Random(1)
    for _ in range(40):
        a, b = rng.choice(cks), rng.choice(cks)
        got = s.store.read(lambda r: {c.path: c.change for c in tl.changes(r, a, b)})
        ta, tb = recorded[a.id], recorded[b.id]
        want = {p: "A" if p not in ta else "D" if p not in tb else "M"
                for p in set(ta) | set(tb) if ta.get(p) != tb.get(p) and
                (ta.get(p, ("f",))[0] != "d" and tb.get(p, ("f",))[0] != "d")}
        assert got == want, (a.id, b.id)


async def test_a_restore_lists_what_it_adds_modifies_and_deletes(session: Session) -> None:
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("start", None, ME)
    ov.create(ME, ROOT_INO, b"added", REG, 0, 0)
    ov.write(ME, ino(ov, "README.md"), 0, b"changed")
    ov.remove(ME, ino(ov, "docs"), b"guide.txt", False)
    result = await tl.restore("start", ME)
    assert restore_files(session, result["id"]) == {}  # listed after the answer:
    assert await tl.complete_restores() == 1
    assert restore_files(session, result["id"]) == {
        "added": "D", "README.md": "M", "hardlink.md": "M", "docs/guide.txt": "A"}  # a link of README
    assert await tl.complete_restores() == 0


def history_records(r, cid, tl):  # the journal records a restore checkpoint stands for
    from overlayckpt.core.journal import records
    ck = tl.get(r, cid)
    yield from records(r, ck.start_seq, ck.seq)


def restore_files(s: Session, cid: int) -> dict[str, str]:
    """What a restore's records list: path -> A, M or D (each path once)."""
    tl = Timeline(s.ctx)
    out: dict[str, str] = {}
    for rec in s.store.read(lambda r: list(history_records(r, cid, tl))):
        for path, change in zip(rec.paths, rec.changes):
            assert path not in out
            out[path] = change
    return out


async def test_a_restore_spans_records_that_stay_small_and_lists_every_file(
        session: Session) -> None:
    """A restore of many files is journaled as several records, each under two LMDB pages
    (one big value costs a search of LMDB's whole free list); they list every file, once."""
    from overlayckpt.core.journal import RECORD_BYTES
    from overlayckpt.tables import JOURNAL
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("start", None, ME)
    start = tree_of(ov)
    for i in range(1000):  # (in a directory of the target: the restore writes each name)
        new, _ = ov.create(ME, ROOT_INO, b"file-%03d" % i, REG, 0, 0)
        ov.write(ME, new, 0, b"%d" % i * 100)
    after = tree_of(ov)
    result = await tl.restore("start", ME)
    assert tree_of(ov) == start
    await tl.complete_restores()
    ck = session.store.read(lambda r: tl.get(r, result["id"]))
    sizes = session.store.read(lambda r: [
        len(v) for k, v in r.range_from(JOURNAL, u64(ck.start_seq)) if from_u64(k) < ck.seq])
    assert len(sizes) > 3 and max(sizes) < RECORD_BYTES + 2000, sizes
    assert restore_files(session, result["id"]) == {f"file-{i:03d}": "D" for i in range(1000)}
    back = await tl.restore("@before-last", ME)
    assert tree_of(ov) == after
    await tl.complete_restores()
    assert restore_files(session, back["id"]) == {f"file-{i:03d}": "A" for i in range(1000)}


async def test_a_restore_left_without_its_file_list_gets_it_after_a_reopen(
        open_session: Callable[..., Session], repo: Path) -> None:
    """The list is written after the restore's answer: a crash in between leaves the mark,
    and the next completion (after the reopen) writes the list."""
    s = open_session(repo)
    tl = Timeline(s.ctx)
    tl.checkpoint("start", None, ME)
    s.overlay.create(ME, ROOT_INO, b"added", REG, 0, 0)
    result = await tl.restore("start", ME)
    s = open_session(repo, store=Path(s.store.path))  # (closed without the list)
    assert restore_files(s, result["id"]) == {}
    assert await Timeline(s.ctx).complete_restores() == 1
    assert restore_files(s, result["id"]) == {"added": "D"}


async def test_a_restore_merged_by_thinning_before_its_list_lists_nothing(
        session: Session) -> None:
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("start", None, ME)
    ov.create(ME, ROOT_INO, b"added", REG, 0, 0)
    await tl.restore("start", ME)
    ov.write(ME, ino(ov, "README.md"), 0, b"after")
    tl.seal()
    await thin(session.store, 0)  # every unnamed checkpoint goes, the restore's too
    assert await tl.complete_restores() == 0
    assert session.store.read(lambda r: [k for k, _ in r.prefix(META, b"restore_files/")]) == []


@pytest.mark.parametrize("old", [1, 2, 3, 4])
async def test_an_older_store_is_upgraded_at_open_to_the_same_states_and_files(
        repo: Path, tmp_path: Path, old: int) -> None:
    store = str(tmp_path / "old")
    s = Session.open(store, str(repo), create=True, window=1e9)
    try:
        await _random_history(s, 3, steps=150)
        before = _trees(s), _files(s)
    finally:
        s.close()
    # make it what format 1, 2, 3 or 4 left: without the tables and keys that came after,
    # checkpoints without their inode counter (before 4), the index without born values
    # and the file rows without their counts (before 5)
    gone = (*HISTORY_TABLES, GROUPFILES) if old == 1 else (GROUPFILES,) if old == 2 else ()
    env = lmdb.open(store, max_dbs=32, map_size=1 << 30)
    with env.begin(write=True) as txn:
        meta, ckpts = env.open_db(META, txn=txn), env.open_db(CKPTS, txn=txn)
        for name in gone:
            txn.drop(env.open_db(name, txn=txn), delete=True)
        for key in (HISTORY_KEY, GROUPFILES_KEY) if old == 1 else (GROUPFILES_KEY,) if old == 2 else ():
            txn.delete(key, db=meta)
        for key, value in list(txn.cursor(db=ckpts)) if old < 4 else ():
            txn.put(key, pack_obj(unpack_obj(value)[:10]), db=ckpts)
        if old > 1:
            changed = env.open_db(CHANGED, txn=txn)
            keys = [k for k, _ in txn.cursor(db=changed)]
            txn.drop(changed, delete=False)
            for key in keys:  # (format 4: seq + vkey -> b"", no layer)
                txn.put(key[1:], b"", db=changed)
            txn.put(HISTORY_KEY, u64(1), db=meta)
        if old > 2:
            rows = env.open_db(GROUPFILES, txn=txn)
            for key in [k for k, _ in txn.cursor(db=rows) if k.endswith(b"\0")]:
                txn.delete(key, db=rows)
        txn.put(FORMAT_KEY, u64(old), db=meta)
    env.close()
    s = Session.open(store, str(repo), create=False, window=1e9)
    try:
        def built(r: ReadTxn) -> tuple[int, bool, bool]:
            raw = r.get(META, FORMAT_KEY)
            assert raw is not None  # (the reopen wrote the current format)
            return from_u64(raw), history.is_built(r), groupfiles.is_built(r)
        assert s.store.read(built) == (FORMAT_VERSION, True, True)
        assert (_trees(s), _files(s)) == before
        assert s.store.read(lambda r: (r.count(CHANGED), r.count(GROUPFILES))) > (0, 0)
        assert fsck(s.store)["clean"]
        # each checkpoint gets the counter at the upgrade (no inode numbered from it on was
        # there), and a restore to one skips by number what was made since
        tl = Timeline(s.ctx)
        cks = s.store.read(tl.all)
        if old < 4:
            assert {ck.next_ino for ck in cks} == {s.store.read(lambda r: r.meta_int(NEXT_INO_KEY))}
        for i, ck in enumerate(random.Random(old).sample(cks, 8)):
            s.overlay.create(ME, ROOT_INO, b"after-upgrade-%d" % i, stat.S_IFDIR | 0o755, 0, 0)
            await tl.restore(ck.id, ME)
            assert tree_of(s.overlay) == before[0][ck.id], ck.id
        assert fsck(s.store)["clean"]
    finally:
        s.close()


def _files(s: Session) -> dict[int, tuple[list[dict[str, str]], int, str]]:
    """Every checkpoint's net file changes, how many, and its summary, as log shows them."""
    from overlayckpt.core.summaries import checkpoint_entry
    tl = Timeline(s.ctx)

    def fn(r):
        entries = {ck.id: checkpoint_entry(r, ck) for ck in tl.all(r)}
        return {i: (e["files"], e["files_total"], e["summary"]) for i, e in entries.items()}
    return s.store.read(fn)


def test_fsck_finds_a_damaged_index_and_repair_rebuilds_it(session: Session) -> None:
    from overlayckpt.core.maintenance import repair
    ov = session.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"x")
    ov.write(OTHER, ino(ov, "README.md"), 0, b"y")
    session.store.write(lambda w: w.txn.drop(w.store.dbs[CHANGED], delete=False))
    result = fsck(session.store)
    assert not result["clean"] and any("history index changed" in p for p in result["problems"])
    assert "the history index (rebuilt from the journal)" in repair(session.store)
    assert fsck(session.store)["clean"]


def test_a_checkpoint_view_costs_the_keys_changed_not_the_records(session: Session) -> None:
    """Thousands of groups after a checkpoint rewrite one file: the index holds each changed
    key once, and the checkpoint still shows the file as it was."""
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("early", None, ME)
    before = tree_of(ov)
    readme = ino(ov, "README.md")
    for i in range(3000):
        ov.write(CALLERS[i % 2], readme, 0, b"%d" % i)
    assert session.store.read(lambda r: r.count(CHANGED)) <= 4  # the node and one block
    early = session.store.read(lambda r: tl.get(r, "early"))
    assert tree_of(ov, lambda r: tl.state(r, early)) == before


class _CountedSeeks:
    """A read transaction that counts its index seeks."""

    def __init__(self, r: ReadTxn) -> None:
        self.r, self.seeks = r, 0

    def seek(self, table: bytes, key: bytes) -> tuple[bytes, bytes] | None:
        self.seeks += 1
        return self.r.seek(table, key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.r, name)


def test_a_diff_costs_what_changed_not_the_names_a_directory_ever_held(session: Session) -> None:
    """A build directory that held 2,000 names over the session, and one file there edited
    between two checkpoints: the diff finds the file's name without listing the directory
    at either checkpoint (a listing there reads every name it ever held). A file made and
    removed in between is named nowhere (its record keeps no link): no listing either."""
    ov = session.overlay
    tl = Timeline(session.ctx)
    out, _ = ov.create(ME, ROOT_INO, b"out", stat.S_IFDIR | 0o755, 0, 0)
    kept, _ = ov.create(ME, out, b"kept.o", REG, 0, 0)
    for i in range(2000):
        who = CALLERS[i % 2]  # (a group each: every name gets versions)
        tmp, _ = ov.create(who, out, b"t%04d.o" % i, REG, 0, 0)
        ov.write(who, tmp, 0, b"x")
        ov.remove(who, out, b"t%04d.o" % i, False)
    a = tl.checkpoint("a", None, ME)
    ov.write(OTHER, kept, 0, b"edited")
    gone, _ = ov.create(OTHER, out, b"gone.o", REG, 0, 0)  # made and removed in between
    ov.write(OTHER, gone, 0, b"y")
    ov.remove(OTHER, out, b"gone.o", False)
    b = tl.checkpoint("b", None, ME)
    def diff(x, y):
        def fn(r):
            c = _CountedSeeks(r)
            # (cast: the proxy forwards every other ReadTxn method to r, by __getattr__)
            return [(f.path, f.change) for f in tl.changes(cast(ReadTxn, c), x, y)], c.seeks
        return session.store.read(fn)
    assert diff(a, b)[0] == [("out/kept.o", "M")]
    assert diff(a, b)[1] < 200, diff(a, b)
    assert diff(a, None)[0] == [("out/kept.o", "M")]
    # the file renamed since (its live name is not the one it had): still exact
    ov.rename(ME, out, b"kept.o", ROOT_INO, b"moved.o", 0)
    assert diff(a, b)[0] == [("out/kept.o", "M")]


async def test_thinning_in_small_slices_off_the_loop_keeps_every_kept_checkpoint_exact(
        open_session: Callable[..., Session], repo: Path, monkeypatch) -> None:
    from overlayckpt.core import maintenance
    monkeypatch.setattr(maintenance, "THIN_SLICE", 3)  # many slices, each its own transaction
    s = open_session(repo)
    rng = random.Random(11)
    tl = Timeline(s.ctx)
    for i in range(400):
        _step(rng, s)
        if i % 97 == 0:
            tl.checkpoint(f"n{i}", None, ME)
    tl.seal()
    before = _trees(s)
    plan = s.store.read(lambda r: maintenance.thin_plan(r, 0))
    assert len(plan) > 5 and any(len(m.dropped) > 1 for m in plan)
    result = await s.maintain(0)
    assert result["thinned"] > 20 and result["removed_blocks"] > 0
    after = _trees(s)
    assert after.keys() < before.keys()
    assert all(after[cid] == before[cid] for cid in after)
    assert fsck(s.store)["clean"], fsck(s.store)["problems"]


async def test_gc_keeps_a_block_written_again_while_it_planned(session: Session) -> None:
    """gc plans in a snapshot: a block unreferenced there but written again before the
    plan is applied (same content: same digest) must stay."""
    from overlayckpt.core.maintenance import apply_merge, gc_apply, gc_plan, merge_slice, thin_plan
    ov = session.overlay
    data = b"z" * 4096
    readme = ino(ov, "README.md")
    ov.write(ME, readme, 0, data)
    ov.write(OTHER, readme, 0, b"y" * 4096)  # a checkpoint between: thinning merges it away
    ov.write(ME, readme, 0, b"x" * 4096)
    Timeline(session.ctx).seal()
    for m in session.store.read(lambda r: thin_plan(r, 0)):
        session.store.write(lambda w: apply_merge(w, m, merge_slice(w, m)))
    plan = session.store.read(gc_plan)
    assert blake3.blake3(data).digest() in plan.doomed, "only a dropped checkpoint needed it"
    new, _ = ov.create(OTHER, ROOT_INO, b"again", REG, 0, 0)
    ov.write(OTHER, new, 0, data)  # the doomed digest, referenced anew
    session.store.write(lambda w: gc_apply(w, plan))
    assert ov.live(lambda r: ov.read_all(r, new)) == data
    assert fsck(session.store)["clean"]


async def test_a_restore_takes_in_what_was_written_after_it_was_prepared(session: Session) -> None:
    """A restore works out what to write in a snapshot, off the loop; what the mount wrote
    after that snapshot and before the restore's transaction is put back too."""
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("start", None, ME)
    start = tree_of(ov)
    ov.write(ME, ino(ov, "README.md"), 0, b"before the snapshot")
    target = session.store.read(lambda r: tl.get(r, "start"))
    prep = session.store.read(lambda r: tl._prepare(r, target, None, True))
    ov.write(OTHER, ino(ov, "run.sh"), 0, b"after the snapshot")  # meanwhile
    ov.write(OTHER, ino(ov, "README.md"), 0, b"and again")  # (a key the snapshot has)
    new, _ = ov.create(OTHER, ROOT_INO, b"late.txt", REG, 0, 0)
    ck = session.store.write(lambda w: tl._write_restore(w, prep, ME, None, "code", []))
    assert tree_of(ov) == start
    await tl.complete_restores()
    assert {"README.md", "run.sh", "late.txt"} <= set(restore_files(session, ck.id))
    # (teardown's fsck: the index the transaction wrote blind is the one the journal implies)


async def test_the_file_lists_of_random_restores_are_what_their_trees_differ_in(
        open_session: Callable[..., Session], repo: Path) -> None:
    for seed in range(3):
        s = open_session(repo, store=repo.parent / f"lists-{seed}")
        recorded = await _random_history(s, seed + 20)
        tl = Timeline(s.ctx)
        assert await tl.complete_restores() > 0
        checked = 0
        for ck in s.store.read(tl.all):
            recs = s.store.read(lambda r: list(history_records(r, ck.id, tl)))
            if ck.kind != "restore" or not recs or any(rec.op != "restore" for rec in recs):
                continue  # (nothing changed, or merged by thinning)
            before, after = recorded[ck.id - 1], recorded[ck.id]  # see _mark_before_restore
            files = {p for p in before.keys() | after.keys()
                     if before.get(p, ("f",))[0] != "d" and after.get(p, ("f",))[0] != "d"}
            want = {p: "A" if p not in before else "D" if p not in after else "M"
                    for p in files if before.get(p) != after.get(p)}
            got = restore_files(s, ck.id)
            assert {p: got.get(p) for p in want} == want, (seed, ck.id)
            assert all(got[p] == "M" and p in before and p in after for p in set(got) - set(want))
            checked += 1
        assert checked > 2, seed


async def test_on_a_mount_the_lists_follow_in_a_task_of_their_own(session: Session,
                                                                   monkeypatch) -> None:
    """A mounted session lists each restore's files after its answer; a restore that comes
    while a list is being made stops it, and every list is written in the end."""
    import dataclasses

    import trio

    from overlayckpt.core import timeline
    monkeypatch.setattr(timeline, "LIST_AFTER", 0.0)  # (the restores come at once anyway)
    session.ctx = dataclasses.replace(session.ctx, mountpoint=str(session.store.path))
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("start", None, ME)
    for i in range(200):
        ov.create(ME, ROOT_INO, b"file-%03d" % i, REG, 0, 0)
    first = await tl.restore("start", ME)
    back = await tl.restore("@before-last", ME)  # (at once: the first list may be unwritten)
    with trio.fail_after(30):
        while session.store.read(lambda r: list(r.prefix(META, b"restore_files/"))):
            await trio.sleep(0.01)
    assert restore_files(session, first["id"]) == {f"file-{i:03d}": "D" for i in range(200)}
    assert restore_files(session, back["id"]) == {f"file-{i:03d}": "A" for i in range(200)}


async def test_a_restore_takes_in_thinning_after_it_was_prepared(session: Session) -> None:
    """Thinning between the snapshot and the transaction merges records: the newest
    versions the snapshot found moved, and the transaction finds them again."""
    from overlayckpt.core.maintenance import Merge, apply_merge, merge_slice
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("start", None, ME)
    start = tree_of(ov)
    readme = ino(ov, "README.md")
    for i in range(10):  # each write a group of its own
        ov.write(CALLERS[i % 2], readme, 0, b"edit %d" % i)
    tl.seal()
    target = session.store.read(lambda r: tl.get(r, "start"))
    prep = session.store.read(lambda r: tl._prepare(r, target, None, True))
    lo, hi = target.seq + 1, session.store.read(lambda r: r.meta_int(SEQ_KEY))
    cks = session.store.read(tl.all)
    m = Merge(lo, hi, [c.id for c in cks if lo < c.seq < hi],  # meanwhile: the newest
              [c.id for c in cks if lo <= c.start_seq < hi <= c.seq])  # versions move to lo
    session.store.write(lambda w: apply_merge(w, m, merge_slice(w, m)))
    session.store.write(lambda w: tl._write_restore(w, prep, ME, None, "code", []))
    assert tree_of(ov) == start
    assert fsck(session.store)["clean"], fsck(session.store)["problems"]


@pytest.mark.parametrize("listing_after", [64, 1])
async def test_a_whole_restore_reads_the_rows_the_rule_keeps(
        open_session: Callable[..., Session], repo: Path, listing_after: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """rows_since skips reading the versions of unborn inodes' keys (those numbered from
    the checkpoint's inode counter on, without a read): it must find exactly the rows that
    reading all of them and leaving out the unborn ones (unborn_left) gives, with the
    counter and without it (a checkpoint from before format 4). listing_after 1: every
    directory's names born since are checked against one listing of it (_NamesNow)."""
    from overlayckpt.core import delta
    from overlayckpt.core.delta import TABLE_NAMES, rows_since, unborn_left
    monkeypatch.setattr(delta, "NAMES_BEFORE_LISTING", listing_after)
    for seed in (3, 11):
        s = open_session(repo, store=repo.parent / f"store-{seed}")
        await _random_history(s, seed, steps=200)
        tl = Timeline(s.ctx)

        def full(r, seq):
            rows = {}
            for c, key, value, last in history.values_since(r, seq):
                current = r.get(TABLE_NAMES[c], key)
                if current != value:
                    rows[(TABLE_NAMES[c], key)] = (value, current, last)
            return rows
        left_out = by_number = 0
        for ck in s.store.read(tl.all):
            assert ck.next_ino >= 1 << 48, ck  # (every checkpoint of format 4 has one)
            got, blind, rows = s.store.read(lambda r: (
                rows_since(r, ck.seq, ck.next_ino), rows_since(r, ck.seq), full(r, ck.seq)))
            assert got == blind == unborn_left(rows), (seed, ck.id)
            left_out += len(rows) > len(got)
            by_number += any(from_u64(k[:8]) >= ck.next_ino for _, k in rows)
        assert left_out, "no restore had rows to leave out: the test tests nothing"
        assert by_number, "no inode was unborn by its number: the counter went untested"


async def test_gc_sweeps_what_a_restore_left_unnamed_and_every_checkpoint_still_shows_it(
        session: Session) -> None:
    """A restore leaves a subtree made since its target as it was, with no name; gc deletes
    it (journaled: the checkpoints that show it still do), and a restore brings it back."""
    from overlayckpt.tables import NODES
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("before", None, ME)
    start = tree_of(ov)
    d, _ = ov.create(ME, ROOT_INO, b"made", stat.S_IFDIR | 0o755, 0, 0)
    sub, _ = ov.create(ME, d, b"sub", stat.S_IFDIR | 0o755, 0, 0)
    for i in range(40):
        ov.write(ME, ov.create(ME, d if i % 2 else sub, b"f%d" % i, REG, 0, 0)[0], 0, b"x%d" % i * 3000)
    ov.rename(ME, ino(ov, "docs"), b"guide.txt", sub, b"moved-in", 0)  # a file of the repo, moved in
    linked = ov.live(lambda r: ov.lookup(r, d, b"f1"))
    ov.link(ME, linked, sub, b"f1-again")  # a hard link: named in two directories of the subtree
    made = tl.checkpoint("made", None, ME)
    after = tree_of(ov)
    nodes = session.store.read(lambda r: r.count(NODES))
    await tl.restore("before", ME)
    assert tree_of(ov) == start
    order = unnamed_left(session)
    assert len(order) == 42  # left as they were, unnamed
    # each after every directory that names it: no slice leaves an entry naming a missing record
    assert order.index(u64(linked)) > max(order.index(u64(d)), order.index(u64(sub)))
    result = await thin(session.store, 1 << 40, then_gc=True)
    assert result["swept_inodes"] == 42, result
    assert session.store.read(lambda r: r.count(NODES)) < nodes - 40
    assert tree_of(ov) == start
    assert unnamed_left(session) == []
    assert tree_of(ov, lambda r: tl.state(r, session.store.read(lambda r2: tl.get(r2, made.id)))) == after
    assert fsck(session.store)["clean"], fsck(session.store)["problems"]
    await tl.restore("made", ME)
    assert tree_of(ov) == after
    assert fsck(session.store)["clean"], fsck(session.store)["problems"]


def unnamed_left(session: Session) -> list[bytes]:
    from overlayckpt.core.sweep import unnamed
    return session.store.read(unnamed)


async def test_fsck_finds_an_entry_without_a_record_in_the_tree_not_in_what_a_restore_unnamed(
        session: Session) -> None:
    """A restore leaves the entries of a directory made since as they are, one naming a repo
    file moved in (whose record then is none) too: that is no damage, as no directory of the
    tree names the directory. The same entry in the tree is."""
    from overlayckpt.tables import DIRENTS, NODES
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("before", None, ME)
    start = tree_of(ov)
    d, _ = ov.create(ME, ROOT_INO, b"made", stat.S_IFDIR | 0o755, 0, 0)
    readme = ino(ov, "README.md")
    ov.rename(ME, ROOT_INO, b"README.md", d, b"moved-in", 0)
    after = tree_of(ov)
    await tl.restore("before", ME)
    assert tree_of(ov) == start
    left = session.store.read(lambda r: (r.get(DIRENTS, u64(d) + b"moved-in"), r.get(NODES, u64(readme))))
    assert left == (u64(readme), None)  # left as it was, naming a file without a record
    assert fsck(session.store)["clean"], fsck(session.store)["problems"]
    await tl.restore("@before-last", ME)
    assert tree_of(ov) == after
    raw = session.store.read(lambda r: r.get(NODES, u64(readme)))
    assert raw is not None
    session.store.write(lambda w: w.delete(NODES, u64(readme)))  # damage, in the tree
    problems = fsck(session.store)["problems"]
    assert any(f"in {d} names inode {readme} without a record" in p for p in problems), problems
    session.store.write(lambda w: w.put(NODES, u64(readme), raw))  # (teardown's fsck)


async def test_restores_that_bring_their_pages_in_with_threads_first_are_exact(
        open_session: Callable[..., Session], repo: Path, monkeypatch) -> None:
    """The warm-up of a whole restore (several threads reading its pages first, when a
    sample says they are on disk) only reads: here it runs for every restore, and every
    restore still gives its checkpoint's tree. (The index's way: none near the last restore.)"""
    from overlayckpt.core import delta
    monkeypatch.setattr(delta, "rows_near", lambda r, target, left: None)
    monkeypatch.setattr(history, "WARM_MIN", 1)
    monkeypatch.setattr(history, "COLD_S", 0.0)  # (every sample is "on disk")
    ran = []
    for name in ("warm_changed", "warm_up"):
        def spy(*args, _real=getattr(history, name), _name=name):  # noqa: B008  (bound per name)
            done = _real(*args)
            ran.append((_name, done))
            return done
        monkeypatch.setattr(history, name, spy)
    s = open_session(repo)
    recorded = await _random_history(s, 5, steps=150)
    tl = Timeline(s.ctx)
    for ck in random.Random(5).sample(s.store.read(tl.all), 10):
        await tl.restore(ck.id, ME)
        assert tree_of(s.overlay) == recorded[ck.id], ck.id
    assert ("warm_changed", True) in ran and ("warm_up", True) in ran, ran


async def test_a_restore_near_the_last_restore_finds_the_rows_the_index_finds(
        open_session: Callable[..., Session], repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """delta.rows_near (the journal records between the last whole restore's target and
    this one's, those since, and the keys of the inodes that restore left) finds exactly
    the rows rows_since finds from the index, and notes at least the inodes it leaves
    that the target had made;
    after each restore the tree is the target's. Random histories with many restores back
    and forth, atomic saves (new inodes), removals, and thinning."""
    from overlayckpt.core import delta
    from overlayckpt.core.delta import rows_near, rows_since
    near_used = 0

    def checked(r: ReadTxn, target: Any, left: set[bytes]) -> Any:
        nonlocal near_used
        rows = rows_near(r, target, left)
        if rows is not None:
            near_used += 1
            want_left: set[bytes] = set()
            assert rows == rows_since(r, target.seq, target.next_ino, want_left), target.id
            made = u64(target.next_ino)  # (those it had not made are known by number)
            assert {i for i in left if i < made} >= {i for i in want_left if i < made}, target.id
        return rows
    monkeypatch.setattr(delta, "rows_near", checked)
    for seed in (5, 6, 7, 8):
        s = open_session(repo, store=repo.parent / f"store-near-{seed}")
        rng = random.Random(seed)
        tl = Timeline(s.ctx)
        trees: dict[int, dict[str, tuple]] = {}
        for i in range(240):
            _step(rng, s)
            if rng.random() < 0.3:
                ck = tl.checkpoint(None, None, ME)
                trees[ck.id] = tree_of(s.overlay)
            if trees and rng.random() < 0.15:
                near = rng.random() < 0.7  # (undo and redo; else anywhere, reviving what went)
                target = rng.choice(sorted(trees)[-6:] if near else sorted(trees))
                await tl.restore(target, ME)
                assert tree_of(s.overlay) == trees[target], (seed, i, target)
            if i == 120:
                await thin(s.store, 0)
                kept = {ck.id for ck in s.store.read(tl.all)}
                trees = {cid: t for cid, t in trees.items() if cid in kept}
        assert fsck(s.store)["clean"], fsck(s.store)["problems"]
    assert near_used > 20, f"rows_near answered {near_used} restores: the test tests little"
