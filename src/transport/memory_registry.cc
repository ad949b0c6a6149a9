#include "transport/memory_registry.h"

#include <cstdio>
#include <string>

#include "common/checks.h"
#include "common/range_text.h"

namespace kvferry {

MemoryRegistry::Pin& MemoryRegistry::Pin::operator=(Pin&& other) noexcept {
  if (this != &other) {
    Release();
    registry_ = other.registry_;
    entry_ = std::move(other.entry_);
    other.registry_ = nullptr;
  }
  return *this;
}

void MemoryRegistry::Pin::Release() {
  if (registry_ == nullptr || entry_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(registry_->mu_);
    --entry_->pins;
  }
  registry_->unpinned_.notify_all();
  entry_.reset();
  registry_ = nullptr;
}

Status MemoryRegistry::CheckFreeLocked(const RegionDescriptor& region) const {
  auto next = regions_.lower_bound(region.base);
  if (next != regions_.end() && next->first < region.base + region.length_bytes) {
    return InvalidArgumentError("region " + RangeText(region.base, region.length_bytes) +
                                " overlaps registered region " +
                                RangeText(next->first, next->second->region.length_bytes));
  }
  if (next != regions_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second->region.length_bytes > region.base) {
      return InvalidArgumentError("region " + RangeText(region.base, region.length_bytes) +
                                  " overlaps registered region " +
                                  RangeText(prev->first, prev->second->region.length_bytes));
    }
  }
  return OkStatus();
}

Status MemoryRegistry::Register(const RegionDescriptor& region) {
  if (region.base == 0) return InvalidArgumentError("cannot register a null address");
  if (region.length_bytes == 0) return InvalidArgumentError("cannot register zero bytes");
  if (region.base + region.length_bytes < region.base) {
    return InvalidArgumentError("region " + RangeText(region.base, region.length_bytes) +
                                " wraps the address space");
  }
  auto entry = std::make_shared<Entry>();
  entry->region = region;
  RegionObserver* observer = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(CheckFreeLocked(region));
    observer = observer_;
  }
  // The observer may take long (UCX maps the memory): outside the lock, then checked again.
  if (observer != nullptr) RETURN_IF_ERROR(observer->OnRegister(&entry->region));
  Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = CheckFreeLocked(region);
    if (status.ok()) regions_.emplace(region.base, entry);
  }
  if (!status.ok() && observer != nullptr) observer->OnUnregister(entry->region);
  return status;
}

Status MemoryRegistry::Unregister(uint64_t base) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = regions_.find(base);
  if (it == regions_.end()) {
    return NotFoundError("no region registered at " + RangeText(base, 0));
  }
  std::shared_ptr<Entry> entry = it->second;
  regions_.erase(it);  // no new pins from here on
  unpinned_.wait(lock, [&] { return entry->pins == 0; });
  RegionObserver* observer = observer_;
  lock.unlock();
  if (observer != nullptr) observer->OnUnregister(entry->region);
  return OkStatus();
}

int MemoryRegistry::PinsOn(uint64_t base) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(base);
  return it == regions_.end() ? 0 : it->second->pins;
}

void MemoryRegistry::SetObserver(RegionObserver* observer) {
  std::lock_guard<std::mutex> lock(mu_);
  observer_ = observer;
}

StatusOr<MemoryRegistry::Pin> MemoryRegistry::PinRange(uint64_t addr, uint64_t length,
                                                       uint32_t access) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.upper_bound(addr);
  if (it == regions_.begin() || !std::prev(it)->second->region.Contains(addr, length)) {
    return FailedPreconditionError("range " + RangeText(addr, length) +
                                   " is not inside a registered region");
  }
  std::shared_ptr<Entry> entry = std::prev(it)->second;
  if ((entry->region.access & access) != access) {
    return FailedPreconditionError(
        "range " + RangeText(addr, length) + " lies in a region registered without remote " +
        std::string((access & kAccessRemoteWrite) ? "write" : "read") + " access");
  }
  ++entry->pins;
  return Pin(this, std::move(entry));
}

bool MemoryRegistry::Lookup(uint64_t addr, uint64_t length, Span* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.upper_bound(addr);
  if (it == regions_.begin()) return false;
  const RegionDescriptor& r = std::prev(it)->second->region;
  if (!r.Contains(addr, length)) return false;
  *out = Span{r.base, r.length_bytes, r.kind, r.device_id};
  return true;
}

std::vector<RegionDescriptor> MemoryRegistry::Regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RegionDescriptor> out;
  out.reserve(regions_.size());
  for (const auto& [base, entry] : regions_) out.push_back(entry->region);
  return out;
}

}  // namespace kvferry
