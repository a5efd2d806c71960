"""`overlayckpt bench`: the operations timed on each side (native, mounted): the write
operations on the sample's files and the git ones, and their samples (cli/bench.py
runs them in rounds)."""
from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass, field

from overlayckpt.cli.bench_sample import SEED
from overlayckpt.errors import UserError
from overlayckpt.names import line_text

BATCH = 20  # files per write operation, per side and round
EDIT_SIZE = 4096
APPEND = b"// appended by overlayckpt bench\n"
NEW_FILE = b"x" * 1024
GIT_TIMEOUT = 600.0  # seconds one git command may take

WRITE_OPS = ("atomic_save", "edit", "append", "create", "delete", "rename")
GIT_OPS = ("git_status", "git_diff")


# -- timing ---------------------------------------------------------------------------

def percentile(values: list[int], q: float) -> float:
    """Nearest-rank percentile of values (ns)."""
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


def us(ns: float) -> float:
    return round(ns / 1000, 1)


@dataclass(slots=True)
class Side:
    """One contender: a root and the samples of each operation on it."""
    name: str  # "native" or "mounted"
    root: str
    samples: dict[str, list[int]] = field(default_factory=dict)
    written: int = 0  # bytes written into this side (timed or not)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def record(self, op: str, ns: int) -> None:
        self.samples.setdefault(op, []).append(ns)


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return len(data)


def write_file(path: str, data: bytes, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
    try:
        return _write_all(fd, data)
    finally:
        os.close(fd)


class Workload:
    """The write operations, each on a file of the sample in turn, the same file
    for both sides; `counter` names temp and new files uniquely."""

    def __init__(self, files: list[str], contents: dict[str, bytes]) -> None:
        self.files = files
        self.contents = contents
        self.cursor = {op: i * BATCH for i, op in enumerate(WRITE_OPS)}
        self.counter = 0
        self.edit_buf = bytes(random.Random(SEED).getrandbits(8) for _ in range(EDIT_SIZE))

    def targets(self, op: str) -> list[str]:
        start = self.cursor[op]
        self.cursor[op] = start + BATCH
        return [self.files[(start + k) % len(self.files)] for k in range(BATCH)]

    def run(self, op: str, side: Side, targets: list[str], first: int) -> None:
        """One batch of op on side; first numbers the batch's temp and new files."""
        fn = getattr(self, "_" + op)
        for k, rel in enumerate(targets):
            fn(side, rel, first + k)

    def _atomic_save(self, side: Side, rel: str, n: int) -> None:
        path = side.path(rel)
        head, tail = os.path.split(path)
        tmp = os.path.join(head, f".{tail}.bench-{n}.tmp")
        data = b"// overlayckpt bench save %d\n" % n + self.contents[rel]
        t0 = time.perf_counter_ns()
        write_file(tmp, data, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.rename(tmp, path)
        side.record("atomic_save", time.perf_counter_ns() - t0)
        side.written += len(data)

    def _edit(self, side: Side, rel: str, n: int) -> None:
        path = side.path(rel)
        size = len(self.contents[rel])
        offset = EDIT_SIZE if size >= 2 * EDIT_SIZE else 0  # inside the file where it can be
        t0 = time.perf_counter_ns()
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, self.edit_buf, offset)
        finally:
            os.close(fd)
        side.record("edit", time.perf_counter_ns() - t0)
        side.written += EDIT_SIZE

    def _append(self, side: Side, rel: str, n: int) -> None:
        t0 = time.perf_counter_ns()
        write_file(side.path(rel), APPEND, os.O_WRONLY | os.O_APPEND)
        side.record("append", time.perf_counter_ns() - t0)
        side.written += len(APPEND)

    def _create(self, side: Side, rel: str, n: int) -> None:
        path = os.path.join(os.path.dirname(side.path(rel)), f"bench-new-{n}.txt")
        t0 = time.perf_counter_ns()
        write_file(path, NEW_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        side.record("create", time.perf_counter_ns() - t0)
        side.written += len(NEW_FILE)

    def _delete(self, side: Side, rel: str, n: int) -> None:
        path = side.path(rel)
        t0 = time.perf_counter_ns()
        os.unlink(path)
        side.record("delete", time.perf_counter_ns() - t0)
        # put it back, untimed: later operations (and git) find the file again
        side.written += write_file(path, self.contents[rel], os.O_WRONLY | os.O_CREAT | os.O_EXCL)

    def _rename(self, side: Side, rel: str, n: int) -> None:
        path = side.path(rel)
        moved = f"{path}.bench-mv"
        t0 = time.perf_counter_ns()
        os.rename(path, moved)
        side.record("rename", time.perf_counter_ns() - t0)
        os.rename(moved, path)  # (back, untimed)


def _git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_OPTIONAL_LOCKS="0", LC_ALL="C", GIT_TERMINAL_PROMPT="0")
    return env


def git_argv(root: str, op: str) -> list[str]:
    """git on root's work tree and root/.git, read-only: no index refresh
    (--no-optional-locks), no fsmonitor daemon started on it, no pager, no external
    diff programs."""
    base = ["git", "--no-pager", "--no-optional-locks", "-c", "core.fsmonitor=false",
            f"--git-dir={os.path.join(root, '.git')}", f"--work-tree={root}"]
    if op == "git_status":
        return base + ["status", "--porcelain"]
    return base + ["diff", "--no-ext-diff", "--no-textconv"]


def run_git(side: Side, op: str, record: str | None) -> None:
    argv = git_argv(side.root, op)
    t0 = time.perf_counter_ns()
    try:
        proc = subprocess.run(argv, check=False, cwd=side.root, env=_git_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=GIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise UserError(f"bench: {' '.join(argv[-2:])} took over {GIT_TIMEOUT:.0f} s "
                        f"({side.name}): try a smaller repository") from None
    ns = time.perf_counter_ns() - t0
    if proc.returncode != 0:
        why = (proc.stderr.decode(errors="replace").strip().splitlines() or ["failed"])[-1]
        raise UserError(f"bench: git {op.removeprefix('git_')} failed ({side.name}): "
                        f"{line_text(why)}")
    if record:
        side.record(record, ns)


def git_problem(repo: str) -> str | None:
    """Why the git ops are left out (None: they run)."""
    dotgit = os.path.join(repo, ".git")
    if not os.path.lexists(dotgit):
        return "not a git repository"
    if os.path.islink(dotgit) or not os.path.isdir(dotgit):
        return ".git is not a directory (a worktree or submodule): its git directory is " \
               "outside the repository, which git in the mount would write"
    if shutil.which("git") is None:
        return "git is not installed"
    return None
