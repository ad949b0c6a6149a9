// Authentication of engine handshakes (docs/security.md): a real peer process holding a secret,
// real sockets. A client without the secret, with another one, or speaking frames out of turn
// gets nothing but the challenge: no descriptor, no byte read or written, no notification
// delivered; one with the secret works on every lane.
#include <gtest/gtest.h>

#include <asio.hpp>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/auth.h"
#include "kvferry/engine.h"
#include "testutil/peer_process.h"
#include "transport/tcp/tcp_common.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testutil::PeerPatternByte;
using testutil::PeerProcess;

constexpr uint64_t kRegionBytes = 8ull << 20;
const std::string kSecret = "correct horse battery staple 42";

std::unique_ptr<TransferEngine> MakeEngine(const std::string& secret, int lanes = 4) {
  EngineOptions options;
  options.name = "auth-test-client";
  options.auth_secret = secret;
  options.tcp_lanes_per_peer = lanes;
  auto engine = TransferEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(*engine) : nullptr;
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    peer_ = std::make_unique<PeerProcess>(kRegionBytes, kSecret);
    ASSERT_TRUE(peer_->ok());
    const std::string& a = peer_->info().address;
    host_ = a.substr(0, a.rfind(':'));
    port_ = static_cast<uint16_t>(std::stoi(a.substr(a.rfind(':') + 1)));
  }

  uint64_t rw(uint64_t offset) const { return peer_->info().rw_base + offset; }

  // The peer's first `n` bytes, read by an engine holding the secret.
  std::vector<uint8_t> PeerBytes(uint64_t n) {
    auto engine = MakeEngine(kSecret);
    auto seg = engine->OpenSegment(peer_->info().address);
    EXPECT_TRUE(seg.ok()) << seg.status().ToString();
    std::vector<uint8_t> got(n);
    TransferRequest r{TransferOp::kRead, got.data(), *seg, rw(0), n};
    Status s = TransferSync(*engine, std::span(&r, 1));
    EXPECT_TRUE(s.ok()) << s.ToString();
    return got;
  }

  // How many notifications the peer received so far (it answers "count" to the asker).
  uint64_t PeerNotificationCount() {
    auto engine = MakeEngine(kSecret);
    auto seg = engine->OpenSegment(peer_->info().address);
    EXPECT_TRUE(seg.ok()) << seg.status().ToString();
    EXPECT_TRUE(engine->SendNotification(*seg, "count", milliseconds(5000)).ok());
    for (int i = 0; i < 500; ++i) {
      for (const Notification& n : engine->PollNotifications()) {
        if (n.message.rfind("count:", 0) == 0) return std::stoull(n.message.substr(6));
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    ADD_FAILURE() << "the peer did not answer 'count'";
    return 0;
  }

  void Connect(asio::ip::tcp::socket& s) { s.connect({asio::ip::make_address(host_), port_}); }

  // Everything the server sends until it closes the connection (5 s at most).
  static std::vector<uint8_t> ReadUntilClosed(asio::ip::tcp::socket& s) {
    timeval tv{5, 0};
    ::setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    std::vector<uint8_t> all;
    uint8_t buf[4096];
    while (true) {
      asio::error_code ec;
      size_t n = s.read_some(asio::buffer(buf), ec);
      all.insert(all.end(), buf, buf + n);
      if (ec) {
        EXPECT_TRUE(ec == asio::error::eof || ec == asio::error::connection_reset)
            << "the server kept the connection open: " << ec.message();
        return all;
      }
    }
  }

  // Sends HELLO with `nonce`; returns the server's challenge.
  static wire::AuthChallenge Hello(asio::ip::tcp::socket& s, const AuthNonce& nonce) {
    wire::AuthHello hello;
    hello.client_nonce = nonce;
    auto body = wire::EncodeAuthHello(hello);
    wire::FrameHeader h;
    h.type = wire::FrameType::kHello;
    h.body_bytes = static_cast<uint32_t>(body.size());
    auto hb = wire::EncodeFrameHeader(h);
    asio::write(s, std::array<asio::const_buffer, 2>{asio::buffer(hb), asio::buffer(body)});
    wire::HeaderBytes reply;
    asio::read(s, asio::buffer(reply));
    auto header = wire::DecodeFrameHeader(reply, 1 << 20);
    EXPECT_TRUE(header.ok());
    EXPECT_EQ(header->type, wire::FrameType::kChallenge);
    std::vector<uint8_t> challenge(header->body_bytes);
    asio::read(s, asio::buffer(challenge));
    auto decoded = wire::DecodeAuthChallenge(challenge);
    EXPECT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(decoded->flags, wire::kAuthFlagSecret);
    return decoded.ok() ? *decoded : wire::AuthChallenge{};
  }

  // Sends AUTH with `proof` and a descriptor, then `after` (frames that must not be served
  // unless the proof holds), and ends this side's sending; returns what the server sent until
  // it closed the connection.
  static std::vector<uint8_t> AuthThenClose(asio::ip::tcp::socket& s, const AuthProof& proof,
                                            const std::vector<uint8_t>& after = {}) {
    SegmentDescriptor me;
    me.name = "intruder";
    me.host = "127.0.0.1";
    me.port = 1;
    std::vector<uint8_t> desc = wire::EncodeDescriptor(me);
    wire::FrameHeader h;
    h.type = wire::FrameType::kAuth;
    h.body_bytes = static_cast<uint32_t>(proof.size() + desc.size());
    auto hb = wire::EncodeFrameHeader(h);
    asio::error_code ec;
    asio::write(s,
                std::array<asio::const_buffer, 4>{asio::buffer(hb), asio::buffer(proof),
                                                  asio::buffer(desc), asio::buffer(after)},
                ec);
    s.shutdown(asio::ip::tcp::socket::shutdown_send, ec);
    return ReadUntilClosed(s);
  }

  // A READ of the peer's first KiB and a WRITE of 0xEE over it, as raw frames.
  std::vector<uint8_t> ReadAndWriteFrames() const {
    std::vector<uint8_t> out;
    wire::FrameHeader r;
    r.type = wire::FrameType::kRead;
    r.addr = rw(0);
    r.length = 1024;
    auto rb = wire::EncodeFrameHeader(r);
    out.insert(out.end(), rb.begin(), rb.end());
    wire::FrameHeader w;
    w.type = wire::FrameType::kWrite;
    w.addr = rw(0);
    w.length = 1024;
    auto wb = wire::EncodeFrameHeader(w);
    out.insert(out.end(), wb.begin(), wb.end());
    out.insert(out.end(), 1024, 0xEE);
    wire::FrameHeader n;
    n.type = wire::FrameType::kNotify;
    n.body_bytes = 5;
    auto nb = wire::EncodeFrameHeader(n);
    out.insert(out.end(), nb.begin(), nb.end());
    for (char c : std::string("count")) out.push_back(static_cast<uint8_t>(c));
    return out;
  }

  void ExpectPeerUntouched() {
    std::vector<uint8_t> now = PeerBytes(1024);
    for (uint64_t i = 0; i < now.size(); ++i) {
      ASSERT_EQ(now[i], PeerPatternByte(i)) << "byte " << i << " of the peer changed";
    }
  }

  std::unique_ptr<PeerProcess> peer_;
  std::string host_;
  uint16_t port_ = 0;
};

// The same secret on both sides: descriptors, READ, WRITE and notifications work, over every
// lane (a 6 MiB batch in 256 KiB requests spreads over the four).
TEST_F(AuthTest, EngineWithTheSecretWorksOnEveryLane) {
  auto engine = MakeEngine(kSecret, 4);
  auto seg = engine->OpenSegment(peer_->info().address);
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  auto desc = engine->GetSegmentDescriptor(*seg);
  ASSERT_TRUE(desc.ok());
  EXPECT_EQ(desc->name, "test-peer");
  std::vector<uint8_t> src(6 << 20);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<TransferRequest> writes;
  for (uint64_t off = 0; off < src.size(); off += 256 << 10) {
    writes.push_back({TransferOp::kWrite, src.data() + off, *seg, rw(off), 256 << 10});
  }
  ASSERT_TRUE(TransferSync(*engine, writes).ok());
  std::vector<uint8_t> back(src.size());
  TransferRequest r{TransferOp::kRead, back.data(), *seg, rw(0), back.size()};
  ASSERT_TRUE(TransferSync(*engine, std::span(&r, 1)).ok());
  EXPECT_EQ(back, src);
}

// No secret, or another one: OpenSegment fails with kPermissionDenied naming why, and the
// peer's memory and notification count stay as they were.
TEST_F(AuthTest, EngineWithoutOrWithAnotherSecretGetsNothing) {
  const uint64_t notified = PeerNotificationCount();
  for (const std::string& secret : {std::string(), std::string("another secret of 24 bytes")}) {
    auto engine = MakeEngine(secret);
    auto seg = engine->OpenSegment(peer_->info().address);
    ASSERT_FALSE(seg.ok());
    EXPECT_EQ(seg.status().code(), StatusCode::kPermissionDenied) << seg.status().ToString();
    EXPECT_NE(seg.status().message().find(secret.empty() ? "this engine has none"
                                                         : "the auth secrets differ"),
              std::string::npos)
        << seg.status().ToString();
  }
  ExpectPeerUntouched();
  EXPECT_EQ(PeerNotificationCount(), notified + 1);  // only the count asked just before
}

// An engine holding a secret refuses a peer that holds none (it would otherwise hand its
// descriptor to anyone listening there).
TEST(AuthLocalTest, EngineWithASecretRefusesAPeerWithout) {
  PeerProcess open_peer(1 << 20, "");
  ASSERT_TRUE(open_peer.ok());
  auto engine = MakeEngine(kSecret);
  auto seg = engine->OpenSegment(open_peer.info().address);
  ASSERT_FALSE(seg.ok());
  EXPECT_EQ(seg.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(seg.status().message().find("holds no auth secret"), std::string::npos)
      << seg.status().ToString();
  // Two engines without a secret still talk.
  auto plain = MakeEngine("");
  EXPECT_TRUE(plain->OpenSegment(open_peer.info().address).ok());
}

// Raw frames before or instead of the handshake: the server answers nothing (at most the
// challenge) and closes; READ, WRITE and NOTIFY frames sent along are never served.
TEST_F(AuthTest, FramesBeforeTheHandshakeAreNeverServed) {
  const uint64_t notified = PeerNotificationCount();
  asio::io_context io;
  {
    // READ, WRITE and NOTIFY with no handshake at all.
    asio::ip::tcp::socket s(io);
    Connect(s);
    asio::write(s, asio::buffer(ReadAndWriteFrames()));
    EXPECT_TRUE(ReadUntilClosed(s).empty());
  }
  {
    // HELLO, then the frames instead of AUTH: the challenge and nothing else.
    asio::ip::tcp::socket s(io);
    Connect(s);
    Hello(s, AuthNonce{});
    asio::write(s, asio::buffer(ReadAndWriteFrames()));
    EXPECT_TRUE(ReadUntilClosed(s).empty());
  }
  {
    // A descriptor-carrying HELLO of the old protocol shape.
    asio::ip::tcp::socket s(io);
    Connect(s);
    SegmentDescriptor me;
    me.name = "old";
    std::vector<uint8_t> body = wire::EncodeDescriptor(me);
    wire::FrameHeader h;
    h.type = wire::FrameType::kHello;
    h.body_bytes = static_cast<uint32_t>(body.size());
    auto hb = wire::EncodeFrameHeader(h);
    asio::write(s, std::array<asio::const_buffer, 2>{asio::buffer(hb), asio::buffer(body)});
    EXPECT_TRUE(ReadUntilClosed(s).empty());
  }
  ExpectPeerUntouched();
  EXPECT_EQ(PeerNotificationCount(), notified + 1);
}

// Wrong proofs: a guessed one, one computed without the secret, and the server's own proof
// reflected back (both nonces match, only the role differs). Each connection is closed after
// the challenge with no descriptor, and the frames pipelined behind the proof are not served.
TEST_F(AuthTest, WrongAndReflectedProofsAreRefused) {
  const uint64_t notified = PeerNotificationCount();
  asio::io_context io;
  AuthNonce nonce{};
  nonce[0] = 7;
  auto attempt = [&](const std::function<AuthProof(const wire::AuthChallenge&)>& make_proof) {
    asio::ip::tcp::socket s(io);
    Connect(s);
    wire::AuthChallenge c = Hello(s, nonce);
    std::vector<uint8_t> answered = AuthThenClose(s, make_proof(c), ReadAndWriteFrames());
    EXPECT_TRUE(answered.empty()) << answered.size() << " bytes answered to a wrong proof";
  };
  attempt([](const wire::AuthChallenge&) { return AuthProof{}; });
  attempt([&](const wire::AuthChallenge& c) {
    return HandshakeProof("", AuthContext::kEngine, AuthRole::kClient, nonce, c.server_nonce);
  });
  attempt([](const wire::AuthChallenge& c) { return c.server_proof; });
  attempt([&](const wire::AuthChallenge& c) {  // right secret, wrong protocol (fd socket's)
    return HandshakeProof(kSecret, AuthContext::kFdSocket, AuthRole::kClient, nonce,
                          c.server_nonce);
  });
  ExpectPeerUntouched();
  EXPECT_EQ(PeerNotificationCount(), notified + 1);

  // The same exchange with the right proof is served: the test can fail.
  asio::ip::tcp::socket s(io);
  Connect(s);
  wire::AuthChallenge c = Hello(s, nonce);
  EXPECT_TRUE(ProofMatches(
      c.server_proof,
      HandshakeProof(kSecret, AuthContext::kEngine, AuthRole::kServer, nonce, c.server_nonce)));
  AuthProof right =
      HandshakeProof(kSecret, AuthContext::kEngine, AuthRole::kClient, nonce, c.server_nonce);
  std::vector<uint8_t> answered = AuthThenClose(s, right, ReadAndWriteFrames());
  ASSERT_GE(answered.size(), wire::kFrameHeaderBytes);
  auto first = wire::DecodeFrameHeader(
      std::span<const uint8_t, wire::kFrameHeaderBytes>(answered.data(), wire::kFrameHeaderBytes),
      1 << 20);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->type, wire::FrameType::kHelloAck);
  EXPECT_GT(answered.size(), wire::kFrameHeaderBytes + first->body_bytes + 1024)
      << "the READ behind a right proof was not served";
}

// The client checks the server's proof before it sends its own descriptor: a fake server that
// answers with a made-up proof never learns the client's proof or descriptor.
TEST(AuthLocalTest, ClientRefusesAServerThatCannotProveTheSecret) {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  const uint16_t port = acceptor.local_endpoint().port();
  std::vector<uint8_t> after_challenge;
  std::thread fake([&] {
    asio::ip::tcp::socket s(io);
    acceptor.accept(s);
    std::array<uint8_t, wire::kFrameHeaderBytes + wire::kAuthHelloBytes> hello;
    asio::read(s, asio::buffer(hello));
    wire::AuthChallenge c;
    c.flags = wire::kAuthFlagSecret;
    c.server_proof.fill(0x42);
    auto body = wire::EncodeAuthChallenge(c);
    wire::FrameHeader h;
    h.type = wire::FrameType::kChallenge;
    h.body_bytes = static_cast<uint32_t>(body.size());
    auto hb = wire::EncodeFrameHeader(h);
    asio::write(s, std::array<asio::const_buffer, 2>{asio::buffer(hb), asio::buffer(body)});
    uint8_t buf[4096];
    asio::error_code ec;
    while (!ec) {
      size_t n = s.read_some(asio::buffer(buf), ec);
      after_challenge.insert(after_challenge.end(), buf, buf + n);
    }
  });
  auto engine = MakeEngine(kSecret);
  auto seg = engine->OpenSegment("127.0.0.1:" + std::to_string(port));
  fake.join();
  ASSERT_FALSE(seg.ok());
  EXPECT_EQ(seg.status().code(), StatusCode::kPermissionDenied) << seg.status().ToString();
  EXPECT_TRUE(after_challenge.empty()) << "the client sent " << after_challenge.size()
                                       << " bytes to a server that did not prove the secret";
}

// Listening on a non-loopback address needs a secret, or insecure.
TEST(AuthLocalTest, NonLoopbackListenNeedsASecretOrInsecure) {
  EngineOptions options;
  options.listen_host = "0.0.0.0";
  auto refused = TransferEngine::Create(options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("0.0.0.0"), std::string::npos);
  options.insecure = true;
  EXPECT_TRUE(TransferEngine::Create(options).ok());
  options.insecure = false;
  options.auth_secret = kSecret;
  EXPECT_TRUE(TransferEngine::Create(options).ok());
  options.auth_secret = "short";
  auto short_secret = TransferEngine::Create(options);
  ASSERT_FALSE(short_secret.ok());
  EXPECT_EQ(short_secret.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(short_secret.status().message().find("short"), std::string::npos)
      << "the message quotes the secret";
}

// Regions registered without remote access are not published, and nothing reaches them.
TEST(AuthLocalTest, RegionsWithoutRemoteAccessAreNotPublished) {
  auto server = MakeEngine("");
  std::vector<uint8_t> hidden(4096, 0x11), shown(4096, 0x22);
  ASSERT_TRUE(server->RegisterMemory(hidden.data(), hidden.size(), {}, kAccessNone).ok());
  ASSERT_TRUE(server->RegisterMemory(shown.data(), shown.size(), {}, kAccessRemoteWrite).ok());
  auto client = MakeEngine("");
  auto seg = client->OpenSegment(server->LocalDescriptor().Address());
  ASSERT_TRUE(seg.ok());
  auto desc = client->GetSegmentDescriptor(*seg);
  ASSERT_EQ(desc->regions.size(), 1u);
  EXPECT_EQ(desc->regions[0].base, reinterpret_cast<uint64_t>(shown.data()));
  std::vector<uint8_t> got(64);
  TransferRequest read_hidden{TransferOp::kRead, got.data(), *seg,
                              reinterpret_cast<uint64_t>(hidden.data()), got.size()};
  EXPECT_FALSE(TransferSync(*client, std::span(&read_hidden, 1)).ok());
  TransferRequest read_shown{TransferOp::kRead, got.data(), *seg,
                             reinterpret_cast<uint64_t>(shown.data()), got.size()};
  EXPECT_FALSE(TransferSync(*client, std::span(&read_shown, 1)).ok());  // write-only
}

}  // namespace
}  // namespace kvferry
