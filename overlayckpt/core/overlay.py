"""The live overlay: every mutating filesystem operation, captured before it lands.

Each operation runs inside one store write transaction (`Overlay._mutate`):
it reads what it is about to replace, stores the previous content of every
block it touches (read from the lower or the store) under its blake3 digest,
records (table, key, previous value) undo entries, changes the live tables
and appends its journal record, and all of that commits atomically. Nothing
here awaits, so an operation is never interleaved with another one.

Deleted or overwritten inodes keep their node record and block map: history
may restore them, and gc drops them once nothing refers to them.
"""
from __future__ import annotations

import errno
import stat
from collections.abc import Callable, Iterator
from typing import TypeVar

import trio

from overlayckpt.core import groupfiles, history
from overlayckpt.core.baseline import seen_key, seen_record, seen_value
from overlayckpt.core.journal import Caller, append, ensure_origin_checkpoint, now_ns
from overlayckpt.core.lower import Lower
from overlayckpt.core.tree import State, Tree
from overlayckpt.errors import FsError
from overlayckpt.messages import Change
from overlayckpt.records import (
    CONTROL_NAME,
    F_OPAQUE,
    F_XATTRS_OWN,
    FIRST_UPPER_INO,
    NAME_MAX,
    ROOT_INO,
    T_BMAP,
    T_DIRENTS,
    T_NODES,
    T_XATTRS,
    TABLE_NAMES,
    WHITEOUT,
    ZERO_BLOCK,
    Node,
    bmap_key,
    dirent_key,
    from_u64,
    u64,
    xattr_key,
)
from overlayckpt.store.lmdbstore import ReaderStore, Store
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import BMAP, DIRENTS, META, NEXT_INO_KEY, REMOVALS_KEY, SEEN, WRITE_BEHIND_KEY, XATTRS

T = TypeVar("T")

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def create_op(mode: int) -> str:
    """The journal's name of a create of an inode of this mode."""
    return "mkdir" if stat.S_ISDIR(mode) else "symlink" if stat.S_ISLNK(mode) else "create"


class Mutation:
    """A write transaction that remembers the first previous value of every key."""

    def __init__(self, w: WriteTxn) -> None:
        self.w = w
        self.undo: list[tuple[int, bytes, bytes | None]] = []
        self._seen: set[tuple[int, bytes]] = set()
        self.paths: list[str] = []
        self.changes: list[str] = []
        self.nodes: dict[bytes, bytes | None] = {}  # NODES key -> the record as put last

    # State protocol, so Tree can read through the transaction.
    def get(self, table: bytes, key: bytes) -> bytes | None:
        return self.w.get(table, key)

    def prefix(self, table: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.w.prefix(table, prefix)

    def block(self, digest: bytes) -> bytes:
        return self.w.block(digest)

    def _remember(self, table: int, key: bytes, prev: bytes | None, explicit: bool) -> None:
        if (table, key) in self._seen:
            return
        self._seen.add((table, key))
        if not explicit:
            prev = self.w.get(TABLE_NAMES[table], key)
        self.undo.append((table, key, prev))

    def put(self, table: int, key: bytes, value: bytes, prev: bytes | None = None,
            explicit_prev: bool = False) -> None:
        self._remember(table, key, prev, explicit_prev)
        self.w.put(TABLE_NAMES[table], key, value)
        if table == T_NODES:
            self.nodes[key] = value

    def put_many(self, table: int, items: list[tuple[bytes, bytes]], prevs: list[bytes | None]) -> None:
        """put for each of items (in key order), with its previous value given (not of nodes)."""
        for (key, _), prev in zip(items, prevs):
            self._remember(table, key, prev, True)
        self.w.put_many(TABLE_NAMES[table], items)

    def delete_many(self, table: int, keys: list[bytes], prevs: list[bytes | None]) -> None:
        """delete for each of keys (in key order), with its previous value given (not of nodes)."""
        for key, prev in zip(keys, prevs):
            self._remember(table, key, prev, True)
        self.w.delete_many(TABLE_NAMES[table], keys)

    def delete(self, table: int, key: bytes, prev: bytes | None = None,
               explicit_prev: bool = False) -> None:
        self._remember(table, key, prev, explicit_prev)
        self.w.delete(TABLE_NAMES[table], key)
        if table == T_NODES:
            self.nodes[key] = None

    def put_node(self, ino: int, node: Node) -> None:
        self.put(T_NODES, u64(ino), node.pack())

    def touched(self, path: str, change: str) -> None:
        self.paths.append(path)
        self.changes.append(change)


class Overlay(Tree):
    """The live tree plus every operation that changes it."""

    def __init__(self, store: Store, lower: Lower, window: float = 1.0) -> None:
        super().__init__(lower, store.block_size)
        self.store = store
        self.window = window
        self.last_written: dict[bytes, bytes | None] = {}  # (written)
        if isinstance(store, ReaderStore):  # (another process's store: its daemon set it up)
            return
        def set_up(w: WriteTxn) -> None:
            ensure_origin_checkpoint(w)
            # the derived tables, where missing (an older format, an import, a recovery):
            # one pass over the journal each
            history.ensure(w)
            groupfiles.ensure(w)
        store.write(set_up)

    # -- plumbing -------------------------------------------------------------

    def _mutate(self, caller: Caller, op: str, fn: Callable[[Mutation], T]) -> T:
        return self.store.write(self.journaled(caller, op, fn))

    def journaled(self, caller: Caller, op: str, fn: Callable[[Mutation], T]) -> Callable[[WriteTxn], T]:
        """The transaction of one operation: fn, then its journal record."""
        def txn(w: WriteTxn) -> T:
            m = Mutation(w)
            result = fn(m)
            if m.undo:
                append(w, caller, op, tuple(m.paths), tuple(m.changes), m.undo, self.window)
            self.last_written = m.nodes
            return result
        return txn

    def written(self, ino: int) -> Node | None:
        """ino's node record as the operation that returned last wrote it (None: it wrote
        none): what a read right after would find, without the read."""
        raw = self.last_written.get(u64(ino))
        return None if raw is None else Node.unpack(raw)

    def wrote_a_directory(self, besides: set[int]) -> bool:
        """Whether the operation that returned last wrote or deleted the node of an inode
        not in besides that is (or may have been) a directory."""
        return any(raw is None or Node.unpack(raw).is_dir
                   for key, raw in self.last_written.items() if from_u64(key) not in besides)

    def live(self, fn: Callable[[ReadTxn], T]) -> T:
        """Read the live state (through a read transaction)."""
        return self.store.read(fn)

    def peek(self, fn: Callable[[ReadTxn], T]) -> T:
        """Read the live state but for the writes deferred (write_later): for a read that
        touches no inode they write, which the caller checks (Store.deferring)."""
        return self.store.peek(fn)

    def _own(self, m: Mutation, ino: int) -> Node:
        """The node record of ino, created from the lower entry if it has none yet."""
        # (one stat, not its directory's listing: the files written first in a
        # directory are a few, where a walk that lists it looks at them all)
        node = self.node(m, ino, siblings=False)
        if not self.has_record(m, ino):
            node.parent = self.parents.get(ino, (0, b""))[0]
            m.put_node(ino, node)
            if node.origin is not None and not node.is_dir:
                # what the repo held when we first changed it: apply checks it is still so
                key = seen_key(node.origin)
                if m.get(SEEN, key) is None:
                    m.w.put(SEEN, key, seen_value(key, node.origin, seen_record(self.lower, ino, node)))
        return node

    def _save(self, m: Mutation, ino: int, node: Node, *, ctime: bool = True, mtime: bool = False,
              t: int | None = None) -> None:
        t = now_ns() if t is None else t
        if ctime:
            node.ctime_ns = t
        if mtime:
            node.mtime_ns = t
        m.put_node(ino, node)

    def dir_node(self, m: State, ino: int) -> Node:
        node = self.node(m, ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def existing(self, m: State, parent: int, name: bytes) -> int | None:
        """The inode parent/name names, or None if it names none."""
        try:
            return self.lookup(m, parent, name)
        except FsError as e:
            if e.errno == errno.ENOENT:
                return None
            raise

    def check_name(self, parent: int, name: bytes) -> None:
        if parent == ROOT_INO and name == CONTROL_NAME:
            raise FsError(errno.EPERM, "the control directory is reserved")
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)

    def _link_entry(self, m: Mutation, parent: int, name: bytes, ino: int) -> None:
        m.put(T_DIRENTS, dirent_key(parent, name), u64(ino))
        self.parents[ino] = (parent, name)
        node = self.node(m, ino)
        if node.parent != parent:
            node.parent = parent
            m.put_node(ino, node)

    def _unlink_entry(self, m: Mutation, parent: int, pnode: Node, name: bytes) -> None:
        key = dirent_key(parent, name)
        if self.merges_lower(pnode) and self.lower_has(pnode, name):
            m.put(T_DIRENTS, key, WHITEOUT)  # hides the repo's entry of that name
        elif m.get(DIRENTS, key) is not None:
            # (a name the repo lacks needs no whiteout: an editor's temporary files would
            # leave one each, for the listings to skip and restores to carry)
            m.delete(T_DIRENTS, key)

    @staticmethod
    def inherited(pnode: Node, mode: int, gid: int) -> tuple[int, int]:
        """The mode and group of a new inode in directory pnode (its set-group-ID passes on)."""
        if pnode.mode & stat.S_ISGID:
            return (mode | stat.S_ISGID if stat.S_ISDIR(mode) else mode), pnode.gid
        return mode, gid

    @staticmethod
    def new_node(mode: int, uid: int, gid: int, t: int, rdev: int = 0, target: bytes | None = None) -> Node:
        is_dir = stat.S_ISDIR(mode)
        return Node(mode, uid, gid, len(target) if target else 0, t, t, t, 2 if is_dir else 1, rdev,
                    None, 0, F_XATTRS_OWN | (F_OPAQUE if is_dir else 0), target)

    def _touch_parent(self, m: Mutation, parent: int, nlink_delta: int = 0, t: int | None = None) -> Node:
        pnode = self._own(m, parent)
        pnode.nlink += nlink_delta
        self._save(m, parent, pnode, mtime=True, t=t)
        return pnode

    # -- namespace ------------------------------------------------------------

    def create(self, caller: Caller, parent: int, name: bytes, mode: int, uid: int, gid: int,
               rdev: int = 0, target: bytes | None = None) -> tuple[int, Node]:
        """create, mknod, mkdir and symlink: a new inode at parent/name."""
        self.check_name(parent, name)

        def fn(m: Mutation) -> tuple[int, Node]:
            made_mode, made_gid = self.inherited(self.dir_node(m, parent), mode, gid)
            return self.made(parent, name, None, self.new_node(made_mode, uid, made_gid, now_ns(), rdev, target),
                             None)(m)
        return self._mutate(caller, create_op(mode), fn)

    def make(self, caller: Caller, parent: int, name: bytes, ino: int, node: Node, logged: bytes) -> None:
        """Store a create answered before it was stored (a replay: core/answered.py)."""
        self._mutate(caller, create_op(node.mode), self.made(parent, name, ino, node, logged))

    def made(self, parent: int, name: bytes, ino: int | None, node: Node, logged: bytes | None
             ) -> Callable[[Mutation], tuple[int, Node]]:
        """A create's change: node linked in at parent/name, numbered ino (None: the next
        number; else the number it was answered with: core/answered.py, which logged it
        as logged)."""
        def fn(m: Mutation) -> tuple[int, Node]:
            self.dir_node(m, parent)
            if self.existing(m, parent, name) is not None:
                raise FsError(errno.EEXIST)
            number = m.w.next_counter(NEXT_INO_KEY, FIRST_UPPER_INO)
            if ino is not None:
                if self.has_record(m, ino):  # (only if another thread made inodes meanwhile)
                    raise FsError(errno.EIO, f"inode {ino} was answered and then taken")
                m.w.set_meta_int(NEXT_INO_KEY, max(number, ino + 1))
                number = ino
            m.put_node(number, node)
            self._link_entry(m, parent, name, number)
            self._touch_parent(m, parent, 1 if node.is_dir else 0, node.mtime_ns)
            m.touched(self.child_path(parent, name), Change.ADDED)
            if logged is not None:
                m.w.put(META, REMOVALS_KEY, logged)
            return number, node
        return fn

    def link(self, caller: Caller, ino: int, parent: int, name: bytes) -> Node:
        self.check_name(parent, name)

        def fn(m: Mutation) -> Node:
            self.dir_node(m, parent)
            if self.existing(m, parent, name) is not None:
                raise FsError(errno.EEXIST)
            node = self._own(m, ino)
            if node.is_dir:
                raise FsError(errno.EPERM)
            node.nlink += 1
            self._save(m, ino, node)
            self._link_entry(m, parent, name, ino)
            self._touch_parent(m, parent)
            m.touched(self.child_path(parent, name), Change.ADDED)
            return node
        return self._mutate(caller, "link", fn)

    def remove(self, caller: Caller, parent: int, name: bytes, is_rmdir: bool, *,
               logged: bytes | None = None, t: int | None = None) -> int:
        """unlink and rmdir. Returns the inode that lost a name. logged: the removal log's
        mark of this removal (answered.py); t: its time (now)."""
        return self._mutate(caller, "rmdir" if is_rmdir else "unlink",
                            self.removal(parent, name, is_rmdir, logged, now_ns() if t is None else t))

    def removal(self, parent: int, name: bytes, is_rmdir: bool, logged: bytes | None,
                t: int) -> Callable[[Mutation], int]:
        def fn(m: Mutation) -> int:
            pnode = self.dir_node(m, parent)
            ino = self.lookup(m, parent, name)
            node = self._own(m, ino)
            if is_rmdir:
                if not node.is_dir:
                    raise FsError(errno.ENOTDIR)
                if not self.is_empty_dir(m, ino):
                    raise FsError(errno.ENOTEMPTY)
                node.nlink = 0
            else:
                if node.is_dir:
                    raise FsError(errno.EISDIR)
                node.nlink -= 1
            path = self.child_path(parent, name)
            self._save(m, ino, node, t=t)
            self._unlink_entry(m, parent, pnode, name)
            self._touch_parent(m, parent, -1 if is_rmdir else 0, t)
            m.touched(path, Change.DELETED)
            if logged is not None:
                m.w.put(META, REMOVALS_KEY, logged)
            return ino
        return fn

    def rename(self, caller: Caller, p1: int, n1: bytes, p2: int, n2: bytes, flags: int) -> int | None:
        """rename(2) incl. RENAME_NOREPLACE and RENAME_EXCHANGE. Returns the replaced inode."""
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == RENAME_NOREPLACE | RENAME_EXCHANGE:
            # e.g. RENAME_WHITEOUT: doing a plain rename instead would silently differ from Linux
            raise FsError(errno.EINVAL, f"unsupported rename flags {flags:#x}")
        self.check_name(p2, n2)
        self.check_name(p1, n1)

        def fn(m: Mutation) -> int | None:
            pn1 = self.dir_node(m, p1)
            self.dir_node(m, p2)
            src = self.lookup(m, p1, n1)
            dst = self.existing(m, p2, n2)
            snode = self._own(m, src)
            old_path, new_path = self.child_path(p1, n1), self.child_path(p2, n2)
            if flags & RENAME_EXCHANGE:
                if dst is None:
                    raise FsError(errno.ENOENT)
                dnode = self._own(m, dst)
                self._link_entry(m, p1, n1, dst)
                self._link_entry(m, p2, n2, src)
                if p1 != p2 and snode.is_dir != dnode.is_dir:
                    delta = 1 if snode.is_dir else -1
                    self._touch_parent(m, p1, -delta)
                    self._touch_parent(m, p2, delta)
                else:
                    self._touch_parent(m, p1)
                    if p2 != p1:
                        self._touch_parent(m, p2)
                snode.parent, dnode.parent = p2, p1
                self._save(m, src, snode)
                self._save(m, dst, dnode)
                m.touched(new_path, Change.RENAMED)
                m.touched(old_path, Change.RENAMED)
                return None
            if dst is not None:
                if flags & RENAME_NOREPLACE:
                    raise FsError(errno.EEXIST)
                if dst == src:
                    return None  # both names are links of one file: POSIX says do nothing
                dnode = self._own(m, dst)
                if snode.is_dir and not dnode.is_dir:
                    raise FsError(errno.ENOTDIR)
                if not snode.is_dir and dnode.is_dir:
                    raise FsError(errno.EISDIR)
                if dnode.is_dir and not self.is_empty_dir(m, dst):
                    raise FsError(errno.ENOTEMPTY)
                dnode.nlink = 0 if dnode.is_dir else dnode.nlink - 1
                self._save(m, dst, dnode)
                if dnode.is_dir:
                    self._touch_parent(m, p2, -1)
            self._unlink_entry(m, p1, pn1, n1)
            self._link_entry(m, p2, n2, src)
            if snode.is_dir and p1 != p2:
                self._touch_parent(m, p1, -1)
                self._touch_parent(m, p2, 1)
            else:
                self._touch_parent(m, p1)
                if p2 != p1:
                    self._touch_parent(m, p2)
            snode.parent = p2
            self._save(m, src, snode)
            # an atomic save modifies
            m.touched(new_path, Change.MODIFIED if dst is not None else Change.RENAMED)
            m.touched(old_path, Change.BEFORE)
            return dst
        return self._mutate(caller, "rename", fn)

    # -- attributes -----------------------------------------------------------

    def setattr(self, caller: Caller, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None) -> Node:
        def fn(m: Mutation) -> Node:
            node = self._own(m, ino)
            if size is not None:
                if not node.is_reg:
                    raise FsError(errno.EISDIR if node.is_dir else errno.EINVAL)
                self._truncate(m, ino, node, size)
            if mode is not None:
                node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
            if uid is not None:
                node.uid = uid
            if gid is not None:
                node.gid = gid
            if atime_ns is not None:
                node.atime_ns = atime_ns
            if mtime_ns is not None:
                node.mtime_ns = mtime_ns
            self._save(m, ino, node, mtime=size is not None and mtime_ns is None)
            m.touched(self.path_of(ino), Change.MODIFIED)
            return node
        return self._mutate(caller, "truncate" if size is not None else "setattr", fn)

    def setxattr(self, caller: Caller, ino: int, name: bytes, value: bytes | None) -> None:
        """Set (value) or remove (None) one extended attribute."""
        def fn(m: Mutation) -> None:
            node = self._own(m, ino)
            if not node.flags & F_XATTRS_OWN:
                for k, v in self.xattrs(m, ino, node).items():
                    m.put(T_XATTRS, xattr_key(ino, k), v)
                node.flags |= F_XATTRS_OWN
            key = xattr_key(ino, name)
            if value is None:
                if m.get(XATTRS, key) is None:
                    raise FsError(errno.ENODATA)
                m.delete(T_XATTRS, key)
            else:
                m.put(T_XATTRS, key, value)
            self._save(m, ino, node)
            m.touched(self.path_of(ino), Change.MODIFIED)
        self._mutate(caller, "setxattr" if value is not None else "removexattr", fn)

    # -- content --------------------------------------------------------------

    def _current_block(self, m: Mutation, ino: int, node: Node, blockno: int) -> tuple[bytes | None, bytes]:
        """(bmap value now, digest of the block's current content, captured into the store)."""
        return self._current(m, ino, node, blockno)[0]

    def _current(self, m: Mutation, ino: int, node: Node, blockno: int
                 ) -> tuple[tuple[bytes | None, bytes], bytes | None]:
        """_current_block, and the block's content if it was read from the repo to capture
        it (a first write patches it without reading it back from the store)."""
        key = bmap_key(ino, blockno)
        raw = m.get(BMAP, key)
        if raw is not None:
            return (raw, raw), None
        off = blockno * self.bs
        if node.origin is not None and off < node.lower_valid:
            n = min(self.bs, node.lower_valid - off)
            data = self._lower_bytes(node.origin, off, n) + bytes(self.bs - n)
            return (None, m.w.put_block(data)), data
        return (None, ZERO_BLOCK), None

    def _set_block(self, m: Mutation, ino: int, node: Node, blockno: int, data: bytes,
                   current: tuple[bytes | None, bytes] | None = None) -> None:
        """Point one block at new content, capturing the old first (blocks dropped: in
        _truncate)."""
        now, captured = current or self._current_block(m, ino, node, blockno)
        prev = captured if now is None and captured != ZERO_BLOCK else now
        m.put(T_BMAP, bmap_key(ino, blockno), m.w.put_block(data), prev, explicit_prev=True)

    def _set_whole_blocks(self, m: Mutation, ino: int, node: Node, first: int, data: bytes) -> None:
        """_set_block for each block of data (whole blocks from block first on), their bmap
        entries read in one pass and written in one call: a big write's blocks."""
        bs = self.bs
        count = len(data) // bs
        keys = [bmap_key(ino, first + i) for i in range(count)]
        stored = {from_u64(k[8:]): v for k, v in m.w.items_between(BMAP, keys[0], keys[-1])}
        held = self._held(m, node, stored, first, first + count)  # (the repo's: first)
        digests = m.w.put_blocks(data[i * bs:(i + 1) * bs] for i in range(count))
        m.put_many(T_BMAP, list(zip(keys, digests)), [held.get(first + i) for i in range(count)])

    def _held(self, m: Mutation, node: Node, stored: dict[int, bytes], first: int,
              end: int) -> dict[int, bytes]:
        """What blocks first to end - 1 hold before a write or a truncate replaces or drops
        them: stored, their bmap entries (by block number), and the repo's blocks among
        the others, captured (_capture_repo), but for those of zeros (no entry reads the
        same: nothing held)."""
        repo_to = min(end, -(-node.lower_valid // self.bs)) if node.origin is not None else first
        repo = [b for b in range(first, repo_to) if b not in stored]
        captured = zip(repo, self._capture_repo(m, node, repo))
        return stored | {b: digest for b, digest in captured if digest != ZERO_BLOCK}

    def _capture_repo(self, m: Mutation, node: Node, blocks: list[int]) -> list[bytes]:
        """The digests of these blocks (ascending) of node's repo file as it is now, stored
        (as _current each): one read and one run stored per run of neighbours (at most 1
        MiB held: a truncate may drop gigabytes)."""
        bs, digests = self.bs, []
        for run in _runs(blocks):
            off = run[0] * bs
            n = min(len(run) * bs, node.lower_valid - off)
            data = self._lower_bytes(node.origin or b"", off, n) + bytes(len(run) * bs - n)
            digests += m.w.put_blocks(data[i * bs:(i + 1) * bs] for i in range(len(run)))
        return digests

    def _patch_block(self, m: Mutation, ino: int, node: Node, blockno: int, lo: int, piece: bytes) -> None:
        bs = self.bs
        if lo == 0 and len(piece) == bs:
            self._set_block(m, ino, node, blockno, piece)
            return
        current, data = self._current(m, ino, node, blockno)
        base = bytearray(m.w.block(current[1]) if data is None else data)
        base[lo:lo + len(piece)] = piece
        self._set_block(m, ino, node, blockno, bytes(base), current)

    def _truncate(self, m: Mutation, ino: int, node: Node, size: int) -> None:
        bs = self.bs
        if size < node.size:
            first_gone = -(-size // bs)
            # only blocks that hold something: stored ones, and those still the repo's
            # (a sparse file's holes cost nothing to cut)
            last = bmap_key(ino, (1 << 64) - 1)
            stored = {from_u64(k[8:]): v for k, v in m.w.items_between(BMAP, bmap_key(ino, first_gone), last)}
            held = self._held(m, node, stored, first_gone, -(-node.size // bs))
            gone = sorted(held)
            m.delete_many(T_BMAP, [bmap_key(ino, b) for b in gone], [held[b] for b in gone])
            if size % bs:
                # zero the tail so a later extension reads zeros, as POSIX wants
                self._patch_block(m, ino, node, size // bs, size % bs, bytes(bs - size % bs))
            node.lower_valid = min(node.lower_valid, size)
        node.size = size

    def write(self, caller: Caller, ino: int, off: int, data: bytes, *,
              logged: bytes | None = None) -> int:
        """logged: the write-behind log's position after this write (writebehind.py)."""
        return self._mutate(caller, "write", self._write(ino, off, data, logged))

    def write_later(self, caller: Caller, ino: int, off: int, data: bytes, logged: bytes,
                    failed: Callable[[Exception], None], since: int = 0) -> None:
        """A write its writer was told is done (write-behind), stored with the next write
        transaction or when ino is read (Store.defer); failed(e) if it fails on its own.
        since: when its request arrived (Store.on_deferred_stored)."""
        self.store.defer(self.journaled(caller, "write", self._write(ino, off, data, logged)), failed, (ino,),
                         len(data), since)

    def _write(self, ino: int, off: int, data: bytes, logged: bytes | None) -> Callable[[Mutation], int]:
        def fn(m: Mutation) -> int:
            node = self._own(m, ino)
            if not node.is_reg:
                raise FsError(errno.EINVAL)
            bs = self.bs
            pos, end = off, off + len(data)
            whole_from, whole_to = -(-off // bs), end // bs  # the blocks data covers whole
            if whole_to - whole_from > 1:
                if off % bs:
                    self._patch_block(m, ino, node, off // bs, off % bs, data[:bs - off % bs])
                start = whole_from * bs - off
                self._set_whole_blocks(m, ino, node, whole_from, data[start:start + (whole_to - whole_from) * bs])
                pos = whole_to * bs
            while pos < end:
                bstart = pos - pos % bs
                stop = min(end, bstart + bs)
                self._patch_block(m, ino, node, bstart // bs, pos - bstart, data[pos - off:stop - off])
                pos = stop
            if end > node.size:
                node.size = end
            self._save(m, ino, node, mtime=True)
            m.touched(self.path_of(ino), Change.MODIFIED)
            if logged is not None:
                m.w.put(META, WRITE_BEHIND_KEY, logged)
            return len(data)
        return fn


def _runs(blocks: list[int]) -> Iterator[list[int]]:
    """Ascending block numbers as runs of neighbours, at most 256 blocks each (1 MiB)."""
    run: list[int] = []
    for b in blocks:
        if run and (b != run[-1] + 1 or len(run) == 256):
            yield run
            run = []
        run.append(b)
    if run:
        yield run


async def make_durable(store: Store) -> None:
    """A sync point (store.py), its fdatasync off the request loop: it may take long."""
    point = store.sync_begin()
    if point is not None:
        await trio.to_thread.run_sync(store.sync_flush, point)
    store.sync_end()


class Batch(Overlay):
    """An overlay whose operations all run in one given Mutation: several operations that
    commit together, journaled by the caller as one record (a backout). It shares the
    overlay's caches, and never opens a transaction of its own."""

    def __init__(self, ov: Overlay, m: Mutation) -> None:  # (not Overlay's: no set-up again)
        self.__dict__.update(vars(ov))
        self.m = m

    def _mutate(self, caller: Caller, op: str, fn: Callable[[Mutation], T]) -> T:
        return fn(self.m)


async def keep_up(store: Store, gate: trio.Lock) -> None:
    """Before a request writes: if writers have got too far ahead of the sync point under
    way (Store.too_far_ahead), wait for it off the request loop. Only the requests that
    write wait, each behind those that came before it (gate: the server's one lock).
    The server sets store.writes_wait off, so the store itself never waits on the loop."""
    if not (gate.locked() or store.too_far_ahead()):
        return
    async with gate:
        while store.too_far_ahead():
            await trio.to_thread.run_sync(store.wait_flush)
            store.finish_flush()
