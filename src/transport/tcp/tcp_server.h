// Serving side of the TCP transport: accepts peers' connections and executes their frames
// against this engine's registered memory.
//
// Each connection gets one thread that reads a frame, executes it and answers in order:
// WRITE payloads are read straight into registered memory, READ payloads written straight
// from it. Every WRITE and READ range is checked against the MemoryRegistry first; a range
// outside memory registered for that access is answered with kFailedPrecondition and nothing
// is read or written (a WRITE's payload is drained). A malformed frame closes that connection
// with a logged reason; other connections carry on.
//
// Thread-safety: Create/destruction from one thread; serving runs on internal threads.
#pragma once

#include <asio.hpp>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

#include "kvferry/transfer.h"
#include "transport/memory_registry.h"
#include "transport/tcp/wire.h"

namespace kvferry::tcp {

struct TcpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  uint32_t max_body_bytes = 4u << 20;
  // Current descriptor of this engine (answers HELLO and DESCRIBE).
  std::function<SegmentDescriptor()> describe;
  // Called for each NOTIFY, on the connection's thread, before it is acknowledged.
  std::function<void(Notification)> on_notification;
};

class TcpServer {
 public:
  // Binds and starts accepting. Errors: kUnavailable when the address cannot be bound.
  static StatusOr<std::unique_ptr<TcpServer>> Create(const TcpServerOptions& options,
                                                     MemoryRegistry* registry);
  ~TcpServer();  // closes every connection and joins its threads

  uint16_t port() const { return port_; }

 private:
  struct Connection {
    std::unique_ptr<asio::ip::tcp::socket> socket;
    std::thread thread;
    bool done = false;
  };
  TcpServer(const TcpServerOptions& options, MemoryRegistry* registry)
      : options_(options), registry_(registry), acceptor_(io_) {}
  void AcceptLoop();
  void Serve(Connection* connection);
  // Answers a READ of GPU memory through the connection's bounce buffers (`bounce_for`).
  template <typename BounceFor>
  Status ServeGpuRead(asio::ip::tcp::socket& socket, const wire::FrameHeader& h, int device,
                      BounceFor& bounce_for, asio::error_code& ec);

  // Bounce buffers per connection and device for GPU memory: a 1 MiB chunk is copied to or
  // from the device while the next one crosses the socket.
  static constexpr int kBounceBuffers = 4;
  static constexpr uint64_t kBounceBytes = 1ull << 20;
  void ReapFinished();

  TcpServerOptions options_;
  MemoryRegistry* registry_;
  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  std::thread accept_thread_;
  std::mutex mu_;
  bool stopping_ = false;
  std::list<Connection> connections_;
};

}  // namespace kvferry::tcp
