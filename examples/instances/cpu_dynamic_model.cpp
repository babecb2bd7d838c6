// The DynamicModel llama-train trains on the CPU, and its trainer, compiled once for the
// whole build (tessera/instances.hpp).
#include "tessera/instances.hpp"

namespace tessera {
TESSERA_CPU_DYNAMIC_MODEL_INSTANCES(template)
}  // namespace tessera
