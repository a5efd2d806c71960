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
from bench.workloads import SUBPROCESS_TIMEOUT, Ctx, Samples, Workload, _add, drop_caches, now


def walk(root: str) -> int:
    """lstat every name below root (os.walk: one listing per directory), like `find`."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return n


def resident_memory(pid: int) -> dict[str, int]:
    """The process's resident memory: all of it, its own (anonymous and shared memory) and
    the file pages it maps (for our daemon: LMDB's store, page cache the kernel reclaims)."""
    with open(f"/proc/{pid}/status") as f:
        kb = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
              if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    return {"rss": kb.get("VmRSS", 0), "own": kb.get("RssAnon", 0) + kb.get("RssShmem", 0),
            "mapped_files": kb.get("RssFile", 0)}


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
