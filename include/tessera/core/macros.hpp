// Portability macros shared by every header.
//
// TESSERA_HD marks a function that runs on both host and device. It expands to
// `__host__ __device__` under nvcc and to nothing under a host compiler, so the
// arithmetic in ops/ is written once and compiled by g++ for the CPU backend and
// by nvcc for the CUDA backend.
#pragma once

#if defined(__CUDACC__)
#define TESSERA_HD __host__ __device__
#define TESSERA_DEVICE_COMPILE 1
#else
#define TESSERA_HD
#define TESSERA_DEVICE_COMPILE 0
#endif

#define TESSERA_INLINE inline
