#include "kvferry/kv_layout.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <utility>

#include "common/checks.h"

namespace kvferry {

StatusOr<DType> ParseDType(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string_view name = lower;
  if (name.starts_with("torch.")) name.remove_prefix(6);
  if (name == "bfloat16" || name == "bf16") return DType::kBFloat16;
  if (name == "float16" || name == "fp16" || name == "half") return DType::kFloat16;
  if (name == "float32" || name == "fp32" || name == "float") return DType::kFloat32;
  if (name == "fp8" || name == "float8_e4m3fn") return DType::kFloat8E4M3;
  return InvalidArgumentError("unknown dtype '" + std::string(text) +
                              "' (expected bfloat16, float16, float32 or float8_e4m3fn)");
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat32:
      return 4;
    case DType::kFloat8E4M3:
      return 1;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
  }
  return "unknown";
}

uint64_t ModelGeometry::KvBytesPerToken() const {
  const uint64_t elem = DTypeSize(dtype);
  const uint64_t layers = static_cast<uint64_t>(std::max(num_layers, 0));
  if (attention == AttentionKind::kMla) {
    return layers * static_cast<uint64_t>(std::max(kv_lora_rank + qk_rope_head_dim, 0)) * elem;
  }
  return 2 * layers * static_cast<uint64_t>(std::max(num_kv_heads, 0)) *
         static_cast<uint64_t>(std::max(head_dim, 0)) * elem;
}

uint64_t ModelGeometry::StateBytesPerRequest() const {
  if (!hybrid()) return 0;
  const uint64_t conv = static_cast<uint64_t>(linear_conv_dim()) *
                        static_cast<uint64_t>(std::max(linear_conv_kernel_dim - 1, 0)) *
                        DTypeSize(dtype);
  const uint64_t recurrent =
      static_cast<uint64_t>(linear_num_value_heads) * static_cast<uint64_t>(linear_value_head_dim) *
      static_cast<uint64_t>(linear_key_head_dim) * DTypeSize(linear_state_dtype);
  return static_cast<uint64_t>(num_linear_layers) * (conv + recurrent);
}

namespace {

ModelGeometry Gqa(std::string name, int layers, int heads, int kv_heads, int head_dim,
                  int hidden_size) {
  ModelGeometry g;
  g.name = std::move(name);
  g.attention = AttentionKind::kMha;
  g.num_layers = layers;
  g.num_attention_heads = heads;
  g.num_kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.hidden_size = hidden_size;
  g.dtype = DType::kBFloat16;
  return g;
}

ModelGeometry Mla(std::string name, int layers, int heads, int kv_lora_rank, int qk_rope_head_dim,
                  int hidden_size) {
  ModelGeometry g;
  g.name = std::move(name);
  g.attention = AttentionKind::kMla;
  g.num_layers = layers;
  g.num_attention_heads = heads;
  g.num_kv_heads = 1;
  g.head_dim = kv_lora_rank + qk_rope_head_dim;
  g.kv_lora_rank = kv_lora_rank;
  g.qk_rope_head_dim = qk_rope_head_dim;
  g.hidden_size = hidden_size;
  g.dtype = DType::kBFloat16;
  return g;
}

// A hybrid model: `layers` in all, every `interval`-th one full attention (GQA), the others
// Gated DeltaNet linear attention with a per-request state.
ModelGeometry Hybrid(std::string name, int layers, int interval, int heads, int kv_heads,
                     int head_dim, int hidden_size, int linear_key_heads, int linear_value_heads,
                     int linear_head_dim, int conv_kernel) {
  ModelGeometry g = Gqa(std::move(name), layers / interval, heads, kv_heads, head_dim, hidden_size);
  g.num_linear_layers = layers - layers / interval;
  g.full_attention_interval = interval;
  g.linear_num_key_heads = linear_key_heads;
  g.linear_num_value_heads = linear_value_heads;
  g.linear_key_head_dim = linear_head_dim;
  g.linear_value_head_dim = linear_head_dim;
  g.linear_conv_kernel_dim = conv_kernel;
  g.linear_state_dtype = DType::kFloat32;
  return g;
}

}  // namespace

const std::vector<ModelGeometry>& ModelPresets() {
  // Values from each model's public Hugging Face config.json.
  static const std::vector<ModelGeometry>* const presets = new std::vector<ModelGeometry>{
      Gqa("llama-3.1-8b", 32, 32, 8, 128, 4096),
      Gqa("llama-3.1-70b", 80, 64, 8, 128, 8192),
      Gqa("qwen3-8b", 36, 32, 8, 128, 4096),
      Gqa("qwen3-32b", 64, 64, 8, 128, 5120),  // head_dim explicit: 5120 / 64 would be 80
      Gqa("qwen3-235b-a22b", 94, 64, 4, 128, 4096),
      Mla("deepseek-v3", 61, 128, 512, 64, 7168),
      Hybrid("qwen3-next-80b-a3b", 48, 4, 16, 2, 256, 2048, 16, 32, 128, 4),
      Hybrid("qwen3.5-397b-a17b", 60, 4, 32, 2, 256, 4096, 16, 64, 128, 4),
  };
  return *presets;
}

StatusOr<ModelGeometry> FindModelPreset(std::string_view name) {
  std::string known;
  for (const ModelGeometry& g : ModelPresets()) {
    if (g.name == name) return g;
    if (!known.empty()) known += ", ";
    known += g.name;
  }
  return NotFoundError("unknown model preset '" + std::string(name) + "'; known: " + known);
}

namespace {

using Json = nlohmann::json;

// Reads an integer field. Returns nullopt when the field is absent or null. Integral floats
// (128.0) are accepted; anything else is kInvalidArgument naming the field.
StatusOr<std::optional<int64_t>> GetOptionalInt(const Json& config, const char* field) {
  auto it = config.find(field);
  if (it == config.end() || it->is_null()) return std::optional<int64_t>();
  if (it->is_number_integer()) return std::optional<int64_t>(it->get<int64_t>());
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
      return std::optional<int64_t>(static_cast<int64_t>(v));
    }
  }
  return InvalidArgumentError(std::string("config field '") + field +
                              "' is not an integer: " + it->dump());
}

// A required positive integer that fits an int.
StatusOr<int> GetPositiveInt(const Json& config, const char* field) {
  ASSIGN_OR_RETURN(std::optional<int64_t> v, GetOptionalInt(config, field));
  if (!v.has_value()) {
    return InvalidArgumentError(std::string("config field '") + field + "' is missing");
  }
  if (*v <= 0 || *v > std::numeric_limits<int>::max()) {
    return InvalidArgumentError(std::string("config field '") + field + "' must be positive, got " +
                                std::to_string(*v));
  }
  return static_cast<int>(*v);
}

// An optional positive integer: absent -> fallback.
StatusOr<int> GetPositiveIntOr(const Json& config, const char* field, int fallback) {
  ASSIGN_OR_RETURN(std::optional<int64_t> v, GetOptionalInt(config, field));
  if (!v.has_value()) return fallback;
  if (*v <= 0 || *v > std::numeric_limits<int>::max()) {
    return InvalidArgumentError(std::string("config field '") + field + "' must be positive, got " +
                                std::to_string(*v));
  }
  return static_cast<int>(*v);
}

bool HasValue(const Json& config, const char* field) {
  auto it = config.find(field);
  return it != config.end() && !it->is_null();
}

}  // namespace

// Reads the hybrid (linear-attention) fields into `g`, whose num_layers still counts every
// layer; afterwards it counts the full-attention layers only.
Status ParseLinearAttention(const Json& config, ModelGeometry& g) {
  ASSIGN_OR_RETURN(g.linear_num_value_heads, GetPositiveInt(config, "linear_num_value_heads"));
  ASSIGN_OR_RETURN(g.linear_num_key_heads, GetPositiveInt(config, "linear_num_key_heads"));
  ASSIGN_OR_RETURN(g.linear_key_head_dim, GetPositiveInt(config, "linear_key_head_dim"));
  ASSIGN_OR_RETURN(g.linear_value_head_dim, GetPositiveInt(config, "linear_value_head_dim"));
  ASSIGN_OR_RETURN(g.linear_conv_kernel_dim, GetPositiveInt(config, "linear_conv_kernel_dim"));
  if (g.linear_conv_kernel_dim < 2) {
    return InvalidArgumentError("config field 'linear_conv_kernel_dim' must be >= 2, got " +
                                std::to_string(g.linear_conv_kernel_dim));
  }
  int interval = 0;
  if (HasValue(config, "layer_types")) {
    const Json& types = config["layer_types"];
    if (!types.is_array() || types.size() != static_cast<size_t>(g.num_layers)) {
      return InvalidArgumentError("config field 'layer_types' must list num_hidden_layers (" +
                                  std::to_string(g.num_layers) + ") layer types");
    }
    for (size_t i = 0; i < types.size(); ++i) {
      if (!types[i].is_string() ||
          (types[i] != "full_attention" && types[i] != "linear_attention")) {
        return InvalidArgumentError(
            "config field 'layer_types'[" + std::to_string(i) +
            "] is not \"full_attention\" or \"linear_attention\": " + types[i].dump());
      }
      if (interval == 0 && types[i] == "full_attention") interval = static_cast<int>(i) + 1;
    }
    if (interval == 0) {
      return InvalidArgumentError("config field 'layer_types' has no full_attention layer");
    }
    for (size_t i = 0; i < types.size(); ++i) {
      const bool full = (i + 1) % static_cast<size_t>(interval) == 0;
      if ((types[i] == "full_attention") != full) {
        return InvalidArgumentError("config field 'layer_types' is not periodic (every " +
                                    std::to_string(interval) + "th layer full attention): layer " +
                                    std::to_string(i) + " is " + types[i].get<std::string>());
      }
    }
  } else {
    ASSIGN_OR_RETURN(interval, GetPositiveInt(config, "full_attention_interval"));
  }
  if (interval > g.num_layers) {
    return InvalidArgumentError("full-attention interval " + std::to_string(interval) +
                                " leaves no full-attention layer among " +
                                std::to_string(g.num_layers));
  }
  g.full_attention_interval = interval;
  const int full = g.num_layers / interval;
  g.num_linear_layers = g.num_layers - full;
  g.num_layers = full;
  g.linear_state_dtype = DType::kFloat32;
  if (HasValue(config, "mamba_ssm_dtype")) {
    const Json& value = config["mamba_ssm_dtype"];
    if (!value.is_string()) {
      return InvalidArgumentError("config field 'mamba_ssm_dtype' is not a string: " +
                                  value.dump());
    }
    StatusOr<DType> dtype = ParseDType(value.get<std::string>());
    if (!dtype.ok()) return dtype.status().WithContext("config field 'mamba_ssm_dtype'");
    g.linear_state_dtype = *dtype;
  }
  return OkStatus();
}

StatusOr<ModelGeometry> ParseHfConfig(std::string_view json_text, std::string name) {
  Json root = Json::parse(json_text.begin(), json_text.end(), /*cb=*/nullptr,
                          /*allow_exceptions=*/false);
  if (root.is_discarded()) return InvalidArgumentError("config is not valid JSON");
  if (!root.is_object()) return InvalidArgumentError("config is not a JSON object");
  // Multimodal configs (Qwen3.5) keep the language model's fields under "text_config".
  const bool nested = !HasValue(root, "num_hidden_layers") && root.contains("text_config") &&
                      root["text_config"].is_object();
  const Json& config = nested ? root["text_config"] : root;

  ModelGeometry g;
  g.name = std::move(name);
  ASSIGN_OR_RETURN(g.num_layers, GetPositiveInt(config, "num_hidden_layers"));
  ASSIGN_OR_RETURN(g.num_attention_heads, GetPositiveInt(config, "num_attention_heads"));
  ASSIGN_OR_RETURN(g.hidden_size, GetPositiveInt(config, "hidden_size"));

  // transformers >= 4.56 writes "dtype"; older configs "torch_dtype".
  const Json& dtype_source =
      HasValue(config, "torch_dtype") || HasValue(config, "dtype") ? config : root;
  const char* dtype_field = HasValue(dtype_source, "torch_dtype") ? "torch_dtype" : "dtype";
  if (HasValue(dtype_source, dtype_field)) {
    const Json& value = dtype_source[dtype_field];
    if (!value.is_string()) {
      return InvalidArgumentError(std::string("config field '") + dtype_field +
                                  "' is not a string: " + value.dump());
    }
    StatusOr<DType> dtype = ParseDType(value.get<std::string>());
    if (!dtype.ok())
      return dtype.status().WithContext(std::string("config field '") + dtype_field + "'");
    g.dtype = *dtype;
  }

  if (HasValue(config, "kv_lora_rank")) {
    // DeepSeek MLA: the cache holds one latent per token per layer (SGLang MLATokenToKVPool).
    g.attention = AttentionKind::kMla;
    ASSIGN_OR_RETURN(g.kv_lora_rank, GetPositiveInt(config, "kv_lora_rank"));
    ASSIGN_OR_RETURN(g.qk_rope_head_dim, GetPositiveInt(config, "qk_rope_head_dim"));
    g.num_kv_heads = 1;
    g.head_dim = g.kv_lora_rank + g.qk_rope_head_dim;
    return g;
  }

  g.attention = AttentionKind::kMha;
  ASSIGN_OR_RETURN(g.num_kv_heads,
                   GetPositiveIntOr(config, "num_key_value_heads", g.num_attention_heads));
  if (g.num_attention_heads % g.num_kv_heads != 0) {
    return InvalidArgumentError(
        "config field 'num_key_value_heads' (" + std::to_string(g.num_kv_heads) +
        ") does not divide num_attention_heads (" + std::to_string(g.num_attention_heads) + ")");
  }
  if (HasValue(config, "head_dim")) {
    ASSIGN_OR_RETURN(g.head_dim, GetPositiveInt(config, "head_dim"));
  } else {
    if (g.hidden_size % g.num_attention_heads != 0) {
      return InvalidArgumentError(
          "config has no 'head_dim' and hidden_size / num_attention_heads = " +
          std::to_string(g.hidden_size) + " / " + std::to_string(g.num_attention_heads) +
          " is not an integer");
    }
    g.head_dim = g.hidden_size / g.num_attention_heads;
  }
  if (HasValue(config, "linear_num_value_heads")) RETURN_IF_ERROR(ParseLinearAttention(config, g));
  return g;
}

StatusOr<ModelGeometry> LoadHfConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError("cannot read model config '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return NotFoundError("cannot read model config '" + path + "'");

  const std::filesystem::path p(path);
  std::string name = p.stem().string();
  if (p.filename() == "config.json") {
    const std::string dir = std::filesystem::absolute(p).parent_path().filename().string();
    if (!dir.empty()) name = dir;
  }
  StatusOr<ModelGeometry> g = ParseHfConfig(text.str(), std::move(name));
  if (!g.ok()) return g.status().WithContext("model config '" + path + "'");
  return g;
}

StatusOr<KvLayout> KvLayout::Create(const ModelGeometry& geometry, int page_size) {
  if (page_size < 1) {
    return InvalidArgumentError("page_size must be >= 1 tokens, got " + std::to_string(page_size));
  }
  const std::string what = "model '" + geometry.name + "': ";
  if (geometry.num_layers < 1) {
    return InvalidArgumentError(what + "num_layers must be >= 1, got " +
                                std::to_string(geometry.num_layers));
  }
  if (geometry.num_layers > std::numeric_limits<int>::max() / 2) {
    return InvalidArgumentError(what + "num_layers too large");
  }
  KvLayout layout;
  layout.geometry_ = geometry;
  layout.page_size_ = page_size;
  const uint64_t elem = DTypeSize(geometry.dtype);
  if (geometry.attention == AttentionKind::kMla) {
    if (geometry.kv_lora_rank < 1 || geometry.qk_rope_head_dim < 0) {
      return InvalidArgumentError(what + "MLA needs kv_lora_rank >= 1 and qk_rope_head_dim >= 0");
    }
    layout.num_buffers_ = geometry.num_layers;
    layout.heads_per_token_ = 1;
    layout.head_bytes_ =
        static_cast<uint64_t>(geometry.kv_lora_rank + geometry.qk_rope_head_dim) * elem;
  } else {
    if (geometry.num_kv_heads < 1 || geometry.head_dim < 1) {
      return InvalidArgumentError(what + "needs num_kv_heads >= 1 and head_dim >= 1, got " +
                                  std::to_string(geometry.num_kv_heads) + " and " +
                                  std::to_string(geometry.head_dim));
    }
    layout.num_buffers_ = 2 * geometry.num_layers;
    layout.heads_per_token_ = geometry.num_kv_heads;
    layout.head_bytes_ = static_cast<uint64_t>(geometry.head_dim) * elem;
  }
  return layout;
}

std::vector<PageRun> CoalescePageRuns(std::span<const int32_t> src_pages,
                                      std::span<const int32_t> dst_pages) {
  std::vector<PageRun> runs;
  if (src_pages.size() != dst_pages.size() || src_pages.empty()) return runs;
  PageRun run{src_pages[0], dst_pages[0], 1};
  for (size_t i = 1; i < src_pages.size(); ++i) {
    if (src_pages[i] == run.src_page + run.num_pages &&
        dst_pages[i] == run.dst_page + run.num_pages) {
      ++run.num_pages;
    } else {
      runs.push_back(run);
      run = PageRun{src_pages[i], dst_pages[i], 1};
    }
  }
  runs.push_back(run);
  return runs;
}

}  // namespace kvferry
