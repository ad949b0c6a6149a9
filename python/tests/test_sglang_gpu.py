"""kvferry.sglang over torch CUDA tensors (GPU machine; skipped without torch or a GPU):
prefill ranks on GPU 0 in their own processes, decode on GPU 1 (GPU 0 when there is one),
KV moved over NVLink, aux fields in host memory as SGLang keeps them; layerwise handed over by
torch.cuda.Event. Every KV byte and aux field checked on decode."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from test_sglang import GQA, MLA, check_landed, close_all, rooms_of, run_pair  # noqa: E402
from kvferry.sglang import KVBootstrapServer  # noqa: E402

DECODE_GPU = 1 if torch.cuda.device_count() > 1 else 0
pytestmark = pytest.mark.gpu


@pytest.fixture
def server():
    s = KVBootstrapServer("127.0.0.1", 0)
    yield s
    s.close()


def gpu_pair(server, geometry, prefill_tp, decode_tp, rooms, **kw):
    torch.cuda.set_device(DECODE_GPU)
    return run_pair(server, geometry, prefill_tp, decode_tp, rooms, prefill_device=0,
                    decode_device=DECODE_GPU, **kw)


@pytest.mark.parametrize("geometry", [GQA, MLA], ids=["gqa", "mla"])
def test_cuda_tensors_over_nvlink(server, geometry):
    rooms = rooms_of(6, base=5000)
    decode, receivers, final, results = gpu_pair(server, geometry, 1, 1, rooms)
    try:
        check_landed(decode, receivers, final, rooms)
    finally:
        close_all(decode)


def test_layerwise_by_cuda_event(server):
    rooms = rooms_of(3, base=6000, chunk=7)
    decode, receivers, final, results = gpu_pair(server, GQA, 1, 1, rooms, layerwise=True)
    try:
        check_landed(decode, receivers, final, rooms)
    finally:
        close_all(decode)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_unequal_tp_on_gpus(server, prefill_tp, decode_tp):
    rooms = rooms_of(4, base=7000)
    decode, receivers, final, results = gpu_pair(server, GQA, prefill_tp, decode_tp, rooms)
    try:
        check_landed(decode, receivers, final, rooms)
    finally:
        close_all(decode)
