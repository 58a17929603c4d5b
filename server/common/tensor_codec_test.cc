#include "server/common/tensor_codec.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/internal.pb.h"

namespace shardserve::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::Tensor Ids(std::vector<int64_t> shape, std::vector<int64_t> values) {
  v1::Tensor t;
  t.set_dtype(v1::INT64);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(values.data(), values.size() * 8);
  return t;
}

TEST(TensorCodec, DecodesAndChecksBytesAgainstShape) {
  std::vector<int64_t> values, shape;
  ASSERT_TRUE(DecodeInt64(Ids({2, 2}, {1, 2, 3, 4}), "ids", &values, &shape).ok());
  EXPECT_THAT(values, ElementsAre(1, 2, 3, 4));
  v1::Tensor short_data = Ids({2, 3}, {1, 2, 3, 4});
  absl::Status status = DecodeInt64(short_data, "ids", &values, &shape);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("ids.data: 32 bytes, but shape [2, 3] x 8 bytes = 48"));
  v1::Tensor wrong_type = Ids({1}, {1});
  wrong_type.set_dtype(v1::FLOAT32);
  EXPECT_THAT(std::string(DecodeInt64(wrong_type, "ids", &values, &shape).message()),
              HasSubstr("ids.dtype: FLOAT32 where INT64 is required"));
  v1::Tensor negative = Ids({-1}, {});
  EXPECT_THAT(std::string(DecodeInt64(negative, "ids", &values, &shape).message()),
              HasSubstr("ids.shape[0]: -1 must be >= 0"));
  wrong_type.set_dtype(static_cast<v1::DType>(7));  // a value proto3 keeps but this build lacks
  EXPECT_THAT(std::string(DecodeInt64(wrong_type, "ids", &values, &shape).message()),
              HasSubstr("ids.dtype: 7 (unknown) where INT64 is required"));
}

TEST(TensorCodec, ValidatesTableSpecs) {
  v1::TableSpec spec;
  spec.set_name("t");
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_num_rows(10);
  spec.set_num_cols(4);
  spec.set_seed(1);
  spec.mutable_sharding()->set_dim(1);
  spec.mutable_sharding()->add_placements("rank:1/cpu");
  spec.mutable_sharding()->add_placements("rank:0/cpu");
  absl::StatusOr<core::TableConfig> config = ConfigFromSpec(spec, 2);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->spec.placements()[0].rank, 1);
  EXPECT_THAT(std::string(ConfigFromSpec(spec, 1).status().message()),
              HasSubstr("2 placements, but the cluster has 1 ranks"));
  // Fewer placements than ranks: the chunks sit on those ranks, rank 2 holds an empty shard.
  config = ConfigFromSpec(spec, 3);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->spec.world_size(), 3);
  EXPECT_EQ(config->spec.num_chunks(), 2);
  EXPECT_EQ(config->spec.PlacementIndexOfRank(2), -1);
  spec.set_name("a|b");
  EXPECT_THAT(std::string(ConfigFromSpec(spec, 2).status().message()), HasSubstr("forbidden"));
  spec.set_name(std::string(257, 'n'));
  EXPECT_THAT(std::string(ConfigFromSpec(spec, 2).status().message()),
              HasSubstr("table.name: 257 bytes, over the limit of 256"));
  spec.set_name("t");
  spec.set_checkpoint(std::string(4097, 'c'));
  EXPECT_THAT(std::string(ConfigFromSpec(spec, 2).status().message()),
              HasSubstr("table.checkpoint: 4097 bytes, over the limit of 4096"));
  spec.set_seed(1);
  spec.set_name("t");
  spec.set_kind(static_cast<v1::TableKind>(5));  // unknown kinds and dtypes are refused
  EXPECT_THAT(std::string(ConfigFromSpec(spec, 2).status().message()),
              HasSubstr("table.kind: 5 is not one of TABLE_KIND_EMBEDDING, TABLE_KIND_LINEAR"));
  spec.set_kind(v1::TABLE_KIND_UNSPECIFIED);  // since v1 has a zero value: refused
  EXPECT_THAT(std::string(ConfigFromSpec(spec, 2).status().message()),
              HasSubstr("table.kind: 0 (not set) is not one of"));
  spec.set_kind(v1::TABLE_KIND_EMBEDDING);
  spec.set_dtype(static_cast<v1::DType>(3));
  EXPECT_THAT(std::string(ConfigFromSpec(spec, 2).status().message()),
              HasSubstr("table.dtype: 3 (unknown) is not supported"));
  spec.set_dtype(v1::FLOAT32);
  spec.clear_seed();
  EXPECT_THAT(std::string(ConfigFromSpec(spec, 2).status().message()), HasSubstr("table.init"));
}

TEST(TensorCodec, BagRequestBecomesCanonicalStepRequest) {
  core::TableConfig table;
  table.name = "t";
  table.num_rows = 10;
  table.num_cols = 4;
  ASSERT_TRUE(table.Validate().ok());
  v1::EmbeddingBagRequest request;
  request.set_table("t");
  *request.mutable_ids() = Ids({4}, {1, 2, 3, 4});
  *request.mutable_offsets() = Ids({2}, {0, 1});
  request.set_mode(v1::POOL_MODE_SUM);
  auto step = MakeStepRequest(request, table, {});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_THAT((*step)->offsets, ElementsAre(0, 1, 4));
  EXPECT_EQ((*step)->mode, core::PoolMode::kSum);
  *request.mutable_offsets() = Ids({2, 1}, {0, 1});
  EXPECT_THAT(std::string(MakeStepRequest(request, table, {}).status().message()),
              HasSubstr("offsets.shape: must be 1-D"));
  *request.mutable_offsets() = Ids({2}, {0, 1});
  request.set_mode(v1::POOL_MODE_MAX);
  v1::Tensor weights;
  weights.set_dtype(v1::FLOAT32);
  weights.add_shape(4);
  weights.set_data(std::string(16, '\0'));
  *request.mutable_per_sample_weights() = weights;
  EXPECT_THAT(std::string(MakeStepRequest(request, table, {}).status().message()),
              HasSubstr("per_sample_weights: only supported with mode sum"));
  request.set_mode(static_cast<v1::PoolMode>(9));  // not taken for the default, MEAN
  EXPECT_THAT(std::string(MakeStepRequest(request, table, {}).status().message()),
              HasSubstr("mode: 9 is not one of POOL_MODE_MEAN (or unset), POOL_MODE_SUM"));
}

v1::Tensor Floats(std::vector<int64_t> shape, std::vector<float> values) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT32);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(values.data(), values.size() * sizeof(float));
  return t;
}

// The coordinator checks a replicated update on its bytes (CheckUpdate) before it takes a place in
// the stream; every worker checks it again as a StepRequest. They must agree on every update, or
// a place would be taken by an update every replica refuses (or one refused that they would take).
TEST(TensorCodec, AnUpdatesCheckInPlaceAgreesWithItsStepRequest) {
  core::TableConfig table;
  table.name = "lin";
  table.kind = core::TableKind::kLinear;
  table.num_rows = 6;
  table.num_cols = 2;
  table.has_bias = true;
  ASSERT_TRUE(table.Validate().ok());
  v1::UpdateRowsRequest good;
  good.set_table("lin");
  good.set_op(v1::ADD);
  *good.mutable_ids() = Ids({3}, {5, 0, 5});
  *good.mutable_values() = Floats({3, 2}, {1, 2, 3, 4, 5, 6});
  *good.mutable_bias() = Floats({3}, {0.5f, 1, 2});
  std::vector<std::pair<std::string, v1::UpdateRowsRequest>> bad;
  auto with = [&](const std::string& error, auto change) {
    v1::UpdateRowsRequest r = good;
    change(r);
    bad.emplace_back(error, r);
  };
  with("op: 0 is not one of ASSIGN, ADD", [](auto& r) { r.set_op(v1::UPDATE_OP_UNSPECIFIED); });
  with("ids[1]: 6 is out of range [0, 6)", [](auto& r) { *r.mutable_ids() = Ids({3}, {5, 6, 5}); });
  with("ids[0]: -1 is out of range", [](auto& r) { *r.mutable_ids() = Ids({3}, {-1, 0, 5}); });
  with("ids.shape: must be 1-D", [](auto& r) { *r.mutable_ids() = Ids({3, 1}, {5, 0, 5}); });
  with("ids.dtype: FLOAT32", [](auto& r) { *r.mutable_ids() = Floats({2}, {1, 2}); });
  with("values.shape: [2, 3] must be [3, 2]",
       [](auto& r) { *r.mutable_values() = Floats({2, 3}, {1, 2, 3, 4, 5, 6}); });
  with("values.data: 20 bytes", [](auto& r) {
    r.mutable_values()->mutable_data()->resize(20);
  });
  with("values[2][1]: nan is not finite", [](auto& r) {
    *r.mutable_values() = Floats({3, 2}, {1, 2, 3, 4, 5, std::nanf("")});
  });
  with("values[0][0]: inf is not finite", [](auto& r) {
    *r.mutable_values() = Floats({3, 2}, {INFINITY, 2, 3, 4, 5, 6});
  });
  with("bias.shape: [2] must be [3]", [](auto& r) { *r.mutable_bias() = Floats({2}, {1, 2}); });
  with("bias[1]: -inf is not finite",
       [](auto& r) { *r.mutable_bias() = Floats({3}, {1, -INFINITY, 2}); });
  for (const auto& [error, request] : bad) {
    const absl::Status in_place = CheckUpdate(request, table, {});
    const absl::Status step = MakeStepRequest(request, table, {}).status();
    EXPECT_EQ(in_place.code(), absl::StatusCode::kInvalidArgument) << error;
    EXPECT_THAT(std::string(in_place.message()), HasSubstr(error));
    EXPECT_EQ(in_place, step) << error;
  }
  // And a bias where the table has none.
  table.has_bias = false;
  EXPECT_THAT(std::string(CheckUpdate(good, table, {}).message()), HasSubstr("has no bias"));
  EXPECT_EQ(CheckUpdate(good, table, {}), MakeStepRequest(good, table, {}).status());
  table.has_bias = true;
  // Limits apply alike.
  core::InputLimits two;
  two.max_elements = 2;
  EXPECT_THAT(std::string(CheckUpdate(good, table, two).message()),
              HasSubstr("more than the limit of 2"));
  EXPECT_EQ(CheckUpdate(good, table, two), MakeStepRequest(good, table, two).status());

  ASSERT_TRUE(CheckUpdate(good, table, {}).ok());
  absl::StatusOr<std::unique_ptr<core::StepRequest>> step = MakeStepRequest(good, table, {});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ((*step)->update, core::UpdateKind::kAdd);
  EXPECT_THAT((*step)->ids, ElementsAre(5, 0, 5));
  EXPECT_THAT((*step)->shape, ElementsAre(3));
  EXPECT_THAT((*step)->values, ElementsAre(1, 2, 3, 4, 5, 6));
  EXPECT_THAT((*step)->bias, ElementsAre(0.5f, 1, 2));
}

// What protobuf itself makes of a float tensor: the reference for the hand-written encoding.
void SetFloats(const std::vector<int64_t>& shape, const core::FloatBuffer& values, v1::Tensor* t) {
  t->set_dtype(v1::FLOAT32);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  t->set_data(values.data(), values.size() * sizeof(float));
}

std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

// The hand-written wire encoding must be exactly what protobuf writes, for any shape and size
// (varint lengths of 1 to 4 bytes, empty data).
TEST(TensorCodec, ResponseWireBytesMatchProtobuf) {
  std::mt19937 rng(7);
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {3}, {2, 3}, {0, 128}, {1, 31}, {40, 128}, {10240, 128}, {2, 3, 5}}) {
    core::DenseResult result;
    result.shape = shape;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    result.values.resize(n);
    for (float& v : result.values) v = std::uniform_real_distribution<float>(-1, 1)(rng);
    v1::TensorResponse expected;
    SetFloats(shape, result.values, expected.mutable_output());
    const std::string wire = Bytes(EncodeTensorResponse(std::move(result)));
    EXPECT_EQ(wire, expected.SerializeAsString()) << "shape size " << shape.size() << ", n " << n;
    v1::TensorResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(wire));
    EXPECT_EQ(parsed.output().data(), expected.output().data());
  }
}

// Results that share one buffer (a step's coalesced requests) are sent from it without a copy:
// each response holds its share until it is gone, after the results themselves.
TEST(TensorCodec, SharedResultsAreSentFromTheirShareOfTheBuffer) {
  auto buffer = std::make_shared<core::FloatBuffer>();
  for (int k = 0; k < 10; ++k) buffer->push_back(static_cast<float>(k));
  const float* first = buffer->data();
  std::weak_ptr<const core::FloatBuffer> alive = buffer;
  std::vector<grpc::ByteBuffer> responses;
  for (const auto& [offset, rows] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {2, 4}}) {
    core::DenseResult result;
    result.shape = {rows, 2};
    result.shared = buffer;
    result.offset = offset;
    result.count = rows * 2;
    responses.push_back(EncodeTensorResponse(std::move(result)));
  }
  buffer.reset();
  ASSERT_FALSE(alive.expired());  // the responses hold it
  v1::TensorResponse expected;
  SetFloats({1, 2}, {0, 1}, expected.mutable_output());
  EXPECT_EQ(Bytes(responses[0]), expected.SerializeAsString());
  SetFloats({4, 2}, {2, 3, 4, 5, 6, 7, 8, 9}, expected.mutable_output());
  EXPECT_EQ(Bytes(responses[1]), expected.SerializeAsString());
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(responses[1].Dump(&slices).ok());
  EXPECT_EQ(reinterpret_cast<const float*>(slices.back().begin()), first + 2);  // not a copy
  slices.clear();
  responses.clear();
  EXPECT_TRUE(alive.expired());
}

TEST(TensorCodec, StreamResponseWireBytesMatchProtobuf) {
  for (const uint64_t id : {uint64_t{0}, uint64_t{7}, uint64_t{1} << 40}) {
    core::DenseResult result;
    result.shape = {2, 3};
    result.values.assign({1, 2, 3, 4, 5, 6});
    v1::StreamResponse expected;
    expected.set_id(id);
    SetFloats(result.shape, result.values, expected.mutable_output());
    EXPECT_EQ(Bytes(EncodeStreamResponse(id, std::move(result))), expected.SerializeAsString());
    v1::StreamResponse error;
    error.set_id(id);
    error.set_code(static_cast<int>(absl::StatusCode::kNotFound));
    error.set_message("no table");
    EXPECT_EQ(Bytes(EncodeStreamResponse(id, absl::NotFoundError("no table"))),
              error.SerializeAsString());
  }
}

TEST(TensorCodec, ParsesRawRequestsAndRejectsGarbage) {
  v1::EmbeddingRequest request;
  request.set_table("t");
  *request.mutable_ids() = Ids({2}, {5, 6});
  const std::string wire = request.SerializeAsString();
  grpc::Slice slice(wire);
  v1::EmbeddingRequest parsed;
  ASSERT_TRUE(ParseRaw(grpc::ByteBuffer(&slice, 1), &parsed).ok());
  EXPECT_EQ(parsed.table(), "t");
  EXPECT_EQ(parsed.ids().data(), request.ids().data());
  grpc::Slice garbage(std::string("\xff\xff\xff"));
  const absl::Status status = ParseRaw(grpc::ByteBuffer(&garbage, 1), &parsed);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("not a valid shardserve.v1.EmbeddingRequest"));
}

// The coordinator wraps a replicated update's bytes as they arrived (in several slices, as gRPC
// hands them over): the very bytes protobuf gives for the same ReplicatedUpdate.
TEST(TensorCodec, ReplicatedUpdateWrapsTheUpdateAsItArrived) {
  v1::UpdateRowsRequest update;
  update.set_table("t");
  update.set_op(v1::ADD);
  *update.mutable_ids() = Ids({3}, {5, 6, 5});
  core::FloatBuffer values(3 * 200);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * i;
  SetFloats({3, 200}, values, update.mutable_values());
  const std::string wire = update.SerializeAsString();
  std::vector<grpc::Slice> parts;  // in three pieces
  parts.emplace_back(wire.substr(0, 7));
  parts.emplace_back(wire.substr(7, 1000));
  parts.emplace_back(wire.substr(1007));
  const grpc::ByteBuffer raw(parts.data(), parts.size());
  for (const auto& [sequence, version] :
       std::vector<std::pair<uint64_t, uint64_t>>{{1, 1}, {123456789, 3}, {1, 0}}) {
    v1::internal::ReplicatedUpdate expected;
    *expected.mutable_update() = update;
    expected.set_sequence(sequence);
    expected.set_version(version);
    EXPECT_EQ(Bytes(EncodeReplicatedUpdate(raw, sequence, version)), expected.SerializeAsString());
  }
  v1::internal::ReplicatedUpdate empty;  // an empty update still names field 1
  empty.mutable_update();
  empty.set_sequence(2);
  EXPECT_EQ(Bytes(EncodeReplicatedUpdate(grpc::ByteBuffer(), 2, 0)), empty.SerializeAsString());
}

TEST(TensorCodec, TableOfRequestReadsTheTableWithoutParsingTheRest) {
  auto raw = [](const google::protobuf::MessageLite& m) {
    grpc::ByteBuffer bytes;
    bool own = false;
    EXPECT_TRUE(grpc::SerializationTraits<google::protobuf::MessageLite>::Serialize(m, &bytes,
                                                                                  &own)
                    .ok());
    return bytes;
  };
  v1::EmbeddingBagRequest bag;
  bag.set_table("emb");
  bag.mutable_ids()->set_data(std::string(1 << 20, '\1'));
  EXPECT_EQ(TableOfRequest(raw(bag), "B").value_or("?"), "emb");
  v1::LinearRequest linear;
  linear.set_table("layer");
  EXPECT_EQ(TableOfRequest(raw(linear), "L").value_or("?"), "layer");
  EXPECT_EQ(TableOfRequest(raw(v1::EmbeddingRequest()), "E").value_or("?"), "");  // no table: empty
  // Field 1 after other fields is still found.
  v1::Tensor ids;
  ids.set_dtype(v1::INT64);
  ids.add_shape(1);
  ids.set_data(std::string(8, '\0'));
  std::string reordered = ids.SerializeAsString();
  reordered = std::string("\x12") + static_cast<char>(reordered.size()) + reordered;
  reordered += std::string("\x0a\x03") + "emb";  // (a hex escape would swallow the "e")
  grpc::Slice slice(reordered);
  EXPECT_EQ(TableOfRequest(grpc::ByteBuffer(&slice, 1), "B").value_or("?"), "emb");
  // Garbage is refused, not read past.
  grpc::Slice garbage(std::string("\x0a\xff\xff\xff\xff\x0f"));
  EXPECT_EQ(TableOfRequest(grpc::ByteBuffer(&garbage, 1), "B").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardserve::server
