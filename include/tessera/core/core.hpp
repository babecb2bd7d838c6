// Everything in core/: element types, tensors, buffers, memory accounting, RNG, errors.
#pragma once

#include "tessera/core/buffer.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/core/tensor.hpp"
