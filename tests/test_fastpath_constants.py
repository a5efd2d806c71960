"""The constants the C library (overlayckpt/fuse/csrc) and Python must agree on,
read from the built library itself rather than trusted to comments: the marked
handle, the write-behind mark (which must be CONTROL_INO_BASE, above every repo
inode), and the layout of a write-behind log record that writebehind.py replays.

No mount, no root: the library is only loaded, never asked to serve a session.
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import os
import re
import struct
from typing import Any

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Where each Python name lives
KERNEL_HANDLE_IN = ["overlayckpt.fuse.ops"]
CONTROL_INO_BASE_IN = ["overlayckpt.records"]
BEHIND_IN = ["overlayckpt.core.writebehind"]
FASTPATH_IN = ["overlayckpt.fuse.fastpath"]


def python_constant(modules: list[str], name: str) -> Any:
    """name from the first of modules that defines it."""
    for module in modules:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            # only the module itself (or a parent) missing means "not here"
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue
            raise
        if hasattr(mod, name):
            return getattr(mod, name)
    pytest.fail(f"{name} is defined in none of {', '.join(modules)}")


def library_path() -> str | None:
    """The built overlayckpt/fuse/libfastpath.so, looked for as fastpath.py does (beside
    it): in the repo, else beside the overlayckpt that imports."""
    dirs = [os.path.join(REPO, "overlayckpt")]
    try:
        import overlayckpt
        dirs += [os.path.abspath(d) for d in getattr(overlayckpt, "__path__", [])]
    except ImportError:
        pass
    for here in dirs:
        found = os.path.join(here, "fuse", "libfastpath.so")
        if os.path.exists(found):
            return found
    return None


def load_library() -> ctypes.CDLL:
    """The built library, loaded RTLD_LOCAL: it stands in for libfuse in no one's place."""
    path = library_path()
    if path is None:
        pytest.fail("the fast path library is not built (run 'make install')")
    return ctypes.CDLL(path)


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return load_library()


def c_u64(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.c_uint64.in_dll(lib, name).value


def c_u32(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.c_uint32.in_dll(lib, name).value


def struct_layout(s: struct.Struct) -> list[tuple[int, int]]:
    """(offset, size) of each field of s, in order."""
    fmt = s.format if isinstance(s.format, str) else s.format.decode()
    prefix, codes = (fmt[0], fmt[1:]) if fmt[:1] in "@=<>!" else ("", fmt)
    fields = []
    for count, code in re.findall(r"(\d*)([a-zA-Z?])", codes):
        fields += [code] * int(count or 1)
    return [(struct.calcsize(prefix + "".join(fields[:i])), struct.calcsize(prefix + code))
            for i, code in enumerate(fields)]


def test_kernel_handle(lib: ctypes.CDLL) -> None:
    assert c_u64(lib, "fastpath_KERNEL_HANDLE") == python_constant(KERNEL_HANDLE_IN, "KERNEL_HANDLE")


def test_listing_mark(lib: ctypes.CDLL) -> None:
    """The offsets Python hands out for a listing C took are C's (names.c)."""
    assert c_u64(lib, "fastpath_LISTING_MARK") == python_constant(KERNEL_HANDLE_IN, "LISTING_MARK")


def test_acknowledged_is_the_control_inode_base(lib: ctypes.CDLL) -> None:
    acknowledged = c_u64(lib, "fastpath_ACKNOWLEDGED")
    assert acknowledged == python_constant(CONTROL_INO_BASE_IN, "CONTROL_INO_BASE")
    # one bit, which no handle C hands out for a repo inode (below it) can carry
    assert acknowledged & (acknowledged - 1) == 0
    assert acknowledged & c_u64(lib, "fastpath_KERNEL_HANDLE") == 0


def test_write_behind_record_layout(lib: ctypes.CDLL) -> None:
    header = python_constant(BEHIND_IN, "HEADER")
    assert c_u32(lib, "fastpath_RECORD_SIZE") == header.size
    count = c_u32(lib, "fastpath_RECORD_FIELDS")
    table = (ctypes.c_uint32 * 2 * count).in_dll(lib, "fastpath_RECORD_LAYOUT")
    c_fields = [(row[0], row[1]) for row in table]
    # seq, ino, off, size, pid: the order writebehind.py unpacks them in
    assert c_fields == struct_layout(header)


def test_wrapped(lib: ctypes.CDLL) -> None:
    assert c_u32(lib, "fastpath_WRAPPED") == python_constant(BEHIND_IN, "WRAPPED")


def test_log_holds_what_may_wait(lib: ctypes.CDLL) -> None:
    """C keeps every unstored record from being overwritten only if the log is more
    than twice the budget plus the largest record it acknowledges. The budget is C's
    (answered, not yet handed to Python) plus what Python has handed to the store but
    the store has deferred (Store.defer): C counts a write done once Python answers it."""
    header = python_constant(BEHIND_IN, "HEADER")
    log_size = python_constant(BEHIND_IN, "LOG_SIZE")
    max_behind = python_constant(FASTPATH_IN, "MAX_BEHIND")
    deferred = python_constant(["overlayckpt.store.lmdbstore"], "MAX_DEFERRED_BYTES")
    largest = max_behind // c_u32(lib, "fastpath_LARGEST_WRITE_SHARE")
    # a deferred write stays deferred until MAX_DEFERRED_BYTES is reached: one more record
    records = max_behind + deferred + header.size + largest
    assert log_size > 2 * records + header.size + (largest + 7) // 8 * 8


def test_histogram_layout(lib: ctypes.CDLL) -> None:
    """stats.c's histograms are read through fastpath._Hist and bucketed as core/latency.py
    reads them back."""
    latency = importlib.import_module("overlayckpt.core.latency")
    fastpath = importlib.import_module("overlayckpt.fuse.fastpath")
    assert c_u32(lib, "fastpath_HIST_SUB_BITS") == latency.SUB_BITS
    assert c_u32(lib, "fastpath_HIST_BUCKETS") == latency.BUCKETS
    assert c_u32(lib, "fastpath_HIST_SIZE") == ctypes.sizeof(fastpath._Hist)
    assert c_u32(lib, "fastpath_STATS_KINDS") == len(fastpath.STATS_KINDS)


def test_histogram_buckets_agree(lib: ctypes.CDLL) -> None:
    latency = importlib.import_module("overlayckpt.core.latency")
    lib.fastpath_hist_bucket.argtypes = [ctypes.c_uint64]
    lib.fastpath_hist_bucket.restype = ctypes.c_uint
    values = [0, 1, 15, 16, 17, 31, 32, 1023, 1024, 1025, 999_999, 10**6, 10**9, 10**11, 2**37,
              2**37 - 1, 2**40, 2**63]
    values += [(1 << k) + d for k in range(4, 62) for d in (-1, 0, 1, 1 << (k - 4))]
    for v in values:
        assert lib.fastpath_hist_bucket(v) == latency.bucket_of(v), v


def test_published_names_layout(lib: ctypes.CDLL) -> None:
    """fastpath.py packs each name's answer as names.c copies it out: struct fuse_entry_out,
    and each inode's attributes: struct fuse_attr_out."""
    fastpath = importlib.import_module("overlayckpt.fuse.fastpath")
    assert c_u32(lib, "fastpath_ENTRY_OUT_SIZE") == fastpath.ENTRY_OUT.size
    # struct fuse_attr_out, as publish_attrs cuts it from fuse_entry_out: 16 bytes, the attr
    assert c_u32(lib, "fastpath_ATTR_OUT_SIZE") == 16 + fastpath.ENTRY_OUT.size - 40
