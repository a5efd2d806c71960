"""The rewind screen's rendering at a given size: the list scrolls with the selection,
the two panes share the width, the conversation reads `role [tool]: text`. (The app
itself, in a pseudo-terminal: tests/test_rewind.py.)"""
from __future__ import annotations

import json
from typing import Any

import pytest

from overlayckpt.cli.rewind import brief, conversation_line, list_width, preview_lines, timeline_rows


def checkpoints(n: int) -> list[Any]:  # (log entries: the fields the list shows)
    return [{"id": n - i, "name": None, "time": "2026-12-01T13:00:00+00:00",
             "summary": f"step {n - i} " + "words " * 30, "files": []} for i in range(n)]


@pytest.mark.parametrize("index", [0, 1, 7, 25, 48, 49])
def test_the_selection_is_always_on_screen(index: int) -> None:
    rows = timeline_rows(checkpoints(50), index, 40, 10)
    assert len(rows) == 10
    selected = [line for style, line in rows if style == "reverse"]
    assert len(selected) == 1 and selected[0].strip().startswith(str(50 - index))
    assert all(len(line) == 40 for _, line in rows)


def test_a_short_list_is_shown_whole_from_the_top() -> None:
    rows = timeline_rows(checkpoints(3), 2, 30, 10)
    assert [line.split()[0] for _, line in rows] == ["3", "2", "1"]
    assert rows[2][0] == "reverse"


@pytest.mark.parametrize("columns, width", [(80, 32), (100, 40), (200, 80), (300, 90), (24, 24)])
def test_the_list_takes_two_fifths_and_the_preview_the_rest(columns: int, width: int) -> None:
    assert list_width(columns) == width


def test_conversation_lines_read_as_role_tool_text() -> None:
    edit = {"role": "assistant", "tool": "Edit", "summary": "Edit src/a.py",
            "content": json.dumps({"file_path": "src/a.py", "old_string": "x", "new_string": "y"})}
    result = {"role": "tool", "tool": "Bash",
              "content": json.dumps({"stdout": "3 passed\nok", "stderr": "", "interrupted": False})}
    assert conversation_line(edit) == "assistant [Edit]: src/a.py"
    assert conversation_line(result) == "tool [Bash]: 3 passed ok"
    assert conversation_line({"role": "user", "content": "fix the\nlogin"}) == "user: fix the login"
    assert brief('{"not": json') == '{"not": json'  # a cut line stays text
    assert brief([{"type": "text", "text": "hi"}]) == "hi"


def test_the_preview_fits_its_width_and_height() -> None:
    patch = "".join(f"+line {i} " + "x" * 200 + "\n" for i in range(100))
    conv = [{"role": "user", "content": "please " * 100}, {"role": "assistant", "content": "done"}]
    lines = preview_lines(patch, conv, 50, 20)
    assert len(lines) == 20 and all(len(line) <= 50 for line in lines)
    assert lines[-1] == "assistant: done"
    assert lines[-5] == "-- conversation at this checkpoint --"  # the prompt wraps to 3 rows
    assert lines[0].startswith("+line 0 ")
