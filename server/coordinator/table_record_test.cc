#include "server/coordinator/table_record.h"

#include "gtest/gtest.h"

namespace shardserve::server {
namespace {

TableRecord Record() {
  TableRecord table;
  table.spec.set_name("t");
  table.spec.set_generation(10);
  table.spec.set_created(10);
  table.spec.set_version(1);
  return table;
}

TEST(TableRecord, AReplicaHoldsTheSpecByItsOwnGenerationIfItHasOne) {
  TableRecord table = Record();
  EXPECT_EQ(table.SpecOn(0).generation(), 10u);
  table.replicas[1].generation = 12;
  EXPECT_EQ(table.SpecOn(0).generation(), 10u);
  EXPECT_EQ(table.SpecOn(1).generation(), 12u);
  EXPECT_EQ(table.SpecOn(1).version(), 1u);
  table.replicas[0].stale = StaleMark{10, 1};  // a record without a generation of its own
  EXPECT_EQ(table.SpecOn(0).generation(), 10u);
}

TEST(TableRecord, AReplicaSwappedByALoadOneAtATimeHoldsTheNewVersion) {
  TableRecord table = Record();
  table.replicas[0].generation = 12;
  VersionLoad& load = table.loading.emplace();
  load.spec = table.spec;
  load.spec.set_version(2);
  load.spec.set_generation(20);
  load.order = {1, 0};
  load.swapped = 1;
  // Beside the serving version: every replica holds the serving one until the switch.
  EXPECT_EQ(table.SpecOn(1).version(), 1u);
  load.mode = v1::SWAP_MODE_ONE_REPLICA_AT_A_TIME;
  EXPECT_EQ(table.SpecOn(1).generation(), 20u);
  EXPECT_EQ(table.SpecOn(0).generation(), 12u);  // not swapped yet
  load.swapped = 2;
  EXPECT_EQ(table.SpecOn(0).generation(), 20u);
}

TEST(TableRecord, AStaleMarkCountsOnlyInItsCreationAndVersion) {
  TableRecord table = Record();
  EXPECT_FALSE(table.StaleOn(1));
  table.replicas[1].stale = StaleMark{10, 1};
  EXPECT_TRUE(table.StaleOn(1));
  EXPECT_FALSE(table.StaleOn(0));
  table.spec.set_version(2);  // switched to another version since
  EXPECT_FALSE(table.StaleOn(1));
  table.spec.set_version(1);
  table.spec.set_created(11);  // created anew since
  EXPECT_FALSE(table.StaleOn(1));
}

}  // namespace
}  // namespace shardserve::server
