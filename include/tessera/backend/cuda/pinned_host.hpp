// cuda::PinnedHost: the CUDA backend's host backend (backend/host.hpp), what FSDP's CPU
// offload keeps its flat shards in on a GPU.
//
// Its tensors are page-locked host memory (cudaHostAlloc, portable: every device's copy
// engines reach it), so Cuda::copy_from_pinned and Cuda::copy_to_pinned move a shard at
// the bus's rate and asynchronously, in the compute stream's order, with no staging
// through the pageable bounce buffer. Its loops are the CPU backend's (OpenMP over the
// host's cores, the same ops/ functors the GPU launches), so an offloaded shard's
// optimizer step is AdamW's arithmetic as every backend does it. Counted as
// Device::host: the device's memory figures leave it out.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/backend/cuda/cuda.hpp"
#include "tessera/backend/cuda/memory.hpp"
#include "tessera/core/buffer.hpp"
#include "tessera/core/error.hpp"

namespace tessera::cuda {

/// Page-locked host memory (cudaHostAlloc, portable).
struct PinnedPages {
  static void* allocate(std::size_t bytes) {
    require_device();
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess || p == nullptr) {
      (void)cudaGetLastError();  // not sticky: clear it
      fail_out_of_memory("out of page-locked host memory allocating ", bytes,
                         " bytes to offload (cudaHostAlloc: ", cudaGetErrorString(e), ")");
    }
    return p;
  }
  static void release(void* p) noexcept { (void)cudaFreeHost(p); }
};

struct PinnedHost : cpu::HostMemory<PinnedHost, PinnedPages> {};

static_assert(Backend<PinnedHost>, "tessera: cuda::PinnedHost must satisfy the Backend concept");
static_assert(is_host_backend<PinnedHost>);

}  // namespace tessera::cuda
