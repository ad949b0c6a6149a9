// KV layout: the shape of a model's paged KV cache, in bytes.
//
// A ModelGeometry says what one token costs in every layer (MHA/GQA: a K and a V head vector per
// KV head; MLA: one compressed latent per layer). A KvLayout adds the page size and describes the
// buffers the way SGLang's token-to-KV pools order them, so a prefill and a decode instance agree
// on which bytes of which buffer hold which token:
//   MHA/GQA (SGLang MHATokenToKVPool): buffers [0, L) hold K of layer l, [L, 2L) hold V of layer l;
//   MLA (SGLang MLATokenToKVPool):     buffers [0, L) hold the latent of layer l.
// Inside a buffer the bytes are laid out [page][token slot][head][head_dim], so one page of one
// buffer is page_bytes() contiguous bytes.
//
// Thread-safety: everything here is a value type or a pure function; distinct objects may be
// used from any thread, and const objects may be shared.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

// Element type of the KV cache (and of hidden states in aux rows).
enum class DType : uint8_t { kBFloat16, kFloat16, kFloat32, kFloat8E4M3 };

// Accepts "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float", "fp8",
// "float8_e4m3fn" (case-insensitive, an optional "torch." prefix is ignored).
// Errors: kInvalidArgument naming the text.
StatusOr<DType> ParseDType(std::string_view text);

// Bytes per element: 2, 2, 4, 1.
size_t DTypeSize(DType dtype);

// Canonical name: "bfloat16", "float16", "float32", "float8_e4m3fn".
std::string_view DTypeName(DType dtype);

enum class AttentionKind : uint8_t {
  kMha,  // MHA and GQA: a K and a V vector per KV head, per layer
  kMla,  // DeepSeek MLA: one latent (kv_lora_rank + qk_rope_head_dim values) per layer
};

// The KV-relevant geometry of a model (values as in its Hugging Face config.json).
// For MLA, num_kv_heads is 1 and head_dim is kv_lora_rank + qk_rope_head_dim (the latent width,
// SGLang's kv_cache_dim), so code that walks heads works for both kinds.
struct ModelGeometry {
  std::string name;
  AttentionKind attention = AttentionKind::kMha;
  int num_layers = 0;              // num_hidden_layers
  int num_attention_heads = 0;     // query heads
  int num_kv_heads = 0;            // num_key_value_heads (MHA/GQA); 1 for MLA
  int head_dim = 0;                // elements per head vector; MLA: kv_lora_rank + qk_rope_head_dim
  int kv_lora_rank = 0;            // MLA only: compressed KV width, elements
  int qk_rope_head_dim = 0;        // MLA only: decoupled RoPE key width, elements
  int hidden_size = 0;             // model width, elements (sizes the hidden state in aux rows)
  DType dtype = DType::kBFloat16;  // KV cache element type

  // Hybrid models (Qwen3-Next, Qwen3.5): besides the full-attention layers above, which keep
  // paged KV (num_layers counts only them), num_linear_layers linear-attention (Gated DeltaNet)
  // layers keep one fixed-size state per request instead of pages: a convolution state
  // [conv_dim, linear_conv_kernel_dim - 1] in `dtype` with
  //   conv_dim = 2 * linear_num_key_heads * linear_key_head_dim
  //              + linear_num_value_heads * linear_value_head_dim,
  // and a recurrent state [linear_num_value_heads, linear_value_head_dim, linear_key_head_dim]
  // in linear_state_dtype (SGLang's MambaPool keeps it in float32 by default). Model layer l
  // (0-based) is full attention iff (l + 1) % full_attention_interval == 0. All zero for
  // models without linear attention.
  int num_linear_layers = 0;
  int full_attention_interval = 0;
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel_dim = 0;
  DType linear_state_dtype = DType::kFloat32;

  bool hybrid() const { return num_linear_layers > 0; }
  // Every layer of the model: full attention and linear attention.
  int num_model_layers() const { return num_layers + num_linear_layers; }
  // Channels of the convolution state (see above); 0 when not hybrid.
  int linear_conv_dim() const {
    return 2 * linear_num_key_heads * linear_key_head_dim +
           linear_num_value_heads * linear_value_head_dim;
  }
  // Where model layer `layer` keeps its cache: linear = false: attention layer `index` (its KV
  // buffers); linear = true: linear-attention layer `index` (its state buffers).
  // REQUIRES 0 <= layer < num_model_layers().
  struct LayerRef {
    bool linear = false;
    int index = 0;
  };
  LayerRef ModelLayer(int layer) const {
    if (!hybrid()) return {false, layer};
    const int full_before = (layer + 1) / full_attention_interval;  // full layers in [0, layer]
    if ((layer + 1) % full_attention_interval == 0) return {false, full_before - 1};
    return {true, layer - full_before};
  }
  // State bytes of one request over all linear-attention layers (whole model, no TP split).
  uint64_t StateBytesPerRequest() const;

  // KV bytes one token occupies over all layers:
  //   MHA: 2 * num_layers * num_kv_heads * head_dim * DTypeSize(dtype)
  //   MLA: num_layers * (kv_lora_rank + qk_rope_head_dim) * DTypeSize(dtype)
  uint64_t KvBytesPerToken() const;
};

// Hard-coded geometries of real models (bf16 cache): GQA llama-3.1-8b, llama-3.1-70b,
// qwen3-8b, qwen3-32b, qwen3-235b-a22b; MLA deepseek-v3; hybrid qwen3-next-80b-a3b and
// qwen3.5-397b-a17b. The returned vector lives forever.
const std::vector<ModelGeometry>& ModelPresets();

// Returns the preset named exactly `name`. Errors: kNotFound listing the known names.
StatusOr<ModelGeometry> FindModelPreset(std::string_view name);

// Parses a Hugging Face config.json:
//   num_hidden_layers (required), num_attention_heads (required), hidden_size (required),
//   num_key_value_heads (default num_attention_heads),
//   head_dim (default hidden_size / num_attention_heads, which must divide evenly),
//   kv_lora_rank + qk_rope_head_dim present => MLA,
//   torch_dtype (or the newer "dtype"; default bfloat16),
//   hybrid linear attention when linear_num_value_heads is present: linear_num_key_heads,
//   linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim (all required then),
//   the layer pattern from layer_types ("linear_attention" / "full_attention", periodic) or
//   full_attention_interval, and mamba_ssm_dtype (default float32) for the recurrent state.
// A multimodal config whose model lives under "text_config" is read from there.
// Errors: kInvalidArgument naming the missing or invalid field (not JSON, a field of the wrong
// type, zero or negative sizes, head_dim not an integer, attention heads not a multiple of KV
// heads).
StatusOr<ModelGeometry> ParseHfConfig(std::string_view json_text, std::string name);

// Reads and parses the file at `path`. The geometry is named after the file's directory when
// the file is called config.json (".../Llama-3.1-8B/config.json" -> "Llama-3.1-8B"), else after
// the file's stem. Errors: kNotFound when the file cannot be read, or ParseHfConfig's errors;
// both name the file.
StatusOr<ModelGeometry> LoadHfConfig(const std::string& path);

// A model geometry cut into pages of `page_size` tokens. Cheap to copy.
class KvLayout {
 public:
  // Errors: kInvalidArgument when page_size < 1 or the geometry is incomplete (no layers, no KV
  // heads, zero head_dim or MLA latent width).
  static StatusOr<KvLayout> Create(const ModelGeometry& geometry, int page_size);

  const ModelGeometry& geometry() const { return geometry_; }
  int page_size() const { return page_size_; }  // tokens per page

  // Number of buffers: 2 * num_layers for MHA, num_layers for MLA.
  int num_buffers() const { return num_buffers_; }
  // Layer held by `buffer`. REQUIRES 0 <= buffer < num_buffers().
  int BufferLayer(int buffer) const {
    return buffer >= geometry_.num_layers ? buffer - geometry_.num_layers : buffer;
  }
  // True for the V buffers of an MHA layout; always false for MLA.
  // REQUIRES 0 <= buffer < num_buffers().
  bool BufferIsValue(int buffer) const {
    return geometry_.attention == AttentionKind::kMha && buffer >= geometry_.num_layers;
  }

  int heads_per_token() const { return heads_per_token_; }  // num_kv_heads (MHA), 1 (MLA)
  uint64_t head_bytes() const { return head_bytes_; }       // one head of one token in one buffer
  uint64_t token_bytes() const { return head_bytes_ * static_cast<uint64_t>(heads_per_token_); }
  uint64_t page_bytes() const { return token_bytes() * static_cast<uint64_t>(page_size_); }
  uint64_t bytes_per_page_all_buffers() const {
    return page_bytes() * static_cast<uint64_t>(num_buffers_);
  }
  // Pages needed for `num_tokens` tokens: ceil(num_tokens / page_size); 0 when num_tokens <= 0.
  // Exact for every int64_t (no rounding up by addition, which overflows near the maximum).
  int64_t NumPages(int64_t num_tokens) const {
    return num_tokens <= 0 ? 0 : num_tokens / page_size_ + (num_tokens % page_size_ != 0 ? 1 : 0);
  }

 private:
  KvLayout() = default;

  ModelGeometry geometry_;
  int page_size_ = 1;
  int num_buffers_ = 0;
  int heads_per_token_ = 0;
  uint64_t head_bytes_ = 0;
};

// A run of `num_pages` pages that are consecutive both at the source (src_page, src_page + 1,
// ...) and at the destination, so it can move as one contiguous transfer per buffer.
struct PageRun {
  int64_t src_page;
  int64_t dst_page;
  int64_t num_pages;

  friend bool operator==(const PageRun&, const PageRun&) = default;
};

// Splits the page pairs (src_pages[i] -> dst_pages[i]) into maximal runs, in order, where both
// sides are consecutive (the same grouping as SGLang's group_concurrent_contiguous).
// REQUIRES src_pages.size() == dst_pages.size(); when they differ the result is empty (callers
// validate first). Empty input gives an empty result.
std::vector<PageRun> CoalescePageRuns(std::span<const int32_t> src_pages,
                                      std::span<const int32_t> dst_pages);

}  // namespace kvferry
