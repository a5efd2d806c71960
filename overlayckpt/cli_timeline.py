"""CLI commands on the timeline: checkpoint, log, diff, show, restore."""
from __future__ import annotations

import argparse
from collections.abc import Callable

HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {}


def add_parsers(sub) -> None:  # type: ignore[no-untyped-def]
    return None
