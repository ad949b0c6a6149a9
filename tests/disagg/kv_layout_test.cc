#include "kvferry/kv_layout.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvferry/state_pool.h"
#include "tools/kv_pattern.h"
#include "tools/kv_pattern_math.h"

namespace kvferry {
namespace {

TEST(DTypeTest, ParsesAliasesAndRejectsUnknown) {
  const std::map<std::string, DType> cases = {
      {"bfloat16", DType::kBFloat16}, {"bf16", DType::kBFloat16},
      {"float16", DType::kFloat16},   {"fp16", DType::kFloat16},
      {"half", DType::kFloat16},      {"float32", DType::kFloat32},
      {"fp32", DType::kFloat32},      {"float", DType::kFloat32},
      {"fp8", DType::kFloat8E4M3},    {"float8_e4m3fn", DType::kFloat8E4M3},
  };
  for (const auto& [text, dtype] : cases) {
    StatusOr<DType> parsed = ParseDType(text);
    ASSERT_TRUE(parsed.ok()) << text << ": " << parsed.status().ToString();
    EXPECT_EQ(*parsed, dtype) << text;
  }
  StatusOr<DType> bad = ParseDType("int7");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("int7"), std::string::npos);

  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(DTypeName(DType::kBFloat16), "bfloat16");
  EXPECT_EQ(DTypeName(DType::kFloat16), "float16");
  EXPECT_EQ(DTypeName(DType::kFloat32), "float32");
  EXPECT_EQ(DTypeName(DType::kFloat8E4M3), "float8_e4m3fn");
}

TEST(ModelPresetsTest, KnownBytesPerToken) {
  const std::map<std::string, uint64_t> expected = {
      {"llama-3.1-8b", 131072},      {"llama-3.1-70b", 327680},    {"qwen3-8b", 147456},
      {"qwen3-32b", 262144},         {"qwen3-235b-a22b", 192512},  {"deepseek-v3", 70272},
      {"qwen3-next-80b-a3b", 24576}, {"qwen3.5-397b-a17b", 30720},  // full-attention layers only
  };
  ASSERT_EQ(ModelPresets().size(), expected.size());
  for (const auto& [name, bytes] : expected) {
    StatusOr<ModelGeometry> g = FindModelPreset(name);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ(g->KvBytesPerToken(), bytes) << name;
  }
  StatusOr<ModelGeometry> missing = FindModelPreset("gpt-5");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("gpt-5"), std::string::npos);
  EXPECT_NE(missing.status().message().find("deepseek-v3"), std::string::npos);
}

TEST(ModelPresetsTest, MatchSharedModelsJson) {
  const std::string path = std::string(KVFERRY_SOURCE_DIR) + "/../shared/models/models.json";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not present";
  std::ifstream in(path);
  nlohmann::json models = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(models.is_discarded()) << path;
  int matched = 0;
  for (const nlohmann::json& m : models["models"]) {
    const std::string name = m["name"].get<std::string>();
    const std::string attention = m["attention"].get<std::string>();
    StatusOr<ModelGeometry> g = FindModelPreset(name);
    ASSERT_TRUE(g.ok()) << "models.json lists " << name << " but there is no preset";
    EXPECT_EQ(g->KvBytesPerToken(), m["kv_bytes_per_token"].get<uint64_t>()) << name;
    EXPECT_EQ(g->num_model_layers(), m["num_hidden_layers"].get<int>()) << name;
    if (attention == "hybrid") {
      EXPECT_TRUE(g->hybrid()) << name;
      EXPECT_EQ(g->StateBytesPerRequest(), m["state_bytes_per_request"].get<uint64_t>()) << name;
      const auto& st = m["state_per_linear_layer"];
      EXPECT_EQ(g->linear_conv_dim(), st["conv"]["shape"][0].get<int>()) << name;
      EXPECT_EQ(g->linear_conv_kernel_dim - 1, st["conv"]["shape"][1].get<int>()) << name;
      EXPECT_EQ(g->linear_num_value_heads, st["recurrent"]["shape"][0].get<int>()) << name;
      // Every fourth layer ("3,7,11,...") is full attention.
      EXPECT_EQ(g->num_layers * 4, g->num_model_layers()) << name;
    } else {
      EXPECT_FALSE(g->hybrid()) << name;
    }
    EXPECT_EQ(g->hidden_size, m["hidden_size"].get<int>()) << name;
    EXPECT_EQ(g->num_attention_heads, m["num_attention_heads"].get<int>()) << name;
    if (attention == "mla") {
      EXPECT_EQ(g->attention, AttentionKind::kMla) << name;
      EXPECT_EQ(g->kv_lora_rank, m["kv_lora_rank"].get<int>()) << name;
      EXPECT_EQ(g->qk_rope_head_dim, m["qk_rope_head_dim"].get<int>()) << name;
    } else {  // GQA and the full-attention layers of hybrid models
      EXPECT_EQ(g->attention, AttentionKind::kMha) << name;
      EXPECT_EQ(g->num_kv_heads, m["num_key_value_heads"].get<int>()) << name;
      EXPECT_EQ(g->head_dim, m["head_dim"].get<int>()) << name;
    }
    ++matched;
  }
  EXPECT_EQ(matched, static_cast<int>(ModelPresets().size()));
}

TEST(KvLayoutTest, Llama8bPage64) {
  StatusOr<KvLayout> layout = KvLayout::Create(*FindModelPreset("llama-3.1-8b"), 64);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->page_size(), 64);
  EXPECT_EQ(layout->num_buffers(), 64);
  EXPECT_EQ(layout->heads_per_token(), 8);
  EXPECT_EQ(layout->head_bytes(), 256u);
  EXPECT_EQ(layout->token_bytes(), 2048u);
  EXPECT_EQ(layout->page_bytes(), 131072u);  // 64 * 8 * 128 * 2
  EXPECT_EQ(layout->bytes_per_page_all_buffers(), 64u * 131072u);
  EXPECT_EQ(layout->bytes_per_page_all_buffers(), 64u * layout->geometry().KvBytesPerToken());
  EXPECT_EQ(layout->BufferLayer(0), 0);
  EXPECT_FALSE(layout->BufferIsValue(0));
  EXPECT_EQ(layout->BufferLayer(31), 31);
  EXPECT_FALSE(layout->BufferIsValue(31));
  EXPECT_EQ(layout->BufferLayer(32), 0);
  EXPECT_TRUE(layout->BufferIsValue(32));
  EXPECT_EQ(layout->BufferLayer(63), 31);
  EXPECT_TRUE(layout->BufferIsValue(63));
  EXPECT_EQ(layout->NumPages(0), 0);
  EXPECT_EQ(layout->NumPages(1), 1);
  EXPECT_EQ(layout->NumPages(64), 1);
  EXPECT_EQ(layout->NumPages(65), 2);
  EXPECT_EQ(layout->NumPages(1000), 16);
}

TEST(KvLayoutTest, DeepSeekMla) {
  StatusOr<KvLayout> layout = KvLayout::Create(*FindModelPreset("deepseek-v3"), 1);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->num_buffers(), 61);
  EXPECT_EQ(layout->heads_per_token(), 1);
  EXPECT_EQ(layout->head_bytes(), 576u * 2);
  EXPECT_EQ(layout->token_bytes(), 1152u);
  EXPECT_EQ(layout->page_bytes(), 1152u);
  EXPECT_EQ(layout->bytes_per_page_all_buffers(), 70272u);
  EXPECT_EQ(layout->BufferLayer(60), 60);
  EXPECT_FALSE(layout->BufferIsValue(60));
  EXPECT_EQ(layout->NumPages(7), 7);
}

// Page counts of the largest token counts, without overflow.
TEST(KvLayoutTest, NumPagesOfHugeRequestsDoesNotOverflow) {
  for (int page_size : {1, 7, 16}) {
    StatusOr<KvLayout> layout = KvLayout::Create(*FindModelPreset("qwen3-8b"), page_size);
    ASSERT_TRUE(layout.ok());
    const int64_t max = std::numeric_limits<int64_t>::max();
    EXPECT_EQ(layout->NumPages(max), max / page_size + (max % page_size != 0)) << page_size;
    EXPECT_EQ(layout->NumPages(max - 1), (max - 1) / page_size + ((max - 1) % page_size != 0));
    EXPECT_EQ(layout->NumPages(std::numeric_limits<int64_t>::min()), 0);
  }
}

TEST(KvLayoutTest, RejectsBadInput) {
  ModelGeometry g = *FindModelPreset("qwen3-8b");
  EXPECT_EQ(KvLayout::Create(g, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KvLayout::Create(g, -4).status().code(), StatusCode::kInvalidArgument);
  ModelGeometry no_layers = g;
  no_layers.num_layers = 0;
  EXPECT_EQ(KvLayout::Create(no_layers, 16).status().code(), StatusCode::kInvalidArgument);
  ModelGeometry no_heads = g;
  no_heads.num_kv_heads = 0;
  EXPECT_EQ(KvLayout::Create(no_heads, 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KvLayout::Create(ModelGeometry{}, 16).status().code(), StatusCode::kInvalidArgument);
}

TEST(HfConfigTest, LlamaLike) {
  const char* config = R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "vocab_size": 128256})";
  StatusOr<ModelGeometry> g = ParseHfConfig(config, "llama");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->name, "llama");
  EXPECT_EQ(g->attention, AttentionKind::kMha);
  EXPECT_EQ(g->num_layers, 32);
  EXPECT_EQ(g->num_attention_heads, 32);
  EXPECT_EQ(g->num_kv_heads, 8);
  EXPECT_EQ(g->head_dim, 128);  // 4096 / 32
  EXPECT_EQ(g->hidden_size, 4096);
  EXPECT_EQ(g->dtype, DType::kBFloat16);
  EXPECT_EQ(g->KvBytesPerToken(), 131072u);
}

TEST(HfConfigTest, DefaultsKvHeadsAndDtype) {
  StatusOr<ModelGeometry> g = ParseHfConfig(
      R"({"hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12})", "gpt");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->num_kv_heads, 12);
  EXPECT_EQ(g->head_dim, 64);
  EXPECT_EQ(g->dtype, DType::kBFloat16);

  StatusOr<ModelGeometry> fp16 = ParseHfConfig(
      R"({"hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
          "dtype": "float16"})",
      "gpt");
  ASSERT_TRUE(fp16.ok()) << fp16.status().ToString();
  EXPECT_EQ(fp16->dtype, DType::kFloat16);
  EXPECT_EQ(fp16->KvBytesPerToken(), 2u * 12 * 12 * 64 * 2);
}

TEST(HfConfigTest, Qwen3_32bExplicitHeadDim) {
  const char* config = R"({
    "architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "hidden_size": 5120,
    "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8,
    "torch_dtype": "bfloat16", "tie_word_embeddings": false})";
  StatusOr<ModelGeometry> g = ParseHfConfig(config, "qwen3-32b");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->head_dim, 128);  // not 5120 / 64 = 80
  EXPECT_EQ(g->num_kv_heads, 8);
  EXPECT_EQ(g->KvBytesPerToken(), 262144u);
  EXPECT_EQ(g->KvBytesPerToken(), FindModelPreset("qwen3-32b")->KvBytesPerToken());
}

TEST(HfConfigTest, DeepSeekMla) {
  const char* config = R"({
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "kv_lora_rank": 512,
    "num_attention_heads": 128, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "torch_dtype": "bfloat16"})";
  StatusOr<ModelGeometry> g = ParseHfConfig(config, "dsv3");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->attention, AttentionKind::kMla);
  EXPECT_EQ(g->num_layers, 61);
  EXPECT_EQ(g->kv_lora_rank, 512);
  EXPECT_EQ(g->qk_rope_head_dim, 64);
  EXPECT_EQ(g->num_kv_heads, 1);
  EXPECT_EQ(g->head_dim, 576);
  EXPECT_EQ(g->KvBytesPerToken(), 70272u);
  StatusOr<KvLayout> layout = KvLayout::Create(*g, 32);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->num_buffers(), 61);
  EXPECT_EQ(layout->page_bytes(), 32u * 1152u);
}

// Expects kInvalidArgument with `needle` in the message.
void ExpectConfigError(const std::string& config, const std::string& needle) {
  StatusOr<ModelGeometry> g = ParseHfConfig(config, "m");
  ASSERT_FALSE(g.ok()) << config;
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument) << g.status().ToString();
  EXPECT_NE(g.status().message().find(needle), std::string::npos)
      << "'" << g.status().message() << "' lacks '" << needle << "'";
}

TEST(HfConfigTest, MissingFields) {
  ExpectConfigError(R"({"hidden_size": 4096, "num_attention_heads": 32})", "num_hidden_layers");
  ExpectConfigError(R"({"hidden_size": 4096, "num_hidden_layers": 32})", "num_attention_heads");
  ExpectConfigError(R"({"num_attention_heads": 32, "num_hidden_layers": 32})", "hidden_size");
  ExpectConfigError(R"({"hidden_size": 7168, "num_attention_heads": 128,
                        "num_hidden_layers": 61, "kv_lora_rank": 512})",
                    "qk_rope_head_dim");
}

TEST(HfConfigTest, InvalidValues) {
  ExpectConfigError(R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                        "torch_dtype": "int3"})",
                    "int3");
  ExpectConfigError(R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 0})",
                    "num_hidden_layers");
  ExpectConfigError(R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": -2})",
                    "num_hidden_layers");
  ExpectConfigError(R"({"hidden_size": 4096, "num_attention_heads": 0, "num_hidden_layers": 2})",
                    "num_attention_heads");
  ExpectConfigError(R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 2,
                        "num_key_value_heads": 0})",
                    "num_key_value_heads");
  ExpectConfigError(R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 2,
                        "num_key_value_heads": 5})",
                    "num_key_value_heads");
  ExpectConfigError(R"({"hidden_size": 1000, "num_attention_heads": 48, "num_hidden_layers": 2})",
                    "head_dim");
  ExpectConfigError(R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 2,
                        "head_dim": 12.5})",
                    "head_dim");
  ExpectConfigError(
      R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": "32"})",
      "num_hidden_layers");
  ExpectConfigError("{not json", "JSON");
  ExpectConfigError("[1, 2]", "object");
}

TEST(HfConfigTest, LoadFileNamesDirectoryAndErrors) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("kvferry_cfg_" + std::to_string(getpid())) / "My-Model";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "config.json").string();
  {
    std::ofstream out(path);
    out << R"({"hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 4,
               "num_key_value_heads": 4, "torch_dtype": "float32"})";
  }
  StatusOr<ModelGeometry> g = LoadHfConfig(path);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->name, "My-Model");
  EXPECT_EQ(g->dtype, DType::kFloat32);
  EXPECT_EQ(g->KvBytesPerToken(), 2u * 4 * 4 * 128 * 4);

  {
    std::ofstream out(path);
    out << R"({"hidden_size": 2048})";
  }
  StatusOr<ModelGeometry> bad = LoadHfConfig(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(path), std::string::npos);
  EXPECT_NE(bad.status().message().find("num_hidden_layers"), std::string::npos);

  const std::string missing = (dir / "nope.json").string();
  StatusOr<ModelGeometry> none = LoadHfConfig(missing);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find(missing), std::string::npos);
  std::filesystem::remove_all(dir.parent_path());
}

std::vector<PageRun> Runs(std::vector<int32_t> src, std::vector<int32_t> dst) {
  return CoalescePageRuns(src, dst);
}

TEST(CoalescePageRunsTest, Cases) {
  EXPECT_TRUE(Runs({}, {}).empty());
  EXPECT_EQ(Runs({7}, {3}), (std::vector<PageRun>{{7, 3, 1}}));
  EXPECT_EQ(Runs({4, 5, 6, 7}, {10, 11, 12, 13}), (std::vector<PageRun>{{4, 10, 4}}));
  EXPECT_EQ(Runs({9, 2, 5}, {1, 7, 3}), (std::vector<PageRun>{{9, 1, 1}, {2, 7, 1}, {5, 3, 1}}));
  // Source consecutive, destination not: no merging.
  EXPECT_EQ(Runs({0, 1, 2}, {5, 9, 6}), (std::vector<PageRun>{{0, 5, 1}, {1, 9, 1}, {2, 6, 1}}));
  // Destination consecutive, source not.
  EXPECT_EQ(Runs({3, 8, 9}, {0, 1, 2}), (std::vector<PageRun>{{3, 0, 1}, {8, 1, 2}}));
  // Mixed runs, including a descending pair that must not merge.
  EXPECT_EQ(Runs({10, 11, 12, 40, 41, 5, 4, 20}, {0, 1, 2, 3, 4, 5, 6, 7}),
            (std::vector<PageRun>{{10, 0, 3}, {40, 3, 2}, {5, 5, 1}, {4, 6, 1}, {20, 7, 1}}));
  // Unequal sizes: empty by contract.
  EXPECT_TRUE(Runs({1, 2}, {1}).empty());
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

TEST(HybridGeometryTest, ModelLayersMapToAttentionOrLinearLayers) {
  const ModelGeometry g = *FindModelPreset("qwen3-next-80b-a3b");
  EXPECT_EQ(g.num_layers, 12);
  EXPECT_EQ(g.num_linear_layers, 36);
  EXPECT_EQ(g.KvBytesPerToken(), 24576u);
  EXPECT_EQ(g.StateBytesPerRequest(), 77266944u);
  struct Want {
    int layer;
    bool linear;
    int index;
  };
  for (const Want& w : {Want{0, true, 0}, Want{2, true, 2}, Want{3, false, 0}, Want{4, true, 3},
                        Want{7, false, 1}, Want{46, true, 35}, Want{47, false, 11}}) {
    auto ref = g.ModelLayer(w.layer);
    EXPECT_EQ(ref.linear, w.linear) << "layer " << w.layer;
    EXPECT_EQ(ref.index, w.index) << "layer " << w.layer;
  }
  // Every attention and every linear index is reached exactly once.
  std::vector<int> full(g.num_layers), linear(g.num_linear_layers);
  for (int l = 0; l < g.num_model_layers(); ++l) {
    auto ref = g.ModelLayer(l);
    ++(ref.linear ? linear : full)[ref.index];
  }
  for (int n : full) EXPECT_EQ(n, 1);
  for (int n : linear) EXPECT_EQ(n, 1);
  const ModelGeometry llama = *FindModelPreset("llama-3.1-8b");
  EXPECT_FALSE(llama.ModelLayer(5).linear);
  EXPECT_EQ(llama.ModelLayer(5).index, 5);
  EXPECT_EQ(llama.StateBytesPerRequest(), 0u);
}

TEST(HybridGeometryTest, HfConfigWithIntervalLayerTypesOrTextConfig) {
  const std::string interval = R"({"num_hidden_layers": 48, "num_attention_heads": 16,
      "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
      "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
      "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
      "torch_dtype": "bfloat16"})";
  auto g = ParseHfConfig(interval, "next");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->num_layers, 12);
  EXPECT_EQ(g->num_linear_layers, 36);
  EXPECT_EQ(g->StateBytesPerRequest(),
            FindModelPreset("qwen3-next-80b-a3b")->StateBytesPerRequest());

  std::string types = "[";
  for (int l = 0; l < 8; ++l) {
    types += std::string(l ? "," : "") +
             ((l + 1) % 4 == 0 ? "\"full_attention\"" : "\"linear_attention\"");
  }
  types += "]";
  const std::string nested = R"({"dtype": "bfloat16", "text_config": {"num_hidden_layers": 8,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
      "layer_types": )" + types +
                             R"(, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
      "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
      "mamba_ssm_dtype": "bfloat16"}})";
  g = ParseHfConfig(nested, "nested");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->num_layers, 2);
  EXPECT_EQ(g->num_linear_layers, 6);
  EXPECT_EQ(g->full_attention_interval, 4);
  EXPECT_EQ(g->linear_state_dtype, DType::kBFloat16);

  std::string bad = nested;
  bad.replace(bad.find("\"linear_attention\""), 18, "\"full_attention\"");
  g = ParseHfConfig(bad, "bad");
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("layer_types"), std::string::npos) << g.status().ToString();

  std::string missing = interval;
  missing.replace(missing.find("\"linear_conv_kernel_dim\": 4,"), 28, "");
  g = ParseHfConfig(missing, "missing");
  EXPECT_NE(g.status().message().find("linear_conv_kernel_dim"), std::string::npos)
      << g.status().ToString();
}

TEST(StateLayoutTest, TpSharesSplitRows) {
  const ModelGeometry g = *FindModelPreset("qwen3-next-80b-a3b");
  auto whole = StateLayout::Create(g, 1);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(whole->num_buffers(), 72);
  EXPECT_EQ(whole->rows(0), 8192);
  EXPECT_EQ(whole->row_bytes(0), 6u);  // 3 bf16
  EXPECT_EQ(whole->rows(36), 32);
  EXPECT_EQ(whole->row_bytes(36), 128u * 128u * 4u);
  EXPECT_EQ(whole->bytes_per_slot_all_buffers(), g.StateBytesPerRequest());
  auto half = StateLayout::Create(g, 2);
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(half->rows(0), 4096);
  EXPECT_EQ(half->rows(40), 16);
  EXPECT_EQ(half->bytes_per_slot_all_buffers() * 2, g.StateBytesPerRequest());
  auto three = StateLayout::Create(g, 3);
  EXPECT_EQ(three.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(three.status().message().find("8192"), std::string::npos) << three.status().ToString();
  EXPECT_EQ(StateLayout::Create(*FindModelPreset("llama-3.1-8b"), 1).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(StatePoolTest, SlotsAreDisjointAndPatternsAgreeAcrossTpShares) {
  const ModelGeometry g = *FindModelPreset("qwen3-next-80b-a3b");
  auto l1 = *StateLayout::Create(g, 1);
  auto l2 = *StateLayout::Create(g, 2);
  auto pool1 = StatePool::Create(l1, 2);
  ASSERT_TRUE(pool1.ok()) << pool1.status().ToString();
  EXPECT_EQ((*pool1)->size_bytes(), 2 * g.StateBytesPerRequest());
  // Buffers tile the pool in order, each [slot][slot_bytes].
  uint64_t offset = 0;
  for (int b = 0; b < l1.num_buffers(); ++b) {
    ASSERT_EQ(static_cast<uint64_t>((*pool1)->BufferBase(b) - (*pool1)->data()), offset) << b;
    EXPECT_EQ((*pool1)->SlotAddress(b, 1) - (*pool1)->SlotAddress(b, 0),
              static_cast<ptrdiff_t>(l1.slot_bytes(b)));
    offset += 2 * l1.slot_bytes(b);
  }
  EXPECT_EQ(offset, (*pool1)->size_bytes());
  auto pool2 = std::move(*StatePool::Create(l2, 1));
  FillStateSlot(l1, **pool1, 1, 42, 0);
  EXPECT_TRUE(VerifyStateSlot(l1, **pool1, 1, 42, 0).ok());
  EXPECT_FALSE(VerifyStateSlot(l1, **pool1, 0, 42, 0).ok());  // slot 0 never written
  // TP rank 1 of 2 holds the second half of every segment: of the value heads for the
  // recurrent state, of each of q, k and v for the conv state ([q_1 | k_1 | v_1]).
  FillStateSlot(l2, *pool2, 0, 42, 1);
  for (int b : {36, 71}) {
    const uint64_t half = l2.slot_bytes(b);
    EXPECT_EQ(std::memcmp(pool2->SlotAddress(b, 0), (*pool1)->SlotAddress(b, 1) + half, half), 0)
        << b;
  }
  EXPECT_EQ(l1.SegmentRows(0), (std::vector<int>{2048, 2048, 4096}));
  EXPECT_EQ(l2.SegmentOffset(0, 2, 2), 2048);
  EXPECT_EQ(l2.GlobalRow(0, 1, 0), 1024);     // q channel 1024
  EXPECT_EQ(l2.GlobalRow(0, 1, 1024), 3072);  // k channel 1024
  EXPECT_EQ(l2.GlobalRow(0, 1, 2048), 6144);  // v channel 2048
  const uint64_t row = l1.row_bytes(0);
  for (int b : {0, 35}) {
    int local = 0, global = 0;
    for (int total : l1.SegmentRows(b)) {
      const uint64_t n = static_cast<uint64_t>(total / 2) * row;
      EXPECT_EQ(std::memcmp(pool2->SlotAddress(b, 0) + local * row,
                            (*pool1)->SlotAddress(b, 1) + (global + total / 2) * row, n),
                0)
          << "buffer " << b << " segment at " << global;
      local += total / 2;
      global += total;
    }
  }
  // One flipped byte is found and named.
  (*pool1)->SlotAddress(40, 1)[5] ^= 1;
  VerifyResult v = VerifyStateSlot(l1, **pool1, 1, 42, 0);
  EXPECT_EQ(v.pages_mismatched, 1);
  EXPECT_NE(v.first_mismatch.find("(linear layer 4 recurrent) row 0 byte 5"), std::string::npos)
      << v.first_mismatch;
}

// StateRowSeeds gives, row by row, the seeds FillStateBuffer writes with (the GPU replay
// writes state from them): rows written word by word from the seeds verify, for both ranks
// of TP 2 and for TP 1, conv (6-byte rows) and recurrent buffers.
TEST(StatePoolTest, RowSeedsReproduceTheStatePattern) {
  const ModelGeometry g = *FindModelPreset("qwen3-next-80b-a3b");
  for (int tp : {1, 2}) {
    const StateLayout l = *StateLayout::Create(g, tp);
    for (int rank = 0; rank < tp; ++rank) {
      for (int b : {0, 17, 36, 71}) {
        const std::vector<uint64_t> seeds = StateRowSeeds(l, b, 77, rank);
        ASSERT_EQ(seeds.size(), static_cast<size_t>(l.rows(b)));
        const uint64_t row_bytes = l.row_bytes(b);
        std::vector<uint8_t> slot(l.slot_bytes(b));
        for (size_t r = 0; r < seeds.size(); ++r) {
          for (uint64_t w = 0; w * 8 < row_bytes; ++w) {
            const uint64_t word = pattern::PatternWord(seeds[r], w);
            std::memcpy(slot.data() + r * row_bytes + w * 8, &word,
                        std::min<uint64_t>(8, row_bytes - w * 8));
          }
        }
        VerifyResult v = VerifyStateBuffer(l, b, slot.data(), 77, rank);
        EXPECT_EQ(v.pages_mismatched, 0)
            << "tp " << tp << " rank " << rank << " buffer " << b << ": " << v.first_mismatch;
        slot[row_bytes + 3] ^= 1;  // and a wrong byte is still seen
        EXPECT_EQ(VerifyStateBuffer(l, b, slot.data(), 77, rank).pages_mismatched, 1);
      }
    }
  }
}

}  // namespace
}  // namespace kvferry
