"""A real model served disaggregated, checked against the same model served colocated.

    python3 -m kvferry.examples.pd_generate --prompts 20 --device cpu --json out.json

Runs the example transformer (model.py: GQA or MLA, weights from a seed) on prompts whose
lengths come from the conversation trace (scaled so the longest fits --max-prompt-tokens) and
whose token ids come from the seed, twice:
- colocated: prefill and decode of every prompt in this process, one pool;
- disaggregated: --prefill-tp prefill processes and --decode-tp decode processes
  (pd_workers.py), the KV pages and the aux row moved by kvferry.sglang, decode's pages
  scattered over its pool.
For every prompt it prints whether the tokens and every decode step's logits are equal (bit for
bit unless --tolerance), the time to first token and the decode tokens/s of both runs. Exits 0
when every prompt matched, 1 on any difference, 2 when the run could not finish.
docs/real-model.md describes the flags and what the check proves.
"""

import argparse
import json
import math
import multiprocessing
import os
import random
import socket
import sys
import time
import traceback
from typing import List, Optional

import numpy as np
import torch

from kvferry.examples.kv_pool import DTYPES, PageAllocator, pages_for
from kvferry.examples.model import Model, ModelConfig
from kvferry.examples.pd_workers import (AUX_ROWS, configure_torch, run_decode, run_prefill,
                                         synchronize, worker_main)

TRACE_NAME = "conversation_trace.jsonl"
READY_TIMEOUT_S = 180


def default_trace() -> Optional[str]:
    """The conversation trace next to the repository (../shared/traces/, as kvferry replay's
    --demo looks for it from the working directory), or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.normpath(os.path.join(here, "..", "..", ".."))
    for base in (os.getcwd(), repo):
        path = os.path.normpath(os.path.join(base, "..", "shared", "traces", TRACE_NAME))
        if os.path.isfile(path):
            return path
    return None


def trace_lengths(path: str, count: int) -> List[int]:
    """input_length of the first `count` requests (cycling when the file has fewer)."""
    lengths = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                lengths.append(int(json.loads(line)["input_length"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: no integer input_length ({e})") from None
            if len(lengths) == count:
                break
    if not lengths:
        raise ValueError(f"{path}: no requests")
    return [lengths[i % len(lengths)] for i in range(count)]


def make_prompts(count: int, trace: Optional[str], max_tokens: int, vocab: int,
                 seed: int) -> "tuple[List[torch.Tensor], List[int]]":
    """Prompts (int64 CPU tensors) and the trace lengths they were scaled from: lengths scaled
    by max_tokens / the longest of them (at least 1 token); ids drawn from the seed. Without a
    trace, lengths are drawn from the seed (log-uniform over 1 ... 100,000)."""
    rng = random.Random(seed)
    if trace:
        source = trace_lengths(trace, count)
    else:
        source = [int(math.exp(rng.uniform(0, math.log(100_000)))) for _ in range(count)]
    scale = max_tokens / max(source)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (max(1, round(n * scale)),), generator=gen)
               for n in source]
    return prompts, source


def devices(kind: str, prefill_tp: int, decode_tp: int) -> dict:
    """Each rank's device: all "cpu"; on CUDA every rank its own GPU while they suffice, else
    prefill ranks on the first half of the GPUs and decode ranks on the rest (one GPU: all on
    it). The colocated run uses the first GPU."""
    if kind == "cpu":
        return {"prefill": ["cpu"] * prefill_tp, "decode": ["cpu"] * decode_tp,
                "colocated": "cpu"}
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("--device cuda: no CUDA device visible to torch")
    if count == 1:
        prefill, decode = [0] * prefill_tp, [0] * decode_tp
    elif count >= prefill_tp + decode_tp:
        prefill = list(range(prefill_tp))
        decode = list(range(prefill_tp, prefill_tp + decode_tp))
    else:
        half = count // 2
        prefill = [r % half for r in range(prefill_tp)]
        decode = [half + r % (count - half) for r in range(decode_tp)]
    return {"prefill": [f"cuda:{g}" for g in prefill], "decode": [f"cuda:{g}" for g in decode],
            "colocated": "cuda:0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_colocated(config: ModelConfig, device: str, prompts: List[torch.Tensor],
                  args: argparse.Namespace) -> List[dict]:
    """Prefill and decode of every prompt in this process, on one pool (pages in order)."""
    device = torch.device(device)
    model = Model(config, device)
    longest = max(p.shape[0] for p in prompts) + args.steps
    num_pages = pages_for(longest, args.page_size) + 1
    pool = model.new_pool(num_pages, args.page_size)
    allocator = PageAllocator(num_pages, shuffled=False)
    layer_hook = (lambda start, end: (lambda layer: None)) if args.layerwise else None
    results = []
    for prompt in prompts:
        began = time.monotonic()
        pages = allocator.alloc(pages_for(prompt.shape[0], args.page_size))
        token, _ = run_prefill(model, pool, pages, prompt.to(device), args.chunk_tokens,
                               layer_hook=layer_hook)
        synchronize(device)
        ttft = time.monotonic() - began
        tokens, logits, seconds = run_decode(model, pool, pages, allocator, token,
                                             prompt.shape[0], args.steps)
        allocator.release(pages)
        results.append({"tokens": tokens, "logits": logits, "ttft_s": ttft, "decode_s": seconds})
    return results


class Disaggregated:
    """The prefill and decode rank processes and the bootstrap server of one PD run."""

    def __init__(self, config: ModelConfig, args: argparse.Namespace, placement: dict,
                 longest: int) -> None:
        from kvferry.sglang import KVBootstrapServer

        self.args = args
        self.server = KVBootstrapServer("127.0.0.1", 0)
        prefill_pages = pages_for(longest, args.page_size) + 1
        # Room to scatter: decode's free list is shuffled over twice what a request needs.
        decode_pages = 2 * pages_for(longest + args.steps, args.page_size) + 1
        self.opts = {
            "config": vars(config), "devices": placement, "page_size": args.page_size,
            "chunk_tokens": args.chunk_tokens, "layerwise": args.layerwise,
            "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
            "num_pages": {"prefill": prefill_pages, "decode": decode_pages},
            "bootstrap": self.server.address, "transport": args.transport,
            "timeout_s": args.timeout, "threads": args.threads, "seed": args.seed,
            "corrupt": args.corrupt,
            "ports": {"prefill": free_port(), "decode": free_port()},
        }
        ctx = multiprocessing.get_context("spawn")
        self.outbox = ctx.Queue()
        self.ranks = [("prefill", r) for r in range(args.prefill_tp)] + \
                     [("decode", r) for r in range(args.decode_tp)]
        self.inboxes = {key: ctx.Queue() for key in self.ranks}
        self.procs = {}
        for role, rank in self.ranks:
            proc = ctx.Process(target=worker_main, name=f"kvferry-{role}-{rank}",
                               args=(role, rank, self.opts, self.inboxes[(role, rank)],
                                     self.outbox), daemon=True)
            proc.start()
            self.procs[(role, rank)] = proc
        self._collect("ready", len(self.ranks), READY_TIMEOUT_S)

    def _collect(self, kind: str, count: int, timeout_s: float) -> List[tuple]:
        """`count` messages of `kind` from the ranks; raises RuntimeError naming the rank on
        an error message, a rank that exited, or the timeout."""
        got = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            try:
                message = self.outbox.get(timeout=0.5)
            except Exception:  # queue.Empty
                for (role, rank), proc in self.procs.items():
                    if not proc.is_alive():
                        raise RuntimeError(f"the {role} rank {rank} process exited "
                                           f"(exit code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out after {timeout_s} s waiting for {kind}")
                continue
            if message[0] == "error":
                lines = [line for line in message[3].splitlines() if line.strip()]
                raise RuntimeError(f"the {message[1]} rank {message[2]} failed: "
                                   f"{lines[-1] if lines else '?'}\n{message[3]}")
            if message[0] != kind:
                raise RuntimeError(f"unexpected message {message[0]!r} while waiting for {kind}")
            got.append(message)
        return got

    def run(self, index: int, prompt: torch.Tensor, room: int) -> dict:
        arrival = time.monotonic()
        for role, rank in self.ranks:
            request = {"index": index, "room": room, "steps": self.args.steps}
            if role == "prefill":
                request["prompt"] = prompt.tolist()
                request["prefill_aux_row"] = index % AUX_ROWS
            else:
                request["prompt_len"] = int(prompt.shape[0])
                request["decode_aux_row"] = (3 * index + 5) % AUX_ROWS
            self.inboxes[(role, rank)].put(("request", request))
        done = self._collect("done", len(self.ranks), 4 * self.args.timeout + 60)
        out = {"arrival": arrival, "prefill": {}, "decode": {}}
        for _, role, rank, result in done:
            out[role][rank] = result
        return out

    def close(self) -> None:
        for key, inbox in self.inboxes.items():
            if self.procs[key].is_alive():
                inbox.put(("stop",))
        for proc in self.procs.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.server.close()


def compare(ref: dict, pd: dict, room: int, tolerance: float) -> dict:
    """The verdict of one prompt: tokens, logits (every decode step, every rank), first token
    on every prefill rank, the room in decode's aux row."""
    problems = []
    decode0 = pd["decode"][0]
    max_diff = 0.0
    for rank, result in sorted(pd["decode"].items()):
        if result["tokens"] != ref["tokens"]:
            problems.append(f"decode rank {rank}: tokens differ")
        if result["logits"].shape != ref["logits"].shape:
            problems.append(f"decode rank {rank}: logits shape {result['logits'].shape}")
            continue
        diff = np.abs(result["logits"].astype(np.float64) - ref["logits"])
        diff = float(np.nan_to_num(diff, nan=np.inf).max()) if diff.size else 0.0
        max_diff = max(max_diff, diff)
        exact = np.array_equal(result["logits"], ref["logits"])
        if not exact and not diff <= tolerance:
            problems.append(f"decode rank {rank}: logits differ (max |diff| {diff:.3g})")
        if result["aux_room"] != room:
            problems.append(f"decode rank {rank}: aux row holds room {result['aux_room']}")
    for rank, result in sorted(pd["prefill"].items()):
        if result["first_token"] != ref["tokens"][0]:
            problems.append(f"prefill rank {rank}: first token {result['first_token']}")
    ready_at = max(r["ready_at"] for r in pd["decode"].values())
    return {
        "equal": not problems,
        "problems": problems,
        "logits_bit_equal": all(np.array_equal(r["logits"], ref["logits"])
                                for r in pd["decode"].values()),
        "max_abs_diff": max_diff,
        "corrupted": any(r["corrupted"] for r in pd["decode"].values()),
        "ttft_ms": (ready_at - pd["arrival"]) * 1e3,
        "tail_ms": (ready_at - max(r["first_token_at"] for r in pd["prefill"].values())) * 1e3,
        "prefill_compute_ms": (pd["prefill"][0]["first_token_at"] - pd["prefill"][0]["began"]) * 1e3,
        "decode_tokens_per_s": len(decode0["logits"]) / decode0["decode_s"]
        if decode0["decode_s"] > 0 else 0.0,
    }


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m kvferry.examples.pd_generate",
        description="Serve the example transformer disaggregated through kvferry.sglang and "
                    "check every decode step's logits against a colocated run.")
    p.add_argument("--prompts", type=int, default=20, help="prompts to run (default 20)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (TCP) or cuda (prefill and decode ranks on their own GPUs)")
    p.add_argument("--json", metavar="FILE", help="write the per-prompt results and summary")
    p.add_argument("--model", choices=("gqa", "mla"), default="gqa",
                   help="gqa: Llama-style; mla: DeepSeek-style latent cache (default gqa)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--chunk-tokens", type=int, default=64,
                   help="tokens per prefill chunk (default 64)")
    p.add_argument("--layerwise", action="store_true",
                   help="send each layer's pages as soon as the layer is computed")
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill attention TP (1, 2, ...)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode attention TP (1, 2, ...)")
    p.add_argument("--steps", type=int, default=16,
                   help="tokens decode generates after the first (default 16)")
    p.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="the longest prompt's length after scaling (default 256)")
    p.add_argument("--trace", help="Mooncake-format JSONL trace for the prompt lengths "
                                   "(default: ../shared/traces/conversation_trace.jsonl when "
                                   "present, else lengths drawn from the seed)")
    p.add_argument("--seed", type=int, default=1, help="prompt ids, rooms and page scattering")
    p.add_argument("--model-seed", type=int, default=1234, help="weights (default 1234)")
    p.add_argument("--corrupt", choices=("none", "page", "swap"), default="none",
                   help="negative control: corrupt decode's pool after each transfer")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="weights, activations and KV (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="largest |logit difference| accepted (default 0: bit for bit)")
    p.add_argument("--transport", choices=("auto", "tcp", "nvlink"), default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="kvferry's bootstrap, transfer and decode waiting timeouts in seconds; "
                        "decode's wait includes prefill's compute (default 60)")
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 8), ("kv-heads", 4),
                          ("head-dim", 32), ("intermediate", 512), ("vocab", 512),
                          ("kv-lora-rank", 64), ("rope-dim", 16)):
        p.add_argument(f"--{name}", type=int, default=default,
                       help=f"model shape (default {default})")
    args = p.parse_args(argv)
    for name in ("prompts", "page_size", "chunk_tokens", "prefill_tp", "decode_tp",
                 "max_prompt_tokens", "threads", "layers", "hidden", "heads", "kv_heads",
                 "head_dim", "intermediate", "vocab", "kv_lora_rank", "rope_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.steps < 0:
        p.error("--steps must be >= 0")
    if not args.timeout > 0:
        p.error("--timeout must be > 0")
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.device == "cpu":
        try:
            one = torch.ones((2, 2), dtype=DTYPES[args.dtype])
            one @ one
        except RuntimeError as e:
            p.error(f"--dtype {args.dtype}: this torch cannot multiply it on the CPU ({e})")
    if args.trace is None:
        args.trace = default_trace()
    elif not os.path.isfile(args.trace):
        p.error(f"--trace {args.trace}: no such file")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(kind=args.model, vocab_size=args.vocab, hidden_size=args.hidden,
                       num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                       head_dim=args.head_dim, intermediate_size=args.intermediate,
                       kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim,
                       max_positions=args.max_prompt_tokens + args.steps + 1,
                       dtype=args.dtype, seed=args.model_seed)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    configure_torch(args.threads)
    config = model_config(args)
    try:
        config.validate()
        config.kv_heads_per_rank(max(args.prefill_tp, args.decode_tp))
        prompts, source = make_prompts(args.prompts, args.trace, args.max_prompt_tokens,
                                       config.vocab_size, args.seed)
        placement = devices(args.device, args.prefill_tp, args.decode_tp)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"pd_generate: {e}", file=sys.stderr)
        return 2
    print(f"model {config.kind}, {config.num_layers} layers, {config.dtype}; page_size "
          f"{args.page_size}, chunks of {args.chunk_tokens}, "
          f"{'layerwise' if args.layerwise else 'chunked'}; prefill TP {args.prefill_tp} -> "
          f"decode TP {args.decode_tp}; {args.device}; prompts from "
          f"{args.trace or 'seeded lengths'}; corrupt {args.corrupt}", flush=True)

    rng = random.Random(args.seed)
    rooms = rng.sample(range(1, 1 << 62), len(prompts))
    verdicts: List[dict] = []
    error = None
    pd = None
    try:
        reference = run_colocated(config, placement["colocated"], prompts, args)
        pd = Disaggregated(config, args, placement, max(p.shape[0] for p in prompts))
        for index, prompt in enumerate(prompts):
            result = pd.run(index, prompt, rooms[index])
            verdict = compare(reference[index], result, rooms[index], args.tolerance)
            verdict.update(prompt=index, prompt_tokens=int(prompt.shape[0]),
                           trace_input_length=source[index], room=rooms[index],
                           pages=pages_for(int(prompt.shape[0]), args.page_size),
                           decode_pages=result["decode"][0]["pages"],
                           colocated_ttft_ms=reference[index]["ttft_s"] * 1e3,
                           colocated_decode_tokens_per_s=(
                               args.steps / reference[index]["decode_s"]
                               if reference[index]["decode_s"] > 0 else 0.0),
                           tokens=reference[index]["tokens"])
            verdicts.append(verdict)
            print_row(verdict)
    except Exception as e:  # a rank, a room or kvferry failed: reported, exit status 2
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        if pd is not None:
            pd.close()
    return report(args, config, verdicts, error)


def print_row(v: dict) -> None:
    if v["prompt"] == 0:
        print(f"{'prompt':>6} {'tokens':>6} {'pages':>5} {'PD == colocated':<16} "
              f"{'max|diff|':>9} {'TTFT ms (col/PD)':>17} {'decode tok/s (col/PD)':>22}")
    same = "yes" if v["equal"] else "NO"
    if v["corrupted"]:
        same += " (corrupted)"
    print(f"{v['prompt']:>6} {v['prompt_tokens']:>6} {v['pages']:>5} {same:<16} "
          f"{v['max_abs_diff']:>9.3g} {v['colocated_ttft_ms']:>8.1f}/{v['ttft_ms']:<8.1f} "
          f"{v['colocated_decode_tokens_per_s']:>10.1f}/{v['decode_tokens_per_s']:<10.1f}",
          flush=True)
    for problem in v["problems"]:
        print(f"       {problem}")


def median(values: List[float]) -> float:
    return float(np.median(values)) if values else 0.0


def report(args: argparse.Namespace, config: ModelConfig, verdicts: List[dict],
           error: Optional[str]) -> int:
    mismatched = [v["prompt"] for v in verdicts if not v["equal"]]
    summary = {
        "prompts": args.prompts,
        "prompts_run": len(verdicts),
        "prompts_equal": len(verdicts) - len(mismatched),
        "mismatched_prompts": mismatched,
        "all_equal": error is None and not mismatched and len(verdicts) == args.prompts,
        "error": error,
        "colocated_ttft_ms_p50": median([v["colocated_ttft_ms"] for v in verdicts]),
        "pd_ttft_ms_p50": median([v["ttft_ms"] for v in verdicts]),
        "pd_tail_ms_p50": median([v["tail_ms"] for v in verdicts]),
        "colocated_decode_tokens_per_s_p50": median(
            [v["colocated_decode_tokens_per_s"] for v in verdicts]),
        "pd_decode_tokens_per_s_p50": median([v["decode_tokens_per_s"] for v in verdicts]),
    }
    print(f"{summary['prompts_equal']}/{args.prompts} prompts equal to colocated; TTFT p50 "
          f"{summary['colocated_ttft_ms_p50']:.1f} ms colocated, {summary['pd_ttft_ms_p50']:.1f}"
          f" ms PD (last piece sent to decode ready: {summary['pd_tail_ms_p50']:.1f} ms); "
          f"decode {summary['colocated_decode_tokens_per_s_p50']:.1f} / "
          f"{summary['pd_decode_tokens_per_s_p50']:.1f} tokens/s", flush=True)
    if error:
        print(f"pd_generate: the run did not finish: {error.splitlines()[0]}", file=sys.stderr)
    if args.json:
        options = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({"options": options, "model": vars(config), "summary": summary,
                       "results": verdicts}, f, indent=1)
    if error:
        return 2
    return 0 if summary["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
