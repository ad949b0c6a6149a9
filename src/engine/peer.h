// One opened segment (a peer engine) and the channels that reach it: its control channel
// (TCP: handshake, descriptor queries, notifications, host memory), the transport chosen for
// each kind of local memory, and the channels opened so far, one per (transport, local GPU).
//
// Thread-safety: fields set at OpenSegment are read-only afterwards; ChannelFor and Close may
// be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "kvferry/memory.h"
#include "kvferry/segment.h"
#include "transport/tcp/tcp_peer.h"
#include "transport/transport.h"

namespace kvferry {

class Peer {
 public:
  uint64_t id = 0;
  std::string address;                    // "host:port" as opened
  std::shared_ptr<tcp::TcpPeer> control;  // its descriptor() is the handshake's
  // Where notifications go: `control`, or a fault-injection wrapper around it
  // (TransportSet::NotifyChannel).
  std::shared_ptr<PeerChannel> notify;
  // The transport for each kind of local memory (TransportSet::Pick at open), or why none.
  std::array<StatusOr<Transport*>, 2> routes{StatusOr<Transport*>(nullptr),
                                             StatusOr<Transport*>(nullptr)};
  // Re-reads the peer's descriptor (handed to channels that map the peer's memory).
  std::function<StatusOr<SegmentDescriptor>()> refresh;

  // Whether the segment still reaches the process it was opened to. When a connection of the
  // control channel failed since the last look (the process may have gone), a DESCRIBE
  // connects again, and the new connection's handshake tells (tcp::PeerIdentity); one that
  // fails on a connection not yet known to be lost is tried once more. Blocks up to twice
  // `timeout` then (one caller at a time per peer); a peer that does not answer counts as the
  // same process.
  bool StillReaches(std::chrono::milliseconds timeout);

  // The channel for local memory of `kind` on `device` (-1: host memory), opened through its
  // route on first use. Errors: the route's, the transport's OpenChannel error (nothing is
  // kept then), kUnavailable once Close began.
  StatusOr<PeerChannel*> ChannelFor(MemoryKind kind, int device);

  // Stops ChannelFor opening channels, closes the control channel, then the notification
  // channel and every other channel. Blocks until their threads stopped.
  void Close();

 private:
  std::mutex mu_;
  bool closed_ = false;  // mu_: Close began
  std::mutex probe_mu_;  // one StillReaches probe at a time
  // control->lane_failures() after the last StillReaches probe (probe_mu_ for writes).
  std::atomic<uint64_t> lane_failures_seen_{0};
  std::map<std::pair<const Transport*, int>, std::shared_ptr<PeerChannel>> channels_;
};

}  // namespace kvferry
