"""Turn raw samples into the numbers SPEC section 6 asks for.

Writes ``results.json`` (everything, raw samples in µs included),
``results.md`` (tables a reviewer can read in a PR) and PNG plots. Ratios are
always between contenders of the same run and size, never against numbers
from another run: the machines are shared and drift.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

BASELINES = {"native": "native", "fuse_overlayfs": "fuse-overlayfs", "shadow_git": "shadow-git"}
CONTENDER_ORDER = ["native", "overlayfs", "fuse-overlayfs", "passthrough", "shadow-git", "overlayckpt"]
METRIC_ORDER = [
    "edit_first", "edit_repeat", "atomic_save", "atomic_save_fsync", "append_log", "create_delete",
    "bigfile_first", "bigfile_edit", "seq_write_64m", "seq_read_64m",
    "small_edits_first", "small_edits_again", "sed_i",
    "many_small_create", "many_small_rm", "git_status_warm", "git_status_cold", "tar_warm", "tar_cold",
    "checkpoint", "checkpoint_cli", "restore_1", "restore_10", "restore_100", "restore_100_cli",
]
CDF_MIN_SAMPLES = 20
SIZE_PLOT_METRICS = ["edit_first", "edit_repeat", "atomic_save", "create_delete", "many_small_create",
                     "git_status_warm", "git_status_cold", "tar_warm", "checkpoint", "restore_100"]


def percentile(sorted_ns: list[int], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_ns:
        return math.nan
    k = (len(sorted_ns) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_ns[lo] + (sorted_ns[hi] - sorted_ns[lo]) * (k - lo)


def summarize(samples_ns: list[int]) -> dict[str, Any]:
    s = sorted(samples_ns)
    return {
        "n": len(s),
        "p50_ns": percentile(s, 0.50),
        "p90_ns": percentile(s, 0.90),
        "p99_ns": percentile(s, 0.99),
        "mean_ns": sum(s) / len(s),
        "min_ns": s[0],
        "max_ns": s[-1],
        "samples_us": [round(x / 1000, 1) for x in samples_ns],
    }


def add_ratios(metrics: dict[str, dict[str, dict[str, Any]]]) -> None:
    """p50 (and p99) ratios to each baseline present for the same metric."""
    for per_c in metrics.values():
        for key, base in BASELINES.items():
            b = per_c.get(base)
            for st in per_c.values():
                st[f"ratio_{key}_p50"] = st["p50_ns"] / b["p50_ns"] if b and b["p50_ns"] else None
                st[f"ratio_{key}_p99"] = st["p99_ns"] / b["p99_ns"] if b and b["p99_ns"] else None


def metric_key(name: str) -> tuple[int, str]:
    if name in METRIC_ORDER:
        return METRIC_ORDER.index(name), name
    return len(METRIC_ORDER), name  # edit@hist10 etc. sort after, alphabetically


def contender_key(name: str) -> int:
    return CONTENDER_ORDER.index(name) if name in CONTENDER_ORDER else len(CONTENDER_ORDER)


def fmt_ns(ns: float | None) -> str:
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "–"
    if ns < 10_000:
        return f"{ns / 1000:.1f} µs"
    if ns < 1_000_000:
        return f"{ns / 1000:.0f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_ratio(r: float | None) -> str:
    if r is None:
        return ""
    return f"{r:.2f}×" if r < 100 else f"{r:.0f}×"


def _load(la: list[float] | None) -> str:
    return "/".join(f"{x:.1f}" for x in la) if la else "?"


def fmt_bytes(b: float) -> str:
    if abs(b) < 10 * 1024:
        return f"{b:.0f} B"
    if abs(b) < 10 * 1024 * 1024:
        return f"{b / 1024:.1f} KiB"
    return f"{b / 1024 / 1024:.1f} MiB"


# --- spec checks -------------------------------------------------------------------------


def _p(size: dict, metric: str, c: str, q: str = "p50_ns") -> float | None:
    st = size["metrics"].get(metric, {}).get(c)
    return st[q] if st else None


def spec_checks(results: dict) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for the SPEC section 6 targets that this run can judge, and
    issue 19's for the real projects."""
    return _size_checks(results) + _project_checks(results.get("projects"))


PROJECT_TARGETS = [("build_c", "LuaJIT `make -j2`"), ("pytest_suite", "click's pytest suite")]


def _project_checks(size: dict | None) -> list[tuple[str, str, str]]:
    """Real build and test suite <= 1.2x native (issue 19), with fuse-overlayfs's ratio and the
    daemon's CPU beside ours."""
    if size is None:
        return []
    out = []
    for m, what in PROJECT_TARGETS:
        ours, native, fo = (_p(size, m, c) for c in ("overlayckpt", "native", "fuse-overlayfs"))
        r = ours / native if ours is not None and native else None
        theirs = f"; fuse-overlayfs {fmt_ratio(fo / native)}" if fo is not None and native else ""
        cpu = {c: _p(size, f"{m}_daemon_cpu", c) for c in ("overlayckpt", "fuse-overlayfs")}
        cpu_s = ", ".join(f"{c} {fmt_ns(v)}" for c, v in cpu.items() if v is not None)
        measured = f"{fmt_ratio(r) or '–'}{theirs}" + (f" (daemon CPU per run: {cpu_s})" if cpu_s else "")
        said = {line for lines in size.get(f"{m}_said", {}).values() for line in lines}
        if len(said) > 1:
            measured += f"; **the contenders' outputs differ**: {' / '.join(sorted(said))}"
        out.append((f"{what} ≤ 1.2× native", measured, "n/a" if r is None else ("PASS" if r <= 1.2 else "FAIL")))
    return out


def _size_checks(results: dict) -> list[tuple[str, str, str]]:
    sizes = sorted(results["sizes"], key=int)
    if not sizes:
        return []
    big = results["sizes"][sizes[-1]]
    small = results["sizes"][sizes[0]]
    oc, fo, nat, sg = "overlayckpt", "fuse-overlayfs", "native", "shadow-git"
    out: list[tuple[str, str, str]] = []

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    at = f"{int(sizes[-1]):,} files"
    for m in ("edit_first", "edit_repeat", "atomic_save"):
        r50 = ratio(_p(big, m, oc), _p(big, m, fo))
        r99 = ratio(_p(big, m, oc, "p99_ns"), _p(big, m, fo, "p99_ns"))
        ok = None if r50 is None or r99 is None else (r50 <= 1.0 and r99 <= 2.0)
        out.append((f"{m}: p50 ≤ 1× and p99 ≤ 2× fuse-overlayfs ({at})",
                    f"p50 {fmt_ratio(r50) or '–'}, p99 {fmt_ratio(r99) or '–'}", verdict(ok)))
    if len(sizes) > 1:
        for m in ("edit_first", "edit_repeat", "atomic_save"):
            r = ratio(_p(big, m, oc), _p(small, m, oc))
            out.append((f"{m}: p50 at {int(sizes[-1]):,} / p50 at {int(sizes[0]):,} files ≤ 1.2",
                        fmt_ratio(r) or "–", verdict(None if r is None else r <= 1.2)))
    r = ratio(_p(big, "checkpoint", sg), _p(big, "checkpoint", oc))
    out.append((f"checkpoint ≥ 1000× cheaper than shadow-git ({at})",
                f"{fmt_ratio(r)} cheaper" if r else "–", verdict(None if r is None else r >= 1000)))
    p = _p(big, "restore_100", oc)
    out.append((f"restore 100 back p50 ≤ 20 ms ({at})", fmt_ns(p), verdict(None if p is None else p <= 20e6)))
    hist = sorted({m for m in big["metrics"] if m.startswith("restore10@hist")},
                  key=lambda m: int(m.split("hist")[1]))
    if len(hist) == 2:
        r = ratio(_p(big, hist[1], oc), _p(big, hist[0], oc))
        out.append((f"restore independent of history ({hist[1]} / {hist[0]} ≤ 1.2)",
                    fmt_ratio(r) or "–", verdict(None if r is None else r <= 1.2)))
    for m, base, lim in (("git_status_warm", nat, 1.5), ("git_status_cold", fo, 1.5), ("tar_warm", nat, 1.5),
                         ("many_small_create", fo, 2.0), ("many_small_rm", fo, 2.0),
                         ("small_edits_first", fo, 2.0), ("small_edits_again", fo, 2.0)):
        r = ratio(_p(big, m, oc), _p(big, m, base))
        out.append((f"{m} ≤ {lim}× {base} ({at})", fmt_ratio(r) or "–", verdict(None if r is None else r <= lim)))
    inc = sorted(big.get("store_incompressible", {}).get(oc, []))
    r = inc[len(inc) // 2] if inc else None
    out.append(("store growth for 256 MiB of random bytes ≤ 1.1× its size",
                fmt_ratio(r) or "–", verdict(None if r is None else r <= 1.1)))
    rss = big.get("daemon_rss", {})
    theirs = f" (fuse-overlayfs {fmt_bytes(rss[fo])})" if fo in rss else ""
    parts = big.get("daemon_rss_parts", {}).get(oc)
    if parts:  # (mapped file pages are page cache: LMDB reads its store through its map)
        theirs = (f": {fmt_bytes(parts['anon'])} the daemon's own, {fmt_bytes(parts['file'])} "
                  f"mapped file pages (the store's){theirs}")
    out.append((f"daemon memory after `find -ls` ≤ 100 MB ({at}; the target is at 200,000)",
                (fmt_bytes(rss[oc]) + theirs) if oc in rss else "–",
                verdict(None if oc not in rss else rss[oc] <= 100e6)))
    g = big.get("store_growth", {})
    if oc in g and sg in g:
        a, b = g[oc]["apparent_bytes_per_edit"], g[sg]["apparent_bytes_per_edit"]
        out.append(("store growth per edit ≤ git's", f"{fmt_bytes(a)} vs {fmt_bytes(b)}", verdict(a <= b)))
    else:
        out.append(("store growth per edit ≤ git's", "–", "n/a"))
    return out


# --- issue 16: stall and long session ------------------------------------------------------

STALL_PROBES = [("stat", "`os.stat` (the kernel may answer)"),
                ("stat_sync", "`statx(AT_STATX_FORCE_SYNC)` (GETATTR to the daemon)"),
                ("read_cached", "4 KiB `pread`, page-cached"),
                ("read_uncached", "4 KiB `pread`, dropped from the page cache first")]
STALL_TARGET = 2.0  # busy p99 / idle p99
# (metric, what, target p50 in ns or None)
LONG_OPS = [
    ("ls_log20", "`log --limit 20`", 100e6), ("ls_checkpoint", "`checkpoint`", 50e6),
    ("ls_view_ls@start", "view: list a dir at a checkpoint near the start", None),
    ("ls_view_ls@middle", "view: list a dir, middle", None), ("ls_view_ls@end", "view: list a dir, end", None),
    ("ls_view_read@start", "view: read a file, start", None),
    ("ls_view_read@middle", "view: read a file, middle", None),
    ("ls_view_read@end", "view: read a file, end", None),
    ("ls_diff_stat@start", "`diff A A+10 --stat`, start", None),
    ("ls_diff_stat@middle", "`diff A A+10 --stat`, middle", None),
    ("ls_diff_stat@end", "`diff A A+10 --stat`, end", None),
    ("ls_restore@first", "`restore` to the first checkpoint (0)", 250e6),
    ("ls_restore@middle", "`restore` to the middle", 250e6), ("ls_restore@last", "`restore` to the last", 250e6),
    ("ls_restore_back@first", "`restore @before-last` (back from the first)", None),
    ("ls_restore_back@middle", "`restore @before-last` (back from the middle)", None),
    ("ls_restore_back@last", "`restore @before-last` (back from the last)", None),
]


STALL_LOADS = [("busy", "CLI"), ("ctl", "ctl"), ("start", "CLI start-up only")]


def _stall_lines(size: dict, c: str) -> list[str]:
    m = size["metrics"]
    facts = size.get("stall", {}).get(c, {})
    lines = [f"### Stall: probes of the mount, idle vs. `log` + `diff --stat` looping ({c})", "",
             f"- the session holds a {facts.get('blob_bytes', 0) / 1e6:.0f} MB mostly-NUL binary change and a "
             f"{facts.get('lock_lines', 0):,}-line lockfile change; {facts.get('busy_loops', 0)} log+diff loops ran "
             f"from the CLI, {facts.get('ctl_loops', 0)} through the control file from one process, and "
             f"{facts.get('start_loops', 0)} CLI start-ups (`--help`, no daemon) in their busy phases, "
             "each phase alternated with an idle one",
             "- busy/idle p99 per load: **CLI** (a process per command, as a user runs them), **ctl** "
             "(the same commands written to `.overlayckpt/ctl` by one process: the daemon's share), "
             "**CLI start-up only** (the client's share, without the daemon)", "",
             "| probe | idle p50 | idle p99 | " + " | ".join(f"{w} p99 | ×idle" for _, w in STALL_LOADS)
             + " | ≤ 2× (CLI / ctl) |",
             "|---|---:|---:|" + "---:|---:|" * len(STALL_LOADS) + "---|"]
    for kind, what in STALL_PROBES:
        i = m.get(f"stall_idle_{kind}", {}).get(c)
        if not i:
            continue
        cells, verdicts = [], []
        for label, _ in STALL_LOADS:
            b = m.get(f"stall_{label}_{kind}", {}).get(c)
            r = b["p99_ns"] / i["p99_ns"] if b and i["p99_ns"] else None
            cells += [fmt_ns(b["p99_ns"]) if b else "–", fmt_ratio(r)]
            if label in ("busy", "ctl"):
                verdicts.append("n/a" if r is None else "PASS" if r <= STALL_TARGET else "FAIL")
        lines.append(f"| {what} | {fmt_ns(i['p50_ns'])} | {fmt_ns(i['p99_ns'])} | " + " | ".join(cells)
                     + f" | {' / '.join(verdicts)} |")
    lines += ["", "| command | n | p50 | p99 | max |", "|---|---:|---:|---:|---:|"]
    for metric, what in (("stall_cmd_log", "`log --limit 5` (CLI)"), ("stall_cmd_diff_stat", "`diff A B --stat` (CLI)"),
                         ("stall_ctl_cmd_log", "`log --limit 5` (ctl)"),
                         ("stall_ctl_cmd_diff_stat", "`diff A B --stat` (ctl)"),
                         ("stall_cmd_help", "`overlayckpt --help` (CLI start-up)")):
        st = m.get(metric, {}).get(c)
        if st:
            lines.append(f"| {what} | {st['n']} | {fmt_ns(st['p50_ns'])} | {fmt_ns(st['p99_ns'])} | "
                         f"{fmt_ns(st['max_ns'])} |")
    errors = facts.get("errors") or []
    lines += [""] + [f"- command error: {e}" for e in errors[:5]] + ([""] if errors else [])
    return lines


def _long_session_lines(size: dict, c: str) -> list[str]:
    m = size["metrics"]
    f = size.get("long_session", {}).get(c, {})
    n = f.get("created_files", 0)
    ops = LONG_OPS + [(f"ls_create_{n}", f"one python loop creates {n:,} files (context)", None),
                      (f"ls_restore_across_{n}_created", f"`restore` across {n:,} created files", 250e6),
                      (f"ls_restore_back_{n}_created", f"`restore @before-last` (brings the {n:,} back)", None)]
    lines = [f"### Long session ({c}): {f.get('records', 0):,} journal records, {f.get('checkpoints', 0):,} "
             f"checkpoints, {f.get('repo_files', 0):,} repo files", "",
             f"- built in-process in {f.get('build_s', 0):.0f} s (cached after), "
             f"store {fmt_bytes(f.get('store_bytes', 0))}; "
             "every command timed from the CLI, process start-up included", "",
             "| operation | n | p50 | p90 | target (issue 16) | |", "|---|---:|---:|---:|---:|---|"]
    for metric, what, target in ops:
        st = m.get(metric, {}).get(c)
        if not st:
            continue
        verdict = "" if target is None else ("PASS" if st["p50_ns"] <= target else "FAIL")
        tgt = "" if target is None else f"≤ {fmt_ns(target)}"
        lines.append(f"| {what} | {st['n']} | {fmt_ns(st['p50_ns'])} | {fmt_ns(st['p90_ns'])} | {tgt} | {verdict} |")
    lines.append("")
    return lines


# --- markdown -----------------------------------------------------------------------------


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["# overlayckpt benchmark results", ""]
    lines.append(f"- run: {meta.get('started')} ({meta.get('mode')}), {meta.get('duration_s', 0):.0f} s")
    lines.append(f"- machine: {meta.get('kernel')}, {meta.get('cpus')} CPUs, {meta.get('mem_gb', 0):.0f} GB RAM; "
                 f"load average at start {_load(meta.get('loadavg_start'))}, at end {_load(meta.get('loadavg_end'))}")
    if "pageout" in meta.get("damon", ""):
        lines.append(f"- **DAMON reclaim is on** ({meta['damon']}): idle page cache and fs metadata are paged out "
                     "within seconds, so warm numbers and file creation vary more than on a normal host")
    lines.append(f"- tools: python {meta.get('python')}, {meta.get('git')}, {meta.get('fuse_overlayfs')}, "
                 f"pyfuse3 {meta.get('pyfuse3')}")
    lines.append(f"- project commit: {meta.get('project_commit')}")
    cold = "drop_caches + FUSE remount" if meta.get("can_drop_caches") else "NOT cold: drop_caches not permitted"
    lines.append(f"- cold caches: {cold}")
    lines.append("- p50 / p90 / p99 of per-operation wall time; ratios are p50 (or p99) over the baseline's, "
                 "same run and size.")
    lines.append("- shadow-git is a native directory for plain file operations, so it runs only the checkpoint "
                 "workloads.")
    lines.append("- overlayckpt `checkpoint` / `restore_*` go through the daemon's control file (the channel its CLI "
                 "uses); `checkpoint_cli` / `restore_100_cli` run the CLI, Python start-up included. "
                 "shadow-git is always two or more git processes.")
    lines.append("- cold: FUSE contenders remounted, then `sync; echo 3 > /proc/sys/vm/drop_caches`; "
                 "warm: the runs right after the cold one.")
    lines += [f"- **{n}**" for n in meta.get("notes", [])]
    lines.append("")
    checks = spec_checks(results)
    if any(v != "n/a" for _, _, v in checks):
        lines += ["## SPEC section 6 targets (overlayckpt)", "", "| target | measured | verdict |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {v} |" for t, m, v in checks]
        lines.append("")
    for size_key in sorted(results["sizes"], key=int):
        size = results["sizes"][size_key]
        lines += _section(f"{int(size_key):,} files ({size['repo']['bytes'] / 1e6:.0f} MB)", size)
    if "big_tree" in results:
        size = results["big_tree"]
        lines += _section(f"Big tree: {size['repo']['files']:,} files ({size['repo']['bytes'] / 1e6:.0f} MB)", size)
    if "projects" in results:
        size = results["projects"]
        lines += _section(f"Real projects: LuaJIT built with `make -j2`, click's pytest suite "
                          f"({size['repo']['files']:,} files, {size['repo']['bytes'] / 1e6:.0f} MB)", size)
    return "\n".join(lines) + "\n"


def _section(title: str, size: dict) -> list[str]:
    """The tables and notes of one measured repo."""
    lines = [f"## {title}", ""]
    cont = size["contenders"]
    names = sorted(cont, key=contender_key)
    for n in names:
        info = cont[n]
        extra = f", setup {info['setup_s']:.1f} s" if info.get("setup_s") is not None else ""
        reason = f": {info['reason']}" if info.get("reason") else ""
        lines.append(f"- **{n}**: {info['status']}{extra}{reason}")
    lines.append("")
    metrics = size["metrics"]
    ran = [n for n in names if any(n in per_c for per_c in metrics.values())]
    if metrics:
        lines.append("### p50 by workload")
        lines.append("")
        lines.append("| workload | " + " | ".join(ran) + " |")
        lines.append("|---|" + "---:|" * len(ran))
        for m in sorted(metrics, key=metric_key):
            row = [fmt_ns(metrics[m][n]["p50_ns"]) if n in metrics[m] else "" for n in ran]
            lines.append(f"| {m} | " + " | ".join(row) + " |")
        lines.append("")
        lines.append("### Detail")
        lines.append("")
        lines.append("| workload | contender | n | p50 | p90 | p99 | p50 ×native | p50 ×fuse-ovl | p99 ×fuse-ovl "
                     "| p50 ×shadow-git |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for m in sorted(metrics, key=metric_key):
            for n in sorted(metrics[m], key=contender_key):
                st = metrics[m][n]
                lines.append(
                    f"| {m} | {n} | {st['n']} | {fmt_ns(st['p50_ns'])} | {fmt_ns(st['p90_ns'])} | "
                    f"{fmt_ns(st['p99_ns'])} | {fmt_ratio(st.get('ratio_native_p50'))} | "
                    f"{fmt_ratio(st.get('ratio_fuse_overlayfs_p50'))} | "
                    f"{fmt_ratio(st.get('ratio_fuse_overlayfs_p99'))} | "
                    f"{fmt_ratio(st.get('ratio_shadow_git_p50'))} |")
        lines.append("")
    for c in sorted(size.get("stall", {}), key=contender_key):
        lines += _stall_lines(size, c)
    for c in sorted(size.get("long_session", {}), key=contender_key):
        lines += _long_session_lines(size, c)
    growth = size.get("store_growth", {})
    if growth:
        lines += ["### Store growth per edit (edit + checkpoint)", "",
                  "| contender | edits | apparent bytes / edit | allocated bytes / edit | store size |",
                  "|---|---:|---:|---:|---:|"]
        for n in sorted(growth, key=contender_key):
            g = growth[n]
            lines.append(f"| {n} | {g['edits']} | {fmt_bytes(g['apparent_bytes_per_edit'])} | "
                         f"{fmt_bytes(g['disk_bytes_per_edit'])} | {fmt_bytes(g['store_apparent_bytes'])} |")
        lines.append("")
    inc = size.get("store_incompressible", {})
    if inc:
        lines += ["### Store growth for 256 MiB of random bytes (allocated bytes / bytes written)", "",
                  "| contender | runs | growth |", "|---|---:|---:|"]
        lines += [f"| {n} | {len(inc[n])} | {' '.join(fmt_ratio(r) for r in inc[n])} |"
                  for n in sorted(inc, key=contender_key)]
        lines.append("")
    hl = size.get("history_length", {})
    ver = size.get("restore_verification", {})
    notes = list(size.get("notes", []))
    notes += [f"{n}: {note}" for n in names for note in cont[n].get("notes", [])]
    for wname, per_c in hl.items():
        notes.append(f"{wname}: history length before timing: "
                     + ", ".join(f"{c} {n}" for c, n in sorted(per_c.items())))
    for c, v in ver.items():
        notes.append(f"restore verification ({c}): {v['ok']} ok, {v['failed']} FAILED")
    ws = size.get("workload_seconds", {})
    if ws:
        notes.append("wall time per workload (all contenders): "
                     + ", ".join(f"{k} {v:.0f} s" for k, v in ws.items()))
    for e in size.get("workload_errors", []):
        notes.append(f"ERROR {e['workload']} / {e['contender']}: {e['error']}")
    if notes:
        lines += ["### Notes", ""] + [f"- {n}" for n in notes] + [""]
    return lines


# --- plots ---------------------------------------------------------------------------------


def plots(results: dict, outdir: Path) -> list[Path]:
    """latency_cdf_<metric>.png for every metric with enough samples, and cost_vs_size.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    sizes = sorted(results["sizes"], key=int)
    all_metrics = sorted({m for s in sizes for m in results["sizes"][s]["metrics"]}, key=metric_key)
    for m in all_metrics:
        cols = [s for s in sizes if any(st["n"] >= CDF_MIN_SAMPLES
                                        for st in results["sizes"][s]["metrics"].get(m, {}).values())]
        if not cols:
            continue
        fig, axes = plt.subplots(1, len(cols), figsize=(5.5 * len(cols), 4), squeeze=False)
        for ax, s in zip(axes[0], cols):
            for c, st in sorted(results["sizes"][s]["metrics"][m].items(), key=lambda kv: contender_key(kv[0])):
                xs = sorted(st["samples_us"])
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{c} (n={len(xs)})")
            ax.set_xscale("log")
            ax.set_xlabel("latency (µs, log)")
            ax.set_ylabel("fraction of operations")
            ax.set_title(f"{m}, {int(s):,} files")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        safe = m.replace("@", "_at_")
        path = outdir / f"latency_cdf_{safe}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    shown = [m for m in SIZE_PLOT_METRICS if m in all_metrics]
    if shown:
        ncol = 3
        nrow = math.ceil(len(shown) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
        for ax, m in zip(axes.flat, shown):
            contenders = sorted({c for s in sizes for c in results["sizes"][s]["metrics"].get(m, {})},
                                key=contender_key)
            for c in contenders:
                pts = [(int(s), results["sizes"][s]["metrics"][m][c]["p50_ns"] / 1000)
                       for s in sizes if c in results["sizes"][s]["metrics"].get(m, {})]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(m)
            ax.set_xlabel("files in repo")
            ax.set_ylabel("p50 (µs)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(shown):]:
            ax.axis("off")
        fig.tight_layout()
        path = outdir / "cost_vs_size.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_all(results: dict, outdir: Path, with_plots: bool = True) -> list[Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    for size in [*results["sizes"].values(), *(results[k] for k in ("big_tree", "projects") if k in results)]:
        add_ratios(size["metrics"])
    (outdir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (outdir / "results.md").write_text(markdown(results))
    written = [outdir / "results.json", outdir / "results.md"]
    if with_plots:
        for old in outdir.glob("latency_cdf_*.png"):
            old.unlink()
        try:
            written += plots(results, outdir)
        except ImportError:
            print("matplotlib not installed: no plots (pip install -e '.[bench]')")
    return written
