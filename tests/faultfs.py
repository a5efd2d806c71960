"""faultfs: an in-memory FUSE file system that simulates a power cut.

    python tests/faultfs.py IMAGE_DIR MOUNTPOINT [--seed N] [--mode reorder|drop|torn]
                            [--fsync-commits-namespace] [--hold-fsync NAME]
                            [--torn-file NAME] [--cut-at-write K] [--torn-order prefix|suffix]
                            [--torn-split J] [--stable-inodes]

At start the directory tree IMAGE_DIR (directories and regular files: modes,
sizes, contents, mtimes) is loaded into memory: it is "the disk". Everything is
then served from memory. faultfs keeps two states:

- volatile: what every request sees (all writes so far);
- durable: what the disk holds.

Data: per inode, every WRITE (and truncate) appends, for each 4 KiB page it
touches, (page index, the whole page after this write, file size after it) to
the inode's pending list. fsync/fdatasync of a file makes its whole volatile
content and size durable and clears the list.

Namespace: create/mkdir/unlink/rmdir/rename/chmod append to one ordered log.
fsyncdir of any directory makes the whole log durable (a journaling file system
commits metadata in order). A file's fsync does NOT make its directory entry
durable (strict POSIX), unless --fsync-commits-namespace (ext4-like: any fsync
commits the metadata journal).

The cut: SIGUSR1. faultfs freezes at once (every later request fails with EIO,
nothing more is recorded) and writes the crash image:
- mode drop: exactly the durable state;
- mode reorder: the durable state, plus a random prefix of the pending
  namespace log, plus a random subset of the pending page versions applied in
  random order (a page may end up with any of its versions or none; a later
  page may persist while an earlier one does not), each file's size one of its
  durable or pending sizes. An inode the resulting namespace does not reach
  loses its data.
- mode torn (a torn sequence, as LazyFS's torn-seq): per file, the writes made
  since its last fsync are numbered 1..n; a contiguous run of them persists, in
  order, and every other one is dropped (its pages keep their durable content;
  the size is the one after the run's last write). For the file named by
  --torn-file (data.mdb) the run is fixed by --torn-order and --torn-split J:
  suffix keeps writes J+1..n (1..J dropped), prefix keeps 1..J; J < 0 picks it
  from the seed. Other files get a random run, the namespace a random prefix.
  With --cut-at-write K the cut comes by itself: once IMAGE_DIR + ".arm"
  exists, the first time the --torn-file file gets the K-th write of a group
  (the writes since its last fsync), that write is applied and the power goes
  (the write fails with EIO). The report then says "auto": true, the group's
  number ("group": fsyncs of the file before it) and the run kept.
Random choices come from --seed, so a cut can be replayed (given the same
requests). The image is written to a new directory next to IMAGE_DIR, then
swapped in (renameat2 RENAME_EXCHANGE), so a crash of faultfs itself never
destroys the image. faultfs then keeps answering EIO until it is unmounted
(fusermount3 -u/-uz), and exits.

A normal unmount (fusermount3 -u, or SIGTERM/SIGINT) without a cut writes the
volatile state as the image: a clean unmount writes everything back.

Report: after writing an image, faultfs writes IMAGE_DIR + ".faultfs.json"
(atomically, next to IMAGE_DIR: {"event": "cut"|"unmount", "mode", "seed",
"pages_pending", "pages_persisted", "ns_pending", "ns_persisted", ...}) and
prints the same JSON on stderr. Once mounted it prints "READY <mountpoint>" on
stdout.

A slow disk (--hold-fsync NAME): while the file IMAGE_DIR + ".hold" exists, an
fsync of any file named NAME waits (other requests go on), and IMAGE_DIR + ".held"
exists while one waits.

Locks (fcntl/flock) are left to the kernel (no lock handlers). Inode numbers
start at a random base on every mount, unless --stable-inodes (as a pass-through
file system such as LazyFS, whose files keep their numbers across its remounts:
a cut is then not told by a new inode number). Entry and attribute timeouts are 0.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import sys
import time
from typing import Any

import pyfuse3
import trio

PAGE = 4096
ZERO = bytes(PAGE)
TIMEOUT = 0.0
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Node:
    __slots__ = ("ino", "mode", "uid", "gid", "nlink", "atime", "mtime", "ctime", "size", "pages",
                 "children", "pending", "dsize", "dpages", "wno", "name", "fsyncs")

    def __init__(self, ino: int, mode: int, uid: int = 0, gid: int = 0) -> None:
        now = time.time_ns()
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.nlink = 2 if stat.S_ISDIR(mode) else 1
        self.atime = self.mtime = self.ctime = now
        self.size = 0
        self.pages: dict[int, bytes] = {}   # volatile content (absent = zeros)
        self.children: dict[bytes, int] | None = {} if stat.S_ISDIR(mode) else None
        # (page index or None, page after the write or None, size after it, write number:
        # 1.. since the last fsync, all pages of one write or truncate sharing it)
        self.pending: list[tuple[int | None, bytes | None, int, int]] = []
        self.wno = 0
        self.dsize = 0                      # durable size and pages
        self.dpages: dict[int, bytes] = {}
        self.name = b""                     # the name it was made or loaded under
        self.fsyncs = 0

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    @property
    def entries(self) -> dict[bytes, int]:
        """A directory's children (asked of a directory only)."""
        assert self.children is not None, "not a directory"
        return self.children


def fail(err: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(err)


def guarded(fn):
    """Every request fails with EIO once the cut happened; nothing more is recorded."""
    async def wrapper(self: FaultFs, *args: Any) -> Any:
        if self.frozen:
            raise fail(errno.EIO)
        return await fn(self, *args)
    wrapper.__name__ = fn.__name__
    return wrapper


class FaultFs(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, image: str, seed: int, mode: str, ns_on_fsync: bool,
                 hold_name: bytes | None = None, torn_file: bytes = b"data.mdb",
                 cut_at_write: int = 0, torn_order: str = "suffix", torn_split: int = -1,
                 stable_inodes: bool = False) -> None:
        super().__init__()
        self.image = os.path.abspath(image)
        self.hold_name = hold_name
        self.seed = seed
        self.mode = mode
        self.ns_on_fsync = ns_on_fsync
        self.frozen = False
        self.reported = False
        self.torn_file = torn_file
        self.cut_at_write = cut_at_write
        self.torn_order = torn_order
        self.torn_split = torn_split
        self.auto_cut: dict[str, Any] | None = None  # what the automatic cut cut
        sysrng = random.SystemRandom()
        # a fresh number space per mount, or numbers from paths (--stable-inodes)
        self.stable_inodes = stable_inodes
        self._paths: dict[int, bytes] = {}
        self._next_ino = (1 << 56) if stable_inodes else sysrng.randrange(1 << 32, 1 << 56)
        self.nodes: dict[int, Node] = {}
        self.handles: dict[int, int] = {}   # fh -> ino
        self.dirhandles: dict[int, list[tuple[bytes, int]]] = {}
        self._next_fh = 1
        # durable namespace: directory inode -> {name: inode}; inode -> mode
        self.dtree: dict[int, dict[bytes, int]] = {}
        self.dmode: dict[int, int] = {}
        self.nslog: list[tuple] = []
        self.counts = {"writes": 0, "fsyncs": 0, "fsyncdirs": 0}
        self._load()

    # -- loading the disk --------------------------------------------------------

    def _new_ino(self, parent: int = 0, name: bytes = b"") -> int:
        if self.stable_inodes and parent:
            # the number its path gets at every mount (a pass-through file system's: the
            # backing file's), so that only a rename changes it
            path = self._paths.get(parent, b"") + b"/" + name
            ino = (1 << 32) + int.from_bytes(hashlib.blake2b(path, digest_size=6).digest(), "little")
            while ino in self.nodes:
                ino += 1
            self._paths[ino] = path
            return ino
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def _load(self) -> None:
        st = os.stat(self.image)
        root = Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        root.mtime = st.st_mtime_ns
        self.nodes[root.ino] = root
        self._load_dir(self.image, root)
        for node in self.nodes.values():
            if node.is_dir:
                self.dtree[node.ino] = dict(node.entries)
            else:
                node.dsize, node.dpages = node.size, dict(node.pages)
            self.dmode[node.ino] = node.mode

    def _load_dir(self, path: str, dnode: Node) -> None:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                continue  # only directories and regular files make up an image
            node = Node(self._new_ino(dnode.ino, os.fsencode(e.name)), st.st_mode, st.st_uid, st.st_gid)
            node.atime, node.mtime, node.ctime = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
            node.name = os.fsencode(e.name)
            self.nodes[node.ino] = node
            dnode.entries[os.fsencode(e.name)] = node.ino
            if node.is_dir:
                dnode.nlink += 1
                self._load_dir(e.path, node)
            else:
                node.size = st.st_size
                with open(e.path, "rb") as f:
                    idx = 0
                    while chunk := f.read(PAGE):
                        if chunk != ZERO[:len(chunk)]:
                            node.pages[idx] = chunk.ljust(PAGE, b"\0")
                        idx += 1

    # -- helpers -------------------------------------------------------------------

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = node.mode
        a.st_nlink = node.nlink
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = 0
        a.st_size = node.size if not node.is_dir else 4096
        a.st_blksize = PAGE
        a.st_blocks = (len(node.pages) * PAGE) // 512
        a.st_atime_ns = node.atime
        a.st_mtime_ns = node.mtime
        a.st_ctime_ns = node.ctime
        return a

    def _node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise fail(errno.ENOENT) from None

    def _dir(self, ino: int) -> Node:
        node = self._node(ino)
        if not node.is_dir:
            raise fail(errno.ENOTDIR)
        return node

    def _log(self, op: tuple) -> None:
        self.nslog.append(op)

    def _touch(self, node: Node) -> None:
        node.mtime = node.ctime = time.time_ns()

    def _write(self, node: Node, off: int, buf: bytes) -> None:
        if not buf:
            return
        end = off + len(buf)
        newsize = max(node.size, end)
        for idx in range(off // PAGE, (end - 1) // PAGE + 1):
            pstart = idx * PAGE
            s, e = max(off, pstart), min(end, pstart + PAGE)
            if s == pstart and e == pstart + PAGE:
                page = bytes(buf[s - off:e - off])
            else:
                b = bytearray(node.pages.get(idx, ZERO))
                b[s - pstart:e - pstart] = buf[s - off:e - off]
                page = bytes(b)
            node.pages[idx] = page
            node.pending.append((idx, page, newsize, node.wno + 1))
        node.wno += 1
        node.size = newsize
        self.counts["writes"] += 1

    def _truncate(self, node: Node, size: int) -> None:
        node.wno += 1
        if size < node.size:
            keep = (size + PAGE - 1) // PAGE
            # pages the cut could otherwise bring back under a later, larger size
            for idx in sorted(set(node.pages) | set(node.dpages)):
                if idx >= keep:
                    node.pages.pop(idx, None)
                    node.pending.append((idx, ZERO, size, node.wno))
            if size % PAGE and (size // PAGE) in node.pages:
                idx = size // PAGE
                b = bytearray(node.pages[idx])
                b[size % PAGE:] = bytes(PAGE - size % PAGE)
                node.pages[idx] = bytes(b)
                node.pending.append((idx, node.pages[idx], size, node.wno))
        node.size = size
        node.pending.append((None, None, size, node.wno))

    def _make_durable(self, node: Node) -> None:
        node.dpages = dict(node.pages)
        node.dsize = node.size
        node.pending.clear()
        node.wno = 0
        node.fsyncs += 1

    def _commit_namespace(self) -> None:
        for op in self.nslog:
            apply_ns(self.dtree, self.dmode, op)
        self.nslog.clear()

    # -- requests ------------------------------------------------------------------

    @guarded
    async def lookup(self, parent_inode, name, ctx=None):
        d = self._dir(parent_inode)
        ino = d.entries.get(name)
        if ino is None:
            raise fail(errno.ENOENT)
        return self._attr(self.nodes[ino])

    async def forget(self, inode_list):
        pass  # inodes live as long as the mount (a test-sized file system)

    @guarded
    async def getattr(self, inode, ctx=None):
        return self._attr(self._node(inode))

    @guarded
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self._node(inode)
        now = time.time_ns()
        if fields.update_size:
            if node.is_dir:
                raise fail(errno.EISDIR)
            self._truncate(node, attr.st_size)
            node.mtime = now
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
            self._log(("chmod", inode, node.mode))
        if fields.update_uid:
            node.uid = attr.st_uid
        if fields.update_gid:
            node.gid = attr.st_gid
        if fields.update_atime:
            node.atime = attr.st_atime_ns
        if fields.update_mtime:
            node.mtime = attr.st_mtime_ns
        node.ctime = attr.st_ctime_ns if fields.update_ctime else now
        return self._attr(node)

    def _new_entry(self, parent_inode: int, name: bytes, mode: int, ctx) -> Node:
        d = self._dir(parent_inode)
        if name in d.entries:
            raise fail(errno.EEXIST)
        node = Node(self._new_ino(parent_inode, name), mode, ctx.uid, ctx.gid)
        node.name = name
        self.nodes[node.ino] = node
        d.entries[name] = node.ino
        if node.is_dir:
            d.nlink += 1
        self._touch(d)
        self._log(("new", parent_inode, name, node.ino, mode))
        return node

    @guarded
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._attr(self._new_entry(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx))

    @guarded
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not stat.S_ISREG(mode):
            raise fail(errno.EPERM)
        return self._attr(self._new_entry(parent_inode, name, mode, ctx))

    def _open_fh(self, ino: int) -> pyfuse3.FileInfo:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = ino
        # page cache, never direct_io: shared writable mmap must work
        return pyfuse3.FileInfo(fh=fh, direct_io=False, keep_cache=True)

    @guarded
    async def create(self, parent_inode, name, mode, flags, ctx):
        d = self._dir(parent_inode)
        ino = d.entries.get(name)
        if ino is not None:
            if flags & os.O_EXCL:
                raise fail(errno.EEXIST)
            node = self.nodes[ino]
            if node.is_dir:
                raise fail(errno.EISDIR)
            if flags & os.O_TRUNC:
                self._truncate(node, 0)
                self._touch(node)
        else:
            node = self._new_entry(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        return self._open_fh(node.ino), self._attr(node)

    @guarded
    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if node.is_dir and flags & os.O_ACCMODE != os.O_RDONLY:
            raise fail(errno.EISDIR)
        if flags & os.O_TRUNC and not node.is_dir and node.size:
            self._truncate(node, 0)
            self._touch(node)
        return self._open_fh(inode)

    @guarded
    async def read(self, fh, off, size):
        node = self._node(self.handles[fh])
        end = min(off + size, node.size)
        if off >= end:
            return b""
        out = bytearray()
        for idx in range(off // PAGE, (end - 1) // PAGE + 1):
            page = node.pages.get(idx, ZERO)
            pstart = idx * PAGE
            out += page[max(off, pstart) - pstart:min(end, pstart + PAGE) - pstart]
        return bytes(out)

    @guarded
    async def write(self, fh, off, buf):
        node = self._node(self.handles[fh])
        self._write(node, off, buf)
        self._touch(node)
        if self.cut_at_write and node.wno == self.cut_at_write and node.name == self.torn_file \
                and os.path.exists(self.image + ".arm"):
            self.auto_cut = {"group": node.fsyncs, "at_write": node.wno}
            self.write_report(self.cut())
            raise fail(errno.EIO)  # the power went during this write
        return len(buf)

    @guarded
    async def flush(self, fh):
        pass

    async def release(self, fh):
        self.handles.pop(fh, None)  # also after the cut: the kernel expects no answer

    async def _hold(self, ino: int) -> None:
        """The slow disk of --hold-fsync: wait while IMAGE_DIR.hold exists."""
        if self.hold_name is None or not any(
                n.entries.get(self.hold_name) == ino for n in self.nodes.values() if n.is_dir):
            return
        hold, held = self.image + ".hold", self.image + ".held"
        if not os.path.exists(hold):
            return
        with open(held, "w"):
            pass
        try:
            while os.path.exists(hold) and not self.frozen:
                await trio.sleep(0.01)
        finally:
            os.unlink(held)

    @guarded
    async def fsync(self, fh, datasync):
        await self._hold(self.handles[fh])
        node = self._node(self.handles[fh])
        self._make_durable(node)
        if self.ns_on_fsync:
            self._commit_namespace()
        self.counts["fsyncs"] += 1

    def _unlink(self, parent_inode: int, name: bytes, want_dir: bool) -> None:
        d = self._dir(parent_inode)
        ino = d.entries.get(name)
        if ino is None:
            raise fail(errno.ENOENT)
        node = self.nodes[ino]
        if want_dir:
            if not node.is_dir:
                raise fail(errno.ENOTDIR)
            if node.children:
                raise fail(errno.ENOTEMPTY)
            d.nlink -= 1
            node.nlink = 0
        else:
            if node.is_dir:
                raise fail(errno.EISDIR)
            node.nlink -= 1
        del d.entries[name]
        node.ctime = time.time_ns()
        self._touch(d)
        self._log(("unlink", parent_inode, name))

    @guarded
    async def unlink(self, parent_inode, name, ctx):
        self._unlink(parent_inode, name, False)

    @guarded
    async def rmdir(self, parent_inode, name, ctx):
        self._unlink(parent_inode, name, True)

    @guarded
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        src, dst = self._dir(parent_inode_old), self._dir(parent_inode_new)
        ino = src.entries.get(name_old)
        if ino is None:
            raise fail(errno.ENOENT)
        node = self.nodes[ino]
        old = dst.entries.get(name_new)
        if flags & RENAME_EXCHANGE:
            if old is None:
                raise fail(errno.ENOENT)
            src.entries[name_old], dst.entries[name_new] = old, ino
            if node.is_dir != self.nodes[old].is_dir:
                d1, d2 = (src, dst) if node.is_dir else (dst, src)
                d1.nlink -= 1
                d2.nlink += 1
        else:
            if old is not None:
                if flags & RENAME_NOREPLACE:
                    raise fail(errno.EEXIST)
                if old == ino:
                    return
                target = self.nodes[old]
                if target.is_dir:
                    if not node.is_dir:
                        raise fail(errno.EISDIR)
                    if target.children:
                        raise fail(errno.ENOTEMPTY)
                    dst.nlink -= 1
                    target.nlink = 0
                elif node.is_dir:
                    raise fail(errno.ENOTDIR)
                else:
                    target.nlink -= 1
            del src.entries[name_old]
            dst.entries[name_new] = ino
            if node.is_dir:
                src.nlink -= 1
                dst.nlink += 1
        self._touch(src)
        self._touch(dst)
        node.ctime = time.time_ns()
        self._log(("rename", parent_inode_old, name_old, parent_inode_new, name_new, flags))

    @guarded
    async def opendir(self, inode, ctx):
        self._dir(inode)
        fh = self._next_fh
        self._next_fh += 1
        self.dirhandles[fh] = [(b"", inode)]
        return fh

    @guarded
    async def readdir(self, fh, start_id, token):
        entries = self.dirhandles[fh]
        ino = entries[0][1]
        if start_id == 0:  # a fresh listing (also after rewinddir)
            entries[1:] = sorted(self._dir(ino).entries.items())
        for i in range(start_id, len(entries) - 1):
            name, child = entries[i + 1]
            node = self.nodes.get(child)
            if node is None:
                continue
            if not pyfuse3.readdir_reply(token, name, self._attr(node), i + 1):
                break

    async def releasedir(self, fh):
        self.dirhandles.pop(fh, None)

    @guarded
    async def fsyncdir(self, fh, datasync):
        self._commit_namespace()
        self.counts["fsyncdirs"] += 1

    @guarded
    async def statfs(self, ctx):
        d = pyfuse3.StatvfsData()
        used = sum(len(n.pages) for n in self.nodes.values())
        d.f_bsize = d.f_frsize = PAGE
        d.f_blocks = 16 << 18  # 16 GiB
        d.f_bfree = d.f_bavail = max(d.f_blocks - used, 0)
        d.f_files = 1 << 20
        d.f_ffree = d.f_favail = (1 << 20) - len(self.nodes)
        d.f_namemax = 255
        return d

    # -- the cut and the image ----------------------------------------------------------

    def cut(self) -> dict[str, Any]:
        """Freeze, then write the crash image. Runs without an await: atomic for requests."""
        self.frozen = True
        rng = random.Random(self.seed)
        dtree = {k: dict(v) for k, v in self.dtree.items()}
        dmode = dict(self.dmode)
        ns_pending = len(self.nslog)
        pages_pending = sum(sum(1 for p in n.pending if p[0] is not None) for n in self.nodes.values())
        report: dict[str, Any] = {"event": "cut", "time": time.time(), "mode": self.mode, "seed": self.seed,
                                  "ns_pending": ns_pending, "pages_pending": pages_pending}
        contents: dict[int, tuple[int, dict[int, bytes]]] = {}
        persisted = 0
        if self.mode == "reorder":
            k = rng.randint(0, ns_pending)
            for op in self.nslog[:k]:
                apply_ns(dtree, dmode, op)
            report["ns_persisted"] = k
            p = rng.choice([0.05, 0.3, 0.5, 0.7, 0.95, rng.random()])
            report["page_probability"] = round(p, 3)
            sizes_changed = 0
            for ino in sorted(self.nodes):
                node = self.nodes[ino]
                if node.is_dir:
                    continue
                pages = dict(node.dpages)
                chosen = [v for v in node.pending if v[0] is not None and rng.random() < p]
                rng.shuffle(chosen)
                for idx, page, *_ in chosen:
                    assert idx is not None and page is not None  # (a page's write: both set)
                    pages[idx] = page
                persisted += len(chosen)
                size = rng.choice([node.dsize] + [v[2] for v in node.pending])
                sizes_changed += size != node.dsize
                contents[ino] = (size, pages)
            report["pages_persisted"] = persisted
            report["sizes_changed"] = sizes_changed
        elif self.mode == "torn":
            k = rng.randint(0, ns_pending)
            for op in self.nslog[:k]:
                apply_ns(dtree, dmode, op)
            report["ns_persisted"] = k
            runs = {}
            for ino in sorted(self.nodes):
                node = self.nodes[ino]
                if node.is_dir:
                    continue
                n = node.wno
                if node.name == self.torn_file and n:
                    j = self.torn_split if self.torn_split >= 0 else rng.randint(0, n)
                    j = min(j, n)
                    first, last = (j + 1, n) if self.torn_order == "suffix" else (1, j)
                    runs[os.fsdecode(node.name)] = [first, last, n]
                else:
                    first = rng.randint(1, n + 1)
                    last = rng.randint(first - 1, n)
                pages = dict(node.dpages)
                size = node.dsize
                for idx, page, psize, wno in node.pending:
                    if first <= wno <= last:
                        if idx is not None:
                            assert page is not None  # (a page's write: both set)
                            pages[idx] = page
                            persisted += 1
                        size = psize
                contents[ino] = (size, pages)
            report["pages_persisted"] = persisted
            report["runs"] = runs  # the torn file's run: [first, last, writes in the group]
            if self.auto_cut is not None:
                report["auto"] = True
                report.update(self.auto_cut)
        else:
            report["ns_persisted"] = 0
            report["pages_persisted"] = 0
            for ino, node in self.nodes.items():
                if not node.is_dir:
                    contents[ino] = (node.dsize, node.dpages)
        report["files"] = self._write_image(dtree, dmode, contents)
        report.update(self.counts)
        return report

    def clean_image(self) -> dict[str, Any]:
        vtree = {ino: dict(n.entries) for ino, n in self.nodes.items() if n.is_dir}
        vmode = {ino: n.mode for ino, n in self.nodes.items()}
        contents = {ino: (n.size, n.pages) for ino, n in self.nodes.items() if not n.is_dir}
        report: dict[str, Any] = {"event": "unmount", "mode": self.mode, "seed": self.seed}
        report["files"] = self._write_image(vtree, vmode, contents)
        report.update(self.counts)
        return report

    def _write_image(self, tree: dict[int, dict[bytes, int]], modes: dict[int, int],
                     contents: dict[int, tuple[int, dict[int, bytes]]]) -> int:
        parent_dir = os.path.dirname(self.image)
        new = os.path.join(parent_dir, f".{os.path.basename(self.image)}.new-{os.getpid()}")
        if os.path.lexists(new):
            shutil.rmtree(new)
        os.mkdir(new, 0o700)
        files = 0
        dirs_done: list[tuple[str, Node, int]] = []
        stack = [(new, pyfuse3.ROOT_INODE)]
        seen = {pyfuse3.ROOT_INODE}
        while stack:
            path, dino = stack.pop()
            for name, ino in sorted(tree.get(dino, {}).items()):
                node = self.nodes.get(ino)
                if node is None or ino in seen:
                    continue  # (a directory cycle cannot come from a prefix; be safe anyway)
                seen.add(ino)
                p = os.path.join(path, os.fsdecode(name))
                mode = modes.get(ino, node.mode)
                if stat.S_ISDIR(mode):
                    os.mkdir(p, 0o700)
                    stack.append((p, ino))
                    dirs_done.append((p, node, mode))
                else:
                    size, pages = contents.get(ino, (0, {}))
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        for idx in sorted(pages):
                            if idx * PAGE >= size or pages[idx] is ZERO or pages[idx] == ZERO:
                                continue
                            os.pwrite(fd, pages[idx][:size - idx * PAGE], idx * PAGE)
                        os.ftruncate(fd, size)
                    finally:
                        os.close(fd)
                    os.chmod(p, stat.S_IMODE(mode))
                    os.utime(p, ns=(node.atime, node.mtime))
                    files += 1
        for p, node, mode in reversed(dirs_done):
            os.chmod(p, stat.S_IMODE(mode))
            os.utime(p, ns=(node.atime, node.mtime))
        root = self.nodes[pyfuse3.ROOT_INODE]
        os.chmod(new, stat.S_IMODE(modes.get(pyfuse3.ROOT_INODE, root.mode)))
        swap_in(new, self.image)
        return files

    def write_report(self, report: dict[str, Any]) -> None:
        path = self.image + ".faultfs.json"
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, path)
        print("faultfs: " + json.dumps(report), file=sys.stderr, flush=True)
        self.reported = True


def apply_ns(tree: dict[int, dict[bytes, int]], modes: dict[int, int], op: tuple) -> None:
    """Replay one namespace operation on a (durable) namespace."""
    kind = op[0]
    if kind == "new":
        _, parent, name, ino, mode = op
        tree.setdefault(parent, {})[name] = ino
        modes[ino] = mode
        if stat.S_ISDIR(mode):
            tree[ino] = {}
    elif kind == "unlink":
        _, parent, name = op
        tree.get(parent, {}).pop(name, None)
    elif kind == "rename":
        _, p1, n1, p2, n2, flags = op
        src, dst = tree.setdefault(p1, {}), tree.setdefault(p2, {})
        ino = src.pop(n1, None)
        if ino is None:
            return
        if flags & RENAME_EXCHANGE:
            other = dst.pop(n2, None)
            if other is not None:
                src[n1] = other
        dst[n2] = ino
    elif kind == "chmod":
        _, ino, mode = op
        modes[ino] = mode


def swap_in(new: str, image: str) -> None:
    """Put directory `new` at `image` without a moment where neither exists."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if os.path.lexists(image):
        if libc.renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(image), RENAME_EXCHANGE) == 0:
            shutil.rmtree(new)
            return
        old = new + ".old"
        os.rename(image, old)
        os.rename(new, image)
        shutil.rmtree(old)
    else:
        os.rename(new, image)


async def serve(fs: FaultFs) -> None:
    async with trio.open_nursery() as nursery:
        async def on_signals() -> None:
            with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT) as sigs:
                async for sig in sigs:
                    if sig == signal.SIGUSR1:
                        if not fs.frozen:
                            fs.write_report(fs.cut())
                    else:
                        pyfuse3.terminate()
                        return
        nursery.start_soon(on_signals)
        await pyfuse3.main(min_tasks=1, max_tasks=8)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="in-memory FUSE file system that simulates power cuts")
    p.add_argument("image")
    p.add_argument("mountpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("reorder", "drop", "torn"), default="reorder")
    p.add_argument("--torn-file", default="data.mdb",
                   help="torn mode: the file whose writes the cut position and run count")
    p.add_argument("--cut-at-write", type=int, default=0, metavar="K",
                   help="torn mode: cut at the K-th write of a group of --torn-file, once armed")
    p.add_argument("--torn-order", choices=("suffix", "prefix"), default="suffix",
                   help="torn mode: suffix keeps writes J+1..n of the group, prefix 1..J")
    p.add_argument("--torn-split", type=int, default=-1, metavar="J",
                   help="torn mode: J (default: from the seed)")
    p.add_argument("--stable-inodes", action="store_true",
                   help="the same inode numbers at every mount of the same image")
    p.add_argument("--fsync-commits-namespace", action="store_true",
                   help="a file's fsync also makes the namespace log durable (ext4-like)")
    p.add_argument("--hold-fsync", metavar="NAME",
                   help="an fsync of a file named NAME waits while IMAGE_DIR.hold exists")
    args = p.parse_args(argv)
    fs = FaultFs(args.image, args.seed, args.mode, args.fsync_commits_namespace,
                 os.fsencode(args.hold_fsync) if args.hold_fsync else None,
                 os.fsencode(args.torn_file), args.cut_at_write, args.torn_order, args.torn_split,
                 args.stable_inodes)
    opts = set(pyfuse3.default_options) | {"fsname=faultfs", "subtype=faultfs"}
    pyfuse3.init(fs, args.mountpoint, opts)
    print(f"READY {os.path.abspath(args.mountpoint)}", flush=True)
    try:
        trio.run(serve, fs)
    except* ConnectionAbortedError:
        pass  # the unmount aborted the connection under a read: the file system's end all the same
    finally:
        pyfuse3.close(unmount=True)
    if not fs.frozen:
        fs.frozen = True
        fs.write_report(fs.clean_image())
    return 0


if __name__ == "__main__":
    sys.exit(main())
