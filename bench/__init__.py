"""Benchmark harness for overlayckpt (SPEC section 6).

Run from the project root: ``python -m bench.run --sizes 1000,10000 --quick``.
Modules: ``gen`` (synthetic repos), ``passthrough`` (the Python floor),
``contenders`` (how each filesystem is mounted and checkpointed),
``workloads`` (what is timed), ``report`` (JSON, Markdown, plots), ``run``
(the command line that ties them together).
"""
