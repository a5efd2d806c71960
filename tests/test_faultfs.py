"""faultfs on its own: what survives a cut, in each mode (real mounts, seconds)."""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

import pytest

from helpers_faultfs import faultfs
from overlayckpt.store.synced import fsync_dir

PAGE = 4096


def image_of(root: Path) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_dir():
                out[rel] = ("d", st.st_mode & 0o7777)
            else:
                out[rel] = ("f", st.st_mode & 0o7777, st.st_size, hashlib.blake2b(p.read_bytes()).hexdigest())
    return out


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, Path]:
    image = tmp_path / "image"
    image.mkdir()
    (image / "old.txt").write_bytes(b"old\n" * 3000)
    (image / "dir").mkdir()
    (image / "dir" / "kept").write_bytes(b"kept")
    return image, tmp_path / "mnt"


@pytest.mark.parametrize("mode", ["reorder", "drop"])
def test_fsynced_file_survives_a_cut(paths, mode: str) -> None:
    image, mnt = paths
    data = os.urandom(5 * PAGE + 123)
    with faultfs(image, mnt, seed=3, mode=mode) as fs:
        write_synced(mnt / "new.bin", data)  # a new file: its entry needs the directory's fsync
        fsync_dir(mnt)
        with open(mnt / "old.txt", "r+b") as f:  # an existing entry: the file's fsync is enough
            f.seek(PAGE + 5)
            f.write(b"X" * 3 * PAGE)
            os.fsync(f.fileno())
        expect_old = (mnt / "old.txt").read_bytes()
        (mnt / "later").write_bytes(b"never synced")
        rep = fs.cut()
        assert rep["mode"] == mode
        with pytest.raises(OSError) as e:
            (mnt / "old.txt").read_bytes()
        assert e.value.errno == errno.EIO
        fs.unmount()
    assert (image / "new.bin").read_bytes() == data
    assert (image / "old.txt").read_bytes() == expect_old
    assert (image / "dir" / "kept").read_bytes() == b"kept"


def test_a_file_fsync_does_not_make_its_entry_durable(paths) -> None:
    image, mnt = paths
    with faultfs(image, mnt, mode="drop") as fs:
        write_synced(mnt / "new.bin", b"data")
        fs.cut()
    assert not (image / "new.bin").exists()


def test_unsynced_writes_are_lost_in_drop_mode(paths) -> None:
    image, mnt = paths
    before = image_of(image)
    with faultfs(image, mnt, mode="drop") as fs:
        (mnt / "new").write_bytes(b"n" * 10000)
        with open(mnt / "old.txt", "r+b") as f:
            f.write(b"changed")
        os.truncate(mnt / "dir" / "kept", 0)
        os.mkdir(mnt / "d2")
        os.rename(mnt / "dir" / "kept", mnt / "d2" / "moved")
        os.chmod(mnt / "old.txt", 0o600)
        rep = fs.cut()
        fs.unmount()
    assert rep["pages_persisted"] == 0 and rep["ns_persisted"] == 0 and rep["ns_pending"] >= 3
    assert image_of(image) == before


def unsynced_overwrite(image: Path, mnt: Path, seed: int) -> tuple[bytes, dict]:
    """40 single-page writes over a 40-page file plus an extension, none synced, then a cut."""
    (image / "f").write_bytes(b"a" * 40 * PAGE)
    with faultfs(image, mnt, seed=seed, mode="reorder") as fs:
        fd = os.open(mnt / "f", os.O_WRONLY)
        try:
            for i in range(42):
                os.pwrite(fd, bytes([ord("b") + i % 20]) * PAGE, i * PAGE)
        finally:
            os.close(fd)
        (mnt / "unsynced-new").write_bytes(b"x" * 3 * PAGE)
        rep = fs.cut()
    return (image / "f").read_bytes(), rep


def test_reorder_persists_a_random_subset_deterministically(tmp_path: Path) -> None:
    outcomes = []
    for seed in range(6):
        image, mnt = tmp_path / f"i{seed}", tmp_path / f"m{seed}"
        image.mkdir()
        data, rep = unsynced_overwrite(image, mnt, seed)
        assert rep["pages_pending"] == 42 + 3
        assert len(data) in (40 * PAGE, 41 * PAGE, 42 * PAGE)
        new_pages = sum(1 for i in range(40) if data[i * PAGE] != ord("a"))
        assert all(data[i * PAGE:(i + 1) * PAGE] in (b"a" * PAGE, bytes([ord("b") + i % 20]) * PAGE)
                   for i in range(40)), "a page holds something never written to it"
        outcomes.append((new_pages, len(data), rep["pages_persisted"]))
    # the same seed and the same requests give the same image
    image, mnt = tmp_path / "again", tmp_path / "mnt-again"
    image.mkdir()
    data, rep = unsynced_overwrite(image, mnt, 2)
    assert (sum(1 for i in range(40) if data[i * PAGE] != ord("a")), len(data),
            rep["pages_persisted"]) == outcomes[2]
    # over these seeds some cut kept part of the writes: neither nothing nor everything
    assert any(0 < n < 40 for n, _, _ in outcomes), outcomes
    assert len(set(outcomes)) > 1, outcomes


def test_rename_without_fsyncdir_may_be_undone(tmp_path: Path) -> None:
    results = set()
    for seed in range(8):
        image, mnt = tmp_path / f"i{seed}", tmp_path / f"m{seed}"
        image.mkdir()
        (image / "a").write_bytes(b"A")
        (image / "b").write_bytes(b"B")
        with faultfs(image, mnt, seed=seed, mode="reorder") as fs:
            os.replace(mnt / "a", mnt / "b")  # over an existing file, as os.replace does
            os.rename(mnt / "b", mnt / "c")
            fs.cut()
        got = tuple(sorted((p.name, p.read_bytes()) for p in image.iterdir()))
        assert got in ((("a", b"A"), ("b", b"B")), (("b", b"A"),), (("c", b"A"),)), got
        results.add(got)
    assert len(results) > 1, "reorder never undid (or never kept) an unsynced rename"
    # and with the directory's fsync the rename is durable in both modes
    for mode in ("reorder", "drop"):
        image, mnt = tmp_path / f"s{mode}", tmp_path / f"ms{mode}"
        image.mkdir()
        (image / "a").write_bytes(b"A")
        (image / "b").write_bytes(b"B")
        with faultfs(image, mnt, seed=1, mode=mode) as fs:
            os.replace(mnt / "a", mnt / "b")
            fsync_dir(str(mnt))  # (fsync_dir is typed str: a Path works as well)
            fs.cut()
        assert sorted((p.name, p.read_bytes()) for p in image.iterdir()) == [("b", b"A")]


def test_clean_unmount_keeps_everything(paths) -> None:
    image, mnt = paths
    with faultfs(image, mnt, seed=5, mode="reorder") as fs:
        (mnt / "new").write_bytes(os.urandom(3 * PAGE + 7))
        os.mkdir(mnt / "d2")
        os.mkdir(mnt / "d2" / "d3", 0o750)
        (mnt / "d2" / "d3" / "deep").write_bytes(b"deep")
        os.rename(mnt / "dir" / "kept", mnt / "d2" / "moved")
        os.rmdir(mnt / "dir")
        with open(mnt / "old.txt", "r+b") as f:
            f.truncate(5000)
            f.seek(20000)
            f.write(b"sparse tail")  # a hole between
        os.chmod(mnt / "new", 0o751)
        (mnt / "gone").write_bytes(b"x")
        os.unlink(mnt / "gone")
        fd = os.open(mnt / "open-unlinked", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.unlink(mnt / "open-unlinked")
        os.write(fd, b"still works")
        assert os.pread(fd, 100, 0) == b"still works"
        os.close(fd)
        with pytest.raises(FileExistsError):
            os.open(mnt / "new", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        expect = image_of(mnt)
        rep = fs.unmount()
    assert rep["event"] == "unmount"
    assert image_of(image) == expect
    data = (image / "old.txt").read_bytes()
    assert len(data) == 20011 and data[5000:20000] == bytes(15000) and data[:5000] == b"old\n" * 1250


def test_mmap_shared_write_then_msync_survives(paths) -> None:
    image, mnt = paths
    (image / "mapped").write_bytes(bytes(8 * PAGE))
    with faultfs(image, mnt, seed=9, mode="drop") as fs:
        fd = os.open(mnt / "mapped", os.O_RDWR)
        try:
            with mmap.mmap(fd, 8 * PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                m[PAGE:PAGE + 5] = b"hello"
                m[7 * PAGE - 3:7 * PAGE] = b"end"
                m.flush()  # msync(MS_SYNC): writeback, then fsync
                m[0:4] = b"lost"  # dirty in the page cache at the cut: never reached the disk
                fs.cut()
        finally:
            with pytest.raises(OSError):  # close flushes: EIO after the cut
                os.close(fd)
        fs.unmount()
    data = (image / "mapped").read_bytes()
    assert data[PAGE:PAGE + 5] == b"hello" and data[7 * PAGE - 3:7 * PAGE] == b"end"
    assert data[:4] == bytes(4)


def test_lmdb_works_on_faultfs_and_inode_numbers_change(paths) -> None:
    lmdb = pytest.importorskip("lmdb")
    image, mnt = paths
    inos = []
    for round_ in range(2):
        with faultfs(image, mnt, seed=round_) as fs:
            env = lmdb.open(str(mnt / "env"), map_size=1 << 30, sync=True)
            with env.begin(write=True) as txn:
                for i in range(300):
                    txn.put(b"k%d-%d" % (round_, i), os.urandom(300))
            with env.begin() as txn:
                assert txn.stat()["entries"] == 300 * (round_ + 1)
            env.close()
            inos.append(os.stat(mnt / "old.txt").st_ino)
            fs.unmount()
    assert inos[0] != inos[1], "inode numbers should come from a fresh space on every mount"
