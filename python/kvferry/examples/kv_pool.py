"""Paged KV pools, page allocators and aux (metadata) buffers laid out as SGLang lays out its own.

- `KVPool`: per layer one K and one V tensor `[num_slots, kv_heads, head_dim]` (MHA/GQA), or one
  latent tensor `[num_slots, 1, kv_lora_rank + qk_rope_head_dim]` per layer (MLA), with
  `num_slots = num_pages * page_size`; token t of a request whose page table is `pages` lives in
  slot `pages[t // page_size] * page_size + t % page_size`. The buffers are separate tensors,
  in SGLang's `kv_data_ptrs` order (K of every layer, then V of every layer; one latent per
  layer for MLA).
- `PageAllocator`: a free list of page indices; shuffled, it hands out pages in the scattered
  order of a long-running server (decode), in order otherwise.
- `AuxBuffers`: SGLang's MetadataBuffers subset, one tensor per field, one row per request in
  flight; the first generated token travels in `output_ids[row, 0]`, and the last field is
  `bootstrap_room` `(rows, 8)` int64 (element 0 = the room, written by kvferry's sender).

Not thread-safe; each process owns its pools.
"""

import random
from typing import List, Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


class KVPool:
    """The paged KV cache of one attention TP rank.

    Args:
        num_layers: model layers, each with its own buffers.
        num_pages: pages in the pool; `num_slots = num_pages * page_size` token slots.
        page_size: tokens per page (>= 1).
        kv_heads: KV heads held by this rank (MLA: 1, the latent).
        head_dim: elements per head and token (MLA: kv_lora_rank + qk_rope_head_dim).
        is_mla: one latent buffer per layer instead of K and V.
        dtype, device: of every buffer.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, is_mla: bool, dtype: torch.dtype, device: torch.device) -> None:
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"page_size ({page_size}) and num_pages ({num_pages}) must be >= 1")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.is_mla = is_mla
        self.dtype = dtype
        self.device = device
        shape = (self.num_slots, kv_heads, head_dim)
        # Zeroed so that a page nobody wrote reads as zeros, not as stale memory.
        if is_mla:
            self.latent = [torch.zeros(shape, dtype=dtype, device=device)
                           for _ in range(num_layers)]
            self.k = self.v = None
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.latent = None

    def buffers(self) -> List[torch.Tensor]:
        """Every layer buffer in SGLang's kv_data_ptrs order."""
        return list(self.latent) if self.is_mla else list(self.k) + list(self.v)

    def page_bytes(self) -> int:
        """Bytes of one page of one buffer (SGLang's kv_item_lens entry)."""
        return self.page_size * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def kv_args_fields(self) -> dict:
        """kv_data_ptrs, kv_data_lens and kv_item_lens for KVArgs."""
        buffers = self.buffers()
        return {
            "kv_data_ptrs": [b.data_ptr() for b in buffers],
            "kv_data_lens": [b.numel() * b.element_size() for b in buffers],
            "kv_item_lens": [self.page_bytes()] * len(buffers),
        }

    def slots(self, pages: List[int], start: int, end: int) -> torch.Tensor:
        """Slot indices (int64, on the pool's device) of token positions [start, end)."""
        page_size = self.page_size
        table = torch.tensor(pages, dtype=torch.int64)
        positions = torch.arange(start, end, dtype=torch.int64)
        slots = table[positions // page_size] * page_size + positions % page_size
        return slots.to(self.device)

    def page_view(self, buffer: torch.Tensor, page: int) -> torch.Tensor:
        """The rows of one page of one buffer (a view: writing it writes the pool)."""
        return buffer[page * self.page_size:(page + 1) * self.page_size]


class PageAllocator:
    """Hands out page indices of a pool. `shuffled` scatters them (seeded) as a long-running
    server's free list does; freed pages return to the end of the list."""

    def __init__(self, num_pages: int, shuffled: bool, seed: int = 0) -> None:
        self.free = list(range(num_pages))
        if shuffled:
            random.Random(seed).shuffle(self.free)

    def alloc(self, count: int) -> List[int]:
        """`count` pages. Raises RuntimeError when fewer are free."""
        if count > len(self.free):
            raise RuntimeError(f"KV pool exhausted: {count} pages asked, {len(self.free)} free")
        pages, self.free = self.free[:count], self.free[count:]
        return pages

    def release(self, pages: List[int]) -> None:
        self.free.extend(pages)


def pages_for(tokens: int, page_size: int) -> int:
    return (tokens + page_size - 1) // page_size


class AuxBuffers:
    """SGLang's MetadataBuffers (a subset, same shapes), host memory unless `device` says.

    Fields, in kvferry.sglang's aux_data_ptrs order: output_ids (rows, 16) int32 (element 0 =
    the first generated token), cached_tokens (rows, 16) int32, output_token_logprobs_val
    (rows, 16) float32, output_token_logprobs_idx (rows, 16) int32, bootstrap_room (rows, 8)
    int64 (last: element 0 = the room).
    """

    def __init__(self, rows: int, device: Optional[torch.device] = None) -> None:
        device = device or torch.device("cpu")
        self.rows = rows
        self.output_ids = torch.zeros((rows, 16), dtype=torch.int32, device=device)
        self.cached_tokens = torch.zeros((rows, 16), dtype=torch.int32, device=device)
        self.output_token_logprobs_val = torch.zeros((rows, 16), dtype=torch.float32,
                                                     device=device)
        self.output_token_logprobs_idx = torch.zeros((rows, 16), dtype=torch.int32,
                                                     device=device)
        self.bootstrap_room = torch.zeros((rows, 8), dtype=torch.int64, device=device)

    def fields(self) -> List[torch.Tensor]:
        return [self.output_ids, self.cached_tokens, self.output_token_logprobs_val,
                self.output_token_logprobs_idx, self.bootstrap_room]

    def kv_args_fields(self) -> dict:
        """aux_data_ptrs, aux_data_lens and aux_item_lens for KVArgs."""
        fields = self.fields()
        return {
            "aux_data_ptrs": [f.data_ptr() for f in fields],
            "aux_data_lens": [f.numel() * f.element_size() for f in fields],
            "aux_item_lens": [f[0].numel() * f.element_size() for f in fields],
        }

    def write_first_token(self, row: int, token: int, logprob: float, cached: int = 0) -> None:
        self.output_ids[row].zero_()
        self.output_ids[row, 0] = token
        self.cached_tokens[row].zero_()
        self.cached_tokens[row, 0] = cached
        self.output_token_logprobs_val[row].zero_()
        self.output_token_logprobs_val[row, 0] = logprob
        self.output_token_logprobs_idx[row].zero_()
        self.output_token_logprobs_idx[row, 0] = token

    def clear(self, row: int) -> None:
        """Marks the row empty (output_ids -1, room 0) before a receive."""
        for f in self.fields():
            f[row].zero_()
        self.output_ids[row].fill_(-1)
