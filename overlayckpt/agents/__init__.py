"""The agents' side: their hook events made into conversation lines (the hook process
imports hooks.py alone), our hooks and MCP server installed in their settings files, and
their own transcripts cut back on a restore. Uses core/; service/ and cli/ use it."""
