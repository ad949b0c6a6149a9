#include "common/env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <initializer_list>
#include <string>

namespace kvferry {
namespace {

// Each variable is read only through ReadEnvConfig: valid values arrive, invalid ones are an
// error naming the variable and the value.
TEST(EnvTest, SpinWindowsAreParsedAndBadValuesNamed) {
  ::setenv("KVFERRY_SPIN_US", "30", 1);
  ::setenv("KVFERRY_IDLE_SPIN_US", "1000", 1);
  auto ok = ReadEnvConfig();
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->spin_us, 30);
  EXPECT_EQ(ok->idle_spin_us, 1000);

  ::setenv("KVFERRY_IDLE_SPIN_US", "-5", 1);
  auto bad = ReadEnvConfig();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("KVFERRY_IDLE_SPIN_US='-5'"), std::string::npos)
      << bad.status().ToString();

  ::setenv("KVFERRY_IDLE_SPIN_US", "200000", 1);
  EXPECT_FALSE(ReadEnvConfig().ok());
  ::unsetenv("KVFERRY_IDLE_SPIN_US");
  ::setenv("KVFERRY_SPIN_US", "1x", 1);
  bad = ReadEnvConfig();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("KVFERRY_SPIN_US"), std::string::npos);
  ::unsetenv("KVFERRY_SPIN_US");
  EXPECT_TRUE(ReadEnvConfig().ok());
}

// Sets `var` to each of `values` in turn: each is refused with a message naming the variable
// and the value. Leaves `var` unset.
void ExpectEachRefusedByName(const char* var, std::initializer_list<const char*> values) {
  for (const char* v : values) {
    ::setenv(var, v, 1);
    auto bad = ReadEnvConfig();
    ASSERT_FALSE(bad.ok()) << var << "=" << v;
    EXPECT_NE(bad.status().message().find(std::string(var) + "='" + v), std::string::npos)
        << bad.status().ToString();
  }
  ::unsetenv(var);
}

TEST(EnvTest, ResidentBlocksAreParsedAndBadValuesNamed) {
  ::setenv("KVFERRY_NVLINK_RESIDENT_BLOCKS", "-1", 1);
  auto ok = ReadEnvConfig();
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->nvlink_resident_blocks, -1);
  ExpectEachRefusedByName("KVFERRY_NVLINK_RESIDENT_BLOCKS", {"-2", "5000", "two"});
  ok = ReadEnvConfig();
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(ok->nvlink_resident_blocks.has_value());
}

TEST(EnvTest, CopyBlocksPerSmAreParsedAndBadValuesNamed) {
  ::setenv("KVFERRY_NVLINK_BLOCKS_PER_SM", "8", 1);
  auto ok = ReadEnvConfig();
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->nvlink_blocks_per_sm, 8);
  ExpectEachRefusedByName("KVFERRY_NVLINK_BLOCKS_PER_SM", {"0", "9", "-1", "one"});
  EXPECT_FALSE(ReadEnvConfig()->nvlink_blocks_per_sm.has_value());
}

TEST(EnvTest, ResidentMinTilesAreParsedAndBadValuesNamed) {
  ::setenv("KVFERRY_NVLINK_RESIDENT_MIN_TILES", "0", 1);
  auto ok = ReadEnvConfig();
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->nvlink_resident_min_tiles, 0);
  ExpectEachRefusedByName("KVFERRY_NVLINK_RESIDENT_MIN_TILES", {"-1", "1073741825", "many"});
  EXPECT_FALSE(ReadEnvConfig()->nvlink_resident_min_tiles.has_value());
}

TEST(EnvTest, NvlinkStreamPriorityIsParsedAndBadValuesNamed) {
  ::setenv("KVFERRY_NVLINK_STREAM_PRIORITY", "normal", 1);
  auto env = ReadEnvConfig();
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(env->nvlink_stream_priority, "normal");
  ::setenv("KVFERRY_NVLINK_STREAM_PRIORITY", "urgent", 1);
  env = ReadEnvConfig();
  ASSERT_FALSE(env.ok());
  EXPECT_NE(
      env.status().message().find("KVFERRY_NVLINK_STREAM_PRIORITY='urgent' must be high or normal"),
      std::string::npos)
      << env.status().ToString();
  ::unsetenv("KVFERRY_NVLINK_STREAM_PRIORITY");
  env = ReadEnvConfig();
  ASSERT_TRUE(env.ok());
  EXPECT_FALSE(env->nvlink_stream_priority.has_value());
}

TEST(EnvTest, UcxSettingsAndCudaAllocAreParsedAndBadValuesNamed) {
  ::setenv("KVFERRY_UCX_GPU", "bounce", 1);
  ::setenv("KVFERRY_CUDA_ALLOC", "cudamalloc", 1);
  auto env = ReadEnvConfig();
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(env->ucx_gpu, "bounce");
  EXPECT_EQ(env->cuda_alloc, "cudamalloc");
  ::setenv("KVFERRY_UCX_GPU", "gpudirect", 1);
  env = ReadEnvConfig();
  ASSERT_FALSE(env.ok());
  EXPECT_NE(env.status().message().find("KVFERRY_UCX_GPU='gpudirect' must be direct or bounce"),
            std::string::npos)
      << env.status().ToString();
  ::unsetenv("KVFERRY_UCX_GPU");
  ::setenv("KVFERRY_CUDA_ALLOC", "vmm", 1);
  env = ReadEnvConfig();
  ASSERT_FALSE(env.ok());
  EXPECT_NE(env.status().message().find("KVFERRY_CUDA_ALLOC='vmm' must be cumem or cudamalloc"),
            std::string::npos)
      << env.status().ToString();
  ::unsetenv("KVFERRY_CUDA_ALLOC");
  env = ReadEnvConfig();
  ASSERT_TRUE(env.ok());
  EXPECT_FALSE(env->ucx_gpu.has_value());
  EXPECT_FALSE(env->cuda_alloc.has_value());
  ::setenv("KVFERRY_UCX_SPIN_US", "30", 1);
  env = ReadEnvConfig();
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->ucx_spin_us, 30);
  ExpectEachRefusedByName("KVFERRY_UCX_SPIN_US", {"-1", "100001", "soon"});
  EXPECT_FALSE(ReadEnvConfig()->ucx_spin_us.has_value());
}

TEST(EnvTest, UcxActiveMessageThresholdIsAByteSize) {
  ::setenv("KVFERRY_UCX_AM_THRESHOLD", "256KiB", 1);
  auto env = ReadEnvConfig();
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(env->ucx_am_threshold_bytes, 256u << 10);
  ::setenv("KVFERRY_UCX_AM_THRESHOLD", "0", 1);
  EXPECT_EQ(ReadEnvConfig()->ucx_am_threshold_bytes, 0u);
  ExpectEachRefusedByName("KVFERRY_UCX_AM_THRESHOLD", {"-1", "big", "12XB"});
  EXPECT_FALSE(ReadEnvConfig()->ucx_am_threshold_bytes.has_value());
}

TEST(EnvTest, UcxEagerLimitIsAByteSize) {
  ::setenv("KVFERRY_UCX_AM_EAGER", "512KiB", 1);
  auto env = ReadEnvConfig();
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(env->ucx_am_eager_bytes, 512u << 10);
  ::setenv("KVFERRY_UCX_AM_EAGER", "0", 1);
  EXPECT_EQ(ReadEnvConfig()->ucx_am_eager_bytes, 0u);
  ExpectEachRefusedByName("KVFERRY_UCX_AM_EAGER", {"-1", "lots", "3QB"});
  EXPECT_FALSE(ReadEnvConfig()->ucx_am_eager_bytes.has_value());
}

TEST(EnvTest, NvlinkCopyEngineMinRowIsAPositiveByteSize) {
  ::setenv("KVFERRY_NVLINK_CE_MIN_ROW", "2KiB", 1);
  auto env = ReadEnvConfig();
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(env->nvlink_ce_min_row_bytes, 2u << 10);
  ExpectEachRefusedByName("KVFERRY_NVLINK_CE_MIN_ROW", {"0", "-1", "wide"});
  EXPECT_FALSE(ReadEnvConfig()->nvlink_ce_min_row_bytes.has_value());
}

}  // namespace
}  // namespace kvferry
