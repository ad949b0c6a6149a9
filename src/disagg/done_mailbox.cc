#include "disagg/done_mailbox.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace kvferry {
namespace {

std::string ErrnoText(const char* call, const std::string& name) {
  return std::string(call) + "(" + name + "): " + std::strerror(errno);
}

constexpr char kPrefix[] = "kvferry-done-";

// Unlinks the mailboxes of decode processes that died without unlinking theirs (the name
// holds the creator's pid; kill(pid, 0) failing with ESRCH means it is gone). Best effort.
void RemoveOrphans() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* e = ::readdir(dir)) {
    const std::string entry = e->d_name;
    if (entry.rfind(kPrefix, 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(entry.c_str() + sizeof(kPrefix) - 1, &end, 10);
    if (pid <= 0 || end == nullptr || *end != '-') continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::string path(1, '/');
      path.append(entry);
      ::shm_unlink(path.c_str());
    }
  }
  ::closedir(dir);
}

}  // namespace

StatusOr<std::unique_ptr<DoneMailbox>> DoneMailbox::Create(int32_t num_rows) {
  if (num_rows < 1) {
    return InvalidArgumentError("done mailbox needs at least one row, got " +
                                std::to_string(num_rows));
  }
  static std::atomic<uint64_t> sequence{0};
  RemoveOrphans();
  const size_t bytes = static_cast<size_t>(num_rows) * sizeof(uint64_t);
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::string name(1, '/');
    name.append(kPrefix).append(std::to_string(::getpid())).append("-").append(
        std::to_string(sequence.fetch_add(1)));
    int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && errno == EEXIST) continue;  // left by a dead process of the same pid
    if (fd < 0) return UnavailableError(ErrnoText("shm_open", name));
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      Status s = UnavailableError(ErrnoText("ftruncate", name));
      ::close(fd);
      ::shm_unlink(name.c_str());
      return s;
    }
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (base == MAP_FAILED) {
      Status s = UnavailableError(ErrnoText("mmap", name));
      ::shm_unlink(name.c_str());
      return s;
    }
    // ftruncate zero-fills: every cell starts unarmed.
    return std::unique_ptr<DoneMailbox>(new DoneMailbox(std::move(name), num_rows, base, bytes,
                                                        /*owner=*/true));
  }
  return UnavailableError("shm_open: no free done-mailbox name after 16 tries");
}

StatusOr<std::unique_ptr<DoneMailbox>> DoneMailbox::Open(const std::string& name,
                                                         int32_t num_rows) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
      name.size() > 200) {
    return InvalidArgumentError("bad done-mailbox name '" + name + "'");
  }
  if (num_rows < 1) {
    return InvalidArgumentError("done mailbox '" + name + "' announced " +
                                std::to_string(num_rows) + " rows");
  }
  const size_t bytes = static_cast<size_t>(num_rows) * sizeof(uint64_t);
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return UnavailableError(ErrnoText("shm_open", name));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    ::close(fd);
    return UnavailableError("done mailbox '" + name + "' holds " +
                            std::to_string(st.st_size) + " bytes, fewer than " +
                            std::to_string(num_rows) + " rows need");
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) return UnavailableError(ErrnoText("mmap", name));
  return std::unique_ptr<DoneMailbox>(new DoneMailbox(name, num_rows, base, bytes,
                                                      /*owner=*/false));
}

DoneMailbox::~DoneMailbox() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  if (owner_) ::shm_unlink(name_.c_str());
}

void DoneMailbox::Arm(int32_t row, uint64_t room) {
  cell(row)->store(Armed(room), std::memory_order_release);
}

bool DoneMailbox::Report(int32_t row, uint64_t room) {
  if (row < 0 || row >= num_rows_) return false;
  const uint64_t armed = Armed(room);
  std::atomic<uint64_t>* c = cell(row);
  uint64_t now = c->load(std::memory_order_relaxed);
  while (Key(now) == armed && (now & kCountMask) < kMaxCount) {
    // acq_rel: the data this report vouches for was written before it (the engine saw the
    // batch complete), and decode's acquire load of the cell pairs with this release.
    if (c->compare_exchange_weak(now, now + 1, std::memory_order_acq_rel,
                                 std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

bool DoneMailbox::Announce(int32_t row, uint64_t room) {
  if (row < 0 || row >= num_rows_) return false;
  const uint64_t armed = Armed(room);
  std::atomic<uint64_t>* c = cell(row);
  uint64_t now = c->load(std::memory_order_relaxed);
  while (Key(now) == armed) {
    if ((now & kImminentBit) != 0) return true;
    if (c->compare_exchange_weak(now, now | kImminentBit, std::memory_order_release,
                                 std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

int DoneMailbox::Count(int32_t row, uint64_t room, bool* imminent) const {
  if (imminent != nullptr) *imminent = false;
  if (row < 0 || row >= num_rows_) return -1;
  const uint64_t now = cell(row)->load(std::memory_order_acquire);
  if (Key(now) != Armed(room)) return -1;
  if (imminent != nullptr) *imminent = (now & kImminentBit) != 0;
  return static_cast<int>(now & kCountMask);
}

}  // namespace kvferry
