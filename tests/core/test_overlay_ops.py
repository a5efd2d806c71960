"""Overlay operations on a real store over a real repo, without FUSE: results and errnos."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from overlayckpt.core.overlay import RENAME_EXCHANGE, RENAME_NOREPLACE, Overlay
from overlayckpt.errors import FsError
from overlayckpt.records import CONTROL_NAME, FIRST_UPPER_INO, ROOT_INO

from .helpers_core import ME, content, exists, ino, names, node

REG = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


def new_file(ov: Overlay, path: str, data: bytes = b"") -> int:
    parent, _, name = path.rpartition("/")
    i, _ = ov.create(ME, ino(ov, parent), os.fsencode(name), REG, 0, 0)
    if data:
        ov.write(ME, i, 0, data)
    return i


def errno_of(fn, *args, **kwargs) -> int:
    with pytest.raises(FsError) as e:
        fn(*args, **kwargs)
    return e.value.errno


# -- create, write, read ---------------------------------------------------------

def test_create_gives_an_upper_inode_and_an_empty_file(ov: Overlay) -> None:
    i = new_file(ov, "new.txt")
    assert i >= FIRST_UPPER_INO
    assert content(ov, "new.txt") == b""
    assert node(ov, "new.txt").nlink == 1
    assert "new.txt" in names(ov)


def test_create_over_an_existing_name_is_eexist(ov: Overlay) -> None:
    assert errno_of(ov.create, ME, ROOT_INO, b"README.md", REG, 0, 0) == errno.EEXIST
    new_file(ov, "x")
    assert errno_of(ov.create, ME, ROOT_INO, b"x", REG, 0, 0) == errno.EEXIST


def test_create_in_a_file_is_enotdir(ov: Overlay) -> None:
    assert errno_of(ov.create, ME, ino(ov, "README.md"), b"x", REG, 0, 0) == errno.ENOTDIR


def test_create_with_a_long_name_is_enametoolong(ov: Overlay) -> None:
    assert errno_of(ov.create, ME, ROOT_INO, b"n" * 256, REG, 0, 0) == errno.ENAMETOOLONG
    new_file(ov, "n" * 255)  # the limit itself is fine


def test_the_control_name_is_reserved(ov: Overlay) -> None:
    assert errno_of(ov.create, ME, ROOT_INO, CONTROL_NAME, REG, 0, 0) == errno.EPERM
    assert errno_of(ov.rename, ME, ROOT_INO, b"README.md", ROOT_INO, CONTROL_NAME, 0) == errno.EPERM


def test_write_at_offsets_across_blocks(ov: Overlay) -> None:
    i = new_file(ov, "f", b"a" * 10000)
    ov.write(ME, i, 4090, b"XYZXYZXYZXYZ")  # straddles the first block boundary
    ov.write(ME, i, 9998, b"END!")  # extends the file
    expect = bytearray(b"a" * 10000)
    expect[4090:4102] = b"XYZXYZXYZXYZ"
    expect[9998:10002] = b"END!"
    assert content(ov, "f") == bytes(expect)
    assert node(ov, "f").size == 10002
    got = ov.live(lambda r: ov.read(r, i, ov.node(r, i), 4088, 6))
    assert got == bytes(expect[4088:4094])


def test_write_into_a_lower_file_keeps_the_rest_of_the_lower(ov: Overlay, repo: Path) -> None:
    original = (repo / "docs" / "guide.txt").read_bytes()
    ov.write(ME, ino(ov, "docs/guide.txt"), 8192, b"EDIT")
    expect = original[:8192] + b"EDIT" + original[8196:]
    assert content(ov, "docs/guide.txt") == expect
    assert (repo / "docs" / "guide.txt").read_bytes() == original  # the repo is untouched


def test_sparse_write_reads_zeros_in_the_hole(ov: Overlay) -> None:
    i = new_file(ov, "sparse")
    ov.write(ME, i, 1 << 20, b"far")
    data = content(ov, "sparse")
    assert len(data) == (1 << 20) + 3
    assert data[: 1 << 20] == bytes(1 << 20) and data[-3:] == b"far"
    # only the written block is stored, not the hole
    assert ov.live(lambda r: sum(1 for _ in r.prefix(b"bmap", i.to_bytes(8, "big")))) == 1


def test_write_to_a_directory_is_einval(ov: Overlay) -> None:
    assert errno_of(ov.write, ME, ino(ov, "docs"), 0, b"x") == errno.EINVAL


def test_read_of_a_directory_is_eisdir(ov: Overlay) -> None:
    i = ino(ov, "docs")
    assert ov.live(lambda r: errno_of(ov.read, r, i, ov.node(r, i), 0, 10)) == errno.EISDIR


# -- truncate ---------------------------------------------------------------------

def test_truncate_shrinks_then_extends_with_zeros(ov: Overlay, repo: Path) -> None:
    i = ino(ov, "docs/guide.txt")
    original = (repo / "docs" / "guide.txt").read_bytes()
    ov.setattr(ME, i, size=5000)
    assert content(ov, "docs/guide.txt") == original[:5000]
    ov.setattr(ME, i, size=12000)
    assert content(ov, "docs/guide.txt") == original[:5000] + bytes(7000)


def test_truncate_to_zero_and_rewrite(ov: Overlay) -> None:
    i = ino(ov, "README.md")
    ov.setattr(ME, i, size=0)
    assert content(ov, "README.md") == b""
    ov.write(ME, i, 0, b"new\n")
    assert content(ov, "README.md") == b"new\n"


def test_truncate_of_a_directory_is_eisdir_and_of_a_symlink_einval(ov: Overlay) -> None:
    assert errno_of(ov.setattr, ME, ino(ov, "docs"), size=0) == errno.EISDIR
    assert errno_of(ov.setattr, ME, ino(ov, "link"), size=0) == errno.EINVAL


# -- unlink, rmdir, whiteouts --------------------------------------------------------

def test_unlink_of_a_lower_file_leaves_a_whiteout(ov: Overlay, repo: Path) -> None:
    ov.remove(ME, ROOT_INO, b"README.md", False)
    assert not exists(ov, "README.md")
    assert "README.md" not in names(ov)
    assert (repo / "README.md").exists()
    raw = ov.live(lambda r: r.get(b"dirents", ROOT_INO.to_bytes(8, "big") + b"README.md"))
    assert raw == b"\0" * 8  # the whiteout hiding the repo's entry
    assert node(ov, "hardlink.md").nlink == 1  # the other name of that inode lost a link


def test_unlink_then_create_the_same_name_is_a_new_file(ov: Overlay) -> None:
    old = ino(ov, "README.md")
    ov.remove(ME, ROOT_INO, b"README.md", False)
    new = new_file(ov, "README.md", b"fresh")
    assert new != old
    assert content(ov, "README.md") == b"fresh"


def test_unlink_in_an_upper_dir_drops_the_entry_without_a_whiteout(ov: Overlay) -> None:
    d, _ = ov.create(ME, ROOT_INO, b"new", DIR, 0, 0)
    new_file(ov, "new/tmp", b"x")
    ov.remove(ME, d, b"tmp", False)
    assert ov.live(lambda r: r.get(b"dirents", d.to_bytes(8, "big") + b"tmp")) is None
    assert not exists(ov, "new/tmp")


def test_unlink_errors(ov: Overlay) -> None:
    assert errno_of(ov.remove, ME, ROOT_INO, b"missing", False) == errno.ENOENT
    assert errno_of(ov.remove, ME, ROOT_INO, b"docs", False) == errno.EISDIR
    ov.remove(ME, ROOT_INO, b"README.md", False)
    assert errno_of(ov.remove, ME, ROOT_INO, b"README.md", False) == errno.ENOENT


def test_rmdir_of_a_non_empty_lower_dir_is_enotempty_until_emptied(ov: Overlay) -> None:
    assert errno_of(ov.remove, ME, ROOT_INO, b"docs", True) == errno.ENOTEMPTY
    ov.remove(ME, ino(ov, "docs"), b"guide.txt", False)
    ov.remove(ME, ROOT_INO, b"docs", True)
    assert not exists(ov, "docs")
    assert errno_of(ov.remove, ME, ROOT_INO, b"README.md", True) == errno.ENOTDIR


def test_rmdir_then_mkdir_is_opaque(ov: Overlay) -> None:
    ov.remove(ME, ino(ov, "docs"), b"guide.txt", False)
    ov.remove(ME, ROOT_INO, b"docs", True)
    ov.create(ME, ROOT_INO, b"docs", DIR, 0, 0)
    assert names(ov, "docs") == []  # the repo's docs/guide.txt does not show through


# -- mkdir, nlink -----------------------------------------------------------------------

def test_mkdir_counts_links_of_the_parent(ov: Overlay) -> None:
    before = node(ov, "src").nlink
    d, _ = ov.create(ME, ino(ov, "src"), b"sub", DIR, 0, 0)
    assert node(ov, "src").nlink == before + 1
    assert node(ov, "src/sub").nlink == 2
    ov.create(ME, d, b"f", REG, 0, 0)
    assert names(ov, "src/sub") == ["f"]
    ov.remove(ME, d, b"f", False)
    ov.remove(ME, ino(ov, "src"), b"sub", True)
    assert node(ov, "src").nlink == before


def test_mkdir_inherits_setgid_group(ov: Overlay) -> None:
    ov.create(ME, ROOT_INO, b"shared", stat.S_IFDIR | 0o2775, 0, 77)
    ov.create(ME, ino(ov, "shared"), b"f", REG, 0, 0)
    ov.create(ME, ino(ov, "shared"), b"d", DIR, 0, 0)
    assert node(ov, "shared/f").gid == 77
    assert node(ov, "shared/d").gid == 77 and node(ov, "shared/d").mode & stat.S_ISGID


# -- rename ----------------------------------------------------------------------------

def test_rename_a_lower_file_into_another_dir(ov: Overlay, repo: Path) -> None:
    i = ino(ov, "README.md")
    assert ov.rename(ME, ROOT_INO, b"README.md", ino(ov, "docs"), b"R.md", 0) is None
    assert not exists(ov, "README.md")
    assert ino(ov, "docs/R.md") == i
    assert content(ov, "docs/R.md") == (repo / "README.md").read_bytes()


def test_rename_over_an_existing_file_replaces_it(ov: Overlay) -> None:
    src, dst = ino(ov, "src/main.py"), ino(ov, "README.md")
    assert ov.rename(ME, ino(ov, "src"), b"main.py", ROOT_INO, b"README.md", 0) == dst
    assert ino(ov, "README.md") == src
    assert node(ov, "hardlink.md").nlink == 1


def test_rename_noreplace(ov: Overlay) -> None:
    assert errno_of(ov.rename, ME, ROOT_INO, b"README.md", ROOT_INO, b"run.sh",
                    RENAME_NOREPLACE) == errno.EEXIST
    ov.rename(ME, ROOT_INO, b"README.md", ROOT_INO, b"new.md", RENAME_NOREPLACE)
    assert exists(ov, "new.md") and not exists(ov, "README.md")


def test_rename_exchange_swaps_a_file_and_a_dir(ov: Overlay) -> None:
    f, d = ino(ov, "README.md"), ino(ov, "empty")
    root_links = node(ov, "").nlink
    ov.rename(ME, ROOT_INO, b"README.md", ROOT_INO, b"empty", RENAME_EXCHANGE)
    assert ino(ov, "README.md") == d and ino(ov, "empty") == f
    assert node(ov, "").nlink == root_links
    assert errno_of(ov.rename, ME, ROOT_INO, b"run.sh", ROOT_INO, b"nothing",
                    RENAME_EXCHANGE) == errno.ENOENT


def test_rename_exchange_across_dirs_moves_the_link_counts(ov: Overlay) -> None:
    ov.create(ME, ROOT_INO, b"d1", DIR, 0, 0)
    ov.create(ME, ino(ov, "d1"), b"sub", DIR, 0, 0)
    new_file(ov, "docs/file")
    ov.rename(ME, ino(ov, "d1"), b"sub", ino(ov, "docs"), b"file", RENAME_EXCHANGE)
    assert node(ov, "d1/sub").is_reg and node(ov, "docs/file").is_dir
    assert node(ov, "d1").nlink == 2 and node(ov, "docs").nlink == 3


def test_rename_bad_flags_are_einval(ov: Overlay) -> None:
    assert errno_of(ov.rename, ME, ROOT_INO, b"README.md", ROOT_INO, b"x", 4) == errno.EINVAL
    assert errno_of(ov.rename, ME, ROOT_INO, b"README.md", ROOT_INO, b"x",
                    RENAME_NOREPLACE | RENAME_EXCHANGE) == errno.EINVAL


def test_rename_dir_over_file_and_file_over_dir(ov: Overlay) -> None:
    assert errno_of(ov.rename, ME, ROOT_INO, b"empty", ROOT_INO, b"README.md", 0) == errno.ENOTDIR
    assert errno_of(ov.rename, ME, ROOT_INO, b"README.md", ROOT_INO, b"empty", 0) == errno.EISDIR


def test_rename_dir_over_a_non_empty_dir_is_enotempty_over_empty_replaces(ov: Overlay) -> None:
    assert errno_of(ov.rename, ME, ROOT_INO, b"empty", ROOT_INO, b"docs", 0) == errno.ENOTEMPTY
    root_links = node(ov, "").nlink
    src = ino(ov, "docs")
    ov.rename(ME, ROOT_INO, b"docs", ROOT_INO, b"empty", 0)
    assert ino(ov, "empty") == src and names(ov, "empty") == ["guide.txt"]
    assert node(ov, "").nlink == root_links - 1


def test_rename_a_lower_dir_keeps_its_subtree(ov: Overlay, repo: Path) -> None:
    ov.rename(ME, ROOT_INO, b"src", ino(ov, "docs"), b"code", 0)
    assert names(ov, "docs/code") == ["main.py", "pkg"]
    assert content(ov, "docs/code/pkg/util.py") == (repo / "src/pkg/util.py").read_bytes()
    assert not exists(ov, "src")


def test_rename_between_two_links_of_one_file_does_nothing(ov: Overlay) -> None:
    assert ov.rename(ME, ROOT_INO, b"README.md", ROOT_INO, b"hardlink.md", 0) is None
    assert exists(ov, "README.md") and exists(ov, "hardlink.md")


def test_rename_of_a_missing_name_is_enoent(ov: Overlay) -> None:
    assert errno_of(ov.rename, ME, ROOT_INO, b"missing", ROOT_INO, b"x", 0) == errno.ENOENT


# -- link, symlink ---------------------------------------------------------------------

def test_hard_link_shares_content_and_counts(ov: Overlay) -> None:
    i = new_file(ov, "a", b"one")
    ov.link(ME, i, ino(ov, "docs"), b"b")
    assert node(ov, "a").nlink == 2
    ov.write(ME, ino(ov, "docs/b"), 0, b"TWO")
    assert content(ov, "a") == b"TWO"
    ov.remove(ME, ROOT_INO, b"a", False)
    assert node(ov, "docs/b").nlink == 1 and content(ov, "docs/b") == b"TWO"


def test_link_errors(ov: Overlay) -> None:
    assert errno_of(ov.link, ME, ino(ov, "docs"), ROOT_INO, b"d2") == errno.EPERM
    assert errno_of(ov.link, ME, ino(ov, "README.md"), ROOT_INO, b"run.sh") == errno.EEXIST


def test_symlink_and_readlink(ov: Overlay) -> None:
    target = b"../somewhere/else"
    i, n = ov.create(ME, ROOT_INO, b"sl", stat.S_IFLNK | 0o777, 0, 0, target=target)
    assert n.size == len(target)
    assert ov.live(lambda r: ov.readlink(r, i, ov.node(r, i))) == target
    lower = ino(ov, "link")
    assert ov.live(lambda r: ov.readlink(r, lower, ov.node(r, lower))) == b"README.md"
    f = ino(ov, "README.md")
    assert ov.live(lambda r: errno_of(ov.readlink, r, f, ov.node(r, f))) == errno.EINVAL


# -- attributes and xattrs -----------------------------------------------------------------

def test_chmod_keeps_the_file_type(ov: Overlay) -> None:
    ov.setattr(ME, ino(ov, "run.sh"), mode=0o600)
    assert node(ov, "run.sh").mode == stat.S_IFREG | 0o600
    ov.setattr(ME, ino(ov, "docs"), mode=0o700)
    assert node(ov, "docs").mode == stat.S_IFDIR | 0o700


def test_utimens_sets_exact_times(ov: Overlay) -> None:
    ov.setattr(ME, ino(ov, "README.md"), atime_ns=1_000_000_001, mtime_ns=2_000_000_002)
    n = node(ov, "README.md")
    assert (n.atime_ns, n.mtime_ns) == (1_000_000_001, 2_000_000_002)


def test_chown(ov: Overlay) -> None:
    ov.setattr(ME, ino(ov, "README.md"), uid=1234, gid=5678)
    n = node(ov, "README.md")
    assert (n.uid, n.gid) == (1234, 5678)


def test_write_moves_mtime(ov: Overlay) -> None:
    ov.setattr(ME, ino(ov, "README.md"), mtime_ns=5)
    ov.write(ME, ino(ov, "README.md"), 0, b"x")
    assert node(ov, "README.md").mtime_ns > 5


def test_xattrs_set_get_list_remove(ov: Overlay, repo: Path) -> None:
    os.setxattr(repo / "run.sh", "user.lower", b"from-repo")
    i = ino(ov, "run.sh")
    get = lambda name: ov.live(lambda r: ov.getxattr(r, i, ov.node(r, i), name))  # noqa: E731
    assert get(b"user.lower") == b"from-repo"
    ov.setxattr(ME, i, b"user.mine", b"v1")
    assert get(b"user.mine") == b"v1" and get(b"user.lower") == b"from-repo"  # copied up
    ov.setxattr(ME, i, b"user.lower", None)
    assert ov.live(lambda r: errno_of(ov.getxattr, r, i, ov.node(r, i), b"user.lower")) == errno.ENODATA
    listed = ov.live(lambda r: ov.xattrs(r, i, ov.node(r, i)))
    assert {k: v for k, v in listed.items() if k.startswith(b"user.")} == {b"user.mine": b"v1"}
    assert os.getxattr(repo / "run.sh", "user.lower") == b"from-repo"


def test_removexattr_of_a_missing_name_is_enodata(ov: Overlay) -> None:
    i = new_file(ov, "x")
    assert errno_of(ov.setxattr, ME, i, b"user.none", None) == errno.ENODATA


def test_lookup_below_a_file_is_enotdir_and_missing_is_enoent(ov: Overlay) -> None:
    f = ino(ov, "README.md")
    assert ov.live(lambda r: errno_of(ov.lookup, r, f, b"x")) == errno.ENOTDIR
    assert ov.live(lambda r: errno_of(ov.lookup, r, ROOT_INO, b"nope")) == errno.ENOENT
    assert ov.live(lambda r: errno_of(ov.lookup, r, ROOT_INO, CONTROL_NAME)) == errno.ENOENT


def test_a_failed_operation_changes_nothing_and_journals_nothing(ov: Overlay) -> None:
    # (store.read: what live does, with the ReadTxn its fn gets typed as one)
    before = ov.store.read(lambda r: (r.count(b"journal"), r.meta_int(b"seq", 1)))
    errno_of(ov.rename, ME, ROOT_INO, b"empty", ROOT_INO, b"docs", 0)
    errno_of(ov.create, ME, ROOT_INO, b"README.md", REG, 0, 0)
    assert ov.store.read(lambda r: (r.count(b"journal"), r.meta_int(b"seq", 1))) == before


def test_changes_survive_a_reopen(open_session, repo: Path, tmp_path: Path) -> None:
    s = open_session(repo, store=tmp_path / "st")
    new_file(s.overlay, "kept", b"data")
    s.overlay.remove(ME, ROOT_INO, b"README.md", False)
    s = open_session(repo, store=tmp_path / "st", create=False)
    assert content(s.overlay, "kept") == b"data"
    assert not exists(s.overlay, "README.md")
