#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "core/kernels/cpu_kernels.h"
#include "core/table/safetensors.h"
#include "core/table/sharded_table.h"
#include "core/table/table_init.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::core {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

TableConfig Embedding(int dim_sharded, int world) {
  TableConfig t;
  t.name = "t";
  t.num_rows = 23;
  t.num_cols = 7;
  t.padding_idx = 4;
  t.spec = ShardingSpec::Contiguous(dim_sharded, world);
  EXPECT_TRUE(t.Validate().ok());
  return t;
}

TEST(SeededInit, FullTableIsTheSameWhateverTheSharding) {
  CpuKernels kernels;
  const TableConfig full_config = Embedding(0, 1);
  std::vector<float> full(23 * 7);
  FillSeededWeight(full_config, 42, 0, 23, 0, 7, full.data());
  EXPECT_EQ(full[4 * 7 + 3], 0.0f);  // padding row zero, like nn.Embedding
  double mean = 0, sq = 0;
  for (float v : full) mean += v, sq += v * v;
  EXPECT_GT(sq / full.size(), 0.3);  // roughly N(0, 1), not constant
  for (int dim : {0, 1}) {
    for (int world : {2, 3, 5}) {
      TableConfig config = Embedding(dim, world);
      ShardLayout layout(config.spec, dim == 0 ? 23 : 7);
      for (int r = 0; r < world; ++r) {
        auto table = ShardedTable::Create(config, r, kernels);
        ASSERT_TRUE(table.ok());
        ASSERT_TRUE((*table)->LoadSeeded(42).ok());
        std::vector<float> shard = *(*table)->ReadShard();
        const auto view = (*table)->shard();
        for (int64_t i = 0; i < view.rows; ++i) {
          for (int64_t j = 0; j < view.cols; ++j) {
            EXPECT_EQ(shard[i * view.cols + j],
                      full[((*table)->row_begin() + i) * 7 + (*table)->col_begin() + j]);
          }
        }
      }
    }
  }
}

TEST(SeededInit, LinearFollowsKaimingUniformBounds) {
  TableConfig config;
  config.kind = TableKind::kLinear;
  config.num_rows = 8;
  config.num_cols = 16;
  std::vector<float> w(8 * 16), b(8);
  FillSeededWeight(config, 1, 0, 8, 0, 16, w.data());
  FillSeededBias(config, 1, b.data());
  for (float v : w) EXPECT_LE(std::abs(v), 0.25f);
  for (float v : b) EXPECT_LE(std::abs(v), 0.25f);
  std::vector<float> other(8 * 16);
  FillSeededWeight(config, 2, 0, 8, 0, 16, other.data());
  EXPECT_NE(w, other);  // the seed matters
}

TEST(Safetensors, RoundTripAndShardLoading) {
  CpuKernels kernels;
  TableConfig config;
  config.name = "lin";
  config.kind = TableKind::kLinear;
  config.num_rows = 5;
  config.num_cols = 9;
  config.spec = *ShardingSpec::Create(1, std::vector<std::string>{"rank:1", "rank:0"});
  ASSERT_TRUE(config.Validate().ok());
  std::vector<float> weight(5 * 9), bias(5);
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = 0.5f * i;
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = -1.0f * i;
  const std::string path = TempPath("lin.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"weight", "F32", {5, 9}, weight.data(), 5 * 9 * 4},
                                      {"bias", "F32", {5}, bias.data(), 5 * 4}})
                  .ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_NE((*file)->Find("weight"), nullptr);
  EXPECT_EQ((*file)->Find("weight")->shape, (std::vector<int64_t>{5, 9}));
  EXPECT_EQ((*file)->Find("missing"), nullptr);
  for (int rank : {0, 1}) {
    auto table = ShardedTable::Create(config, rank, kernels);
    ASSERT_TRUE((*table)->LoadCheckpoint(path).ok());
    std::vector<float> shard = *(*table)->ReadShard();
    const auto view = (*table)->shard();
    for (int64_t i = 0; i < view.rows; ++i) {
      for (int64_t j = 0; j < view.cols; ++j) {
        EXPECT_EQ(shard[i * view.cols + j], weight[i * 9 + (*table)->col_begin() + j]);
      }
    }
    EXPECT_EQ((*table)->bias(), bias);
  }
}

// A table of 2^40 rows and one column, split by columns over 2 ranks: rank 1's shard is empty. It
// loads at once (no loop over its rows) when it is an embedding table; as a linear layer, whose
// bias every rank holds whole, it is refused with RESOURCE_EXHAUSTED (not a thrown bad_alloc).
TEST(ShardedTable, EmptyShardsOfHugeTablesLoadAtOnceOrAreRefused) {
  CpuKernels kernels;
  TableConfig config;
  config.name = "huge";
  config.num_rows = int64_t{1} << 40;
  config.num_cols = 1;
  config.spec = ShardingSpec::Contiguous(1, 2);
  ASSERT_TRUE(config.Validate().ok());
  auto table = ShardedTable::Create(config, 1, kernels);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ((*table)->shard().cols, 0);
  EXPECT_TRUE((*table)->LoadSeeded(1).ok());
  EXPECT_EQ(ShardedTable::Create(config, 0, kernels).status().code(),
            absl::StatusCode::kResourceExhausted);  // the rank with the column
  config.kind = TableKind::kLinear;
  absl::StatusOr<std::unique_ptr<ShardedTable>> layer = ShardedTable::Create(config, 1, kernels);
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(layer.status().message()), HasSubstr("bias: cannot allocate"));
  config.has_bias = false;
  EXPECT_TRUE(ShardedTable::Create(config, 1, kernels).ok());
}

// Exports write only regular files, at absolute paths, in directories that exist: a device or a
// pipe named as the path is left alone (it used to be replaced by the renamed file).
TEST(Safetensors, WritesOnlyRegularFilesAtAbsolutePaths) {
  std::vector<float> w(6, 1.f);
  const std::vector<SafetensorsEntry> entries = {{"weight", "F32", {2, 3}, w.data(), 24}};
  const std::string fifo = TempPath("a.fifo"), dir = TempPath("a.dir"), link = TempPath("a.link");
  ::unlink(fifo.c_str());  // from an earlier run outside Bazel
  ::rmdir(dir.c_str());
  ::unlink(link.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  ASSERT_EQ(::symlink(TempPath("a.target").c_str(), link.c_str()), 0);
  const std::pair<std::string, std::string> refused[] = {
      {"relative.safetensors", "must be absolute"},
      {"", "must be absolute"},
      {fifo, "exists and is not a regular file"},
      {dir, "exists and is not a regular file"},
      {link, "exists and is not a regular file"},
      {TempPath("missing/x.safetensors"), "does not exist"}};
  for (const auto& [path, why] : refused) {
    const absl::Status status = WriteSafetensors(path, entries);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_THAT(std::string(status.message()), HasSubstr(why)) << path;
  }
  struct stat st;
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  const std::string file = TempPath("ok.safetensors");
  ASSERT_TRUE(WriteSafetensors(file, entries).ok());
  ASSERT_TRUE(WriteSafetensors(file, entries).ok());  // over a regular file: replaced
  auto opened = SafetensorsFile::Open(file);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)->Find("weight")->bytes, 24);
}

// A durable write goes around the page cache in 4 KiB blocks through a 4 MiB buffer: whatever
// the sizes (a block's, the buffer's, or neither), the file holds the same bytes as one written
// through the page cache, and nothing after them.
TEST(Safetensors, DurableFilesHoldTheBytesOfBufferedOnes) {
  for (const int64_t floats : {int64_t{1}, int64_t{1024}, int64_t{(4 << 20) / 4 - 30},
                               int64_t{(4 << 20) / 4}, int64_t{3 * (1 << 20) + 777}}) {
    std::vector<float> weight(floats), bias(floats % 5 + 1);
    for (int64_t i = 0; i < floats; ++i) weight[i] = 0.25f * static_cast<float>(i % 9973) - 7;
    for (size_t i = 0; i < bias.size(); ++i) bias[i] = -0.5f * i;
    const std::vector<SafetensorsEntry> entries = {
        {"weight", "F32", {floats}, weight.data(), floats * 4},
        {"bias", "F32", {static_cast<int64_t>(bias.size())}, bias.data(),
         static_cast<int64_t>(bias.size() * 4)}};
    const std::string buffered = TempPath("buffered.safetensors");
    const std::string durable = TempPath("durable.safetensors");
    ASSERT_TRUE(WriteSafetensors(buffered, entries).ok());
    ASSERT_TRUE(WriteSafetensors(durable, entries, /*durable=*/true).ok());
    auto read = [](const std::string& path) {
      std::ifstream in(path, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    const std::string expected = read(buffered);
    EXPECT_EQ(static_cast<int64_t>(expected.size()),
              static_cast<int64_t>(SafetensorsHeader(entries).size()) + (floats + bias.size()) * 4);
    EXPECT_TRUE(read(durable) == expected) << floats << " floats";
    auto opened = SafetensorsFile::Open(durable);
    ASSERT_TRUE(opened.ok()) << opened.status();
    std::vector<float> back(floats);
    const SafetensorsTensor* t = (*opened)->Find("weight");
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE((*opened)->Read(t->data, t->bytes, back.data()).ok());
    EXPECT_EQ(back, weight);
  }
}

// Headers a corrupt or hostile file may hold are refused with INVALID_ARGUMENT, not a crash:
// integers past 64 bits (std::stoll threw), a lone '-', negative or overflowing dimensions, and
// metadata nested deep enough to exhaust the stack.
TEST(Safetensors, RefusesHostileHeaders) {
  auto write = [](const std::string& name, const std::string& header, int64_t data_bytes) {
    const std::string path = TempPath(name);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t len = header.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << header << std::string(data_bytes, '\0');
    return path;
  };
  const std::string nested = "{\"__metadata__\":" + std::string(100000, '[') +
                             std::string(100000, ']') + "}";
  const std::pair<std::string, std::string> hostile[] = {
      {R"({"w":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,16]}})",
       "integer of at most 64 bits"},
      {R"({"w":{"dtype":"F32","shape":[-],"data_offsets":[0,16]}})", "integer of at most 64 bits"},
      {R"({"w":{"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]}})", "do not fit"},
      {R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})",
       "do not fit"},
      {R"({"w":{"dtype":"F32","shape":[3037000500,3037000500,2],"data_offsets":[0,16]}})",
       "do not fit"},
      {nested, "nested too deep"}};
  int i = 0;
  for (const auto& [header, why] : hostile) {
    const std::string path = write(absl::StrCat("hostile", i++, ".safetensors"), header, 16);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::Open(path);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument) << header.substr(0, 80);
    EXPECT_THAT(std::string(opened.status().message()), HasSubstr(why)) << header.substr(0, 80);
  }
  const std::string fine = write(
      "fine.safetensors", R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 16);
  EXPECT_TRUE(SafetensorsFile::Open(fine).ok());
}

TEST(Safetensors, RejectsMalformedFilesAndWrongShapes) {
  const std::string missing = TempPath("nope.safetensors");
  const absl::Status not_found = SafetensorsFile::Open(missing).status();
  EXPECT_EQ(not_found.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(not_found.message()), HasSubstr(missing));
  const std::string bad = TempPath("bad.safetensors");
  {
    std::ofstream out(bad, std::ios::binary);
    const uint64_t len = 1000;
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << "{}";
  }
  EXPECT_THAT(std::string(SafetensorsFile::Open(bad).status().message()),
              HasSubstr("header length 1000 exceeds the file"));
  for (const std::string& not_a_file : {TempPath(""), std::string("/dev/zero")}) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::Open(not_a_file);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument) << not_a_file;
    EXPECT_THAT(std::string(opened.status().message()), HasSubstr("not a regular file"));
  }
  std::vector<float> w(6);
  const std::string small = TempPath("small.safetensors");
  ASSERT_TRUE(WriteSafetensors(small, {{"weight", "F32", {2, 3}, w.data(), 24}}).ok());
  CpuKernels kernels;
  TableConfig config = Embedding(0, 1);
  auto table = ShardedTable::Create(config, 0, kernels);
  absl::Status status = (*table)->LoadCheckpoint(small);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("needs tensor \"weight\" F32 [23,7], has F32 [2,3]"));
}

// A unix socket bound at `path` (the file stays after the socket closes).
void BindUnixSocket(const std::string& path) {
  ::unlink(path.c_str());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(address.sun_path));
  std::strcpy(address.sun_path, path.c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0) << path;
  ::close(fd);
}

// Runs `open` on a thread of its own and returns its status, failing the test if it has not
// returned within 5 s (open() of a FIFO used to wait for a writer without bound): then a writer is
// made to appear, so the thread ends and the test does not hang.
absl::Status OpenPromptly(const std::function<absl::Status()>& open, const std::string& fifo) {
  auto done = std::make_shared<absl::Notification>();
  auto status = std::make_shared<absl::Status>();
  std::thread thread([=] {
    *status = open();
    done->Notify();
  });
  if (!done->WaitForNotificationWithTimeout(absl::Seconds(5))) {
    ADD_FAILURE() << "opening " << fifo << " blocked";
    const int writer = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK);  // releases the blocked open
    done->WaitForNotification();
    if (writer >= 0) ::close(writer);
  }
  thread.join();
  return *status;
}

// Checkpoint paths that are not regular files - a FIFO, a unix socket, a directory, a device, a
// link to a FIFO - are refused at once with INVALID_ARGUMENT saying what they are, by the reader
// the coordinator uses (SafetensorsFile::Open) and by a rank's load (LoadCheckpoint); so are
// relative paths, which each process would resolve against its own working directory. No call
// waits on a FIFO's writer.
TEST(Safetensors, RefusesPathsThatAreNotRegularFilesAtOnce) {
  // A socket's path must fit sockaddr_un (108 bytes), which the test's directory may not leave.
  char socket_dir[] = "/tmp/shardserve_test_XXXXXX";
  ASSERT_NE(::mkdtemp(socket_dir), nullptr);
  const std::string socket = absl::StrCat(socket_dir, "/ckpt.sock");
  const std::string fifo = TempPath("ckpt.fifo");
  const std::string dir = TempPath("ckpt.dir"), link = TempPath("ckpt.link");
  const std::string file = TempPath("ckpt.safetensors"), file_link = TempPath("ckpt_file.link");
  ::unlink(fifo.c_str());  // from an earlier run outside Bazel
  ::rmdir(dir.c_str());
  ::unlink(link.c_str());
  ::unlink(file_link.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  BindUnixSocket(socket);
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  ASSERT_EQ(::symlink(fifo.c_str(), link.c_str()), 0);
  std::vector<float> w(23 * 7, 0.5f);
  ASSERT_TRUE(WriteSafetensors(file, {{"weight", "F32", {23, 7}, w.data(), 23 * 7 * 4}}).ok());
  ASSERT_EQ(::symlink(file.c_str(), file_link.c_str()), 0);
  const std::pair<std::string, std::string> refused[] = {
      {fifo, "is a FIFO (named pipe), not a regular file"},
      {link, "is a FIFO (named pipe), not a regular file"},
      {socket, "is a unix socket, not a regular file"},
      {dir, "is a directory, not a regular file"},
      {"/dev/null", "is a character device, not a regular file"},
      {"ckpt.safetensors", "must be an absolute path"},
      {"", "must be an absolute path"}};
  CpuKernels kernels;
  auto table = ShardedTable::Create(Embedding(1, 2), 0, kernels);
  ASSERT_TRUE(table.ok());
  for (const auto& [path, why] : refused) {
    SCOPED_TRACE(path);
    const absl::Status opened =
        OpenPromptly([path = path] { return SafetensorsFile::Open(path).status(); }, fifo);
    EXPECT_EQ(opened.code(), absl::StatusCode::kInvalidArgument) << opened;
    EXPECT_THAT(std::string(opened.message()),
                HasSubstr(absl::StrCat("checkpoint \"", path, "\": ", why)));
    const absl::Status loaded =
        OpenPromptly([&, path = path] { return (*table)->LoadCheckpoint(path); }, fifo);
    EXPECT_EQ(loaded.code(), absl::StatusCode::kInvalidArgument) << loaded;
    EXPECT_THAT(std::string(loaded.message()), HasSubstr(why));
  }
  // A link to a regular file is what it leads to (checkpoint caches are made of links).
  EXPECT_TRUE((*table)->LoadCheckpoint(file_link).ok());
  ::unlink(socket.c_str());
  ::rmdir(socket_dir);
}

// A malformed header's error names the checkpoint and the tensor and field it is in.
TEST(Safetensors, MalformedHeadersNameTheFileAndTheField) {
  auto write = [](const std::string& name, const std::string& header) {
    const std::string path = TempPath(name);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t len = header.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << header << std::string(16, '\0');
    return path;
  };
  const std::pair<std::string, std::string> malformed[] = {
      {R"([])", "expected '{' at header byte 0 (the header object)"},
      {R"({1:{}})", "expected a string at header byte 1 (the first tensor's name)"},
      {R"({"w":{"dtype":5,"shape":[2,2],"data_offsets":[0,16]}})",
       "expected a string at header byte 14 (tensor \"w\", field \"dtype\")"},
      {R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,16]}})",
       "expected '[' at header byte 28 (tensor \"w\", field \"shape\")"},
      {R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,x]}})",
       "expected an integer of at most 64 bits at header byte 52 (tensor \"w\", field "
       "\"data_offsets\")"},
      {R"({"w":{"dtype":"F32" "shape":[2,2]}})", "expected '}' at header byte 20 (tensor \"w\")"},
      {R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"v"})",
       "expected ':' at header byte 60 (tensor \"v\")"}};
  int i = 0;
  for (const auto& [header, why] : malformed) {
    const std::string path = write(absl::StrCat("malformed", i++, ".safetensors"), header);
    const absl::Status status = SafetensorsFile::Open(path).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << header;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat("checkpoint \"", path, "\": malformed safetensors header: ",
                                       why)))
        << header;
  }
}

}  // namespace
}  // namespace shardserve::core
