// The model on the GPU, for test_gpu_model.cpp: what the checks call, in host types
// only. The plain functions below (cuda_*, memory_access_*) are defined in
// model_launchers.cpp, which compiles every instantiation of the model, the trainer and
// the engines over the CUDA backend. The templates are the runs themselves, written
// once: model_launchers.cpp instantiates them over Cuda, the checks over Cpu for the
// reference. This header includes no CUDA header, so the checks need none.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../parallel/harness.hpp"
#include "tessera/backend/backend.hpp"
#include "tessera/comm/engine.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/data/documents.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/layer/kv_cache.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/float8.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/train/trainer.hpp"
#include "tessera/train/trainer_options.hpp"

namespace tessera::gpu_test {

/// Parameter values or gradients by parameter name, on the host (bf16 values widened).
using NamedValues = std::map<std::string, std::vector<float>>;

/// The elements of a host tensor as floats (exact for float and bf16).
template <class U>
std::vector<float> as_floats(const Tensor<U>& host) {
  std::vector<float> v(static_cast<std::size_t>(host.numel()));
  for (std::int64_t i = 0; i < host.numel(); ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(host[i]);
  return v;
}

// ---- the runs, written once for every backend ----------------------------------------

/// Every parameter's values, downloaded from the model's backend.
template <class Model>
NamedValues parameter_values(Model& model) {
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;
  NamedValues out;
  model.for_each_parameter([&](nn::Parameter<T>& p) {
    out[p.name] = as_floats(download<B>(p.value));
  });
  return out;
}

/// Every parameter's gradient (accum_t<T>), downloaded from the model's backend.
template <class Model>
NamedValues gradient_values(Model& model) {
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;
  NamedValues out;
  model.for_each_parameter([&](nn::Parameter<T>& p) {
    out[p.name] = as_floats(download<B>(p.grad));
  });
  return out;
}

/// The byte-tokenized synthetic corpus small_job trains on.
inline std::vector<std::uint32_t> small_job_tokens(const train::JobConfig& c) {
  return train::load_training_tokens(c, io::ByteTokenizer{}).ids;
}

/// One forward_backward of a fresh model (seed c.training.seed) on the first batch (its
/// packed documents masked apart with training.document_mask).
struct ForwardBackward {
  double loss_sum = 0;  // the sum of token losses
  std::int64_t n_targets = 0;
  NamedValues gradients;  // of the mean token loss
};

template <class Model>
ForwardBackward forward_backward_once(const train::JobConfig& c) {
  Model model(c.model.args, train::make_plan(c, nullptr));
  model.init_weights(static_cast<std::uint64_t>(c.training.seed));
  model.shard();
  model.zero_grad();
  data::DataLoader loader(small_job_tokens(c), c.training.seq_len, c.training.local_batch_size);
  data::Batch b = loader.next();
  nn::Geometry g{b.batch, b.seq_len};
  if (c.training.document_mask) {  // as the Trainer takes a batch
    g.document_start_id = train::document_start_id(c);
    data::mask_document_boundaries(b, g.document_start_id);
  }
  ForwardBackward r;
  r.n_targets = b.n_targets;
  r.loss_sum = model.forward_backward(b.inputs, b.targets, g, 1.0 / static_cast<double>(b.n_targets));
  r.gradients = gradient_values(model);
  return r;
}

/// c.training.steps Trainer steps of a fresh model (seed c.training.seed) on one rank.
struct TrainRun {
  std::vector<double> losses, grad_norms;
  NamedValues before, after;  // parameters
};

template <class Model>
TrainRun train_steps(const train::JobConfig& c) {
  Model model(c.model.args, train::make_plan(c, nullptr));
  model.init_weights(static_cast<std::uint64_t>(c.training.seed));
  TrainRun r;
  r.before = parameter_values(model);
  data::DataLoader loader(small_job_tokens(c), c.training.seq_len, c.training.local_batch_size);
  train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
  for (std::int64_t s = 0; s < c.training.steps; ++s) {
    const train::StepMetrics m = trainer.step();
    r.losses.push_back(m.loss);
    r.grad_norms.push_back(m.grad_norm);
  }
  r.after = parameter_values(model);
  return r;
}

/// Decoding through a KV cache with a fresh model (seed c.training.seed, the plan c
/// makes): the logits (on the host) after each run of `steps` new tokens of `ids`,
/// through one cache and over the whole prefix, and nn::generate's tokens after `prompt`
/// through the cache and over the whole window (SampleOptions::kv_cache).
struct DecodeRun {
  bool decodes = false;  // Model::decodes_with_kv_cache()
  std::vector<std::vector<float>> cached, whole;
  std::vector<std::int32_t> with_cache, without_cache;
};

template <class Model>
DecodeRun decode_run(const train::JobConfig& c, const std::vector<std::int32_t>& ids,
                     const std::vector<std::size_t>& steps, const std::vector<std::int32_t>& prompt,
                     nn::SampleOptions o) {
  using T = typename Model::scalar_type;
  Model model(c.model.args, train::make_plan(c, nullptr));
  model.init_weights(static_cast<std::uint64_t>(c.training.seed));
  model.shard();
  DecodeRun r;
  r.decodes = model.decodes_with_kv_cache();
  if (!r.decodes) return r;
  nn::KvCache<T> cache(static_cast<std::int64_t>(ids.size()));
  const std::span<const std::int32_t> all(ids);
  std::size_t done = 0;
  for (const std::size_t n : steps) {
    r.cached.push_back(as_floats(model.cached_last_logits(all.subspan(done, n), cache)));
    done += n;
    r.whole.push_back(as_floats(model.last_logits(all.first(done), nn::Geometry{1, static_cast<std::int64_t>(done)})));
  }
  o.kv_cache = true;
  r.with_cache = nn::generate(model, prompt, o);
  o.kv_cache = false;
  r.without_cache = nn::generate(model, prompt, o);
  return r;
}

// ---- the CUDA runs (model_launchers.cpp)-----------------------------------------------

/// forward_backward_once / train_steps with nn::Transformer<float, Cuda>.
ForwardBackward cuda_forward_backward(const train::JobConfig& c);
TrainRun cuda_train_steps(const train::JobConfig& c);

/// The same with the block type the binaries use, every choice from the plan c makes:
/// Parallel<nn::LlamaBlock<float, Cuda>, Sharding<Dynamic>, TensorParallel<dynamic>,
/// Pipeline<dynamic>, Checkpoint<Dynamic>>, on one rank.
ForwardBackward cuda_dynamic_forward_backward(const train::JobConfig& c);
TrainRun cuda_dynamic_train_steps(const train::JobConfig& c);

/// The binaries' block type over bf16 (Parallel<nn::LlamaBlock<bf16, Cuda>, ...>): bf16
/// activations and parameters, fp32 gradients, AdamW with fp32 masters; on one rank.
ForwardBackward cuda_bf16_forward_backward(const train::JobConfig& c);
TrainRun cuda_bf16_train_steps(const train::JobConfig& c);

/// test::train_layout of the dynamic CUDA model on shape.world() thread ranks sharing
/// this GPU (comm::ThreadOptions::memory = Cuda::memory_access()), each rank's result.
std::vector<test::RunResult> cuda_thread_ranks(comm::MeshShape shape, const train::JobConfig& c);

/// test::train_layout of the dynamic CUDA model on one rank (a SelfEngine moving device
/// memory through Cuda::memory_access()).
test::RunResult cuda_one_rank(const train::JobConfig& c);

/// decode_run with nn::Transformer<float, Cuda>, and with the binaries' block type over
/// bf16 (as cuda_bf16_train_steps).
DecodeRun cuda_decode(const train::JobConfig& c, const std::vector<std::int32_t>& ids,
                      const std::vector<std::size_t>& steps, const std::vector<std::int32_t>& prompt,
                      const nn::SampleOptions& o);
DecodeRun cuda_bf16_decode(const train::JobConfig& c, const std::vector<std::int32_t>& ids,
                           const std::vector<std::size_t>& steps, const std::vector<std::int32_t>& prompt,
                           const nn::SampleOptions& o);

/// A fresh nn::Transformer<float, Cuda> (seed c.training.seed) saved to `path` with
/// train::save_model as float32; returns its parameters.
NamedValues cuda_save_model(const train::JobConfig& c, const std::string& path);

/// A nn::Transformer<float, Cuda> loaded from `path` with train::load_model; returns
/// its parameters.
NamedValues cuda_load_model(const train::JobConfig& c, const std::string& path);

/// Cuda::empty<float> of `bytes` bytes (a multiple of 4), freed again.
void cuda_allocate(std::size_t bytes);

/// upload<Cuda> then download<Cuda>.
std::vector<float> cuda_round_trip(const std::vector<float>& v);

// ---- Cuda::memory_access() --------------------------------------------------------------

/// Where a buffer handed to the memory access lives.
enum class Place { device, host, pinned_host, managed };

/// Cuda::memory_access().reduce(dst, src, ...) with dst and src (same length) placed
/// as said; returns dst afterwards. T is float, double, int32_t or int64_t.
template <class T>
std::vector<T> memory_access_reduce(std::vector<T> dst, const std::vector<T>& src, comm::ReduceOp op, Place dst_at,
                                    Place src_at);

/// Cuda::memory_access().reduce over n elements of `t`, device buffers (for the refusals).
void memory_access_reduce_type(comm::DataType t, std::size_t n);

/// Cuda::memory_access().copy of v from a buffer placed at `from` to one at `to`.
std::vector<float> memory_access_copy(const std::vector<float>& v, Place from, Place to);

/// In one device buffer holding v: copy of elements [0, n - shift) onto [shift, n)
/// through Cuda::memory_access().copy (overlapping ranges); returns the buffer.
std::vector<float> memory_access_overlapping_copy(const std::vector<float>& v, std::size_t shift);

/// What every rank of `ranks` thread ranks gets from each collective, its inputs made
/// by collective_input(rank, ...): all_reduce (sum, then max) of a device buffer,
/// reduce_scatter, all_gather and broadcast (root 1) of device buffers, and all_reduce
/// of host values (a double and an int64, as a loss sum and a token count are).
struct CollectiveResults {
  std::vector<float> all_reduce_sum, all_reduce_max, reduce_scatter, all_gather, broadcast;
  double host_sum = 0;
  std::int64_t host_count = 0;
};

/// The inputs every rank feeds the collectives: n floats with full mantissas.
inline std::vector<float> collective_input(int rank, std::size_t n) {
  std::vector<float> v(n);
  std::uint32_t x = 0x9e3779b9u * static_cast<std::uint32_t>(rank + 1);
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = (static_cast<float>(x >> 8) / static_cast<float>(1u << 24) - 0.5f) * static_cast<float>(rank + 1);
  }
  return v;
}

/// The collectives above on `ranks` thread ranks whose buffers are B's, moved by
/// `memory` (ThreadOptions::memory); n divisible by ranks.
template <Backend B>
std::vector<CollectiveResults> thread_collectives(int ranks, std::size_t n, comm::MemoryAccess memory) {
  std::vector<CollectiveResults> out(static_cast<std::size_t>(ranks));
  comm::ThreadOptions options;
  options.memory = memory;
  comm::run_thread_ranks(
      ranks,
      [&](comm::Communicator& world) {
        const int r = world.rank();
        const std::vector<float> in = collective_input(r, n);
        const std::size_t part = n / static_cast<std::size_t>(ranks);
        auto values = [](const Tensor<float>& t) {
          const Tensor<float> host = download<B>(t);
          return std::vector<float>(host.data(), host.data() + host.numel());
        };
        auto span_of = [](const Tensor<float>& t) {
          return std::span<float>(t.data(), static_cast<std::size_t>(t.numel()));
        };
        CollectiveResults& res = out[static_cast<std::size_t>(r)];
        const Tensor<float> sum = upload<B>(std::span<const float>(in));
        world.all_reduce(span_of(sum));
        res.all_reduce_sum = values(sum);
        const Tensor<float> max = upload<B>(std::span<const float>(in));
        world.all_reduce(span_of(max), comm::ReduceOp::max);
        res.all_reduce_max = values(max);
        const Tensor<float> whole = upload<B>(std::span<const float>(in));
        const Tensor<float> mine = B::template empty<float>(Shape{static_cast<std::int64_t>(part)});
        world.reduce_scatter(std::span<const float>(whole.data(), n), span_of(mine));
        res.reduce_scatter = values(mine);
        const Tensor<float> piece = upload<B>(std::span<const float>(in.data(), part));
        const Tensor<float> gathered = B::template empty<float>(Shape{static_cast<std::int64_t>(n)});
        world.all_gather(std::span<const float>(piece.data(), part), span_of(gathered));
        res.all_gather = values(gathered);
        const Tensor<float> cast = upload<B>(std::span<const float>(in));
        world.broadcast(span_of(cast), 1);
        res.broadcast = values(cast);
        res.host_sum = world.all_reduce_value(static_cast<double>(in.front()) * 1e3 + r);
        res.host_count = world.all_reduce_value(static_cast<std::int64_t>(1000 + 7 * r));
      },
      options);
  return out;
}

/// thread_collectives<Cuda> with ThreadOptions::memory = Cuda::memory_access().
std::vector<CollectiveResults> cuda_thread_collectives(int ranks, std::size_t n);

/// `x` rounded to bf16 (the GPU model's type) and cast to float8 by `cast` on B
/// (nn::cast_to_float8): the float8 values as floats, and the scales. `kept_row_amaxes`:
/// the cast given x's row amaxes (RowAbsMax on B, kept in an nn::Float8RowAmaxes) as a
/// kernel that wrote x would give them.
struct Float8CastValues {
  std::vector<float> values, scales;
};
template <class B>
Float8CastValues float8_cast_on(const Tensor<float>& x, ops::Float8Cast cast, bool transpose = false,
                                bool kept_row_amaxes = false) {
  Tensor<bf16> host(x.shape(), Uninitialized{});
  for (std::int64_t i = 0; i < x.numel(); ++i) host[i] = bf16(x[i]);
  const Tensor<bf16> on = upload<B>(host);
  nn::Float8RowAmaxes<B> amaxes;
  if (kept_row_amaxes) {
    const Tensor<float> m = B::template empty<float>(Shape{x.size(0)});
    B::for_each(x.size(0), ops::RowAbsMax<bf16>{on.data(), x.size(1), x.size(1), m.data()});
    amaxes.keep(on.cview(), m);
  }
  const nn::Float8Operand<B> q = nn::cast_to_float8<B>(on.cview(), cast, transpose);
  const Tensor<float> v = download<B>(nn::float8_values<B>(q)), s = download<B>(q.scale);
  return {{v.data(), v.data() + v.numel()}, {s.data(), s.data() + s.numel()}};
}
Float8CastValues cuda_float8_cast(const Tensor<float>& x, ops::Float8Cast cast, bool transpose = false,
                                  bool kept_row_amaxes = false);
/// `x` cast as float8_cast_on casts it, not transposed, by one scale (tensorwise), then its
/// float8 values transposed (nn::transposed_float8: ops::Float8Transpose).
template <class B>
Float8CastValues float8_transposed_on(const Tensor<float>& x, ops::Float8Cast cast) {
  Tensor<bf16> host(x.shape(), Uninitialized{});
  for (std::int64_t i = 0; i < x.numel(); ++i) host[i] = bf16(x[i]);
  const Tensor<bf16> on = upload<B>(host);
  const nn::Float8Operand<B> q = nn::transposed_float8<B>(nn::cast_to_float8<B>(on.cview(), cast, false));
  const Tensor<float> v = download<B>(nn::float8_values<B>(q)), s = download<B>(q.scale);
  return {{v.data(), v.data() + v.numel()}, {s.data(), s.data() + s.numel()}};
}
Float8CastValues cuda_float8_transposed(const Tensor<float>& x, ops::Float8Cast cast);
/// `x` cast as float8_cast_on casts it, by one scale (tensorwise), into both layouts in
/// one pass (nn::cast_to_float8_both_layouts): the values as x lies, then the transposed
/// ones the scope kept.
template <class B>
std::array<Float8CastValues, 2> float8_both_layouts_on(const Tensor<float>& x, ops::Float8Cast cast) {
  Tensor<bf16> host(x.shape(), Uninitialized{});
  for (std::int64_t i = 0; i < x.numel(); ++i) host[i] = bf16(x[i]);
  const Tensor<bf16> on = upload<B>(host);
  nn::Float8SharedCasts<B> shared;
  const nn::Float8Operand<B> q = nn::cast_to_float8_both_layouts<B>(on.cview(), cast);
  const nn::Float8Operand<B> t = nn::cast_to_float8<B>(on.cview(), cast, true);  // the one kept
  std::array<Float8CastValues, 2> out;
  for (int i = 0; i < 2; ++i) {
    const nn::Float8Operand<B>& o = i == 0 ? q : t;
    const Tensor<float> v = download<B>(nn::float8_values<B>(o)), s = download<B>(o.scale);
    out[static_cast<std::size_t>(i)] = {{v.data(), v.data() + v.numel()}, {s.data(), s.data() + s.numel()}};
  }
  return out;
}
std::array<Float8CastValues, 2> cuda_float8_both_layouts(const Tensor<float>& x, ops::Float8Cast cast);

/// op(A) op(B) by nn::float8_gemm on B, A and B rounded to bf16, C in float (emulated
/// unless `options` say otherwise); plus `residual` where given, read apart from C as the
/// GEMM's own (a block's residual added in its output projection).
template <class B>
std::vector<float> float8_gemm_on(Trans ta, Trans tb, const Tensor<float>& a, ops::Float8Cast ca, const Tensor<float>& b,
                                  ops::Float8Cast cb, std::int64_t m, std::int64_t n,
                                  nn::Float8GemmOptions options = {}, const Tensor<float>* residual = nullptr) {
  auto on = [](const Tensor<float>& x) {
    Tensor<bf16> host(x.shape(), Uninitialized{});
    for (std::int64_t i = 0; i < x.numel(); ++i) host[i] = bf16(x[i]);
    return upload<B>(host);
  };
  const Tensor<bf16> da = on(a), db = on(b);
  Tensor<float> c = B::template zeros<float>(Shape{m, n});
  const Tensor<float> r = residual != nullptr ? upload<B>(*residual) : Tensor<float>{};
  nn::float8_gemm<B>(ta, tb, da.cview(), ca, db.cview(), cb, residual != nullptr ? 1.0f : 0.0f, c.view(),
                     "float8_gemm_on", options, r.cview());
  const Tensor<float> h = download<B>(c);
  return {h.data(), h.data() + h.numel()};
}
std::vector<float> cuda_float8_gemm(Trans ta, Trans tb, const Tensor<float>& a, ops::Float8Cast ca,
                                    const Tensor<float>& b, ops::Float8Cast cb, std::int64_t m, std::int64_t n,
                                    nn::Float8GemmOptions options = {}, const Tensor<float>* residual = nullptr);

}  // namespace tessera::gpu_test
