// The instances `kvferry replay` starts and talks to: a child `kvferry prefill` or `kvferry
// decode` process (ChildInstance) holding the replay's fresh secret in its environment, and
// HTTP clients for an instance's control API.
//
// Thread-safety: see ChildInstance.
#pragma once

#include <httplib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/checks.h"
#include "common/host_port.h"
#include "disagg/http_auth.h"
#include "tools/auth_flags.h"

namespace kvferry::tools {

// An HTTP client for an instance's control "host:port", sending the bearer token of `secret`
// (empty: none). Errors: kInvalidArgument naming the address.
inline StatusOr<std::unique_ptr<httplib::Client>> ControlClient(const std::string& address,
                                                                const std::string& secret) {
  ASSIGN_OR_RETURN(HostPort endpoint, ParseHostPort(address, "control address"));
  auto client = std::make_unique<httplib::Client>(endpoint.host, endpoint.port);
  SetBearerToken(*client, secret);
  return client;
}

// How a process that ended (waitpid's `status`) ended, e.g. "was killed by signal 9 (Killed)".
inline std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + ::strsignal(sig) + ")";
  }
  return "ended (wait status " + std::to_string(status) + ")";
}

// A child instance process started by the replay. Its stdout carries the ready line. What it
// writes to stderr is held back until it is ready, then copied to the replay's stderr as it
// comes: an instance that exits before it is ready is reported with what it said.
//
// Thread-safety: Ended may run on another thread than Start and Stop (it takes mu_).
class ChildInstance {
 public:
  ~ChildInstance() {
    Stop();
    if (stderr_thread_.joinable()) stderr_thread_.join();
  }

  // Starts `kvferry <role> <args>` holding `secret` (through its environment's
  // KVFERRY_AUTH_TOKEN, never its command line) and waits for its ready line.
  Status Start(const std::string& role, const std::vector<std::string>& args,
               const std::string& secret) {
    role_ = role;
    secret_ = secret;
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0) return InternalError("pipe failed");
    if (::pipe2(err, O_CLOEXEC) != 0) {
      ::close(out[0]);
      ::close(out[1]);
      return InternalError("pipe failed");
    }
    // Built before fork: other threads (earlier children's stderr copies) may hold the
    // allocator's or stdio's locks at fork, so the child only calls async-signal-safe functions.
    std::vector<std::string> argv_s = {"kvferry", role};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_storage;
    std::vector<char*> env = ChildEnvironment(secret, &env_storage);
    pid_ = ::fork();
    if (pid_ < 0) {
      for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
      return InternalError("fork failed");
    }
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::execve("/proc/self/exe", argv.data(), env.data());
      static const char kExecFailed[] = "kvferry replay: cannot exec /proc/self/exe\n";
      [[maybe_unused]] ssize_t ignored =
          ::write(STDERR_FILENO, kExecFailed, sizeof(kExecFailed) - 1);
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    stderr_thread_ = std::thread([this, fd = err[0]] { CopyStderr(fd); });
    FILE* f = ::fdopen(out[0], "r");
    char line[4096];
    std::string text;
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      text = line;
      if (text.rfind("KVFERRY_READY ", 0) == 0) break;
      text.clear();
    }
    std::fclose(f);
    if (text.empty()) {
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
      stderr_thread_.join();  // the pipe ends with the process
      std::string said = held_stderr_;
      while (!said.empty() && std::isspace(static_cast<unsigned char>(said.back()))) {
        said.pop_back();
      }
      return UnavailableError(
          "the " + role + " instance " + DescribeExit(status) +
          " before it was ready: " + (said.empty() ? "it printed nothing" : said));
    }
    info_ = nlohmann::json::parse(text.substr(14), nullptr, false);
    if (info_.is_discarded()) return InternalError("bad ready line from " + role + ": " + text);
    {
      std::lock_guard<std::mutex> lock(stderr_mu_);
      std::fwrite(held_stderr_.data(), 1, held_stderr_.size(), stderr);
      held_stderr_.clear();
      ready_ = true;
    }
    return OkStatus();
  }

  const nlohmann::json& info() const { return info_; }

  // Whether the process ended; then `how` says how and which ("the decode instance (pid 12)
  // was killed by signal 9 (Killed)"). Reaps it.
  bool Ended(std::string* how) {
    std::lock_guard<std::mutex> lock(mu_);
    if (pid_ <= 0) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
    *how = "the " + role_ + " instance (pid " + std::to_string(pid_) + ") " + DescribeExit(status);
    pid_ = -1;
    return true;
  }

  // Asks the instance to shut down; kills it when it has not ended within 5 s.
  void Stop() {
    std::lock_guard<std::mutex> lock(mu_);
    if (pid_ <= 0) return;
    if (info_.contains("control_address")) {
      if (auto c = ControlClient(info_["control_address"], secret_); c.ok()) {
        (*c)->set_connection_timeout(2);
        (*c)->Post("/shutdown");
      }
    }
    for (int i = 0; i < 100; ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // Kills the instance at once (its rooms are lost).
  void Kill() {
    std::lock_guard<std::mutex> lock(mu_);
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  // Copies the child's stderr (`fd`) to ours once it is ready; holds the last 64 KiB of it
  // until then.
  void CopyStderr(int fd) {
    constexpr size_t kHeldBytes = 64 << 10;
    char buf[4096];
    while (true) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      std::lock_guard<std::mutex> lock(stderr_mu_);
      if (ready_) {
        std::fwrite(buf, 1, static_cast<size_t>(n), stderr);
      } else {
        held_stderr_.append(buf, static_cast<size_t>(n));
        if (held_stderr_.size() > kHeldBytes) {
          held_stderr_.erase(0, held_stderr_.size() - kHeldBytes);
        }
      }
    }
    ::close(fd);
  }

  std::string role_;
  std::mutex mu_;  // pid_
  pid_t pid_ = -1;
  nlohmann::json info_;
  std::string secret_;
  std::thread stderr_thread_;
  std::mutex stderr_mu_;  // ready_, held_stderr_
  bool ready_ = false;
  std::string held_stderr_;
};

inline StatusOr<nlohmann::json> GetJson(const std::string& address, const std::string& path,
                                        const std::string& secret) {
  ASSIGN_OR_RETURN(auto c, ControlClient(address, secret));
  c->set_connection_timeout(5);
  auto res = c->Get(path.c_str());
  if (!res) return UnavailableError("cannot reach instance at " + address);
  if (res->status == 401) {
    return PermissionDeniedError(address + path +
                                 " refused the bearer token: give the instances' secret "
                                 "(KVFERRY_AUTH_TOKEN or --auth-token-file)");
  }
  nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
  if (j.is_discarded()) return InternalError(address + path + " returned no JSON");
  return j;
}

}  // namespace kvferry::tools
