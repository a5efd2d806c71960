"""Where a session's files live, and where they must never be.

A store directory holds exactly STORE_FILES: `--store` takes a new directory, an
empty one or a store, never a directory that holds the user's own files (`drop`
would delete them). Everything in it holds captured content or conversation, so
the directory is 0700 and its files 0600 whatever the umask, also when the user
made the directory beforehand.

A store, a mountpoint or a path a command writes (a fork's store, a bundle) must lie
outside the repo and outside the mount: the daemon would reach it through its own
mount, and a process serving the mount that waits on the mount waits forever.
`inside` tells whether a path lies in a place, lexically, after resolving it, and by
the identity (device, inode) of its ancestors, so that symlinks and bind mounts
cannot hide the relation. It stats the path: the daemon calls it on a worker
thread, never on the thread that serves the mount.
"""
from __future__ import annotations

import errno
import os
import stat

from overlayckpt.errors import UserError

# every file a store consists of (lmdbstore, synced.py, core/writebehind.py,
# core/answered.py, info.py and the daemon's log); drop deletes these and nothing else
STORE_FILES = ("data.mdb", "lock.mdb", "lock", "synced", "behind.log", "removals.log",
               "session.json", "session.json.tmp", "daemon.log")
DIR_MODE = 0o700
FILE_MODE = 0o600


def is_store(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("data.mdb", "lock.mdb"))


def foreign_entries(path: str) -> list[str]:
    """What a store directory holds besides its own files, sorted."""
    try:
        return sorted(set(os.listdir(path)) - set(STORE_FILES))
    except FileNotFoundError:
        return []


def check_store_dir(path: str) -> None:
    """A directory --store may take: none yet, an empty one, one holding only a store's
    files, or a store (whatever else it holds: it is a store already)."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise UserError(f"store {path} exists and is not a directory: give --store a new or "
                        "empty directory")
    others = foreign_entries(path)
    if others and not is_store(path):
        raise UserError(f"store {path} is a non-empty directory that is not an overlayckpt "
                        f"store (it holds {others[0]!r}): give --store a new or empty directory")


def secure(path: str) -> None:
    """The store directory 0700 and its files 0600 (a directory made with mkdir, files
    written by an older version or under another umask); best effort: what we may not
    change is not ours to fix."""
    try:
        if stat.S_IMODE(os.stat(path).st_mode) != DIR_MODE:
            os.chmod(path, DIR_MODE)
    except OSError:
        pass
    for name in STORE_FILES:
        try:
            st = os.lstat(os.path.join(path, name))
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != FILE_MODE:
                os.chmod(os.path.join(path, name), FILE_MODE)
        except OSError:
            pass


def make_dirs(path: str) -> None:
    """makedirs with every directory it creates 0700 whatever the umask (os.makedirs
    makes the missing parents 0777 & ~umask: 0777 under umask 000, where anyone could
    rename the store away)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        make_dirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    os.chmod(path, DIR_MODE)  # (mkdir's mode is masked by the umask)


def open_private(path: str, flags: int) -> int:
    """os.open of a store file: 0600 whatever the umask, also if it was there before."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except OSError:
        pass
    return fd


def remove_store(path: str) -> list[str]:
    """Delete a store's own files, then its directory if that left it empty. Returns
    what it kept (the directory's other entries)."""
    for name in STORE_FILES:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
    kept = foreign_entries(path)
    if not kept:
        try:
            os.rmdir(path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise
            kept = foreign_entries(path)
    return kept


# -- inside the repo or the mount ---------------------------------------------------

class Place:
    """A directory nothing of ours may be put into: its path (compared lexically and
    resolved) and identity; dev alone (a FUSE mount's device) makes every path on that
    filesystem inside it. (Not a dataclass: every CLI start imports this module, and
    dataclasses costs 6 ms.)"""
    __slots__ = ("label", "path", "ident", "dev")

    def __init__(self, label: str, path: str, ident: tuple[int, int] | None = None,
                 dev: int | None = None) -> None:
        self.label = label  # "the repo", "the mount"
        self.path = path
        self.ident = ident  # (st_dev, st_ino) of the directory
        self.dev = dev


def within(path: str, root: str) -> bool:
    """path is root or lies below it, as strings (both absolute and normalized)."""
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root if root == "/" else root + "/")


def lexically_inside(path: str, places: list[Place]) -> Place | None:
    """The place path lies in by its name alone (no system call: safe anywhere)."""
    norm = os.path.normpath(path)
    for p in places:
        if within(norm, os.path.normpath(p.path)):
            return p
    return None


def place_of(label: str, path: str) -> Place:
    """A place by its path, with its identity if it exists (statted: never on the
    thread serving the mount)."""
    try:
        st = os.stat(path)
    except OSError:
        return Place(label, os.path.realpath(path))
    return Place(label, os.path.realpath(path), (st.st_dev, st.st_ino))


def inside(path: str, places: list[Place], lexical: bool = True) -> Place | None:
    """The place path lies in: by its name, its resolved name, or the identity of the
    path or of any of its ancestors (the nearest that exist). Stats: never on the
    thread serving the mount."""
    if lexical:
        found = lexically_inside(os.path.abspath(path), places) or \
            lexically_inside(os.path.realpath(path), places)
        if found:
            return found
    d = os.path.realpath(path)
    while True:
        try:
            st = os.stat(d)
        except OSError:
            st = None
        if st is not None:
            for p in places:
                if p.ident == (st.st_dev, st.st_ino) or p.dev == st.st_dev:
                    return p
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent
