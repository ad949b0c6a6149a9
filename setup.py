"""Builds kvferry._kvferry with CMake for the interpreter running this (pyproject.toml has the
package's metadata).

CMake configures the repository with KVFERRY_BUILD_PYTHON=ON, no tests, Python_EXECUTABLE set
to this interpreter, plus whatever CMAKE_ARGS holds (e.g. CMAKE_ARGS="-DKVFERRY_WITH_CUDA=OFF"
for a CPU-only build, or -Dpybind11_DIR=...); CMAKE_BUILD_PARALLEL_LEVEL sets the build's jobs
(default: the number of CPUs).
"""

import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = os.path.abspath(self.build_temp)
        configure = [
            "cmake", "-S", ROOT, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DKVFERRY_BUILD_PYTHON=ON",
            "-DKVFERRY_BUILD_TESTS=OFF",
            f"-DPython_EXECUTABLE={sys.executable}",
            *shlex.split(os.environ.get("CMAKE_ARGS", "")),
        ]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", build_dir, "--target", "kvferry_python", "-j", jobs],
                       check=True)
        built = os.path.join(build_dir, "python", "kvferry")
        module = [f for f in os.listdir(built) if f.startswith("_kvferry.") and f.endswith(".so")]
        if len(module) != 1:
            raise RuntimeError(f"expected one _kvferry module in {built}, found {module}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(built, module[0]), target)


setup(ext_modules=[CMakeExtension("kvferry._kvferry")], cmdclass={"build_ext": CMakeBuild})
