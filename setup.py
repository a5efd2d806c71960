"""Builds the one C part, the library overlayckpt._kcache, from the files in
overlayckpt/fuse/csrc (see kcache.h there); the rest of the project is configured
in pyproject.toml."""
import glob
import subprocess

from setuptools import Extension, setup


def fuse3_flags(kind: str) -> list[str]:
    out = subprocess.run(["pkg-config", kind, "fuse3"], capture_output=True, text=True, check=True)
    return out.stdout.split()


CSRC = "overlayckpt/fuse/csrc"

setup(ext_modules=[Extension(
    "overlayckpt._kcache", sources=sorted(glob.glob(f"{CSRC}/*.c")),
    include_dirs=[CSRC], depends=sorted(glob.glob(f"{CSRC}/*.h")),
    extra_compile_args=fuse3_flags("--cflags"), extra_link_args=fuse3_flags("--libs") + ["-ldl"],
    py_limited_api=False,
)])
