// TableDirName: every name the API accepts gives a directory name a file system takes, the same
// one on every host and build, and names that differ give different directories.
#include "server/worker/shard_store.h"

#include <string>

#include "gtest/gtest.h"

namespace shardserve::server {
namespace {

v1::TableSpec Spec(const std::string& name, uint64_t created) {
  v1::TableSpec spec;
  spec.set_name(name);
  spec.set_created(created);
  return spec;
}

TEST(TableDirName, AShortNameIsKeptAsItIs) {
  EXPECT_EQ(TableDirName(Spec("users", 1796529369631920)), "users.1796529369631920");
  // The longest name that still fits with a 16-digit creation time.
  const std::string fits(255 - 17, 'n');
  EXPECT_EQ(TableDirName(Spec(fits, 1796529369631920)), fits + ".1796529369631920");
}

TEST(TableDirName, ALongNameGetsADigestThatFitsAndTellsNamesApart) {
  const uint64_t created = ~uint64_t{0};  // 20 digits, the longest
  const std::string longest(256, 'n');
  const std::string dir = TableDirName(Spec(longest, created));
  EXPECT_LE(dir.size(), 255u);
  EXPECT_EQ(dir.substr(0, 200), longest.substr(0, 200));
  EXPECT_EQ(dir.substr(dir.rfind('.')), ".18446744073709551615");
  // Stable: the same on every host and build (the log is found again after a restart).
  EXPECT_EQ(dir, TableDirName(Spec(longest, created)));
  EXPECT_EQ(dir.substr(200, 17), "~512dc65af22aa725");
  // Names alike in their first 200 bytes get directories of their own.
  std::string other = longest;
  other[255] = 'm';
  EXPECT_NE(TableDirName(Spec(other, created)), dir);
}

}  // namespace
}  // namespace shardserve::server
