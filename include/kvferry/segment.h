// Segment descriptors: what one transfer engine tells its peers about itself.
//
// Each engine owns one segment: its listening address, the transports it speaks, the node it
// runs on, and its registered regions. Peers exchange descriptors in the handshake when one
// opens the other's segment by "host:port"; no external metadata service is involved.
//
// Thread-safety: plain value types; SegmentHandle is an opaque id valid for the engine that
// returned it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvferry/memory.h"

namespace kvferry {

// Version of the handshake and frame protocol. Peers with a different version are refused.
// 2: strided WRITE frames; 3: the handshake authenticates both sides (challenge and response);
// 4: descriptors carry the UCX worker addresses (one per lane) and each region's packed UCX rkey;
// 5: large UCX rows travel as active messages (transport/ucx/ucx_am.h), which an engine of
// version 4 cannot serve; 6: a UCX target answers them with a reply endpoint, which the
// initiator checks (version 5 answers lack one and would be dropped); 7: descriptors carry the
// engine's incarnation, which a reconnecting client checks.
inline constexpr uint16_t kProtocolVersion = 7;

struct SegmentDescriptor {
  std::string name;  // engine name, unique per process group (e.g. "prefill-0")
  std::string host;  // address peers connect to
  uint16_t port = 0;
  std::string node_id;  // identifies the host machine (engines on one node share it)
  uint32_t pid = 0;
  // Random and nonzero, drawn once per engine instance: a process restarted at the same address
  // (even with the same name and pid, as in a container) has another, so that a segment opened
  // to the old one never reaches it (TransferEngine::OpenSegment).
  uint64_t incarnation = 0;
  std::vector<std::string> transports;  // e.g. {"tcp", "nvlink"}
  std::string ipc_socket;  // abstract Unix socket serving device-memory file descriptors
  // The engine's UCX worker addresses (opaque bytes from UCX), one per UCX lane (worker with
  // its own progress thread), when it offers the "ucx" transport; empty otherwise. Sent only
  // after the handshake authenticated both sides.
  std::vector<std::vector<uint8_t>> ucx_addresses;
  std::vector<RegionDescriptor> regions;

  std::string Address() const { return host + ":" + std::to_string(port); }
  friend bool operator==(const SegmentDescriptor&, const SegmentDescriptor&) = default;
};

// Opaque handle of a peer segment opened by an engine.
struct SegmentHandle {
  uint64_t value = 0;
  friend bool operator==(SegmentHandle, SegmentHandle) = default;
  friend auto operator<=>(SegmentHandle, SegmentHandle) = default;
};

}  // namespace kvferry
