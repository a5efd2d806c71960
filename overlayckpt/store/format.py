"""The store's format: its version, and the upgrade of an older store when it is opened.

`meta` `format` is the version a store was written in; FORMAT_VERSION is the one this
overlayckpt writes. What each version added (docs/design.md, on-disk schema):

  2  the history index (`versions`, `changed`)
  3  `groupfiles`, and raw blocks split between key and value (store/txn.py)
  4  the inode counter at each checkpoint (`Checkpoint.next_ino`)
  5  each group's counts row in `groupfiles`; `changed` keeps the born seq and layer

An older store is upgraded in place when opened: the derived tables it never had are
made empty (the session rebuilds them from the journal at open), the checkpoints get
the inode counter, and the format record moves to FORMAT_VERSION. Blocks stored
before format 3 stay whole (both shapes read). A newer store is refused.
"""
from __future__ import annotations

from dataclasses import replace

import lmdb

from overlayckpt.errors import StoreDamaged, UserError
from overlayckpt.records import FIRST_UPPER_INO, Checkpoint, from_u64, u64
from overlayckpt.store.trust import way_out
from overlayckpt.store.txn import WriteTxn
from overlayckpt.tables import (
    CKPTS,
    DERIVED_KEYS,
    DERIVED_TABLES,
    FORMAT_KEY,
    GROUPFILES_KEY,
    HISTORY_BORN,
    HISTORY_KEY,
    META,
    NEXT_INO_KEY,
    TABLES,
)

FORMAT_VERSION = 5


def open_tables(env: lmdb.Environment, path: str, new: bool) -> dict[bytes, lmdb._Database]:
    """Every table of the store at path, by name (made when the store is new).

    An existing store never gets a missing table made anew (empty): that is damage
    (StoreDamaged, env closed); only an older store gets the derived tables it never
    had (an upgrade)."""
    try:
        dbs = {META: env.open_db(META, create=new)}
        with env.begin() as txn:
            version = from_u64(txn.get(FORMAT_KEY, db=dbs[META]) or u64(0))
        for name in TABLES[1:]:
            upgrade = 0 < version < FORMAT_VERSION and name in DERIVED_TABLES
            dbs[name] = env.open_db(name, create=new or upgrade)
    except lmdb.NotFoundError:
        env.close()
        raise StoreDamaged(f"store {path} is damaged (a table is missing): nothing was "
                           f"served; {way_out(path)}") from None
    return dbs


def settle_format(w: WriteTxn, new: bool) -> None:
    """In the first write transaction of an open: stamp a new store with FORMAT_VERSION
    (its derived tables match its empty journal), or upgrade an older one. Raises
    StoreDamaged for a store without a format record, UserError for a newer one (the
    caller aborts w and closes the environment)."""
    path = w.store.path
    version = w.meta_int(FORMAT_KEY, 0)
    if version == 0 and new:
        w.set_meta_int(FORMAT_KEY, FORMAT_VERSION)
        for key in DERIVED_KEYS:  # an empty journal: empty derived tables match it
            w.set_meta_int(key, HISTORY_BORN if key == HISTORY_KEY else 1)
    elif 0 < version < FORMAT_VERSION:
        # the new tables are there, empty: open fills them; from 2 only blocks
        # stored from now on are split
        w.set_meta_int(FORMAT_KEY, FORMAT_VERSION)
        if version < 4:
            _count_inodes(w)
        if version < 5:  # each group's counts row (groupfiles.py): rebuilt at open
            w.delete(META, GROUPFILES_KEY)
    elif version == 0:
        raise StoreDamaged(f"store {path} is damaged (no format record): nothing "
                           f"was served; {way_out(path)}")
    elif version > FORMAT_VERSION:
        raise UserError(f"store {path} has format {version}, newer than this "
                        f"overlayckpt understands ({FORMAT_VERSION}): upgrade overlayckpt")


def _count_inodes(w: WriteTxn) -> None:
    """Give every checkpoint of an older format the inode counter now: no inode numbered
    from it on existed at any of them (numbers are never given twice), so a restore to one
    skips by number those the session makes from now on."""
    now = w.meta_int(NEXT_INO_KEY, FIRST_UPPER_INO)
    rows = [(k, Checkpoint.unpack(from_u64(k), v)) for k, v in w.range_from(CKPTS)]
    w.put_many(CKPTS, [(k, replace(ck, next_ino=ck.next_ino or now).pack())
                       for k, ck in rows])
