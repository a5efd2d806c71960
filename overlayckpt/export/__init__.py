"""Checkpoints as git commits, and session bundles (export and import)."""
