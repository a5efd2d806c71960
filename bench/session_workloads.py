"""Issue 16's workloads, overlayckpt only: does a command stall the mount, and do
restores, views and diffs stay cheap in a long session?

``stall``: a session holding a 10 MB mostly-NUL binary change and a
20,000-line lockfile change; the mount is probed (stat, 4 KiB reads) in
alternating idle and busy phases, busy meaning ``overlayckpt log`` and
``overlayckpt diff --stat`` run back to back in a loop. The probes that must
reach the daemon are ``statx(AT_STATX_FORCE_SYNC)`` (a GETATTR whatever the
kernel cached) and a read of a block dropped from the page cache first
(``POSIX_FADV_DONTNEED``); plain ``os.stat`` and a page-cached read show what
the kernel answers alone.

``long_session``: a session of 1,000,000 journal records and 100,000
checkpoints (``bench/longsession.py`` builds and caches it), mounted through
the CLI beside the contender's mount, and every command timed from the CLI,
process start-up included, as a user or a hook runs it.
"""
from __future__ import annotations

import ctypes
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import longsession
from bench.contenders import (
    MOUNT_TIMEOUT,
    Contender,
    ContenderError,
    Overlayckpt,
    force_unmount,
    is_mounted,
    run_cli,
    wait_mounted,
)
from bench.workloads import Ctx, Samples, Workload, _add, now, resident_memory

# -- probes of the mount -----------------------------------------------------------

AT_FDCWD = -100
AT_STATX_FORCE_SYNC = 0x2000
STATX_BASIC_STATS = 0x7FF
_libc = ctypes.CDLL(None, use_errno=True)
_statx_buf = ctypes.create_string_buffer(256)


def statx_sync(path: bytes) -> None:
    """A stat the kernel must ask the filesystem for (FUSE: a GETATTR to the daemon)."""
    if _libc.statx(AT_FDCWD, path, AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, _statx_buf) != 0:
        raise OSError(ctypes.get_errno(), f"statx {path!r}")


class Probe:
    """Timed requests on one file of the mount, one kind after another."""

    KINDS = ("stat", "stat_sync", "read_cached", "read_uncached")
    READ = 4096

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.bpath = os.fsencode(path)
        self.fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: one block per read
        self.blocks = size // self.READ
        self.rng = random.Random(3)
        os.pread(self.fd, self.READ, 0)  # block 0 stays cached for read_cached

    def close(self) -> None:
        os.close(self.fd)

    def once(self, kind: str) -> int:
        if kind == "stat":
            t0 = now()
            os.stat(self.path)
        elif kind == "stat_sync":
            t0 = now()
            statx_sync(self.bpath)
        elif kind == "read_cached":
            t0 = now()
            os.pread(self.fd, self.READ, 0)
        else:
            off = self.rng.randrange(1, self.blocks) * self.READ
            os.posix_fadvise(self.fd, off, self.READ, os.POSIX_FADV_DONTNEED)
            t0 = now()
            os.pread(self.fd, self.READ, off)
        return now() - t0


class CommandLoop:
    """CLI commands back to back in a process of their own (bench/cmdloop.py), until
    stopped; times each."""

    def __init__(self, commands: list[tuple[str, list[str]]]) -> None:
        self.commands = commands
        self.times: Samples = {}
        self.errors: list[str] = []
        self._dots = tempfile.NamedTemporaryFile(prefix="stall-loops-")
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.cmdloop", self._dots.name, json.dumps(self.commands)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            cwd=Path(__file__).resolve().parent.parent)

    @property
    def done(self) -> int:
        """Loops completed so far."""
        return os.path.getsize(self._dots.name)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        assert self._proc is not None
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=600)
        done = self.done
        self._dots.close()
        result = json.loads(out) if out.strip() else {"times": {}, "errors": ["the loop died"]}
        self.times, self.errors = result["times"], result["errors"]
        self.done_at_stop = done


# -- the stall workload ---------------------------------------------------------------

BLOB_SIZE = 10 * 1000 * 1000
LOCK_LINES = 20_000
PROBE_SIZE = 8 * 1024 * 1024


def nasty_blob(version: int) -> bytes:
    """10 MB, mostly NUL with a newline every 96 bytes and 4 KiB of random bytes per 64 KiB."""
    data = bytearray(BLOB_SIZE)
    data[95::96] = b"\n" * len(range(95, BLOB_SIZE, 96))
    rng = random.Random(23)
    for off in range(0, BLOB_SIZE - 4096, 65536):
        data[off:off + 4096] = rng.randbytes(4096)
    vr = random.Random(1000 + version)  # a version differs in a few places
    for _ in range(8):
        off = vr.randrange(BLOB_SIZE - 64)
        data[off:off + 64] = vr.randbytes(64)
    return bytes(data)


def lockfile(version: int) -> bytes:
    """A ``json.dumps(indent=2)`` lockfile of LOCK_LINES lines; a version changes five of them."""
    n = LOCK_LINES // 6  # one package is 6 lines
    bumped = {(version * 997 + k * n // 5) % n for k in range(5)} if version else set()
    pkgs = {}
    for i in range(n):
        pkgs[f"node_modules/pkg-{i:05d}"] = {
            "version": f"1.{i % 17}.{version if i in bumped else 0}",
            "resolved": f"https://registry.example.invalid/pkg-{i:05d}/-/pkg-{i:05d}-1.0.0.tgz",
            "integrity": f"sha512-{i:064x}",
            "license": "MIT",
        }
    return json.dumps({"name": "bench", "lockfileVersion": 3, "packages": pkgs}, indent=2).encode() + b"\n"


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


class Stall(Workload):
    """Probes of the mount, idle then busy (log and diff --stat looping), alternated."""

    name = "stall"
    iterations = (4, 10)  # idle/busy pairs
    rounds = (2, 5)
    PHASE_S = (3.0, 10.0)  # seconds of probing per phase (busy: at least one log and one diff)
    GAP_S = 0.0005  # between probes: an interactive user, not a saturating loop
    DIR = "bench-stall"

    def applies(self, c: Contender) -> bool:
        return isinstance(c, Overlayckpt)

    def wanted(self, ctx: Ctx) -> bool:
        return ctx.largest

    def prepare(self, c, ctx):
        d = c.root / self.DIR
        d.mkdir(exist_ok=True)
        _write(d / "probe.bin", random.Random(29).randbytes(PROBE_SIZE))
        _write(d / "blob.bin", nasty_blob(0))
        _write(d / "package-lock.json", lockfile(0))
        self.base = c.checkpoint()
        self.version = 0
        ctx.extra.setdefault("stall", {})[c.name] = {
            "blob_bytes": BLOB_SIZE, "lock_lines": lockfile(0).count(b"\n"), "busy_loops": 0, "errors": []}

    def _change(self, c) -> str:
        """A new version of both files and its checkpoint: fresh work for log's line counts."""
        self.version += 1
        d = c.root / self.DIR
        _write(d / "blob.bin", nasty_blob(self.version))
        _write(d / "package-lock.json", lockfile(self.version))
        return c.checkpoint()

    def _phase(self, label: str, out: Samples, seconds: float, loop: CommandLoop | None) -> None:
        kinds = Probe.KINDS
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline or (loop is not None and loop.done < 1 and loop.is_alive()):
            kind = kinds[i % len(kinds)]
            _add(out, f"stall_{label}_{kind}", self.probe.once(kind))
            i += 1
            time.sleep(self.GAP_S)

    def run(self, c, ctx, start, count, out):
        seconds = self.PHASE_S[0] if ctx.quick else self.PHASE_S[1]
        facts = ctx.extra["stall"][c.name]
        self.probe = Probe(c.root / self.DIR / "probe.bin", PROBE_SIZE)
        try:
            self._rounds(c, ctx, count, seconds, facts, out)
        finally:
            self.probe.close()  # an open file would keep the mount busy at teardown

    def _rounds(self, c, ctx, count: int, seconds: float, facts: dict, out: Samples) -> None:
        for _ in range(count):
            head = self._change(c)
            os.sync()  # the change's writes reach the daemon now, not during the idle phase
            self._phase("idle", out, seconds, None)
            for label, commands in self._loads(c, head):
                loop = CommandLoop(commands)
                loop.start()
                try:
                    self._phase(label, out, seconds, loop)
                finally:
                    loop.stop()
                for metric, ns in loop.times.items():
                    out.setdefault(metric, []).extend(ns)
                facts[f"{label}_loops"] = facts.get(f"{label}_loops", 0) + loop.done_at_stop
                facts["errors"] += loop.errors[:3]
            ctx.tick(1)

    def _loads(self, c, head: str) -> list[tuple[str, list]]:
        """The busy phases, one after another: log and diff --stat from the CLI (a process
        started per command, as a user or a script runs them); the same two commands through
        the control file from one process (the daemon's share alone); and the CLI starting
        and printing its help, with no daemon in it (the client's share alone: on two cores
        its start-up competes with the probe and the daemon for the CPU)."""
        mnt = str(c.root)
        return [
            ("busy", [("stall_cmd_log", [c.exe, "log", "--limit", "5", "--mount", mnt]),
                      ("stall_cmd_diff_stat", [c.exe, "diff", self.base, head, "--stat", "--mount", mnt])]),
            ("ctl", [("stall_ctl_cmd_log", {"mount": mnt, "cmd": {"cmd": "log", "limit": 5}}),
                     ("stall_ctl_cmd_diff_stat", {"mount": mnt, "cmd": {"cmd": "diff", "a": _ref(self.base),
                                                                      "b": _ref(head), "stat": True}})]),
            ("start", [("stall_cmd_help", [c.exe, "--help"])]),
        ]


def _ref(value: str) -> int | str:
    return int(value) if value.isdigit() else value


# -- the long-session workload -------------------------------------------------------------


class LongSession(Workload):
    """CLI commands on a mounted session of 1M journal records and 100k checkpoints."""

    name = "long_session"
    iterations = (3, 5)
    rounds = (3, 5)

    def applies(self, c: Contender) -> bool:
        return isinstance(c, Overlayckpt)

    def wanted(self, ctx: Ctx) -> bool:
        return ctx.largest

    def prepare(self, c, ctx):
        records, checkpoints = ctx.long_session
        self.built = longsession.ensure(ctx.repo, records, checkpoints, log=ctx.log)
        self.workdir = c.workdir.parent / f"{c.name}-long-session"
        self.workdir.mkdir()
        self.store = longsession.private_copy(self.built, self.workdir / "store")
        self.mnt = self.workdir / "mnt"
        self.mnt.mkdir()
        self.exe = c.exe
        self._cli("mount", str(self.built.repo), str(self.mnt), "--store", str(self.store),
                  timeout=MOUNT_TIMEOUT * 5)
        wait_mounted(self.mnt, None, None)
        self.minor = os.minor(os.stat(self.mnt).st_dev)
        c.also_abort.append(self.minor)  # a hang on this mount is the watchdog's too
        last = self.built.checkpoints - 1
        self.points = {"start": 1, "middle": last // 2, "end": last}
        ctx.extra.setdefault("long_session", {})[c.name] = {
            "records": self.built.records, "checkpoints": self.built.checkpoints,
            "build_s": round(self.built.build_s, 1), "store_bytes": self.built.store_bytes,
            "created_files": ctx.created_files, "repo_files": ctx.repo.n_files}

    def _cli(self, *args: str, timeout: float = 3600) -> str:
        return run_cli(self.exe, *args, timeout=timeout)

    def _timed(self, out: Samples, metric: str, *args: str) -> str:
        t0 = now()
        text = self._cli(*args, "--mount", str(self.mnt))
        _add(out, metric, now() - t0)
        return text

    def run(self, c, ctx, start, count, out):
        for i in range(start, start + count):
            self._timed(out, "ls_log20", "log", "--limit", "20")
            self._timed(out, "ls_checkpoint", "checkpoint")
            for where, ck in self.points.items():
                self._view(out, where, ck + (i if where != "end" else -i))
            for where, ck in self.points.items():
                a = max(0, ck - 10 - i) if where == "end" else ck + i
                self._timed(out, f"ls_diff_stat@{where}", "diff", str(a), str(a + 10), "--stat")
            for where, ck in (("first", 0), ("middle", self.points["middle"]), ("last", self.points["end"])):
                self._timed(out, f"ls_restore@{where}", "restore", str(ck))
                self._timed(out, f"ls_restore_back@{where}", "restore", "@before-last")
            self._created(out, i, ctx.created_files)
            ctx.tick(1)

    def _view(self, out: Samples, where: str, ck: int) -> None:
        """List a directory of a checkpoint view, then read a file there (each view is new to the kernel)."""
        view = self.mnt / ".overlayckpt" / "checkpoints" / str(ck)
        d = view / self.built.created_dirs[ck % len(self.built.created_dirs)]
        t0 = now()
        with os.scandir(d) as it:
            for e in it:
                e.stat(follow_symlinks=False)
        _add(out, f"ls_view_ls@{where}", now() - t0)
        f = view / self.built.edited[ck % len(self.built.edited)]
        t0 = now()
        f.read_bytes()
        _add(out, f"ls_view_read@{where}", now() - t0)

    def _created(self, out: Samples, i: int, n: int) -> None:
        """A python loop creates n small files; restore to before it, and back."""
        before = json.loads(self._cli("checkpoint", "--json", "--mount", str(self.mnt)))["id"]
        d = self.mnt / f"bench-created-{i}"
        t0 = now()
        d.mkdir()
        for k in range(n):
            fd = os.open(d / f"f{k:05d}.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, b"created %d\n" % k)
            os.close(fd)
        _add(out, f"ls_create_{n}", now() - t0)
        self._timed(out, f"ls_restore_across_{n}_created", "restore", str(before))
        if d.exists():
            raise ContenderError(f"restore {before} left {d} in place")
        self._timed(out, f"ls_restore_back_{n}_created", "restore", "@before-last")
        if not (d / f"f{n - 1:05d}.txt").exists():
            raise ContenderError(f"restore @before-last did not bring back {d}")
        self._cli("restore", str(before), "--mount", str(self.mnt))  # untimed: the next round starts alike

    def finish(self, c, ctx):
        c.also_abort.remove(self.minor)
        # the daemon's resident memory after every command above (SPEC: <= 300 MB)
        pid = json.loads(self._cli("status", "--json", "--mount", str(self.mnt))).get("pid")
        if pid:
            ctx.extra["long_session"][c.name]["daemon_rss"] = resident_memory(pid)
        if is_mounted(self.mnt):
            try:
                self._cli("unmount", str(self.mnt), "--no-apply", timeout=120)
            except ContenderError:
                force_unmount(str(self.mnt), "fuse")
