// Cross-binary tests of the coordinator's faults: its return after a crash must not
// disturb the workers' group, a full state disk must fail admin calls cleanly and leave a registry
// that restarts, and an export can never write into the state directory.
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "c10/core/InferenceMode.h"
#include "client/client.h"
#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "tests/cluster_fixture.h"

namespace shardserve::tests {
namespace {

using client::LocalCluster;
using client::LocalClusterOptions;
using grpc::health::v1::HealthCheckResponse;
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

// Callers that make each call once, straight to the workers (no coordinator on their path), and
// count what they get.
class DirectCallers {
 public:
  DirectCallers(const LocalCluster& cluster, const Table& table, int threads)
      : client_(ConnectOnce(cluster, absl::Seconds(20))) {
    for (int t = 0; t < threads; ++t) {
      threads_.emplace_back([this, &table, t] {
        c10::InferenceMode guard;
        std::mt19937 rng(t);
        while (!stop_) {
          const Answer a = RandomSumBags(*client_, table, rng, 2, 4);
          if (a.Right()) {
            ++ok_;
            continue;
          }
          absl::MutexLock lock(&mu_);
          failures_.push_back(a.got.ok() ? "wrong values" : a.got.status().ToString());
        }
      });
    }
  }
  ~DirectCallers() { Stop(); }
  void Stop() {
    stop_ = true;
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  int ok() const { return ok_; }
  std::vector<std::string> failures() {
    absl::MutexLock lock(&mu_);
    return failures_;
  }

 private:
  std::unique_ptr<client::Client> client_;
  std::atomic<bool> stop_{false};
  std::atomic<int> ok_{0};
  absl::Mutex mu_;
  std::vector<std::string> failures_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

// A health Watch held open on one service of one server, counting the changes it reports after
// the first status.
class HealthWatch {
 public:
  HealthWatch(const std::string& address, const std::string& service)
      : stub_(grpc::health::v1::Health::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    stream_ = stub_->Watch(&context_, request);
    grpc::health::v1::HealthCheckResponse first;
    if (stream_->Read(&first)) first_ = first.status();
    reader_ = std::thread([this] {
      grpc::health::v1::HealthCheckResponse seen;
      while (stream_->Read(&seen)) ++changes_;
    });
  }
  ~HealthWatch() {
    context_.TryCancel();
    reader_.join();
    stream_->Finish().IgnoreError();
  }
  HealthCheckResponse::ServingStatus first() const { return first_; }
  int changes() const { return changes_; }

 private:
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>> stream_;
  HealthCheckResponse::ServingStatus first_ = HealthCheckResponse::UNKNOWN;
  std::atomic<int> changes_{0};
  std::thread reader_;
};

bool TableServesAt(const std::string& address, const std::string& table) {
  return Health(address, "shardserve.v1.table/" + table) == HealthCheckResponse::SERVING;
}

// The group epochs the coordinator's log says it formed, or adopted from the workers.
constexpr char kFormed[] = "coordinator: group epoch ";
constexpr char kAdopted[] = "coordinator: adopted group epoch ";
std::vector<std::string> EpochsLogged(const std::string& log, const std::string& marker) {
  std::vector<std::string> epochs;
  std::istringstream lines(ReadFile(log));
  for (std::string line; std::getline(lines, line);) {
    const size_t at = line.find(marker);
    if (at == std::string::npos) continue;
    std::istringstream rest(line.substr(at + marker.size()));
    std::string epoch;
    rest >> epoch;
    epochs.push_back(epoch);
  }
  return epochs;
}

// The coordinator is killed while direct callers run and stays down for 10 s
// (long enough that gRPC's default reconnect backoff would put the workers' return seconds apart);
// rank 1 is stopped across the coordinator's return, so that the coordinator hears rank 0 well
// before it. The workers' group is kept (no new epoch: the coordinator adopts the one they
// report), no direct call fails, no worker's table health flickers, and both workers are back
// with the coordinator promptly.
TEST(CoordinatorRestart, AFormedGroupServesOnAndIsAdoptedWhenTheCoordinatorReturns) {
  const LocalClusterOptions options = ClusterOptions(2);
  auto cluster = Start(options);
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 300, 8, 1, {0, 1}, TempDir());
  ASSERT_TRUE(admin->CreateTable(emb.spec).ok());
  const std::string log = options.work_dir + "/coordinator.log";
  const std::vector<std::string> formed = EpochsLogged(log, kFormed);
  ASSERT_EQ(formed.size(), 1u) << ReadFile(log);

  HealthWatch watch0(cluster->worker_address(0), "shardserve.v1.table/emb");
  HealthWatch watch1(cluster->worker_address(1), "shardserve.v1.table/emb");
  ASSERT_EQ(watch0.first(), HealthCheckResponse::SERVING);
  ASSERT_EQ(watch1.first(), HealthCheckResponse::SERVING);
  DirectCallers callers(*cluster, emb, 4);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(cluster->KillCoordinator(SIGKILL).ok());
  absl::SleepFor(absl::Milliseconds(9500));
  // Stopped for 0.9 s in all: well within the workers' collective timeout (3 s), so its peer's
  // steps wait for it rather than fail.
  ASSERT_TRUE(cluster->SignalWorker(1, SIGSTOP).ok());
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_TRUE(cluster->StartCoordinator().ok());
  const absl::Time back = absl::Now();
  absl::SleepFor(absl::Milliseconds(400));
  ASSERT_TRUE(cluster->SignalWorker(1, SIGCONT).ok());
  // Adopted once both workers have reported again: within about a second of their heartbeats'
  // reconnect backoff (at most 1 s), not after gRPC's default (which grows to 120 s).
  ASSERT_TRUE(WaitFor([&] { return TableServesAt(cluster->coordinator_address(), "emb"); },
                      absl::Seconds(10)));
  const absl::Duration adopted = absl::Now() - back;
  std::printf("the coordinator's return -> table serving there: %s\n",
              absl::FormatDuration(adopted).c_str());
  EXPECT_LT(adopted, absl::Seconds(3));
  absl::SleepFor(absl::Seconds(1));  // and calls go on after the adoption
  callers.Stop();
  EXPECT_THAT(callers.failures(), ::testing::IsEmpty());
  EXPECT_GT(callers.ok(), 100);
  EXPECT_EQ(watch0.changes(), 0);
  EXPECT_EQ(watch1.changes(), 0);
  EXPECT_EQ(EpochsLogged(log, kFormed), formed) << ReadFile(log);
  EXPECT_EQ(EpochsLogged(log, kAdopted), formed) << ReadFile(log);
  CheckOps(*admin, emb, "after the coordinator's return");
}

// Without --state_dir the coordinator persists nothing: when it comes back it learns the tables
// that every worker holds alike (same generation) from their heartbeats instead of telling them to
// drop everything.
TEST(CoordinatorRestart, ACoordinatorWithoutStateLearnsTheTablesTheWorkersHold) {
  LocalClusterOptions options = ClusterOptions(2);
  options.coordinator_flags.push_back("--state_dir=");  // (the last one counts): persist nothing
  auto cluster = Start(options);
  ASSERT_NE(cluster, nullptr);
  auto admin = Connect(*cluster);
  Table emb = MakeTable("emb", v1::TABLE_KIND_EMBEDDING, 300, 8, 0, {1, 0}, TempDir());
  absl::StatusOr<v1::TableInfo> created = admin->CreateTable(emb.spec);
  ASSERT_TRUE(created.ok()) << created.status();
  DirectCallers callers(*cluster, emb, 2);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(cluster->KillCoordinator(SIGKILL).ok());
  absl::SleepFor(absl::Seconds(1));
  ASSERT_TRUE(cluster->StartCoordinator().ok());
  ASSERT_TRUE(WaitFor([&] { return TableServesAt(cluster->coordinator_address(), "emb"); },
                      absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(500));
  callers.Stop();
  EXPECT_THAT(callers.failures(), ::testing::IsEmpty());
  EXPECT_GT(callers.ok(), 10);
  absl::StatusOr<std::vector<v1::TableInfo>> tables = admin->ListTables();
  ASSERT_TRUE(tables.ok()) << tables.status();
  ASSERT_EQ(tables->size(), 1u);
  EXPECT_EQ((*tables)[0].spec().generation(), created->spec().generation());
  EXPECT_EQ((*tables)[0].state(), v1::TABLE_STATE_SERVING);
  // A learnt table is the coordinator's like any other: it can be dropped and created again.
  ASSERT_TRUE(admin->DropTable("emb").ok());
  ASSERT_TRUE(admin->CreateTable(emb.spec).ok());
  CheckOps(*admin, emb, "created again");
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

// With the state directory on a full disk, CreateTable and DropTable fail with
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

// An export never writes into the coordinator's state directory (over its
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
