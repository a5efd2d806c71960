"""The daemon stops promptly whatever runs: SIGTERM and `overlayckpt unmount` while a
command is busy in a worker thread.

The slow command is an export_bundle whose worker holds an LMDB read transaction
and waits in open() for its output: the bundle's temporary file (bundle.py names
it PATH.tmp-PID) is a FIFO, which a reader the test starts after SLOW seconds
would let through. That is the hardest case: a worker that cannot check for the
stop. Stopping must end the daemon and the mount long before then, tell the
command's client so in one line, and leave the store whole.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from conftest import (
    CLI,
    daemon_pid,
    force_unmount,
    is_mounted,
    make_repo,
    proc_alive,
    run_cli,
    stop_daemon,
    wait_for,
)

SLOW = 30.0  # seconds the export would wait for its output: what stopping must beat
DEADLINE = 60.0
STOPPED = "the daemon stopped while this command ran: run it again after mounting"


def waiting_on_daemon(tid: int) -> bool:
    with open(f"/proc/self/task/{tid}/wchan") as f:
        return f.read() == "request_wait_answer"


class SlowExport:
    """An export_bundle from a client thread, held up by a FIFO at its temporary file."""

    def __init__(self, mnt: Path, store: Path, out: Path) -> None:
        self.mnt = mnt
        self.bundle = out / "session.bundle"
        self.fifo = out / f"session.bundle.tmp-{daemon_pid(store)}"
        os.mkfifo(self.fifo)
        self.reply: dict | None = None
        self.tid: list[int] = []
        self.thread = threading.Thread(target=self._run)
        self.started = 0.0
        # the reader that lets the export through: it "finishes" (fails, EPIPE) at SLOW
        self.timer = threading.Timer(SLOW, self._let_through)

    def _run(self) -> None:
        self.tid.append(threading.get_native_id())
        fd = os.open(self.mnt / ".overlayckpt" / "ctl", os.O_RDWR)
        try:
            with contextlib.suppress(OSError):  # EINVAL: the command failed, the reply says why
                os.write(fd, json.dumps({"cmd": "export_bundle", "path": str(self.bundle)}).encode()
                         + b"\n")
            self.reply = json.loads(os.pread(fd, 1 << 20, 0))
        finally:
            os.close(fd)

    def start(self) -> None:
        self.started = time.monotonic()
        self.timer.start()
        self.thread.start()
        wait_for(lambda: self.tid and waiting_on_daemon(self.tid[0]), "the export to be sent")
        # its worker waits in open() of the FIFO, for a reader
        wait_for(lambda: self._worker_waits(), "the export's worker to wait for its output")

    def _worker_waits(self) -> bool:
        return any(_wchan(t) == "wait_for_partner" for t in _tasks(self.daemon))

    @property
    def daemon(self) -> int:
        return int(self.fifo.name.rsplit("-", 1)[1])

    def _let_through(self) -> None:
        with contextlib.suppress(OSError):
            os.close(os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK))

    def release(self) -> None:
        """Let a writer still waiting on the FIFO through (and fail), then forget it."""
        self.timer.cancel()
        self._let_through()
        self.thread.join(timeout=DEADLINE)
        with contextlib.suppress(OSError):
            self.fifo.unlink()


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _wchan(tid: int) -> str:
    try:
        with open(f"/proc/{tid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


@contextlib.contextmanager
def slow_export(mnt: Path, store: Path, out: Path) -> Iterator[SlowExport]:
    out.mkdir(exist_ok=True)
    export = SlowExport(mnt, store, out)
    try:
        export.start()
        yield export
    finally:
        export.release()


def gone(pid: int, mnt: Path) -> bool:
    return not proc_alive(pid) and not is_mounted(str(mnt))


def test_sigterm_stops_the_daemon_while_a_command_runs(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    mnt, store = tmp_path / "mnt", tmp_path / "store"
    mnt.mkdir()
    run_cli("mount", str(repo), str(mnt), "--store", str(store))
    try:
        (mnt / "new.txt").write_text("kept\n")
        pid = daemon_pid(store)
        assert pid is not None
        with slow_export(mnt, store, tmp_path / "out") as export:
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: gone(pid, mnt), "the daemon to exit and the mount to go", SLOW)
            assert time.monotonic() - export.started < SLOW
            export.thread.join(timeout=DEADLINE)
            assert export.reply == {"ok": False, "error": STOPPED}
        assert not export.bundle.exists()
    finally:
        force_unmount(str(mnt))
        stop_daemon(store)
    # the store is whole and has everything: mount again and look
    run_cli("mount", str(repo), str(mnt), "--store", str(store))
    try:
        assert (mnt / "new.txt").read_text() == "kept\n"
        run_cli("unmount", str(mnt))
    finally:
        force_unmount(str(mnt))
        stop_daemon(store)
    assert run_cli("--store", str(store), "fsck").returncode == 0


def test_unmount_in_place_applies_while_a_command_runs(tmp_path: Path, torn_down) -> None:
    repo = make_repo(tmp_path / "repo")
    store = tmp_path / "store"
    torn_down(repo, store)
    run_cli("mount", str(repo), "--store", str(store))
    (repo / "new.txt").write_text("applied\n")
    pid = daemon_pid(store)
    assert pid is not None
    with slow_export(repo, store, tmp_path / "out") as export:
        proc = subprocess.run(CLI + ["unmount", str(repo)], capture_output=True, text=True,
                              timeout=SLOW)
        assert proc.returncode == 0, proc.stderr
        assert "applied to" in proc.stdout
        wait_for(lambda: gone(pid, repo), "the daemon to exit and the mount to go", SLOW)
        assert time.monotonic() - export.started < SLOW
        export.thread.join(timeout=DEADLINE)
        assert export.reply == {"ok": False, "error": STOPPED}
    assert (repo / "new.txt").read_text() == "applied\n"  # in the repo itself now
    assert not (repo / ".overlayckpt").exists()
    assert run_cli("--store", str(store), "fsck").returncode == 0


def test_unmount_still_refuses_while_the_mount_is_in_use(tmp_path: Path) -> None:
    """Cutting commands short is for the commands' own handles: a program with a file
    open on the mount still makes unmount refuse, and the daemon serves on."""
    repo = make_repo(tmp_path / "repo")
    mnt, store = tmp_path / "mnt", tmp_path / "store"
    mnt.mkdir()
    run_cli("mount", str(repo), str(mnt), "--store", str(store))
    try:
        with open(mnt / "README.md") as busy:
            proc = run_cli("unmount", str(mnt), check=False)
            assert proc.returncode == 1 and "cannot unmount" in proc.stderr, proc.stderr
            assert is_mounted(str(mnt))
            assert busy.read().startswith("# demo")
        # (after the refusal, commands are refused for a moment at most: then served)
        wait_for(lambda: run_cli("--mount", str(mnt), "checkpoint", check=False).returncode == 0,
                 "commands to be served again")
        run_cli("unmount", str(mnt))
    finally:
        force_unmount(str(mnt))
        stop_daemon(store)


def test_talking_to_the_daemon_loads_neither_trio_nor_lmdb(tmp_path: Path) -> None:
    """The CLI path that only talks to a daemon stays light (`checkpoint` from a hook)."""
    repo = make_repo(tmp_path / "repo")
    mnt, store = tmp_path / "mnt", tmp_path / "store"
    mnt.mkdir()
    run_cli("mount", str(repo), str(mnt), "--store", str(store))
    probe = ("import sys, runpy\n"
             "sys.argv = ['overlayckpt'] + sys.argv[1:]\n"
             "try:\n"
             "    runpy.run_module('overlayckpt', run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    assert not e.code, e.code\n"
             "heavy = sorted(m for m in ('trio', 'lmdb', 'pyfuse3', 'zstandard', 'blake3', 'msgpack')"
             " if m in sys.modules)\n"
             "print('HEAVY', heavy, file=sys.stderr)\n")
    try:
        for args in (["checkpoint", "light"], ["log", "--limit", "20"], ["status"]):
            proc = subprocess.run([sys.executable, "-c", probe, "--mount", str(mnt), *args],
                                  capture_output=True, text=True, timeout=DEADLINE)
            assert proc.returncode == 0, proc.stderr
            assert "HEAVY []" in proc.stderr, (args, proc.stderr)
        run_cli("unmount", str(mnt))
    finally:
        force_unmount(str(mnt))
        stop_daemon(store)
