"""A small decoder-only transformer whose attention reads its KV cache from a paged pool.

Two attention kinds, weights drawn from a seed (no checkpoint exists here):
- "gqa": Llama architecture. RMSNorm, rotary embeddings (rotate-half form), grouped-query
  attention with fewer KV heads than query heads, SwiGLU MLP. The pool caches K (after the
  rotary embedding) and V per KV head and token.
- "mla": DeepSeek-style multi-head latent attention. The pool caches one compressed latent
  per token: the RMS-normed `kv_lora_rank` vector followed by the `qk_rope_head_dim` rotary
  part of the key, shared by all heads. Attention up-projects each head's K (no-rope part) and
  V from the cached latent (`wkv_b`), and adds the rotary part's score.

Attention tensor parallelism splits the heads as SGLang does: rank r of `tp_size` computes
query heads [r*H/tp, (r+1)*H/tp) and (GQA) holds KV heads [r*n, (r+1)*n), n = kv_heads/tp, in
its pool (MLA: every rank holds the whole latent). The per-head outputs of the ranks are
concatenated by `all_gather` (no partial sums), and everything else is replicated, so a rank's
arithmetic per head is the arithmetic of a single-rank run: logits are bit for bit those of
tp_size 1 on the same device type.

Attention is computed one KV head (GQA group) or one head (MLA) at a time, reading K/V through
the request's page table; a wrong page gives wrong logits.
"""

import dataclasses
import math
from typing import Callable, List, Optional

import torch

from kvferry.examples.kv_pool import DTYPES, KVPool


@dataclasses.dataclass
class ModelConfig:
    """Shapes of the model. Defaults are small enough for a 2-core CPU test run."""
    kind: str = "gqa"            # "gqa" or "mla"
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8           # query heads
    num_kv_heads: int = 4        # GQA only; divides num_heads
    head_dim: int = 32           # GQA only
    intermediate_size: int = 512
    kv_lora_rank: int = 64       # MLA only
    qk_rope_head_dim: int = 16   # MLA only
    qk_nope_head_dim: int = 32   # MLA only
    v_head_dim: int = 32         # MLA only
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_positions: int = 8192
    dtype: str = "float32"       # "float32", "bfloat16", "float16"
    seed: int = 1234

    def validate(self) -> None:
        if self.kind not in ("gqa", "mla"):
            raise ValueError(f"model kind must be 'gqa' or 'mla', not {self.kind!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.kind == "gqa" and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        rope = self.head_dim if self.kind == "gqa" else self.qk_rope_head_dim
        if rope % 2:
            raise ValueError(f"the rotary dimension ({rope}) must be even")

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def total_kv_heads(self) -> int:
        """KV heads of the whole model as the pool sees them (MLA: 1, the latent)."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def cache_dim(self) -> int:
        """Elements per cached head and token (MLA: kv_lora_rank + qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def kv_heads_per_rank(self, tp_size: int) -> int:
        if self.is_mla:
            return 1
        if self.num_kv_heads % tp_size:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must be a multiple of the "
                             f"attention TP size ({tp_size})")
        return self.num_kv_heads // tp_size


def default_config(kind: str) -> ModelConfig:
    return ModelConfig(kind=kind)


class _Layer:
    pass


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, d], cos/sin [T, d] float32; computed in float32, returned in x's dtype."""
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


class Model:
    """The weights (replicated on every rank) and the forward pass of one attention TP rank.

    Args:
        config: the model's shapes and seed; weights depend only on it (drawn on the CPU with
            a seeded generator, then moved), so every process and device gets the same ones.
        device: where weights and activations live.
        tp_rank, tp_size: attention tensor parallelism (heads split as described above).
        all_gather: concatenates a [T, w] tensor of every rank along dim 1 in rank order
            (collective; required when tp_size > 1).
    """

    def __init__(self, config: ModelConfig, device: torch.device, tp_rank: int = 0,
                 tp_size: int = 1,
                 all_gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        config.validate()
        if tp_size > 1 and all_gather is None:
            raise ValueError("tp_size > 1 needs an all_gather")
        if config.num_heads % tp_size:
            raise ValueError(f"num_heads ({config.num_heads}) must be a multiple of the "
                             f"attention TP size ({tp_size})")
        self.config = config
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.all_gather = all_gather or (lambda x: x)
        kv_per_rank = config.kv_heads_per_rank(tp_size)
        self.kv_heads = list(range(tp_rank * kv_per_rank, (tp_rank + 1) * kv_per_rank))
        heads_per_rank = config.num_heads // tp_size
        self.heads = list(range(tp_rank * heads_per_rank, (tp_rank + 1) * heads_per_rank))
        self._init_weights()
        rope_dim = config.qk_rope_head_dim if config.is_mla else config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
        freqs = torch.arange(config.max_positions).float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(self.device)
        self.sin = angles.sin().to(self.device)

    def _init_weights(self) -> None:
        c = self.config
        gen = torch.Generator().manual_seed(c.seed)
        dtype = c.torch_dtype

        def draw(*shape: int, fan_in: int = 0) -> torch.Tensor:
            scale = 1.0 / math.sqrt(fan_in) if fan_in else 1.0
            return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(self.device)

        def norm(size: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(size, generator=gen)).to(dtype).to(self.device)

        hidden = c.hidden_size
        self.embed = draw(c.vocab_size, hidden)
        self.layers: List[_Layer] = []
        for _ in range(c.num_layers):
            w = _Layer()
            w.attn_norm = norm(hidden)
            if c.is_mla:
                qk_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
                w.wq = draw(c.num_heads, qk_dim, hidden, fan_in=hidden)
                w.wkv_a = draw(c.kv_lora_rank + c.qk_rope_head_dim, hidden, fan_in=hidden)
                w.kv_norm = norm(c.kv_lora_rank)
                w.wkv_b = draw(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank,
                               fan_in=c.kv_lora_rank)
                w.wo = draw(hidden, c.num_heads * c.v_head_dim, fan_in=c.num_heads * c.v_head_dim)
            else:
                group = c.num_heads // c.num_kv_heads
                w.wq = draw(c.num_kv_heads, group * c.head_dim, hidden, fan_in=hidden)
                w.wk = draw(c.num_kv_heads, c.head_dim, hidden, fan_in=hidden)
                w.wv = draw(c.num_kv_heads, c.head_dim, hidden, fan_in=hidden)
                w.wo = draw(hidden, c.num_heads * c.head_dim, fan_in=c.num_heads * c.head_dim)
            w.mlp_norm = norm(hidden)
            w.w_gate = draw(c.intermediate_size, hidden, fan_in=hidden)
            w.w_up = draw(c.intermediate_size, hidden, fan_in=hidden)
            w.w_down = draw(hidden, c.intermediate_size, fan_in=c.intermediate_size)
            self.layers.append(w)
        self.final_norm = norm(hidden)
        self.lm_head = draw(c.vocab_size, hidden, fan_in=hidden)

    def new_pool(self, num_pages: int, page_size: int) -> KVPool:
        """A pool for this rank's share of the KV heads, on the model's device."""
        c = self.config
        return KVPool(c.num_layers, num_pages, page_size, len(self.kv_heads), c.cache_dim,
                      c.is_mla, c.torch_dtype, self.device)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, start: int, pool: KVPool, pages: List[int],
                on_layer_done: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Runs tokens at positions [start, start + T) of one request.

        Writes their K/V (or latent) into the pool at the request's slots, attends over
        positions [0, start + T) read back from the pool (causal within the T tokens), and
        calls `on_layer_done(layer)` once a layer's KV is written and its output computed.

        Args:
            token_ids: int64 [T] on the model's device.
            start: position of token_ids[0]; positions [0, start) must already be in the pool.
            pool: this rank's pool; pages: the request's page table (token order), covering
                start + T tokens.
        Returns:
            float32 [vocab] logits of the last of the T tokens.
        """
        c = self.config
        count = token_ids.shape[0]
        end = start + count
        if end > c.max_positions:
            raise ValueError(f"position {end} exceeds max_positions ({c.max_positions})")
        slots_write = pool.slots(pages, start, end)
        slots_read = pool.slots(pages, 0, end)
        positions = torch.arange(start, end, device=self.device)
        cos, sin = self.cos[positions], self.sin[positions]
        mask = None
        if count > 1:
            keys = torch.arange(end, device=self.device)
            mask = keys[None, :] > positions[:, None]  # [T, S]: True where masked
        x = self.embed[token_ids]
        for index, w in enumerate(self.layers):
            h = _rms_norm(x, w.attn_norm, c.rms_eps)
            if c.is_mla:
                attn = self._mla(index, w, h, cos, sin, pool, slots_write, slots_read, mask)
            else:
                attn = self._gqa(index, w, h, cos, sin, pool, slots_write, slots_read, mask)
            x = x + attn
            h = _rms_norm(x, w.mlp_norm, c.rms_eps)
            gate = torch.nn.functional.silu(h @ w.w_gate.T)
            x = x + (gate * (h @ w.w_up.T)) @ w.w_down.T
            if on_layer_done is not None:
                on_layer_done(index)
        last = _rms_norm(x[-1:], self.final_norm, c.rms_eps)
        return (last @ self.lm_head.T).float()[0]

    def _softmax_attend(self, scores: torch.Tensor, values: torch.Tensor,
                        mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        scores = scores.float() * scale
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return probs @ values

    def _gqa(self, layer: int, w: _Layer, h: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, pool: KVPool, slots_write: torch.Tensor,
             slots_read: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        c = self.config
        count = h.shape[0]
        group = c.num_heads // c.num_kv_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        outs = []
        for local, kv_head in enumerate(self.kv_heads):
            k = _apply_rope(h @ w.wk[kv_head].T, cos, sin)
            v = h @ w.wv[kv_head].T
            pool.k[layer][slots_write, local] = k
            pool.v[layer][slots_write, local] = v
            keys = pool.k[layer][slots_read, local]      # [S, d]
            values = pool.v[layer][slots_read, local]    # [S, d]
            q = (h @ w.wq[kv_head].T).view(count, group, c.head_dim).transpose(0, 1)
            q = _apply_rope(q, cos, sin)                 # [G, T, d]
            out = self._softmax_attend(q @ keys.T, values, mask, scale)   # [G, T, d]
            outs.append(out.transpose(0, 1).reshape(count, group * c.head_dim))
        return self.all_gather(torch.cat(outs, dim=1)) @ w.wo.T

    def _mla(self, layer: int, w: _Layer, h: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, pool: KVPool, slots_write: torch.Tensor,
             slots_read: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        c = self.config
        rank, nope = c.kv_lora_rank, c.qk_nope_head_dim
        latent = h @ w.wkv_a.T                                   # [T, rank + rope]
        compressed = _rms_norm(latent[:, :rank], w.kv_norm, c.rms_eps)
        rotary = _apply_rope(latent[:, rank:], cos, sin)
        pool.latent[layer][slots_write, 0] = torch.cat((compressed, rotary), dim=-1)
        cached = pool.latent[layer][slots_read, 0]               # [S, rank + rope]
        cached_compressed, cached_rotary = cached[:, :rank], cached[:, rank:]
        scale = 1.0 / math.sqrt(nope + c.qk_rope_head_dim)
        outs = []
        for head in self.heads:
            q = h @ w.wq[head].T                                 # [T, nope + rope]
            q_rotary = _apply_rope(q[:, nope:], cos, sin)
            kv = cached_compressed @ w.wkv_b[head].T             # [S, nope + v]
            scores = q[:, :nope] @ kv[:, :nope].T + q_rotary @ cached_rotary.T
            outs.append(self._softmax_attend(scores, kv[:, nope:], mask, scale))
        return self.all_gather(torch.cat(outs, dim=1)) @ w.wo.T


def greedy(logits: torch.Tensor) -> "tuple[int, float]":
    """The argmax token of float32 [vocab] logits and its log-probability."""
    token = int(torch.argmax(logits).item())
    logprob = float(torch.log_softmax(logits, dim=-1)[token].item())
    return token, logprob


def prefill_chunks(length: int, chunk_tokens: int) -> List["tuple[int, int]"]:
    """[start, end) token ranges of chunked prefill: chunks of chunk_tokens, the last shorter."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, not {chunk_tokens}")
    return [(s, min(s + chunk_tokens, length)) for s in range(0, length, chunk_tokens)]


def pages_ready(chunk_end: int, length: int, page_size: int, sent: int) -> "tuple[int, int]":
    """Pages [sent, ready) whose every token is computed once tokens [0, chunk_end) are: whole
    pages for a chunk that ends inside a page, every page for the last chunk (SGLang sends a
    chunk's partial last page with the next chunk)."""
    if chunk_end >= length:
        return sent, (length + page_size - 1) // page_size
    return sent, chunk_end // page_size
