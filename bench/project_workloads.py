"""Real work in the mount (issue 19): a C build with ``make -j2`` and a pytest suite.

Both run on the projects repo (bench/projects.py), never on the generated
monorepo. Each iteration starts from the checked-out tree (``git clean -fdx``
of the project, untimed), then times the command. Beside the wall time it
records the CPU the FUSE daemon used during the command (all its threads,
from /proc), since a daemon answering in Python competes with the compiler
for the same cores, and the CPU of the command itself.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys

from bench.contenders import Contender
from bench.projects import C_PROJECT, PY_PROJECT
from bench.workloads import SUBPROCESS_TIMEOUT, Ctx, Samples, Workload, now

TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def process_cpu_ns(pid: int | None) -> int | None:
    """User + system CPU of *pid* and its threads so far, or None (no daemon)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_NS  # utime, stime (fields 14 and 15)


def children_cpu_ns() -> int:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return int((ru.ru_utime + ru.ru_stime) * 1e9)


class ProjectCommand(Workload):
    """One real command in one project of the projects repo, from a clean tree each time."""

    only_projects = True

    def __init__(self, name: str, project: str, argv: list[str], env: dict[str, str] | None = None,
                 iterations: tuple[int, int] = (1, 5)) -> None:
        self.name = name
        self.project = project
        self.argv = argv
        self.env = env or {}
        self.iterations = iterations
        self.rounds = iterations

    def wanted(self, ctx: Ctx) -> bool:
        return ctx.projects

    def _clean(self, c: Contender) -> None:
        subprocess.run(["git", "clean", "-fdxq", "--", self.project], cwd=c.root, check=True,
                       stdout=subprocess.DEVNULL, timeout=SUBPROCESS_TIMEOUT)

    def run(self, c: Contender, ctx: Ctx, start: int, count: int, out: Samples) -> None:
        env = dict(os.environ, **self.env)
        for _ in range(count):
            self._clean(c)
            os.sync()  # the clean's write-back must not land in the timed run
            pid = c.daemon_pid()
            daemon0, own0, t0 = process_cpu_ns(pid), children_cpu_ns(), now()
            r = subprocess.run(self.argv, cwd=c.root / self.project, env=env, capture_output=True,
                               timeout=SUBPROCESS_TIMEOUT)
            wall, own, daemon1 = now() - t0, children_cpu_ns() - own0, process_cpu_ns(pid)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(self.argv)} exited {r.returncode}: "
                                   f"{r.stderr.decode(errors='replace')[-800:]}")
            # the last line (pytest's counts) must be the same on every contender: said in the report
            last = (r.stdout.decode(errors="replace").strip().splitlines() or [""])[-1]
            ctx.extra.setdefault(f"{self.name}_said", {}).setdefault(c.name, []).append(_timeless(last))
            out.setdefault(self.name, []).append(wall)
            out.setdefault(f"{self.name}_cpu", []).append(own)
            if daemon0 is not None and daemon1 is not None:
                out.setdefault(f"{self.name}_daemon_cpu", []).append(daemon1 - daemon0)
            ctx.tick(1)
        self._clean(c)


def _timeless(line: str) -> str:
    """pytest's summary without its " in 3.61s"."""
    return re.sub(r" in [0-9.]+s\b.*", "", line)


def project_workloads() -> list[Workload]:
    return [
        ProjectCommand("build_c", C_PROJECT, ["make", "-j2"]),
        ProjectCommand("pytest_suite", PY_PROJECT,
                       [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        # click 8.1.7 turns warnings into errors; today's pytest warns of its fixtures
                        "-W", "ignore::DeprecationWarning", "-W", "ignore::pytest.PytestRemovedIn10Warning",
                        "tests"],
                       env={"PYTHONPATH": "src"}),
    ]
