"""The example transformer served disaggregated (kvferry.examples.pd_generate) against the same
model served colocated: tokens and every decode step's logits bit for bit, for GQA and MLA,
page sizes 1 and 16, chunked and layerwise prefill, prefill TP 2 -> decode TP 1 and 1 -> 2,
over TCP between real processes; and the negative control (decode's pool corrupted after the
transfer must fail the run). GPU variant: prefill on cuda:0, decode on cuda:1."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the example model needs PyTorch (python3-torch)")

import kvferry  # noqa: E402
from kvferry.examples.kv_pool import PageAllocator, pages_for  # noqa: E402
from kvferry.examples.model import Model, ModelConfig  # noqa: E402
from kvferry.examples.pd_workers import corrupt_pool, run_decode, run_prefill  # noqa: E402

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvferry.__file__)))
# Short runs: 8 prompts of up to 96 tokens (lengths from the conversation trace), 6 decode steps.
SHORT = ["--prompts", "8", "--max-prompt-tokens", "96", "--steps", "6"]


def generate(tmp_path, *flags, timeout=240):
    """Runs pd_generate; returns (exit code, its JSON, its output)."""
    out = tmp_path / "out.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry.examples.pd_generate", *SHORT, *flags, "--json",
         str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    text = proc.stdout.decode(errors="replace")
    result = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, result, text


def prompt_and_decode(model, page_size, chunk_tokens, shuffled, corrupt=None):
    prompt = torch.randint(0, model.config.vocab_size, (70,),
                           generator=torch.Generator().manual_seed(5))
    pool = model.new_pool(32, page_size) if page_size > 1 else model.new_pool(256, 1)
    allocator = PageAllocator(pool.num_pages, shuffled=shuffled, seed=3)
    pages = allocator.alloc(pages_for(70, page_size))
    token, _ = run_prefill(model, pool, pages, prompt, chunk_tokens)
    if corrupt:
        assert corrupt_pool(pool, pages, 70, corrupt, model.config.kv_lora_rank)
    tokens, logits, _ = run_decode(model, pool, pages, allocator, token, 70, 5)
    return tokens, logits


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_pages_are_where_attention_reads(kind):
    """In one process: pages in order or scattered, page size 1 or 16 give the same logits bit
    for bit; a corrupted or swapped page on the decode pool does not. (The chunking stays: a
    chunk's row count can change the BLAS kernel's summation order, so the colocated reference
    prefills in the same chunks as PD.)"""
    model = Model(ModelConfig(kind=kind), "cpu")
    base_tokens, base = prompt_and_decode(model, 16, 32, shuffled=False)
    for page_size, chunk, shuffled in ((16, 32, True), (1, 32, True), (1, 32, False)):
        tokens, logits = prompt_and_decode(model, page_size, chunk, shuffled)
        assert tokens == base_tokens
        assert torch.equal(torch.from_numpy(logits), torch.from_numpy(base))
    for corrupt in ("page", "swap"):
        _, logits = prompt_and_decode(model, 16, 32, shuffled=True, corrupt=corrupt)
        assert not torch.equal(torch.from_numpy(logits), torch.from_numpy(base)), corrupt


def check_equal(code, result, text):
    assert code == 0, text
    summary = result["summary"]
    assert summary["all_equal"] and summary["prompts_run"] == 8, text
    for r in result["results"]:
        assert r["logits_bit_equal"] and r["max_abs_diff"] == 0.0, r
        assert len(r["tokens"]) == 7
    # Decode's pages were scattered, not the prefill order (the transfer placed them).
    assert any(r["decode_pages"] != sorted(r["decode_pages"]) for r in result["results"])


CASES = {
    "gqa-p16-chunked-tp2to1": ["--model", "gqa", "--page-size", "16", "--chunk-tokens", "32",
                               "--prefill-tp", "2"],
    "gqa-p1-layerwise-tp1to2": ["--model", "gqa", "--page-size", "1", "--chunk-tokens", "16",
                                "--layerwise", "--decode-tp", "2"],
    # Chunks of 12 tokens in pages of 16: some chunks complete no page, most leave a partial
    # one to the next chunk.
    "gqa-p16-layerwise-tp2to1-partial-pages": ["--model", "gqa", "--page-size", "16",
                                               "--chunk-tokens", "12", "--layerwise",
                                               "--prefill-tp", "2"],
    # bfloat16 KV (2-byte pages; the ranks' all-gather carries bytes, gloo has no bfloat16).
    "mla-p1-chunked-tp2to1-bf16": ["--model", "mla", "--page-size", "1", "--chunk-tokens", "32",
                                   "--prefill-tp", "2", "--dtype", "bfloat16"],
    "mla-p16-layerwise-tp1to2": ["--model", "mla", "--page-size", "16", "--chunk-tokens", "16",
                                 "--layerwise", "--decode-tp", "2"],
}


# The transfer API; a tree without the file skips the PD runs, one whose module fails to import
# fails them.
needs_sglang = pytest.mark.skipif(
    not os.path.isfile(os.path.join(os.path.dirname(kvferry.__file__), "sglang.py")),
    reason="kvferry.sglang is not in this tree")


@needs_sglang
@pytest.mark.parametrize("flags", list(CASES.values()), ids=list(CASES))
def test_disaggregated_equals_colocated(tmp_path, flags):
    check_equal(*generate(tmp_path, "--device", "cpu", "--transport", "tcp", *flags))


@needs_sglang
def test_negative_control_fails(tmp_path):
    """Two pages of K swapped on decode after the transfer (test_pages_are_where_attention_reads
    covers both corruptions for both kinds in one process)."""
    code, result, text = generate(tmp_path, "--model", "gqa", "--corrupt", "swap",
                                  "--prefill-tp", "2", "--transport", "tcp")
    assert code == 1, text
    results = result["results"]
    assert len(results) == 8 and not result["summary"]["all_equal"]
    for r in results:
        # Every corrupted prompt is caught by its logits; untouched ones still match.
        assert r["equal"] == (not r["corrupted"]), r
        assert r["logits_bit_equal"] == (not r["corrupted"]), r
    # How many prompts have the two prompt pages a swap needs depends on the prompt lengths
    # (the conversation trace when ../shared has it, else synthetic ones): at least one.
    assert sum(r["corrupted"] for r in results) >= 1


def cuda_gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@needs_sglang
@pytest.mark.skipif(cuda_gpus() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("flags", [
    ["--model", "gqa", "--layerwise"],
    ["--model", "mla", "--layerwise"],
    ["--model", "gqa", "--prefill-tp", "2"],
    ["--model", "mla", "--page-size", "1", "--decode-tp", "2", "--layerwise"],
], ids=["gqa-layerwise", "mla-layerwise", "gqa-tp2to1", "mla-p1-tp1to2-layerwise"])
def test_disaggregated_equals_colocated_gpu(tmp_path, flags):
    code, result, text = generate(tmp_path, "--device", "cuda", *flags)
    check_equal(code, result, text)
