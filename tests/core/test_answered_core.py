"""Creates and removals answered before they are stored (core/answered.py).

A create, unlink or rmdir is checked against the live state (what was answered
and not stored included), logged, answered, and committed with the next write
transaction. What must hold: the same errors as an operation committed at once,
for the same reasons; the state and the journal after the commit the same as
with each committed at once (a create's inode the number it was answered with);
every read that may see the name sees it as answered; and what a daemon that
died before storing it answered is stored by the next open, once.
"""
from __future__ import annotations

import errno
import multiprocessing
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from overlayckpt.core import answered
from overlayckpt.core.answered import Answered
from overlayckpt.core.journal import next_seq, records
from overlayckpt.errors import FsError
from overlayckpt.fuse.ops import Operations
from overlayckpt.records import ROOT_INO
from overlayckpt.service.session import Session

from .helpers_core import ME, OTHER, content, exists, ino, names, node, put

REG = stat.S_IFREG | 0o644


def _failed(e: Exception) -> None:
    raise AssertionError(f"a checked removal failed when stored: {e!r}")


@pytest.fixture
def logged(session: Session) -> Iterator[tuple[Session, Answered]]:
    """A session of the small repo and its removal log (closed at teardown)."""
    log = Answered(session.overlay)
    yield session, log
    log.close()


def _journal_ops(s: Session) -> list[tuple[str, int, tuple[str, ...]]]:
    return s.store.read(lambda r: [(rec.op, rec.pid, rec.paths)
                                   for rec in records(r, 0, next_seq(r), undo=False)])


def test_unlinks_are_answered_then_stored_together_in_order(
        logged: tuple[Session, Answered]) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "build/a.o", b"a")
    put(ov, ME, "build/b.o", b"b")
    build = ino(ov, "build")
    before = s.store.read(lambda r: ov.node(r, build))
    gone, parent = log.remove(ME, build, b"a.o", False, _failed)
    log.remove(OTHER, ROOT_INO, b"README.md", False, _failed)  # a repo file: a whiteout
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
    assert answered.stored(s.store) == 2


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
        logged: tuple[Session, Answered], case: str) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "gen/sub/a.js", b"a")
    put(ov, ME, "gen/sub/b.js", b"b")
    sub = ino(ov, "gen/sub")
    is_rmdir, where, name, err = CASES[case]
    parent = ino(ov, where) if where else ROOT_INO
    log.remove(ME, sub, b"a.js", False, _failed)  # (deferred: gen/sub keeps b.js)
    if case == "rmdir twice":
        log.remove(ME, sub, b"b.js", False, _failed)
        log.remove(ME, parent, name, True, _failed)
    if case == "twice":  # the first is deferred, not stored: the second must see it
        log.remove(ME, parent, name, False, _failed)
    deferred, before = s.store.deferred(), log.last
    with pytest.raises(FsError) as later:
        log.remove(ME, parent, name, is_rmdir, _failed)
    assert later.value.errno == err
    assert s.store.deferred() == deferred and log.last == before  # nothing logged
    if "twice" not in case:  # the same error as a removal committed at once
        with pytest.raises(FsError) as at_once:
            ov.remove(ME, parent, name, is_rmdir)
        assert at_once.value.errno == err


def test_a_tree_goes_as_rm_rf_removes_it(logged: tuple[Session, Answered]) -> None:
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
            log.remove(ME, at, name, is_dir, _failed)
    rm_rf("nm")
    log.remove(ME, root, b"nm", True, _failed)
    assert s.store.deferred() == 10  # (nothing stored in between)
    assert not exists(ov, "nm") and s.store.deferred() == 0
    ops = [(op, p) for op, _, p in _journal_ops(s)][-10:]
    assert ops[-1] == ("rmdir", ("nm",)) and ops[:4] == [
        ("unlink", ("nm/a/index.js",)), ("unlink", ("nm/a/lib/x.js",)),
        ("unlink", ("nm/a/lib/y.js",)), ("rmdir", ("nm/a/lib",))]
    assert answered.stored(s.store) == 10


def test_the_last_name_of_a_file_goes_and_a_new_one_of_that_name_comes(
        logged: tuple[Session, Answered]) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "tmp.txt", b"old")
    log.remove(ME, ROOT_INO, b"tmp.txt", False, _failed)
    # a create stores the unlink first, in the same transaction: the name is free
    made = ov.create(ME, ROOT_INO, b"tmp.txt", REG, 0, 0)[0]
    assert s.store.deferred() == 0 and ino(ov, "tmp.txt") == made
    assert [op for op, _, _ in _journal_ops(s)][-2:] == ["unlink", "create"]


def _as_a_daemon_that_dies(end: Callable[..., None], store: Path, repo: Path, *args: object) -> None:
    """end(store, repo, *args) in a forked process, which then exits as kill -9 would: no
    close, nothing stored."""
    def run() -> None:
        end(str(store), str(repo), *args)
        os._exit(0)
    child = multiprocessing.get_context("fork").Process(target=run)
    child.start()
    child.join()
    assert child.exitcode == 0


def _answer_and_die(store: str, repo: str, paths: list[str]) -> None:
    """A daemon's end: answer these removals, then die before anything stores them."""
    s = Session.open(store, repo)
    log = Answered(s.overlay)
    parents = [ino(s.overlay, p.rpartition("/")[0]) if "/" in p else ROOT_INO for p in paths]
    for path, parent in zip(paths, parents):
        name = path.rpartition("/")[2].encode()
        log.remove(ME, parent, name, path == "empty", _failed)
    assert s.store.deferred() == len(paths)


def test_removals_answered_by_a_daemon_that_died_are_stored_at_the_next_open(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "st"
    s = Session.open(str(store), str(repo), create=True)
    for i in range(5):
        put(s.overlay, ME, f"gen/f{i}.js", b"x")
    s.close()
    paths = ["gen/f0.js", "gen/f3.js", "docs/guide.txt", "README.md", "empty"]
    _as_a_daemon_that_dies(_answer_and_die, store, repo, paths)
    s = open_session(repo, store=store)
    assert names(s.overlay, "gen") == ["f1.js", "f2.js", "f4.js"]
    assert not exists(s.overlay, "docs/guide.txt") and not exists(s.overlay, "README.md")
    assert not exists(s.overlay, "empty")
    assert "stored 5 creates and removals that a stopped daemon had answered" in caplog.text
    assert [(op, p) for op, _, p in _journal_ops(s) if op in ("unlink", "rmdir")] == \
        [("unlink", (p,)) for p in paths[:-1]] + [("rmdir", ("empty",))]
    # stored once: the open after that replays nothing
    caplog.clear()
    s = open_session(repo, store=store)
    assert "that a stopped daemon had answered" not in caplog.text
    assert len([op for op, _, _ in _journal_ops(s) if op in ("unlink", "rmdir")]) == 5


def test_a_replay_that_cannot_be_stored_is_passed_and_a_torn_tail_ignored(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "st"
    s = open_session(repo, store=store)
    put(s.overlay, ME, "keep.txt", b"k")
    log = Answered(s.overlay)
    log._append([ROOT_INO, b"never-there.txt", ME.pid, ME.comm, 1, b"", False])  # (then it failed)
    log._append([ROOT_INO, b"keep.txt", ME.pid, ME.comm, 2, b"", False])
    log.close()
    path = store / answered.LOG_NAME
    path.write_bytes(path.read_bytes()[:-3])  # the second record torn: never answered
    s = open_session(repo, store=store)
    assert exists(s.overlay, "keep.txt")
    assert "could not be stored again" in caplog.text
    assert answered.stored(s.store) == 1  # passed, not tried at every open


def test_the_log_is_emptied_once_all_of_it_is_stored(
        logged: tuple[Session, Answered], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(answered, "TRIM_BYTES", 40)
    s, log = logged
    ov = s.overlay
    for i in range(4):
        put(ov, ME, f"t{i}", b"x")
    path = Path(s.store.path) / answered.LOG_NAME
    log.remove(ME, ROOT_INO, b"t0", False, _failed)
    log.remove(ME, ROOT_INO, b"t1", False, _failed)
    grown = path.stat().st_size
    assert grown > 40
    # not all stored yet: kept, whatever its size
    log.remove(ME, ROOT_INO, b"t2", False, _failed)
    assert path.stat().st_size > grown
    s.store.store_deferred()
    log.remove(ME, ROOT_INO, b"t3", False, _failed)  # all stored before it: emptied first
    assert 0 < path.stat().st_size < grown
    s.store.store_deferred()
    assert not any(n.startswith("t") for n in names(ov))


# -- creates -------------------------------------------------------------------


def test_creates_are_answered_with_the_inodes_their_commit_takes(
        logged: tuple[Session, Answered]) -> None:
    """A burst of creates and their first writes, answered, then stored in one commit:
    each file has the inode number it was answered with, the content written, and the
    journal names them as creates one by one would have."""
    s, log = logged
    ov = s.overlay
    put(ov, ME, "gen/keep.js", b"k")
    gen = ino(ov, "gen")
    before = s.store.read(lambda r: ov.node(r, gen))
    made = []
    for i in range(5):
        number, node, parent = log.create(ME, gen, b"m%d.js" % i, REG, 1000, 1000, _failed)
        ov.write_later(ME, number, 0, b"module %d\n" % i, b"\0" * 16, _failed)
        made.append(number)
        assert node.size == 0 and node.nlink == 1 and stat.S_ISREG(node.mode)
        assert parent.nlink == before.nlink and parent.mtime_ns == parent.ctime_ns == node.mtime_ns
    assert made == list(range(made[0], made[0] + 5)) and s.store.deferred() == 10
    assert ov.peek(lambda r: ov.entries(r, gen))[-1][0] == b"keep.js"  # (not stored yet)
    s.store.store_deferred()
    assert [ino(ov, f"gen/m{i}.js") for i in range(5)] == made
    assert [content(ov, f"gen/m{i}.js") for i in range(5)] == [b"module %d\n" % i for i in range(5)]
    assert s.store.read(lambda r: ov.node(r, gen)).mtime_ns == parent.mtime_ns  # as answered
    assert [(op, p) for op, _, p in _journal_ops(s)][-10:] == [
        (op, (f"gen/m{i}.js",)) for i in range(5) for op in ("create", "write")]
    # the next inode a create takes, answered or not, is the one after them
    assert ov.create(ME, gen, b"later.js", REG, 0, 0)[0] == made[-1] + 1
    assert log.create(ME, gen, b"later2.js", REG, 0, 0, _failed)[0] == made[-1] + 2


CREATE_CASES = {  # where a file is made (parent's path, name), and the error
    "a file's name": ("docs", b"guide.txt", errno.EEXIST),
    "a directory's name": ("", b"docs", errno.EEXIST),
    "a name made and not stored yet": ("gen", b"new.js", errno.EEXIST),
    "parent not a directory": ("README.md", b"x", errno.ENOTDIR),
    "a name too long": ("gen", b"n" * 256, errno.ENAMETOOLONG),
    "the control directory's name": ("", b".overlayckpt", errno.EPERM),
}


@pytest.mark.parametrize("case", list(CREATE_CASES))
def test_a_bad_create_fails_as_at_once_and_changes_nothing(
        logged: tuple[Session, Answered], case: str) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "gen/a.js", b"a")
    where, name, err = CREATE_CASES[case]
    parent = ino(ov, where) if where else ROOT_INO
    log.create(ME, ino(ov, "gen"), b"new.js", REG, 0, 0, _failed)
    deferred, before = s.store.deferred(), log.last
    with pytest.raises(FsError) as later:
        log.create(ME, parent, name, REG, 0, 0, _failed)
    assert later.value.errno == err
    assert s.store.deferred() == deferred and log.last == before  # nothing logged
    with pytest.raises(FsError) as at_once:  # the same error as a create committed at once
        ov.create(ME, parent, name, REG, 0, 0)
    assert at_once.value.errno == err


def test_names_made_and_not_stored_are_seen_by_every_change_of_names(
        logged: tuple[Session, Answered]) -> None:
    s, log = logged
    ov = s.overlay
    put(ov, ME, "gen/old.js", b"old")
    gen = ino(ov, "gen")
    # a removal's name freed by it: made again, a new inode
    old = ino(ov, "gen/old.js")
    log.remove(ME, gen, b"old.js", False, _failed)
    again = log.create(ME, gen, b"old.js", REG, 0, 0, _failed)[0]
    assert again != old
    # a directory whose only name is one made and not stored is not empty
    empty = ov.create(ME, gen, b"empty", stat.S_IFDIR | 0o755, 0, 0)[0]
    log.create(ME, empty, b"f", REG, 0, 0, _failed)
    with pytest.raises(FsError) as e:
        log.remove(ME, gen, b"empty", True, _failed)
    assert e.value.errno == errno.ENOTEMPTY
    # a name made and not stored can be removed at once
    log.create(ME, gen, b"tmp.js", REG, 0, 0, _failed)
    log.remove(ME, gen, b"tmp.js", False, _failed)
    s.store.store_deferred()
    assert names(ov, "gen") == ["empty", "old.js"] and ino(ov, "gen/old.js") == again
    assert names(ov, "gen/empty") == ["f"]


def test_directories_made_and_not_stored_take_names_and_count_links(
        logged: tuple[Session, Answered]) -> None:
    """A package's directories and files made one after the other, each in a directory
    not stored yet: one commit, the tree and journal as made one by one, each parent's
    link count in its answer as stored."""
    s, log = logged
    ov = s.overlay
    put(ov, ME, "gen/keep.js", b"k")
    gen = ino(ov, "gen")
    links = s.store.read(lambda r: ov.node(r, gen)).nlink
    pkg, dnode, parent = log.create(ME, gen, b"pkg", stat.S_IFDIR | 0o755, 0, 0, _failed)
    assert stat.S_ISDIR(dnode.mode) and dnode.nlink == 2 and parent.nlink == links + 1
    lib, _, in_pkg = log.create(ME, pkg, b"lib", stat.S_IFDIR | 0o755, 0, 0, _failed)
    assert in_pkg.nlink == 3
    index = log.create(ME, pkg, b"index.js", REG, 0, 0, _failed)[0]
    log.create(ME, lib, b"a.js", REG, 0, 0, _failed)
    with pytest.raises(FsError) as e:  # a name being made, in a directory being made
        log.create(ME, pkg, b"lib", stat.S_IFDIR | 0o755, 0, 0, _failed)
    assert e.value.errno == errno.EEXIST
    with pytest.raises(FsError) as e:  # not empty: its removal stores them first, and finds a.js
        log.remove(ME, pkg, b"lib", True, _failed)
    assert e.value.errno == errno.ENOTEMPTY and s.store.deferred() == 0
    assert names(ov, "gen/pkg") == ["index.js", "lib"] and names(ov, "gen/pkg/lib") == ["a.js"]
    assert ino(ov, "gen/pkg/index.js") == index and node(ov, "gen/pkg").nlink == 3
    assert node(ov, "gen").nlink == links + 1
    assert [(op, p) for op, _, p in _journal_ops(s)][-4:] == [
        ("mkdir", ("gen/pkg",)), ("mkdir", ("gen/pkg/lib",)), ("create", ("gen/pkg/index.js",)),
        ("create", ("gen/pkg/lib/a.js",))]


def _create_and_die(store: str, repo: str) -> None:
    """A daemon's end: answer a removal and creates (one of the removed name), then die
    before anything stores them."""
    s = Session.open(store, repo)
    log = Answered(s.overlay)
    gen = ino(s.overlay, "gen")
    log.remove(ME, gen, b"a.js", False, _failed)
    for name in (b"n0.js", b"a.js", b"n2.js", b"n3.js"):
        log.create(ME, gen, name, REG | 0o4000, 1000, 1000, _failed)  # (setuid kept as asked)
    sub = log.create(ME, gen, b"sub", stat.S_IFDIR | 0o750, 0, 0, _failed)[0]
    log.create(ME, sub, b"in.js", REG, 0, 0, _failed)
    assert s.store.deferred() == 7


def test_creates_answered_by_a_daemon_that_died_are_stored_at_the_next_open(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "st"
    s = Session.open(str(store), str(repo), create=True)
    put(s.overlay, ME, "gen/a.js", b"a")
    first = s.overlay.create(ME, ROOT_INO, b"probe", REG, 0, 0)[0] + 1
    s.close()
    _as_a_daemon_that_dies(_create_and_die, store, repo)
    s = open_session(repo, store=store)
    assert names(s.overlay, "gen") == ["a.js", "n0.js", "n2.js", "n3.js", "sub"]
    assert names(s.overlay, "gen/sub") == ["in.js"] and node(s.overlay, "gen/sub").mode == stat.S_IFDIR | 0o750
    assert [ino(s.overlay, f"gen/{n}") for n in ("n0.js", "a.js", "n2.js", "n3.js")] == \
        list(range(first, first + 4))
    made = node(s.overlay, "gen/a.js")
    assert (made.mode, made.uid, made.gid, made.size) == (REG | 0o4000, 1000, 1000, 0)
    assert content(s.overlay, "gen/a.js") == b""
    assert "stored 7 creates and removals that a stopped daemon had answered" in caplog.text
    assert [(op, p) for op, _, p in _journal_ops(s)][-7:] == [("unlink", ("gen/a.js",))] + [
        ("create", (f"gen/{n}",)) for n in ("n0.js", "a.js", "n2.js", "n3.js")] + [
        ("mkdir", ("gen/sub",)), ("create", ("gen/sub/in.js",))]
    # stored once: the open after that replays nothing
    caplog.clear()
    s = open_session(repo, store=store)
    assert "that a stopped daemon had answered" not in caplog.text and names(s.overlay, "gen")[0] == "a.js"


@pytest.mark.parametrize("bad", ["a slash in the name", "a device's mode", "a boolean inode"])
def test_a_hostile_create_record_ends_the_replay(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path, bad: str) -> None:
    """The log is the store's own file, but a record that is not shaped like one of ours
    is damage: nothing from it on is replayed (no file outside its directory, no
    device node made from a create)."""
    store = tmp_path / "st"
    s = open_session(repo, store=store)
    log = Answered(s.overlay)
    name, mode, number = b"ok.js", REG, 1 << 40
    if bad == "a slash in the name":
        name = b"../../escape"
    elif bad == "a device's mode":
        mode = stat.S_IFCHR | 0o666
    log._append([ROOT_INO, name, ME.pid, ME.comm, 1, b"", True if bad == "a boolean inode" else number,
                 mode, 0, 0])
    log._append([ROOT_INO, b"after.js", ME.pid, ME.comm, 2, b"", number + 1, REG, 0, 0])
    log.close()
    s = open_session(repo, store=store)
    assert not exists(s.overlay, "ok.js") and not exists(s.overlay, "after.js")
    assert not (tmp_path.parent / "escape").exists()


def test_a_listing_stores_first_only_what_changes_what_it_shows(
        logged: tuple[Session, Answered]) -> None:
    """A directory's listing leaves deferred the changes elsewhere (an rm -rf lists each
    directory between the removals of the one before), and stores first those of the
    directory or of any name in it (their attributes are in the listing)."""
    s, log = logged
    ov = s.overlay
    put(ov, ME, "a/x", b"x")
    put(ov, ME, "a/y", b"y")
    put(ov, ME, "b/z", b"z")
    o = Operations(ov, None, answered=log)  # type: ignore[arg-type]  # (no control directory)
    a, b, z = ino(ov, "a"), ino(ov, "b"), ino(ov, "b/z")  # (a read stores what waits)

    def listed(d: int) -> dict[bytes, tuple[int, int, int]]:
        return {n: (e.st_ino, e.st_size, e.st_nlink) for n, e in o._listing(d)[0][2:]}

    log.remove(ME, a, b"x", False, _failed)
    assert listed(b) == {b"z": (z, 1, 1)}
    assert s.store.deferred() == 1  # (the removal in a waits)
    assert set(listed(a)) == {b"y"}
    assert s.store.deferred() == 0

    ov.write_later(ME, z, 0, b"longer", b"\0" * 16, _failed)  # (a write its writer was told is done)
    assert listed(b) == {b"z": (z, 6, 1)}
    assert s.store.deferred() == 0

    ov.link(ME, z, a, b"z2")
    log.remove(ME, a, b"z2", False, _failed)  # a's name, b's inode: its link count
    assert listed(b) == {b"z": (z, 6, 1)}
    assert s.store.deferred() == 0
