"""`overlayckpt bench REPO`: per-write snapshot latency on the user's own repository.

What runs, in order:

1. A walk of REPO in sorted order (at most WALK_SECONDS; `.git` and `.overlayckpt`
   skipped) samples up to SAMPLE_FILES regular files of at most MAX_FILE bytes that
   we may write, by reservoir sampling with a fixed seed: the same repo gives the
   same sample.
2. A scratch directory under $TMPDIR (never inside REPO) holds three things:
   `native/`, copies of the sampled files in their relative layout (the native
   contender: same filesystem as the store, so both write to the same disk);
   `mnt/`, where a scratch session mounts REPO at a separate mountpoint with
   `--no-apply` (REPO is its read-only lower, never written); `store/`, that
   session's store.
3. Rounds until --seconds have passed. In each round every write operation runs a
   batch on each side, native first in even rounds and mounted first in odd ones,
   so drift on a shared machine hits both alike: atomic save (write a temp file,
   rename it over the real one), in-place edit (open, 4 KiB pwrite, close), append,
   create a small new file, delete a real file, rename a real file. Then, in the
   mount only, a checkpoint (unnamed, as an agent's automatic ones are: a named
   one is also synced to disk) and a restore to the state at mount (checkpoint 0)
   through the control file, so that every round's writes in the mount are first
   touches of REPO's files again. (Native copies are not reset: a native delete
   removes a file written earlier in the run, whose blocks the filesystem frees,
   where the overlay keeps them as history.) After the restore the mount shows exactly REPO again,
   so `git status` and `git diff` (when REPO has a `.git` directory) compare like
   with like: native git runs on REPO itself, the mounted one on the mount, both
   with `--no-optional-locks` (and GIT_OPTIONAL_LOCKS=0), which keeps git from
   refreshing the index: it never writes REPO/.git, and writes nothing into the
   overlay either. The mount shows the lower's inode numbers, so REPO's index is
   as fresh in the mount as it is natively. A copy of REPO would be the other
   fair tree for git, but copying 200,000 files costs more than the whole bench.
   The git ops run in a round only while they have taken at most GIT_SHARE of the
   time, so a big repo still gets many write samples. Before the first round one
   `git status` on each side is reported on its own (git_status_first): in the
   mount it is the first, on the kernel's cold caches for the new mount.
4. Unmount (also on an error, Ctrl-C, SIGTERM or SIGHUP) and remove the scratch
   directory. Nothing is mounted and nothing is left beside REPO afterwards.

A repo whose `.git` is a file (a worktree, a submodule) has its git directory
outside REPO, where git in the mount would reach the real one: its git ops are
left out, and the report says why.

Times are perf_counter_ns around the operation alone; choosing targets and
putting deleted or renamed files back happen outside it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from overlayckpt.cli import client
from overlayckpt.errors import UserError
from overlayckpt.messages import CheckpointRequest, Request, RestoreRequest
from overlayckpt.names import line_text

SAMPLE_FILES = 300
MAX_FILE = 256 << 10  # bytes: a bigger file is skipped (its content is held in memory)
WALK_SECONDS = 10.0  # the sampling walk stops here on a slow or huge tree
SEED = 33
BATCH = 20  # files per write operation, per side and round
EDIT_SIZE = 4096
APPEND = b"// appended by overlayckpt bench\n"
NEW_FILE = b"x" * 1024
GIT_SHARE = 0.5  # at most this part of the measuring time goes to git ops
GIT_TIMEOUT = 600.0  # seconds one git command may take
READ_AHEAD_WAIT = 60.0  # seconds to let the daemon's read-ahead of REPO's metadata end
MAX_SECONDS = 3600.0
DAEMON_EXIT_WAIT = 30.0

WRITE_OPS = ("atomic_save", "edit", "append", "create", "delete", "rename")
GIT_OPS = ("git_status", "git_diff")


# -- checks -------------------------------------------------------------------------

def _mount_of(path: str) -> tuple[str, str]:
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
    point, fstype = _mount_of(repo)
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


# -- timing ---------------------------------------------------------------------------

def percentile(values: list[int], q: float) -> float:
    """Nearest-rank percentile of values (ns)."""
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


def _us(ns: float) -> float:
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


def _write_file(path: str, data: bytes, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
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
        _write_file(tmp, data, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
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
        _write_file(side.path(rel), APPEND, os.O_WRONLY | os.O_APPEND)
        side.record("append", time.perf_counter_ns() - t0)
        side.written += len(APPEND)

    def _create(self, side: Side, rel: str, n: int) -> None:
        path = os.path.join(os.path.dirname(side.path(rel)), f"bench-new-{n}.txt")
        t0 = time.perf_counter_ns()
        _write_file(path, NEW_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        side.record("create", time.perf_counter_ns() - t0)
        side.written += len(NEW_FILE)

    def _delete(self, side: Side, rel: str, n: int) -> None:
        path = side.path(rel)
        t0 = time.perf_counter_ns()
        os.unlink(path)
        side.record("delete", time.perf_counter_ns() - t0)
        # put it back, untimed: later operations (and git) find the file again
        side.written += _write_file(path, self.contents[rel], os.O_WRONLY | os.O_CREAT | os.O_EXCL)

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


# -- progress -------------------------------------------------------------------------

class Progress:
    """A bar on stderr when it is a terminal, else a line at every tenth."""

    WIDTH = 30

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def update(self, fraction: float, label: str) -> None:
        pct = max(0, min(100, int(fraction * 100)))
        if self.tty:
            filled = pct * self.WIDTH // 100
            sys.stderr.write(f"\r\x1b[K[{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                             f"{pct:3d}% {label}")
            sys.stderr.flush()
        elif pct > 0 and (pct // 10 > self.shown // 10 or self.shown <= 0):
            # (from the first step after sampling: a REPO refused then gets one line only)
            sys.stderr.write(f"overlayckpt bench: {pct}% {label}\n")
            sys.stderr.flush()
        self.shown = pct

    def done(self, ok: bool) -> None:
        if self.tty and self.shown >= 0:
            sys.stderr.write("\r\x1b[K")
        elif not self.tty and ok:
            sys.stderr.write("overlayckpt bench: 100% done\n")
        sys.stderr.flush()
        self.shown = -1


# -- the session ----------------------------------------------------------------------

class Scratch:
    """The scratch directory and the session mounted from it; close() unmounts and
    removes everything, whatever state the run stopped in."""

    def __init__(self, repo: str) -> None:
        self.repo = repo
        self.dir = tempfile.mkdtemp(prefix="overlayckpt-bench-", dir=scratch_base(repo))
        self.native = os.path.join(self.dir, "native")
        self.mnt = os.path.join(self.dir, "mnt")
        self.store = os.path.join(self.dir, "store")
        os.mkdir(self.native)
        os.mkdir(self.mnt)
        self.pid: int | None = None
        self.conn: client.Connection | None = None
        self.log_problems: list[str] = []  # what the daemon logged that it should not

    def mount(self) -> None:
        from overlayckpt.cli.daemon import spawn_daemon
        opts = argparse.Namespace(block_size=None, window=None, allow_other=False, verbose=False)
        spawn_daemon(self.repo, self.mnt, self.store, opts, False)
        self.pid = client.status(self.mnt).get("pid")
        self.conn = client.Connection(self.mnt)

    def call(self, cmd: Request[Any]) -> tuple[Any, int]:
        assert self.conn is not None
        t0 = time.perf_counter_ns()
        reply = self.conn.call(cmd)
        return reply, time.perf_counter_ns() - t0

    def _mounted(self) -> bool:
        return _mount_of(self.mnt)[0] == self.mnt

    def _daemon_pid(self) -> int | None:
        """Our daemon: known from its status, else the process we started with this
        store (the unique scratch path) and --foreground, if it is still starting."""
        if self.pid:
            return self.pid
        want = os.fsencode(self.store)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if want in argv and b"--foreground" in argv:
                return int(entry)
        return None

    def close(self) -> None:
        """Unmount (lazily if it must), wait for the daemon, remove the scratch dir."""
        from overlayckpt.cli.daemon import unmount
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        pid = self._daemon_pid()
        if pid and not self._mounted():  # (stopped while it started: let it mount first)
            deadline = time.monotonic() + DAEMON_EXIT_WAIT
            while client.pid_alive(pid) and not self._mounted() and time.monotonic() < deadline:
                time.sleep(0.02)
        if self._mounted():
            try:
                unmount(self.mnt, False)
            except (UserError, OSError):
                subprocess.run(["fusermount3", "-uz", self.mnt], check=False, capture_output=True)
        if pid:
            deadline = time.monotonic() + DAEMON_EXIT_WAIT
            while client.pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if client.pid_alive(pid):  # (the daemon we started; it ignored the unmount)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self._mounted():
            subprocess.run(["fusermount3", "-uz", self.mnt], check=False, capture_output=True)
        if self._mounted():  # never delete through a mount
            raise UserError(f"bench: {self.mnt} is still mounted: run 'fusermount3 -uz "
                            f"{self.mnt}', then remove {self.dir}")
        self.log_problems = _log_problems(os.path.join(self.store, "daemon.log"))
        shutil.rmtree(self.dir, ignore_errors=True)


# an unmount right after a close: the kernel's release finds its request gone (harmless)
_LOG_NOISE = ("fuse_reply_* failed with No such file or directory",)


def _log_problems(path: str) -> list[str]:
    """The daemon's warnings, errors and tracebacks, to report before its log goes."""
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines()
            if ("WARNING" in line or "ERROR" in line or "CRITICAL" in line
                or line.startswith("Traceback")) and not any(n in line for n in _LOG_NOISE)]


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _signals(handler: Any) -> None:
    """SIGTERM and SIGHUP end a run as Ctrl-C does, through the finally that unmounts."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)


# -- the run --------------------------------------------------------------------------

def _stat_key(path: str) -> tuple[int, ...] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _repo_marks(repo: str) -> list[tuple[int, ...] | None]:
    """Cheap marks of REPO that a write would move: the root, .git, its index and HEAD."""
    return [_stat_key(os.path.join(repo, p)) for p in ("", ".git", ".git/index", ".git/HEAD")]


def _wait_read_ahead(mnt: str, until: float) -> None:
    """Let the daemon's background read of REPO's metadata (started by the first
    listing) end before timing: it would share the CPU with the measured operations,
    and in real use it is over soon after mounting. Bounded by until."""
    os.listdir(mnt)
    while time.monotonic() < until:
        ahead = client.status(mnt).get("repo_read_ahead")
        if not isinstance(ahead, dict) or ahead.get("done", True):
            return
        time.sleep(0.05)


def summarize(native: Side, mounted: Side, ops: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for op in ops:
        a, b = native.samples.get(op), mounted.samples.get(op)
        if not a or not b:
            continue
        row: dict[str, Any] = {"count": min(len(a), len(b))}
        for q, key in ((0.5, "p50"), (0.99, "p99")):
            n, m = _us(percentile(a, q)), _us(percentile(b, q))
            row[f"native_{key}_us"] = n
            row[f"mounted_{key}_us"] = m
            # of the figures shown, so the row is consistent (a native p50 of a few µs
            # rounds to 0.1 µs: the ratio of the unrounded times could differ by 2%)
            row[f"ratio_{key}"] = round(m / n, 3) if n > 0 else None
        out[op] = row
    return out


def _mounted_only(samples: list[int]) -> dict[str, Any]:
    return {"count": len(samples), "p50_us": _us(percentile(samples, 0.5)),
            "p99_us": _us(percentile(samples, 0.99))} if samples else {"count": 0}


def run_bench(repo: str, seconds: float, progress: Progress) -> dict[str, Any]:
    started = time.monotonic()
    git_skip = git_problem(repo)
    progress.update(0.0, "sampling files")
    try:
        sample = sample_files(repo)
    except BaseException:
        progress.done(False)
        raise
    contents: dict[str, bytes] = {}
    for rel in sample.files:
        try:
            with open(os.path.join(repo, rel), "rb") as f:
                contents[rel] = f.read(MAX_FILE + 1)
        except OSError:
            continue  # (gone or changed since the walk: measure the others)
    sample.files = [rel for rel in sample.files if rel in contents]
    if not sample.files:
        progress.done(False)
        raise UserError(f"bench: {line_text(repo)} has no regular file of at most "
                        f"{MAX_FILE >> 10} KiB that could be written: nothing to measure")
    marks = _repo_marks(repo)
    scratch: Scratch | None = None
    ok = False
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        _signals(_stop)
        scratch = Scratch(repo)
        result = _measure(repo, seconds, progress, scratch, sample, contents, git_skip)
        ok = True
    finally:
        # nothing cuts the clean-up short: a mount left behind would outlive us
        for s in saved:
            signal.signal(s, signal.SIG_IGN)
        try:
            if scratch is not None:
                progress.update(max(progress.shown, 0) / 100, "unmounting")
                scratch.close()
            progress.done(ok)
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
    result["repo_untouched"] = _repo_marks(repo) == marks
    result["daemon_log_problems"] = scratch.log_problems if scratch is not None else []
    result["wall_s"] = round(time.monotonic() - started, 2)
    return result


def _measure(repo: str, seconds: float, progress: Progress, scratch: Scratch, sample: Sample,
             contents: dict[str, bytes], git_skip: str | None) -> dict[str, Any]:
    progress.update(0.02, "copying the sample")
    for rel in sample.files:
        dest = os.path.join(scratch.native, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        _write_file(dest, contents[rel], os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        shutil.copymode(os.path.join(repo, rel), dest)
    progress.update(0.04, "mounting")
    t0 = time.perf_counter_ns()
    scratch.mount()
    mount_ms = (time.perf_counter_ns() - t0) / 1e6
    progress.update(0.05, "reading ahead")
    t0 = time.perf_counter_ns()
    _wait_read_ahead(scratch.mnt, time.monotonic() + READ_AHEAD_WAIT)
    read_ahead_ms = (time.perf_counter_ns() - t0) / 1e6
    base = client.status(scratch.mnt)
    base_ck = base.get("live_checkpoint") or 0
    native = Side("native", scratch.native)
    mounted = Side("mounted", scratch.mnt)
    work = Workload(sample.files, contents)
    git_native = Side("native", repo)  # (git runs on REPO itself, read-only)
    git_sides = (git_native, mounted)
    if git_skip is None:
        progress.update(0.06, "first git status")
        for side in git_sides:  # the first one, cold in the mount: one sample each
            run_git(side, "git_status", "git_status_first")
    checkpoints: list[int] = []
    restores: list[int] = []
    changed: list[int] = []
    git_ns = 0
    begin = time.monotonic()
    rnd = 0
    while rnd == 0 or time.monotonic() - begin < seconds:
        order = (native, mounted) if rnd % 2 == 0 else (mounted, native)
        for op in WRITE_OPS:
            frac = min(1.0, (time.monotonic() - begin) / seconds)
            progress.update(0.08 + 0.9 * frac, f"round {rnd + 1}: {op}")
            targets = work.targets(op)
            first = work.counter
            work.counter += BATCH
            for side in order:
                work.run(op, side, targets, first)
        _, ns = scratch.call(CheckpointRequest(message=f"overlayckpt bench round {rnd + 1}"))
        checkpoints.append(ns)
        reply, ns = scratch.call(RestoreRequest(id=base_ck, what="code"))
        restores.append(ns)
        changed.append(int(reply.get("changed_keys") or 0))
        elapsed = time.monotonic() - begin
        if git_skip is None and (rnd == 0 or git_ns <= GIT_SHARE * elapsed * 1e9):
            progress.update(0.08 + 0.9 * min(1.0, elapsed / seconds), f"round {rnd + 1}: git")
            t0 = time.perf_counter_ns()
            git_order = git_sides if rnd % 2 == 0 else git_sides[::-1]
            for op in GIT_OPS:
                for side in git_order:
                    run_git(side, op, op)
            git_ns += time.perf_counter_ns() - t0
        rnd += 1
    measured = time.monotonic() - begin
    end = client.status(scratch.mnt)
    for op, samples in git_native.samples.items():
        native.samples[op] = samples
    grown = max(0, int(end.get("store_bytes", 0)) - int(base.get("store_bytes", 0)))
    mib = mounted.written / (1 << 20)
    blocks = max(0, int(end.get("blocks", 0)) - int(base.get("blocks", 0)))
    block_size = int(end.get("block_size") or 4096)
    ops = summarize(native, mounted, WRITE_OPS + GIT_OPS + ("git_status_first",))
    return {
        "repo": repo,
        "files_walked": sample.walked, "walk_complete": sample.complete,
        "files_sampled": len(sample.files), "seed": SEED, "batch": BATCH,
        "git": git_skip is None, "git_skipped": git_skip,
        "rounds": rnd, "measured_s": round(measured, 2), "mount_ms": round(mount_ms, 1),
        "read_ahead_ms": round(read_ahead_ms, 1),
        "ops": ops,
        "checkpoint": _mounted_only(checkpoints),
        "restore": {**_mounted_only(restores),
                    "p50_ms": round(percentile(restores, 0.5) / 1e6, 2),
                    "changed_entries_p50": int(percentile(changed, 0.5))},
        # on disk (data.mdb's allocated bytes: LMDB's copy-on-write pages included, which
        # it reuses later) and the blocks of content captured (count x block size)
        "store": {"bytes_written": mounted.written, "store_bytes_grown": grown,
                  "bytes_per_mib_written": round(grown / mib) if mib else None,
                  "blocks_grown": blocks, "block_bytes_per_mib_written":
                      round(blocks * block_size / mib) if mib else None},
    }


# -- output ---------------------------------------------------------------------------

def _fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us:,.0f} µs" if us < 100_000 else f"{us / 1e6:,.2f} s"


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def text_report(r: dict[str, Any]) -> str:
    walked = f"{r['files_walked']:,}" + ("" if r["walk_complete"] else "+ (walk cut short)")
    lines = [(f"overlayckpt bench {line_text(r['repo'])}: {r['files_sampled']} files sampled of "
              f"{walked}, {r['rounds']} rounds in {r['measured_s']:.1f} s "
              f"(mounted in {r['mount_ms']:.0f} ms)")]
    if not r["git"]:
        lines.append(f"git operations left out: {r['git_skipped']}")
    rows = [("operation", "n", "native p50", "mounted p50", "ratio", "native p99",
             "mounted p99", "ratio")]
    for op, o in r["ops"].items():
        rows.append((op, str(o["count"]), _fmt_us(o["native_p50_us"]), _fmt_us(o["mounted_p50_us"]),
                     _fmt_ratio(o["ratio_p50"]), _fmt_us(o["native_p99_us"]),
                     _fmt_us(o["mounted_p99_us"]), _fmt_ratio(o["ratio_p99"])))
    for op in ("checkpoint", "restore"):
        o = r[op]
        if o["count"]:
            rows.append((op, str(o["count"]), "-", _fmt_us(o["p50_us"]), "-", "-",
                         _fmt_us(o["p99_us"]), "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  ".join([row[0].ljust(widths[0])]
                               + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]).rstrip())
    s = r["store"]
    per = s["bytes_per_mib_written"]
    lines.append(f"store: grew {s['store_bytes_grown'] / (1 << 20):.2f} MiB for "
                 f"{s['bytes_written'] / (1 << 20):.2f} MiB written in the mount"
                 + (f" ({per / 1024:,.0f} KiB per MiB written; captured blocks "
                    f"{s['block_bytes_per_mib_written'] / 1024:,.0f} KiB per MiB)"
                    if per is not None else ""))
    rs = r["restore"]
    if rs["count"]:
        lines.append(f"restore to the state at mount: {rs['p50_ms']:.1f} ms p50 "
                     f"({rs['changed_entries_p50']} entries differing)")
    for line in r["daemon_log_problems"][:3]:
        lines.append(f"warning: the scratch daemon logged: {line_text(line)}")
    if not r["repo_untouched"]:
        lines.append(f"warning: {line_text(r['repo'])} or its .git changed during the run "
                     "(another program wrote it?)")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.mount or args.store:
        raise UserError("bench mounts a scratch session of its own (its store in a temp dir): "
                        "drop --mount and --store")
    seconds = args.seconds
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
        raise UserError(f"bench: --seconds {seconds!r} is not a number of seconds above 0 and "
                        f"at most {MAX_SECONDS:g}: pass e.g. --seconds 20")
    repo = check_repo(args.repo)
    check_fuse()
    result = run_bench(repo, seconds, Progress())
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(text_report(result))
    return 0
