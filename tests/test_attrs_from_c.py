"""The GETATTRs a walk sends after a restore, answered in C (fuse/forgotten.py,
fuse/csrc/names.c), give what the checkpoint had, and no change after one leaves it
stale.

A restore makes the kernel forget the attributes of every inode it changed; a walk then
asks for each. Python answers the first of a run and publishes the next ones to C.
Each walk below must see exactly what the same walk saw when the checkpoint was made:
inode, mode, links, owner, size, times, blocks.
"""
from __future__ import annotations

import os
from pathlib import Path

from conftest import Mount, MountFactory

DIRS, FILES = 4, 150


def snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            out[str(p.relative_to(root))] = (st.st_ino, st.st_mode, st.st_nlink, st.st_uid,
                                             st.st_gid, st.st_size, st.st_mtime_ns,
                                             st.st_ctime_ns, st.st_blocks, st.st_blksize)
    return out


def attrs_from_c(m: Mount) -> int:
    return m.ctl_ok({"cmd": "status"})["attrs_from_c"]


def big_repo(path: Path) -> Path:
    path.mkdir()
    for d in range(DIRS):
        (path / f"d{d}").mkdir()
        for f in range(FILES):
            (path / f"d{d}" / f"f{f:03d}.txt").write_text(f"file {d}/{f}\n" * (f % 7 + 1))
    return path


def test_a_walk_after_a_restore_sees_the_checkpoint(tmp_path: Path, mount_factory: MountFactory
                                                    ) -> None:
    m = mount_factory(big_repo(tmp_path / "repo"))
    root = m.mnt
    at_a = snapshot(root)
    a = m.ctl_ok({"cmd": "checkpoint", "name": "a"})["id"]
    # every file changed in place (the kernel keeps the directories' listings: a GETATTR
    # per file follows a restore), and in the last directory names too
    for d in range(DIRS):
        for f in range(FILES):
            p = root / f"d{d}" / f"f{f:03d}.txt"
            if d < DIRS - 1:
                (os.chmod(p, 0o600) if f % 3 == 0 else
                 os.utime(p, ns=(f * 10**9, f * 10**9)) if f % 3 == 1 else
                 p.write_bytes(p.read_bytes() + b"more\n" * f))
            elif f % 10 == 0:
                tmp = p.with_name(p.name + ".tmp")
                tmp.write_text("saved\n")
                os.replace(tmp, p)  # (a new inode under the name)
            elif f % 10 == 1:
                os.chmod(p, 0o600)
            elif f % 10 == 2:
                os.unlink(p)
            else:
                with open(p, "a") as out:
                    out.write("more\n" * f)
    (root / f"d{DIRS - 1}" / "new.txt").write_text("new\n")
    at_b = snapshot(root)
    b = m.ctl_ok({"cmd": "checkpoint", "name": "b"})["id"]
    for target, want in ((a, at_a), (b, at_b), (a, at_a)):
        before = attrs_from_c(m)
        m.ctl_ok({"cmd": "restore", "id": target})
        assert snapshot(root) == want
        assert attrs_from_c(m) - before >= (DIRS - 1) * FILES // 2  # (most of them: C's)
    # after C answered them: a change to each is seen at once, written through C or Python
    for d in range(DIRS):
        for f in range(3, FILES, 10):
            p = root / f"d{d}" / f"f{f:03d}.txt"
            size = at_a[str(p.relative_to(root))][5]
            with open(p, "ab") as out:  # (C acknowledges it before Python stores it)
                out.write(b"x" * 100)
            assert os.lstat(p).st_size == size + 100
            os.chmod(p, 0o640)
            assert os.lstat(p).st_mode & 0o777 == 0o640
            os.utime(p, ns=(10**18, 10**18))
            assert os.lstat(p).st_mtime_ns == 10**18
    after = snapshot(root)
    c = m.ctl_ok({"cmd": "checkpoint", "name": "c"})["id"]
    for target, want in ((b, at_b), (a, at_a), (c, after)):
        m.ctl_ok({"cmd": "restore", "id": target})
        assert snapshot(root) == want

