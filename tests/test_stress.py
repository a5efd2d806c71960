"""Long reliability runs (`make stress`): the crash harness of test_reliability at many points."""
from __future__ import annotations

from pathlib import Path

import pytest

import test_reliability as rel  # a module, so pytest does not collect its tests here again

pytestmark = pytest.mark.stress


def test_crash_write_storm_long(tmp_path: Path) -> None:
    """50 kill -9 points in write storms, each followed by a remount and full checks."""
    stats = rel.crash_rounds(tmp_path, rounds=50, seed=2024, verify_limit=60)
    print("crash storm:", stats)
    assert stats["kill_points"] == 50


@pytest.mark.parametrize("seed", [1, 2])
def test_crash_during_restore_long(tmp_path: Path, seed: int) -> None:
    rel.test_crash_during_restore(tmp_path, rounds=8, seed=seed)


@pytest.mark.parametrize("seed", [1, 2])
def test_crash_during_gc_long(tmp_path: Path, seed: int) -> None:
    rel.test_crash_during_gc(tmp_path, rounds=8, seed=seed)


@pytest.mark.parametrize("round_", range(5))
def test_concurrency_repeated(tmp_path: Path, round_: int) -> None:
    """The concurrency scenario again: its checkpoints land at different points each time."""
    rel.test_concurrent_writers_renamers_readers(tmp_path)
