"""Lower's cache of the repo's metadata stays bounded whatever the tree's size, and a
directory too big to keep listed is never listed again for each name looked up in it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from overlayckpt.core import lower as lower_module
from overlayckpt.core.lower import Lower, Stat


def counted_lower(repo: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Lower, list[bytes]]:
    """A Lower over repo, and the directories it lists from the disk, in order."""
    lower = Lower(str(repo))
    listed: list[bytes] = []
    real = lower._listdir

    def listdir(path: bytes) -> list[tuple[bytes, Stat]]:
        listed.append(path)
        return real(path)
    monkeypatch.setattr(lower, "_listdir", listdir)
    return lower, listed


def test_the_cache_stays_bounded_and_a_huge_directory_is_listed_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lower_module, "CACHE_ENTRIES", 64)
    repo = tmp_path / "repo"
    for d in range(10):  # 10 directories of 12: more than the cache holds in all
        (repo / f"d{d}").mkdir(parents=True)
        for f in range(12):
            (repo / f"d{d}" / f"f{f}").write_bytes(b"x" * f)
    (repo / "huge").mkdir()
    for f in range(80):  # more than the whole cache holds
        (repo / "huge" / f"f{f:02d}").write_bytes(b"y" * f)
    lower, listed = counted_lower(repo, monkeypatch)
    try:
        for top in sorted(os.listdir(repo)):
            for name in sorted(os.listdir(repo / top)):
                path = f"{top}/{name}"
                st = lower.stat(path.encode())
                want = os.lstat(repo / path)
                assert (st.st_ino, st.st_size, st.st_mode) == (want.st_ino, want.st_size, want.st_mode)
                assert len(lower._stats) + lower._listed <= 64 + 12 * 2
        assert listed.count(b"huge") == 1  # not once per name in it
        assert b"huge" not in lower._listings
    finally:
        lower.close()


def test_a_small_directory_is_listed_at_its_first_name_a_big_one_at_its_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk looks up a directory's names one after the other: a small directory is
    listed (every entry stat-ed, and C answers the rest) at the first; a big one only
    at the second, so that one edit in it costs one stat."""
    repo = tmp_path / "repo"
    (repo / "small").mkdir(parents=True)
    (repo / "small" / "only").write_bytes(b"x")
    (repo / "big").mkdir()
    for f in range(400):
        (repo / "big" / f"a-rather-long-file-name-{f:04d}").write_bytes(b"y")
    if os.lstat(repo / "big").st_size <= lower_module.SMALL_DIR_BYTES:
        pytest.skip("this file system gives directories no size by their names")
    assert os.lstat(repo / "small").st_size <= lower_module.SMALL_DIR_BYTES
    lower, listed = counted_lower(repo, monkeypatch)
    try:
        lower.listdir(b"")  # (a walk listed the root: its directories' sizes are known)
        assert lower.stat(b"small/only").st_ino == os.lstat(repo / "small" / "only").st_ino
        assert listed == [b"", b"small"]
        lower.stat(b"big/a-rather-long-file-name-0000")
        assert listed == [b"", b"small"]
        lower.stat(b"big/a-rather-long-file-name-0001")
        assert listed == [b"", b"small", b"big"]
    finally:
        lower.close()
