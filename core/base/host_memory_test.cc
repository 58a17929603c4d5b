// AvailableHostMemoryUnder on made-up /proc and cgroup trees (v1 and v2, with and without a
// limit, in a cgroup namespace), and AvailableHostMemory on this machine.
#include "core/base/host_memory.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

class FakeRoot {
 public:
  FakeRoot() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    root_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/host_memory_",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    Write("/proc/meminfo", "MemTotal:       24000000 kB\nMemAvailable:   8000000 kB\n");
  }
  ~FakeRoot() { std::filesystem::remove_all(root_); }
  void Write(const std::string& path, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root_ + path).parent_path());
    std::ofstream(root_ + path) << text;
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

constexpr char kV1Mounts[] =
    "30 22 0:27 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "31 30 0:28 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "34 30 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "40 30 0:40 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

TEST(HostMemory, WithoutACgroupLimitTheHostsAvailableMemoryCounts) {
  FakeRoot fake;
  fake.Write("/proc/self/cgroup", "4:memory:/pod\n0::/\n");
  fake.Write("/proc/self/mountinfo", kV1Mounts);
  fake.Write("/sys/fs/cgroup/memory/pod/memory.limit_in_bytes", "9223372036854771712\n");
  fake.Write("/sys/fs/cgroup/memory/pod/memory.usage_in_bytes", "1000\n");
  fake.Write("/sys/fs/cgroup/memory/pod/memory.stat",
             "total_inactive_file 0\nhierarchical_memory_limit 9223372036854771712\n");
  const HostMemoryRoom room = AvailableHostMemoryUnder(fake.root());
  EXPECT_EQ(room.bytes, int64_t{8000000} * 1024);
  EXPECT_THAT(room.limit, HasSubstr("MemAvailable"));
}

TEST(HostMemory, ACgroupV1LimitBoundsTheRoomLessItsUseButNotItsInactivePageCache) {
  FakeRoot fake;
  fake.Write("/proc/self/cgroup", "9:name=systemd:/\n4:cpu,memory:/kubepods/pod1\n0::/\n");
  fake.Write("/proc/self/mountinfo",
             "30 22 0:27 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
             "34 30 0:31 / /sys/fs/cgroup/cpu,memory rw - cgroup cgroup rw,cpu,memory\n");
  const std::string dir = "/sys/fs/cgroup/cpu,memory/kubepods/pod1";
  fake.Write(dir + "/memory.limit_in_bytes", "9223372036854771712\n");  // its parent's bounds it
  fake.Write(dir + "/memory.usage_in_bytes", "500000000\n");
  fake.Write(dir + "/memory.stat",
             "cache 200000000\ntotal_inactive_file 100000000\n"
             "hierarchical_memory_limit 734003200\n");
  const HostMemoryRoom room = AvailableHostMemoryUnder(fake.root());
  EXPECT_EQ(room.bytes, 734003200 - (500000000 - 100000000));
  EXPECT_THAT(room.limit, HasSubstr("cgroup /kubepods/pod1"));
  EXPECT_THAT(room.limit, HasSubstr("734003200"));
}

TEST(HostMemory, ACgroupV2AncestorsLimitCountsWhenItIsTheTightest) {
  FakeRoot fake;
  fake.Write("/proc/self/cgroup", "0::/kubepods/burstable/pod1/c1\n");
  fake.Write("/proc/self/mountinfo", "25 1 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  const std::string top = "/sys/fs/cgroup";
  fake.Write(top + "/kubepods/burstable/pod1/c1/memory.max", "max\n");
  fake.Write(top + "/kubepods/burstable/pod1/c1/memory.current", "300000000\n");
  fake.Write(top + "/kubepods/burstable/pod1/c1/memory.stat", "inactive_file 0\n");
  fake.Write(top + "/kubepods/burstable/pod1/memory.max", "1000000000\n");
  fake.Write(top + "/kubepods/burstable/pod1/memory.current", "600000000\n");
  fake.Write(top + "/kubepods/burstable/pod1/memory.stat", "anon 1\ninactive_file 50000000\n");
  fake.Write(top + "/kubepods/memory.max", "20000000000\n");
  fake.Write(top + "/kubepods/memory.current", "600000000\n");
  const HostMemoryRoom room = AvailableHostMemoryUnder(fake.root());
  EXPECT_EQ(room.bytes, 1000000000 - (600000000 - 50000000));
  EXPECT_THAT(room.limit, HasSubstr("cgroup /kubepods/burstable/pod1 (memory.max 1000000000"));
}

TEST(HostMemory, InACgroupNamespaceTheMountIsTheProcesssOwnCgroup) {
  FakeRoot fake;
  // A container with its own cgroup namespace: it sees itself at "/", and the mount is its cgroup.
  fake.Write("/proc/self/cgroup", "0::/\n");
  fake.Write("/proc/self/mountinfo", "600 500 0:23 / /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n");
  fake.Write("/sys/fs/cgroup/memory.max", "734003200\n");
  fake.Write("/sys/fs/cgroup/memory.current", "34003200\n");
  const HostMemoryRoom room = AvailableHostMemoryUnder(fake.root());
  EXPECT_EQ(room.bytes, 700000000);
  EXPECT_THAT(room.limit, HasSubstr("cgroup / (memory.max 734003200"));
}

TEST(HostMemory, TheRoomIsNeverNegativeAndAnAllocationOverItIsRefusedNamingTheLimit) {
  FakeRoot fake;
  fake.Write("/proc/self/cgroup", "0::/full\n");
  fake.Write("/proc/self/mountinfo", "25 1 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  fake.Write("/sys/fs/cgroup/full/memory.max", "1000\n");
  fake.Write("/sys/fs/cgroup/full/memory.current", "5000\n");
  EXPECT_EQ(AvailableHostMemoryUnder(fake.root()).bytes, 0);
  // This machine: small allocations are never checked; one of 1 PiB is refused.
  EXPECT_TRUE(CheckHostAllocation(int64_t{1} << 20, "test").ok());
  const absl::Status huge = CheckHostAllocation(int64_t{1} << 50, "test");
  EXPECT_EQ(huge.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(huge.message()), HasSubstr("available under"));
}

}  // namespace
}  // namespace shardserve::core
