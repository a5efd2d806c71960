"""The store across power cuts, in-process: a real LMDB store over tmp_path, no mount.

A cut is simulated on files: the disk holds data.mdb as it was when the last sync
point returned, plus any subset of the pages written since (the kernel may write
back any dirty page, in any order); the copy gets a new inode number, as a store
gets a new incarnation after a reboot.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import lmdb.verify
import pytest

from overlayckpt.errors import StoreDamaged
from overlayckpt.store import lmdbstore, synced
from overlayckpt.store.lmdbstore import Store
from overlayckpt.tables import REPO_KEY

TABLE = b"conv"
PAGE = 4096


def _put_many(store: Store, rng: random.Random, n: int, tag: str) -> dict[bytes, bytes]:
    added: dict[bytes, bytes] = {}
    for _ in range(n):
        key = rng.randbytes(6)
        value = f"{tag}-".encode() * rng.randrange(1, 400)  # some overflow pages too
        store.write(lambda w: w.put(TABLE, key, value))
        added[key] = value
    return added


def _contents(store: Store) -> dict[bytes, bytes]:
    return store.read(lambda r: dict(r.range_from(TABLE)))


def _kill(store: Store) -> None:
    """What a killed daemon leaves: no clean close (which would sync and say so)."""
    store.env.close()
    if store.lock_fd is not None:
        os.close(store.lock_fd)


def _crash_image(durable: Path, live: Path, out: Path, rng: random.Random) -> int:
    """durable's files with a random subset of live's data.mdb pages that differ."""
    shutil.copytree(durable, out)
    old = (durable / "data.mdb").read_bytes()
    new = (live / "data.mdb").read_bytes()
    changed = [i for i in range(0, len(new), PAGE) if new[i:i + PAGE] != old[i:i + PAGE]]
    chosen = [i for i in changed if rng.random() < 0.5]
    rng.shuffle(chosen)
    with open(out / "data.mdb", "r+b") as f:
        for i in chosen:
            f.seek(i)
            f.write(new[i:i + PAGE])
    return len(chosen)


@pytest.mark.parametrize("seed", range(12))
def test_cut_after_a_sync_point_rolls_back_to_it(tmp_path: Path, seed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # the commits after the sync point must stay unsynced: no automatic sync point among
    # them (one would record a newer snapshot, which the image here would not hold)
    monkeypatch.setattr(lmdbstore, "AUTO_POINT_COMMITS", 1 << 30)
    monkeypatch.setattr(lmdbstore, "AUTO_POINT_PAGES", 1 << 30)
    rng = random.Random(seed)
    live, durable = tmp_path / "live", tmp_path / "durable"
    store = Store.open(str(live))
    _put_many(store, rng, 200, "old")
    before = _contents(store)
    # churn: deletes free pages that later commits reuse (which the pin must forbid)
    keys = list(before)
    for k in keys[: len(keys) // 2]:
        store.write(lambda w: w.delete(TABLE, k))
    synced_state = _contents(store)
    store.sync()
    shutil.copytree(live, durable)  # what the disk holds once the sync point returned
    for k in list(synced_state)[:50]:
        store.write(lambda w: w.delete(TABLE, k))
    _put_many(store, rng, 300, "new")  # never synced
    persisted = _crash_image(durable, live, tmp_path / "cut", rng)
    _kill(store)

    reopened = Store.open(str(tmp_path / "cut"))
    assert reopened.cache_lost, persisted
    assert _contents(reopened) == synced_state
    reopened.close()


def test_kill_without_cut_keeps_every_commit(tmp_path: Path) -> None:
    """Same incarnation (the page cache survived): LMDB's newest snapshot is kept."""
    rng = random.Random(1)
    store = Store.open(str(tmp_path / "s"))
    _put_many(store, rng, 20, "a")
    store.sync()
    _put_many(store, rng, 20, "b")  # committed, never synced
    want = _contents(store)
    _kill(store)
    reopened = Store.open(str(tmp_path / "s"))
    assert not reopened.cache_lost
    assert _contents(reopened) == want
    reopened.close()


def test_clean_close_then_new_incarnation_loses_nothing(tmp_path: Path) -> None:
    rng = random.Random(2)
    store = Store.open(str(tmp_path / "s"))
    _put_many(store, rng, 30, "a")
    want = _contents(store)
    store.close()
    shutil.copytree(tmp_path / "s", tmp_path / "copy")  # new inode numbers
    reopened = Store.open(str(tmp_path / "copy"))
    assert _contents(reopened) == want
    reopened.close()


def _newest_written_pages(durable: bytes, live: bytes) -> list[int]:
    """The pages past the meta pages that differ: what commits after the sync point wrote."""
    return [i for i in range(2 * PAGE, len(live), PAGE) if live[i:i + PAGE] != durable[i:i + PAGE]]


@pytest.mark.parametrize("keep", ["suffix", "prefix"])
def test_torn_unsynced_commits_in_the_same_incarnation_fall_back(
        tmp_path: Path, keep: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36: a cut the incarnation cannot tell (a pass-through file system that kept the
    inode number and mount): the newest meta page is on disk, some of the pages it reaches
    are not. The store must open at the recorded sync point, not be refused."""
    monkeypatch.setattr(lmdbstore, "AUTO_POINT_COMMITS", 1 << 30)
    monkeypatch.setattr(lmdbstore, "AUTO_POINT_PAGES", 1 << 30)
    rng = random.Random(36)
    path = tmp_path / "s"
    store = Store.open(str(path))
    _put_many(store, rng, 200, "old")
    for k in list(_contents(store))[:100]:  # free pages for the commits after to reuse
        store.write(lambda w: w.delete(TABLE, k))
    want = _contents(store)
    store.sync()
    durable = (path / "data.mdb").read_bytes()
    _put_many(store, rng, 200, "new")  # never synced
    _kill(store)
    live = (path / "data.mdb").read_bytes()
    changed = _newest_written_pages(durable, live)
    assert len(changed) > 4
    # a contiguous run of the written pages persists, the rest (and never the meta pages,
    # which stay as LMDB wrote them: the newest one names the new roots) keep old content
    cut = len(changed) // 3
    dropped = changed[:cut] if keep == "suffix" else changed[cut:]
    raw = bytearray(live)
    for i in dropped:
        raw[i:i + PAGE] = durable[i:i + PAGE].ljust(PAGE, b"\0")
    (path / "data.mdb").write_bytes(bytes(raw))  # in place: the same inode and mount
    assert lmdb.verify.verify(str(path)), "the torn image should be damaged as LMDB opens it"
    reopened = Store.open(str(path))
    try:
        assert reopened.cache_lost
        assert _contents(reopened) == want
    finally:
        reopened.close()


def test_damaged_store_is_refused_with_one_line(tmp_path: Path) -> None:
    rng = random.Random(3)
    store = Store.open(str(tmp_path / "s"))
    _put_many(store, rng, 100, "a")
    store.sync()
    _kill(store)
    data = tmp_path / "s" / "data.mdb"
    raw = bytearray(data.read_bytes())
    for i in range(2 * PAGE, len(raw), PAGE * 3):  # scribble over some pages
        raw[i + 20:i + 60] = rng.randbytes(40)
    data.write_bytes(bytes(raw))
    with pytest.raises(StoreDamaged) as e:
        Store.open(str(tmp_path / "s"))
    msg = str(e.value)
    assert "\n" not in msg and "damaged" in msg and "recover" in msg


def test_existing_store_never_gets_missing_tables_made(tmp_path: Path) -> None:
    import lmdb
    path = tmp_path / "s"
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=4)  # an LMDB environment, but not one of ours
    env.open_db(b"meta")
    env.close()
    with pytest.raises(StoreDamaged):
        Store.open(str(path))
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin() as txn:
        names = [k for k, _ in txn.cursor()]
    assert names == [b"meta"]
    env.close()


def test_the_record_survives_a_torn_slot(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s"))
    _put_many(store, random.Random(4), 5, "a")
    store.sync()
    rec = synced.load(str(tmp_path / "s"))
    assert rec is not None
    store.close()
    last = synced.load(str(tmp_path / "s"))
    assert last is not None and last.clean and last.counter > rec.counter
    with open(tmp_path / "s" / synced.FILE_NAME, "r+b") as f:  # tear the newest slot
        f.seek((last.counter % 2) * synced.SLOT + 10)
        f.write(b"\xff" * 20)
    older = synced.load(str(tmp_path / "s"))
    assert older is not None and older.counter == last.counter - 1


def test_recover_salvages_a_damaged_store_and_keeps_it(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import run_cli
    # one sync point only: the last page is then one of the tree's (lmdb.verify checks
    # those), not a reused page holding a value (no checksum would tell its damage)
    monkeypatch.setattr(lmdbstore, "AUTO_POINT_COMMITS", 1 << 30)
    monkeypatch.setattr(lmdbstore, "AUTO_POINT_PAGES", 1 << 30)
    rng = random.Random(5)
    path = tmp_path / "s"
    (tmp_path / "repo").mkdir()
    store = Store.open(str(path))
    store.write(lambda w: w.put(b"meta", REPO_KEY, os.fsencode(tmp_path / "repo")))
    want = _put_many(store, rng, 300, "a")
    store.sync()
    _kill(store)
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    last = len(raw) // PAGE - 1
    raw[last * PAGE + 20:last * PAGE + 60] = rng.randbytes(40)  # one damaged page
    data.write_bytes(bytes(raw))
    refused = run_cli("--store", str(path), "log", check=False)
    assert refused.returncode == 1 and "damaged" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "recover" in refused.stderr

    done = run_cli("--store", str(path), "--json", "recover")
    import json
    result = json.loads(done.stdout)
    kept = Path(result["damaged_copy"])
    assert kept.is_dir() and (kept / "data.mdb").read_bytes() == bytes(raw)  # untouched
    again = Store.open(str(path))
    got = _contents(again)
    again.close()
    assert got.items() <= want.items()  # nothing invented
    assert result["entries"] >= len(got)
    if len(got) < len(want):
        assert result["lost"]


def test_map_growth_never_runs_under_an_open_read(tmp_path: Path) -> None:
    import errno

    from overlayckpt.errors import FsError
    store = Store.open(str(tmp_path / "s"))
    store._drop_pins(keep=0)
    store.env.set_mapsize(1 << 20)  # a small map, so that it fills
    store.sync_pin()
    view = store.begin_read()
    before = _contents(store)
    value = b"x" * 60000
    with pytest.raises(FsError) as e:
        for i in range(100):
            store.write(lambda w: w.put(TABLE, b"k%d" % i, value))
    assert e.value.errno == errno.ENOSPC and "long read" in str(e.value)
    assert dict(view.range_from(TABLE)) == before  # the view still reads its snapshot
    store.end_read(view)
    for i in range(100):
        store.write(lambda w: w.put(TABLE, b"k%d" % i, value))
    assert store.env.info()["map_size"] > 1 << 20
    assert len(_contents(store)) == 100
    store.close()
