"""The command line: parser and dispatch in app.py, one module per command group."""
from overlayckpt.cli.app import main

__all__ = ["main"]
