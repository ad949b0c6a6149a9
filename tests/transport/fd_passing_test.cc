// The NVLink transport's fd socket (fd_passing.h) with a shared secret: only a client that
// proves it gets a descriptor, and the provider (which exports GPU memory) never runs for
// anyone else. Runs without a GPU: the provider hands out a pipe's descriptor.
#include "transport/nvlink/fd_passing.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "common/auth.h"

namespace kvferry {
namespace {

const std::string kSecret = "fd socket secret, 32 bytes long";

class FdPassingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::pipe(pipe_), 0);
    name_ = "kvferry-fd-auth-test-" + std::to_string(::getpid());
    auto server = FdServer::Create(name_, kSecret, [this](uint64_t key) -> StatusOr<int> {
      ++provided_;
      if (key != 42) return NotFoundError("unknown key");
      return ::dup(pipe_[1]);
    });
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
  }
  void TearDown() override {
    server_.reset();
    ::close(pipe_[0]);
    ::close(pipe_[1]);
  }

  // A raw connection to the server.
  int Connect() {
    int c = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, name_.data(), name_.size());
    const socklen_t len =
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name_.size());
    EXPECT_EQ(::connect(c, reinterpret_cast<sockaddr*>(&addr), len), 0);
    timeval tv{5, 0};
    ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return c;
  }

  int pipe_[2] = {-1, -1};
  std::string name_;
  std::atomic<int> provided_{0};
  std::unique_ptr<FdServer> server_;
};

// The right secret gets a working descriptor (bytes written to it come out of the pipe).
TEST_F(FdPassingTest, TheSecretGetsTheDescriptor) {
  auto fd = RequestFd(name_, 42, kSecret);
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  ASSERT_EQ(::write(*fd, "x", 1), 1);
  char c = 0;
  ASSERT_EQ(::read(pipe_[0], &c, 1), 1);
  EXPECT_EQ(c, 'x');
  ::close(*fd);
  EXPECT_EQ(provided_.load(), 1);
  auto unknown = RequestFd(name_, 7, kSecret);
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
}

// No secret or another one: kPermissionDenied, and the provider never ran.
TEST_F(FdPassingTest, WithoutTheSecretNothingIsProvided) {
  for (const std::string& secret : {std::string(), std::string("another secret, 26 bytes..")}) {
    auto fd = RequestFd(name_, 42, secret);
    ASSERT_FALSE(fd.ok());
    EXPECT_EQ(fd.status().code(), StatusCode::kPermissionDenied) << fd.status().ToString();
  }
  EXPECT_EQ(provided_.load(), 0);
}

// A client that answers the challenge with a wrong proof, or with the server's own proof
// reflected, gets no status byte and no descriptor: the connection just closes.
TEST_F(FdPassingTest, WrongOrReflectedProofGetsNoAnswer) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    int c = Connect();
    std::array<uint8_t, kAuthNonceBytes + 8> request{};
    request[kAuthNonceBytes] = 42;  // key 42, little-endian
    ASSERT_EQ(::write(c, request.data(), request.size()), static_cast<ssize_t>(request.size()));
    std::array<uint8_t, kAuthNonceBytes + kAuthProofBytes> challenge{};
    ASSERT_EQ(::recv(c, challenge.data(), challenge.size(), MSG_WAITALL),
              static_cast<ssize_t>(challenge.size()));
    AuthProof proof{};
    if (attempt == 1)
      std::copy(challenge.begin() + kAuthNonceBytes, challenge.end(), proof.begin());
    ASSERT_EQ(::write(c, proof.data(), proof.size()), static_cast<ssize_t>(proof.size()));
    uint8_t status = 0;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    iovec iov{&status, 1};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    EXPECT_EQ(::recvmsg(c, &msg, 0), 0) << "the server answered a wrong proof";
    EXPECT_EQ(CMSG_FIRSTHDR(&msg), nullptr);
    ::close(c);
  }
  EXPECT_EQ(provided_.load(), 0);
  // The right proof on the same raw exchange is answered: the test can fail.
  int c = Connect();
  std::array<uint8_t, kAuthNonceBytes + 8> request{};
  request[kAuthNonceBytes] = 42;
  ASSERT_EQ(::write(c, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::array<uint8_t, kAuthNonceBytes + kAuthProofBytes> challenge{};
  ASSERT_EQ(::recv(c, challenge.data(), challenge.size(), MSG_WAITALL),
            static_cast<ssize_t>(challenge.size()));
  AuthNonce client_nonce{}, server_nonce{};
  std::copy(challenge.begin(), challenge.begin() + kAuthNonceBytes, server_nonce.begin());
  AuthProof proof = HandshakeProof(kSecret, AuthContext::kFdSocket, AuthRole::kClient, client_nonce,
                                   server_nonce);
  ASSERT_EQ(::write(c, proof.data(), proof.size()), static_cast<ssize_t>(proof.size()));
  uint8_t status = 1;
  ASSERT_EQ(::recv(c, &status, 1, 0), 1);
  EXPECT_EQ(status, 0);
  ::close(c);
  EXPECT_EQ(provided_.load(), 1);
}

// A client that connects and sends a byte now and then, never finishing its request, holds
// the server (one connection at a time) for at most its 2 s: a real request made meanwhile is
// answered, not starved until its own time runs out.
TEST_F(FdPassingTest, ATricklingClientHoldsTheServerOnlyForItsTime) {
  int slow = Connect();
  std::atomic<bool> stop{false};
  std::thread trickler([&] {
    while (!stop.load()) {
      if (::send(slow, "x", 1, MSG_NOSIGNAL) != 1) return;  // cut off
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server holds it now
  const auto start = std::chrono::steady_clock::now();
  auto fd = RequestFd(name_, 42, kSecret);
  const auto took = std::chrono::steady_clock::now() - start;
  stop.store(true);
  trickler.join();
  ::close(slow);
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  ::close(*fd);
  EXPECT_LT(took, std::chrono::milliseconds(4000));
}

}  // namespace
}  // namespace kvferry
