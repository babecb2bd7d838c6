// The flight recorder: each collective a rank issues, numbered on its group, with the
// layer that issued it and whether the rank's wait returned; the ring of the last N; the
// file a failed run leaves; and thread ranks one of which stops calling collectives.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "tessera/comm/flight_recorder.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/core/profile.hpp"

namespace test_flight_recorder {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::comm;

TEST_CASE("flight recorder: each collective numbered on its group, its context, and its wait") {
  std::mutex m;
  std::vector<std::vector<FlightRecord>> kept(4);
  run_thread_ranks(4, [&](Communicator& world) {
    auto recorder = std::make_shared<FlightRecorder>(100, world.rank(), world.size());
    world.record_flights(recorder);
    DeviceMesh mesh(world, MeshShape{1, 1, 2, 2});  // dp_shard 2 x tp 2: splits inherit the recorder
    std::vector<float> one(4, 1.0f), all(8);
    profile::Recorder spans;
    {
      const profile::Recording on(spans);
      const profile::Span step("step", "step 1");
      const profile::Span layer("layer", "layers.0 forward");
      mesh.tp().all_gather(std::span<const float>(one), std::span<float>(all));
      mesh.dp_shard().all_reduce(std::span<float>(one));
      mesh.tp().all_reduce(std::span<float>(one));
    }
    Handle pending = mesh.dp_shard().all_reduce_async(std::span<float>(one));
    {
      std::lock_guard lock(m);
      kept[static_cast<std::size_t>(world.rank())] = recorder->records();
    }
    pending.wait();
    world.barrier();  // a collective too: on the world, its first there
    const std::vector<FlightRecord> after = recorder->records();
    REQUIRE(after.size() == 5);
    CHECK(after[3].waited_us >= after[3].issued_us);
    CHECK(std::string(after[4].op) == "barrier");
    CHECK(after[4].group == "world");
    CHECK(after[4].seq == 1);
    CHECK(after[4].ranks == std::vector<int>{0, 1, 2, 3});
    CHECK(after[4].waited_us >= 0);
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const auto& k = kept[static_cast<std::size_t>(r)];
    REQUIRE(k.size() == 4);
    CHECK(k[0].group == "tp");
    CHECK(k[0].seq == 1);
    CHECK(std::string(k[0].op) == "all_gather");
    CHECK(k[0].bytes == 32);  // the gathered output
    CHECK(k[0].ranks == std::vector<int>{r - r % 2, r - r % 2 + 1});
    CHECK(k[0].group_rank == r % 2);
    CHECK(k[0].group_size == 2);
    CHECK(k[0].where == std::vector<std::string>{"step 1", "layers.0 forward"});  // not its own span
    CHECK(k[1].group == "dp_shard");
    CHECK(k[1].seq == 1);
    CHECK(k[1].ranks == std::vector<int>{r % 2, r % 2 + 2});
    CHECK(k[2].group == "tp");
    CHECK(k[2].seq == 2);
    CHECK(k[3].seq == 2);
    CHECK(k[3].where.empty());
    for (int i = 0; i < 3; ++i) CHECK(k[static_cast<std::size_t>(i)].waited_us >= k[static_cast<std::size_t>(i)].issued_us);
    CHECK(k[3].waited_us == -1);  // issued, not yet waited for
    for (std::size_t i = 0; i < k.size(); ++i) CHECK(k[i].id == i);
  }
}

TEST_CASE("flight recorder: the ring keeps the last N, and its file is the JSON the tools read") {
  FlightRecorder r(3, 5, 8);
  const GroupInfo g{"pp", {4, 5}};
  for (std::uint64_t s = 1; s <= 5; ++s) r.issued(g, s, "send_recv", 100 * s, 1, 2);
  r.waited(0);  // dropped by the ring: nothing
  r.waited(3);
  const std::vector<FlightRecord> k = r.records();
  REQUIRE(k.size() == 3);
  CHECK(k[0].seq == 3);
  CHECK(k[2].seq == 5);
  CHECK(k[1].waited_us >= 0);
  CHECK(k[0].waited_us == -1);
  CHECK(r.total() == 5);
  const auto dir = std::filesystem::temp_directory_path() / "tessera_flight_recorder_test";
  std::filesystem::remove_all(dir);
  CHECK(r.dump("no path set").empty());
  r.dump_to((dir / "comm_traces" / "rank5_trace.json").string());
  const std::string path = r.dump("rank 5: NCCL send_recv (collective #5 of 2 ranks) did not complete \"in time\"");
  REQUIRE(path == (dir / "comm_traces" / "rank5_trace.json").string());
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  CHECK(j.at("rank") == 5);
  CHECK(j.at("world_size") == 8);
  CHECK(j.at("recorded") == 5);
  CHECK(j.at("kept") == 3);
  CHECK(j.at("reason").get<std::string>().find("did not complete \"in time\"") != std::string::npos);
  const auto& cs = j.at("collectives");
  REQUIRE(cs.size() == 3);
  CHECK(cs[0].at("seq") == 3);
  CHECK(cs[0].at("group") == "pp");
  CHECK(cs[0].at("ranks") == nlohmann::json::array({4, 5}));
  CHECK(cs[0].at("waited_us").is_null());
  CHECK(cs[1].at("waited_us").is_number());
  CHECK(cs[2].at("bytes") == 500);
  CHECK(cs[2].at("op") == "send_recv");
  // dump_all writes every live recorder's file.
  std::filesystem::remove(path);
  FlightRecorder::dump_all("the watchdog");
  CHECK(std::filesystem::exists(path));
  std::filesystem::remove_all(dir);
}

TEST_CASE("flight recorder: a rank that stops calling collectives leaves the others' records waiting") {
  std::mutex m;
  std::vector<std::vector<FlightRecord>> kept(2);
  ThreadOptions options;
  options.timeout = std::chrono::milliseconds(300);
  CHECK_ERROR_CONTAINS(run_thread_ranks(
                           2,
                           [&](Communicator& world) {
                             auto recorder = std::make_shared<FlightRecorder>(10, world.rank(), 2);
                             world.record_flights(recorder);
                             float x = 1.0f;
                             try {
                               world.all_reduce(std::span<float>(&x, 1));
                               if (world.rank() == 0) world.all_reduce(std::span<float>(&x, 1));  // rank 1 never comes
                             } catch (...) {
                               std::lock_guard lock(m);
                               kept[static_cast<std::size_t>(world.rank())] = recorder->records();
                               throw;
                             }
                             std::lock_guard lock(m);
                             kept[static_cast<std::size_t>(world.rank())] = recorder->records();
                           },
                           options),
                       "all_reduce");
  REQUIRE(kept[0].size() == 2);
  CHECK(kept[0][1].seq == 2);
  CHECK(kept[0][1].waited_us == -1);
  REQUIRE(kept[1].size() == 1);
  CHECK(kept[1][0].waited_us >= 0);
}

}  // namespace test_flight_recorder
