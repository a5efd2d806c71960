"""First contact: the mount shows the repo, edits land in the store, not the repo."""
from __future__ import annotations

import os

from conftest import Mount, tree_digest


def test_mount_shows_repo(mounted: Mount) -> None:
    assert tree_digest(str(mounted.mnt)) == tree_digest(str(mounted.repo))


def test_control_dir_hidden_but_found(mounted: Mount) -> None:
    assert ".overlayckpt" not in os.listdir(mounted.mnt)
    assert os.path.isdir(mounted.mnt / ".overlayckpt")
    assert mounted.ctl({"cmd": "status"})["ok"]


def test_edits_stay_out_of_repo(mounted: Mount) -> None:
    (mounted.mnt / "README.md").write_text("changed\n")
    (mounted.mnt / "new.txt").write_text("new\n")
    os.unlink(mounted.mnt / "run.sh")
    assert (mounted.mnt / "README.md").read_text() == "changed\n"
    assert (mounted.mnt / "hardlink.md").read_text() == "changed\n"
    assert (mounted.repo / "README.md").read_text() == "# demo\n\nhello\n"
    assert not (mounted.repo / "new.txt").exists()
