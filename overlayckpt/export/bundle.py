"""Session bundles (export bundle): writing one and reading one back.


export bundle / import
    A bundle is one zstd stream of msgpack objects: a header (format,
    block size, repo, the lower inodes the session refers to with their
    paths, type, size and content digest), then `[table, key, value]` for
    every entry of every table of the store, then a trailer with the counts.
    `import` loads it into a new, empty store, verifying every block's digest.
    The history index is left out: the store rebuilds it from the journal.

    Lower entries are numbered by the repo's own st_ino, so another checkout
    of the repo (another machine, a `cp -a`) numbers them differently. Import
    looks each recorded path up in the target repo, refuses it if a file is
    missing or differs (pinned paths excepted: the store keeps those), and
    rewrites every lower inode in the entries it loads (`Remap`). Over the
    recorded directory itself (same inodes) nothing is hashed or rewritten.
    Only the entries the session refers to are checked, not the whole tree.

The bundle writer reads only raw tables, in a thread of its own.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
import zstandard

from overlayckpt.core.maintenance import referenced_blocks
from overlayckpt.core.validate import (
    RECORD_MAX,
    finite_number,
    int_in,
    rel_path_problem,
    value_max,
)
from overlayckpt.errors import UserError
from overlayckpt.export.identity import (
    identities,
    lower_files,
    lower_identity,
    lower_links,
    seen_files,
)
from overlayckpt.messages import ExportBundleReply
from overlayckpt.records import (
    CONTROL_INO_BASE,
    FIRST_UPPER_INO,
    KEY_MAX,
    MAX_FILE_SIZE,
    PATH_MAX,
    ROOT_INO,
    block_size_problem,
    iso_time,
)
from overlayckpt.store.format import FORMAT_VERSION
from overlayckpt.store.lmdbstore import Store, parent_block, parent_of
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import (
    BLOCKS,
    DERIVED_KEYS,
    DERIVED_TABLES,
    FORK_KEY,
    FORMAT_KEY,
    META,
    PARENT_KEY,
    TABLES,
)

BUNDLE_MAGIC = "overlayckpt-bundle"
BUNDLE_VERSION = 1
# the history index is derived from the journal: import rebuilds it instead
BUNDLE_TABLES = tuple(t for t in TABLES if t not in DERIVED_TABLES)
_FLUSH = 1 << 20
HEADER_MAX = RECORD_MAX  # bytes of the header (lower_files grows with the files a session touched)
_CHUNK = 1 << 16  # bytes inflated at a time

def write_bundle(store: Store, path: str, info: Mapping[str, object], lower_fd: int
                 ) -> ExportBundleReply:
    """Write every table of the store, as one consistent snapshot, into a bundle file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    counts: dict[str, int] = {}

    def fn(r: ReadTxn) -> None:
        lower, pinned = lower_identity(r)
        identity = identities(lower_fd)
        files = lower_files(r, identity, lower)
        header = {"bundle": BUNDLE_MAGIC, "version": BUNDLE_VERSION, "format": r.meta_int(FORMAT_KEY),
                  "block_size": store.block_size, "tables": [t.decode() for t in BUNDLE_TABLES],
                  "created": iso_time(time.time_ns()), "lower": lower, "pinned": pinned,
                  "lower_files": files, "seen_files": seen_files(r, identity),
                  "lower_links": lower_links(identity, files), **info}
        packer = msgpack.Packer()
        buf = bytearray(packer.pack(header))
        if len(buf) > HEADER_MAX:
            raise UserError(f"the session refers to too many repo files for a bundle "
                            f"({len(files)}): it cannot be exported")
        # it holds every captured file: the owner's alone, whatever the umask
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as f:
            os.fchmod(fd, 0o600)
            with zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as z:
                for ti, table in enumerate(BUNDLE_TABLES):
                    n = 0
                    limit = value_max(table, store.block_size)
                    for k, v in _entries(r, table):
                        if table == META and (k in DERIVED_KEYS or _family(k)):
                            continue
                        if len(v) > limit:  # import would refuse it: say so now
                            raise UserError(f"a {table.decode()} record of {len(v)} bytes is "
                                            f"larger than a bundle holds ({limit}): the session "
                                            "cannot be exported as a bundle")
                        buf += packer.pack([ti, k, v])
                        n += 1
                        if len(buf) >= _FLUSH:
                            z.write(bytes(buf))
                            buf.clear()
                    counts[table.decode()] = n
                buf += packer.pack({"end": True, "counts": counts})
                z.write(bytes(buf))
            f.flush()
            os.fsync(f.fileno())

    try:
        store.read(fn)
        os.replace(tmp, path)
    except OSError as e:
        unlink_quietly(tmp)
        raise UserError(f"cannot write bundle {path}: {e.strerror or e}: pick a writable path") from None
    except BaseException:
        unlink_quietly(tmp)
        raise
    return {"path": path, "bytes": os.path.getsize(path), "records": counts,
            "checkpoints": counts["ckpts"], "blocks": counts["blocks"], "journal": counts["journal"]}


def _entries(r: ReadTxn, table: bytes) -> Iterator[tuple[bytes, bytes]]:
    """A table's entries; a fork's blocks also those it reads from its parent's store
    (a bundle stands alone)."""
    yield from r.range_from(table)
    if table == BLOCKS and parent_of(r) is not None:
        for digest in sorted(referenced_blocks(r, forks=False)):
            if r.get(BLOCKS, digest) is None:
                raw = parent_block(r, digest)
                if raw is not None:
                    yield digest, raw


def _family(key: bytes) -> bool:
    """A fork's parent and a parent's forks: not the bundle's (its blocks are its own)."""
    return key == PARENT_KEY or key.startswith(FORK_KEY)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class BundleReader:
    """Reading an untrusted bundle: the header, then records, then the trailer, each checked
    against the schema as it is read.

    The zstd stream is inflated _CHUNK bytes at a time, and nothing is buffered beyond what
    the piece being read may hold: the header (HEADER_MAX, parsed by a msgpack Unpacker with
    small limits), then each record's envelope ([table, key, value], two bins) parsed here,
    its key at most KEY_MAX and its value at most its table's value_max (a block: the block
    size), both refused from their length prefix before a byte of them is read.
    The records themselves are validated by the importer (core/validate.py)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.f = open(path, "rb")
        except OSError as e:
            raise UserError(f"cannot read bundle {path}: {e.strerror}") from None
        try:
            self._z = zstandard.ZstdDecompressor().stream_reader(self.f, read_size=_CHUNK)
            self._buf = b""
            self._pos = 0
            self.header = self._object(HEADER_MAX, "its header")
            self._check_header(self.header)
        except BaseException:
            self.f.close()
            raise
        self.block_size: int = self.header["block_size"]
        self.tables = [t.encode() for t in self.header["tables"]]

    def _damaged(self, what: str) -> UserError:
        return UserError(f"{self.path} is not a valid overlayckpt bundle ({what}): refused, nothing "
                         "was imported; export the bundle again")

    def _inflate(self) -> bytes:
        try:
            return self._z.read(_CHUNK)
        except (zstandard.ZstdError, OSError):
            raise self._damaged("its compressed stream is corrupt") from None

    def _take(self, n: int) -> bytes:
        """The next n bytes of the stream (n is bounded by the caller)."""
        end = self._pos + n
        if end <= len(self._buf):
            self._pos = end
            return self._buf[end - n:end]
        out = bytearray(self._buf[self._pos:])
        while len(out) < n:
            chunk = self._inflate()
            if not chunk:
                raise UserError(f"{self.path} is truncated: refused, nothing was imported; "
                                "export the bundle again")
            out += chunk
        self._buf, self._pos = bytes(out[n:]), 0
        del out[n:]
        return bytes(out)

    def _object(self, limit: int, what: str) -> Any:
        """One msgpack object of at most limit bytes (the header, the trailer)."""
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=limit,
                                    max_bin_len=PATH_MAX, max_str_len=PATH_MAX,
                                    max_array_len=1 << 20, max_map_len=1 << 10, max_ext_len=0)
        fed = 0
        data = self._buf[self._pos:]
        self._buf, self._pos = b"", 0
        while True:
            if data:
                try:
                    unpacker.feed(data)
                except msgpack.BufferFull:
                    raise self._damaged(f"{what} is larger than {limit} bytes") from None
                fed += len(data)
                try:
                    obj = unpacker.unpack()
                except msgpack.OutOfData:
                    pass
                except Exception:  # (msgpack's: malformed, or beyond a limit)
                    raise self._damaged(f"{what} is malformed") from None
                else:
                    # the rest of what was fed belongs to what follows (it ends in data)
                    self._buf = data[len(data) - (fed - unpacker.tell()):]
                    return obj
            data = self._inflate()
            if not data:
                raise UserError(f"{self.path} is truncated or not an overlayckpt bundle: refused, "
                                "nothing was imported")

    def _check_header(self, h: Any) -> None:
        if not isinstance(h, dict) or h.get("bundle") != BUNDLE_MAGIC:
            raise UserError(f"{self.path} is not an overlayckpt bundle: give a file made by "
                            "'overlayckpt export bundle'")
        fmt = h.get("format")
        if h.get("version") != BUNDLE_VERSION or isinstance(fmt, int) and fmt > FORMAT_VERSION:
            raise UserError(f"{self.path} is a bundle of a newer overlayckpt: upgrade overlayckpt "
                            "to import it")
        why = header_problem(h)
        if why is not None:
            raise self._damaged(f"its header {why}")

    def records(self) -> Iterator[tuple[bytes, bytes, bytes]]:
        """(table, key, value) of every record, each of bounded length; then the trailer
        (self.trailer), after which the stream must end."""
        while True:
            lead = self._take(1)[0]
            if lead != 0x93:  # not a record ([table, key, value]): the trailer, a map
                if not (0x80 <= lead <= 0x8F or lead in (0xDE, 0xDF)):
                    raise self._damaged("a record is malformed")
                self._pos -= 1
                trailer = self._object(1 << 16, "its trailer")
                if not _trailer_ok(trailer, self.tables) or self._buf or self._inflate():
                    raise self._damaged("its trailer is malformed")
                self.trailer = trailer
                return
            ti = self._take(1)[0]
            if ti >= len(self.tables):
                raise self._damaged("a record names no table of its header")
            table = self.tables[ti]
            key = self._take(self._bin_len(KEY_MAX, "a key"))
            value = self._take(self._bin_len(value_max(table, self.block_size),
                                             f"a {table.decode()} record"))
            yield table, key, value

    def _bin_len(self, limit: int, what: str) -> int:
        """The length of the bin that follows, refused above limit before it is read."""
        lead = self._take(1)[0]
        width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(lead)
        if width is None:
            raise self._damaged(f"{what} is not a byte string")
        n = int.from_bytes(self._take(width), "big")
        if n > limit:
            raise self._damaged(f"{what} claims {n} bytes, more than {limit}")
        return n

    def close(self) -> None:
        self.f.close()


def header_problem(h: Mapping[str, object]) -> str | None:
    """What is wrong with a bundle's header (already known to be one, of this version), or
    None: every field against the schema, every path of single components."""
    why = block_size_problem(h.get("block_size"))
    if why is not None:
        return f"says {why}"
    fmt = h.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        return "has no format"
    tables = h.get("tables")
    if (not isinstance(tables, list) or len(set(map(str, tables))) != len(tables)
            or not all(isinstance(t, str) and t.encode() in BUNDLE_TABLES for t in tables)):
        return "names tables this overlayckpt does not know"
    for key in ("repo", "created", "session"):
        if key in h and not (isinstance(value := h[key], str) and len(value) <= PATH_MAX):
            return f"has a malformed {key}"
    if "window" in h and not finite_number(h["window"], 0, 1e12):  # (seconds; 1e9: for good)
        return "has a malformed window"
    lower, pinned = h.get("lower", []), h.get("pinned", [])
    if not isinstance(lower, list) or not all(
            isinstance(e, list) and len(e) == 2 and int_in(e[0], ROOT_INO + 1, FIRST_UPPER_INO - 1)
            and rel_path_problem(e[1]) is None for e in lower):
        return "has a malformed lower entry"
    if not isinstance(pinned, list) or not all(rel_path_problem(p) is None for p in pinned):
        return "has a malformed pinned path"
    files = h.get("lower_files")
    if files is not None:
        if not isinstance(files, list) or not all(
                isinstance(e, list) and len(e) == 5 and int_in(e[0], ROOT_INO + 1, CONTROL_INO_BASE - 1)
                and rel_path_problem(e[1]) is None
                and (e[2] is None or int_in(e[2], 0, 0o170000))
                and (e[3] is None or int_in(e[3], 0, MAX_FILE_SIZE))
                and (e[4] is None or isinstance(e[4], bytes) and len(e[4]) == 32) for e in files):
            return "has a malformed lower_files entry"
        # every repo inode the session refers to is named, with its path: import checks each
        named = {e[0] for e in files}
        if any(e[0] not in named for e in lower):
            return "refers to repo files that lower_files does not name"
    seen = h.get("seen_files", [])
    if not isinstance(seen, list) or not all(
            isinstance(e, list) and len(e) == 3 and rel_path_problem(e[0]) is None
            and int_in(e[1], 0, MAX_FILE_SIZE) and isinstance(e[2], bytes) and len(e[2]) == 32
            for e in seen):
        return "has a malformed seen_files entry"
    links = h.get("lower_links", [])
    if not isinstance(links, list) or not all(
            isinstance(e, list) and len(e) == 2 and int_in(e[0], 0, CONTROL_INO_BASE - 1)
            and int_in(e[1], 2, 1 << 32) for e in links):
        return "has a malformed lower_links entry"
    return None


def _trailer_ok(trailer: Any, tables: list[bytes]) -> bool:
    counts = trailer.get("counts") if isinstance(trailer, dict) else None
    return (trailer.get("end") is True and isinstance(counts, dict)
            and all(isinstance(k, str) and k.encode() in tables and int_in(v, 0, 1 << 62)
                    for k, v in counts.items()))
