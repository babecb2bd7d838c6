// Grouped-query flash attention on CUDA, causal or full: the portable kernels (any
// sm_80+), built from the row functors of ops/flash_attention.hpp.
//
// Layout and semantics as the CPU backend's: q, o (B*T, H*hd), k, v (B*T, KV*hd),
// row-major with an ld each; lse (B, H, T) in float; dq overwritten, dk and dv added into.
// AttentionShape::causal picks the mask: a full call (no mask) walks every tile; the
// causal path is the same code with its bounds (a kernel argument, uniform over a block).
//
// Forward: one thread per query row, a block of kFlashBlockRows (64) consecutive rows of
// one (batch, head). The block walks the key tiles below its last query -- tiles wholly
// above the causal diagonal are never loaded; full, it walks them all -- staging each
// tile's K and V rows into shared memory as float with every thread of the block, then
// each thread runs FlashForwardRow::update on the shared tile (threads read the same
// shared row at the same time: broadcasts, no bank conflicts).
//
// Backward: a FlashDelta pass (D = dO . O per row and head, into the caller's
// workspace), then two passes with no atomics. The key pass runs one thread per key row
// (a block of 64 keys of one (batch, kv head)); it walks, for every q head of the group,
// the query tiles from the block's first key on (full: from the first query), staged as
// Q, dO, lse and D, and adds its dk, dv rows into the outputs once at the end. The query
// pass runs one thread per query row over key tiles as the forward does and overwrites
// dq. Every output row has one owner summing in a fixed order: results are deterministic.
//
// Decoding after a KV cache's keys (AttentionShape::past, the forward only): k and v hold
// past + T rows a sequence and the causal bound moves `past` keys on. Each row's keys are
// walked in runs of ops::kFlashSplitKeys, a block per (run, query block, head), each
// run's o and lse written in float to the caller's scratch; ops::FlashMergeSplits then
// combines the runs, one thread per element of o. A token's few queries so spread over
// (keys / 128) times as many blocks, where one block a head would walk every key alone.
//
// Packed documents (AttentionShape::documents, per row): a query block starts at the key
// its first row's document starts at, a key block stops after the query its last row's
// document ends with, and each row's functor keeps to its own document's bounds.
//
// Tiles are 64 rows at head dims up to 64 and 32 at 128, so two float tiles take at most 32 KiB of
// static shared memory either way. Tiles are loaded with 16-byte vector loads when the
// staged tensors' base pointers are 16-byte aligned and their ld * sizeof(T) is a
// multiple of 16 (hd * sizeof(T) is, for every supported hd), with scalar loads otherwise;
// the launchers decide at run time. Blocks with the most work (the last query blocks,
// the first key blocks) are launched first.
//
// Register pressure: every thread keeps its own row's inputs and HD fp32 accumulators
// (2 HD values in the forward, 3 HD in the dq pass, 4 HD in the dk/dv pass); at head dim
// 128 part of that spills to local memory. That is the price of a portable, plainly
// correct path; the Hopper path (wgmma on row tiles, TMA loads) is a separate kernel.
//
// Storage T is float or bf16 (arithmetic in float); float64 is refused by name.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/kernels.hpp"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/flash_attention.hpp"

namespace tessera::cuda {

namespace detail {

/// Rows (threads) per block.
inline constexpr int kFlashBlockRows = 64;

/// Rows per staged tile: two float tiles of HD columns fit in 32 KiB.
template <int HD>
inline constexpr int kFlashTileRows = HD <= 64 ? 64 : 32;

__device__ inline std::int64_t flash_min(std::int64_t a, std::int64_t b) { return a < b ? a : b; }
__device__ inline std::int64_t flash_max(std::int64_t a, std::int64_t b) { return a > b ? a : b; }

/// Copies rows [0, n) of a (n, HD) slice (src, ld) into dst, a (kRows, HD) float tile;
/// rows n..kRows-1 become zeros. Every thread of the block takes part.
template <class T, int HD, int kRows>
__device__ void flash_stage(float* dst, const T* src, std::int64_t ld, int n, bool vector_loads) {
  if (vector_loads) {
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
    constexpr int kChunks = HD / kPer;                      // loads per row
    static_assert(HD % kPer == 0, "flash_stage: a row must be whole 16-byte chunks");
    for (int c = threadIdx.x; c < kRows * kChunks; c += blockDim.x) {
      const int r = c / kChunks, col = (c % kChunks) * kPer;
      float* out = dst + r * HD + col;
      if (r < n) {
        const uint4 raw = *reinterpret_cast<const uint4*>(src + r * ld + col);
        T vals[kPer];
        memcpy(vals, &raw, sizeof(raw));
#pragma unroll
        for (int e = 0; e < kPer; ++e) out[e] = static_cast<float>(vals[e]);
      } else {
#pragma unroll
        for (int e = 0; e < kPer; ++e) out[e] = 0.0f;
      }
    }
  } else {
    for (int c = threadIdx.x; c < kRows * HD; c += blockDim.x) {
      const int r = c / HD, col = c % HD;
      dst[c] = r < n ? static_cast<float>(src[r * ld + col]) : 0.0f;
    }
  }
}

/// Copies n values of a (B, H, T) float array into a kRows tile; the rest become zeros.
template <int kRows>
__device__ void flash_stage_values(float* dst, const float* src, int n) {
  for (int r = threadIdx.x; r < kRows; r += blockDim.x) dst[r] = r < n ? src[r] : 0.0f;
}

template <class T>
struct FlashArgs {
  const T* q;
  std::int64_t ldq;
  const T* k;
  std::int64_t ldk;
  const T* v;
  std::int64_t ldv;
  const T* d_o;
  std::int64_t lddo;
  T* out;  // forward: o; backward query pass: dq
  std::int64_t ldout;
  T* dk;
  std::int64_t lddk;
  T* dv;
  std::int64_t lddv;
  float* lse_out;      // (B, H, T): the forward's log-sum-exp
  const float* lse;    // (B, H, T): the backward's copy of it
  const float* delta;  // (B, H, T): D = dO . O
  std::int64_t batch, seq_len, n_heads, n_kv_heads;
  std::int64_t past;  // forward: keys a sequence before its first query (a KV cache's); backward: 0
  // The forward's runs of keys (ops::flash_key_splits): `splits` runs of `split_keys`
  // keys, the last run shorter; one run of every key writes out and lse_out, more write
  // their o and lse into o_parts (splits x (B*T, H*hd)) and lse_parts (splits x (B, H, T)).
  std::int64_t split_keys, splits;
  float* o_parts;
  float* lse_parts;
  const ops::DocumentSpan* documents;  // (B*T) or nullptr: one document a sequence
  float scale;
  bool causal;  // false: no mask, every tile visited
  bool vector_loads;
};

/// One thread per query row over the key/value tiles it sees: the forward (o, lse)
/// and, with `backward`, the backward's query pass (dq); they differ only in the row
/// functor and what it starts from and writes.
template <class T, int HD, bool backward>
__global__ void __launch_bounds__(kFlashBlockRows) flash_query_kernel(FlashArgs<T> a) {
  constexpr int kTile = kFlashTileRows<HD>;
  __shared__ float ks[kTile * HD];
  __shared__ float vs[kTile * HD];
  const std::int64_t heads = a.batch * a.n_heads, t = a.seq_len, key_len = a.past + t;
  const std::int64_t blocks = (t + kFlashBlockRows - 1) / kFlashBlockRows;
  const std::int64_t split = blockIdx.x / (blocks * heads), block = blockIdx.x % (blocks * heads);
  const std::int64_t qb = blocks - 1 - block / heads, bh = block % heads;  // the last blocks first
  const std::int64_t b = bh / a.n_heads, h = bh % a.n_heads, kvh = h / (a.n_heads / a.n_kv_heads);
  const std::int64_t i0 = qb * kFlashBlockRows, i = i0 + threadIdx.x, base = b * t, key_base = b * key_len;
  const bool active = i < t;
  // This block's run of keys (every key in one run but the forward's after a KV cache).
  const std::int64_t run_begin = split * a.split_keys, run_end = flash_min(key_len, run_begin + a.split_keys);

  std::conditional_t<backward, ops::FlashBackwardQueryRow<T, HD>, ops::FlashForwardRow<T, HD>> row;
  if (active) {
    const std::int64_t last_key = flash_min(ops::detail::flash_last_key(a.causal, i, t, a.past), run_end - 1);
    const std::int64_t first_key = flash_max(ops::detail::flash_first_key(a.documents, base + i, 0), run_begin);
    if constexpr (backward)
      row.start(a.q + (base + i) * a.ldq + h * HD, a.d_o + (base + i) * a.lddo + h * HD, a.lse[bh * t + i],
                a.delta[bh * t + i], last_key, a.scale, first_key);
    else
      row.start(a.q + (base + i) * a.ldq + h * HD, last_key, a.scale, first_key);
  }
  // The keys the block's queries see: from its first row's document on (documents begin
  // in row order), up to its last row causal; within the block's run.
  const std::int64_t key_begin = flash_max(ops::detail::flash_first_key(a.documents, base + i0, 0), run_begin);
  const std::int64_t key_end =
      flash_min(a.causal ? flash_min(key_len, a.past + i0 + kFlashBlockRows) : key_len, run_end);
  for (std::int64_t key0 = key_begin; key0 < key_end; key0 += kTile) {
    const int n = static_cast<int>(flash_min(kTile, key_len - key0));
    __syncthreads();  // the previous tile has been read by every thread
    flash_stage<T, HD, kTile>(ks, a.k + (key_base + key0) * a.ldk + kvh * HD, a.ldk, n, a.vector_loads);
    flash_stage<T, HD, kTile>(vs, a.v + (key_base + key0) * a.ldv + kvh * HD, a.ldv, n, a.vector_loads);
    __syncthreads();
    if (active) row.update(ks, HD, vs, HD, key0, n);
  }
  if (active) {
    if constexpr (backward)
      row.finish(a.out + (base + i) * a.ldout + h * HD);
    else if (a.splits == 1)
      row.finish(a.out + (base + i) * a.ldout + h * HD, a.lse_out + bh * t + i);
    else
      row.finish(a.o_parts + (split * a.batch * t + base + i) * (a.n_heads * HD) + h * HD,
                 a.lse_parts + (split * heads + bh) * t + i);
  }
}

template <class T, int HD>
__global__ void __launch_bounds__(kFlashBlockRows) flash_backward_key_kernel(FlashArgs<T> a) {
  constexpr int kTile = kFlashTileRows<HD>;
  __shared__ float qs[kTile * HD];
  __shared__ float dos[kTile * HD];
  __shared__ float lses[kTile];
  __shared__ float deltas[kTile];
  const std::int64_t kv_heads = a.batch * a.n_kv_heads, t = a.seq_len, group = a.n_heads / a.n_kv_heads;
  const std::int64_t jb = blockIdx.x / kv_heads, bkv = blockIdx.x % kv_heads;  // the first blocks first
  const std::int64_t b = bkv / a.n_kv_heads, kvh = bkv % a.n_kv_heads;
  const std::int64_t j0 = jb * kFlashBlockRows, j = j0 + threadIdx.x, base = b * t;
  const bool active = j < t;

  ops::FlashBackwardKeyRow<T, HD> row;
  if (active)
    row.start(a.k + (base + j) * a.ldk + kvh * HD, a.v + (base + j) * a.ldv + kvh * HD,
              ops::detail::flash_first_query_of(a.causal, j), a.scale,
              ops::detail::flash_last_query(a.documents, base + j, t - 1));
  // The queries the block's keys are seen by: from its first key on causal, up to the end
  // of its last row's document (documents end in row order).
  const std::int64_t query_begin = a.causal ? j0 : 0;
  const std::int64_t query_end =
      ops::detail::flash_last_query(a.documents, base + flash_min(j0 + kFlashBlockRows, t) - 1, t - 1) + 1;
  for (std::int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    const std::int64_t bh = b * a.n_heads + h;
    for (std::int64_t query0 = query_begin; query0 < query_end; query0 += kTile) {
      const int n = static_cast<int>(flash_min(kTile, t - query0));
      __syncthreads();
      flash_stage<T, HD, kTile>(qs, a.q + (base + query0) * a.ldq + h * HD, a.ldq, n, a.vector_loads);
      flash_stage<T, HD, kTile>(dos, a.d_o + (base + query0) * a.lddo + h * HD, a.lddo, n, a.vector_loads);
      flash_stage_values<kTile>(lses, a.lse + bh * t + query0, n);
      flash_stage_values<kTile>(deltas, a.delta + bh * t + query0, n);
      __syncthreads();
      if (active) row.update(qs, HD, dos, HD, lses, deltas, query0, n);
    }
  }
  if (active) row.finish(a.dk + (base + j) * a.lddk + kvh * HD, a.dv + (base + j) * a.lddv + kvh * HD);
}

/// Whether 16-byte loads may read every row of a view: an aligned base and ld.
template <class T>
bool flash_vector_loadable(TensorView<const T> m) {
  return reinterpret_cast<std::uintptr_t>(m.data()) % 16 == 0 && (m.ld() * sizeof(T)) % 16 == 0;
}

/// One block per 64 rows of each of `heads` heads (or kv heads), checked against CUDA's limit.
inline unsigned flash_grid(std::int64_t seq_len, std::int64_t heads, const char* pass) {
  const std::int64_t blocks = (seq_len + kFlashBlockRows - 1) / kFlashBlockRows * heads;
  TESSERA_CHECK(blocks <= INT_MAX, "flash attention (CUDA): the ", pass, " needs ", blocks,
                " blocks, more than a grid holds");
  return static_cast<unsigned>(blocks);
}

template <class T>
constexpr void flash_check_storage() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                "flash attention: T must be float, bf16 or double");
}

}  // namespace detail

/// Forward (declared in kernels.hpp): o (B*T, H*hd) and lse (B, H, T) in float. T is
/// float or bf16. After a KV cache's keys (s.past), `split_scratch` holds
/// ops::flash_split_scratch(s) floats for the runs of keys (none needed without).
template <class T>
void flash_attention_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                             TensorView<const T> v, TensorView<T> o, float* lse, cudaStream_t stream,
                             float* split_scratch) {
  detail::flash_check_storage<T>();
  if constexpr (std::is_same_v<T, double>) {
    fail("flash attention (CUDA): float64 storage is not supported (float or bf16)");
  } else {
    ops::flash_check_forward<T>(s, q, k, v, o);
    if (s.rows() == 0) return;
    detail::FlashArgs<T> a{};
    a.q = q.data(), a.ldq = q.ld(), a.k = k.data(), a.ldk = k.ld(), a.v = v.data(), a.ldv = v.ld();
    a.out = o.data(), a.ldout = o.ld(), a.lse_out = lse;
    a.batch = s.batch, a.seq_len = s.seq_len, a.n_heads = s.n_heads, a.n_kv_heads = s.n_kv_heads;
    a.past = s.past;
    a.splits = ops::flash_key_splits(s);
    a.split_keys = a.splits > 1 ? ops::kFlashSplitKeys : s.key_len();
    if (a.splits > 1) {
      TESSERA_CHECK(split_scratch != nullptr, "flash attention (CUDA): a call after ", s.past,
                    " keys of a KV cache needs ", ops::flash_split_scratch(s), " floats of scratch for its ",
                    a.splits, " runs of keys");
      a.o_parts = split_scratch;
      a.lse_parts = split_scratch + a.splits * s.rows() * s.n_heads * s.head_dim;
    }
    a.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    a.causal = s.causal;
    a.documents = s.documents;
    a.vector_loads = detail::flash_vector_loadable(k) && detail::flash_vector_loadable(v);
    const unsigned grid = detail::flash_grid(s.seq_len, s.batch * s.n_heads * a.splits, "forward");
    ops::with_flash_head_dim(s.head_dim, [&]<int HD>() {
      detail::flash_query_kernel<T, HD, false><<<grid, detail::kFlashBlockRows, 0, stream>>>(a);
      TESSERA_CUDA_CHECK(cudaGetLastError());
    });
    if (a.splits > 1) {
      const ops::FlashMergeSplits<T> merge{a.o_parts, a.lse_parts, o.data(), o.ld(), lse,
                                           a.splits,  s.batch,     s.seq_len, s.n_heads, s.head_dim};
      tessera::cuda::for_each(s.batch * s.n_heads * s.seq_len * s.head_dim, merge, stream);
    }
  }
}

/// Backward (declared in kernels.hpp): dq (B*T, H*hd) overwritten, dk and dv (B*T,
/// KV*hd) added into (pass zeros), from the forward's o and lse. `delta` is a workspace
/// of B*H*T floats.
template <class T>
void flash_attention_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                              TensorView<const T> v, TensorView<const T> o, const float* lse,
                              TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv,
                              float* delta, cudaStream_t stream) {
  detail::flash_check_storage<T>();
  if constexpr (std::is_same_v<T, double>) {
    fail("flash attention (CUDA): float64 storage is not supported (float or bf16)");
  } else {
    ops::flash_check_backward<T>(s, q, k, v, o, d_o, dq, dk, dv);
    if (s.rows() == 0) return;
    const ops::FlashDelta<T> rowdot{o.data(), o.ld(), d_o.data(), d_o.ld(), delta, s.seq_len, s.n_heads, s.head_dim};
    tessera::cuda::for_each(s.batch * s.n_heads * s.seq_len, rowdot, stream);
    detail::FlashArgs<T> a{};
    a.q = q.data(), a.ldq = q.ld(), a.k = k.data(), a.ldk = k.ld(), a.v = v.data(), a.ldv = v.ld();
    a.d_o = d_o.data(), a.lddo = d_o.ld();
    a.out = dq.data(), a.ldout = dq.ld(), a.dk = dk.data(), a.lddk = dk.ld(), a.dv = dv.data(), a.lddv = dv.ld();
    a.lse = lse, a.delta = delta;
    a.batch = s.batch, a.seq_len = s.seq_len, a.n_heads = s.n_heads, a.n_kv_heads = s.n_kv_heads;
    a.past = 0, a.split_keys = s.seq_len, a.splits = 1;  // every key in one run
    a.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    a.causal = s.causal;
    a.documents = s.documents;
    a.vector_loads = detail::flash_vector_loadable(q) && detail::flash_vector_loadable(k) &&
                     detail::flash_vector_loadable(v) && detail::flash_vector_loadable(d_o);
    const unsigned key_grid = detail::flash_grid(s.seq_len, s.batch * s.n_kv_heads, "backward key pass");
    const unsigned query_grid = detail::flash_grid(s.seq_len, s.batch * s.n_heads, "backward query pass");
    ops::with_flash_head_dim(s.head_dim, [&]<int HD>() {
      detail::flash_backward_key_kernel<T, HD><<<key_grid, detail::kFlashBlockRows, 0, stream>>>(a);
      TESSERA_CUDA_CHECK(cudaGetLastError());
      detail::flash_query_kernel<T, HD, true><<<query_grid, detail::kFlashBlockRows, 0, stream>>>(a);
      TESSERA_CUDA_CHECK(cudaGetLastError());
    });
  }
}

}  // namespace tessera::cuda
