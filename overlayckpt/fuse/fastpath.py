"""Load the fast path library (C, built from fuse/csrc/) that answers the FUSE requests
needing no Python (opens, their releases, the security.capability lookup before every
write), acknowledges writes before Python stores them (write-behind) and asks the
kernel to keep pages and directory listings across opens; and Python's bindings to it.

It must be loaded before pyfuse3 is imported, because it stands in for libfuse's
fuse_session_new, which pyfuse3 binds when it is loaded. Without it (not built,
or pyfuse3 already imported) the mount works as before, only slower.
"""
from __future__ import annotations

import ctypes
import errno
import inspect
import logging
import os
import struct
import sys
from typing import TYPE_CHECKING, Any, TypedDict

from overlayckpt.core.latency import BUCKETS, Histogram, RequestLatency
from overlayckpt.records import CONTROL_INO_BASE, FIRST_UPPER_INO, LOWER_INO_ONE

if TYPE_CHECKING:  # (only for the type: this module must load before pyfuse3 is imported)
    from pyfuse3 import EntryAttributes

log = logging.getLogger(__name__)

# How long pyfuse3's loop watches for the next request in C before it waits in trio.
SPIN_NS = 30_000
YIELD_EVERY = 64
# Write-behind (see fuse/csrc/behind.c): how many bytes of acknowledged writes may wait for
# Python, and the free space on the store's file system below which none may: far
# more than those writes can take, so that a full disk fails the write itself.
MAX_BEHIND = 8 << 20
MIN_FREE = 64 << 20

_lib: ctypes.CDLL | None = None
_request_pid: ctypes.c_int | None = None
_request_seq: ctypes.c_uint64 | None = None
_request_next: ctypes.c_uint64 | None = None
_request_arrival: ctypes.c_uint64 | None = None


class _Hist(ctypes.Structure):
    """fastpath.h's struct hist."""
    _fields_ = [("sum_ns", ctypes.c_uint64), ("max_ns", ctypes.c_uint64),
                ("errors", ctypes.c_uint64), ("buckets", ctypes.c_uint64 * BUCKETS)]


# fastpath.h's STATS_WRITE, STATS_WRITE_EARLY, STATS_READ, STATS_FSYNC, STATS_READ_C: the
# histograms of stats.c (read_c: the reads C answered from the repo, lowerdirs.c)
STATS_KINDS = ("write", "write_early", "read", "fsync", "read_c")


LIBRARY = "libfastpath.so"  # setup.py builds it beside this module (no Python extension)


def _library_path() -> str | None:
    """The built library, beside this module."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY)
    return path if os.path.exists(path) else None


def preload() -> None:
    """Load the library ahead of pyfuse3, in the daemon process only."""
    global _lib
    if _lib is not None:
        return
    if "pyfuse3" in sys.modules:
        log.warning("pyfuse3 was imported before the fast path library: directory "
                    "listings will not be cached by the kernel")
        return
    path = _library_path()
    if path is None:
        log.warning("fast path library not built (run 'make install'): directory "
                    "listings will not be cached by the kernel")
        return
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as e:
        log.warning("fast path library %s not loaded: %s", path, e)
        return
    lib.fastpath_configure.argtypes = [ctypes.c_uint64]
    lib.fastpath_configure(CONTROL_INO_BASE)
    lib.fastpath_write_behind.argtypes = [ctypes.c_int] + [ctypes.c_uint64] * 5
    lib.fastpath_warm_tree.argtypes = [ctypes.c_int]
    lib.fastpath_wait_queued.argtypes = [ctypes.c_long]
    lib.fastpath_wait_queued.restype = ctypes.c_int
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    lib.fastpath_publish_dir_attrs.argtypes = [u64] + [u32] * 5 + [u64, u64, u32] + [u64, u32] * 3 + [u64]
    lib.fastpath_publish_dir_attrs.restype = None
    lib.fastpath_drop_dir_attrs.restype = None
    lib.fastpath_names_clock.restype = u64
    lib.fastpath_names_changed.restype = None
    lib.fastpath_names_touch.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.fastpath_names_touch.restype = None
    lib.fastpath_publish_attrs.argtypes = [u64, ctypes.c_char_p, ctypes.c_size_t]
    lib.fastpath_publish_attrs.restype = ctypes.c_size_t
    lib.fastpath_publish_listing.argtypes = [u64, u64, ctypes.c_char_p, ctypes.c_size_t]
    lib.fastpath_publish_listing.restype = ctypes.c_int
    lib.fastpath_listing_change.argtypes = [u64, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                            ctypes.c_size_t]
    lib.fastpath_listing_change.restype = ctypes.c_int
    lib.fastpath_serve_promptly.restype = ctypes.c_int
    lib.fastpath_lower_start.argtypes = [ctypes.c_int, u32, u64, u64, u64, u32]
    lib.fastpath_lower_start.restype = None
    lib.fastpath_lower_stop.restype = None
    lib.fastpath_lower_hint.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.fastpath_lower_hint.restype = None
    lib.fastpath_lower_entry.argtypes = [u64, ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_int),
                                         ctypes.c_char_p, ctypes.c_size_t]
    lib.fastpath_lower_entry.restype = ctypes.c_int
    lib.fastpath_lower_known.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.fastpath_lower_known.restype = ctypes.c_size_t
    lib.fastpath_hist_bucket.argtypes = [ctypes.c_uint64]
    lib.fastpath_notify_inc_epoch.argtypes = []
    lib.fastpath_notify_inc_epoch.restype = ctypes.c_int
    lib.fastpath_notify_inval_entries.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p,
                                                 ctypes.POINTER(ctypes.c_uint32), ctypes.c_size_t]
    lib.fastpath_notify_inval_entries.restype = ctypes.c_long
    lib.fastpath_notify_inval_inodes.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                                               ctypes.c_int]
    lib.fastpath_notify_inval_inodes.restype = ctypes.c_long
    lib.fastpath_hist_bucket.restype = ctypes.c_uint
    global _request_pid, _request_seq, _request_next, _request_arrival
    _request_pid = ctypes.c_int.in_dll(lib, "fastpath_request_pid")
    _request_seq = ctypes.c_uint64.in_dll(lib, "fastpath_request_seq")
    _request_next = ctypes.c_uint64.in_dll(lib, "fastpath_request_next")
    _request_arrival = ctypes.c_uint64.in_dll(lib, "fastpath_request_arrival")
    _lib = lib


def speed_up_loop(pyfuse3: Any) -> None:  # (the module: a private function of it is replaced)
    """Have pyfuse3's loop take the next request without a trip through trio.

    pyfuse3 waits for each request in trio (a lock, epoll, a reschedule), which
    costs more than most of our handlers. Its loop looks the waiting function up
    by name at every request, so we put one in front that first watches the queue
    in C, without the GIL, for SPIN_NS (a client's next request often follows our
    reply at once), and otherwise waits in trio as before; so does every
    YIELD_EVERY-th request, so that timers, signals and threads get their turn.
    """
    trio_wait = getattr(pyfuse3, "_wait_fuse_readable", None)
    # a private function of pyfuse3 3.x's loop (3.0 to 3.5 at least): leave any other alone
    if _lib is None or not active() or not inspect.iscoroutinefunction(trio_wait) \
            or not pyfuse3.__version__.startswith("3."):
        log.info("pyfuse3's loop left as it is")
        return
    wait_queued = _lib.fastpath_wait_queued
    streak = 0
    # after a watch that found nothing, every task (pyfuse3 runs several) waits in
    # trio until a request comes that way, so that no other one holds trio up again
    idle = False

    async def wait_fuse_readable() -> bool:
        nonlocal streak, idle
        if not idle and streak < YIELD_EVERY:
            if wait_queued(SPIN_NS):
                streak += 1
                return True
            idle = True
        streak = 0
        readable = await trio_wait()
        idle = False
        return readable

    pyfuse3._wait_fuse_readable = wait_fuse_readable


def serve_promptly() -> bool:
    """Give the calling thread (the one that runs pyfuse3's loop) the scheduler's
    shortest slice, as C's reader thread has (queue.c): it preempts other work on the
    host when a request wakes it. Threads it starts from now on get the default."""
    return _lib is not None and _lib.fastpath_serve_promptly() == 0


def requests_waiting() -> bool:
    """Whether requests are queued for pyfuse3 (False without the library)."""
    return _lib is not None and bool(_lib.fastpath_wait_queued(0))


def loaded() -> bool:
    """Whether the library is loaded (in the daemon, before pyfuse3)."""
    return _lib is not None


def active() -> bool:
    """Whether the mounted session's handlers go through the library."""
    return _lib is not None and _lib.fastpath_sessions_wrapped() > 0


def request_pid() -> int:
    """The process of the write request being handled (0 for page writeback)."""
    return _request_pid.value if _request_pid is not None else 0


def request_logged() -> tuple[int, int] | None:
    """For a write request acknowledged already: its record in the write-behind log
    and where the next record starts (writebehind.py); None for any other write."""
    if _request_seq is None or not _request_seq.value:
        return None
    return _request_seq.value, _request_next.value  # type: ignore[union-attr]  # bound together with _request_seq


def request_arrival() -> int:
    """When the write request being handled arrived (time.monotonic_ns(); 0: unknown)."""
    return _request_arrival.value if _request_arrival is not None else 0


def request_latency() -> RequestLatency | None:
    """The reply latency of the reads, writes and fsyncs C has timed (stats.c), by kind (STATS_KINDS),
    and "untimed": how many it could not time; None when the library serves no session."""
    if _lib is None or not active():
        return None
    raw = (_Hist * len(STATS_KINDS)).in_dll(_lib, "fastpath_stats")
    write, write_early, read, fsync, read_c = (Histogram(list(h.buckets), h.sum_ns, h.max_ns, h.errors)
                                               for h in raw)  # (in STATS_KINDS order)
    return {"write": write, "write_early": write_early, "read": read, "fsync": fsync, "read_c": read_c,
            "untimed": ctypes.c_uint64.in_dll(_lib, "fastpath_stats_untimed").value}


def write_behind(log_fd: int, size: int, seq: int, offset: int) -> None:
    """Let C acknowledge writes before Python stores them, logging each to log_fd
    (in the store, mapped; size bytes) from record number seq at offset on."""
    if _lib is None or not active():
        return
    err = _lib.fastpath_write_behind(log_fd, size, seq, offset, MAX_BEHIND, MIN_FREE)
    if err:
        log.warning("write-behind left off: %s", os.strerror(-err))


def warm_tree(dir_fd: int) -> bool:
    """Have C threads read the metadata of the tree below dir_fd ahead, once: the
    daemon's first lookups on a cold cache then find the repo's inodes read. False
    when it did not start (the mount is not served by the library yet, or never)."""
    if _lib is not None and active():
        _lib.fastpath_warm_tree(dir_fd)
        return True
    return False


class ReadAhead(TypedDict):
    dirs: int  # directories listed so far
    done: bool  # whether the walk has ended


def read_ahead() -> ReadAhead | None:
    """How far warm_tree got: directories listed, and whether the walk has ended."""
    if _lib is None or not active():
        return None
    return {"dirs": ctypes.c_uint64.in_dll(_lib, "fastpath_warmed_dirs").value,
            "done": bool(ctypes.c_int.in_dll(_lib, "fastpath_warm_done").value)}


def publish_dir_attrs(a: EntryAttributes) -> None:
    """Have C answer the directory's next GETATTRs with a (pyfuse3.EntryAttributes, what
    Python's getattr answers now) until a request that may change anything comes:
    called by a request that changed the directory, before its reply (dirattrs.c)."""
    if _lib is None:
        return
    atime, atime_ns = divmod(a.st_atime_ns, 10**9)  # (unsigned in pyfuse3, split alike)
    mtime, mtime_ns = divmod(a.st_mtime_ns, 10**9)
    ctime, ctime_ns = divmod(a.st_ctime_ns, 10**9)
    _lib.fastpath_publish_dir_attrs(a.st_ino, a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_rdev,
                                  a.st_size, a.st_blocks, a.st_blksize, atime, atime_ns, mtime,
                                  mtime_ns, ctime, ctime_ns,
                                  int(a.attr_timeout))


def drop_dir_attrs() -> None:
    """Forget what publish_dir_attrs published: the daemon changed the tree itself."""
    if _lib is not None:
        _lib.fastpath_drop_dir_attrs()


# A listing goes to names.c as, for each entry, u32 name length, the name, then
# linux/fuse.h's struct fuse_entry_out (its size is checked by a test): nodeid,
# generation, entry_valid, attr_valid, their nsecs, then struct fuse_attr (ino, size,
# blocks, atime, mtime, ctime, their nsecs, mode, nlink, uid, gid, rdev, blksize, flags).
_LEN = struct.Struct("<I")
ENTRY_OUT = struct.Struct("<QQQQII6Q10I")
# Its times' seconds are the kernel's signed 64 bits in unsigned fields, as libfuse
# casts a time_t: a time before 1970 goes as its two's complement (& U64).
U64 = (1 << 64) - 1
# A bigger listing is not published: packing it would cost its readdir more than C's
# answers save (names.c takes at most a quarter of its 32 MiB in one listing anyway).
PUBLISH_MOST = 16384


def names_clock() -> int:
    """The clock names.c stamps published listings with: read it before reading what
    to publish (0 without the library)."""
    return _lib.fastpath_names_clock() if _lib is not None else 0


def names_changed() -> None:
    """Anything may have changed: drop every published listing (the repo's cached
    answers went, or pins were made), and list no repo directory in C any more."""
    global _lower_on
    if _lib is not None:
        _lower_on = False
        _lib.fastpath_lower_stop()
        _lib.fastpath_names_changed()


# Repo directories C lists itself (lowerdirs.c): at most this many names (lower.py keeps
# no bigger listing, and the reader thread would stall on it)
LOWER_MOST = 4096
_HINT = struct.Struct("=QQBH")
_lower_on = False
_KNOWN = struct.Struct("=QQBB")


def lower_start(fd: int, block_size: int, timeout: int) -> None:
    """Have C list the repo directories (read through fd) that neither it nor any of
    their entries was ever stamped from now on (lowerdirs.c): stamp (names_touch) the
    repo inodes the store already has records of next. Only while the repo has no pins."""
    global _lower_on
    if _lib is not None:
        _lib.fastpath_lower_start(fd, block_size, timeout, FIRST_UPPER_INO, LOWER_INO_ONE, LOWER_MOST)
        _lower_on = True


def lower_on() -> bool:
    """Whether C lists repo directories (lower_start, until names_changed)."""
    return _lower_on


def lower_hint(dirs: list[tuple[int, int, bytes, bool]]) -> None:
    """Where these directories (inode, parent inode, path in the repo, whether at most a
    block) are in the repo, for C to list them from there (lowerdirs.c checks)."""
    if _lib is not None and dirs:
        pack = _HINT.pack
        buf = b"".join([pack(ino, parent, small, len(path)) + path for ino, parent, path, small in dirs
                        if 0 < len(path) < 65536])
        _lib.fastpath_lower_hint(buf, len(buf))


def lower_entry(ino: int) -> tuple[int, bytes, bool] | None:
    """Where inode ino is in the repo, if only C listed it: (directory inode, name, whether
    a directory)."""
    if _lib is None:
        return None
    parent, is_dir, name = ctypes.c_uint64(), ctypes.c_int(), ctypes.create_string_buffer(256)
    n = _lib.fastpath_lower_entry(ino, ctypes.byref(parent), ctypes.byref(is_dir), name, 256)
    return None if n < 0 else (parent.value, name.raw[:n], bool(is_dir.value))


def lower_known() -> list[tuple[int, int, bytes, bool]]:
    """Every entry C listed from the repo: (inode, directory inode, name, whether a
    directory)."""
    if _lib is None:
        return []
    need = 0
    while True:
        buf = ctypes.create_string_buffer(need or 1)
        got = int(_lib.fastpath_lower_known(buf, need))
        if got <= need:
            break
        need = got
    raw, at, out, unpack = buf.raw[:got], 0, [], _KNOWN.unpack_from
    while at < got:
        ino, parent, is_dir, n = unpack(raw, at)
        out.append((ino, parent, raw[at + 18:at + 18 + n], bool(is_dir)))
        at += 18 + n
    return out


def counter(name: str) -> int:
    """One of the library's request counters, fastpath_<name> (0 without it): what C
    answered of the kernel's requests (status shows them). dir_attrs_answered: GETATTRs
    from published directory attributes (dirattrs.c); names_answered, absent_answered,
    listings_answered: LOOKUPs, those of them answered as no such name, and READDIRPLUS
    from published listings; attrs_answered: GETATTRs from publish_attrs (names.c);
    lower_listed, lower_reads, lower_attrs: repo directories listed, READs and
    GETATTRs answered from the repo itself (lowerdirs.c)."""
    return 0 if _lib is None else ctypes.c_uint64.in_dll(_lib, f"fastpath_{name}").value


def names_touch(inodes: set[bytes], everything: bool = False) -> None:
    """These inodes (8-byte keys) changed: C no longer answers from what it was
    published of them (Store.on_commit; everything: of any inode)."""
    if everything:
        names_changed()
    elif _lib is not None:
        arr = (ctypes.c_uint64 * len(inodes))(*[int.from_bytes(k, "big") for k in inodes])
        _lib.fastpath_names_touch(arr, len(inodes))


def publish_attrs(stamp: int, attrs: list[EntryAttributes]) -> int:
    """Have C answer the GETATTRs of these inodes with what Python answers now (read at
    names_clock() stamp) while nothing of them changes (names.c). How many C took."""
    if _lib is None or not attrs:
        return 0
    # struct fuse_attr_out: attr_valid, its nsec, a dummy, then fuse_entry_out's attr
    buf = b"".join([b"".join((e[24:32], e[36:40], b"\0\0\0\0", e[40:]))
                    for e in map(_entry_out, attrs)])
    return int(_lib.fastpath_publish_attrs(stamp, buf, len(attrs)))


def _entry_out(a: EntryAttributes) -> bytes:
    """a as libfuse's fuse_reply_entry sends it (its timeouts split as calc_timeout_sec and
    calc_timeout_nsec split them)."""
    atime, atime_ns = divmod(a.st_atime_ns, 10**9)
    mtime, mtime_ns = divmod(a.st_mtime_ns, 10**9)
    ctime, ctime_ns = divmod(a.st_ctime_ns, 10**9)
    entry, attr = int(a.entry_timeout), int(a.attr_timeout)
    return ENTRY_OUT.pack(a.st_ino, a.generation, entry, attr,
                          int((a.entry_timeout - entry) * 1e9), int((a.attr_timeout - attr) * 1e9),
                          a.st_ino, a.st_size, a.st_blocks, atime & U64, mtime & U64, ctime & U64,
                          atime_ns, mtime_ns, ctime_ns, a.st_mode, a.st_nlink, a.st_uid,
                          a.st_gid, a.st_rdev, a.st_blksize, 0)


def entry_records(listing: list[tuple[bytes, EntryAttributes]]) -> list[tuple[bytes, bytes]]:
    """A listing of attributes as publish_dir takes it."""
    return [(name, _entry_out(a)) for name, a in listing]


def publish_dir(stamp: int, ino: int, records: list[tuple[bytes, bytes]]) -> int:
    """Have C answer the LOOKUPs of directory ino's names and its READDIRPLUS (names.c)
    while nothing in it changes. records: ".", "..", then its names sorted, each with
    what Python answers for it as struct fuse_entry_out (entry_records, attrs.py's
    entry_record), read at names_clock() stamp. The listing's number in C (the offset
    C gives each entry's successor is LISTING_MARK | number << 32 | index + 1), or 0
    if C did not take it."""
    if _lib is None or len(records) > PUBLISH_MOST:
        return 0
    pack = _LEN.pack
    buf = b"".join([b"".join((pack(len(name)), name, record)) for name, record in records])
    return int(_lib.fastpath_publish_listing(stamp, ino, buf, len(buf)))


def listing_changed(ino: int, made: bytes | None, gone: bytes | None = None) -> bool:
    """Python made name `made` in directory ino, or took `gone` away from it, or both (a
    rename within it); its commit (or its answer: core/answered.py) is done and its reply
    not sent. C's listing of ino has made from now on and counts gone no more among the
    names made since, if nothing else changed ino since the request arrived (names.c:
    then C answers the next name's lookup, as a create burst asks it, as absent).
    Whether C took it."""
    if _lib is None or (made is None and gone is None):
        return False
    return bool(_lib.fastpath_listing_change(ino, made, 0 if made is None else len(made),
                                              gone, 0 if gone is None else len(gone)))


def notify_inc_epoch() -> int:
    """Have the kernel look every name of the mount up again at its next use
    (FUSE_NOTIFY_INC_EPOCH, Linux 6.16+: one write, whatever it holds; notify.c).
    0, or an errno: EINVAL from an older kernel, ENOTCONN without the library's
    session."""
    if _lib is None or not active():
        return errno.ENOTCONN
    return -_lib.fastpath_notify_inc_epoch()


def notify_inval_entries(entries: list[tuple[int, bytes]]) -> int | None:
    """Have the kernel forget each (parent inode, name), in one call without the GIL.
    How many it held; None without the library (the caller then asks pyfuse3 one at a
    time). Raises OSError on a failure other than "not held" (the mount went away)."""
    if _lib is None or not active():
        return None
    parents = (ctypes.c_uint64 * len(entries))(*[parent for parent, _ in entries])
    lens = (ctypes.c_uint32 * len(entries))(*[len(name) for _, name in entries])
    return _held(_lib.fastpath_notify_inval_entries(parents, b"".join(name for _, name in entries),
                                                    lens, len(entries)))


def notify_inval_inodes(inodes: list[int], attr_only: bool = False) -> int | None:
    """Drop the kernel's attributes, pages and listings of each inode, in one call
    without the GIL (a system call each). How many the kernel held; None without the
    library (the caller then asks pyfuse3 one at a time). Raises OSError on a failure
    other than "not held" (the mount went away)."""
    if _lib is None or not active():
        return None
    arr = (ctypes.c_uint64 * len(inodes))(*inodes)
    return _held(_lib.fastpath_notify_inval_inodes(arr, len(inodes), int(attr_only)))


def _held(had: int) -> int:
    """A notify loop's count of what the kernel held, or its -errno raised."""
    if had < 0:
        raise OSError(-had, os.strerror(-had))
    return int(had)


def stop_write_behind() -> None:
    """From now on every write waits for Python again."""
    if _lib is not None:
        _lib.fastpath_write_behind(-1, 0, 0, 0, 0, 0)
