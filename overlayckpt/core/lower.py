"""Read-only access to the lower directory (the repo) through one directory fd.

The fd is opened before the overlay is mounted, so an in-place mount can still
reach the hidden repo. Every path is resolved with openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS): nothing here ever follows a symlink or leaves the repo.
Paths are bytes relative to the repo root; b"" is the root itself.

`Lower` also consults the store's pinned table: when `apply` is about to change
a lower entry, its original content is pinned into the store first, and from
then on this module answers for that path from the pin, so checkpoints that
still refer to the original lower entry keep seeing exactly what it was.
"""
from __future__ import annotations

import ctypes
import errno
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from overlayckpt.errors import FsError

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437  # x86_64 and aarch64 share it
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
# lower stat results kept in memory, those in listings included: at most this many (a
# walk of 200,000 files must not keep 200,000: the kernel keeps what it looked up)
CACHE_ENTRIES = 1 << 14
# a directory this size or smaller is listed at the first name looked up in it
SMALL_DIR_BYTES = 4096
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2_beneath(dirfd: int, path: bytes, flags: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0, _RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, path or b".", ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise FsError(err, f"{path!r}: {os.strerror(err)}")
    return fd


def open_noatime(dirfd: int, path: bytes, flags: int) -> int:
    """openat2_beneath, reading without moving the entry's atime where we may: what the
    mount shows of a repo entry nothing changed is its lstat (fuse/csrc/lowerdirs.c
    lists it afresh), so reading it through the overlay must leave it as it is."""
    try:
        return openat2_beneath(dirfd, path, flags | os.O_NOATIME)
    except FsError as e:
        if e.errno != errno.EPERM:  # (not the owner's: its atime moves, as natively)
            raise
    return openat2_beneath(dirfd, path, flags)


def lstat_beneath(dirfd: int, path: bytes) -> os.stat_result | None:
    """lstat of the entry at path below dirfd, never leaving it; None if there is none."""
    parent, _, name = path.rpartition(b"/")
    try:
        fd = openat2_beneath(dirfd, parent, os.O_RDONLY | os.O_DIRECTORY)
    except FsError:
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)


def split(path: bytes) -> tuple[bytes, bytes]:
    head, _, tail = path.rpartition(b"/")
    return head, tail


def join(parent: bytes, name: bytes) -> bytes:
    return parent + b"/" + name if parent else name


# Pins: path -> (stat-like tuple, data) provided by the store (see apply.py).
PinLookup = Callable[[bytes], "Pin | None"]


class PinStat:
    """The attributes of a pinned or cached entry, shaped like the os.stat_result fields we
    use (in less than half of an os.stat_result's 640 bytes)."""

    __slots__ = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns",
                 "st_mtime_ns", "st_ctime_ns", "st_rdev")

    def __init__(self, st_mode: int, st_ino: int, st_nlink: int, st_uid: int, st_gid: int,
                 st_size: int, st_atime_ns: int, st_mtime_ns: int, st_ctime_ns: int,
                 st_rdev: int) -> None:
        # (one by one: a listing makes one per entry, and a loop of setattr costs 3x)
        self.st_mode = st_mode
        self.st_ino = st_ino
        self.st_nlink = st_nlink
        self.st_uid = st_uid
        self.st_gid = st_gid
        self.st_size = st_size
        self.st_atime_ns = st_atime_ns
        self.st_mtime_ns = st_mtime_ns
        self.st_ctime_ns = st_ctime_ns
        self.st_rdev = st_rdev

    @classmethod
    def fields(cls, st: os.stat_result | PinStat) -> list[int]:
        return [getattr(st, name) for name in cls.__slots__]


Stat = os.stat_result | PinStat  # what Lower answers a stat with


def slim(st: os.stat_result) -> PinStat:
    return PinStat(st.st_mode, st.st_ino, st.st_nlink, st.st_uid, st.st_gid, st.st_size,
                   st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, st.st_rdev)


class Pin:
    """The original state of one lower entry, kept in the store."""

    __slots__ = ("st", "entries", "read", "target", "xattrs")

    def __init__(self, st: os.stat_result | PinStat, entries: set[bytes] | None,
                 read: Callable[[int, int], bytes] | None, target: bytes | None,
                 xattrs: dict[bytes, bytes]) -> None:
        self.st, self.entries, self.read, self.target, self.xattrs = st, entries, read, target, xattrs


class Lower:
    """The repo as it was when the session first saw it."""

    def __init__(self, root: str, pins: PinLookup | None = None,
                 warm: Callable[[int], bool] | None = None, fd: int | None = None) -> None:
        """fd: the repo's directory, opened already (a mount in place hides its path)."""
        self.root_path = os.path.abspath(root)
        try:
            self.fd = fd if fd is not None else os.open(
                self.root_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise FsError(e.errno or errno.EIO, f"cannot open repo {root}: {e.strerror}") from None
        self.pins = pins
        self._dirfds: OrderedDict[bytes, int] = OrderedDict()
        # The repo does not change while mounted (only apply writes it, and it calls
        # forget_cached), so what it answered once stays true.
        self._xattrs: dict[bytes, dict[bytes, bytes]] = {}
        self._stats: dict[bytes, Any] = {}
        self._listings: OrderedDict[bytes, list[tuple[bytes, Any]]] = OrderedDict()
        self._listed = 0  # entries in _listings
        self._huge: set[bytes] = set()  # directories too big to keep listed
        self._once: set[bytes] = set()  # directories one name was looked up in, not listed
        # called with the repo's fd before each read of it until it answers True, once it
        # ran (the daemon reads the repo's metadata ahead from there: fastpath.warm_tree,
        # which runs only once the mount is served by the C library)
        self.warm = warm
        self.listings_made = 0  # directories listed from the disk and kept (not huge) so far
        # called when the cached answers go (the FUSE adapter drops what C answers from them)
        self.on_forget: Callable[[], None] | None = None

    def close(self) -> None:
        self.forget_cached()
        os.close(self.fd)

    def forget_cached(self) -> None:
        """Drop cached fds and answers (after apply changed the repo)."""
        for fd in self._dirfds.values():
            os.close(fd)
        self._dirfds.clear()
        self._xattrs.clear()
        self._stats.clear()
        self._listings.clear()
        self._listed = 0
        self._huge.clear()
        self._once.clear()
        if self.on_forget is not None:
            self.on_forget()

    def _dirfd(self, path: bytes) -> int:
        """A cached fd of a lower directory (the repo is read-only while mounted)."""
        if not path:
            return self.fd
        fd = self._dirfds.get(path)
        if fd is not None:
            self._dirfds.move_to_end(path)
            return fd
        fd = openat2_beneath(self.fd, path, os.O_RDONLY | os.O_DIRECTORY)
        self._dirfds[path] = fd
        if len(self._dirfds) > 512:
            os.close(self._dirfds.popitem(last=False)[1])
        return fd

    def _pin(self, path: bytes) -> Pin | None:
        return self.pins(path) if self.pins is not None else None

    def stat(self, path: bytes, siblings: bool = True) -> os.stat_result | PinStat:
        """lstat of a repo path; the second name in a directory lists (and stats) all of
        it, unless siblings is False (a lookup that will not be followed by its neighbours)."""
        pin = self._pin(path)
        if pin is not None:
            return pin.st
        if not path:
            return os.fstat(self.fd)
        cached = self._stats.get(path)
        if cached is not None:
            return cached
        parent, name = split(path)
        ppin = self._pin(parent)
        if ppin is not None and ppin.entries is not None and name not in ppin.entries:
            raise FsError(errno.ENOENT)  # added to the repo by an apply, not original
        if siblings and ppin is None and parent not in self._listings and parent not in self._huge \
                and (self.is_small(parent) or not self._first_in(parent)):
            # the second name looked up in a directory, or the first in a small one: list
            # it, which stats all its entries in one pass. A tree walk (git status) looks
            # up the siblings next, and on a cold cache one pass reads the inodes in
            # order, not one by one; a lone name in a big directory (an edit here and
            # there) costs one stat, not the directory's. A small directory listed at
            # once spares the walk a second request for it, and its READDIRPLUS one
            # to Python: in a generated monorepo half the directories hold one name.
            try:
                self.listdir(parent)
            except (FsError, OSError):
                pass  # the stat below gives the error
            cached = self._stats.get(path)
            if cached is not None:
                return cached
        self._start_warm()
        try:
            st = slim(os.stat(name, dir_fd=self._dirfd(parent), follow_symlinks=False))
        except OSError as e:
            raise FsError(e.errno or errno.EIO) from None
        self._remember_stat(path, st)
        return st

    def _start_warm(self) -> None:
        """Before the repo's metadata is first read: have it read ahead (warm)."""
        if self.warm is not None and self.warm(self.fd):
            self.warm = None

    def is_small(self, path: bytes) -> bool:
        """Whether directory path is known to fit one block of the repo's filesystem
        (ext4's size of a directory of up to some hundred names; a few names' worth on
        tmpfs, btrfs or xfs): listing it costs about what a stat does."""
        st = self._stats.get(path)
        return st is not None and st.st_size <= SMALL_DIR_BYTES

    def _first_in(self, parent: bytes) -> bool:
        """Whether this is the first name looked up in parent (then noted)."""
        if parent in self._once:
            return False
        if len(self._once) >= CACHE_ENTRIES:
            self._once.clear()
        self._once.add(parent)
        return True

    def _make_room(self, entries: int) -> None:
        # the oldest listings go first, with the stats of their entries: all at once
        # would make the directories in use listed again, name after name
        while self._listings and len(self._stats) + self._listed + entries > CACHE_ENTRIES:
            path, listing = self._listings.popitem(last=False)
            self._listed -= len(listing)
            prefix = path + b"/" if path else b""
            for name, _ in listing:
                self._stats.pop(prefix + name, None)
        if len(self._stats) + self._listed + entries > CACHE_ENTRIES:
            self._stats.clear()

    def _remember_stat(self, path: bytes, st: Any) -> None:
        self._make_room(1)
        self._stats[path] = st

    def listdir(self, path: bytes) -> list[tuple[bytes, Any]]:
        cached = self._listings.get(path)
        if cached is not None:
            self._listings.move_to_end(path)
        else:
            cached = self._listdir(path)
            if len(cached) > CACHE_ENTRIES // 4:
                # not kept: a lookup in it stats its one name, never lists it all again
                self._huge.add(path)
                return cached
            self.listings_made += 1
            self._make_room(2 * len(cached))
            self._listings[path] = cached
            self._listed += len(cached)
            stats, prefix = self._stats, path + b"/" if path else b""
            for name, st in cached:  # what stat(child) would answer (counted in _listed)
                stats[prefix + name] = st
        return cached

    def _listdir(self, path: bytes) -> list[tuple[bytes, Stat]]:
        pin = self._pin(path)
        if pin is not None:
            out = []
            for name in sorted(pin.entries or ()):
                try:
                    out.append((name, self.stat(join(path, name))))
                except FsError:
                    pass
            return out
        self._start_warm()
        fd = open_noatime(self.fd, path, os.O_RDONLY | os.O_DIRECTORY)
        pins, prefix, fsencode = self.pins, path + b"/" if path else b"", os.fsencode
        try:
            out = []
            with os.scandir(fd) as it:
                for entry in it:
                    name = fsencode(entry.name)
                    pin = pins(prefix + name) if pins is not None else None
                    if pin is not None:
                        out.append((name, pin.st))
                        continue
                    try:
                        st = slim(entry.stat(follow_symlinks=False))
                    except OSError:
                        continue  # vanished behind our back
                    out.append((name, st))
            return out
        finally:
            os.close(fd)

    def open_file(self, path: bytes) -> LowerFile:
        pin = self._pin(path)
        if pin is not None and pin.read is not None:
            return LowerFile(-1, pin.read)
        # (O_NONBLOCK: a repo file swapped for a fifo behind our back is not waited on)
        return LowerFile(open_noatime(self.fd, path, os.O_RDONLY | os.O_NONBLOCK), None)

    def readlink(self, path: bytes) -> bytes:
        pin = self._pin(path)
        if pin is not None:
            return pin.target or b""
        parent, name = split(path)
        try:
            return os.readlink(name, dir_fd=self._dirfd(parent))
        except OSError as e:
            raise FsError(e.errno or errno.EIO) from None

    def xattrs(self, path: bytes) -> dict[bytes, bytes]:
        pin = self._pin(path)
        if pin is not None:
            return dict(pin.xattrs)
        cached = self._xattrs.get(path)
        if cached is None:
            # the kernel asks for security.capability before every write: keep answers
            cached = self._read_xattrs(path)
            if len(self._xattrs) > 4096:
                self._xattrs.clear()
            self._xattrs[path] = cached
        return dict(cached)

    def _read_xattrs(self, path: bytes) -> dict[bytes, bytes]:
        if not path:
            proc = f"/proc/self/fd/{self.fd}"
        else:
            parent, name = split(path)
            proc = f"/proc/self/fd/{self._dirfd(parent)}/{os.fsdecode(name)}"
        out: dict[bytes, bytes] = {}
        try:
            for n in os.listxattr(proc, follow_symlinks=False):
                try:
                    out[os.fsencode(n)] = os.getxattr(proc, n, follow_symlinks=False)
                except OSError:
                    pass
        except OSError as e:
            if e.errno not in (errno.ENOTSUP, errno.EPERM):
                raise FsError(e.errno or errno.EIO) from None
        return out


class LowerFile:
    """An open lower file, or a pinned one served from the store."""

    __slots__ = ("fd", "_read")

    def __init__(self, fd: int, read: Callable[[int, int], bytes] | None) -> None:
        self.fd, self._read = fd, read

    def pread(self, size: int, off: int) -> bytes:
        if self._read is not None:
            return self._read(size, off)
        try:
            return os.pread(self.fd, size, off)
        except OSError as e:  # (a repo file changed behind our back: a fifo now, say)
            raise FsError(e.errno or errno.EIO, f"reading the repo's file: {e.strerror}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

