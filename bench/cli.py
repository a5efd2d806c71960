"""What a short CLI command costs on a mounted session: `checkpoint` and `log --limit 20`
against `python -c pass`, all through the installed console script.

    python -m bench.cli [--runs 30]

Mounts a small repo with 40 checkpoints under a temporary directory, then
alternates the three commands RUNS times each (run in the mount, as a hook or a
script runs them) and prints their medians and p90s in milliseconds. Unmounts in
any case. (The targets: checkpoint <= 50 ms and log --limit 20 <= 100 ms p50.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from bench.hook import timed


def report(times: dict[str, list[float]]) -> None:
    """Median and p90 of each command's alternated runs, in milliseconds."""
    for name, xs in times.items():
        xs.sort()
        print(f"{name:16} p50 {statistics.median(xs) * 1e3:6.1f} ms   "
              f"p90 {xs[int(len(xs) * 0.9)] * 1e3:6.1f} ms   ({len(xs)} runs, alternated)")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    cli = [sys.executable, "-m", "overlayckpt"]
    script = os.path.join(os.path.dirname(sys.executable), "overlayckpt")
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        repo, mnt, store = (os.path.join(tmp, x) for x in ("repo", "mnt", "store"))
        os.mkdir(repo)
        os.mkdir(mnt)
        subprocess.run(cli + ["mount", repo, mnt, "--store", store], check=True,
                       stdout=subprocess.DEVNULL)
        try:
            for i in range(40):  # a timeline for log to show, with line counts to make
                with open(os.path.join(mnt, f"f{i % 7}.txt"), "a") as f:
                    f.write(f"line {i}\n" * (i + 1))
                subprocess.run([script, "checkpoint"], cwd=mnt, check=True, stdout=subprocess.DEVNULL)
            commands = {"python -c pass": [sys.executable, "-c", "pass"],
                        "checkpoint": [script, "checkpoint"],
                        "log --limit 20": [script, "log", "--limit", "20"]}
            times: dict[str, list[float]] = {name: [] for name in commands}
            for _ in range(args.runs):
                for name, argv in commands.items():
                    times[name].append(timed(argv, b"", mnt))
        finally:
            subprocess.run(cli + ["unmount", mnt, "--no-apply"], check=False)
    report(times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
