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

This module runs the bench and reports it; the checks and the sample are in
bench_sample.py, the timed operations in bench_ops.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import FrameType
from typing import TypedDict

from overlayckpt.cli import client
from overlayckpt.cli.bench_ops import (
    BATCH,
    GIT_OPS,
    WRITE_OPS,
    Side,
    Workload,
    git_problem,
    percentile,
    run_git,
    us,
    write_file,
)
from overlayckpt.cli.bench_sample import (
    MAX_FILE,
    SEED,
    Sample,
    check_fuse,
    check_repo,
    mount_of,
    sample_files,
    scratch_base,
)
from overlayckpt.errors import UserError
from overlayckpt.messages import CheckpointRequest, R, Request, RestoreRequest
from overlayckpt.names import line_text

GIT_SHARE = 0.5  # at most this part of the measuring time goes to git ops
READ_AHEAD_WAIT = 60.0  # seconds to let the daemon's read-ahead of REPO's metadata end
MAX_SECONDS = 3600.0
DAEMON_EXIT_WAIT = 30.0


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
        spawn_daemon(self.repo, self.mnt, self.store, opts, False, started=self._started)
        self.conn = client.Connection(self.mnt)

    def call(self, cmd: Request[R]) -> tuple[R, int]:
        assert self.conn is not None
        t0 = time.perf_counter_ns()
        reply = self.conn.call(cmd)
        return reply, time.perf_counter_ns() - t0

    def _mounted(self) -> bool:
        return mount_of(self.mnt)[0] == self.mnt

    def _started(self, pid: int) -> None:
        self.pid = pid

    def close(self) -> None:
        """Unmount (lazily if it must), wait for the daemon, remove the scratch dir."""
        from overlayckpt.cli.daemon import unmount
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        pid = self.pid
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
            if not client.wait_gone(pid, DAEMON_EXIT_WAIT):  # (the daemon we started; it ignored the unmount)
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


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _signals(handler: Callable[[int, FrameType | None], None]) -> None:
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


# -- the report (its JSON, `bench --json`, is these dicts) ------------------------------

class OpRow(TypedDict):
    """One operation timed on both sides: µs at the median and the 99th percentile."""
    count: int
    native_p50_us: float
    mounted_p50_us: float
    ratio_p50: float | None  # mounted / native
    native_p99_us: float
    mounted_p99_us: float
    ratio_p99: float | None


class MountedOnly(TypedDict, total=False):
    """An operation that runs in the mount only (checkpoint, restore); no times if count is 0."""
    count: int
    p50_us: float
    p99_us: float


class RestoreRow(MountedOnly, total=False):
    p50_ms: float
    changed_entries_p50: int  # the store entries each restore wrote


class StoreGrowth(TypedDict):
    """On disk (data.mdb's allocated bytes: LMDB's copy-on-write pages included, which it
    reuses later), and the blocks of content captured (count x block size)."""
    bytes_written: int
    store_bytes_grown: int
    bytes_per_mib_written: int | None
    blocks_grown: int
    block_bytes_per_mib_written: int | None


class Measured(TypedDict):
    """What _measure found."""
    repo: str
    files_walked: int
    walk_complete: bool
    files_sampled: int
    seed: int
    batch: int
    git: bool
    git_skipped: str | None  # why the git ops were left out
    rounds: int
    measured_s: float
    mount_ms: float
    read_ahead_ms: float
    ops: dict[str, OpRow]
    checkpoint: MountedOnly
    restore: RestoreRow
    store: StoreGrowth


class Report(Measured):
    """The whole run."""
    repo_untouched: bool
    daemon_log_problems: list[str]
    wall_s: float


def _ratio(mounted: float, native: float) -> float | None:
    # of the figures shown, so the row is consistent (a native p50 of a few µs rounds to
    # 0.1 µs: the ratio of the unrounded times could differ by 2%)
    return round(mounted / native, 3) if native > 0 else None


def summarize(native: Side, mounted: Side, ops: tuple[str, ...]) -> dict[str, OpRow]:
    out: dict[str, OpRow] = {}
    for op in ops:
        a, b = native.samples.get(op), mounted.samples.get(op)
        if not a or not b:
            continue
        n50, m50 = us(percentile(a, 0.5)), us(percentile(b, 0.5))
        n99, m99 = us(percentile(a, 0.99)), us(percentile(b, 0.99))
        out[op] = {"count": min(len(a), len(b)),
                   "native_p50_us": n50, "mounted_p50_us": m50, "ratio_p50": _ratio(m50, n50),
                   "native_p99_us": n99, "mounted_p99_us": m99, "ratio_p99": _ratio(m99, n99)}
    return out


def _mounted_only(samples: list[int]) -> MountedOnly:
    return {"count": len(samples), "p50_us": us(percentile(samples, 0.5)),
            "p99_us": us(percentile(samples, 0.99))} if samples else {"count": 0}


def run_bench(repo: str, seconds: float, progress: Progress) -> Report:
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
    return {**result, "repo_untouched": _repo_marks(repo) == marks,
            "daemon_log_problems": scratch.log_problems if scratch is not None else [],
            "wall_s": round(time.monotonic() - started, 2)}


def _measure(repo: str, seconds: float, progress: Progress, scratch: Scratch, sample: Sample,
             contents: dict[str, bytes], git_skip: str | None) -> Measured:
    progress.update(0.02, "copying the sample")
    for rel in sample.files:
        dest = os.path.join(scratch.native, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        write_file(dest, contents[rel], os.O_WRONLY | os.O_CREAT | os.O_EXCL)
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
        keys = reply.get("changed_keys")
        changed.append(keys if isinstance(keys, int) else 0)
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


def text_report(r: Report) -> str:
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
    for op, m in (("checkpoint", r["checkpoint"]), ("restore", r["restore"])):
        if m["count"]:
            rows.append((op, str(m["count"]), "-", _fmt_us(m.get("p50_us")), "-", "-",
                         _fmt_us(m.get("p99_us")), "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  ".join([row[0].ljust(widths[0])]
                               + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]).rstrip())
    s = r["store"]
    per, blocks_per = s["bytes_per_mib_written"], s["block_bytes_per_mib_written"]
    lines.append(f"store: grew {s['store_bytes_grown'] / (1 << 20):.2f} MiB for "
                 f"{s['bytes_written'] / (1 << 20):.2f} MiB written in the mount"
                 + (f" ({per / 1024:,.0f} KiB per MiB written; captured blocks "
                    f"{blocks_per / 1024:,.0f} KiB per MiB)"
                    if per is not None and blocks_per is not None else ""))
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
