"""Writing the live state (or a checkpoint) into the repo.

Only directories that hold something the overlay changed are visited (the
ancestors of every inode with a node record and of every directory with
dirents), so apply costs what changed, not the size of the repo.

Before apply changes or removes any entry of the repo as the session first
saw it, that entry is *pinned*: its attributes, its content (as blocks) or its
listing go into the `pinned` table, and lower.py answers for that path from
the pin from then on. So every checkpoint that still refers to the original
repo keeps seeing it exactly, after any number of applies.

Every write goes through the repo's directory fd with *at() calls and
O_NOFOLLOW, never following a symlink out of the repo.
"""
from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any


from overlayckpt.core import history
from overlayckpt.core.context import Context
from overlayckpt.errors import FsError, UserError
from overlayckpt.core.lower import Pin, PinLookup, PinStat, join, lstat_beneath, openat2_beneath
from overlayckpt.core.seen import is_git_index, repo_digest, seen_key, seen_path, seen_value
from overlayckpt.records import (
    CONTROL_NAME, ROOT_INO, T_DIRENTS, T_NODES, Node, from_u64, lower_ino, pack_obj, path_cut,
    path_key, unpack_obj,
)
from overlayckpt.store.lmdbstore import ReadTxn, Store
from overlayckpt.store.synced import pwrite_all
from overlayckpt.tables import APPLIED_KEY, DIRENTS, NODES, PINNED, SEEN, SEQ_KEY



def pin_key(path: bytes) -> bytes:
    return path_key(b"/", path)  # LMDB keys cannot be empty, and the root's path is b""


def pinned_path(key: bytes, rec: dict[str, Any]) -> bytes:
    """The path of the pin at key (rec: its record, which keeps a path too long for a key)."""
    return rec["path"] if path_cut(key, 1) else key[1:]


def pin_lookup(store: Store) -> PinLookup | None:
    if store.read(lambda r: r.count(PINNED)) == 0:
        return None
    bs = store.block_size

    def lookup(path: bytes) -> Pin | None:
        raw = store.read(lambda r: r.get(PINNED, pin_key(path)))
        if raw is None:
            return None
        rec = unpack_obj(raw)
        st = PinStat(*rec["st"])
        read: Callable[[int, int], bytes] | None = None
        if rec.get("blocks") is not None:
            blocks: list[bytes] = rec["blocks"]
            size = st.st_size

            def read_pinned(n: int, off: int) -> bytes:
                end = min(size, off + n)
                if off >= end:
                    return b""
                out = []
                pos = off
                while pos < end:
                    b = pos // bs
                    stop = min(end, (b + 1) * bs)
                    data = store.read(lambda r: r.block(blocks[b]))
                    out.append(data[pos - b * bs:stop - b * bs])
                    pos = stop
                return b"".join(out)
            read = read_pinned
        entries = rec.get("entries")
        return Pin(st, None if entries is None else set(entries), read, rec.get("target"), rec.get("xattrs") or {})
    return lookup


class Applier:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.ov = ctx.overlay
        self.lower = ctx.lower
        self.fd = ctx.lower.fd
        self.written: dict[int, bytes] = {}  # inode -> path already written (hard links)
        self.stats = {"written": 0, "removed": 0, "pinned": 0}

    # -- pinning ----------------------------------------------------------------

    def _pin(self, path: bytes, recursive: bool) -> None:
        """Keep the original lower entry at path in the store before it changes."""
        store = self.ctx.store
        if store.read(lambda r: r.get(PINNED, pin_key(path))) is not None:
            return
        try:
            st = self.lower.stat(path)  # the original (already pinned parts answer from pins)
        except FsError:
            return  # not part of the original lower: nothing to keep
        if self.lower.pins is not None and self.lower.pins(path) is not None:
            return
        rec: dict[str, Any] = {"st": PinStat.fields(st), "xattrs": self.lower.xattrs(path)}
        if stat.S_ISDIR(st.st_mode):
            entries = self.lower.listdir(path)
            rec["entries"] = [name for name, _ in entries]
            if recursive:
                for name, _ in entries:
                    self._pin(join(path, name), True)
        elif stat.S_ISLNK(st.st_mode):
            rec["target"] = self.lower.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            f = self.lower.open_file(path)
            try:
                bs = store.block_size
                blocks: list[bytes] = []
                for off in range(0, st.st_size, bs):
                    data = f.pread(bs, off)
                    data += bytes(bs - len(data))
                    blocks.append(store.write(lambda w, d=data: w.put_block(d)))
                rec["blocks"] = blocks
            finally:
                f.close()
        key = pin_key(path)
        if path_cut(key, 1):
            rec["path"] = path
        raw = pack_obj(rec)
        store.write(lambda w: w.put(PINNED, key, raw))
        self.stats["pinned"] += 1
        if self.lower.pins is None:
            self.lower.pins = pin_lookup(store)

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
        for ino in set(dirs) | set(extra_dirs):
            out.add(ino)
            out |= self.ov.ancestors(state, ino)
        return out

    def apply(self, state: Any, extra_nodes: list[int], extra_dirs: list[int],
              force: bool = False) -> dict[str, int]:
        if not force:
            self.refuse_conflicts(state)
        dirty = self.dirty_dirs(state, extra_nodes, extra_dirs)
        self._sync_dir(state, ROOT_INO, b"", dirty, force=False)
        self.lower_reset()
        self.remember_repo()
        return self.stats

    # -- conflicts with changes made to the repo itself -------------------------

    def _seen(self) -> list[tuple[bytes, list[int]]]:
        def fn(r: ReadTxn) -> list[tuple[bytes, list[Any]]]:
            records = ((k, unpack_obj(v)) for k, v in r.range_from(SEEN))
            return [(seen_path(k, rec), rec) for k, rec in records]
        return self.ctx.store.read(fn)

    def refuse_conflicts(self, state: Any) -> None:
        """Refuse to overwrite a file that changed in the repo since the session first
        changed it, unless the result would be the same bytes anyway."""
        conflicts = []
        for path, seen in self._seen():
            real = lstat_beneath(self.fd, path)
            if seen[:3] != seen_fingerprint(real):
                why = self._conflict(state, path, seen, real)
                if why is not None:
                    conflicts.append(why)
        if conflicts:
            more = f"; and {len(conflicts) - 3} more" if len(conflicts) > 3 else ""
            raise UserError(f"the repo itself changed since the session first changed these "
                            f"files ({'; '.join(conflicts[:3])}{more}): applying would overwrite "
                            "that; save those changes, or apply --force")

    def _conflict(self, state: Any, path: bytes, seen: list[Any], real: os.stat_result | None
                  ) -> str | None:
        """What differs in the repo's copy of path (None: nothing an apply would lose)."""
        name = os.fsdecode(path)
        if real is None:
            return f"{name} was removed in the repo"
        if not stat.S_ISREG(real.st_mode):
            return f"{name} is no longer a regular file in the repo"
        if len(seen) > 3 and repo_digest(self.fd, path, real.st_size) == seen[3]:
            return None  # rewritten with the same content (a git index: the same entries)
        try:
            live_ino = self.ov.resolve(state, name)
            node: Node | None = self.ov.node(state, live_ino)
        except FsError:
            node = None
        if node is not None and node.is_reg and node.size == real.st_size:
            fd = openat2_beneath(self.fd, path, os.O_RDONLY)
            try:
                if self._same_content(fd, state, live_ino, node):
                    return None
            finally:
                os.close(fd)
        if is_git_index(path) and len(seen) > 3:
            return f"{name} stages other entries in the repo than when the session began"
        how = [f"size {seen[1]} -> {real.st_size} bytes"] if seen[1] != real.st_size else []
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(real.st_mtime_ns / 1e9))
        how.append(f"modified {when}" if seen[2] != real.st_mtime_ns else "replaced")
        return f"{name} changed in the repo after the session changed it ({', '.join(how)})"

    def remember_repo(self) -> None:
        """After an apply the repo holds what we wrote: that is what later applies compare with."""
        updates = []
        for path, _ in self._seen():
            st = lstat_beneath(self.fd, path)
            record: list[Any] = seen_fingerprint(st)
            digest = repo_digest(self.fd, path, st.st_size) if st and stat.S_ISREG(st.st_mode) else None
            key = seen_key(path)
            updates.append((key, seen_value(key, path, record + ([digest] if digest else []))))

        def fn(w: Any) -> None:
            for key, value in updates:
                w.put(SEEN, key, value)
        self.ctx.store.write(fn)

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

    def _remove(self, dfd: int, path: bytes, name: bytes, st: os.stat_result) -> None:
        self._pin(path, recursive=True)
        if stat.S_ISDIR(st.st_mode):
            sub = openat2_beneath(dfd, name, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for child, cst in self._real_entries(sub).items():
                    self._remove(sub, join(path, child), child, cst)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dfd)
        else:
            os.unlink(name, dir_fd=dfd)
        self.stats["removed"] += 1

    def _sync_dir(self, state: Any, ino: int, path: bytes, dirty: set[int], force: bool) -> None:
        dfd = self._dirfd(path)
        try:
            want = {name: (child, cnode or self.ov.node(state, child))
                    for name, child, cnode in self.ov.entries(state, ino)}
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
        kind = stat.S_IFMT(node.mode)
        if st is not None and stat.S_IFMT(st.st_mode) != kind:
            self._remove(dfd, path, name, st)
            st = None
        if node.is_dir:
            if st is None:
                os.mkdir(name, 0o700, dir_fd=dfd)
                self.stats["written"] += 1
            if st is None or stat.S_IMODE(st.st_mode) != stat.S_IMODE(node.mode):
                if st is not None:
                    self._pin(path, recursive=False)
                os.chmod(name, stat.S_IMODE(node.mode), dir_fd=dfd, follow_symlinks=False)
            if st is None or force or ino in dirty or node.origin != path or self._pinned(path):
                self._sync_dir(state, ino, path, dirty, force=st is None or force or node.origin != path)
            return
        if node.is_link:
            target = self.ov.readlink(state, ino, node)
            if st is not None and os.readlink(name, dir_fd=dfd) == target:
                return
            if st is not None:
                self._remove(dfd, path, name, st)
            os.symlink(target, name, dir_fd=dfd)
            self.stats["written"] += 1
            return
        if not node.is_reg:
            if st is None:
                os.mknod(name, node.mode, node.rdev, dir_fd=dfd)
            return
        if ino in self.written:  # another name of a file already written: a hard link
            first = os.stat(self.written[ino], dir_fd=self.fd, follow_symlinks=False)
            if st is not None and (st.st_dev, st.st_ino) == (first.st_dev, first.st_ino):
                return
            if st is not None:
                self._remove(dfd, path, name, st)
            os.link(self.written[ino], name, src_dir_fd=self.fd, dst_dir_fd=dfd, follow_symlinks=False)
            self.stats["written"] += 1
            return
        self.written.setdefault(ino, path)
        if (st is not None and not self.ov.has_record(state, ino) and node.origin == path
                and not self._pinned(path)):
            return  # untouched original lower file at its own place
        if st is not None and st.st_size == node.size and stat.S_IMODE(st.st_mode) == stat.S_IMODE(node.mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
            try:
                same = self._same_content(fd, state, ino, node)
            finally:
                os.close(fd)
            if same:
                return
        if st is not None:
            self._pin(path, recursive=False)
        tmp = b".overlayckpt-apply-" + name[:200]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            self._write_content(fd, state, ino, node)
            os.fchmod(fd, stat.S_IMODE(node.mode))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.utime(tmp, ns=(node.atime_ns, node.mtime_ns), dir_fd=dfd, follow_symlinks=False)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        self.stats["written"] += 1

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
        for off, piece in self._pieces(state, ino, node):
            if piece != _ZEROS[:len(piece)]:
                pwrite_all(fd, piece, off)
        os.ftruncate(fd, node.size)


CHUNK = 1 << 20
_ZEROS = bytes(CHUNK)


def seen_fingerprint(st: os.stat_result | None) -> list[int]:
    """What `seen` records of a repo entry: inode, size, mtime; zeros for no entry."""
    return [lower_ino(st.st_ino), st.st_size, st.st_mtime_ns] if st is not None else [0, 0, 0]


def apply_live(ctx: Context, force: bool = False) -> dict[str, int]:
    seq = ctx.store.read(lambda r: r.meta_int(SEQ_KEY, 1))
    stats = Applier(ctx).apply(_LiveState(ctx), [], [], force)
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

    def prefix(self, table: bytes, prefix: bytes):  # type: ignore[no-untyped-def]
        return iter(self.store.read(lambda r: list(r.prefix(table, prefix))))

    def block(self, digest: bytes) -> bytes:
        return self.store.read(lambda r: r.block(digest))


def apply_checkpoint(ctx: Context, ref: Any, force: bool = False) -> dict[str, int]:
    from overlayckpt.core.timeline import Timeline
    tl = Timeline(ctx)
    r = ctx.store.begin_read()
    try:
        ck = tl.get(r, ref)
        state = tl.state(r, ck)
        since = list(history.changed_since(r, ck.seq))  # what the live records no longer show
        extra_nodes = sorted({from_u64(k[:8]) for code, k in since if code == T_NODES})
        extra_dirs = sorted({from_u64(k[:8]) for code, k in since if code == T_DIRENTS})
        stats = Applier(ctx).apply(state, extra_nodes, extra_dirs, force)
    finally:
        ctx.store.end_read(r)
    _applied_at(ctx.store, ck.seq)
    return stats
