// The arithmetic of every op, as host/device functors.
#pragma once

#include "tessera/ops/adamw.hpp"
#include "tessera/ops/cross_entropy.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/embedding.hpp"
#include "tessera/ops/flash_attention.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/rmsnorm.hpp"
#include "tessera/ops/rope.hpp"
#include "tessera/ops/softmax.hpp"
#include "tessera/ops/swiglu.hpp"
