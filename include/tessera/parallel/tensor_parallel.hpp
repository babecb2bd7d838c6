// Tensor parallelism, with or without sequence parallelism, and loss parallelism, as
// torchtitan (and, without sequence parallelism, Megatron-LM) lays Llama out.
//
// Activations are (R, dim) matrices of R = batch * seq_len rows. A block's regions
// (attention, feed-forward) split heads and hidden units over the N ranks of the tp
// group: column-parallel wq, wk, wv | w1, w3 (each rank its own heads / hidden units),
// then row-parallel wo | w2, whose outputs are partial sums over the ranks. Between the
// regions, where norms and residual adds run, the rows are laid out one of two ways:
//
//   sequence parallel (the default): split by rows, rank t holding rows
//   [t R/N, (t+1) R/N). A region runs
//     x (R/N rows) --all-gather--> x (R rows) --region--> partial sums (R rows)
//       --reduce-scatter--> y (R/N rows)
//   and its backward mirrors it: the row-sharded gradient is all-gathered, the input
//   gradient (a partial sum, each rank contributed its heads) reduce-scattered.
//
//   without (parallelism.disable_sequence_parallel): every rank holds every row. A
//   region's entry is the identity forward and an all-reduce of the input gradient
//   backward; its exit an all-reduce of the partial sums forward and the identity
//   backward (Megatron-LM's f and g). Norms and residual adds run on every row on every
//   rank, so their work and their activations are N times the split layout's, for the
//   same bytes on the wire (an all-reduce moves what a gather and a reduce-scatter do).
//
// whole_rows(), summed_rows() and own_rows() move between these layouts and the whole
// rows a region reads, so a layer is written once for both.
//
// Asynchronous tensor parallelism (parallelism.enable_async_tensor_parallel, torchtitan's
// async TP; sequence parallel only): a region's gather and its reduce-scatter are cut
// into one transfer per peer, each beside a GEMM on rows already at hand.
// whole_rows_overlapped() hands the GEMM this rank's rows first, then each peer's as they
// arrive; summed_rows_overlapped() has the GEMM write each peer's rows of the partial
// sums first, sends them while it writes the next, and sums the pieces it received last.
// The bytes are the collectives'; what changes is that the GEMM no longer waits for all
// of them (the transfers run on the communication stream, plan/timeline.hpp prices the
// overlap). The gathered rows are the gather's bit for bit and the sum is a host engine's
// reduce-scatter's (ops::SumOfPieces); a GEMM run a block of rows at a time may round
// otherwise than the whole one (OpenBLAS and cuBLASLt block each call their own way), so
// a run matches the collectives' within the parity bar, not to the bit. Row shards of the flattened
// (batch * seq) dimension are torchtitan's Shard(1) of (batch, seq, dim) when batch = 1;
// every op between regions works row by row, so any row split gives the same values.
//
// The embedding is split by vocabulary (row-parallel): each rank looks up the ids in
// its range, zeros elsewhere, and the sum is brought to the layout (reduce-scattered,
// or all-reduced). The output projection is split by vocabulary too and the
// cross-entropy is computed without gathering the logits (loss parallelism: the row
// maximum and the sum of exponentials are all-reduced, nn/output.hpp). With loss
// parallelism disabled the output projection stays whole on every rank.
//
// Key/value heads: with N <= n_kv_heads each rank takes n_kv_heads / N of them; with
// N > n_kv_heads (N a multiple of n_kv_heads) each kv head is held by N / n_kv_heads
// ranks, the ones whose query heads read it, and its gradient is summed over them.
//
// A parameter is initialised as its piece directly (piece_index maps the piece's
// elements to the whole's, so the values are the whole's), or made whole (loaded, the
// same on every rank) and narrow() then keeps this rank's piece; gather_whole() puts the
// pieces back together for saving.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/float8.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/block_args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/ops/traffic.hpp"
#include "tessera/parallel/wording.hpp"

namespace tessera::parallel {

/// The mesh's tensor-parallel degree as `wording` names it: by its config key, or in words.
inline nn::TensorParallelDegree mesh_degree(int degree, Wording wording) {
  return {degree, wording(settings::tensor_parallel_degree, degree)};
}

/// Whether `tp` splits the model's attention heads: each rank computes n_heads / degree
/// query heads, and the key/value heads are split the same way or, with more ranks than
/// kv heads, each held by the ranks whose query heads read it. nn::Attention checks it as
/// it is made; the model, before it makes anything.
inline void check_heads_split(const nn::ModelArgs& a, const nn::TensorParallelDegree& tp) {
  tp.check_divides(a.n_heads, "n_heads =", "each rank computes n_heads / degree query heads");
  const std::int64_t kv = a.kv_heads();
  TESSERA_CHECK(kv % tp.degree == 0 || tp.degree % kv == 0, tp.named, " and n_kv_heads = ", kv,
                ": one must divide the other (fewer kv heads than ranks are replicated over the ranks that read them)");
}

/// Whether `tp` splits what the model itself holds, whatever its blocks: the attention
/// heads (the model's attention shape: its rotary table, the library's Attention), the
/// vocabulary (the embedding and the output are split by it), and tied embeddings only
/// with loss parallelism. `wording` names the loss-parallel setting.
inline void check_model_split(const nn::ModelArgs& a, const nn::TensorParallelDegree& tp, bool loss_parallel,
                              Wording wording) {
  if (tp.degree <= 1) return;
  check_heads_split(a, tp);
  tp.check_divides(a.vocab_size, "vocab_size =", "the embedding and the output are split by vocabulary");
  TESSERA_CHECK(loss_parallel || !a.tie_embeddings,
                wording.pick("parallelism.disable_loss_parallel = true", "loss parallelism off (Plan::loss_parallel)"),
                " with tied embeddings (", a.flavor, ") and tensor parallelism: the output shares the "
                "vocabulary-split embedding, so it needs loss parallelism");
}

/// Whether `tp` splits a model of `Block`s (bare, or wrapped in tessera::Parallel) given
/// `options`: the model's own parts, then what the block states of itself
/// (nn::ChecksTensorParallel; a block that states nothing has each split layer check
/// itself as it is made). Every rank checks the same arguments, so every rank fails the
/// same way before any collective, also a pipeline rank that holds no block.
template <class Block>
void check_tensor_parallel(const nn::ModelArgs& a, const nn::block_options_t<Block>& options,
                           const nn::TensorParallelDegree& tp, bool loss_parallel, Wording wording) {
  if (tp.degree <= 1) return;
  check_model_split(a, tp, loss_parallel, wording);
  using Bare = nn::bare_block_t<Block>;
  if constexpr (requires { &Bare::check_tensor_parallel; }) {
    static_assert(nn::ChecksTensorParallel<Bare>,
                  "tessera: a block's check_tensor_parallel must be `static void check_tensor_parallel(const "
                  "nn::ModelArgs&, const options_type&, const nn::TensorParallelDegree&)` (options_type: "
                  "nn::NoBlockOptions for a block without options)");
    Bare::check_tensor_parallel(a, options, tp);
  }
}

/// This rank's tensor-parallel group: the communicator, and what the layers ask of it.
/// Degree 1 (no communicator) makes every collective here the identity.
class TensorParallelGroup {
 public:
  TensorParallelGroup() = default;
  explicit TensorParallelGroup(comm::Communicator* comm, bool loss_parallel = true, bool sequence_parallel = true,
                               bool overlapped = false)
      : comm_(comm && comm->size() > 1 ? comm : nullptr),
        loss_parallel_(loss_parallel),
        sequence_parallel_(sequence_parallel),
        overlapped_(overlapped && sequence_parallel) {}
  TensorParallelGroup(const TensorParallelGroup&) = delete;
  TensorParallelGroup& operator=(const TensorParallelGroup&) = delete;

  int degree() const { return comm_ ? comm_->size() : 1; }
  int rank() const { return comm_ ? comm_->rank() : 0; }
  bool active() const { return comm_ != nullptr; }
  /// The output split by vocabulary and the loss computed without gathering logits.
  bool loss_parallel() const { return loss_parallel_; }
  /// Between the regions each rank holds its share of the rows (true), or every row.
  bool sequence_parallel() const { return sequence_parallel_; }
  /// The regions' gathers and reduce-scatters cut into one transfer per peer, each beside
  /// a GEMM (asynchronous tensor parallelism; under sequence parallelism only).
  bool overlapped() const { return overlapped_ && active(); }
  /// The rows this rank holds between the regions, of `rows` in all.
  std::int64_t rows_held(std::int64_t rows) const { return sequence_parallel_ ? rows / degree() : rows; }
  comm::Communicator& comm() {
    TESSERA_CHECK(comm_, "tensor parallelism: no communicator at degree 1");
    return *comm_;
  }

  /// An even split along `dim`: rank t holds piece t of N.
  nn::TensorSplit split(int dim) const { return pieces(dim, degree()); }
  /// Whole on every rank.
  nn::TensorSplit whole() const { return pieces(0, 1); }
  /// `parts` pieces along `dim` (parts divides the degree or the degree divides parts);
  /// with fewer pieces than ranks, rank t holds piece t / (N / parts).
  nn::TensorSplit pieces(int dim, std::int64_t parts) const {
    const int n = degree();
    if (parts >= n) return nn::TensorSplit{dim, n, rank(), 1, true};
    const int holders = n / static_cast<int>(parts);
    return nn::TensorSplit{dim, static_cast<int>(parts), rank() / holders, holders, rank() % holders == 0};
  }

  /// The communicator over the ranks holding the same piece as this one, when
  /// `holders` ranks hold each piece. Every rank of the group must ask for the same
  /// `holders` in the same order the first time (the split is collective).
  comm::Communicator& holders_comm(int holders) {
    if (holders == degree()) return comm();
    auto it = holders_.find(holders);
    if (it == holders_.end())
      it = holders_.emplace(holders, std::make_unique<comm::Communicator>(comm().split_strided(1, holders))).first;
    return *it->second;
  }

 private:
  comm::Communicator* comm_ = nullptr;
  bool loss_parallel_ = true;
  bool sequence_parallel_ = true;
  bool overlapped_ = false;
  std::map<int, std::unique_ptr<comm::Communicator>> holders_;
};

/// Whether `tp` splits anything (a null group is degree 1).
inline bool active(const TensorParallelGroup* tp) { return tp && tp->active(); }

/// Whether `tp` splits the rows between the regions.
inline bool splits_rows(const TensorParallelGroup* tp) { return active(tp) && tp->sequence_parallel(); }

/// The degree of `tp` as the layer `layer` names it in its own check ("layers.0.attention:
/// the tensor-parallel degree 3"), run as the layer is made. Inside a model what the model
/// and its block state is checked before that (check_tensor_parallel), naming the degree
/// as the plan gives it.
inline nn::TensorParallelDegree layer_degree(std::string_view layer, const TensorParallelGroup& tp) {
  return {tp.degree(), tessera::detail::concat(layer, ": the tensor-parallel degree ", tp.degree())};
}

/// Refuses a split of `p` its whole shape does not allow, naming the parameter and the
/// shape: a layer checks its parameters as it makes them (nn::Linear), so a width the
/// degree does not divide is refused before anything is allocated.
template <class T>
void check_split(const nn::Parameter<T>& p) {
  const nn::TensorSplit& s = p.split;
  const Shape& w = p.whole;
  if (!s.split()) return;
  TESSERA_CHECK(s.dim >= 0 && s.dim < w.rank && w.rank <= 2 && w.dims[s.dim] % s.parts == 0, p.name, ": shape ",
                w.str(), " does not split into ", s.parts, " pieces along dimension ", s.dim);
}

/// The rows this rank holds between the regions -> every row, for a region to read:
/// (R/N, c) on each rank -> (R, c), rank t's rows at block t; already whole without
/// sequence parallelism.
template <Backend B, class T>
Tensor<T> whole_rows(TensorParallelGroup* tp, const Tensor<T>& x) {
  if (!splits_rows(tp)) return x;
  const std::int64_t n = tp->degree();
  Tensor<T> y = B::template empty<T>(Shape{x.size(0) * n, x.size(1)});
  if constexpr (sizeof(T) == 1 && !std::is_integral_v<T>) {  // float8 values, as their bytes
    const auto count = static_cast<std::size_t>(x.numel());
    tp->comm().all_gather(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(x.data()), count),
                          std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(y.data()), count * n));
  } else {
    tp->comm().all_gather(std::span<const T>(x.data(), static_cast<std::size_t>(x.numel())),
                          std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  }
  return y;
}

/// (R, c) partial sums on each rank -> the rows this rank holds of their sum: rank t's
/// (R/N, c) under sequence parallelism, else all of them. Out of place either way: x
/// may be an output a checkpoint policy keeps.
template <Backend B, class T>
Tensor<T> summed_rows(TensorParallelGroup* tp, const Tensor<T>& x) {
  if (!active(tp)) return x;
  if (!tp->sequence_parallel()) {
    Tensor<T> y = B::template empty<T>(x.shape());
    tp->comm().all_reduce(std::span<const T>(x.data(), static_cast<std::size_t>(x.numel())),
                          std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
    return y;
  }
  const std::int64_t n = tp->degree();
  TESSERA_CHECK(x.size(0) % n == 0, "tensor parallelism: ", x.size(0), " rows do not split over ", n, " ranks");
  Tensor<T> y = B::template empty<T>(Shape{x.size(0) / n, x.size(1)});
  tp->comm().reduce_scatter(std::span<const T>(x.data(), static_cast<std::size_t>(x.numel())),
                            std::span<T>(y.data(), static_cast<std::size_t>(y.numel())));
  return y;
}

/// Whether a region's collectives run cut into its GEMMs (whole_rows_overlapped,
/// summed_rows_overlapped).
inline bool overlaps(const TensorParallelGroup* tp) { return splits_rows(tp) && tp->overlapped(); }

namespace detail {
/// The element type a transfer of T elements moves as: float8 values as their bytes.
template <class T>
constexpr comm::DataType moved_as() {
  if constexpr (std::is_same_v<T, float8_e4m3> || std::is_same_v<T, float8_e5m2>)
    return comm::DataType::u8;
  else
    return comm::data_type_of<T>();
}
}  // namespace detail

/// whole_rows(x) (x of any element type the layers move, float8 among them), with
/// `consume(y, begin, end)` called on the gathered y's rows
/// [begin, end) of each rank as they are there: this rank's first, then rank r + 1's,
/// r + 2's, ... (modulo the degree), each while the rows after it are on their way. Not
/// overlapped (overlaps() false): the rows gathered whole, then consume(y, 0, rows) once.
/// Step s of the transfers sends this rank's rows to rank r - s and takes rank r + s's:
/// every rank issues the same steps in the same order, so NCCL's matching holds.
template <Backend B, class T, class F>
Tensor<T> whole_rows_overlapped(TensorParallelGroup* tp, const Tensor<T>& x, F&& consume) {
  if (!overlaps(tp)) {
    Tensor<T> y = whole_rows<B>(tp, x);
    consume(y, std::int64_t{0}, y.size(0));
    return y;
  }
  const int n = tp->degree(), r = tp->rank();
  const std::int64_t m = x.size(0), cols = x.size(1);
  const auto count = static_cast<std::size_t>(m * cols);
  Tensor<T> y = B::template empty<T>(Shape{m * n, cols});
  B::for_each(x.numel(), ops::Copy<T>{x.data(), y.data() + r * m * cols});
  std::vector<comm::Handle> arriving;
  for (int s = 1; s < n; ++s) {
    const int to = (r - s + n) % n, from = (r + s) % n;
    const comm::PeerOp step[] = {
        {comm::PeerOp::Kind::send, to, const_cast<T*>(x.data()), count, detail::moved_as<T>()},
        {comm::PeerOp::Kind::recv, from, y.data() + from * m * cols, count, detail::moved_as<T>()}};
    arriving.push_back(tp->comm().send_recv_async(step));
  }
  consume(y, r * m, (r + 1) * m);
  for (int s = 1; s < n; ++s) {
    arriving[static_cast<std::size_t>(s - 1)].wait();
    const std::int64_t from = (r + s) % n;
    consume(y, from * m, (from + 1) * m);
  }
  return y;
}

/// summed_rows of the (rows, cols) partial sums `produce(p, begin, end)` writes into p's
/// rows [begin, end): called for rank r + 1's rows first, then r + 2's, ... and this
/// rank's last, each peer's rows sent to it while the next are made; the pieces this rank
/// receives are summed in rank order (ops::SumOfPieces). Not overlapped: produce(p, 0,
/// rows) once, then summed_rows(p).
template <Backend B, class T, class F>
Tensor<T> summed_rows_overlapped(TensorParallelGroup* tp, std::int64_t rows, std::int64_t cols, F&& produce) {
  Tensor<T> partial = B::template empty<T>(Shape{rows, cols});
  if (!overlaps(tp)) {
    produce(partial, std::int64_t{0}, rows);
    return summed_rows<B>(tp, partial);
  }
  const int n = tp->degree(), r = tp->rank();
  TESSERA_CHECK(rows % n == 0, "tensor parallelism: ", rows, " rows do not split over ", n, " ranks");
  const std::int64_t m = rows / n;
  const auto count = static_cast<std::size_t>(m * cols);
  // Every other rank's piece of this rank's rows: rank q's at block q, or q - 1 past r.
  Tensor<T> received = B::template empty<T>(Shape{rows - m, cols});
  std::vector<comm::Handle> sent;
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n, from = (r - s + n) % n;
    produce(partial, to * m, (to + 1) * m);
    const comm::PeerOp step[] = {
        {comm::PeerOp::Kind::send, to, partial.data() + to * m * cols, count, comm::data_type_of<T>()},
        {comm::PeerOp::Kind::recv, from, received.data() + (from < r ? from : from - 1) * m * cols, count,
         comm::data_type_of<T>()}};
    sent.push_back(tp->comm().send_recv_async(step));
  }
  produce(partial, r * m, (r + 1) * m);
  for (comm::Handle& h : sent) h.wait();
  Tensor<T> y = B::template empty<T>(Shape{m, cols});
  B::for_each(y.numel(), ops::SumOfPieces<T>{received.data(), m * cols, partial.data() + r * m * cols, r, n, y.data()});
  return y;
}

/// The rows this rank holds of an (R, c) tensor every rank holds whole: rank t's, as a
/// tensor of its own, under sequence parallelism; else x itself.
template <Backend B, class T>
Tensor<T> own_rows(TensorParallelGroup* tp, const Tensor<T>& x) {
  if (!splits_rows(tp)) return x;
  const std::int64_t rows = x.size(0) / tp->degree(), cols = x.size(1);
  Tensor<T> y = B::template empty<T>(Shape{rows, cols});
  B::for_each(y.numel(), ops::Copy<T>{x.data() + tp->rank() * rows * cols, y.data()});
  return y;
}

/// Adds `contribution` (this rank's part of p's gradient) summed over the ranks holding
/// the same piece into p's gradient; on a piece held by one rank, adds it. The step's
/// first write copies it (layer.hpp's first-write rule).
template <Backend B, class T>
void accumulate_over_holders(TensorParallelGroup* tp, Tensor<accum_t<T>>& contribution, nn::Parameter<T>& p) {
  using A = accum_t<T>;
  if (active(tp) && p.split.holders > 1)
    tp->holders_comm(p.split.holders)
        .all_reduce(std::span<A>(contribution.data(), static_cast<std::size_t>(contribution.numel())));
  if (p.grad_write_beta() == A(0))
    B::for_each(p.grad.numel(), ops::Copy<A>{contribution.data(), p.grad.data()});
  else
    B::for_each(p.grad.numel(), ops::Axpy<A>{A(1), contribution.data(), p.grad.data()});
}

namespace detail {
/// Row r of a (prow, pcol) piece at (r0, c0) of a matrix with `cols` columns: copied
/// into the piece, or back into the whole.
template <class T>
struct CopyPieceRow {
  T* whole;
  T* piece;
  std::int64_t cols, pcol, r0, c0;
  bool into_piece;
  TESSERA_HD void operator()(std::int64_t r) const {
    T* w = whole + (r0 + r) * cols + c0;
    T* p = piece + r * pcol;
    for (std::int64_t c = 0; c < pcol; ++c) {
      if (into_piece)
        p[c] = w[c];
      else
        w[c] = p[c];
    }
  }
  // pcol elements a row read and written, whichever way the copy goes.
  ops::Traffic traffic(std::int64_t rows) const {
    const double e = static_cast<double>(rows) * static_cast<double>(pcol);
    ops::Traffic t{e * sizeof(T), e * sizeof(T), 0, 0};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

/// Copies piece `index` along dim (0 or 1) of a rank-1/2 tensor `whole` into `piece`, or
/// back. A vector is one row: its pieces are column ranges.
template <Backend B, class T>
void copy_piece(const Tensor<T>& whole, const Tensor<T>& piece, int dim, int index, bool into_piece) {
  const bool matrix = whole.shape().rank >= 2;
  const std::int64_t cols = matrix ? whole.size(1) : whole.size(0);
  const std::int64_t prow = matrix ? piece.size(0) : 1;
  const std::int64_t pcol = matrix ? piece.size(1) : piece.size(0);
  const bool by_rows = matrix && dim == 0;
  const std::int64_t r0 = by_rows ? index * prow : 0, c0 = by_rows ? 0 : index * pcol;
  B::for_each(prow, CopyPieceRow<T>{whole.data(), piece.data(), cols, pcol, r0, c0, into_piece});
}
}  // namespace detail

/// Where element `first + i` of this rank's piece of `p` lies in the whole parameter
/// (the identity for a parameter that is not split): copy_piece's layout, as an index
/// map, so that a piece is initialised (or read) as the elements of the whole it holds.
template <class T>
ops::PieceIndex piece_index(const nn::Parameter<T>& p, std::int64_t first) {
  const Shape& w = p.whole;
  const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  if (!p.split.split() || w.rank < 1) return ops::PieceIndex{u(first), 1, 1, 0, 0};
  const nn::TensorSplit& s = p.split;
  check_split(p);
  const bool matrix = w.rank == 2;
  const std::int64_t rows = matrix ? w.dims[0] : 1, cols = matrix ? w.dims[1] : w.dims[0];
  if (matrix && s.dim == 0) return ops::PieceIndex{u(first), u(cols), u(cols), u(s.index * (rows / s.parts)), 0};
  const std::int64_t pcols = cols / s.parts;
  return ops::PieceIndex{u(first), u(cols), u(pcols), 0, u(s.index * pcols)};
}

/// Keeps this rank's piece of a whole parameter (value and a zeroed gradient); a no-op
/// for a parameter that is not split or already narrowed.
template <Backend B, class T>
void narrow(nn::Parameter<T>& p) {
  if (!p.split.split() || p.value.shape() != p.whole) return;
  const nn::TensorSplit& s = p.split;
  check_split(p);
  // The piece is allocated as any parameter's storage is (beside the rest of its
  // ParameterStack, where it has one), then filled from the whole.
  const Tensor<T> whole = p.value;
  p.template allocate<B>(p.piece_shape());
  detail::copy_piece<B>(whole, p.value, s.dim, s.index, true);
}

/// The whole value of a narrowed parameter, put together from every rank's piece
/// (collective over the tp group); the value itself if it is not split.
template <Backend B, class T>
Tensor<T> gather_whole(TensorParallelGroup* tp, const nn::Parameter<T>& p) {
  if (!p.split.split() || p.value.shape() == p.whole) return p.value;
  TESSERA_CHECK(active(tp), p.name, ": split over ", p.split.parts, " tensor-parallel ranks, but no group to gather from");
  const int n = tp->degree();
  const std::int64_t piece_numel = p.value.numel();
  Tensor<T> all = B::template empty<T>(Shape{piece_numel * n});
  tp->comm().all_gather(std::span<const T>(p.value.data(), static_cast<std::size_t>(piece_numel)),
                        std::span<T>(all.data(), static_cast<std::size_t>(all.numel())));
  Tensor<T> whole = B::template empty<T>(p.whole);
  // Piece k comes from its first holder, rank k * holders.
  for (int k = 0; k < p.split.parts; ++k)
    detail::copy_piece<B>(whole, all.slice(static_cast<std::int64_t>(k) * p.split.holders * piece_numel, p.value.shape()),
                       p.split.dim, k, false);
  return whole;
}

}  // namespace tessera::parallel
