"""Where lower entries are: a lower entry's lower path is where it is in the lower, whatever
the overlay did to it (renames of lower directories), in this process and in the next
one, in the live tree, in checkpoints and across restores."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from overlayckpt.core.timeline import Timeline
from overlayckpt.records import ROOT_INO
from overlayckpt.service.session import Session

from .helpers_core import ME, content, ino, native_tree, tree_of


def move_lower_dirs(s: Session) -> None:
    """src -> lib, then lib/pkg -> pkg2: a lower directory moved, and one moved out of it."""
    ov = s.overlay
    ov.rename(ME, ROOT_INO, b"src", ROOT_INO, b"lib", 0)
    ov.rename(ME, ino(ov, "lib"), b"pkg", ROOT_INO, b"pkg2", 0)


def test_a_moved_lower_directory_keeps_the_lower_paths_below_it(session: Session) -> None:
    ov = session.overlay
    util, main = ino(ov, "src/pkg/util.py"), ino(ov, "src/main.py")
    move_lower_dirs(session)
    assert ov.lower_paths.get(util) == b"src/pkg/util.py"
    assert ov.lower_paths.get(main) == b"src/main.py"
    assert ov.lower_paths.get(ino(ov, "pkg2")) == b"src/pkg"
    assert ov.path_of(util) == "pkg2/util.py" and ov.path_of(main) == "lib/main.py"
    assert ino(ov, "pkg2/util.py") == util
    assert content(ov, "pkg2/util.py") == b"def answer():\n    return 42\n"
    assert ov.live(lambda r: ov.ancestors(r, util)) == {ino(ov, "pkg2"), ROOT_INO}


def test_a_new_process_finds_the_lower_paths_below_a_moved_directory(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path) -> None:
    """The next daemon reaches pkg2 through its record and never looked up src/pkg: the
    lower paths below it are learned from the lower."""
    first = open_session(repo, store=tmp_path / "s")
    move_lower_dirs(first)
    before = tree_of(first.overlay)
    ov = open_session(repo, store=tmp_path / "s").overlay  # (closes the first)
    assert content(ov, "pkg2/util.py") == b"def answer():\n    return 42\n"
    util = ino(ov, "pkg2/util.py")
    assert ov.lower_paths.get(util) == b"src/pkg/util.py"
    assert ov.path_of(util) == "pkg2/util.py"
    assert ov.parents.get(util) == (ino(ov, "pkg2"), b"util.py")
    assert tree_of(ov) == before


def test_checkpoints_and_restores_across_a_moved_lower_directory(session: Session, repo: Path) -> None:
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("before", None, ME)
    move_lower_dirs(session)
    ov.write(ME, ino(ov, "pkg2/util.py"), 0, b"DEF")
    at_before = tree_of(ov, lambda r: tl.state(r, tl.get(r, "before")))
    assert at_before == native_tree(repo)
    util = ino(ov, "pkg2/util.py")
    assert ov.lower_paths.get(util) == b"src/pkg/util.py"  # in every state


async def test_restore_across_a_moved_lower_directory(session: Session, repo: Path) -> None:
    ov = session.overlay
    tl = Timeline(session.ctx)
    tl.checkpoint("before", None, ME)
    move_lower_dirs(session)
    ov.write(ME, ino(ov, "pkg2/util.py"), 0, b"DEF")
    after = tree_of(ov)
    await tl.restore("before", ME)
    assert tree_of(ov) == native_tree(repo)
    assert ov.path_of(ino(ov, "src/pkg/util.py")) == "src/pkg/util.py"
    await session.command({"cmd": "restore", "id": "@before-last"})
    assert tree_of(ov) == after
    assert ov.path_of(ino(ov, "pkg2/util.py")) == "pkg2/util.py"


def test_a_walk_of_the_lower_keeps_one_entry_per_inode(session: Session) -> None:
    """What bounds the daemon's memory at 200,000 files: an entry named in the overlay
    where it is in the lower has no parents entry of its own, only its lower place."""
    ov = session.overlay
    readme = ino(ov, "README.md")  # its lower place is the first name seen
    tree_of(ov)
    assert ov.parents._seen.keys() == {readme}  # the hard link: listed after README.md
    assert ov.parents.get(readme) == (ROOT_INO, b"hardlink.md")
    assert ov.lower_paths.get(readme) == b"README.md"
    assert ino(ov, "hardlink.md") == readme  # one lower inode, two names
    for path in ("src", "src/pkg", "src/pkg/util.py", "docs/guide.txt"):
        assert ov.lower_paths.get(ino(ov, path)) == path.encode()
        assert ov.path_of(ino(ov, path)) == path
    assert ov.parents.get(ino(ov, "src/pkg")) == (ino(ov, "src"), b"pkg")
