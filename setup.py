"""Builds the one C part, overlayckpt/_kcache.c (see its header); the rest of the
project is configured in pyproject.toml."""
import subprocess

from setuptools import Extension, setup


def fuse3_flags(kind: str) -> list[str]:
    out = subprocess.run(["pkg-config", kind, "fuse3"], capture_output=True, text=True, check=True)
    return out.stdout.split()


setup(ext_modules=[Extension(
    "overlayckpt._kcache", sources=["overlayckpt/_kcache.c"],
    extra_compile_args=fuse3_flags("--cflags"), extra_link_args=fuse3_flags("--libs") + ["-ldl"],
    py_limited_api=False,
)])
