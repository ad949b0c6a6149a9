// One peer's UCX channel: WRITE and READ items as ucp_put_nbx / ucp_get_nbx, a put or get per
// row (strided items carry several rows), the peer's regions reached through the packed rkeys
// of its descriptor; rows of at least UcxChannelOptions::am_threshold_bytes of host memory as
// active messages with rendezvous instead (ucx_am.h: no copy in user space where UCX emulates
// put and get, and the target checks the range itself); WRITE rows among them of at most
// UcxContext::am_eager_max_bytes as eager active messages (no rendezvous handshake).
//
// Lanes: one per local worker, each an endpoint (UCP_ERR_HANDLING_MODE_PEER) from worker i to
// the peer's worker i (modulo the peer's count), driven by worker i's progress thread. A
// submission's items go to the lanes with the fewest bytes handed to them so far, so the
// slices of a batch spread evenly; each lane is the channel described below, on its own.
//
// Checks: every item's remote range must lie inside one region of the peer's descriptor with
// the access its op needs and a UCX key; a miss re-reads the descriptor once (off the
// progress thread), then fails with kFailedPrecondition and nothing is moved. A region the
// peer published without a key (GPU memory of a peer whose UCX has no CUDA) is reached over
// the peer's TCP control channel instead, for host memory on this side.
//
// Completion: an item completes once every put or get of it completed (a WRITE also once a
// flush of the endpoint issued after its puts completed: its bytes are in the peer's memory);
// by active messages, once the peer answered each row of a WRITE (its bytes are in the peer's
// memory) and each row of a READ was received here,
// with the first failure of any of them: a flush alone never makes an item succeed. Notifications
// and descriptor queries go over the control channel.
//
// Failures: the endpoint's error callback (a peer that died) and Abandon of an item whose
// operations are moving or whose flush is pending (a deadline: a frozen peer is never reported
// by UCX) close the endpoint with UCP_EP_CLOSE_FLAG_FORCE, which cancels every operation on it
// (and fails every row still awaiting the target's answer); each item completes once UCX called
// back for all of its operations (kUnavailable, or the abandon's reason), and the channel lets
// go of it once its flush, if any, was called back too. The next submission opens a new
// endpoint.
//
// Thread-safety: the PeerChannel methods from any thread; everything else on the worker's
// progress thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kvferry/segment.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry::ucx {

struct UcxChannelOptions {
  std::vector<UcxWorker*> workers;  // one lane each, at least one; outlive the channel's Close
  // Per worker (same index): bytes of items that completed on its lane are added here. Null:
  // not counted. Outlives the channel.
  std::atomic<uint64_t>* lane_bytes = nullptr;
  SegmentDescriptor peer;
  std::shared_ptr<PeerChannel> control;  // the peer's TCP channel
  std::function<StatusOr<SegmentDescriptor>()> refresh;
  MemoryKind local_kind = MemoryKind::kHost;
  // Rows of at least this many bytes between host memory on both sides go as active
  // messages with rendezvous (ucx_am.h) instead of put / get; 0: never.
  uint64_t am_threshold_bytes = 0;
  ChannelTraits traits;
};

std::shared_ptr<PeerChannel> CreateUcxChannel(UcxChannelOptions options);

}  // namespace kvferry::ucx
