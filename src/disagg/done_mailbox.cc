#include "disagg/done_mailbox.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

namespace kvferry {
namespace {

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "done mailbox cells are shared between processes: they must be lock-free");

constexpr char kPrefix[] = "kvferry-done-";

std::string ErrnoText(const char* call, const std::string& name, int error) {
  return std::string(call) + "(" + name + "): " + std::strerror(error);
}

bool IsMailboxName(const std::string& name) {
  return name.size() > sizeof(kPrefix) && name.size() <= 200 && name[0] == '/' &&
         name.compare(1, sizeof(kPrefix) - 1, kPrefix) == 0 &&
         name.find('/', 1) == std::string::npos;
}

}  // namespace

uint64_t DoneMailbox::Armed(uint64_t room) {
  uint64_t z = room + 0x9e3779b97f4a7c15ull;  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return ((z & ((uint64_t{1} << 54) - 1)) << 10) | kArmedBit;
}

int DoneMailbox::RemoveOrphans(std::chrono::seconds min_age) {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const auto now = std::chrono::system_clock::now();
  while (const dirent* e = ::readdir(dir)) {
    std::string name(1, '/');
    name.append(e->d_name);
    if (!IsMailboxName(name)) continue;
    int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) continue;
    struct stat st {};
    const bool old_enough = ::fstat(fd, &st) == 0 &&
                            now - std::chrono::system_clock::from_time_t(st.st_mtime) >= min_age;
    // Its creator holds a shared lock while it lives (in any PID namespace).
    if (old_enough && ::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      if (::shm_unlink(name.c_str()) == 0) ++removed;
    }
    ::close(fd);
  }
  ::closedir(dir);
  return removed;
}

StatusOr<std::unique_ptr<DoneMailbox>> DoneMailbox::Create(int32_t num_rows) {
  if (num_rows < 1) {
    return InvalidArgumentError("done mailbox needs at least one row, got " +
                                std::to_string(num_rows));
  }
  RemoveOrphans(std::chrono::seconds(10));
  const size_t bytes = static_cast<size_t>(num_rows) * kCellBytes;
  std::random_device random;
  for (int attempt = 0; attempt < 16; ++attempt) {
    char suffix[17];
    std::snprintf(suffix, sizeof(suffix), "%08x%08x", random(), random());
    std::string name(1, '/');
    name.append(kPrefix).append(std::to_string(::getpid())).append("-").append(suffix);
    int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) return UnavailableError(ErrnoText("shm_open", name, errno));
    auto fail = [&](const char* call, int error) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      return UnavailableError(ErrnoText(call, name, error));
    };
    if (::flock(fd, LOCK_SH) != 0) return fail("flock", errno);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail("ftruncate", errno);
    // tmpfs reserves nothing at ftruncate: without this, a full /dev/shm would surface as a
    // SIGBUS at the first store into a cell.
    if (int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
      return fail("posix_fallocate", error);
    }
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) return fail("mmap", errno);
    // ftruncate zero-fills: every cell starts unarmed.
    auto mailbox =
        std::unique_ptr<DoneMailbox>(new DoneMailbox(std::move(name), num_rows, base, bytes, fd));
    mailbox->creator_pid_ = ::getpid();
    return mailbox;
  }
  return UnavailableError("shm_open: no free done-mailbox name after 16 tries");
}

StatusOr<std::unique_ptr<DoneMailbox>> DoneMailbox::Open(const std::string& name,
                                                         int32_t num_rows) {
  if (!IsMailboxName(name)) {
    return InvalidArgumentError("'" + name + "' is not a done-mailbox name (/" +
                                std::string(kPrefix) + "...)");
  }
  if (num_rows < 1) {
    return InvalidArgumentError("done mailbox '" + name + "' announced " +
                                std::to_string(num_rows) + " rows");
  }
  const size_t bytes = static_cast<size_t>(num_rows) * kCellBytes;
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return UnavailableError(ErrnoText("shm_open", name, errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return UnavailableError(ErrnoText("fstat", name, error));
  }
  if (static_cast<size_t>(st.st_size) < bytes) {
    ::close(fd);
    return UnavailableError("done mailbox '" + name + "' holds " + std::to_string(st.st_size) +
                            " bytes, fewer than " + std::to_string(num_rows) + " rows need");
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  if (base == MAP_FAILED) return UnavailableError(ErrnoText("mmap", name, error));
  return std::unique_ptr<DoneMailbox>(new DoneMailbox(name, num_rows, base, bytes, -1));
}

DoneMailbox::~DoneMailbox() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  if (owner_fd_ >= 0) {
    if (::getpid() == creator_pid_) ::shm_unlink(name_.c_str());
    ::close(owner_fd_);
  }
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
