"""Builds the C parts: the library overlayckpt._kcache, from the files in
overlayckpt/fuse/csrc (see fastpath.h there), and the agent hook program
overlayckpt/bin/overlayckpt-hook, from overlayckpt/bin/hook.c (no Python in it: a hook
must cost milliseconds); the rest of the project is configured in pyproject.toml.

The build writes nothing into the source tree (it may be a shared checkout or an
unpacked sdist the user cannot write): objects and metadata go to a temporary
directory, removed when the build ends. An editable install (make install) still
puts the library beside the sources: that is what editable means."""
import atexit
import glob
import os
import shutil
import subprocess
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def fuse3_flags(kind: str) -> list[str]:
    out = subprocess.run(["pkg-config", kind, "fuse3"], capture_output=True, text=True, check=True)
    return out.stdout.split()


CSRC = "overlayckpt/fuse/csrc"

HOOK_SRC = "overlayckpt/bin/hook.c"
HOOK = "overlayckpt-hook"


class BuildWithHook(build_ext):
    """build_ext, then the hook program into the build tree's overlayckpt/bin (so a wheel
    carries it), copied beside the sources for an in-place or editable build, as the
    extension is."""

    def run(self) -> None:
        super().run()
        objects = self.compiler.compile([HOOK_SRC], output_dir=self.build_temp,
                                        extra_postargs=["-O2", "-Wall"])
        out_dir = os.path.join(self.build_lib, "overlayckpt", "bin")
        self.mkpath(out_dir)
        self.compiler.link_executable(objects, HOOK, output_dir=out_dir)
        if self.inplace:
            self.copy_file(os.path.join(out_dir, HOOK), os.path.join("overlayckpt", "bin", HOOK))


OUT = tempfile.mkdtemp(prefix="overlayckpt-build-")
atexit.register(shutil.rmtree, OUT, ignore_errors=True)

setup(options={"build": {"build_base": OUT}, "egg_info": {"egg_base": OUT}},
      cmdclass={"build_ext": BuildWithHook}, ext_modules=[Extension(
    "overlayckpt._kcache", sources=sorted(glob.glob(f"{CSRC}/*.c")),
    include_dirs=[CSRC], depends=sorted(glob.glob(f"{CSRC}/*.h")),
    extra_compile_args=fuse3_flags("--cflags"), extra_link_args=fuse3_flags("--libs") + ["-ldl"],
    py_limited_api=False,
)])
