"""The read side of the overlay: what the tree looks like in one state.

A *state* is anything with `get`, `prefix` and `block` over the tables (the
live tables in a read or write transaction, or a checkpoint's view built by
timeline.py). `Tree` merges it with the lower directory: an entry of the
dirents table replaces or hides (whiteout) the lower entry of the same name; a
node record replaces the lower attributes; a block map entry replaces the
lower block. Plain Python, no FUSE, no LMDB: errors are FsError.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol, overload

from overlayckpt.core.lower import Lower, LowerFile, Stat, join, split
from overlayckpt.errors import FsError, enoent
from overlayckpt.records import (
    CONTROL_NAME,
    F_OPAQUE,
    F_XATTRS_OWN,
    FIRST_UPPER_KEY,
    NAME_MAX,
    ROOT_INO,
    WHITEOUT,
    Node,
    bmap_key,
    dirent_key,
    from_u64,
    lower_ino,
    u64,
    xattr_key,
)
from overlayckpt.tables import BMAP, DIRENTS, LIVE_TABLES, NODES, XATTRS


class State(Protocol):
    def get(self, table: bytes, key: bytes) -> bytes | None: ...
    def prefix(self, table: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...
    def block(self, digest: bytes) -> bytes: ...


class Seekable(Protocol):
    def seek(self, table: bytes, key: bytes) -> tuple[bytes, bytes] | None: ...


def repo_inodes_changed(r: Seekable) -> set[bytes]:
    """The repo's inodes (8-byte keys) the live state has records of, in any live table
    (each key begins with its inode): what shows of them is not what the repo has."""
    out: set[bytes] = set()
    for table in LIVE_TABLES:
        key = u64(1)
        while (found := r.seek(table, key)) is not None and found[0] < FIRST_UPPER_KEY:
            out.add(found[0][:8])
            key = u64(from_u64(found[0][:8]) + 1)
    return out


def node_from_stat(st: Stat, origin: bytes) -> Node:
    return Node(st.st_mode, st.st_uid, st.st_gid, st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink, st.st_rdev,
                origin, st.st_size if stat.S_ISREG(st.st_mode) else 0, 0, None)


_dir_ino = struct.Struct(">Q").unpack_from  # the directory's ino at the start of an `at` value


class LowerPaths:
    """ino -> lower path of every lower entry seen. Facts about the immutable lower, valid in
    every state: an entry the overlay moved is still where it was in the lower.

    An entry is kept as where it is in its lower directory, (directory ino, name) packed in
    one bytes object, and only directories keep their whole path: a path per entry cost
    28 MB at 200,000 files. `Parents` reads the same map (an entry the overlay did not move
    is named in the overlay as in the lower)."""

    __slots__ = ("at", "whole", "dir_inos", "from_c", "all_from_c")

    def __init__(self) -> None:
        self.at: dict[int, bytes] = {}  # ino -> u64(lower directory ino) + name
        # ino -> path: every directory, and an entry whose directory has no number
        self.whole: dict[int, bytes] = {ROOT_INO: b""}
        self.dir_inos: dict[bytes, int] = {b"": ROOT_INO}  # directory path -> ino
        # where an entry that only the FUSE adapter's C listed is (fuse/csrc/lowerdirs.c):
        # (directory ino, name, whether a directory), and all of them
        self.from_c: Callable[[int], tuple[int, bytes, bool] | None] | None = None
        self.all_from_c: Callable[[], list[tuple[int, int, bytes, bool]]] | None = None

    def get(self, ino: int) -> bytes | None:
        raw = self.at.get(ino)
        if raw is None:
            found = self.whole.get(ino)
            if found is None and self.from_c is not None and self.learn_from_c(ino):
                return self.get(ino)
            return found
        base = self.whole[_dir_ino(raw)[0]]  # (once per node of a lower file: no slice)
        return base + b"/" + raw[8:] if base else raw[8:]

    def learn_from_c(self, ino: int) -> bool:
        """Learn where ino is in the lower from C, which listed it (and so its directory)."""
        found = self.from_c(ino) if self.from_c is not None else None
        return found is not None and self._learn(ino, *found)

    def _learn(self, ino: int, parent: int, name: bytes, is_dir: bool) -> bool:
        base = self.whole.get(parent)  # (a directory's path: every one we know is there)
        if base is None and self.learn_from_c(parent):
            base = self.whole.get(parent)
        if base is None:
            return False
        self.at[ino] = u64(parent) + name
        if is_dir:
            path = base + b"/" + name if base else name
            self.whole[ino] = path
            self.dir_inos[path] = ino
        return True

    def __contains__(self, ino: int) -> bool:
        return ino in self.at or ino in self.whole

    def items(self) -> Iterator[tuple[int, bytes]]:
        if self.all_from_c is not None:
            for ino, parent, name, is_dir in self.all_from_c():
                if ino not in self:
                    self._learn(ino, parent, name, is_dir)  # (its directory first, if need be)
        for ino in self.whole.keys() | self.at.keys():
            yield ino, self.get(ino) or b""


class Parents:
    """ino -> (parent ino, name) as last seen, else where the lower has it: only an entry
    seen elsewhere than in the lower (moved, hard-linked, created) has its own, packed in
    one bytes object (a tuple costs 56 bytes more)."""

    __slots__ = ("_seen", "_lower", "_paths")

    def __init__(self, lower: LowerPaths) -> None:
        self._seen: dict[int, bytes] = {}
        self._lower = lower.at
        self._paths = lower

    @overload
    def get(self, ino: int) -> tuple[int, bytes] | None: ...
    @overload
    def get(self, ino: int, default: tuple[int, bytes]) -> tuple[int, bytes]: ...

    def get(self, ino: int, default: tuple[int, bytes] | None = None) -> tuple[int, bytes] | None:
        raw = self._seen.get(ino) or self._lower.get(ino)
        if raw is None and self._paths.from_c is not None and self._paths.learn_from_c(ino):
            raw = self._lower.get(ino)
        return default if raw is None else (from_u64(raw[:8]), raw[8:])

    def __setitem__(self, ino: int, where: tuple[int, bytes]) -> None:
        packed = u64(where[0]) + where[1]
        if self._lower.get(ino) == packed:
            self._seen.pop(ino, None)
        else:
            self._seen[ino] = packed


class Tree:
    """Resolve names, attributes and content of any state over the lower."""

    def __init__(self, lower: Lower, block_size: int) -> None:
        self.lower = lower
        self.bs = block_size
        # ino -> lower path, for lower entries that have no node record yet
        self.lower_paths = LowerPaths()
        # ino -> (parent ino, name) as last seen; to name paths in the journal
        self.parents = Parents(self.lower_paths)
        self._lower_files: OrderedDict[bytes, LowerFile] = OrderedDict()

    # -- identity -------------------------------------------------------------

    def ino_of_lower(self, st: Stat, path: bytes) -> int:
        if not path:
            return ROOT_INO
        ino = lower_ino(st.st_ino)
        if ino not in self.lower_paths:  # (the first path seen of a hard-linked file)
            self._learn_lower(ino, path, stat.S_ISDIR(st.st_mode))
        return ino

    def _learn_lower(self, ino: int, path: bytes, is_dir: bool) -> None:
        known = self.lower_paths
        parent_path, name = split(path)
        parent = known.dir_inos.get(parent_path)
        if parent is None:  # a directory reached through a record (moved), never looked up
            try:
                self.ino_of_lower(self.lower.stat(parent_path, False), parent_path)
            except FsError:
                pass
            parent = known.dir_inos.get(parent_path)
        if parent is None:
            known.whole[ino] = path
        else:
            known.at[ino] = u64(parent) + name
        if is_dir:
            known.whole[ino] = path
            known.dir_inos[path] = ino

    def path_of(self, ino: int) -> str:
        parts: list[bytes] = []
        for _ in range(4096):
            if ino == ROOT_INO:
                return os.fsdecode(b"/".join(reversed(parts)))
            up = self.parents.get(ino)
            if up is None:
                lp = self.lower_paths.get(ino)
                if lp is not None:
                    parts.append(lp)
                    return os.fsdecode(b"/".join(reversed(parts)))
                return f"<inode {ino}>"
            parts.append(up[1])
            ino = up[0]
        return f"<inode {ino}>"

    def child_path(self, parent: int, name: bytes) -> str:
        base = self.path_of(parent)
        return f"{base}/{os.fsdecode(name)}" if base else os.fsdecode(name)

    # -- attributes -----------------------------------------------------------

    def node(self, s: State, ino: int, siblings: bool = True) -> Node:
        """ino's attributes in state s. siblings: see Lower.stat."""
        raw = s.get(NODES, u64(ino))
        if raw is not None:
            return Node.unpack(raw)
        path = self.lower_paths.get(ino)
        if path is None:
            raise FsError(errno.ESTALE, f"unknown inode {ino}")
        return node_from_stat(self.lower.stat(path, siblings), path)

    def has_record(self, s: State, ino: int) -> bool:
        return s.get(NODES, u64(ino)) is not None

    def merges_lower(self, node: Node) -> bool:
        return node.origin is not None and not node.flags & F_OPAQUE

    def lower_has(self, pnode: Node, name: bytes) -> bool:
        """Whether the repo directory that pnode merges holds name (when in doubt: yes)."""
        try:
            self.lower.stat(join(pnode.origin or b"", name), siblings=False)
        except FsError as e:
            return e.errno not in (errno.ENOENT, errno.ENOTDIR)
        return True

    # -- names ----------------------------------------------------------------

    def lookup(self, s: State, parent: int, name: bytes, siblings: bool = True) -> int:
        """The inode at parent/name, or FsError(ENOENT). siblings: see Lower.stat."""
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if parent == ROOT_INO and name == CONTROL_NAME:
            raise enoent()
        raw = s.get(DIRENTS, dirent_key(parent, name))
        if raw is not None:
            if raw == WHITEOUT:
                raise enoent()
            ino = from_u64(raw)
            self.parents[ino] = (parent, name)
            return ino
        pnode = self.node(s, parent)
        if not pnode.is_dir:
            raise FsError(errno.ENOTDIR)
        if not self.merges_lower(pnode):
            raise enoent()
        path = join(pnode.origin or b"", name)
        try:
            st = self.lower.stat(path, siblings)
        except FsError as e:
            raise FsError(errno.ENOENT if e.errno in (errno.ENOENT, errno.ENOTDIR) else e.errno) from None
        ino = self.ino_of_lower(st, path)
        self.parents[ino] = (parent, name)
        return ino

    def entries(self, s: State, ino: int) -> list[tuple[bytes, int, Node | None]]:
        """Directory listing: (name, inode, node if already known) in a stable order."""
        node = self.node(s, ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        merged: dict[bytes, tuple[int, Node | None]] = {}
        if self.merges_lower(node):
            base = node.origin or b""
            for name, st in self.lower.listdir(base):
                path = join(base, name)
                child = self.ino_of_lower(st, path)
                merged[name] = (child, None if self.has_record(s, child) else node_from_stat(st, path))
        for key, val in s.prefix(DIRENTS, u64(ino)):
            name = key[8:]
            if val == WHITEOUT:
                merged.pop(name, None)
            else:
                merged[name] = (from_u64(val), None)
        if ino == ROOT_INO:
            merged.pop(CONTROL_NAME, None)
        out = []
        for name, (child, cnode) in sorted(merged.items()):
            self.parents[child] = (ino, name)
            out.append((name, child, cnode))
        return out

    def is_empty_dir(self, s: State, ino: int) -> bool:
        return not self.entries(s, ino)

    # -- content --------------------------------------------------------------

    def lower_file(self, origin: bytes) -> LowerFile:
        f = self._lower_files.get(origin)
        if f is None:
            f = self.lower.open_file(origin)
            self._lower_files[origin] = f
            if len(self._lower_files) > 128:
                self._lower_files.popitem(last=False)[1].close()
        else:
            self._lower_files.move_to_end(origin)
        return f

    def forget_lower_files(self) -> None:
        for f in self._lower_files.values():
            f.close()
        self._lower_files.clear()

    def _lower_bytes(self, origin: bytes, off: int, size: int) -> bytes:
        data = self.lower_file(origin).pread(size, off)
        return data if len(data) == size else data + bytes(size - len(data))

    def read(self, s: State, ino: int, node: Node, off: int, size: int) -> bytes:
        if not node.is_reg:
            raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)
        end = min(node.size, off + size)
        if off >= end:
            return b""
        if not self.has_record(s, ino):
            return self._lower_bytes(node.origin or b"", off, end - off)
        bs = self.bs
        out: list[bytes] = []
        lower_run = -1  # start offset of a run of lower-backed bytes not yet read
        pos = off
        while pos < end:
            bstart = pos - pos % bs
            stop = min(end, bstart + bs)
            digest = s.get(BMAP, bmap_key(ino, bstart // bs))
            if digest is None and node.origin is not None and pos < node.lower_valid:
                if lower_run < 0:
                    lower_run = pos
                lim = min(stop, node.lower_valid)
                if lim < stop:
                    out.append(self._lower_bytes(node.origin, lower_run, lim - lower_run))
                    out.append(bytes(stop - lim))
                    lower_run = -1
            else:
                if lower_run >= 0:
                    out.append(self._lower_bytes(node.origin or b"", lower_run, pos - lower_run))
                    lower_run = -1
                if digest is None:
                    out.append(bytes(stop - pos))
                else:
                    out.append(s.block(digest)[pos - bstart:stop - bstart])
            pos = stop
        if lower_run >= 0:
            out.append(self._lower_bytes(node.origin or b"", lower_run, end - lower_run))
        return b"".join(out)

    def read_all(self, s: State, ino: int, node: Node | None = None) -> bytes:
        node = node or self.node(s, ino)
        return self.read(s, ino, node, 0, node.size)

    def readlink(self, s: State, ino: int, node: Node) -> bytes:
        if not node.is_link:
            raise FsError(errno.EINVAL)
        if node.target is not None:
            return node.target
        return self.lower.readlink(node.origin or b"")

    # -- xattrs ---------------------------------------------------------------

    def xattrs(self, s: State, ino: int, node: Node) -> dict[bytes, bytes]:
        if node.flags & F_XATTRS_OWN or node.origin is None:
            return {k[8:]: v for k, v in s.prefix(XATTRS, u64(ino))}
        return self.lower.xattrs(node.origin)

    def getxattr(self, s: State, ino: int, node: Node, name: bytes) -> bytes:
        if node.flags & F_XATTRS_OWN or node.origin is None:
            val = s.get(XATTRS, xattr_key(ino, name))
        else:
            val = self.lower.xattrs(node.origin).get(name)
        if val is None:
            raise FsError(errno.ENODATA)
        return val

    # -- ancestry -------------------------------------------------------------

    def ancestors(self, s: State, ino: int, out: set[int] | None = None) -> set[int]:
        """The directories above ino in state s (to prune walks to what changed), added to
        out; a walk stops at a directory already there, as its ancestors are too.

        A node record carries a parent hint. An inode without one is a lower entry
        that never moved (moving it would have given it a record), so its parent is
        the lower directory above its lower path.
        """
        out = set() if out is None else out
        lower_path = self.lower_paths.get(ino)
        for _ in range(4096):
            if ino == ROOT_INO:
                break
            raw = s.get(NODES, u64(ino))
            node = Node.unpack(raw) if raw else None
            parent = (node.parent if node else 0) or self.parents.get(ino, (0, b""))[0]
            origin = node.origin if node else lower_path
            if not parent and origin:
                parent_path = origin.rpartition(b"/")[0]
                try:
                    parent = self.ino_of_lower(self.lower.stat(parent_path, False), parent_path)
                except FsError:
                    parent = 0
                lower_path = parent_path
            elif origin is not None and parent:
                lower_path = origin.rpartition(b"/")[0]
            if not parent or parent in out:
                break
            out.add(parent)
            ino = parent
            if lower_path is not None:
                known = self.lower_paths.get(ino)
                lower_path = lower_path if known is None else known
        out.add(ROOT_INO)
        return out

    # -- walking --------------------------------------------------------------

    def walk(self, s: State, ino: int = ROOT_INO, prefix: str = ""
             ) -> Iterator[tuple[str, int, Node]]:
        """Every entry below ino, parents before children, as (path, ino, node)."""
        for name, child, cnode in self.entries(s, ino):
            node = cnode or self.node(s, child)
            path = f"{prefix}{os.fsdecode(name)}"
            yield path, child, node
            if node.is_dir:
                yield from self.walk(s, child, path + "/")

    def resolve(self, s: State, path: str) -> int:
        """The inode at a path relative to the root, never following symlinks."""
        if "\0" in path:
            raise FsError(errno.EINVAL, "a path cannot contain a NUL byte")
        ino = ROOT_INO
        for part in path.strip("/").split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                raise FsError(errno.EINVAL, "'..' is not allowed in a path")
            ino = self.lookup(s, ino, os.fsencode(part))
        return ino
