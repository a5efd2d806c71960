"""Automatic checkpoints group by process (thread group), not by the thread FUSE names."""
from __future__ import annotations

import subprocess
import sys

from conftest import Mount

# An atomic save from three threads, one after the other, as Node and Bun agents do it
# from their thread pools: write a temp file, fsync it, rename it over the target. Each
# thread renames itself, so that a checkpoint named after a thread would show it.
ATOMIC_SAVE = r"""
import ctypes, os, sys, threading
libc = ctypes.CDLL(None)
path = sys.argv[1]
tmp = path + ".tmp.4711"
fd = None

def named(name, fn):
    def run():
        libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        fn()
    return run

def write():
    global fd
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"saved atomically\n")

def sync():
    os.fsync(fd)
    os.close(fd)

def rename():
    os.rename(tmp, path)

for i, step in enumerate((write, sync, rename)):
    t = threading.Thread(target=named(f"pool-{i}", step))
    t.start()
    t.join()
"""


def checkpoints_after(m: Mount, last: int) -> list[dict]:
    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    return sorted((c for c in log if c["id"] > last), key=lambda c: c["id"])


def last_id(m: Mount) -> int:
    return max(c["id"] for c in m.ctl_ok({"cmd": "log"})["checkpoints"])


def test_a_three_thread_atomic_save_is_one_checkpoint(mounted: Mount) -> None:
    before = last_id(mounted)
    subprocess.run([sys.executable, "-c", ATOMIC_SAVE, str(mounted.mnt / "README.md")],
                   check=True, timeout=60)
    new = checkpoints_after(mounted, before)
    assert len(new) == 1, new
    assert new[0]["files"] == [{"path": "README.md", "change": "M"}]  # no temp file state
    assert new[0]["process"]["comm"].startswith("python")  # the process, not "pool-2"
    assert (mounted.mnt / "README.md").read_text() == "saved atomically\n"
    assert not (mounted.mnt / "README.md.tmp.4711").exists()


def test_two_processes_are_still_two_checkpoints(mounted: Mount) -> None:
    before = last_id(mounted)
    for name in ("one.txt", "two.txt"):
        subprocess.run([sys.executable, "-c", ATOMIC_SAVE, str(mounted.mnt / name)],
                       check=True, timeout=60)
    new = checkpoints_after(mounted, before)
    assert [[f["path"] for f in c["files"]] for c in new] == [["one.txt"], ["two.txt"]]
    assert new[0]["process"]["pid"] != new[1]["process"]["pid"]
