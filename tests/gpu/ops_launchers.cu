// Launchers for the GPU op tests: device memory for the checks, and ops/ functors run
// through cuda::launch_op (the lowered kernels of backend/cuda/row_kernels.cuh) or
// cuda::for_each (one index per thread). Kernels only; the checks are in
// test_gpu_ops.cpp.
#include <cuda_runtime.h>

#include <vector>

#include "ops_launchers.hpp"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/backend/cuda/row_kernels.cuh"
#include "tessera/core/dtype.hpp"
#include "tessera/ops/ops.hpp"

namespace tessera::gpu_test {

// Which functors have kernels of their own is a compile-time property: these pin it.
static_assert(cuda::HasOpKernel<ops::RmsNormForward<float>>);
static_assert(cuda::HasOpKernel<ops::RmsNormBackwardInput<bf16>>);
static_assert(cuda::HasOpKernel<ops::RmsNormBackwardWeight<float>>);
static_assert(cuda::HasOpKernel<ops::CrossEntropyRow<bf16>>);
static_assert(cuda::HasOpKernel<ops::CrossEntropyRow<float, bf16>>);
static_assert(cuda::HasOpKernel<ops::CausalSoftmaxForward<float>>);
static_assert(cuda::HasOpKernel<ops::RopeRotate<float>>);
static_assert(cuda::HasOpKernel<ops::SwiGluBackward<float>>);
static_assert(cuda::HasOpKernel<ops::SwiGluForwardRows<bf16>> && cuda::HasOpKernel<ops::SwiGluBackwardRows<float>>);
static_assert(cuda::HasOpKernel<ops::SwiGluForwardPaired<bf16>> && cuda::HasOpKernel<ops::SwiGluBackwardPaired<float>>);
static_assert(cuda::HasOpKernel<ops::Fill<bf16>>);
static_assert(!cuda::HasOpKernel<ops::RmsNormForward<double>>, "double runs one index per thread");
static_assert(!cuda::HasOpKernel<ops::AdamWStep<float>>, "one tensor's AdamW is not lowered");
static_assert(cuda::HasOpKernel<ops::AdamWMultiStep<bf16, float>>);

int device_count() { return cuda::device_count(); }

bool cross_entropy_one_read_runs() { return cuda::detail::one_read_runs_here<float, bf16, 32>(); }

int device_compute_major() {
  int device = 0, major = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major;
}

void* device_allocate(std::size_t bytes) {
  void* p = nullptr;
  TESSERA_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void device_release(void* p) { TESSERA_CUDA_CHECK(cudaFree(p)); }

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  TESSERA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  TESSERA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

template <class F>
void launch_op(std::int64_t n, const F& f) {
  cuda::launch_op(n, f, cuda::compute_stream());
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
}

template <class F>
void launch_op_on_side_stream(std::int64_t n, const F& f) {
  cudaStream_t side = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cuda::launch_op(n, f, side);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(side));
  TESSERA_CUDA_CHECK(cudaStreamDestroy(side));
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
}

template <class F>
void launch_per_index(std::int64_t n, const F& f) {
  cuda::for_each(n, f, cuda::compute_stream());
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
}

std::vector<float> adamw_step(std::vector<float> p, const std::vector<float>& g, float lr) {
  const std::vector<float> zeros(p.size(), 0.0f);
  DeviceArray<float> dp(p), dg(g), dm(zeros), dv(zeros);
  launch_op(static_cast<std::int64_t>(p.size()),
            ops::AdamWStep<float>{dp.data(), dg.data(), dm.data(), dv.data(), lr, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f,
                                  0.05f, 1.0f});
  return dp.download();
}

// The functors the checks launch, per element type.
#define TESSERA_GPU_TEST_LAUNCHERS(F)                                        \
  template void launch_op<F>(std::int64_t, const F&);                       \
  template void launch_op_on_side_stream<F>(std::int64_t, const F&);        \
  template void launch_per_index<F>(std::int64_t, const F&);

#define TESSERA_GPU_TEST_OPS(T)                                \
  TESSERA_GPU_TEST_LAUNCHERS(ops::RmsNormForward<T>)           \
  TESSERA_GPU_TEST_LAUNCHERS(ops::RmsNormBackwardInput<T>)     \
  TESSERA_GPU_TEST_LAUNCHERS(ops::RmsNormBackwardWeight<T>)    \
  TESSERA_GPU_TEST_LAUNCHERS(ops::RmsNormBackward<T>)          \
  TESSERA_GPU_TEST_LAUNCHERS(ops::CrossEntropyRow<T>)          \
  TESSERA_GPU_TEST_LAUNCHERS(ops::CrossEntropyShardMax<T>)     \
  TESSERA_GPU_TEST_LAUNCHERS(ops::CrossEntropyShardExp<T>)     \
  TESSERA_GPU_TEST_LAUNCHERS(ops::CrossEntropyShardGrad<T>)    \
  TESSERA_GPU_TEST_LAUNCHERS(ops::CausalSoftmaxForward<T>)     \
  TESSERA_GPU_TEST_LAUNCHERS(ops::CausalSoftmaxRecompute<T>)   \
  TESSERA_GPU_TEST_LAUNCHERS(ops::CausalSoftmaxBackward<T>)    \
  TESSERA_GPU_TEST_LAUNCHERS(ops::RowDot<T>)                   \
  TESSERA_GPU_TEST_LAUNCHERS(ops::RopeRotate<T>)               \
  TESSERA_GPU_TEST_LAUNCHERS(ops::SwiGluForward<T>)            \
  TESSERA_GPU_TEST_LAUNCHERS(ops::SwiGluBackward<T>)           \
  TESSERA_GPU_TEST_LAUNCHERS(ops::SwiGluForwardRows<T>)        \
  TESSERA_GPU_TEST_LAUNCHERS(ops::SwiGluBackwardRows<T>)       \
  TESSERA_GPU_TEST_LAUNCHERS(ops::SwiGluForwardPaired<T>)      \
  TESSERA_GPU_TEST_LAUNCHERS(ops::SwiGluBackwardPaired<T>)     \
  TESSERA_GPU_TEST_LAUNCHERS(ops::Add<T>)                      \
  TESSERA_GPU_TEST_LAUNCHERS(ops::Copy<T>)                     \
  TESSERA_GPU_TEST_LAUNCHERS(ops::Axpy<T>)                     \
  TESSERA_GPU_TEST_LAUNCHERS(ops::Scale<T>)                    \
  TESSERA_GPU_TEST_LAUNCHERS(ops::Fill<T>)

TESSERA_GPU_TEST_OPS(float)
TESSERA_GPU_TEST_OPS(bf16)
TESSERA_GPU_TEST_LAUNCHERS(ops::RmsNormForward<double>)  // no kernel of its own: the per-index fallback
// The bf16 model's cross-entropy: float logits, the gradient written as bf16.
using CrossEntropyFloatToBf16 = ops::CrossEntropyRow<float, bf16>;
TESSERA_GPU_TEST_LAUNCHERS(CrossEntropyFloatToBf16)
// Multi-tensor AdamW with bf16 moments, over fp32 parameters (with or without masters) and a bf16 model.
using AdamWFloatBf16Moments = ops::AdamWMultiStep<float, bf16>;
using AdamWBf16Bf16Moments = ops::AdamWMultiStep<bf16, bf16>;
TESSERA_GPU_TEST_LAUNCHERS(AdamWFloatBf16Moments)
TESSERA_GPU_TEST_LAUNCHERS(AdamWBf16Bf16Moments)
// And with fp32 moments: a bf16 model (fp32 masters) and an fp32 one.
using AdamWBf16FloatMoments = ops::AdamWMultiStep<bf16, float>;
using AdamWFloatFloatMoments = ops::AdamWMultiStep<float, float>;
TESSERA_GPU_TEST_LAUNCHERS(AdamWBf16FloatMoments)
TESSERA_GPU_TEST_LAUNCHERS(AdamWFloatFloatMoments)

}  // namespace tessera::gpu_test
