"""Which paths are bookkeeping: what the repo ignores, and agents' own files.

The default log folds a checkpoint whose every path is ignored into its neighbour's
row (Aider's chat history and repo-map cache, test and bytecode caches), so a step
of the agent is one row, not several. The rules are a bounded subset of gitignore's:

- read from the root `.gitignore` and `.git/info/exclude` as the state has them (at
  most RULES_BYTES each), plus AGENT_RULES; a nested `.gitignore`, `core.excludesFile`
  and the global excludes are not read;
- `#` comments, blank lines, `!` negation (the last matching rule wins), a trailing
  `/` (directories only: it matches a directory the path lies under), a leading or
  inner `/` (anchored at the root, else matched against every component), `*`, `?`,
  `[...]` and `**`; git's rule that a file under an excluded directory cannot be
  included again is not applied, nor are escapes of trailing spaces.

Pure computation over a state: any thread.
"""
from __future__ import annotations

import re

from overlayckpt.core.tree import State, Tree
from overlayckpt.errors import FsError

RULES_BYTES = 64 * 1024
RULE_FILES = (".gitignore", ".git/info/exclude")
# What agents and the tools they run keep beside the code, ignored or not.
AGENT_RULES = (
    ".aider*", "__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/",
    ".cache/", "*.db-wal", "*.db-shm", "*.db-journal", "*.sqlite-wal", "*.sqlite-shm",
    "*.swp", ".*.lock", "*.lck",
)


def _glob(pattern: str) -> str:
    """A regex for one gitignore glob ('*' stays within a component; '**' crosses them)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append("/.*")
            break
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 2)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                out.append("[" + ("^" + body[1:] if body[:1] == "!" else body).replace("\\", "\\\\") + "]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


class Ignored:
    """A list of rules; `(path)` says whether the last rule matching path ignores it."""

    def __init__(self, lines: list[str]) -> None:
        # (regex, negated, directories only, anchored)
        self._rules: list[tuple[re.Pattern[str], bool, bool, bool]] = []
        for line in lines:
            line = line.rstrip("\r").rstrip(" ")
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            if negated:
                line = line[1:]
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            line = line.lstrip("/")
            if line:
                self._rules.append((re.compile(_glob(line)), negated, dir_only, anchored))

    def __call__(self, path: str, maybe_dir: bool = False) -> bool:
        """maybe_dir: path may be a directory (rules for directories match it too)."""
        parts = path.strip("/").split("/") + (["-"] if maybe_dir else [])
        verdict = False
        for rx, negated, dir_only, anchored in self._rules:
            # the path itself (a file: unless the rule is for directories), then each
            # directory it lies under
            last = len(parts) - 1 if dir_only else len(parts)
            for n in range(last, 0, -1) if anchored else ():
                if rx.fullmatch("/".join(parts[:n])):
                    verdict = not negated
                    break
            if not anchored and any(rx.fullmatch(p) for p in parts[:last]):
                verdict = not negated
        return verdict

    @classmethod
    def of(cls, tree: Tree, state: State) -> Ignored:
        """The rules a state's rule files hold, after AGENT_RULES (theirs win)."""
        lines = list(AGENT_RULES)
        for path in RULE_FILES:
            try:
                ino = tree.resolve(state, path)
                node = tree.node(state, ino)
                if node.is_reg:
                    raw = tree.read(state, ino, node, 0, RULES_BYTES)
                    lines += raw.decode("utf-8", "surrogateescape").split("\n")
            except FsError:
                continue
        return cls(lines)
