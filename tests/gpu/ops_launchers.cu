// Launchers for the GPU op tests: copy host inputs to the device, run an ops/ functor
// through tessera::cuda::for_each, copy the result back. Kernels only; the checks are
// in test_gpu_ops.cpp.
#include <vector>

#include "ops_launchers.hpp"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/ops/ops.hpp"

namespace {
template <class T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  TESSERA_CUDA_CHECK(cudaMalloc(&d, v.size() * sizeof(T) + 1));
  TESSERA_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, std::size_t n) {
  std::vector<T> v(n);
  TESSERA_CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}
}  // namespace

namespace tessera::gpu_test {

int device_count() { return cuda::device_count(); }

std::vector<float> rmsnorm_forward(const std::vector<float>& x, const std::vector<float>& w, std::int64_t rows,
                                   float eps) {
  const auto n = static_cast<std::int64_t>(w.size());
  float *dx = to_device(x), *dw = to_device(w), *dy = to_device(x), *drstd = to_device(std::vector<float>(rows));
  cuda::for_each(rows, ops::RmsNormForward<float>{dx, n, dw, dy, n, drstd, n, eps});
  auto y = to_host(dy, x.size());
  for (float* p : {dx, dw, dy, drstd}) TESSERA_CUDA_CHECK(cudaFree(p));
  return y;
}

std::vector<float> swiglu_forward(const std::vector<float>& a, const std::vector<float>& b) {
  float *da = to_device(a), *db = to_device(b), *dg = to_device(a);
  cuda::for_each(static_cast<std::int64_t>(a.size()), ops::SwiGluForward<float>{da, db, dg});
  auto g = to_host(dg, a.size());
  for (float* p : {da, db, dg}) TESSERA_CUDA_CHECK(cudaFree(p));
  return g;
}

std::vector<float> adamw_step(std::vector<float> p, const std::vector<float>& g, float lr) {
  std::vector<float> zeros(p.size(), 0.0f);
  float *dp = to_device(p), *dg = to_device(g), *dm = to_device(zeros), *dv = to_device(zeros);
  cuda::for_each(static_cast<std::int64_t>(p.size()),
                 ops::AdamWStep<float>{dp, dg, dm, dv, lr, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f, 1.0f});
  auto out = to_host(dp, p.size());
  for (float* q : {dp, dg, dm, dv}) TESSERA_CUDA_CHECK(cudaFree(q));
  return out;
}

}  // namespace tessera::gpu_test
