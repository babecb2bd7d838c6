// The Llama model over the CPU in fp32 and what the binaries call of it, compiled once
// for the whole build (tessera/instances.hpp).
#include "tessera/instances.hpp"

namespace tessera {
TESSERA_CPU_MODEL_INSTANCES(template)
}  // namespace tessera
