"""Grouping into checkpoints, named checkpoints, restore (with fake kernel hooks) and the
conversation sidecar, in process over a real store."""
from __future__ import annotations

import dataclasses
import json
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from overlayckpt.agents.lines import parse_line
from overlayckpt.core.conversation import all_lines, live_lines
from overlayckpt.core.journal import Caller, records
from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import UserError
from overlayckpt.records import ROOT_INO, u64
from overlayckpt.service.session import Session
from overlayckpt.tables import DIRENTS

from .helpers_core import ME, OTHER, content, ino, native_tree, tree_of

REG = stat.S_IFREG | 0o644


class KernelHooks:
    """Stands in for the daemon's kernel-cache callbacks and records what a restore asks."""

    def __init__(self) -> None:
        self.flushes = 0
        self.inodes: list[int] = []
        self.entries: list[tuple[int, bytes]] = []
        self.calls = 0

    async def flush_kernel(self) -> None:
        self.flushes += 1

    async def invalidate(self, inodes: list[int], entries: list[tuple[int, bytes]]) -> None:
        self.calls += 1
        self.inodes += inodes
        self.entries += entries


@pytest.fixture
def hooks(session: Session) -> KernelHooks:
    h = KernelHooks()
    # as the mount gives them at Session.open: into the session's context
    session.ctx = dataclasses.replace(session.ctx, flush_kernel=h.flush_kernel, invalidate=h.invalidate)
    return h


def checkpoints(s: Session) -> list[Any]:
    tl = Timeline(s.ctx)
    return s.store.read(tl.all)


def group_paths(s: Session, ck: Any) -> list[str]:
    return s.store.read(lambda r: [p for rec in records(r, ck.start_seq, ck.seq) for p in rec.paths])


# -- grouping ------------------------------------------------------------------------

def test_a_new_session_has_only_the_origin_checkpoint(session: Session) -> None:
    [origin] = checkpoints(session)
    assert origin.id == 0 and origin.seq == 1 and origin.message == "session start"


def test_operations_of_one_process_group_until_another_process_writes(session: Session) -> None:
    ov = session.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"1")
    ov.write(ME, ino(ov, "run.sh"), 0, b"2")
    assert len(checkpoints(session)) == 1  # the group is still open
    ov.write(OTHER, ino(ov, "README.md"), 0, b"3")
    cks = checkpoints(session)
    assert len(cks) == 2
    assert (cks[1].pid, cks[1].comm, cks[1].kind) == (ME.pid, ME.comm, "auto")
    assert group_paths(session, cks[1]) == ["README.md", "run.sh"]
    Timeline(session.ctx).seal()
    cks = checkpoints(session)
    assert len(cks) == 3 and cks[2].pid == OTHER.pid
    assert group_paths(session, cks[2]) == ["README.md"]


def test_seal_without_an_open_group_adds_nothing(session: Session) -> None:
    Timeline(session.ctx).seal()
    Timeline(session.ctx).seal()
    assert len(checkpoints(session)) == 1


def test_window_zero_makes_every_operation_a_checkpoint(open_session, repo: Path) -> None:
    s = open_session(repo, window=0)
    ov = s.overlay
    for i in range(3):
        ov.write(ME, ino(ov, "README.md"), i, b"x")
    cks = checkpoints(s)
    assert len(cks) == 4
    assert [c.seq - c.start_seq for c in cks[1:]] == [1, 1, 1]


def test_an_idle_gap_longer_than_the_window_ends_a_group(open_session, repo: Path) -> None:
    s = open_session(repo, window=1e-9)  # two operations are always further apart than 1 ns
    ov = s.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"a")
    ov.write(ME, ino(ov, "README.md"), 1, b"b")
    Timeline(s.ctx).seal()
    assert len(checkpoints(s)) == 3


def test_only_operations_that_change_something_are_journaled(session: Session) -> None:
    ov = session.overlay
    try:
        ov.remove(ME, ROOT_INO, b"missing", False)
    except Exception:
        pass
    assert session.store.read(lambda r: r.count(b"journal")) == 0
    ov.write(ME, ino(ov, "README.md"), 0, b"")  # zero bytes, but mtime moves: one record
    assert session.store.read(lambda r: r.count(b"journal")) == 1
    Timeline(session.ctx).seal()
    assert len(checkpoints(session)) == 2


# -- named checkpoints ------------------------------------------------------------------

def test_named_checkpoint_closes_the_open_group(session: Session) -> None:
    ov = session.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"X")
    ck = Timeline(session.ctx).checkpoint("step1", "first step", ME)
    cks = checkpoints(session)
    assert [c.kind for c in cks] == ["auto", "auto", "named"]
    assert (ck.name, ck.message, ck.seq) == ("step1", "first step", cks[1].seq)
    tl = Timeline(session.ctx)
    assert session.store.read(lambda r: tl.get(r, "step1").id) == ck.id
    assert session.store.read(lambda r: tl.get(r, str(ck.id)).name) == "step1"


@pytest.mark.parametrize("name", ["", "123", "@x", "a/b", "n" * 201])
def test_bad_checkpoint_names_are_refused(session: Session, name: str) -> None:
    with pytest.raises(UserError):
        Timeline(session.ctx).checkpoint(name, None, ME)
    assert len(checkpoints(session)) == 1


def test_a_taken_name_is_refused(session: Session) -> None:
    Timeline(session.ctx).checkpoint("once", None, ME)
    with pytest.raises(UserError, match="taken"):
        Timeline(session.ctx).checkpoint("once", None, ME)


def test_unknown_checkpoint_refs(session: Session) -> None:
    tl = Timeline(session.ctx)
    for ref in ("nope", 99, True, None, "@before-last"):
        with pytest.raises(UserError):
            session.store.read(lambda r: tl.get(r, ref))


# -- restore ------------------------------------------------------------------------------

async def test_restore_both_puts_the_tree_back_and_invalidates_what_changed(
        session: Session, hooks: KernelHooks, repo: Path) -> None:
    ov = session.overlay
    before = tree_of(ov)
    await session.command({"cmd": "checkpoint", "name": "before"})
    readme = ino(ov, "README.md")
    ov.write(ME, readme, 0, b"CHANGED")
    new, _ = ov.create(ME, ROOT_INO, b"new.txt", REG, 0, 0)
    ov.remove(ME, ino(ov, "docs"), b"guide.txt", False)
    t0 = time.perf_counter()
    result = await session.command({"cmd": "restore", "id": "before"})
    took = (time.perf_counter() - t0) * 1e3
    assert tree_of(ov) == before
    assert result["what"] == "both" and result["changed_keys"] > 0
    assert list(result["took_ms"]) == ["flush", "prepare", "write", "invalidate"]
    assert 0 < sum(result["took_ms"].values()) <= took + 0.5  # (each rounded to 0.1 ms)
    assert hooks.flushes == 1 and hooks.calls == 1
    assert {readme, ROOT_INO, ino(ov, "docs")} <= set(hooks.inodes)
    assert new not in hooks.inodes  # deleted: no name leads to it (its name's entry goes)
    assert (ROOT_INO, b"new.txt") in hooks.entries
    assert (ino(ov, "docs"), b"guide.txt") in hooks.entries
    assert checkpoints(session)[-1].kind == "restore"


async def test_a_restore_that_deletes_a_directory_invalidates_its_name_not_what_was_in_it(
        session: Session, hooks: KernelHooks) -> None:
    """The kernel drops the names below a directory with the directory's own name. The
    subtree made since the target is left as it was, unnamed: the restore that brings it
    back writes that one name again, and what is below comes back with it."""
    ov = session.overlay
    await session.command({"cmd": "checkpoint", "name": "before"})
    start = tree_of(ov)
    d, _ = ov.create(ME, ROOT_INO, b"made", stat.S_IFDIR | 0o755, 0, 0)
    for i in range(50):
        ov.write(ME, ov.create(ME, d, b"f%d" % i, REG, 0, 0)[0], 0, b"%d" % i)
    after = tree_of(ov)
    first = await session.command({"cmd": "restore", "id": "before"})
    assert hooks.entries == [(ROOT_INO, b"made")] and hooks.inodes == [ROOT_INO]
    assert tree_of(ov) == start and first["changed_keys"] == 2  # (the name, the root's record)
    hooks.inodes, hooks.entries = [], []
    back = await session.command({"cmd": "restore", "id": "@before-last"})
    assert hooks.entries == [(ROOT_INO, b"made")] and hooks.inodes == [ROOT_INO]
    assert tree_of(ov) == after and back["changed_keys"] == 2


async def test_an_editors_temporary_names_leave_nothing_for_a_restore_to_undo(
        session: Session, hooks: KernelHooks) -> None:
    """Atomic saves in a repo directory: a temporary name written, then renamed over the
    file. The repo never had the temporary names, so nothing hides them afterwards and
    a restore across the saves changes (and has the kernel forget) the files' names
    only. A repo file removed is still hidden, and comes back."""
    ov = session.overlay
    docs = ino(ov, "docs")
    await session.command({"cmd": "checkpoint", "name": "before"})
    start = tree_of(ov)
    for i in range(3):
        tmp, _ = ov.create(ME, docs, b".guide.txt.tmp%d" % i, REG, 0, 0)
        ov.write(ME, tmp, 0, b"saved %d\n" % i)
        ov.rename(ME, docs, b".guide.txt.tmp%d" % i, docs, b"guide.txt", 0)
    ov.remove(ME, ROOT_INO, b"README.md", False)
    after = tree_of(ov)
    rows = session.store.read(lambda r: [k[8:] for k, _ in r.prefix(DIRENTS, u64(docs))])
    assert rows == [b"guide.txt"]
    await session.command({"cmd": "restore", "id": "before"})
    assert tree_of(ov) == start
    assert sorted(hooks.entries) == [(ROOT_INO, b"README.md"), (docs, b"guide.txt")]
    await session.command({"cmd": "restore", "id": "@before-last"})
    assert tree_of(ov) == after


async def test_restore_is_undone_with_before_last(session: Session, hooks: KernelHooks) -> None:
    ov = session.overlay
    Timeline(session.ctx).checkpoint("clean", None, ME)
    ov.write(ME, ino(ov, "README.md"), 0, b"WORK")
    after = tree_of(ov)
    await session.command({"cmd": "restore", "id": "clean"})
    assert tree_of(ov) != after
    await session.command({"cmd": "restore", "id": "@before-last"})
    assert tree_of(ov) == after


async def test_restore_to_the_origin_gives_the_repo(session: Session, hooks: KernelHooks,
                                                    repo: Path) -> None:
    ov = session.overlay
    ov.rename(ME, ROOT_INO, b"src", ROOT_INO, b"lib", 0)
    ov.create(ME, ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
    ov.setattr(ME, ino(ov, "run.sh"), mode=0o600)
    await Timeline(session.ctx).restore(0, ME)
    assert dict(tree_of(ov)) == native_tree(repo)


async def test_restore_of_chosen_paths_keeps_the_other_changes(session: Session,
                                                               hooks: KernelHooks) -> None:
    ov = session.overlay
    Timeline(session.ctx).checkpoint("start", None, ME)
    ov.write(ME, ino(ov, "README.md"), 0, b"R")
    ov.write(ME, ino(ov, "run.sh"), 0, b"S")
    original_readme = content(ov, "README.md")
    result = await session.command({"cmd": "restore", "id": "start", "paths": ["run.sh"]})
    assert content(ov, "run.sh").startswith(b"#!/bin/sh")
    assert content(ov, "README.md") == original_readme
    assert result["what"] == "code"
    assert any("README.md" in w for w in result["warnings"])  # they changed together


async def test_restore_of_a_path_that_never_existed_is_refused(session: Session,
                                                               hooks: KernelHooks) -> None:
    with pytest.raises(UserError):
        await Timeline(session.ctx).restore(0, ME, ["nowhere/at/all"], "code")
    with pytest.raises(UserError):
        await session.command({"cmd": "restore", "id": 0, "paths": ["../x"]})


async def test_restore_of_a_deleted_upper_file_brings_it_back(session: Session,
                                                              hooks: KernelHooks) -> None:
    ov = session.overlay
    i, _ = ov.create(ME, ROOT_INO, b"notes", REG, 0, 0)
    ov.write(ME, i, 0, b"precious" * 1000)
    ck = Timeline(session.ctx).checkpoint(None, None, ME)
    ov.remove(ME, ROOT_INO, b"notes", False)
    await Timeline(session.ctx).restore(ck.id, ME)
    assert content(ov, "notes") == b"precious" * 1000


def line(role: str, text: str, **extra: Any) -> bytes:
    return json.dumps({"role": role, "content": text, **extra}).encode()


async def test_restore_conversation_only_moves_the_head_and_leaves_code(
        session: Session, hooks: KernelHooks) -> None:
    ov = session.overlay
    session.conversation_append(line("user", "first"))
    Timeline(session.ctx).checkpoint("talked", None, ME)
    session.conversation_append(line("assistant", "second"))
    ov.write(ME, ino(ov, "README.md"), 0, b"CODE")
    result = await session.command({"cmd": "restore", "id": "talked", "what": "conversation"})
    assert result["what"] == "conversation" and result["changed_keys"] == 0
    assert content(ov, "README.md").startswith(b"CODE")
    assert hooks.flushes == 0 and hooks.calls == 0
    assert [x["content"] for x in session.store.read(live_lines)] == ["first"]


async def test_restore_code_only_keeps_the_conversation(session: Session,
                                                        hooks: KernelHooks) -> None:
    ov = session.overlay
    Timeline(session.ctx).checkpoint("c", None, ME)
    ov.write(ME, ino(ov, "README.md"), 0, b"CODE")
    session.conversation_append(line("user", "kept"))
    await session.command({"cmd": "restore", "id": "c", "what": "code"})
    assert not content(ov, "README.md").startswith(b"CODE")
    assert [x["content"] for x in session.store.read(live_lines)] == ["kept"]


# -- conversation branches -----------------------------------------------------------------

async def test_conversation_branches_after_a_restore(session: Session, hooks: KernelHooks) -> None:
    session.conversation_append(line("user", "a"))
    Timeline(session.ctx).checkpoint("fork", None, ME)
    session.conversation_append(line("assistant", "b"))
    await Timeline(session.ctx).restore("fork", ME, what="conversation")
    session.conversation_append(line("assistant", "c"))
    live = session.store.read(live_lines)
    assert [x["content"] for x in live] == ["a", "c"]
    everything = session.store.read(all_lines)
    assert [(x["content"], x["live"]) for x in everything] == [("a", True), ("b", False), ("c", True)]
    tl = Timeline(session.ctx)
    at_fork = session.store.read(lambda r: live_lines(r, tl.get(r, "fork").conv_head))
    assert [x["content"] for x in at_fork] == ["a"]
    # the abandoned branch is still reachable through a restore of the checkpoint after it
    reply = await session.command({"cmd": "conversation", "all": True})
    assert len(reply["lines"]) == 3
    assert session.conversation_text().decode().count("\n") == 2


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"content": "no role"}',
                                 b'{"role": "user"}', b'{"role": 3, "content": ""}'])
def test_bad_conversation_lines_are_refused(raw: bytes) -> None:
    with pytest.raises(UserError):
        parse_line(raw)


async def test_log_command_lists_newest_first_with_files(session: Session) -> None:
    ov = session.overlay
    session.conversation_append(line("assistant", "Fix the greeting\nmore text"))
    ov.write(ME, ino(ov, "README.md"), 0, b"x")
    ov.create(Caller(ME.pid, ME.comm), ROOT_INO, b"added.txt", REG, 0, 0)
    reply = await session.command({"cmd": "log"})
    newest = reply["checkpoints"][0]
    assert newest["files"] == [{"path": "README.md", "change": "M"}, {"path": "added.txt", "change": "A"}]
    assert newest["summary"] == "Fix the greeting"
    assert reply["checkpoints"][-1]["id"] == 0


def test_each_operation_is_journaled_with_who_what_and_where(session: Session) -> None:
    ov = session.overlay
    ov.rename(ME, ROOT_INO, b"README.md", ino(ov, "docs"), b"R.md", 0)
    ov.remove(OTHER, ROOT_INO, b"run.sh", False)
    recs = session.store.read(lambda r: records(r, 1, 1 << 62))
    assert [(r.pid, r.comm, r.op, r.paths, r.changes) for r in recs] == [
        (ME.pid, ME.comm, "rename", ("docs/R.md", "README.md"), ("R", "<")),
        (OTHER.pid, OTHER.comm, "unlink", ("run.sh",), ("D",)),
    ]
    assert all(r.undo for r in recs)


async def test_restore_of_a_directory_path_restores_its_subtree_only(
        session: Session, hooks: KernelHooks) -> None:
    ov = session.overlay
    Timeline(session.ctx).checkpoint("start", None, ME)
    before = tree_of(ov)
    ov.write(ME, ino(ov, "src/pkg/util.py"), 0, b"BROKEN")
    ov.remove(ME, ino(ov, "src"), b"main.py", False)
    ov.create(ME, ino(ov, "src"), b"extra.py", REG, 0, 0)
    ov.write(ME, ino(ov, "README.md"), 0, b"KEEP")
    await Timeline(session.ctx).restore("start", ME, ["src"], "code")
    after = tree_of(ov)
    assert {p: v for p, v in after.items() if p.startswith("src")} == \
        {p: v for p, v in before.items() if p.startswith("src")}
    assert after["README.md"][2].startswith(b"KEEP")


def durable(store: Any) -> bool:
    """Whether the newest snapshot is the one the last sync point recorded."""
    return bool(store._durable == store.env.info()["last_txnid"])


async def test_a_named_checkpoint_is_durable_when_it_answers_an_unnamed_one_soon_after(
        session: Session) -> None:
    """SPEC 3.1 keeps every named checkpoint whose command returned, and everything older
    than a few seconds: a named checkpoint waits for its sync point, an unnamed one (an
    agent hook's, per tool call) starts it as it answers."""
    store = session.store
    ov, a = session.overlay, ME
    ov.create(a, ROOT_INO, b"named.txt", stat.S_IFREG | 0o644, 0, 0)
    await session.command({"cmd": "checkpoint", "name": "kept"})
    assert durable(store)
    ov.create(a, ROOT_INO, b"unnamed.txt", stat.S_IFREG | 0o644, 0, 0)
    await session.command({"cmd": "checkpoint"})
    assert not durable(store)  # answered first
    with trio.fail_after(10):
        while not durable(store):
            await trio.sleep(0.001)


async def test_a_burst_of_unnamed_checkpoints_shares_its_sync_points(session: Session) -> None:
    """An agent hook makes an unnamed checkpoint per tool call: while the sync point one
    started waits on the disk, the next ones wait for a single one after it (each of
    their own would be another fdatasync, and a worker thread started on the request
    loop), and the last is durable all the same."""
    store = session.store
    syncs = store._counter
    with store._flush_lock:  # a slow disk: the first sync point waits
        for i in range(20):
            session.overlay.create(ME, ROOT_INO, b"f%d" % i, stat.S_IFREG | 0o644, 0, 0)
            await session.command({"cmd": "checkpoint"})
            await trio.sleep(0.001)  # (the sync point it started gets going)
    with trio.fail_after(10):
        while not durable(store) or session._syncing:
            await trio.sleep(0.001)
    assert store._counter - syncs == 2  # the one under way, then one for the rest


def test_a_name_stored_before_the_rule_still_resolves_by_exact_lookup(session: Session) -> None:
    """"-1" or "a b" are refused now; a store that holds one keeps finding it by its own
    name, and ids stay ASCII digits: "１" and "²" never read as ids."""
    from overlayckpt.records import u64
    from overlayckpt.store.txn import WriteTxn
    from overlayckpt.tables import NAMES
    tl = Timeline(session.ctx)
    ck = tl.checkpoint("fine", None, ME)
    def put_names(w: WriteTxn) -> None:
        w.put(NAMES, b"-1", u64(ck.id))
        w.put(NAMES, b"a b", u64(ck.id))
    session.store.write(put_names)
    assert session.store.read(lambda r: (tl.get(r, "-1").id, tl.get(r, "a b").id)) == (ck.id, ck.id)
    for ref in ("１", "²", "", "\udcff", "\ud800", "x" * 600, -1, 1 << 70):
        with pytest.raises(UserError, match="unknown checkpoint"):
            session.store.read(lambda r: tl.get(r, ref))
    for name in ("-2", "a c", "x\0y", "\ud800", ".", ".."):
        with pytest.raises(UserError, match="bad checkpoint name"):
            tl.checkpoint(name, None, ME)
