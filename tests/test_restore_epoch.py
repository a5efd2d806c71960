"""A big restore drops the kernel's caches exactly, by either path: every name,
cached or negative, shows the restored state, and so does every file's content
and mode, whether the kernel held them before or not.

A restore invalidates the names it changed one by one, in C; one that changes more
than mount.EPOCH_ABOVE names drops every cached name at once instead
(FUSE_NOTIFY_INC_EPOCH, Linux 6.16+). Either way it invalidates the inodes it changed
in C. OVERLAYCKPT_KERNEL_INVALIDATION=epoch takes the epoch for any restore that
changed a name, =entries never (older kernels' path). Both are run here, on a tree
the test has walked and read whole before each restore, so that the kernel holds
every name, attribute and page.
"""
from __future__ import annotations

import errno
import os
import platform
from pathlib import Path

import pytest

from conftest import tree_digest
from overlayckpt.mount import INVALIDATION_ENV

DIRS, PER_DIR = 10, 200  # 2,000 repo files under many/
EDITED = range(0, 2000, 2)  # in place: same inode, new content
CHMODDED = range(1, 2000, 10)
SAVED = range(3, 2000, 4)  # atomic saves: a new inode under the name
REMOVED = range(5, 2000, 4)
CREATED = 600


def rel(i: int) -> str:
    return f"many/d{i % DIRS:02d}/f{i:04d}.txt"


def kernel_has_epoch() -> bool:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 16)


def gone(path: Path) -> bool:
    try:
        os.lstat(path)
    except OSError as e:
        return e.errno == errno.ENOENT
    return False


@pytest.fixture
def big_repo(repo: Path) -> Path:
    for d in range(DIRS):
        (repo / "many" / f"d{d:02d}").mkdir(parents=True)
    for i in range(DIRS * PER_DIR):
        (repo / rel(i)).write_text(f"file {i}\n" + "x" * (i % 300))
    return repo


@pytest.mark.parametrize("path", ["epoch", "entries"])
def test_big_restore_exact(big_repo: Path, mount_factory, monkeypatch, path: str) -> None:
    monkeypatch.setenv(INVALIDATION_ENV, path)
    m = mount_factory(big_repo)
    mnt = m.mnt
    want = "epoch" if path == "epoch" and kernel_has_epoch() else "entries"
    assert m.ctl_ok({"cmd": "status"})["kernel_invalidation"] == want

    before = tree_digest(str(mnt))  # every name, attribute and page now cached
    assert len(before) > DIRS * PER_DIR
    a = m.ctl_ok({"cmd": "checkpoint", "name": "a"})["id"]

    for i in EDITED:
        with open(mnt / rel(i), "r+b") as f:
            f.write(b"EDITED ")
    for i in CHMODDED:
        os.chmod(mnt / rel(i), 0o600)
    for i in SAVED:
        tmp = mnt / (rel(i) + ".tmp")
        tmp.write_text(f"saved {i}\n")
        os.replace(tmp, mnt / rel(i))
    for i in REMOVED:
        os.unlink(mnt / rel(i))
    created = [mnt / "many" / f"d{i % DIRS:02d}" / f"new{i:04d}.txt" for i in range(CREATED)]
    for p in created:
        p.write_text("new\n")
    (mnt / "newdir" / "sub").mkdir(parents=True)
    (mnt / "newdir" / "sub" / "deep.txt").write_text("deep\n")
    (mnt / "README.md").write_text("changed readme\n")
    assert all(gone(mnt / rel(i)) for i in REMOVED)  # negative names cached too
    after = tree_digest(str(mnt))
    b = m.ctl_ok({"cmd": "checkpoint", "name": "b"})["id"]

    names_changed = len(SAVED) + len(REMOVED) + CREATED

    # files held open across the restores (their inodes stay in the kernel whatever
    # happens to their names): the restored content must show through these fds too
    held = {i: os.open(mnt / rel(i), os.O_RDONLY) for i in EDITED[:20]}
    for fd in held.values():
        assert os.pread(fd, 7, 0) == b"EDITED "  # (its pages cached)
    for target, state in ((a, before), (b, after), (a, before)):
        reply = m.ctl_ok({"cmd": "restore", "id": target})
        for i, fd in held.items():
            assert os.pread(fd, 7, 0).startswith(b"file " if state is before else b"EDITED "), rel(i)
        assert reply["changed_keys"] > names_changed
        # the names looked up one by one first (positive and negative dentries)
        for i in REMOVED:
            assert gone(mnt / rel(i)) == (state is after), rel(i)
        for p in created:
            assert gone(p) == (state is before), p
        assert gone(mnt / "newdir") == (state is before)
        for i, new in [(i, b"EDITED ") for i in EDITED[:50]] + [(i, b"saved ") for i in SAVED[:50]]:
            with open(mnt / rel(i), "rb") as f:
                head = f.read(7)
            assert head.startswith(b"file " if state is before else new), (rel(i), head)
        for i in set(CHMODDED) - set(SAVED) - set(REMOVED):
            mode = os.lstat(mnt / rel(i)).st_mode & 0o777
            assert (mode == 0o600) == (state is after), rel(i)
        # then the whole tree: listings, modes, sizes, contents, links
        assert tree_digest(str(mnt)) == state
    for fd in held.values():
        os.close(fd)
    # the checkpoint views agree with what the mount shows
    view = tree_digest(str(mnt / ".overlayckpt" / "checkpoints" / str(a)))
    assert view == before
