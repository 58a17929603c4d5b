#include "server/common/tensor_codec.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"
#include "proto/internal.pb.h"

namespace shardserve::server {
namespace {

// `tensor`'s elements, checked (dtype `want`, shape, bytes) and viewed where they lie. Only bytes
// not aligned for T (protobuf's buffers always are) are copied, into `scratch`.
template <typename T>
absl::StatusOr<absl::Span<const T>> View(const v1::Tensor& tensor, const std::string& field,
                                         v1::DType want, std::vector<int64_t>* shape,
                                         std::vector<T>* scratch) {
  if (tensor.dtype() != want) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: ", DTypeName(tensor.dtype()),
                                                   " where ", DTypeName(want), " is required"));
  }
  shape->assign(tensor.shape().begin(), tensor.shape().end());
  int64_t n = 1;
  for (int i = 0; i < tensor.shape_size(); ++i) {
    const int64_t d = tensor.shape(i);
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape[", i, "]: ", d, " must be >= 0"));
    }
    if (d != 0 && n > (int64_t{1} << 40) / d) {
      return absl::ResourceExhaustedError(
          absl::StrCat(field, ".shape [", absl::StrJoin(*shape, ", "), "] is too large"));
    }
    n *= d;
  }
  if (static_cast<int64_t>(tensor.data().size()) != n * static_cast<int64_t>(sizeof(T))) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data: ", tensor.data().size(), " bytes, but shape [", absl::StrJoin(*shape, ", "),
        "] x ", sizeof(T), " bytes = ", n * static_cast<int64_t>(sizeof(T))));
  }
  const char* bytes = tensor.data().data();
  if (reinterpret_cast<uintptr_t>(bytes) % alignof(T) == 0) {
    return absl::MakeConstSpan(reinterpret_cast<const T*>(bytes), n);
  }
  scratch->resize(n);
  if (n > 0) std::memcpy(scratch->data(), bytes, n * sizeof(T));
  return absl::MakeConstSpan(*scratch);
}

template <typename T>
absl::Status Decode(const v1::Tensor& tensor, const std::string& field, v1::DType want,
                    std::vector<T>* values, std::vector<int64_t>* shape) {
  SHARDSERVE_ASSIGN_OR_RETURN(const absl::Span<const T> view,
                              View(tensor, field, want, shape, values));
  // (assign copies once; resize would zero the values first, a tenth of a large update's decode)
  if (view.data() != values->data()) values->assign(view.begin(), view.end());
  return absl::OkStatus();
}

core::PoolMode ModeOf(v1::PoolMode mode) {
  switch (mode) {
    case v1::POOL_MODE_SUM:
      return core::PoolMode::kSum;
    case v1::POOL_MODE_MAX:
      return core::PoolMode::kMax;
    default:
      return core::PoolMode::kMean;
  }
}

// Protobuf's length-delimited field key (wire type 2) and base-128 varints.
void AppendLengthKey(int field, std::string* out) {
  out->push_back(static_cast<char>(field << 3 | 2));
}
void AppendVarint(uint64_t value, std::string* out) {
  for (; value >= 0x80; value >>= 7) out->push_back(static_cast<char>(value | 0x80));
  out->push_back(static_cast<char>(value));
}

// `fields` (a message's fields numbered below `tensor_field`, already encoded), then
// `tensor_field` = Tensor{FLOAT32, result.shape, result.values}, the values referenced in place,
// then `after` (the fields numbered above it).
// The largest step buffer an answer keeps alive for the sake of a smaller share of it.
constexpr size_t kLargestSharedPin = size_t{1} << 20;

grpc::ByteBuffer EncodeWithTensor(std::string fields, int tensor_field, core::DenseResult result,
                                  const std::string& after) {
  v1::Tensor head;  // every field of the Tensor but its data
  head.set_dtype(v1::FLOAT32);
  head.mutable_shape()->Assign(result.shape.begin(), result.shape.end());
  const size_t data_bytes = result.Values().size() * sizeof(float);
  std::string data_key;  // proto3 leaves an empty bytes field out
  if (data_bytes > 0) {
    AppendLengthKey(v1::Tensor::kDataFieldNumber, &data_key);
    AppendVarint(data_bytes, &data_key);
  }
  std::string prefix = std::move(fields);
  AppendLengthKey(tensor_field, &prefix);
  AppendVarint(head.ByteSizeLong() + data_key.size() + data_bytes, &prefix);
  head.AppendToString(&prefix);
  prefix += data_key;
  if (data_bytes == 0) {
    grpc::Slice only(prefix + after);
    return grpc::ByteBuffer(&only, 1);
  }
  // The data slice keeps the values' buffer (or a share of a step's buffer) until gRPC has sent it.
  // A small share of a large step buffer is copied instead: an answer its client is slow to read
  // would otherwise keep the whole step's results alive, the other callers' answers included.
  if (result.shared != nullptr && result.shared->size() * sizeof(float) > kLargestSharedPin &&
      result.shared->size() > 2 * static_cast<size_t>(result.count)) {
    const absl::Span<const float> rows = result.Values();
    result.values.assign(rows.begin(), rows.end());
    result.shared.reset();
  }
  grpc::Slice data;
  if (result.shared == nullptr) {
    auto* values = new core::FloatBuffer(std::move(result.values));
    data = grpc::Slice(values->data(), data_bytes,
                       [](void* owner) { delete static_cast<core::FloatBuffer*>(owner); }, values);
  } else {
    using Share = std::shared_ptr<const core::FloatBuffer>;
    auto* share = new Share(std::move(result.shared));
    data = grpc::Slice(const_cast<float*>((*share)->data() + result.offset), data_bytes,
                       [](void* owner) { delete static_cast<Share*>(owner); }, share);
  }
  const grpc::Slice slices[] = {grpc::Slice(prefix), std::move(data), grpc::Slice(after)};
  return grpc::ByteBuffer(slices, after.empty() ? 2 : 3);
}

}  // namespace

absl::Status DecodeInt64(const v1::Tensor& tensor, const std::string& field,
                         std::vector<int64_t>* values, std::vector<int64_t>* shape) {
  return Decode(tensor, field, v1::INT64, values, shape);
}

absl::Status DecodeFloat(const v1::Tensor& tensor, const std::string& field,
                         std::vector<float>* values, std::vector<int64_t>* shape) {
  return Decode(tensor, field, v1::FLOAT32, values, shape);
}

namespace {

// A uint64 field, as protobuf writes it (nothing for 0).
std::string VarintField(int field, uint64_t value) {
  std::string out;
  if (value == 0) return out;
  out.push_back(static_cast<char>(field << 3));
  AppendVarint(value, &out);
  return out;
}

}  // namespace

grpc::ByteBuffer EncodeTensorResponse(core::DenseResult result, uint64_t version,
                                      uint64_t sequence) {
  return EncodeWithTensor("", v1::TensorResponse::kOutputFieldNumber, std::move(result),
                          VarintField(v1::TensorResponse::kVersionFieldNumber, version) +
                              VarintField(v1::TensorResponse::kSequenceFieldNumber, sequence));
}

namespace {
grpc::ByteBuffer Serialized(const google::protobuf::MessageLite& message) {
  grpc::Slice only(message.SerializeAsString());
  return grpc::ByteBuffer(&only, 1);
}
}  // namespace

grpc::ByteBuffer EncodeReplicatedUpdate(const grpc::ByteBuffer& update, uint64_t sequence,
                                        uint64_t version) {
  std::vector<grpc::Slice> slices(1);
  std::string head;
  AppendLengthKey(v1::internal::ReplicatedUpdate::kUpdateFieldNumber, &head);
  AppendVarint(update.Length(), &head);
  slices[0] = grpc::Slice(std::move(head));
  std::vector<grpc::Slice> body;
  if (update.Length() > 0 && update.Dump(&body).ok()) {
    slices.insert(slices.end(), body.begin(), body.end());  // references, not copies
  }
  slices.emplace_back(VarintField(v1::internal::ReplicatedUpdate::kSequenceFieldNumber, sequence) +
                      VarintField(v1::internal::ReplicatedUpdate::kVersionFieldNumber, version));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeUpdateResponse(uint64_t version, uint64_t sequence) {
  v1::UpdateRowsResponse response;
  response.set_version(version);
  response.set_sequence(sequence);
  return Serialized(response);
}

grpc::ByteBuffer EncodeStreamUpdateResponse(uint64_t id, uint64_t version, uint64_t sequence) {
  v1::StreamResponse response;
  response.set_id(id);
  response.set_version(version);
  response.set_sequence(sequence);
  return Serialized(response);
}

namespace {

// An UpdateRows request's rows as views into it (copied into `scratch_*` only where misaligned),
// their shapes checked against `table`.
struct UpdateView {
  core::UpdateRows rows;
  std::vector<int64_t> ids_shape;
  std::vector<int64_t> scratch_ids;
  std::vector<float> scratch_values, scratch_bias;
};

absl::Status ViewUpdate(const v1::UpdateRowsRequest& request, const core::TableConfig& table,
                        UpdateView* view) {
  switch (request.op()) {
    case v1::ASSIGN:
      view->rows.kind = core::UpdateKind::kAssign;
      break;
    case v1::ADD:
      view->rows.kind = core::UpdateKind::kAdd;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("op: ", request.op(), " is not one of ASSIGN, ADD"));
  }
  SHARDSERVE_ASSIGN_OR_RETURN(
      view->rows.ids,
      View(request.ids(), "ids", v1::INT64, &view->ids_shape, &view->scratch_ids));
  if (view->ids_shape.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ids.shape: must be 1-D (k), has ", view->ids_shape.size(), " dims"));
  }
  std::vector<int64_t> shape;
  SHARDSERVE_ASSIGN_OR_RETURN(
      view->rows.values,
      View(request.values(), "values", v1::FLOAT32, &shape, &view->scratch_values));
  const int64_t k = view->ids_shape[0];
  if (shape != std::vector<int64_t>{k, table.num_cols}) {
    return absl::InvalidArgumentError(
        absl::StrCat("values.shape: [", absl::StrJoin(shape, ", "), "] must be [", k, ", ",
                     table.num_cols, "] (one row of ", table.num_cols, " per id)"));
  }
  if (request.has_bias()) {
    SHARDSERVE_ASSIGN_OR_RETURN(
        view->rows.bias,
        View(request.bias(), "bias", v1::FLOAT32, &shape, &view->scratch_bias));
    if (shape != std::vector<int64_t>{k}) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bias.shape: [", absl::StrJoin(shape, ", "), "] must be [", k, "] (one per id)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<core::StepRequest>> MakeStepRequest(
    const v1::UpdateRowsRequest& request, const core::TableConfig& table,
    const core::InputLimits& limits) {
  UpdateView view;
  SHARDSERVE_RETURN_IF_ERROR(ViewUpdate(request, table, &view));
  auto r = std::make_unique<core::StepRequest>();
  r->op = core::StepRequest::Op::kUpdate;
  r->table = request.table();
  r->update = view.rows.kind;
  r->shape = std::move(view.ids_shape);
  r->ids.assign(view.rows.ids.begin(), view.rows.ids.end());
  r->values.assign(view.rows.values.begin(), view.rows.values.end());
  r->bias.assign(view.rows.bias.begin(), view.rows.bias.end());
  SHARDSERVE_RETURN_IF_ERROR(core::PrepareRequest(table, limits, *r, {}, false, false));
  return r;
}

absl::Status CheckUpdate(const v1::UpdateRowsRequest& request, const core::TableConfig& table,
                         const core::InputLimits& limits) {
  UpdateView view;
  SHARDSERVE_RETURN_IF_ERROR(ViewUpdate(request, table, &view));
  return core::ValidateUpdate(table, limits, view.rows);
}

grpc::ByteBuffer EncodeStreamResponse(uint64_t id, absl::StatusOr<core::DenseResult> result,
                                      uint64_t version, uint64_t sequence) {
  v1::StreamResponse head;  // the fields before `output`, or the whole error answer
  head.set_id(id);
  if (!result.ok()) {
    head.set_code(static_cast<int>(result.status().code()));
    head.set_message(std::string(result.status().message()));
    grpc::Slice only(head.SerializeAsString());
    return grpc::ByteBuffer(&only, 1);
  }
  return EncodeWithTensor(head.SerializeAsString(), v1::StreamResponse::kOutputFieldNumber,
                          *std::move(result),
                          VarintField(v1::StreamResponse::kVersionFieldNumber, version) +
                              VarintField(v1::StreamResponse::kSequenceFieldNumber, sequence));
}

absl::Status ParseRaw(const grpc::ByteBuffer& raw, google::protobuf::MessageLite* message) {
  grpc::ByteBuffer shared(raw);  // the reader consumes its buffer; this one shares the slices
  grpc::ProtoBufferReader reader(&shared);
  if (!reader.status().ok() || !message->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request is not a valid ", message->GetTypeName(), " message"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<core::StepRequest>> MakeStepRequest(
    const v1::EmbeddingRequest& request, const core::TableConfig& table,
    const core::InputLimits& limits) {
  auto r = std::make_unique<core::StepRequest>();
  r->op = core::StepRequest::Op::kEmbedding;
  r->table = request.table();
  r->version = request.version();
  SHARDSERVE_RETURN_IF_ERROR(DecodeInt64(request.ids(), "ids", &r->ids, &r->shape));
  SHARDSERVE_RETURN_IF_ERROR(core::PrepareRequest(table, limits, *r, {}, false, false));
  return r;
}

absl::StatusOr<std::unique_ptr<core::StepRequest>> MakeStepRequest(
    const v1::EmbeddingBagRequest& request, const core::TableConfig& table,
    const core::InputLimits& limits) {
  auto r = std::make_unique<core::StepRequest>();
  r->op = core::StepRequest::Op::kEmbeddingBag;
  r->table = request.table();
  r->version = request.version();
  if (!v1::PoolMode_IsValid(request.mode())) {
    return absl::InvalidArgumentError(
        absl::StrCat("mode: ", request.mode(),
                     " is not one of POOL_MODE_MEAN (or unset), POOL_MODE_SUM, POOL_MODE_MAX"));
  }
  r->mode = ModeOf(request.mode());
  SHARDSERVE_RETURN_IF_ERROR(DecodeInt64(request.ids(), "ids", &r->ids, &r->shape));
  std::vector<int64_t> offsets, offsets_shape;
  const bool has_offsets = request.has_offsets();
  if (has_offsets) {
    SHARDSERVE_RETURN_IF_ERROR(DecodeInt64(request.offsets(), "offsets", &offsets, &offsets_shape));
    if (offsets_shape.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("offsets.shape: must be 1-D, has ", offsets_shape.size(), " dims"));
    }
  }
  if (request.has_per_sample_weights()) {
    std::vector<int64_t> weights_shape;
    SHARDSERVE_RETURN_IF_ERROR(DecodeFloat(request.per_sample_weights(), "per_sample_weights",
                                           &r->weights, &weights_shape));
    if (weights_shape != r->shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "per_sample_weights.shape: [", absl::StrJoin(weights_shape, ", "),
          "] does not match ids.shape [", absl::StrJoin(r->shape, ", "), "]"));
    }
    r->has_weights = true;
  }
  SHARDSERVE_RETURN_IF_ERROR(
      core::PrepareRequest(table, limits, *r, offsets, has_offsets, request.include_last_offset()));
  return r;
}

absl::StatusOr<std::unique_ptr<core::StepRequest>> MakeStepRequest(
    const v1::LinearRequest& request, const core::TableConfig& table,
    const core::InputLimits& limits) {
  auto r = std::make_unique<core::StepRequest>();
  r->op = core::StepRequest::Op::kLinear;
  r->table = request.table();
  r->version = request.version();
  SHARDSERVE_RETURN_IF_ERROR(DecodeFloat(request.input(), "input", &r->values, &r->shape));
  SHARDSERVE_RETURN_IF_ERROR(core::PrepareRequest(table, limits, *r, {}, false, false));
  return r;
}

absl::StatusOr<std::string> TableOfRequest(const grpc::ByteBuffer& request,
                                           absl::string_view type) {
  using google::protobuf::internal::WireFormatLite;
  grpc::ByteBuffer bytes(request);  // (shares the slices; the reader wants it mutable)
  grpc::ProtoBufferReader reader(&bytes);
  google::protobuf::io::CodedInputStream in(&reader);
  const uint32_t table_tag =
      WireFormatLite::MakeTag(1, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
  while (const uint32_t tag = in.ReadTag()) {
    if (tag == table_tag) {
      std::string table;
      if (WireFormatLite::ReadString(&in, &table)) return table;
      break;
    }
    if (!WireFormatLite::SkipField(&in, tag)) break;
  }
  if (!in.ConsumedEntireMessage()) {
    return absl::InvalidArgumentError(absl::StrCat("the request is not a valid ", type));
  }
  return std::string();
}

}  // namespace shardserve::server
