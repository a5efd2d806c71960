"""Unlinks answered before they are stored (Overlay.unlink_later, core/removals.py).

An unlink is checked against the live state (the deferred unlinks included),
logged, answered, and committed with the next write transaction. What must hold:
the same errors as an unlink committed at once, for the same reasons; the state
and the journal after the commit the same as with each unlink committed at once;
every read that may see the name sees it gone; and an unlink answered by a
daemon that died before storing it is stored by the next open, once.
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
from overlayckpt.core.removals import RemovalLog
from overlayckpt.errors import FsError
from overlayckpt.records import ROOT_INO
from overlayckpt.service.session import Session

from .helpers_core import ME, OTHER, exists, ino, names, put

REG = stat.S_IFREG | 0o644


def _failed(e: Exception) -> None:
    raise AssertionError(f"a checked unlink failed when stored: {e!r}")


@pytest.fixture
def logged(session: Session) -> Iterator[tuple[Session, RemovalLog]]:
    """A session of the small repo and its removal log (closed at teardown)."""
    log = RemovalLog(session.store)
    yield session, log


def _journal_ops(s: Session) -> list[tuple[str, int, tuple[str, ...]]]:
    from overlayckpt.core.journal import JournalRecord
    from overlayckpt.records import from_u64
    from overlayckpt.tables import JOURNAL
    return s.store.read(lambda r: [
        (rec.op, rec.pid, rec.paths) for rec in
        (JournalRecord.unpack(from_u64(k), v) for k, v in r.prefix(JOURNAL, b""))])


def test_unlinks_are_answered_then_stored_together_in_order(
        logged: tuple[Session, RemovalLog]) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "build/a.o", b"a")
    put(ov, ME, "build/b.o", b"b")
    build = ino(ov, "build")
    before = s.store.read(lambda r: ov.node(r, build))
    gone, parent = ov.unlink_later(ME, build, b"a.o", log.append, _failed)
    ov.unlink_later(OTHER, ROOT_INO, b"README.md", log.append, _failed)  # a repo file: a whiteout
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


@pytest.mark.parametrize("case", ["missing", "twice", "a directory", "parent not a directory"])
def test_a_bad_unlink_fails_as_at_once_and_changes_nothing(
        logged: tuple[Session, RemovalLog], case: str) -> None:
    s, log = logged
    ov = s.overlay
    docs, readme = ino(ov, "docs"), ino(ov, "README.md")
    parent, name, err = {
        "missing": (docs, b"nothing.txt", errno.ENOENT),
        "twice": (docs, b"guide.txt", errno.ENOENT),
        "a directory": (ROOT_INO, b"docs", errno.EISDIR),
        "parent not a directory": (readme, b"x", errno.ENOTDIR),
    }[case]
    if case == "twice":  # the first is deferred, not stored: the second must see it
        ov.unlink_later(ME, docs, b"guide.txt", log.append, _failed)
    else:  # the same error as an unlink committed at once
        with pytest.raises(FsError) as at_once:
            ov.remove(ME, parent, name, False)
        assert at_once.value.errno == err
    before = log.last
    with pytest.raises(FsError) as later:
        ov.unlink_later(ME, parent, name, log.append, _failed)
    assert later.value.errno == err
    assert s.store.deferred() == (case == "twice") and log.last == before  # nothing logged


def test_the_last_name_of_a_file_goes_and_a_new_one_of_that_name_comes(
        logged: tuple[Session, RemovalLog]) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "tmp.txt", b"old")
    ov.unlink_later(ME, ROOT_INO, b"tmp.txt", log.append, _failed)
    # a create stores the unlink first, in the same transaction: the name is free
    made = ov.create(ME, ROOT_INO, b"tmp.txt", REG, 0, 0)[0]
    assert s.store.deferred() == 0 and ino(ov, "tmp.txt") == made
    assert [op for op, _, _ in _journal_ops(s)][-2:] == ["unlink", "create"]


def _answer_and_die(store: str, repo: str, paths: list[str]) -> None:
    """A daemon's end: answer these unlinks, then die before anything stores them."""
    s = Session.open(store, repo)
    log = RemovalLog(s.store)
    parents = [ino(s.overlay, p.rpartition("/")[0]) if "/" in p else ROOT_INO for p in paths]
    for path, parent in zip(paths, parents):
        s.overlay.unlink_later(ME, parent, path.rpartition("/")[2].encode(), log.append, _failed)
    assert s.store.deferred() == len(paths)
    os._exit(0)  # as kill -9: no close, nothing stored


def test_unlinks_answered_by_a_daemon_that_died_are_stored_at_the_next_open(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "st"
    s = Session.open(str(store), str(repo), create=True)
    for i in range(5):
        put(s.overlay, ME, f"gen/f{i}.js", b"x")
    s.close()
    paths = ["gen/f0.js", "gen/f3.js", "docs/guide.txt", "README.md"]
    child = multiprocessing.get_context("fork").Process(
        target=_answer_and_die, args=(str(store), str(repo), paths))
    child.start()
    child.join()
    assert child.exitcode == 0
    s = open_session(repo, store=store)
    assert names(s.overlay, "gen") == ["f1.js", "f2.js", "f4.js"]
    assert not exists(s.overlay, "docs/guide.txt") and not exists(s.overlay, "README.md")
    assert "stored 4 unlinks that a stopped daemon had answered" in caplog.text
    assert [p for op, _, p in _journal_ops(s) if op == "unlink"] == [(p,) for p in paths]
    # stored once: the open after that replays nothing
    caplog.clear()
    s = open_session(repo, store=store)
    assert "unlinks that a stopped daemon" not in caplog.text
    assert len([op for op, _, _ in _journal_ops(s) if op == "unlink"]) == 4


def test_a_replay_that_cannot_be_stored_is_passed_and_a_torn_tail_ignored(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "st"
    s = open_session(repo, store=store)
    put(s.overlay, ME, "keep.txt", b"k")
    log = RemovalLog(s.store)
    log.append(ROOT_INO, b"never-there.txt", ME, 1, "")  # (logged, then the store failed it)
    log.append(ROOT_INO, b"keep.txt", ME, 2, "")
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
    ov.unlink_later(ME, ROOT_INO, b"t0", log.append, _failed)
    ov.unlink_later(ME, ROOT_INO, b"t1", log.append, _failed)
    grown = path.stat().st_size
    assert grown > 40
    # not all stored yet: kept, whatever its size
    ov.unlink_later(ME, ROOT_INO, b"t2", log.append, _failed)
    assert path.stat().st_size > grown
    s.store.store_deferred()
    ov.unlink_later(ME, ROOT_INO, b"t3", log.append, _failed)  # all stored before it: emptied first
    assert 0 < path.stat().st_size < grown
    s.store.store_deferred()
    assert names(ov) == [n for n in names(ov) if not n.startswith("t")]
