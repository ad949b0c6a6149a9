#include "disagg/done_mailbox.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

namespace kvferry {
namespace {

TEST(DoneMailboxTest, ReportsCountOnlyForTheArmedRoom) {
  auto decode = DoneMailbox::Create(8);
  ASSERT_TRUE(decode.ok()) << decode.status().ToString();
  auto prefill = DoneMailbox::Open((*decode)->name(), 8);
  ASSERT_TRUE(prefill.ok()) << prefill.status().ToString();
  // Unarmed rows hold no room, not even room 0.
  EXPECT_EQ((*decode)->Count(3, 0), -1);
  EXPECT_FALSE((*prefill)->Report(3, 0));
  (*decode)->Arm(3, 1234);
  EXPECT_EQ((*decode)->Count(3, 1234), 0);
  EXPECT_EQ((*decode)->Count(3, 1235), -1);
  EXPECT_TRUE((*prefill)->Report(3, 1234));  // through the other mapping
  EXPECT_TRUE((*prefill)->Report(3, 1234));
  EXPECT_FALSE((*prefill)->Report(3, 999));  // a stale room: nothing changes
  EXPECT_EQ((*decode)->Count(3, 1234), 2);
  // Re-armed for the row's next room: a late report of the old room is refused.
  (*decode)->Arm(3, 77);
  EXPECT_FALSE((*prefill)->Report(3, 1234));
  EXPECT_EQ((*decode)->Count(3, 77), 0);
  // Ids that differ only in their high bits get different tags.
  (*decode)->Arm(1, 7);
  EXPECT_FALSE((*prefill)->Report(1, 7 | (uint64_t{1} << 60)));
  EXPECT_EQ((*decode)->Count(1, 7), 0);
  // Rows outside the mailbox.
  EXPECT_FALSE((*prefill)->Report(8, 77));
  EXPECT_FALSE((*prefill)->Report(-1, 77));
  EXPECT_EQ((*decode)->Count(8, 77), -1);
  // Announcing the last data sets a flag that neither counts nor survives re-arming.
  bool imminent = true;
  EXPECT_EQ((*decode)->Count(3, 77, &imminent), 0);
  EXPECT_FALSE(imminent);
  EXPECT_FALSE((*prefill)->Announce(3, 1234));
  EXPECT_TRUE((*prefill)->Announce(3, 77));
  EXPECT_TRUE((*prefill)->Announce(3, 77));
  EXPECT_EQ((*decode)->Count(3, 77, &imminent), 0);
  EXPECT_TRUE(imminent);
  EXPECT_TRUE((*prefill)->Report(3, 77));
  EXPECT_EQ((*decode)->Count(3, 77, &imminent), 1);
  EXPECT_TRUE(imminent);
  (*decode)->Arm(3, 78);
  EXPECT_EQ((*decode)->Count(3, 78, &imminent), 0);
  EXPECT_FALSE(imminent);
  EXPECT_FALSE((*prefill)->Announce(9, 78));
  // The count saturates.
  (*decode)->Arm(0, 5);
  for (int i = 0; i < DoneMailbox::kMaxCount; ++i) ASSERT_TRUE((*prefill)->Report(0, 5)) << i;
  EXPECT_FALSE((*prefill)->Report(0, 5));
  EXPECT_EQ((*decode)->Count(0, 5), DoneMailbox::kMaxCount);
}

TEST(DoneMailboxTest, ConcurrentReportsAreAllCounted) {
  auto decode = DoneMailbox::Create(1);
  ASSERT_TRUE(decode.ok());
  (*decode)->Arm(0, 42);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      auto mine = DoneMailbox::Open((*decode)->name(), 1);
      ASSERT_TRUE(mine.ok());
      for (int i = 0; i < 50; ++i) (*mine)->Report(0, 42);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ((*decode)->Count(0, 42), 200);
}

TEST(DoneMailboxTest, OpenRefusesBadNamesMissingAndShortSegments) {
  EXPECT_EQ(DoneMailbox::Create(0).status().code(), StatusCode::kInvalidArgument);
  auto bad = DoneMailbox::Open("no-slash", 4);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("no-slash"), std::string::npos);
  EXPECT_EQ(DoneMailbox::Open("/a/b", 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DoneMailbox::Open("/kvferry-done-none-here", 4).status().code(),
            StatusCode::kUnavailable);
  auto decode = DoneMailbox::Create(4);
  ASSERT_TRUE(decode.ok());
  auto short_one = DoneMailbox::Open((*decode)->name(), 5);
  EXPECT_EQ(short_one.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(short_one.status().message().find("fewer than 5 rows"), std::string::npos)
      << short_one.status().ToString();
  EXPECT_EQ(DoneMailbox::Open((*decode)->name(), 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(DoneMailboxTest, NameIsRemovedWithItsCreatorAndOrphansBySomeoneElse) {
  std::string name;
  {
    auto decode = DoneMailbox::Create(2);
    ASSERT_TRUE(decode.ok());
    name = (*decode)->name();
    ASSERT_TRUE(DoneMailbox::Open(name, 2).ok());
    // A live creator holds its segment: the sweep leaves it, however old.
    DoneMailbox::RemoveOrphans(std::chrono::seconds(0));
    ASSERT_TRUE(DoneMailbox::Open(name, 2).ok());
    // A forked child (sharing the creator's lock) does not unlink it when it destroys its
    // copy of the object.
    pid_t child = ::fork();
    if (child == 0) {
      decode->reset();
      ::_exit(0);
    }
    ASSERT_EQ(::waitpid(child, nullptr, 0), child);
    EXPECT_TRUE(DoneMailbox::Open(name, 2).ok());
  }
  EXPECT_EQ(DoneMailbox::Open(name, 2).status().code(), StatusCode::kUnavailable);

  // A mailbox whose creator died without unlinking it: nobody holds its lock.
  const std::string orphan = "/kvferry-done-1-orphanedfortest";
  int fd = ::shm_open(orphan.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 128), 0);
  ::close(fd);
  ASSERT_TRUE(DoneMailbox::Open(orphan, 2).ok());
  EXPECT_GE(DoneMailbox::RemoveOrphans(std::chrono::seconds(0)), 1);
  EXPECT_EQ(DoneMailbox::Open(orphan, 2).status().code(), StatusCode::kUnavailable);
  ::shm_unlink(orphan.c_str());  // in case the check above failed
}

TEST(DoneMailboxTest, ReportsCrossProcesses) {
  auto decode = DoneMailbox::Create(4);
  ASSERT_TRUE(decode.ok());
  (*decode)->Arm(2, 0xabcdef);
  pid_t child = ::fork();
  if (child == 0) {
    auto prefill = DoneMailbox::Open((*decode)->name(), 4);
    const bool ok = prefill.ok() && (*prefill)->Announce(2, 0xabcdef) &&
                    (*prefill)->Report(2, 0xabcdef) && !(*prefill)->Report(2, 0xabcdee);
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  bool imminent = false;
  EXPECT_EQ((*decode)->Count(2, 0xabcdef, &imminent), 1);
  EXPECT_TRUE(imminent);
}

}  // namespace
}  // namespace kvferry
