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

StatusOr<ModelGeometry> ParseHfConfig(std::string_view json_text, std::string name) {
  Json config = Json::parse(json_text.begin(), json_text.end(), /*cb=*/nullptr,
                            /*allow_exceptions=*/false);
  if (config.is_discarded()) return InvalidArgumentError("config is not valid JSON");
  if (!config.is_object()) return InvalidArgumentError("config is not a JSON object");

  ModelGeometry g;
  g.name = std::move(name);
  ASSIGN_OR_RETURN(g.num_layers, GetPositiveInt(config, "num_hidden_layers"));
  ASSIGN_OR_RETURN(g.num_attention_heads, GetPositiveInt(config, "num_attention_heads"));
  ASSIGN_OR_RETURN(g.hidden_size, GetPositiveInt(config, "hidden_size"));

  // transformers >= 4.56 writes "dtype"; older configs "torch_dtype".
  const char* dtype_field = HasValue(config, "torch_dtype") ? "torch_dtype" : "dtype";
  if (HasValue(config, dtype_field)) {
    const Json& value = config[dtype_field];
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
