"""Builds the C parts: the fast path library overlayckpt/fuse/libfastpath.so, from the
files in overlayckpt/fuse/csrc (see fastpath.h there), and the agent hook program
overlayckpt/bin/overlayckpt-hook, from overlayckpt/bin/hook.c (no Python in it: a hook
must cost milliseconds); the rest of the project is configured in pyproject.toml.

The library is a plain shared library, not a Python extension: it has no PyInit, and
fuse/fastpath.py loads it with ctypes (RTLD_GLOBAL, before pyfuse3, for which it
stands in for four libfuse functions). So it is no setuptools Extension: the build_ext
step below compiles and links it itself, and the distribution says it has binary parts
so that the wheel is tagged for this platform.

The build writes nothing into the source tree (it may be a shared checkout or an
unpacked sdist the user cannot write): objects and metadata go to a temporary
directory, removed when the build ends. An editable install (make install) still
puts the library and the hook beside the sources: that is what editable means."""
import atexit
import glob
import os
import shutil
import subprocess
import tempfile

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext


def fuse3_flags(kind: str) -> list[str]:
    out = subprocess.run(["pkg-config", kind, "fuse3"], capture_output=True, text=True, check=True)
    return out.stdout.split()


CSRC = "overlayckpt/fuse/csrc"
LIBRARY = "libfastpath.so"  # fuse/fastpath.py looks for it beside itself
LIBRARY_DIR = os.path.join("overlayckpt", "fuse")

HOOK_SRC = "overlayckpt/bin/hook.c"
HOOK = "overlayckpt-hook"
HOOK_DIR = os.path.join("overlayckpt", "bin")


class BuildNative(build_ext):
    """The library and the hook program, into the build tree (so a wheel carries them),
    copied beside the sources for an in-place or editable build."""

    def run(self) -> None:
        # (setuptools' own distutils: setuptools is imported by now)
        from distutils.ccompiler import new_compiler
        from distutils.sysconfig import customize_compiler
        compiler = new_compiler(verbose=self.verbose, force=self.force)
        customize_compiler(compiler)  # CC, CFLAGS, -fPIC and -shared as Python was built
        sources = sorted(glob.glob(f"{CSRC}/*.c"))
        headers = sorted(glob.glob(f"{CSRC}/*.h"))
        lib_dir = os.path.join(self.build_lib, LIBRARY_DIR)
        self.mkpath(lib_dir)
        library = os.path.join(lib_dir, LIBRARY)
        if self.force or _newer(sources + headers, library):
            objects = compiler.compile(sources, output_dir=self.build_temp, include_dirs=[CSRC],
                                       extra_postargs=fuse3_flags("--cflags"),
                                       depends=headers)
            compiler.link_shared_object(objects, LIBRARY, output_dir=lib_dir,
                                        extra_postargs=fuse3_flags("--libs") + ["-ldl"])
        objects = compiler.compile([HOOK_SRC], output_dir=self.build_temp,
                                   extra_postargs=["-O2", "-Wall"])
        hook_dir = os.path.join(self.build_lib, HOOK_DIR)
        self.mkpath(hook_dir)
        compiler.link_executable(objects, HOOK, output_dir=hook_dir)
        if self.inplace:  # (an editable install sets it too)
            self.copy_file(library, os.path.join(LIBRARY_DIR, LIBRARY))
            self.copy_file(os.path.join(hook_dir, HOOK), os.path.join(HOOK_DIR, HOOK))

    def get_outputs(self) -> list[str]:
        return [os.path.join(self.build_lib, LIBRARY_DIR, LIBRARY),
                os.path.join(self.build_lib, HOOK_DIR, HOOK)]


def _newer(sources: list[str], target: str) -> bool:
    if not os.path.exists(target):
        return True
    built = os.path.getmtime(target)
    return any(os.path.getmtime(s) > built for s in sources)


class BinaryDistribution(Distribution):
    """No Extension, yet binary parts: build_ext runs, and the wheel is platform-tagged."""

    def has_ext_modules(self) -> bool:
        return True


OUT = tempfile.mkdtemp(prefix="overlayckpt-build-")
atexit.register(shutil.rmtree, OUT, ignore_errors=True)

setup(options={"build": {"build_base": OUT}, "egg_info": {"egg_base": OUT}},
      distclass=BinaryDistribution, cmdclass={"build_ext": BuildNative})
