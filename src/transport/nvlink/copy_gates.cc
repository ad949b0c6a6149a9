#include "transport/nvlink/copy_gates.h"

#include <atomic>
#include <string>

namespace kvferry {

StatusOr<std::unique_ptr<CopyGates>> CopyGates::Create(int count) {
  if (count <= 0) return InvalidArgumentError("CopyGates: count must be positive");
  std::unique_ptr<CopyGates> g(new CopyGates());
  void* host = nullptr;
  cudaError_t e = cudaMallocHost(&host, sizeof(HostWords) * static_cast<size_t>(count));
  if (e != cudaSuccess) {
    return InternalError(std::string("CopyGates: cudaMallocHost failed: ") + cudaGetErrorName(e));
  }
  g->host_ = static_cast<HostWords*>(host);
  void* device = nullptr;
  e = cudaMalloc(&device, sizeof(uint32_t) * static_cast<size_t>(count));
  if (e != cudaSuccess) {
    return InternalError(std::string("CopyGates: cudaMalloc failed: ") + cudaGetErrorName(e));
  }
  g->decision_ = static_cast<uint32_t*>(device);
  g->state_.resize(static_cast<size_t>(count));
  for (int i = count - 1; i >= 0; --i) g->free_.push_back(i);
  return g;
}

CopyGates::~CopyGates() {
  if (host_ != nullptr) cudaFreeHost(host_);
  if (decision_ != nullptr) cudaFree(decision_);
}

int CopyGates::Acquire(WorkOwner* owner, uint32_t tag) {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) return -1;
  const int g = free_.back();
  free_.pop_back();
  state_[static_cast<size_t>(g)] = State{true, false, false, owner, tag, OkStatus()};
  // No launch reads these words now: plain stores, published to the GPU by the launch.
  std::atomic_ref<uint32_t>(host_[g].started).store(0, std::memory_order_relaxed);
  std::atomic_ref<uint32_t>(host_[g].cancel).store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return g;
}

cuda::CopyGate CopyGates::Args(int g) const {
  return cuda::CopyGate{decision_ + g, &host_[g].started, &host_[g].cancel};
}

bool CopyGates::WithdrawLocked(int g, const Status& why) {
  State& s = state_[static_cast<size_t>(g)];
  s.why = why;
  // Dekker's handshake with the kernel's PassGate: our store, a full fence, then its word.
  std::atomic_ref<uint32_t>(host_[g].cancel).store(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (std::atomic_ref<uint32_t>(host_[g].started).load(std::memory_order_seq_cst) != 0) {
    return false;  // it may be copying: it reports `why` when it ends (Outcome)
  }
  s.before_start = true;
  s.reported = true;
  return true;
}

template <typename Which>
std::vector<std::pair<WorkOwner*, uint32_t>> CopyGates::WithdrawWhere(Which&& which,
                                                                      const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<WorkOwner*, uint32_t>> claimed;
  for (size_t g = 0; g < state_.size(); ++g) {
    State& s = state_[g];
    if (!s.armed || !s.why.ok() || s.reported || !which(s)) continue;
    if (WithdrawLocked(static_cast<int>(g), why)) claimed.emplace_back(s.owner, s.tag);
  }
  return claimed;
}

int CopyGates::Withdraw(WorkOwner* owner, uint32_t tag, const Status& why) {
  return static_cast<int>(
      WithdrawWhere([&](const State& s) { return s.owner == owner && s.tag == tag; }, why).size());
}

std::vector<std::pair<WorkOwner*, uint32_t>> CopyGates::WithdrawAll(const Status& why) {
  return WithdrawWhere([](const State&) { return true; }, why);
}

bool CopyGates::Outcome(int g, const Status& copied, Status* status) {
  std::lock_guard<std::mutex> lock(mu_);
  State& s = state_[static_cast<size_t>(g)];
  const bool report = !s.reported;
  *status = s.why.ok() ? copied : s.why;
  s = State{};
  free_.push_back(g);
  return report;
}

bool CopyGates::WithdrawnBeforeStart(int g) const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_[static_cast<size_t>(g)].before_start;
}

}  // namespace kvferry
