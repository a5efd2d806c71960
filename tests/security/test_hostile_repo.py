"""A hostile repo against what the daemon reads of it itself: the C fast path lists its
untouched directories and reads its untouched files (fuse/csrc/lowerdirs.c), Python the
rest. Symlinks (out of the repo, in loops) are shown, never followed; fifos are shown,
never opened so as to wait; odd names and a directory too big to list in C are shown as
natively; a file swapped for a fifo behind the overlay's back fails its reads rather
than hanging the mount. Every probe runs in a subprocess with a timeout.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MountFactory

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="forgetting the kernel's names needs root")

WALK = r"""
import json, os, sys
out = {}
for d, dirs, files in os.walk(sys.argv[1]):
    for name in dirs + files:
        p = os.path.join(d, name)
        st = os.lstat(p)
        out[os.path.relpath(p, sys.argv[1])] = [st.st_mode, st.st_size if not os.path.isdir(p) else 0,
                                                 os.readlink(p) if os.path.islink(p) else None]
print(json.dumps(out, sort_keys=True))
"""


def walk(root: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", WALK, str(root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def forget() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def hostile_repo(path: Path) -> Path:
    d = path / "d" / "sub"
    d.mkdir(parents=True)
    (path / "d" / "out").symlink_to("/etc")
    (path / "d" / "loop").symlink_to("loop")
    (path / "d" / "up").symlink_to("../..")
    os.mkfifo(path / "d" / "fifo")
    (path / "d" / "file").write_text("content\n")
    (path / "d" / "victim").write_text("swapped later\n")
    (d / "nl\nname").write_text("x")
    (d / os.fsdecode(b"\xff\xfe bytes")).write_text("y")
    (path / "d" / "sub" / ("a" * 200)).mkdir()
    big = path / "big"
    big.mkdir()
    for i in range(4100):  # (more than C lists: Python's)
        (big / f"f{i}").touch()
    return path


def test_a_hostile_repo_is_shown_as_natively_and_never_followed(tmp_path: Path,
                                                               mount_factory: MountFactory) -> None:
    repo = hostile_repo(tmp_path / "repo")
    native = walk(repo)
    m = mount_factory(repo)
    forget()
    assert walk(m.mnt) == native
    listed = m.ctl_ok({"cmd": "status"})["repo_dirs_listed_in_c"]
    assert listed >= 2  # (d, d/sub: the big one is Python's)
    read = subprocess.run(["cat", str(m.mnt / "d" / "file")], capture_output=True, timeout=30)
    assert read.stdout == b"content\n"
    # behind the overlay's back (the repo must not change while mounted; a hostile one may)
    os.unlink(repo / "d" / "victim")
    os.mkfifo(repo / "d" / "victim")
    forget()
    probe = subprocess.run(["cat", str(m.mnt / "d" / "victim")], capture_output=True, timeout=30)
    assert probe.returncode != 0 or probe.stdout == b""
    assert (m.mnt / "d" / "file").read_text() == "content\n"  # (the mount still answers)
