// Aux rows in GPU memory next to a busy model: decode checks a finished room's aux row
// (ReadRoom) and frees rows (FreeRow) while its model keeps the legacy default stream busy,
// where PyTorch runs by default. Neither may wait for that model's work. Skips without a GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "cuda/device_ops.h"
#include "kvferry/aux_buffer.h"
#include "tools/gpu/baselines.h"
#include "tools/gpu/gpu_pattern.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;

TEST(AuxBufferGpuTest, RoomChecksAndFreesDoNotWaitForTheDefaultStream) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto layout = AuxLayout::Create(64, DType::kBFloat16);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  auto aux = AuxBuffer::CreateOnDevice(*layout, 4, 0);
  ASSERT_TRUE(aux.ok()) << aux.status().ToString();
  auto row = (*aux)->AllocateRow();
  ASSERT_TRUE(row.ok());
  const uint64_t room = 0x1234'5678'9abc'def0ULL;
  // Rows are kvferry's own (cuMemCreate) allocation: the copies must find their device.
  Status put = cuda::CopyToDevice((*aux)->Row(*row) + layout->room_offset(), &room, sizeof(room));
  ASSERT_TRUE(put.ok()) << put.ToString();

  // A "forward step" of 2 s on the legacy default stream.
  auto model = cuda::ComputeStream::Create(0, 1, /*legacy_default_stream=*/true);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const auto start = Clock::now();
  ASSERT_TRUE((*model)->Spin(2'000'000).ok());
  EXPECT_EQ((*aux)->ReadRoom(*row), room);
  ASSERT_TRUE((*aux)->FreeRow(*row).ok());
  std::vector<uint8_t> zeros((*layout).row_bytes(), 0xff);
  ASSERT_TRUE(cuda::CopyToHost(zeros.data(), (*aux)->Row(*row), zeros.size()).ok());
  const auto elapsed = Clock::now() - start;
  EXPECT_LT(elapsed, std::chrono::milliseconds(1000))
      << "the aux row operations waited for the default stream's kernel";
  EXPECT_EQ(zeros, std::vector<uint8_t>(zeros.size(), 0));  // FreeRow zeroed the row
  ASSERT_TRUE((*model)->Synchronize().ok());
}

// Polls RoomSeen for up to `limit`; whether it said true.
bool SeenWithin(const AuxBuffer& aux, int32_t row, uint64_t room, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    if (aux.RoomSeen(row, room)) return true;
  }
  return false;
}

// Background reads of a GPU row's room: never true before the room is written, true soon
// after (also while a model keeps the legacy default stream busy), false again once the row
// was freed; a wrong room is never seen. Host rows answer directly.
TEST(AuxBufferGpuTest, RoomSeenByBackgroundReads) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  using std::chrono::milliseconds;
  auto layout = AuxLayout::Create(64, DType::kBFloat16);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  auto aux = AuxBuffer::CreateOnDevice(*layout, 8, 0);
  ASSERT_TRUE(aux.ok()) << aux.status().ToString();
  auto row = (*aux)->AllocateRow();
  ASSERT_TRUE(row.ok());
  const uint64_t room = 0x8000'0000'0000'0007ULL;
  EXPECT_FALSE(SeenWithin(**aux, *row, room, milliseconds(20))) << "seen before it was written";
  auto model = cuda::ComputeStream::Create(0, 1, /*legacy_default_stream=*/true);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ASSERT_TRUE((*model)->Spin(2'000'000).ok());  // a 2 s "forward step"
  const auto start = Clock::now();
  ASSERT_TRUE(cuda::CopyToDevice((*aux)->Row(*row) + layout->room_offset(), &room, 8).ok());
  EXPECT_TRUE(SeenWithin(**aux, *row, room, milliseconds(500)));
  EXPECT_LT(Clock::now() - start, milliseconds(500)) << "waited for the default stream";
  EXPECT_FALSE(SeenWithin(**aux, *row, room + 1, milliseconds(5)));
  EXPECT_TRUE((*aux)->RoomSeen(*row, room));  // its last read showed it: no new read needed
  ASSERT_TRUE((*aux)->FreeRow(*row).ok());
  EXPECT_FALSE(SeenWithin(**aux, *row, room, milliseconds(20))) << "seen after FreeRow";
  ASSERT_TRUE((*model)->Synchronize().ok());

  auto host = AuxBuffer::Create(*layout, 2);
  ASSERT_TRUE(host.ok());
  std::memcpy((*host)->Row(1) + layout->room_offset(), &room, 8);
  EXPECT_TRUE((*host)->RoomSeen(1, room));
  EXPECT_FALSE((*host)->RoomSeen(0, room));
}

TEST(AuxBufferGpuTest, DeviceCopiesRefuseHostAddressesAndCrossTheScratchSize) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::vector<uint8_t> host(16);
  EXPECT_EQ(cuda::CopyToHost(host.data(), host.data() + 8, 8).code(), StatusCode::kInvalidArgument);
  // 3 MiB + 5 bytes: several pieces through the 1 MiB pinned scratch, and an odd tail.
  auto layout = AuxLayout::Create(0, DType::kBFloat16);
  ASSERT_TRUE(layout.ok());
  const int32_t rows =
      static_cast<int32_t>(((3u << 20) + 5 + layout->row_bytes() - 1) / layout->row_bytes());
  auto aux = AuxBuffer::CreateOnDevice(*layout, rows, 0);
  ASSERT_TRUE(aux.ok()) << aux.status().ToString();
  const uint64_t n = (3u << 20) + 5;
  std::vector<uint8_t> in(n), out(n, 0);
  for (uint64_t i = 0; i < n; ++i) in[i] = static_cast<uint8_t>(i * 131 + (i >> 11));
  (*aux)->RoomSeen(0, 1);  // a background read, not waited for: must not touch the upload
  ASSERT_TRUE(cuda::CopyToDevice((*aux)->data() + 3, in.data(), n - 3).ok());
  ASSERT_TRUE(cuda::CopyToHost(out.data(), (*aux)->data() + 3, n - 3).ok());
  EXPECT_EQ(0, std::memcmp(in.data(), out.data(), n - 3));
}

}  // namespace
}  // namespace kvferry
