"""Automatic checkpoints group by process (thread group), not by the thread FUSE names."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_two_processes_of_a_harness_older_than_the_mount_are_two_checkpoints(mounted: Mount) -> None:
    before = last_id(mounted)  # (pytest, no job of its own, runs them as its children)
    for name in ("one.txt", "two.txt"):
        subprocess.run([sys.executable, "-c", ATOMIC_SAVE, str(mounted.mnt / name)],
                       check=True, timeout=60)
    new = checkpoints_after(mounted, before)
    assert [[f["path"] for f in c["files"]] for c in new] == [["one.txt"], ["two.txt"]]
    assert new[0]["process"]["pid"] != new[1]["process"]["pid"]


# An agent as a shell starts it: the leader of its own process group (a job). It saves a
# file itself, then runs each command as agents do (bash -c, attached to its group or,
# with "detached", in a session of its own as Node's `detached` spawns), back to back.
AGENT = r"""
import subprocess, sys
mnt, detached, commands = sys.argv[1], sys.argv[2] == "detached", sys.argv[3:]
for cmd in commands:
    if cmd.startswith("save "):
        with open(f"{mnt}/{cmd[5:]}", "a") as f:
            f.write("/* saved by the agent */\n")
    else:
        subprocess.run(["bash", "-c", cmd], cwd=mnt, check=True, start_new_session=detached,
                       stdout=subprocess.DEVNULL)
"""


def run_agent(m: Mount, mode: str, *commands: str) -> None:
    """The agent run at a prompt: a job (`set -m`) of a shell that leads its session."""
    subprocess.run(["bash", "-c", 'set -m; "$@"; exit $?', "shell",
                    sys.executable, "-c", AGENT, str(m.mnt), mode, *commands],
                   check=True, timeout=300, start_new_session=True)


def test_two_commands_of_an_agent_are_two_checkpoints(mounted: Mount) -> None:
    before = last_id(mounted)
    run_agent(mounted, "attached", *(f"{sys.executable} -c '{ATOMIC_SAVE}' {name}"
                                     for name in ("one.txt", "two.txt")))
    new = checkpoints_after(mounted, before)
    assert [[f["path"] for f in c["files"]] for c in new] == [["one.txt"], ["two.txt"]]
    assert new[0]["process"]["pid"] != new[1]["process"]["pid"]


C_PROJECT = {f"f{i}.c": f"int f{i}(void) {{ return {i}; }}\n" for i in range(1, 7)} | {
    "main.c": "int main(void) { return 0; }\n",
    "Makefile": "OBJS = main.o f1.o f2.o f3.o f4.o f5.o f6.o\nprog: $(OBJS)\n\tcc -o prog $(OBJS)\n"
                "%.o: %.c\n\tcc -c -o $@ $<\n",
} | {f"t{i}.txt": f"aaa {i}\n" for i in range(10)}


@pytest.mark.parametrize("mode", ["attached", "detached"])
def test_a_make_and_a_shell_loop_are_one_checkpoint_each(tmp_path: Path, mount_factory,
                                                          mode: str) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, text in C_PROJECT.items():
        (repo / name).write_text(text)
    # a window no pause reaches: groups end only where another command writes
    m = mount_factory(repo, "--window", "600")
    run_agent(m, mode, "save main.c", "make -s -j2", "for f in t*.txt; do sed -i s/a/b/ $f; done",
              "save f1.c")
    new = checkpoints_after(m, 0)
    agent = os.path.basename(sys.executable)[:15]  # (a process name is at most 15 bytes)
    assert [(c["process"]["comm"], c["summary"]) for c in new] == [
        (agent, "modified main.c"),
        ("make", "added f1.o, f2.o, f3.o and 5 more"),  # (bash runs its one command as itself)
        ("bash", "modified t0.txt, t1.txt, t2.txt and 7 more"),
        (agent, "modified f1.c"),
    ]
    assert (m.mnt / "prog").exists() and (m.mnt / "t9.txt").read_text() == "baa 9\n"


# A SQLite database in WAL mode, as Aider's repo-map cache and many tools keep one: its
# -shm file is written through a shared mmap, which reaches the daemon as page writeback
# (no process).
SQLITE_WAL = r"""
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE t (x)")
for i in range(3):
    db.execute("INSERT INTO t VALUES (?)", (i,))
db.close()
"""


def test_a_sqlite_wal_script_is_one_checkpoint_named_after_its_process(tmp_path: Path,
                                                                        mount_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("hi\n")
    m = mount_factory(repo, "--window", "600")  # groups end only where another writer writes
    subprocess.run([sys.executable, "-c", SQLITE_WAL, str(m.mnt / "t.db")], check=True, timeout=60)
    new = checkpoints_after(m, 0)
    assert len(new) == 1, [(c["process"]["comm"], c["summary"]) for c in new]
    assert new[0]["process"]["comm"].startswith("python")
    assert {f["path"] for f in new[0]["files"]} == {"t.db"}


# A command that writes its first file, waits at a fifo until every command has written
# its first, then writes the rest: the commands' writes are certain to interleave.
WRITER = 'echo 0 > "$1_0.txt"; read go < "$2"; for i in 1 2 3 4 5 6 7 8 9; do echo $i > "$1_$i.txt"; done'
# one command whose children write at once (as make -j2 runs its compilers)
PARENT = ('echo 0 > "$1_0.txt"; read go < "$2"; '
          'for i in 1 2 3; do (for j in 1 2 3; do echo $j > "$1_$i$j.txt"; done) & done; wait')


def test_independent_commands_at_once_are_a_checkpoint_each(tmp_path: Path, mount_factory) -> None:
    """Issue 34: 40 processes writing at once became one checkpoint (or, told apart, one
    per switch). Commands in sessions of their own are a checkpoint each, however their
    writes interleave; one command's children stay its one."""
    from conftest import wait_for
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("hi\n")
    m = mount_factory(repo, "--window", "600")
    names = ["a", "b", "c", "p"]
    fifos = []
    for name in names:
        fifos.append(tmp_path / f"go-{name}")
        os.mkfifo(fifos[-1])
    procs = [subprocess.Popen(["setsid", "bash", "-c", PARENT if name == "p" else WRITER, "cmd",
                               name, str(fifo)], cwd=m.mnt)
             for name, fifo in zip(names, fifos)]
    wait_for(lambda: all((m.mnt / f"{name}_0.txt").exists() for name in names), "first files")
    for fifo in fifos:
        fifo.write_text("go\n")
    for p in procs:
        assert p.wait(timeout=60) == 0
    new = checkpoints_after(m, 0)
    by_writer = sorted("".join(sorted({f["path"][0] for f in c["files"]})) for c in new)
    assert by_writer == ["a", "b", "c", "p"], [
        (c["id"], c["process"], c["files_total"], sorted(f["path"] for f in c["files"])) for c in new]
    assert all(c["files_total"] == 10 for c in new)  # (p: its own file and its children's 9)
