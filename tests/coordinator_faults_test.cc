// Cross-binary tests of the coordinator's faults (issue 19): a full state disk must fail admin
// calls cleanly and leave a registry that restarts, and an export can never write into the state
// directory.
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster_fixture.h"

namespace shardserve::tests {
namespace {

using client::LocalCluster;
using client::LocalClusterOptions;
using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::unique_ptr<LocalCluster> Start(const LocalClusterOptions& options) {
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? std::move(*cluster) : nullptr;
}

// A small tmpfs mounted on a directory for the test's duration (root only; unmounted at the end).
class SmallDisk {
 public:
  explicit SmallDisk(const std::string& dir) : dir_(dir) {
    ::mkdir(dir.c_str(), 0755);
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=64k") == 0) {
      mounted_ = true;
    } else {
      error_ = std::strerror(errno);
    }
  }
  ~SmallDisk() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }
  // Fills the disk with one file; returns its path.
  std::string Fill() {
    const std::string path = dir_ + "/filler";
    FILE* f = std::fopen(path.c_str(), "wb");
    const std::string block(512, 'x');
    while (f != nullptr && std::fwrite(block.data(), 1, block.size(), f) == block.size() &&
           std::fflush(f) == 0) {
    }
    if (f != nullptr) std::fclose(f);
    return path;
  }

 private:
  std::string dir_;
  bool mounted_ = false;
  std::string error_;
};

// Issue 19, item 2: with the state directory on a full disk, CreateTable and DropTable fail with
// RESOURCE_EXHAUSTED naming the registry file, change nothing (in the coordinator, on disk), and
// the coordinator restarts with the registry as it was; once there is room, they succeed.
TEST(RegistryDurability, AFullStateDiskFailsAdminCallsCleanlyAndTheCoordinatorRestarts) {
  LocalClusterOptions options = ClusterOptions(2);
  options.state_dir = TempDir() + "/state";
  SmallDisk disk(options.state_dir);
  if (!disk.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here: " << disk.error();
  auto cluster = Start(options);
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  const std::string dir = TempDir();
  Table kept = MakeTable("kept", v1::TABLE_KIND_EMBEDDING, 40, 4, 1, {0, 1}, dir);
  Table other = MakeTable("other", v1::TABLE_KIND_EMBEDDING, 30, 4, 0, {1, 0}, dir);
  ASSERT_TRUE(admin->CreateTable(kept.spec).ok());
  const std::string registry = options.state_dir + "/tables.pb";
  const std::string saved = ReadFile(registry);
  ASSERT_FALSE(saved.empty());

  const std::string filler = disk.Fill();
  absl::StatusOr<v1::TableInfo> created = admin->CreateTable(other.spec);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted) << created.status();
  EXPECT_THAT(std::string(created.status().message()), HasSubstr(registry));
  EXPECT_THAT(std::string(created.status().message()), HasSubstr(std::strerror(ENOSPC)));
  const absl::Status dropped = admin->DropTable("kept");
  EXPECT_EQ(dropped.code(), absl::StatusCode::kResourceExhausted) << dropped;
  absl::StatusOr<std::vector<v1::TableInfo>> tables = admin->ListTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  ASSERT_EQ(tables->size(), 1u);
  EXPECT_EQ((*tables)[0].spec().name(), "kept");
  EXPECT_EQ(ReadFile(registry), saved);
  CheckOps(*admin, kept, "while the disk is full");

  ASSERT_TRUE(cluster->KillCoordinator(SIGKILL).ok());
  ASSERT_TRUE(cluster->StartCoordinator().ok());  // the registry reads back: no DATA_LOSS
  tables = admin->ListTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  ASSERT_EQ(tables->size(), 1u);
  EXPECT_EQ((*tables)[0].spec().name(), "kept");

  ASSERT_EQ(std::remove(filler.c_str()), 0);
  ASSERT_TRUE(admin->CreateTable(other.spec).ok());
  ASSERT_TRUE(cluster->KillCoordinator(SIGKILL).ok());
  ASSERT_TRUE(cluster->StartCoordinator().ok());
  tables = admin->ListTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  EXPECT_EQ(tables->size(), 2u);
  cluster->Stop();  // before the disk goes
}

// Issue 19, item 2: an export never writes into the coordinator's state directory (over its
// registry, or beside it, or through a link to it): INVALID_ARGUMENT, and the registry stays.
TEST(RegistryDurability, AnExportIntoTheStateDirectoryIsRefused) {
  LocalClusterOptions options = ClusterOptions(2);
  options.state_dir = TempDir() + "/state";
  auto cluster = Start(options);
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  const std::string dir = TempDir();
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 40, 4, 1, {0, 1}, dir);
  ASSERT_TRUE(admin->CreateTable(emb.spec).ok());
  const std::string registry = options.state_dir + "/tables.pb";
  const std::string saved = ReadFile(registry);
  const std::string link = dir + "/state_link";
  ASSERT_EQ(::symlink(options.state_dir.c_str(), link.c_str()), 0);
  for (const std::string& path :
       {registry, registry + ".tmp", options.state_dir + "/emb.safetensors",
        link + "/tables.pb", options.state_dir + "/../state/tables.pb"}) {
    absl::StatusOr<v1::ExportTableResponse> exported = admin->ExportTable("emb", path);
    EXPECT_EQ(exported.status().code(), absl::StatusCode::kInvalidArgument)
        << path << ": " << exported.status();
    EXPECT_THAT(std::string(exported.status().message()), HasSubstr("state directory")) << path;
  }
  EXPECT_EQ(ReadFile(registry), saved);
  ASSERT_TRUE(admin->ExportTable("emb", dir + "/emb.safetensors").ok());
  ASSERT_TRUE(cluster->KillCoordinator(SIGKILL).ok());
  ASSERT_TRUE(cluster->StartCoordinator().ok());
  absl::StatusOr<std::vector<v1::TableInfo>> tables = admin->ListTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  EXPECT_EQ(tables->size(), 1u);
}

}  // namespace
}  // namespace shardserve::tests
