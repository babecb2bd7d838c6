// llama-train's CUDA side, defined in llama_train_cuda.cpp and linked where the build
// found CUDA (with the kernels of examples/instances/cuda_kernels.cu); llama_train.cpp
// calls it through these plain declarations, which include no CUDA header.
#pragma once

#include <string>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/memory_access.hpp"
#include "train_run.hpp"

namespace tessera::llama_train {

/// The device this process trains on (the current one), as the header line and MFU need it.
struct CudaDeviceInfo {
  bool visible = false;  // false: no device, or no driver (`why` says which)
  std::string why;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  double peak_bf16 = 0, peak_fp32 = 0;  // dense FLOP/s of the known parts (H100, H200, A100); 0: unknown
};
CudaDeviceInfo cuda_device_info();

/// The CUDA devices this process sees (after CUDA_VISIBLE_DEVICES); 0 with no device or
/// no driver.
int cuda_device_count();

/// Makes `device` this thread's current device: the one a process of a multi-process
/// launch trains on (comm::choose_device), set before anything touches the GPU.
void use_cuda_device(int device);

/// Sets up the current GPU's caching allocator as training.expandable_segments asks
/// (backend/cuda/memory.hpp), before anything is allocated on it, and returns the
/// start-up line's words for how it takes memory ("expandable segments", or "a segment
/// per block" and why).
std::string setup_cuda_allocator(const train::JobConfig& c);

/// Resolves training.attention for a run on this GPU (backend/cuda/attention_choice.hpp):
/// loads cuDNN and builds the model's attention graphs where it may run, installs the
/// chosen engine in the CUDA backend (backend/cuda/attention_engine.hpp) and returns
/// the start-up line's words for it. "cudnn" that cannot run throws, naming the key.
std::string setup_cuda_attention(const train::JobConfig& c);

/// How thread ranks sharing the GPU move and reduce its buffers (Cuda::memory_access()).
comm::MemoryAccess cuda_memory_access();

/// NVTX ranges for a recorded step's spans (profiling.enable_profiling): under Nsight
/// Systems each span shows over the kernels it launched.
profile::Annotations nvtx_annotations();

/// run_rank over the CUDA backend: nn::Transformer<bf16, Cuda, ...> when
/// training.mixed_precision_param is "bfloat16" (bf16 activations and parameters, fp32
/// gradients and AdamW state), nn::Transformer<float, Cuda, ...> when it is "float32".
int run_rank_cuda(comm::Communicator world, const RunInputs& in);

}  // namespace tessera::llama_train
