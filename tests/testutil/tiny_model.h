// Small model geometries for tests: TinyGeometry for connector tests, SlicedGeometry for head
// slices across unequal TP, SmallMha / SmallMla for the replay's content (kv_pattern) tests.
#pragma once

#include "kvferry/kv_layout.h"

namespace kvferry::testutil {

// A tiny MHA model for connector tests: 3 layers, 2 KV heads of 16 bf16 values, so that pools
// of a few hundred pages take kilobytes.
inline ModelGeometry TinyGeometry() {
  ModelGeometry g;
  g.name = "tiny";
  g.attention = AttentionKind::kMha;
  g.num_layers = 3;
  g.num_attention_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 16;
  g.hidden_size = 64;
  g.dtype = DType::kBFloat16;
  return g;
}

// A small model for tests of head slices across unequal TP: MLA (one 48-value latent per
// layer: kv_lora_rank 32 + rope 16, 4 query heads), or GQA with `query_heads` query heads of
// `head_dim` bf16 values over `rank_heads` KV heads (what one rank holds).
inline ModelGeometry SlicedGeometry(const char* name, AttentionKind kind, int num_layers,
                                    int rank_heads, int query_heads, int head_dim) {
  ModelGeometry g;
  g.name = name;
  g.attention = kind;
  g.num_layers = num_layers;
  g.hidden_size = 64;
  g.dtype = DType::kBFloat16;
  if (kind == AttentionKind::kMla) {
    g.num_attention_heads = 4;
    g.kv_lora_rank = 32;
    g.qk_rope_head_dim = 16;
    g.num_kv_heads = 1;
    g.head_dim = 48;
  } else {
    g.num_attention_heads = query_heads;
    g.num_kv_heads = rank_heads;
    g.head_dim = head_dim;
  }
  return g;
}

// A small GQA model for content tests: 3 layers, 8 query heads over 2 KV heads of `head_dim`
// values of `dtype` (16 bf16 values: 32-byte heads).
inline ModelGeometry SmallMha(int head_dim = 16, DType dtype = DType::kBFloat16) {
  ModelGeometry g;
  g.name = "small-gqa";
  g.attention = AttentionKind::kMha;
  g.num_layers = 3;
  g.num_attention_heads = 8;
  g.num_kv_heads = 2;
  g.head_dim = head_dim;
  g.hidden_size = 128;
  g.dtype = dtype;
  return g;
}

// A small MLA model for content tests: 4 layers, one 40-value bf16 latent per token and layer
// (kv_lora_rank 32 + rope 8: 80 bytes).
inline ModelGeometry SmallMla() {
  ModelGeometry g;
  g.name = "small-mla";
  g.attention = AttentionKind::kMla;
  g.num_layers = 4;
  g.num_attention_heads = 8;
  g.num_kv_heads = 1;
  g.kv_lora_rank = 32;
  g.qk_rope_head_dim = 8;
  g.head_dim = 40;
  g.hidden_size = 128;
  return g;
}

}  // namespace kvferry::testutil
