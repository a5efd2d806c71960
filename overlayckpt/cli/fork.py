"""Forks from the command line: fork, diff and apply across sessions, run --fork N.

A fork is made by its parent's session (the `fork` command, in its daemon or
offline: core/fork.py), then mounted like any session of the repo. Commands
across sessions read each one's store where it is: a mounted session's beside
its daemon (read-only), an unmounted one's opened here.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import NotRequired, TypedDict

from overlayckpt.cli import client
from overlayckpt.cli.sessions import numbered, session_label, session_store, store_for
from overlayckpt.cli.target import Target, emit
from overlayckpt.errors import UserError
from overlayckpt.messages import (
    ApplyReply,
    ApplyRequest,
    CheckpointRequest,
    DiffFile,
    DiffRequest,
    ForkPoint,
    ForkReply,
    ForkRequest,
    Ref,
    UnforkRequest,
)
from overlayckpt.store.info import read_info

TYPE_CHECKING = False  # (not typing's: typing costs every CLI start a few ms)
if TYPE_CHECKING:
    from overlayckpt.service.session import Session
    from overlayckpt.store.lmdbstore import ReadTxn


def _parent(args: argparse.Namespace) -> tuple[Target, str, str]:
    """The session a fork starts from (--mount, --store or the mount we are in): its
    target, repo and store."""
    target = Target(args)
    if target.mount is not None:
        status = client.status(target.mount)
        repo, store = status["repo"], status["store"]
    else:
        store = os.path.realpath(target.store or "")
        repo = str(read_info(store).get("repo") or "")
        if not repo:
            raise UserError(f"{store} is not an overlayckpt session store: check --store")
    _not_in_place(repo)
    return target, repo, store


def _not_in_place(repo: str) -> None:
    """A fork reads the repo itself: a session mounted in place hides it."""
    if os.path.exists(os.path.join(repo, ".overlayckpt", "ctl")):
        raise UserError(f"{repo} is mounted in place, which hides the repo a fork reads: "
                        "unmount it (the session is kept) and mount it at a separate mountpoint")


class Forked(ForkReply):
    mountpoint: str
    session: str
    parent_session: str
    status: NotRequired[int]  # (run --fork: its command's exit status, and what it changed)
    files: NotRequired[list[DiffFile]]


def make_fork(target: Target, repo: str, ref: Ref | None, mountpoint: str, store: str | None,
              window: float | None = None) -> Forked:
    """Fork target's session at ref (None: live) into store (None: the repo's next
    numbered session) and mount it at mountpoint; a fork that fails to mount is undone."""
    from overlayckpt.cli.daemon import check_places, prepare_mountpoint, spawn_daemon
    from overlayckpt.store.places import check_store_dir
    mountpoint = os.path.realpath(mountpoint)
    if mountpoint == repo:
        raise UserError("a fork is mounted beside the repo, not over it: give another MOUNTPOINT")
    new = os.path.realpath(store) if store else store_for(repo, None, True)
    # the fork's daemon reads the parent's store too; neither may be reached through
    # the new mount, nor the new store through the parent's (its daemon writes it)
    parent_store = target.store or client.status(target.mount or "")["store"]
    parent_mount = target.mount or client.served_at(parent_store)
    check_places(repo, mountpoint, [new, parent_store],
                 (("the parent's mount", parent_mount),) if parent_mount else ())
    check_store_dir(new)
    prepare_mountpoint(mountpoint)
    made = target.call(ForkRequest(store=new, id=ref))
    opts = argparse.Namespace(block_size=None, window=window, allow_other=False, verbose=False)
    try:
        spawn_daemon(repo, mountpoint, new, opts, False)
    except BaseException:
        import shutil
        with contextlib.suppress(UserError, OSError):
            target.call(UnforkRequest(store=new))
        shutil.rmtree(new, ignore_errors=True)
        raise
    return {**made, "mountpoint": mountpoint, "session": session_label(repo, new),
            "parent_session": session_label(repo, made["parent"])}


def cmd_fork(args: argparse.Namespace) -> int:
    ref = None if args.id is None else _ref(args.id)
    target, repo, _ = _parent(args)
    result = make_fork(target, repo, ref, args.mountpoint, args.fork_store)
    emit(args, result, lambda r: (
        f"forked {r['parent_session']} at checkpoint {r['checkpoint']} into {r['session']}, "
        f"mounted at {r['mountpoint']} (store {r['store']}; {r['entries']} entries copied, "
        "no file data)"))
    return 0


def _ref(value: str) -> Ref:
    from overlayckpt.names import parse_ref  # (ASCII digits only: "²" is a name)
    return parse_ref(value)


# -- across sessions --------------------------------------------------------------

def split_refs(args: argparse.Namespace, words: list[str]
               ) -> tuple[str, list[tuple[str, Ref | None]]]:
    """Each SESSION[:ID] -> (its store, the checkpoint; None: live), and their one repo
    (a session id is one of --repo's, or of the repo we are in)."""
    from overlayckpt.cli.sessions import repo_here
    numeric = [w.partition(":")[0] for w in words]
    here = repo_here(args.repo) if any(n.isascii() and n.isdigit() for n in numeric) else ""
    out, repos = [], set()
    for word in words:
        session, _, cid = word.partition(":")
        store = session_store(session, here)
        repos.add(read_info(store).get("repo") or here)
        out.append((store, None if cid in ("", "live") else _ref(cid)))
    if len(repos) != 1 or "" in repos:
        raise UserError(f"{' and '.join(words)} are not sessions of one repo: compare the "
                        "sessions of one repo ('overlayckpt sessions' lists them)")
    repo = repos.pop()
    _not_in_place(repo)
    return repo, out


@contextlib.contextmanager
def reading(store: str, repo: str) -> Iterator[Session]:
    """The session in store, to read: beside its daemon if one serves it, else opened here."""
    from overlayckpt.service.session import Session
    if client.served_at(store):
        fd = os.open(repo, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        session = Session.open_reader(store, repo, fd)
    else:
        session = Session.open(store)
    try:
        yield session
    finally:
        session.close()


class CrossDiff(TypedDict):
    a: str  # SESSION:ID
    b: str
    files: list[DiffFile]
    patch: NotRequired[str]


def cross_diff(args: argparse.Namespace, text: Callable[[CrossDiff], str]) -> int:
    """diff SESSION_A[:ID] SESSION_B[:ID]: any two states of two sessions of the repo."""
    from overlayckpt.core.fork import changes_between
    from overlayckpt.core.patch import render, stat_lines
    from overlayckpt.core.summaries import is_internal
    from overlayckpt.core.timeline import Timeline
    if len(args.refs) != 2:
        raise UserError("a diff across sessions takes two states: diff SESSION_A[:ID] SESSION_B[:ID]")
    repo, ((store_a, ref_a), (store_b, ref_b)) = split_refs(args, args.refs)
    with contextlib.ExitStack() as stack:
        sa = stack.enter_context(reading(store_a, repo))
        sb = sa if store_b == store_a else stack.enter_context(reading(store_b, repo))
        tl = Timeline(sa.ctx)

        def fn(ra: ReadTxn, rb: ReadTxn) -> CrossDiff:
            a = None if ref_a is None else tl.get(ra, ref_a)
            b = None if ref_b is None else Timeline(sb.ctx).get(rb, ref_b)
            changes = changes_between(tl, ra, a, rb, b, args.paths or None)
            if not args.all and not args.paths:
                changes = [c for c in changes if not is_internal(c.path)]
            out: CrossDiff = {
                "a": f"{session_label(repo, store_a)}:{a.id if a else 'live'}",
                "b": f"{session_label(repo, store_b)}:{b.id if b else 'live'}",
                "files": [{"path": p, "change": c, "added": ad, "removed": rm}
                          for p, c, ad, rm in stat_lines(changes)]}
            if not args.stat:
                out["patch"] = render(changes)
            return out
        result = sa.store.read(lambda ra: sb.store.read(lambda rb: fn(ra, rb)))
    emit(args, result, text)
    return 0


def apply_from(args: argparse.Namespace) -> ApplyReply:
    """apply --from SESSION[:ID]: that session's apply, with its conflict rules."""
    _, ((store, ref),) = split_refs(args, [args.from_session])
    if ref is None and args.checkpoint is not None:
        ref = _ref(args.checkpoint)
    return client.call_store(store, ApplyRequest(checkpoint=ref, force=args.force,
                                                 special=args.special))


# -- run --fork N ------------------------------------------------------------------

def cmd_run_forks(args: argparse.Namespace) -> int:
    """run --fork N -- CMD: N forks of the live state, CMD run in each at once (its exit
    status kept as a named checkpoint's message), then a table of the forks; the forks
    stay, unmounted."""
    from overlayckpt.cli.daemon import unmount
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UserError("run needs a command: overlayckpt run --fork N -- CMD ...")
    if args.fork < 1:
        raise UserError("--fork needs a number of forks, 1 or more")
    from overlayckpt.cli.target import find_mount
    if not args.store and find_mount(args.mount) is None:  # (else: the session we are in)
        repo = os.path.realpath(args.repo)
        if not numbered(repo):
            raise UserError(f"{repo} has no session to fork: mount it first, or give --store")
        args.store = store_for(repo, None, False)
    target, repo, _ = _parent(args)
    base = tempfile.mkdtemp(prefix="overlayckpt-forks-")
    forks: list[Forked] = []
    try:
        ref = None
        for i in range(args.fork):
            mnt = os.path.join(base, str(i + 1))
            os.mkdir(mnt)
            made = make_fork(target, repo, ref, mnt, None, args.window)
            ref = made["checkpoint"]  # one checkpoint of the parent for all of them
            forks.append(made)
        procs = []
        for i, f in enumerate(forks):
            env = dict(os.environ, OVERLAYCKPT_MOUNT=f["mountpoint"], OVERLAYCKPT_FORK=str(i + 1))
            try:
                procs.append(subprocess.Popen(cmd, cwd=f["mountpoint"], env=env))
            except OSError as e:
                for p in procs:  # (the others would keep their mounts busy)
                    p.kill()
                    p.wait()
                raise UserError(f"cannot run {cmd[0]}: {e.strerror}") from None
        for f, proc in zip(forks, procs):
            f["status"] = status = proc.wait()
            mnt = f["mountpoint"]
            client.send(mnt, CheckpointRequest(message=f"run: exit {status}"))
            f["files"] = client.send(mnt, DiffRequest(a=0, stat=True))["files"]
    finally:
        for f in forks:
            with contextlib.suppress(UserError, OSError):
                unmount(f["mountpoint"], False)
        for f in forks:
            with contextlib.suppress(OSError):
                os.rmdir(f["mountpoint"])
        with contextlib.suppress(OSError):
            os.rmdir(base)
    result: ForkRun = {
        "repo": repo, "checkpoint": forks[0]["checkpoint"] if forks else None,
        "forks": [{"session": f["session"], "store": f["store"], "status": f.get("status"),
                   "files": f.get("files")} for f in forks]}
    emit(args, result, _run_table)
    return 0 if forks and all(f.get("status") == 0 for f in forks) else 1


class ForkRan(TypedDict):
    session: str
    store: str
    status: int | None  # its command's exit status
    files: list[DiffFile] | None


class ForkRun(TypedDict):
    repo: str
    checkpoint: int | None
    forks: list[ForkRan]


def _run_table(r: ForkRun) -> str:
    rows = [("FORK", "STATUS", "FILES", "+", "-", "STORE")]
    for f in r["forks"]:
        files = f["files"] or []
        rows.append((f["session"], str(f["status"]), str(len(files)),
                     str(sum(x["added"] or 0 for x in files)),
                     str(sum(x["removed"] or 0 for x in files)), f["store"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"forks of checkpoint {r['checkpoint']} of {r['repo']}:"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for f in r["forks"]:
        for x in f["files"] or []:
            counts = "Bin" if x["added"] is None else f"+{x['added']} -{x['removed']}"
            lines.append(f"  {f['session']}: {x['change']} {x['path']} | {counts}")
    lines.append("keep the winner: overlayckpt apply --from SESSION; compare: "
                 "overlayckpt diff SESSION_A: SESSION_B:")
    return "\n".join(lines)


def forked_from_line(parent: ForkPoint) -> str:
    """What log says of a fork's start."""
    repo = read_info(parent["store"]).get("repo", "")
    return (f"(forked from {session_label(repo, parent['store'])} at its checkpoint "
            f"{parent['checkpoint']}: checkpoint 0)")
