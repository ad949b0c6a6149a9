// A real peer engine in a child process, for two-process tests.
//
// The child creates a TransferEngine on loopback, registers a read-write region of
// `region_bytes` and a second, read-only region, fills both with a known pattern, and serves
// until killed. It echoes every notification back to the sender as "echo:<xxh64 of range>"
// when the message is "hash:<offset>:<length>" (offset into the read-write region), so a
// test can check what had landed when the notification arrived. Every notification it receives
// is counted; "count" is answered "count:<notifications received before>".
// "unregister-rw" and "register-rw" unregister and register the read-write region again (its
// memory and bytes stay) and are answered "unregistered" / "registered" once done.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvferry::testutil {

struct PeerInfo {
  std::string address;
  uint64_t rw_base = 0;
  uint64_t rw_bytes = 0;
  uint64_t ro_base = 0;
  uint64_t ro_bytes = 0;
};

// Where and how the child's engine runs.
struct PeerOptions {
  std::string auth_secret;  // empty: none, unless the environment's KVFERRY_AUTH_TOKEN
  std::string netns;        // a network namespace (`ip netns` name) to enter; empty: this one
  std::string listen_host = "127.0.0.1";
  std::string transport = "auto";
  std::vector<std::pair<std::string, std::string>> env;  // set in the child before its engine
};

class PeerProcess {
 public:
  // Forks the child, whose engine holds `auth_secret` (empty: none, unless the environment's
  // KVFERRY_AUTH_TOKEN). Call before the test creates threads.
  explicit PeerProcess(uint64_t region_bytes, const std::string& auth_secret = "");
  PeerProcess(uint64_t region_bytes, const PeerOptions& options);
  ~PeerProcess();  // SIGKILLs and reaps the child

  const PeerInfo& info() const { return info_; }
  pid_t pid() const { return pid_; }
  bool ok() const { return !info_.address.empty(); }
  void Kill();
  void Stop();      // SIGSTOP: the peer stalls with sockets open
  void Continue();  // SIGCONT

 private:
  pid_t pid_ = -1;
  PeerInfo info_;
};

// Byte `i` of the pattern the child writes at offset `i` of its regions.
uint8_t PeerPatternByte(uint64_t i);

uint64_t Hash64(const void* data, size_t length);

}  // namespace kvferry::testutil
