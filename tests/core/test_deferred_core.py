"""Writes deferred to the next transaction (Store.defer, Overlay.write_later).

An acknowledged write (write-behind) commits with whatever writes next, or when
its inode is read: one commit for several writes, or for a write and the create
after it. What must hold: the state after is the same as with each write
committed at once, in the same order; a read of the written inode, a sync point,
and the store's close see the write (a command flushes first: fuse/ops.py); a write that fails alone fails
alone, told through its callback, and takes nothing else with it.
"""
from __future__ import annotations

import errno
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from overlayckpt.errors import FsError
from overlayckpt.records import ROOT_INO
from overlayckpt.service.session import Session
from overlayckpt.store.lmdbstore import MAX_DEFERRED, MAX_DEFERRED_BYTES

from .helpers_core import ME, OTHER, content, ino

REG = stat.S_IFREG | 0o644


def test_a_deferred_write_commits_with_the_next_operation_in_order(
        open_session: Callable[..., Session], repo: Path) -> None:
    s = open_session(repo)
    ov = s.overlay
    readme = ino(ov, "README.md")
    failures: list[Exception] = []
    ov.write_later(ME, readme, 0, b"first", b"", failures.append)
    ov.write_later(ME, readme, 0, b"FI", b"", failures.append)
    assert s.store.deferred() == 2
    # a read that does not flush sees the committed state: the repo's file
    assert ov.peek(lambda r: ov.read_all(r, readme)).startswith(b"# demo")
    new = ov.create(OTHER, ROOT_INO, b"after.txt", REG, 0, 0)[0]  # one transaction, writes first
    assert s.store.deferred() == 0 and not failures
    assert ov.peek(lambda r: ov.read_all(r, readme)).startswith(b"FIrst")
    assert ov.peek(lambda r: ov.node(r, new)).size == 0
    # journaled as if each had committed at once, in order: two writes, then the create
    ops = [rec.op for rec in s.store.read(lambda r: list(_records(r)))]
    assert ops[-3:] == ["write", "write", "create"]


def _records(r):
    from overlayckpt.core.journal import JournalRecord
    from overlayckpt.records import from_u64
    from overlayckpt.tables import JOURNAL
    for key, raw in r.prefix(JOURNAL, b""):
        yield JournalRecord.unpack(from_u64(key), raw)


def test_reads_syncs_and_close_store_what_is_deferred(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path) -> None:
    s = open_session(repo, store=tmp_path / "st")
    ov = s.overlay
    readme = ino(ov, "README.md")
    ov.write_later(ME, readme, 0, b"read", b"", lambda e: None)
    assert content(ov, "README.md").startswith(b"read")  # live reads flush
    assert s.store.deferred() == 0
    ov.write_later(ME, readme, 0, b"sync", b"", lambda e: None)
    s.store.sync_begin()
    assert s.store.deferred() == 0
    ov.write_later(ME, readme, 0, b"shut", b"", lambda e: None)
    s = open_session(repo, store=tmp_path / "st")  # closes the first, then opens again
    assert content(s.overlay, "README.md").startswith(b"shut")


def test_a_deferred_write_that_fails_alone_fails_alone(
        open_session: Callable[..., Session], repo: Path) -> None:
    s = open_session(repo)
    ov = s.overlay
    readme, docs = ino(ov, "README.md"), ino(ov, "docs")
    failures: list[Exception] = []
    ov.write_later(ME, readme, 0, b"kept", b"", failures.append)
    ov.write_later(ME, docs, 0, b"a directory", b"", failures.append)  # EINVAL inside
    ov.write_later(ME, readme, 4, b"!", b"", failures.append)
    new = ov.create(ME, ROOT_INO, b"also.txt", REG, 0, 0)[0]
    assert [e.errno for e in failures if isinstance(e, FsError)] == [errno.EINVAL]
    assert content(ov, "README.md").startswith(b"kept!")
    assert ov.peek(lambda r: ov.node(r, new)).is_reg
    # an operation that fails itself still fails, after the deferred writes went in
    ov.write_later(ME, readme, 0, b"more", b"", failures.append)
    try:
        ov.create(ME, ROOT_INO, b"also.txt", REG, 0, 0)
    except FsError as e:
        assert e.errno == errno.EEXIST
    else:
        raise AssertionError("a second create of also.txt succeeded")
    assert content(ov, "README.md").startswith(b"more!") and len(failures) == 1


def test_deferred_writes_are_bounded_in_count_and_bytes(
        open_session: Callable[..., Session], repo: Path) -> None:
    s = open_session(repo)
    ov = s.overlay
    readme = ino(ov, "README.md")
    for i in range(MAX_DEFERRED + 3):
        ov.write_later(ME, readme, i, b"x", b"", lambda e: None)
        assert s.store.deferred() < MAX_DEFERRED
    big = b"y" * (MAX_DEFERRED_BYTES // 2 + 1)
    ov.write_later(ME, readme, 0, big, b"", lambda e: None)
    ov.write_later(ME, readme, 0, big, b"", lambda e: None)
    assert s.store.deferred() == 0
    assert content(ov, "README.md")[:4] == b"yyyy"


def test_a_deferred_write_is_told_apart_by_its_inode(
        open_session: Callable[..., Session], repo: Path) -> None:
    s = open_session(repo)
    ov = s.overlay
    readme, docs = ino(ov, "README.md"), ino(ov, "docs")
    ov.write_later(ME, readme, 0, b"x", b"", lambda e: None)
    assert s.store.deferring(readme) and not s.store.deferring(docs)
    # another thread's read neither flushes nor sees it (a command's worker)
    seen: list[bytes] = []
    t = threading.Thread(target=lambda: seen.append(s.store.read(lambda r: ov.read_all(r, readme))))
    t.start()
    t.join()
    assert seen[0].startswith(b"# demo") and s.store.deferred() == 1
