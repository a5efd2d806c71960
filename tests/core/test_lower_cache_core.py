"""Lower's cache of the repo's metadata stays bounded whatever the tree's size, and a
directory too big to keep listed is never listed again for each name looked up in it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from overlayckpt.core import lower as lower_module
from overlayckpt.core.lower import Lower, Stat


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
    lower = Lower(str(repo))
    listed: list[bytes] = []
    real = lower._listdir
    def listdir(path: bytes) -> list[tuple[bytes, Stat]]:
        listed.append(path)
        return real(path)
    monkeypatch.setattr(lower, "_listdir", listdir)
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
