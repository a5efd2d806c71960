"""Forks in process over real stores: the fork's tree is the parent's at the checkpoint,
edits stay apart, blocks are shared (not copied), the parent's gc and thinning keep what
forks need, fsck follows the chain, and two sessions' states diff exactly."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from overlayckpt.core.fork import changes_between
from overlayckpt.core.maintenance import fsck, gc, gc_plan, referenced_blocks, thin_plan
from overlayckpt.core.patch import render
from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import UserError
from overlayckpt.service.session import Session
from overlayckpt.store.txn import WriteTxn
from overlayckpt.tables import BLOCKS, BMAP, JOURNAL, META, PARENT_KEY, PINNED

from .helpers_core import ME, content, exists, ino, tree_of
from .test_backout_core import edit_line, remove, set_file

BIG = os.urandom(1 << 20)  # incompressible: its blocks are what a store's size is made of


def run(s: Session, cmd: dict[str, Any]) -> dict[str, Any]:
    return trio.run(s.command, cmd)


def checkpoint(s: Session, name: str | None = None) -> int:
    return Timeline(s.ctx).checkpoint(name, None, ME).id


def at(s: Session, cid: int) -> dict[str, tuple]:
    tl = Timeline(s.ctx)
    return tree_of(s.overlay, lambda r: tl.state(r, tl.get(r, cid)))


def blocks(s: Session) -> int:
    return s.store.read(lambda r: r.count(BLOCKS))


@pytest.fixture
def family(open_session: Callable[..., Session], repo: Path, tmp_path: Path
           ) -> Callable[[Session, int | None, str], Session]:
    """fork(parent, checkpoint, name): the fork made by the parent's command, opened."""
    def fork(parent: Session, cid: int | None, name: str) -> Session:
        cmd: dict[str, Any] = {"cmd": "fork", "store": str(tmp_path / name)}
        if cid is not None:
            cmd["id"] = cid
        made = run(parent, cmd)
        return open_session(repo, store=Path(made["store"]), create=False)
    return fork


def test_fork_starts_at_the_checkpoint_and_edits_stay_apart(session: Session, family: Any) -> None:
    set_file(session, "big.bin", BIG)
    edit_line(session, "docs/guide.txt", 5, "parent before")
    first = checkpoint(session)
    edit_line(session, "docs/guide.txt", 9, "parent after")
    remove(session, "README.md")
    checkpoint(session)
    expected = at(session, first)
    f = family(session, first, "f1")
    assert tree_of(f.overlay) == expected
    assert at(f, 0) == expected  # its checkpoint 0 is the fork point
    assert blocks(f) == 0  # nothing copied: every block is read from the parent
    assert content(f.overlay, "big.bin") == BIG
    edit_line(f, "docs/guide.txt", 1, "fork")
    set_file(f, "new.txt", b"fork only\n")
    edit_line(session, "docs/guide.txt", 2, "parent again")
    assert not exists(session.overlay, "new.txt") and exists(f.overlay, "README.md")
    assert b"fork\n" not in content(session.overlay, "docs/guide.txt")
    assert b"parent again" not in content(f.overlay, "docs/guide.txt")
    assert b"parent after" not in content(f.overlay, "docs/guide.txt")
    assert blocks(f) > 0  # its own new blocks are its own
    log = run(f, {"cmd": "log", "all": True})
    assert log["forked_from"] == {"store": os.path.realpath(session.store.path), "checkpoint": first}
    # its checkpoint 0 knows the counter it numbers from, so a restore to it skips what the
    # fork made by number: exactly the fork point again
    origin = f.store.read(lambda r: Timeline(f.ctx).get(r, 0))
    set_file(f, "sub/more.txt", b"made in the fork\n")
    assert 0 < origin.next_ino <= min(ino(f.overlay, "new.txt"), ino(f.overlay, "sub/more.txt"))
    run(f, {"cmd": "restore", "id": 0, "what": "code"})
    assert tree_of(f.overlay) == expected


def test_fork_of_live_makes_a_checkpoint_and_costs_the_changes_not_the_blocks(
        session: Session, family: Any) -> None:
    set_file(session, "big.bin", BIG)
    parent_ck = Timeline(session.ctx).latest().id  # type: ignore[union-attr]  # a session has checkpoint 0
    f = family(session, None, "f1")
    newest = Timeline(session.ctx).latest()
    assert newest is not None and newest.id > parent_ck and newest.kind == "named"
    assert tree_of(f.overlay) == tree_of(session.overlay)
    assert f.store.disk_bytes() < session.store.disk_bytes() // 4


def test_fork_of_a_fork_reads_along_the_chain(session: Session, family: Any) -> None:
    set_file(session, "big.bin", BIG)
    f1 = family(session, None, "f1")
    set_file(f1, "f1.txt", b"from f1\n" * 1000)
    f2 = family(f1, None, "f2")
    assert content(f2.overlay, "big.bin") == BIG
    assert content(f2.overlay, "f1.txt") == b"from f1\n" * 1000
    assert blocks(f2) == 0
    assert fsck(f2.store)["clean"]


def test_parent_gc_keeps_what_forks_refer_to(session: Session, family: Any) -> None:
    set_file(session, "big.bin", BIG)
    f1 = family(session, None, "f1")
    f2 = family(f1, None, "f2")
    remove(session, "big.bin")
    remove(f1, "big.bin")
    assert gc(session.store)["removed_blocks"] == 0
    assert content(f2.overlay, "big.bin") == BIG
    assert fsck(f2.store)["clean"] and fsck(f1.store)["clean"]
    # a parent whose own references were gone would still keep what its fork's fork
    # names (its history keeps them as well: here it is left out, in a transaction undone)
    mine = f2.store.read(lambda r: referenced_blocks(r, forks=False))
    held = set(session.store.read(lambda r: [d for d, _ in r.range_from(BLOCKS)]))
    assert mine & held
    assert not set(doomed_without_own_refs(session)) & mine
    run(session, {"cmd": "unfork", "store": f1.store.path})  # (f1 names them too)
    assert mine & held <= set(doomed_without_own_refs(session))


def doomed_without_own_refs(s: Session) -> list[bytes]:
    """What gc would drop if the session itself referred to no block (undone after)."""
    txn = s.store.env.begin(write=True)
    try:
        w = WriteTxn(s.store, txn)
        for table in (BMAP, JOURNAL, PINNED):
            w.clear(table)
        return gc_plan(w).doomed
    finally:
        txn.abort()


def test_the_parent_lists_its_forks_and_forgets_a_dropped_one(session: Session, family: Any,
                                                              tmp_path: Path) -> None:
    set_file(session, "big.bin", BIG)
    family(session, None, "f1")
    assert run(session, {"cmd": "forks"}) == {"parent": None, "forks": {str(tmp_path / "f1"): 2}}
    assert run(session, {"cmd": "unfork", "store": str(tmp_path / "f1")})["forgot"]
    assert run(session, {"cmd": "forks"})["forks"] == {}
    assert not run(session, {"cmd": "unfork", "store": str(tmp_path / "f1")})["forgot"]


def test_thinning_keeps_the_checkpoint_a_fork_started_from(session: Session, family: Any) -> None:
    from overlayckpt.core.journal import Caller
    ids = []
    for i in range(6):
        edit_line(session, "docs/guide.txt", i, f"edit {i}")
        set_file(session, f"f{i}.bin", os.urandom(8192))
        session.overlay.write(Caller(5000 + i, "x"), session.overlay.live(
            lambda r: session.overlay.resolve(r, "README.md")), 0, b"#")  # another writer
        ids.append(Timeline(session.ctx).latest().id)  # type: ignore[union-attr]  # a session has checkpoint 0
    tl = Timeline(session.ctx)
    autos = [c.id for c in session.store.read(tl.all) if c.kind == "auto" and c.id]
    forked = autos[0]
    family(session, forked, "f1")
    dropped = {cid for m in session.store.read(lambda r: thin_plan(r, 0)) for cid in m.dropped}
    assert dropped and forked not in dropped


def test_fsck_of_a_fork_finds_a_block_missing_from_the_chain(session: Session, family: Any) -> None:
    set_file(session, "big.bin", BIG)
    f = family(session, None, "f1")
    assert fsck(f.store)["clean"]
    victim, raw = session.store.read(lambda r: next(iter(r.range_from(BLOCKS))))
    session.store.write(lambda w: w.delete(BLOCKS, victim))
    result = fsck(f.store)
    assert not result["clean"] and any(victim.hex() in p for p in result["problems"])
    session.store.write(lambda w: w.put(BLOCKS, victim, raw))  # (for the teardown's fsck)
    assert fsck(f.store)["clean"]


def test_diff_between_two_sessions_is_exact(session: Session, family: Any) -> None:
    set_file(session, "big.bin", BIG)
    base = checkpoint(session)
    f1 = family(session, base, "f1")
    f2 = family(session, base, "f2")
    edit_line(f1, "docs/guide.txt", 3, "one")
    set_file(f1, "only1.txt", b"one\n")
    edit_line(f2, "docs/guide.txt", 3, "two")
    remove(f2, "bin.dat")
    set_file(f2, "big.bin", BIG[:5000])
    tl = Timeline(f1.ctx)
    changes = f1.store.read(lambda ra: f2.store.read(
        lambda rb: changes_between(tl, ra, None, rb, None)))
    assert {c.path: c.change for c in changes} == {
        "docs/guide.txt": "M", "only1.txt": "D", "bin.dat": "D", "big.bin": "M"}
    patch = render(changes)
    assert "-line 3\n" not in patch and "-one\n+two\n" in patch
    # against the parent at the fork point: exactly f2's own changes
    ck = session.store.read(lambda r: Timeline(session.ctx).get(r, base))
    own = session.store.read(lambda ra: f2.store.read(
        lambda rb: changes_between(Timeline(session.ctx), ra, ck, rb, None)))
    assert {c.path for c in own} == {"docs/guide.txt", "bin.dat", "big.bin"}
    same = f1.store.read(lambda ra: f1.store.read(lambda rb: changes_between(tl, ra, None, rb, None)))
    assert same == []


def test_fork_into_an_existing_session_is_refused(session: Session, family: Any,
                                                  tmp_path: Path) -> None:
    family(session, None, "f1")
    with pytest.raises(UserError, match="holds a session already"):
        run(session, {"cmd": "fork", "store": str(tmp_path / "f1")})
    with pytest.raises(UserError, match="unknown checkpoint"):
        run(session, {"cmd": "fork", "store": str(tmp_path / "f9"), "id": 999})
    assert run(session, {"cmd": "forks"})["forks"] == {str(tmp_path / "f1"): 1}
    assert not os.path.exists(tmp_path / "f9")


def test_a_forks_bundle_stands_alone(session: Session, family: Any, open_session: Any,
                                     repo: Path, tmp_path: Path) -> None:
    from overlayckpt.export.importer import import_bundle
    set_file(session, "big.bin", BIG)
    f = family(session, None, "f1")
    edit_line(f, "docs/guide.txt", 1, "fork")
    expected = tree_of(f.overlay)
    run(f, {"cmd": "export_bundle", "path": str(tmp_path / "f.bundle")})
    import_bundle(str(tmp_path / "f.bundle"), str(tmp_path / "imported"), None)
    alone = open_session(repo, store=tmp_path / "imported", create=False)
    assert alone.store.read(lambda r: r.get(META, PARENT_KEY)) is None  # no parent to read
    assert tree_of(alone.overlay) == expected
    assert at(alone, 0) == at(f, 0)


def test_a_fork_keeps_the_conversation_up_to_its_checkpoint(session: Session, family: Any) -> None:
    from overlayckpt.core.conversation import live_lines
    session.conversation_append(b'{"role": "user", "content": "before"}')
    set_file(session, "a.txt", b"a\n")
    first = checkpoint(session)
    session.conversation_append(b'{"role": "user", "content": "after"}')
    f = family(session, first, "f1")
    assert [x["content"] for x in f.store.read(live_lines)] == ["before"]
    f.conversation_append(b'{"role": "user", "content": "in the fork"}')
    assert [x["content"] for x in f.store.read(live_lines)] == ["before", "in the fork"]
    assert [x["content"] for x in session.store.read(live_lines)] == ["before", "after"]


def test_a_fork_sees_the_repo_as_it_was_after_the_parent_applied(session: Session, family: Any,
                                                                   repo: Path) -> None:
    from overlayckpt.core.apply import apply_live
    original = tree_of(session.overlay)
    edit_line(session, "docs/guide.txt", 0, "applied")
    remove(session, "README.md")
    apply_live(session.ctx)  # the repo changes: the parent pinned what it first saw
    assert b"applied" in (repo / "docs" / "guide.txt").read_bytes()
    f = family(session, 0, "f1")  # the session's start: the repo before the apply
    assert tree_of(f.overlay) == original
