"""A long session, built fast and deterministically, in-process through the core API.

``build(repo, records, checkpoints)`` opens a new session store over a
generated repo (``Session.open``) and drives its ``Overlay`` directly, as the
FUSE layer would but without a mount: edits to existing files, creates (and
their first write), deletes and renames, over a few thousand distinct files.
Records group into automatic checkpoints when another process writes
(``core/journal.py``), so the generator alternates two ``Caller`` pids, one
group per checkpoint, with a window too long to end a group by itself.

Built stores are cached under ``bench/work/longsession-<key>`` keyed by the
parameters, the generator version, the repo and the store format
(``store.format.FORMAT_VERSION``, checked against the store's meta ``format``
key), so re-runs skip the build; every run works on a private copy.
"""
from __future__ import annotations

import json
import random
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.gen import GEN_VERSION as REPO_VERSION
from bench.gen import SEED, WORK_DIR, Repo, text_blob, vocabulary

GEN_VERSION = 2
BLOCK = 4096
WINDOW = 1e9  # seconds: a group ends only when the other pid writes
EDIT_FILES = 3000  # repo files the session edits
LIVE_CREATED = 1500  # created files kept alive at most (older ones are deleted)
GEN_DIRS = 20  # new directories the created files live in


@dataclass(frozen=True, slots=True)
class Built:
    """A cached long-session store and what it holds."""

    store: Path
    repo: Path
    records: int
    checkpoints: int
    build_s: float
    store_bytes: int
    created_dirs: list[str]  # directories made by the session (a checkpoint view lists one)
    edited: list[str]  # repo files the session edited (a view reads one)


def store_format() -> int:
    from overlayckpt.store.format import FORMAT_VERSION
    return int(FORMAT_VERSION)


def cache_key(repo: Repo, records: int, checkpoints: int) -> str:
    return f"{repo.n_files}v{REPO_VERSION}-r{records}-c{checkpoints}-g{GEN_VERSION}-f{store_format()}"


def _meta_format(store: Path) -> int | None:
    """The store's own meta ``format`` value (read-only, without the overlayckpt lock)."""
    import lmdb
    try:
        env = lmdb.open(str(store), readonly=True, lock=False, max_dbs=64, subdir=True)
    except lmdb.Error:
        return None
    try:
        with env.begin() as txn:
            raw = txn.get(b"format", db=env.open_db(b"meta", txn=txn, create=False))
    except lmdb.Error:
        return None
    finally:
        env.close()
    return int.from_bytes(raw, "big") if raw and len(raw) == 8 else None


def ensure(repo: Repo, records: int, checkpoints: int, log: Callable[[str], None] = print) -> Built:
    """The cached store for these parameters, built on first use."""
    key = cache_key(repo, records, checkpoints)
    base = WORK_DIR / f"longsession-{key}"
    manifest = base / "built.json"
    if manifest.exists():
        meta = json.loads(manifest.read_text())
        if _meta_format(base / "store") == store_format():
            return Built(base / "store", repo.path, meta["records"], meta["checkpoints"], meta["build_s"],
                         meta["store_bytes"], meta["created_dirs"], meta["edited"])
        log(f"long session {key}: cached store has another format; rebuilding")
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    t0 = time.monotonic()
    counts, dirs, edited = _generate(repo, base / "store", records, checkpoints, log)
    build_s = time.monotonic() - t0
    size = sum(f.stat().st_blocks * 512 for f in (base / "store").iterdir() if f.is_file())
    meta = {"records": counts[0], "checkpoints": counts[1], "build_s": build_s, "store_bytes": size,
            "created_dirs": dirs, "edited": edited}
    manifest.write_text(json.dumps(meta))
    log(f"long session {key}: built in {build_s:.0f} s ({size / 1e6:.0f} MB)")
    return Built(base / "store", repo.path, counts[0], counts[1], build_s, size, dirs, edited)


def private_copy(built: Built, dest: Path) -> Path:
    """A copy of the cached store that a run may change (restores, checkpoints)."""
    subprocess.run(["cp", "-a", "--sparse=always", str(built.store), str(dest)], check=True)
    return dest


def _generate(repo: Repo, store_dir: Path, records: int, checkpoints: int,
              log: Callable[[str], None]) -> tuple[tuple[int, int], list[str], list[str]]:
    """Write the session; returns ((journal records, checkpoints), created dirs, edited files)."""
    from overlayckpt.core.journal import Caller
    from overlayckpt.errors import FsError
    from overlayckpt.service.session import Session
    from overlayckpt.tables import CKPTS, JOURNAL

    rng = random.Random(SEED * 7 + records * 31 + checkpoints)
    vocab = vocabulary(random.Random(SEED + 1))
    # full blocks from a small pool dedupe in the block store: the journal, not the
    # data, is what this session is long in; a few edits are unaligned (new blocks)
    pool = [text_blob(random.Random(i), vocab, BLOCK) for i in range(256)]
    snippets = [text_blob(random.Random(1000 + i), vocab, 200) for i in range(64)]
    sizes = dict(repo.files)
    candidates = sorted(repo.text_files(2 * BLOCK, 64 * 1024))
    edited = sorted(random.Random(SEED + 2).sample(candidates, min(EDIT_FILES, len(candidates))))

    s = Session.open(str(store_dir), str(repo.path), create=True, window=WINDOW)
    ov = s.overlay
    callers = [Caller(41001, "agent"), Caller(41002, "build")]
    try:
        ino_of = {p: ov.live(lambda r, p=p: ov.resolve(r, p)) for p in edited}
        root = ov.live(lambda r: ov.resolve(r, ""))
        top, _ = ov.create(callers[0], root, b"bench-gen", stat.S_IFDIR | 0o755, 0, 0)
        dirs: list[tuple[str, int]] = []
        for d in range(GEN_DIRS):
            name = f"d{d:02d}"
            ino, _ = ov.create(callers[0], top, name.encode(), stat.S_IFDIR | 0o755, 0, 0)
            dirs.append((f"bench-gen/{name}", ino))
        created: list[tuple[int, bytes, int]] = []  # (dir ino, name, file ino), oldest first
        made = GEN_DIRS + 1
        groups = max(1, checkpoints - 1)  # checkpoint 0 is the session's start
        start = made
        t0 = time.monotonic()
        for group in range(groups):
            caller = callers[group % 2]
            goal = start + (records - start) * (group + 1) // groups
            while made < goal:
                made += _one_op(ov, caller, rng, edited, ino_of, sizes, dirs, created, pool, snippets, FsError)
            if (group + 1) % 5000 == 0:
                rate = made / (time.monotonic() - t0)
                log(f"long session: {made:,}/{records:,} records, {group:,} checkpoints "
                    f"({rate:,.0f} records/s)")
        from overlayckpt.core.timeline import Timeline
        Timeline(s.ctx).seal()
        counts = s.store.read(lambda r: (r.count(JOURNAL), r.count(CKPTS)))
        s.store.sync()
    finally:
        s.close()
    return counts, [d for d, _ in dirs], edited


def _one_op(ov, caller, rng: random.Random, edited: list[str], ino_of: dict[str, int],
            sizes: dict[str, int], dirs: list[tuple[str, int]], created: list[tuple[int, bytes, int]],
            pool: list[bytes], snippets: list[bytes], FsError: type) -> int:
    """One operation (two for a create: the file and its first write); returns records made."""
    r = rng.random()
    if r < 0.70:  # edit an existing repo file
        path = rng.choice(edited)
        ino = ino_of[path]
        nblocks = max(1, sizes[path] // BLOCK)
        if r < 0.69:
            ov.write(caller, ino, rng.randrange(nblocks) * BLOCK, rng.choice(pool))
        else:
            ov.write(caller, ino, rng.randrange(sizes[path] - 256), rng.choice(snippets))
        return 1
    if r < 0.85 or len(created) < 50:  # create a file, then write it
        d_ino = rng.choice(dirs)[1]
        name = b"f%07d.txt" % rng.randrange(10_000_000)
        try:
            ino, _ = ov.create(caller, d_ino, name, stat.S_IFREG | 0o644, 0, 0)
        except FsError:
            return 0  # the name is taken: skip
        ov.write(caller, ino, 0, rng.choice(pool)[: rng.choice((200, 600, 1500, 3000))])
        created.append((d_ino, name, ino))
        made = 2
        if len(created) > LIVE_CREATED:  # keep the live set bounded: delete the oldest
            p, n, _ = created.pop(0)
            ov.remove(caller, p, n, False)
            made += 1
        return made
    i = rng.randrange(len(created))
    p, n, ino = created[i]
    if r < 0.92:  # delete a created file
        created.pop(i)
        ov.remove(caller, p, n, False)
        return 1
    # rename a created file, to another directory and name
    d2 = rng.choice(dirs)[1]
    n2 = b"r%07d.txt" % rng.randrange(10_000_000)
    try:
        ov.rename(caller, p, n, d2, n2, 1)  # RENAME_NOREPLACE
    except FsError:
        return 0
    created[i] = (d2, n2, ino)
    return 1
