#include "core/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/base/status_macros.h"

namespace shardserve::core {
namespace {

ncclDataType_t NcclType(DataType type) {
  switch (type) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kInt64:
      return ncclInt64;
  }
  return ncclFloat32;
}

int DeviceType(DataType type) {
  return type == DataType::kFloat32 ? 0 : type == DataType::kFloat64 ? 1 : 2;
}

ncclComm_t C(void* comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

// ncclSuccess, or ncclInProgress from a non-blocking communicator (Finish waits for it).
bool Enqueued(ncclResult_t result) { return result == ncclSuccess || result == ncclInProgress; }

std::vector<int64_t> Offsets(absl::Span<const int64_t> counts) {
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t q = 1; q < counts.size(); ++q) offsets[q] = offsets[q - 1] + counts[q - 1];
  return offsets;
}

}  // namespace

NcclCommunicator::NcclCommunicator(void* comm, void* stream, int rank, int world_size,
                                   int device_index)
    : comm_(comm), stream_(stream), rank_(rank), world_size_(world_size),
      device_index_(device_index) {}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    RendezvousStore& store, const std::string& key_prefix, int rank, int world_size,
    int device_index, absl::Duration timeout) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: rank ", rank, " is out of range [0, ", world_size, ")"));
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || device_index < 0 || device_index >= devices) {
    return absl::UnavailableError(absl::StrCat("nccl: cuda:", device_index, " is not available (",
                                               devices, " GPUs visible)"));
  }
  if (cudaSetDevice(device_index) != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("nccl: cannot use cuda:", device_index));
  }
  const std::string key = key_prefix + "/nccl-unique-id";
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclGetUniqueId(&id) != ncclSuccess) return absl::UnavailableError("nccl: no unique id");
    SHARDSERVE_RETURN_IF_ERROR(store.Set(key, absl::string_view(id.internal, sizeof(id.internal))));
  } else {
    absl::StatusOr<std::string> value = store.Get(key, timeout);
    if (!value.ok()) {
      return absl::UnavailableError(
          absl::StrCat("nccl: rank ", rank, ": ", value.status().message()));
    }
    if (value->size() != sizeof(id.internal)) return absl::InternalError("nccl: bad unique id");
    std::memcpy(id.internal, value->data(), sizeof(id.internal));
  }
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    return absl::UnavailableError("nccl: cannot create a stream");
  }
  // Non-blocking init: a peer that never arrives times out here instead of hanging.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t result = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
  const absl::Time deadline = absl::Now() + timeout;
  while (result == ncclInProgress || result == ncclSuccess) {
    ncclResult_t state = ncclInProgress;
    if (comm != nullptr) ncclCommGetAsyncError(comm, &state);
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      result = state;
      break;
    }
    if (absl::Now() > deadline) {
      if (comm != nullptr) ncclCommAbort(comm);
      cudaStreamDestroy(stream);
      return absl::UnavailableError(absl::StrCat("nccl: rank ", rank, " of ", world_size,
                                                 " could not join group \"", key_prefix,
                                                 "\" within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Microseconds(100));
  }
  if (result != ncclSuccess && result != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    return absl::UnavailableError(absl::StrCat("nccl: init failed: ", ncclGetErrorString(result)));
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, stream, rank, world_size, device_index));
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) ncclCommAbort(C(comm_));  // never blocks on a stuck peer
  if (stream_ != nullptr) cudaStreamDestroy(S(stream_));
}

absl::Status NcclCommunicator::Refuse(const char* what) const {
  return absl::UnavailableError(absl::StrCat("nccl: rank ", rank_, ": ", what,
                                             " refused, group is broken: ", broken_reason_));
}

absl::Status NcclCommunicator::Fail(const std::string& failure) {
  Abort().IgnoreError();
  broken_reason_ = failure;
  return absl::UnavailableError(
      absl::StrCat("nccl: rank ", rank_, " of ", world_size_, ": ", failure));
}

absl::Status NcclCommunicator::Finish(const char* what, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(C(comm_), &state);
    const cudaError_t done = cudaStreamQuery(S(stream_));
    if (done == cudaErrorNotReady)
      (void)cudaGetLastError();  // not an error: do not leave it latched
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(absl::StrCat(what, " failed: ", ncclGetErrorString(state)));
    }
    if (done == cudaSuccess && state == ncclSuccess) return absl::OkStatus();
    if (done != cudaSuccess && done != cudaErrorNotReady) {
      return Fail(absl::StrCat(what, " failed: ", cudaGetErrorString(done)));
    }
    if (absl::Now() > deadline) {
      return Fail(absl::StrCat(what, " timed out after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

absl::Status NcclCommunicator::SendRecv(const char* what, const std::vector<const void*>& send,
                                        absl::Span<const int64_t> send_counts, char* out,
                                        absl::Span<const int64_t> recv_counts, DataType type,
                                        absl::Duration timeout) {
  const size_t world = static_cast<size_t>(world_size_);
  if (send.size() != world || send_counts.size() != world || recv_counts.size() != world) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: ", what, ": expected one count per rank (", world_size_, ")"));
  }
  if (send_counts[rank_] > recv_counts[rank_]) {  // the own block would overrun its place
    return absl::InvalidArgumentError(absl::StrCat("nccl: ", what, ": own block of ",
                                                   send_counts[rank_], " elements, room for ",
                                                   recv_counts[rank_]));
  }
  const size_t elem = SizeOf(type);
  const std::vector<int64_t> recv_off = Offsets(recv_counts);
  if (send_counts[rank_] > 0) {
    const cudaError_t copied =
        cudaMemcpyAsync(out + recv_off[rank_] * elem, send[rank_], send_counts[rank_] * elem,
                        cudaMemcpyDeviceToDevice, S(stream_));
    if (copied != cudaSuccess) {
      return Fail(absl::StrCat(what, ": own block: ", cudaGetErrorString(copied)));
    }
  }
  ncclResult_t result = ncclGroupStart();
  for (int q = 0; q < world_size_ && Enqueued(result); ++q) {
    if (q == rank_) continue;
    if (send_counts[q] > 0) {
      result = ncclSend(send[q], send_counts[q], NcclType(type), q, C(comm_), S(stream_));
    }
    if (Enqueued(result) && recv_counts[q] > 0) {
      result = ncclRecv(out + recv_off[q] * elem, recv_counts[q], NcclType(type), q, C(comm_),
                        S(stream_));
    }
  }
  const ncclResult_t ended = ncclGroupEnd();
  if (!Enqueued(result) || !Enqueued(ended)) {
    return Fail(absl::StrCat(what, " failed: ",
                             ncclGetErrorString(Enqueued(result) ? ended : result)));
  }
  return Finish(what, timeout);
}

absl::Status NcclCommunicator::AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                                         absl::Duration timeout) {
  if (broken_) return Refuse("all-reduce");
  const ncclResult_t result =
      ncclAllReduce(data, data, count, NcclType(type), op == ReduceOp::kSum ? ncclSum : ncclMax,
                    C(comm_), S(stream_));
  if (!Enqueued(result)) {
    return Fail(absl::StrCat("all-reduce failed: ", ncclGetErrorString(result)));
  }
  return Finish("all-reduce", timeout);
}

// Sends are recorded; Wait() issues them with the receives as one NCCL group.
class NcclCommunicator::Exchange : public PendingExchange {
 public:
  Exchange(NcclCommunicator& comm, char* out, std::vector<int64_t> recv_counts, DataType type,
           absl::Duration timeout)
      : comm_(comm), out_(out), recv_counts_(std::move(recv_counts)), type_(type),
        timeout_(timeout), send_(recv_counts_.size(), nullptr),
        send_counts_(recv_counts_.size(), 0) {}

  absl::Status Send(int peer, const void* data, int64_t count) override {
    if (peer < 0 || peer >= comm_.world_size_) return absl::InternalError("nccl: bad peer");
    send_[peer] = data;
    send_counts_[peer] = count;
    return absl::OkStatus();
  }

  absl::Status Wait() override {
    if (comm_.broken_) return comm_.Refuse("all-to-all");
    return comm_.SendRecv("all-to-all", send_, send_counts_, out_, recv_counts_, type_, timeout_);
  }

 private:
  NcclCommunicator& comm_;
  char* out_;
  std::vector<int64_t> recv_counts_;
  DataType type_;
  absl::Duration timeout_;
  std::vector<const void*> send_;  // per peer, as given to Send
  std::vector<int64_t> send_counts_;
};

absl::StatusOr<std::unique_ptr<PendingExchange>> NcclCommunicator::StartAllToAllV(
    void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t>, DataType type,
    absl::Duration timeout) {
  if (broken_) return Refuse("all-to-all");
  return std::make_unique<Exchange>(*this, static_cast<char*>(out),
                                    std::vector<int64_t>(recv_counts.begin(), recv_counts.end()),
                                    type, timeout);
}

absl::Status NcclCommunicator::Health() const {
  if (!broken_) return absl::OkStatus();
  return Refuse("collectives");
}

absl::Status NcclCommunicator::Abort() {
  if (!broken_) {
    broken_ = true;
    broken_reason_ = "aborted";
  }
  if (comm_ != nullptr) {
    ncclCommAbort(C(comm_));
    comm_ = nullptr;
  }
  return absl::OkStatus();
}

}  // namespace shardserve::core

