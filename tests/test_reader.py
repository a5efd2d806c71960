"""Commands read in processes of their own (service/reader.py), never in the daemon's.

A reader the test stops (SIGSTOP) is a command that reads for as long as the test
wants: the mount must go on answering meanwhile, stopping the daemon must not wait
for it, and a reader that dies must cost its command one line, not the next one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CLI, Mount, daemon_pid, proc_alive, run_cli, stop_daemon, wait_for

DEADLINE = 60.0


def readers(daemon: int) -> list[int]:
    """The daemon's reader processes."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == daemon and b"overlayckpt.service.reader" in argv:
            out.append(int(pid))
    return out


def one_reader(m: Mount) -> int:
    daemon = daemon_pid(m.store)
    assert daemon
    found: list[int] = []

    def found_one() -> list[int]:
        found.extend(readers(daemon))
        return found
    wait_for(found_one, "the daemon's reader")
    return found[0]


def test_commands_read_in_a_lower_priority_process_that_sees_every_change(mounted: Mount) -> None:
    m = mounted
    (m.mnt / "new.txt").write_text("one\n")
    assert "new.txt" in m.cli("log").stdout
    reader = one_reader(m)
    assert os.getpriority(os.PRIO_PROCESS, reader) == 10
    (m.mnt / "new.txt").write_text("one\ntwo\n")  # a write the same reader must see next
    out = m.cli("diff", "0", "--stat").stdout
    assert "new.txt" in out and "+2" in out, out
    assert one_reader(m) == reader  # kept between commands
    # a user's mistake in a reading is one line, as before
    bad = m.cli("diff", "999", check=False)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "unknown checkpoint 999" in bad.stderr


def held_up_log(m: Mount) -> tuple[int, subprocess.Popen[str]]:
    """A `log` whose reader the test stopped (SIGSTOP) with the request in its pipe."""
    (m.mnt / "a.txt").write_text("a\n")
    m.cli("log")
    reader = one_reader(m)
    os.kill(reader, signal.SIGSTOP)
    log = subprocess.Popen([*CLI, "--mount", str(m.mnt), "log"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _stopped_with_input(reader), "log to reach the stopped reader")
    return reader, log


def test_the_mount_answers_while_a_reading_is_held_up(mounted: Mount) -> None:
    m = mounted
    reader, log = held_up_log(m)
    try:
        # the request loop is free: stats, reads, writes and listings all answer
        os.stat(m.mnt / "a.txt")
        assert (m.mnt / "a.txt").read_text() == "a\n"
        (m.mnt / "b.txt").write_text("b\n")
        assert "b.txt" in os.listdir(m.mnt)
        assert "checkpoints" in (m.mnt / ".overlayckpt" / "status.json").read_text()
        # and so do other clients' commands: the kernel lets ctl writes through in parallel
        made = m.ctl_ok({"cmd": "checkpoint", "message": "while log waits"})
        assert made["id"] > 0
        assert log.poll() is None  # still waiting for its reader
    finally:
        os.kill(reader, signal.SIGCONT)
    out, err = log.communicate(timeout=DEADLINE)
    assert log.returncode == 0, err
    assert "a.txt" in out


def test_a_dead_reader_costs_its_command_one_line_and_the_next_one_nothing(mounted: Mount) -> None:
    m = mounted
    reader, log = held_up_log(m)
    os.kill(reader, signal.SIGKILL)
    out, err = log.communicate(timeout=DEADLINE)
    # the command is answered all the same (in a thread of the daemon): nothing waits
    assert log.returncode == 0, err
    assert "a.txt" in out
    wait_for(lambda: not proc_alive(reader) or _zombie_gone(reader), "the dead reader reaped")
    assert "a.txt" in m.cli("log").stdout
    assert one_reader(m) != reader


def test_stopping_the_daemon_does_not_wait_for_a_reading(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    reader, log = held_up_log(m)
    t0 = time.monotonic()
    daemon = daemon_pid(m.store)
    assert daemon is not None
    os.kill(daemon, signal.SIGTERM)
    assert stop_daemon(m.store) is None
    assert time.monotonic() - t0 < 10, "the daemon waited for its reader"
    _, err = log.communicate(timeout=DEADLINE)
    assert log.returncode != 0 and err.strip().count("\n") == 0, err
    wait_for(lambda: not proc_alive(reader) or _zombie_gone(reader), "the reader gone with its daemon")
    assert "clean" in run_cli("--store", str(m.store), "fsck").stdout


def _stopped_with_input(pid: int) -> bool:
    """The stopped reader has a request waiting in its pipe."""
    try:
        with open(f"/proc/{pid}/fdinfo/0") as f:
            f.read()
        return _pipe_bytes(pid) > 0
    except OSError:
        return False


def _pipe_bytes(pid: int) -> int:
    import array
    import fcntl
    import termios
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, buf)
        return buf[0]
    finally:
        os.close(fd)


def _zombie_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_reader_exits_with_its_daemon_killed(mounted: Mount) -> None:
    m = mounted
    m.cli("log")
    reader = one_reader(m)
    m.kill_daemon()
    wait_for(lambda: not proc_alive(reader) or _zombie_gone(reader), "the reader to exit")


def test_a_change_deep_in_the_repo_is_found_by_a_process_that_looked_nothing_up(
        repo: Path, mount_factory) -> None:
    """A reader, or a daemon mounted anew, has looked up none of the repo's directories:
    diff and log still find a file changed two directories down, with its line counts."""
    deep = repo / "docs" / "deep"
    deep.mkdir()
    (deep / "notes.txt").write_text("".join(f"{i}\n" for i in range(100)))
    m = mount_factory(repo)
    subprocess.run(["sed", "-i", "s/^5$/five/", str(m.mnt / "docs" / "deep" / "notes.txt")], check=True)
    for when in ("the daemon that served the edit", "a daemon mounted anew"):
        assert m.cli("diff", "0", "--stat").stdout.split()[:4] == \
            ["M", "docs/deep/notes.txt", "|", "+1"], when
        assert "M docs/deep/notes.txt +1 -1" in m.cli("log", "--limit", "1").stdout, when
        m.cli("unmount", str(m.mnt), "--no-apply")
        run_cli("mount", str(repo), str(m.mnt), "--store", str(m.store))


@pytest.mark.parametrize("then", [signal.SIGCONT, signal.SIGKILL], ids=["goes-on", "dies"])
def test_a_restores_file_list_is_made_in_a_reader(mounted: Mount, then: int) -> None:
    """A restore's file list (seconds of Python after a big restore) is a reader's work,
    not a thread's that would hold the GIL the mount's requests need: with the reader
    stopped, the restore answers and the mount serves, the list waits in the reader's
    pipe, and comes once the reader goes on, or from the daemon if the reader dies."""
    m = mounted
    m.cli("log")
    reader = one_reader(m)
    before = m.ctl_ok({"cmd": "checkpoint", "name": "before"})["id"]
    for i in range(20):
        (m.mnt / f"new{i}.txt").write_text(f"{i}\n")
    m.ctl_ok({"cmd": "checkpoint", "name": "after"})
    os.kill(reader, signal.SIGSTOP)
    try:
        made = m.ctl_ok({"cmd": "restore", "id": before})["id"]
        wait_for(lambda: _stopped_with_input(reader), "the file list to reach the stopped reader")
        assert not (m.mnt / "new0.txt").exists()
        (m.mnt / "b.txt").write_text("b\n")
        assert "b.txt" in os.listdir(m.mnt)
    finally:
        os.kill(reader, then)

    def listed() -> bool:
        row = next(c for c in m.ctl_ok({"cmd": "log", "limit": 50})["checkpoints"]
                   if c["id"] == made)
        return sorted(f["path"] for f in row["files"]) == sorted(f"new{i}.txt" for i in range(20))
    wait_for(listed, "the restore's files listed")
