// UpdateSequencer: the coordinator's side of a replicated table's updates (ControlPlane,
// "Updates of replicated tables"). An UpdateRows for a table on several replica groups is checked
// here, given its place in the table's update stream, sent to one worker of every replica that
// holds the stream so far (WorkerInternal.ApplyUpdate; each group applies the stream in order)
// and answered once every one of them has applied it durably - or once those that failed it are
// marked stale and their ranks have heard so (they no longer serve the table: no lookup on them
// misses the update), or are dead. A thread of its own runs the shard recoveries that bring stale
// replicas back (WorkerInternal.RecoverShard on every rank of the replica, each copying the same
// rank of a replica that is not stale).
//
// Its time is the control plane's clock (ControlPlane::clock): the updates' deadlines and the wait
// for stale replicas to hear run on it (a fake one in tests); the workers' calls get the time left
// as a real deadline.
//
// Thread-safe. `control` must outlive it.
#ifndef SHARDSERVE_SERVER_COORDINATOR_UPDATE_SEQUENCER_H_
#define SHARDSERVE_SERVER_COORDINATOR_UPDATE_SEQUENCER_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "proto/internal.grpc.pb.h"
#include "rpc/security.h"
#include "server/coordinator/clock.h"
#include "server/coordinator/control_plane.h"

namespace shardserve::server {

class UpdateSequencer {
 public:
  using Done = std::function<void(const grpc::Status& status, grpc::ByteBuffer response)>;

  UpdateSequencer(ControlPlane& control, rpc::ChannelSecurity security);
  // Stops recovering (a recovery under way ends first) once every update under way is answered
  // (each by its deadline: ControlPlane::Shutdown first ends those that wait for their place).
  ~UpdateSequencer();

  // Applies the UpdateRowsRequest `request` to every replica of its table, whose spec (as the
  // caller read it, to tell that it is replicated) is `spec`; `done` runs once, on
  // a gRPC thread or one of the sequencer's. Returns at once: the update is checked and waits for
  // its place (ControlPlane::StartUpdate, until `deadline` at most) on the sequencer's threads,
  // never on gRPC's (whose few callback threads also carry the workers' heartbeats).
  // `done` gets OK with the answer of a replica that applied it (the replicas that failed it are
  // stale, and have heard so: see the top); else INVALID_ARGUMENT (a malformed update), the
  // control plane's StartUpdate / FinishUpdate errors (UNAVAILABLE while the update waited for its
  // place until `deadline`, or when the coordinator stops; the replicas' error when none applied
  // it) or DEADLINE_EXCEEDED (applied, but a stale replica had not heard by `deadline`).
  void Update(const grpc::ByteBuffer& request, v1::TableSpec spec, absl::Time deadline,
              Done done);

 private:
  struct Call;
  // Update's work, on a sequencer thread.
  void Start(const grpc::ByteBuffer& request, const v1::TableSpec& spec, absl::Time deadline,
             Done done);
  void Serve();  // a sequencer thread: runs queued updates' Start
  void Answer(Call& call);  // with the first replica's answer (some replica applied it)
  // `deadline` (on the clock) as a real time, for gRPC: the same outside tests.
  absl::Time RealTime(absl::Time deadline) const;
  // Answers once the replicas the call marked stale have heard it, or its deadline came.
  void AnswerOnceTold(Call& call, const std::vector<ControlPlane::StaleNotice>& notices);
  // A worker's stubs, on one channel: made at its first use, kept (as its address) for good.
  struct Stubs {
    std::unique_ptr<v1::internal::WorkerInternal::Stub> typed;
    std::unique_ptr<grpc::GenericStub> generic;
  };
  Stubs& StubsFor(const std::string& address);
  void RecoveryLoop();
  // Runs `plan`: every rank of the replica copies its shard (in parallel).
  void Recover(const RecoveryPlan& plan);

  ControlPlane& control_;
  Clock& clock_;  // the control plane's
  const rpc::ChannelSecurity security_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::unique_ptr<Stubs>> stubs_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);  // updates to Start
  int calls_ ABSL_GUARDED_BY(mu_) = 0;  // Calls under way (started, not all gone yet)
  std::vector<std::thread> threads_;
  std::thread recovery_;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_UPDATE_SEQUENCER_H_
