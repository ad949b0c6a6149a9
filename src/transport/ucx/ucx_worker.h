// One UCX context per engine (UcxContext: the memory mappings and their rkeys, valid on every
// worker of the context) and its workers (UcxWorker: one per lane), each with the progress
// thread that owns it. Every UCX call on a worker (endpoints, puts, gets, flushes, progress)
// runs on that worker's thread: others hand it work with Post or Run. The thread polls the worker
// while there is work and for a while after it (UcxTransportOptions::idle_spin), then sleeps on
// UCX's wakeup file descriptor (ucp_worker_get_efd) and its own event fd, so an idle engine costs
// no CPU. The serving side needs it too: over transports that emulate RMA in software (tcp) the
// target's worker executes peers' puts and gets when it progresses.
//
// Only the .cc files of src/transport/ucx/ include this header (it includes UCX's).
//
// Active messages (ucx_am.h): every worker serves peers' WRITE and READ requests sent as UCX
// active messages (the range checked against, and pinned in, the engine's registry) and routes the
// replies to its own requests to the channel that sent them (AmClient, by operation id).
//
// Thread-safety: Post, Run, the accessors, MapRegion / UnmapRegion from any thread; AddAmOp /
// RemoveAmOp / FindAmOp on the progress thread only.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvferry/memory.h"
#include "kvferry/status.h"
#include "transport/memory_registry.h"

namespace kvferry::ucx {

// UCX settings kvferry applies where the user set no UCX_<name> of its own: tcp segments and
// socket buffers sized for bulk transfers (UCX's defaults reach ~40% of iperf3 here).
struct UcxDefault {
  const char* name;  // without the UCX_ prefix
  const char* value;
};
inline constexpr UcxDefault kUcxDefaults[] = {{"TCP_TX_SEG_SIZE", "256K"},
                                              {"TCP_RX_SEG_SIZE", "512K"},
                                              {"TCP_SNDBUF", "4M"},
                                              {"TCP_RCVBUF", "4M"}};

class UcxContext {
 public:
  // Reads UCX's configuration (UCX_* variables, kUcxDefaults where unset) and creates the
  // context (RMA, wakeup; workers share it). Errors: kUnavailable with UCX's reason.
  static StatusOr<std::unique_ptr<UcxContext>> Create();
  ~UcxContext();  // unmaps what is still mapped; every worker must be gone

  // Whether this UCX registers and moves CUDA memory (built with CUDA, cuda_copy present).
  bool cuda_memory() const { return cuda_memory_; }
  // The version of the UCX library loaded at run time ("1.13.1").
  const std::string& version() const { return version_; }
  ucp_context_h context() const { return context_; }

  // Maps `region` with UCX (remote read / write as its access allows) and returns the packed
  // rkey, which peers may use on endpoints to any worker of this context; the mapping stays
  // until UnmapRegion(region). Mappings are told apart by base and RegionDescriptor::key (random
  // per registration), so a registration of the same base racing an Unregister keeps its own.
  // Errors: kUnavailable with UCX's reason.
  StatusOr<std::vector<uint8_t>> MapRegion(const RegionDescriptor& region);
  // Unmaps the mapping MapRegion made for `region` (same base and key); nothing when none is.
  void UnmapRegion(const RegionDescriptor& region);
  // How many mappings are in place.
  size_t num_mapped() const;

  // The engine's registry (not owned; it outlives the context), which the active-message
  // target pins a range in for as long as UCX writes or reads it, so that an Unregister waits
  // for those. Set once, before any worker exists; null: nothing pinned.
  void set_registry(MemoryRegistry* registry) { registry_ = registry; }
  MemoryRegistry* registry() const { return registry_; }
  // Active-message rows of host memory up to this many bytes go eager (the bytes with the
  // message, ucx_am.h): the WRITE rows this context's workers send and the READ rows they
  // answer; larger ones as rendezvous. Set once, before any worker exists; 0: always
  // rendezvous.
  void set_am_eager_max_bytes(uint64_t bytes) { am_eager_max_bytes_ = bytes; }
  uint64_t am_eager_max_bytes() const { return am_eager_max_bytes_; }

 private:
  UcxContext() = default;

  ucp_context_h context_ = nullptr;
  MemoryRegistry* registry_ = nullptr;
  uint64_t am_eager_max_bytes_ = 0;
  bool cuda_memory_ = false;
  std::string version_;

  mutable std::mutex map_mu_;
  std::map<std::pair<uint64_t, uint64_t>, ucp_mem_h> mapped_;  // by region base and key
};

// What a channel implements to hear the replies to its active-message requests (ucx_am.h);
// called on the worker's progress thread from inside UCX's callbacks.
class AmClient {
 public:
  virtual ~AmClient() = default;
  // The target refused or failed operation `op` (or, with UCS_OK, finished it).
  virtual void OnAmDone(uint64_t op, ucs_status_t status) = 0;
  // The data of READ `op`: `desc` is UCX's rendezvous descriptor (`rndv`) or the bytes
  // themselves, `length_bytes` long. Returns what UCX's AM callback returns.
  virtual ucs_status_t OnAmReadData(uint64_t op, void* desc, size_t length_bytes, bool rndv) = 0;
};

class UcxWorker {
 public:
  // Creates a worker on `context` (not owned; outlives the worker) and starts its progress
  // thread, which polls for `idle_spin` after its last work before it sleeps. Errors:
  // kUnavailable with UCX's reason.
  static StatusOr<std::unique_ptr<UcxWorker>> Create(UcxContext* context,
                                                     std::chrono::nanoseconds idle_spin);
  ~UcxWorker();  // stops the thread; every channel on it must be closed

  UcxContext& context() const { return *context_; }
  // The worker's address, as peers pass it to ucp_ep_create.
  const std::vector<uint8_t>& address() const { return address_; }
  ucp_worker_h worker() const { return worker_; }

  // Runs `fn` on the progress thread soon; never blocks. Tasks run in order.
  void Post(std::function<void()> fn);
  // Runs `fn` on the progress thread and waits for it (runs it here when called there).
  void Run(const std::function<void()>& fn);
  bool OnProgressThread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Operation ids of active-message requests in flight from this worker, with the channel
  // their replies go to and the endpoint the request left on (progress thread only). Ids are
  // never reused.
  uint64_t AddAmOp(AmClient* client, ucp_ep_h ep);
  void RemoveAmOp(uint64_t op) { am_ops_.erase(op); }
  // The channel waiting for `op`'s reply, when the reply came back on the endpoint the request
  // left on (`reply_ep`: the receive's reply endpoint, null when it has none); null otherwise,
  // so that a peer cannot answer for another peer's request.
  AmClient* FindAmOp(uint64_t op, ucp_ep_h reply_ep) const {
    auto it = am_ops_.find(op);
    if (it == am_ops_.end() || reply_ep == nullptr || it->second.ep != reply_ep) return nullptr;
    return it->second.client;
  }

 private:
  UcxWorker() = default;
  void Loop();
  void Wake();

  UcxContext* context_ = nullptr;
  std::chrono::nanoseconds idle_spin_{0};
  ucp_worker_h worker_ = nullptr;
  std::vector<uint8_t> address_;
  int ucx_fd_ = -1;    // ucp_worker_get_efd
  int event_fd_ = -1;  // Wake
  int epoll_fd_ = -1;

  uint64_t next_am_op_ = 1;
  struct AmOpEntry {
    AmClient* client;
    ucp_ep_h ep;
  };
  std::unordered_map<uint64_t, AmOpEntry> am_ops_;  // progress thread only

  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

// "UCX error <name>" for a UCX status.
std::string UcxStatusText(ucs_status_t status);

}  // namespace kvferry::ucx
