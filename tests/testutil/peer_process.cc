#include "testutil/peer_process.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "kvferry/engine.h"
#include "testutil/netns.h"

namespace kvferry::testutil {

uint8_t PeerPatternByte(uint64_t i) { return static_cast<uint8_t>((i * 131) ^ (i >> 9)); }

uint64_t Hash64(const void* data, size_t length) { return XXH64(data, length, 0); }

namespace {

[[noreturn]] void ChildMain(int write_fd, uint64_t region_bytes, const PeerOptions& peer) {
  auto fail = [&](const std::string& why) {
    std::string msg = "ERR " + why + "\n";
    (void)!::write(write_fd, msg.data(), msg.size());
    ::_exit(1);
  };
  if (!peer.netns.empty()) {
    const std::string failed = EnterNetnsInChild(peer.netns);
    if (!failed.empty()) fail(failed);
  }
  for (const auto& [name, value] : peer.env) ::setenv(name.c_str(), value.c_str(), 1);
  auto* rw = static_cast<uint8_t*>(
      ::mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  const uint64_t ro_bytes = 1 << 20;
  auto* ro = static_cast<uint8_t*>(
      ::mmap(nullptr, ro_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (rw == MAP_FAILED || ro == MAP_FAILED) fail("mmap");
  for (uint64_t i = 0; i < region_bytes; ++i) rw[i] = PeerPatternByte(i);
  for (uint64_t i = 0; i < ro_bytes; ++i) ro[i] = PeerPatternByte(i);
  EngineOptions options;
  options.name = "test-peer";
  options.auth_secret = peer.auth_secret;
  options.listen_host = peer.listen_host;
  options.transport = peer.transport;
  auto engine = TransferEngine::Create(options);
  if (!engine.ok()) fail(engine.status().ToString());
  TransferEngine* e = engine->get();
  if (!e->RegisterMemory(rw, region_bytes, {}, kAccessRemoteReadWrite).ok()) fail("register rw");
  if (!e->RegisterMemory(ro, ro_bytes, {}, kAccessRemoteRead).ok()) fail("register ro");
  auto received = std::make_shared<std::atomic<uint64_t>>(0);
  e->SetNotificationHandler([e, rw, region_bytes, received](const Notification& n) {
    const uint64_t before = (*received)++;
    unsigned long long off = 0, len = 0;
    std::string reply;
    if (n.message == "count") {
      reply = "count:" + std::to_string(before);
    } else if (std::sscanf(n.message.c_str(), "hash:%llu:%llu", &off, &len) == 2) {
      reply = "echo:";
      if (off + len <= region_bytes) reply += std::to_string(Hash64(rw + off, len));
    } else if (n.message == "unregister-rw" || n.message == "register-rw") {
      reply = n.message == "unregister-rw" ? "unregistered" : "registered";
    } else if (n.message == "unregister-scribble-rw") {
      reply = "scribbled";
    } else {
      return;
    }
    // Reply from another thread: the handler runs on the connection's serving thread.
    std::thread([e, rw, region_bytes, reply, addr = n.peer_address] {
      // The memory stays mapped either way: only the engine's registration changes.
      Status s = reply == "unregistered" || reply == "scribbled" ? e->UnregisterMemory(rw)
                 : reply == "registered"
                     ? e->RegisterMemory(rw, region_bytes, {}, kAccessRemoteReadWrite)
                     : OkStatus();
      if (!s.ok()) return;
      // As an application reusing the memory would: zeroes once the Unregister returned.
      if (reply == "scribbled") std::memset(rw, 0, region_bytes);
      auto seg = e->OpenSegment(addr);
      if (seg.ok()) e->SendNotification(*seg, reply, std::chrono::seconds(5)).IgnoreError();
    }).detach();
  });
  char line[256];
  int n = std::snprintf(line, sizeof(line), "OK %s %llu %llu %llu %llu\n",
                        e->LocalDescriptor().Address().c_str(),
                        static_cast<unsigned long long>(reinterpret_cast<uint64_t>(rw)),
                        static_cast<unsigned long long>(region_bytes),
                        static_cast<unsigned long long>(reinterpret_cast<uint64_t>(ro)),
                        static_cast<unsigned long long>(ro_bytes));
  (void)!::write(write_fd, line, static_cast<size_t>(n));
  ::close(write_fd);
  while (true) ::pause();
}

}  // namespace

PeerProcess::PeerProcess(uint64_t region_bytes, const std::string& auth_secret)
    : PeerProcess(region_bytes, PeerOptions{.auth_secret = auth_secret}) {}

PeerProcess::PeerProcess(uint64_t region_bytes, const PeerOptions& options) {
  int fds[2];
  if (::pipe(fds) != 0) return;
  pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ == 0) {
    ::close(fds[0]);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a crashed test
    if (::getppid() != parent) ::_exit(1);
    ChildMain(fds[1], region_bytes, options);
  }
  ::close(fds[1]);
  if (pid_ < 0) {
    ::close(fds[0]);
    return;
  }
  std::string text;
  char buf[256];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  char addr[128] = {0};
  unsigned long long rw = 0, rw_bytes = 0, ro = 0, ro_bytes = 0;
  if (std::sscanf(text.c_str(), "OK %127s %llu %llu %llu %llu", addr, &rw, &rw_bytes, &ro,
                  &ro_bytes) == 5) {
    info_ = PeerInfo{addr, rw, rw_bytes, ro, ro_bytes};
  } else {
    std::fprintf(stderr, "peer process failed to start: %s\n", text.c_str());
  }
}

PeerProcess::~PeerProcess() { Kill(); }

void PeerProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

void PeerProcess::Stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGSTOP);
  // kill() only queues the signal: the child may still run (and answer a
  // request) until it is next scheduled. Wait until it has really stopped.
  int status = 0;
  while (::waitpid(pid_, &status, WUNTRACED) < 0 && errno == EINTR) {
  }
}

void PeerProcess::Continue() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGCONT);
  int status = 0;
  while (::waitpid(pid_, &status, WCONTINUED) < 0 && errno == EINTR) {
  }
}

}  // namespace kvferry::testutil
