#include "rpc/logging.h"

#include "glog/logging.h"

namespace shardserve::rpc {

void InitLogging(const char* argv0, int verbosity) {
  FLAGS_logtostderr = true;
  FLAGS_v = verbosity;
  // LibTorch may have set glog up already (its own logging goes through it).
  if (!google::IsGoogleLoggingInitialized()) google::InitGoogleLogging(argv0);
  google::InstallFailureSignalHandler();
}

}  // namespace shardserve::rpc
