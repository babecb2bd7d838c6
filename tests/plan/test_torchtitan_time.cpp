// plan/torchtitan_time.hpp: torchtitan's eager FSDP2 step from a trace of tessera's FSDP
// step: its kernels site by site, FSDP2's copies around each collective, and what it
// refuses.
#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <vector>

#include "../support/trace_kernels.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/plan/layout.hpp"
#include "tessera/plan/machine.hpp"
#include "tessera/plan/torchtitan_time.hpp"

#ifndef TESSERA_MACHINES
#error "TESSERA_MACHINES must name the examples/machines folder (tests/plan/meson.build defines it)"
#endif

using namespace tessera;

namespace {

/// The debug model in bf16 with grouped-query attention (16 heads over 4), batches of
/// 2 x 32 tokens, FSDP over `ranks`, with `keys` on top.
train::JobConfig titan_config(int ranks, const std::vector<std::string>& keys = {}) {
  std::vector<std::string> o = {"--training.seq_len", "32", "--training.local_batch_size", "2",
                                "--training.mixed_precision_param", "bfloat16", "--model.n_kv_heads", "4",
                                "--parallelism.data_parallel_shard_degree", std::to_string(ranks)};
  o.insert(o.end(), keys.begin(), keys.end());
  return train::parse_config("[model]\nflavor = \"debugmodel\"\n", "test_torchtitan_time", o);
}

plan::TorchtitanRun run_of(const train::JobConfig& c, bool fused) {
  plan::TorchtitanRun r;
  r.args = c.model.args;
  r.fused_rmsnorm = fused;
  r.sm_count = 108;
  return r;
}

}  // namespace

TEST_CASE("torchtitan time: its eager kernels in place of tessera's, repeat_kv's copies, the fp32 loss, foreach AdamW") {
  const train::JobConfig c = titan_config(2);
  plan::StepTrace st = plan::dry_run_step<bf16>(c, 0, 2, 0);
  const std::int64_t layers = c.model.args.n_layers, norms = 2 * layers + 1;
  const std::int64_t losses = test::kernels_named(st.trace, "CrossEntropyRow<"), embeddings = test::kernels_named(st.trace, "EmbeddingBackward<");
  const std::int64_t optimizers = test::kernels_named(st.trace, "AdamWMultiStep<");
  REQUIRE(losses >= 1);
  REQUIRE(embeddings == 1);
  REQUIRE(optimizers >= 1);
  const plan::Machine a100 = plan::load_machine(std::string(TESSERA_MACHINES) + "/a100-80gb-sxm.toml");
  const plan::GpuPricer pricer(a100, plan::AttentionKernel::cudnn);
  const auto step = [&](const plan::StepTrace& s) { return plan::predict_layout({s}, pricer, a100.network.value()).step_seconds; };
  const double before = step(st);

  const plan::TorchtitanTimeRewrites r = plan::torchtitan_step_time(st, run_of(c, /*fused=*/true));
  using enum plan::EagerSite;
  const auto at = [&](plan::EagerSite s) { return r.eager[static_cast<std::size_t>(s)]; };
  // The Triton norm: tessera's passes stay, the weight's gradient summed from the SMs' partials.
  CHECK(at(rmsnorm_weight_gradient) == norms);
  CHECK(test::kernels_named(st.trace, "RmsNormForward<") == norms);
  CHECK(test::kernels_named(st.trace, "RmsNormBackwardWeight<") == 0);
  CHECK(test::kernels_named(st.trace, "Triton RMSNorm backward") == 2 * norms);
  const double dim = static_cast<double>(c.model.args.dim), rows = 2 * 32;
  CHECK(test::bytes_of_kernels_named(st.trace, "Triton RMSNorm backward") == doctest::Approx(norms * dim * (4 * 108 + 4 + 4 + 2)));
  CHECK(test::kernels_named(st.trace, "eager RoPE") == 3 * 4 * layers);
  // 16 query heads over 4 key/value heads: both copied to every query head and summed back.
  const double q = dim, kv = dim / 4;
  CHECK(test::kernels_named(st.trace, "repeat_kv: ") == 2 * layers);
  CHECK(test::kernels_named(st.trace, "repeat_kv backward") == 2 * layers);
  CHECK(test::bytes_of_kernels_named(st.trace, "repeat_kv") == doctest::Approx(4 * layers * rows * 2 * (q + kv)));
  CHECK(test::kernels_named(st.trace, "eager SwiGLU") == 5 * layers);
  CHECK(test::kernels_named(st.trace, "autograd: ") == 5 * layers);  // the residuals' sums are 2 a layer
  // tessera's norm backward adds the residual's gradient as it writes; the Triton norm
  // does not read it (autograd's sum does).
  CHECK(at(rmsnorm_backward_residual) == 2 * layers);
  CHECK(test::kernels_named(st.trace, "fused RMSNorm backward (input)") == 2 * layers);
  CHECK(test::kernels_named(st.trace, "RmsNormBackwardInput<") == 1);
  // The loss: 48 bytes a logit (the cast of its gradient to bf16 included) where
  // tessera's kernel reads 12 and writes 2.
  CHECK(at(cross_entropy) == losses);
  CHECK(test::kernels_named(st.trace, "CrossEntropyRow<") == 0);
  const double logits = rows * static_cast<double>(c.model.args.vocab_size);
  CHECK(test::bytes_of_kernels_named(st.trace, "eager loss") == doctest::Approx(48 * logits + 24 * rows + 4 * rows));
  CHECK(test::kernels_named(st.trace, "eager embedding backward") == 1);
  CHECK(test::bytes_of_kernels_named(st.trace, "eager embedding backward") == doctest::Approx(2 * c.model.args.vocab_size * dim));
  // AdamW: eight foreach passes, 80 bytes an element of the shard.
  CHECK(at(adamw) == optimizers);
  CHECK(test::kernels_named(st.trace, "foreach AdamW") == 8 * optimizers);
  CHECK(step(st) > before);

  // The eager norm (the 70B configs'): eight kernels forward, sixteen backward.
  plan::StepTrace eager = plan::dry_run_step<bf16>(c, 0, 2, 0);
  plan::torchtitan_step_time(eager, run_of(c, /*fused=*/false));
  CHECK(test::kernels_named(eager.trace, "RmsNorm") == 0);
  CHECK(test::kernels_named(eager.trace, "torch RMSNorm forward") == 8 * norms);
  CHECK(test::kernels_named(eager.trace, "torch RMSNorm backward") == 16 * norms);

  // As many key/value heads as query heads: no repeat_kv.
  const train::JobConfig mha = titan_config(2, {"--model.n_kv_heads", "16"});
  plan::StepTrace m = plan::dry_run_step<bf16>(mha, 0, 2, 0);
  plan::torchtitan_step_time(m, run_of(mha, true));
  CHECK(test::kernels_named(m.trace, "repeat_kv") == 0);
}

TEST_CASE("torchtitan time: FSDP2 copies each all-gather in and out and each reduce-scatter's gradients in, in fp32") {
  const train::JobConfig c = titan_config(4);
  plan::StepTrace st = plan::dry_run_step<bf16>(c, 0, 4, 0);
  double gathered = 0, scattered = 0;
  std::int64_t gathers = 0, scatters = 0;
  for (const auto& col : st.trace.all<trace::Collective>()) {
    if (std::string_view(col.kind) == "all_gather") ++gathers, gathered += static_cast<double>(col.bytes);
    if (std::string_view(col.kind) == "reduce_scatter") ++scatters, scattered += static_cast<double>(col.bytes);
  }
  REQUIRE(gathers > c.model.args.n_layers);  // the blocks resharded after forward gather again
  REQUIRE(scatters > 1);
  const plan::TorchtitanTimeRewrites r = plan::torchtitan_fsdp_copies(st);
  CHECK(r.all_gathers == gathers);
  CHECK(r.reduce_scatters == scatters);
  CHECK(test::kernels_named(st.trace, "FSDP2 all-gather copy-in") == 2 * gathers);
  CHECK(test::kernels_named(st.trace, "FSDP2 all-gather copy-out") == gathers);
  CHECK(test::kernels_named(st.trace, "FSDP2 reduce-scatter copy-in") == scatters);
  // bf16 gathers: the fp32 shard cast (6 bytes) and copied (4); the unsharded output split (4).
  CHECK(test::bytes_of_kernels_named(st.trace, "FSDP2 all-gather copy-in") == doctest::Approx(gathered / 2 / 4 * 10));
  CHECK(test::bytes_of_kernels_named(st.trace, "FSDP2 all-gather copy-out") == doctest::Approx(2 * gathered));
  // fp32 reduce-scatters: 2 bytes read and 4 written an element.
  CHECK(test::bytes_of_kernels_named(st.trace, "FSDP2 reduce-scatter copy-in") == doctest::Approx(1.5 * scattered));
  // Each copy-out right after its all-gather's wait; each copy-in right before its collective.
  const auto& ev = st.trace.events();
  for (std::size_t i = 0; i < ev.size(); ++i)
    if (const auto* k = std::get_if<trace::Kernel>(&ev[i].op)) {
      const std::string_view f = k->functor;
      if (f.starts_with("FSDP2 all-gather copy-out")) {
        const auto* w = std::get_if<trace::CommWait>(&ev[i - 1].op);
        REQUIRE(w != nullptr);
        bool gather = false;
        for (std::size_t j = 0; j < i; ++j)
          if (const auto* col = std::get_if<trace::Collective>(&ev[j].op); col && col->id == w->id)
            gather = std::string_view(col->kind) == "all_gather";
        CHECK(gather);
      }
      if (f.starts_with("FSDP2 reduce-scatter copy-in")) {
        const auto* col = std::get_if<trace::Collective>(&ev[i + 1].op);
        CHECK((col && std::string_view(col->kind) == "reduce_scatter"));
      }
    }
}

TEST_CASE("torchtitan time: its tensor and pipeline parallelism are not counted, and are refused by name") {
  const train::JobConfig tp = titan_config(1, {"--parallelism.tensor_parallel_degree", "2"});
  plan::StepTrace st = plan::dry_run_step<bf16>(tp, 0, 2, 0);
  CHECK_THROWS_WITH_AS(plan::torchtitan_step_time(st, run_of(tp, true)),
                       doctest::Contains("plan.runtime torchtitan: counts the FSDP layouts"), Error);
}
