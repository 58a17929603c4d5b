// Conversions between the wire types (proto/shardserve.proto) and core's types: tensors, table
// specs, and data requests turned into validated StepRequests. Everything a client sends is checked
// here or in core's validation: wrong dtype, bytes that do not match shape x dtype size, bad specs
// give INVALID_ARGUMENT naming the field.
#ifndef SHARDSERVE_SERVER_COMMON_TENSOR_CODEC_H_
#define SHARDSERVE_SERVER_COMMON_TENSOR_CODEC_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/ops/op_inputs.h"
#include "core/step/step_request.h"
#include "core/table/table_config.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/shardserve.grpc.pb.h"
#include "proto/shardserve.pb.h"
#include "server/common/table_spec.h"  // ConfigFromSpec, DTypeName

namespace shardserve::server {

absl::Status DecodeInt64(const v1::Tensor& tensor, const std::string& field,
                         std::vector<int64_t>* values, std::vector<int64_t>* shape);
absl::Status DecodeFloat(const v1::Tensor& tensor, const std::string& field,
                         std::vector<float>* values, std::vector<int64_t>* shape);
// The data API with every method on raw bytes (requests parsed with ParseRaw, answers encoded as
// below): the coordinator forwards it untouched. (Workers serve the same raw methods on the async
// API.)
using RawDataService = v1::DataService::WithRawCallbackMethod_Embedding<
    v1::DataService::WithRawCallbackMethod_EmbeddingBag<
        v1::DataService::WithRawCallbackMethod_Linear<v1::DataService::WithRawCallbackMethod_Stream<
            v1::DataService::WithRawCallbackMethod_UpdateRows<v1::DataService::Service>>>>>;

// A TensorResponse holding `result` in protobuf's wire format (the very bytes
// TensorResponse::SerializeAsString() gives), with the values referenced where they lie, not
// copied: the buffer owns them and frees them once gRPC has sent them.
// `version`: the table version the answer came from (0: not said).
// `sequence`: that version's update sequence it reflects.
grpc::ByteBuffer EncodeTensorResponse(core::DenseResult result, uint64_t version = 0,
                                      uint64_t sequence = 0);
// A WorkerInternal.ApplyUpdate request (a ReplicatedUpdate) around the UpdateRowsRequest
// `update` as it arrived: its bytes are shared, not copied, however many replicas it goes to.
grpc::ByteBuffer EncodeReplicatedUpdate(const grpc::ByteBuffer& update, uint64_t sequence,
                                        uint64_t version);
// An UpdateRows answer, unary and in a Stream.
grpc::ByteBuffer EncodeUpdateResponse(uint64_t version, uint64_t sequence);
grpc::ByteBuffer EncodeStreamUpdateResponse(uint64_t id, uint64_t version, uint64_t sequence);

// The table a raw Embedding, EmbeddingBag or Linear request names (their field 1), read without
// parsing the rest: where the coordinator forwards it. The first occurrence counts (serializers
// write field 1 first); empty when absent. INVALID_ARGUMENT for bytes that are no message (named
// `type`, e.g. "shardserve.v1.EmbeddingRequest").
absl::StatusOr<std::string> TableOfRequest(const grpc::ByteBuffer& request,
                                           absl::string_view type);
// The same for a StreamResponse: `id`, and the result or the error's code and message.
grpc::ByteBuffer EncodeStreamResponse(uint64_t id, absl::StatusOr<core::DenseResult> result,
                                      uint64_t version = 0, uint64_t sequence = 0);

// Parses a request that arrived as raw bytes: INVALID_ARGUMENT if they are not a `message`.
absl::Status ParseRaw(const grpc::ByteBuffer& raw, google::protobuf::MessageLite* message);

// Decode + validate a data request against its table: the request is ready for StepLoop::Submit.
absl::StatusOr<std::unique_ptr<core::StepRequest>> MakeStepRequest(
    const v1::EmbeddingRequest& request, const core::TableConfig& table,
    const core::InputLimits& limits);
absl::StatusOr<std::unique_ptr<core::StepRequest>> MakeStepRequest(
    const v1::EmbeddingBagRequest& request, const core::TableConfig& table,
    const core::InputLimits& limits);
absl::StatusOr<std::unique_ptr<core::StepRequest>> MakeStepRequest(
    const v1::LinearRequest& request, const core::TableConfig& table,
    const core::InputLimits& limits);
absl::StatusOr<std::unique_ptr<core::StepRequest>> MakeStepRequest(
    const v1::UpdateRowsRequest& request, const core::TableConfig& table,
    const core::InputLimits& limits);
// The same checks of an update, on its bytes where they lie (no StepRequest, nothing copied): the
// coordinator's, before the update takes its place in a replicated table's stream.
absl::Status CheckUpdate(const v1::UpdateRowsRequest& request, const core::TableConfig& table,
                         const core::InputLimits& limits);

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COMMON_TENSOR_CODEC_H_
