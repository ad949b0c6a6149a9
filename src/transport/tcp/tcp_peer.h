// Client side of the TCP transport: a pool of persistent connections ("lanes") to one peer.
//
// Every lane runs the authenticated handshake (tcp_common.h) when it connects. Each lane has a
// sender thread that pipelines frames (gathering several small requests into one writev,
// payloads sent straight from the caller's memory) and a receiver thread that matches
// responses in order and reads READ payloads straight into the caller's memory. A
// lane that fails (peer closed, reset, malformed response, abandoned mid-transfer) completes
// everything it held with kUnavailable and is replaced on the next submission.
//
// Thread-safety: TcpPeer is thread-safe.
#pragma once

#include <asio.hpp>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"

namespace kvferry::tcp {

struct TcpPeerOptions {
  std::string address;  // peer "host:port"
  SegmentDescriptor self;
  int num_lanes = 4;
  // Requests longer than this are moved as slices spread over the lanes (ChannelTraits).
  uint64_t slice_bytes = 4ull << 20;
  std::chrono::milliseconds connect_timeout{5000};
  uint32_t max_body_bytes = 4u << 20;
  // The shared secret every lane's handshake proves and checks (common/auth.h); empty: none.
  std::string auth_secret;
};

class TcpLane;

// The process a TcpPeer's first connection reached (its descriptor's name and incarnation),
// which every connection made later must reach again: a peer that restarted at the same
// address is another process, with other memory at the addresses the caller holds, and a
// segment opened to the old one must not write into it. Also counts lanes whose connection
// was lost (not those abandoned or closed), so that the engine knows when to look again
// (TransferEngine::OpenSegment).
//
// Thread-safety: Set before any lane starts; the rest from any thread.
class PeerIdentity {
 public:
  explicit PeerIdentity(std::string address) : address_(std::move(address)) {}
  void Set(const SegmentDescriptor& first);
  // OK when `now` (a later handshake's descriptor) is the process Set saw; else kUnavailable
  // naming both, and the peer counts as restarted from then on.
  Status Check(const SegmentDescriptor& now);
  bool restarted() const { return restarted_.load(std::memory_order_acquire); }
  // Why every request fails once restarted() (kUnavailable); OK before.
  Status restart_status() const;
  void CountLaneFailure() { lane_failures_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t lane_failures() const { return lane_failures_.load(std::memory_order_relaxed); }

 private:
  const std::string address_;
  std::string name_;          // set once by Set, before any lane reconnects
  uint64_t incarnation_ = 0;  // likewise
  std::atomic<bool> restarted_{false};
  std::atomic<uint64_t> lane_failures_{0};
  mutable std::mutex mu_;
  Status restart_;  // mu_: set once, with restarted_
};

class TcpPeer : public PeerChannel {
 public:
  // Connects the first lane and performs the handshake (blocks up to connect_timeout);
  // further lanes connect on first use. Errors: kUnavailable.
  static StatusOr<std::unique_ptr<TcpPeer>> Create(const TcpPeerOptions& options);
  ~TcpPeer() override;

  const SegmentDescriptor& descriptor() const { return descriptor_; }
  const std::string& address() const { return options_.address; }
  // Whether a connection made after the first reached another process at the address (a
  // restarted peer): every request fails from then on, with restart_status(). Non-blocking.
  bool restarted() const { return identity_.restarted(); }
  Status restart_status() const { return identity_.restart_status(); }
  // Connections lost so far (peer gone, reset, refused, a malformed answer); not those
  // abandoned at a deadline or closed.
  uint64_t lane_failures() const { return identity_.lane_failures(); }

  void Submit(std::shared_ptr<WorkItem> item) override;
  void SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) override;
  void Abandon(WorkItem* item, const Status& why) override;
  void Close() override;

 private:
  explicit TcpPeer(const TcpPeerOptions& options);
  // The lane for the next item (least outstanding bytes; a new one while others are busy).
  // Moves failed lanes whose threads have returned into `reaped`, for the caller to release
  // after unlocking. REQUIRES mu_.
  std::shared_ptr<TcpLane> PickLane(std::vector<std::shared_ptr<TcpLane>>* reaped);
  void SubmitOne(std::shared_ptr<WorkItem> item, bool allow_inline);

  TcpPeerOptions options_;
  SegmentDescriptor descriptor_;
  PeerIdentity identity_{options_.address};
  std::mutex mu_;
  bool closed_ = false;
  std::vector<std::shared_ptr<TcpLane>> lanes_;  // size num_lanes; null until first use
  // Failed lanes, released by PickLane once their threads returned, the rest joined on Close.
  std::vector<std::shared_ptr<TcpLane>> retired_;
};

}  // namespace kvferry::tcp
