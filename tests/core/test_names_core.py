"""Names and texts as a terminal gets them: nothing in them acts on it, and a byte of
a name that is not UTF-8 shows as that byte, as the file lines beside it show it."""
from __future__ import annotations

import os

from overlayckpt.names import line_text, quote_path, terminal_text


def test_a_name_that_is_not_utf8_shows_its_bytes() -> None:
    name = os.fsdecode(b"d/bad\xff\xfename")  # (as a summary holds it: surrogateescape)
    assert line_text(name) == "d/bad\\xff\\xfename"
    assert terminal_text(f"modified {name}\n") == "modified d/bad\\xff\\xfename\n"
    assert quote_path(name) == '"d/bad\\377\\376name"'
    assert line_text("\ud800 \x1b[31m new\nline") == "\\ud800 \\x1b[31m new\\nline"
