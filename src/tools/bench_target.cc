#include "tools/bench_target.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "common/checks.h"
#include "common/env.h"
#include "cuda/device_memory.h"
#include "cuda/device_ops.h"
#include "kvferry/engine.h"
#include "tools/auth_flags.h"

namespace kvferry::tools {

namespace {

constexpr char kTargetLinePrefix[] = "kvferry-bench-target";

std::string ErrnoText(int err) { return std::strerror(err); }

std::string DescribeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return "exit status " + std::to_string(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    return std::string("signal ") + strsignal(WTERMSIG(wait_status));
  }
  return "wait status " + std::to_string(wait_status);
}

}  // namespace

StatusOr<HostBuffer> HostBuffer::Allocate(uint64_t size_bytes) {
  if (size_bytes == 0) return InvalidArgumentError("buffer size must be > 0");
  void* p = ::mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return ResourceExhaustedError("cannot map a " + std::to_string(size_bytes) +
                                  "-byte buffer: " + ErrnoText(errno));
  }
  std::memset(p, 0, size_bytes);  // touch every page now, not inside a timed loop
  HostBuffer buffer;
  buffer.data_ = static_cast<uint8_t*>(p);
  buffer.size_bytes_ = size_bytes;
  return buffer;
}

StatusOr<HostBuffer> HostBuffer::AllocateOnDevice(uint64_t size_bytes, int device) {
  if (size_bytes == 0) return InvalidArgumentError("buffer size must be > 0");
  ASSIGN_OR_RETURN(std::unique_ptr<cuda::DeviceAllocation> memory,
                   cuda::DeviceAllocation::Create(device, size_bytes));
  RETURN_IF_ERROR(cuda::MemsetDevice(memory->data(), 0, size_bytes));
  HostBuffer buffer;
  buffer.data_ = memory->data();
  buffer.size_bytes_ = size_bytes;
  buffer.location_ = MemoryLocation{MemoryKind::kCuda, device};
  buffer.device_memory_ = std::move(memory);
  return buffer;
}

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : data_(other.data_),
      size_bytes_(other.size_bytes_),
      location_(other.location_),
      device_memory_(std::move(other.device_memory_)) {
  other.data_ = nullptr;
  other.size_bytes_ = 0;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr && device_memory_ == nullptr) ::munmap(data_, size_bytes_);
    data_ = other.data_;
    size_bytes_ = other.size_bytes_;
    location_ = other.location_;
    device_memory_ = std::move(other.device_memory_);
    other.data_ = nullptr;
    other.size_bytes_ = 0;
  }
  return *this;
}

HostBuffer::~HostBuffer() {
  if (data_ != nullptr && device_memory_ == nullptr) ::munmap(data_, size_bytes_);
}

std::string FormatTargetLine(const TargetInfo& info) {
  char base[32];
  std::snprintf(base, sizeof(base), "0x%" PRIx64, info.base);
  return std::string(kTargetLinePrefix) + " address=" + info.address + " base=" + base +
         " length_bytes=" + std::to_string(info.length_bytes);
}

StatusOr<TargetInfo> ParseTargetLine(const std::string& line) {
  auto bad = [&](const std::string& why) {
    return InvalidArgumentError("bad bench target line '" + line + "': " + why);
  };
  std::istringstream in(line);
  std::string word;
  if (!(in >> word) || word != kTargetLinePrefix) {
    return bad(std::string("does not start with ") + kTargetLinePrefix);
  }
  TargetInfo info;
  bool have_base = false;
  bool have_length = false;
  while (in >> word) {
    size_t eq = word.find('=');
    if (eq == std::string::npos) return bad("'" + word + "' is not key=value");
    std::string key = word.substr(0, eq);
    std::string value = word.substr(eq + 1);
    char* end = nullptr;
    errno = 0;
    if (key == "address") {
      info.address = value;
    } else if (key == "base") {
      info.base = std::strtoull(value.c_str(), &end, 16);
      if (value.empty() || errno != 0 || *end != '\0') return bad("base is not hexadecimal");
      have_base = true;
    } else if (key == "length_bytes") {
      info.length_bytes = std::strtoull(value.c_str(), &end, 10);
      if (value.empty() || errno != 0 || *end != '\0') return bad("length_bytes is not a number");
      have_length = true;
    }  // unknown keys: ignored, so the line can grow
  }
  if (info.address.empty() || !have_base || !have_length) {
    return bad("needs address, base and length_bytes");
  }
  return info;
}

int RunBenchTarget(const TargetOptions& options) {
  const char* who = options.until_stdin_closes ? "kvferry bench-target" : "kvferry bench --serve";
  if (options.until_stdin_closes) {
    // Executed as /proc/self/exe, the process would show as "exe" in top and perf; threads
    // created from here on inherit this name.
    ::prctl(PR_SET_NAME, "kvferry-target");
  }
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  if (!options.until_stdin_closes) {
    // Blocked before the engine starts its threads, so they inherit the mask and the signal
    // reaches sigwait below instead of killing the process mid-transfer.
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  }
  StatusOr<HostBuffer> buffer =
      options.device == "cuda" ? HostBuffer::AllocateOnDevice(options.buffer_bytes, options.gpu)
                               : HostBuffer::Allocate(options.buffer_bytes);
  if (!buffer.ok()) {
    std::fprintf(stderr, "%s: %s\n", who, buffer.status().ToString().c_str());
    return 1;
  }
  EngineOptions engine_options;
  engine_options.transport = options.transport;
  engine_options.listen_host = options.listen_host;
  engine_options.listen_port = options.listen_port;
  engine_options.name = "bench-target-" + std::to_string(::getpid());
  engine_options.auth_secret = options.auth_secret;
  engine_options.insecure = options.insecure;
  StatusOr<std::unique_ptr<TransferEngine>> engine = TransferEngine::Create(engine_options);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s: cannot create engine: %s\n", who, engine.status().ToString().c_str());
    return 1;
  }
  Status registered = (*engine)->RegisterMemory(buffer->data(), buffer->size_bytes(),
                                                buffer->location(), kAccessRemoteReadWrite);
  if (!registered.ok()) {
    std::fprintf(stderr, "%s: cannot register the buffer: %s\n", who,
                 registered.ToString().c_str());
    return 1;
  }
  TargetInfo info;
  info.address = (*engine)->LocalDescriptor().Address();
  info.base = reinterpret_cast<uint64_t>(buffer->data());
  info.length_bytes = buffer->size_bytes();
  std::printf("%s\n", FormatTargetLine(info).c_str());
  std::fflush(stdout);

  if (options.until_stdin_closes) {
    char scratch[256];
    while (true) {
      ssize_t n = ::read(STDIN_FILENO, scratch, sizeof(scratch));
      if (n > 0 || (n < 0 && errno == EINTR)) continue;
      break;  // end of file: the initiator is done (or gone)
    }
  } else {
    std::fprintf(stderr, "%s: serving a %s buffer on %s; stop with Ctrl-C\n", who,
                 FormatBytes(buffer->size_bytes()).c_str(), info.address.c_str());
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
  }
  engine->reset();  // closes connections before the buffer goes away
  return 0;
}

StatusOr<std::unique_ptr<TargetProcess>> TargetProcess::Spawn(
    const TargetOptions& options, std::chrono::milliseconds startup_timeout) {
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::vector<std::string> args = {
      "kvferry",       "bench-target",
      "--transport",   options.transport,
      "--listen",      options.listen_host + ":" + std::to_string(options.listen_port),
      "--buffer-size", std::to_string(options.buffer_bytes),
      "--device",      options.device,
      "--gpu",         std::to_string(options.gpu)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_storage;
  std::vector<char*> env = ChildEnvironment(options.auth_secret, &env_storage);
  const char* exe = "/proc/self/exe";

  int to_child[2];
  int from_child[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0) return InternalError("pipe: " + ErrnoText(errno));
  if (::pipe2(from_child, O_CLOEXEC) != 0) {
    int err = errno;
    ::close(to_child[0]);
    ::close(to_child[1]);
    return InternalError("pipe: " + ErrnoText(err));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    int err = errno;
    for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) ::close(fd);
    return InternalError("fork: " + ErrnoText(err));
  }
  if (pid == 0) {
    // dup2 clears O_CLOEXEC on the new descriptors; the originals close at exec.
    if (::dup2(to_child[0], STDIN_FILENO) < 0 || ::dup2(from_child[1], STDOUT_FILENO) < 0) {
      ::_exit(126);
    }
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(125);  // the parent died before prctl took effect
    ::execve(exe, argv.data(), env.data());
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  std::unique_ptr<TargetProcess> process(new TargetProcess());
  process->pid_ = pid;
  process->stdin_fd_ = to_child[1];
  process->stdout_fd_ = from_child[0];

  // Read the target line, bounded by the startup timeout.
  std::string line;
  constexpr int kMaxSkippedLines = 64;
  int skipped = 0;
  const auto deadline = std::chrono::steady_clock::now() + startup_timeout;
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return UnavailableError("bench target (pid " + std::to_string(pid) +
                              ") did not report its address within " +
                              std::to_string(startup_timeout.count()) + " ms");
    }
    pollfd pfd{process->stdout_fd_, POLLIN, 0};
    int ready = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;  // timeout: the loop reports it
    char c = 0;
    ssize_t n = ::read(process->stdout_fd_, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int wait_status = 0;
      std::string how = "closed its stdout";
      if (::waitpid(pid, &wait_status, 0) == pid) {
        process->pid_ = -1;
        how = "exited (" + DescribeWaitStatus(wait_status) + ")";
      }
      return UnavailableError("bench target " + how + " before reporting its address");
    }
    if (c == '\n') {
      // Libraries the target loads may print to stdout first (UCX's warnings do): skip
      // lines until the target's own, up to a bound.
      if (line.rfind(kTargetLinePrefix, 0) == 0) break;
      if (++skipped > kMaxSkippedLines) break;  // ParseTargetLine reports this line
      line.clear();
      continue;
    }
    line.push_back(c);
  }
  ASSIGN_OR_RETURN(process->info_, ParseTargetLine(line));
  return process;
}

TargetProcess::~TargetProcess() { Stop().IgnoreError(); }

Status TargetProcess::Stop() {
  if (stdin_fd_ >= 0) {
    ::close(stdin_fd_);
    stdin_fd_ = -1;
  }
  Status result;
  if (pid_ > 0) {
    int wait_status = 0;
    pid_t reaped = 0;
    for (int i = 0; i < 200 && reaped == 0; ++i) {
      reaped = ::waitpid(pid_, &wait_status, WNOHANG);
      if (reaped == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (reaped == 0) {
      ::kill(pid_, SIGKILL);
      reaped = ::waitpid(pid_, &wait_status, 0);
    } else if (reaped == pid_ && !(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0)) {
      result = InternalError("bench target (pid " + std::to_string(pid_) + ") ended with " +
                             DescribeWaitStatus(wait_status));
    }
    pid_ = -1;
  }
  if (stdout_fd_ >= 0) {
    ::close(stdout_fd_);
    stdout_fd_ = -1;
  }
  return result;
}

}  // namespace kvferry::tools
