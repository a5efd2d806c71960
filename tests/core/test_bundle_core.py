"""Session bundles offline: export, import over the same repo and over another checkout
(the inode remap), and the refusals."""
from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import UserError
from overlayckpt.export.importer import import_bundle
from overlayckpt.records import FIRST_UPPER_INO, ROOT_INO
from overlayckpt.service.session import Session

from .helpers_core import ME, ino, tree_of

REG = stat.S_IFREG | 0o644


def record(s: Session) -> None:
    """A few checkpoints that touch repo inodes (edit, rename, delete, xattr) and new ones."""
    ov = s.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"# EDITED")
    Timeline(s.ctx).checkpoint("edited", None, ME)
    ov.rename(ME, ino(ov, "src/pkg"), b"util.py", ROOT_INO, b"util.py", 0)
    ov.remove(ME, ino(ov, "docs"), b"guide.txt", False)
    ov.setxattr(ME, ino(ov, "run.sh"), b"user.tag", b"v")
    i, _ = ov.create(ME, ino(ov, "src"), b"new.py", REG, 0, 0)
    ov.write(ME, i, 0, b"print('new')\n")
    Timeline(s.ctx).checkpoint("moved", None, ME)
    ov.write(ME, ino(ov, "bin.dat"), 100, b"\x01\x02")


def every_tree(s: Session) -> dict[Any, dict[str, tuple]]:
    tl = Timeline(s.ctx)
    ids = [c.id for c in s.store.read(tl.all)]
    out: dict[int | str, dict[str, tuple]] = {cid: tree_of(s.overlay, lambda r: tl.state(r, tl.get(r, cid)))
                                             for cid in ids}
    out["live"] = tree_of(s.overlay)
    return out


def xattrs_of(s: Session, path: str) -> dict[bytes, bytes]:
    ov = s.overlay
    i = ino(ov, path)
    got = ov.live(lambda r: ov.xattrs(r, i, ov.node(r, i)))
    return {k: v for k, v in got.items() if k.startswith(b"user.")}


async def export(s: Session, path: Path) -> dict[str, Any]:
    return await s.command({"cmd": "export_bundle", "path": str(path)})


async def test_bundle_round_trip_over_the_same_repo(open_session, session: Session, repo: Path,
                                                    tmp_path: Path) -> None:
    record(session)
    expected = every_tree(session)
    reply = await export(session, tmp_path / "s.bundle")
    assert reply["checkpoints"] == len(expected) - 1 and reply["bytes"] > 0
    result = import_bundle(str(tmp_path / "s.bundle"), str(tmp_path / "imported"), None)
    assert result["repo"] == str(repo.resolve())
    s2 = open_session(repo, store=tmp_path / "imported", create=False)
    assert every_tree(s2) == expected
    assert xattrs_of(s2, "run.sh") == {b"user.tag": b"v"}


async def test_bundle_import_into_another_checkout_remaps_the_inodes(
        open_session, session: Session, repo: Path, tmp_path: Path) -> None:
    record(session)
    expected = every_tree(session)
    await export(session, tmp_path / "s.bundle")
    checkout = tmp_path / "checkout"
    subprocess.run(["cp", "-a", str(repo), str(checkout)], check=True)
    import_bundle(str(tmp_path / "s.bundle"), str(tmp_path / "imported"), str(checkout))
    s2 = open_session(checkout, store=tmp_path / "imported", create=False)
    ov2 = s2.overlay
    assert every_tree(s2) == expected
    # the edited repo file now carries the checkout's inode number, not the recorded one
    assert ino(ov2, "README.md") == (checkout / "README.md").stat().st_ino
    assert ino(ov2, "util.py") == (checkout / "src/pkg/util.py").stat().st_ino
    # and it keeps working: a restore and a new file on the imported session
    await Timeline(s2.ctx).restore("edited", ME)
    assert tree_of(ov2) == expected[s2.store.read(lambda r: Timeline(s2.ctx).get(r, "edited").id)]
    new, _ = ov2.create(ME, ROOT_INO, b"after-import", REG, 0, 0)
    assert new >= FIRST_UPPER_INO


async def test_import_refuses_a_checkout_where_a_referenced_file_differs(
        session: Session, repo: Path, tmp_path: Path) -> None:
    record(session)
    await export(session, tmp_path / "s.bundle")
    checkout = tmp_path / "checkout"
    subprocess.run(["cp", "-a", str(repo), str(checkout)], check=True)
    (checkout / "README.md").write_text("something else\n")
    with pytest.raises(UserError, match="README.md has other content"):
        import_bundle(str(tmp_path / "s.bundle"), str(tmp_path / "imported"), str(checkout))
    assert not (tmp_path / "imported").exists()  # a failed import leaves no store behind


async def test_import_never_merges_into_a_store_that_holds_a_session(
        session: Session, repo: Path, tmp_path: Path) -> None:
    record(session)
    await export(session, tmp_path / "s.bundle")
    import_bundle(str(tmp_path / "s.bundle"), str(tmp_path / "imported"), None)
    with pytest.raises(UserError, match="already holds a session"):
        import_bundle(str(tmp_path / "s.bundle"), str(tmp_path / "imported"), None)
    with pytest.raises(UserError, match="in use"):  # the open session's own store
        import_bundle(str(tmp_path / "s.bundle"), session.store.path, None)


async def test_export_bundle_needs_an_absolute_path(session: Session) -> None:
    with pytest.raises(UserError):
        await session.command({"cmd": "export_bundle", "path": "relative.bundle"})


async def test_import_over_a_checkout_that_split_a_hard_link(
        open_session, session: Session, repo: Path, tmp_path: Path) -> None:
    ov = session.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"# EDITED")  # hardlink.md is the same inode
    expected = every_tree(session)
    assert expected["live"]["hardlink.md"] == expected["live"]["README.md"]
    await export(session, tmp_path / "s.bundle")
    checkout = tmp_path / "checkout"
    shutil.copytree(repo, checkout, symlinks=True)  # README.md and hardlink.md: two inodes
    # the edit would show under README.md only: refused, naming the file, nothing imported
    with pytest.raises(UserError, match="README.md has 2 names"):
        import_bundle(str(tmp_path / "s.bundle"), str(tmp_path / "imported"), str(checkout))
    assert not (tmp_path / "imported" / "data.mdb").exists()
    # a copy that keeps the hard link imports, and shows the edit under both names
    kept = tmp_path / "kept"
    subprocess.run(["cp", "-a", str(repo), str(kept)], check=True)
    import_bundle(str(tmp_path / "s.bundle"), str(tmp_path / "imported2"), str(kept))
    s2 = open_session(kept, store=tmp_path / "imported2", create=False)
    assert every_tree(s2) == expected
