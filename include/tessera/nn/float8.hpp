// Float8 GEMMs of a linear layer (ops/float8.hpp holds the recipes' casts and the functors).
//
// float8_gemm casts both operands to float8 (dynamic scaling: each scale from the amax
// of the tensor, row or column as the cast says, taken when it is cast; the weight again
// in the backward, as torchao recasts it there) into the layout a float8 GEMM takes, each
// operand's reduction along its rows (Float8GemmOperand, backend.hpp: cuBLASLt's "TN";
// an operand the GEMM reduces down its columns, as both of the weight gradient's are, is
// transposed as it is cast), then multiplies them one of two ways:
//   - on the backend's own float8 GEMM (HasFloat8Gemm: the CUDA backend's cuBLASLt
//     float8 matmul, fast accumulation where the recipe asks; the dry run records it as
//     a float8 GEMM, which llama-plan prices at float8 rates);
//   - emulated (float8.emulate, and any backend without one: the CPU): the float8 values
//     widened to float (exactly), multiplied by the backend's float GEMM, the sums
//     multiplied by the two inverse scales. The operands are bitwise those the GPU
//     multiplies; only the order of the float sums differs.
//
// Under tensor parallelism an operand may be a piece of the tensor one rank would cast
// (Float8Split): a scale that covers elements on other ranks takes its amax over them
// (an all-reduce of the maxima: exact), so every piece is cast as the whole would be.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/float8.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/float8.hpp"

namespace tessera::nn {

using ops::Float8Cast;
using ops::Float8LinearCasts;
using ops::Float8Recipe;

/// How a tensor a float8 cast reads lies over a tensor-parallel group
/// (parallel/tensor_parallel.hpp): whole on every rank (no group), or each rank holding
/// a piece of it, a range of its rows or of its columns (as stored, before any
/// transpose). A scale whose elements lie on several ranks (a tensorwise cast of a split
/// tensor; a scale per row of a tensor split by columns, per column of one split by rows)
/// takes its amax over the group: each rank's maxima, then an all-reduce of them by max.
/// A maximum is exact in any order, so the scale is the whole tensor's (or row's), bit
/// for bit, and each rank's piece is cast as the piece of the whole tensor's cast. A scale
/// whose elements lie on one rank (per row of a tensor split by rows, or of one every
/// rank holds whole) is that rank's own.
struct Float8Split {
  comm::Communicator* group = nullptr;  // the ranks holding the other pieces (none: whole)
  bool by_rows = false;                 // the pieces are ranges of rows (else of columns)

  static Float8Split rows(comm::Communicator& group) { return {&group, true}; }
  static Float8Split columns(comm::Communicator& group) { return {&group, false}; }
  /// Whether a cast by `axis` takes its amaxes over the group.
  bool spans(ops::Float8Axis axis) const {
    if (group == nullptr) return false;
    if (axis == ops::Float8Axis::tensor) return true;
    return (axis == ops::Float8Axis::rows) != by_rows;  // along the split dimension
  }
};

/// Options of a float8 GEMM: whether to emulate it even where the backend has float8
/// GEMMs, cuBLASLt's fast accumulation (torchao takes it for the forward only), and how
/// each operand (A and B as stored) lies over a tensor-parallel group.
struct Float8GemmOptions {
  bool emulate = true;
  bool fast_accumulation = false;
  Float8Split split_a{}, split_b{};
};

/// An operand cast to float8: its values (rows x cols as stored: the cast tensor's, or its
/// transpose's when `transposed`), the scales and inverses (one, or one per row or column
/// of the cast tensor as its cast says), and the cast.
template <Backend B>
struct Float8Operand {
  Tensor<float8_e4m3> e4m3;  // one of the two, as cast.format says
  Tensor<float8_e5m2> e5m2;
  Tensor<float> scale, inverse;
  Float8Cast cast;
  bool transposed = false;
  std::int64_t rows = 0, cols = 0;

  /// The operand as a float8 GEMM takes it: the reduction along each stored row, so the
  /// scales must be one or one per stored row (`what` names the GEMM in the error).
  Float8GemmOperand gemm_operand(std::string_view what) const {
    const ops::Float8Axis along = transposed ? ops::Float8Axis::columns : ops::Float8Axis::rows;
    TESSERA_CHECK(cast.axis == ops::Float8Axis::tensor || cast.axis == along, what,
                  ": a float8 operand's scales do not run along the GEMM's reduction");
    return {values(), cast.format, rows, cols, inverse.data(), cast.axis != ops::Float8Axis::tensor};
  }

  /// The values' storage, of whichever format the cast made.
  const void* values() const {
    return cast.format == DType::f8e4m3 ? static_cast<const void*>(e4m3.data()) : static_cast<const void*>(e5m2.data());
  }
};

/// A tensor as the float8 scopes below tell tensors apart: its storage, element type,
/// shape and leading dimension (that of the matrix as stored: a one-column tensor's is 1
/// whatever its view says), the x.ld() every cast reads it by.
struct Float8Tensor {
  const void* data = nullptr;
  DType type = DType::f32;
  std::int64_t rows = 0, cols = 0, ld = 0;
  bool operator==(const Float8Tensor&) const = default;
  template <class T>
  static Float8Tensor of(TensorView<const T> x) {
    return {x.data(), dtype_of<T>(), x.rows(), x.cols(), x.cols() <= 1 ? x.cols() : x.ld()};
  }
};

/// While one is open on this thread, casts to float8 on backend B are kept, and a cast of
/// the same tensor (its address, element type, shape and leading dimension) by the same
/// cast, transposed alike, is handed the kept one instead of casting again; by the same
/// tensorwise cast transposed the other way, it takes the kept one's scale (the amax of
/// the same values) and only casts. A layer whose linear layers read one input opens one
/// around them (attention's wq, wk and wv; the feed-forward's w1 and w3), so the input is
/// cast once for the three or two GEMMs, and its transpose once for their weight
/// gradients; a linear layer opens one around its backward, so that the output's gradient
/// (tensorwise) has its amax taken once for the input gradient and the weight gradient,
/// and hands it the scales of x and W its forward took (keep_scale), so that their
/// transposes are cast without another amax.
/// Whoever opens one keeps the tensors alive and unchanged while it is open; one opened
/// inside another sees the outer one's casts too. The values are those of casting each
/// time.
template <Backend B>
class Float8SharedCasts {
 public:
  struct Key {
    Float8Tensor tensor;
    Float8Cast cast;
    bool transpose = false;
    bool operator==(const Key& o) const {
      return tensor == o.tensor && cast.format == o.cast.format && cast.axis == o.cast.axis &&
             cast.power_of_two == o.cast.power_of_two && transpose == o.transpose;
    }
  };

  /// The key of casting `x` by `cast`, transposed or not.
  template <class T>
  static Key key_of(TensorView<const T> x, Float8Cast cast, bool transpose) {
    return Key{Float8Tensor::of(x), cast, transpose};
  }

  Float8SharedCasts() : previous_(current_) { current_ = this; }
  ~Float8SharedCasts() { current_ = previous_; }
  Float8SharedCasts(const Float8SharedCasts&) = delete;
  Float8SharedCasts& operator=(const Float8SharedCasts&) = delete;

  /// The innermost one open on this thread, or none.
  static Float8SharedCasts* current() { return current_; }
  /// The cast kept for `k`, in this one or one open around it.
  const Float8Operand<B>* find(const Key& k) const { return lookup(k, false); }
  /// A kept cast of the same tensor by the same tensorwise cast in the other layout, or
  /// a kept scale of it (keep_scale): its scale is k's. Or none.
  const Float8Operand<B>* find_scale(const Key& k) const {
    if (k.cast.axis != ops::Float8Axis::tensor) return nullptr;
    Key other = k;
    other.transpose = !k.transpose;
    return lookup(other, true);
  }
  void keep(const Key& k, const Float8Operand<B>& q) { kept_.push_back({k, q, false}); }
  /// Keeps a scale (and its inverse) taken earlier of the tensor `k` names, by k's
  /// tensorwise cast: a cast of it in the other layout takes it (find_scale); no cast is
  /// handed it whole (find). A layer's backward keeps its forward's scales so, for the
  /// same values.
  void keep_scale(const Key& k, const Tensor<float>& scale, const Tensor<float>& inverse) {
    TESSERA_CHECK(k.cast.axis == ops::Float8Axis::tensor && scale.data() != nullptr && inverse.data() != nullptr &&
                      scale.numel() == 1 && inverse.numel() == 1,
                  "Float8SharedCasts::keep_scale: one scale of a tensorwise cast");
    Float8Operand<B> q;
    q.scale = scale;
    q.inverse = inverse;
    q.cast = k.cast;
    q.transposed = k.transpose;
    kept_.push_back({k, std::move(q), true});
  }
  std::size_t kept() const { return kept_.size(); }

 private:
  struct Kept {
    Key key;
    Float8Operand<B> operand;
    bool scale_only;  // keep_scale's: no values
  };
  const Float8Operand<B>* lookup(const Key& k, bool scales_too) const {
    for (const Float8SharedCasts* s = this; s != nullptr; s = s->previous_)
      for (const Kept& kept : s->kept_)
        if (kept.key == k && (scales_too || !kept.scale_only)) return &kept.operand;
    return nullptr;
  }

  static inline thread_local Float8SharedCasts* current_ = nullptr;
  Float8SharedCasts* previous_;
  std::vector<Kept> kept_;
};

/// While one is open on this thread, the amax of each row of the tensors kept in it is
/// known: written by the kernel that made the tensor, in the same pass (RMSNorm's forward,
/// ops::RmsNormForward::y_amax; SwiGLU's forward and backward, ops::SwiGluForwardRows
/// and ops::SwiGluBackwardRows), the values RowAbsMax gives. A float8 cast of such a
/// tensor whose scales come from its rows' amaxes (a tensorwise cast, in either layout,
/// or one by rows) takes them from there, with no pass of its own over the tensor; a cast
/// by columns takes its own. A maximum is exact, so the scales are those of taking the
/// amaxes, bit for bit. A layer opens one around the layer that casts what it wrote
/// (nn::LlamaBlock around attention and the feed-forward, the norm's output; the
/// feed-forward around w2, SwiGLU's output, and around w1 and w3's backward, their
/// output gradients).
/// Whoever opens one keeps the tensors alive and unchanged while it is open; one opened
/// inside another sees the outer one's too.
template <Backend B>
class Float8RowAmaxes {
 public:
  Float8RowAmaxes() : previous_(current_) { current_ = this; }
  ~Float8RowAmaxes() { current_ = previous_; }
  Float8RowAmaxes(const Float8RowAmaxes&) = delete;
  Float8RowAmaxes& operator=(const Float8RowAmaxes&) = delete;

  /// Keeps `row_amax` (one float a row of x) as the amaxes of x's rows.
  template <class T>
  void keep(TensorView<const T> x, const Tensor<float>& row_amax) {
    TESSERA_CHECK(row_amax.data() != nullptr && row_amax.numel() == x.rows(),
                  "Float8RowAmaxes::keep: one amax a row of a ", x.rows(), "-row tensor, not ", row_amax.numel());
    kept_.push_back({Float8Tensor::of(x), row_amax});
  }
  /// The amaxes of x's rows, kept in the one open on this thread or one around it, or none.
  template <class T>
  static const Tensor<float>* find(TensorView<const T> x) {
    const Float8Tensor id = Float8Tensor::of(x);
    for (const Float8RowAmaxes* s = current_; s != nullptr; s = s->previous_)
      for (const Kept& k : s->kept_)
        if (k.tensor == id) return &k.row_amax;
    return nullptr;
  }

 private:
  struct Kept {
    Float8Tensor tensor;
    Tensor<float> row_amax;
  };

  static inline thread_local Float8RowAmaxes* current_ = nullptr;
  Float8RowAmaxes* previous_;
  std::vector<Kept> kept_;
};

/// q.scale and q.inverse for casting `x` (rows x cols, leading dimension ld) by `cast`:
/// the amax of each row (or column), and the scales from them (a tensorwise cast's one
/// from all the rows'). The rows' amaxes are the ones the kernel that wrote x kept
/// (Float8RowAmaxes) where it did. Where `split` says x is a piece and a scale spans
/// pieces, the amaxes are reduced over its group first (a tensorwise cast's rows to one
/// value on each rank, then that one value).
template <Backend B, class T>
void take_float8_scales(TensorView<const T> x, Float8Cast cast, Float8Operand<B>& q, const Float8Split& split = {}) {
  using ops::Float8Axis;
  const std::int64_t xr = x.rows(), xc = x.cols(), ld = Float8Tensor::of(x).ld;
  const std::int64_t n_scales = cast.axis == Float8Axis::rows ? xr : cast.axis == Float8Axis::columns ? xc : 1;
  const Tensor<float>* known = cast.axis == Float8Axis::columns ? nullptr : Float8RowAmaxes<B>::find(x);
  const bool agreed = split.spans(cast.axis);
  q.scale = B::template empty<float>(Shape{n_scales});
  q.inverse = B::template empty<float>(Shape{n_scales});
  const double format_max = cast.format == DType::f8e4m3 ? float8_e4m3::max() : float8_e5m2::max();
  Tensor<float> amax;
  if (known != nullptr) {
    amax = *known;
  } else {
    amax = B::template empty<float>(Shape{cast.axis == Float8Axis::columns ? xc : xr});
    if (cast.axis == Float8Axis::columns) {
      B::for_each(xc, ops::ColumnAbsMax<T>{x.data(), ld, xr, amax.data()});
    } else if (cast.axis == Float8Axis::tensor && !agreed) {  // the rows' amaxes and the one scale, in one launch
      B::for_each(xr, ops::RowAbsMaxScale<T>{{x.data(), ld, xc, amax.data()},
                                             {amax.data(), xr, q.scale.data(), q.inverse.data(), format_max,
                                              cast.power_of_two}});
      return;
    } else {
      B::for_each(xr, ops::RowAbsMax<T>{x.data(), ld, xc, amax.data()});
    }
  }
  if (agreed) {
    // Out of place: a kept amax (Float8RowAmaxes) stays this piece's. A tensorwise cast
    // reduces its piece's rows to one value first, so one float crosses the group.
    Tensor<float> over = B::template empty<float>(Shape{n_scales});
    if (cast.axis == Float8Axis::tensor) {
      B::for_each(1, ops::MaxOf{amax.data(), amax.numel(), over.data()});
      split.group->all_reduce(std::span<float>(over.data(), 1), comm::ReduceOp::max);
    } else {
      split.group->all_reduce(std::span<const float>(amax.data(), static_cast<std::size_t>(n_scales)),
                              std::span<float>(over.data(), static_cast<std::size_t>(n_scales)), comm::ReduceOp::max);
    }
    amax = over;
  }
  if (cast.axis == Float8Axis::tensor && !agreed)  // the rows' amaxes (a kernel's that wrote x) to one scale, in one launch
    B::for_each(1, ops::Float8ScaleFromAmaxes{amax.data(), xr, q.scale.data(), q.inverse.data(), format_max,
                                              cast.power_of_two});
  else
    B::for_each(n_scales, ops::Float8ScaleFromAmax{amax.data(), q.scale.data(), q.inverse.data(), format_max,
                                                   cast.power_of_two});
}

/// q's values: x (rows x cols, leading dimension ld) cast by q.cast at q.scale, stored as q
/// lies (rows x cols, or cols x rows where q.transposed), by one QuantizeFloat8; where
/// `straight` is given (q transposed), the same values also as x lies, into its storage
/// (QuantizeFloat8's `straight`: x read once for both).
template <Backend B, class T>
void quantize_float8(TensorView<const T> x, std::int64_t ld, Float8Operand<B>& q, Float8Operand<B>* straight = nullptr) {
  const std::int64_t xr = x.rows(), xc = x.cols(), n = xr * xc;
  const auto run = [&]<class F>(Tensor<F>& out, Tensor<F>* also) {
    out = B::template empty<F>(Shape{q.rows, q.cols});
    if (also != nullptr) *also = B::template empty<F>(Shape{xr, xc});
    B::for_each(n, ops::QuantizeFloat8<T, F>{x.data(), ld, xr, xc, q.scale.data(), q.cast.axis, q.transposed,
                                             out.data(), also != nullptr ? also->data() : nullptr});
  };
  if (q.cast.format == DType::f8e4m3) {
    run(q.e4m3, straight != nullptr ? &straight->e4m3 : nullptr);
  } else {
    TESSERA_CHECK(q.cast.format == DType::f8e5m2, "float8: a cast to ", name_of(q.cast.format), " (not a float8 format)");
    run(q.e5m2, straight != nullptr ? &straight->e5m2 : nullptr);
  }
}

/// `x` (rows x cols, leading dimension ld) cast to float8 by `cast`: amaxes, scales, and
/// the values, stored as x^T (cols x rows) when `transpose`; the kept cast where a
/// Float8SharedCasts open on this thread has one, or the kept scale where it has the
/// same tensorwise cast in the other layout. `split`: how x lies over a tensor-parallel
/// group (take_float8_scales). A cast by rows, not transposed, whose rows lie whole on
/// this rank is one launch (ops::CastRowsFloat8); any other takes its scales first.
template <Backend B, class T>
Float8Operand<B> cast_to_float8(TensorView<const T> x, Float8Cast cast, bool transpose = false,
                                const Float8Split& split = {}) {
  Float8SharedCasts<B>* shared = Float8SharedCasts<B>::current();
  const typename Float8SharedCasts<B>::Key key = Float8SharedCasts<B>::key_of(x, cast, transpose);
  if (shared != nullptr)
    if (const Float8Operand<B>* kept = shared->find(key)) return *kept;
  Float8Operand<B> q;
  q.cast = cast;
  q.transposed = transpose;
  const std::int64_t xr = x.rows(), xc = x.cols(), ld = key.tensor.ld;
  q.rows = transpose ? xc : xr;
  q.cols = transpose ? xr : xc;
  const Float8Operand<B>* twin = shared != nullptr ? shared->find_scale(key) : nullptr;
  if (twin == nullptr && cast.axis == ops::Float8Axis::rows && !transpose && !split.spans(cast.axis)) {
    // Each row its own scale, found within the row: amax, scale and values in one pass.
    q.scale = B::template empty<float>(Shape{xr});
    q.inverse = B::template empty<float>(Shape{xr});
    const Tensor<float>* known = Float8RowAmaxes<B>::find(x);
    const float* amax = known != nullptr ? known->data() : nullptr;
    const double format_max = cast.format == DType::f8e4m3 ? float8_e4m3::max() : float8_e5m2::max();
    if (cast.format == DType::f8e4m3) {
      q.e4m3 = B::template empty<float8_e4m3>(Shape{xr, xc});
      B::for_each(xr, ops::CastRowsFloat8<T, float8_e4m3>{x.data(), ld, xc, amax, format_max, cast.power_of_two,
                                                          q.scale.data(), q.inverse.data(), q.e4m3.data()});
    } else {
      TESSERA_CHECK(cast.format == DType::f8e5m2, "float8: a cast to ", name_of(cast.format), " (not a float8 format)");
      q.e5m2 = B::template empty<float8_e5m2>(Shape{xr, xc});
      B::for_each(xr, ops::CastRowsFloat8<T, float8_e5m2>{x.data(), ld, xc, amax, format_max, cast.power_of_two,
                                                          q.scale.data(), q.inverse.data(), q.e5m2.data()});
    }
    if (shared != nullptr) shared->keep(key, q);
    return q;
  }
  if (twin != nullptr) {
    q.scale = twin->scale;
    q.inverse = twin->inverse;
  } else {
    take_float8_scales<B>(x, cast, q, split);
  }
  quantize_float8<B>(x, ld, q);
  if (shared != nullptr) shared->keep(key, q);
  return q;
}

/// `x` (rows x cols) cast by a tensorwise `cast` into both layouts in one pass: x read
/// once, its values written transposed and as x lies (QuantizeFloat8's `straight`). The
/// operand returned is cast_to_float8(x, cast, false)'s and `*transposed` (where given)
/// cast_to_float8(x, cast, true)'s, bit for bit (one scale, the same elementwise cast).
/// Both are kept in the Float8SharedCasts open on this thread, if one is, where a cast of
/// either layout finds its values; where it already holds the values of either, this is
/// cast_to_float8's, and a scale it holds for either (keep_scale) serves both. For an
/// operand two GEMMs take by one cast in its two layouts: a tensorwise output gradient,
/// dx = dy W and dW = dy^T x (2 bytes a bf16 element read and 2 written, where two casts
/// read 4 and write 2).
template <Backend B, class T>
Float8Operand<B> cast_to_float8_both_layouts(TensorView<const T> x, Float8Cast cast, const Float8Split& split = {},
                                             Float8Operand<B>* transposed = nullptr) {
  using Casts = Float8SharedCasts<B>;
  Casts* shared = Casts::current();
  TESSERA_CHECK(cast.axis == ops::Float8Axis::tensor && (shared != nullptr || transposed != nullptr),
                "cast_to_float8_both_layouts: a tensorwise cast, its transpose handed back or kept in a "
                "Float8SharedCasts");
  const typename Casts::Key as_is = Casts::key_of(x, cast, false), other = Casts::key_of(x, cast, true);
  if (shared != nullptr && (shared->find(as_is) != nullptr || shared->find(other) != nullptr)) {
    if (transposed != nullptr) *transposed = cast_to_float8<B>(x, cast, true, split);
    return cast_to_float8<B>(x, cast, false, split);
  }
  const std::int64_t xr = x.rows(), xc = x.cols();
  Float8Operand<B> q, t;
  q.cast = t.cast = cast;
  q.rows = t.cols = xr;
  q.cols = t.rows = xc;
  t.transposed = true;
  const Float8Operand<B>* kept = nullptr;
  if (shared != nullptr) {
    kept = shared->find_scale(as_is);
    if (kept == nullptr) kept = shared->find_scale(other);
  }
  if (kept != nullptr) {
    q.scale = kept->scale;
    q.inverse = kept->inverse;
  } else {
    take_float8_scales<B>(x, cast, q, split);
  }
  t.scale = q.scale;
  t.inverse = q.inverse;
  quantize_float8<B>(x, as_is.tensor.ld, t, &q);
  if (shared != nullptr) {
    shared->keep(as_is, q);
    shared->keep(other, t);
  }
  if (transposed != nullptr) *transposed = t;
  return q;
}

/// The rows of x on this rank (x split by rows over `group`: sequence parallelism) cast
/// by `cast` (one scale, agreed over the group: Float8Split::rows) and gathered as float8:
/// every row's values, rank t's rows at block t, with the one scale. The cast is
/// elementwise and the scale the whole tensor's, so these are the bytes of gathering x
/// and casting it whole, in half (bf16) or a quarter (float32) of the gather's bytes.
/// The rows' amaxes a kernel that wrote x kept (Float8RowAmaxes) serve the scale.
template <Backend B, class T>
Float8Operand<B> gather_float8_rows(comm::Communicator& group, TensorView<const T> x, Float8Cast cast) {
  TESSERA_CHECK(cast.axis == ops::Float8Axis::tensor, "gather_float8_rows: one scale a tensor (tensorwise), so that "
                "the rows of every rank share it");
  const Float8Operand<B> local = cast_to_float8<B>(x, cast, false, Float8Split::rows(group));
  Float8Operand<B> whole;
  whole.scale = local.scale;
  whole.inverse = local.inverse;
  whole.cast = cast;
  whole.rows = local.rows * group.size();
  whole.cols = local.cols;
  const auto n = static_cast<std::size_t>(local.rows * local.cols);
  const auto bytes = [](const auto* p) { return reinterpret_cast<const std::uint8_t*>(p); };
  const auto out = [](auto* p) { return reinterpret_cast<std::uint8_t*>(p); };
  if (cast.format == DType::f8e4m3) {
    whole.e4m3 = B::template empty<float8_e4m3>(Shape{whole.rows, whole.cols});
    group.all_gather(std::span<const std::uint8_t>(bytes(local.e4m3.data()), n),
                     std::span<std::uint8_t>(out(whole.e4m3.data()), n * static_cast<std::size_t>(group.size())));
  } else {
    whole.e5m2 = B::template empty<float8_e5m2>(Shape{whole.rows, whole.cols});
    group.all_gather(std::span<const std::uint8_t>(bytes(local.e5m2.data()), n),
                     std::span<std::uint8_t>(out(whole.e5m2.data()), n * static_cast<std::size_t>(group.size())));
  }
  return whole;
}

/// Rows [begin, end) of a float8 GEMM operand (its scales with them where it has one a row).
inline Float8GemmOperand rows_of(Float8GemmOperand o, std::int64_t begin, std::int64_t end) {
  o.data = static_cast<const std::uint8_t*>(o.data) + begin * o.k;
  if (o.per_row) o.inverse += begin;
  o.rows = end - begin;
  return o;
}

/// `q` (one scale) with its values transposed: the operand of the same cast of the
/// transposed tensor, for a GEMM that reduces down q's columns (a weight gradient
/// multiplying an input or output gradient gathered in float8).
template <Backend B>
Float8Operand<B> transposed_float8(const Float8Operand<B>& q) {
  TESSERA_CHECK(q.cast.axis == ops::Float8Axis::tensor, "transposed_float8: one scale a tensor (tensorwise)");
  Float8Operand<B> t = q;
  t.rows = q.cols;
  t.cols = q.rows;
  t.transposed = !q.transposed;
  if (q.cast.format == DType::f8e4m3) {
    t.e4m3 = B::template empty<float8_e4m3>(Shape{t.rows, t.cols});
    B::for_each(q.rows * q.cols, ops::Float8Transpose<float8_e4m3>{q.e4m3.data(), q.rows, q.cols, t.e4m3.data()});
  } else {
    t.e5m2 = B::template empty<float8_e5m2>(Shape{t.rows, t.cols});
    B::for_each(q.rows * q.cols, ops::Float8Transpose<float8_e5m2>{q.e5m2.data(), q.rows, q.cols, t.e5m2.data()});
  }
  return t;
}

/// The multiples a float8 GEMM's sizes must be of (cuBLASLt's float8 matmul: its
/// reduction and the second operand's rows, both leading dimensions of 1-byte elements).
inline constexpr std::int64_t kFloat8GemmMultiple = 16;

/// The values of a float8 GEMM operand as floats (exact), rows x k.
template <Backend B>
Tensor<float> float8_values(const Float8GemmOperand& o) {
  Tensor<float> f = B::template empty<float>(Shape{o.rows, o.k});
  const std::int64_t n = o.rows * o.k;
  if (o.format == DType::f8e4m3)
    B::for_each(n, ops::Float8ToFloat<float8_e4m3>{static_cast<const float8_e4m3*>(o.data), f.data()});
  else
    B::for_each(n, ops::Float8ToFloat<float8_e5m2>{static_cast<const float8_e5m2*>(o.data), f.data()});
  return f;
}

/// The float8 values of `q` as floats (exact), as stored: rows x cols.
template <Backend B>
Tensor<float> float8_values(const Float8Operand<B>& q) {
  return float8_values<B>(Float8GemmOperand{q.values(), q.cast.format, q.rows, q.cols, q.inverse.data(), false});
}

/// C = (a b^T) * a.inverse[.] * b.inverse[.] + beta C for two operands already in float8
/// (C is m x n, a m x k, b n x k): on the backend's float8 GEMM unless `options.emulate`
/// or the backend has none, else emulated. `what` names the GEMM in errors. `c_in`: the
/// C that beta multiplies, read apart from the `c` written (of its shape and leading
/// dimension: a residual the sum goes onto), or empty for c itself.
template <Backend B, class C>
void float8_multiply(Float8GemmOperand a, Float8GemmOperand b, float beta, TensorView<C> c, std::string_view what,
                     Float8GemmOptions options, TensorView<const C> c_in = {}) {
  const GemmSizes s = check_float8_gemm(a, b, c, /*scales_alike=*/false);
  const bool apart = c_in.data() != nullptr && c_in.data() != c.data();
  if (apart) check_float8_gemm_input(c_in, c);
  if (s.m == 0 || s.n == 0) return;
  if constexpr (HasFloat8Gemm<B>) {
    if (!options.emulate) {
      TESSERA_CHECK(s.k % kFloat8GemmMultiple == 0 && s.n % kFloat8GemmMultiple == 0, what,
                    ": a float8 GEMM needs its reduction and its output's columns in multiples of ",
                    kFloat8GemmMultiple, " (cuBLASLt), not k = ", s.k, ", n = ", s.n, " (m = ", s.m,
                    "); set float8.emulate = true or keep the layer out by float8.filter_fqns");
      // cuBLASLt scales both operands alike: a single scale beside a scaled-by-row operand
      // is given to each of its rows.
      Tensor<float> spread;
      for (Float8GemmOperand* o : {&a, &b})
        if (!o->per_row && (a.per_row || b.per_row)) {
          spread = B::template empty<float>(Shape{o->rows});
          B::for_each(o->rows, ops::Float8ScaleBroadcast{o->inverse, spread.data()});
          o->inverse = spread.data();
          o->per_row = true;
        }
      if constexpr (HasOutOfPlaceFloat8Gemm<B>) {
        if (apart) {
          B::gemm_float8(a, b, beta, c_in, c, options.fast_accumulation);
          return;
        }
      }
      B::gemm_float8(a, b, apart ? 0.0f : beta, c, options.fast_accumulation);
      if (apart && beta != 0.0f) add_scaled<B>(beta, c_in, c, what);
      return;
    }
  }
  const Tensor<float> va = float8_values<B>(a), vb = float8_values<B>(b);
  Tensor<float> sum = B::template empty<float>(Shape{s.m, s.n});
  B::gemm(Trans::no, Trans::yes, 1.0f, va.cview(), vb.cview(), 0.0f, sum.view());
  // C read apart: the product rounded to C's type, then beta C added and rounded (as the
  // CPU backend's out-of-place gemm, and cuBLASLt with a bf16 C).
  B::for_each(s.m * s.n, ops::Float8GemmScale<C>{sum.data(), s.n, a.inverse, a.per_row, b.inverse, b.per_row,
                                                 apart ? 0.0f : beta, c.data(), c.cols() <= 1 ? c.cols() : c.ld()});
  if (apart && beta != 0.0f) add_scaled<B>(beta, c_in, c, what);
}

/// The cast of op(A) a float8 GEMM takes (m x k, the reduction along its rows), by
/// `cast`, whose axis must run along the reduction (`what` names the GEMM in the error);
/// `split`: how A lies over a tensor-parallel group.
template <Backend B, class T>
Float8Operand<B> cast_first_operand(Trans ta, TensorView<const T> a, Float8Cast cast, std::string_view what,
                                    const Float8Split& split = {}) {
  const ops::Float8Axis along = ta == Trans::no ? ops::Float8Axis::rows : ops::Float8Axis::columns;
  TESSERA_CHECK(cast.axis == ops::Float8Axis::tensor || cast.axis == along, what,
                ": the first operand's float8 scales do not run along the GEMM's reduction");
  return cast_to_float8<B>(a, cast, ta == Trans::yes, split);
}

/// C = (op(A) op(B)) / (scale_a scale_b) + beta C, A and B cast to float8 by `cast_a` and
/// `cast_b`: a scale per row of op(A) or one, per column of op(B) or one (each cast's
/// axis must run along the reduction: `what` names the GEMM in the error). `c_in`: the C
/// beta multiplies, read apart from the `c` written, or empty (float8_multiply). Where
/// `options` says A or B is a piece of a tensor split over a tensor-parallel group, its
/// scales are the whole tensor's (Float8Split).
template <Backend B, class T, class C>
void float8_gemm(Trans ta, Trans tb, TensorView<const T> a, Float8Cast cast_a, TensorView<const T> b, Float8Cast cast_b,
                 float beta, TensorView<C> c, std::string_view what, Float8GemmOptions options = {},
                 TensorView<const C> c_in = {}) {
  using ops::Float8Axis;
  const auto [m, n, k] = check_gemm(ta, tb, a, b, c);
  const Float8Axis b_along = tb == Trans::no ? Float8Axis::columns : Float8Axis::rows;
  const Float8Operand<B> qa = cast_first_operand<B>(ta, a, cast_a, what, options.split_a);
  TESSERA_CHECK(cast_b.axis == Float8Axis::tensor || cast_b.axis == b_along, what,
                ": the second operand's float8 scales do not run along the GEMM's reduction");
  if (m == 0 || n == 0) return;
  // Both as a float8 GEMM takes them: op(A) (m x k) and op(B)^T (n x k), k along the rows.
  const Float8Operand<B> qb = cast_to_float8<B>(b, cast_b, tb == Trans::no, options.split_b);
  float8_multiply<B>(qa.gemm_operand(what), qb.gemm_operand(what), beta, c, what, options, c_in);
}

/// C = op(A) W^T / (scale_a scale_w) + beta C with W already in float8 (`w`: n x k, the
/// reduction along its rows: FSDP's float8 all-gather), A cast by `cast_a`.
template <Backend B, class T, class C>
void float8_gemm(Trans ta, TensorView<const T> a, Float8Cast cast_a, const Float8GemmOperand& w, float beta,
                 TensorView<C> c, std::string_view what, Float8GemmOptions options = {}, TensorView<const C> c_in = {}) {
  const Float8Operand<B> qa = cast_first_operand<B>(ta, a, cast_a, what, options.split_a);
  float8_multiply<B>(qa.gemm_operand(what), w, beta, c, what, options, c_in);
}

}  // namespace tessera::nn
