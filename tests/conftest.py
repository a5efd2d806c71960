"""Fixtures that mount for real and always unmount, also when a test fails."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from helpers_users import user  # noqa: F401  (the one session-wide second user)

CLI = [sys.executable, "-m", "overlayckpt"]


def run_cli(*args: str, check: bool = True, input: str | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    _note_daemon_store(args)
    proc = subprocess.run(CLI + list(args), capture_output=True, text=True, input=input, cwd=cwd,
                          env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"overlayckpt {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def wait_for(cond: Callable[[], object], what: str, timeout: float = 60.0,
             interval: float = 0.01) -> None:
    """Wait until cond() holds, at most timeout seconds (then fail, saying what)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def proc_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def daemon_pid(store: Path) -> int | None:
    try:
        return json.loads((store / "session.json").read_text()).get("pid")
    except (OSError, ValueError):
        return None


def tree_digest(root: str) -> dict[str, tuple]:
    """Everything observable about a tree: type, mode, size, content hash, link target, xattrs."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            try:
                xattrs = tuple(sorted((n, os.getxattr(p, n, follow_symlinks=False))
                                      for n in os.listxattr(p, follow_symlinks=False)
                                      if n.startswith("user.")))
            except OSError:
                xattrs = ()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(p), xattrs)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), xattrs)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    h = hashlib.blake2b(f.read()).hexdigest()
                out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_size, h, st.st_nlink, xattrs)
            else:
                out[rel] = ("o", st.st_mode, xattrs)
    return out


def make_repo(path: Path) -> Path:
    """A small repo with nested dirs, a symlink, a hard link, an executable and a binary."""
    (path / "src" / "pkg").mkdir(parents=True)
    (path / "docs").mkdir()
    (path / "empty").mkdir()
    (path / "README.md").write_text("# demo\n\nhello\n")
    (path / "src" / "main.py").write_text("import pkg.util\nprint(pkg.util.answer())\n")
    (path / "src" / "pkg" / "__init__.py").write_text("")
    (path / "src" / "pkg" / "util.py").write_text("def answer():\n    return 42\n")
    (path / "docs" / "guide.txt").write_text("line\n" * 5000)  # several blocks
    (path / "bin.dat").write_bytes(bytes(range(256)) * 64 + b"\0" * 8192 + b"tail")
    run = path / "run.sh"
    run.write_text("#!/bin/sh\necho run\n")
    run.chmod(0o755)
    (path / "link").symlink_to("README.md")
    os.link(path / "README.md", path / "hardlink.md")
    return path


@pytest.fixture
def model() -> Iterator[Any]:
    """A scripted model server (agent_server.py) for one test of a real agent CLI."""
    from agent_server import ScriptedModel
    server = ScriptedModel()
    yield server
    server.close()


def conversation(m: Mount) -> list[dict]:
    """The mount's conversation sidecar, line by line."""
    return [json.loads(x) for x in (m.mnt / ".overlayckpt" / "conversation.jsonl").read_text().splitlines()]


def summaries(m: Mount) -> dict[str, str]:
    """Each changed path -> the summary of the newest checkpoint that changed it."""
    out: dict[str, str] = {}
    for c in sorted(m.ctl_ok({"cmd": "log"})["checkpoints"], key=lambda c: c["id"]):
        for f in c["files"]:
            out[f["path"]] = c["summary"]
    return out


@dataclass
class Mount:
    repo: Path
    mnt: Path
    store: Path

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_cli("--mount", str(self.mnt), *args, check=check)

    def ctl_ok(self, cmd: dict) -> dict:
        """A control command that must succeed; its reply without the ok flag."""
        reply = self.ctl(cmd)
        assert reply.pop("ok"), reply
        return reply

    def ctl(self, cmd: dict) -> dict:
        with open(self.mnt / ".overlayckpt" / "ctl", "r+b", buffering=0) as f:
            f.write((json.dumps(cmd) + "\n").encode())
            return json.loads(f.read().decode().strip().splitlines()[-1])

    def listed_log(self, **args: Any) -> list[dict]:
        """The log once no restore's file list is still to come (the daemon lists a
        restore's files just after its answer)."""
        deadline = time.monotonic() + 60
        while True:
            entries = self.ctl_ok({"cmd": "log", **args})["checkpoints"]
            if not any(c.get("files_pending") for c in entries):
                return entries
            assert time.monotonic() < deadline, "a restore's files were never listed"
            time.sleep(0.02)

    def kill_daemon(self) -> None:
        """kill -9 the daemon (no clean shutdown), then wait until its mount is stale."""
        pid = daemon_pid(self.store)
        assert pid and proc_alive(pid), "no live daemon to kill"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while proc_alive(pid) or not self.stale():
            assert time.monotonic() < deadline, f"daemon {pid} did not die, or its mount answers"
            time.sleep(0.02)

    def stale(self) -> bool:
        """The daemon is gone (the mount root's attributes may still come from the
        kernel's cache: ask for something never cached)."""
        try:
            os.stat(self.mnt / ".overlayckpt" / "status.json")
        except OSError as e:
            return e.errno == errno.ENOTCONN
        return False


def is_mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def force_unmount(path: str) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", path], capture_output=True)
    deadline = time.monotonic() + 10
    while is_mounted(path) and time.monotonic() < deadline:
        subprocess.run(["fusermount3", "-uz", path], capture_output=True)
        time.sleep(0.05)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


def tear_down(mounts: list[Mount], fsck: bool) -> None:
    """Unmount each mount (lazily if it must), wait for its daemon to exit, kill it if it
    does not, then (fsck) check every store that was made."""
    seen: dict[tuple[Path, Path], Mount] = {(m.mnt, m.store): m for m in mounts}
    problems = []
    for m in seen.values():
        force_unmount(str(m.mnt))
    for m in seen.values():
        problem = stop_daemon(m.store)
        force_unmount(str(m.mnt))  # a killed daemon leaves a stale mount behind
        if problem:
            problems.append(problem)
    assert not problems, "; ".join(problems)
    for m in seen.values() if fsck else ():
        if not (m.store / "data.mdb").exists():
            continue  # the mount failed before it made a store
        proc = run_cli("--store", str(m.store), "fsck", check=False)
        assert proc.returncode == 0, f"fsck after the test:\n{proc.stdout}{proc.stderr}"


class MountFactory(Protocol):
    def __call__(self, repo: Path, *extra: str, name: str = "mnt") -> Mount: ...


@pytest.fixture
def mount_factory(tmp_path: Path) -> Iterator[MountFactory]:
    """Mount any repo at a separate mountpoint; unmount everything at teardown.

    A mount is recorded before the CLI starts its daemon, so that a mount that fails
    half-way (a daemon started, the CLI timed out or raised) is torn down too."""
    mounts: list[Mount] = []

    def factory(repo: Path, *extra: str, name: str = "mnt") -> Mount:
        mnt = tmp_path / name
        mnt.mkdir(exist_ok=True)
        store = tmp_path / f"store-{name}"
        m = Mount(repo, mnt, store)
        mounts.append(m)
        run_cli("mount", str(repo), str(mnt), "--store", str(store), *extra)
        return m

    yield factory
    tear_down(mounts, fsck=True)


@pytest.fixture
def torn_down() -> Iterator:
    """For tests that mount by themselves (in place, `run`): torn_down(mnt, store) before
    the CLI mounts; at teardown the mount is unmounted and its daemon ended, whatever
    happened in the test."""
    mounts: list[Mount] = []

    def track(mnt: Path, store: Path) -> None:
        mounts.append(Mount(mnt, mnt, store))

    yield track
    tear_down(mounts, fsck=False)


def _is_our_daemon(pid: int, store: Path) -> bool:
    """pid is an overlayckpt daemon of this store (not a process that reused the number)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"overlayckpt" in argv and os.fsencode(os.path.abspath(store)) in argv


def stop_daemon(store: Path, timeout: float = 60) -> str | None:
    """After the unmount: wait (bounded) for the store's daemon to exit; kill -9 it if it
    does not. Returns what went wrong, or None if it exited by itself."""
    pid = daemon_pid(store)
    if not pid or not proc_alive(pid) or not _is_our_daemon(pid, store):
        return None
    deadline = time.monotonic() + timeout
    while proc_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not proc_alive(pid):
        return None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"the daemon {pid} of {store} did not exit within {timeout:.0f} s after the unmount: killed"


def wait_daemon_gone(store: Path, timeout: float = 60) -> None:
    """Wait until the store's daemon has exited (it applies and closes after unmount)."""
    info = store / "session.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = json.loads(info.read_text()).get("pid")
        except (OSError, ValueError):
            return
        if not pid or not os.path.exists(f"/proc/{pid}") or _zombie(pid):
            return
        time.sleep(0.02)
    raise AssertionError(f"daemon of {store} did not exit")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True


@pytest.fixture
def mounted(repo: Path, mount_factory: MountFactory) -> Iterator[Mount]:
    """The sample repo mounted at a separate mountpoint; the repo must stay untouched."""
    before = tree_digest(str(repo))
    m = mount_factory(repo)
    yield m
    force_unmount(str(m.mnt))
    assert tree_digest(str(repo)) == before, "the lower repo changed while mounted"


# -- the daemons' logs ---------------------------------------------------------------
#
# Every store a test mounts through run_cli ("mount" or "run" with --store) is noted;
# after each test, what its daemon wrote to <store>/daemon.log since the last check
# must hold no traceback, no ERROR or CRITICAL and no WARNING, except the warnings
# below, which tests provoke on purpose (message pattern, test id pattern, and why).
# (test_powercut.py starts its daemons with its own cli() and reads their logs itself.)

DAEMON_LOG_ALLOWED: list[tuple[str, str]] = [
    # kill -9 (or SIGTERM) while C had acknowledged writes Python had not stored yet: the
    # next mount (or the daemon itself, after SIGTERM) replays them from the write-behind
    # log and says so. The crash tests kill on purpose; these two check this very line.
    (r"WARNING overlayckpt\.core\.writebehind: stored \d+ writes that a stopped daemon had acknowledged",
     r"test_reliability\.py::(test_crash_|test_restore_both_is_both_or_neither_when_killed|"
     r"test_writes_acknowledged_before_they_were_stored_survive_kill|"
     r"test_creates_and_removals_answered_before_they_were_stored_survive_kill|"
     r"test_sigterm_stores_acknowledged_writes_before_it_applies|"
     r"test_stale_mount_is_reported_and_cleared)"
     r"|test_stress\.py::"),
    # and creates and removals Python had answered and not stored yet (core/answered.py), likewise
    (r"WARNING overlayckpt\.core\.answered: stored \d+ creates and removals that a stopped daemon had answered",
     r"test_reliability\.py::(test_crash_|test_restore_both_is_both_or_neither_when_killed|"
     r"test_creates_and_removals_answered_before_they_were_stored_survive_kill|"
     r"test_stale_mount_is_reported_and_cleared)"
     r"|test_stress\.py::"),
    # the restore removed the file a write was acknowledged for: the test checks that
    # the file's fsync reports it, the daemon logs it as it should
    (r"ERROR overlayckpt\.fuse\.ops: a write of \d+ bytes at \d+ to inode \d+ failed after it "
     r"was acknowledged \(Stale file handle\)",
     r"test_timeline\.py::test_write_to_a_file_a_restore_removed_fails_at_fsync"),
    # the repo changed behind the mount on purpose: the unmount's apply refuses, and the
    # daemon logs the refusal (one line) before the CLI reports it
    (r"ERROR overlayckpt\.mount: apply at unmount refused: the repo itself changed",
     r"test_cli\.py::test_apply_refuses_to_overwrite_changes_made_in_the_repo"),
    # a command's worker stuck in a system call while the daemon stops (an export
    # waiting on a FIFO, on purpose): the daemon leaves the store synced but unclosed
    (r"WARNING overlayckpt\.mount: a command's worker thread is still reading the store",
     r"test_promptness\.py::"),
    # a reader process the test killed on purpose: its command is answered in a thread
    # (a restore's file list too: it is then made in a thread)
    (r"WARNING overlayckpt\.service\.session: the store's reader failed",
     r"test_reader\.py::(test_a_dead_reader|test_a_restores_file_list_is_made_in_a_reader\[dies\])"),
    # any test that unmounts right after closing a file: the kernel sends the release
    # without waiting for it and the unmount aborts the connection, so the daemon's
    # answer to it finds no request (ENOENT) and pyfuse3 logs that; the release itself ran
    (r"ERROR pyfuse3: fuse_release\(\): fuse_reply_\* failed with No such file or directory",
     r""),
]

_daemon_logs: dict[Path, int] = {}  # daemon.log -> bytes already checked


def _note_daemon_store(args: tuple[str, ...]) -> None:
    if ("mount" in args or "run" in args) and "--store" in args:
        i = args.index("--store")
        if i + 1 < len(args):
            log = Path(os.path.abspath(args[i + 1])) / "daemon.log"
            if log not in _daemon_logs:
                try:
                    _daemon_logs[log] = log.stat().st_size  # what an earlier run wrote
                except OSError:
                    _daemon_logs[log] = 0


_BAD_LINE = re.compile(r"^overlayckpt: (WARNING|ERROR|CRITICAL) ")


def _log_entries(text: str) -> list[str]:
    """The bad entries of a log: each bad line, and each traceback as one entry (from
    "Traceback" to its exception line), so that an allowance can name the exception."""
    entries = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last)"):
            j = i + 1
            while j < len(lines) and lines[j].startswith(" "):
                j += 1
            entries.append("\n".join(lines[i:j + 1]))
            i = j + 1
            continue
        if _BAD_LINE.search(lines[i]):
            entries.append(lines[i])
        i += 1
    return entries


def daemon_log_problems(nodeid: str) -> list[str]:
    """New entries in the noted daemon logs that are bad and not allowed for this test."""
    allowed = [re.compile(msg) for msg, test in DAEMON_LOG_ALLOWED if re.search(test, nodeid)]
    problems = []
    for log, done in _daemon_logs.items():
        try:
            with open(log, "rb") as f:
                f.seek(done)
                new = f.read()
        except OSError:
            continue  # gone with its tmpfs or faultfs, or never made
        _daemon_logs[log] = done + len(new)
        for entry in _log_entries(new.decode(errors="replace")):
            if not any(a.search(entry) for a in allowed):
                problems.append(f"{log}:\n    " + entry.replace("\n", "\n    "))
    return problems


@pytest.fixture(autouse=True)
def daemon_log_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test whose daemons logged a traceback, an error or an unexpected warning.
    (Autouse, so set up before and torn down after the test's mount fixtures: the
    lines a daemon writes while it unmounts are checked too.)"""
    yield
    problems = daemon_log_problems(request.node.nodeid)
    if problems:
        pytest.fail("the daemon logged:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def daemon_logs_clean_at_the_end() -> Iterator[None]:
    """What daemons of module-scoped mounts logged after the last test's check."""
    yield
    problems = daemon_log_problems("(session end)")
    if problems:
        pytest.fail("a daemon logged:\n" + "\n".join(problems), pytrace=False)
