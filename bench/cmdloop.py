"""Runs CLI commands back to back, each in its own process, until SIGTERM; then prints
the timings as JSON. The stall workload's busy load, in a process of its own: as a
thread of the bench it would hold the bench process's GIL between the probe's system
calls, and the probe would time the bench's own waits for it.

argv: a file that gets one byte per completed loop, then the commands as JSON
([metric, argv] pairs; an argv that is {"mount": path, "cmd": {...}} is written to the
mount's control file from this process instead: the daemon's share of a command, without
a client process starting each time)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from overlayckpt.cli.client import send
from overlayckpt.errors import UserError
from overlayckpt.messages import parse


def run(argv: list[str]) -> str | None:
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}" if r.returncode else None


def ctl(spec: dict) -> str | None:
    """One command through the control file, as the CLI sends it; its error, if any."""
    try:
        send(spec["mount"], parse(spec["cmd"]))
    except UserError as e:
        return str(e)[-300:]
    return None


def main() -> None:
    dots, commands = sys.argv[1], json.loads(sys.argv[2])
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True
    signal.signal(signal.SIGTERM, on_term)
    times: dict[str, list[int]] = {}
    errors: list[str] = []
    with open(dots, "ab", buffering=0) as progress:
        while not stop:
            for metric, argv in commands:
                t0 = time.perf_counter_ns()
                error = ctl(argv) if isinstance(argv, dict) else run(argv)
                times.setdefault(metric, []).append(time.perf_counter_ns() - t0)
                if error and not stop:
                    errors.append(f"{metric}: {error}")
            progress.write(b".")
    json.dump({"times": times, "errors": errors}, sys.stdout)


if __name__ == "__main__":
    main()
