// The TCP serving side's bounds, against a real engine over real sockets: connections beyond
// the cap are closed at once, connections stuck in their handshake give way to newer ones (at
// either cap), a connection that never says HELLO is closed after the handshake
// timeout, a frame that stalls or trickles in is closed after the frame timeout, a greeted
// connection may stay idle between frames, a frame body costs memory only as its bytes
// arrive, and large WRITEs are acknowledged while more requests are still arriving.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <asio.hpp>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvferry/engine.h"
#include "transport/tcp/tcp_common.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::unique_ptr<TransferEngine> MakeEngine(int max_connections = 1024, int max_handshakes = 64,
                                           milliseconds handshake_timeout = milliseconds(400)) {
  EngineOptions o;
  o.name = "bounded";
  o.tcp_max_connections = max_connections;
  o.tcp_max_handshakes = max_handshakes;
  o.tcp_handshake_timeout = handshake_timeout;
  o.tcp_frame_timeout = milliseconds(400);
  auto e = TransferEngine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(*e) : nullptr;
}

// A raw connection to the engine's port.
class RawConnection {
 public:
  // Connects; with `authenticate`, performs the handshake too (the engine has no secret, so
  // the proofs are of the empty one).
  RawConnection(uint16_t port, bool authenticate = false) : socket_(io_) {
    if (authenticate) {
      SegmentDescriptor self;
      self.name = "raw";
      self.host = "127.0.0.1";
      self.port = 1;
      SegmentDescriptor peer;
      Status s = tcp::ConnectAndHello(socket_, "127.0.0.1:" + std::to_string(port), self,
                                      /*auth_secret=*/"", milliseconds(2000), 16u << 20, &peer);
      EXPECT_TRUE(s.ok()) << s.ToString();
      return;
    }
    asio::error_code ec;
    socket_.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
    EXPECT_FALSE(ec) << ec.message();
  }
  asio::ip::tcp::socket& socket() { return socket_; }
  int fd() { return socket_.native_handle(); }

  // Whether the server closed the connection within `limit` (a read returns EOF or an error).
  bool ClosedWithin(milliseconds limit) {
    const auto until = Clock::now() + limit;
    while (Clock::now() < until) {
      pollfd p{fd(), POLLIN, 0};
      const int left =
          static_cast<int>(std::chrono::duration_cast<milliseconds>(until - Clock::now()).count());
      if (::poll(&p, 1, std::max(left, 1)) > 0) {
        char byte;
        const ssize_t n = ::recv(fd(), &byte, 1, MSG_DONTWAIT);
        if (n <= 0) return true;
      }
    }
    return false;
  }

  void Send(const wire::FrameHeader& h) {
    wire::HeaderBytes bytes = wire::EncodeFrameHeader(h);
    asio::write(socket_, asio::buffer(bytes));
  }

 private:
  asio::io_context io_;
  asio::ip::tcp::socket socket_;
};

// Reads one frame header, waiting at most `limit`; nullopt on timeout, close or a bad header.
std::optional<wire::FrameHeader> ReadHeaderWithin(RawConnection& c, milliseconds limit) {
  wire::HeaderBytes bytes{};
  size_t got = 0;
  const auto until = Clock::now() + limit;
  while (got < bytes.size() && Clock::now() < until) {
    pollfd p{c.fd(), POLLIN, 0};
    const int left =
        static_cast<int>(std::chrono::duration_cast<milliseconds>(until - Clock::now()).count());
    if (::poll(&p, 1, std::max(left, 1)) <= 0) continue;
    const ssize_t n = ::recv(c.fd(), bytes.data() + got, bytes.size() - got, MSG_DONTWAIT);
    if (n <= 0) return std::nullopt;
    got += static_cast<size_t>(n);
  }
  if (got < bytes.size()) return std::nullopt;
  auto h = wire::DecodeFrameHeader(bytes, 1u << 20);
  if (!h.ok()) return std::nullopt;
  return *h;
}

int64_t ResidentBytes() {
  std::ifstream in("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

TEST(TcpBoundsTest, ConnectionsBeyondTheCapAreClosedAtOnce) {
  auto engine = MakeEngine(/*max_connections=*/4);
  ASSERT_NE(engine, nullptr);
  const uint16_t port = engine->LocalDescriptor().port;
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<RawConnection>(port, /*authenticate=*/true));
    ASSERT_FALSE(HasFailure());
  }
  RawConnection extra(port);
  EXPECT_TRUE(extra.ClosedWithin(milliseconds(300)));
  // The held ones are served: a greeted connection idle for longer than the frame timeout is
  // still open.
  std::this_thread::sleep_for(milliseconds(700));
  for (auto& c : held) EXPECT_FALSE(c->ClosedWithin(milliseconds(10)));
  held.clear();
  // Room again once they closed (the server notices at its next accept).
  std::this_thread::sleep_for(milliseconds(100));
  RawConnection first_after(port);
  RawConnection second_after(port, /*authenticate=*/true);
  EXPECT_FALSE(second_after.ClosedWithin(milliseconds(100)));
}

// Connections that never say HELLO, as many as the cap, do not lock an authenticating peer out
// for the handshake timeout: the oldest of them is closed to make room.
TEST(TcpBoundsTest, SilentConnectionsAtTheCapGiveWayToAPeer) {
  auto engine = MakeEngine(/*max_connections=*/4, 64, milliseconds(10000));
  ASSERT_NE(engine, nullptr);
  const uint16_t port = engine->LocalDescriptor().port;
  std::vector<std::unique_ptr<RawConnection>> silent;
  for (int i = 0; i < 4; ++i) silent.push_back(std::make_unique<RawConnection>(port));
  RawConnection peer(port, /*authenticate=*/true);
  ASSERT_FALSE(HasFailure());
  EXPECT_TRUE(silent[0]->ClosedWithin(milliseconds(2000)));
  for (int i = 1; i < 4; ++i) EXPECT_FALSE(silent[i]->ClosedWithin(milliseconds(10)));
  EXPECT_FALSE(peer.ClosedWithin(milliseconds(10)));
  const EngineMetrics m = engine->Metrics();
  EXPECT_EQ(m.handshakes_refused_crowded, 1u);
  EXPECT_EQ(m.handshakes_completed, 1u);
  EXPECT_EQ(m.connections_refused, 0u);
}

// At most max_handshakes connections wait in their handshake: a newer one closes the oldest
// long before the handshake timeout; authenticated connections do not count.
TEST(TcpBoundsTest, HandshakesBeyondTheirCapCloseTheOldest) {
  auto engine = MakeEngine(1024, /*max_handshakes=*/2, milliseconds(10000));
  ASSERT_NE(engine, nullptr);
  const uint16_t port = engine->LocalDescriptor().port;
  std::vector<std::unique_ptr<RawConnection>> peers;
  for (int i = 0; i < 3; ++i) {
    peers.push_back(std::make_unique<RawConnection>(port, /*authenticate=*/true));
    ASSERT_FALSE(HasFailure());
  }
  RawConnection first(port), second(port);
  EXPECT_FALSE(first.ClosedWithin(milliseconds(100)));
  RawConnection third(port);
  EXPECT_TRUE(first.ClosedWithin(milliseconds(2000)));
  EXPECT_FALSE(second.ClosedWithin(milliseconds(10)));
  EXPECT_FALSE(third.ClosedWithin(milliseconds(10)));
  for (auto& p : peers) EXPECT_FALSE(p->ClosedWithin(milliseconds(10)));
  const EngineMetrics m = engine->Metrics();
  EXPECT_EQ(m.handshakes_refused_crowded, 1u);
  EXPECT_EQ(m.handshakes_refused_timeout, 0u);
  // The closed connection's thread ends soon after its client saw the close.
  const auto until = Clock::now() + milliseconds(2000);
  while (engine->Metrics().connections_open != 5 && Clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ(engine->Metrics().connections_open, 5u);
}

TEST(TcpBoundsTest, ConnectionWithoutHelloIsClosedAfterTheHandshakeTimeout) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  RawConnection silent(engine->LocalDescriptor().port);
  const auto start = Clock::now();
  EXPECT_TRUE(silent.ClosedWithin(milliseconds(3000)));
  EXPECT_GE(Clock::now() - start, milliseconds(300));
}

TEST(TcpBoundsTest, TrickledHeaderIsClosedAfterTheFrameTimeout) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  RawConnection c(engine->LocalDescriptor().port, /*authenticate=*/true);
  ASSERT_FALSE(HasFailure());
  wire::FrameHeader h;
  h.type = wire::FrameType::kDescribe;
  h.request_id = 2;
  wire::HeaderBytes bytes = wire::EncodeFrameHeader(h);
  bool closed = false;
  for (size_t i = 0; i + 1 < bytes.size() && !closed; ++i) {
    asio::error_code ec;
    asio::write(c.socket(), asio::buffer(&bytes[i], 1), ec);
    closed = ec || c.ClosedWithin(milliseconds(100));
  }
  EXPECT_TRUE(closed) << "a header trickling in at 10 bytes/s was served for 4 s";
}

TEST(TcpBoundsTest, StalledWritePayloadIsClosedAfterTheFrameTimeout) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  std::vector<uint8_t> region(1 << 20);
  ASSERT_TRUE(engine->RegisterMemory(region.data(), region.size(), {}).ok());
  RawConnection c(engine->LocalDescriptor().port, /*authenticate=*/true);
  ASSERT_FALSE(HasFailure());
  wire::FrameHeader h;
  h.type = wire::FrameType::kWrite;
  h.request_id = 3;
  h.addr = reinterpret_cast<uint64_t>(region.data());
  h.length = region.size();
  c.Send(h);
  asio::write(c.socket(), asio::buffer(region.data(), 1000));  // then silence
  // frame_timeout (0.4 s) plus 1 MiB at 1 MiB/s: not sooner, and not much later.
  const auto start = Clock::now();
  EXPECT_TRUE(c.ClosedWithin(milliseconds(4000)));
  EXPECT_GE(Clock::now() - start, milliseconds(1200));
}

TEST(TcpBoundsTest, AnnouncedBodyCostsMemoryOnlyAsItArrives) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  const uint16_t port = engine->LocalDescriptor().port;
  const int64_t before = ResidentBytes();  // after the engine's own start
  std::vector<std::unique_ptr<RawConnection>> conns;
  for (int i = 0; i < 40; ++i) {
    conns.push_back(std::make_unique<RawConnection>(port, /*authenticate=*/true));
    ASSERT_FALSE(HasFailure());
    wire::FrameHeader h;
    h.type = wire::FrameType::kNotify;
    h.request_id = 2;
    h.body_bytes = 1u << 20;  // announced and never sent
    conns.back()->Send(h);
  }
  std::this_thread::sleep_for(milliseconds(200));
  const int64_t grown = ResidentBytes() - before;
  // Allocated up front, 40 bodies of 1 MiB would take 40 MiB.
  EXPECT_LT(grown, 16ll << 20) << "resident memory grew by " << (grown >> 20) << " MiB";
  for (auto& c : conns) EXPECT_TRUE(c->ClosedWithin(milliseconds(3000)));
}

// A client with a bounded number of bytes in flight (the GPU bounce channel) sends its next
// WRITE before the previous one is acknowledged; the acknowledgement of a large WRITE must not
// wait until the socket has nothing more to read.
TEST(TcpBoundsTest, LargeWriteIsAcknowledgedWhileTheNextOneArrives) {
  // A frame timeout far beyond the wait below: a server that held the acknowledgement would
  // send it only when the half-sent WRITE times out.
  EngineOptions o;
  o.name = "acks";
  o.tcp_frame_timeout = milliseconds(20000);
  auto made = TransferEngine::Create(o);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::unique_ptr<TransferEngine> engine = std::move(*made);
  constexpr uint64_t kWrite = 1 << 20;
  std::vector<uint8_t> region(2 * kWrite, 0);
  ASSERT_TRUE(engine->RegisterMemory(region.data(), region.size(), {}).ok());
  RawConnection c(engine->LocalDescriptor().port, /*authenticate=*/true);
  ASSERT_FALSE(HasFailure());
  std::vector<uint8_t> payload(2 * kWrite);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7 + 1);
  wire::FrameHeader a;
  a.type = wire::FrameType::kWrite;
  a.request_id = 10;
  a.addr = reinterpret_cast<uint64_t>(region.data());
  a.length = kWrite;
  wire::FrameHeader b = a;
  b.request_id = 11;
  b.addr += kWrite;
  const wire::HeaderBytes ha = wire::EncodeFrameHeader(a);
  const wire::HeaderBytes hb = wire::EncodeFrameHeader(b);
  // A whole, then B's header and half its payload, in one write: B's bytes are queued in the
  // server's socket when it finishes A.
  std::vector<asio::const_buffer> first = {asio::buffer(ha), asio::buffer(payload.data(), kWrite),
                                           asio::buffer(hb),
                                           asio::buffer(payload.data() + kWrite, kWrite / 2)};
  asio::write(c.socket(), first);
  std::optional<wire::FrameHeader> ack = ReadHeaderWithin(c, milliseconds(3000));
  ASSERT_TRUE(ack.has_value()) << "no acknowledgement of the first 1 MiB WRITE while the second "
                                  "was still arriving";
  EXPECT_EQ(ack->type, wire::FrameType::kWriteAck);
  EXPECT_EQ(ack->request_id, 10u);
  EXPECT_EQ(ack->status, 0u);
  asio::write(c.socket(), asio::buffer(payload.data() + kWrite + kWrite / 2, kWrite / 2));
  ack = ReadHeaderWithin(c, milliseconds(2000));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->request_id, 11u);
  EXPECT_EQ(ack->status, 0u);
  EXPECT_EQ(region, payload);
}

}  // namespace
}  // namespace kvferry
