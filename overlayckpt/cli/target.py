"""Where a command goes (a mounted daemon, or an unmounted store) and how its answer is shown.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from overlayckpt.cli import client
from overlayckpt.errors import UserError

TYPE_CHECKING = False  # (not typing's: typing costs every CLI start a few ms)
if TYPE_CHECKING:
    from typing import TypeVar

    from overlayckpt.messages import Request
    R = TypeVar("R")

# -- finding the session ----------------------------------------------------

def _has_ctl(d: str) -> bool:
    """Whether d is a mount of ours (it has the control file); a directory we may not
    search is said so, not taken for "not a mount" (chmod 000 MNT)."""
    try:
        os.stat(os.path.join(d, ".overlayckpt", "ctl"))
        return True
    except PermissionError:
        pass
    except (OSError, ValueError):
        return False
    try:  # d itself, or a .overlayckpt someone planted in it (ours is open to all: 0755)?
        os.stat(os.path.join(d, ".overlayckpt"))
        return False
    except PermissionError:
        from overlayckpt.names import quote_path
        raise UserError(f"permission denied on {quote_path(d)}: ask its owner for access "
                        "(search permission, x), or run as its owner") from None
    except (OSError, ValueError):
        return False


def find_mount(explicit: str | None) -> str | None:
    """The mountpoint of the session: --mount, $OVERLAYCKPT_MOUNT, or walking up from cwd."""
    candidate = explicit or os.environ.get("OVERLAYCKPT_MOUNT")
    if candidate:
        if not _has_ctl(candidate):
            if client.is_stale(candidate):
                raise UserError(f"{candidate}: the daemon is gone (stale mount); "
                                f"run 'overlayckpt mount' again to recover it")
            raise UserError(f"{candidate} is not an overlayckpt mount: check --mount")
        return os.path.abspath(candidate)
    try:
        d = os.getcwd()
    except OSError:
        raise UserError("the current directory is gone (stale mount?): cd elsewhere and retry") from None
    while True:
        if _has_ctl(d):
            return d
        if client.is_stale(d):
            raise UserError(f"{d}: the daemon is gone (stale mount); run 'overlayckpt mount' "
                            "again to recover it")
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


class Target:
    """Where a command goes: a mounted daemon, or an unmounted store."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.mount: str | None = None
        self.store: str | None = args.store
        if args.store is None:
            self.mount = find_mount(args.mount)
            if self.mount is None:
                raise UserError("no overlayckpt session here: cd into a mount, or pass --mount or --store")
        elif not os.path.isdir(args.store):
            raise UserError(f"no session store at {args.store}: check --store")

    def call(self, cmd: Request[R]) -> R:
        if self.mount is not None:
            return client.send(self.mount, cmd)
        return client.call_store(self.store or "", cmd)


def emit(args: argparse.Namespace, result: R, text: Callable[[R], str]) -> None:
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out = text(result)
        if out:
            print(out)
