"""Fixtures of the in-process tier: a real Store, Lower and Overlay over tmp_path, no mount.

Nothing here needs root or FUSE. Every session a test opens is checked with
`maintenance.fsck` at teardown: a test whose store is not clean fails there.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from overlayckpt.core.maintenance import fsck
from overlayckpt.core.overlay import Overlay
from overlayckpt.service.session import Session

from .helpers_core import BIG_WINDOW, make_small_repo


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_small_repo(tmp_path / "repo")


@pytest.fixture
def open_session(tmp_path: Path) -> Iterator[Callable[..., Session]]:
    """Open sessions (store under tmp_path); each is fsck'd and closed at teardown."""
    opened: dict[str, Session] = {}  # store path -> its open session

    def factory(repo: Path, *, window: float = BIG_WINDOW, store: Path | None = None,
                create: bool = True) -> Session:
        """A session on store; one already open on that store is closed first (a reopen)."""
        path = str(store or tmp_path / f"store{len(opened)}")
        if path in opened:
            opened.pop(path).close()
        s = Session.open(path, str(repo), create=create, window=window)
        opened[path] = s
        return s

    yield factory
    problems: list[str] = []
    for path, s in opened.items():
        result = fsck(s.store)
        s.close()
        if not result["clean"]:
            problems.append(f"{path}: {result['problems']}")
    if problems:
        pytest.fail("fsck found problems at teardown:\n" + "\n".join(problems))


@pytest.fixture
def session(open_session: Callable[..., Session], repo: Path) -> Session:
    return open_session(repo)


@pytest.fixture
def ov(session: Session) -> Overlay:
    return session.overlay


