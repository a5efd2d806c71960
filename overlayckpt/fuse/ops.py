"""The pyfuse3 adapter: the only place that speaks FUSE and translates errors.

Each handler calls one synchronous core operation; FsError becomes the
matching errno, any other exception is logged and answered with EIO (a dead
mount would let the agent write straight into the repo, unrecorded).
Inodes at or above CONTROL_INO_BASE belong to the control directory.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import pyfuse3
import trio

from overlayckpt.core.answered import Answered
from overlayckpt.core.context import Invalidate, no_invalidate
from overlayckpt.core.journal import Caller
from overlayckpt.core.latency import Captures
from overlayckpt.core.overlay import RENAME_EXCHANGE, Overlay, make_durable
from overlayckpt.core.tree import repo_inodes_changed
from overlayckpt.errors import FsError
from overlayckpt.fuse import fastpath
from overlayckpt.fuse.attrs import CACHE_TIMEOUT, entry_attrs, entry_record
from overlayckpt.fuse.behind import Behind
from overlayckpt.fuse.callers import CallerCache, Writers
from overlayckpt.fuse.control import VIEW_INO_BASE, ControlFs
from overlayckpt.fuse.forgotten import Forgotten
from overlayckpt.records import CONTROL_INO_BASE, CONTROL_NAME, ROOT_INO, Node, u64

log = logging.getLogger(__name__)

CAPABILITY_XATTR = b"security.capability"
# Handles of directories, and of files that need no state (all but control files) when
# the fast path library is active: the inode number with this bit set. C hands them out for most
# opens, Python for create and truncating opens; their release never reaches Python.
KERNEL_HANDLE = 1 << 63
LISTING_MARK = 1 << 62  # in a listing's offsets: C's numbering (fuse/csrc/names.c)
# Directory listings are snapshots found by offset, not by handle: an offset carries
# its snapshot's number (bits 32-61) and the index (low 32 bits), so a listing read
# in chunks never mixes snapshots, whatever else opens the directory meanwhile.
SNAPSHOTS_KEPT = 256
# directories waiting to be published to C at a lookup in them (a bound, not a cache)
UNPUBLISHED_MOST = 4096
Listing = list[tuple[bytes, pyfuse3.EntryAttributes]]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
T = TypeVar("T")


def translate_errors(fn: F) -> F:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper  # type: ignore[return-value]  # wraps(fn): the same signature as fn


@dataclass(slots=True)
class Handle:
    ino: int
    caller: Caller
    control: Any = None  # a control-file handle for control inodes


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    # No writeback cache: with it the kernel trusts its own i_size and would keep a
    # stale size after a restore changes a file behind its back.
    enable_writeback_cache = False

    def __init__(self, overlay: Overlay, control: ControlFs, *,
                 invalidate: Invalidate = no_invalidate,
                 kernel_handles: Callable[[], bool] = lambda: False,
                 capture: Captures | None = None, forgotten: Forgotten | None = None,
                 answered: Answered | None = None) -> None:
        """invalidate: drops kernel caches (the mount's); kernel_handles: whether
        the fast path library serves the session, asked once, at the first open (after the mount);
        capture: where the capture latency of writes is recorded (overlayckpt stats);
        forgotten: the inodes invalidate makes the kernel forget (fuse/forgotten.py);
        answered: what answers creates and removals before they are stored (None: none is)."""
        super().__init__()
        self.answered = answered
        self.capture = capture if capture is not None else Captures()
        self.behind = Behind(overlay, self.capture, invalidate)
        if fastpath.loaded():  # every change drops the names C answers (fuse/csrc/names.c)
            overlay.store.on_commit = fastpath.names_touch
            overlay.lower.on_forget = fastpath.names_changed
            overlay.lower_paths.from_c = fastpath.lower_entry  # (fuse/csrc/lowerdirs.c)
            overlay.lower_paths.all_from_c = fastpath.lower_known
            if overlay.lower.pins is None:  # (a pinned entry shows what the repo no longer has)
                fastpath.lower_start(overlay.lower.fd, overlay.bs, int(CACHE_TIMEOUT))
                fastpath.names_touch(overlay.store.read(repo_inodes_changed))
        self.ov = overlay
        self.ctl = control
        self.callers = CallerCache()
        self.writers = Writers()
        self.handles: dict[int, Handle] = {}
        self.snapshots: OrderedDict[int, Listing] = OrderedDict()  # number -> listing
        self._next_snapshot = 0
        self._kernel_handles_known = kernel_handles
        self._kernel_handles: bool | None = None
        self.invalidate = invalidate
        self.forgotten = forgotten if forgotten is not None else Forgotten()
        self._next_fh = 1
        self._unpublished: set[int] = set()  # directories to publish to C at a lookup (_publish_names)

    # -- helpers --------------------------------------------------------------

    @property
    def kernel_handles(self) -> bool:
        if self._kernel_handles is None:
            self._kernel_handles = self._kernel_handles_known()
        return self._kernel_handles

    def _attrs(self, ino: int, node: Node | None = None) -> pyfuse3.EntryAttributes:
        if node is None:
            node = self._live_of(ino, lambda r: self.ov.node(r, ino))
        return entry_attrs(ino, node, self.ov.bs)

    def _live_of(self, ino: int, fn: Callable[[Any], T]) -> T:
        """fn on the live state, for a read of ino alone: the writes deferred to other
        inodes (Overlay.write_later) change nothing it reads, so they stay deferred."""
        return self.ov.live(fn) if self.ov.store.deferring(ino) else self.ov.peek(fn)

    def _file_handle(self, ino: int, ctx: pyfuse3.RequestContext) -> int:
        if self.kernel_handles:
            return KERNEL_HANDLE | ino
        return self._fh(Handle(ino, self._caller(ctx)))

    def _fh(self, handle: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = handle
        return fh

    def _caller(self, ctx: pyfuse3.RequestContext) -> Caller:
        return self.callers.caller(ctx.pid)

    @staticmethod
    def _no_control(ino: int) -> None:
        if ino >= VIEW_INO_BASE:
            raise FsError(errno.EROFS)  # checkpoint views are read-only
        if ino >= CONTROL_INO_BASE:
            raise FsError(errno.EPERM)

    # -- lookups and attributes -----------------------------------------------

    @translate_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        if parent_inode >= CONTROL_INO_BASE or (parent_inode == ROOT_INO and name == CONTROL_NAME):
            return await self.ctl.lookup(parent_inode, name)
        if self.answered is not None and self.answered.making(parent_inode, name):
            self.ov.store.store_deferred()  # (a name being made, or any in a directory being made)
        if name == b".":
            return self._attrs(parent_inode)
        if name == b"..":
            parent = self.ov.parents.get(parent_inode, (ROOT_INO, b""))[0]
            return self._attrs(parent)

        def fn(r: Any) -> tuple[int, Node]:
            ino = self.ov.lookup(r, parent_inode, name)
            return ino, self.ov.node(r, ino)
        publish = fastpath.loaded()  # (C answers what Python publishes: fuse/csrc/names.c)
        stamp, listed = (fastpath.names_clock(), self.ov.lower.listings_made) if publish else (0, 0)
        try:
            # (a name being removed is found, and its inode is deferred: stored first)
            ino, node = self.ov.peek(fn)
            if self.ov.store.deferring(ino):
                ino, node = self.ov.live(fn)
        except FsError as e:
            if e.errno != errno.ENOENT:
                raise
            ino, node = 0, None
        if publish and (self.ov.lower.listings_made != listed or parent_inode in self._unpublished):
            self._publish_names(parent_inode)
        if node is not None and publish:
            self._hint_dirs(parent_inode, [(ino, node)])
        if node is None:
            neg = pyfuse3.EntryAttributes()
            neg.st_ino = 0
            neg.entry_timeout = CACHE_TIMEOUT
            return neg
        return self._attrs(ino, node)

    def _publish_names(self, parent: int) -> None:
        """Have C answer the lookups of every name in parent and its listing
        (fuse/csrc/names.c) while nothing in it changes: a lookup that had the repo's
        directory listed is a walk's (the second name looked up in it: core/lower.py),
        whose next lookups are its siblings. (A directory too big for Lower to keep is not
        counted as listed: publishing it would stall this lookup.) While a change of it
        waits to be stored, at a later lookup in it: an editor's save looks up its
        temporary name, then its target, once the temporary file is made. (Not read at
        all while anything waits: a directory a build writes into would be read whole
        at each of its lookups.)"""
        if self.ov.store.deferred():
            if len(self._unpublished) < UNPUBLISHED_MOST:
                self._unpublished.add(parent)
            return
        self._unpublished.discard(parent)
        self._publish(*self._read_for_c(lambda r: self._entries(r, parent)), parent)

    def _publish(self, stamp: int, entries: list[tuple[bytes, int, Node]], ino: int) -> int:
        """Hand C directory ino's entries (".", "..", its names), read at names clock
        stamp (fuse/csrc/names.c), and where its subdirectories are in the repo
        (lowerdirs.c lists them itself while nothing changes them). The listing's number
        in C, or 0 if C did not take it."""
        if not fastpath.loaded():
            return 0
        bs = self.ov.bs
        number = fastpath.publish_dir(stamp, ino, [(name, entry_record(child, node, bs))
                                                   for name, child, node in entries])
        self._hint_dirs(ino, ((child, node) for _, child, node in entries[2:]))
        return number

    def _hint_dirs(self, parent: int, children: Iterable[tuple[int, Node]]) -> None:
        """Where those of these children of parent that are repo directories are in the
        repo, so that C lists them itself while nothing changes them
        (fuse/csrc/lowerdirs.c checks they are the repo's)."""
        if fastpath.lower_on():
            small = self.ov.lower.is_small
            fastpath.lower_hint([(ino, parent, node.origin, small(node.origin)) for ino, node in children
                                 if node.is_dir and node.origin])

    @translate_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode >= CONTROL_INO_BASE:
            return await self.ctl.getattr(inode)
        if self.forgotten.inodes and fastpath.loaded():
            run = self.forgotten.take(inode)
            if run:
                return self._publish_attrs(run)
        return self._attrs(inode)

    def _publish_attrs(self, run: list[int]) -> pyfuse3.EntryAttributes:
        """The attributes of run[0], a forgotten inode the kernel asks for; C takes those
        of the rest, which it asks for next (fuse/forgotten.py)."""
        def fn(r: Any) -> list[pyfuse3.EntryAttributes]:
            out = [self._attrs(run[0], self.ov.node(r, run[0]))]
            for ino in run[1:]:
                try:
                    out.append(self._attrs(ino, self.ov.node(r, ino)))
                except FsError:
                    pass  # (gone since: the kernel asks no more of it)
            return out
        stamp, attrs = self._read_for_c(fn)
        fastpath.publish_attrs(stamp, attrs[1:])
        return attrs[0]

    @translate_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode >= CONTROL_INO_BASE:
            return await self.ctl.setattr(inode)
        caller = self.handles[fh].caller if fh in self.handles else self._caller(ctx)
        if fields.update_size:
            self.writers.wrote(inode, caller)
        node = self.ov.setattr(
            caller, inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return self._attrs(inode, node)

    @translate_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        if inode >= CONTROL_INO_BASE:
            return await self.ctl.readlink(inode)
        return self._live_of(inode, lambda r: self.ov.readlink(r, inode, self.ov.node(r, inode)))

    @translate_errors
    async def forget(self, inode_list: Any) -> None:
        return None  # (nothing counts lookups: with the C library, forgets end there)

    # -- namespace ------------------------------------------------------------

    def _create(self, parent: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext,
                rdev: int = 0, target: bytes | None = None) -> tuple[int, Node]:
        self._no_control(parent)
        caller = self._caller(ctx)
        pnode: Node | None
        if (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) and not rdev and self._answer_first():
            assert self.answered is not None  # answered now, stored with what is around it (answered.py)
            ino, node, pnode = self.answered.create(caller, parent, name, mode, ctx.uid, ctx.gid,
                                                    functools.partial(self._answered_failed, parent, name))
            self._answered(ino, parent, pnode)
        else:
            ino, node = self.ov.create(caller, parent, name, mode, ctx.uid, ctx.gid, rdev, target)
            pnode = None  # (the commit wrote it: Overlay.written)
            self._changed_dirs(parent)
        self.writers.wrote(ino, caller)
        fastpath.listing_changed(parent, name)
        if stat.S_ISDIR(mode) and fastpath.loaded():  # its listing, with no names: read nothing
            fastpath.publish_dir(fastpath.names_clock(), ino, fastpath.entry_records([
                (b".", self._attrs(ino, node)),
                (b"..", self._attrs(parent, pnode if pnode is not None else self.ov.written(parent)))]))
        return ino, node

    def _changed_dirs(self, *inos: int) -> None:
        """Have C answer the GETATTRs of these directories, which this request changed:
        the kernel drops what it has of them and asks next (default_permissions)."""
        if fastpath.loaded():
            for ino in inos:
                fastpath.publish_dir_attrs(self._attrs(ino, self.ov.written(ino)))

    @translate_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(*self._create(parent_inode, name, mode, ctx, rdev))

    @translate_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
                    ) -> pyfuse3.EntryAttributes:
        return self._attrs(*self._create(parent_inode, name, stat.S_IFDIR | (mode & 0o7777), ctx))

    @translate_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
                      ) -> pyfuse3.EntryAttributes:
        return self._attrs(*self._create(parent_inode, name, stat.S_IFLNK | 0o777, ctx, 0, target))

    @translate_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        await self.behind.keep_up()
        ino, node = self._create(parent_inode, name, stat.S_IFREG | (mode & 0o7777), ctx)
        return pyfuse3.FileInfo(fh=self._file_handle(ino, ctx), keep_cache=True), self._attrs(ino, node)

    @translate_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._remove(parent_inode, name, False, ctx)

    @translate_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._remove(parent_inode, name, True, ctx)

    def _remove(self, parent: int, name: bytes, is_rmdir: bool, ctx: pyfuse3.RequestContext) -> None:
        self._no_control(parent)
        if not self._answer_first():
            self.ov.remove(self._caller(ctx), parent, name, is_rmdir)
            self._changed_dirs(parent)
        else:  # answered now, stored with what is around it (answered.py)
            assert self.answered is not None
            ino, pnode = self.answered.remove(self._caller(ctx), parent, name, is_rmdir,
                                              functools.partial(self._answered_failed, parent, name))
            self._answered(ino, parent, pnode)
        fastpath.listing_changed(parent, None, name)  # (C's listing of parent, if whole, stays so)

    def _answer_first(self) -> bool:
        """Whether a create or removal may be answered before it is stored (answered.py)."""
        return self.answered is not None and self.behind.may_answer_first()

    def _answered(self, ino: int, parent: int, pnode: Node) -> None:
        """A create or removal of ino in parent answered before it is stored: what C held
        of them is stale, the parent is as pnode says, and its commit reports none of
        this again (Store.defer's announced), so that C keeps answering from it."""
        fastpath.names_touch({u64(ino), u64(parent)})
        fastpath.publish_dir_attrs(self._attrs(parent, pnode))
        self.behind.store_soon()

    def _answered_failed(self, parent: int, name: bytes, e: Exception) -> None:
        log.error("a create or removal of %r in inode %d failed after it was answered (%s): "
                  "the directory is as it was", name, parent, e, exc_info=not isinstance(e, FsError))
        fastpath.names_touch({u64(parent)})  # (what C was told of it as it was answered)
        fastpath.drop_dir_attrs()
        with contextlib.suppress(RuntimeError):  # (at unmount, outside the loop: nothing held)
            trio.lowlevel.spawn_system_task(self.invalidate, [parent], [(parent, name)])

    @translate_errors
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        self._no_control(parent_inode_old)
        self._no_control(parent_inode_new)
        self.ov.rename(self._caller(ctx), parent_inode_old, name_old, parent_inode_new, name_new, flags)
        parents = {parent_inode_old, parent_inode_new}
        if self.ov.wrote_a_directory(parents):  # (C dropped the parents' as it took the request)
            fastpath.drop_dir_attrs()
        self._changed_dirs(*parents)
        within = parent_inode_old == parent_inode_new and not flags & RENAME_EXCHANGE
        fastpath.listing_changed(parent_inode_new, name_new, name_old if within else None)

    @translate_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self._no_control(inode)
        self._no_control(new_parent_inode)
        node = self.ov.link(self._caller(ctx), inode, new_parent_inode, new_name)
        self._changed_dirs(new_parent_inode)
        fastpath.listing_changed(new_parent_inode, new_name)
        return self._attrs(inode, node)

    # -- files ----------------------------------------------------------------

    @translate_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode >= CONTROL_INO_BASE:
            handle = Handle(inode, self._caller(ctx), await self.ctl.open(inode, flags))
            return pyfuse3.FileInfo(fh=self._fh(handle), direct_io=True, keep_cache=False)
        if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            # the kernel passes O_TRUNC on to us; ignoring it would keep the old data
            node = self.ov.live(lambda r: self.ov.node(r, inode))
            if node.is_reg and node.size:
                caller = self._caller(ctx)
                self.writers.wrote(inode, caller)
                self.ov.setattr(caller, inode, size=0)
        return pyfuse3.FileInfo(fh=self._file_handle(inode, ctx), keep_cache=True)

    @translate_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        if fh & KERNEL_HANDLE:
            ino = fh ^ KERNEL_HANDLE
        else:
            h = self.handles[fh]
            if h.control is not None:
                return await self.ctl.read(h.control, off, size)
            ino = h.ino
        return self._live_of(ino, lambda r: self.ov.read(r, ino, self.ov.node(r, ino), off, size))

    @translate_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if fh & KERNEL_HANDLE:
            # first thing: the pid is the C library's, set for this request only
            pid, logged, arrival = fastpath.request_pid(), fastpath.request_logged(), fastpath.request_arrival()
            ino = fh ^ KERNEL_HANDLE
            if pid:
                caller = self.callers.caller(pid)
                self.writers.wrote(ino, caller)
            else:  # page writeback: the file's last writer dirtied those pages
                caller = self.writers.of(ino)
            if logged is not None:
                return self.behind.write(caller, ino, off, buf, logged, arrival)
            await self.behind.keep_up()
            written = self.ov.write(caller, ino, off, buf)
            if arrival:  # captured (and committed) before the reply
                self.capture.before_reply.record(time.monotonic_ns() - arrival)
            return written
        h = self.handles[fh]
        if h.control is not None:
            return await self.ctl.write(h.control, off, buf)
        await self.behind.keep_up()
        return self.ov.write(h.caller, h.ino, off, buf)

    @translate_errors
    async def flush(self, fh: int) -> None:
        # Nothing to do on close (no writeback cache); ENOSYS tells the kernel to stop
        # sending flush, which saves a round trip per close.
        raise FsError(errno.ENOSYS)

    @translate_errors
    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None and h.control is not None:
            await self.ctl.release(h.control)

    @translate_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await make_durable(self.ov.store)
        ino = fh ^ KERNEL_HANDLE if fh & KERNEL_HANDLE else self.handles[fh].ino
        failed = self.behind.failed_writes.pop(ino, None)
        if failed is not None:
            raise FsError(failed)

    # -- directories ----------------------------------------------------------

    @translate_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        # a listing is found by its offset (readdir), so a directory handle needs no
        # state: the inode, marked. (With the fast path library no opendir comes here at all, and
        # its readdirplus wrapper passes the same marked inode.)
        return KERNEL_HANDLE | inode

    def _entries(self, r: Any, ino: int) -> list[tuple[bytes, int, Node]]:
        """Directory ino's entries in state r: ".", "..", then its names."""
        parent = self.ov.parents.get(ino, (ROOT_INO, b""))[0] if ino != ROOT_INO else ROOT_INO
        out = [(b".", ino, self.ov.node(r, ino)), (b"..", parent, self.ov.node(r, parent))]
        for name, child, cnode in self.ov.entries(r, ino):
            out.append((name, child, cnode or self.ov.node(r, child)))
        return out

    def _entries_for_c(self, ino: int) -> tuple[int, list[tuple[bytes, int, Node]]] | None:
        """Directory ino's entries and the names clock read before them, as _read_for_c
        reads them but leaving deferred what they do not show; None while a change of it
        or of any of its names waits to be stored (their attributes are in them).
        Changes deferred elsewhere stay so: an rm -rf lists each directory
        before it removes what is in it, and the removals before the listing then share
        commits with those after it. (The kernel and C take no attributes from "." and
        "..".)"""
        store = self.ov.store
        if store.deferring(ino):
            return None
        stamp = fastpath.names_clock()
        entries = self.ov.peek(lambda r: self._entries(r, ino))
        if store.deferred() and store.deferring_any({child for _, child, _ in entries[2:]}):
            return None
        return stamp, entries

    def _listing(self, ino: int) -> tuple[Listing, int]:
        """ino's listing now, which C answers the next READDIRPLUS and lookups from while
        nothing in it changes (fuse/csrc/names.c), and its number there (0: not taken)."""
        if ino >= CONTROL_INO_BASE:
            raise AssertionError("control listings go through ControlFs")
        stamp, entries = self._entries_for_c(ino) or self._read_for_c(lambda r: self._entries(r, ino))
        bs = self.ov.bs
        listing = [(name, entry_attrs(child, node, bs)) for name, child, node in entries]
        return listing, self._publish(stamp, entries, ino)

    def _read_for_c(self, fn: Callable[[Any], T]) -> tuple[int, T]:
        """fn on the live state, and the names clock read before it (fuse/csrc/names.c):
        what C may answer from while nothing it shows changes since that stamp."""
        self.ov.store.store_deferred()  # (before the stamp: their commit moves the clock)
        stamp = fastpath.names_clock()
        return stamp, self.ov.peek(fn)

    @translate_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        number, index = start_id >> 32, start_id & 0xFFFFFFFF
        listing = self.snapshots.get(number) if start_id else None
        if listing is None:  # offset 0, or a snapshot dropped meanwhile: take it (again)
            ino = fh ^ KERNEL_HANDLE
            listing, published = (await self.ctl.listing(ino), 0) if ino >= CONTROL_INO_BASE \
                else self._listing(ino)
            if not start_id and published:
                # C's offsets (names.c), so that C answers the READDIRPLUS that carry on
                # (the one at the end, which returns nothing, among them); the snapshot
                # is kept under the same number for those C can no longer answer
                number = LISTING_MARK >> 32 | published
            elif not start_id:
                self._next_snapshot = self._next_snapshot % 0x3FFFFFFF + 1  # (below the mark)
                number = self._next_snapshot
            self.snapshots[number] = listing
            if len(self.snapshots) > SNAPSHOTS_KEPT:
                self.snapshots.popitem(last=False)
        else:
            self.snapshots.move_to_end(number)
        for i in range(index, len(listing)):
            name, attrs = listing[i]
            if not pyfuse3.readdir_reply(token, name, attrs, (number << 32) + i + 1):
                return

    @translate_errors
    async def releasedir(self, fh: int) -> None:
        pass  # directory handles hold nothing (see opendir)

    @translate_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await make_durable(self.ov.store)

    @translate_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.ov.store.path)
        d = pyfuse3.StatvfsData()
        d.f_bsize = self.ov.bs
        d.f_frsize = st.f_frsize
        d.f_blocks = st.f_blocks
        d.f_bfree = st.f_bfree
        d.f_bavail = st.f_bavail
        d.f_files = st.f_files
        d.f_ffree = st.f_ffree
        d.f_favail = st.f_favail
        d.f_namemax = 255
        return d

    # -- xattrs ---------------------------------------------------------------

    @translate_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode >= CONTROL_INO_BASE or name == CAPABILITY_XATTR:
            raise FsError(errno.ENODATA)
        return self._live_of(inode, lambda r: self.ov.getxattr(r, inode, self.ov.node(r, inode), name))

    @translate_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if inode >= CONTROL_INO_BASE:
            return []
        names = self._live_of(inode, lambda r: self.ov.xattrs(r, inode, self.ov.node(r, inode)))
        return [n for n in names if n != CAPABILITY_XATTR]  # never served (see fuse/csrc/fastpath.c)

    @translate_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._no_control(inode)
        if name.startswith(b"system.posix_acl_"):
            # Without ACL support in the kernel connection an ACL would be kept as an inert
            # xattr and the mode left alone; refusing makes cp -p, sed -i & co. use chmod.
            raise FsError(errno.EOPNOTSUPP)
        if name == CAPABILITY_XATTR:
            # no effect on a nosuid mount, and the kernel's lookup before every write is
            # answered "none" in C (fuse/csrc/fastpath.c); cp -a and tar treat this as "not supported"
            raise FsError(errno.EOPNOTSUPP)
        self.ov.setxattr(self._caller(ctx), inode, name, value)

    @translate_errors
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._no_control(inode)
        self.ov.setxattr(self._caller(ctx), inode, name, None)
