"""Paths that commands carry (a fork's store, a bundle file), examined without ever
reaching through the session's own mount on the thread that serves it.

Any path a ctl line names may lead into the mount (directly, through a symlink, a
bind mount or `..`). Resolving or statting it on the request loop would make the
daemon wait on itself, and every process using the mount with it. So a path is
first compared by name (no system call), then resolved and compared by the identity
of its ancestors on a worker thread, where the loop stays free to answer; a path in
the mount or in the repo is refused (store/places.py says why each place is off limits).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from overlayckpt.errors import UserError
from overlayckpt.store.places import Place, inside, lexically_inside

T = TypeVar("T")


def _named(s: Any) -> list[Place]:
    out = [Place("the repo", s.repo)]
    if s.mountpoint:
        out.append(Place("the mount", s.mountpoint))
    return out


def _places(s: Any) -> list[Place]:
    """The repo (by the lower directory's identity) and the mount (its whole device);
    on a worker thread: the mount root is statted through the mount."""
    st = os.fstat(s.lower.fd)
    out = [Place("the repo", s.repo, ident=(st.st_dev, st.st_ino))]
    if s.mountpoint:
        out.append(Place("the mount", s.mountpoint, dev=os.stat(s.mountpoint).st_dev))
    return out


def refusal(what: str, path: str, place: Place) -> UserError:
    return UserError(f"{what} {path} is inside {place.label} {place.path}: the daemon never "
                     "writes into the repo or through its own mount; give a path outside both")


async def off_mount(s: Any, value: Any, what: str, then: Callable[[str], T] | None = None
                    ) -> tuple[str, T | None]:
    """value (an absolute path) resolved, once it is known to lie outside the mount and
    the repo; then(resolved) runs on the same worker thread (so no path it touches is
    resolved on the loop). UserError (one line) otherwise."""
    if not isinstance(value, str) or not os.path.isabs(value) or "\0" in value:
        raise UserError(f"{what} must be an absolute path")
    found = lexically_inside(value, _named(s))  # (no system call: on the loop)
    if found:
        raise refusal(what, value, found)

    def examine() -> tuple[str, T | None]:
        place = inside(value, _places(s))
        if place is not None:
            raise refusal(what, value, place)
        real = os.path.realpath(value)
        return real, then(real) if then is not None else None
    return await trio.to_thread.run_sync(examine, abandon_on_cancel=True)


async def git_dir_off_mount(s: Any, git_dir: str) -> None:
    """The repo's .git and its HEAD (which the daemon reads itself) must not lead into
    the mount: a repo may hold a .git symlink to anywhere. stat follows every link to
    where it ends; on the mount's device is in the mount."""
    if not s.mountpoint:
        return

    def examine() -> None:
        dev = os.stat(s.mountpoint).st_dev
        for name in (".git", ".git/HEAD"):
            try:
                st = os.stat(os.path.join(os.path.dirname(git_dir), name))
            except OSError:
                continue
            if st.st_dev == dev:
                raise UserError(f"the repo's {name} leads into the mount {s.mountpoint}: the "
                                "daemon would reach it through its own mount; make .git a "
                                "directory of the repo")
    await trio.to_thread.run_sync(examine, abandon_on_cancel=True)
