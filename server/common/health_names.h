// The services every shardserve server reports in grpc.health.v1: the server as a whole (""),
// its data API, and each table it serves.
#ifndef SHARDSERVE_SERVER_COMMON_HEALTH_NAMES_H_
#define SHARDSERVE_SERVER_COMMON_HEALTH_NAMES_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardserve::server {

inline constexpr char kServerHealthName[] = "";
inline constexpr char kDataServiceHealthName[] = "shardserve.v1.DataService";

// "shardserve.v1.table/NAME": SERVING while any replica of the table serves.
inline std::string TableHealthName(absl::string_view table) {
  return absl::StrCat("shardserve.v1.table/", table);
}
// "shardserve.v1.table/NAME/group/G": the replica of the table on group G (coordinator only;
// table names cannot hold '/').
inline std::string ReplicaHealthName(absl::string_view table, int group) {
  return absl::StrCat("shardserve.v1.table/", table, "/group/", group);
}
// "shardserve.v1.group/G": group G is formed and serving (coordinator only).
inline std::string GroupHealthName(int group) {
  return absl::StrCat("shardserve.v1.group/", group);
}

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COMMON_HEALTH_NAMES_H_
