#include "server/coordinator/table_export.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/table/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::server {
namespace {

using ::testing::HasSubstr;

std::string NewDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string path = absl::StrCat(base ? base : "/tmp", "/exportXXXXXX");
  EXPECT_NE(::mkdtemp(path.data()), nullptr);
  return path;
}

// 5 x 3, column-sharded over 2 ranks with placement 0 on rank 1: rank 1 holds columns [0, 2),
// rank 0 column 2.
v1::TableSpec Spec(v1::TableKind kind = v1::TABLE_KIND_EMBEDDING) {
  v1::TableSpec spec;
  spec.set_name("t");
  spec.set_kind(kind);
  spec.set_num_rows(5);
  spec.set_num_cols(3);
  spec.mutable_sharding()->set_dim(1);
  spec.mutable_sharding()->add_placements("rank:1/cpu");
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  spec.set_seed(1);
  spec.set_generation(9);
  return spec;
}

// The full table's value at (r, c).
float Value(int64_t r, int64_t c) { return static_cast<float>(10 * r + c); }

// Rows [row, row + rows) of the shard holding columns [col0, col0 + cols).
v1::internal::ReadShardChunk Chunk(int64_t row, int64_t rows, int64_t col0, int64_t cols) {
  v1::internal::ReadShardChunk chunk;
  chunk.set_rows(rows);
  chunk.set_cols(cols);
  std::vector<float> data;
  for (int64_t r = row; r < row + rows; ++r) {
    for (int64_t c = col0; c < col0 + cols; ++c) data.push_back(Value(r, c));
  }
  chunk.set_data(data.data(), data.size() * sizeof(float));
  return chunk;
}

std::unique_ptr<TableExport> Plan(const std::string& path,
                                  v1::TableKind kind = v1::TABLE_KIND_EMBEDDING) {
  absl::StatusOr<std::unique_ptr<TableExport>> plan =
      TableExport::Create(Spec(kind), 2, {"w0:1", "w1:1"}, path, "");
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? std::move(*plan) : nullptr;
}

TEST(TableExport, ReadsEveryRankAndPlacesEachShardWhereItsChunkBelongs) {
  const std::string path = NewDir() + "/t.safetensors";
  auto plan = Plan(path);
  ASSERT_NE(plan, nullptr);
  ASSERT_EQ(plan->reads().size(), 2u);
  EXPECT_EQ(plan->reads()[1].address, "w1:1");
  EXPECT_EQ(plan->reads()[1].request.table(), "t");
  EXPECT_EQ(plan->reads()[1].request.generation(), 9u);  // a rank holding another load: ABORTED
  ASSERT_TRUE(plan->AddChunk(0, Chunk(0, 5, 2, 1)).ok());
  ASSERT_TRUE(plan->EndShard(0).ok());
  ASSERT_TRUE(plan->AddChunk(1, Chunk(0, 2, 0, 2)).ok());  // in two chunks
  ASSERT_TRUE(plan->AddChunk(1, Chunk(2, 3, 0, 2)).ok());
  ASSERT_TRUE(plan->EndShard(1).ok());
  absl::StatusOr<v1::ExportTableResponse> written = plan->Write();
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->bytes(), 5 * 3 * 4);
  auto file = core::SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const core::SafetensorsTensor* weight = (*file)->Find("weight");
  ASSERT_NE(weight, nullptr);
  ASSERT_EQ(weight->bytes, 5 * 3 * 4);
  const auto* values = reinterpret_cast<const float*>(weight->data);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(values[r * 3 + c], Value(r, c)) << r << "," << c;
  }
}

// The bytes streamed to a caller are the file Write writes; an export to the caller has no file.
TEST(TableExport, FileHoldsTheBytesWriteWrites) {
  for (v1::TableKind kind : {v1::TABLE_KIND_EMBEDDING, v1::TABLE_KIND_LINEAR}) {
    const std::string path = NewDir() + "/t.safetensors";
    auto to_file = Plan(path, kind);
    absl::StatusOr<std::unique_ptr<TableExport>> streamed =
        TableExport::Create(Spec(kind), 2, {"w0:1", "w1:1"}, "", "");
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    for (TableExport* plan : {to_file.get(), streamed->get()}) {
      v1::internal::ReadShardChunk first = Chunk(0, 5, 2, 1);
      if (kind == v1::TABLE_KIND_LINEAR) first.set_bias(std::string(5 * 4, '\x3f'));
      ASSERT_TRUE(plan->AddChunk(0, first).ok());
      ASSERT_TRUE(plan->EndShard(0).ok());
      ASSERT_TRUE(plan->AddChunk(1, Chunk(0, 5, 0, 2)).ok());
      ASSERT_TRUE(plan->EndShard(1).ok());
    }
    ASSERT_TRUE(to_file->Write().ok());
    EXPECT_EQ((*streamed)->Write().status().code(), absl::StatusCode::kInternal);
    absl::StatusOr<std::vector<absl::string_view>> file = (*streamed)->File();
    ASSERT_TRUE(file.ok()) << file.status();
    std::string bytes;
    for (absl::string_view piece : *file) bytes.append(piece.data(), piece.size());
    std::ifstream in(path, std::ios::binary);
    std::stringstream written;
    written << in.rdbuf();
    EXPECT_TRUE(bytes == written.str()) << bytes.size() << " vs " << written.str().size();
  }
  // Not whole yet: no file.
  auto partial = Plan("");
  ASSERT_TRUE(partial->AddChunk(0, Chunk(0, 5, 2, 1)).ok());
  EXPECT_EQ(partial->File().status().code(), absl::StatusCode::kInternal);
}

TEST(TableExport, AChunkThatDoesNotFitItsShardIsRefusedNamingTheRank) {
  struct Bad {
    std::string what;
    v1::internal::ReadShardChunk chunk;
  };
  v1::internal::ReadShardChunk short_bytes = Chunk(0, 2, 0, 2);
  short_bytes.mutable_data()->resize(5);
  v1::internal::ReadShardChunk negative = Chunk(0, 1, 0, 2);
  negative.set_rows(-1);
  v1::internal::ReadShardChunk bias = Chunk(0, 1, 0, 2);
  bias.set_bias(std::string(5 * 4, '\0'));  // an embedding has none
  const std::vector<Bad> bad = {
      {"more rows than the shard", Chunk(0, 6, 0, 2)},
      {"another width", Chunk(0, 2, 0, 3)},
      {"bytes that are not rows x cols", short_bytes},
      {"negative rows", negative},
      {"a bias", bias},
  };
  for (const Bad& b : bad) {
    auto plan = Plan(NewDir() + "/t.safetensors");
    const absl::Status s = plan->AddChunk(1, b.chunk);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << b.what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1")) << b.what;
  }
  auto plan = Plan(NewDir() + "/t.safetensors");
  EXPECT_EQ(plan->AddChunk(2, Chunk(0, 1, 0, 1)).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(plan->AddChunk(-1, Chunk(0, 1, 0, 1)).code(), absl::StatusCode::kInternal);
  // Rows past the shard's end over several chunks, too.
  ASSERT_TRUE(plan->AddChunk(1, Chunk(0, 4, 0, 2)).ok());
  EXPECT_EQ(plan->AddChunk(1, Chunk(4, 2, 0, 2)).code(), absl::StatusCode::kInternal);
}

TEST(TableExport, AShardThatEndsShortOrNeverComesFailsTheExportAndWritesNothing) {
  const std::string path = NewDir() + "/t.safetensors";
  auto plan = Plan(path);
  ASSERT_TRUE(plan->AddChunk(1, Chunk(0, 4, 0, 2)).ok());
  const absl::Status ended = plan->EndShard(1);
  EXPECT_EQ(ended.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(ended.message()), HasSubstr("4 rows in all, of 5"));
  ASSERT_TRUE(plan->AddChunk(0, Chunk(0, 5, 2, 1)).ok());
  ASSERT_TRUE(plan->EndShard(0).ok());
  EXPECT_EQ(plan->Write().status().code(), absl::StatusCode::kInternal);  // rank 1 never ended
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

TEST(TableExport, ALayerWhoseBiasNeverCameIsNotWritten) {
  const std::string path = NewDir() + "/l.safetensors";
  auto plan = Plan(path, v1::TABLE_KIND_LINEAR);
  ASSERT_TRUE(plan->AddChunk(0, Chunk(0, 5, 2, 1)).ok());
  ASSERT_TRUE(plan->EndShard(0).ok());
  ASSERT_TRUE(plan->AddChunk(1, Chunk(0, 5, 0, 2)).ok());
  ASSERT_TRUE(plan->EndShard(1).ok());
  const absl::Status written = plan->Write().status();
  EXPECT_EQ(written.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(written.message()), HasSubstr("bias"));
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

TEST(TableExport, APathIntoTheStateDirectoryByAnyRouteIsRefused) {
  const std::string dir = NewDir();
  const std::string state = dir + "/state";
  ASSERT_EQ(::mkdir(state.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((state + "/sub").c_str(), 0755), 0);
  ASSERT_EQ(::symlink(state.c_str(), (dir + "/link").c_str()), 0);
  for (const std::string& path :
       {state + "/tables.pb", state + "/tables.pb.tmp", state + "/sub/t.safetensors",
        dir + "/link/tables.pb", dir + "/state/../state/t.safetensors", state + "/./x"}) {
    const absl::Status s = CheckExportPath(path, state);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("state directory")) << path;
  }
  EXPECT_TRUE(CheckExportPath(dir + "/t.safetensors", state).ok());
  ASSERT_EQ(::mkdir((dir + "/state2").c_str(), 0755), 0);  // a name that begins as it does
  EXPECT_TRUE(CheckExportPath(dir + "/state2/t.safetensors", state).ok());
  EXPECT_TRUE(CheckExportPath(state + "/tables.pb", "").ok());  // no state directory
  // The general rules still hold: absolute, an existing directory, a regular file.
  EXPECT_EQ(CheckExportPath("relative", state).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckExportPath(dir + "/none/t", state).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckExportPath(dir, state).code(), absl::StatusCode::kInvalidArgument);
  // And an export planned to such a path is refused before anything is read.
  EXPECT_EQ(TableExport::Create(Spec(), 2, {"a", "b"}, state + "/t", state).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardserve::server
