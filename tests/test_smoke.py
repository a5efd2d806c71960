"""First contact: the mount shows the repo, edits land in the store, not the repo."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

from conftest import Mount, tree_digest, wait_for


def test_mount_shows_repo(mounted: Mount) -> None:
    assert tree_digest(str(mounted.mnt)) == tree_digest(str(mounted.repo))


def test_control_dir_hidden_but_found(mounted: Mount) -> None:
    assert ".overlayckpt" not in os.listdir(mounted.mnt)
    assert os.path.isdir(mounted.mnt / ".overlayckpt")
    assert mounted.ctl({"cmd": "status"})["ok"]


def test_edits_stay_out_of_repo(mounted: Mount) -> None:
    (mounted.mnt / "README.md").write_text("changed\n")
    (mounted.mnt / "new.txt").write_text("new\n")
    os.unlink(mounted.mnt / "run.sh")
    assert (mounted.mnt / "README.md").read_text() == "changed\n"
    assert (mounted.mnt / "hardlink.md").read_text() == "changed\n"
    assert (mounted.repo / "README.md").read_text() == "# demo\n\nhello\n"
    assert not (mounted.repo / "new.txt").exists()


def test_names_need_not_be_utf8(mounted: Mount) -> None:
    name = os.path.join(os.fsencode(mounted.mnt), b"caf\xe9.txt")
    with open(name, "wb") as f:
        f.write(b"latin-1 name\n")
    assert b"caf\xe9.txt" in os.listdir(os.fsencode(mounted.mnt))
    log = mounted.ctl({"cmd": "log"})
    assert log["ok"] and any(f["path"] == "caf\udce9.txt" for c in log["checkpoints"] for f in c["files"])


def test_lower_files_keep_their_inode_numbers(mounted: Mount) -> None:
    # git's index recorded these numbers before the mount: equal numbers spare a re-hash
    for name in ("README.md", "src/main.py", "docs"):
        assert os.stat(mounted.mnt / name).st_ino == os.stat(mounted.repo / name).st_ino


def test_requests_without_state_are_answered_in_c(mounted: Mount) -> None:
    """The fast path library (fuse/csrc/) is built and in the daemon's path: without
    it the mount still works, only slower, so only this test would notice."""
    assert mounted.ctl({"cmd": "status"})["kernel_dir_cache"] is True
    path = mounted.mnt / "docs" / "guide.txt"
    before = os.listdir(mounted.mnt / "docs")
    with open(path, "rb") as f:  # opened in C: the handle is the inode number, marked
        data = f.read()
    (mounted.mnt / "docs" / "extra.md").write_text("x\n")  # drops the cached listing
    assert sorted(os.listdir(mounted.mnt / "docs")) == sorted(before + ["extra.md"])
    assert path.read_bytes() == data


def test_repo_metadata_is_read_ahead_without_leaving_the_repo(repo: Path, mount_factory,
                                                              tmp_path: Path) -> None:
    """The first lookup starts C threads that list every repo directory once (so a cold
    walk finds the inodes read); a symlink to a directory outside is not followed."""
    outside = tmp_path / "outside"
    (outside / "a" / "b").mkdir(parents=True)
    (repo / "docs" / "elsewhere").symlink_to(outside)
    repo_dirs = sum(1 for _ in os.walk(repo))  # os.walk does not follow symlinks either
    m = mount_factory(repo)
    os.stat(m.mnt / "src" / "main.py")

    def ended() -> bool:
        return m.ctl_ok({"cmd": "status"})["repo_read_ahead"]["done"]
    wait_for(ended, "the read-ahead walk to end", timeout=30)
    assert m.ctl_ok({"cmd": "status"})["repo_read_ahead"] == {"dirs": repo_dirs, "done": True}
    assert os.listdir(m.mnt / "docs" / "elsewhere") == ["a"]  # still reachable as a symlink


def _pages_cached(path: Path) -> int:
    """How many of the file's pages are in the kernel's page cache (mincore on a
    private mapping: mapping reads nothing)."""
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        vec = ctypes.create_string_buffer((len(mm) + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        start = ctypes.c_char.from_buffer(mm)  # its address; released before mm closes
        try:
            assert mincore(ctypes.addressof(start), len(mm), vec) == 0, \
                os.strerror(ctypes.get_errno())
        finally:
            del start
    return sum(b & 1 for b in vec.raw)


def test_written_pages_stay_cached_after_stat(mounted: Mount) -> None:
    """A file written through the mount is read back from the kernel's cache: the stat
    after a write shows a new mtime, which must not drop the pages (auto_inval_data)."""
    path = mounted.mnt / "docs" / "written.bin"
    data = os.urandom(64 * mmap.PAGESIZE)
    with open(path, "wb") as f:
        f.write(data)
    os.stat(path)  # the write left the attributes stale: this asks the daemon
    assert _pages_cached(path) == 64
    assert path.read_bytes() == data


def test_file_capabilities_are_not_kept(mounted: Mount) -> None:
    """security.capability is answered "none" in C before every write; setting one is
    refused (the mount is nosuid, where capabilities have no effect anyway)."""
    path = mounted.mnt / "run.sh"
    try:
        os.getxattr(path, "security.capability")
        raise AssertionError("security.capability should be absent")
    except OSError as e:
        assert e.errno == errno.ENODATA
    try:
        os.setxattr(path, "security.capability", b"\x01\x00\x00\x02" + b"\x00" * 16)
        raise AssertionError("setting security.capability should fail")
    except OSError as e:
        assert e.errno == errno.EOPNOTSUPP
    assert "security.capability" not in os.listxattr(path)
    os.setxattr(path, "user.kept", b"1")
    assert os.getxattr(path, "user.kept") == b"1"
