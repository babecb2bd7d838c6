// The Llama model the example binaries build: every policy chosen at run time.
// It stands where a job's config meets the model (train/), above both the layers (nn/)
// and the policies (parallel/) it puts together.
//
// DynamicBlock wraps the Llama block in each policy family with its choice left to the
// Plan (parallel/plan.hpp), which the config's [parallelism] and [activation_checkpoint]
// keys fill: one compiled model type runs every layout and checkpoint mode. llama-train
// trains it, llama-plan traces it (plan/dry_run.hpp), the tests hold it to one rank.
#pragma once

#include "tessera/nn/block.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"
#include "tessera/parallel/policies.hpp"

namespace tessera {

template <class T, class B>
using DynamicBlock =
    Parallel<nn::LlamaBlock<T, B>, Sharding<Dynamic>, TensorParallel<dynamic>, Pipeline<dynamic>, Checkpoint<Dynamic>>;

template <class T, class B>
using DynamicModel = nn::Transformer<T, B, DynamicBlock<T, B>>;

}  // namespace tessera
