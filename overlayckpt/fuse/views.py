"""Read-only views of checkpoints under .overlayckpt/checkpoints/.

`checkpoints/ID/` shows the whole tree at checkpoint ID; `checkpoints/NAME` is
a symlink to its id. A checkpoint never changes, so its entries may be cached
by the kernel for long. View inodes are allocated here, in memory: (checkpoint
id, inode in that state) <-> a number above VIEW_INO_BASE. Every write fails
with EROFS.
"""
from __future__ import annotations

import errno
import stat
from typing import Any

import pyfuse3

from overlayckpt.core.context import Context
from overlayckpt.core.timeline import AtCheckpoint, Timeline
from overlayckpt.errors import FsError, UserError
from overlayckpt.fuse.attrs import VirtualAttr, entry_attrs, virtual_attrs
from overlayckpt.fuse.control import CKPTS_INO, VIEW_INO_BASE
from overlayckpt.names import parse_id
from overlayckpt.records import ROOT_INO, Checkpoint, from_u64
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import CKPTS, NAMES

_NAME_LINK = -1  # pseudo inode of a name symlink


class CheckpointViews:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.tl = Timeline(ctx)
        self._ino: dict[tuple[int, int | str], int] = {}
        self._key: dict[int, tuple[int, int | str]] = {}

    # -- inode numbers ----------------------------------------------------------

    def _view_ino(self, cid: int, real: int | str) -> int:
        key = (cid, real)
        ino = self._ino.get(key)
        if ino is None:
            ino = VIEW_INO_BASE + len(self._ino) + 1
            self._ino[key] = ino
            self._key[ino] = key
        return ino

    def _unview(self, ino: int) -> tuple[int, int | str]:
        key = self._key.get(ino)
        if key is None:
            raise FsError(errno.ESTALE)
        return key

    # -- states -----------------------------------------------------------------

    def _state(self, r: ReadTxn, cid: int) -> tuple[Checkpoint, AtCheckpoint]:
        try:
            ck = self.tl.get(r, cid)
        except UserError:
            raise FsError(errno.ENOENT) from None
        return ck, AtCheckpoint(r, ck.seq)

    def _with_state(self, cid: int, fn: Any) -> Any:
        def run(r: ReadTxn) -> Any:
            _, state = self._state(r, cid)
            return fn(state)
        return self.ctx.store.read(run)

    def _attrs(self, cid: int, real: int, state: Any) -> pyfuse3.EntryAttributes:
        node = self.ctx.overlay.node(state, real)
        return entry_attrs(self._view_ino(cid, real), node, self.ctx.overlay.bs)

    def _name_attrs(self, name: str, cid: int) -> pyfuse3.EntryAttributes:
        ino = self._view_ino(cid, f"name:{name}")
        return virtual_attrs(VirtualAttr(ino, stat.S_IFLNK | 0o777, len(str(cid))))

    # -- the Views protocol -------------------------------------------------------

    def root_attr(self, cid: int) -> pyfuse3.EntryAttributes:
        return self._with_state(cid, lambda st: self._attrs(cid, ROOT_INO, st))

    async def lookup(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes:
        if name in (b".", b".."):
            raise FsError(errno.ENOENT)
        if parent == CKPTS_INO:
            text = name.decode(errors="replace")
            cid = parse_id(text)  # (ASCII digits only: int("²") fails, int("１") is 1)
            if cid is not None:
                return self.root_attr(cid)

            def by_name(r: ReadTxn) -> int | None:
                raw = r.get(NAMES, name)
                return from_u64(raw) if raw else None
            cid = self.ctx.store.read(by_name)
            if cid is None:
                raise FsError(errno.ENOENT)
            return self._name_attrs(text, cid)
        cid, real = self._unview(parent)
        if not isinstance(real, int):
            raise FsError(errno.ENOTDIR)

        def fn(state: Any) -> pyfuse3.EntryAttributes:
            child = self.ctx.overlay.lookup(state, real, name)
            return self._attrs(cid, child, state)
        return self._with_state(cid, fn)

    async def getattr(self, ino: int) -> pyfuse3.EntryAttributes:
        cid, real = self._unview(ino)
        if isinstance(real, str):
            return self._name_attrs(real.removeprefix("name:"), cid)
        return self._with_state(cid, lambda st: self._attrs(cid, real, st))

    def listing_mtime_ns(self) -> int:
        """The checkpoints directory's mtime, new whenever its listing is.

        Checkpoints are only added (with the next id, names only with them) or
        thinned away, so (count, newest id) changes at every change of the listing.
        It goes in the nanoseconds of the newest checkpoint's second.
        """
        def fn(r: ReadTxn) -> int:
            newest = next(self.tl.newest_first(r), None)
            if newest is None:
                return 0
            spread = (r.count(CKPTS) * 1000 + newest.id % 1000) % 1_000_000_000
            return newest.time_ns - newest.time_ns % 1_000_000_000 + spread
        return self.ctx.store.read(fn)

    async def listing(self, ino: int) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
        if ino == CKPTS_INO:
            def fn(r: ReadTxn) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
                out = []
                for ck in self.tl.all(r):
                    root = self._view_ino(ck.id, ROOT_INO)
                    out.append((str(ck.id).encode(), virtual_attrs(VirtualAttr(root, stat.S_IFDIR | 0o555))))
                    if ck.name:
                        out.append((ck.name.encode(), self._name_attrs(ck.name, ck.id)))
                return out
            return self.ctx.store.read(fn)
        cid, real = self._unview(ino)
        if not isinstance(real, int):
            raise FsError(errno.ENOTDIR)

        def entries(state: Any) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
            ov = self.ctx.overlay
            out = [(b".", self._attrs(cid, real, state))]
            for name, child, cnode in ov.entries(state, real):
                node = cnode or ov.node(state, child)
                out.append((name, entry_attrs(self._view_ino(cid, child), node, ov.bs)))
            return out
        return self._with_state(cid, entries)

    async def readlink(self, ino: int) -> bytes:
        cid, real = self._unview(ino)
        if isinstance(real, str):
            return str(cid).encode()
        ov = self.ctx.overlay
        return self._with_state(cid, lambda st: ov.readlink(st, real, ov.node(st, real)))

    async def read(self, ino: int, off: int, size: int) -> bytes:
        cid, real = self._unview(ino)
        if isinstance(real, str):
            raise FsError(errno.EINVAL)
        ov = self.ctx.overlay
        return self._with_state(cid, lambda st: ov.read(st, real, ov.node(st, real), off, size))
