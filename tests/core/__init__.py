"""The in-process tier: store, core and adapter without FUSE or root (make test-fast)."""
