"""Removals answered before they are stored (Overlay.remove_later, core/removals.py).

An unlink or rmdir is checked against the live state (the deferred removals
included), logged, answered, and committed with the next write transaction.
What must hold: the same errors as a removal committed at once, for the same
reasons; the state and the journal after the commit the same as with each
committed at once; every read that may see the name sees it gone; and a removal
answered by a daemon that died before storing it is stored by the next open, once.
"""
from __future__ import annotations

import errno
import multiprocessing
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from overlayckpt.core import removals
from overlayckpt.core.journal import next_seq, records
from overlayckpt.core.removals import RemovalLog
from overlayckpt.errors import FsError
from overlayckpt.records import ROOT_INO
from overlayckpt.service.session import Session

from .helpers_core import ME, OTHER, exists, ino, names, put

REG = stat.S_IFREG | 0o644


def _failed(e: Exception) -> None:
    raise AssertionError(f"a checked removal failed when stored: {e!r}")


@pytest.fixture
def logged(session: Session) -> Iterator[tuple[Session, RemovalLog]]:
    """A session of the small repo and its removal log (closed at teardown)."""
    log = RemovalLog(session.store)
    yield session, log
    log.close()


def _journal_ops(s: Session) -> list[tuple[str, int, tuple[str, ...]]]:
    return s.store.read(lambda r: [(rec.op, rec.pid, rec.paths)
                                   for rec in records(r, 0, next_seq(r), undo=False)])


def test_unlinks_are_answered_then_stored_together_in_order(
        logged: tuple[Session, RemovalLog]) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "build/a.o", b"a")
    put(ov, ME, "build/b.o", b"b")
    build = ino(ov, "build")
    before = s.store.read(lambda r: ov.node(r, build))
    gone, parent = ov.remove_later(ME, build, b"a.o", False, log.append, _failed)
    ov.remove_later(OTHER, ROOT_INO, b"README.md", False, log.append, _failed)  # a repo file: a whiteout
    assert s.store.deferred() == 2
    # what the reply tells the kernel: the parent as the commit will leave it
    assert parent.mtime_ns == parent.ctime_ns >= before.mtime_ns and parent.nlink == before.nlink
    # committed state still has them; a read that may see them stores them first
    assert ov.peek(lambda r: ov.lookup(r, build, b"a.o")) == gone
    assert s.store.deferring(gone) and s.store.deferring(build)
    assert names(ov, "build") == ["b.o"] and s.store.deferred() == 0
    assert not exists(ov, "README.md")
    assert s.store.read(lambda r: ov.node(r, build)).mtime_ns == parent.mtime_ns
    ops = _journal_ops(s)
    assert ops[-2:] == [("unlink", ME.pid, ("build/a.o",)), ("unlink", OTHER.pid, ("README.md",))]
    assert removals.stored(s.store) == 2


CASES = {  # what is removed (is_rmdir, parent's path, name), and the error
    "missing": (False, "docs", b"nothing.txt", errno.ENOENT),
    "twice": (False, "docs", b"guide.txt", errno.ENOENT),
    "a directory": (False, "", b"docs", errno.EISDIR),
    "parent not a directory": (False, "README.md", b"x", errno.ENOTDIR),
    "rmdir of a file": (True, "docs", b"guide.txt", errno.ENOTDIR),
    "rmdir of a repo directory with files": (True, "", b"docs", errno.ENOTEMPTY),
    "rmdir of a directory one of whose files is left": (True, "gen", b"sub", errno.ENOTEMPTY),
    "rmdir twice": (True, "gen", b"sub", errno.ENOENT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_removal_fails_as_at_once_and_changes_nothing(
        logged: tuple[Session, RemovalLog], case: str) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "gen/sub/a.js", b"a")
    put(ov, ME, "gen/sub/b.js", b"b")
    sub = ino(ov, "gen/sub")
    is_rmdir, where, name, err = CASES[case]
    parent = ino(ov, where) if where else ROOT_INO
    ov.remove_later(ME, sub, b"a.js", False, log.append, _failed)  # (deferred: gen/sub keeps b.js)
    if case == "rmdir twice":
        ov.remove_later(ME, sub, b"b.js", False, log.append, _failed)
        ov.remove_later(ME, parent, name, True, log.append, _failed)
    if case == "twice":  # the first is deferred, not stored: the second must see it
        ov.remove_later(ME, parent, name, False, log.append, _failed)
    deferred, before = s.store.deferred(), log.last
    with pytest.raises(FsError) as later:
        ov.remove_later(ME, parent, name, is_rmdir, log.append, _failed)
    assert later.value.errno == err
    assert s.store.deferred() == deferred and log.last == before  # nothing logged
    if "twice" not in case:  # the same error as a removal committed at once
        with pytest.raises(FsError) as at_once:
            ov.remove(ME, parent, name, is_rmdir)
        assert at_once.value.errno == err


def test_a_tree_goes_as_rm_rf_removes_it(logged: tuple[Session, RemovalLog]) -> None:
    """Depth first, every removal deferred until the listing of the next directory:
    one commit, the same tree and journal as removals one by one."""
    s, log = logged
    ov = s.overlay
    for path in ("nm/a/index.js", "nm/a/lib/x.js", "nm/a/lib/y.js", "nm/b/index.js", "nm/c/.keep"):
        put(ov, ME, path, b"x")
    root = ino(ov, "")

    def rm_rf(path: str) -> None:
        at = ov.peek(lambda r: ov.resolve(r, path))  # (ino() would store what is deferred)
        for name, is_dir in ov.peek(lambda r: [(n, ov.node(r, c).is_dir) for n, c, _ in ov.entries(r, at)]):
            if is_dir:
                rm_rf(f"{path}/{os.fsdecode(name)}")
            ov.remove_later(ME, at, name, is_dir, log.append, _failed)
    rm_rf("nm")
    ov.remove_later(ME, root, b"nm", True, log.append, _failed)
    assert s.store.deferred() == 10  # (nothing stored in between)
    assert not exists(ov, "nm") and s.store.deferred() == 0
    ops = [(op, p) for op, _, p in _journal_ops(s)][-10:]
    assert ops[-1] == ("rmdir", ("nm",)) and ops[:4] == [
        ("unlink", ("nm/a/index.js",)), ("unlink", ("nm/a/lib/x.js",)),
        ("unlink", ("nm/a/lib/y.js",)), ("rmdir", ("nm/a/lib",))]
    assert removals.stored(s.store) == 10


def test_the_last_name_of_a_file_goes_and_a_new_one_of_that_name_comes(
        logged: tuple[Session, RemovalLog]) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "tmp.txt", b"old")
    ov.remove_later(ME, ROOT_INO, b"tmp.txt", False, log.append, _failed)
    # a create stores the unlink first, in the same transaction: the name is free
    made = ov.create(ME, ROOT_INO, b"tmp.txt", REG, 0, 0)[0]
    assert s.store.deferred() == 0 and ino(ov, "tmp.txt") == made
    assert [op for op, _, _ in _journal_ops(s)][-2:] == ["unlink", "create"]


def _answer_and_die(store: str, repo: str, paths: list[str]) -> None:
    """A daemon's end: answer these removals, then die before anything stores them."""
    s = Session.open(store, repo)
    log = RemovalLog(s.store)
    parents = [ino(s.overlay, p.rpartition("/")[0]) if "/" in p else ROOT_INO for p in paths]
    for path, parent in zip(paths, parents):
        name = path.rpartition("/")[2].encode()
        s.overlay.remove_later(ME, parent, name, path == "empty", log.append, _failed)
    assert s.store.deferred() == len(paths)
    os._exit(0)  # as kill -9: no close, nothing stored


def test_removals_answered_by_a_daemon_that_died_are_stored_at_the_next_open(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "st"
    s = Session.open(str(store), str(repo), create=True)
    for i in range(5):
        put(s.overlay, ME, f"gen/f{i}.js", b"x")
    s.close()
    paths = ["gen/f0.js", "gen/f3.js", "docs/guide.txt", "README.md", "empty"]
    child = multiprocessing.get_context("fork").Process(
        target=_answer_and_die, args=(str(store), str(repo), paths))
    child.start()
    child.join()
    assert child.exitcode == 0
    s = open_session(repo, store=store)
    assert names(s.overlay, "gen") == ["f1.js", "f2.js", "f4.js"]
    assert not exists(s.overlay, "docs/guide.txt") and not exists(s.overlay, "README.md")
    assert not exists(s.overlay, "empty")
    assert "stored 5 removals that a stopped daemon had answered" in caplog.text
    assert [(op, p) for op, _, p in _journal_ops(s) if op in ("unlink", "rmdir")] == \
        [("unlink", (p,)) for p in paths[:-1]] + [("rmdir", ("empty",))]
    # stored once: the open after that replays nothing
    caplog.clear()
    s = open_session(repo, store=store)
    assert "removals that a stopped daemon" not in caplog.text
    assert len([op for op, _, _ in _journal_ops(s) if op in ("unlink", "rmdir")]) == 5


def test_a_replay_that_cannot_be_stored_is_passed_and_a_torn_tail_ignored(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "st"
    s = open_session(repo, store=store)
    put(s.overlay, ME, "keep.txt", b"k")
    log = RemovalLog(s.store)
    log.append(ROOT_INO, b"never-there.txt", False, ME, 1, "")  # (logged, then the store failed it)
    log.append(ROOT_INO, b"keep.txt", False, ME, 2, "")
    log.close()
    path = store / removals.LOG_NAME
    path.write_bytes(path.read_bytes()[:-3])  # the second record torn: never answered
    s = open_session(repo, store=store)
    assert exists(s.overlay, "keep.txt")
    assert "could not be stored again" in caplog.text
    assert removals.stored(s.store) == 1  # passed, not tried at every open


def test_the_log_is_emptied_once_all_of_it_is_stored(
        logged: tuple[Session, RemovalLog], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(removals, "TRIM_BYTES", 40)
    s, log = logged
    ov = s.overlay
    for i in range(4):
        put(ov, ME, f"t{i}", b"x")
    path = Path(s.store.path) / removals.LOG_NAME
    ov.remove_later(ME, ROOT_INO, b"t0", False, log.append, _failed)
    ov.remove_later(ME, ROOT_INO, b"t1", False, log.append, _failed)
    grown = path.stat().st_size
    assert grown > 40
    # not all stored yet: kept, whatever its size
    ov.remove_later(ME, ROOT_INO, b"t2", False, log.append, _failed)
    assert path.stat().st_size > grown
    s.store.store_deferred()
    ov.remove_later(ME, ROOT_INO, b"t3", False, log.append, _failed)  # all stored before it: emptied first
    assert 0 < path.stat().st_size < grown
    s.store.store_deferred()
    assert not any(n.startswith("t") for n in names(ov))
