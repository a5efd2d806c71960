"""A writer that outruns the disk waits in its own requests, not in everyone's (issue 18).

The store sits on tests/faultfs.py, whose --hold-fsync holds every fsync of the
store's `synced` file (the last step of a sync point, synced.py) for as long as the
test wants: a disk that takes that long to sync. LMDB's own file stays writable
(FUSE holds a file's inode lock during its fsync, so holding data.mdb's would stop
every commit, which a real disk does not). A big writer then grows the store past
what the store lets a writer get ahead of a sync point under way (AHEAD_PAGES), so
it must wait for that sync point; a stat and a read of other files, from another
process, must still be answered meanwhile.
"""
from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from conftest import daemon_log_problems, force_unmount, make_repo, run_cli, stop_daemon, wait_for
from helpers_faultfs import faultfs
from overlayckpt.store import synced
from overlayckpt.store.lmdbstore import AHEAD_PAGES
from test_promptness import _wchan

T = TypeVar("T")

MB = 1 << 20
WRITTEN = 64 * MB  # far more than a writer may get ahead (AHEAD_PAGES pages, 8 MiB)
ANSWER = 30.0  # what the stat and the read get (they take milliseconds)
LAST_PG_AT = synced.PAGE_HEADER + 120  # MDB_meta's mm_last_pg, before mm_txnid

WRITER = r'''
import hashlib, os, sys
path, total = sys.argv[1], int(sys.argv[2])
digest = hashlib.blake2b()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for _ in range(total >> 20):
    chunk = os.urandom(1 << 20)  # incompressible and never deduplicated: every MiB grows the store
    digest.update(chunk)
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]
os.close(fd)
print(digest.hexdigest(), flush=True)
'''


def _answered_in_time(fn: Callable[[], T], what: str) -> T:
    """fn() from another thread: its result, or fail if it does not return within ANSWER."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(ANSWER)
    assert out, f"{what} was not answered within {ANSWER:g} s while a writer waited for the disk"
    return out[0]


def test_stat_and_read_are_answered_while_a_writer_waits_for_the_disk(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    repo = make_repo(tmp_path / "repo")
    image, disk, mnt = tmp_path / "disk", tmp_path / "diskmnt", tmp_path / "mnt"
    hold, held = Path(f"{image}.hold"), Path(f"{image}.held")
    mnt.mkdir()
    with faultfs(image, disk, mode="drop", extra=("--hold-fsync", synced.FILE_NAME)):
        store = disk / "store"
        writer = None
        try:
            run_cli("mount", str(repo), str(mnt), "--store", str(store))
            hold.touch()
            writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mnt / "big.bin"), str(WRITTEN)],
                                      stdout=subprocess.PIPE, text=True)
            wait_for(held.exists, "a sync point to wait for the disk")
            # the sync point's record is written, its fdatasync held: it names the pages
            # the writer grows the store from
            point = synced.load(str(store))
            assert point is not None
            last_pg = struct.unpack_from("<Q", point.meta, LAST_PG_AT)[0]
            far = (last_pg + AHEAD_PAGES + 1) * point.psize
            wait_for(lambda: (store / synced.DATA_NAME).stat().st_size >= far,
                     "the writer to get too far ahead of the sync point")
            # from here the writer cannot finish: it waits for the sync point
            st = _answered_in_time(lambda: os.stat(mnt / "src" / "pkg" / "util.py"), "a stat")
            assert st.st_size == (repo / "src" / "pkg" / "util.py").stat().st_size
            data = _answered_in_time(lambda: (mnt / "docs" / "guide.txt").read_bytes(), "a read")
            assert data == (repo / "docs" / "guide.txt").read_bytes()
            assert writer.poll() is None, "the writer finished while its sync point was held"
            seen: list[str] = []  # (where it waited instead, should it not get there)

            def in_a_request() -> bool:
                seen.append(_wchan(writer.pid))
                return seen[-1] == "request_wait_answer"
            try:
                wait_for(in_a_request, "the writer to wait in a write request")
            except AssertionError as e:
                raise AssertionError(f"{e}; it waited in {sorted(set(seen[-50:]))}") from None
            assert held.exists()
            hold.unlink()  # the disk catches up: so does the writer
            out, _ = writer.communicate(timeout=300)
            assert writer.returncode == 0
            assert hashlib.blake2b((mnt / "big.bin").read_bytes()).hexdigest() == out.strip()
        finally:
            hold.unlink(missing_ok=True)
            if writer is not None and writer.poll() is None:
                writer.kill()
                writer.wait()
            force_unmount(str(mnt))
            problem = stop_daemon(store)
        assert problem is None, problem
        fsck = run_cli("--store", str(store), "fsck", check=False)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
        # (the daemon's log goes with faultfs: checked here)
        assert not daemon_log_problems(request.node.nodeid)
