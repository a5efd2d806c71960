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
from collections.abc import Iterator
from typing import Any

import msgpack
import zstandard

from overlayckpt.errors import UserError
from overlayckpt.records import FORMAT_VERSION, iso_time
from overlayckpt.core.maintenance import referenced_blocks
from overlayckpt.store.lmdbstore import ReadTxn, Store, parent_block, parent_of
from overlayckpt.tables import (
    BLOCKS, DERIVED_KEYS, DERIVED_TABLES, FORK_KEY, FORMAT_KEY, META, PARENT_KEY, TABLES,
)
from overlayckpt.export.identity import (
    identities, lower_files, lower_identity, lower_links, seen_files,
)


BUNDLE_MAGIC = "overlayckpt-bundle"
BUNDLE_VERSION = 1
# the history index is derived from the journal: import rebuilds it instead
BUNDLE_TABLES = tuple(t for t in TABLES if t not in DERIVED_TABLES)
_FLUSH = 1 << 20

def write_bundle(store: Store, path: str, info: dict[str, Any], lower_fd: int) -> dict[str, Any]:
    """Write every table of the store, as one consistent snapshot, into a bundle file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    counts: dict[str, int] = {}

    def fn(r: ReadTxn) -> dict[str, Any]:
        lower, pinned = lower_identity(r)
        identity = identities(lower_fd)
        header = {"bundle": BUNDLE_MAGIC, "version": BUNDLE_VERSION, "format": r.meta_int(FORMAT_KEY),
                  "block_size": store.block_size, "tables": [t.decode() for t in BUNDLE_TABLES],
                  "created": iso_time(time.time_ns()), "lower": lower, "pinned": pinned,
                  "lower_files": lower_files(r, identity, lower),
                  "seen_files": seen_files(r, identity), **info}
        header["lower_links"] = lower_links(identity, header["lower_files"])
        packer = msgpack.Packer()
        with open(tmp, "wb") as f:
            with zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as z:
                buf = bytearray(packer.pack(header))
                for ti, table in enumerate(BUNDLE_TABLES):
                    n = 0
                    for k, v in _entries(r, table):
                        if table == META and (k in DERIVED_KEYS or _family(k)):
                            continue
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
        return {"checkpoints": counts["ckpts"], "blocks": counts["blocks"],
                "journal": counts["journal"]}

    try:
        result = store.read(fn)
        os.replace(tmp, path)
    except OSError as e:
        unlink_quietly(tmp)
        raise UserError(f"cannot write bundle {path}: {e.strerror or e}: pick a writable path") from None
    except BaseException:
        unlink_quietly(tmp)
        raise
    return {"path": path, "bytes": os.path.getsize(path), "records": counts, **result}


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
    """Reading a bundle: the header, then records, then the trailer."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.f = open(path, "rb")
        except OSError as e:
            raise UserError(f"cannot read bundle {path}: {e.strerror}") from None
        self.unpacker = msgpack.Unpacker(zstandard.ZstdDecompressor().stream_reader(self.f),
                                         raw=False, strict_map_key=False,
                                         max_buffer_size=1 << 31)
        header = self._next()
        if (not isinstance(header, dict) or header.get("bundle") != BUNDLE_MAGIC
                or not isinstance(header.get("tables"), list)):
            raise UserError(f"{path} is not an overlayckpt bundle: give a file made by "
                            "'overlayckpt export bundle'")
        if header.get("version") != BUNDLE_VERSION or int(header.get("format", 0)) > FORMAT_VERSION:
            raise UserError(f"{path} is a bundle of a newer overlayckpt: upgrade overlayckpt to import it")
        lower, pinned = header.get("lower", []), header.get("pinned", [])
        if (not isinstance(header.get("block_size"), int) or not isinstance(lower, list)
                or not isinstance(pinned, list) or not all(isinstance(t, str) for t in header["tables"])
                or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], int)
                           and isinstance(e[1], bytes) for e in lower)
                or not all(isinstance(p, bytes) for p in pinned)
                or not _rows_ok(header.get("lower_files", []), 5, 1)
                or not _rows_ok(header.get("seen_files", []), 3, 0)):
            raise UserError(f"{path} is damaged (its header is malformed): export the bundle again")
        self.header = header
        self.tables = [t.encode() for t in header["tables"]]
        if any(t not in BUNDLE_TABLES for t in self.tables):
            raise UserError(f"{path} holds tables this overlayckpt does not know: upgrade overlayckpt")

    def _next(self) -> Any:
        try:
            return next(self.unpacker)
        except StopIteration:
            raise UserError(f"{self.path} is truncated or not an overlayckpt bundle") from None
        except UserError:
            raise
        except Exception as e:  # zstd or msgpack: the file is damaged or something else
            raise UserError(f"{self.path} is not a valid overlayckpt bundle ({e})") from None

    def records(self) -> Iterator[tuple[bytes, bytes, bytes]]:
        while True:
            rec = self._next()
            if isinstance(rec, dict):
                if not rec.get("end"):
                    break
                self.trailer = rec
                return
            if (not isinstance(rec, list) or len(rec) != 3 or not isinstance(rec[0], int)
                    or not 0 <= rec[0] < len(self.tables) or not isinstance(rec[1], bytes)
                    or not rec[1] or not isinstance(rec[2], bytes)):
                break
            yield self.tables[rec[0]], rec[1], rec[2]
        raise UserError(f"{self.path} is damaged (a record is malformed): export the bundle again")

    def close(self) -> None:
        self.f.close()


def _rows_ok(rows: Any, n: int, path_at: int) -> bool:
    """Header rows (lower_files, seen_files) of n ints, bytes or nils, with a path at path_at."""
    return isinstance(rows, list) and all(
        isinstance(e, list) and len(e) == n and isinstance(e[path_at], bytes)
        and all(isinstance(x, (int, bytes, type(None))) for x in e) for e in rows)
