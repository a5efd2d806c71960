"""Repo directories nothing changed are listed in C (fuse/csrc/lowerdirs.c), as Python
lists them, and never one that a change (of this mount or an earlier one) touched.

The reader thread lists such a directory from the repo at the first lookup or
listing in it and publishes it to names.c; Python learns where its entries are when
the kernel asks about them. Every walk below has the kernel forget its names first
(drop_caches: root), compares names, types, modes, sizes and link counts with a
native copy, and each attribute the kernel got with what Python answers (test_names_from_c).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from conftest import Mount, MountFactory, make_repo
from test_dir_attrs import attrs, synced
from test_names_from_c import append, copy_tree, forget_names, walk_by_listing, walk_by_path

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="forgetting the kernel's names needs root")

DEEP = "deep/a/b/f.txt"


def listed_in_c(m: Mount) -> int:
    return int(m.ctl_ok({"cmd": "status"})["repo_dirs_listed_in_c"])


def deep_repo(path: Path) -> Path:
    """make_repo, with a chain of directories and one holding a hard-linked file."""
    make_repo(path)
    for d in ("deep/a/b", "deep/a/c", "deep/e"):
        (path / d).mkdir(parents=True)
    for i, d in enumerate(("deep", "deep/a", "deep/a/b", "deep/a/c", "deep/e")):
        for k in range(3):
            (path / d / f"f{k}.txt").write_text(f"{d} {k}\n" * (i + k))
    (path / DEEP).write_text("deep\n")
    (path / "deep/a/b/run").symlink_to("f.txt")
    (path / "hl").mkdir()
    (path / "hl" / "x").write_text("x\n")
    os.link(path / "hl" / "x", path / "hl" / "y")
    return path


@pytest.fixture
def deep(tmp_path: Path, mount_factory: MountFactory) -> Mount:
    """deep_repo mounted, copied first to tmp_path / "native" (reading the repo's
    directories moves their atimes, which the mount shows)."""
    repo = deep_repo(tmp_path / "repo")
    copy_tree(repo, tmp_path / "native")
    copy_tree(repo, tmp_path / "at-start")
    return mount_factory(repo)


def test_untouched_repo_directories_are_listed_in_c_as_python_lists_them(deep: Mount,
                                                                       tmp_path: Path) -> None:
    m, native = deep, tmp_path / "native"
    forget_names()
    for name in ("x", "y"):  # (a directory with a hard-linked file: Python's)
        assert synced(m.mnt / "hl" / name) == attrs(m.mnt / "hl" / name)
    assert listed_in_c(m) == 0
    assert (m.mnt / DEEP).read_text() == "deep\n"  # deep, deep/a, deep/a/b
    assert listed_in_c(m) == 3
    walk_by_path(m, native, ("f.txt", "no-such-name"))
    walk_by_listing(m, native)
    assert listed_in_c(m) > 3


def test_a_file_only_c_listed_is_changed_and_named_as_any(deep: Mount, tmp_path: Path) -> None:
    m, native = deep, tmp_path / "native"
    forget_names()
    os.lstat(m.mnt / DEEP)
    assert listed_in_c(m) == 3  # (Python never saw f.txt nor deep/a/b)
    start = m.ctl_ok({"cmd": "checkpoint", "name": "start"})["id"]
    for root in (native, m.mnt):
        append(root / DEEP, b"more\n")
        os.rename(root / "deep/a/c/f1.txt", root / "deep/a/c/g.txt")
        (root / "deep/e/new").mkdir()
    diff = m.cli("diff", str(start), "--stat").stdout
    for path in (DEEP, "deep/a/c/g.txt", "deep/a/c/f1.txt"):
        assert path in diff, diff
    walk_by_path(m, native, ("g.txt", "f1.txt", "new"))
    walk_by_listing(m, native)
    m.ctl_ok({"cmd": "restore", "id": start})
    walk_by_path(m, tmp_path / "at-start", ("g.txt", "f1.txt", "new"))
    assert (m.mnt / DEEP).read_text() == "deep\n"


def test_what_an_earlier_mount_changed_is_never_listed_from_the_repo(
        tmp_path: Path, mount_factory: MountFactory) -> None:
    repo = deep_repo(tmp_path / "repo")
    native = tmp_path / "native"
    copy_tree(repo, native)
    m = mount_factory(repo)
    for root in (native, m.mnt):
        append(root / DEEP, b"changed\n")
        os.chmod(root / "deep/e", 0o700)
        os.unlink(root / "deep/a/c/f2.txt")
    m.cli("unmount", str(m.mnt), "--no-apply")
    m = mount_factory(repo)
    forget_names()
    assert (m.mnt / DEEP).read_bytes() == b"deep\nchanged\n"
    assert not (m.mnt / "deep/a/c/f2.txt").exists()
    walk_by_path(m, native, ("f2.txt", "f.txt"))
    walk_by_listing(m, native)
    assert listed_in_c(m) > 0  # (deep/a/b holds a changed file: Python's; others are C's)


def test_once_the_repo_changes_nothing_is_listed_from_it(tmp_path: Path,
                                                         mount_factory: MountFactory) -> None:
    repo = deep_repo(tmp_path / "repo")
    native = tmp_path / "native"
    copy_tree(repo, native)
    m = mount_factory(repo)
    forget_names()
    walk_by_listing(m, native)
    for root in (native, m.mnt):
        append(root / DEEP, b"applied\n")
    m.cli("apply")  # (writes the repo itself, and pins what it had)
    listed = listed_in_c(m)
    forget_names()
    walk_by_path(m, native, ("f.txt",))
    walk_by_listing(m, native)
    assert listed_in_c(m) == listed


def drop_pages() -> None:
    """Have the kernel forget names and file pages (ours included)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def test_reads_of_files_nothing_changed_are_answered_from_the_repo(deep: Mount, tmp_path: Path) -> None:
    m, native = deep, tmp_path / "native"
    walk_by_listing(m, native)  # (C lists the directories)
    drop_pages()
    reads = m.ctl_ok({"cmd": "status"})["repo_reads_in_c"]
    counted = m.ctl_ok({"cmd": "stats"})["reads"]["count"]
    for rel in files_of(native):
        assert (m.mnt / rel).read_bytes() == (native / rel).read_bytes(), rel
    from_c = m.ctl_ok({"cmd": "status"})["repo_reads_in_c"] - reads
    assert from_c >= 10  # (those in directories C listed)
    assert m.ctl_ok({"cmd": "stats"})["reads"]["count"] - counted >= from_c
    for root in (native, m.mnt):  # (a write C acknowledges, a truncation, a new name)
        append(root / DEEP, b"more\n")
        os.truncate(root / "deep/a/f2.txt", 1)
        os.rename(root / "deep/e/f1.txt", root / "deep/e/g.txt")
    for drop in (lambda: forget_names(sync=False), drop_pages):
        drop()
        for rel in files_of(native):
            assert (m.mnt / rel).read_bytes() == (native / rel).read_bytes(), rel


def as_python_answers(st: os.stat_result) -> tuple[int, ...]:
    """What Python answers for a repo entry nothing changed (tree.py node_from_stat,
    attrs.py entry_attrs), as synced() reads it."""
    size = 0 if stat.S_ISDIR(st.st_mode) else st.st_size
    return (st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, size, (size + 511) // 512,
            st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)


def test_attributes_asked_of_untouched_entries_are_the_repo_s(deep: Mount, tmp_path: Path) -> None:
    """After a read the kernel asks a file's attributes again (its atime); C answers them
    from the repo, as Python would, and Python once the file changed."""
    m, native = deep, tmp_path / "native"
    walk_by_listing(m, native)
    drop_pages()
    before = m.ctl_ok({"cmd": "status"})["repo_attrs_in_c"]
    rels = [str(p.relative_to(native)) for p in native.rglob("*")]
    for rel in rels:
        if (m.mnt / rel).is_file() and not (m.mnt / rel).is_symlink():
            (m.mnt / rel).read_bytes()
        assert synced(m.mnt / rel) == as_python_answers(os.lstat(m.repo / rel)), rel
    assert m.ctl_ok({"cmd": "status"})["repo_attrs_in_c"] - before >= 10
    os.chmod(m.mnt / DEEP, 0o600)
    append(m.mnt / "deep/a/f0.txt", b"x")
    for rel in (DEEP, "deep/a/f0.txt"):
        st = os.lstat(m.repo / rel)
        assert synced(m.mnt / rel) != as_python_answers(st)
    assert stat.S_IMODE(synced(m.mnt / DEEP)[1]) == 0o600
    assert synced(m.mnt / "deep/a/f0.txt")[5] == os.lstat(m.repo / "deep/a/f0.txt").st_size + 1
