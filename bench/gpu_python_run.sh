#!/usr/bin/env bash
# The Python package on a GPU machine (issue 18): the pytest suite with its GPU tests (torch
# CUDA tensors over NVLink: the native engine, kvferry.mooncake, kvferry.sglang with
# layerwise handed over by torch.cuda.Event), then the Python-side cost over NVLink
# (bench/python_engine.py --device cuda: native submit_write + result, the native blocking
# write with lists and with numpy columns (read and submitted in groups), and
# batch_transfer_sync_write with lists and numpy (through that write) against kvferry bench,
# same blocks, same run, next to torch's GPU 0 -> GPU 1 copy).
#
# Runs from the repository root with .devbuild/ carried: scripts/device_bundle.sh BUILD (the
# kvferry binary and its libraries) and scripts/python_bundle.sh BUILD (the package built for
# the machine's Python, see that script). Logs and JSON go to $OUT (default /tmp/out).
# STEPS picks what runs: pytest, bench (default: both).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$PWD/.devbuild/python${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-pytest bench}
has() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo "=== $* ($(date -u +%T))"; }
{
  date -u; hostname; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"
} 2>&1 | tee "$OUT/python_machine.txt"
if has pytest; then
  step "pytest (GPU tests included)"
  timeout 400 python3 -m pytest -q -p no:cacheprovider -rs .devbuild/python/tests \
    > "$OUT/pytest.log" 2>&1
  echo "exit $?"; tail -15 "$OUT/pytest.log"
fi
if has bench; then
  step "bench/python_engine.py --device cuda"
  timeout 300 python3 bench/python_engine.py --device cuda --binary .devbuild/kvferry \
    --duration 2 --rounds 3 --json "$OUT/python_nvlink.json" > "$OUT/python_nvlink.txt" 2>&1
  echo "exit $?"; cat "$OUT/python_nvlink.txt"
fi
