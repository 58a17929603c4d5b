// Responder and ResponseSink: how a StepLoop's answers leave it. The serving process gives each
// request a Responder (StepRequest::responder) that knows its caller - a unary call, a stream
// request by its id, a thread waiting for an update - and implements the ResponseSink that sends
// a round's answers together. Core knows neither gRPC nor the callers: it answers each request
// through its responder, then flushes.
#ifndef SHARDSERVE_CORE_STEP_RESPONDER_H_
#define SHARDSERVE_CORE_STEP_RESPONDER_H_

#include "absl/status/statusor.h"
#include "core/ops/op_inputs.h"
#include "core/step/step_request.h"

namespace shardserve::core {

// Who a request answers. Not owned by the request or the step loop: whoever submits a request
// owns its responder and keeps it alive until Answer returns (or Submit refused the request).
// The StepLoop calls Answer exactly once for every request it accepted - on its own thread, on
// BreakGroup's or on Stop's - so a responder made for one request may delete itself in Answer.
class Responder {
 public:
  virtual ~Responder() = default;
  // The answer to `request`: must not block. `request` is destroyed once Answer returns; what
  // the responder keeps of it, it copies (or, for `answer`, moves). An answer may go out at once
  // or wait for the next ResponseSink::Flush.
  virtual void Answer(const StepRequest& request, absl::StatusOr<DenseResult> answer) = 0;
};

// Where a StepLoop's answers go out together. Flush: the answers given so far (through the
// requests' responders) may go out now - after every round, and before the loop waits on its
// peers - so that a round's answers cost the serving side one wake-up. Called from the loop's
// thread, BreakGroup's or Stop's; must not block.
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  virtual void Flush() = 0;
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_RESPONDER_H_
