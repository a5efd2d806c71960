"""`overlayckpt bench`: the checks on REPO before anything is mounted, and the sample
of its files the write operations run on (cli/bench.py runs them)."""
from __future__ import annotations

import os
import random
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass

from overlayckpt.cli import client
from overlayckpt.errors import UserError
from overlayckpt.names import line_text

SAMPLE_FILES = 300
MAX_FILE = 256 << 10  # bytes: a bigger file is skipped (its content is held in memory)
WALK_SECONDS = 10.0  # the sampling walk stops here on a slow or huge tree
SEED = 33


# -- checks -------------------------------------------------------------------------

def mount_of(path: str) -> tuple[str, str]:
    """The mountpoint holding path and its filesystem type (from /proc/self/mounts)."""
    best, fstype = "/", ""
    with open("/proc/self/mounts", "rb") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            # (mounts escape spaces and the like as octal)
            point = fields[1].decode("unicode_escape").encode("latin-1")
            mnt = os.fsdecode(point)
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, fields[2].decode()
    return best, fstype


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_repo(repo_arg: str) -> str:
    """REPO as a real path, or one line saying why it cannot be measured."""
    shown = line_text(repo_arg)
    try:
        st = os.stat(repo_arg)
    except FileNotFoundError:
        raise UserError(f"bench: {shown} does not exist: give the repository to measure") from None
    except OSError as e:
        raise UserError(f"bench: cannot reach {shown} ({e.strerror}): give a readable "
                        "repository directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"bench: {shown} is not a directory: give the repository to measure")
    repo = os.path.realpath(repo_arg)
    if client.is_stale(repo):
        raise UserError(f"bench: {shown} is a stale mount (its daemon is gone): run "
                        "'overlayckpt unmount' on it first")
    point, fstype = mount_of(repo)
    if os.path.exists(os.path.join(repo, ".overlayckpt", "ctl")) or (
            fstype == "fuse.overlayckpt" and point == repo):
        raise UserError(f"bench: {shown} is an overlayckpt mount: bench the repository itself "
                        "(unmount it first if it is mounted in place)")
    if fstype == "fuse.overlayckpt":
        raise UserError(f"bench: {shown} is inside the overlayckpt mount {line_text(point)}: "
                        "bench the repository itself")
    if not os.access(repo, os.R_OK | os.X_OK):
        raise UserError(f"bench: {shown} is not readable: run as its owner")
    return repo


def check_fuse() -> None:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise UserError(f"bench: FUSE is not available here (/dev/fuse: {e.strerror}): install "
                        "fuse3 and load the fuse module ('modprobe fuse')") from None
    os.close(fd)
    if shutil.which("fusermount3") is None:
        raise UserError("bench: FUSE is not available here (no fusermount3): install fuse3")


def scratch_base(repo: str) -> str:
    """The temp directory the scratch directory goes in: never inside REPO (the store
    must not be in the lower, and REPO must stay as it was)."""
    base = os.path.realpath(tempfile.gettempdir())
    if _inside(base, repo):
        raise UserError(f"bench: the temp directory {line_text(base)} is inside the repository: "
                        "set TMPDIR to a directory outside it")
    return base


# -- sampling -----------------------------------------------------------------------

@dataclass(slots=True)
class Sample:
    files: list[str]  # relative paths, sorted
    walked: int  # regular files seen
    complete: bool  # the walk saw the whole tree within WALK_SECONDS


def sample_files(repo: str, limit: int = SAMPLE_FILES, seed: int = SEED,
                 budget: float = WALK_SECONDS) -> Sample:
    """Up to limit writable regular files of REPO (not in .git), chosen by reservoir
    sampling over a walk in sorted order: deterministic for a given tree."""
    rng = random.Random(seed)
    chosen: list[str] = []
    walked = eligible = 0
    deadline = time.monotonic() + budget
    stack = [""]
    complete = True
    while stack:
        if time.monotonic() > deadline:
            complete = False
            break
        rel = stack.pop()
        try:
            with os.scandir(os.path.join(repo, rel)) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        writable_dir = os.access(os.path.join(repo, rel), os.W_OK | os.X_OK)
        for e in entries:
            path = f"{rel}/{e.name}" if rel else e.name
            try:
                if e.is_dir(follow_symlinks=False):
                    if e.name not in (".git", ".overlayckpt"):
                        subdirs.append(path)
                    continue
                if not e.is_file(follow_symlinks=False):
                    continue
                size = e.stat(follow_symlinks=False).st_size
            except OSError:
                continue
            walked += 1
            if size > MAX_FILE or not writable_dir or not os.access(e.path, os.R_OK | os.W_OK):
                continue
            # reservoir sampling (algorithm R) over the files that qualify
            eligible += 1
            if len(chosen) < limit:
                chosen.append(path)
            else:
                j = rng.randrange(eligible)
                if j < limit:
                    chosen[j] = path
        stack.extend(reversed(subdirs))  # (depth first, in name order)
    return Sample(sorted(chosen), walked, complete)
