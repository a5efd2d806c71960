"""session.json: the repo path, the window and the current daemon, next to the store.

What the CLI reads to find a session without opening LMDB (so it imports no
lmdb); written durably, since every --store command depends on it.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from overlayckpt.store.places import open_private
from overlayckpt.store.synced import fsync_dir

INFO_FILE = "session.json"  # repo path and current daemon, for the CLI


def default_store_dir(repo: str) -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    absrepo = os.path.realpath(repo)
    slug = absrepo.strip("/").replace("/", "-")[-60:] or "root"
    digest = hashlib.blake2b(absrepo.encode(), digest_size=4).hexdigest()
    return os.path.join(base, "overlayckpt", f"{slug}-{digest}")


def read_info(store_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(store_dir, INFO_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_info(store_dir: str, info: dict[str, Any]) -> None:
    """Durably: after a power cut every --store command still finds the session (and
    the repo path is kept in the store too, see Session.open)."""
    tmp = os.path.join(store_dir, INFO_FILE + ".tmp")
    # 0600: it names the repo and the session's places (places.py)
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
        json.dump(info, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(store_dir, INFO_FILE))
    fsync_dir(store_dir)
