"""Bundles are untrusted data (issue 32, points 1, 6 and 9): a crafted bundle is refused by
`import` with one line, changes nothing around it, leaves no store behind, and stays
bounded in memory and time; `fsck` reports in a store what import refuses in a bundle.

Every crafted bundle starts from a real export (a session recorded offline over a real
repo): it is decoded, one record or header field is changed, and it is encoded again.
Imports run as the real CLI, in a child whose own peak RSS is taken from wait4.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zstandard

from conftest import CLI, run_cli
from core.helpers_core import ME, ino, make_small_repo
from overlayckpt.core.maintenance import fsck
from overlayckpt.records import ROOT_INO, Node, pack_obj, u64
from overlayckpt.service.session import Session
from overlayckpt.store.lmdbstore import Store
from overlayckpt.tables import DIRENTS, META, NODES, PARENT_KEY
from security.conftest import assert_one_line, surroundings

RSS_MB = 300  # the peak a refused import may reach (an import of nothing is ~60 MB here)
SECONDS = 60  # (they take about a second each)
GIB = 1 << 30


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(repo, bundle): a session that edits a repo file, creates a file, a directory and a
    symlink, exported as a bundle. Imports only read the repo: the tests share it."""
    root = tmp_path_factory.mktemp("base")
    repo = make_small_repo(root / "repo")
    (root / "outside").mkdir()
    (root / "outside" / "victim.txt").write_text("keep me\n")
    s = Session.open(str(root / "store"), str(repo), create=True, window=1e9)
    try:
        ov = s.overlay
        ov.write(ME, ino(ov, "README.md"), 0, b"# EDITED")
        i, _ = ov.create(ME, ROOT_INO, b"new.txt", stat.S_IFREG | 0o644, 0, 0)
        ov.write(ME, i, 0, b"hello\n" * 2000)
        ov.create(ME, ROOT_INO, b"Z", stat.S_IFDIR | 0o755, 0, 0)
        ov.create(ME, ROOT_INO, b"ln", stat.S_IFLNK | 0o777, 0, 0, target=b"new.txt")
        bundle = root / "session.bundle"
        trio.run(s.command, {"cmd": "export_bundle", "path": str(bundle)})
    finally:
        s.close()
    return repo, bundle


# -- crafting ---------------------------------------------------------------------------

class Crafted:
    """A decoded bundle: header, records [table index, key, value] and trailer."""

    def __init__(self, src: Path) -> None:
        with src.open("rb") as f:
            objs = list(msgpack.Unpacker(zstandard.ZstdDecompressor().stream_reader(f),
                                         raw=False, strict_map_key=False))
        self.header, *self.records, self.trailer = objs

    def ti(self, table: bytes) -> int:
        return self.header["tables"].index(table.decode())

    def rows(self, table: bytes) -> list[list[Any]]:
        return [r for r in self.records if r[0] == self.ti(table)]

    def node_row(self, kind: int) -> list[Any]:
        return next(r for r in self.rows(NODES) if stat.S_IFMT(Node.unpack(r[2]).mode) == kind)

    def add(self, table: bytes, key: bytes, value: bytes) -> None:
        """A record more: the trailer counts it, so only the record itself can be refused."""
        self.records.append([self.ti(table), key, value])
        self.trailer["counts"][table.decode()] += 1

    def encode(self) -> bytes:
        return b"".join(msgpack.packb(o) for o in (self.header, *self.records, self.trailer))

    def write(self, dst: Path, raw: bytes | None = None) -> Path:
        dst.write_bytes(zstandard.ZstdCompressor().compress(self.encode() if raw is None else raw))
        return dst


def with_node(c: Crafted, kind: int, **fields: Any) -> None:
    row = c.node_row(kind)
    node = Node.unpack(row[2])
    for k, v in fields.items():
        setattr(node, k, v)
    row[2] = node.pack()


def renamed_dirent(c: Crafted, name: bytes) -> None:
    """The dirent of new.txt, renamed (what apply would create beneath the repo)."""
    row = next(r for r in c.rows(DIRENTS) if r[1] == u64(ROOT_INO) + b"new.txt")
    row[1] = u64(ROOT_INO) + name


def header_field(key: str, value: Any) -> Callable[[Crafted], None]:
    return lambda c: c.header.__setitem__(key, value)


def zeros_frame(head: bytes, n: int) -> bytes:
    """A zstd frame of head then n zeros, written in pieces (a few tens of KB for 1 GiB)."""
    z = zstandard.ZstdCompressor(level=1).compressobj(size=len(head) + n)
    out = [z.compress(head)]
    piece = bytes(1 << 20)
    for _ in range(n >> 20):
        out.append(z.compress(piece))
    out.append(z.flush())
    return b"".join(out)


# -- running a refused import -----------------------------------------------------------

# The CLI runs as a grandchild: a child exec'd straight from pytest keeps pytest's own peak
# as its ru_maxrss (Linux records the old mm's high-water mark at exec), hundreds of MB
# after the core tier. A small Python in between starts it, kills it after SECONDS and
# writes its peak (KiB) to a file.
_MEASURE = """
import os, signal, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
signal.signal(signal.SIGALRM, lambda *_: p.kill())
signal.alarm(int(sys.argv[1].rsplit(":", 1)[1]))
_, status, usage = os.wait4(p.pid, 0)
with open(sys.argv[1].rsplit(":", 1)[0], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(*args: str) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """The CLI with its own peak RSS (MB) and its wall time; killed after SECONDS (then the
    test fails on its status)."""
    fd, peak_file = tempfile.mkstemp(prefix="peak-")
    os.close(fd)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", _MEASURE, f"{peak_file}:{SECONDS}", *CLI,
                               *args], capture_output=True, text=True, timeout=2 * SECONDS)
        peak = int(Path(peak_file).read_text()) / 1024
    finally:
        os.unlink(peak_file)
    return proc, peak, time.monotonic() - t0


def assert_refused(base: tuple[Path, Path], bundle: Path, tmp_path: Path, *words: str,
                   store_exists: bool = False) -> str:
    """import exits 1 with one line holding words; nothing under the test's directory and
    the shared base changes (no store left behind); memory and time bounded."""
    repo, _ = base
    store = tmp_path / "stores" / "imported"
    if store_exists:
        store.mkdir(parents=True)
    before = surroundings(tmp_path), surroundings(repo.parent)
    proc, peak, seconds = run_measured("import", str(bundle), "--store", str(store),
                                       "--repo", str(repo))
    err = assert_one_line(proc, *words)
    assert (surroundings(tmp_path), surroundings(repo.parent)) == before
    assert store.exists() == store_exists and not (store_exists and os.listdir(store))
    assert not (tmp_path / "stores").exists() or store_exists
    assert peak < RSS_MB, f"the refused import reached {peak:.0f} MB"
    assert seconds < SECONDS
    return err


# -- the crafted bundles ----------------------------------------------------------------

NAMES = [b"../evil-link", b"Z/../../outside/pwned-file", b"a/b", b"x\0y", b"", b"..", b".",
         b"n" * 256]


@pytest.mark.parametrize("name", NAMES, ids=lambda n: repr(n)[:24])
def test_a_dirent_name_that_is_not_one_component_is_refused(base, tmp_path: Path,
                                                            name: bytes) -> None:
    c = Crafted(base[1])
    renamed_dirent(c, name)
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "evil.bundle",
                   "dirents", "single path component")


def test_a_journal_undo_entry_with_a_bad_name_is_refused(base, tmp_path: Path) -> None:
    """Restoring a checkpoint would write the journal's old names: they are checked too."""
    c = Crafted(base[1])
    ti = c.ti(b"journal")
    row = next(r for r in c.records if r[0] == ti)
    rec = msgpack.unpackb(row[2])
    rec[6].append([2, u64(ROOT_INO) + b"../outside/pwned-file", u64(ROOT_INO + 1)])
    row[2] = pack_obj(rec)
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "journal",
                   "single path component")


@pytest.mark.parametrize("mode, words", [(0o104777, "setuid"), (0o102755, "setuid or setgid"),
                                         (0o060666, "device node"), (0o020666, "device node"),
                                         (0o170644, "no known file type")],
                         ids=lambda v: f"{v:o}" if isinstance(v, int) else v)
def test_a_node_that_grants_more_or_is_a_device_is_refused(base, tmp_path: Path, mode: int,
                                                          words: str) -> None:
    c = Crafted(base[1])
    with_node(c, stat.S_IFREG, mode=mode)
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "nodes", words)


def test_a_node_size_of_two_to_the_62_is_refused(base, tmp_path: Path) -> None:
    """Apply never ended on it; import must not let it in."""
    c = Crafted(base[1])
    with_node(c, stat.S_IFREG, size=1 << 62)
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "nodes", "size")


@pytest.mark.parametrize("value", [b"\x93\x01\x02\x03", b"\xc1", b"", msgpack.packb(["x"] * 14)],
                         ids=["short", "invalid", "empty", "strings"])
def test_a_malformed_node_value_is_refused(base, tmp_path: Path, value: bytes) -> None:
    c = Crafted(base[1])
    c.node_row(stat.S_IFREG)[2] = value
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "nodes")


def test_a_symlink_target_out_of_bounds_is_refused(base, tmp_path: Path) -> None:
    c = Crafted(base[1])
    with_node(c, stat.S_IFLNK, target=b"x" * 5000, size=5000)
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "nodes")


@pytest.mark.parametrize("block_size", [0, -4096, 3, 1 << 40, "4096", None])
def test_a_bad_block_size_is_refused_before_anything_is_made(base, tmp_path: Path,
                                                            block_size: Any) -> None:
    c = Crafted(base[1])
    c.header["block_size"] = block_size
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "block size")


def test_a_bad_block_size_leaves_a_pre_existing_empty_store_dir_empty(base, tmp_path: Path) -> None:
    c = Crafted(base[1])
    c.header["block_size"] = -4096
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "block size",
                   store_exists=True)


def test_a_refused_record_late_in_the_bundle_leaves_an_empty_store_dir_empty(base,
                                                                           tmp_path: Path) -> None:
    """The store was made and partly filled before the bad record came: all of it goes."""
    c = Crafted(base[1])
    c.add(b"seen", b"/../outside/victim.txt", pack_obj([1, 2, 3]))
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "seen", store_exists=True)


@pytest.mark.parametrize("edit, words", [
    (header_field("lower", [[5, b"../../etc/passwd"]]), "lower entry"),
    (header_field("pinned", [b"/etc"]), "pinned"),
    (header_field("seen_files", [[b"a/../../b", 1, bytes(32)]]), "seen_files"),
    (header_field("lower_files", [[5, b"ok", None, 1 << 62, None]]), "lower_files"),
    (header_field("tables", ["meta", "nosuch"]), "tables"),
    (header_field("window", float("nan")), "window"),
    (header_field("format", "5"), "format"),
], ids=["lower", "pinned", "seen_files", "lower_files", "tables", "window", "format"])
def test_every_header_field_is_checked(base, tmp_path: Path, edit: Callable[[Crafted], None],
                                       words: str) -> None:
    c = Crafted(base[1])
    edit(c)
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, words)


def test_empty_lower_files_cannot_hide_the_repo_files_the_session_refers_to(base,
                                                                           tmp_path: Path) -> None:
    """With lower_files empty, import checked nothing and took any --repo: the repo
    inodes the records refer to must each be named with a path."""
    c = Crafted(base[1])
    c.header["lower"] = []
    c.header["lower_files"] = []
    c.header["lower_links"] = []
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "without naming its path")


def test_a_meta_parent_pointing_at_itself_is_refused(base, tmp_path: Path) -> None:
    c = Crafted(base[1])
    c.add(META, PARENT_KEY, pack_obj([str(tmp_path / "stores" / "imported"), 1]))
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "another store")


def test_an_unknown_meta_key_is_refused(base, tmp_path: Path) -> None:
    c = Crafted(base[1])
    c.add(META, b"fork/" + str(tmp_path).encode(), u64(1))
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "meta")


@pytest.mark.parametrize("content_size", [True, False], ids=["stated", "unstated"])
def test_a_compression_bomb_block_is_not_inflated(base, tmp_path: Path, content_size: bool) -> None:
    """A 2 KB frame of 64 MiB (saying so in its header, or not), stored as a block: it
    fits a block's record, and decoding it stops at the block size. (Its name avoids the
    codec's: tmp_path, in the message, holds it.)"""
    c = Crafted(base[1])
    bomb = zstandard.ZstdCompressor(write_content_size=content_size).compress(bytes(64 << 20))
    assert len(bomb) < 4096
    c.add(b"blocks", bytes(32), b"\1" + bomb)
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "does not match")


def test_a_bundle_stream_that_inflates_to_a_gib_of_zeros_is_refused(base, tmp_path: Path) -> None:
    c = Crafted(base[1])
    bundle = tmp_path / "evil.bundle"
    bundle.write_bytes(zeros_frame(msgpack.packb(c.header), GIB))
    assert_refused(base, bundle, tmp_path, "malformed")


@pytest.mark.parametrize("table", [b"journal", b"blocks", b"conv"])
def test_a_bin32_claiming_a_gib_is_refused_unread(base, tmp_path: Path,
                                                         table: bytes) -> None:
    """33 KB of stream whose record claims (and holds) a 1 GiB bin: refused from its length
    prefix, before a byte of it is buffered."""
    c = Crafted(base[1])
    head = c.encode()[:-len(msgpack.packb(c.trailer))]  # (header and records, no trailer)
    record = bytes([0x93, c.ti(table), 0xC4, 8]) + u64(1) + b"\xc6" + GIB.to_bytes(4, "big")
    bundle = tmp_path / "evil.bundle"
    bundle.write_bytes(zeros_frame(head + record, GIB))
    assert bundle.stat().st_size < 128 << 10
    assert_refused(base, bundle, tmp_path, "claims")


def test_a_header_bin_claiming_a_gib_is_refused(base, tmp_path: Path) -> None:
    c = Crafted(base[1])
    head = msgpack.packb(c.header)
    # a map of one more key than it holds, whose last value is a 1 GiB bin
    header = bytes([head[0] + 1]) + head[1:] + msgpack.packb("x") + b"\xc6" + GIB.to_bytes(4, "big")
    bundle = tmp_path / "evil.bundle"
    bundle.write_bytes(zeros_frame(header, GIB))
    assert_refused(base, bundle, tmp_path, "header")


@pytest.mark.parametrize("cut", [1, 100, 5000])
def test_a_truncated_or_garbled_bundle_is_refused(base, tmp_path: Path, cut: int) -> None:
    raw = Crafted(base[1]).encode()
    bundle = tmp_path / "evil.bundle"
    bundle.write_bytes(zstandard.ZstdCompressor().compress(raw[:-cut]))
    assert_refused(base, bundle, tmp_path, "evil.bundle")
    data = bytearray(base[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    bundle.write_bytes(bytes(data))
    assert_refused(base, bundle, tmp_path, "evil.bundle")


def test_a_count_the_trailer_does_not_match_is_refused(base, tmp_path: Path) -> None:
    c = Crafted(base[1])
    c.trailer["counts"]["nodes"] += 1
    assert_refused(base, c.write(tmp_path / "evil.bundle"), tmp_path, "incomplete")


def test_the_real_bundle_still_imports_and_is_clean(base, tmp_path: Path) -> None:
    """The checks refuse nothing a real export holds (the crafted ones start from it)."""
    repo, bundle = base
    store = tmp_path / "imported"
    proc, peak, _ = run_measured("import", str(bundle), "--store", str(store), "--repo", str(repo))
    assert proc.returncode == 0, proc.stderr
    assert "clean" in run_cli("--store", str(store), "fsck").stdout.lower()
    assert peak < RSS_MB


# -- export ----------------------------------------------------------------------------

def test_export_bundle_writes_a_file_only_its_owner_reads(base, tmp_path: Path) -> None:
    """It holds every captured file: 0600 whatever the umask."""
    repo, bundle = base
    store = tmp_path / "imported"
    run_cli("import", str(bundle), "--store", str(store), "--repo", str(repo))
    out = tmp_path / "again.bundle"
    old = os.umask(0)
    try:
        run_cli("--store", str(store), "export", "bundle", str(out))
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


# -- fsck finds what import refuses ------------------------------------------------------

@pytest.fixture
def store_copy(base, tmp_path: Path) -> Iterator[Path]:
    repo, bundle = base
    store = tmp_path / "store"
    run_cli("import", str(bundle), "--store", str(store), "--repo", str(repo))
    yield store


def put_raw(store: Path, table: bytes, key: bytes, value: bytes) -> None:
    s = Store.open(str(store))
    try:
        s.write(lambda w: w.put(table, key, value))
    finally:
        s.close()


def fsck_problems(store: Path) -> list[str]:
    s = Store.open(str(store))
    try:
        return fsck(s)["problems"]
    finally:
        s.close()


def first_file_node(store: Path) -> tuple[bytes, bytes]:
    s = Store.open(str(store))
    try:
        return s.read(lambda r: next((k, v) for k, v in r.range_from(NODES)
                                     if Node.unpack(v).is_reg))
    finally:
        s.close()


@pytest.mark.parametrize("what", ["malformed node", "huge node", "bad dirent", "bad bmap",
                                  "self parent"])
def test_fsck_reports_a_record_import_would_refuse(store_copy: Path, what: str) -> None:
    key, value = first_file_node(store_copy)
    if what == "malformed node":
        put_raw(store_copy, NODES, key, b"\x93\x01\x02\x03")
    elif what == "huge node":
        node = Node.unpack(value)
        node.size = 1 << 63  # beyond any off_t
        put_raw(store_copy, NODES, key, node.pack())
    elif what == "bad dirent":
        put_raw(store_copy, DIRENTS, u64(ROOT_INO) + b"../pwned", key)
    elif what == "bad bmap":
        put_raw(store_copy, b"bmap", key + u64(0), b"short")
    else:
        put_raw(store_copy, META, PARENT_KEY, pack_obj([str(store_copy), 1]))
    problems = fsck_problems(store_copy)
    assert problems, what
    assert all("\n" not in p for p in problems)
    proc = run_cli("--store", str(store_copy), "fsck", check=False)
    assert proc.returncode == 1 and "DAMAGED" in proc.stdout, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr


def test_fsck_of_the_imported_store_is_clean(store_copy: Path) -> None:
    assert fsck_problems(store_copy) == []


@pytest.mark.parametrize("command", [["log"], ["fsck"], ["apply"]])
def test_a_store_with_block_size_0_is_refused_as_damaged(store_copy: Path,
                                                         command: list[str]) -> None:
    """log and apply gave a ZeroDivisionError traceback on it."""
    put_raw(store_copy, META, b"block_size", u64(0))
    before = surroundings(store_copy.parent)
    assert_one_line(run_cli("--store", str(store_copy), *command, check=False),
                    "damaged", "block size 0")
    assert surroundings(store_copy.parent, store_copy) == {
        k: v for k, v in before.items() if not k.startswith("store")}
