// llama-train over the CUDA backend: the instantiations of train_run.hpp's run_rank with
// B = Cuda (see train_cuda.hpp). Host C++: the kernels it launches come from the build's
// kernel library (examples/instances/cuda_kernels.cu).
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "tessera/backend/cuda/cuda.hpp"
#include "tessera/backend/cuda/select_attention.hpp"
#include "train_cuda.hpp"
#include "train_run.hpp"

namespace tessera::llama_train {

CudaDeviceInfo cuda_device_info() {
  CudaDeviceInfo d;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    d.why = status != cudaSuccess ? std::string("cudaGetDeviceCount: ") + cudaGetErrorName(status) + ": " +
                                        cudaGetErrorString(status)
                                  : "cudaGetDeviceCount: 0 devices";
    (void)cudaGetLastError();  // clear the sticky error of a missing driver
    return d;
  }
  d.visible = true;
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp p{};
  TESSERA_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  d.name = p.name;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  // Dense tensor-core bf16 and plain fp32 (no TF32) peaks of the parts MFU is quoted for.
  const bool pcie = d.name.find("PCIe") != std::string::npos;
  if (p.major == 9 && p.minor == 0) {  // H100, H200
    d.peak_bf16 = pcie ? 756e12 : 989e12;
    d.peak_fp32 = pcie ? 51e12 : 67e12;
  } else if (p.major == 8 && p.minor == 0) {  // A100
    d.peak_bf16 = 312e12;
    d.peak_fp32 = 19.5e12;
  }
  return d;
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error of a missing driver
    return 0;
  }
  return count;
}

void use_cuda_device(int device) { TESSERA_CUDA_CHECK(cudaSetDevice(device)); }

std::string setup_cuda_allocator(const train::JobConfig& c) {
  cuda::set_expandable_segments(c.training.expandable_segments);
  const int device = cuda::current_device();
  (void)cuda::device_allocator(device);  // created now, in the mode asked for
  return cuda::expandable_segments_status(device);
}

std::string setup_cuda_attention(const train::JobConfig& c) {
  const nn::ModelArgs& a = c.model.args;
  // One rank's attention call: heads split by tensor parallelism, one micro-batch;
  // under context parallelism a block of one chunk a sequence, causal and full
  // (parallel/context_parallel.hpp).
  const std::int64_t tp = c.parallelism.tensor_parallel_degree, cp = c.parallelism.context_parallel_degree;
  const std::int64_t batch = c.parallelism.pipeline_parallel_degree > 1 ? c.parallelism.pipeline_parallel_microbatch_size
                                                                        : c.training.local_batch_size;
  const std::int64_t length = cp > 1 ? c.training.seq_len / (2 * cp) : c.training.seq_len;
  const AttentionShape s{batch, length, a.n_heads / tp, std::max<std::int64_t>(1, a.kv_heads() / tp), a.head_dim()};
  return cuda::select_attention(c.training.attention, c.training.mixed_precision_param == "bfloat16", s,
                                c.training.deterministic, cp > 1, c.training.document_mask)
      .text;
}

comm::MemoryAccess cuda_memory_access() { return Cuda::memory_access(); }

profile::Annotations nvtx_annotations() {
  profile::Annotations a;
  a.push = [](const char* name) { (void)nvtxRangePushA(name); };
  a.pop = [] { (void)nvtxRangePop(); };
  return a;
}

int run_rank_cuda(comm::Communicator world, const RunInputs& in) {
  if (in.config->training.mixed_precision_param == "bfloat16") return run_rank<DynamicModel<bf16, Cuda>>(world, in);
  return run_rank<DynamicModel<float, Cuda>>(world, in);
}

}  // namespace tessera::llama_train
