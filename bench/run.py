"""Run every contender over the same generated repos and write the report.

    python -m bench.run --sizes 1000,10000 [--quick]
        [--contenders native,overlayfs,...] [--workloads edit_first,git_status,tar,...]

For each size: generate (or reuse) the repo, mount all contenders side by
side, run each workload in rounds that alternate contenders, unmount
everything (always: try/finally, then a sweep of bench/work for leftovers)
and write bench/results/. A contender that fails to mount is skipped with the
reason in the results; one that fails a workload is reported and, if its mount
died, dropped for the rest of that size. A watchdog aborts a FUSE connection
whose batch hangs, so a stuck daemon cannot stall the whole run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from bench import report
from bench.contenders import ALL, EXTRA, PROJECT_ROOT, Contender, force_unmount, mounts_under
from bench.gen import WORK_DIR, Repo, ensure_repo
from bench.projects import ProjectsMissing, ensure_projects_repo
from bench.workloads import Ctx, Samples, Workload, all_workloads, drop_caches

log = logging.getLogger("bench")

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


class Progress:
    """One status line on stderr (redrawn in place on a terminal, throttled lines otherwise)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.t_start = time.monotonic()
        self.size = self.workload = self.contender = ""
        self.round = self.rounds = self.done = self.total = 0
        self._last = 0.0
        self._width = 0

    def set(self, **kw) -> None:
        new_phase = kw.get("workload", self.workload) != self.workload or kw.get("size", self.size) != self.size
        for k, v in kw.items():
            setattr(self, k, v)
        self.draw(force=self.tty or new_phase)

    def tick(self, n: int = 1) -> None:
        self.done += n
        self.draw()

    def draw(self, force: bool = False) -> None:
        t = time.monotonic()
        if not force and t - self._last < (0.2 if self.tty else 15.0):
            return
        self._last = t
        msg = (f"[{self.size} files] {self.workload:<18} {self.contender:<15} "
               f"round {self.round}/{self.rounds}  {self.done}/{self.total} it  "
               f"({t - self.t_start:5.0f} s)")
        if self.tty:
            sys.stderr.write("\r" + msg.ljust(self._width))
            self._width = len(msg)
        else:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def note(self, msg: str) -> None:
        if self.tty and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            self._width = 0
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()


class Watchdog:
    """Aborts the FUSE connection of a contender whose batch overruns its deadline."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._contender: Contender | None = None
        self.fired = False
        threading.Thread(target=self._loop, daemon=True, name="watchdog").start()

    def arm(self, c: Contender, seconds: float) -> None:
        with self._lock:
            self._contender, self._deadline, self.fired = c, time.monotonic() + seconds, False

    def disarm(self) -> None:
        with self._lock:
            self._contender, self._deadline = None, None

    def _loop(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                c, d = self._contender, self._deadline
                if c is None or d is None or time.monotonic() < d:
                    continue
                self._deadline = None
                self.fired = True
            self.progress.note(f"watchdog: {c.name} overran its batch deadline; aborting its FUSE connection")
            c.abort()


def _version(cmd: list[str], want: str = "") -> str:
    """First output line of *cmd* (the first containing *want*, if given)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        lines = (r.stdout + "\n" + r.stderr).strip().splitlines()
        return next((ln for ln in lines if want in ln), lines[0])
    except (OSError, subprocess.SubprocessError, IndexError, StopIteration):
        return "unavailable"


def _pkg_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def damon_state() -> str:
    """DAMON reclaim pages out 'cold' page cache within seconds; warm numbers suffer, so say so."""
    root = Path("/sys/kernel/mm/damon/admin/kdamonds")
    states = []
    for kd in sorted(root.glob("[0-9]*")):
        try:
            state = (kd / "state").read_text().strip()
            actions = {a.read_text().strip() for a in kd.glob("contexts/*/schemes/*/action")}
        except OSError:
            continue
        states.append(f"kdamond {kd.name} {state} ({', '.join(sorted(actions)) or 'no schemes'})")
    return "; ".join(states) or "off"


def environment(args: argparse.Namespace, can_drop: bool) -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    commit = _version(["git", "-C", str(PROJECT_ROOT), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "-C", str(PROJECT_ROOT), "status", "--porcelain"],
                           capture_output=True, text=True).stdout.strip()
    return {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "args": vars(args),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_gb": mem,
        "python": platform.python_version(),
        "git": _version(["git", "--version"]),
        "fuse_overlayfs": (_version(["fuse-overlayfs", "--version"], "fuse-overlayfs")
                           if shutil.which("fuse-overlayfs") else "missing"),
        "pyfuse3": _pkg_version("pyfuse3"),
        "overlayckpt": _pkg_version("overlayckpt"),
        "project_commit": commit + (" (dirty)" if dirty else ""),
        "can_drop_caches": can_drop,
        "damon": damon_state(),
        "loadavg_start": os.getloadavg(),
    }


def sweep_mounts(where: Path, progress: Progress) -> None:
    """Unmount anything still mounted under *where* (ours, from this or a crashed run)."""
    for mp, fstype in mounts_under(where):
        progress.note(f"unmounting leftover {fstype} at {mp}")
        force_unmount(mp, fstype)


def split(total: int, rounds: int) -> list[int]:
    return [total // rounds + (1 if r < total % rounds else 0) for r in range(rounds)]


def run_workload(w: Workload, live: list[Contender], dead: set[str], ctx: Ctx, size_res: dict,
                 progress: Progress, watchdog: Watchdog, batch_timeout: float) -> None:
    todo = [c for c in live if w.applies(c) and c.name not in dead]
    if not todo or not w.wanted(ctx):
        return
    t_start = time.monotonic()
    os.sync()  # write back what earlier workloads left dirty, so it does not land in this one
    total, rounds = w.plan(ctx)
    w.setup(ctx)
    samples: dict[str, Samples] = {c.name: {} for c in todo}
    failed: set[str] = set()

    def guarded(c: Contender, what: str, fn) -> None:
        watchdog.arm(c, batch_timeout)
        try:
            fn()
        except Exception as e:  # one contender's failure must not end the run
            failed.add(c.name)
            err = " ".join(f"{what}: {type(e).__name__}: {e}".split())
            if watchdog.fired:
                err += " (watchdog abort)"
            size_res["workload_errors"].append({"workload": w.name, "contender": c.name, "error": err[-1500:]})
            log.debug("%s/%s failed:\n%s", w.name, c.name, traceback.format_exc())
            progress.note(f"  {w.name} / {c.name}: {err[:300]}")
            if not c.alive():
                dead.add(c.name)
                progress.note(f"  {c.name}: mount is gone; dropped for the rest of this size")
        finally:
            watchdog.disarm()

    progress.set(workload=w.name, contender="(prepare)", round=0, rounds=rounds, done=0, total=total * len(todo))
    for c in todo:
        progress.set(contender=c.name)
        guarded(c, "prepare", lambda c=c: w.prepare(c, ctx))
    starts = {c.name: 0 for c in todo}
    for r, per_round in enumerate(split(total, rounds)):
        order = todo[r % len(todo):] + todo[:r % len(todo)]  # rotate so no one always goes first
        for c in order:
            if c.name in failed or c.name in dead:
                continue
            progress.set(contender=c.name, round=r + 1)
            gc.collect()
            gc.disable()  # no collector pauses inside timed loops
            try:
                guarded(c, f"round {r + 1}",
                        lambda c=c: w.run(c, ctx, starts[c.name], per_round, samples[c.name]))  # noqa: B023
            finally:
                gc.enable()
            starts[c.name] += per_round
    for c in todo:
        if c.name not in failed and c.name not in dead:
            guarded(c, "finish", lambda c=c: w.finish(c, ctx))
    size_res["workload_seconds"][w.name] = round(time.monotonic() - t_start, 1)
    for cname, per_metric in samples.items():
        if cname in failed:
            continue  # partial samples would mislead
        for metric, ns in per_metric.items():
            size_res["metrics"].setdefault(metric, {})[cname] = report.summarize(ns)


def prime(c: Contender) -> None:
    """Let git refresh its index for this view of the tree, untimed (copies change ctime/inode)."""
    if c.applies_to_fs_workloads:
        subprocess.run(["git", "status", "--porcelain"], cwd=c.root, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=3600)


def run_size(n_files: int, args: argparse.Namespace, names: list[str], workloads: list[Workload],
             can_drop: bool, progress: Progress, watchdog: Watchdog, size_res: dict) -> None:
    """Measure one generated repo size into *size_res* (filled as we go, so an interrupt keeps
    what was measured)."""
    progress.note(f"== {n_files:,} files ==")
    repo = ensure_repo(n_files, log=progress.note)
    run_repo(repo, f"{n_files:,}", WORK_DIR / f"run-{n_files}", args, names,
             [w for w in workloads if not w.only_projects and not w.only_big_tree], can_drop, progress,
             watchdog, size_res, largest=n_files == max(args.sizes))


def run_big_tree(args: argparse.Namespace, names: list[str], workloads: list[Workload], can_drop: bool,
                 progress: Progress, watchdog: Watchdog, size_res: dict) -> None:
    """Measure the big tree's workloads (bench/tree_workloads.py) on a repo of --big-tree files."""
    progress.note(f"== big tree: {args.big_tree:,} files ==")
    repo = ensure_repo(args.big_tree, log=progress.note)
    run_repo(repo, f"big tree {args.big_tree:,}", WORK_DIR / "run-big-tree", args, names,
             [w for w in workloads if w.only_big_tree], can_drop, progress, watchdog, size_res,
             largest=False, big_tree=True)


def run_projects(args: argparse.Namespace, names: list[str], workloads: list[Workload], can_drop: bool,
                 progress: Progress, watchdog: Watchdog, size_res: dict) -> None:
    """Measure the real projects' build and test suite (bench/projects.py) into *size_res*."""
    progress.note("== real projects ==")
    repo = ensure_projects_repo(log=progress.note)
    run_repo(repo, "projects", WORK_DIR / "run-projects", args, names,
             [w for w in workloads if w.only_projects], can_drop, progress, watchdog, size_res,
             largest=False, projects=True)


def run_repo(repo: Repo, label: str, rundir: Path, args: argparse.Namespace, names: list[str],
             workloads: list[Workload], can_drop: bool, progress: Progress, watchdog: Watchdog,
             size_res: dict, largest: bool, projects: bool = False, big_tree: bool = False) -> None:
    size_res.update({
        "repo": {"files": len(repo.files), "bytes": repo.total_bytes, "path": str(repo.path)},
        "contenders": {}, "metrics": {}, "workload_errors": [], "notes": [], "workload_seconds": {},
    })
    sweep_mounts(rundir, progress)
    if rundir.exists():
        if mounts_under(rundir):
            raise RuntimeError(f"{rundir} still has mounts; refusing to delete it")
        shutil.rmtree(rundir)
    rundir.mkdir(parents=True)
    contenders = [{**ALL, **EXTRA}[name](repo, rundir) for name in names]
    live: list[Contender] = []
    dead: set[str] = set()
    try:
        for c in contenders:
            progress.set(size=label, workload="(setup)", contender=c.name, round=0, rounds=0, done=0, total=0)
            t0 = time.monotonic()
            watchdog.arm(c, args.batch_timeout)
            try:
                c.setup()
                prime(c)
                live.append(c)
                size_res["contenders"][c.name] = {"status": "ok", "setup_s": time.monotonic() - t0}
            except Exception as e:  # skip the contender, keep the run
                c.teardown()
                reason = f"{type(e).__name__}: {e}"[-600:]
                size_res["contenders"][c.name] = {"status": "skipped", "reason": reason}
                progress.note(f"  skipping {c.name}: {reason}")
            finally:
                watchdog.disarm()
        ctx = Ctx(repo=repo, quick=args.quick, history_lengths=tuple(args.history), can_drop_caches=can_drop,
                  tick=progress.tick, largest=largest, projects=projects, big_tree=big_tree, log=progress.note,
                  long_session=tuple(args.long_session), created_files=args.created_files)
        for w in workloads:
            run_workload(w, live, dead, ctx, size_res, progress, watchdog, args.batch_timeout)
        for c in live:
            if c.supports_checkpoint and c.name in ctx.hist:
                h = ctx.hist[c.name]
                size_res.setdefault("restore_verification", {})[c.name] = {"ok": h.verify_ok,
                                                                            "failed": h.verify_failures}
        size_res.update(ctx.extra)
        if ctx.pool.wrapped:
            size_res["notes"].append("target pool wrapped: some 'first' edits were repeats")
        size_res["notes"] += ctx.notes
    finally:
        progress.note(f"  tearing down ({label})")
        for c in contenders:
            c.teardown()
            if c.notes:
                size_res["contenders"].setdefault(c.name, {"status": "?"})["notes"] = c.notes
        for c in dead:
            size_res["contenders"][c]["status"] = "died"
        sweep_mounts(rundir, progress)
        if not args.keep_work and not mounts_under(rundir):
            shutil.rmtree(rundir, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [w.name for w in all_workloads()]
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1000,10000", help="comma-separated repo sizes in files")
    p.add_argument("--quick", action="store_true", help="fewer iterations (under 5 min for 1000,10000)")
    p.add_argument("--contenders", default=",".join(ALL), help=f"subset of {','.join(ALL)}, or {','.join(EXTRA)} "
                        "($OVERLAYCKPT_BASELINE: another build's overlayckpt, for before/after)")
    p.add_argument("--workloads", default=",".join(names), help=f"subset of {','.join(names)}")
    p.add_argument("--history", default=None,
                   help="short,long history lengths for hist_small/hist_large (default 10,10000; quick 10,1000)")
    p.add_argument("--long-session", default=None,
                   help="journal records,checkpoints of the long_session workload "
                        "(default 1000000,100000; quick 20000,2000); it and stall run at the largest size only")
    p.add_argument("--created-files", type=int, default=None,
                   help="files created before long_session's restore across them (default 20000; quick 5000)")
    p.add_argument("--big-tree", type=int, default=None,
                   help="files of the big tree's repo, where only big_tree runs (default 200000; quick 0: none)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--batch-timeout", type=float, default=3600.0,
                   help="seconds before the watchdog aborts a hung FUSE contender")
    p.add_argument("--keep-work", action="store_true", help="keep bench/work/run-<N> (uppers, stores) afterwards")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.contenders = [s for s in args.contenders.split(",") if s]
    args.workloads = [s for s in args.workloads.split(",") if s]
    hist = args.history or ("10,1000" if args.quick else "10,10000")
    args.history = [int(x) for x in hist.split(",")]
    long_session = args.long_session or ("20000,2000" if args.quick else "1000000,100000")
    args.long_session = [int(x) for x in long_session.split(",")]
    if args.big_tree is None:
        args.big_tree = 0 if args.quick else 200_000
    if args.created_files is None:
        args.created_files = 5000 if args.quick else 20000
    unknown = ([c for c in args.contenders if c not in ALL and c not in EXTRA]
               + [w for w in args.workloads if w not in names])
    if unknown:
        p.error(f"unknown contender/workload: {', '.join(unknown)}")
    if len(args.history) != 2:
        p.error("--history wants two numbers: short,long")
    if len(args.long_session) != 2 or min(args.long_session) < 2 or args.long_session[0] < args.long_session[1]:
        p.error("--long-session wants two numbers: records,checkpoints (records >= checkpoints >= 2)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # Hermetic git: no user or system config (fsmonitor, hooks, untracked cache) may skew timings.
    os.environ.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null")
    progress = Progress()

    def on_term(signum, frame):  # turn SIGTERM into an exception so every finally unmounts
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    names = list(args.contenders)
    run_notes: list[str] = []

    def skip(msg: str) -> None:
        progress.note(msg)
        run_notes.append(msg)

    if "fuse-overlayfs" in names and shutil.which("fuse-overlayfs") is None:
        skip("fuse-overlayfs not found: `apt-get install fuse-overlayfs` to compare against it; skipped")
        names.remove("fuse-overlayfs")
    if "overlayfs" in names and os.geteuid() != 0:
        skip("kernel overlayfs needs root; skipped")
        names.remove("overlayfs")
    can_drop = drop_caches()
    if not can_drop:
        skip("cannot write /proc/sys/vm/drop_caches (not root?): the *_cold numbers are not cold")
    workloads = [w for w in all_workloads() if w.name in args.workloads]

    results: dict = {"meta": environment(args, can_drop), "sizes": {}}
    results["meta"]["notes"] = run_notes
    t0 = time.monotonic()
    watchdog = Watchdog(progress)
    rc = 0
    try:
        for n in args.sizes if any(not w.only_projects and not w.only_big_tree for w in workloads) else []:
            size_res = results["sizes"][str(n)] = {}
            run_size(n, args, names, workloads, can_drop, progress, watchdog, size_res)
            results["meta"]["duration_s"] = time.monotonic() - t0
            report.write_all(results, args.out, with_plots=False)  # keep partial results
        if args.big_tree and any(w.only_big_tree for w in workloads):
            run_big_tree(args, names, workloads, can_drop, progress, watchdog, results.setdefault("big_tree", {}))
            report.write_all(results, args.out, with_plots=False)
        if any(w.only_projects for w in workloads):
            try:
                run_projects(args, names, workloads, can_drop, progress, watchdog, results.setdefault("projects", {}))
            except ProjectsMissing as e:
                skip(f"real projects skipped: {e}")
                results.pop("projects", None)
    except KeyboardInterrupt as e:
        progress.note(f"interrupted ({e or 'SIGINT'}); writing what was measured")
        rc = 130
        results["sizes"] = {k: v for k, v in results["sizes"].items() if "repo" in v}
        for part in ("big_tree", "projects"):
            if "repo" not in results.get(part, {}):
                results.pop(part, None)
    finally:
        sweep_mounts(WORK_DIR, progress)
    results["meta"]["duration_s"] = time.monotonic() - t0
    results["meta"]["loadavg_end"] = os.getloadavg()
    written = report.write_all(results, args.out, with_plots=not args.no_plots)
    progress.note(f"done in {results['meta']['duration_s']:.0f} s; wrote {len(written)} files to {args.out}")
    progress.note(f"see {args.out / 'results.md'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
