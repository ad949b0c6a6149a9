// The transports of one engine and the choice among them. TCP is always present: it is the
// control plane (handshake, descriptor queries, notifications) and the fallback data path.
// Data transports are tried in one preference order:
//
//   nvlink (GPU memory to GPU memory on one node), then ucx (peers on other nodes, when both
//   sides offer it; any peer when forced), then tcp (anything, anywhere)
// For each kind of local memory the first
// transport whose capabilities allow it (local memory kind, same node) and whose CanReach
// accepts the peer's descriptor carries a peer's requests; EngineOptions::transport ("auto",
// or one transport's name) may force one. A new transport plugs in here (Create and the
// order) and in its own folder under transport/; the engine's core does not change.
//
// Thread-safety: const methods may be called from any thread; the set is built once.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/faults.h"
#include "kvferry/memory.h"
#include "kvferry/segment.h"
#include "transport/fault/fault_transport.h"
#include "transport/memory_registry.h"
#include "transport/nvlink/nvlink_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_transport.h"

namespace kvferry {

struct TransportSetOptions {
  std::string transport = "auto";  // "auto" or a name from TransportSet::KnownNames()
  tcp::TcpTransportOptions tcp;
  NvlinkTransportOptions nvlink;
  UcxTransportOptions ucx;
  // Whether "auto" starts UCX (where built and it starts; the engine: when it listens beyond
  // loopback); "ucx" always does.
  bool ucx_in_auto = true;
  // When active, every transport is wrapped in a FaultTransport and notification channels in
  // a FaultChannel (kvferry/faults.h), all sharing one FaultInjector.
  FaultPlan faults;
};

class TransportSet {
 public:
  // Every name EngineOptions::transport accepts, "auto" first.
  static std::vector<std::string> KnownNames();

  // Starts TCP and every other transport this build and machine support (NVLink with CUDA and
  // a device, UCX where built and it starts). `registry` (not owned) outlives the set. Errors:
  // kInvalidArgument for an unknown transport name or bad TCP or UCX options; a forced transport
  // that cannot start fails with its reason (kFailedPrecondition: no CUDA device, no UCX in this
  // build or UCX could not start); kUnavailable when the listen address cannot be bound.
  static StatusOr<std::unique_ptr<TransportSet>> Create(const TransportSetOptions& options,
                                                        MemoryRegistry* registry);

  tcp::TcpTransport& control() const { return *tcp_; }

  // The started transport `name`'s Transport::LaneBytes; empty when it did not start.
  std::vector<uint64_t> LaneBytes(std::string_view name) const;

  // Adds every started transport to `self` (name, and what peers need to reach it), TCP first.
  void Describe(SegmentDescriptor* self) const;

  // The transport that carries requests on local memory of `local_kind` from the engine
  // described by `self` to `peer`. Never blocks. Errors: kFailedPrecondition naming the
  // forced transport and why it cannot, or why none can.
  // The channel notifications to a peer go through: `control` itself, or with a fault plan a
  // FaultChannel around it.
  std::shared_ptr<PeerChannel> NotifyChannel(std::shared_ptr<PeerChannel> control) const;

  StatusOr<Transport*> Pick(MemoryKind local_kind, const SegmentDescriptor& self,
                            const SegmentDescriptor& peer) const;

 private:
  TransportSet() = default;

  std::string forced_;  // empty: auto
  std::unique_ptr<tcp::TcpTransport> tcp_;
  std::vector<std::unique_ptr<Transport>> data_;  // transports other than TCP, started
  std::vector<Transport*> preference_;            // candidates, most preferred first
  std::shared_ptr<FaultInjector> faults_;         // null without a fault plan
  std::vector<std::unique_ptr<FaultTransport>> fault_wrappers_;
};

}  // namespace kvferry
