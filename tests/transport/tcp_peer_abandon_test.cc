// TcpPeer::Abandon against a real engine over a real socket, for an item TCP never carried:
// another transport's item that is being completed elsewhere (the UCX lanes hand their
// notifications and queries to a TcpPeer, and an abandon may race a lane's own completion).
// The peer must leave such an item alone, also while some of its lanes are not connected yet.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>

#include "kvferry/engine.h"
#include "transport/tcp/tcp_peer.h"

namespace kvferry {
namespace {

class CountingOwner : public WorkOwner {
 public:
  void OnWorkDone(WorkItem*, const Status&) override { calls.fetch_add(1); }
  std::atomic<int> calls{0};
};

TEST(TcpPeerAbandonTest, ItemNoLaneCarriedIsLeftAlone) {
  EngineOptions o;
  o.name = "served";
  o.transport = "tcp";
  auto served = TransferEngine::Create(o);
  ASSERT_TRUE(served.ok()) << served.status().ToString();

  tcp::TcpPeerOptions p;
  p.address = "127.0.0.1:" + std::to_string((*served)->LocalDescriptor().port);
  p.self.name = "initiator";
  p.self.host = "127.0.0.1";
  p.self.port = 1;
  p.num_lanes = 4;  // lanes 1..3 connect on first use: none is connected here
  auto peer = tcp::TcpPeer::Create(p);
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

}  // namespace
}  // namespace kvferry
