// Status propagation macros. Abseil 20220623 ships none, so they are defined here, once.
//
//   SHARDSERVE_RETURN_IF_ERROR(expr);        // returns expr's status when it is not OK
//   SHARDSERVE_ASSIGN_OR_RETURN(lhs, expr);  // lhs = *expr, or returns expr's status if not OK
#ifndef SHARDSERVE_CORE_BASE_STATUS_MACROS_H_
#define SHARDSERVE_CORE_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SHARDSERVE_CONCAT_INNER_(a, b) a##b
#define SHARDSERVE_CONCAT_(a, b) SHARDSERVE_CONCAT_INNER_(a, b)

#define SHARDSERVE_RETURN_IF_ERROR(expr)                     \
  do {                                                       \
    const ::absl::Status shardserve_status_ = (expr);        \
    if (!shardserve_status_.ok()) return shardserve_status_; \
  } while (false)

#define SHARDSERVE_ASSIGN_OR_RETURN(lhs, expr) \
  SHARDSERVE_ASSIGN_OR_RETURN_IMPL_(SHARDSERVE_CONCAT_(shardserve_statusor_, __LINE__), lhs, expr)

#define SHARDSERVE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                      \
  if (!statusor.ok()) return std::move(statusor).status();     \
  lhs = std::move(statusor).value()

#endif  // SHARDSERVE_CORE_BASE_STATUS_MACROS_H_
