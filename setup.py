"""Builds the one C part, the library overlayckpt._kcache, from the files in
overlayckpt/fuse/csrc (see kcache.h there); the rest of the project is configured
in pyproject.toml.

The build writes nothing into the source tree (it may be a shared checkout or an
unpacked sdist the user cannot write): objects and metadata go to a temporary
directory, removed when the build ends. An editable install (make install) still
puts the library beside the sources: that is what editable means."""
import atexit
import glob
import shutil
import subprocess
import tempfile

from setuptools import Extension, setup


def fuse3_flags(kind: str) -> list[str]:
    out = subprocess.run(["pkg-config", kind, "fuse3"], capture_output=True, text=True, check=True)
    return out.stdout.split()


CSRC = "overlayckpt/fuse/csrc"

OUT = tempfile.mkdtemp(prefix="overlayckpt-build-")
atexit.register(shutil.rmtree, OUT, ignore_errors=True)

setup(options={"build": {"build_base": OUT}, "egg_info": {"egg_base": OUT}}, ext_modules=[Extension(
    "overlayckpt._kcache", sources=sorted(glob.glob(f"{CSRC}/*.c")),
    include_dirs=[CSRC], depends=sorted(glob.glob(f"{CSRC}/*.h")),
    extra_compile_args=fuse3_flags("--cflags"), extra_link_args=fuse3_flags("--libs") + ["-ldl"],
    py_limited_api=False,
)])
