// TcpPeer against real engines and sockets: failed lanes are released, a handshake that gets no
// answer ends at the connect timeout, and TcpPeer::Abandon of an item TCP never carried:
// another transport's item that is being completed elsewhere (the UCX lanes hand their
// notifications and queries to a TcpPeer, and an abandon may race a lane's own completion).
// The peer must leave such an item alone, also while some of its lanes are not connected yet.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>

#include "kvferry/engine.h"
#include "transport/tcp/tcp_peer.h"

namespace kvferry {
namespace {

class CountingOwner : public WorkOwner {
 public:
  void OnWorkDone(WorkItem*, const Status&) override { calls.fetch_add(1); }
  std::atomic<int> calls{0};
};

// A TCP engine for the peer to connect to.
StatusOr<std::unique_ptr<TransferEngine>> StartServed() {
  EngineOptions o;
  o.name = "served";
  o.transport = "tcp";
  return TransferEngine::Create(o);
}

// Options of a TcpPeer to `port` on this host, with `lanes` lanes.
tcp::TcpPeerOptions PeerOptions(uint16_t port, int lanes) {
  tcp::TcpPeerOptions p;
  p.address = "127.0.0.1:" + std::to_string(port);
  p.self.name = "initiator";
  p.self.host = "127.0.0.1";
  p.self.port = 1;
  p.num_lanes = lanes;
  return p;
}

TEST(TcpPeerAbandonTest, ItemNoLaneCarriedIsLeftAlone) {
  auto served = StartServed();
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  // Lanes 1..3 connect on first use: none is connected here.
  auto peer = tcp::TcpPeer::Create(PeerOptions((*served)->LocalDescriptor().port, 4));
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();

  CountingOwner owner;
  WorkItem item;
  item.kind = WorkItem::Kind::kWrite;
  item.owner = &owner;
  item.state.store(WorkItem::kTaken);  // taken by another transport, carrier never set
  (*peer)->Abandon(&item, CancelledError("deadline"));
  EXPECT_EQ(item.state.load(), WorkItem::kTaken);
  EXPECT_EQ(owner.calls.load(), 0);

  item.state.store(WorkItem::kDone);  // completed meanwhile
  (*peer)->Abandon(&item, CancelledError("deadline"));
  EXPECT_EQ(owner.calls.load(), 0);
  (*peer)->Close();
}

// Memory mappings of this process (/proc/self/maps lines): an exited but unjoined thread
// keeps its stack and guard page mapped.
int MappingCount() {
  std::ifstream maps("/proc/self/maps");
  return static_cast<int>(
      std::count(std::istreambuf_iterator<char>(maps), std::istreambuf_iterator<char>(), '\n'));
}

// Submissions to a peer that has gone away each open a lane that fails: the lanes go once
// their threads have returned, so a segment that stays open does not gather two exited
// threads per submission until the process runs out of mappings.
TEST(TcpPeerAbandonTest, FailedLanesAreReleased) {
  auto served = StartServed();
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  tcp::TcpPeerOptions p = PeerOptions((*served)->LocalDescriptor().port, 1);
  p.connect_timeout = std::chrono::milliseconds(1000);
  auto peer = tcp::TcpPeer::Create(p);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  served->reset();  // the peer goes away: every lane from now on fails to connect
  CountingOwner owner;
  const int before = MappingCount();
  constexpr int kSubmissions = 300;
  for (int i = 0; i < kSubmissions; ++i) {
    auto item = std::make_shared<WorkItem>();
    item->kind = WorkItem::Kind::kNotify;
    item->message = "ping";
    item->owner = &owner;
    (*peer)->Submit(item);
    while (owner.calls.load() < i + 1) std::this_thread::yield();
  }
  EXPECT_EQ(owner.calls.load(), kSubmissions);
  // Two mappings per unreleased lane would be 600; a few lanes may still be returning.
  EXPECT_LT(MappingCount() - before, 60);
  (*peer)->Close();
}

// A peer whose kernel accepts connections (its listen backlog) but which never answers, as a
// frozen process does: opening it fails once the connect timeout has passed, naming why,
// instead of waiting forever in the handshake.
TEST(TcpPeerTest, HandshakeWithAPeerThatNeverAnswersEndsAtTheConnectTimeout) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  tcp::TcpPeerOptions p = PeerOptions(ntohs(addr.sin_port), 1);
  p.connect_timeout = std::chrono::milliseconds(500);
  const auto start = std::chrono::steady_clock::now();
  auto peer = tcp::TcpPeer::Create(p);
  const auto took = std::chrono::steady_clock::now() - start;
  ::close(listener);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(peer.status().message().find("no answer in time"), std::string::npos)
      << peer.status().ToString();
  EXPECT_LT(took, std::chrono::milliseconds(3000));
}

}  // namespace
}  // namespace kvferry
