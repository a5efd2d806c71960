"""What an agent hook costs: the hook command on a real mount against `python -c pass`.

    python -m bench.hook [--runs 30]

Mounts a small repo under a temporary directory, then alternates the two
commands RUNS times each (the hook as install-hooks writes it, fed one
PreToolUse event on stdin, run in the mount as the agent runs it) and prints
their medians and p90s in milliseconds. Unmounts in any case.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from overlayckpt.core.agents import HOOK_MARK

EVENT = {"hook_event_name": "PreToolUse", "session_id": "bench", "transcript_path": "",
         "tool_name": "Edit", "tool_use_id": "toolu_bench",
         "tool_input": {"file_path": "README.md", "old_string": "a", "new_string": "b"}}


def timed(argv: list[str], stdin: bytes, cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run(argv, input=stdin, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


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
    with tempfile.TemporaryDirectory(prefix="bench-hook-") as tmp:
        repo, mnt, store = (os.path.join(tmp, x) for x in ("repo", "mnt", "store"))
        os.mkdir(repo)
        os.mkdir(mnt)
        with open(os.path.join(repo, "README.md"), "w") as f:
            f.write("a\n")
        subprocess.run(cli + ["mount", repo, mnt, "--store", store], check=True,
                       stdout=subprocess.DEVNULL)
        try:
            hook = [sys.executable, "-P", "-m", *HOOK_MARK.split(), "claude-code"]
            event = json.dumps(dict(EVENT, cwd=mnt)).encode()
            times: dict[str, list[float]] = {"python -c pass": [], "hook": []}
            for _ in range(args.runs):
                times["python -c pass"].append(timed([sys.executable, "-c", "pass"], b"", mnt))
                times["hook"].append(timed(hook, event, mnt))
            with open(os.path.join(mnt, ".overlayckpt", "conversation.jsonl")) as f:
                logged = sum(1 for _ in f)
        finally:
            subprocess.run(cli + ["unmount", mnt, "--no-apply"], check=False)
    assert logged == args.runs, f"the hook logged {logged} lines of {args.runs}"
    report(times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
