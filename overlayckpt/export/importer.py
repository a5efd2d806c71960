"""import: load a session bundle into a new, empty store (verifying every block's digest,
remapping lower inodes when the target is another checkout).
"""
from __future__ import annotations

import os
import shutil
import stat
from typing import Any, TypedDict

import blake3

from overlayckpt.core.validate import lower_inos, record_problem
from overlayckpt.errors import UserError
from overlayckpt.export.bundle import BundleReader, unlink_quietly
from overlayckpt.export.remap import Remap, repo_remap
from overlayckpt.store.info import default_store_dir, read_info, write_info
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import BLOCK_SIZE_KEY, BLOCKS, DERIVED_KEYS, FORMAT_KEY, META, TABLES

_KEEP = (FORMAT_KEY, BLOCK_SIZE_KEY, *DERIVED_KEYS)  # what a new, empty store holds in META


def _store_is_empty(store: Store) -> bool:
    def fn(r: ReadTxn) -> bool:
        if any(r.count(t) for t in TABLES if t != META):
            return False
        return all(k in _KEEP for k, _ in r.range_from(META))
    return store.read(fn)


class Imported(TypedDict):
    store: str
    repo: str
    checkpoints: int
    blocks: int
    records: dict[str, int]  # entries per table


def import_bundle(path: str, store_dir: str | None, repo: str | None) -> Imported:
    """Load a bundle into a new, empty store. The bundle is untrusted: its header was checked
    as it was read (BundleReader), every record is checked here against the tables' schema
    (core/validate.py) before it is stored, and a refused bundle leaves nothing behind (no
    store directory made for it, no file in a directory that was empty)."""
    bundle = BundleReader(path)
    try:
        header = bundle.header
        repo = repo or header.get("repo")
        if not repo or not os.path.isdir(repo):
            raise UserError(f"the bundle's repo {repo} is not a directory here: give --repo DIR "
                            "(the directory the session was recorded on, or a checkout of it)")
        repo = os.path.realpath(repo)
        remap = repo_remap(header, repo, path)
        store_dir = os.path.abspath(store_dir or default_store_dir(repo))
        if os.path.exists(store_dir) and not os.path.isdir(store_dir):
            raise UserError(f"{store_dir} exists and is not a directory: pick another --store")
        made = _first_missing(store_dir)
        before = set(os.listdir(store_dir)) if made is None else None
        mode = stat.S_IMODE(os.stat(store_dir).st_mode) if made is None else 0  # Store.open makes it 0700
        store: Store | None = None
        failed = True
        try:
            store = Store.open(store_dir, create=True, block_size=bundle.block_size)
            if not _store_is_empty(store):
                failed = False  # not ours to clean
                raise UserError(f"store {store_dir} already holds a session: import into a new "
                                "--store (import never merges sessions)")
            counts = _load(store, bundle, remap)
            failed = False
        except (UserError, KeyboardInterrupt):
            raise
        except OSError as e:
            raise UserError(f"cannot import into {store_dir}: {e.strerror or e}: nothing was "
                            "imported") from None
        except Exception:  # a record the checks let through and the store would not take
            raise bundle._damaged("a record cannot be loaded") from None
        finally:
            if failed and store is not None and before is not None and "data.mdb" in before:
                _clear(store)
            if store is not None:
                store.close()
            if failed and (before is None or "data.mdb" not in before):
                _remove_new(store_dir, made, before)
                if made is None:
                    os.chmod(store_dir, mode)
    finally:
        bundle.close()
    info = read_info(store_dir)
    info.update({"repo": repo, "window": header.get("window", 1.0), "block_size": bundle.block_size,
                 "imported_from": os.path.abspath(path)})
    write_info(store_dir, info)
    return {"store": store_dir, "repo": repo, "checkpoints": counts.get("ckpts", 0),
            "blocks": counts.get("blocks", 0), "records": counts}


def _first_missing(path: str) -> str | None:
    """The outermost directory of path that does not exist yet (None: path exists): what
    Store.open creates, and a failed import removes."""
    missing = None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _remove_new(store_dir: str, made: str | None, before: set[str] | None) -> None:
    """Undo a failed import into a directory it created or found empty."""
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        return
    for name in set(os.listdir(store_dir)) - (before or set()):
        unlink_quietly(os.path.join(store_dir, name))


def _load(store: Store, bundle: BundleReader, remap: Remap | None = None) -> dict[str, int]:
    counts = {t.decode(): 0 for t in bundle.tables}
    batch: list[tuple[bytes, bytes, bytes]] = []
    size = 0
    bs = bundle.block_size
    files = bundle.header.get("lower_files")
    named = None if files is None else {e[0] for e in files}

    def flush() -> None:
        def fn(w: Any) -> None:
            for table, key, value in batch:
                if table == BLOCKS and w.get(BLOCKS, key) is not None:
                    continue  # content-addressed: already here
                w.put(table, key, value)
        store.write(fn)
        batch.clear()

    for table, key, value in bundle.records():
        why = record_problem(table, key, value, bs, bundle=True)
        if why is not None:
            raise UserError(f"{bundle.path} is refused: its {why}; nothing was imported")
        if table == BLOCKS:
            try:
                data = store.decode_block(value)  # (bounded by the block size)
                ok = len(data) == bs and blake3.blake3(data).digest() == key
            except Exception:
                ok = False
            if not ok:
                raise UserError(f"{bundle.path} is damaged (block {key.hex()[:16]} does not match its "
                                "digest): export the bundle again")
        elif named is not None:
            for ino in lower_inos(table, key, value):
                if ino not in named:
                    raise UserError(f"{bundle.path} is refused: it refers to repo inode {ino} "
                                    "without naming its path; nothing was imported")
        counts[table.decode()] += 1
        if remap is not None:
            key, value = remap.row(table, key, value)
        batch.append((table, key, value))
        size += len(key) + len(value)
        if len(batch) >= 20000 or size >= 64 << 20:
            flush()
            size = 0
    if remap is not None:
        batch += [(META, key, value) for key, value in remap.meta_rows()]
    if batch:
        flush()

    def drop_derived(w: WriteTxn) -> None:
        for key in DERIVED_KEYS:
            w.delete(META, key)
    store.write(drop_derived)  # rebuilt at next open
    expected = getattr(bundle, "trailer", {}).get("counts")
    if expected != counts:
        raise UserError(f"{bundle.path} is incomplete (expected {expected}, found {counts}): "
                        "export the bundle again")
    return counts


def _clear(store: Store) -> None:
    """Empty a store that an import failed to fill (it was empty before)."""
    def fn(w: Any) -> None:
        for table in TABLES:
            if table == META:
                for k, _ in list(w.range_from(META)):
                    if k not in _KEEP:
                        w.delete(META, k)
            else:
                w.clear(table)
    store.write(fn)
