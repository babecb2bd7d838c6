// The model over the CUDA backend, for the checks in test_gpu_model.cpp: every
// instantiation of nn::Transformer, train::Trainer and the checkpoint functions with
// B = Cuda is compiled here, behind the plain functions model_launchers.hpp declares.
// Host C++: the kernels come from the build's kernel library
// (examples/instances/cuda_kernels.cu).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model_launchers.hpp"
#include "tessera/backend/cuda/cuda.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/comm/self.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"
#include "tessera/train/trainer.hpp"

namespace tessera::gpu_test {

namespace {

using CudaModel = nn::Transformer<float, Cuda>;
using CudaDynamicModel = DynamicModel<float, Cuda>;
using CudaBf16Model = DynamicModel<bf16, Cuda>;

/// Host, pinned host, managed or device memory for n elements of T, freed at the end
/// of the scope; every CUDA call checked.
template <class T>
class Placed {
 public:
  Placed(Place at, std::size_t n) : at_(at), n_(n) {
    cuda::require_device();
    const std::size_t bytes = (n > 0 ? n : 1) * sizeof(T);
    switch (at) {
      case Place::device: TESSERA_CUDA_CHECK(cudaMalloc(&p_, bytes)); break;
      case Place::host: host_.resize(n > 0 ? n : 1); p_ = host_.data(); break;
      case Place::pinned_host: TESSERA_CUDA_CHECK(cudaMallocHost(&p_, bytes)); break;
      case Place::managed: TESSERA_CUDA_CHECK(cudaMallocManaged(&p_, bytes)); break;
    }
  }
  ~Placed() {
    // A destructor cannot report: the frees' codes are dropped (the test has its results).
    switch (at_) {
      case Place::device:
      case Place::managed: (void)cudaFree(p_); break;
      case Place::pinned_host: (void)cudaFreeHost(p_); break;
      case Place::host: break;
    }
  }
  Placed(const Placed&) = delete;
  Placed& operator=(const Placed&) = delete;

  T* data() const { return static_cast<T*>(p_); }

  void set(const std::vector<T>& v) {
    TESSERA_CUDA_CHECK(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyDefault));
  }
  std::vector<T> get() const {
    std::vector<T> v(n_);
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
    TESSERA_CUDA_CHECK(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDefault));
    return v;
  }

 private:
  Place at_;
  std::size_t n_;
  void* p_ = nullptr;
  std::vector<T> host_;
};

}  // namespace

ForwardBackward cuda_forward_backward(const train::JobConfig& c) { return forward_backward_once<CudaModel>(c); }

TrainRun cuda_train_steps(const train::JobConfig& c) { return train_steps<CudaModel>(c); }

ForwardBackward cuda_dynamic_forward_backward(const train::JobConfig& c) {
  return forward_backward_once<CudaDynamicModel>(c);
}

TrainRun cuda_dynamic_train_steps(const train::JobConfig& c) { return train_steps<CudaDynamicModel>(c); }

ForwardBackward cuda_bf16_forward_backward(const train::JobConfig& c) { return forward_backward_once<CudaBf16Model>(c); }

TrainRun cuda_bf16_train_steps(const train::JobConfig& c) { return train_steps<CudaBf16Model>(c); }

DecodeRun cuda_decode(const train::JobConfig& c, const std::vector<std::int32_t>& ids,
                      const std::vector<std::size_t>& steps, const std::vector<std::int32_t>& prompt,
                      const nn::SampleOptions& o) {
  return decode_run<CudaModel>(c, ids, steps, prompt, o);
}

DecodeRun cuda_bf16_decode(const train::JobConfig& c, const std::vector<std::int32_t>& ids,
                           const std::vector<std::size_t>& steps, const std::vector<std::int32_t>& prompt,
                           const nn::SampleOptions& o) {
  return decode_run<CudaBf16Model>(c, ids, steps, prompt, o);
}

std::vector<test::RunResult> cuda_thread_ranks(comm::MeshShape shape, const train::JobConfig& c) {
  std::vector<test::RunResult> per_rank(static_cast<std::size_t>(shape.world()));
  comm::ThreadOptions options;
  options.memory = Cuda::memory_access();
  comm::run_thread_ranks(
      shape.world(),
      [&](comm::Communicator& world) {
        per_rank[static_cast<std::size_t>(world.rank())] = test::train_layout<CudaDynamicModel>(world, shape, c);
      },
      options);
  return per_rank;
}

test::RunResult cuda_one_rank(const train::JobConfig& c) {
  return test::train_layout<CudaDynamicModel>(comm::Communicator(comm::SelfEngine(Cuda::memory_access())),
                                              comm::MeshShape{}, c);
}

NamedValues cuda_save_model(const train::JobConfig& c, const std::string& path) {
  CudaModel model(c.model.args);
  model.init_weights(static_cast<std::uint64_t>(c.training.seed));
  train::save_model(model, path, DType::f32);
  return parameter_values(model);
}

NamedValues cuda_load_model(const train::JobConfig& c, const std::string& path) {
  CudaModel model(c.model.args);
  train::load_model(model, path);
  return parameter_values(model);
}

void cuda_allocate(std::size_t bytes) {
  const Tensor<float> t = Cuda::empty<float>(Shape{static_cast<std::int64_t>(bytes / sizeof(float))});
  Cuda::synchronize();
}

std::vector<float> cuda_round_trip(const std::vector<float>& v) {
  const Tensor<float> d = upload<Cuda>(std::span<const float>(v));
  const Tensor<float> host = download<Cuda>(d);
  return std::vector<float>(host.data(), host.data() + host.numel());
}

template <class T>
std::vector<T> memory_access_reduce(std::vector<T> dst, const std::vector<T>& src, comm::ReduceOp op, Place dst_at,
                                    Place src_at) {
  TESSERA_CHECK(dst.size() == src.size(), "memory_access_reduce: ", dst.size(), " and ", src.size(), " elements");
  Placed<T> d(dst_at, dst.size()), s(src_at, src.size());
  d.set(dst);
  s.set(src);
  Cuda::memory_access().reduce(d.data(), s.data(), dst.size(), comm::data_type_of<T>(), op);
  return d.get();
}

template std::vector<float> memory_access_reduce(std::vector<float>, const std::vector<float>&, comm::ReduceOp, Place,
                                                 Place);
template std::vector<double> memory_access_reduce(std::vector<double>, const std::vector<double>&, comm::ReduceOp,
                                                  Place, Place);
template std::vector<std::int32_t> memory_access_reduce(std::vector<std::int32_t>, const std::vector<std::int32_t>&,
                                                        comm::ReduceOp, Place, Place);
template std::vector<std::int64_t> memory_access_reduce(std::vector<std::int64_t>, const std::vector<std::int64_t>&,
                                                        comm::ReduceOp, Place, Place);

void memory_access_reduce_type(comm::DataType t, std::size_t n) {
  Placed<std::uint8_t> d(Place::device, n * comm::size_of(t)), s(Place::device, n * comm::size_of(t));
  Cuda::memory_access().reduce(d.data(), s.data(), n, t, comm::ReduceOp::sum);
}

std::vector<float> memory_access_copy(const std::vector<float>& v, Place from, Place to) {
  Placed<float> s(from, v.size()), d(to, v.size());
  s.set(v);
  Cuda::memory_access().copy(d.data(), s.data(), v.size() * sizeof(float));
  return d.get();
}

std::vector<float> memory_access_overlapping_copy(const std::vector<float>& v, std::size_t shift) {
  TESSERA_CHECK(shift <= v.size(), "memory_access_overlapping_copy: shift ", shift, " of ", v.size());
  Placed<float> b(Place::device, v.size());
  b.set(v);
  Cuda::memory_access().copy(b.data() + shift, b.data(), (v.size() - shift) * sizeof(float));
  return b.get();
}

std::vector<CollectiveResults> cuda_thread_collectives(int ranks, std::size_t n) {
  return thread_collectives<Cuda>(ranks, n, Cuda::memory_access());
}

Float8CastValues cuda_float8_cast(const Tensor<float>& x, ops::Float8Cast cast, bool transpose, bool kept_row_amaxes) {
  return float8_cast_on<Cuda>(x, cast, transpose, kept_row_amaxes);
}

Float8CastValues cuda_float8_transposed(const Tensor<float>& x, ops::Float8Cast cast) {
  return float8_transposed_on<Cuda>(x, cast);
}

std::array<Float8CastValues, 2> cuda_float8_both_layouts(const Tensor<float>& x, ops::Float8Cast cast) {
  return float8_both_layouts_on<Cuda>(x, cast);
}

std::vector<float> cuda_float8_gemm(Trans ta, Trans tb, const Tensor<float>& a, ops::Float8Cast ca,
                                    const Tensor<float>& b, ops::Float8Cast cb, std::int64_t m, std::int64_t n,
                                    nn::Float8GemmOptions options, const Tensor<float>* residual) {
  return float8_gemm_on<Cuda>(ta, tb, a, ca, b, cb, m, n, options, residual);
}

}  // namespace tessera::gpu_test
