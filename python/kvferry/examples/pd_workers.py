"""The processes of a disaggregated run of the example model (pd_generate drives them).

- `run_prefill` / `run_decode`: what a colocated server and the PD processes both execute for
  one request, so the arithmetic is the same call for call: prefill in chunks of
  `chunk_tokens` (each chunk one forward pass over the pool), the first token sampled greedily,
  then `steps` decode steps of one token each, greedily.
- `worker_main`: the entry point of a prefill or decode rank process. It builds the model
  (weights from the seed), its share of the pool and aux buffers, a `kvferry.sglang.KVManager`,
  then serves requests from its inbox until told to stop:
  - prefill: waits for decode's destination (KVSender.poll), runs the prompt chunk by chunk and
    hands each chunk's completed pages to KVSender.send as soon as the chunk is computed, or,
    layerwise, registers the chunk with `begin_layerwise` and marks each layer ready as soon as
    it is computed (on CUDA through a torch.cuda.Event recorded after the layer); the first
    token goes into the aux row before the last piece leaves; waits for Success.
  - decode: allocates the request's pages from a shuffled free list, receives through
    KVReceiver, reads the first token from the aux row, optionally corrupts its pool (the
    negative control), then generates from its own pool.
  Attention TP ranks of one side form a torch.distributed gloo group whose all_gather
  concatenates the ranks' per-head attention outputs (model.py explains why this keeps the
  arithmetic of a single rank).

Messages (multiprocessing queues, plain Python and numpy values): the inbox takes
("request", dict) and ("stop",); the outbox gets ("ready", role, rank), ("done", role, rank,
dict) and ("error", role, rank, text).
"""

import datetime
import time
import traceback
from typing import Callable, List, Optional

import numpy as np
import torch

from kvferry.examples.kv_pool import AuxBuffers, KVPool, PageAllocator, dtype_name, pages_for
from kvferry.examples.model import Model, ModelConfig, greedy, pages_ready, prefill_chunks

AUX_ROWS = 8


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_prefill(model: Model, pool: KVPool, pages: List[int], prompt: torch.Tensor,
                chunk_tokens: int,
                on_chunk: Optional[Callable[[int, int, Optional[tuple]], None]] = None,
                layer_hook: Optional[Callable[[int, int], Callable[[int], None]]] = None
                ) -> "tuple[int, float]":
    """Prefills `prompt` (int64 [L] on the model's device) in chunks of chunk_tokens.

    on_chunk(start, end, sampled) runs after each chunk (sampled: (first token, its
    log-probability) on the last chunk, else None); layer_hook(start, end) returns the on_layer_done callback of that chunk's
    forward pass. Returns the greedy first token and its log-probability.
    """
    length = prompt.shape[0]
    logits = None
    first = None
    for start, end in prefill_chunks(length, chunk_tokens):
        hook = layer_hook(start, end) if layer_hook is not None else None
        logits = model.forward(prompt[start:end], start, pool, pages, on_layer_done=hook)
        if end == length:
            first = greedy(logits)
        if on_chunk is not None:
            on_chunk(start, end, first)
    return first


def run_decode(model: Model, pool: KVPool, pages: List[int], allocator: PageAllocator,
               first_token: int, prompt_len: int, steps: int) -> "tuple[list, np.ndarray, float]":
    """Generates `steps` tokens after first_token greedily, extending `pages` from allocator
    as the sequence grows. Returns (tokens incl. first_token, float32 logits [steps, vocab],
    seconds spent)."""
    tokens = [first_token]
    logits_rows = []
    began = time.perf_counter()
    for step in range(steps):
        position = prompt_len + step
        need = pages_for(position + 1, pool.page_size)
        if need > len(pages):
            pages.extend(allocator.alloc(need - len(pages)))
        ids = torch.tensor([tokens[-1]], dtype=torch.int64, device=model.device)
        logits = model.forward(ids, position, pool, pages)
        tokens.append(greedy(logits)[0])
        logits_rows.append(logits.cpu().numpy())
    seconds = time.perf_counter() - began
    return tokens, np.stack(logits_rows) if logits_rows else np.zeros((0, 0), np.float32), seconds


def corrupt_pool(pool: KVPool, pages: List[int], prompt_len: int, mode: str,
                 kv_lora_rank: int) -> bool:
    """The negative control, on layer 0 of decode's pool after the transfer.

    "page": overwrites the middle prompt page of the first buffer (K, or the MLA latent) with
    0.25. "swap": exchanges the first two prompt pages of layer 0's K (GQA) or of the
    compressed part of layer 0's latent (MLA). Swapping whole pages in every buffer of a layer
    alike would not change decode's logits: attention over a set of (K, V) pairs whose
    positions RoPE baked into K does not depend on their order. Returns whether anything
    changed (swap needs two prompt pages).
    """
    prompt_pages = pages[:pages_for(prompt_len, pool.page_size)]
    buffer = pool.buffers()[0]
    if mode == "page":
        pool.page_view(buffer, prompt_pages[len(prompt_pages) // 2]).fill_(0.25)
        return True
    if mode == "swap":
        if len(prompt_pages) < 2:
            return False
        a = pool.page_view(buffer, prompt_pages[0])
        b = pool.page_view(buffer, prompt_pages[1])
        if pool.is_mla:
            a, b = a[..., :kv_lora_rank], b[..., :kv_lora_rank]
        saved = a.clone()
        a.copy_(b)
        b.copy_(saved)
        return True
    raise ValueError(f"unknown corruption {mode!r} (page, swap)")


def _all_gather_fn(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch.distributed as dist

    world = dist.get_world_size()

    def all_gather(local: torch.Tensor) -> torch.Tensor:
        host = local.contiguous().cpu()
        wire = host.view(torch.uint8)  # gloo lacks bfloat16 (and int16): bytes, unchanged
        parts = [torch.empty_like(wire) for _ in range(world)]
        dist.all_gather(parts, wire)
        return torch.cat([part.view(host.dtype) for part in parts], dim=1).to(device)

    return all_gather


def _kv_args(model: Model, pool: KVPool, aux: AuxBuffers, tp_rank: int, tp_size: int):
    from kvferry.sglang import KVArgs

    c = model.config
    args = KVArgs()
    for key, value in {**pool.kv_args_fields(), **aux.kv_args_fields()}.items():
        setattr(args, key, value)
    args.engine_rank = tp_rank
    args.tp_rank = tp_rank
    args.tp_size = tp_size
    args.page_size = pool.page_size
    args.kv_head_num = pool.kv_heads
    args.total_kv_head_num = c.total_kv_heads
    args.head_dim = c.cache_dim
    args.kv_dtype = dtype_name(pool.dtype)
    args.is_mla = c.is_mla
    args.kv_lora_rank = c.kv_lora_rank if c.is_mla else 0
    args.qk_rope_head_dim = c.qk_rope_head_dim if c.is_mla else 0
    args.gpu_id = pool.device.index if pool.device.type == "cuda" else None
    return args


def _wait_room(room_obj, what: str, timeout_s: float, done: int) -> None:
    """Polls a KVSender/KVReceiver until its state reaches `done` (or beyond); raises
    KVTransferError on failure, TimeoutError when kvferry's own timeouts (timeout_s) have not
    ended the room 30 s after they should have."""
    from kvferry.sglang import KVPoll

    deadline = time.monotonic() + timeout_s + 30
    while True:
        state = room_obj.poll()
        if state == KVPoll.Failed:
            room_obj.failure_exception()
        if state >= done:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: room {room_obj.bootstrap_room} still in state {state} "
                               f"after {timeout_s} s")
        time.sleep(0.0002)


class _Worker:
    def __init__(self, role: str, rank: int, opts: dict) -> None:
        from kvferry.sglang import DisaggregationMode, KVManager

        self.role = role
        self.rank = rank
        self.opts = opts
        self.device = torch.device(opts["devices"][role][rank])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        tp_size = opts[f"{role}_tp"]
        all_gather = None
        if tp_size > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{opts['ports'][role]}",
                                    rank=rank, world_size=tp_size,
                                    timeout=datetime.timedelta(seconds=opts["timeout_s"]))
            all_gather = _all_gather_fn(self.device)
        self.config = ModelConfig(**opts["config"])
        self.model = Model(self.config, self.device, rank, tp_size, all_gather)
        self.pool = self.model.new_pool(opts["num_pages"][role], opts["page_size"])
        self.allocator = PageAllocator(self.pool.num_pages, shuffled=(role == "decode"),
                                       seed=opts["seed"] + 7919 * (rank + 1))
        self.aux = AuxBuffers(AUX_ROWS)
        args = _kv_args(self.model, self.pool, self.aux, rank, tp_size)
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        timeout_s = opts["timeout_s"]
        kwargs = {"transport": opts["transport"], "bootstrap_timeout": timeout_s}
        if role == "prefill":
            kwargs.update(bootstrap_address=opts["bootstrap"], transfer_timeout=timeout_s)
        else:
            # From WaitingForInput to Success: prefill's compute of the prompt, then the transfer.
            kwargs["waiting_timeout"] = timeout_s
        self.mgr = KVManager(args, mode, is_mla_backend=self.config.is_mla, **kwargs)

    def close(self) -> None:
        self.mgr.close()
        if self.opts[f"{self.role}_tp"] > 1:
            import torch.distributed as dist

            dist.destroy_process_group()

    def prefill(self, req: dict) -> dict:
        from kvferry.sglang import KVPoll, KVSender

        opts = self.opts
        length = len(req["prompt"])
        prompt = torch.tensor(req["prompt"], dtype=torch.int64, device=self.device)
        page_size = self.pool.page_size
        sender = KVSender(self.mgr, opts["bootstrap"], req["room"])
        # As SGLang's prefill scheduler: the request computes once decode's destination is in.
        _wait_room(sender, "prefill bootstrap", opts["timeout_s"], KVPoll.WaitingForInput)
        pages = self.allocator.alloc(pages_for(length, page_size))
        row = req["prefill_aux_row"]
        sender.init(len(pages), aux_index=row)
        began = time.monotonic()
        sent = [0]
        events = []  # CUDA events stay alive until the room is final
        cuda = self.device.type == "cuda"
        num_layers = self.config.num_layers
        first = {}

        def event():
            if not cuda:
                return None
            e = torch.cuda.Event()
            e.record()
            events.append(e)
            return e

        def chunk_pages(end: int) -> np.ndarray:
            lo, hi = pages_ready(end, length, page_size, sent[0])
            sent[0] = hi
            return np.asarray(pages[lo:hi], dtype=np.int32)

        def write_aux(token: int, logprob: float) -> None:
            self.aux.write_first_token(row, token, logprob)
            first["token"] = token
            first["at"] = time.monotonic()

        if opts["layerwise"]:
            passes = {}

            def layer_hook(start: int, end: int) -> Callable[[int], None]:
                passes[start] = self.mgr.begin_layerwise([(sender, chunk_pages(end))])
                last_chunk = end == length

                def on_layer_done(layer: int) -> None:
                    # The last chunk's last layer leaves with the aux row, once the token is in.
                    if not (last_chunk and layer == num_layers - 1):
                        passes[start].layer_ready(layer, event())

                return on_layer_done

            def on_chunk(start: int, end: int, sampled: Optional[tuple]) -> None:
                if sampled is not None:
                    write_aux(*sampled)
                    passes[start].layer_ready(num_layers - 1, event())
        else:
            layer_hook = None

            def on_chunk(start: int, end: int, sampled: Optional[tuple]) -> None:
                if sampled is not None:
                    write_aux(*sampled)
                chunk = chunk_pages(end)
                if len(chunk):
                    synchronize(self.device)  # send() takes no event: the chunk's KV is written
                    sender.send(chunk)

        result = run_prefill(self.model, self.pool, pages, prompt, opts["chunk_tokens"],
                             on_chunk=on_chunk, layer_hook=layer_hook)
        _wait_room(sender, "prefill transfer", opts["timeout_s"], KVPoll.Success)
        sender.clear()
        self.allocator.release(pages)
        events.clear()
        return {"index": req["index"], "first_token": result[0], "began": began,
                "first_token_at": first.get("at", 0.0), "pages": len(pages)}

    def decode(self, req: dict) -> dict:
        from kvferry.sglang import KVPoll, KVReceiver

        opts = self.opts
        length = req["prompt_len"]
        row = req["decode_aux_row"]
        pages = self.allocator.alloc(pages_for(length, self.pool.page_size))
        self.aux.clear(row)
        receiver = KVReceiver(self.mgr, opts["bootstrap"], req["room"])
        receiver.init(np.asarray(pages, dtype=np.int32), aux_index=row)
        _wait_room(receiver, "decode transfer", opts["timeout_s"], KVPoll.Success)
        ready_at = time.monotonic()
        first_token = int(self.aux.output_ids[row, 0])
        aux_room = int(self.aux.bootstrap_room[row, 0])
        receiver.clear()
        corrupted = False
        if opts["corrupt"] != "none" and self.rank == 0:
            corrupted = corrupt_pool(self.pool, pages, length, opts["corrupt"],
                                     self.config.kv_lora_rank)
        tokens, logits, seconds = run_decode(self.model, self.pool, pages, self.allocator,
                                             first_token, length, req["steps"])
        self.allocator.release(pages)
        return {"index": req["index"], "ready_at": ready_at, "aux_room": aux_room,
                "tokens": tokens, "logits": logits, "decode_s": seconds,
                "corrupted": corrupted, "pages": pages[:pages_for(length, self.pool.page_size)]}


def configure_torch(threads: int) -> None:
    """The same numerics in every process: a fixed CPU thread count, no TF32."""
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def worker_main(role: str, rank: int, opts: dict, inbox, outbox) -> None:
    """A prefill or decode rank process (see the module docstring)."""
    worker = None
    try:
        configure_torch(opts["threads"])
        worker = _Worker(role, rank, opts)
        outbox.put(("ready", role, rank))
        while True:
            message = inbox.get()
            if message[0] == "stop":
                break
            request = message[1]
            result = worker.prefill(request) if role == "prefill" else worker.decode(request)
            outbox.put(("done", role, rank, result))
    except BaseException:  # reported to the driver, which stops the run
        outbox.put(("error", role, rank, traceback.format_exc()))
    finally:
        if worker is not None:
            try:
                worker.close()
            except Exception:
                pass
