// Host-side declarations of the CUDA backend launchers (defined in backend_launchers.cu):
// what the checks in test_gpu_backend.cpp call, in host types only.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/caching_allocator.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"

namespace tessera::gpu_test {

/// Cuda::gemm on device copies of the host tensors the views look into (each view at the
/// same offset and strides in its copy). Returns the whole of c_store afterwards.
/// T is float or bf16.
template <class T, class C = T>
Tensor<C> cuda_gemm(Trans ta, Trans tb, accum_t<T> alpha, const Tensor<T>& a_store, TensorView<const T> a,
                    const Tensor<T>& b_store, TensorView<const T> b, accum_t<T> beta, const Tensor<C>& c_store,
                    TensorView<C> c);

/// Cuda::gemm reading C apart from the D it writes (whole tensors, D of C's shape): D, and
/// C as it is afterwards. T is float or bf16; C is T, or float from bf16 operands.
template <class T, class C = T>
std::pair<Tensor<C>, Tensor<C>> cuda_gemm_apart(Trans ta, Trans tb, accum_t<T> alpha, const Tensor<T>& a,
                                                const Tensor<T>& b, accum_t<T> beta, const Tensor<C>& c);

/// As cuda_gemm on whole tensors, once for every algorithm cuda::gemm_candidates offers
/// (each run starts from c), in the heuristic's order. T is float or bf16.
/// `described`, when given, gets each candidate's configuration (cuda::gemm_algo_text).
template <class T>
std::vector<Tensor<T>> cuda_gemm_each_candidate(Trans ta, Trans tb, float alpha, const Tensor<T>& a, const Tensor<T>& b,
                                                float beta, const Tensor<T>& c,
                                                std::vector<std::string>* described = nullptr);

/// Where the algorithm gemm() chose (cuda::gemm_chosen_algo) stands among
/// gemm_candidates for this float GEMM: its index, or -1 when it is not among them.
int chosen_algo_index(Trans ta, Trans tb, const Tensor<float>& a, const Tensor<float>& b, const Tensor<float>& c);

/// gemm_candidates for a float GEMM whose A starts one byte into a device block: no
/// algorithm can read it, so this throws naming the GEMM.
std::size_t candidates_for_misaligned_gemm();

/// A cuBLASLt call that fails (a preference attribute of the wrong size) under
/// TESSERA_CUBLAS_CHECK, with a GEMM's description as the context.
void failing_cublas_call();

/// The "no device" error, as cudaGetDeviceCount's failure (runtime_error) or as a count
/// of zero would raise it.
void check_device_count(bool runtime_error);

/// Cuda::attention_forward<bf16> through the backend member: o and the fp32 lse.
std::pair<Tensor<bf16>, Tensor<float>> cuda_attention_forward_bf16(const AttentionShape& s, const Tensor<bf16>& q,
                                                                   const Tensor<bf16>& k, const Tensor<bf16>& v);

/// upload<Cuda> then download<Cuda>; `uploaded_on` receives the device tensor's device.
template <class T>
Tensor<T> round_trip(const Tensor<T>& host, Device* uploaded_on);

/// Cuda::zeros<T>(shape) downloaded, made right after a tensor of the same size filled
/// with ones was freed (so the block it gets has held non-zero bytes).
template <class T>
Tensor<T> zeros_after_reuse(Shape shape);

/// ops::SwiGluForward run by Cuda::for_each on device copies of a and b.
Tensor<float> cuda_swiglu(const Tensor<float>& a, const Tensor<float>& b);

/// A device tensor from Cuda::empty<float>, handed to host code to hold and free.
Tensor<float> cuda_empty(Shape shape);

/// The caching allocator's counters for the current device.
CachingAllocator::Stats allocator_stats();

/// What the current device's allocator did with a block freed at the end of its large
/// pool and a request twice its size after it (backend/cuda/memory.hpp): how it takes
/// memory, whether the freed block had been placed at the end, whether the larger block
/// began where the freed one did, the bytes reserved before and after it, and whether
/// bytes written over the whole larger block (cudaMemset) read back at both its ends.
struct GrowthCheck {
  std::string mode;
  bool y_at_end = false;
  bool same_address = false;
  std::size_t reserved_before = 0, reserved_after = 0;
  bool values_read_back = false;
  // Then: the bytes empty_cache gave back from that block's pages inside the segment
  // (a block in use on each side), and a block over them: at its address, written and
  // read back.
  std::size_t unmapped_inside = 0;
  bool remapped_same_address = false, remapped_read_back = false;
};
GrowthCheck allocator_growth();

/// The compute stream (cuda::compute_stream()), and the backend's work captured on it: a
/// GEMM (c = a b) then a lowered kernel (c *= 0.5) run eagerly, then issued again into
/// another output under stream capture, the graph replayed twice.
struct CaptureCheck {
  bool created = false;  // not the legacy default stream
  bool stable = false;   // the same stream on every call, and Cuda::stream()'s
  std::size_t nodes = 0;          // the captured graph's
  bool scratch_from_pool = false;  // a tensor allocated inside the capture came from the graph pool
  bool copy_refused = false;       // a copy from the host inside a capture was refused by name
  bool capture_ended = false;      // ... and the refused capture was ended
  Tensor<float> eager, replayed;  // the outputs, downloaded
};
CaptureCheck capture_backend_work(const Tensor<float>& a, const Tensor<float>& b);

}  // namespace tessera::gpu_test
