"""A second local user for tests that need one (root only): made for the session with
useradd, removed after. The machine is made usable by users the way Debian's is, for the
session only, then put back: /dev/fuse read-write for all (Debian's default mode) and
search permission on the directories leading to the interpreter (pyenv's lives under /root).
"""
from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FUSE = "/dev/fuse"


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: Path

    def argv(self, *argv: str, cwd: Path | None = None) -> list[str]:
        """argv as this user (no capabilities, its own groups) in cwd (entered as the user:
        root may not enter a user's FUSE mount)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
                "--inh-caps=-all", "--ambient-caps=-all", "--", "env", "-C", str(cwd or self.home),
                *argv]

    def run(self, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*argv, cwd=cwd), cwd="/", env=self.env(),
                              capture_output=True, text=True, timeout=300)

    def env(self) -> dict[str, str]:
        return {"HOME": str(self.home), "USER": self.name, "PATH": "/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8"}

    def read(self, path: Path) -> str:
        return self.run("cat", str(path)).stdout

    def cli(self, *args: str, cwd: Path | None = None, check: bool = True,
            wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        proc = self.run(*wrap, sys.executable, "-m", "overlayckpt", *args, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"overlayckpt {' '.join(args)} as {self.name} failed "
                                 f"({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def chown(self, path: Path) -> None:
        for p in [path, *path.rglob("*")]:
            os.lchown(p, self.uid, self.gid)


def _unsearchable_dirs(paths: list[Path]) -> list[Path]:
    """The directories on the way to paths that other users cannot pass through."""
    dirs = {d for p in paths for d in [p, *p.parents] if d.is_dir()}
    return sorted(d for d in dirs if not os.stat(d).st_mode & stat.S_IXOTH)


@pytest.fixture(scope="session")
def user() -> Iterator[User]:
    if os.geteuid() != 0:
        pytest.skip("making a test user needs root")
    for tool in ("useradd", "userdel", "setpriv", "unshare"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is missing: cannot run the CLI as a test user")
    if not os.path.exists(FUSE):
        pytest.skip(f"no {FUSE} on this machine")
    name = f"ockt{os.getpid() % 100000}"
    home = Path(tempfile.mkdtemp(prefix=f"{name}-home-"))
    subprocess.run(["useradd", "-M", "-d", str(home), "-s", "/bin/sh", "-U", name], check=True,
                   capture_output=True)
    fuse_mode = stat.S_IMODE(os.stat(FUSE).st_mode)
    opened = _unsearchable_dirs([Path(os.path.realpath(sys.executable)), ROOT])
    try:
        pw = pwd.getpwnam(name)
        u = User(name, pw.pw_uid, pw.pw_gid, home)
        u.chown(home)
        os.chmod(home, 0o700)
        os.chmod(FUSE, 0o666)
        for d in opened:
            os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) | stat.S_IXOTH)
        yield u
    finally:
        for d in opened:
            os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) & ~stat.S_IXOTH)
        os.chmod(FUSE, fuse_mode)
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)

