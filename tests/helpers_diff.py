"""Shared helpers for the differential (native vs mount) tests and workload tests."""
from __future__ import annotations

import ctypes
import errno
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import is_mounted, run_cli, wait_for

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = _libc.renameat2
_renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
_renameat2.restype = ctypes.c_int


def renameat2(src: str | os.PathLike, dst: str | os.PathLike, flags: int) -> None:
    """rename(2) with flags (RENAME_NOREPLACE, RENAME_EXCHANGE); raises OSError like os.rename."""
    rc = _renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), os.fspath(src), None, os.fspath(dst))


def outcome(fn: Callable[[], Any]) -> tuple:
    """("ok", value) or ("err", errno name): what a caller of fn observes."""
    try:
        return ("ok", fn())
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno, e.errno) if e.errno is not None else None)


def unmount(mnt: Path) -> None:
    """Unmount through the CLI (a clean shutdown that flushes the store) and wait for it."""
    run_cli("unmount", str(mnt))
    wait_for(lambda: not is_mounted(str(mnt)), f"{mnt} to unmount", timeout=30)


def run(cmd: list[str], cwd: str | os.PathLike, env: dict[str, str] | None = None,
        check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.update({
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
        "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "LC_ALL": "C",
    })
    full_env.pop("PYTHONDONTWRITEBYTECODE", None)  # tools behave as they would for a user
    if env:
        full_env.update(env)
    p = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300,
                       input=input)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} in {cwd} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p
