// Copy kernels' thread blocks shared by a process's copying NVLink channels on one GPU (see
// copy_block_share.h).
#include "transport/nvlink/copy_block_share.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>

namespace kvferry {
namespace {

// A slot's value: free, joined (no launch yet), or the steady-clock time of its last launch
// (any other value).
constexpr int64_t kFree = INT64_MIN;
constexpr int64_t kJoined = INT64_MIN + 1;

// A device's slots, and how many of the first ones were ever taken (the ones to look at).
struct DeviceSlots {
  DeviceSlots() {
    for (auto& s : slots) s.store(kFree, std::memory_order_relaxed);
  }
  std::array<std::atomic<int64_t>, CopyBlockShare::kSlotsPerDevice> slots;
  std::atomic<int> used{0};

  template <typename F>
  int Count(F&& counts) const {
    const int n = used.load(std::memory_order_relaxed);
    int c = 0;
    for (int i = 0; i < n; ++i) c += counts(slots[i].load(std::memory_order_relaxed)) ? 1 : 0;
    return c;
  }
};

// Every device's slots, for the life of the process.
DeviceSlots* SlotsOf(int device) {
  static std::array<DeviceSlots, CopyBlockShare::kMaxDevices> devices{};
  if (device < 0 || device >= CopyBlockShare::kMaxDevices) return nullptr;
  return &devices[device];
}

bool Copying(int64_t value, int64_t now_ns) {
  return value != kFree && value != kJoined && now_ns - value < CopyBlockShare::kActiveWindowNs;
}

}  // namespace

CopyBlockShare::~CopyBlockShare() {
  if (slot_ != nullptr) slot_->store(kFree, std::memory_order_relaxed);
}

void CopyBlockShare::Join(int device, int blocks) {
  if (joined_) return;
  joined_ = true;
  device_ = device;
  blocks_ = std::max(1, blocks);
  DeviceSlots* d = SlotsOf(device);
  if (d == nullptr) return;
  for (int i = 0; i < kSlotsPerDevice; ++i) {
    int64_t expected = kFree;
    if (d->slots[i].compare_exchange_strong(expected, kJoined, std::memory_order_relaxed)) {
      slot_ = &d->slots[i];
      int used = d->used.load(std::memory_order_relaxed);
      while (used < i + 1 &&
             !d->used.compare_exchange_weak(used, i + 1, std::memory_order_relaxed)) {
      }
      return;
    }
  }
}

int CopyBlockShare::ForLaunch() {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  return ForLaunchAt(now);
}

int CopyBlockShare::ForLaunchAt(int64_t now_ns) {
  if (slot_ != nullptr) slot_->store(now_ns, std::memory_order_relaxed);
  // This channel counts itself even when it has no slot.
  const int copying = CopyingOn(device_, now_ns) + (slot_ == nullptr ? 1 : 0);
  return std::max(1, blocks_ / std::max(1, copying));
}

int CopyBlockShare::ChannelsOn(int device) {
  const DeviceSlots* d = SlotsOf(device);
  return d == nullptr ? 0 : d->Count([](int64_t v) { return v != kFree; });
}

int CopyBlockShare::CopyingOn(int device, int64_t now_ns) {
  const DeviceSlots* d = SlotsOf(device);
  return d == nullptr ? 0 : d->Count([now_ns](int64_t v) { return Copying(v, now_ns); });
}

}  // namespace kvferry
