"""What is timed, and only that.

Each workload is run in rounds: in every round each contender does a batch of
iterations, so machine drift (other tenants, page-cache pressure, thermal)
hits all contenders alike. ``time.perf_counter_ns`` brackets the operation
itself; choosing targets, resetting state and verifying results happen
outside it. A workload may produce several metrics (e.g. create and rm), and
every contender sees the same targets in the same order.

Workloads run in one thread; a contender's ``root`` is the only path they use.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.contenders import Contender, ContenderError, _git_env
from bench.gen import BIG_FILE, BIG_FILE_SIZE, Repo, text_blob, vocabulary

Samples = dict[str, list[int]]
EDIT_SIZE = 4096
EDIT_OFFSET = 4096  # targets are 8-32 KiB, so the block lies inside the file
SUBPROCESS_TIMEOUT = 3600


def now() -> int:
    return time.perf_counter_ns()


def drop_caches() -> bool:
    """Write back and drop the page, dentry and inode caches; False if not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def small_edit(path: Path | str, buf: bytes) -> None:
    """The agent's basic move: open, 4 KiB overwrite, close."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, buf, EDIT_OFFSET)
    finally:
        os.close(fd)


class TargetPool:
    """Deterministic supply of distinct ~20 KB text files, so first touches really are first."""

    def __init__(self, repo: Repo) -> None:
        files = repo.text_files(8 * 1024, 32 * 1024)
        random.Random(7).shuffle(files)
        self.files = files
        self.next = 0
        self.wrapped = False

    def remaining(self) -> int:
        return len(self.files) - self.next

    def take(self, k: int) -> list[str]:
        out = []
        for _ in range(k):
            if self.next >= len(self.files):
                self.next = 0
                self.wrapped = True
            out.append(self.files[self.next])
            self.next += 1
        return out


@dataclass
class History:
    """Per-contender bookkeeping for the checkpoint workloads."""

    step: int = 0
    markers: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # ckpt -> (file, marker)
    verify_failures: int = 0
    verify_ok: int = 0


@dataclass
class Ctx:
    """Everything workloads share for one repo size."""

    repo: Repo
    quick: bool
    history_lengths: tuple[int, int]
    can_drop_caches: bool
    tick: Callable[[int], None]
    largest: bool = True  # the run's largest repo size (the long workloads run there only)
    projects: bool = False  # the real projects' repo (bench/projects.py), not a generated one
    big_tree: bool = False  # the big tree's repo (--big-tree): only its workloads run there
    long_session: tuple[int, int] = (20_000, 2_000)  # journal records, checkpoints
    created_files: int = 5_000  # long_session: files one loop creates before a restore across them
    log: Callable[[str], None] = print
    pool: TargetPool = field(init=False)
    ckpt_targets: list[str] = field(init=False)
    text: list[bytes] = field(init=False)
    hist: dict[str, History] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, dict] = field(default_factory=dict)  # workload -> contender -> facts

    def __post_init__(self) -> None:
        self.pool = TargetPool(self.repo)
        self.ckpt_targets = self.pool.take(50)
        self.text = vocabulary(random.Random(11))

    def edit_buf(self, marker: bytes = b"") -> bytes:
        body = text_blob(random.Random(len(marker) + 3), self.text, EDIT_SIZE)
        return (marker + body)[:EDIT_SIZE]

    def history(self, c: Contender) -> History:
        return self.hist.setdefault(c.name, History())

    def history_step(self, c: Contender) -> tuple[str, bytes]:
        """One real change before a checkpoint: an edit whose marker a restore can verify."""
        h = self.history(c)
        rel = self.ckpt_targets[h.step % len(self.ckpt_targets)]
        marker = b"/* bench checkpoint step %09d */\n" % h.step
        small_edit(c.root / rel, self.edit_buf(marker))
        h.step += 1
        return rel, marker

    def record_checkpoint(self, c: Contender, ckpt: str, change: tuple[str, bytes] | None) -> None:
        c.ckpts.append(ckpt)
        if change is not None:
            self.history(c).markers[ckpt] = change

    def verify(self, c: Contender, ckpt: str) -> None:
        """After a restore, the file changed just before *ckpt* must hold that change."""
        h = self.history(c)
        if ckpt not in h.markers:
            return
        rel, marker = h.markers[ckpt]
        with open(c.root / rel, "rb") as f:
            f.seek(EDIT_OFFSET)
            got = f.read(len(marker))
        if got == marker:
            h.verify_ok += 1
        else:
            h.verify_failures += 1


class Workload:
    """Base: ``plan`` says how many iterations and rounds; ``run`` times a batch."""

    name = "base"
    only_checkpoint = False  # only contenders that checkpoint (shadow-git, overlayckpt)
    only_projects = False  # only on the real projects' repo (bench/project_workloads.py)
    only_big_tree = False  # only on the big tree's repo (bench/tree_workloads.py)
    iterations = (1, 1)  # (quick, full) per contender
    rounds = (1, 1)

    def applies(self, c: Contender) -> bool:
        return c.supports_checkpoint if self.only_checkpoint else c.applies_to_fs_workloads

    def wanted(self, ctx: Ctx) -> bool:
        """Whether to run at this repo size at all."""
        return True

    def plan(self, ctx: Ctx) -> tuple[int, int]:
        i = self.iterations[0] if ctx.quick else self.iterations[1]
        r = self.rounds[0] if ctx.quick else self.rounds[1]
        return i, max(1, min(r, i))

    def setup(self, ctx: Ctx) -> None:
        """Once per repo size, before any contender (pick shared targets here)."""

    def prepare(self, c: Contender, ctx: Ctx) -> None:
        """Once per contender, untimed."""

    def run(self, c: Contender, ctx: Ctx, start: int, count: int, out: Samples) -> None:
        raise NotImplementedError

    def finish(self, c: Contender, ctx: Ctx) -> None:
        """Once per contender after the last round, untimed."""


def resident_memory(pid: int) -> dict[str, int]:
    """The process's resident memory: all of it, its own (anonymous and shared memory) and
    the file pages it maps (for our daemon: LMDB's store, page cache the kernel reclaims)."""
    with open(f"/proc/{pid}/status") as f:
        kb = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
              if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    return {"rss": kb.get("VmRSS", 0), "own": kb.get("RssAnon", 0) + kb.get("RssShmem", 0),
            "mapped_files": kb.get("RssFile", 0)}


def _add(out: Samples, metric: str, ns: int) -> None:
    out.setdefault(metric, []).append(ns)


# --- plain file operations ----------------------------------------------------------


class EditFirst(Workload):
    """4 KiB overwrite of a file never written before (copy-up on overlays)."""

    name = "edit_first"
    iterations = (100, 1000)
    rounds = (5, 10)

    def plan(self, ctx: Ctx) -> tuple[int, int]:
        i, r = super().plan(ctx)
        return min(i, max(10, ctx.pool.remaining() - 120)), r

    def setup(self, ctx: Ctx) -> None:
        self.targets = ctx.pool.take(self.plan(ctx)[0])
        self.buf = ctx.edit_buf(b"/* first */")

    def run(self, c, ctx, start, count, out):
        root, buf = c.root, self.buf
        for i in range(start, start + count):
            path = root / self.targets[i]
            t0 = now()
            fd = os.open(path, os.O_WRONLY)
            os.pwrite(fd, buf, EDIT_OFFSET)
            os.close(fd)
            _add(out, "edit_first", now() - t0)
            ctx.tick(1)


class EditRepeat(Workload):
    """4 KiB overwrite of files already written (the steady state of an agent's loop)."""

    name = "edit_repeat"
    iterations = (300, 3000)
    rounds = (5, 10)

    def setup(self, ctx):
        self.targets = ctx.pool.take(16)
        self.buf = ctx.edit_buf(b"/* again */")

    def prepare(self, c, ctx):
        for rel in self.targets:
            small_edit(c.root / rel, self.buf)

    def run(self, c, ctx, start, count, out):
        root, buf, n = c.root, self.buf, len(self.targets)
        for i in range(start, start + count):
            path = root / self.targets[i % n]
            t0 = now()
            fd = os.open(path, os.O_WRONLY)
            os.pwrite(fd, buf, EDIT_OFFSET)
            os.close(fd)
            _add(out, "edit_repeat", now() - t0)
            ctx.tick(1)


class AtomicSave(Workload):
    """Editor-style save: write a temp file beside the target, (fsync,) rename over it."""

    iterations = (200, 2000)
    rounds = (5, 10)

    def __init__(self, fsync: bool) -> None:
        self.fsync = fsync
        self.name = "atomic_save_fsync" if fsync else "atomic_save"
        if fsync:
            self.iterations = (100, 1000)

    def setup(self, ctx):
        self.targets = ctx.pool.take(32)
        self.data = text_blob(random.Random(5), ctx.text, 20 * 1024)

    def run(self, c, ctx, start, count, out):
        data, sync = self.data, self.fsync
        for i in range(start, start + count):
            path = c.root / self.targets[i % len(self.targets)]
            tmp = path.with_name("." + path.name + ".bench-tmp")
            t0 = now()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, data)
            if sync:
                os.fsync(fd)
            os.close(fd)
            os.rename(tmp, path)
            _add(out, self.name, now() - t0)
            ctx.tick(1)


class AppendLog(Workload):
    """Open with O_APPEND, add one line, close: build and agent logs."""

    name = "append_log"
    iterations = (300, 3000)
    rounds = (5, 10)
    LOG = "bench-agent.log"

    def prepare(self, c, ctx):
        (c.root / self.LOG).write_bytes(b"")

    def run(self, c, ctx, start, count, out):
        path = c.root / self.LOG
        for i in range(start, start + count):
            line = b"%08d step ok: compiled 3 targets, 0 warnings, took 12 ms\n" % i
            t0 = now()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.write(fd, line)
            os.close(fd)
            _add(out, "append_log", now() - t0)
            ctx.tick(1)

    def finish(self, c, ctx):
        (c.root / self.LOG).unlink(missing_ok=True)


class CreateDelete(Workload):
    """Create a 1 KiB file in an existing source dir, close, unlink it."""

    name = "create_delete"
    iterations = (200, 2000)
    rounds = (5, 10)

    def setup(self, ctx):
        self.dir = os.path.dirname(ctx.pool.take(1)[0])
        self.data = b"x" * 1024

    def run(self, c, ctx, start, count, out):
        d, data = c.root / self.dir, self.data
        for i in range(start, start + count):
            path = d / f"bench-cd-{i}.tmp"
            t0 = now()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)
            os.unlink(path)
            _add(out, "create_delete", now() - t0)
            ctx.tick(1)


class ManySmall(Workload):
    """A package install: thousands of small files in nested dirs, then ``rm -rf``."""

    name = "many_small"
    iterations = (1, 3)
    rounds = (1, 3)

    def setup(self, ctx):
        n_files = 1000 if ctx.quick else 20000
        rng = random.Random(13)
        self.dirs: list[str] = []
        self.files: list[tuple[str, bytes]] = []
        pkg = 0
        while len(self.files) < n_files:
            base = f"node_modules/pkg-{pkg:05d}"
            pkg += 1
            self.dirs += [base, f"{base}/lib", f"{base}/dist"]
            self.files.append((f"{base}/package.json", b'{"name": "pkg-%d", "version": "1.0.0"}\n' % pkg))
            for j in range(rng.randint(3, 15)):
                sub = "lib" if j % 2 else "dist"
                size = int(100 * 40 ** rng.random())  # 100 B - 4 KB
                self.files.append((f"{base}/{sub}/m{j}.js", b"module.exports = 1;\n" * (size // 20 + 1)))
        self.files = self.files[:n_files]

    def run(self, c, ctx, start, count, out):
        root = c.root
        for _ in range(count):
            t0 = now()
            os.mkdir(root / "node_modules")
            for d in self.dirs:
                os.mkdir(root / d)
            for k, (rel, data) in enumerate(self.files):
                fd = os.open(root / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.write(fd, data)
                os.close(fd)
                if k % 500 == 0:
                    ctx.tick(0)
            _add(out, "many_small_create", now() - t0)
            t0 = now()
            subprocess.run(["rm", "-rf", "node_modules"], cwd=root, check=True, timeout=SUBPROCESS_TIMEOUT)
            _add(out, "many_small_rm", now() - t0)
            ctx.tick(1)


class SmallEdits(Workload):
    """One process editing many files (issue 18: "1,000 small edits from one Python
    process about 7x", "1,000 `sed -i` edits 2.84x native"): open, a few bytes written
    inside, close, over N files of the repo never written before, spread over its
    directories (the first touch after the mount: a copy-up on an overlay), then over
    the same N again; and N `sed -i` runs, each on a file never written before. One
    sample is a whole batch of N."""

    name = "small_edits"
    iterations = (2, 3)  # batches per contender
    rounds = (2, 3)
    EDIT = b"/*ed*/"
    EDIT_AT = 32

    def setup(self, ctx):
        batches = self.plan(ctx)[0]
        # below the target pool's 8-32 KiB: files no other workload writes
        files = ctx.repo.text_files(self.EDIT_AT + len(self.EDIT), 8 * 1024 - 1)
        random.Random(29).shuffle(files)
        n = min(200 if ctx.quick else 1000, len(files) // (2 * batches))
        self.n = n
        self.edits = [files[2 * b * n:(2 * b + 1) * n] for b in range(batches)]
        self.seds = [files[(2 * b + 1) * n:(2 * b + 2) * n] for b in range(batches)]

    def run(self, c, ctx, start, count, out):
        root, edit, at = c.root, self.EDIT, self.EDIT_AT
        for b in range(start, start + count):
            paths = [root / rel for rel in self.edits[b]]
            for metric in ("small_edits_first", "small_edits_again"):
                t0 = now()
                for path in paths:
                    fd = os.open(path, os.O_WRONLY)
                    os.pwrite(fd, edit, at)
                    os.close(fd)
                _add(out, metric, now() - t0)
            t0 = now()
            for rel in self.seds[b]:
                subprocess.run(["sed", "-i", "1s/$/ x/", rel], cwd=root, check=True,
                               timeout=SUBPROCESS_TIMEOUT)
            _add(out, "sed_i", now() - t0)
            ctx.tick(1)


class BigFileEdit(Workload):
    """4 KiB overwrite inside a 50 MiB file; the first one pays any whole-file copy-up."""

    name = "bigfile"
    iterations = (50, 500)
    rounds = (5, 10)

    def setup(self, ctx):
        rng = random.Random(17)
        n = self.plan(ctx)[0]
        self.offsets = [rng.randrange(BIG_FILE_SIZE // 4096) * 4096 for _ in range(n)]
        self.buf = ctx.edit_buf(b"big")

    def run(self, c, ctx, start, count, out):
        path = c.root / BIG_FILE
        for i in range(start, start + count):
            t0 = now()
            fd = os.open(path, os.O_WRONLY)
            os.pwrite(fd, self.buf, self.offsets[i])
            os.close(fd)
            _add(out, "bigfile_first" if i == 0 else "bigfile_edit", now() - t0)
            ctx.tick(1)

    def finish(self, c, ctx):
        # Put the blob back: a dirty 50 MiB file would make every later `git status`
        # re-hash it, and that hashing would swamp what those workloads measure.
        subprocess.run(["git", "checkout", "--", BIG_FILE], cwd=c.root, check=True,
                       stdout=subprocess.DEVNULL, timeout=SUBPROCESS_TIMEOUT)


class SeqIO(Workload):
    """64 MiB written sequentially (1 MiB writes, fsync), then read back."""

    name = "seq_io"
    iterations = (2, 5)
    rounds = (2, 5)
    SIZE = 64 * 1024 * 1024
    CHUNK = 1024 * 1024

    def setup(self, ctx):
        self.chunk = random.Random(19).randbytes(self.CHUNK)

    def run(self, c, ctx, start, count, out):
        path = c.root / "bench-seq.bin"
        for _ in range(count):
            t0 = now()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for _ in range(self.SIZE // self.CHUNK):
                os.write(fd, self.chunk)
            os.fsync(fd)
            os.close(fd)
            _add(out, "seq_write_64m", now() - t0)
            t0 = now()
            fd = os.open(path, os.O_RDONLY)
            while os.read(fd, self.CHUNK):
                pass
            os.close(fd)
            _add(out, "seq_read_64m", now() - t0)
            os.unlink(path)
            ctx.tick(1)


class Incompressible(Workload):
    """Store growth for incompressible data: 256 MiB of random bytes (1 MiB writes, fsync)
    and a checkpoint, the store's allocated bytes before and after (issue 18: <= 1.1x;
    a few MiB of it are pages the store reuses, whatever the size)."""

    name = "incompressible"
    only_checkpoint = True
    iterations = (1, 3)
    rounds = (1, 3)
    SIZE = 256 * 1024 * 1024
    CHUNK = 1024 * 1024

    def run(self, c, ctx, start, count, out):
        for i in range(start, start + count):
            rng = random.Random(23 + i)  # new bytes each time (the same would be deduplicated)
            path = c.root / f"bench-random-{i}.bin"
            _, d0 = c.store_bytes()
            t0 = now()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for _ in range(self.SIZE // self.CHUNK):
                os.write(fd, rng.randbytes(self.CHUNK))
            os.fsync(fd)
            os.close(fd)
            c.checkpoint()
            _add(out, "random_write_256m", now() - t0)
            _, d1 = c.store_bytes()
            ctx.extra.setdefault("store_incompressible", {}).setdefault(c.name, []).append(
                (d1 - d0) / self.SIZE)
            os.unlink(path)
            ctx.tick(1)


class DaemonMemory(Workload):
    """The FUSE daemon's resident memory after a walk that stats every entry (``find
    -ls``; issue 18: <= 100 MB at 200,000 files), and the walk's time."""

    name = "daemon_memory"
    iterations = (1, 1)
    rounds = (1, 1)

    def applies(self, c: Contender) -> bool:
        return c.is_fuse

    def wanted(self, ctx: Ctx) -> bool:
        return ctx.largest

    def run(self, c, ctx, start, count, out):
        pid = c.daemon_pid()
        t0 = now()
        subprocess.run(["find", str(c.root), "-ls"], stdout=subprocess.DEVNULL, check=True)
        _add(out, "walk_find_ls", now() - t0)
        if pid is not None:
            mem = resident_memory(pid)
            ctx.extra.setdefault("daemon_rss", {})[c.name] = mem["rss"]
            ctx.extra.setdefault("daemon_rss_parts", {})[c.name] = {
                "anon": mem["own"], "file": mem["mapped_files"]}
        ctx.tick(1)


class TreeCommand(Workload):
    """A whole-tree command (``git status``, ``tar``), cold then warm.

    Each iteration: FUSE contenders are remounted (their own caches go), the
    kernel's caches are dropped, one cold run is timed, then the warm runs
    follow at once (the cold run is their warm-up).
    """

    def __init__(self, base: str, argv: list[str], iterations: tuple[int, int],
                 warm_runs: tuple[int, int]) -> None:
        self.name = base
        self.argv = argv
        self.iterations = iterations
        self.rounds = iterations
        self.warm_runs = warm_runs

    def _run(self, c: Contender) -> None:
        subprocess.run(self.argv, cwd=c.root, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=SUBPROCESS_TIMEOUT)

    def run(self, c, ctx, start, count, out):
        for _ in range(count):
            if c.is_fuse:
                c.remount()
            drop_caches()
            t0 = now()
            self._run(c)
            _add(out, f"{self.name}_cold", now() - t0)
            for _ in range(self.warm_runs[0] if ctx.quick else self.warm_runs[1]):
                t0 = now()
                self._run(c)
                _add(out, f"{self.name}_warm", now() - t0)
            ctx.tick(1)


# --- history: checkpoints and restores ------------------------------------------------


class Checkpoint(Workload):
    """Cost of one checkpoint right after one small edit; also store growth per edit."""

    name = "checkpoint"
    only_checkpoint = True
    # quick: still 5 per round, so one first-after-idle sample (pages the host reclaimed
    # while other contenders ran) does not decide the p50
    iterations = (20, 100)
    rounds = (4, 10)

    def setup(self, ctx):
        self.before: dict[str, tuple[int, int]] = {}

    def prepare(self, c, ctx):
        self.before[c.name] = c.store_bytes()

    def run(self, c, ctx, start, count, out):
        cli = getattr(c, "checkpoint_cli", None)
        for i in range(start, start + count):
            change = ctx.history_step(c)
            t0 = now()
            ckpt = c.checkpoint()
            _add(out, "checkpoint", now() - t0)
            ctx.record_checkpoint(c, ckpt, change)
            if cli is not None and i % 2 == 0:  # the same through the CLI, process start-up included
                change = ctx.history_step(c)
                t0 = now()
                ckpt = cli()
                _add(out, "checkpoint_cli", now() - t0)
                ctx.record_checkpoint(c, ckpt, change)
            ctx.tick(1)

    def finish(self, c, ctx):
        n = self.plan(ctx)[0]
        if getattr(c, "checkpoint_cli", None) is not None:
            n += (n + 1) // 2  # the CLI checkpoints had an edit each too
        a0, d0 = self.before[c.name]
        a1, d1 = c.store_bytes()
        ctx.extra.setdefault("store_growth", {})[c.name] = {
            "edits": n,
            "apparent_bytes_per_edit": (a1 - a0) / n,
            "disk_bytes_per_edit": (d1 - d0) / n,
            "store_apparent_bytes": a1,
            "store_disk_bytes": d1,
        }


class Restore(Workload):
    """Restore 1, 10 and 100 changes back (then return to the newest, untimed)."""

    name = "restore"
    only_checkpoint = True
    iterations = (2, 10)
    rounds = (2, 10)
    BACK = (1, 10, 100)

    def prepare(self, c, ctx):
        # Real one-edit checkpoints, so "100 back" means 100 real changes.
        while len(c.ckpts) < max(self.BACK) + 1:
            change = ctx.history_step(c)
            ctx.record_checkpoint(c, c.checkpoint(), change)
            ctx.tick(0)

    def run(self, c, ctx, start, count, out):
        head = c.ckpts[-1]
        cli = getattr(c, "restore_cli", None)
        for _ in range(count):
            for back in self.BACK:
                t0 = now()
                target = c.restore_back(back)
                _add(out, f"restore_{back}", now() - t0)
                ctx.verify(c, target)
                c.restore(head)
                ctx.verify(c, head)
            if cli is not None:  # the same through the CLI, process start-up included
                target = c.ckpts[-1 - self.BACK[-1]]
                t0 = now()
                cli(target)
                _add(out, f"restore_{self.BACK[-1]}_cli", now() - t0)
                ctx.verify(c, target)
                c.restore(head)
                ctx.verify(c, head)
            ctx.tick(1)


class RestoreDelta(Workload):
    """Restore cost against the size of what differs (SPEC 6: a 20,000-file restore
    at most 2x a 100-file one, both <= 100 ms at 100k files): checkpoints base ->
    100 files edited in place -> BIG files edited in place -> the same BIG files
    replaced by atomic saves (new inodes, so every name changed), then restores
    walking that chain down and up, so each restore crosses one delta, the small and
    big ones alternated. Then a branch switch: SWITCH other files committed on a
    branch of their own and `git switch` back (git rewrites each as a new inode,
    and its index, HEAD and logs), restored across both ways. After each restore, a
    metadata walk of the whole tree (every name lstat'ed): what the restore left the
    next reader to pay. The reply's phases (took_ms) go into the results' extra
    "restore_delta"."""

    name = "restore_delta"
    only_checkpoint = True
    iterations = (2, 5)
    rounds = (2, 5)
    SMALL = 100
    BIG = 20_000
    SWITCH = 10_000

    def wanted(self, ctx):
        return len(ctx.repo.files) >= 4 * self.SMALL

    def setup(self, ctx):
        files = [p for p, _ in ctx.repo.files]
        random.Random(17).shuffle(files)
        self.big_n = min(self.BIG, (len(files) - 2 * self.SMALL) // 2)
        self.switch_n = min(self.SWITCH, len(files) - 2 * self.SMALL - self.big_n)
        self.small = files[:self.SMALL]
        self.big = files[self.SMALL:self.SMALL + self.big_n]
        self.switch = files[self.SMALL + self.big_n:][:self.switch_n]
        self.chain: dict[str, list[str]] = {}
        self.phases: dict[str, dict[str, list[float]]] = {}

    @staticmethod
    def _edit(root: Path, rel: str, tag: bytes) -> None:
        fd = os.open(root / rel, os.O_WRONLY)
        try:
            os.pwrite(fd, tag, 0)  # (in place: same inode, same name, new content)
        finally:
            os.close(fd)

    @staticmethod
    def _save(root: Path, rel: str, tag: bytes) -> None:
        path = root / rel
        data = tag + path.read_bytes()[len(tag):]
        tmp = path.with_name(path.name + ".delta~")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # (an editor's or formatter's save: a new inode under the name)

    def prepare(self, c, ctx):
        root = c.root
        chain = [c.checkpoint()]
        for rel in self.small:
            self._edit(root, rel, b"/* delta small */\n")
        chain.append(c.checkpoint())
        for i, rel in enumerate(self.big):
            self._edit(root, rel, b"/* delta big */\n")
            if i % 1000 == 0:
                ctx.tick(0)
        chain.append(c.checkpoint())
        for i, rel in enumerate(self.big):
            self._save(root, rel, b"/* delta save */\n")
            if i % 1000 == 0:
                ctx.tick(0)
        chain.append(c.checkpoint())
        chain += self._branch_switch(c, ctx)
        self.chain[c.name] = chain  # base, small, big edits, big saves, on branch, back
        self._walk(root)

    def _branch_switch(self, c, ctx) -> list[str]:
        """[checkpoint on a branch whose last commit changed the SWITCH files, checkpoint
        after `git switch` back]; other changes stay uncommitted in the work tree."""
        root = c.root

        def git(*args: str, data: bytes | None = None) -> str:
            # (no auto gc: its background repack would delete loose objects under the walks)
            return subprocess.run(["git", "-c", "gc.auto=0", *args], cwd=root, input=data, check=True,
                                  capture_output=True, env=_git_env(),
                                  timeout=SUBPROCESS_TIMEOUT).stdout.decode().strip()
        home = git("rev-parse", "--abbrev-ref", "HEAD")
        git("switch", "-q", "-c", "bench-switch")
        for i, rel in enumerate(self.switch):
            self._edit(root, rel, b"/* delta switch */\n")
            if i % 1000 == 0:
                ctx.tick(0)
        git("add", "--pathspec-from-file=-", data="\n".join(self.switch).encode())
        git("commit", "-q", "-m", "bench: switch")
        on_branch = c.checkpoint()
        git("switch", "-q", home)
        return [on_branch, c.checkpoint()]

    @staticmethod
    def _walk(root: Path) -> int:
        n = 0
        for dirpath, _dirnames, filenames in os.walk(root):
            for name in filenames:
                os.lstat(os.path.join(dirpath, name))
                n += 1
        return n

    def _check(self, c, rel: str, tag: bytes | None) -> None:
        """rel starts with tag (None: with none of the tags) after a restore."""
        with open(c.root / rel, "rb") as f:
            head = f.read(32)
        if head.startswith(b"/* delta") if tag is None else not head.startswith(tag):
            raise ContenderError(f"{c.name}: {rel} starts with {head!r} after a restore "
                                 f"(want {tag!r})")

    def run(self, c, ctx, start, count, out):
        base, small, edits, saves, on_branch, back = self.chain[c.name]
        big, switch = f"{self.big_n}", f"switch_{self.switch_n}"
        # (to, metric or None: not measured, a file and what it must start with afterwards);
        # from the state prepare left (back from the branch), and back to it
        steps = [(on_branch, switch, self.switch[0], b"/* delta switch */"),
                 (back, switch, self.switch[1], None),
                 (saves, None, self.big[3], b"/* delta save */"),
                 (edits, f"edit_{big}", self.big[0], b"/* delta big */"),
                 (small, f"edit_{big}", self.big[1], None),
                 (base, f"edit_{self.SMALL}", self.small[0], None),
                 (small, f"edit_{self.SMALL}", self.small[1], b"/* delta small */"),
                 (edits, f"edit_{big}", self.big[2], b"/* delta big */"),
                 (saves, f"save_{big}", self.big[3], b"/* delta save */"),
                 (back, None, self.switch[2], None)]
        for _ in range(count):
            for target, what, rel, tag in steps:
                t0 = now()
                c.restore(target)
                took = now() - t0
                if what is None:
                    self._check(c, rel, tag)
                    continue
                _add(out, f"restore_delta_{what}", took)
                reply = getattr(c, "last_restore", None) or {}
                for phase, ms in (reply.get("took_ms") or {}).items():
                    self.phases.setdefault(what, {}).setdefault(phase, []).append(ms)
                self._check(c, rel, tag)
                t0 = now()
                self._walk(c.root)
                _add(out, f"walk_after_restore_{what}", now() - t0)
            ctx.tick(1)

    def finish(self, c, ctx):
        med = {what: {ph: sorted(v)[len(v) // 2] for ph, v in phases.items()}
               for what, phases in self.phases.items()}
        ctx.extra.setdefault("restore_delta", {})[c.name] = {
            "big_files": self.big_n, "small_files": self.SMALL, "took_ms_p50": med}
        self.phases = {}


class HistoryLength(Workload):
    """Small edit, checkpoint and restore 10 back with H checkpoints already recorded."""

    only_checkpoint = True
    iterations = (3, 20)
    rounds = (3, 10)
    EDITS = 10

    def __init__(self, which: int) -> None:
        self.which = which  # 0: short history, 1: long history
        self.name = "hist_small" if which == 0 else "hist_large"

    def prepare(self, c, ctx):
        target = ctx.history_lengths[self.which]
        have = len(c.ckpts)
        if have < target:
            c.pad_history(target - have, lambda _i: (ctx.history_step(c), ctx.tick(0)))
        ctx.extra.setdefault("history_length", {}).setdefault(self.name, {})[c.name] = len(c.ckpts)
        self.buf = ctx.edit_buf(b"/* hist */")

    def run(self, c, ctx, start, count, out):
        h = ctx.history_lengths[self.which]
        for _ in range(count):
            for k in range(self.EDITS):
                path = c.root / ctx.ckpt_targets[(k * 7) % len(ctx.ckpt_targets)]
                t0 = now()
                fd = os.open(path, os.O_WRONLY)
                os.pwrite(fd, self.buf, 0)  # the marker at EDIT_OFFSET stays intact
                os.close(fd)
                _add(out, f"edit@hist{h}", now() - t0)
            change = ctx.history_step(c)
            t0 = now()
            ckpt = c.checkpoint()
            _add(out, f"checkpoint@hist{h}", now() - t0)
            ctx.record_checkpoint(c, ckpt, change)
            t0 = now()
            target = c.restore_back(10)
            _add(out, f"restore10@hist{h}", now() - t0)
            ctx.verify(c, target)
            c.restore(ckpt)
            ctx.verify(c, ckpt)
            ctx.tick(1)


def all_workloads() -> list[Workload]:
    """Every workload, in the order they run (history ones last: they add checkpoints)."""
    from bench.fork_workloads import Fork  # (these build on this module)
    from bench.project_workloads import project_workloads
    from bench.session_workloads import LongSession, Stall
    from bench.tree_workloads import tree_workloads
    return [
        EditFirst(),
        EditRepeat(),
        AtomicSave(fsync=False),
        AtomicSave(fsync=True),
        AppendLog(),
        CreateDelete(),
        SmallEdits(),
        BigFileEdit(),
        SeqIO(),
        ManySmall(),
        Incompressible(),
        DaemonMemory(),
        TreeCommand("git_status", ["git", "status", "--porcelain"], iterations=(1, 3), warm_runs=(2, 3)),
        # GNU tar skips reading data when writing straight to /dev/null: pipe through cat.
        TreeCommand("tar", ["bash", "-o", "pipefail", "-c", "tar cf - . | cat > /dev/null"],
                    iterations=(1, 3), warm_runs=(1, 2)),
        HistoryLength(0),
        Fork(0),
        Checkpoint(),
        Restore(),
        RestoreDelta(),
        HistoryLength(1),
        Fork(1),
        Stall(),
        LongSession(),
        *project_workloads(),
        *tree_workloads(),
    ]

