#!/usr/bin/env bash
# Packs the Python package built here for another machine's interpreter into .devbuild/python
# (git-ignored): the package with its compiled module, the pytest suite (and the model configs
# it reads from tests/data, into .devbuild/tests/data), and the shared libraries the module
# links that a bare image lacks (into .devbuild/lib, as scripts/device_bundle.sh does for the
# binaries). The GPU machine (Python 3.12, pybind11 3.x,
# no Asio/spdlog/fmt/cpp-httplib headers) cannot build kvferry itself; build the module here
# for a matching interpreter, e.g. pyenv's 3.12 with pip's pybind11:
#
#   /root/.pyenv/versions/3.12.1/bin/python3 -m venv /tmp/py312
#   /tmp/py312/bin/pip install pybind11 numpy pytest
#   cmake -S . -B build-py312 -DKVFERRY_BUILD_TESTS=OFF -DPython_EXECUTABLE=/tmp/py312/bin/python
#   cmake --build build-py312 --target kvferry_python
#   scripts/python_bundle.sh build-py312
#
# and there: LD_LIBRARY_PATH=.devbuild/lib PYTHONPATH=.devbuild/python \
#   python3 -m pytest .devbuild/python/tests
# Usage: scripts/python_bundle.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
out=.devbuild/python
[ -d "$build/python/kvferry" ] || { echo "no $build/python/kvferry: build kvferry_python" >&2; exit 2; }
rm -rf "$out" && mkdir -p "$out/kvferry" "$out/tests" .devbuild/lib
cp -L "$build"/python/kvferry/*.py "$build"/python/kvferry/*.pyi "$build"/python/kvferry/py.typed \
  "$out/kvferry/"
cp -rL "$build"/python/kvferry/examples "$out/kvferry/" && rm -rf "$out/kvferry/examples/__pycache__"
for module in "$build"/python/kvferry/_kvferry*.so; do strip -o "$out/kvferry/$(basename "$module")" "$module"; done
cp python/tests/*.py "$out/tests/"
# The model configs some tests read from the repository's tests/data (two levels above them).
mkdir -p .devbuild/tests/data && cp tests/data/*.json .devbuild/tests/data/
for lib in libcpp-httplib.so.0.11 libxxhash.so.0 libspdlog.so.1.10 libfmt.so.9 libcrypto.so.3 libbrotlidec.so.1 libbrotlienc.so.1 \
           libbrotlicommon.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$lib" .devbuild/lib/
done
du -sh "$out" .devbuild/lib
