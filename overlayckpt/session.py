"""One session: its store, its lower, its live overlay, and the commands on them.

The same `Session` answers commands inside the daemon (through the control
file) and in the CLI for an unmounted session (`--store`), so both paths run
the same code. Commands take and return plain JSON-able dicts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from . import kcache
from .errors import UserError
from .lower import Lower
from .overlay import Overlay, make_durable
from .records import REPO_KEY
from .store import Store
from .synced import fsync_dir

log = logging.getLogger(__name__)

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
    with open(tmp, "w") as f:
        json.dump(info, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(store_dir, INFO_FILE))
    fsync_dir(store_dir)


Handler = Callable[["Session", dict[str, Any]], Awaitable[dict[str, Any]]]
COMMANDS: dict[str, Handler] = {}
DURABLE: set[str] = set()  # commands whose changes survive a power cut once they answer


def command(name: str, durable: bool = False) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        COMMANDS[name] = fn
        if durable:
            DURABLE.add(name)
        return fn
    return register


class Session:
    def __init__(self, store: Store, lower: Lower, overlay: Overlay, repo: str,
                 mountpoint: str | None) -> None:
        self.store = store
        self.lower = lower
        self.overlay = overlay
        self.repo = repo
        self.mountpoint = mountpoint
        self.apply_on_exit = False
        self.line_counts: dict[tuple[int, int], tuple[int, int]] = {}  # see commands.log
        # set by the daemon: run kernel-cache invalidations after a restore
        self.invalidate: Callable[[list[int], list[tuple[int, bytes]]], Awaitable[None]] | None = None
        self.flush_kernel: Callable[[], Awaitable[None]] | None = None
        self.kernel_dir_cache = False  # the mount's listings are cached by the kernel (kcache.py)

    @classmethod
    def open(cls, store_dir: str, repo: str | None = None, *, create: bool = False,
             block_size: int | None = None, window: float | None = None,
             mountpoint: str | None = None) -> "Session":
        info = read_info(store_dir)
        if repo is None and not os.path.exists(os.path.join(store_dir, "data.mdb")):
            raise UserError(f"{store_dir} is not an overlayckpt session store")
        store = Store.open(store_dir, create=create, block_size=block_size)
        if repo is None:
            raw = store.read(lambda r: r.get(b"meta", REPO_KEY))
            repo = info.get("repo") or (raw.decode(errors="surrogateescape") if raw else None)
            if not repo:
                store.close()
                raise UserError(f"{store_dir} is not an overlayckpt session store")
        try:
            from .apply import pin_lookup
            lower = Lower(repo, pin_lookup(store))
        except Exception:
            store.close()
            raise
        if window is None:
            window = float(info.get("window", 1.0))
        overlay = Overlay(store, lower, window=window)
        try:
            from .behind import discard, recover
            if store.cache_lost:
                discard(store_dir)  # its pages may be a mix of old and new: never replayed
            else:
                recover(overlay, store_dir)  # what a killed daemon acknowledged, never stored
            absrepo = os.fsencode(os.path.realpath(repo))
            if store.read(lambda r: r.get(b"meta", REPO_KEY)) != absrepo:
                store.write(lambda w: w.put(b"meta", REPO_KEY, absrepo))
                store.sync()
        except Exception:
            store.close()
            lower.close()
            raise
        info.update(repo=os.path.realpath(repo), window=window, block_size=store.block_size)
        write_info(store_dir, info)
        return cls(store, lower, overlay, os.path.realpath(repo), mountpoint)

    def close(self) -> None:
        self.lower.close()
        self.store.close()

    async def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from . import commands  # noqa: F401  (registers the timeline commands)
        name = cmd.get("cmd")
        handler = COMMANDS.get(name)  # type: ignore[arg-type]
        if handler is None:
            raise UserError(f"unknown command {name!r}; known: {', '.join(sorted(COMMANDS))}")
        result = await handler(self, cmd)
        if name in DURABLE:
            await make_durable(self.store)
        return result

    def status(self) -> dict[str, Any]:
        from .timeline import Timeline
        tl = Timeline(self)
        counts = self.store.read(lambda r: {
            "checkpoints": r.count(b"ckpts"), "journal": r.count(b"journal"),
            "blocks": r.count(b"blocks"), "nodes": r.count(b"nodes")})
        live = tl.latest()
        return {
            "repo": self.repo, "mountpoint": self.mountpoint, "store": self.store.path,
            "pid": os.getpid() if self.mountpoint else None,
            # never stat the mountpoint here: the daemon would wait on itself
            "in_place": self.mountpoint == self.repo,
            "apply_on_unmount": self.apply_on_exit,
            "kernel_dir_cache": self.kernel_dir_cache,
            "repo_read_ahead": kcache.read_ahead(),
            "live_checkpoint": live.id if live else None,
            "block_size": self.store.block_size,
            "store_bytes": self.store.disk_bytes(), **counts,
        }

    def conversation_text(self) -> bytes:
        from .conversation import live_text
        return live_text(self)

    def conversation_append(self, line: bytes) -> None:
        from .conversation import append_line
        append_line(self, line)


@command("status")
async def _status(s: Session, cmd: dict[str, Any]) -> dict[str, Any]:
    return s.status()


@command("set_apply")
async def _set_apply(s: Session, cmd: dict[str, Any]) -> dict[str, Any]:
    value = cmd.get("apply")
    if not isinstance(value, bool):
        raise UserError('"apply" must be true or false')
    s.apply_on_exit = value
    return {"apply_on_unmount": value}

