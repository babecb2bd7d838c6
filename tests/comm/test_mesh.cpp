// DeviceMesh: degrees from torchtitan's keys (dp_shard = -1 inferred, bad products
// refused), coordinates with tp fastest, and sub-communicators that group the right
// ranks.
#include <doctest/doctest.h>

#include <mutex>
#include <set>
#include <vector>

#include "../support/errors.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/comm/thread.hpp"

namespace test_mesh {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::comm;

TEST_CASE("mesh_shape: data_parallel_shard_degree -1 takes the ranks left over") {
  MeshShape s = mesh_shape(8, 2, -1, 2, 1);
  CHECK(s.dp_shard == 2);
  CHECK(s.world() == 8);
  CHECK(mesh_shape(8, 1, -1, 1, 1).dp_shard == 8);
  CHECK(mesh_shape(1, 1, -1, 1, 1).dp_shard == 1);
}

TEST_CASE("mesh_shape: degrees whose product is not the world size are refused, naming the keys") {
  CHECK_ERROR_CONTAINS(mesh_shape(8, 1, 3, 1, 1),
                       "data_parallel_shard_degree 3 x tensor_parallel_degree 1 x pipeline_parallel_degree 1 = 3, "
                       "but the world has 8 ranks");
  CHECK_ERROR_CONTAINS(mesh_shape(6, 4, -1, 1, 1), "does not divide the world size 6");
  CHECK_ERROR_CONTAINS(mesh_shape(4, 0, -1, 1, 1), "parallelism.data_parallel_replicate_degree = 0");
  CHECK_ERROR_CONTAINS(mesh_shape(4, 1, -2, 1, 1), "parallelism.data_parallel_shard_degree = -2");
}

TEST_CASE("DeviceMesh: coordinates with tp fastest and communicators per dimension") {
  const MeshShape shape{2, 2, 2, 2};  // pp, dp_replicate, dp_shard, tp
  std::mutex m;
  std::set<std::vector<int>> coords;
  run_thread_ranks(16, [&](Communicator& world) {
    DeviceMesh mesh(world, shape);
    const int r = world.rank();
    CHECK(mesh.tp_rank() == r % 2);
    CHECK(mesh.dp_shard_rank() == (r / 2) % 2);
    CHECK(mesh.dp_replicate_rank() == (r / 4) % 2);
    CHECK(mesh.pp_rank() == r / 8);
    CHECK(mesh.tp().rank() == mesh.tp_rank());
    CHECK(mesh.dp_shard().rank() == mesh.dp_shard_rank());
    CHECK(mesh.pp().rank() == mesh.pp_rank());
    CHECK(mesh.dp().size() == 4);
    CHECK(mesh.dp().rank() == mesh.dp_rank());
    // The members of each group differ from this rank in that coordinate only.
    auto members = [&](Communicator& c) {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(c.size()));
      std::int32_t me = r;
      c.all_gather(std::span<const std::int32_t>(&me, 1), std::span<std::int32_t>(ids));
      return ids;
    };
    CHECK(members(mesh.tp()) == std::vector<std::int32_t>{r - r % 2, r - r % 2 + 1});
    const int s0 = r - ((r / 2) % 2) * 2;
    CHECK(members(mesh.dp_shard()) == std::vector<std::int32_t>{s0, s0 + 2});
    const int p0 = r % 8;
    CHECK(members(mesh.pp()) == std::vector<std::int32_t>{p0, p0 + 8});
    std::lock_guard lock(m);
    coords.insert({mesh.pp_rank(), mesh.dp_replicate_rank(), mesh.dp_shard_rank(), mesh.tp_rank()});
  });
  CHECK(coords.size() == 16);
}

TEST_CASE("DeviceMesh: each communicator knows its name and its members' world ranks") {
  const MeshShape shape{2, 2, 2, 1, 2};  // pp, dp_replicate, dp_shard, tp, cp: 16 ranks
  run_thread_ranks(16, [&](Communicator& world) {
    DeviceMesh mesh(world, shape);
    CHECK(world.group().name == "world");
    CHECK(world.group().world_ranks.size() == 16);
    const std::int32_t me = world.rank();
    auto check = [&](Communicator& c, const char* name) {
      INFO(name << " of rank " << me);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(c.size()));
      c.all_gather(std::span<const std::int32_t>(&me, 1), std::span<std::int32_t>(ids));
      CHECK(c.group().name == name);
      CHECK(std::vector<std::int32_t>(c.group().world_ranks.begin(), c.group().world_ranks.end()) == ids);
    };
    check(mesh.tp(), "tp");
    check(mesh.cp(), "cp");
    check(mesh.dp_shard(), "dp_shard");
    check(mesh.dp_replicate(), "dp_replicate");
    check(mesh.pp(), "pp");
    check(mesh.dp(), "dp");
    check(mesh.dp_shard_cp(), "dp_shard_cp");
    check(mesh.dp_cp(), "dp_cp");
    // A split of a split composes (a pipeline's pair of dp_cp ranks).
    Communicator half = mesh.dp_cp().split_strided(2, 2);
    std::vector<std::int32_t> ids(2);
    half.all_gather(std::span<const std::int32_t>(&me, 1), std::span<std::int32_t>(ids));
    CHECK(std::vector<std::int32_t>(half.group().world_ranks.begin(), half.group().world_ranks.end()) == ids);
    // A split by color cannot know its members.
    CHECK(world.split(me % 2, me).group().world_ranks.empty());
  });
}

TEST_CASE("DeviceMesh: a shape that does not match the world is refused") {
  CHECK_ERROR_CONTAINS(run_thread_ranks(2, [&](Communicator& world) { DeviceMesh mesh(world, MeshShape{1, 1, 4, 1}); }),
                       "needs 4 ranks, the world has 2");
}

}  // namespace test_mesh
