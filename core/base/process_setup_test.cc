#include "core/base/process_setup.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

std::string ThisThreadsName() {
  std::ifstream comm("/proc/self/task/" + std::to_string(syscall(SYS_gettid)) + "/comm");
  std::string name;
  std::getline(comm, name);
  return name;
}

// Profiles and `top -H` tell a worker's threads apart by these names; Linux keeps 15 characters,
// and a longer name must be cut, not refused (pthread_setname_np fails with ERANGE).
TEST(ProcessSetup, NamesTheCallingThreadAndCutsLongNames) {
  std::string short_name, long_name;
  std::thread([&] {
    NameThread("wal_syncer");
    short_name = ThisThreadsName();
    NameThread("a_name_longer_than_fifteen");
    long_name = ThisThreadsName();
  }).join();
  EXPECT_EQ(short_name, "wal_syncer");
  EXPECT_EQ(long_name, "a_name_longer_t");
}

}  // namespace
}  // namespace shardserve::core
