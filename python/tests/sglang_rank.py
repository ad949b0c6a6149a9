"""One rank of an SGLang-shaped server for the kvferry.sglang tests: per-layer K and V buffers
(numpy, one per layer buffer, as SGLang's MHATokenToKVPool keeps them; one latent per layer
for MLA), aux fields as SGLang's MetadataBuffers (output_ids, cached_tokens, bootstrap_room),
and the expected contents of every token of every KV head, so a decode rank checks each byte.

Run as a prefill process:
    sglang_rank.py prefill '<json spec>'
It prints {"address": engine address} once its manager is up, sends every room of the spec,
then prints one JSON line of results: {room: [KVPoll value, failure text]}.
"""

import json
import sys
import time

import numpy as np

from kvferry.sglang import DisaggregationMode, KVArgs, KVManager, KVPoll, KVSender

OUTPUT_IDS_WIDTH = 16  # int32 per row, as SGLang's output_ids (rows, 16)


class Rank:
    """Buffers of one rank: `heads` of `total_heads` KV heads (0 for MLA), `num_pages` pages."""

    def __init__(self, spec: dict, tp_rank: int, tp_size: int, num_pages: int, rows: int = 64,
                 device=None):
        self.spec = spec
        self.device = device  # None: numpy host buffers; an ordinal: torch CUDA tensors
        self.mla = spec.get("mla", False)
        self.layers = spec["layers"]
        self.page_size = spec["page_size"]
        self.head_dim = spec["head_dim"]
        self.total_heads = 1 if self.mla else spec["heads"]
        self.heads = 1 if self.mla else self.total_heads // tp_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.first_head = 0 if self.mla else tp_rank * self.heads
        self.num_pages = num_pages
        slots = num_pages * self.page_size
        count = self.layers if self.mla else 2 * self.layers
        shape = (slots, self.heads, self.head_dim)
        if device is None:
            self.kv = [np.zeros(shape, np.uint16) for _ in range(count)]
        else:
            import torch

            self.kv = [torch.zeros(shape, dtype=torch.float16, device=f"cuda:{device}")
                       for _ in range(count)]
        self.output_ids = np.zeros((rows, OUTPUT_IDS_WIDTH), np.int32)
        self.cached_tokens = np.zeros((rows, 4), np.int32)
        self.bootstrap_room = np.zeros((rows, 8), np.int64)
        self.aux = [self.output_ids, self.cached_tokens, self.bootstrap_room]

    def args(self) -> KVArgs:
        a = KVArgs()
        a.engine_rank = self.tp_rank
        a.tp_size = self.tp_size
        if self.device is None:
            a.kv_data_ptrs = [b.ctypes.data for b in self.kv]
        else:
            a.kv_data_ptrs = [b.data_ptr() for b in self.kv]
        item = self.heads * self.head_dim * 2
        a.kv_data_lens = [item * b.shape[0] for b in self.kv]
        a.kv_item_lens = [item * self.page_size for _ in self.kv]
        a.aux_data_ptrs = [b.ctypes.data for b in self.aux]
        a.aux_data_lens = [b.nbytes for b in self.aux]
        a.aux_item_lens = [b[0].nbytes for b in self.aux]
        a.page_size = self.page_size
        a.kv_head_num = self.heads
        a.total_kv_head_num = self.total_heads
        a.head_dim = self.head_dim
        a.kv_dtype = "float16"
        a.is_mla = self.mla
        if self.mla:
            a.kv_lora_rank = self.head_dim - 8
            a.qk_rope_head_dim = 8
        return a

    def expected(self, room: int, buffer: int, tokens: np.ndarray) -> np.ndarray:
        """[len(tokens), heads, head_dim] values of this rank's heads for the request's tokens."""
        heads = np.arange(self.first_head, self.first_head + self.heads)[None, :, None]
        dims = np.arange(self.head_dim)[None, None, :]
        t = tokens[:, None, None].astype(np.int64)
        return ((room * 1000003 + buffer * 7919 + heads * 131 + t * 17 + dims) % 65521).astype(
            np.uint16
        )

    def fill(self, room: int, pages: np.ndarray, buffers=None, wait: bool = True) -> None:
        """Writes the request's KV into `pages` (its pages in token order), in every buffer or
        those listed. GPU buffers: on the current stream, which this waits for unless `wait` is
        False (a layer then hands its KV over by an event recorded after it): send() moves
        pages as they are when it is called, as SGLang calls it after the forward pass."""
        ps = self.page_size
        tokens = np.arange(len(pages) * ps)
        slots = (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)
        for b in buffers if buffers is not None else range(len(self.kv)):
            values = self.expected(room, b, tokens)
            if self.device is None:
                self.kv[b][slots] = values
            else:
                import torch

                index = torch.from_numpy(slots.astype(np.int64)).to(self.kv[b].device)
                src = torch.from_numpy(values.view(np.float16)).to(self.kv[b].device)
                self.kv[b][index] = src
        if self.device is not None and wait:
            import torch

            torch.cuda.current_stream(self.device).synchronize()

    def buffers_of_layer(self, layer: int) -> list:
        return [layer] if self.mla else [layer, self.layers + layer]

    def host_view(self, b: int) -> np.ndarray:
        buf = self.kv[b]
        if self.device is None:
            return buf
        return buf.cpu().numpy().view(np.uint16)

    def mismatches(self, room: int, pages: np.ndarray) -> int:
        """Bytes of the request's KV in `pages` that differ from what prefill wrote."""
        ps = self.page_size
        tokens = np.arange(len(pages) * ps)
        slots = (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)
        bad = 0
        for b in range(len(self.kv)):
            buf = self.host_view(b)
            diff = buf[slots].view(np.uint8) != self.expected(room, b, tokens).view(np.uint8)
            bad += int(diff.sum())
        return bad

    def write_aux(self, row: int, room: int) -> None:
        self.output_ids[row] = np.arange(OUTPUT_IDS_WIDTH) + room % 100000
        self.cached_tokens[row] = [room % 7, 1, 2, 3]

    def aux_ok(self, row: int, room: int) -> bool:
        return (
            bool((self.output_ids[row] == np.arange(OUTPUT_IDS_WIDTH) + room % 100000).all())
            and list(self.cached_tokens[row]) == [room % 7, 1, 2, 3]
            and int(self.bootstrap_room[row, 0]) == room
        )


def fragmented(rng: np.random.Generator, free: list, count: int) -> np.ndarray:
    """`count` pages taken from random places of the free list (a long-running server's)."""
    picks = []
    for _ in range(count):
        picks.append(free.pop(int(rng.integers(len(free)))))
    return np.array(picks, np.int32)


def run_prefill(spec: dict) -> None:
    device = spec.get("device")
    if device is not None:
        import torch

        torch.cuda.set_device(device)
    rank = Rank(spec, spec["tp_rank"], spec["tp_size"], spec["num_pages"], device=device)
    mgr = KVManager(
        rank.args(),
        DisaggregationMode.PREFILL,
        bootstrap_address=spec["bootstrap"],
        bootstrap_timeout=spec.get("bootstrap_timeout", 30.0),
        pull=spec.get("pull", False),
    )
    print(json.dumps({"address": mgr.engine_address}), flush=True)
    rng = np.random.default_rng(spec["seed"] + spec["tp_rank"])
    free = list(range(rank.num_pages))
    senders = {}
    for i, room_spec in enumerate(spec["rooms"]):
        room = room_spec["room"]
        senders[room] = (KVSender(mgr, spec["bootstrap"], room), room_spec, i)
    deadline = time.monotonic() + 60
    results = {}
    waiting = dict(senders)
    layerwise = spec.get("layerwise", False)
    while waiting and time.monotonic() < deadline:
        for room, (sender, room_spec, row) in list(waiting.items()):
            state = sender.poll()
            if state == KVPoll.Bootstrapping:
                continue
            del waiting[room]
            if state == KVPoll.Failed:
                results[room] = [state, _failure(sender)]
                continue
            pages = fragmented(rng, free, room_spec["pages"])
            if not (layerwise and device is not None):
                rank.fill(room, pages)
            rank.write_aux(row, room)
            sender.init(len(pages), aux_index=row)
            if room_spec.get("abort"):
                sender.abort()  # prefill gives the room up before sending anything
                results[room] = None
                continue
            chunk = room_spec.get("chunk_pages", len(pages))
            for start in range(0, len(pages), chunk):
                if layerwise:
                    p = mgr.begin_layerwise([(sender, pages[start : start + chunk])])
                    for layer in range(rank.layers):
                        if device is None:
                            p.layer_ready(layer)
                            continue
                        # the layer "computes" its KV on the GPU, then is marked by an event
                        import torch

                        rank.fill(room, pages, rank.buffers_of_layer(layer), wait=False)
                        event = torch.cuda.Event()
                        event.record()
                        p.layer_ready(layer, event)
                else:
                    sender.send(pages[start : start + chunk])
            results[room] = None
    for room, (sender, _, _) in waiting.items():
        results[room] = [sender.poll(), "decode never sent its destination"]
    deadline = time.monotonic() + 60
    for room, (sender, _, _) in senders.items():
        if results[room] is not None:
            continue
        state = sender.poll()
        while state not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.005)
            state = sender.poll()
        results[room] = [state, _failure(sender) if state == KVPoll.Failed else ""]
    print(json.dumps({"results": {str(k): v for k, v in results.items()}}), flush=True)
    sys.stdin.read()  # keep the engine up until the test is done with this rank
    mgr.close()


def _failure(sender) -> str:
    try:
        sender.failure_exception()
    except Exception as e:  # KVTransferError
        return str(e)
    return ""


if __name__ == "__main__":
    if sys.argv[1] != "prefill":
        sys.exit(f"unknown mode {sys.argv[1]}")
    run_prefill(json.loads(sys.argv[2]))
