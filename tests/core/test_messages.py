"""The control protocol's schemas (overlayckpt/messages.py): what parse accepts and
refuses, that every command has a handler, and that docs/protocol.md documents each
command with every field of its request and of its reply."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from overlayckpt.errors import UserError
from overlayckpt.messages import (
    REQUESTS,
    DiffRequest,
    GcRequest,
    InterruptRequest,
    LogRequest,
    RestoreRequest,
    parse,
    reply_fields,
)
from overlayckpt.service.registry import COMMANDS

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_a_request_is_parsed_into_its_dataclass() -> None:
    req = parse({"cmd": "restore", "id": "baseline", "what": "code", "paths": ["a.txt"]})
    assert req == RestoreRequest(id="baseline", what="code", paths=["a.txt"])
    assert parse({"cmd": "log"}) == LogRequest()
    assert parse({"cmd": "diff", "a": None, "stat": True}) == DiffRequest(stat=True)  # null: default


def test_to_json_is_what_parse_reads_back() -> None:
    for req in (RestoreRequest(id=7), DiffRequest(a=1, b="x", stat=True, paths=["p"]),
                GcRequest(budget=10), LogRequest(limit=5, all=True), InterruptRequest()):
        assert parse(req.to_json()) == req
    assert RestoreRequest(id=7).to_json() == {"cmd": "restore", "id": 7}  # defaults left out


@pytest.mark.parametrize("raw, error", [
    ([1], 'a command is a JSON object with a "cmd" string'),
    ({"cmd": 3}, 'a command is a JSON object with a "cmd" string'),
    ({"cmd": "nope"}, "unknown command 'nope'; known: apply, backout,"),
    ({"cmd": "log", "limt": 3}, "log takes no field 'limt'; it takes: limit, file, all"),
    ({"cmd": "status", "x": 1}, "status takes no field 'x'; it takes: nothing"),
    ({"cmd": "log", "limit": -1}, '"limit" must be a non-negative integer'),
    ({"cmd": "log", "limit": True}, '"limit" must be a non-negative integer'),
    ({"cmd": "log", "all": 1}, '"all" must be true or false'),
    ({"cmd": "checkpoint", "name": 5}, '"name" must be a string'),
    ({"cmd": "restore"}, 'restore needs "id" (a checkpoint id or name)'),
    ({"cmd": "restore", "id": 1.5}, '"id" must be a checkpoint id or name'),
    ({"cmd": "restore", "id": None}, '"id" must be a checkpoint id or name'),
    ({"cmd": "restore", "id": 1, "what": "all"}, '"what" must be "code", "conversation" or "both"'),
    ({"cmd": "diff", "paths": "a"}, '"paths" must be a list of strings'),
    ({"cmd": "diff", "paths": [1]}, '"paths" must be a list of strings'),
    ({"cmd": "gc", "budget": 1e308}, '"budget" must be a number of bytes'),
    ({"cmd": "set_apply"}, '"apply" must be true or false'),
    ({"cmd": "show"}, 'show needs "id"'),
    ({"cmd": "fork"}, 'fork needs "store"'),
])
def test_a_bad_request_is_refused_in_one_line(raw: object, error: str) -> None:
    with pytest.raises(UserError) as e:
        parse(raw)
    assert str(e.value).startswith(error), str(e.value)
    assert "\n" not in str(e.value)


def test_a_long_unknown_field_is_cut_short() -> None:
    with pytest.raises(UserError) as e:
        parse({"cmd": "log", "x" * 5000: 1})
    assert len(str(e.value)) < 300


def test_every_command_has_a_handler() -> None:
    # interrupt is the control directory's own (fuse/control.py)
    assert set(COMMANDS) == set(REQUESTS) - {"interrupt"}


def _sections() -> dict[str, str]:
    """protocol.md's "### `name`" sections of the Commands part, by command."""
    text = PROTOCOL.read_text()
    commands = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### `([a-z_]+)`\n", commands, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _bullet(section: str, word: str) -> set[str]:
    """The `names` of a section's "- request:" (or "- response...:") bullet."""
    found = re.search(rf"^- {word}[^:]*:(.*?)(?=^- |^\s*$)", section, flags=re.M | re.S)
    return set(re.findall(r"`([a-z_0-9]+)`", found.group(1))) if found else set()


def test_protocol_md_documents_every_command_as_the_schema_has_it() -> None:
    sections = _sections()
    assert set(sections) == set(REQUESTS), "commands documented but not in the schema, or back"
    for name, cls in REQUESTS.items():
        section = sections[name]
        fields = {f.name for f in cls.FIELDS}
        documented = _bullet(section, "request")
        assert fields <= documented, f"{name}: request fields not in protocol.md: {fields - documented}"
        if not fields:
            assert "request: nothing" in section, name
        replied = reply_fields(cls)
        shown = _bullet(section, "response")
        assert replied <= shown | {"interruptible"}, \
            f"{name}: reply fields not in protocol.md: {replied - shown}"
