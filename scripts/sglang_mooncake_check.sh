#!/usr/bin/env bash
# kvferry against the real thing (issue 18 part 6), outside CI:
#   1. python/tests/test_mooncake.py against Mooncake's own engine (--mooncake-impl=mooncake)
#      and against kvferry.mooncake, in the same interpreter;
#   2. SGLang's own Mooncake backend moving KV between a prefill and a decode process over
#      kvferry.mooncake (python/tests/peers/sglang_mooncake_check.py), then over Mooncake's
#      engine as the reference.
#
#   scripts/sglang_mooncake_check.sh            # set up (once) and run everything
#   VENV=/path/to/venv BUILD_DIR=build-venv scripts/sglang_mooncake_check.sh
#
# Set-up, skipped when done: a venv of the `python3` on PATH (pyenv's 3.11 here; it reaches
# PyPI) at $VENV (default /work/venv-peers, outside the repository) with
# mooncake-transfer-engine-non-cuda (Mooncake's CPU-only wheel: the default wheel needs
# libcudart.so.12), pytest, pybind11, and sglang without its dependencies plus what its
# disaggregation modules import (torch from PyPI: about 5 GB with its CUDA libraries, used
# on the CPU); then kvferry's module built for that interpreter in $BUILD_DIR (CPU-only).
# docs/python.md records the versions this ran with and the result.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/work/venv-peers}
BUILD_DIR=${BUILD_DIR:-build-venv}
PY=$VENV/bin/python

if [[ ! -x $PY ]]; then
  python3 -m venv "$VENV"
fi
if ! "$PY" -c "import mooncake.engine, pytest, pybind11" 2>/dev/null; then
  "$PY" -m pip install mooncake-transfer-engine-non-cuda numpy pytest pybind11
fi
if ! "$PY" -c "import sglang.srt.disaggregation.mooncake.conn" 2>/dev/null; then
  # sglang's own requirements pull CUDA kernels, flashinfer and more; its disaggregation
  # modules need only these (found by importing them), at the versions sglang pins.
  "$PY" -m pip install --no-deps sglang==0.5.23
  "$PY" -m pip install torch==2.14.1 transformers==5.19.0 apache-tvm-ffi==0.1.11 msgspec \
    requests pyzmq aiohttp prometheus-client orjson psutil pybase64 pillow starlette pydantic \
    tqdm IPython torchvision dill zstandard sentencepiece compressed-tensors gguf
fi
if [[ ! -f $BUILD_DIR/CMakeCache.txt ]]; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  cmake -S . -B "$BUILD_DIR" -DPython_EXECUTABLE="$PY" -DKVFERRY_WITH_CUDA=OFF \
    -DKVFERRY_BUILD_TESTS=OFF -DKVFERRY_BUILD_PYTHON=ON -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD_DIR" -j2 --target kvferry_python

export PYTHONPATH=$PWD/$BUILD_DIR/python
status=0
for impl in mooncake kvferry; do
  echo "== python/tests/test_mooncake.py --mooncake-impl=$impl"
  "$PY" -m pytest -q -p no:cacheprovider -rs python/tests/test_mooncake.py \
    --mooncake-impl=$impl || status=1
done
for engine in kvferry mooncake; do
  echo "== SGLang's Mooncake backend over $engine (log: /tmp/sglang_mooncake_check.$engine.log)"
  "$PY" python/tests/peers/sglang_mooncake_check.py --engine $engine \
    --log /tmp/sglang_mooncake_check.$engine.log || status=1
done
exit $status
