"""Lookups and listings answered in C (fuse/csrc/names.c) are Python's answers, and no
change leaves one stale.

Python publishes a directory's listing to C as it lists it; C then answers the LOOKUPs
of its names and its READDIRPLUS until something in it changes. Each step below changes
the tree, on the mount and on a native copy alike (restores included, mirrored with
copies of the native tree), then has the kernel forget every name and walks the mount
twice: by path, a LOOKUP per name as git status does, and by listing, READDIRPLUS as
find does. Names, types, modes, sizes, link counts and symlink targets must be the
native copy's, and every attribute the kernel got must be what Python answers now
(statx forcing a GETATTR). Forgetting names needs root (drop_caches).
"""
from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Mount, MountFactory, make_repo
from overlayckpt.core.lower import CACHE_ENTRIES
from test_dir_attrs import attrs, synced

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="forgetting the kernel's names needs root")


def forget_names(sync: bool = True) -> None:
    """Have the kernel drop every dentry and inode it can (ours included). Without sync,
    writes C acknowledged may not be stored yet."""
    if sync:
        os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as out:
        out.write(data)


def copy_tree(src: Path, dest: Path) -> None:
    """A copy keeping hard links (shutil.copytree makes each name a file of its own)."""
    subprocess.run(["cp", "-a", str(src), str(dest)], check=True)


def counters(m: Mount) -> tuple[int, int, int]:
    s = m.ctl_ok({"cmd": "status"})
    return s["names_from_c"], s["listings_from_c"], s["absent_from_c"]


def shape(path: Path) -> tuple:
    """What must match between the mount and a native directory."""
    st = os.lstat(path)
    target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    size = st.st_size if not stat.S_ISDIR(st.st_mode) else None  # (directory sizes differ)
    return st.st_mode, size, st.st_nlink if not stat.S_ISDIR(st.st_mode) else None, target


def tree(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = shape(p)
    return out


def walk_by_path(m: Mount, native: Path, names: tuple[str, ...] = ()) -> None:
    """lstat every native path on the mount, names forgotten first (writes perhaps not
    stored yet): LOOKUPs only. Then look up each of names in every directory: there on
    the mount where there natively (C answers those a listing lacks as absent)."""
    forget_names(sync=False)
    found = tree(native)
    for rel, want in found.items():
        p = m.mnt / rel
        assert shape(p) == want, rel
        assert attrs(p) == synced(p), f"{rel}: the lookup's attributes are not Python's"
    for rel in ("no-such-name", "src/no-such-name"):
        assert not (m.mnt / rel).exists()
    for d in [""] + [rel for rel, want in found.items() if stat.S_ISDIR(want[0])]:
        for name in names:
            rel = os.path.join(d, name)
            assert os.path.lexists(m.mnt / rel) == (rel in found), f"{rel}: there or not"


def walk_by_listing(m: Mount, native: Path) -> None:
    """Walk the mount by listing, names forgotten first: READDIRPLUS, then lookups of
    what the kernel got from it."""
    forget_names()
    seen = {}
    for dirpath, dirnames, filenames in os.walk(m.mnt):  # (.overlayckpt is never listed)
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(m.mnt))
            seen[rel] = shape(p)
            assert attrs(p) == synced(p), f"{rel}: the listing's attributes are not Python's"
    assert seen == tree(native)


class Twins:
    """The same change on the mount and on the native copy."""

    def __init__(self, m: Mount, native: Path, rng: random.Random) -> None:
        self.m, self.native, self.rng = m, native, rng
        self.saved: dict[int, Path] = {}  # checkpoint id -> a copy of the native tree then
        self.n = 0

    def both(self, fn: Callable[[Path], object]) -> None:
        fn(self.native)
        fn(self.m.mnt)

    def files(self) -> list[str]:
        return sorted(k for k, v in tree(self.native).items() if stat.S_ISREG(v[0]))

    def dirs(self) -> list[str]:
        return [""] + sorted(k for k, v in tree(self.native).items() if stat.S_ISDIR(v[0]))

    def new_name(self) -> str:
        self.n += 1
        return f"n{self.n}"

    def step(self) -> str:
        rng, files, dirs = self.rng, self.files(), self.dirs()
        f = rng.choice(files) if files else ""
        d = rng.choice(dirs)
        new = os.path.join(d, self.new_name())
        kind = rng.choice(["create", "append", "truncate", "chmod", "rename", "move", "unlink",
                           "mkdir", "rmdir", "symlink", "link", "utime", "rename dir",
                           "checkpoint", "restore"])
        if not f and kind in ("append", "truncate", "chmod", "rename", "move", "unlink",
                                  "symlink", "link", "utime"):
            kind = "create"
        if kind == "create":
            data = b"x" * rng.randrange(0, 9000)
            self.both(lambda r: (r / new).write_bytes(data))
        elif kind == "append":
            data = b"y" * rng.randrange(1, 5000)
            self.both(lambda r: append(r / f, data))
        elif kind == "truncate":
            size = rng.randrange(0, 3)
            self.both(lambda r: os.truncate(r / f, size))
        elif kind == "chmod":
            mode = rng.choice([0o600, 0o644, 0o755, 0o700])
            self.both(lambda r: os.chmod(r / f, mode))
        elif kind in ("rename", "move"):
            to = os.path.join(os.path.dirname(f) if kind == "rename" else d, self.new_name())
            self.both(lambda r: os.rename(r / f, r / to))
        elif kind == "unlink":
            self.both(lambda r: os.unlink(r / f))
        elif kind == "mkdir":
            self.both(lambda r: os.mkdir(r / new))
        elif kind == "rmdir":
            empty = [x for x in dirs[1:] if not os.listdir(self.native / x)]
            if not empty:
                return "rmdir (none empty)"
            f = empty[0]
            self.both(lambda r: os.rmdir(r / empty[0]))
        elif kind == "symlink":
            self.both(lambda r: os.symlink(os.path.basename(f), r / new))
        elif kind == "link":
            self.both(lambda r: os.link(r / f, r / new))
        elif kind == "utime":  # (before 1970 too: C gets those as the kernel's signed seconds)
            t = rng.randrange(-2 * 10**9, 2 * 10**9) * 10**9 + rng.randrange(10**9)
            self.both(lambda r: os.utime(r / f, ns=(t, t)))
        elif kind == "rename dir":
            if len(dirs) < 2:
                return "rename dir (none)"
            src = rng.choice(dirs[1:])
            to = os.path.join(os.path.dirname(src), self.new_name())
            self.both(lambda r: os.rename(r / src, r / to))
        elif kind == "checkpoint":
            ck = self.m.ctl_ok({"cmd": "checkpoint", "name": self.new_name()})["id"]
            copy = self.native.parent / f"native-at-{ck}"
            copy_tree(self.native, copy)
            self.saved[ck] = copy
        elif kind == "restore":
            if not self.saved:
                return "restore (no checkpoint)"
            ck = rng.choice(sorted(self.saved))
            self.m.ctl_ok({"cmd": "restore", "id": ck})
            shutil.rmtree(self.native)
            copy_tree(self.saved[ck], self.native)
        return f"{kind} {f} {d} {new}"


def test_published_names_answer_as_python_does(mounted: Mount) -> None:
    """After a listing, C answers the lookups of its names, as Python would."""
    m = mounted
    names = [f"f{i:03d}.txt" for i in range(60)]
    (m.mnt / "many").mkdir()
    for name in names:
        (m.mnt / "many" / name).write_text(name)
    os.listdir(m.mnt / "many")  # (Python lists it: READDIRPLUS, published)
    forget_names()
    names_before, listings_before, _ = counters(m)
    got = {name: attrs(m.mnt / "many" / name) for name in names}
    names_after, _, _ = counters(m)
    assert names_after - names_before >= len(names) - 2  # (the first lookups may be Python's)
    for name in names:
        assert got[name] == synced(m.mnt / "many" / name), name
    forget_names()
    assert sorted(os.listdir(m.mnt / "many")) == names
    assert counters(m)[1] > listings_before


def test_a_write_acknowledged_in_c_is_seen_at_once(mounted: Mount) -> None:
    """A write C acknowledged before Python stored it: a lookup right after it (the
    kernel having forgotten the name) shows the new size, never the published one."""
    m = mounted
    d = m.mnt / "src"
    files = sorted(os.listdir(d))  # (published)
    sizes = {name: os.lstat(d / name).st_size for name in files}
    for i in range(40):
        name = files[i % len(files)]
        if not os.path.isfile(d / name):
            continue
        append(d / name, b"z" * (i + 1))
        sizes[name] += i + 1
        forget_names(sync=False)
        assert os.lstat(d / name).st_size == sizes[name], (i, name)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_change_leaves_an_answer_stale(mounted: Mount, tmp_path: Path, seed: int) -> None:
    m = mounted
    native = tmp_path / "native"
    copy_tree(m.repo, native)
    twins = Twins(m, native, random.Random(seed))
    walk_by_listing(m, native)  # (publishes every directory)
    before = counters(m)
    done = []
    for i in range(60):
        done.append(twins.step())
        if i % 4 == 3:
            try:
                if i % 8 == 3:  # (every name ever made, looked up everywhere)
                    walk_by_path(m, native, tuple(f"n{k}" for k in range(1, twins.n + 1)))
                else:
                    walk_by_listing(m, native)
            except AssertionError as e:
                raise AssertionError(f"after {done}: {e}") from None
    after = counters(m)
    assert after[0] > before[0] and after[1] > before[1], "C answered no lookup or listing"
    assert after[2] > before[2], "C answered no lookup of an absent name"


def test_a_name_made_after_its_listing_is_never_absent(mounted: Mount) -> None:
    """Names made, linked and renamed into a published directory, then looked up with the
    kernel's names forgotten, as a create burst's next lookups are: the listing C answers
    absent names from is stale from the first change on."""
    m = mounted
    d = m.mnt / "src"
    os.listdir(d)  # (published)
    before = counters(m)
    assert not os.path.lexists(d / "new0")
    assert counters(m)[2] == before[2] + 1, "C did not answer an absent name"
    made: list[Path] = []
    for i in range(24):
        os.listdir(d)  # (published again, then made stale)
        if i % 3 == 0:
            os.close(os.open(d / f"new{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            made.append(d / f"new{i}")
        elif i % 3 == 1:
            os.link(made[-1], d / f"link{i}")
            made.append(d / f"link{i}")
        else:
            (m.mnt / f"elsewhere{i}").write_bytes(b"x")
            os.rename(m.mnt / f"elsewhere{i}", d / f"moved{i}")
            made.append(d / f"moved{i}")
        # then a name made as a burst makes it: C may take it into the listing only if
        # nothing else changed the directory since it was whole
        os.close(os.open(d / f"after{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        made.append(d / f"after{i}")
        forget_names(sync=False)
        for p in made:
            assert os.path.lexists(p), f"{p.name} made, then answered absent"
        assert not os.path.lexists(d / f"new{i + 1}")
    # a name a restore brings back (no request C saw made it), then one made as a burst
    (d / "back").write_bytes(b"b")
    ck = m.ctl_ok({"cmd": "checkpoint", "name": "with-back"})["id"]
    os.unlink(d / "back")
    os.listdir(d)  # (published without it)
    m.ctl_ok({"cmd": "restore", "id": ck})
    os.close(os.open(d / "after-restore", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    forget_names(sync=False)
    assert os.path.lexists(d / "back"), "a name the restore brought back answered absent"


def test_a_create_burst_has_its_next_names_answered_in_c(mounted: Mount) -> None:
    """Files made one after another in a new directory, and in a listed one: each new
    name's lookup is answered in C as absent (names.c: the listing takes each name
    made), and afterwards every name is there and no other."""
    m = mounted
    for d in (m.mnt / "burst", m.mnt / "src"):
        if not d.exists():
            d.mkdir()  # (made by Python: published empty)
        os.listdir(d)
        names = sorted(os.listdir(d)) + [f"new{i}" for i in range(50)]
        before = counters(m)
        for name in names[-50:]:
            os.close(os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        assert counters(m)[2] - before[2] >= 45, "C answered few of the burst's lookups"
        forget_names()
        assert sorted(os.listdir(d)) == sorted(names)
        forget_names()
        for name in names:
            assert os.path.lexists(d / name), name
        assert not os.path.lexists(d / "new50")


def test_saves_over_a_file_have_their_next_temporary_name_answered_in_c(mounted: Mount) -> None:
    """An editor's saves, renamed over the file from a temporary name, the same one each
    time or one never used again: the lookup of each save's temporary name is answered
    in C as absent (saves under names never used again do not fill the names a listing
    keeps as made since it was published); afterwards the directory holds the file,
    with the last save's content, and nothing else."""
    m = mounted
    d = m.mnt / "saves"
    d.mkdir()
    (d / "f.py").write_bytes(b"v0")
    os.listdir(d)
    for saves, tmp_name in ((50, ".f.py.swp"), (1100, ".f.py.{}.tmp")):
        before = counters(m)
        for i in range(saves):
            tmp = d / tmp_name.format(i)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, b"v%d" % i)
            os.close(fd)
            os.rename(tmp, d / "f.py")
        assert counters(m)[2] - before[2] >= saves - 5, f"C answered few lookups of {tmp_name}"
        forget_names()
        assert os.listdir(d) == ["f.py"] and (d / "f.py").read_bytes() == b"v%d" % (saves - 1)
        assert not os.path.lexists(d / tmp_name.format(5))


def test_saves_into_directories_by_turns_are_answered_in_c(mounted: Mount) -> None:
    """Saves over repo files in two directories nothing lists, by turns (the bench's
    atomic save): once a save's changes are stored, a lookup publishes its directory's
    listing; from then on the lookup of each save's temporary name is answered in C as
    absent, and each directory's attributes, which the kernel asks before it makes a
    name there, too."""
    m = mounted
    files = [m.mnt / "src" / "pkg" / "util.py", m.mnt / "docs" / "guide.txt"]
    before, dirs_before = counters(m), m.ctl_ok({"cmd": "status"})["dir_attrs_from_c"]
    for i in range(40):
        path = files[i % 2]
        tmp = path.with_name("." + path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"v%d" % i)
        os.close(fd)
        os.rename(tmp, path)
    s = m.ctl_ok({"cmd": "status"})
    assert s["absent_from_c"] - before[2] >= 40 - 6, "C answered few lookups of the temporary names"
    assert s["dir_attrs_from_c"] - dirs_before >= 40 - 6, "C answered few GETATTRs of the directories"
    forget_names()
    assert [p.read_bytes() for p in files] == [b"v38", b"v39"]
    assert sorted(os.listdir(files[0].parent)) == ["__init__.py", "util.py"]


def test_outputs_removed_and_made_again_have_their_lookups_answered_in_c(mounted: Mount) -> None:
    """A build that deletes its outputs and makes them again: after each unlink the
    listing C answers from stays whole, so the new names' lookups are answered in C as
    absent; the names removed (published with the listing or made since) are absent,
    the new ones there, whatever the kernel forgot."""
    m = mounted
    d = m.mnt / "out"
    d.mkdir()
    for i in range(10):
        (d / f"old{i}.o").write_bytes(b"x")
    os.listdir(d)  # (published with them)
    for i in range(10, 20):
        (d / f"old{i}.o").write_bytes(b"x")  # (made since)
    for i in range(20):
        os.unlink(d / f"old{i}.o")
    before = counters(m)
    for i in range(20):
        os.close(os.open(d / f"new{i}.o", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    assert counters(m)[2] - before[2] >= 18, "C answered few of the new names' lookups"
    for forget in (False, True):
        if forget:
            forget_names()
        assert not any(os.path.lexists(d / f"old{i}.o") for i in range(20))
        assert all(os.path.lexists(d / f"new{i}.o") for i in range(20))
    assert sorted(os.listdir(d)) == sorted(f"new{i}.o" for i in range(20))


def test_a_lookup_never_publishes_a_directory_too_big_to_keep(mount_factory: MountFactory,
                                                                tmp_path: Path) -> None:
    """Lookups in a repo directory too big for Lower to keep listed (core/lower.py) publish
    nothing: that would stall the lookup for the whole directory. Its listing does."""
    repo = make_repo(tmp_path / "repo")
    (repo / "big").mkdir()
    names = [f"f{i:05d}" for i in range(CACHE_ENTRIES // 4 + 100)]
    for name in names:
        (repo / "big" / name).write_bytes(b"")
    m = mount_factory(repo)
    forget_names()
    before = counters(m)[0]
    for name in names[::7]:
        os.lstat(m.mnt / "big" / name)
    assert counters(m)[0] == before, "C answered lookups in a directory no lookup should publish"
    assert len(os.listdir(m.mnt / "big")) == len(names)  # (Python's listing: published)
    forget_names()
    for name in names[::7]:
        assert attrs(m.mnt / "big" / name) == synced(m.mnt / "big" / name)
    assert counters(m)[0] > before


def test_times_before_1970_are_answered_as_natively(mount_factory: MountFactory,
                                                   tmp_path: Path) -> None:
    """A repo file dated before 1970 (an old archive's, or anyone's on purpose), and one
    dated so on the mount: every lookup and listing of their directory answers, with
    the native times (a published listing packed them as unsigned seconds: the lookup
    failed with EIO, and so did ls of the whole directory)."""
    repo = make_repo(tmp_path / "repo")
    old = -315_619_200 * 10**9 + 123_456_789  # 1960-01-01, and some ns
    for name in ("a", "b", "old"):
        (repo / "docs" / name).write_text(name)
    os.utime(repo / "docs" / "old", ns=(old, old))
    m = mount_factory(repo)
    os.utime(m.mnt / "docs" / "a", ns=(old - 10**9, old - 10**9))
    os.utime(m.mnt / "src", ns=(-1, -1))
    for walk in range(2):  # by path (lookups), then by listing (READDIRPLUS)
        forget_names()
        if walk:
            assert sorted(os.listdir(m.mnt / "docs")) == ["a", "b", "guide.txt", "old"]
        for rel, want in (("docs/old", old), ("docs/a", old - 10**9), ("src", -1),
                          ("docs/b", os.lstat(repo / "docs" / "b").st_mtime_ns)):
            assert os.lstat(m.mnt / rel).st_mtime_ns == want, rel
            assert attrs(m.mnt / rel) == synced(m.mnt / rel), rel
