// What one launch of a functor does, for the cost model (include/tessera/plan/).
//
// Every functor a backend launches (B::for_each(n, f)) says what its n indices read and
// write in the backend's memory, how many floating-point operations they make and how
// many transcendental calls (exp, log, sqrt, rsqrt, sin, cos, each counted once), in a
// host member `Traffic traffic(std::int64_t n) const` next to its arithmetic. The
// figures are those of the functor's own loop, the work any correct kernel must do: a
// value the functor reads twice (a row's two passes) counts twice only when the
// functor's loop reads it twice from memory and a kernel could not keep it on chip; each
// functor's comment says which. Reads of small tables reused by every index (a norm's
// weight, RoPE's tables) count once per launch. The dry run (backend/meta) records them
// with each launch; plan/cost.hpp prices them against a machine's bandwidth and rates.
#pragma once

#include <concepts>
#include <cstdint>

namespace tessera::ops {

struct Traffic {
  double bytes_read = 0;
  double bytes_written = 0;
  double flops = 0;            // additions, multiplications, comparisons, divisions
  double transcendentals = 0;  // exp, log, sqrt, rsqrt, sin, cos calls
  /// Of the bytes read and written, those an index reaches by walking a run of
  /// consecutive elements alone (a row, a chunk) while the next index walks a run of its
  /// own elsewhere; 0 when neighbouring indices touch neighbouring elements. A kernel
  /// that runs one index per thread (cuda::for_each) coalesces the second kind of access
  /// and not the first.
  double walk_bytes = 0;

  double bytes() const { return bytes_read + bytes_written; }
  Traffic& operator+=(const Traffic& o) {
    bytes_read += o.bytes_read;
    bytes_written += o.bytes_written;
    flops += o.flops;
    transcendentals += o.transcendentals;
    walk_bytes += o.walk_bytes;
    return *this;
  }
  friend Traffic operator*(Traffic t, double k) {
    t.bytes_read *= k;
    t.bytes_written *= k;
    t.flops *= k;
    t.transcendentals *= k;
    t.walk_bytes *= k;
    return t;
  }
};

/// Whether F says what a launch of it does.
template <class F>
concept HasTraffic = requires(const F& f, std::int64_t n) {
  { f.traffic(n) } -> std::same_as<Traffic>;
};

/// A functor whose CUDA kernel moves other bytes than its operator() does over the same
/// indices (a row the kernel holds on chip between passes): cuda_traffic(n) is the
/// kernel's, which the GPU cost model prices (plan/cost.hpp); traffic(n) stays the
/// functor's, which the CPU's does.
template <class F>
concept HasCudaTraffic = requires(const F& f, std::int64_t n) {
  { f.cuda_traffic(n) } -> std::same_as<Traffic>;
};

/// A functor that runs other functors' passes in one launch (F::kFusesParts, and
/// f.parts(n, visit) calling visit(part, part's n, the CUDA kernel's traffic put on that
/// part, whether the part is a launch of its own on the GPU) for each, in order). A trace
/// records the parts (backend/traced.hpp), and the CPU backend runs them as their own
/// loops; the CUDA backend's kernel runs them fused.
template <class F>
concept FusesParts = requires { requires F::kFusesParts; };

/// A functor that also runs a contiguous range of its indices in one call: f.range(begin,
/// end) does exactly what f(i) does for each i in [begin, end), and lets a functor over a
/// matrix walk its rows and columns without dividing every index by a row's length. The
/// CPU backend gives each thread its share of the indices that way; the CUDA backend
/// launches f(i).
template <class F>
concept RunsRanges = requires(const F& f, std::int64_t i) { f.range(i, i); };

}  // namespace tessera::ops
