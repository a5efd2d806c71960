"""What a well-formed entry of each table is: the one schema that import checks every record
of a bundle against and fsck checks every entry of a store against.

A bundle comes from another machine and is untrusted; a store may be damaged. Either way a
record that does not decode into what its table holds (a node of a known file type with
sizes in bounds, a dirent whose name is one path component, a digest of 32 bytes, ...) is
refused by import and reported by fsck, before apply or a view trips over it.

Bundles get a stricter policy on top (`bundle=True`): nothing that grants more than a
file's owner had (no setuid bit, no setgid bit but on directories, no device node) and no
meta key that points outside the store (a fork's parent, a parent's forks). A store may
hold those legitimately (an agent may `chmod 4755` or `mknod` in the mount; apply decides
what reaches the repo), so fsck does not call them damage.

Pure functions over (table, key, value) bytes; every decode is bounded (msgpack limits
derived from the value's length), so a crafted value cannot claim more memory than a
small multiple of its own size.
"""
from __future__ import annotations

import math
import stat
from typing import Any

import msgpack

from overlayckpt.names import is_file_name, quote_path
from overlayckpt.records import (
    CONTROL_INO_BASE,
    FIRST_UPPER_INO,
    KEY_MAX,
    MAX_FILE_SIZE,
    NAME_MAX,
    PATH_MAX,
    ROOT_INO,
    TABLE_NAMES,
    WHITEOUT,
    ZERO_BLOCK,
    block_size_problem,
    from_u64,
)
from overlayckpt.store.format import FORMAT_VERSION
from overlayckpt.tables import (
    APPLIED_KEY,
    BLOCK_BYTES_KEY,
    BLOCK_SIZE_KEY,
    BLOCKS,
    BMAP,
    CKPTS,
    CONV,
    CONV_HEAD_KEY,
    CONV_NEXT_KEY,
    DIRENTS,
    FORK_KEY,
    FORMAT_KEY,
    GROUP_KEY,
    GROUPFILES_KEY,
    HISTORY_KEY,
    JOURNAL,
    META,
    NAMES,
    NEXT_CKPT_KEY,
    NEXT_INO_KEY,
    NODES,
    PARENT_KEY,
    PINNED,
    REMOVALS_KEY,
    REPO_KEY,
    RESTORE_FILES_KEY,
    RESTORED_KEY,
    RESTORED_LEFT_MOST,
    SEEN,
    SEQ_KEY,
    UNDER_KEY,
    WRITE_BEHIND_KEY,
    XATTRS,
)

# the largest value of a table whose records grow with a session (a restore's journal record,
# a conversation line, a big file's pin): the importer's own batch size
RECORD_MAX = 64 << 20
XATTR_VALUE_MAX = 1 << 16  # XATTR_SIZE_MAX
_NODE_MAX = 3 * PATH_MAX  # an origin path, a symlink target and fourteen numbers
_SMALL = {DIRENTS: 8, BMAP: 32, NAMES: 8, SEEN: 2 * PATH_MAX, CKPTS: 1 << 20}
CALL_KEY = b"tool_call"  # (core/journal.py's: held in META while a tool call runs)
_U64_KEYS = (FORMAT_KEY, BLOCK_SIZE_KEY, BLOCK_BYTES_KEY, SEQ_KEY, NEXT_INO_KEY, NEXT_CKPT_KEY,
             CONV_HEAD_KEY, CONV_NEXT_KEY, APPLIED_KEY, HISTORY_KEY, GROUPFILES_KEY, REMOVALS_KEY)
_KINDS = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK)
_DEVICES = (stat.S_IFCHR, stat.S_IFBLK)
_U32 = (1 << 32) - 1
_I64 = 1 << 63
OFF_MAX = _I64 - 1  # a file's size as the kernel allows it; a bundle's: MAX_FILE_SIZE
_DECODE_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError,
                  msgpack.UnpackException, RecursionError)


class Bad(Exception):
    """One malformed field: the message says which and why."""


def value_max(table: bytes, block_size: int) -> int:
    """The largest value a record of table can have: what a bundle reader may buffer."""
    if table == BLOCKS:
        return block_size + 1  # a codec byte and at most a whole block
    if table == NODES:
        return _NODE_MAX
    if table == XATTRS:
        return XATTR_VALUE_MAX
    if table == META:
        return 2 * PATH_MAX
    return _SMALL.get(table, RECORD_MAX)


def bounded_unpack(raw: bytes) -> Any:
    """unpack_obj that no value can make allocate more than a few times its length: a
    container or string claims no more items or bytes than the value holds."""
    n = len(raw)
    return msgpack.unpackb(raw, unicode_errors="surrogateescape", strict_map_key=False,
                           max_bin_len=n, max_str_len=n, max_array_len=min(n, 1 << 21),
                           max_map_len=min(n, 1 << 16), max_ext_len=0)


def record_problem(table: bytes, key: bytes, value: bytes, block_size: int,
                   bundle: bool = False) -> str | None:
    """Why an entry of table is malformed (one line naming the table and key), or None."""
    try:
        check_record(table, key, value, block_size, bundle)
    except Bad as e:
        return f"{table.decode()} entry {_show_key(table, key)} {e}"
    except _DECODE_ERRORS:
        return f"{table.decode()} entry {_show_key(table, key)} cannot be decoded"
    return None


def _show_key(table: bytes, key: bytes) -> str:
    if table in (META, NAMES):
        return quote_path(key)
    if len(key) >= 8 and table in (NODES, JOURNAL, CKPTS, CONV):
        return str(from_u64(key[:8]))
    if len(key) > 8 and table in (DIRENTS, XATTRS):
        return f"{from_u64(key[:8])}/{quote_path(key[8:])}"
    return quote_path(key[:64])


def check_record(table: bytes, key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    """Bad (or a decode error) when the entry is malformed."""
    if not isinstance(key, bytes) or not 0 < len(key) <= KEY_MAX or not isinstance(value, bytes):
        raise Bad("has a key or value of the wrong type or length")
    if len(value) > value_max(table, block_size):
        raise Bad("is longer than such a record can be")
    _CHECKS[table](key, value, block_size, bundle)


def _ino(raw: bytes, what: str) -> int:
    if len(raw) != 8:
        raise Bad(f"has a {what} that is not 8 bytes")
    ino = from_u64(raw)
    if not 0 < ino < CONTROL_INO_BASE:
        raise Bad(f"has {what} {ino}, outside the numbers of files")
    return ino


def int_in(v: Any, lo: int, hi: int) -> bool:
    """v is an int (not a bool) from lo to hi."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if not int_in(v, lo, hi):
        raise Bad(f"has a {what} out of range ({v!r:.40})")
    return v


def rel_path_problem(path: Any) -> str | None:
    """Why path (bytes, relative to the repo, b"" for the repo itself) is unsafe, or None."""
    if not isinstance(path, bytes) or len(path) > PATH_MAX:
        return "a path that is not bytes or too long"
    if path and not all(is_file_name(c) for c in path.split(b"/")):
        return f"the path {quote_path(path)}, which is not made of single components"
    return None


def _path(path: Any) -> bytes:
    why = rel_path_problem(path)
    if why is not None:
        raise Bad(f"holds {why}")
    return path


def mode_problem(mode: Any, bundle: bool) -> str | None:
    """Why mode (st_mode) is not of a file the product keeps, or grants what it must not."""
    if not isinstance(mode, int) or isinstance(mode, bool) or mode & ~0o177777:
        return f"a mode ({mode!r:.40}) that is not a file mode"
    kind = stat.S_IFMT(mode)
    if kind in _DEVICES:
        if bundle:
            return f"a mode ({mode:o}) of a device node"
    elif kind not in _KINDS:
        return f"a mode ({mode:o}) of no known file type"
    if bundle and (mode & stat.S_ISUID or mode & stat.S_ISGID and kind != stat.S_IFDIR):
        return f"a mode ({mode:o}) that is setuid or setgid"
    return None


def check_node(value: bytes, block_size: int, bundle: bool) -> None:
    fields = bounded_unpack(value)
    if not isinstance(fields, list) or len(fields) != 14:
        raise Bad("is not a node record")
    (mode, uid, gid, size, atime, mtime, ctime, nlink, rdev, origin, lower_valid, flags, target,
     parent) = fields
    why = mode_problem(mode, bundle)
    if why is not None:
        raise Bad(f"has {why}")
    _int(uid, 0, _U32, "uid")
    _int(gid, 0, _U32, "gid")
    _int(size, 0, _size_max(bundle), "size")
    for t in (atime, mtime, ctime):
        _int(t, -_I64, _I64 - 1, "time")
    _int(nlink, 0, _U32, "link count")
    _int(rdev, 0, (1 << 64) - 1, "device number")
    if origin is not None:
        _path(origin)
    _int(lower_valid, 0, _size_max(bundle), "lower size")
    _int(flags, 0, 3, "flags")
    _int(parent, 0, CONTROL_INO_BASE - 1, "parent")
    if target is not None:
        if not stat.S_ISLNK(mode) or not isinstance(target, bytes) or not 0 < len(target) <= PATH_MAX \
                or b"\0" in target:
            raise Bad("has a symlink target that is not one")
        if size != len(target):
            raise Bad("has a size other than its symlink target's")
    elif stat.S_ISLNK(mode) and (origin is None or size > PATH_MAX):
        raise Bad("is a symlink without a target")


def _nodes(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    _ino(key, "key")
    check_node(value, block_size, bundle)


def _dirent_key(key: bytes) -> None:
    _ino(key[:8], "directory")
    if not is_file_name(key[8:]):
        raise Bad("has a name that is not a single path component")


def _dirents(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    _dirent_key(key)
    if value != WHITEOUT:
        _ino(value, "child inode")


def _size_max(bundle: bool) -> int:
    return MAX_FILE_SIZE if bundle else OFF_MAX


def _bmap_key(key: bytes, block_size: int, bundle: bool) -> None:
    if len(key) != 16:
        raise Bad("has a key that is not 16 bytes")
    _ino(key[:8], "inode")
    _int(from_u64(key[8:]), 0, _size_max(bundle) // block_size, "block number")


def _bmap(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    _bmap_key(key, block_size, bundle)
    if value != ZERO_BLOCK and len(value) != 32:
        raise Bad("has a block digest that is not 32 bytes")


def _xattr_key(key: bytes) -> None:
    _ino(key[:8], "inode")
    if not 0 < len(key) - 8 <= NAME_MAX or b"\0" in key[8:]:
        raise Bad("has an attribute name that is not one")


def _xattrs(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    _xattr_key(key)


def _blocks(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    # (its content against its digest: the caller, which decodes it anyway)
    if len(key) != 32:
        raise Bad("has a digest that is not 32 bytes")
    if value[:1] not in (b"\0", b"\1"):
        raise Bad("has an unknown codec")


_UNDO_KEYS = {NODES: lambda k, bs, b: _ino(k, "key"), DIRENTS: lambda k, bs, b: _dirent_key(k),
              BMAP: _bmap_key, XATTRS: lambda k, bs, b: _xattr_key(k)}


def _journal(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    _int(from_u64(key) if len(key) == 8 else -1, 1, 1 << 62, "journal position")
    rec = bounded_unpack(value)
    if not isinstance(rec, list) or len(rec) != 7:
        raise Bad("is not a journal record")
    t, pid, comm, op, paths, changes, undo = rec
    _int(t, -_I64, _I64 - 1, "time")
    _int(pid, -_I64, _I64 - 1, "pid")
    if not (isinstance(comm, str) and isinstance(op, str) and isinstance(paths, list)
            and isinstance(changes, list) and all(isinstance(p, str) for p in paths)
            and all(isinstance(c, str) for c in changes) and isinstance(undo, list)):
        raise Bad("is not a journal record")
    for u in undo:
        if not isinstance(u, list) or len(u) != 3 or u[0] not in TABLE_NAMES \
                or not isinstance(u[1], bytes) or not (u[2] is None or isinstance(u[2], bytes)):
            raise Bad("holds an undo entry that is not one")
        table = TABLE_NAMES[u[0]]
        if u[2] is None:
            _UNDO_KEYS[table](u[1], block_size, bundle)
        else:
            check_record(table, u[1], u[2], block_size, bundle)


def _ckpts(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    _int(from_u64(key) if len(key) == 8 else -1, 0, 1 << 62, "checkpoint id")
    f = bounded_unpack(value)
    if not isinstance(f, list) or not 8 <= len(f) <= 11:
        raise Bad("is not a checkpoint record")
    for i, v in enumerate(f):
        if i in (3, 7):
            ok = isinstance(v, str)
        elif i in (4, 5):
            ok = v is None or isinstance(v, str)
        elif i == 8:
            ok = v is None or isinstance(v, int)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and -_I64 <= v < _I64
        if not ok:
            raise Bad("is not a checkpoint record")


def _names(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    if len(value) != 8:
        raise Bad("does not hold a checkpoint id")


def _pinned(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    if key[:1] != b"/":
        raise Bad("has a key that is not a path")
    rec = bounded_unpack(value)
    if not isinstance(rec, dict) or not isinstance(rec.get("st"), list) or len(rec["st"]) != 10:
        raise Bad("is not a pin record")
    _path(rec["path"] if b"\0" in key else key[1:])
    why = mode_problem(rec["st"][0], bundle)
    if why is not None:
        raise Bad(f"has {why}")
    _int(rec["st"][1], 0, (1 << 64) - 1, "inode")
    _int(rec["st"][5], 0, _size_max(bundle), "size")
    for name in rec.get("entries") or ():
        if not is_file_name(name):
            raise Bad("lists a name that is not a single path component")
    target = rec.get("target")
    if target is not None and (not isinstance(target, bytes) or not 0 < len(target) <= PATH_MAX
                               or b"\0" in target):
        raise Bad("has a symlink target that is not one")
    blocks = rec.get("blocks")
    if blocks is not None:
        if not isinstance(blocks, list) or len(blocks) > -(-rec["st"][5] // block_size) \
                or not all(isinstance(b, bytes) and len(b) in (0, 32) for b in blocks):
            raise Bad("has a block list that does not fit its size")


def _seen(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    if key[:1] != b"/":
        raise Bad("has a key that is not a path")
    rec = bounded_unpack(value)
    if not isinstance(rec, list) or not 3 <= len(rec) <= 5:
        raise Bad("is not a seen record")
    _path(rec[4] if b"\0" in key and len(rec) == 5 else key[1:])


def _conv(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    _int(from_u64(key) if len(key) == 8 else -1, 0, 1 << 62, "line number")
    if not isinstance(bounded_unpack(value), dict):
        raise Bad("is not a conversation line")


def _meta(key: bytes, value: bytes, block_size: int, bundle: bool) -> None:
    if key in _U64_KEYS:
        if len(value) != 8:
            raise Bad("is not a number")
        n = from_u64(value)
        if key == FORMAT_KEY:
            _int(n, 1, FORMAT_VERSION, "format")
        elif key == BLOCK_SIZE_KEY:
            if block_size_problem(n) is not None or n != block_size:
                raise Bad(f"says block size {n}, not {block_size}")
        elif key == NEXT_INO_KEY:
            _int(n, FIRST_UPPER_INO, CONTROL_INO_BASE - 1, "inode counter")
        elif key == SEQ_KEY:
            _int(n, 1, 1 << 62, "journal position")
    elif key in (REPO_KEY, WRITE_BEHIND_KEY, GROUP_KEY, CALL_KEY):
        pass  # (bytes of their own: a path, a position, a packed group, a flag)
    elif key == RESTORED_KEY:
        if len(value) % 8 or not 8 <= len(value) <= 8 * (1 + RESTORED_LEFT_MOST):
            raise Bad("is not a restore's checkpoint and the inodes it left")
    elif key.startswith(RESTORE_FILES_KEY):
        if len(key) != len(RESTORE_FILES_KEY) + 8 or len(value) != 8:
            raise Bad("is not a restore's mark")
    elif key.startswith(UNDER_KEY):
        if len(key) != len(UNDER_KEY) + 8 or len(value) != 8:
            raise Bad("is not a checkpoint's command tree mark")
    elif key == PARENT_KEY or key.startswith(FORK_KEY):
        if bundle:
            raise Bad("points to another store (a fork's parent or forks)")
        if key == PARENT_KEY:
            parent = bounded_unpack(value)
            if not isinstance(parent, list) or len(parent) != 2 or not isinstance(parent[0], str) \
                    or not isinstance(parent[1], int):
                raise Bad("is not a fork's parent")
    elif bundle:
        raise Bad("is no key overlayckpt writes")


_CHECKS = {META: _meta, BLOCKS: _blocks, NODES: _nodes, DIRENTS: _dirents, BMAP: _bmap,
           XATTRS: _xattrs, JOURNAL: _journal, CKPTS: _ckpts, NAMES: _names, PINNED: _pinned,
           CONV: _conv, SEEN: _seen}
VALIDATED_TABLES = tuple(_CHECKS)


def lower_inos(table: bytes, key: bytes, value: bytes | None) -> list[int]:
    """The repo (lower) inode numbers an entry refers to, as import must find them named in
    the bundle's lower_files (a node's parent is a hint, not a reference). Call on an entry
    that record_problem passed."""
    out: list[int] = []
    if table in (NODES, DIRENTS, BMAP, XATTRS):
        out.append(from_u64(key[:8]))
        if table == DIRENTS and value is not None and value != WHITEOUT:
            out.append(from_u64(value))
    elif table == JOURNAL and value is not None:
        for t, k, v in bounded_unpack(value)[6]:
            out += lower_inos(TABLE_NAMES[t], k, v)
    return [i for i in out if ROOT_INO < i < FIRST_UPPER_INO]


def finite_number(v: Any, lo: float, hi: float) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and lo <= v <= hi)
