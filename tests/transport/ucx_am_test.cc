// kvferry's active-message handlers (transport/ucx/ucx_am.h) on two real UCX workers of one
// process: replies the initiator no longer waits for. UCX allows an active-message callback
// to answer an error only for a rendezvous (it asserts so in assertion-enabled builds such as
// Debian's 1.13), so an eager READ answer for an operation that was abandoned, or never
// existed, must be dropped with UCS_OK: the process survives and the worker keeps serving.
// Also a frozen initiator's rendezvous WRITE, which an Unregister waits for, and the context's
// memory mappings, one per registration.
#include <gtest/gtest.h>

#ifdef KVFERRY_WITH_UCX
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/memory_registry.h"
#include "transport/ucx/ucx_am.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry::ucx {
namespace {

// Records the replies routed to it.
class RecordingClient : public AmClient {
 public:
  void OnAmDone(uint64_t op, ucs_status_t status) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_.push_back({op, status});
    cv_.notify_all();
  }
  ucs_status_t OnAmReadData(uint64_t, void*, size_t, bool) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++read_data_;
    return UCS_OK;
  }
  // Waits up to 10 s for a kAmDone of `op`; its status, or UCS_ERR_TIMED_OUT.
  ucs_status_t WaitDone(uint64_t op) {
    std::unique_lock<std::mutex> lock(mu_);
    ucs_status_t status = UCS_ERR_TIMED_OUT;
    cv_.wait_for(lock, std::chrono::seconds(10), [&] {
      for (const auto& [o, s] : done_) {
        if (o == op) status = s;
      }
      return status != UCS_ERR_TIMED_OUT;
    });
    return status;
  }
  int read_data() {
    std::lock_guard<std::mutex> lock(mu_);
    return read_data_;
  }
  size_t done_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<uint64_t, ucs_status_t>> done_;
  int read_data_ = 0;
};

// Sends active message `id` with `header` and `data` eager (and `flags`) on `ep` from `w`'s
// progress thread and progresses until it completed; its status.
template <typename Header>
ucs_status_t SendEager(UcxWorker& w, ucp_ep_h ep, unsigned id, const Header& header,
                       const std::vector<uint8_t>& data, uint32_t flags = UCP_AM_SEND_FLAG_REPLY) {
  ucs_status_t result = UCS_INPROGRESS;
  w.Run([&] {
    ucp_request_param_t p = {};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER | flags;
    ucs_status_ptr_t r =
        ucp_am_send_nbx(ep, id, &header, sizeof(header), data.data(), data.size(), &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      result = r == nullptr ? UCS_OK : UCS_PTR_STATUS(r);
      return;
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (ucp_request_check_status(r) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < until) {
      ucp_worker_progress(w.worker());
    }
    result = ucp_request_check_status(r);
    ucp_request_free(r);
  });
  return result;
}

// An endpoint from `from` to `to`'s worker (PEER error handling), created on `from`'s
// progress thread; null when UCX refused it.
ucp_ep_h Connect(UcxWorker& from, const UcxWorker& to) {
  ucp_ep_h ep = nullptr;
  from.Run([&] {
    ucp_ep_params_t p = {};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(to.address().data());
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
    if (ucp_ep_create(from.worker(), &p, &ep) != UCS_OK) ep = nullptr;
  });
  return ep;
}

// Force-closes `ep` of worker `w` and progresses until the close completed; on w's progress
// thread.
void ForceClose(UcxWorker& w, ucp_ep_h ep) {
  ucp_request_param_t p = {};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
    while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(w.worker());
    ucp_request_free(r);
  }
}

// A host region over `memory` with remote read and write access that the target's range check
// takes for mapped (PinMapped asks for a UCX key; active messages use none).
RegionDescriptor MappedHostRegion(std::vector<uint8_t>& memory) {
  RegionDescriptor region;
  region.base = reinterpret_cast<uint64_t>(memory.data());
  region.length_bytes = memory.size();
  region.access = kAccessRemoteReadWrite;
  region.ucx_rkey = {1};
  return region;
}

// UCX over tcp on loopback only: other tests running at the same time make and remove veth
// devices, and a device that vanishes while UCX lists them fails the context ("No such
// device").
void PinLoopback() {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", "lo", 1);
}

TEST(UcxAmTest, EagerReadDataForAnOperationNoLongerAwaitedIsDropped) {
  PinLoopback();
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status().ToString();
  auto initiator = UcxWorker::Create(context->get(), std::chrono::nanoseconds(0));
  ASSERT_TRUE(initiator.ok()) << initiator.status().ToString();
  auto target = UcxWorker::Create(context->get(), std::chrono::nanoseconds(0));
  ASSERT_TRUE(target.ok()) << target.status().ToString();
  UcxWorker& from = **target;  // the side that answers READs
  UcxWorker& to = **initiator;

  RecordingClient client;
  // The initiator's own endpoint to the target, which its live operation's request leaves on.
  ucp_ep_h request_ep = Connect(to, from);
  ASSERT_NE(request_ep, nullptr);
  uint64_t live_op = 0;
  to.Run([&] { live_op = to.AddAmOp(&client, request_ep); });

  ucp_ep_h ep = Connect(from, to);
  ASSERT_NE(ep, nullptr);

  // READ data, eager, for an operation the initiator never had, then for one it dropped
  // (AddAmOp then RemoveAmOp, as an abandoned batch does), 4 KiB and 200 KiB.
  uint64_t dropped_op = 0;
  to.Run([&] {
    dropped_op = to.AddAmOp(&client, request_ep);
    to.RemoveAmOp(dropped_op);
  });
  const std::vector<uint8_t> small(4096, 0x5a), large(200 << 10, 0xa5);
  EXPECT_EQ(SendEager(from, ep, kAmReadData, AmReply{live_op + 1000, UCS_OK}, small), UCS_OK);
  EXPECT_EQ(SendEager(from, ep, kAmReadData, AmReply{dropped_op, UCS_OK}, small), UCS_OK);
  EXPECT_EQ(SendEager(from, ep, kAmReadData, AmReply{dropped_op, UCS_OK}, large), UCS_OK);
  // Then the live operation's request, a WRITE the target refuses (it maps no memory): its
  // answer comes back on the request's endpoint, so the initiator's worker survived the three
  // and still routes replies.
  EXPECT_EQ(SendEager(to, request_ep, kAmWrite, AmRequest{live_op, 4096, 64},
                      std::vector<uint8_t>(64, 1)),
            UCS_OK);
  EXPECT_EQ(client.WaitDone(live_op), UCS_ERR_OUT_OF_RANGE);
  EXPECT_EQ(client.read_data(), 0);

  from.Run([&] { ForceClose(from, ep); });
  to.Run([&] {
    ForceClose(to, request_ep);
    to.RemoveAmOp(live_op);
  });
}

TEST(UcxAmTest, RepliesCountOnlyOnTheEndpointTheRequestLeftOn) {
  // Three workers: the initiator waits for the answer to a WRITE it sends to the target; a third
  // worker (another peer of the initiator) knows the operation's id and answers it first, with
  // and without a reply endpoint, and sends READ bytes for it. None of that reaches the
  // initiator's client; the target's real answer does.
  PinLoopback();
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status().ToString();
  MemoryRegistry registry;
  std::vector<uint8_t> memory(4096, 0);
  const RegionDescriptor region = MappedHostRegion(memory);
  ASSERT_TRUE(registry.Register(region).ok());
  (*context)->set_registry(&registry);
  std::unique_ptr<UcxWorker> workers[3];
  for (auto& w : workers) {
    auto created = UcxWorker::Create(context->get(), std::chrono::nanoseconds(0));
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    w = std::move(*created);
  }
  UcxWorker& initiator = *workers[0];
  UcxWorker& target = *workers[1];
  UcxWorker& other = *workers[2];

  RecordingClient client;
  ucp_ep_h request_ep = Connect(initiator, target);
  ucp_ep_h other_ep = Connect(other, initiator);
  ASSERT_NE(request_ep, nullptr);
  ASSERT_NE(other_ep, nullptr);
  uint64_t op = 0;
  initiator.Run([&] { op = initiator.AddAmOp(&client, request_ep); });

  EXPECT_EQ(SendEager(other, other_ep, kAmDone, AmReply{op, UCS_OK}, {}), UCS_OK);
  EXPECT_EQ(SendEager(other, other_ep, kAmDone, AmReply{op, UCS_OK}, {}, 0), UCS_OK);
  EXPECT_EQ(
      SendEager(other, other_ep, kAmReadData, AmReply{op, UCS_OK}, std::vector<uint8_t>(64, 7)),
      UCS_OK);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(client.read_data(), 0);

  EXPECT_EQ(SendEager(initiator, request_ep, kAmWrite, AmRequest{op, region.base, 64},
                      std::vector<uint8_t>(64, 0x33)),
            UCS_OK);
  EXPECT_EQ(client.WaitDone(op), UCS_OK);
  EXPECT_EQ(client.done_count(), 1) << "an answer from the other worker was taken";
  EXPECT_EQ(memory[0], 0x33);

  other.Run([&] { ForceClose(other, other_ep); });
  initiator.Run([&] {
    ForceClose(initiator, request_ep);
    initiator.RemoveAmOp(op);
  });
}

TEST(UcxAmTest, UnregisterWaitsForAFrozenInitiatorsRow) {
  // The target pins a WRITE's range while it receives the row as rendezvous, and an Unregister
  // waits for the pin. An initiator that stops mid-row (here: its progress thread blocked
  // right after it sent the request) holds the Unregister until it goes on: UCX cannot cancel
  // a rendezvous receive, and force-closing the reply endpoint does not stop the row's bytes
  // from landing once the initiator resumes (a pin released at a deadline would let them land
  // in memory no longer registered). Once it resumes, the row lands, then the Unregister
  // returns.
  PinLoopback();
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status().ToString();
  MemoryRegistry registry;
  std::vector<uint8_t> memory(1 << 20, 0);
  const RegionDescriptor region = MappedHostRegion(memory);
  ASSERT_TRUE(registry.Register(region).ok());
  (*context)->set_registry(&registry);
  auto initiator = UcxWorker::Create(context->get(), std::chrono::nanoseconds(0));
  ASSERT_TRUE(initiator.ok()) << initiator.status().ToString();
  auto target = UcxWorker::Create(context->get(), std::chrono::nanoseconds(0));
  ASSERT_TRUE(target.ok()) << target.status().ToString();
  UcxWorker& from = **initiator;
  UcxWorker& to = **target;

  RecordingClient client;
  ucp_ep_h ep = Connect(from, to);
  ASSERT_NE(ep, nullptr);
  // Sends a WRITE of `data` to the start of the region as operation `op`, flags `flags`.
  const auto send_write = [&](uint64_t op, const std::vector<uint8_t>& data, uint32_t flags) {
    auto* header = new AmRequest{op, region.base, data.size()};
    ucp_request_param_t p = {};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = flags | UCP_AM_SEND_FLAG_REPLY;
    p.user_data = header;
    p.cb.send = [](void* request, ucs_status_t, void* user_data) {
      delete static_cast<AmRequest*>(user_data);
      ucp_request_free(request);
    };
    ucs_status_ptr_t r =
        ucp_am_send_nbx(ep, kAmWrite, header, sizeof(*header), data.data(), data.size(), &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) delete header;
  };
  // An eager WRITE first: the endpoint is wired up and the target answers.
  const std::vector<uint8_t> first(64, 0x11);
  uint64_t first_op = 0;
  from.Run([&] {
    first_op = from.AddAmOp(&client, ep);
    send_write(first_op, first, UCP_AM_SEND_FLAG_EAGER);
  });
  ASSERT_EQ(client.WaitDone(first_op), UCS_OK);
  ASSERT_EQ(memory[0], 0x11);
  std::fill(memory.begin(), memory.end(), 0);
  // The target answers before its handler returns and releases the WRITE's pin.
  for (int i = 0; i < 1000 && registry.PinsOn(region.base) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(registry.PinsOn(region.base), 0);

  // Then a rendezvous WRITE, and the initiator's thread stops right after sending it.
  const std::vector<uint8_t> row(512 << 10, 0xA5);
  uint64_t row_op = 0;
  std::promise<void> resume;
  std::shared_future<void> resumed = resume.get_future().share();
  from.Run([&] { row_op = from.AddAmOp(&client, ep); });
  from.Post([&, resumed] {
    send_write(row_op, row, UCP_AM_SEND_FLAG_RNDV);
    resumed.wait();
  });
  // The target received the request and pinned the range for the row.
  for (int i = 0; i < 1000 && registry.PinsOn(region.base) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (registry.PinsOn(region.base) != 1) resume.set_value();
  ASSERT_EQ(registry.PinsOn(region.base), 1) << "the target never began receiving the row";
  // The Unregister waits for it.
  auto unregistered =
      std::async(std::launch::async, [&] { return registry.Unregister(region.base); });
  const bool waited =
      unregistered.wait_for(std::chrono::milliseconds(500)) == std::future_status::timeout;
  resume.set_value();
  EXPECT_TRUE(waited) << "Unregister returned while the row was still to come";
  ASSERT_EQ(unregistered.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "Unregister still waits after the initiator resumed";
  EXPECT_TRUE(unregistered.get().ok());
  // The row landed before the Unregister returned, and only where it was sent.
  EXPECT_EQ(std::count(memory.begin(), memory.begin() + row.size(), 0xA5),
            static_cast<long>(row.size()));
  EXPECT_EQ(std::count(memory.begin() + row.size(), memory.end(), 0),
            static_cast<long>(memory.size() - row.size()));
  // Nothing lands after it: the memory, cleared, stays so while the initiator goes on and
  // closes its endpoint.
  std::fill(memory.begin(), memory.end(), 0);
  from.Run([&] {
    ForceClose(from, ep);
    from.RemoveAmOp(first_op);
    from.RemoveAmOp(row_op);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(std::count(memory.begin(), memory.end(), 0), static_cast<long>(memory.size()))
      << "bytes landed after the Unregister returned";
}

TEST(UcxContextTest, RegistrationsOfOneBaseKeepTheirOwnMappings) {
  // A registration of an address racing an Unregister of the same address (a framework's
  // allocator handing the memory out again) maps it while the old mapping is still in place:
  // each mapping is its registration's, and unmapping one leaves the other.
  PinLoopback();
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status().ToString();
  std::vector<uint8_t> memory(1 << 20);
  RegionDescriptor old_region;
  old_region.base = reinterpret_cast<uint64_t>(memory.data());
  old_region.length_bytes = memory.size();
  old_region.access = kAccessRemoteReadWrite;
  old_region.key = 1;
  RegionDescriptor new_region = old_region;
  new_region.length_bytes = memory.size() / 2;
  new_region.key = 2;
  ASSERT_TRUE((*context)->MapRegion(old_region).ok());
  ASSERT_TRUE((*context)->MapRegion(new_region).ok());
  EXPECT_EQ((*context)->num_mapped(), 2u);
  (*context)->UnmapRegion(old_region);
  EXPECT_EQ((*context)->num_mapped(), 1u);
  (*context)->UnmapRegion(old_region);  // already gone: nothing
  EXPECT_EQ((*context)->num_mapped(), 1u);
  (*context)->UnmapRegion(new_region);
  EXPECT_EQ((*context)->num_mapped(), 0u);
}

}  // namespace
}  // namespace kvferry::ucx

#else
TEST(UcxAmTest, NeedsUcxBuild) { GTEST_SKIP() << "built without UCX (KVFERRY_WITH_UCX)"; }
#endif
