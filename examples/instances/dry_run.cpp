// The dry runs of the fp32 and the bf16 model (plan/dry_run.hpp), compiled once for the
// whole build (tessera/instances.hpp).
#include "tessera/plan/dry_run.hpp"

namespace tessera::plan {
TESSERA_DRY_RUN_INSTANCES(template)
}  // namespace tessera::plan
