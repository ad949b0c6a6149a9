// MemoryRegistry: the regions an engine registered, and the range check every remote access
// passes through.
//
// Thread-safety: all methods are thread-safe. A Pin keeps its region registered while it
// lives; Unregister waits for outstanding pins, so a region is never freed under a transfer.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kvferry/memory.h"
#include "kvferry/status.h"

namespace kvferry {

// What a transport keeps for each registered region (UCX: the region's memory mapping and
// packed remote key). Called outside the registry's lock, from the registering thread.
class RegionObserver {
 public:
  virtual ~RegionObserver() = default;
  // Before `region` enters the registry; may add to it (RegionDescriptor::ucx_rkey). An error
  // refuses the registration.
  virtual Status OnRegister(RegionDescriptor* region) = 0;
  // After `region` left the registry and every pin on it was released; also for a region
  // whose registration failed after OnRegister succeeded.
  virtual void OnUnregister(const RegionDescriptor& region) = 0;
};

class MemoryRegistry {
 private:
  struct Entry {
    RegionDescriptor region;
    int pins = 0;  // guarded by MemoryRegistry::mu_
  };

 public:
  // Keeps one region in use; releases it on destruction.
  class Pin {
   public:
    Pin() = default;
    Pin(Pin&& other) noexcept { *this = std::move(other); }
    Pin& operator=(Pin&& other) noexcept;
    ~Pin() { Release(); }
    const RegionDescriptor& region() const { return entry_->region; }

   private:
    friend class MemoryRegistry;
    Pin(MemoryRegistry* registry, std::shared_ptr<Entry> entry)
        : registry_(registry), entry_(std::move(entry)) {}
    void Release();
    MemoryRegistry* registry_ = nullptr;
    std::shared_ptr<Entry> entry_;
  };

  // Errors: kInvalidArgument (null, zero length, wrapping, overlap with a registered region),
  // the observer's.
  Status Register(const RegionDescriptor& region);
  // Blocks until pins on the region are released: remote accesses in progress, and batches
  // whose local side it is (until they are final). Errors: kNotFound.
  Status Unregister(uint64_t base);

  // Checks that [addr, addr + length) lies inside one region with all of `access` and pins
  // it. Errors: kFailedPrecondition naming the range and what is wrong.
  StatusOr<Pin> PinRange(uint64_t addr, uint64_t length, uint32_t access);
  // Where a local range lives, without copying the region's descriptor.
  struct Span {
    uint64_t base = 0;
    uint64_t length_bytes = 0;
    MemoryKind kind = MemoryKind::kHost;
    int32_t device_id = -1;
    bool Contains(uint64_t addr, uint64_t length) const {
      return length_bytes != 0 && addr >= base && length <= length_bytes &&
             addr - base <= length_bytes - length;
    }
  };
  // True when [addr, addr + length) lies inside one registered region; fills `out`.
  bool Lookup(uint64_t addr, uint64_t length, Span* out) const;

  std::vector<RegionDescriptor> Regions() const;
  // How many pins hold the region registered at `base` now (0 when none is registered there).
  int PinsOn(uint64_t base) const;

  // Sets (or with null clears) the one observer; `observer` (not owned) outlives the setting.
  // Regions registered before are not shown to it.
  void SetObserver(RegionObserver* observer);

 private:
  Status CheckFreeLocked(const RegionDescriptor& region) const;

  mutable std::mutex mu_;
  std::condition_variable unpinned_;
  std::map<uint64_t, std::shared_ptr<Entry>> regions_;  // by base
  RegionObserver* observer_ = nullptr;                  // guarded by mu_
};

}  // namespace kvferry
