// A tiny MHA model geometry for connector tests: 3 layers, 2 KV heads of 16 bf16 values, so
// that pools of a few hundred pages take kilobytes.
#pragma once

#include "kvferry/kv_layout.h"

namespace kvferry::testutil {

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

}  // namespace kvferry::testutil
