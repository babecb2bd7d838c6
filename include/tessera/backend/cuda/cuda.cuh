// The CUDA backend with its kernels, for a file nvcc compiles: tessera::Cuda (cuda.hpp)
// and the definitions of every kernel it launches (the per-index kernel, the ops' own
// kernels, flash attention). A .cu file that includes this header and trains a model
// over Cuda compiles the kernels it launches, with nothing else to link: the library
// stays header-only. kernels.hpp says how a program compiles them once instead.
#pragma once

#include "tessera/backend/cuda/cuda.hpp"
#include "tessera/backend/cuda/flash_attention.cuh"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/backend/cuda/row_kernels.cuh"
