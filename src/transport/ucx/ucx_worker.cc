#include "transport/ucx/ucx_worker.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdlib>
#include <future>

#include "common/checks.h"
#include "common/logging.h"
#include "common/spin.h"
#include "transport/ucx/ucx_am.h"

namespace kvferry::ucx {

std::string UcxStatusText(ucs_status_t status) {
  return std::string("UCX error '") + ucs_status_string(status) + "'";
}

StatusOr<std::unique_ptr<UcxContext>> UcxContext::Create() {
  std::unique_ptr<UcxContext> w(new UcxContext());
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  w->version_ = std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);

  // kvferry's defaults go into the environment (never over a value the user set) before UCX
  // reads it: UCX reads its transports' settings (UCX_TCP_*) from there when the context is
  // created, and ucp_config_modify does not reach them.
  {
    static std::mutex env_mu;
    std::lock_guard<std::mutex> lock(env_mu);
    for (const UcxDefault& d : kUcxDefaults) {
      ::setenv(("UCX_" + std::string(d.name)).c_str(), d.value, /*overwrite=*/0);
    }
  }
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UnavailableError("UCX configuration: " + UcxStatusText(s));
  ucp_params_t params = {};
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  // Regions are mapped from the registering thread while the workers' progress threads use
  // the context: UCX then guards the context's shared state with its own lock.
  params.mt_workers_shared = 1;
  params.name = "kvferry";
  s = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return UnavailableError("UCX context: " + UcxStatusText(s));

  ucp_context_attr_t attr = {};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(w->context_, &attr) == UCS_OK) {
    w->cuda_memory_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  return w;
}

UcxContext::~UcxContext() {
  {
    std::lock_guard<std::mutex> lock(map_mu_);
    for (auto& [where, memh] : mapped_) ucp_mem_unmap(context_, memh);
    mapped_.clear();
  }
  if (context_ != nullptr) ucp_cleanup(context_);
}

StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(UcxContext* context,
                                                       std::chrono::nanoseconds idle_spin) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  w->context_ = context;
  w->idle_spin_ = idle_spin;
  ucp_worker_params_t wp = {};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
  wp.events = UCP_WAKEUP_RMA | UCP_WAKEUP_AMO | UCP_WAKEUP_TX | UCP_WAKEUP_RX;
  ucs_status_t s = ucp_worker_create(context->context(), &wp, &w->worker_);
  if (s != UCS_OK) return UnavailableError("UCX worker: " + UcxStatusText(s));

  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  s = ucp_worker_get_address(w->worker_, &address, &address_bytes);
  if (s != UCS_OK) return UnavailableError("UCX worker address: " + UcxStatusText(s));
  const auto* bytes = reinterpret_cast<const uint8_t*>(address);
  w->address_.assign(bytes, bytes + address_bytes);
  ucp_worker_release_address(w->worker_, address);

  s = ucp_worker_get_efd(w->worker_, &w->ucx_fd_);
  if (s != UCS_OK) return UnavailableError("UCX wakeup fd: " + UcxStatusText(s));
  w->event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  w->epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (w->event_fd_ < 0 || w->epoll_fd_ < 0) return UnavailableError("UCX progress: no event fd");
  for (int fd : {w->ucx_fd_, w->event_fd_}) {
    epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(w->epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return UnavailableError("UCX progress: epoll_ctl failed");
    }
  }
  RETURN_IF_ERROR(SetAmHandlers(w.get()));
  w->thread_ = std::thread([p = w.get()] { p->Loop(); });
  return w;
}

UcxWorker::~UcxWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  if (thread_.joinable()) {
    Wake();
    thread_.join();
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (event_fd_ >= 0) ::close(event_fd_);
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
}

void UcxWorker::Wake() {
  const uint64_t one = 1;
  (void)!::write(event_fd_, &one, sizeof(one));
}

void UcxWorker::Post(std::function<void()> fn) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake = tasks_.empty();
    tasks_.push_back(std::move(fn));
  }
  if (wake && !OnProgressThread()) Wake();
}

void UcxWorker::Run(const std::function<void()>& fn) {
  if (OnProgressThread()) {
    fn();
    return;
  }
  std::promise<void> done;
  Post([&] {
    fn();
    done.set_value();
  });
  done.get_future().wait();
}

void UcxWorker::Loop() {
  // ucp_worker_progress calls per round before posted tasks run again.
  constexpr int kProgressPerRound = 64;
  using Clock = std::chrono::steady_clock;
  const auto idle_spin = idle_spin_;
  auto last_work = Clock::now();
  std::deque<std::function<void()>> tasks;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
      tasks.swap(tasks_);
    }
    bool worked = !tasks.empty();
    for (auto& task : tasks) task();
    tasks.clear();
    // Bounded, so that a steady stream of incoming work cannot hold back posted tasks (an
    // abandon at a deadline, a submission) for longer than one bounded round.
    for (int i = 0; i < kProgressPerRound && ucp_worker_progress(worker_) != 0; ++i) {
      worked = true;
    }
    if (worked) {
      last_work = Clock::now();
      continue;
    }
    if (Clock::now() - last_work < idle_spin) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!tasks_.empty() || stop_) continue;
    }
    // Nothing to do: arm the worker (UCS_ERR_BUSY: events arrived meanwhile) and sleep until
    // UCX or a Post wakes us.
    const ucs_status_t armed = ucp_worker_arm(worker_);
    if (armed == UCS_ERR_BUSY) continue;
    epoll_event events[2];
    const int n = ::epoll_wait(epoll_fd_, events, 2, armed == UCS_OK ? -1 : 1);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == event_fd_) {
        uint64_t value = 0;
        (void)!::read(event_fd_, &value, sizeof(value));
      }
    }
  }
  // Tasks posted after the stop run here, so that none waits forever in Run.
  std::deque<std::function<void()>> rest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rest.swap(tasks_);
  }
  for (auto& task : rest) task();
}

StatusOr<std::vector<uint8_t>> UcxContext::MapRegion(const RegionDescriptor& region) {
  ucp_mem_map_params_t p = {};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                 UCP_MEM_MAP_PARAM_FIELD_PROT | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  p.address = reinterpret_cast<void*>(region.base);
  p.length = region.length_bytes;
  p.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE;
  if ((region.access & kAccessRemoteRead) != 0) p.prot |= UCP_MEM_MAP_PROT_REMOTE_READ;
  if ((region.access & kAccessRemoteWrite) != 0) p.prot |= UCP_MEM_MAP_PROT_REMOTE_WRITE;
  p.memory_type = region.kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &p, &memh);
  if (s != UCS_OK) return UnavailableError("UCX cannot map the region: " + UcxStatusText(s));
  void* packed = nullptr;
  size_t packed_bytes = 0;
  s = ucp_rkey_pack(context_, memh, &packed, &packed_bytes);
  if (s != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return UnavailableError("UCX cannot pack the region's key: " + UcxStatusText(s));
  }
  const auto* bytes = static_cast<const uint8_t*>(packed);
  std::vector<uint8_t> rkey(bytes, bytes + packed_bytes);
  ucp_rkey_buffer_release(packed);
  std::lock_guard<std::mutex> lock(map_mu_);
  auto [it, inserted] = mapped_.emplace(std::make_pair(region.base, region.key), memh);
  if (!inserted) {
    ucp_mem_unmap(context_, it->second);
    it->second = memh;
  }
  return rkey;
}

void UcxContext::UnmapRegion(const RegionDescriptor& region) {
  ucp_mem_h memh = nullptr;
  {
    std::lock_guard<std::mutex> lock(map_mu_);
    auto it = mapped_.find(std::make_pair(region.base, region.key));
    if (it == mapped_.end()) return;
    memh = it->second;
    mapped_.erase(it);
  }
  ucp_mem_unmap(context_, memh);
}

size_t UcxContext::num_mapped() const {
  std::lock_guard<std::mutex> lock(map_mu_);
  return mapped_.size();
}

uint64_t UcxWorker::AddAmOp(AmClient* client, ucp_ep_h ep) {
  const uint64_t op = next_am_op_++;
  am_ops_[op] = AmOpEntry{client, ep};
  return op;
}

}  // namespace kvferry::ucx
