#include "core/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/cuda_kernels_device.h"
#include "core/status_macros.h"

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
    RETURN_IF_ERROR(store.Set(key, absl::string_view(id.internal, sizeof(id.internal))));
  } else {
    absl::StatusOr<std::string> value = store.Get(key, timeout);
    if (!value.ok()) {
      return absl::UnavailableError(absl::StrCat("nccl: rank ", rank, ": ", value.status().message()));
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
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (stream_ != nullptr) cudaStreamDestroy(S(stream_));
}

absl::Status NcclCommunicator::Refuse(const char* what) const {
  return absl::UnavailableError(absl::StrCat("nccl: rank ", rank_, ": ", what,
                                             " refused, group is broken: ", broken_reason_));
}

absl::Status NcclCommunicator::Finish(const char* what, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(C(comm_), &state);
    const cudaError_t done = cudaStreamQuery(S(stream_));
    std::string failure;
    if (state != ncclSuccess && state != ncclInProgress) {
      failure = absl::StrCat(what, " failed: ", ncclGetErrorString(state));
    } else if (done == cudaSuccess && state == ncclSuccess) {
      return absl::OkStatus();
    } else if (done != cudaSuccess && done != cudaErrorNotReady) {
      failure = absl::StrCat(what, " failed: ", cudaGetErrorString(done));
    } else if (absl::Now() > deadline) {
      failure = absl::StrCat(what, " timed out after ", absl::FormatDuration(timeout));
    }
    if (!failure.empty()) {
      Abort().IgnoreError();
      broken_reason_ = failure;
      return absl::UnavailableError(
          absl::StrCat("nccl: rank ", rank_, " of ", world_size_, ": ", failure));
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

absl::Status NcclCommunicator::AllGatherV(const void* in, void* out,
                                          absl::Span<const int64_t> counts, DataType type,
                                          absl::Duration timeout) {
  if (broken_) return Refuse("all-gather");
  // Every peer gets this rank's whole block: an all-to-all whose send blocks all start at `in`.
  const size_t elem = SizeOf(type);
  const std::vector<int64_t> recv_off = Offsets(counts);
  char* dst = static_cast<char*>(out);
  ncclGroupStart();
  for (int q = 0; q < world_size_; ++q) {
    if (q == rank_) continue;
    if (counts[rank_] > 0) ncclSend(in, counts[rank_], NcclType(type), q, C(comm_), S(stream_));
    if (counts[q] > 0) {
      ncclRecv(dst + recv_off[q] * elem, counts[q], NcclType(type), q, C(comm_), S(stream_));
    }
  }
  ncclGroupEnd();
  if (counts[rank_] > 0) {
    cudaMemcpyAsync(dst + recv_off[rank_] * elem, in, counts[rank_] * elem,
                    cudaMemcpyDeviceToDevice, S(stream_));
  }
  return Finish("all-gather", timeout);
}

absl::Status NcclCommunicator::AllToAllV(const void* in, absl::Span<const int64_t> send_counts,
                                         void* out, absl::Span<const int64_t> recv_counts,
                                         DataType type, absl::Duration timeout) {
  if (broken_) return Refuse("all-to-all");
  const size_t elem = SizeOf(type);
  const std::vector<int64_t> send_off = Offsets(send_counts), recv_off = Offsets(recv_counts);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  ncclGroupStart();
  for (int q = 0; q < world_size_; ++q) {
    if (q == rank_) continue;
    if (send_counts[q] > 0) {
      ncclSend(src + send_off[q] * elem, send_counts[q], NcclType(type), q, C(comm_), S(stream_));
    }
    if (recv_counts[q] > 0) {
      ncclRecv(dst + recv_off[q] * elem, recv_counts[q], NcclType(type), q, C(comm_), S(stream_));
    }
  }
  ncclGroupEnd();
  if (recv_counts[rank_] > 0) {
    cudaMemcpyAsync(dst + recv_off[rank_] * elem, src + send_off[rank_] * elem,
                    recv_counts[rank_] * elem, cudaMemcpyDeviceToDevice, S(stream_));
  }
  return Finish("all-to-all", timeout);
}

absl::Status NcclCommunicator::AllReduce(void* data, int64_t count, DataType type, ReduceOp op,
                                         absl::Duration timeout) {
  if (broken_) return Refuse("all-reduce");
  ncclAllReduce(data, data, count, NcclType(type), op == ReduceOp::kSum ? ncclSum : ncclMax,
                C(comm_), S(stream_));
  return Finish("all-reduce", timeout);
}

absl::Status NcclCommunicator::ReduceScatter(const void* in, absl::Span<const int64_t> counts,
                                             void* out, DataType type, ReduceOp op,
                                             absl::Duration timeout) {
  if (broken_) return Refuse("reduce-scatter");
  const int64_t mine = counts[rank_];
  const size_t elem = SizeOf(type);
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == mine; })) {
    ncclReduceScatter(in, out, mine, NcclType(type), op == ReduceOp::kSum ? ncclSum : ncclMax,
                      C(comm_), S(stream_));
    return Finish("reduce-scatter", timeout);
  }
  // Ragged blocks: every rank's block q to rank q, then reduce the W received blocks here.
  const int64_t bytes = mine * world_size_ * static_cast<int64_t>(elem);
  if (scratch_bytes_ < bytes) {
    if (scratch_ != nullptr) cudaFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    if (cudaMalloc(&scratch_, bytes) != cudaSuccess) {
      return absl::ResourceExhaustedError("nccl: no device memory for reduce-scatter");
    }
    scratch_bytes_ = bytes;
  }
  RETURN_IF_ERROR(AllToAllV(in, counts, scratch_, std::vector<int64_t>(world_size_, mine), type,
                            timeout));
  if (mine == 0) return absl::OkStatus();
  cudaMemcpyAsync(out, scratch_, mine * elem, cudaMemcpyDeviceToDevice, S(stream_));
  for (int q = 1; q < world_size_; ++q) {
    cuda::LaunchAccumulate(out, static_cast<char*>(scratch_) + q * mine * elem, mine,
                           DeviceType(type), op == ReduceOp::kSum ? 0 : 1, stream_);
  }
  return Finish("reduce-scatter", timeout);
}

absl::Status NcclCommunicator::Barrier(absl::Duration timeout) {
  if (broken_) return Refuse("barrier");
  if (scratch_bytes_ < 8) {
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (cudaMalloc(&scratch_, 8) != cudaSuccess) return absl::ResourceExhaustedError("nccl: barrier");
    scratch_bytes_ = 8;
  }
  return AllReduce(scratch_, 1, DataType::kFloat32, ReduceOp::kSum, timeout);
}

absl::StatusOr<std::vector<absl::Span<const char>>> NcclCommunicator::AllGatherMessages(
    absl::Span<const char>, absl::Duration) {
  return absl::UnimplementedError(
      "nccl: message all-gather carries host data; use the worker's host (Gloo) communicator");
}

// Sends are recorded; Wait() issues them with the receives as one NCCL group.
class NcclCommunicator::Exchange : public PendingExchange {
 public:
  Exchange(NcclCommunicator& comm, char* out, std::vector<int64_t> recv_counts, DataType type,
           absl::Duration timeout)
      : comm_(comm), out_(out), recv_counts_(std::move(recv_counts)), type_(type),
        timeout_(timeout), sends_(recv_counts_.size(), {nullptr, 0}) {}

  absl::Status Send(int peer, const void* data, int64_t count) override {
    if (peer < 0 || peer >= comm_.world_size_) return absl::InternalError("nccl: bad peer");
    sends_[peer] = {data, count};
    return absl::OkStatus();
  }

  absl::Status Wait() override {
    if (comm_.broken_) return comm_.Refuse("all-to-all");
    const size_t elem = SizeOf(type_);
    const std::vector<int64_t> recv_off = Offsets(recv_counts_);
    ncclGroupStart();
    for (int q = 0; q < comm_.world_size_; ++q) {
      if (q == comm_.rank_) continue;
      if (sends_[q].second > 0) {
        ncclSend(sends_[q].first, sends_[q].second, NcclType(type_), q, C(comm_.comm_),
                 S(comm_.stream_));
      }
      if (recv_counts_[q] > 0) {
        ncclRecv(out_ + recv_off[q] * elem, recv_counts_[q], NcclType(type_), q, C(comm_.comm_),
                 S(comm_.stream_));
      }
    }
    ncclGroupEnd();
    if (sends_[comm_.rank_].second > 0) {
      cudaMemcpyAsync(out_ + recv_off[comm_.rank_] * elem, sends_[comm_.rank_].first,
                      sends_[comm_.rank_].second * elem, cudaMemcpyDeviceToDevice,
                      S(comm_.stream_));
    }
    return comm_.Finish("all-to-all", timeout_);
  }

 private:
  NcclCommunicator& comm_;
  char* out_;
  std::vector<int64_t> recv_counts_;
  DataType type_;
  absl::Duration timeout_;
  std::vector<std::pair<const void*, int64_t>> sends_;
};

absl::StatusOr<std::unique_ptr<PendingExchange>> NcclCommunicator::StartAllToAllV(
    void* out, absl::Span<const int64_t> recv_counts, absl::Span<const int64_t>, DataType type,
    absl::Duration timeout) {
  if (broken_) return Refuse("all-to-all");
  return std::make_unique<Exchange>(*this, static_cast<char*>(out),
                                    std::vector<int64_t>(recv_counts.begin(), recv_counts.end()),
                                    type, timeout);
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
