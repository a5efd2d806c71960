"""The stall's control: probes of a FUSE mount while fresh processes open files on it.

The stall workload's CLI load lifts the probes' p99 where the same commands sent by one
process do not (bench/results/issue16-session9-full). This runs the stall's probe
(session_workloads.Probe) on any mount (ours or fuse-overlayfs's) while a shell loop
starts processes back to back that each do one thing: nothing on the mount (`python -c
pass`), a stat there, a `cat` of a file there, or an open, a write and a close there.
Phases of a few seconds, alternated with idle ones, p99 in microseconds.

    python -m bench.fresh_clients MOUNT [SECONDS] [ROUNDS]
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.session_workloads import PROBE_SIZE, Probe


def loads(m: Path) -> dict[str, str | None]:
    py = sys.executable
    write = f'import os; fd = os.open("{m}/fresh-w.txt", os.O_RDWR | os.O_CREAT); os.write(fd, b"x"); os.close(fd)'
    return {
        "idle": None,
        "python, nothing on the mount": f"{py} -c pass",
        "python, a stat on the mount": f"{py} -c 'import os; os.stat(\"{m}/fresh-probe.bin\")'",
        "cat of a file on the mount": f"cat {m}/fresh-probe.bin >/dev/null",
        "python, open+write+close there": f"{py} -c '{write}'",
    }


def phase(m: Path, cmd: str | None, seconds: float) -> dict[str, float]:
    loop = subprocess.Popen(["bash", "-c", f"while :; do {cmd} >/dev/null 2>&1; done"]) if cmd else None
    probe = Probe(m / "fresh-probe.bin", PROBE_SIZE)
    times: dict[str, list[int]] = {k: [] for k in Probe.KINDS}
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for kind in Probe.KINDS:
                times[kind].append(probe.once(kind))
            time.sleep(0.0005)
    finally:
        probe.close()
        if loop is not None:
            loop.kill()
            loop.wait()
    return {k: sorted(v)[int(len(v) * 0.99)] / 1e3 for k, v in times.items()}


def main() -> None:
    m = Path(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    (m / "fresh-probe.bin").write_bytes(bytes(PROBE_SIZE))
    print(f"# p99 in µs on {m}, {seconds:.0f} s a phase")
    print("| load | " + " | ".join(Probe.KINDS) + " |")
    for _ in range(rounds):
        for label, cmd in loads(m).items():
            p = phase(m, cmd, seconds)
            print(f"| {label} | " + " | ".join(f"{p[k]:.0f}" for k in Probe.KINDS) + " |", flush=True)
    (m / "fresh-probe.bin").unlink()


if __name__ == "__main__":
    main()
