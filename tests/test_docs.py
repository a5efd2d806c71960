"""The documentation stays true: a short README for users, links that lead somewhere,
and a protocol.md section for every control command the daemon registers."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *DOCS]
README_MAX_LINES = 250

# what belongs in a lab notebook, not in a user's README
NOTEBOOK = {
    "an issue number": re.compile(r"\bissues?\s*#?\d+|#\d+\b", re.IGNORECASE),
    "a work session's name": re.compile(r"\bsession[-_ ]?\d+\b|full-session", re.IGNORECASE),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "a reference to the specification": re.compile(r"\bSPEC\b"),
}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"


@pytest.mark.parametrize("what", sorted(NOTEBOOK))
def test_readme_holds_no_notebook_references(what: str) -> None:
    found = [f"{n}: {line.strip()}" for n, line in enumerate(README.read_text().splitlines(), 1)
             if NOTEBOOK[what].search(line)]
    assert not found, f"README.md holds {what}:\n" + "\n".join(found)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines()
            if line.startswith("#")}


def _relative_links(path: Path) -> list[str]:
    text = path.read_text()
    text = re.sub(r"^(    |\t).*$", "", text, flags=re.MULTILINE)  # (code blocks hold no links)
    return [t for t in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not https:, mailto:, ...


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(doc: Path) -> None:
    broken = []
    for target in _relative_links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def _documented_commands() -> list[str]:
    text = (ROOT / "docs" / "protocol.md").read_text()
    return re.findall(r"^### `([a-z_]+)`\s*$", text, flags=re.MULTILINE)


def test_every_control_command_is_documented() -> None:
    import overlayckpt.service  # noqa: F401  (registers every command)
    from overlayckpt.service.registry import COMMANDS
    documented = set(_documented_commands())
    missing = sorted(set(COMMANDS) - documented)
    assert not missing, f"docs/protocol.md has no ### `name` section for: {', '.join(missing)}"


def test_protocol_documents_no_command_that_does_not_exist() -> None:
    import overlayckpt.service  # noqa: F401
    from overlayckpt.service.registry import COMMANDS
    known = set(COMMANDS) | {"interrupt"}  # (answered by fuse/control.py itself)
    stale = sorted(set(_documented_commands()) - known)
    assert not stale, f"docs/protocol.md documents commands that do not exist: {', '.join(stale)}"
