"""session.json: the repo path, the window and the current daemon, next to the store.

What the CLI reads to find a session without opening LMDB (so it imports no
lmdb); written durably, since every --store command depends on it.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

from overlayckpt.store.places import open_private

INFO_FILE = "session.json"  # repo path and current daemon, for the CLI

TYPE_CHECKING = False  # (not typing's: every CLI start reads this file, typing costs 3 ms)
if TYPE_CHECKING:
    from typing import TypedDict

    class SessionInfo(TypedDict, total=False):
        """What session.json holds (read_info: each field present only with its type)."""
        repo: str  # the repo's absolute path
        window: float  # seconds of quiet that end an automatic group
        block_size: int
        created: str  # ISO time of checkpoint 0
        pid: int  # the daemon serving it, while mounted
        mountpoint: str  # its mountpoint, while mounted
        last_unmount: dict[str, object]  # what the last unmount did (applied, refused, error)
        parent: str  # a fork's: the parent's store path
        parent_checkpoint: int  # a fork's: the checkpoint it forked from
        imported_from: str  # an import's: the bundle's path


# the JSON types each field must have to be read (bool is an int to Python: refused)
_FIELDS: dict[str, tuple[type, ...]] = {
    "repo": (str,), "window": (int, float), "block_size": (int,), "created": (str,),
    "pid": (int,), "mountpoint": (str,), "last_unmount": (dict,), "parent": (str,),
    "parent_checkpoint": (int,), "imported_from": (str,)}


def default_store_dir(repo: str) -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    absrepo = os.path.realpath(repo)
    slug = absrepo.strip("/").replace("/", "-")[-60:] or "root"
    digest = hashlib.blake2b(absrepo.encode(), digest_size=4).hexdigest()
    return os.path.join(base, "overlayckpt", f"{slug}-{digest}")


def read_info(store_dir: str) -> SessionInfo:
    """session.json of the store at store_dir: a field of another type than SessionInfo
    says is left out (as is everything when the file is missing or not a JSON object);
    fields it does not name are kept, so that write_info writes them back."""
    try:
        with open(os.path.join(store_dir, INFO_FILE)) as f:
            found: object = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    info: SessionInfo = {}
    for key, value in found.items():
        kinds = _FIELDS.get(key)
        if kinds is None or isinstance(value, kinds) and not isinstance(value, bool):
            info[key] = value  # type: ignore[literal-required]  # checked against _FIELDS
    return info


def write_info(store_dir: str, info: Mapping[str, object]) -> None:
    """Durably: after a power cut every --store command still finds the session (and
    the repo path is kept in the store too, see Session.open)."""
    tmp = os.path.join(store_dir, INFO_FILE + ".tmp")
    # 0600: it names the repo and the session's places (places.py)
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
        json.dump(info, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(store_dir, INFO_FILE))
    from overlayckpt.store.synced import fsync_dir  # (the CLI reads this file, seldom writes)
    fsync_dir(store_dir)
