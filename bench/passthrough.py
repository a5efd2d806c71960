"""A plain pyfuse3 passthrough filesystem: the "Python floor".

It captures nothing, so the gap between it and overlayckpt is the cost of
capture, and the gap between it and fuse-overlayfs is the cost of Python and
pyfuse3. It avoids the pyfuse3 example's known handicaps (FACTS.md): entry and
attribute timeouts are 10 s, every open handle gets its own fd opened with the
caller's flags, ``create`` honours the mode, rename passes its flags on.

Inode numbers are the source's ``st_ino`` (the root is 1), so they are stable
across lookups and remounts, as git's index expects (it compares ``st_ino``;
numbers that change make ``git status`` re-hash every file). A node remembers
its (parent inode, name) entries so paths follow directory renames, and the
kernel's lookup counts decide when it is dropped. ``flush`` is left
unimplemented (ENOSYS once, then the kernel stops sending it). One trio
thread, blocking syscalls: that is the floor.

    python -m bench.passthrough SRC MNT   # foreground; exits on unmount
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import stat
import sys
from dataclasses import dataclass, field

import pyfuse3
import trio

log = logging.getLogger(__name__)

TIMEOUT = 10.0
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


@dataclass(slots=True)
class Node:
    """What we know of one inode the kernel may hold."""

    names: set[tuple[int, bytes]] = field(default_factory=set)
    lookups: int = 0


class Passthrough(pyfuse3.Operations):
    """Mirror *src* through FUSE without recording anything."""

    enable_writeback_cache = False

    def __init__(self, src: str) -> None:
        super().__init__()
        self.src = os.fsencode(os.path.abspath(src))
        self.root_ino = os.lstat(self.src).st_ino
        self.nodes: dict[int, Node] = {pyfuse3.ROOT_INODE: Node(lookups=1)}
        self.entries: dict[tuple[int, bytes], int] = {}
        self.dirs: dict[int, tuple[int, list[tuple[bytes, os.stat_result]] | None]] = {}
        self.next_dh = 1

    # --- inode bookkeeping -------------------------------------------------

    def _path(self, inode: int) -> bytes:
        if inode == pyfuse3.ROOT_INODE:
            return self.src
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        for parent, name in node.names:
            if parent in self.nodes:
                return os.path.join(self._path(parent), name)
        raise pyfuse3.FUSEError(errno.ESTALE)

    def _ino(self, st: os.stat_result) -> int:
        return pyfuse3.ROOT_INODE if st.st_ino == self.root_ino else st.st_ino

    def _attr(self, st: os.stat_result) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = self._ino(st)
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = st.st_size
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    def _remember(self, parent: int, name: bytes, inode: int) -> None:
        """Count one kernel lookup of *inode* under (parent, name)."""
        old = self.entries.get((parent, name))
        if old is not None and old != inode:
            self._drop_name(parent, name)
        node = self.nodes.get(inode)
        if node is None:
            node = self.nodes[inode] = Node()
        node.names.add((parent, name))
        node.lookups += 1
        self.entries[(parent, name)] = inode

    def _drop_name(self, parent: int, name: bytes) -> None:
        inode = self.entries.pop((parent, name), None)
        node = self.nodes.get(inode) if inode is not None else None
        if node is not None:
            node.names.discard((parent, name))

    def _entry(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes:
        path = os.path.join(self._path(parent), name)
        try:
            st = os.lstat(path)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        self._remember(parent, name, self._ino(st))
        return self._attr(st)

    # --- metadata ------------------------------------------------------------

    async def lookup(self, parent_inode, name, ctx):
        if name == b".":
            return await self.getattr(parent_inode, ctx)
        if name == b"..":
            raise pyfuse3.FUSEError(errno.ENOENT)  # supports_dot_lookup is off
        return self._entry(parent_inode, name)

    async def forget(self, inode_list):
        for inode, n in inode_list:
            node = self.nodes.get(inode)
            if node is None or inode == pyfuse3.ROOT_INODE:
                continue
            node.lookups -= n
            if node.lookups <= 0:
                for key in node.names:
                    if self.entries.get(key) == inode:
                        del self.entries[key]
                del self.nodes[inode]

    async def getattr(self, inode, ctx):
        try:
            st = os.lstat(self._path(inode))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return self._attr(st)

    async def setattr(self, inode, attr, fields, fh, ctx):
        path = self._path(inode)
        try:
            if fields.update_size:
                if fh is not None:
                    os.ftruncate(fh, attr.st_size)
                else:
                    os.truncate(path, attr.st_size)
            if fields.update_mode:
                if not stat.S_ISLNK(os.lstat(path).st_mode):  # Linux cannot chmod a symlink
                    os.chmod(path, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                os.chown(path, attr.st_uid if fields.update_uid else -1,
                         attr.st_gid if fields.update_gid else -1, follow_symlinks=False)
            if fields.update_atime or fields.update_mtime:
                st = os.lstat(path)
                at = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
                mt = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
                os.utime(path, ns=(at, mt), follow_symlinks=False)
            st = os.fstat(fh) if fh is not None else os.lstat(path)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return self._attr(st)

    async def readlink(self, inode, ctx):
        try:
            return os.readlink(self._path(inode))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None

    async def statfs(self, ctx):
        sv = os.statvfs(self.src)
        out = pyfuse3.StatvfsData()
        for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                  "f_files", "f_ffree", "f_favail", "f_namemax"):
            setattr(out, f, getattr(sv, f))
        return out

    # --- directories -------------------------------------------------------

    async def opendir(self, inode, ctx):
        self._path(inode)
        dh = self.next_dh
        self.next_dh += 1
        self.dirs[dh] = (inode, None)
        return dh

    async def readdir(self, fh, start_id, token):
        inode, listing = self.dirs[fh]
        if listing is None or start_id == 0:
            path = self._path(inode)
            try:
                # "." and ".." first: the kernel never counts them as lookups.
                listing = [(b".", os.lstat(path)), (b"..", os.lstat(os.path.join(path, b"..")))]
                with os.scandir(path) as it:
                    for de in it:
                        try:
                            listing.append((os.fsencode(de.name), de.stat(follow_symlinks=False)))
                        except FileNotFoundError:
                            pass
            except OSError as e:
                raise pyfuse3.FUSEError(e.errno) from None
            self.dirs[fh] = (inode, listing)
        for i in range(start_id, len(listing)):
            name, st = listing[i]
            attr = self._attr(st)
            if not pyfuse3.readdir_reply(token, name, attr, i + 1):
                return
            if i >= 2:
                self._remember(inode, name, attr.st_ino)  # readdirplus counts as a lookup
        return

    async def releasedir(self, fh):
        self.dirs.pop(fh, None)

    async def mkdir(self, parent_inode, name, mode, ctx):
        path = os.path.join(self._path(parent_inode), name)
        try:
            os.mkdir(path, stat.S_IMODE(mode))
            self._chown(path, ctx)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return self._entry(parent_inode, name)

    async def rmdir(self, parent_inode, name, ctx):
        try:
            os.rmdir(os.path.join(self._path(parent_inode), name))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        self._drop_name(parent_inode, name)

    async def unlink(self, parent_inode, name, ctx):
        try:
            os.unlink(os.path.join(self._path(parent_inode), name))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        self._drop_name(parent_inode, name)

    async def symlink(self, parent_inode, name, target, ctx):
        path = os.path.join(self._path(parent_inode), name)
        try:
            os.symlink(target, path)
            self._chown(path, ctx)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return self._entry(parent_inode, name)

    async def link(self, inode, new_parent_inode, new_name, ctx):
        try:
            os.link(self._path(inode), os.path.join(self._path(new_parent_inode), new_name),
                    follow_symlinks=False)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return self._entry(new_parent_inode, new_name)

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        path = os.path.join(self._path(parent_inode), name)
        try:
            os.mknod(path, mode, rdev)
            self._chown(path, ctx)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return self._entry(parent_inode, name)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        old = os.path.join(self._path(parent_inode_old), name_old)
        new = os.path.join(self._path(parent_inode_new), name_new)
        try:
            if flags & RENAME_EXCHANGE:
                raise pyfuse3.FUSEError(errno.EINVAL)  # os has no renameat2 wrapper
            if flags & RENAME_NOREPLACE and os.path.lexists(new):
                raise pyfuse3.FUSEError(errno.EEXIST)
            os.rename(old, new)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        moved = self.entries.pop((parent_inode_old, name_old), None)
        self._drop_name(parent_inode_new, name_new)
        if moved is not None and moved in self.nodes:
            node = self.nodes[moved]
            node.names.discard((parent_inode_old, name_old))
            node.names.add((parent_inode_new, name_new))
            self.entries[(parent_inode_new, name_new)] = moved

    # --- files ---------------------------------------------------------------

    def _chown(self, path: bytes, ctx) -> None:
        if os.geteuid() == 0 and (ctx.uid, ctx.gid) != (0, 0):
            os.chown(path, ctx.uid, ctx.gid, follow_symlinks=False)

    async def open(self, inode, flags, ctx):
        try:
            fd = os.open(self._path(inode), flags & ~os.O_CREAT)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return pyfuse3.FileInfo(fh=fd)

    async def create(self, parent_inode, name, mode, flags, ctx):
        path = os.path.join(self._path(parent_inode), name)
        try:
            fd = os.open(path, flags | os.O_CREAT, stat.S_IMODE(mode))
            self._chown(path, ctx)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return pyfuse3.FileInfo(fh=fd), self._entry(parent_inode, name)

    async def read(self, fh, off, size):
        try:
            return os.pread(fh, size, off)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None

    async def write(self, fh, off, buf):
        try:
            return os.pwrite(fh, buf, off)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None

    async def fsync(self, fh, datasync):
        try:
            (os.fdatasync if datasync else os.fsync)(fh)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None

    async def release(self, fh):
        try:
            os.close(fh)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.passthrough", description=__doc__.split("\n")[0])
    parser.add_argument("src")
    parser.add_argument("mountpoint")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING)
    os.umask(0)  # the kernel already applied the caller's umask to create/mkdir modes
    ops = Passthrough(args.src)
    options = set(pyfuse3.default_options)
    options.add("fsname=bench-passthrough")
    pyfuse3.init(ops, args.mountpoint, options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
