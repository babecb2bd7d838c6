// Scalar helpers shared by the ops: exp, log, sqrt and sigmoid for float and double,
// on host and device.
#pragma once

#include <cmath>

#include "tessera/core/macros.hpp"

namespace tessera::ops {

template <class T>
TESSERA_HD inline T exp_(T x) {
  return std::exp(x);
}
template <class T>
TESSERA_HD inline T log_(T x) {
  return std::log(x);
}
template <class T>
TESSERA_HD inline T sqrt_(T x) {
  return std::sqrt(x);
}
template <class T>
TESSERA_HD inline T sigmoid(T x) {
  return T(1) / (T(1) + exp_(-x));
}

}  // namespace tessera::ops
