"""Issue 20's workload: how long a fork of a session takes, against `git worktree add`.

``fork@histH``: ``overlayckpt fork MOUNTPOINT`` of the mounted session with H
checkpoints recorded (the history workloads' lengths: 10 and 10,000 in a full
run), from the CLI, process start-up included, until the fork's mount answers.
``git_worktree_add@histH``: ``git worktree add --detach`` of the same repo (a
private copy of it, so its ``.git`` never changes under the mount), the usual way
to give a second agent a tree of its own; the two alternate, one each per
iteration. Both are undone after each iteration, untimed (unmount and drop the
fork, ``git worktree remove``), and the fork's tree is checked against the
session's.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from bench.contenders import Contender, ContenderError, Overlayckpt, copy_tree, force_unmount, is_mounted
from bench.workloads import Ctx, Samples, Workload, _add, now


class Fork(Workload):
    """Fork the session (and add a git worktree) with H checkpoints already recorded."""

    only_checkpoint = True
    iterations = (3, 10)
    rounds = (3, 5)

    def __init__(self, which: int) -> None:
        self.which = which  # 0: the short history, 1: the long one
        self.name = "fork_small" if which == 0 else "fork_large"

    def applies(self, c: Contender) -> bool:
        return isinstance(c, Overlayckpt)

    def prepare(self, c, ctx: Ctx) -> None:
        target = ctx.history_lengths[self.which]
        if len(c.ckpts) < target:
            c.pad_history(target - len(c.ckpts), lambda _i: (ctx.history_step(c), ctx.tick(0)))
        self.work = c.workdir.parent / f"{c.name}-{self.name}"
        self.work.mkdir()
        self.git_repo = self.work / "git-repo"
        copy_tree(ctx.repo.path, self.git_repo)
        self.probe = ctx.ckpt_targets[0]
        ctx.extra.setdefault("fork", {}).setdefault(self.name, {})[c.name] = {
            "checkpoints": len(c.ckpts), "repo_files": ctx.repo.n_files}

    def run(self, c, ctx: Ctx, start: int, count: int, out: Samples) -> None:
        h = ctx.history_lengths[self.which]
        for i in range(start, start + count):
            mnt, store, tree = self.work / f"mnt-{i}", self.work / f"store-{i}", self.work / f"wt-{i}"
            mnt.mkdir()
            t0 = now()
            c._cli("fork", str(mnt), "--fork-store", str(store), "--mount", str(c.root))
            _add(out, f"fork@hist{h}", now() - t0)
            try:
                if (mnt / self.probe).read_bytes() != (c.root / self.probe).read_bytes():
                    raise ContenderError(f"the fork's {self.probe} differs from the session's")
            finally:
                self._undo_fork(c, mnt, store)
            t0 = now()
            subprocess.run(["git", "-C", str(self.git_repo), "worktree", "add", "-q", "--detach",
                            str(tree)], check=True, capture_output=True)
            _add(out, f"git_worktree_add@hist{h}", now() - t0)
            subprocess.run(["git", "-C", str(self.git_repo), "worktree", "remove", "--force",
                            str(tree)], check=True, capture_output=True)
            ctx.tick(1)

    def _undo_fork(self, c, mnt: Path, store: Path) -> None:
        if is_mounted(mnt):
            try:
                c._cli("unmount", str(mnt), "--no-apply", timeout=120)
            except ContenderError:
                force_unmount(str(mnt), "fuse")
        if store.exists():
            c._cli("drop", str(store))
        mnt.rmdir()

    def finish(self, c, ctx: Ctx) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
