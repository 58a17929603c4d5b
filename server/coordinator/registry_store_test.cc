#include "server/coordinator/registry_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::server {
namespace {

using ::testing::HasSubstr;

std::string NewDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string path = absl::StrCat(base ? base : "/tmp", "/registryXXXXXX");
  EXPECT_NE(::mkdtemp(path.data()), nullptr);
  return path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

v1::internal::TableRegistry RegistryOf(const std::string& table, uint64_t generation) {
  v1::internal::TableRegistry registry;
  v1::TableSpec* spec = registry.add_tables();
  spec->set_name(table);
  spec->set_generation(generation);
  registry.set_last_generation(generation);
  return registry;
}

// The real calls, but the `at`-th call of `op` fails with `error` (ops: "open", "read", "write",
// "fsync", "close", "rename"); with `short_writes`, every write writes at most 3 bytes.
class FaultyFiles final : public FileOps {
 public:
  std::string op;
  int at = 1;
  int error = EIO;
  bool short_writes = false;

  int Open(const std::string& path, int flags, mode_t mode) override {
    if (Fails("open")) return -error;
    return FileOps::Posix().Open(path, flags, mode);
  }
  ssize_t Read(int fd, char* data, size_t size) override {
    if (Fails("read")) return -error;
    return FileOps::Posix().Read(fd, data, size);
  }
  ssize_t Write(int fd, const char* data, size_t size) override {
    if (Fails("write")) return -error;
    return FileOps::Posix().Write(fd, data, short_writes ? std::min<size_t>(size, 3) : size);
  }
  int Fsync(int fd) override { return Fails("fsync") ? -error : FileOps::Posix().Fsync(fd); }
  int Close(int fd) override {
    const int result = FileOps::Posix().Close(fd);  // (the descriptor goes either way)
    return Fails("close") ? -error : result;
  }
  int Rename(const std::string& from, const std::string& to) override {
    return Fails("rename") ? -error : FileOps::Posix().Rename(from, to);
  }
  int Unlink(const std::string& path) override { return FileOps::Posix().Unlink(path); }

 private:
  bool Fails(const std::string& name) { return name == op && ++seen_ == at; }
  int seen_ = 0;
};

TEST(RegistryStore, AFirstStartHasAnEmptyRegistryAndASaveReadsBack) {
  const std::string dir = NewDir();
  auto store = RegistryStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<v1::internal::TableRegistry> loaded = (*store)->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tables_size(), 0);
  ASSERT_TRUE((*store)->Save(RegistryOf("t", 7)).ok());
  EXPECT_EQ((*store)->path(), dir + "/tables.pb");
  EXPECT_FALSE(Exists(dir + "/tables.pb.tmp"));
  auto again = RegistryStore::Open(dir);
  loaded = (*again)->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->tables_size(), 1);
  EXPECT_EQ(loaded->tables(0).name(), "t");
  EXPECT_EQ(loaded->last_generation(), 7u);
}

TEST(RegistryStore, ATruncatedGarbledOrEmptyRegistryIsDataLossNamingTheFile) {
  const std::string dir = NewDir();
  std::string bytes;
  ASSERT_TRUE(RegistryOf("a_table_with_a_name", 12345).SerializeToString(&bytes));
  for (const std::string& broken :
       {bytes.substr(0, bytes.size() - 3), std::string("\xff\xff\xff\xff garbage", 13),
        std::string()}) {
    WriteFile(dir + "/tables.pb", broken);
    auto store = RegistryStore::Open(dir);
    absl::StatusOr<v1::internal::TableRegistry> loaded = (*store)->Load();
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
    EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(dir + "/tables.pb"));
  }
}

// Protobuf parses a file cut short where a field ends; the store still tells every such cut.
TEST(RegistryStore, ARegistryCutShortAnywhereIsDataLoss) {
  const std::string dir = NewDir();
  v1::internal::TableRegistry registry = RegistryOf("first", 5);
  v1::TableSpec* second = registry.add_tables();
  second->set_name("second");
  second->set_generation(6);
  registry.set_last_generation(6);
  std::string bytes;
  ASSERT_TRUE(registry.SerializeToString(&bytes));
  for (size_t n = 0; n < bytes.size(); ++n) {
    WriteFile(dir + "/tables.pb", bytes.substr(0, n));
    auto loaded = (*RegistryStore::Open(dir))->Load();
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << n << " of " << bytes.size();
  }
  WriteFile(dir + "/tables.pb", bytes);
  EXPECT_TRUE((*RegistryStore::Open(dir))->Load().ok());
  // A registry from before tables had generations has no last_generation: still read.
  v1::internal::TableRegistry old;
  old.add_tables()->set_name("old");
  ASSERT_TRUE(old.SerializeToString(&bytes));
  WriteFile(dir + "/tables.pb", bytes);
  auto loaded = (*RegistryStore::Open(dir))->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tables(0).name(), "old");
}

TEST(RegistryStore, AReadErrorIsInternalNamingTheFile) {
  const std::string dir = NewDir();
  ASSERT_TRUE((*RegistryStore::Open(dir))->Save(RegistryOf("t", 1)).ok());
  FaultyFiles files;
  files.op = "read";
  auto store = RegistryStore::Open(dir, files);
  absl::StatusOr<v1::internal::TableRegistry> loaded = (*store)->Load();
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(dir + "/tables.pb"));
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(std::strerror(EIO)));
}

TEST(RegistryStore, AStateDirThatIsNoDirectoryIsRefused) {
  const std::string dir = NewDir();
  WriteFile(dir + "/file", "x");
  for (const std::string& bad : {dir + "/file", dir + "/missing"}) {
    auto store = RegistryStore::Open(bad);
    EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(store.status().message()), HasSubstr(bad));
  }
}

// Every step of a save is checked: whichever fails, the save fails with the file and the system's
// error named, the registry on disk is what it was, and no temporary file is left.
TEST(RegistryStore, ASaveThatFailsAtAnyStepLeavesTheRegistryAsItWas) {
  struct Fault {
    std::string op;
    int at;
    int error;
    bool short_writes;
    absl::StatusCode code;
  };
  const Fault faults[] = {
      {"open", 1, EACCES, false, absl::StatusCode::kInternal},           // the temporary file
      {"write", 1, ENOSPC, false, absl::StatusCode::kResourceExhausted},  // a full disk
      {"write", 4, ENOSPC, true, absl::StatusCode::kResourceExhausted},   // full after a part
      {"write", 1, EDQUOT, false, absl::StatusCode::kResourceExhausted},  // a full quota
      {"fsync", 1, EIO, false, absl::StatusCode::kInternal},
      {"fsync", 1, ENOSPC, false, absl::StatusCode::kResourceExhausted},  // delayed allocation
      {"close", 1, EIO, false, absl::StatusCode::kInternal},
      {"rename", 1, EXDEV, false, absl::StatusCode::kInternal},
  };
  for (const Fault& fault : faults) {
    const std::string label = absl::StrCat(fault.op, " #", fault.at, ": ",
                                           std::strerror(fault.error));
    const std::string dir = NewDir();
    ASSERT_TRUE((*RegistryStore::Open(dir))->Save(RegistryOf("old", 1)).ok());
    const std::string before = ReadFile(dir + "/tables.pb");
    FaultyFiles files;
    auto store = RegistryStore::Open(dir, files);
    ASSERT_TRUE((*store)->Load().ok());
    files.op = fault.op;  // armed now: the calls of Load do not count
    files.at = fault.at;
    files.error = fault.error;
    files.short_writes = fault.short_writes;
    const absl::Status saved = (*store)->Save(RegistryOf("a_much_longer_new_table_name", 2));
    EXPECT_EQ(saved.code(), fault.code) << label << ": " << saved;
    EXPECT_THAT(std::string(saved.message()), HasSubstr(dir + "/tables.pb")) << label;
    EXPECT_THAT(std::string(saved.message()), HasSubstr(std::strerror(fault.error))) << label;
    EXPECT_EQ(ReadFile(dir + "/tables.pb"), before) << label;
    EXPECT_FALSE(Exists(dir + "/tables.pb.tmp")) << label;
    // And the store still works once the fault is gone.
    files.op.clear();
    EXPECT_TRUE((*store)->Save(RegistryOf("after", 3)).ok()) << label;
  }
}

// The directory's fsync comes after the rename: when it fails the new file is in place but may not
// survive a crash, so the previous registry is written back and the save fails.
TEST(RegistryStore, AFailedDirectoryFsyncPutsThePreviousRegistryBack) {
  const std::string dir = NewDir();
  ASSERT_TRUE((*RegistryStore::Open(dir))->Save(RegistryOf("old", 1)).ok());
  const std::string before = ReadFile(dir + "/tables.pb");
  FaultyFiles files;
  auto store = RegistryStore::Open(dir, files);
  ASSERT_TRUE((*store)->Load().ok());
  files.op = "fsync";
  files.at = 2;  // the temporary file's is the first
  const absl::Status saved = (*store)->Save(RegistryOf("new", 2));
  EXPECT_EQ(saved.code(), absl::StatusCode::kInternal) << saved;
  EXPECT_THAT(std::string(saved.message()), HasSubstr("the previous registry is back"));
  EXPECT_EQ(ReadFile(dir + "/tables.pb"), before);

  // With no registry before, the new file is removed instead.
  const std::string fresh = NewDir();
  FaultyFiles fresh_files;
  auto first = RegistryStore::Open(fresh, fresh_files);
  ASSERT_TRUE((*first)->Load().ok());
  fresh_files.op = "fsync";
  fresh_files.at = 2;
  EXPECT_FALSE((*first)->Save(RegistryOf("new", 2)).ok());
  EXPECT_FALSE(Exists(fresh + "/tables.pb"));
}

// A temporary file left by a crash, or a link planted under its name, is replaced, never written
// through: the file the link points to stays as it was.
TEST(RegistryStore, AStaleTemporaryFileOrLinkIsNeverWrittenThrough) {
  const std::string dir = NewDir();
  const std::string outside = NewDir() + "/precious";
  WriteFile(outside, "precious bytes");
  ASSERT_EQ(::symlink(outside.c_str(), (dir + "/tables.pb.tmp").c_str()), 0);
  auto store = RegistryStore::Open(dir);
  ASSERT_TRUE((*store)->Load().ok());
  ASSERT_TRUE((*store)->Save(RegistryOf("t", 1)).ok());
  EXPECT_EQ(ReadFile(outside), "precious bytes");
  EXPECT_FALSE(Exists(dir + "/tables.pb.tmp"));
  auto loaded = (*RegistryStore::Open(dir))->Load();
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->tables(0).name(), "t");
}

}  // namespace
}  // namespace shardserve::server
