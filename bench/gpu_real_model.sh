#!/usr/bin/env bash
# Runs on a GPU machine from the repository root with .devbuild/python carried
# (scripts/python_bundle.sh, built for that machine's Python; torch from that machine): the real
# model's GPU tests, then the example model served disaggregated on two GPUs (prefill GPU 0,
# decode GPU 1, NVLink), chunked against layerwise, GQA and MLA, every decode step's logits
# checked against the colocated run. Logs and JSON under $OUT (docs/perf/real-model.md).
#   bench/gpu_real_model.sh            # $OUT defaults to /tmp/out
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$PWD/.devbuild/python${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TRACE=$PWD/.devbuild/traces/conversation_trace.jsonl
trace=(); [ -f "$TRACE" ] && trace=(--trace "$TRACE")
{
  date -u; hostname; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__)"; git rev-parse HEAD 2>/dev/null
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
echo "=== GPU tests"
python3 -m pytest -q -p no:cacheprovider .devbuild/python/tests/test_real_model.py -k gpu \
  2>&1 | tee "$OUT/pytest_gpu.txt" | tail -5
# A model big enough for its layers to take time: 16 layers, hidden 2048, prompts up to 4096
# tokens in chunks of 1024, bfloat16.
big=(--layers 16 --hidden 2048 --heads 16 --kv-heads 8 --head-dim 128 --intermediate 5504
     --vocab 32000 --kv-lora-rank 512 --rope-dim 64 --max-prompt-tokens 4096
     --chunk-tokens 1024 --steps 32 --prompts 20 --device cuda --threads 4)
rc=0
for model in gqa mla; do
  for mode in chunked layerwise; do
    flags=(); [ "$mode" = layerwise ] && flags=(--layerwise)
    echo "=== $model $mode"
    python3 -m kvferry.examples.pd_generate "${big[@]}" "${trace[@]}" --model "$model" \
      "${flags[@]}" --json "$OUT/$model-$mode.json" > "$OUT/$model-$mode.txt" 2>&1 || rc=1
    tail -1 "$OUT/$model-$mode.txt"
  done
done
exit $rc
