"""KVArgs for kvferry.sglang and how kvferry reads them: the pool geometry, the connector's pool
arguments (buffers, rows, devices) and the attention TP size, from the fields SGLang's schedulers
fill (sglang/srt/disaggregation/base/conn.py KVArgs) and those kvferry adds."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

import kvferry
from kvferry import _kvferry


class KVArgs:
    """The buffers and geometry of one rank, shaped as SGLang's KVArgs (plain attributes).

    kv_data_ptrs / kv_data_lens / kv_item_lens: per layer buffer (K of every layer, then V of
      every layer for MHA/GQA; one latent per layer for MLA) its address, its bytes, and the
      bytes of one page (page_size * kv_head_num * head_dim * element size).
    aux_data_ptrs / aux_data_lens / aux_item_lens: per aux field (SGLang's MetadataBuffers
      order) its address, bytes, and bytes of one row. Field aux_room_field (default -1: the
      last, SGLang's bootstrap_room) holds the room as a 64-bit integer at offset 0.
    state_data_ptrs / state_data_lens / state_item_lens: hybrid models' state buffers, the
      convolution state of each linear-attention layer then the recurrent state of each; item
      = bytes of one slot. Flat lists (a list of lists, SGLang's per-type form, is flattened).
    page_size, kv_head_num (heads in this rank's buffers; 1 for MLA), total_kv_head_num,
    head_dim (MLA: kv_lora_rank + qk_rope_head_dim), kv_dtype ("bfloat16", "float16",
    "float32", "float8_e4m3fn"), is_mla, kv_lora_rank, qk_rope_head_dim.
    hf_config: optional config.json text or dict; hybrid models need it (the geometry of their
      state comes from it).
    engine_rank / tp_rank, tp_size, cp_rank, cp_size, pp_rank: this rank's attention
    parallelism. gpu_id: informational (where each buffer lives is looked up from its address).

    SGLang's schedulers leave head_dim, kv_dtype, kv_lora_rank, qk_rope_head_dim and tp_size
    unset (and kv_head_num for MLA). Then head_dim comes from one page's bytes, kv_item_lens =
    page_size x kv_head_num x head_dim x element size, counted in elements of kv_dtype (its
    default, bfloat16, where unset: kvferry moves bytes, so only the product matters and both
    sides must derive it alike). An MLA pool's latent is taken as kv_lora_rank = head_dim,
    qk_rope_head_dim = 0. tp_size comes from KVManager's server_args (SGLang's attention TP:
    tp_size, divided by dp_size under enable_dp_attention), and the rank is engine_rank modulo
    it. An MHA/GQA rank without kv_head_num (SGLang's decode) takes it from config.json in
    server_args.model_path when that is a local directory.
    """

    engine_rank: int = 0
    kv_data_ptrs: List[int] = []
    kv_data_lens: List[int] = []
    kv_item_lens: List[int] = []
    aux_data_ptrs: List[int] = []
    aux_data_lens: List[int] = []
    aux_item_lens: List[int] = []
    aux_room_field: int = -1
    state_data_ptrs: List[int] = []
    state_data_lens: List[int] = []
    state_item_lens: List[int] = []
    state_type: str = "none"
    gpu_id: Optional[int] = None
    ib_device: Optional[str] = None
    page_size: int = 1
    kv_head_num: int = 0
    total_kv_head_num: int = 0
    head_dim: int = 0
    kv_dtype: str = "bfloat16"
    is_mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    hf_config: Any = None
    tp_rank: Optional[int] = None
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    pp_rank: int = 0

    def __init__(self, **values: Any):
        for key, value in values.items():
            if not hasattr(KVArgs, key):
                raise TypeError(f"KVArgs has no field {key!r}")
            setattr(self, key, value)


def _flat(values: Any) -> List[int]:
    out: List[int] = []
    for v in values or []:
        if isinstance(v, (list, tuple)):
            out.extend(int(x) for x in v)
        else:
            out.append(int(v))
    return out


def _rows(what: str, lens: Sequence[int], items: Sequence[int]) -> int:
    """Rows (pages, aux rows, slots) every buffer holds: each len / item, all equal."""
    if len(lens) != len(items):
        raise kvferry.InvalidArgumentError(
            f"{what}: {len(lens)} data lengths but {len(items)} item lengths"
        )
    counts = set()
    for i, (n, item) in enumerate(zip(lens, items)):
        if item <= 0 or n < item:
            raise kvferry.InvalidArgumentError(
                f"{what} buffer {i}: {n} bytes cannot hold one item of {item} bytes"
            )
        counts.add(n // item)
    if len(counts) != 1:
        raise kvferry.InvalidArgumentError(
            f"{what}: buffers hold different numbers of items ({sorted(counts)})"
        )
    return counts.pop()


def _device_of(what: str, addresses: Sequence[int]) -> Optional[int]:
    devices = {kvferry.locate_memory(int(a)) for a in addresses}
    if len(devices) != 1:
        raise kvferry.InvalidArgumentError(f"{what} buffers lie on different devices: {devices}")
    return devices.pop()


def _derived_head_dim(args: KVArgs, heads: int) -> int:
    """head_dim from one page's bytes where SGLang leaves it unset (KVArgs' docstring)."""
    items = _flat(args.kv_item_lens)
    if heads <= 0:
        raise kvferry.InvalidArgumentError(
            "KVArgs.kv_head_num is 0 and head_dim is unset: kvferry needs this rank's KV heads "
            "(SGLang's token_to_kv_pool.head_num, or a model_path in server_args whose "
            "config.json names them) to read one page's layout"
        )
    per_page = int(args.page_size) * heads * _element_bytes(args.kv_dtype)
    if not items or items[0] <= 0 or items[0] % per_page:
        raise kvferry.InvalidArgumentError(
            f"kv_item_lens {sorted(set(items))} is not page_size {args.page_size} x {heads} KV "
            f"heads x a head of {args.kv_dtype} elements: set KVArgs.head_dim and kv_dtype"
        )
    return items[0] // per_page


def _geometry(args: KVArgs) -> Dict[str, Any]:
    """The connector geometry of one rank (num_kv_heads = this rank's heads)."""
    num_buffers = len(args.kv_data_ptrs)
    if args.hf_config is not None:
        text = args.hf_config
        if not isinstance(text, str):
            text = json.dumps(text)
        g = _kvferry.geometry_from_hf_config(text)
        if g["attention"] == "mha" and args.kv_head_num:
            g["num_kv_heads"] = int(args.kv_head_num)
        return g
    if args.is_mla:
        head_dim = args.head_dim or args.kv_lora_rank + args.qk_rope_head_dim
        kv_lora_rank, rope = int(args.kv_lora_rank), int(args.qk_rope_head_dim)
        if not head_dim:
            head_dim = kv_lora_rank = _derived_head_dim(args, 1)
            rope = 0
        return {
            "attention": "mla",
            "num_layers": num_buffers,
            "num_attention_heads": max(1, int(args.total_kv_head_num)),
            "num_kv_heads": 1,
            "head_dim": int(head_dim),
            "kv_lora_rank": kv_lora_rank,
            "qk_rope_head_dim": rope,
            "dtype": args.kv_dtype,
        }
    if num_buffers % 2:
        raise kvferry.InvalidArgumentError(
            f"an MHA/GQA pool has a K and a V buffer per layer; got {num_buffers} kv_data_ptrs"
        )
    return {
        "attention": "mha",
        "num_layers": num_buffers // 2,
        "num_attention_heads": max(1, int(args.total_kv_head_num or args.kv_head_num)),
        "num_kv_heads": int(args.kv_head_num),
        "head_dim": int(args.head_dim) or _derived_head_dim(args, int(args.kv_head_num)),
        "dtype": args.kv_dtype,
    }


def _pool_kwargs(args: KVArgs) -> Dict[str, Any]:
    kv_ptrs = [int(p) for p in args.kv_data_ptrs]
    aux_ptrs = [int(p) for p in args.aux_data_ptrs]
    if not kv_ptrs:
        raise kvferry.InvalidArgumentError("KVArgs.kv_data_ptrs is empty")
    if not aux_ptrs:
        raise kvferry.InvalidArgumentError(
            "KVArgs.aux_data_ptrs is empty (at least the bootstrap_room field is needed)"
        )
    num_pages = _rows("kv", _flat(args.kv_data_lens), _flat(args.kv_item_lens))
    num_aux_rows = _rows("aux", _flat(args.aux_data_lens), _flat(args.aux_item_lens))
    geometry = _geometry(args)
    item = _flat(args.kv_item_lens)
    elem = _element_bytes(geometry["dtype"])
    expected = args.page_size * geometry["num_kv_heads"] * geometry["head_dim"] * elem
    if any(i != expected for i in item):
        raise kvferry.InvalidArgumentError(
            f"kv_item_lens {sorted(set(item))} differ from page_size {args.page_size} x "
            f"{geometry['num_kv_heads']} KV heads x head_dim {geometry['head_dim']} x "
            f"{elem} bytes = {expected}"
        )
    state_ptrs = _flat(args.state_data_ptrs)
    num_slots = 0
    if state_ptrs:
        num_slots = _rows("state", _flat(args.state_data_lens), _flat(args.state_item_lens))
    return dict(
        geometry=geometry,
        page_size=int(args.page_size),
        num_pages=num_pages,
        kv_bases=kv_ptrs,
        aux_field_bytes=_flat(args.aux_item_lens),
        aux_bases=aux_ptrs,
        num_aux_rows=num_aux_rows,
        aux_room_field=int(args.aux_room_field),
        state_bases=state_ptrs,
        num_state_slots=num_slots,
        device=_device_of("kv", kv_ptrs + state_ptrs),
        aux_device=_device_of("aux", aux_ptrs),
    )


def _element_bytes(dtype: Any) -> int:
    """Bytes of one element of a KV dtype name, read as kvferry's C++ reads it (any case, an
    optional "torch." prefix); 2 for a name it does not know (the connector refuses it)."""
    name = str(dtype).lower().removeprefix("torch.")
    return np.dtype(_NUMPY_DTYPES.get(name, "u2")).itemsize


_NUMPY_DTYPES = {
    "float32": "f4",
    "fp32": "f4",
    "float": "f4",
    "float16": "f2",
    "fp16": "f2",
    "half": "f2",
    "bfloat16": "u2",
    "bf16": "u2",
    "fp8": "u1",
    "float8_e4m3fn": "u1",
}


def _attention_tp_size(args: KVArgs, server_args: Any) -> int:
    """KVArgs.tp_size where set, else SGLang's attention TP size from server_args (tp_size,
    divided by dp_size under enable_dp_attention), else 1."""
    if "tp_size" in vars(args) or server_args is None:
        return int(args.tp_size)
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False):
        tp //= max(1, int(getattr(server_args, "dp_size", 1) or 1))
    return max(1, tp)


def _fill_kv_heads_from_model(args: KVArgs, server_args: Any, tp_size: int) -> None:
    """Sets args.kv_head_num / total_kv_head_num of an MHA/GQA rank that left them unset (SGLang's
    decode does) from the model's config.json in server_args.model_path, when that is a local
    directory: num_key_value_heads (else num_attention_heads) of the model, or of its
    text_config, split over the attention TP size (replicated where TP exceeds it)."""
    if args.is_mla or args.kv_head_num or args.hf_config is not None or server_args is None:
        return
    path = os.path.join(str(getattr(server_args, "model_path", "") or ""), "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return
    for c in (config, config.get("text_config") or {}):
        total = c.get("num_key_value_heads") or c.get("num_attention_heads")
        if total:
            args.kv_head_num = max(1, int(total) // tp_size)
            args.total_kv_head_num = args.total_kv_head_num or int(total)
            return
