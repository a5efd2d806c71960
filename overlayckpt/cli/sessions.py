"""A repo's sessions: where their stores are, which one a mount resumes, `sessions`, `drop`.

A repo's sessions live in the data directory, named after the repo
(store/info.py's default_store_dir): session 1 at that very path (where every
store was before sessions were numbered, so old stores stay session 1), each
later one, made by `mount --new`, beside it with a suffix (`.2`, `.3`, ...). A
mount without --store resumes the newest: that is the default session. A store
given with --store is a session of its own and is not numbered here.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import time
from collections.abc import Iterable, Mapping

from overlayckpt.cli import client
from overlayckpt.cli.target import emit, find_mount
from overlayckpt.errors import UserError
from overlayckpt.store.info import default_store_dir, read_info
from overlayckpt.store.places import STORE_FILES, check_store_dir, is_store, remove_store

# (types only, defined for the type checker: a mount's CLI starts the daemon before it
# imports the messages, 14 ms of every CLI start)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NotRequired, TypedDict

    from overlayckpt.messages import ForkPoint, SummaryReply

    class Announced(SummaryReply):
        text: str  # what a mount prints of the session it resumed

    class SessionRow(TypedDict):
        """One session in `sessions`: where it is, and its summary (or why there is none)."""
        id: int
        store: str
        default: bool
        mounted: str | None
        parent: ForkPoint | None
        created: str | None
        last_activity: str
        size_bytes: int
        checkpoints: NotRequired[int]
        unapplied: NotRequired[int]
        applied: NotRequired[bool]
        last_checkpoint: NotRequired[str | None]
        error: NotRequired[str]

    class Sessions(TypedDict):
        repo: str
        default: int | None
        sessions: list[SessionRow]

    class Family(TypedDict):
        parent: ForkPoint | None
        forks: list[str]  # stores


def numbered(repo: str) -> list[tuple[int, str]]:
    """The repo's sessions in the data directory, (id, store), oldest first."""
    base = default_store_dir(repo)
    parent, name = os.path.split(base)
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    out = [(1, base)] if name in entries and is_store(base) else []
    for entry in entries:
        suffix = entry[len(name) + 1:]
        if entry.startswith(name + ".") and suffix.isascii() and suffix.isdigit() and int(suffix) > 1:
            path = os.path.join(parent, entry)
            if is_store(path):
                out.append((int(suffix), path))
    return sorted(out)


def store_for(repo: str, store: str | None, new: bool) -> str:
    """The store a mount of repo uses: --store, a new numbered one (--new), or the default."""
    if store:
        if new:
            raise UserError("--new picks a new store itself: give --new or --store, not both")
        check_store_dir(os.path.abspath(store))  # (drop deletes a store's files: none of yours)
        return os.path.abspath(store)
    found = numbered(repo)
    if not found:
        return default_store_dir(repo)
    if not new:
        return default_of(found)[1]
    return f"{default_store_dir(repo)}.{found[-1][0] + 1}"


def default_of(found: list[tuple[int, str]]) -> tuple[int, str]:
    """The session a mount resumes: the newest that is not a fork (forks are mounted by
    name), else the newest."""
    mains = [s for s in found if not read_info(s[1]).get("parent")]
    return (mains or found)[-1]


def session_store(ref: str, repo: str) -> str:
    """A session named on the command line: its id in 'sessions', or its store."""
    if ref.isascii() and ref.isdigit():  # (ASCII: int("²") fails, "１" is no id)
        stores = dict(numbered(repo))
        if int(ref) not in stores:
            raise UserError(f"{repo} has no session {ref}: 'overlayckpt sessions' lists them")
        return stores[int(ref)]
    store = os.path.realpath(ref)
    if not is_store(store):
        raise UserError(f"{ref} is not an overlayckpt session store: give an id or a "
                        "store path that 'overlayckpt sessions' lists")
    return store


def session_label(repo: str, store: str) -> str:
    """How commands name a session: "session N" for the repo's numbered ones."""
    ids = {path: n for n, path in numbered(repo)}
    store = os.path.realpath(store)
    return f"session {ids[store]}" if store in ids else f"the session in {store}"


def _ago(iso: str | None) -> str:
    if not iso:
        return "at an unknown time"
    import datetime
    seconds = time.time() - datetime.datetime.fromisoformat(iso).timestamp()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


def announce(repo: str, mountpoint: str, store: str) -> Announced:
    """A resumed session's summary from its daemon, and the lines a mount prints of it."""
    from overlayckpt.messages import SummaryRequest
    summary = client.send(mountpoint, SummaryRequest())
    which = session_label(repo, store)
    unapplied = (f"{summary['unapplied']} not yet applied to the repo" if summary["applied"]
                 else f"{summary['unapplied']} after its start, never applied to the repo")
    text = (
        f"resumed {which} of {repo} (started {_ago(summary.get('created'))}; "
        f"{summary['checkpoints']} checkpoints, {unapplied})\n"
        f"for a fresh one: overlayckpt unmount {mountpoint} --no-apply && "
        f"overlayckpt mount {repo}{'' if mountpoint == repo else ' ' + mountpoint} --new "
        "(this one is kept: 'overlayckpt sessions')")
    return {**summary, "text": text}


# -- sessions, drop -------------------------------------------------------------------

def repo_here(arg: str | None) -> str:
    """The repo a command means: REPO, else the mount we are in, else the nearest
    directory up from here that has sessions (else here)."""
    if arg:
        if not os.path.isdir(arg):
            raise UserError(f"repo {arg} is not a directory: give the repo the sessions are of")
        return os.path.realpath(arg)
    mnt = find_mount(None)
    if mnt is not None:
        return str(client.status(mnt)["repo"])
    here = d = os.path.realpath(os.getcwd())
    while True:
        if numbered(d):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return here
        d = parent


def _allocated(paths: Iterable[str]) -> int:
    """What the files at paths take on disk (one that is gone counts nothing)."""
    total = 0
    for path in paths:
        try:
            total += os.lstat(path).st_blocks * 512
        except OSError:
            pass
    return total


def _disk_bytes(path: str) -> int:
    """What everything under path takes on disk."""
    return _allocated(os.path.join(d, f) for d, _, files in os.walk(path) for f in files)


def _store_bytes(path: str) -> int:
    """What a store's own files take on disk."""
    return _allocated(os.path.join(path, name) for name in STORE_FILES)


def _parent(info: Mapping[str, object]) -> ForkPoint | None:
    """The fork point session.json records (None: not a fork)."""
    store, ck = info.get("parent"), info.get("parent_checkpoint")
    return {"store": store, "checkpoint": ck} if isinstance(store, str) and isinstance(ck, int) else None


def describe(n: int, store: str, default: bool) -> SessionRow:
    mounted = client.served_at(store)
    mtime = max(os.stat(os.path.join(store, f)).st_mtime for f in ("data.mdb", "lock.mdb"))
    from overlayckpt.records import iso_time
    info = read_info(store)
    created = info.get("created")
    row: SessionRow = {"id": n, "store": store, "default": default, "mounted": mounted,
                       "parent": _parent(info),
                       "created": created if isinstance(created, str) else None,
                       "last_activity": iso_time(int(mtime * 1e9)),
                       "size_bytes": _disk_bytes(store)}
    from overlayckpt.messages import SummaryRequest
    try:
        summary = client.call_store(store, SummaryRequest())
    except (UserError, OSError) as e:
        row["error"] = str(e)
        return row
    row["checkpoints"], row["unapplied"] = summary["checkpoints"], summary["unapplied"]
    row["applied"], row["last_checkpoint"] = summary["applied"], summary["last_checkpoint"]
    row["created"] = summary["created"] or row["created"]
    return row


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _table(r: Sessions) -> str:
    if not r["sessions"]:
        return f"no sessions of {r['repo']} (a mount starts one)"
    rows = [("", "ID", "FORK OF", "CREATED", "LAST ACTIVITY", "CHECKPOINTS", "NOT APPLIED", "SIZE",
             "MOUNTED", "STORE")]
    ids = {s["store"]: s["id"] for s in r["sessions"]}
    for s, depth in _tree(r["sessions"]):
        p = s["parent"]
        fork_of = "-" if p is None else f"{ids.get(p['store'], '?')}:{p['checkpoint']}"
        rows.append(("*" if s["default"] else "", "  " * depth + str(s["id"]), fork_of,
                     (s["created"] or "?")[:16].replace("T", " "),
                     s["last_activity"][:16].replace("T", " "),
                     str(s.get("checkpoints", "?")), str(s.get("unapplied", "?")),
                     _size(s["size_bytes"]), s["mounted"] or "-", s["store"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"sessions of {r['repo']} (* the default: a mount without --store resumes it; "
             "a fork under its parent)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"session {s['id']}: {s['error']}" for s in r["sessions"] if "error" in s]
    from overlayckpt.names import line_text  # (a repo or store path may hold anything)
    return "\n".join(line_text(line) for line in lines)


def _tree(sessions: list[SessionRow]) -> list[tuple[SessionRow, int]]:
    """Sessions in order, each fork under its parent (depth: how far down)."""
    listed = {s["store"] for s in sessions}
    children: dict[str | None, list[SessionRow]] = {}
    for s in sessions:
        p = s["parent"]["store"] if s["parent"] and s["parent"]["store"] in listed else None
        children.setdefault(p, []).append(s)
    out: list[tuple[SessionRow, int]] = []

    def visit(parent: str | None, depth: int) -> None:
        for s in children.get(parent, ()):
            out.append((s, depth))
            visit(s["store"], depth + 1)
    visit(None, 0)
    return out


def cmd_sessions(args: argparse.Namespace) -> int:
    repo = repo_here(args.repo)
    found = numbered(repo)
    newest = default_of(found)[0] if found else None
    result: Sessions = {"repo": repo, "default": newest,
                        "sessions": [describe(n, store, n == newest) for n, store in found]}
    emit(args, result, _table)
    return 0


def _family(store: str) -> Family:
    """The session's parent and forks: from its store, and the forks the repo's numbered
    sessions name (a store that cannot be read still has those)."""
    info = read_info(store)
    from overlayckpt.messages import ForksRequest
    try:
        family = client.call_store(store, ForksRequest())
    except UserError:  # (damaged, say: it can still be dropped)
        family = {"forks": {}, "parent": _parent(info)}
    repo = info.get("repo")
    named = [path for _, path in numbered(repo)
             if read_info(path).get("parent") == store] if isinstance(repo, str) and repo else []
    return {"parent": family["parent"], "forks": sorted(set(family["forks"]) | set(named))}


def cmd_drop(args: argparse.Namespace) -> int:
    given = args.session
    repo = repo_here(args.repo) if given.isascii() and given.isdigit() else ""
    store = session_store(given, repo)
    mounted = client.served_at(store)
    if mounted:
        raise UserError(f"session {given} is mounted at {mounted}: unmount it first")
    family = _family(store)
    live = [f for f in family["forks"] if is_store(f)]
    if live:
        repo = repo or read_info(store).get("repo", "")
        raise UserError(f"session {given} has forks that read their files from it: "
                        f"{', '.join(session_label(repo, f) for f in live)}; drop them first")
    lock_fd = os.open(os.path.join(store, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:  # the daemon's lock (lmdbstore.Store.open): none may start while we delete
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"session {given} is in use by an overlayckpt daemon: unmount it "
                            "first") from None
        freed = _store_bytes(store)
        kept = remove_store(store)  # its own files only: never what else the directory holds
    finally:
        os.close(lock_fd)
    parent = family["parent"]
    if parent and is_store(parent["store"]):  # its blocks are the parent's garbage now
        from overlayckpt.messages import UnforkRequest
        try:
            client.call_store(parent["store"], UnforkRequest(store=store))
        except UserError:  # (harmless: a parent's gc passes over a fork that is gone)
            pass
    emit(args, {"dropped": store, "freed_bytes": freed, "kept": kept},
         lambda r: f"dropped session {given} (store {store}, {_size(freed)} freed)"
         + (f"; kept the directory, which holds other files ({', '.join(kept[:3])})" if kept else ""))
    return 0
