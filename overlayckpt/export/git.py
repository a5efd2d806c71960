"""Git plumbing on the repo's real .git, reached through the lower directory fd, with an
environment and configuration that keep git from running user code or looking elsewhere;
the fast-import stream; trailers of our commit messages.
"""
from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import trio

from overlayckpt.core.context import Context
from overlayckpt.errors import UserError

# Environment variables that would point git at another repository or object store.
_GIT_LOCATION_ENV = (
    "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES", "GIT_PREFIX",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM", "GIT_QUARANTINE_PATH", "GIT_SHALLOW_FILE", "GIT_GRAFT_FILE",
    "GIT_REPLACE_REF_BASE", "GIT_NO_REPLACE_OBJECTS",
)
# Settings that could make plumbing run user code, prompt, or write beside the objects.
# fastimport.unpackLimit=0: always write one pack into .git/objects/pack, never loose
# objects: in an in-place session the overlay may hold .git/objects/XX directories of its
# own, which would hide loose objects written behind it into the repo's.
_GIT_CONFIG = ("core.hooksPath=/dev/null", "core.fsmonitor=false", "gc.auto=0",
               "core.splitIndex=false", "maintenance.auto=false", "fastimport.unpackLimit=0")


# -- git --------------------------------------------------------------------------

class Git:
    """Git plumbing on the repo's real .git, reached through the lower directory fd."""

    def __init__(self, s: Context, tmpdir: str) -> None:
        self.git_dir = f"/proc/{os.getpid()}/fd/{s.lower.fd}/.git"
        self.tmpdir = tmpdir
        if not os.path.exists(self.git_dir):
            raise UserError(f"{s.repo} is not a git repository (no .git in the repo as mounted): "
                            "'git init' it, or use 'export bundle' to keep the session")
        env = {k: v for k, v in os.environ.items()
               if k not in _GIT_LOCATION_ENV and not k.startswith(("GIT_AUTHOR_", "GIT_COMMITTER_"))}
        env.update(GIT_DIR=self.git_dir, GIT_TERMINAL_PROMPT="0", GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
        self.env = env

    async def run(self, *args: str, stdin: Any = b"", check: bool = True) -> subprocess.CompletedProcess[bytes]:
        argv = ["git", "--bare"]
        for c in _GIT_CONFIG:
            argv += ["-c", c]
        argv += list(args)
        try:
            proc = await trio.run_process(argv, stdin=stdin, capture_stdout=True, capture_stderr=True,
                                          check=False, env=self.env, cwd=self.tmpdir)
        except FileNotFoundError:
            raise UserError("git is not installed: install git to export checkpoints as commits") from None
        if check and proc.returncode != 0:
            raise UserError(f"git {args[0]} failed: {last_line(proc.stderr)}")
        return proc

    def head_file(self) -> bytes:
        try:
            with open(os.path.join(self.git_dir, "HEAD"), "rb") as f:
                return f.read(4096).strip()
        except OSError:
            return b""


def last_line(err: bytes) -> str:
    lines = [ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "no error message"


def parse_trailers(message: bytes) -> dict[str, str]:
    """Our `Key: value` lines of a commit message (only at the start of a line)."""
    out: dict[str, str] = {}
    for line in message.decode(errors="replace").splitlines():
        m = re.match(r"(Checkpoint-[A-Za-z-]+|Overlayckpt-[A-Za-z-]+): (.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


class Stream:
    """The fast-import command stream, spooled to a file (it may hold much file data)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f = open(path, "wb")
        self.commits = 0

    def line(self, text: bytes) -> None:
        self.f.write(text + b"\n")

    def data(self, payload: bytes) -> None:
        self.f.write(b"data %d\n" % len(payload))
        self.f.write(payload)
        self.f.write(b"\n")

    def close(self) -> None:
        self.f.close()
