"""Deterministic synthetic monorepo generator.

Every contender is measured on the same tree, and runs on different days must
see the same tree too, so everything here comes from one seeded RNG: paths,
sizes and contents. File mtimes are pinned to a fixed date and the commit uses
fixed author/committer dates, so the repo (and its commit id) is reproducible.

Layout: ``packages/<pkg>/src/<module>/[<sub>/[<subsub>/]]`` leaf directories of
10-50 files each, plus package manifests, ``docs/``, ``tools/`` and a few
multi-MB binaries under ``assets/``; ``assets/blob-50m.bin`` (50 MiB) exists in
every repo for the large-file workload. Most text files are 1-20 KiB of
code-like lines.

Generated repos are cached under ``bench/work/repo-<N>``; a sidecar
``repo-<N>.json`` manifest (file list with sizes) marks a complete generation
and lets the workloads pick targets without walking the tree.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GEN_VERSION = 2
SEED = 20240601
FIXED_EPOCH = 1704067200  # 2024-01-01T00:00:00Z: pinned mtime for every file
GIT_DATE = "2024-01-01T00:00:00+0000"
BIG_FILE = "assets/blob-50m.bin"
BIG_FILE_SIZE = 50 * 1024 * 1024

WORK_DIR = Path(__file__).resolve().parent / "work"

GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.invalid",
    "GIT_AUTHOR_DATE": GIT_DATE,
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.invalid",
    "GIT_COMMITTER_DATE": GIT_DATE,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}

_SYLLABLES = [
    "ab", "ac", "ad", "al", "an", "ar", "ba", "be", "bi", "ca", "ce", "co",
    "da", "de", "di", "do", "el", "en", "er", "fa", "fi", "ga", "ge", "ha",
    "he", "in", "is", "ka", "ke", "la", "le", "li", "lo", "ma", "me", "mi",
    "mo", "na", "ne", "no", "or", "pa", "pe", "po", "ra", "re", "ri", "ro",
    "sa", "se", "si", "so", "ta", "te", "ti", "to", "un", "va", "ve", "za",
]
_EXTS = [".ts", ".ts", ".tsx", ".js", ".py", ".py", ".go", ".rs", ".json", ".md"]
_TEMPLATES = [
    "{i}const {a} = {b}({c}, {n});",
    "{i}let {a} = {b}.{c}({d});",
    "{i}if ({a} > {n}) {{",
    "{i}}}",
    "{i}return {a}.{b}({c});",
    "{i}// {a} {b} {c} {d}: keep in sync with {e}",
    "{i}def {a}_{b}(self, {c}: int, {d}: str) -> {E}:",
    "{i}for {a} in range({n}):",
    "{i}import {{ {A}, {B} }} from '../{c}/{d}';",
    "{i}func ({a} *{A}) {B}({c} {d}) error {{",
    "{i}self.{a} = {b}.get('{c}', {n})",
    "{i}export function {a}{B}({c}: {D}): {E} {{",
    "{i}assert {a}.{b} == {n}, \"{c} {d}\"",
    "{i}\"{a}_{b}\": \"{c}-{d}\",",
    "{i}pub fn {a}_{b}(&mut self, {c}: u{w}) -> Result<{A}, {B}> {{",
    "{i}throw new {A}Error(`{b} ${{{c}}} {d}`);",
    "",
]


def _word(rng: random.Random, lo: int = 2, hi: int = 4) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(lo, hi)))


def vocabulary(rng: random.Random, count: int = 4000) -> list[bytes]:
    """A pool of code-like lines; files are sampled from it (fast, compressible like code)."""
    lines = []
    for _ in range(count):
        t = rng.choice(_TEMPLATES)
        w = [_word(rng) for _ in range(5)]
        lines.append(
            t.format(
                i="    " * rng.randint(0, 3),
                a=w[0], b=w[1], c=w[2], d=w[3], e=w[4],
                A=w[0].capitalize(), B=w[1].capitalize(),
                D=w[3].capitalize(), E=w[4].capitalize(),
                n=rng.randint(0, 9999), w=rng.choice([8, 16, 32, 64]),
            ).encode()
            + b"\n"
        )
    return lines


def text_blob(rng: random.Random, vocab: list[bytes], size: int) -> bytes:
    """About *size* bytes of code-like text (cut to exactly *size*)."""
    n = max(1, size // 38 + 1)
    data = b"".join(rng.choices(vocab, k=n))
    while len(data) < size:
        data += b"".join(rng.choices(vocab, k=n))
    return data[:size]


def _text_size(rng: random.Random) -> int:
    """Skewed sizes: 85% 1-20 KiB (log-uniform), 10% under 1 KiB, 5% 20-200 KiB."""
    r = rng.random()
    if r < 0.10:
        return rng.randint(60, 1023)
    if r < 0.95:
        return int(1024 * 20 ** rng.random())
    return int(20 * 1024 * 10 ** rng.random())


@dataclass(frozen=True, slots=True)
class Repo:
    """A generated repo: where it is and what is in it."""

    n_files: int
    path: Path
    files: list[tuple[str, int]]  # (relative path, size), sorted by path

    @property
    def total_bytes(self) -> int:
        return sum(s for _, s in self.files)

    def text_files(self, lo: int, hi: int) -> list[str]:
        """Text files with lo <= size <= hi (binaries live under assets/)."""
        return [p for p, s in self.files if lo <= s <= hi and not p.startswith("assets/")]


def _layout(rng: random.Random, n_files: int) -> list[tuple[str, str]]:
    """Return [(relative path, kind)] with kind 'text' or 'bin', exactly n_files long."""
    out: list[tuple[str, str]] = [
        ("README.md", "text"), ("package.json", "text"), (".gitignore", "gitignore"),
        (BIG_FILE, "bin"),
    ]
    n_bins = 1 if n_files <= 2000 else max(2, min(10, n_files // 12000 + 2))
    for i in range(n_bins):
        out.append((f"assets/{_word(rng)}-{i}.bin", "bin"))
    for i in range(max(1, n_files // 500)):
        out.append((f"docs/{_word(rng)}-{i}.md", "text"))
    for i in range(max(1, n_files // 1000)):
        out.append((f"tools/{_word(rng)}-{i}.py", "text"))
    n_pkgs = max(2, n_files // 400)
    pkg_names = [f"{_word(rng, 2, 3)}-{i}" for i in range(n_pkgs)]
    pkg_i = 0
    while len(out) < n_files:
        pkg = pkg_names[pkg_i % n_pkgs]
        pkg_i += 1
        base = f"packages/{pkg}"
        if pkg_i <= n_pkgs:
            out.append((f"{base}/package.json", "text"))
            out.append((f"{base}/README.md", "text"))
        # leaf dir 4-6 levels deep below the root: packages/pkg/src/mod[/sub[/subsub]]
        parts = [base, "src", _word(rng)]
        for _ in range(rng.randint(0, 2)):
            parts.append(_word(rng))
        leaf = "/".join(parts)
        for j in range(rng.randint(10, 50)):
            out.append((f"{leaf}/{_word(rng)}_{j}{rng.choice(_EXTS)}", "text"))
    out = out[:n_files]
    seen: set[str] = set()
    uniq = []
    for p, k in out:  # word collisions can repeat a path; keep the first
        if p not in seen:
            seen.add(p)
            uniq.append((p, k))
    i = 0
    while len(uniq) < n_files:  # top up to the exact count
        p = f"packages/extra/src/fill/file_{i}.ts"
        i += 1
        if p not in seen:
            seen.add(p)
            uniq.append((p, "text"))
    return uniq


def _git(repo: Path, *args: str) -> None:
    env = dict(os.environ, **GIT_ENV)
    subprocess.run(["git", "-C", str(repo), "-c", "gc.auto=0", *args], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def generate(n_files: int, dest: Path, log=print) -> list[tuple[str, int]]:
    """Write the repo for *n_files* into *dest* (must not exist) and commit it."""
    rng = random.Random(SEED * 1_000_003 + n_files)
    vocab = vocabulary(random.Random(SEED))
    layout = _layout(rng, n_files)
    files: list[tuple[str, int]] = []
    made_dirs: set[str] = set()
    old_umask = os.umask(0o022)
    try:
        for idx, (rel, kind) in enumerate(layout):
            d = os.path.dirname(rel)
            if d and d not in made_dirs:
                os.makedirs(dest / d, exist_ok=True)
                made_dirs.add(d)
            if rel == BIG_FILE:
                data = rng.randbytes(BIG_FILE_SIZE)
            elif kind == "gitignore":
                data = b"dist/\ncoverage/\n"
            elif kind == "bin":
                data = rng.randbytes(rng.randint(1, 8) * 1024 * 1024)
            else:
                data = text_blob(rng, vocab, _text_size(rng))
            with open(dest / rel, "wb") as f:
                f.write(data)
            os.utime(dest / rel, (FIXED_EPOCH, FIXED_EPOCH))
            files.append((rel, len(data)))
            if idx % 5000 == 0:
                log(f"gen {n_files}: {idx}/{n_files} files")
    finally:
        os.umask(old_umask)
    for d in made_dirs | {""}:
        os.utime(dest / d, (FIXED_EPOCH, FIXED_EPOCH))
    log(f"gen {n_files}: git commit")
    _git(dest, "init", "-q", "-b", "main")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", f"synthetic monorepo, {n_files} files")
    _git(dest, "gc", "-q")
    _git(dest, "status", "--porcelain")  # settle the index (no racy entries)
    files.sort()
    return files


def ensure_repo(n_files: int, log=print) -> Repo:
    """Return the cached repo for *n_files*, generating it on first use."""
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    path = WORK_DIR / f"repo-{n_files}"
    manifest = WORK_DIR / f"repo-{n_files}.json"
    if manifest.exists() and path.is_dir():
        meta = json.loads(manifest.read_text())
        if meta.get("version") == GEN_VERSION and meta.get("seed") == SEED:
            return Repo(n_files, path, [(p, s) for p, s in meta["files"]])
    if path.exists():
        shutil.rmtree(path)
    manifest.unlink(missing_ok=True)
    tmp = WORK_DIR / f"repo-{n_files}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = generate(n_files, tmp, log)
    tmp.rename(path)
    manifest.write_text(json.dumps({"version": GEN_VERSION, "seed": SEED, "files": files}))
    return Repo(n_files, path, files)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.gen 1000 10000``: pre-generate repos."""
    for arg in (argv if argv is not None else sys.argv[1:]) or ["1000"]:
        repo = ensure_repo(int(arg), log=lambda m: print(m, file=sys.stderr))
        print(f"{repo.path}: {len(repo.files)} files, {repo.total_bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
