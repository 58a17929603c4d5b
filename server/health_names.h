// The services every shardserve server reports in grpc.health.v1: the server as a whole (""),
// its data API, and each table it serves.
#ifndef SHARDSERVE_SERVER_HEALTH_NAMES_H_
#define SHARDSERVE_SERVER_HEALTH_NAMES_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardserve::server {

inline constexpr char kServerHealthName[] = "";
inline constexpr char kDataServiceHealthName[] = "shardserve.v1.DataService";

// "shardserve.v1.table/NAME".
inline std::string TableHealthName(absl::string_view table) {
  return absl::StrCat("shardserve.v1.table/", table);
}

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_HEALTH_NAMES_H_
