// Context parallelism: each sequence split over the cp ranks of a group, attention as a
// ring (the load-balanced ring attention torchtitan and Megatron-LM run for Llama).
//
// The split. A sequence of S tokens is cut into 2 cp chunks of c = S / (2 cp); rank i
// holds chunks i and 2 cp - 1 - i (the head-tail balance: under a causal mask chunk j
// attends over j + 1 chunks, so every rank's pair attends over 2 cp + 1 chunks; with
// parallelism.context_parallel_load_balancer = "none", chunks 2i and 2i + 1, so rank i's
// pair attends over 4i + 3 and the last rank's work sets the step's pace). Its
// rows are chunk-major, the first chunk of every sequence then the second
// (ops/positions.hpp), so a chunk is one (batch, c) block. context_tokens() makes that
// layout from whole sequences; everything but attention and RoPE works row by row and
// never sees the difference, and RoPE rotates each row by its global position
// (nn::Geometry::positions).
//
// The forward ring. Each rank packs its keys and values into one buffer and, over cp
// steps, attends with the buffer it holds while passing it on: at step s it holds the
// keys of rank (i - s) mod cp, sends them to rank i + 1 and receives the next from rank
// i - 1, one send/recv group issued before the step's attention and waited on after it,
// so the transfer runs beside the compute. Each (query chunk, key chunk) pair is causal
// when the chunks are the same, full when the key chunk comes earlier and skipped when
// it comes later; every rank computes three blocks at step 0 and two at every other.
// Each block's output and log-sum-exp are merged into running ones in accum_t<T>
// (ops/attention_merge.hpp), rounded to T once at the end: o is exactly softmax(q K^T) V
// over the whole sequence, up to rounding.
//
// The backward ring. Given the merged o and lse, a block's backward is the whole
// attention's restricted to the block (P = exp(S - lse), D = rowsum(dO o)), so the
// backends' attention backward runs per block unchanged. Keys and values go round again;
// each rank adds a block's dq into its own, and its dk and dv into the running gradient
// of the keys it holds, which travels one step behind them: after computing step s the
// rank sends the running dk, dv of the keys it held to rank i + 1 and receives those of
// the keys it will hold next, in one group every rank issues at the same step (so no
// rank waits on a later group), waited on at step s + 1 once that step's blocks are
// computed (summed apart meanwhile, then added in). After the last step the gradients
// have gone round to their keys' rank.
//
// Packed documents (AttentionShape::documents: each local row's document in whole-
// sequence positions). A block masks them as a whole-sequence call would: each query
// sees the block's keys from its document's first on, and a key is seen by the queries
// of its own document (ops::BlockDocuments computes both bounds from the query chunk's
// rows alone, so no span travels the ring). A query may see no key of a full block (its
// document begins after it): the block gives it lse -inf, which the merge skips, and
// the diagonal block always gives it its own key.
//
// Traffic per attention call and rank: (cp - 1) times the local keys and values forward;
// as much again backward, plus cp times their gradients (accum_t<T>).
//
// All-gathered keys (parallelism.context_parallel_rotate_method = "allgather", torchtitan's
// default; the ring is its "alltoall"). The keys and values of every rank are gathered at
// once, while the rank computes its blocks with its own; then it computes the other
// ranks' blocks in the ring's order (so the forward's merge, and its result, are the
// ring's bit for bit). The backward gathers them again, sums each block's gradients of the
// keys into the slot of the rank they came from, and one reduce-scatter brings each
// rank the sum for its own keys. The same bytes as the ring, in two collectives an
// attention call instead of cp - 1 exchanges, one of them (the reduce-scatter) waited on
// with nothing beside it; and cp times the keys and values held at once.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/attention_merge.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/positions.hpp"
#include "tessera/parallel/plan.hpp"

namespace tessera::parallel {

/// The ranks that hold parts of the same sequences: the mesh's cp dimension.
class ContextParallelGroup {
 public:
  /// Degree 1: every rank holds whole sequences.
  ContextParallelGroup() = default;
  /// `comm` must outlive the group.
  explicit ContextParallelGroup(comm::Communicator* comm, ContextRotation rotation = ContextRotation::ring,
                                ContextBalance balance = ContextBalance::head_tail)
      : comm_(comm), rotation_(rotation), balance_(balance) {}

  int degree() const { return comm_ ? comm_->size() : 1; }
  int rank() const { return comm_ ? comm_->rank() : 0; }
  bool active() const { return degree() > 1; }
  comm::Communicator& comm() { return *comm_; }
  ops::ContextShard shard() const { return {rank(), degree(), balance_ == ContextBalance::head_tail}; }
  ContextRotation rotation() const { return rotation_; }
  ContextBalance balance() const { return balance_; }

 private:
  comm::Communicator* comm_ = nullptr;
  ContextRotation rotation_ = ContextRotation::ring;
  ContextBalance balance_ = ContextBalance::head_tail;
};

inline bool active(const ContextParallelGroup* cp) { return cp && cp->active(); }

/// This rank's tokens of `all` (batch sequences of seq_len tokens, row-major) in the
/// chunk-major layout: for each run of `group` consecutive sequences (a pipeline's
/// microbatch; the whole batch otherwise), the first chunk of each, then the second.
/// seq_len must be a multiple of 2 x degree (the caller names the setting it came from).
template <class Id>
std::vector<Id> context_tokens(std::span<const Id> all, std::int64_t batch, std::int64_t seq_len,
                               ops::ContextShard cp, std::int64_t group) {
  TESSERA_CHECK(seq_len % cp.chunks() == 0 && group > 0 && batch % group == 0 &&
                    static_cast<std::int64_t>(all.size()) == batch * seq_len,
                "context parallelism: ", all.size(), " tokens as ", batch, " sequences of ", seq_len,
                " in groups of ", group, " do not split into ", cp.chunks(), " chunks a sequence");
  const std::int64_t c = seq_len / cp.chunks();
  std::vector<Id> out;
  out.reserve(static_cast<std::size_t>(batch * 2 * c));
  for (std::int64_t g0 = 0; g0 < batch; g0 += group)
    for (int j = 0; j < (cp.whole() ? 1 : 2); ++j)
      for (std::int64_t b = g0; b < g0 + group; ++b) {
        const Id* chunk = all.data() + b * seq_len + cp.chunk(j) * c;
        out.insert(out.end(), chunk, chunk + c);
      }
  return out;
}

namespace detail {

/// One (query chunk i, key chunk j) block of a ring step, and whether it is causal.
struct RingBlock {
  int q_chunk, kv_chunk;
  bool causal;
};

/// The blocks rank `rank` computes with the keys and values of rank `src` (up to three).
inline std::vector<RingBlock> ring_blocks(ops::ContextShard me, int src) {
  const ops::ContextShard from{src, me.degree, me.head_tail};
  std::vector<RingBlock> blocks;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const int q = me.chunk(i), k = from.chunk(j);
      if (k <= q) blocks.push_back({i, j, k == q});
    }
  return blocks;
}

/// The views of one chunk of a chunk-major (2 R, cols) matrix.
template <class T>
TensorView<T> chunk_rows(TensorView<T> m, int j, std::int64_t rows) {
  return TensorView<T>(m.row(j * rows), Shape{rows, m.size(1)}, {m.ld(), 1});
}

template <class T>
TensorView<T> packed(T* base, std::int64_t rows, std::int64_t cols) {
  return TensorView<T>(base, Shape{rows, cols});
}

/// The ring copies and converts whole matrices: each must be contiguous (rows, cols).
template <class... Views>
void check_contiguous(const AttentionShape& s, const Views&... views) {
  const bool ok = (... && (views.is_contiguous() && views.rows() == s.rows()));
  TESSERA_CHECK(ok && s.seq_len % 2 == 0 && s.causal, "context parallelism: attention over ", s.batch, " x ",
                s.seq_len, " rows takes contiguous causal (rows, cols) operands of two chunks a sequence");
}

/// One attention call's ring: this rank's place in it, and its keys and values packed
/// [k (2R rows); v (2R rows)] in two buffers, the one attended with and the one arriving;
/// or, all-gathered (ContextRotation::all_gather), every rank's in one buffer, in rank
/// order, which a step past the first reads its keys from instead.
template <Backend B, class T>
struct Ring {
  ContextParallelGroup& cp;
  ops::ContextShard me;
  const AttentionShape& shape;  // this rank's call: two chunks a sequence
  std::int64_t R, kv_cols, kv_numel;  // rows of a chunk (batch x c); kv's width; a packed buffer's elements
  int P, next, prev;
  std::array<Tensor<T>, 2> kv;
  Tensor<std::int32_t> bounds;  // packed documents: the current block's (R ops::DocumentSpan)
  Tensor<T> all;                // all-gathered: every rank's packed keys and values (P x kv_numel)
  comm::Handle gathering;       // the all-gather in flight, waited on before step 1

  Ring(ContextParallelGroup& group, const AttentionShape& s, TensorView<const T> k, TensorView<const T> v)
      : cp(group),
        me(group.shard()),
        shape(s),
        R(s.batch * (s.seq_len / 2)),
        kv_cols(k.size(1)),
        kv_numel(2 * (2 * R) * kv_cols),
        P(me.degree),
        next((me.rank + 1) % P),
        prev((me.rank + P - 1) % P),
        kv{B::template empty<T>(Shape{kv_numel}), B::template empty<T>(Shape{kv_numel})} {
    B::for_each(2 * R * kv_cols, ops::Copy<T>{k.data(), kv[0].data()});
    B::for_each(2 * R * kv_cols, ops::Copy<T>{v.data(), kv[0].data() + 2 * R * kv_cols});
    if (s.documents) bounds = B::template empty<std::int32_t>(Shape{2 * R});
    if (gathered()) {  // every rank's keys, arriving while step 0 computes with this rank's own
      all = B::template empty<T>(Shape{P * kv_numel});
      gathering = cp.comm().all_gather_async(std::span<const T>(kv[0].data(), static_cast<std::size_t>(kv_numel)),
                                             std::span<T>(all.data(), static_cast<std::size_t>(P * kv_numel)));
    }
  }

  bool gathered() const { return cp.rotation() == ContextRotation::all_gather; }

  /// Sends `send` to the next rank and receives `recv` from the one before, as one group.
  template <class E>
  comm::Handle exchange(const E* send, E* recv) {
    const std::array<comm::PeerOp, 2> ops{
        comm::PeerOp{comm::PeerOp::Kind::send, next, const_cast<E*>(send), static_cast<std::size_t>(kv_numel),
                     comm::data_type_of<E>(), 0},
        comm::PeerOp{comm::PeerOp::Kind::recv, prev, recv, static_cast<std::size_t>(kv_numel), comm::data_type_of<E>(),
                     0}};
    return cp.comm().send_recv_async(std::span<const comm::PeerOp>(ops));
  }
  /// Step `step`'s keys and values passed on (none after the last step, none when
  /// gathered), to wait on after it. Gathered, step 1 first waits for the gather.
  comm::Handle pass(int step) {
    if (gathered()) {
      if (step == 1) gathering.wait();
      return {};
    }
    if (step + 1 >= P) return {};
    return exchange(held(step), kv[static_cast<std::size_t>((step + 1) % 2)].data());
  }
  /// The packed keys and values step `step` computes with: rank source(step)'s.
  const T* held(int step) const {
    if (gathered() && step > 0) return all.data() + source(step) * kv_numel;
    return kv[static_cast<std::size_t>(step % 2)].data();
  }
  TensorView<const T> keys(int step) const { return packed<const T>(held(step), 2 * R, kv_cols); }
  TensorView<const T> values(int step) const { return packed<const T>(held(step) + 2 * R * kv_cols, 2 * R, kv_cols); }
  /// The blocks step `step` computes: with the keys of rank i - step.
  std::vector<RingBlock> blocks(int step) const { return ring_blocks(me, source(step)); }
  int source(int step) const { return (me.rank + P - step) % P; }
  /// Block b of step `step` as one attention call over (batch, c) queries and keys; with
  /// packed documents, their bounds in the block (ops::BlockDocuments) computed into
  /// `bounds`, which the call must read before the next block's are (one stream).
  AttentionShape block(int step, const RingBlock& b) {
    const std::int64_t c = shape.seq_len / 2;
    AttentionShape block{shape.batch, c, shape.n_heads, shape.n_kv_heads, shape.head_dim, b.causal};
    if (shape.documents) {
      const ops::ContextShard from{source(step), P, me.head_tail};
      auto* out = reinterpret_cast<ops::DocumentSpan*>(bounds.data());
      B::for_each(R, ops::BlockDocuments{shape.documents + b.q_chunk * R, out, c, me.chunk(b.q_chunk) * c,
                                         from.chunk(b.kv_chunk) * c});
      block.documents = out;
    }
    return block;
  }
};

}  // namespace detail

/// Causal attention over the local chunks of `s` (s.seq_len: this rank's 2 chunks a
/// sequence; lse written (2, batch, heads, chunk)), the keys of every rank of the group
/// brought round the ring. Degree 1: the backend's attention over whole sequences.
template <Backend B, class T>
void attention_forward(ContextParallelGroup* cp, const AttentionShape& s, TensorView<const T> q,
                       TensorView<const T> k, TensorView<const T> v, TensorView<T> o, accum_t<T>* lse) {
  if (!active(cp)) {
    B::attention_forward(s, q, k, v, o, lse);
    return;
  }
  using A = accum_t<T>;
  detail::check_contiguous(s, q, k, v, o);
  detail::Ring<B, T> ring(*cp, s, k, v);
  const std::int64_t c = s.seq_len / 2, R = ring.R, q_cols = q.size(1);
  const std::int64_t stats = s.batch * s.n_heads * c;  // lse elements of one chunk
  // The running output: o itself when T is its own accumulation type.
  Tensor<A> o_acc;
  TensorView<A> acc;
  if constexpr (std::is_same_v<T, A>) {
    acc = o;
  } else {
    o_acc = B::template empty<A>(Shape{2 * R, q_cols});
    acc = o_acc.view();
  }
  Tensor<T> o_block = B::template empty<T>(Shape{R, q_cols});
  Tensor<A> lse_block = B::template empty<A>(Shape{stats});
  std::array<bool, 2> merged{false, false};
  for (int step = 0; step < ring.P; ++step) {
    comm::Handle pass = ring.pass(step);
    for (const detail::RingBlock& b : ring.blocks(step)) {
      const AttentionShape block = ring.block(step, b);
      B::attention_forward(block, detail::chunk_rows(q, b.q_chunk, R), detail::chunk_rows(ring.keys(step), b.kv_chunk, R),
                           detail::chunk_rows(ring.values(step), b.kv_chunk, R), o_block.view(), lse_block.data());
      const auto i = static_cast<std::size_t>(b.q_chunk);
      B::for_each(R, ops::MergeAttention<T>{acc.row(b.q_chunk * R), lse + b.q_chunk * stats, o_block.data(),
                                            lse_block.data(), acc.ld(), q_cols, s.n_heads, s.head_dim, c,
                                            !merged[i]});
      merged[i] = true;
    }
    pass.wait();
  }
  if constexpr (!std::is_same_v<T, A>) {
    for (std::int64_t r = 0; r < 2 * R; r += R)
      B::for_each(R * q_cols, ops::Convert<A, T>{o_acc.data() + r * q_cols, o.row(r)});
  }
}

/// The gradients of attention_forward's: dq, dk, dv (overwritten) from the merged o and
/// lse it wrote. Degree 1: the backend's attention backward over whole sequences.
template <Backend B, class T>
void attention_backward(ContextParallelGroup* cp, const AttentionShape& s, TensorView<const T> q,
                        TensorView<const T> k, TensorView<const T> v, TensorView<const T> o, const accum_t<T>* lse,
                        TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv) {
  if (!active(cp)) {
    B::attention_backward(s, q, k, v, o, lse, d_o, dq, dk, dv);
    return;
  }
  using A = accum_t<T>;
  detail::check_contiguous(s, q, k, v, o, d_o, dq, dk, dv);
  detail::Ring<B, T> ring(*cp, s, k, v);
  const std::int64_t c = s.seq_len / 2, R = ring.R, kv_cols = ring.kv_cols, kv_numel = ring.kv_numel;
  const std::int64_t q_cols = q.size(1), stats = s.batch * s.n_heads * c;
  // Both rotations: each block's backward from the merged o and lse, its dq summed into
  // this rank's, its dk and dv into `slot` (packed like the keys the step used).
  Tensor<A> dq_acc = B::template empty<A>(Shape{2 * R * q_cols});
  std::array<bool, 2> dq_written{false, false};
  Tensor<T> dq_block = B::template empty<T>(Shape{R, q_cols});
  Tensor<T> dk_block = B::template empty<T>(Shape{R, kv_cols}), dv_block = B::template empty<T>(Shape{R, kv_cols});
  auto backward_blocks = [&](int step, A* slot) {
    for (const detail::RingBlock& b : ring.blocks(step)) {
      const AttentionShape block = ring.block(step, b);
      const std::int64_t qi = b.q_chunk;
      B::attention_backward(block, detail::chunk_rows(q, b.q_chunk, R), detail::chunk_rows(ring.keys(step), b.kv_chunk, R),
                            detail::chunk_rows(ring.values(step), b.kv_chunk, R), detail::chunk_rows(o, b.q_chunk, R),
                            lse + qi * stats, detail::chunk_rows(d_o, b.q_chunk, R), dq_block.view(),
                            dk_block.view(), dv_block.view());
      const auto i = static_cast<std::size_t>(b.q_chunk);
      B::for_each(R * q_cols, ops::AccumulateInto<T>{dq_block.data(), dq_acc.data() + qi * R * q_cols, !dq_written[i]});
      dq_written[i] = true;
      A* dk_into = slot + b.kv_chunk * R * kv_cols;
      B::for_each(R * kv_cols, ops::AccumulateInto<T>{dk_block.data(), dk_into, false});
      B::for_each(R * kv_cols, ops::AccumulateInto<T>{dv_block.data(), dk_into + 2 * R * kv_cols, false});
    }
  };
  // dq, and this rank's keys' gradients `home` (packed), written out in T.
  auto write_out = [&](const A* home) {
    B::for_each(2 * R * q_cols, ops::Convert<A, T>{dq_acc.data(), dq.data()});
    B::for_each(2 * R * kv_cols, ops::Convert<A, T>{home, dk.data()});
    B::for_each(2 * R * kv_cols, ops::Convert<A, T>{home + 2 * R * kv_cols, dv.data()});
  };
  if (ring.gathered()) {
    // Each block's gradients of the keys summed into the slot of the rank they came from,
    // then one reduce-scatter: every rank the sum for its own keys.
    Tensor<A> dkv_all = B::template zeros<A>(Shape{ring.P * kv_numel});
    for (int step = 0; step < ring.P; ++step) {
      comm::Handle pass = ring.pass(step);  // none: step 1 waits for the gather
      backward_blocks(step, dkv_all.data() + ring.source(step) * kv_numel);
    }
    Tensor<A> home = B::template empty<A>(Shape{kv_numel});
    cp->comm().reduce_scatter(std::span<const A>(dkv_all.data(), static_cast<std::size_t>(ring.P * kv_numel)),
                              std::span<A>(home.data(), static_cast<std::size_t>(kv_numel)));
    write_out(home.data());
    return;
  }
  // The running gradients of the keys held, packed like them, in accum_t<T>: the one
  // being added into, and the one arriving for the next step's keys; and this step's
  // blocks' gradients of the keys, summed apart while the running ones arrive.
  std::array<Tensor<A>, 2> dkv{B::template zeros<A>(Shape{kv_numel}), B::template empty<A>(Shape{kv_numel})};
  Tensor<A> step_dkv = B::template empty<A>(Shape{kv_numel});
  comm::Handle gradients;  // the running gradients' exchange issued at the previous step
  for (int step = 0; step < ring.P; ++step) {
    comm::Handle pass = ring.pass(step);
    // Step 0 adds into its own keys' running gradients (zero); a later step sums its
    // blocks apart while those of its keys are still arriving from rank i - 1.
    Tensor<A>& run = dkv[static_cast<std::size_t>(step % 2)];
    Tensor<A>& into = step == 0 ? run : step_dkv;
    if (step > 0) B::for_each(kv_numel, ops::Fill<A>{A(0), step_dkv.data()});
    backward_blocks(step, into.data());
    if (step > 0) {
      gradients.wait();  // the running gradients of these keys, sent by rank i - 1 after its step - 1
      B::for_each(kv_numel, ops::AccumulateInto<A>{step_dkv.data(), run.data(), false});
    }
    // Pass the running gradients on and take those of the next keys (after the last step:
    // of this rank's own keys, home). Every rank issues this group at the same step.
    gradients = ring.exchange(run.data(), dkv[static_cast<std::size_t>((step + 1) % 2)].data());
    pass.wait();
  }
  gradients.wait();
  write_out(dkv[static_cast<std::size_t>(ring.P % 2)].data());
}

}  // namespace tessera::parallel
