// Copy kernels' thread blocks shared by a process's NVLink channels on one GPU (see
// copy_block_share.h).
#include "transport/nvlink/copy_block_share.h"

#include <algorithm>
#include <array>

namespace kvferry {
namespace {

// Channels joined per device ordinal, for the life of the process.
std::array<std::atomic<int>, CopyBlockShare::kMaxDevices>& DeviceChannels() {
  static std::array<std::atomic<int>, CopyBlockShare::kMaxDevices> counts{};
  return counts;
}

}  // namespace

CopyBlockShare::~CopyBlockShare() {
  if (channels_ != nullptr) channels_->fetch_sub(1, std::memory_order_relaxed);
}

void CopyBlockShare::Join(int device, int blocks) {
  blocks_ = std::max(1, blocks);
  if (channels_ != nullptr || device < 0 || device >= kMaxDevices) return;
  channels_ = &DeviceChannels()[device];
  channels_->fetch_add(1, std::memory_order_relaxed);
}

int CopyBlockShare::Blocks() const {
  const int channels = channels_ == nullptr ? 1 : channels_->load(std::memory_order_relaxed);
  return std::max(1, blocks_ / std::max(1, channels));
}

int CopyBlockShare::ChannelsOn(int device) {
  if (device < 0 || device >= kMaxDevices) return 0;
  return DeviceChannels()[device].load(std::memory_order_relaxed);
}

}  // namespace kvferry
