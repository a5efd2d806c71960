"""The export_git and export_bundle commands (export/ does the work; import runs offline,
from the CLI, on a new store).
"""
from __future__ import annotations

import os
import weakref

import trio

from overlayckpt.core.workers import off_loop
from overlayckpt.errors import UserError
from overlayckpt.export.bundle import write_bundle
from overlayckpt.export.exporter import GitExport
from overlayckpt.export.gitnames import session_name
from overlayckpt.messages import ExportBundleReply, ExportBundleRequest, ExportGitReply, ExportGitRequest
from overlayckpt.service.paths import git_dir_off_mount, off_mount
from overlayckpt.service.registry import command
from overlayckpt.service.session import Session

_locks: weakref.WeakKeyDictionary[Session, trio.Lock] = weakref.WeakKeyDictionary()


@command(ExportGitRequest, durable=True, reaches_out=True)
async def _export_git(s: Session, cmd: ExportGitRequest) -> ExportGitReply:
    await git_dir_off_mount(s, f"/proc/{os.getpid()}/fd/{s.lower.fd}/.git")
    exporter = GitExport(s.ctx, cmd.branch)
    lock = _locks.setdefault(s, trio.Lock())
    async with lock:  # one export at a time per session (the daemon serves many requests)
        result = await exporter.run(cmd.since, cmd.limit)
    if result["exported"]:
        await _show_new_git_objects(s, "refs/heads/" + result["branch"])
    return result


async def _show_new_git_objects(s: Session, ref: str) -> None:
    """Export added a pack and a ref (with its reflog) to the repo's .git behind the
    overlay: drop what the overlay and the kernel cached of .git, including negative
    entries for the ref's names, so git inside the mount sees them."""
    s.repo_changed()
    if s.mountpoint is None:
        return  # no kernel caches to drop
    git_inos = {path: ino for ino, path in list(s.overlay.lower_paths.items())
                if path == b".git" or path.startswith(b".git/")}
    entries = []
    for top in (".git/", ".git/logs/"):
        parts = (top + ref).encode().split(b"/")
        for i in range(1, len(parts)):
            parent = git_inos.get(b"/".join(parts[:i]))
            if parent is not None:
                entries.append((parent, parts[i]))
    await s.ctx.invalidate(list(git_inos.values()), entries)


@command(ExportBundleRequest, reaches_out=True)
async def _export_bundle(s: Session, cmd: ExportBundleRequest) -> ExportBundleReply:
    path = cmd.path
    if not os.path.isabs(path):
        raise UserError('export_bundle needs "path": an absolute file path')
    # never stat or open anything inside our own mount: the daemon would wait on itself
    path, _ = await off_mount(s, path, "the bundle")
    info = {"repo": s.repo, "window": s.overlay.window, "session": session_name(s.store.path)}
    return await off_loop(s.store, lambda store: write_bundle(store, path, info, s.lower.fd))
