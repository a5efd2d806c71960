"""Checkpoints as git commits (export git) and session bundles (export bundle / import).

Registers its session commands and CLI subcommands; see add_cli().
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_cli(sub: Any, handlers: dict[str, Callable[[argparse.Namespace], int]]) -> None:
    """Add the `export` and `import` subcommands to the CLI."""
    return None
