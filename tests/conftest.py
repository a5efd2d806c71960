"""Fixtures that mount for real and always unmount, also when a test fails."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "overlayckpt"]


def run_cli(*args: str, check: bool = True, input: str | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(CLI + list(args), capture_output=True, text=True, input=input, cwd=cwd,
                          env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"overlayckpt {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


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


@pytest.fixture
def mount_factory(tmp_path: Path) -> Iterator:
    """Mount any repo at a separate mountpoint; unmount everything at teardown."""
    mounts: list[Mount] = []

    def factory(repo: Path, *extra: str, name: str = "mnt") -> Mount:
        mnt = tmp_path / name
        mnt.mkdir(exist_ok=True)
        store = tmp_path / f"store-{name}"
        run_cli("mount", str(repo), str(mnt), "--store", str(store), *extra)
        m = Mount(repo, mnt, store)
        mounts.append(m)
        return m

    yield factory
    for m in mounts:
        force_unmount(str(m.mnt))
    for m in mounts:
        wait_daemon_gone(m.store)
        proc = run_cli("--store", str(m.store), "fsck", check=False)
        assert proc.returncode == 0, f"fsck after the test:\n{proc.stdout}{proc.stderr}"


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
def mounted(repo: Path, mount_factory) -> Iterator[Mount]:
    """The sample repo mounted at a separate mountpoint; the repo must stay untouched."""
    before = tree_digest(str(repo))
    m = mount_factory(repo)
    yield m
    force_unmount(str(m.mnt))
    assert tree_digest(str(repo)) == before, "the lower repo changed while mounted"
