// Host-side declarations of the flash attention launchers (defined in flash_launchers.cu).
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/ops/attention_shape.hpp"

namespace tessera::gpu_test {

/// One flash attention run on the device, with host data as float. Matrices are dense
/// on the host ((B*T, H*hd) or (B*T, KV*hd)); on the device each row gets `pad` extra
/// columns (ld = cols + pad), which decides between vector and scalar tile loads.
struct FlashRun {
  AttentionShape shape;
  std::int64_t pad = 0;
  bool bf16 = false;                // store every matrix as bf16 on the device
  std::vector<float> q, k, v, d_o;  // inputs (k and v: past + seq_len rows a sequence)
  std::vector<float> dq, dk, dv;    // in: the outputs' initial contents; out: the results
  std::vector<float> o, lse;        // out: o (B*T, H*hd), lse (B, H, T)
  std::vector<ops::DocumentSpan> documents;  // packed documents (B*T rows), uploaded for the device; empty: none
};

/// cuda::flash_attention_forward, then cuda::flash_attention_backward on the forward's
/// o and lse.
void flash_attention(FlashRun& run);

/// Decoding: cuda::flash_attention_forward alone, after run.shape.past keys of a KV
/// cache (k and v hold past + seq_len rows a sequence), with the scratch its runs of
/// keys take (ops::flash_split_scratch); fills run.o and run.lse.
void flash_decode(FlashRun& run);

/// Calls cuda::flash_attention_forward (float, or double when `float64`) on views
/// without storage: for the errors raised before any launch.
void flash_forward_without_data(const AttentionShape& s, bool float64);

}  // namespace tessera::gpu_test
