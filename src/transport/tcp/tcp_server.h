// Serving side of the TCP transport: accepts peers' connections and executes their frames
// against this engine's registered memory.
//
// Each connection first runs the server's side of the handshake (wire.h): until the client
// proved the shared secret (TcpServerOptions::auth_secret; the proof of no secret when empty)
// it is answered nothing but the challenge, and a wrong proof or any other frame closes it,
// logged at most once a second. Then one thread per connection reads a frame, executes it and
// answers in order:
// WRITE payloads are read straight into registered memory, READ payloads written straight
// from it. Every WRITE and READ range is checked against the MemoryRegistry first; a range
// outside memory registered for that access is answered with kFailedPrecondition and nothing
// is read or written (a WRITE's payload is drained). A malformed frame closes that connection
// with a logged reason; other connections carry on.
//
// Bounded: at most max_connections are served at once, and at most max_handshakes of them may
// be in their handshake. A new connection that would pass either cap closes the oldest one
// still in its handshake (so connections that never authenticate cannot lock peers out
// for a handshake_timeout); with none in the handshake it is closed itself. Both are
// logged and counted. A connection must complete its HELLO within handshake_timeout; once a
// frame starts arriving,
// all of it (and its answer) must pass within frame_timeout plus its size at
// kMinFrameBytesPerSecond, or the connection is closed; frame bodies are allocated as their
// bytes arrive. Idle connections between frames of an authenticated peer stay open (they are the
// peer's persistent lanes). A watchdog thread enforces the times.
//
// Counted (TcpServerCounters, read by the engine's Metrics): connections open, accepted and
// refused at the cap; handshakes completed and refused, by why.
//
// Thread-safety: Create/destruction from one thread; serving runs on internal threads;
// counters() may be read from any thread.
#pragma once

#include <array>
#include <asio.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "common/log_limiter.h"
#include "kvferry/transfer.h"
#include "transport/memory_registry.h"
#include "transport/tcp/wire.h"

namespace kvferry::tcp {

struct TcpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  // The shared secret clients must prove (common/auth.h); empty: none (any client proves "no
  // secret"). Without one, a non-loopback `host` is refused unless `insecure`.
  std::string auth_secret;
  bool insecure = false;
  uint32_t max_body_bytes = 4u << 20;
  // Current descriptor of this engine (answers HELLO and DESCRIBE).
  std::function<SegmentDescriptor()> describe;
  // Called for each NOTIFY, on the connection's thread, before it is acknowledged.
  std::function<void(Notification)> on_notification;
  // Connections served at once (one thread each), and of those the ones still in their
  // handshake (see above).
  int max_connections = 1024;
  int max_handshakes = 64;
  // From accept to a completed HELLO.
  std::chrono::milliseconds handshake_timeout{10000};
  // A frame's time from its first header byte to its answer, plus its size at
  // kMinFrameBytesPerSecond.
  std::chrono::milliseconds frame_timeout{10000};
};

// Why a connection's handshake did not complete, as counted.
enum class HandshakeRefusal : uint8_t {
  // The client's proof was wrong, or it hung up after the challenge without sending one (what
  // a kvferry engine holding another secret, or none, does once the server's proof fails).
  kAuth = 0,
  // A malformed frame, a frame out of turn, a body of the wrong size, another protocol
  // version, or an undecodable descriptor.
  kProtocol = 1,
  // No complete handshake within handshake_timeout.
  kTimeout = 2,
  // Closed while in the handshake to make room for a newer connection: max_handshakes, or
  // max_connections, were reached.
  kCrowded = 3,
};
inline constexpr size_t kNumHandshakeRefusals = 4;

// What a server has seen since it started. Updated with relaxed atomics by the accept and
// connection threads (once per connection, never per frame); each field may be read at any
// time, the set is not one atomic snapshot.
struct TcpServerCounters {
  std::atomic<uint64_t> connections_open{0};      // served now (in the handshake or after it)
  std::atomic<uint64_t> connections_accepted{0};  // ever accepted and served
  // Closed at accept: max_connections were open, none of them in the handshake.
  std::atomic<uint64_t> connections_refused{0};
  std::atomic<uint64_t> handshakes_completed{0};
  std::array<std::atomic<uint64_t>, kNumHandshakeRefusals> handshakes_refused{};  // by reason
  // Connections that closed before sending a whole HELLO (e.g. port probes) count in neither.
};

// Slowest rate a frame's bytes may arrive (or its answer leave) before the connection counts
// as stalled: 1 MiB/s.
inline constexpr uint64_t kMinFrameBytesPerSecond = 1ull << 20;

class TcpServer {
 public:
  // Binds and starts accepting. Errors: kInvalidArgument for a host that is not an IP address,
  // kFailedPrecondition for a non-loopback host without a secret (CheckListenSecurity),
  // kUnavailable when the address cannot be bound.
  static StatusOr<std::unique_ptr<TcpServer>> Create(const TcpServerOptions& options,
                                                     MemoryRegistry* registry);
  ~TcpServer();  // closes every connection and joins its threads

  uint16_t port() const { return port_; }
  const TcpServerCounters& counters() const { return counters_; }

 private:
  struct Connection {
    std::unique_ptr<asio::ip::tcp::socket> socket;
    std::thread thread;
    bool done = false;           // guarded by mu_
    bool authenticated = false;  // proved the secret (before told so); guarded by mu_
    // Closed by the accept thread to make room (HandshakeRefusal::kCrowded); set under mu_.
    std::atomic<bool> crowded_out{false};
    // Steady-clock nanoseconds by which the current handshake or frame must be over; 0: none
    // (idle between frames). Set by the connection's thread, enforced by the watchdog.
    std::atomic<int64_t> deadline_ns{0};
    std::atomic<bool> timed_out{false};  // closed by the watchdog
  };
  TcpServer(const TcpServerOptions& options, MemoryRegistry* registry)
      : options_(options), registry_(registry), acceptor_(io_) {}
  void AcceptLoop();
  // Serves `socket`, closing the oldest connection in its handshake to make room, or refuses
  // it. Caller holds mu_.
  void Admit(std::unique_ptr<asio::ip::tcp::socket> socket);
  void WatchdogLoop();
  void Serve(Connection* connection);
  // The server's side of the handshake on a new connection: the client's descriptor, or why
  // the connection is closed (an empty message: the client went away). `*refusal` is set when
  // the failure counts as a refusal (HandshakeRefusal), left alone otherwise.
  // Marks the connection authenticated (under mu_) before the client is told it is.
  StatusOr<SegmentDescriptor> Handshake(Connection& connection,
                                        std::optional<HandshakeRefusal>* refusal);
  // Answers a READ of GPU memory through the connection's bounce buffers (`bounce_for`).
  template <typename BounceFor>
  Status ServeGpuRead(asio::ip::tcp::socket& socket, const wire::FrameHeader& h, int device,
                      BounceFor& bounce_for, asio::error_code& ec);

  // Bounce buffers per connection and device for GPU memory: a 1 MiB chunk is copied to or
  // from the device while the next one crosses the socket.
  static constexpr int kBounceBuffers = 4;
  static constexpr uint64_t kBounceBytes = 1ull << 20;
  // Moves connections whose thread finished out of connections_, to be joined once mu_ is
  // released. Caller holds mu_.
  std::list<Connection> TakeFinished();

  TcpServerOptions options_;
  MemoryRegistry* registry_;
  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  std::thread accept_thread_;
  std::thread watchdog_thread_;
  std::mutex mu_;
  std::condition_variable watchdog_cv_;
  bool stopping_ = false;
  std::list<Connection> connections_;
  TcpServerCounters counters_;
};

}  // namespace kvferry::tcp
