// What each launched functor says one launch does (ops/traffic.hpp): every functor the
// library hands to B::for_each has traffic(), and its figures on small shapes match the
// bytes, flops and transcendentals worked out by hand here from the functor's loop.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/backend/kernel_class.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/core/float8.hpp"
#include "tessera/nn/float8.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/ops/ops.hpp"
#include "tessera/ops/norm.hpp"
#include "tessera/ops/traffic.hpp"
#include "tessera/optim/adamw.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/parallel/sharding.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace test_traffic {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using ops::HasTraffic;

// Every functor library code launches: a new one without traffic() fails here.
template <class T>
constexpr bool all_have_traffic =
    HasTraffic<ops::Add<T>> && HasTraffic<ops::Copy<T>> && HasTraffic<ops::Axpy<T>> && HasTraffic<ops::Scale<T>> &&
    HasTraffic<ops::Fill<T>> && HasTraffic<ops::SquaredNormPartial<T>> && HasTraffic<ops::RmsNormForward<T>> &&
    HasTraffic<ops::RmsNormBackwardInput<T>> && HasTraffic<ops::RmsNormBackwardWeight<T>> &&
    HasTraffic<ops::SwiGluForward<T>> && HasTraffic<ops::SwiGluBackward<T>> && HasTraffic<ops::RopeRotate<T>> &&
    HasTraffic<ops::SwiGluForwardRows<T>> && HasTraffic<ops::SwiGluBackwardRows<T>> &&
    HasTraffic<ops::SwiGluForwardPaired<T>> && HasTraffic<ops::SwiGluBackwardPaired<T>> &&
    HasTraffic<ops::CausalSoftmaxForward<T>> && HasTraffic<ops::CausalSoftmaxRecompute<T>> &&
    HasTraffic<ops::CausalSoftmaxBackward<T>> && HasTraffic<ops::RowDot<T>> && HasTraffic<ops::CrossEntropyRow<T>> &&
    HasTraffic<ops::CrossEntropyShardMax<T>> && HasTraffic<ops::CrossEntropyShardExp<T>> &&
    HasTraffic<ops::CrossEntropyShardGrad<T>> && HasTraffic<ops::EmbeddingForward<T>> &&
    HasTraffic<ops::EmbeddingBackward<T>> && HasTraffic<ops::InitValues<T>> && HasTraffic<ops::SquaredNormChunks<T>> &&
    HasTraffic<ops::AdamWStep<T>> && HasTraffic<ops::AdamWMultiStep<T>> &&
    HasTraffic<nn::detail::InterleaveColumns<T>> && HasTraffic<parallel::detail::CopyPieceRow<T>>;
static_assert(all_have_traffic<float>, "a float functor has no traffic()");
static_assert(all_have_traffic<bf16>, "a bf16 functor has no traffic()");
static_assert(all_have_traffic<double>, "a double functor has no traffic()");
static_assert(HasTraffic<ops::Convert<float, bf16>> && HasTraffic<ops::Convert<bf16, float>> &&
                  HasTraffic<ops::Convert<float, float>>,
              "Convert has no traffic()");
static_assert(HasTraffic<parallel::detail::PackBf16> && HasTraffic<parallel::detail::UnpackBf16> &&
                  HasTraffic<optim::detail::RoundToBf16>,
              "a bf16 packing functor has no traffic()");

constexpr double kF = sizeof(float), kB = sizeof(bf16), kI = sizeof(std::int32_t), kD = sizeof(double);

void check_equal(const ops::Traffic& t, double read, double written, double flops, double transcendentals) {
  CHECK(t.bytes_read == read);
  CHECK(t.bytes_written == written);
  CHECK(t.flops == flops);
  CHECK(t.transcendentals == transcendentals);
}

// A launch over n indices does n times what one index does.
template <class F>
void check_linear(const F& f, std::int64_t n) {
  const ops::Traffic one = f.traffic(n), three = f.traffic(3 * n);
  CHECK(three.bytes_read == 3 * one.bytes_read);
  CHECK(three.bytes_written == 3 * one.bytes_written);
  CHECK(three.flops == 3 * one.flops);
  CHECK(three.transcendentals == 3 * one.transcendentals);
}

// A launch reading a table once: each further index adds the same figures.
template <class F>
void check_affine(const F& f, std::int64_t n) {
  const ops::Traffic a = f.traffic(n), b = f.traffic(2 * n), c = f.traffic(3 * n);
  CHECK(c.bytes_read - b.bytes_read == b.bytes_read - a.bytes_read);
  CHECK(c.bytes_written - b.bytes_written == b.bytes_written - a.bytes_written);
  CHECK(c.flops - b.flops == b.flops - a.flops);
  CHECK(c.transcendentals - b.transcendentals == b.transcendentals - a.transcendentals);
}

TEST_CASE("traffic: element-wise functors") {
  const std::int64_t n = 8;
  check_equal(ops::Add<float>{nullptr, nullptr, nullptr}.traffic(n), 2 * 8 * kF, 8 * kF, 8, 0);
  check_equal(ops::Add<bf16>{nullptr, nullptr, nullptr}.traffic(n), 2 * 8 * kB, 8 * kB, 8, 0);
  check_equal(ops::Copy<float>{nullptr, nullptr}.traffic(n), 8 * kF, 8 * kF, 0, 0);
  check_equal(ops::Copy<bf16>{nullptr, nullptr}.traffic(n), 8 * kB, 8 * kB, 0, 0);
  check_equal(ops::Convert<float, bf16>{nullptr, nullptr}.traffic(n), 8 * kF, 8 * kB, 0, 0);
  check_equal(ops::Convert<bf16, float>{nullptr, nullptr}.traffic(n), 8 * kB, 8 * kF, 0, 0);
  // y += alpha x: x and y read, y written, a multiplication and an addition.
  check_equal(ops::Axpy<float>{1.0f, nullptr, nullptr}.traffic(n), 2 * 8 * kF, 8 * kF, 2 * 8, 0);
  check_equal(ops::Axpy<bf16>{1.0f, nullptr, nullptr}.traffic(n), 2 * 8 * kB, 8 * kB, 2 * 8, 0);
  check_equal(ops::Scale<float>{2.0f, nullptr}.traffic(n), 8 * kF, 8 * kF, 8, 0);
  check_equal(ops::Scale<bf16>{2.0f, nullptr}.traffic(n), 8 * kB, 8 * kB, 8, 0);
  check_equal(ops::Fill<float>{0.0f, nullptr}.traffic(n), 0, 8 * kF, 0, 0);
  check_equal(ops::Fill<bf16>{bf16(0.0f), nullptr}.traffic(n), 0, 8 * kB, 0, 0);
  check_linear(ops::Add<bf16>{nullptr, nullptr, nullptr}, n);
  check_linear(ops::Copy<float>{nullptr, nullptr}, n);
  check_linear(ops::Convert<float, bf16>{nullptr, nullptr}, n);
  check_linear(ops::Axpy<float>{1.0f, nullptr, nullptr}, n);
  check_linear(ops::Scale<bf16>{2.0f, nullptr}, n);
  check_linear(ops::Fill<float>{0.0f, nullptr}, n);

  // 1000 elements in chunks of 100: 10 chunks cover them; 4 chunks cover 400; 12 still
  // 1000 (the last two are empty). A multiplication and an addition an element.
  const ops::SquaredNormPartial<float> sq{nullptr, 1000, 100, nullptr};
  check_equal(sq.traffic(10), 1000 * kF, 10 * kD, 2 * 1000, 0);
  check_equal(sq.traffic(4), 400 * kF, 4 * kD, 2 * 400, 0);
  check_equal(sq.traffic(12), 1000 * kF, 12 * kD, 2 * 1000, 0);
  // 11 chunks of 91 over 1000 bf16: the last chunk holds 1000 - 10 * 91 = 90.
  check_equal(ops::SquaredNormPartial<bf16>{nullptr, 1000, 91, nullptr}.traffic(11), (10 * 91 + 90) * kB, 11 * kD,
              2 * 1000, 0);
}

TEST_CASE("traffic: bf16 packing and the piece copies") {
  check_equal(parallel::detail::PackBf16{nullptr, nullptr}.traffic(8), 8 * kF, 8 * sizeof(std::uint16_t), 0, 0);
  check_equal(parallel::detail::UnpackBf16{nullptr, nullptr}.traffic(8), 8 * sizeof(std::uint16_t), 8 * kF, 0, 0);
  check_equal(optim::detail::RoundToBf16{nullptr, nullptr}.traffic(8), 8 * kF, 8 * kF, 0, 0);
  check_linear(parallel::detail::PackBf16{nullptr, nullptr}, 8);
  check_linear(parallel::detail::UnpackBf16{nullptr, nullptr}, 8);
  check_linear(optim::detail::RoundToBf16{nullptr, nullptr}, 8);

  // 3 rows of a piece 5 columns wide, of a whole 12 columns wide: 15 elements each way.
  const parallel::detail::CopyPieceRow<float> into{nullptr, nullptr, 12, 5, 0, 5, true};
  const parallel::detail::CopyPieceRow<bf16> back{nullptr, nullptr, 12, 5, 0, 5, false};
  check_equal(into.traffic(3), 3 * 5 * kF, 3 * 5 * kF, 0, 0);
  check_equal(back.traffic(3), 3 * 5 * kB, 3 * 5 * kB, 0, 0);
  check_linear(into, 3);

  // 4 rows of 3 parts of 6 columns: 4 * 18 elements each way.
  const nn::detail::InterleaveColumns<float> inter{nullptr, nullptr, 3, 4, 6};
  check_equal(inter.traffic(4), 4 * 3 * 6 * kF, 4 * 3 * 6 * kF, 0, 0);
  check_linear(inter, 4);
}

TEST_CASE("traffic: RMSNorm forward and backward") {
  const std::int64_t rows = 3, n = 8;
  // x read once and y written (rows * n), w read once (n), rstd written (rows, accum_t).
  // Per element x^2 and the sum, then w * (x * r); per row / n, + eps, 1 / and a sqrt.
  const ops::RmsNormForward<float> ff{nullptr, n, nullptr, nullptr, n, nullptr, n, 1e-5f};
  check_equal(ff.traffic(rows), 3 * 8 * kF + 8 * kF, 3 * 8 * kF + 3 * kF, 3 * (2 * 8 + 2 * 8 + 3), 3);
  const ops::RmsNormForward<bf16> fb{nullptr, n, nullptr, nullptr, n, nullptr, n, 1e-5f};
  check_equal(fb.traffic(rows), 3 * 8 * kB + 8 * kB, 3 * 8 * kB + 3 * kF, 3 * (2 * 8 + 2 * 8 + 3), 3);
  check_affine(ff, rows);
  CHECK(fb.traffic(2 * rows).bytes_read - fb.traffic(rows).bytes_read == 3 * 8 * kB);
  // With the rows' amaxes of y (for a float8 cast): a float a row written, a comparison
  // an element.
  float amax[3];
  const ops::RmsNormForward<bf16> fa{nullptr, n, nullptr, nullptr, n, nullptr, n, 1e-5f, amax};
  check_equal(fa.traffic(rows), 3 * 8 * kB + 8 * kB, 3 * 8 * kB + 3 * kF + 3 * kF, 3 * (2 * 8 + 2 * 8 + 3) + 3 * 8, 3);
  check_affine(fa, rows);

  // x and dy read once (2 * rows * n), w (n), rstd (rows); dx written. Per element
  // w dy x and the sum (3), then r w dy - c x (4); per row c = r^3 dot / n (4).
  const ops::RmsNormBackwardInput<float> bf{nullptr, n, nullptr, nullptr, nullptr, n, nullptr, n, n};
  check_equal(bf.traffic(rows), 2 * 3 * 8 * kF + 8 * kF + 3 * kF, 3 * 8 * kF, 3 * (3 * 8 + 4 * 8 + 4), 0);
  const ops::RmsNormBackwardInput<bf16> bb{nullptr, n, nullptr, nullptr, nullptr, n, nullptr, n, n};
  check_equal(bb.traffic(rows), 2 * 3 * 8 * kB + 8 * kB + 3 * kF, 3 * 8 * kB, 3 * (3 * 8 + 4 * 8 + 4), 0);
  check_affine(bb, rows);

  // Launched over 8 columns of 5 rows: dy and x (2 * 5 * 8), rstd once (5), dw read and
  // written (8, accum_t). dy x r and the sum per (row, column), dw += per column.
  const ops::RmsNormBackwardWeight<float> wf{nullptr, n, nullptr, nullptr, n, nullptr, 5};
  check_equal(wf.traffic(n), 2 * 5 * 8 * kF + 5 * kF + 8 * kF, 8 * kF, 8 * (3 * 5 + 1), 0);
  const ops::RmsNormBackwardWeight<bf16> wb{nullptr, n, nullptr, nullptr, n, nullptr, 5};
  check_equal(wb.traffic(n), 2 * 5 * 8 * kB + 5 * kF + 8 * kF, 8 * kF, 8 * (3 * 5 + 1), 0);
  check_affine(wb, n);
}

TEST_CASE("traffic: SwiGLU") {
  // sigmoid: exp, 1 + e, 1 / (...): 2 flops and an exp; then a s b: 2 more.
  check_equal(ops::SwiGluForward<float>{nullptr, nullptr, nullptr}.traffic(8), 2 * 8 * kF, 8 * kF, 8 * 4, 8);
  check_equal(ops::SwiGluForward<bf16>{nullptr, nullptr, nullptr}.traffic(8), 2 * 8 * kB, 8 * kB, 8 * 4, 8);
  // a, b, dg read; da, db written. sigmoid (2), silu (1), da: dg b, * s, 1 - s, a (..),
  // 1 + .., * (6), db: dg silu (1).
  const ops::SwiGluBackward<bf16> b{nullptr, nullptr, nullptr, nullptr, nullptr};
  check_equal(b.traffic(8), 3 * 8 * kB, 2 * 8 * kB, 8 * (2 + 1 + 6 + 1), 8);
  check_equal(ops::SwiGluBackward<float>{nullptr, nullptr, nullptr, nullptr, nullptr}.traffic(8), 3 * 8 * kF,
              2 * 8 * kF, 8 * 10, 8);
  check_linear(ops::SwiGluForward<float>{nullptr, nullptr, nullptr}, 8);
  check_linear(b, 8);

  // By rows of 8, with the outputs' row amaxes: the elementwise traffic of 3 rows, a
  // float a row an output more, a comparison an element an output.
  const ops::SwiGluForwardRows<bf16> fr{{nullptr, nullptr, nullptr}, 8, nullptr};
  check_equal(fr.traffic(3), 2 * 24 * kB, 24 * kB + 3 * kF, 24 * 4 + 24, 24);
  const ops::SwiGluBackwardRows<bf16> br{b, 8, nullptr, nullptr};
  check_equal(br.traffic(3), 3 * 24 * kB, 2 * 24 * kB + 2 * 3 * kF, 24 * 10 + 2 * 24, 24);
  check_linear(fr, 3);
  check_linear(br, 3);

  // Side by side in the rows of one matrix (w1 and w3 as one GEMM): the elementwise
  // traffic of 3 rows of 8, nothing more.
  const ops::SwiGluForwardPaired<bf16> fp{nullptr, nullptr, 8};
  check_equal(fp.traffic(3), 2 * 24 * kB, 24 * kB, 24 * 4, 24);
  const ops::SwiGluBackwardPaired<bf16> bp{nullptr, nullptr, nullptr, 8};
  check_equal(bp.traffic(3), 3 * 24 * kB, 2 * 24 * kB, 24 * 10, 24);
  check_linear(fp, 3);
  check_linear(bp, 3);
}

TEST_CASE("traffic: RoPE") {
  // 2 heads of 8 (4 pairs) a row, positions repeating every 4 rows; cos and sin rows of
  // 4 values per position touched. A pair: a c - b s and b c + a s, 6 flops.
  const ops::RopeRotate<float> f{nullptr, 16, 2, 8, 4, nullptr, nullptr, false};
  check_equal(f.traffic(6), 6 * 16 * kF + 2 * 4 * 4 * kF, 6 * 16 * kF, 6 * 2 * 4 * 6, 0);
  check_equal(f.traffic(2), 2 * 16 * kF + 2 * 2 * 4 * kF, 2 * 16 * kF, 2 * 2 * 4 * 6, 0);
  // The inverse, out of place (src): the same figures.
  const ops::RopeRotate<bf16> b{nullptr, 16, 2, 8, 4, nullptr, nullptr, true, nullptr};
  check_equal(b.traffic(6), 6 * 16 * kB + 2 * 4 * 4 * kB, 6 * 16 * kB, 6 * 2 * 4 * 6, 0);
  check_affine(f, 4);  // from seq_len rows on, the tables are read whole
}

TEST_CASE("traffic: causal softmax rows") {
  // The visible keys, brute force against the closed form.
  for (std::int64_t rows = 0; rows <= 9; ++rows)
    for (std::int64_t offset = 0; offset <= 9; ++offset)
      for (std::int64_t cols = 1; cols <= 9; ++cols) {
        double sum = 0;
        for (std::int64_t r = 0; r < rows; ++r) sum += static_cast<double>(std::min(r + offset + 1, cols));
        CHECK(ops::detail::causal_visible(rows, offset, cols) == sum);
      }

  // 4 rows of 6 keys from query 1: rows see 2, 3, 4, 5 keys, 14 in all.
  const double visible = 2 + 3 + 4 + 5;
  // Scores read once, the whole row written (probabilities and zeros), lse written.
  // Flops: the max (a scaling and a comparison each, less a comparison), exponentials
  // (x sc - m), their sum, 1 / sum per row, the scaling, m + log(sum) per row.
  const ops::CausalSoftmaxForward<float> ff{nullptr, 6, 6, 1, 0.5f, nullptr};
  check_equal(ff.traffic(4), visible * kF, 4 * 6 * kF + 4 * kF,
              (2 * visible - 4) + 2 * visible + visible + 4 + visible + 4, visible + 4);
  // bf16: the exponentials computed twice (for the sum, then for the output).
  const ops::CausalSoftmaxForward<bf16> fb{nullptr, 6, 6, 1, 0.5f, nullptr};
  check_equal(fb.traffic(4), visible * kB, 4 * 6 * kB + 4 * kF,
              (2 * visible - 4) + 3 * visible + 4 + 3 * visible + 4, 2 * visible + 4);

  const ops::CausalSoftmaxRecompute<float> rf{nullptr, 6, 6, 1, 0.5f, nullptr};
  check_equal(rf.traffic(4), visible * kF + 4 * kF, 4 * 6 * kF, 2 * visible, visible);
  const ops::CausalSoftmaxRecompute<bf16> rb{nullptr, 6, 6, 1, 0.5f, nullptr};
  check_equal(rb.traffic(4), visible * kB + 4 * kF, 4 * 6 * kB, 2 * visible, visible);

  // p and dP read where visible, D per row; dS written over the whole row. sc p (dP - D).
  const ops::CausalSoftmaxBackward<float> bf{nullptr, 6, nullptr, 6, nullptr, 6, 1, 0.5f};
  check_equal(bf.traffic(4), 2 * visible * kF + 4 * kF, 4 * 6 * kF, 3 * visible, 0);
  const ops::CausalSoftmaxBackward<bf16> bb{nullptr, 6, nullptr, 6, nullptr, 6, 1, 0.5f};
  check_equal(bb.traffic(4), 2 * visible * kB + 4 * kF, 4 * 6 * kB, 3 * visible, 0);

  // Queries from 5 on see all 6 keys: then every row is the same.
  check_linear(ops::CausalSoftmaxForward<bf16>{nullptr, 6, 6, 5, 0.5f, nullptr}, 4);
  check_linear(ops::CausalSoftmaxRecompute<float>{nullptr, 6, 6, 5, 0.5f, nullptr}, 4);
  check_linear(ops::CausalSoftmaxBackward<float>{nullptr, 6, nullptr, 6, nullptr, 6, 7, 0.5f}, 4);

  // 3 rows of 8: a and b read, one sum per row written; a multiplication and an addition.
  const ops::RowDot<bf16> d{nullptr, 8, nullptr, 8, 8, nullptr};
  check_equal(d.traffic(3), 2 * 3 * 8 * kB, 3 * kF, 2 * 3 * 8, 0);
  check_linear(d, 3);
}

TEST_CASE("traffic: RMSNorm's backward in one launch, x and dy read once on the GPU, traced as its two passes") {
  const std::int64_t rows = 64, n = 32;
  const ops::RmsNormBackwardInput<bf16> in{nullptr, n, nullptr, nullptr, nullptr, n, nullptr, n, n};
  for (const bool add : {false, true}) {
    const ops::RmsNormBackwardWeight<bf16> w{nullptr, n, nullptr, nullptr, n, nullptr, rows, add};
    const ops::RmsNormBackward<bf16> f{in, w};
    // The CPU runs the two loops: their traffic.
    ops::Traffic both = in.traffic(rows);
    both += w.traffic(n);
    check_equal(f.traffic(rows + n), both.bytes_read, both.bytes_written, both.flops, both.transcendentals);
    // The kernel: the input pass's bytes, then 4 chunks of 16 rows' float partials
    // written and read back, dw written (and read when added to); x and dy not again.
    const ops::Traffic once = f.cuda_traffic(rows + n);
    const ops::Traffic input = in.traffic(rows);
    check_equal(once, input.bytes_read + 4 * n * kF + (add ? n * kF : 0), input.bytes_written + 4 * n * kF + n * kF,
                both.flops, 0);
    CHECK(both.bytes() - once.bytes() == doctest::Approx(2.0 * rows * n * kB + rows * kF - 8 * n * kF));
    // Traced as the two functors, the kernel's bytes on the first.
    std::vector<std::string> names;
    std::vector<std::int64_t> counts;
    std::vector<double> bytes;
    std::vector<int> own_launches;
    f.parts(rows + n, [&]<class F>(const F&, std::int64_t m, const ops::Traffic& cuda, bool own_launch) {
      names.push_back(tessera::trace::functor_name<F>());
      counts.push_back(m);
      bytes.push_back(cuda.bytes());
      own_launches.push_back(own_launch);
    });
    CHECK(names == std::vector<std::string>{"RmsNormBackwardInput<bf16>", "RmsNormBackwardWeight<bf16>"});
    CHECK(counts == std::vector<std::int64_t>{rows, n});
    CHECK(bytes == std::vector<double>{once.bytes(), 0.0});
    CHECK(own_launches == std::vector<int>{1, 1});  // the partial sums' reduction is a kernel of its own
  }
  static_assert(ops::FusesParts<ops::RmsNormBackward<float>> && !ops::FusesParts<ops::RmsNormBackwardInput<float>>);
  static_assert(cuda_kernel_class<ops::RmsNormBackward<bf16>> == KernelClass::row);
}

TEST_CASE("traffic: cross-entropy rows") {
  const std::int64_t rows = 3, v = 10;
  // Per row: the target id and its logit, then the row read by the max, the
  // exponentials' pass and the gradient's pass; the loss written (a double). A float row
  // writes its exponentials back, then the gradient.
  const ops::CrossEntropyRow<float> f{nullptr, v, v, nullptr, 0.5f, true, nullptr};
  // max: 9 comparisons; exponentials: a subtraction and a sum each (20); the loss: 2;
  // the gradient: scale / sum, a multiplication each, the target's correction (12).
  check_equal(f.traffic(rows), 3 * (kI + kF + 3 * 10 * kF), 3 * (kD + 2 * 10 * kF), 3 * (9 + 20 + 2 + 12),
              3 * (10 + 1));
  // Loss only: no gradient pass; the float row still holds the exponentials.
  const ops::CrossEntropyRow<float> fl{nullptr, v, v, nullptr, 0.5f, false, nullptr};
  check_equal(fl.traffic(rows), 3 * (kI + kF + 2 * 10 * kF), 3 * (kD + 10 * kF), 3 * (9 + 20 + 2), 3 * (10 + 1));
  // bf16: the row keeps its logits; the gradient computes the exponentials again (a
  // subtraction and a multiplication each), and the target's again (3 flops and an exp).
  const ops::CrossEntropyRow<bf16> b{nullptr, v, v, nullptr, 0.5f, true, nullptr};
  check_equal(b.traffic(rows), 3 * (kI + kB + 3 * 10 * kB), 3 * (kD + 10 * kB), 3 * (9 + 20 + 2 + 1 + 20 + 3),
              3 * (10 + 1 + 10 + 1));
  const ops::CrossEntropyRow<bf16> bl{nullptr, v, v, nullptr, 0.5f, false, nullptr};
  check_equal(bl.traffic(rows), 3 * (kI + kB + 2 * 10 * kB), 3 * kD, 3 * (9 + 20 + 2), 3 * (10 + 1));
  check_linear(f, rows);
  check_linear(bl, rows);

  // The CUDA kernel's bytes: a row of a vocabulary the one-read kernel takes is read once
  // (target id, target logit, the row) and its output written once, whatever the
  // passes; the arithmetic is the functor's. Outside that range the passes' bytes.
  const std::int64_t llama3 = 128256;
  std::vector<bf16> grad(1);  // only whether the gradient goes apart counts
  const ops::CrossEntropyRow<float, bf16> with_grad{nullptr, llama3, llama3, nullptr, 0.5f, true, nullptr,
                                                    grad.data(), llama3};
  const ops::Traffic passes = with_grad.traffic(rows), once = with_grad.cuda_traffic(rows);
  CHECK(passes.bytes_read == 3 * (kI + kF + 3 * double(llama3) * kF));
  check_equal(once, 3 * (kI + kF + double(llama3) * kF), 3 * (kD + double(llama3) * kB), passes.flops,
              passes.transcendentals);
  CHECK(once.bytes() / double(rows) < 6.01 * double(llama3));  // 6 bytes a logit: 14 in the passes
  // In place: the float row's gradient written over it; loss only: its exponentials.
  const ops::CrossEntropyRow<float> in_place{nullptr, llama3, llama3, nullptr, 0.5f, true, nullptr};
  check_equal(in_place.cuda_traffic(rows), 3 * (kI + kF + double(llama3) * kF), 3 * (kD + double(llama3) * kF),
              in_place.traffic(rows).flops, in_place.traffic(rows).transcendentals);
  const ops::CrossEntropyRow<float> in_place_loss{nullptr, llama3, llama3, nullptr, 0.5f, false, nullptr};
  CHECK(in_place_loss.cuda_traffic(rows).bytes_written == 3 * (kD + double(llama3) * kF));
  const ops::CrossEntropyRow<bf16> bf16_loss{nullptr, llama3, llama3, nullptr, 0.5f, false, nullptr};
  CHECK(bf16_loss.cuda_traffic(rows).bytes_written == 3 * kD);
  // The range's edges: the passes below kOneReadMinVocab and above kOneReadMaxVocab.
  for (const std::int64_t vocab : {ops::kOneReadMinVocab - 1, ops::kOneReadMaxVocab + 1}) {
    const ops::CrossEntropyRow<float> e{nullptr, vocab, vocab, nullptr, 0.5f, true, nullptr};
    CHECK(e.cuda_traffic(rows).bytes() == e.traffic(rows).bytes());
  }
  for (const std::int64_t vocab : {ops::kOneReadMinVocab, ops::kOneReadMaxVocab}) {
    const ops::CrossEntropyRow<float> e{nullptr, vocab, vocab, nullptr, 0.5f, true, nullptr};
    CHECK(e.cuda_traffic(rows).bytes() < e.traffic(rows).bytes());
  }
  static_assert(ops::HasCudaTraffic<ops::CrossEntropyRow<float, bf16>>);
  static_assert(!ops::HasCudaTraffic<ops::CrossEntropyShardMax<float>>, "the vocabulary-parallel passes are read as they run");

  // Vocabulary-split: the max pass reads the target and the row, writes the max.
  const ops::CrossEntropyShardMax<float> mf{nullptr, v, v, nullptr, nullptr};
  check_equal(mf.traffic(rows), 3 * (kI + 10 * kF), 3 * kF, 3 * 9, 0);
  const ops::CrossEntropyShardMax<bf16> mb{nullptr, v, v, nullptr, nullptr};
  check_equal(mb.traffic(rows), 3 * (kI + 10 * kB), 3 * kF, 3 * 9, 0);
  // The exponentials: target, max, target logit and the row read; the 2 sums written
  // (and a float row's exponentials).
  const ops::CrossEntropyShardExp<float> ef{nullptr, v, v, 20, nullptr, nullptr, nullptr};
  check_equal(ef.traffic(rows), 3 * (kI + kF + kF + 10 * kF), 3 * (2 * kF + 10 * kF), 3 * 20, 3 * 10);
  const ops::CrossEntropyShardExp<bf16> eb{nullptr, v, v, 20, nullptr, nullptr, nullptr};
  check_equal(eb.traffic(rows), 3 * (kI + kF + kB + 10 * kB), 3 * (2 * kF), 3 * 20, 3 * 10);
  // The gradient: target, max and the 2 sums read, the loss written (max + log(sum) -
  // z_t: 2 flops and a log), then the row's gradient pass.
  const ops::CrossEntropyShardGrad<float> gf{nullptr, v, v, 20, nullptr, nullptr, nullptr, 0.5f, true, nullptr};
  check_equal(gf.traffic(rows), 3 * (kI + 3 * kF + 10 * kF), 3 * (kD + 10 * kF), 3 * (2 + 1 + 10 + 1), 3);
  const ops::CrossEntropyShardGrad<bf16> gb{nullptr, v, v, 20, nullptr, nullptr, nullptr, 0.5f, true, nullptr};
  check_equal(gb.traffic(rows), 3 * (kI + 3 * kF + 10 * kB), 3 * (kD + 10 * kB), 3 * (2 + 1 + 20 + 3),
              3 * (1 + 10 + 1));
  const ops::CrossEntropyShardGrad<float> gl{nullptr, v, v, 20, nullptr, nullptr, nullptr, 0.5f, false, nullptr};
  check_equal(gl.traffic(rows), 3 * (kI + 3 * kF), 3 * kD, 3 * 2, 3);
  check_linear(mf, rows);
  check_linear(eb, rows);
  check_linear(gf, rows);
}

TEST_CASE("traffic: embedding") {
  // 3 rows of 8: each row's id read once, each element read from the table and written.
  const ops::EmbeddingForward<float> ff{nullptr, nullptr, nullptr, 8};
  check_equal(ff.traffic(24), 3 * kI + 3 * 8 * kF, 3 * 8 * kF, 0, 0);
  const ops::EmbeddingForward<bf16> fb{nullptr, nullptr, nullptr, 8, 0, 100};
  check_equal(fb.traffic(24), 3 * kI + 3 * 8 * kB, 3 * 8 * kB, 0, 0);
  check_linear(ff, 24);
  // 2 distinct ids over 5 positions, 8 columns (16 indices): per id its value and its
  // offset, each position once; per (id, column) the gradient (accum_t) read and
  // written; per (position, column) dout read and added.
  const ops::EmbeddingBackward<float> bf{nullptr, nullptr, nullptr, nullptr, nullptr, 8, 0, 5};
  check_equal(bf.traffic(16), 2 * 2 * kI + 5 * kI + 16 * kF + 5 * 8 * kF, 16 * kF, 5 * 8, 0);
  const ops::EmbeddingBackward<bf16> bb{nullptr, nullptr, nullptr, nullptr, nullptr, 8, 0, 5};
  check_equal(bb.traffic(16), 2 * 2 * kI + 5 * kI + 16 * kF + 5 * 8 * kB, 16 * kF, 5 * 8, 0);
}

TEST_CASE("traffic: parameter initialisation") {
  // Each element written; a normal draw's arithmetic and one square root per element.
  const ops::InitValues<float> n{nullptr, 1, ops::InitKind::normal, 0.02};
  check_equal(n.traffic(10), 0, 10 * kF, 10 * (60 + 2 * (4 + 30 + 25 + 3)), 10);
  check_linear(n, 10);
  const ops::InitValues<bf16> ones{nullptr, 1, ops::InitKind::ones};
  check_equal(ones.traffic(10), 0, 10 * kB, 0, 0);
}

TEST_CASE("traffic: AdamW") {
  // p, g, m, v read; p, m, v written. Flops: g gs (1), p (1 - lr wd) (3), m (4), v (5),
  // sqrt(v / c2) + eps (2), p - lr (m / c1) / denom (4); and the sqrt.
  const ops::AdamWStep<float> s{nullptr, nullptr, nullptr, nullptr, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f, 1.0f};
  check_equal(s.traffic(8), 4 * 8 * kF, 3 * 8 * kF, 8 * (1 + 3 + 4 + 5 + 2 + 4), 8);
  check_linear(s, 8);

  // Two tensors of 3000 and 100 elements: blocks of 2048 give 2 + 1 blocks, a launch of
  // 3 * 2048 indices of which 3100 are not padding. The tables: 3 block entries, 2
  // tensor entries.
  const std::int64_t launch = 3 * ops::kAdamWBlock;
  const ops::AdamWScalars<float> sc{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f, 1.0f};
  const double tables_f = 3 * kI + 2 * sizeof(ops::AdamWTensor<float>);
  // No masters: g, m, v and the parameter read; m, v and the parameter written.
  const ops::AdamWMultiStep<float> plain{nullptr, nullptr, sc, 3100, 2, false};
  check_equal(plain.traffic(launch), tables_f + 3100 * (3 * kF + kF), 3100 * (2 * kF + kF), 3100 * 19.0, 3100);
  // Masters: the master read instead of the parameter, and written besides it.
  const ops::AdamWMultiStep<float> mixed{nullptr, nullptr, sc, 3100, 2, true};
  check_equal(mixed.traffic(launch), tables_f + 3100 * (3 * kF + kF), 3100 * (2 * kF + kF + kF), 3100 * 19.0, 3100);
  const ops::AdamWMultiStep<bf16> b{nullptr, nullptr, sc, 3100, 2, true};
  check_equal(b.traffic(launch), 3 * kI + 2 * sizeof(ops::AdamWTensor<bf16>) + 3100 * (3 * kF + kF),
              3100 * (2 * kF + kB + kF), 3100 * 19.0, 3100);
  // bf16 moments: m and v move 2 bytes each way instead of 4.
  const ops::AdamWMultiStep<float, bf16> plain_b{nullptr, nullptr, sc, 3100, 2, false};
  check_equal(plain_b.traffic(launch), 3 * kI + 2 * sizeof(ops::AdamWTensor<float, bf16>) + 3100 * (kF + 2 * kB + kF),
              3100 * (2 * kB + kF), 3100 * 19.0, 3100);
  const ops::AdamWMultiStep<bf16, bf16> b_b{nullptr, nullptr, sc, 3100, 2, true};
  check_equal(b_b.traffic(launch), 3 * kI + 2 * sizeof(ops::AdamWTensor<bf16, bf16>) + 3100 * (kF + 2 * kB + kF),
              3100 * (2 * kB + kB + kF), 3100 * 19.0, 3100);
}

// The CPU backend, keeping what each launch says it does.
struct Recording : Cpu {
  static inline std::vector<ops::Traffic> launches;
  template <class F>
  static void for_each(std::int64_t n, const F& f) {
    if constexpr (ops::FusesParts<F>) {  // each part as a trace records it
      f.parts(n, [](const auto&, std::int64_t, const ops::Traffic& t, bool) { launches.push_back(t); });
    } else {
      static_assert(ops::HasTraffic<F>, "a launched functor has no traffic()");
      launches.push_back(f.traffic(n));
    }
    Cpu::for_each(n, f);
  }
};
static_assert(Backend<Recording>);

struct TwoTensors {
  using scalar_type = float;
  nn::Parameter<float> a{"a", Shape{3000}, nn::Init::ones()};
  nn::Parameter<float> b{"b", Shape{10, 10}, nn::Init::ones()};
  template <class F>
  void for_each_parameter(F&& f) {
    f(a);
    f(b);
  }
};

TEST_CASE("traffic: the optimizer and the gradient norm set the figures' fields") {
  TwoTensors model;
  for (const bool masters : {false, true})
    for (const bool bf16_states : {false, true}) {
      optim::AdamWOptions o;
      o.param_dtype = masters ? DType::bf16 : DType::f32;
      o.state_dtype = bf16_states ? DType::bf16 : DType::f32;
      optim::AdamW<float, Recording> opt(model, o);
      Recording::launches.clear();
      opt.step(1e-3);
      REQUIRE(Recording::launches.size() == 1);
      // The launch reads the scalars stage() wrote to the backend (AdamW::stage).
      const ops::AdamWScalars<float> staged{};
      const ops::Traffic want =
          bf16_states ? ops::AdamWMultiStep<float, bf16>{nullptr, nullptr, {}, 3100, 2, masters, nullptr, &staged}
                            .traffic(3 * ops::kAdamWBlock)
                      : ops::AdamWMultiStep<float>{nullptr, nullptr, {}, 3100, 2, masters, nullptr, &staged}.traffic(
                            3 * ops::kAdamWBlock);
      const ops::Traffic got = Recording::launches[0];
      CHECK(got.bytes_read == want.bytes_read);
      CHECK(got.bytes_written == want.bytes_written);
      CHECK(got.flops == want.flops);
    }

  // 40000 elements in chunks of kNormChunk (16384): 3 chunks; then 5 more in one chunk.
  std::vector<float> x(40000, 1.0f);
  optim::SquaredNorms<Recording, float> norms;
  norms.add(x.data(), 40000);
  norms.add(x.data(), 5);
  Recording::launches.clear();
  CHECK(norms.sum() == 40005.0);
  REQUIRE(Recording::launches.size() == 2);
  // The table of 2 pieces read once, every element once, one slot per chunk written;
  // then the 4 slots added into one (ops::LaneSum), which stays in the backend's memory.
  check_equal(Recording::launches[0], 2 * sizeof(ops::NormPiece<float>) + 40005 * kF, 4 * kD, 2 * 40005, 0);
  check_equal(Recording::launches[1], 4 * kD, kD, 4, 0);
  CHECK(cuda_kernel_class<ops::LaneSum> == KernelClass::row);
  check_equal(ops::SquaredNormChunks<float>{nullptr, 2, nullptr, 40005}.traffic(4),
              2 * sizeof(ops::NormPiece<float>) + 40005 * kF, 4 * kD, 2 * 40005, 0);
  // A block per chunk on CUDA, its loads coalesced: nothing priced as a walk of one thread.
  CHECK(ops::SquaredNormChunks<float>{nullptr, 2, nullptr, 40005}.traffic(4).walk_bytes == 0);
  CHECK(cuda_kernel_class<ops::SquaredNormChunks<float>> == KernelClass::row);
}

TEST_CASE("traffic: a float8 cast by rows is one launch that reads x once; by columns, three") {
  // nn::cast_to_float8 by rows (not transposed, each row its own scale): ops::CastRowsFloat8,
  // x read once, the values and two floats a row written; with the amaxes a kernel that
  // wrote x kept (nn::Float8RowAmaxes), those read too. By columns: ColumnAbsMax, the
  // scales, then QuantizeFloat8 reading x again.
  const std::int64_t rows = 37, cols = 29;
  Tensor<float> x(Shape{rows, cols});
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 0.01f * static_cast<float>(i % 97) - 0.4f;
  const double e = static_cast<double>(rows * cols);
  for (const bool known : {false, true}) {
    CAPTURE(known);
    nn::Float8RowAmaxes<Recording> amaxes;
    if (known) {
      Tensor<float> m(Shape{rows});
      Cpu::for_each(rows, ops::RowAbsMax<float>{x.data(), cols, cols, m.data()});
      amaxes.keep(x.cview(), m);
    }
    Recording::launches.clear();
    const nn::Float8Operand<Recording> q =
        nn::cast_to_float8<Recording>(x.cview(), {DType::f8e4m3, ops::Float8Axis::rows, true});
    REQUIRE(Recording::launches.size() == 1);
    check_equal(Recording::launches[0], e * kF + (known ? rows * kF : 0), e + 2 * rows * kF, 2 * e + 3 * rows, 0);
    CHECK(q.scale.numel() == rows);
  }
  Recording::launches.clear();
  (void)nn::cast_to_float8<Recording>(x.cview(), {DType::f8e4m3, ops::Float8Axis::columns, true}, true);
  REQUIRE(Recording::launches.size() == 3);
  CHECK(Recording::launches[0].bytes_read == e * kF);
  CHECK(Recording::launches[2].bytes_read == e * (kF + kF));
  CHECK(cuda_kernel_class<ops::CastRowsFloat8<bf16, float8_e4m3>> == KernelClass::row);
  CHECK(cuda_kernel_class<ops::CastRowsFloat8<float, float8_e5m2>> == KernelClass::row);
}

TEST_CASE("traffic: a tensorwise float8 cast into both layouts reads x once and writes each layout once") {
  // nn::cast_to_float8_both_layouts (a tensorwise output gradient's two casts): the amax
  // and scale in one launch (RowAbsMaxScale: its two parts recorded), then one
  // QuantizeFloat8 that writes the values transposed and as x lies; on CUDA, x read once
  // (2 bytes a bf16 element) and a byte written to each layout, where two casts read it
  // twice.
  const std::int64_t rows = 40, cols = 24;
  Tensor<float> x(Shape{rows, cols});
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 0.02f * static_cast<float>(i % 89) - 0.8f;
  const double e = static_cast<double>(rows * cols);
  nn::Float8SharedCasts<Recording> shared;
  Recording::launches.clear();
  (void)nn::cast_to_float8_both_layouts<Recording>(x.cview(), {DType::f8e5m2, ops::Float8Axis::tensor, false});
  REQUIRE(Recording::launches.size() == 3);
  CHECK(Recording::launches[0].bytes_read == e * kF);
  CHECK(Recording::launches[2].bytes_read == e * (kF + kF));
  CHECK(Recording::launches[2].bytes_written == 2 * e);
  (void)nn::cast_to_float8<Recording>(x.cview(), {DType::f8e5m2, ops::Float8Axis::tensor, false}, true);  // kept
  CHECK(Recording::launches.size() == 3);
  const ops::QuantizeFloat8<bf16, float8_e5m2> both{nullptr, cols, rows, cols, nullptr, ops::Float8Axis::tensor,
                                                    true, nullptr, reinterpret_cast<float8_e5m2*>(16)};
  check_equal(both.cuda_traffic(rows * cols), e * sizeof(bf16), 2 * e, e, 0);
  ops::QuantizeFloat8<bf16, float8_e5m2> one = both;
  one.straight = nullptr;
  check_equal(one.cuda_traffic(rows * cols), e * sizeof(bf16), e, e, 0);
}

TEST_CASE("traffic: a float8 transpose walks down columns a thread an element, the CUDA kernel's tiles do not") {
  // ops::Float8Transpose: per index, neighbouring indices read a row apart (priced as a
  // walk); on CUDA, tiles through shared memory read and write along rows, each byte once.
  const ops::Float8Transpose<float8_e4m3> t{nullptr, 300, 200, nullptr};
  const ops::Traffic walked = t.traffic(60000), tiled = t.cuda_traffic(60000);
  check_equal(walked, 60000, 60000, 0, 0);
  CHECK(walked.walk_bytes == 60000);
  check_equal(tiled, 60000, 60000, 0, 0);
  CHECK(tiled.walk_bytes == 0);
  CHECK(cuda_kernel_class<ops::Float8Transpose<float8_e4m3>> == KernelClass::tiles);
  CHECK(cuda_kernel_class<ops::Float8Transpose<float8_e5m2>> == KernelClass::tiles);
}

}  // namespace test_traffic
