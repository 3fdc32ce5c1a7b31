"""Builds the localsgd Python package with CMake; see pyproject.toml.

    pip install --no-build-isolation .

build_ext configures this checkout with CMake (the tests, LibTorch parts
and benchmarks off; Ninja where installed; ccache through the project's own
compiler launcher), builds the target _localsgd for the interpreter that
runs the build, and copies the module into the wheel; build_py copies
python/localsgd/*.py next to it.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
# The CMake build directory, kept between installs (incremental rebuilds).
BUILD_DIR = os.path.abspath(os.environ.get("LOCALSGD_PIP_BUILD_DIR") or
                            os.path.join(ROOT, "build-pip"))
# setuptools' own build and metadata directories: inside BUILD_DIR, so that
# neither the checkout's build/ (a CMake build directory by convention) nor
# python/ gets them.
SETUPTOOLS_DIR = os.path.join(BUILD_DIR, "setuptools")


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(\s*localsgd\s+VERSION\s+([0-9.]+)", f.read())
    if not m:
        sys.exit("setup.py: no `project(localsgd VERSION x.y.z)` in "
                 "CMakeLists.txt")
    return m.group(1)


def run(command):
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


class CMakeExtension(Extension):
    """An extension CMake builds (no sources of setuptools' own)."""

    def __init__(self, name, target):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("cmake is not on PATH (Debian: cmake; "
                               "scripts/install-deps.sh installs every "
                               "build dependency)")
        configure = [
            cmake, "-S", ROOT, "-B", BUILD_DIR,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLOCALSGD_BUILD_TESTS=OFF", "-DLOCALSGD_BUILD_TORCH=OFF",
            "-DLOCALSGD_BUILD_BENCH=OFF", "-DLOCALSGD_BUILD_PYTHON=ON",
            # The module is built for the interpreter that runs the build
            # (a venv's python included).
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        cache = os.path.join(BUILD_DIR, "CMakeCache.txt")
        if not os.path.exists(cache) and shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        configure += os.environ.get("CMAKE_ARGS", "").split()
        run(configure)
        with open(cache) as f:
            if "LOCALSGD_PYTHON:INTERNAL=ON" not in f.read():
                raise RuntimeError(
                    "CMake did not configure the Python package: it needs "
                    "python3-dev and pybind11-dev (see the configure output "
                    "above)")
        build = [cmake, "--build", BUILD_DIR, "--target", ext.target]
        jobs = self.parallel or os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL")
        if jobs:
            build += ["-j", str(jobs)]
        run(build)
        built = os.path.join(BUILD_DIR, "python", "localsgd",
                             ext.target + sysconfig.get_config_var(
                                 "EXT_SUFFIX"))
        if not os.path.exists(built):
            raise RuntimeError(f"CMake built no {built}")
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(built, dest)
        shutil.copymode(built, dest)


os.makedirs(SETUPTOOLS_DIR, exist_ok=True)
setup(
    version=project_version(),
    packages=["localsgd"],
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("localsgd._localsgd", "_localsgd")],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": SETUPTOOLS_DIR},
             "egg_info": {"egg_base": SETUPTOOLS_DIR}},
)
