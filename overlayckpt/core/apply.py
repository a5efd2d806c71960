"""Writing the live state (or a checkpoint) into the repo.

Only directories that hold something the overlay changed are visited (the
ancestors of every inode with a node record and of every directory with
dirents), so apply costs what changed, not the size of the repo.

Before apply changes or removes any entry of the repo as the session first
saw it, that entry is pinned (core/pins.py), so every checkpoint that still
refers to the original repo keeps seeing it exactly, after any number of applies.

The session's store is untrusted here (a bundle from another machine, a damaged
store, another user writing in an --allow-other mount), and so is the repo
while apply runs (anyone who may write in it can swap a directory for a
symlink). So:

- every name is checked to be one path component before anything is written
  and again where it is used; every entry is made, linked, renamed or removed
  only as (directory fd, one name), directories opened with openat2
  RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS or O_NOFOLLOW: a symlink apply did not
  make is never followed;
- temp names are ours (random, O_EXCL), never derived from a name in the store,
  and never left behind;
- a second name of a file is linked from an fd of the first, checked to be the
  file apply wrote (or kept), never through a path;
- apply grants nothing the repo did not have: no setuid/setgid bit the repo's
  file did not have (with the same owner), no device node, fifo or socket
  unless asked (`special`), owners kept by root and, for anyone else, entries
  of another owner refused (reported, never silently re-owned);
- an apply that fails part way raises PartlyDone naming what it wrote.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import Any

from overlayckpt.core import history
from overlayckpt.core.conflicts import refuse_conflicts, remember_repo
from overlayckpt.core.context import Context
from overlayckpt.core.lower import join, openat2_beneath
from overlayckpt.core.pins import pin
from overlayckpt.errors import FsError, PartlyDone, UserError
from overlayckpt.messages import ApplyStats, Ref, Refused
from overlayckpt.names import check_file_name, is_file_name, quote_path
from overlayckpt.records import (
    CONTROL_NAME,
    ROOT_INO,
    T_DIRENTS,
    T_NODES,
    WHITEOUT,
    Node,
    from_u64,
)
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.synced import pwrite_all
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import APPLIED_KEY, DIRENTS, NODES, SEQ_KEY

TEMP_PREFIX = b".overlayckpt-apply-"  # + random hex: a temp name is never derived from input
SETID = stat.S_ISUID | stat.S_ISGID
SPECIAL = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
           stat.S_IFIFO: "a fifo", stat.S_IFSOCK: "a socket"}
KINDS = frozenset({stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, *SPECIAL})
# no repo holds a file this big (ext4's limit is 16 TiB); a size beyond it is a damaged or
# crafted record, and writing it (holes, a piece at a time) would never end
MAX_FILE_SIZE = 1 << 46
SHOWN = 5  # paths a one-line message names before "and N more"
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_AT_EMPTY_PATH = 0x1000
_AT_SYMLINK_NOFOLLOW = 0x100
_libc = ctypes.CDLL(None, use_errno=True)


def fchown_fd(fd: int, uid: int, gid: int) -> None:
    """Change the owner of what fd (O_PATH: a symlink or a special file) refers to itself,
    never of a name that may have been swapped since (fchownat AT_EMPTY_PATH)."""
    if _libc.fchownat(fd, b"", uid, gid, _AT_EMPTY_PATH | _AT_SYMLINK_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def shown_paths(paths: list[str]) -> str:
    """The first few of paths, quoted like git, for a one-line message."""
    first = ", ".join(quote_path(p) for p in paths[:SHOWN])
    return first + (f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else "")


class Applier:
    def __init__(self, ctx: Context, special: bool = False) -> None:
        self.ctx = ctx
        self.ov = ctx.overlay
        self.lower = ctx.lower
        self.fd = ctx.lower.fd
        self.special = special  # device nodes, fifos and sockets are written only when asked
        self.root = os.geteuid() == 0  # may keep every entry's owner
        self.uid = os.geteuid()
        self.groups = {os.getegid(), *os.getgroups()}
        # inode -> (path, st_dev, st_ino) of the repo file its first name became: a second
        # name is linked from that file, reopened and checked to be the same one
        self.written: dict[int, tuple[bytes, int, int]] = {}
        self.stats = {"written": 0, "removed": 0, "pinned": 0}  # (ApplyStats' counts)
        self.written_paths: list[str] = []
        self.removed_paths: list[str] = []
        self.refused: list[Refused] = []  # left as the repo has it
        self.setid_dropped: list[str] = []
        self.at: bytes | None = None  # the entry being applied (named if apply stops there)

    def result(self) -> ApplyStats:
        return {"written": self.stats["written"], "removed": self.stats["removed"],
                "pinned": self.stats["pinned"], "refused": self.refused,
                "setid_dropped": self.setid_dropped}

    # -- pinning ----------------------------------------------------------------

    def _pin(self, path: bytes, recursive: bool) -> None:
        """Keep the original lower entry at path in the store before it changes."""
        self.stats["pinned"] += pin(self.ctx.store, self.lower, path, recursive)

    def _pinned(self, path: bytes) -> bool:
        """Whether the repo at path may differ from the original (an earlier apply changed it)."""
        return self.lower.pins is not None and self.lower.pins(path) is not None

    # -- walking ----------------------------------------------------------------

    def dirty_dirs(self, state: Any, extra_nodes: list[int], extra_dirs: list[int]) -> set[int]:
        """Directories whose subtree differs from the lower: ancestors of every changed inode."""
        def fn(r: ReadTxn) -> tuple[list[int], list[int]]:
            nodes = [from_u64(k) for k, _ in r.range_from(NODES)]
            dirs = sorted({from_u64(k[:8]) for k, _ in r.range_from(DIRENTS)})
            return nodes, dirs
        nodes, dirs = self.ctx.store.read(fn)
        out: set[int] = {ROOT_INO}
        for ino in set(nodes) | set(extra_nodes):
            out |= self.ov.ancestors(state, ino)
            out |= self._origin_dirs(state, ino)
        for ino in set(dirs) | set(extra_dirs):
            out.add(ino)
            out |= self.ov.ancestors(state, ino)
        return out

    def _origin_dirs(self, state: Any, ino: int) -> set[int]:
        """The lower directory a repo file came from, and its ancestors: a record's parent
        hint names one directory that holds it, and after a link elsewhere that is not the
        one where the repo still has its original name."""
        try:
            origin = self.ov.node(state, ino).origin
        except FsError:
            return set()
        if not origin or b"/" not in origin:
            return set()  # at the root, which is always visited
        parent_path = origin.rpartition(b"/")[0]
        try:
            parent = self.ov.ino_of_lower(self.lower.stat(parent_path, False), parent_path)
        except FsError:
            return set()
        return {parent} | self.ov.ancestors(state, parent)

    def apply(self, state: Any, extra_nodes: list[int], extra_dirs: list[int],
              force: bool = False) -> ApplyStats:
        self.check_state(state)  # a hostile or damaged store: refused before anything is written
        try:
            if not force:
                self.refuse_conflicts(state)
            dirty = self.dirty_dirs(state, extra_nodes, extra_dirs)
            try:
                self._sync_dir(state, ROOT_INO, b"", dirty, force=False)
            finally:
                self.lower_reset()
            self.remember_repo()
        except UserError as e:
            if self.at is None:  # (a conflict: refused before anything was looked at)
                raise
            raise self._stopped(e) from None
        except (OSError, FsError) as e:  # ENOSPC, EIO, an entry swapped for a symlink
            raise self._stopped(e) from None
        return self.result()

    def check_state(self, state: Any) -> None:
        """Every name in the state's dirents is one path component, every node a known type
        of a sane size: else one line, and nothing is written. (The lower's names come from
        the kernel: they are checked where they are used, below.)"""
        where = "the session's store"
        for key, val in state.prefix(DIRENTS, b""):
            if val != WHITEOUT:
                check_file_name(key[8:], where)
        for key, raw in state.prefix(NODES, b""):
            try:
                node = Node.unpack(raw)
                mode, size = int(node.mode), int(node.size)
            except Exception:  # (msgpack, TypeError, ValueError: whatever a damaged value gives)
                raise UserError(f"{where} holds a damaged file record (inode {from_u64(key[:8])}): "
                                "nothing was written; run fsck") from None
            if stat.S_IFMT(mode) not in KINDS:
                raise UserError(f"{where} holds a file of unknown type {mode:#o} (inode "
                                f"{from_u64(key[:8])}): it is refused, nothing was written")
            if not 0 <= size <= MAX_FILE_SIZE:
                raise UserError(f"{where} holds a file of {size} bytes (inode {from_u64(key[:8])}), "
                                "more than any file system holds: it is refused, nothing was written")

    def _stopped(self, e: BaseException) -> PartlyDone:
        """The one line (and the details for --json) of an apply that failed part way."""
        if isinstance(e, UserError):
            why = str(e)
        else:
            err = getattr(e, "errno", None)
            why = os.strerror(err) if err else str(e)
        where = quote_path(self.at) if self.at is not None else "the repo"
        written, removed = self.written_paths, self.removed_paths
        if not written and not removed:
            done = "nothing in the repo was changed"
        else:
            parts = [f"{len(written)} written ({shown_paths(written)})" if written else "0 written"]
            parts.append(f"{len(removed)} removed ({shown_paths(removed)})" if removed else "0 removed")
            done = f"the repo is partly applied: {', '.join(parts)}; --json lists them"
        details = {"failed_at": os.fsdecode(self.at) if self.at is not None else None,
                   "written_paths": written, "removed_paths": removed, **self.result()}
        return PartlyDone(f"apply stopped at {where}: {why}; {done}; fix that and run apply again",
                          details)

    # -- conflicts with changes made to the repo itself (core/conflicts.py) ------

    def refuse_conflicts(self, state: Any) -> None:
        refuse_conflicts(self.ctx.store, self.fd, self.ov, state, self._same_content)

    def remember_repo(self) -> None:
        remember_repo(self.ctx.store, self.fd)

    def lower_reset(self) -> None:
        self.lower.forget_cached()
        self.ov.forget_lower_files()

    def _dirfd(self, path: bytes) -> int:
        return openat2_beneath(self.fd, path, os.O_RDONLY | os.O_DIRECTORY)

    def _real_entries(self, dfd: int) -> dict[bytes, os.stat_result]:
        out = {}
        with os.scandir(dfd) as it:
            for e in it:
                out[os.fsencode(e.name)] = e.stat(follow_symlinks=False)
        return out

    # -- what apply writes, and what it refuses ---------------------------------

    def _wrote(self, path: bytes) -> None:
        self.stats["written"] += 1
        self.written_paths.append(os.fsdecode(path))

    def _refused(self, path: bytes, node: Node) -> bool:
        """Whether the entry at path must not be written (then it is reported once)."""
        why = self._refusal(node)
        if why is not None:
            self.refused.append({"path": os.fsdecode(path), "why": why})
        return why is not None

    def _refusal(self, node: Node) -> str | None:
        kind = stat.S_IFMT(node.mode)
        if kind in SPECIAL and not self.special:
            return f"{SPECIAL[kind]}: apply --special writes device nodes, fifos and sockets"
        if self.root:
            return None
        if node.uid != self.uid:
            return f"owned by uid {node.uid}: only root can write it and keep its owner"
        if node.gid not in self.groups:
            return f"of group {node.gid}, which is not yours: only root can keep it"
        return None

    def _mode(self, node: Node, st: os.stat_result | None) -> int:
        """node's permissions, less a setuid/setgid bit the repo's entry did not have for the
        same owner (a bit set in the mount, by the agent or another user, is never granted)."""
        mode = stat.S_IMODE(node.mode)
        if not mode & SETID:
            return mode
        uid, gid = (node.uid, node.gid) if self.root else (self.uid, node.gid)
        keep = 0
        if st is not None and stat.S_IFMT(st.st_mode) == stat.S_IFMT(node.mode):
            if st.st_mode & stat.S_ISUID and st.st_uid == uid:
                keep |= stat.S_ISUID
            if st.st_mode & stat.S_ISGID and st.st_gid == gid:
                keep |= stat.S_ISGID
        return mode & ~SETID | keep

    def _given_mode(self, path: bytes, node: Node, st: os.stat_result | None) -> int:
        """_mode, for an entry being written: a bit left out is reported."""
        mode = self._mode(node, st)
        if stat.S_IMODE(node.mode) & SETID & ~mode:
            self.setid_dropped.append(os.fsdecode(path))
        return mode

    def _own(self, fd: int, node: Node, st: os.stat_result, new: bool) -> None:
        """Give what the open fd refers to node's owner: root keeps every owner; anyone else
        gives what it makes a group of its own (another owner was refused before)."""
        if self.root:
            if (st.st_uid, st.st_gid) != (node.uid, node.gid):
                os.fchown(fd, node.uid, node.gid)
        elif new and st.st_gid != node.gid:
            os.fchown(fd, -1, node.gid)

    def _owned(self, st: os.stat_result, node: Node) -> bool:
        """Whether the repo's entry already has the owner apply would give it (only root
        changes the owner of what exists)."""
        return not self.root or (st.st_uid, st.st_gid) == (node.uid, node.gid)

    def _temp(self, make: Callable[[bytes], Any]) -> tuple[bytes, Any]:
        """A fresh name of ours in a directory and what make(name) made there (make fails
        with FileExistsError on a name taken: another is drawn)."""
        for _ in range(16):
            name = TEMP_PREFIX + secrets.token_hex(8).encode()
            try:
                return name, make(name)
            except FileExistsError:
                continue
        raise FsError(errno.EEXIST, "no free temp name")

    @staticmethod
    def _drop_temp(dfd: int, name: bytes) -> None:
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass

    def _place(self, dfd: int, tmp: bytes, name: bytes) -> None:
        """Rename our temp over name; the temp is gone whatever happens."""
        try:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            # (also when tmp and name were already links of one file: rename then does nothing)
            self._drop_temp(dfd, tmp)

    # -- walking the directories ------------------------------------------------

    def _remove(self, dfd: int, path: bytes, name: bytes, st: os.stat_result) -> None:
        self.at = path
        self._pin(path, recursive=True)
        if stat.S_ISDIR(st.st_mode):
            sub = openat2_beneath(dfd, name, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for child, cst in self._real_entries(sub).items():
                    self._remove(sub, join(path, child), child, cst)
            finally:
                os.close(sub)
            self.at = path
            os.rmdir(name, dir_fd=dfd)
        else:
            os.unlink(name, dir_fd=dfd)
        self.stats["removed"] += 1
        self.removed_paths.append(os.fsdecode(path))

    def _sync_dir(self, state: Any, ino: int, path: bytes, dirty: set[int], force: bool) -> None:
        self.at = path
        dfd = self._dirfd(path)
        try:
            want = {name: (child, cnode or self.ov.node(state, child))
                    for name, child, cnode in self.ov.entries(state, ino)}
            for name in want:  # (checked again where used: the store may have changed)
                if not is_file_name(name):
                    raise UserError(f"the session's store holds the file name {quote_path(name)}, "
                                    "which is not a single path component")
            have = self._real_entries(dfd)
            if path == b"":
                have.pop(CONTROL_NAME, None)
            if set(have) != set(want):
                self._pin(path, recursive=False)
            for name, st in have.items():
                if name not in want:
                    self._remove(dfd, join(path, name), name, st)
            for name, (child, node) in sorted(want.items()):
                self._sync_entry(state, dfd, path, name, child, node, have.get(name), dirty, force)
        finally:
            os.close(dfd)

    def _sync_entry(self, state: Any, dfd: int, parent: bytes, name: bytes, ino: int, node: Node,
                    st: os.stat_result | None, dirty: set[int], force: bool) -> None:
        path = join(parent, name)
        self.at = path
        kind = stat.S_IFMT(node.mode)
        if kind not in KINDS:
            raise UserError(f"the session's store gives it the unknown file type {node.mode:#o}")
        if st is not None and stat.S_IFMT(st.st_mode) != kind:
            if self._refused(path, node):
                return  # the repo's entry stays
            self._remove(dfd, path, name, st)
            self.at = path
            st = None
        if kind == stat.S_IFDIR:
            self._sync_subdir(state, dfd, path, name, ino, node, st, dirty, force)
        elif kind == stat.S_IFLNK:
            self._sync_symlink(state, dfd, path, name, ino, node, st)
        elif kind in SPECIAL:
            self._sync_special(dfd, path, name, node, st)
        elif ino in self.written:  # another name of a file already written: a hard link
            self._link(dfd, path, name, ino, node, st)
        else:
            self._sync_file(state, dfd, path, name, ino, node, st)

    def _sync_subdir(self, state: Any, dfd: int, path: bytes, name: bytes, ino: int, node: Node,
                     st: os.stat_result | None, dirty: set[int], force: bool) -> None:
        if st is None:
            if self._refused(path, node):
                return  # (and all it holds)
            os.mkdir(name, 0o700, dir_fd=dfd)
            self._wrote(path)
        if (st is None or stat.S_IMODE(st.st_mode) != self._mode(node, st)
                or not self._owned(st, node)):
            if st is not None:
                self._pin(path, recursive=False)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                real = os.fstat(fd)
                self._own(fd, node, real, st is None)  # (before the mode: a chown clears setgid)
                os.fchmod(fd, self._given_mode(path, node, st))
            finally:
                os.close(fd)
        if st is None or force or ino in dirty or node.origin != path or self._pinned(path):
            self._sync_dir(state, ino, path, dirty, force=st is None or force or node.origin != path)

    def _sync_symlink(self, state: Any, dfd: int, path: bytes, name: bytes, ino: int, node: Node,
                      st: os.stat_result | None) -> None:
        target = self.ov.readlink(state, ino, node)
        if st is not None and os.readlink(name, dir_fd=dfd) == target:
            return
        own = (lambda fd: fchown_fd(fd, node.uid, node.gid)) if self.root else None
        self._replace(dfd, path, name, node, st, lambda t: os.symlink(target, t, dir_fd=dfd), own)

    def _sync_special(self, dfd: int, path: bytes, name: bytes, node: Node,
                      st: os.stat_result | None) -> None:
        """A device node, fifo or socket: only with special (else refused and reported)."""
        kind = stat.S_IFMT(node.mode)
        if st is not None and (kind not in (stat.S_IFCHR, stat.S_IFBLK) or st.st_rdev == node.rdev):
            return  # the repo has it already

        def fix(fd: int) -> None:
            if self.root:
                fchown_fd(fd, node.uid, node.gid)
            # through the fd (its magic link names this very inode, checked before)
            os.chmod(f"/proc/self/fd/{fd}", self._given_mode(path, node, None))
        self._replace(dfd, path, name, node, st,
                      lambda t: os.mknod(t, kind | 0o600, node.rdev, dir_fd=dfd), fix)

    def _replace(self, dfd: int, path: bytes, name: bytes, node: Node, st: os.stat_result | None,
                 make: Callable[[bytes], Any], fix: Callable[[int], None] | None) -> None:
        """Write a symlink or special file at path (unless refused): made by make(temp) under
        a temp name of ours, checked through an O_PATH fd to be what was made (node's type)
        and given to fix(fd) (owner, mode), then renamed over name; the temp never stays."""
        if self._refused(path, node):
            return
        if st is not None:
            self._remove(dfd, path, name, st)
            self.at = path
        tmp, _ = self._temp(make)
        try:
            if fix is not None:
                fd = os.open(tmp, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    if stat.S_IFMT(os.fstat(fd).st_mode) != stat.S_IFMT(node.mode):
                        raise FsError(errno.EBUSY, "replaced while apply ran")
                    fix(fd)
                finally:
                    os.close(fd)
            self._place(dfd, tmp, name)
        except BaseException:
            self._drop_temp(dfd, tmp)
            raise
        self._wrote(path)

    def _link(self, dfd: int, path: bytes, name: bytes, ino: int, node: Node,
              st: os.stat_result | None) -> None:
        """path becomes another name of the file written for ino: linked from an fd of that
        file, reopened without following a symlink and checked to be that very file."""
        first, dev, inum = self.written[ino]
        if st is not None and (st.st_dev, st.st_ino) == (dev, inum):
            return
        src = openat2_beneath(self.fd, first, _O_PATH)
        try:
            real = os.fstat(src)
            if (real.st_dev, real.st_ino) != (dev, inum) or not stat.S_ISREG(real.st_mode):
                raise UserError(f"{quote_path(first)} was replaced in the repo while apply ran: "
                                "no name is linked to it")
            if st is not None:
                self._pin(path, recursive=False)
            # linkat(AT_SYMLINK_FOLLOW) of the fd's magic link: the file itself, by no path
            tmp, _ = self._temp(lambda t: os.link(f"/proc/self/fd/{src}", t, dst_dir_fd=dfd,
                                                  follow_symlinks=True))
        finally:
            os.close(src)
        self._place(dfd, tmp, name)
        self._wrote(path)

    def _sync_file(self, state: Any, dfd: int, path: bytes, name: bytes, ino: int, node: Node,
                   st: os.stat_result | None) -> None:
        if st is not None:
            if not self.ov.has_record(state, ino) and node.origin == path and not self._pinned(path):
                self.written[ino] = (path, st.st_dev, st.st_ino)
                return  # untouched original lower file at its own place
            if (st.st_size == node.size and stat.S_IMODE(st.st_mode) == self._mode(node, st)
                    and self._owned(st, node)):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    same = stat.S_ISREG(os.fstat(fd).st_mode) and self._same_content(fd, state, ino, node)
                finally:
                    os.close(fd)
                if same:
                    self.written[ino] = (path, st.st_dev, st.st_ino)
                    return
        if self._refused(path, node):
            return
        if st is not None:
            self._pin(path, recursive=False)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        tmp, fd = self._temp(lambda t: os.open(t, flags, 0o600, dir_fd=dfd))
        try:
            try:
                self._own(fd, node, os.fstat(fd), True)  # (before the mode: a chown clears setuid)
                self._write_content(fd, state, ino, node)
                os.fchmod(fd, self._given_mode(path, node, st))
                os.utime(fd, ns=(node.atime_ns, node.mtime_ns))
                os.fsync(fd)
                real = os.fstat(fd)
            finally:
                os.close(fd)
            self._place(dfd, tmp, name)
        except BaseException:
            self._drop_temp(dfd, tmp)  # (ENOSPC, EIO, a stop: no temp file is left)
            raise
        self.written[ino] = (path, real.st_dev, real.st_ino)
        self._wrote(path)

    # -- file content, streamed ---------------------------------------------------

    def _pieces(self, state: Any, ino: int, node: Node) -> Iterator[tuple[int, bytes]]:
        """The file's content in CHUNK pieces: a file of any size is never held whole."""
        for off in range(0, node.size, CHUNK):
            yield off, self.ov.read(state, ino, node, off, CHUNK)

    def _same_content(self, fd: int, state: Any, ino: int, node: Node) -> bool:
        for off, piece in self._pieces(state, ino, node):
            if os.pread(fd, len(piece), off) != piece:
                return False
        return os.pread(fd, 1, node.size) == b""

    def _write_content(self, fd: int, state: Any, ino: int, node: Node) -> None:
        """Write into a new empty file; zero pieces stay holes, so a sparse file stays sparse."""
        os.ftruncate(fd, node.size)  # (first: a size the file system cannot hold fails now)
        for off, piece in self._pieces(state, ino, node):
            if piece != _ZEROS[:len(piece)]:
                pwrite_all(fd, piece, off)


CHUNK = 1 << 20
_ZEROS = bytes(CHUNK)


def apply_live(ctx: Context, force: bool = False, special: bool = False) -> ApplyStats:
    """Write the live state into the repo. special: device nodes, fifos and sockets too."""
    seq = ctx.store.read(lambda r: r.meta_int(SEQ_KEY, 1))
    stats = Applier(ctx, special).apply(_LiveState(ctx), [], [], force)
    _applied_at(ctx.store, seq)
    return stats


def _applied_at(store: Store, seq: int) -> None:
    """The repo holds the state before journal position seq (sessions shows what came after)."""
    store.write(lambda w: w.set_meta_int(APPLIED_KEY, seq))


class _LiveState:
    """The live tables, read one short transaction at a time (apply may run long)."""

    def __init__(self, ctx: Context) -> None:
        self.store = ctx.store

    def get(self, table: bytes, key: bytes) -> bytes | None:
        return self.store.read(lambda r: r.get(table, key))

    def prefix(self, table: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return iter(self.store.read(lambda r: list(r.prefix(table, prefix))))

    def block(self, digest: bytes) -> bytes:
        return self.store.read(lambda r: r.block(digest))


def apply_checkpoint(ctx: Context, ref: Ref, force: bool = False, special: bool = False
                     ) -> ApplyStats:
    from overlayckpt.core.timeline import Timeline
    tl = Timeline(ctx)
    r = ctx.store.begin_read()
    try:
        ck = tl.get(r, ref)
        state = tl.state(r, ck)
        since = list(history.changed_since(r, ck.seq))  # what the live records no longer show
        extra_nodes = sorted({from_u64(k[:8]) for code, k in since if code == T_NODES})
        extra_dirs = sorted({from_u64(k[:8]) for code, k in since if code == T_DIRENTS})
        stats = Applier(ctx, special).apply(state, extra_nodes, extra_dirs, force)
    finally:
        ctx.store.end_read(r)
    _applied_at(ctx.store, ck.seq)
    return stats
