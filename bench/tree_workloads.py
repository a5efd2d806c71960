"""A big tree (SPEC 6: 200,000 files): what a user pays before the first edit.

Run on a generated repo of its own size (``--big-tree``, default 200,000 files),
never on the sizes of the other workloads. Each iteration: FUSE contenders are
remounted (the remount is timed: unmount, then mount until it answers), the
kernel's caches dropped, then a first ``git status`` (cold), a second (warm), and
a walk that lstat's every entry, cold (after another remount and drop) and warm.
After the last walk, the daemon's resident memory.
"""

from __future__ import annotations

import os
import subprocess

from bench.contenders import Contender
from bench.workloads import SUBPROCESS_TIMEOUT, Ctx, Samples, Workload, _add, drop_caches, now, resident_memory


def walk(root: str) -> int:
    """lstat every name below root (os.walk: one listing per directory), like `find`."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return n


class BigTree(Workload):
    name = "big_tree"
    only_big_tree = True
    iterations = (1, 3)
    rounds = (1, 3)

    def wanted(self, ctx: Ctx) -> bool:
        return ctx.big_tree

    def applies(self, c: Contender) -> bool:
        return c.applies_to_fs_workloads

    def _fresh(self, c: Contender, out: Samples) -> None:
        if c.is_fuse:
            t0 = now()
            c.remount()
            _add(out, "big_tree_remount", now() - t0)
        drop_caches()

    def run(self, c, ctx, start, count, out):
        for _ in range(count):
            self._fresh(c, out)
            for which in ("cold", "warm"):
                t0 = now()
                subprocess.run(["git", "status", "--porcelain"], cwd=c.root, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               timeout=SUBPROCESS_TIMEOUT)
                _add(out, f"big_tree_git_status_{which}", now() - t0)
            self._fresh(c, out)
            for which in ("cold", "warm"):
                t0 = now()
                walk(str(c.root))
                _add(out, f"big_tree_walk_{which}", now() - t0)
            pid = c.daemon_pid()
            if pid is not None:
                ctx.extra.setdefault("big_tree_rss", {})[c.name] = resident_memory(pid)
            ctx.tick(1)


def tree_workloads() -> list[Workload]:
    return [BigTree()]
