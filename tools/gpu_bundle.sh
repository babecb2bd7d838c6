#!/usr/bin/env bash
# Packs what a machine with a GPU runs first into gpu-bundle.tar.xz (ignored by git):
# the GPU suite, bench-kernels, bench-train, bench-generate-gpu, llama-train and
# llama-generate, built here for sm_90 (H100, H200), the shared libraries they load that
# a bare CUDA image lacks (OpenBLAS, toml++, PCRE2, SentencePiece, Open MPI, the GCC
# runtimes), the configs, torch_llama.py, torchtitan_eager.py with llama-plan's
# predictions for it (made here), and run.sh, which runs them there and writes every
# output to $OUT.
#
# A machine lent for GPU work may reach no package registry, so nothing is built there:
# the binaries travel. They need the CUDA 13 runtime and cuBLASLt where they run, and a
# glibc at least as new as this machine's. cuDNN is not carried (hundreds of MB): the
# binaries open libcudnn.so.9 at run time where it is installed (attention through cuDNN,
# with the frontend headers from tools/install-deps.sh in the build) and run tessera's
# own attention kernels where it is not, saying so. run.sh looks for libcudnn and libnccl
# in the Python wheels of an image's PyTorch (nvidia/cudnn/lib, nvidia/nccl/lib) when the
# system's loader does not know them; device.txt records what each binary resolves.
#
# Python wheels the image lacks travel too where TESSERA_WHEELS names a folder of them
# (pip download --no-deps ... -d DIR; none is kept in the repository): they are copied into
# the bundle's wheels/, and run.sh's torch and titan steps install them (pip install
# --no-deps into a temporary folder put on PYTHONPATH) before they run. liger-kernel gives
# torch_llama.py Liger's fused loss head; torchtitan 0.2.x with tyro, docstring_parser,
# typeguard and typing_extensions lets titan run torchtitan itself. Without the folder the
# bundle is as before and those steps say what they lacked.
#
#   bash tools/gpu_bundle.sh                  # here: builds build-gpu/, writes gpu-bundle.tar.xz
#   TESSERA_WHEELS=wheels bash tools/gpu_bundle.sh   # the same, with the wheels in wheels/
#   tar -xJf gpu-bundle.tar.xz -C /tmp && bash /tmp/gpu-bundle/run.sh test     # there
#
# run.sh STEP, one step per command (each fits in ten minutes):
#   test      the GPU suite (more arguments go to doctest) (tests/gpu): ops, row kernels, GEMMs, flash attention, the
#             model in fp32 and bf16 against the CPU backend, virtual ranks on one GPU
#   kernels   bench-kernels (GEMMs, attention, memory-bound ops), JSON and text
#   train     bench-train on Llama 3.2 1B and 3B without activation checkpointing (3 warm-up
#             and 10 timed steps; 3B again with bf16 moments), and 8B with full checkpointing,
#             then none under the early step (optimizer.early_step_in_backward), then every 6th
#             block's checkpointing, then none with the SwiGLU output recomputed, and bf16 AdamW
#             moments (what fits one H200; 2 and 5), batch 1 x seq 8192, Markdown
#             rows for RESULTS.md; with CUPTI, one more step of each (but the selective
#             one) profiled, its device time by llama-plan's classes beside the prediction;
#             1B and 3B with the projections one by one (--separate-projections, the step
#             before they ran as one GEMM and wo and w2 added the residuals); and 1B with its
#             steps replayed from a CUDA graph (--graph)
#   torch     bench/torch_llama.py, the strongest fair PyTorch baseline: 1B and 3B without
#             checkpointing, 8B with full checkpointing, the same batch, sequence and steps
#             as train; eager, then torch.compile (default mode; 1B also
#             max-autotune-no-cudagraphs), attention and loss head by its auto rules; each
#             against bench-train's row of the same flavor (train.json, train8b.json, where
#             train ran first in the same $OUT). run.sh torch [SECONDS]: within SECONDS
#             (default 360); under 300 (all's cap), 1B eager and default compile only
#   titan     bench/torchtitan_train.py: torchtitan's own 8B step (batch 1 x 8192, full
#             checkpointing, compiled), timed the same way, against train8b.json; where the
#             wheels carry no torchtitan 0.2.x, or it cannot run on this torch, one line
#             saying why. Not part of `all`
#   eager     bench/torchtitan_eager.py: torchtitan's eager step (Llama 2 13B's width, 6
#             blocks, batch 2 x seq 4096; Llama 3 8B's, 4 blocks, 1 x 8192) timed and
#             profiled, beside llama-plan --plan.runtime torchtitan's prediction for this GPU;
#             then each again under FSDP2 itself on one rank (--fsdp2), against the first
#   gemms     bench-kernels' bf16 GEMMs with the toolkit's cuBLASLt and with PyTorch's, then
#             bench/torch_gemms.py: torch.matmul on the same shapes, timed the same way, then
#             the same GEMMs beside 1 to 32 SMs held (bench-kernels --sections sm-hold)
#   float8    bench-kernels --sections float8 (the float8 GEMMs and casts of 3B and 8B),
#             then bench-train with the blocks' linear layers on cuBLASLt's float8 matmul
#             (--float8): 1B and 3B without checkpointing, tensorwise then rowwise, and 8B
#             with full checkpointing and bf16 moments (an H200), each against train's bf16
#             row of the same flavor and checkpointing (train.json, train8b.json) and
#             llama-plan's float8 prediction; then bench/float8_curves.py: Llama 3.2 1B, 300
#             steps at 2048 tokens, bf16 against tensorwise and rowwise, the loss curves
#             (float8-curves.json); not part of `all` unless given a cap (about 4.5 minutes)
#   llama     llama-train on the debug model on the GPU, 100 steps
#   generate  bench-generate-gpu: sampling through the KV cache against the whole window,
#             Llama 3.2 1B in bf16 after 16 and 2048 prompt tokens, the debug model in float32;
#             then llama-generate --device cuda on a debug model the GPU trained, float32
#             greedy against the CPU's text, and bf16
#   offload   FSDP's CPU offload (training.enable_cpu_offload) on the GPU: the debug model's
#             10 steps with and without it (the losses within 1e-5: AdamW on the host's
#             loops against the GPU's), then Llama 3.2 3B (full checkpointing, batch 1 x
#             8192, bf16) offloaded for 3 steps beside llama-plan's prediction for this
#             machine (offload-plan-*.json: the device's peak, the host's memory, the step;
#             the host rate is a DGX node's share, this machine's host differs), and again
#             under the early step, each unit's update on the host beside the device's
#             backward (offload-early-plan-*.json); about 3 minutes
#   nccl      several llama-train processes sharing the one GPU over NCCL (comm.share_gpu):
#             FSDP 2, TP 2, PP 2 (1F1B, Interleaved1F1B), CP 2 on 2 processes, FSDP 2 x
#             TP 2, HSDP 2 x 2, PP 2 x TP 2, CP 2 x FSDP 2 on 4, each against one process's
#             losses (float32: 1e-5; bf16 with cuDNN on FSDP 2, TP 2, CP 2: 1e-3), kill -9 of a rank, a
#             checkpoint saved under FSDP 4 and resumed under TP 2 x FSDP 2, FSDP 2 under
#             torchrun itself and Open MPI's mpirun where the image has them, NCCL's version
#             and transports; not part of `all` (a few minutes)
#   all       every step above but nccl and titan in one command (eager, gemms, test, train,
#             torch, llama, generate, kernels), each under a cap and within SECONDS in all (default
#             540), the torch step planning its runs within its cap; the logs packed into
#             $OUT/results.tar.gz after each step, a line a step in $OUT/summary.txt; the
#             GPU's clocks and power logged through it, by step (bench/gpu_clocks.py).
#             run.sh all SECONDS STEP:CAP ... runs the steps named instead, in that order
#             (nccl and float8 too; a cap of 0 takes what is left)
set -euo pipefail
if [ -n "${TESSERA_WHEELS:-}" ]; then
  TESSERA_WHEELS=$(cd "$TESSERA_WHEELS" 2>/dev/null && pwd) ||
    { echo "gpu_bundle: TESSERA_WHEELS is not a folder" >&2; exit 1; }
fi
cd "$(dirname "$0")/.."
build=${BUILD:-build-gpu}  # any release build with CUDA enabled will do (BUILD=build)
bundle=gpu-bundle
[ -f "$build/build.ninja" ] || meson setup "$build" --buildtype=release -Dcuda=enabled -Dgpu_arch=90
# Machine code and optimised host code, whatever the build was configured for (CI's
# -Dgpu_code=check compiles the CUDA code only to check it).
meson configure "$build" -Dgpu_code=run > /dev/null
# A CUDA object for which ninja recorded no header dependencies (Meson before 1.4 gives
# nvcc none) may predate the headers it includes: compile it again, so the GPU runs the
# tree as it is.
while read -r obj; do
  [ -n "$obj" ] || continue
  if ninja -C "$build" -t deps "$obj" 2>/dev/null | head -n 1 | grep -q '#deps 0,'; then rm -f "$build/$obj"; fi
done < <(cd "$build" && find . -name '*.cu.o' | sed 's|^\./||')
meson compile -C "$build" test_gpu bench-kernels bench-train bench-generate-gpu llama-train llama-generate llama-plan

rm -rf "$bundle" "$bundle.tar.xz"
mkdir -p "$bundle/lib"
bins=("$build/tests/gpu/test_gpu" "$build/bench/bench-kernels" "$build/bench/bench-train" "$build/bench/bench-generate-gpu"
      "$build/examples/llama-train" "$build/examples/llama-generate")
cp "${bins[@]}" "$bundle/"
# Every library they load, except the C and C++ runtimes (newer there) and CUDA's own.
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*|libpthread|libdl|librt)\.so|/libcud|/libcublas|/libnccl' |
  while read -r lib; do cp -L "$lib" "$bundle/lib/"; done
cp -r examples/configs "$bundle/configs"
cp bench/torch_llama.py bench/torchtitan_eager.py bench/torchtitan_train.py bench/torch_gemms.py bench/gpu_clocks.py \
  bench/float8_curves.py tools/memory_snapshot.py tools/comm_trace.py "$bundle/"
# The Python wheels of TESSERA_WHEELS, where given (see the header).
if [ -n "${TESSERA_WHEELS:-}" ]; then
  compgen -G "$TESSERA_WHEELS/*.whl" > /dev/null ||
    { echo "gpu_bundle: TESSERA_WHEELS=$TESSERA_WHEELS holds no .whl files" >&2; exit 1; }
  mkdir -p "$bundle/wheels"
  cp "$TESSERA_WHEELS"/*.whl "$bundle/wheels/"
fi
# llama-plan's prediction of torchtitan_eager.py's runs, on each GPU profile (the eager step
# as plan/torchtitan_time.hpp counts it; torchtitan_eager.py says what it runs).
for run in "llama2_13b 6 2 4096" "llama3_8b 4 1 8192"; do
  read -r flavor layers batch seq <<< "$run"
  for machine in h100-sxm h200; do
    "$build/examples/llama-plan" --config examples/configs/$flavor.toml --machine $machine --json \
      --model.n_layers "$layers" --training.seq_len "$seq" --training.local_batch_size "$batch" \
      --training.global_batch_size "$batch" --training.mixed_precision_param bfloat16 \
      --activation_checkpoint.mode none --plan.runtime torchtitan --plan.rmsnorm torch \
      > "$bundle/eager-plan-$flavor-$machine.json"
  done
done
# llama-plan's memory snapshot of run.sh nccl's FSDP 2 run (its first rank, on h200),
# beside the snapshot that run writes on the device: the allocator replay held to account.
"$build/examples/llama-plan" --config examples/configs/debug_model.toml --machine h200 --gpus 2 \
  --training.seq_len 128 --training.global_batch_size 8 --training.mixed_precision_param float32 \
  --training.attention tessera --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4 \
  --emit-memory-snapshot "$bundle/fsdp2-plan.pickle" > /dev/null
# llama-plan's prediction of bench-train's runs (run.sh train), beside which bench-train
# --profile prints its step by class and tessera's kernels by functor (every kind of
# operation listed: --plan.top): batch 1 x seq 8192 on one GPU, bf16, as
# bench/predicted_gpu_step.sh makes them.
one=(--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1
     --parallelism.tensor_parallel_degree 1 --parallelism.pipeline_parallel_degree 1
     --parallelism.context_parallel_degree 1 --training.seq_len 8192 --training.local_batch_size 1
     --training.global_batch_size 1 --training.mixed_precision_param bfloat16)
for run in "llama3.2_1b none float32" "llama3.2_3b none float32" "llama3_8b full bfloat16"; do
  read -r flavor ac moments <<< "$run"
  for machine in h100-sxm h200; do
    "$build/examples/llama-plan" --config examples/configs/$flavor.toml --machine $machine --json "${one[@]}" \
      --activation_checkpoint.mode "$ac" --optimizer.state_dtype "$moments" --plan.top 1000 \
      > "$bundle/train-plan-$flavor-$machine.json"
  done
done
# The offloaded 3B step (run.sh offload), as llama-plan predicts it.
for machine in h100-sxm h200; do
  "$build/examples/llama-plan" --config examples/configs/llama3.2_3b.toml --machine $machine --json "${one[@]}" \
    --activation_checkpoint.mode full --training.enable_cpu_offload true > "$bundle/offload-plan-$machine.json"
  "$build/examples/llama-plan" --config examples/configs/llama3.2_3b.toml --machine $machine --json "${one[@]}" \
    --activation_checkpoint.mode full --training.enable_cpu_offload true --optimizer.early_step_in_backward true \
    --training.max_norm 0 > "$bundle/offload-early-plan-$machine.json"
done
# bench-train --profile needs CUPTI, which Meson may not have found.
if ldd "$build/bench/bench-train" | grep -q libcupti; then touch "$bundle/PROFILE"; fi
git rev-parse --short HEAD > "$bundle/COMMIT" 2>/dev/null || echo "-" > "$bundle/COMMIT"

cat > "$bundle/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs one step of the GPU checks (see tools/gpu_bundle.sh); outputs go to $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
commit=$(cat "$here/COMMIT")
cuda_libs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib; do
  [ -d "$d" ] && cuda_libs="$cuda_libs:$d"
done
# cuDNN and NCCL where the toolkit lacks them: the wheels PyTorch's image carries.
for name in cudnn nccl; do
  ldconfig -p 2>/dev/null | grep -q "lib$name\.so" && continue
  for d in $(python3 -c "import nvidia, os; print(' '.join(os.path.join(p, '$name', 'lib') for p in nvidia.__path__))" 2>/dev/null); do
    [ -d "$d" ] && cuda_libs="$cuda_libs:$d"
  done
done
export LD_LIBRARY_PATH="$here/lib$cuda_libs:${LD_LIBRARY_PATH:-}"
{ nvidia-smi -L; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  for b in test_gpu bench-kernels bench-train bench-generate-gpu llama-train llama-generate; do ldd "$here/$b" | grep -E "not found|cudnn|nccl|cublas|cudart" | sed "s|^|$b: |"; done
} 2>&1 | tee "$out/device.txt"
# Marks the start of a window of bench/gpu_clocks.py's table where `all` keeps a clock log.
mark() { [ -n "${MARKS:-}" ] && echo "$(date '+%Y/%m/%d %H:%M:%S.%N') $*" >> "$MARKS"; return 0; }
# The bundle's Python wheels (TESSERA_WHEELS when it was made), installed once per step into
# a temporary folder put on PYTHONPATH: pip install --no-deps, or unpacked where pip is missing.
wheels() {
  compgen -G "$here/wheels/*.whl" > /dev/null || { echo "wheels: none in the bundle"; return 0; }
  local site
  site=$(mktemp -d)
  local how="pip install --no-deps"
  if ! python3 -m pip install --no-deps --no-index --quiet --target "$site" "$here"/wheels/*.whl > "$out/wheels.log" 2>&1 ||
     [ -z "$(ls -A "$site")" ]; then
    how="unpacked (pip: $(tail -n 1 "$out/wheels.log"))"
    for w in "$here"/wheels/*.whl; do python3 -m zipfile -e "$w" "$site"; done
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "wheels: $(cd "$here/wheels" && ls -- *.whl | tr '\n' ' ')$how into $site"
}
# tessera's result files among $@ that hold a row of flavor $1 that ran, as --tessera-json options.
tessera_rows() {
  local flavor=$1 f
  shift
  for f in "$@"; do
    [ -f "$f" ] && python3 -c 'import json, sys
rows = json.load(open(sys.argv[1])); rows = rows if isinstance(rows, list) else [rows]
sys.exit(0 if any(isinstance(r, dict) and r.get("flavor") == sys.argv[2] and "tokens_per_sec" in r for r in rows) else 1)' \
      "$f" "$flavor" 2>/dev/null && printf -- '--tessera-json %s ' "$f"
  done
  return 0
}
# The GPU profile whose predictions (made with the bundle) this GPU's runs are set beside.
machine=h100-sxm
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && machine=h200
case "${1:-}" in
  test) "$here/test_gpu" "${@:2}" 2>&1 | tee "$out/gpu-tests.txt" ;;
  kernels) "$here/bench-kernels" --commit "$commit" --json "$out/kernels.json" 2>&1 | tee "$out/kernels.txt" ;;
  train)
    # With CUPTI, one more step each under --profile, by class beside llama-plan's prediction.
    profile() { [ -f "$here/PROFILE" ] && for f in "$@"; do printf -- '--profile --plan-json %s=%s ' "$f" "$here/train-plan-$f-$machine.json"; done; }
    # shellcheck disable=SC2046
    "$here/bench-train" --flavors llama3.2_1b,llama3.2_3b --ac none --steps 10 --warmup 3 --markdown --commit "$commit" \
      $(profile llama3.2_1b llama3.2_3b) --json "$out/train.json" 2>&1 | tee "$out/train.txt"
    status=$?
    # 3B again with bf16 moments (optimizer.state_dtype), the 60% target's row: llama-plan
    # 348.52 ms, 60.3% MFU, 63.50 GiB (354.71 ms with fp32 moments).
    "$here/bench-train" --flavors llama3.2_3b --ac none --state-dtype bfloat16 --steps 10 --warmup 3 --markdown \
      --commit "$commit" --json "$out/train3b-bf16.json" 2>&1 | tee "$out/train3b-bf16.txt" || status=1
    # 1B and 3B again with the projections one by one and the residuals added by passes of
    # their own (model.fuse_projections = false): the step before either change (llama-plan
    # 148.18 and 359.32 ms against 146.38 and 354.71).
    "$here/bench-train" --flavors llama3.2_1b,llama3.2_3b --ac none --steps 10 --warmup 3 --separate-projections \
      --markdown --commit "$commit" --json "$out/train-separate.json" 2>&1 | tee "$out/train-separate.txt" || status=1
    # 1B again with its timed steps replayed from a CUDA graph (training.cuda_graph).
    "$here/bench-train" --flavors llama3.2_1b --ac none --steps 10 --warmup 3 --graph --markdown --commit "$commit" \
      --json "$out/train-graph.json" 2>&1 | tee "$out/train-graph.txt" || status=1
    # Llama 3 8B with full checkpointing and bf16 moments needs 109 GiB: an H200, not an H100.
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    if [ "${mib:-0}" -ge 120000 ]; then
      # shellcheck disable=SC2046
      "$here/bench-train" --flavors llama3_8b --ac full --state-dtype bfloat16 --steps 5 --warmup 2 --markdown --commit "$commit" \
        $(profile llama3_8b) --json "$out/train8b.json" 2>&1 | tee "$out/train8b.txt" || status=1
      # And no block recomputed, each unit updated in the backward and its gradient freed
      # (optimizer.early_step_in_backward, nothing clipped): llama-plan 739.50 ms, 64.8% MFU,
      # 113.15 GiB (without the early step 141.13 GiB: does not fit).
      "$here/bench-train" --flavors llama3_8b --ac none --early-step --state-dtype bfloat16 --steps 5 --warmup 2 \
        --markdown --commit "$commit" --json "$out/train8b-early.json" 2>&1 | tee "$out/train8b-early.txt" || status=1
      # And with every 6th block recomputed (selective_ac_option = 6): llama-plan's fastest
      # checkpointing that fits with room (61.3% MFU, 136.2 GiB of 138.0 usable; every 8th:
      # 61.8% at 137.1, too close), the 58% target's row.
      "$here/bench-train" --flavors llama3_8b --ac selective:6 --state-dtype bfloat16 --steps 5 --warmup 2 --markdown \
        --commit "$commit" --json "$out/train8b-selective.json" 2>&1 | tee "$out/train8b-selective.txt" || status=1
      # And no block recomputed, the SwiGLU output remade in the backward instead of kept
      # (activation_checkpoint.recompute_swiglu): llama-plan 748.60 ms, 64.1% MFU, 134.13 GiB.
      "$here/bench-train" --flavors llama3_8b --ac none --recompute-swiglu --state-dtype bfloat16 --steps 5 --warmup 2 \
        --markdown --commit "$commit" --json "$out/train8b-swiglu.json" 2>&1 | tee "$out/train8b-swiglu.txt" || status=1
    else
      echo "train: llama3_8b skipped: it needs about 110 GiB and this GPU has ${mib:-?} MiB" | tee "$out/train8b.txt"
    fi
    # Llama 3 8B with LoRA (rank 8, every linear layer, the rest frozen), no block
    # recomputed: llama-plan 551.73 ms, 14,848 tokens/s, 51.76 GiB on an H200 (582.96 ms,
    # 50.82 GiB on an H100): it fits either.
    "$here/bench-train" --flavors llama3_8b --ac none --lora 8 --steps 5 --warmup 2 --markdown --commit "$commit" \
      --json "$out/train8b-lora.json" 2>&1 | tee "$out/train8b-lora.txt" || status=1
    exit "$status" ;;
  torch)
    # The strongest fair PyTorch baseline beside each bench-train row (bench/torch_llama.py's
    # docstring): the same flavor, batch, sequence, checkpointing, warm-up and timed steps.
    # Each run gets the time left of SECONDS as its cap and two thirds of its share as
    # --time-budget (no row starts after it); its JSON is written after every row, so a
    # run cut short keeps the rows it finished. max-autotune-no-cudagraphs benchmarks Triton
    # GEMM templates for every distinct GEMM shape (minutes at 3B and 8B on an H200): within
    # the 6 minutes of this step it runs at 1B only, where it says what the mode gains over
    # default; 3B and 8B take the default mode. Under 300 s (all's cap), 1B eager and
    # default compile only, as before.
    budget=${2:-360}
    wheels
    if (( budget < 300 )); then
      plan=("llama3.2_1b none default 3 10 $budget")
    else
      plan=("llama3.2_1b none default,max-autotune-no-cudagraphs 3 10 170" "llama3.2_3b none default 3 10 90"
            "llama3_8b full default 2 5 0")
    fi
    start=$(date +%s)
    status=0
    : > "$out/torch.txt"
    for p in "${plan[@]}"; do
      read -r flavor ac modes warmup steps share <<< "$p"
      left=$(( budget - ($(date +%s) - start) ))
      (( share > 0 && share < left )) && left=$share
      if (( left < 30 )); then echo "torch: $flavor skipped, ${left} s left" | tee -a "$out/torch.txt"; status=1; continue; fi
      mark "torch: $flavor"
      # shellcheck disable=SC2046
      timeout -k 10 "$left" python3 "$here/torch_llama.py" --flavor "$flavor" --batch 1 --seq 8192 --ac "$ac" \
        --warmup "$warmup" --steps "$steps" --compile-modes "$modes" --time-budget $(( left * 2 / 3 )) \
        $(tessera_rows "$flavor" "$out/train.json" "$out/train8b.json") --json "$out/torch-$flavor.json" 2>&1 |
        tee -a "$out/torch.txt"
      rc=${PIPESTATUS[0]}
      if (( rc != 0 )); then echo "torch: $flavor exited $rc" | tee -a "$out/torch.txt"; status=1; fi
    done
    exit "$status" ;;
  titan)
    # torchtitan's own 8B step (bench/torchtitan_train.py), against bench-train's 8B row.
    # Without torchtitan 0.2.x in the wheels, or where it cannot run, one line says why.
    wheels
    # shellcheck disable=SC2046
    timeout -k 10 "${2:-540}" python3 "$here/torchtitan_train.py" --flavor llama3_8b --batch 1 --seq 8192 --ac full \
      --warmup 2 --steps 5 $(tessera_rows llama3_8b "$out/train8b.json") --json "$out/titan.json" 2>&1 |
      tee "$out/titan.txt" ;;
  eager)
    for run in "llama2_13b 6 2 4096" "llama3_8b 4 1 8192"; do
      read -r flavor layers batch seq <<< "$run"
      mark "eager: $flavor"
      python3 "$here/torchtitan_eager.py" --flavor "$flavor" --n-layers "$layers" --batch "$batch" --seq "$seq" \
        --plan-json "$here/eager-plan-$flavor-$machine.json" --json "$out/eager-$flavor.json" 2>&1 |
        tee "$out/eager-$flavor.txt"
      # The same step under FSDP2 itself on one rank: what FSDP2 and DTensor add to it.
      mark "eager: $flavor under FSDP2"
      python3 "$here/torchtitan_eager.py" --flavor "$flavor" --n-layers "$layers" --batch "$batch" --seq "$seq" --fsdp2 \
        --baseline-json "$out/eager-$flavor.json" --plan-json "$here/eager-plan-$flavor-$machine.json" \
        --json "$out/eager-fsdp2-$flavor.json" 2>&1 | tee "$out/eager-fsdp2-$flavor.txt"
    done ;;
  gemms)
    # tessera's cuBLASLt GEMMs and PyTorch's on the same shapes, timed the same way: with the
    # toolkit's cuBLASLt, then with PyTorch's own (its wheel's) where it has one, then torch.
    mark "gemms: tessera, toolkit cuBLASLt"
    "$here/bench-kernels" --sections ceilings,gemm --dtypes bf16 --commit "$commit" --json "$out/gemms-tessera.json" \
      > "$out/gemms-tessera.txt" 2>&1
    grep -E "^software|^ceilings" "$out/gemms-tessera.txt"
    wheel=$(python3 -c "import nvidia, os; print(next((os.path.join(p, 'cublas', 'lib') for p in nvidia.__path__ if os.path.isdir(os.path.join(p, 'cublas', 'lib'))), ''))" 2>/dev/null)
    if [ -n "$wheel" ]; then
      mark "gemms: tessera, torch's cuBLAS"
      LD_LIBRARY_PATH="$wheel:$LD_LIBRARY_PATH" "$here/bench-kernels" --sections ceilings,gemm --dtypes bf16 --commit "$commit" \
        --json "$out/gemms-tessera-torchcublas.json" > "$out/gemms-tessera-torchcublas.txt" 2>&1
      grep -E "^software|^ceilings" "$out/gemms-tessera-torchcublas.txt"
    fi
    mark "gemms: torch.matmul"
    python3 "$here/torch_gemms.py" --kernels-json "$out/gemms-tessera.json" --json "$out/gemms-torch.json" 2>&1 |
      tee "$out/gemms-torch.txt"
    # llama-plan's price of a GEMM beside an NCCL collective, checked: SMs held by blocks
    # that spin (bounded), the same GEMMs beside them (bench-kernels --sections sm-hold).
    mark "gemms: SMs held"
    "$here/bench-kernels" --sections sm-hold --commit "$commit" --json "$out/gemms-sm-hold.json" 2>&1 |
      tee "$out/gemms-sm-hold.txt" ;;
  nccl)
    # Several NCCL processes on this one GPU (comm.share_gpu: a host per rank, NCCL over
    # sockets on loopback), each against one process on the same config and global batch:
    #  - the float32 model with tessera's attention, per-step losses within 1e-5 (the CPU
    #    parity bar): FSDP 2 (its third step profiled, and its memory snapshot beside
    #    llama-plan's), TP 2, PP 2 (1F1B, Interleaved1F1B,
    #    an order from a CSV file), CP 2 (the ring, and the keys all-gathered) on 2
    #    processes, FSDP 2 x TP 2, HSDP 2 x 2, PP 2 x TP 2, CP 2 x FSDP 2 on 4;
    #  - the bf16 model with cuDNN's attention (deterministic), within 1e-3 on FSDP 2, TP 2
    #    and CP 2 (cuDNN's causal and full blocks): the CPU's bf16 parity bar (tests/parallel/test_bf16_training.cpp: a layout
    #    reorders fp32 sums and a last-bit change flips a bf16 rounding now and then; a
    #    quarter of a bf16 ulp, far below what a lost or doubled gradient piece does);
    #  - kill -9 of one of 2 ranks mid-run (the survivor's flight record read by
    #    tools/comm_trace.py): the other exits non-zero within
    #    comm.train_timeout_seconds (30) + 15 s, naming its rank and the NCCL collective;
    #  - a sharded checkpoint saved (async) under FSDP 4, resumed under TP 2 x FSDP 2: the
    #    run's losses, saved and resumed, within 1e-5 of one process's; checkpoint_seconds;
    #  - NCCL's version and transports (NCCL_DEBUG=INFO), from every log.
    work="$out/nccl"
    mkdir -p "$work"
    # No closing sample (--sample-tokens 0, here and in the offload runs): several ranks
    # draw it on the CPU, and an offloaded model's forward streams its weights each token.
    base=(--sample-tokens 0 --config "$here/configs/debug_model.toml" --training.device cuda --training.steps 6
          --training.seq_len 128 --training.global_batch_size 8 --metrics.log_freq 1 --checkpoint.enable false
          --comm.train_timeout_seconds 60 --comm.init_timeout_seconds 60)
    f32=(--training.mixed_precision_param float32 --training.attention tessera)
    b16=(--training.mixed_precision_param bfloat16 --training.attention cudnn --training.deterministic true)
    # start NAME N ARGS...: N processes in the background (pids in $pids), torchrun-style
    # variables, one GPU; wait_all: exit 1 if any failed.
    start() {
      local name=$1 n=$2 port=$((29600 + RANDOM % 2000)) r
      shift 2
      pids=()
      for ((r = 0; r < n; r++)); do
        RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
          NCCL_DEBUG=INFO timeout 240 "$here/llama-train" "${base[@]}" --comm.share_gpu true \
          --job.dump_folder "$work/$name" "$@" > "$work/$name.rank$r.log" 2>&1 &
        pids+=($!)
      done
    }
    wait_all() { local p rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; return $rc; }
    # compare NAME REFERENCE BAR: NAME's losses (rank 0's metrics.jsonl) against REFERENCE's.
    compare() {
      python3 - "$work/$2/metrics.jsonl" "$work/$1/metrics.jsonl" "$1" "$3" <<'PY'
import json, sys
one, run = ([json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:3])
bar = float(sys.argv[4])
worst = max(abs(a - b) / abs(b) for a, b in zip(run, one)) if one and len(one) == len(run) else float("inf")
print(f"nccl: {sys.argv[3]}: {len(run)} steps, largest relative loss difference from one process {worst:.1e}"
      + ("" if worst <= bar else f"  (over {bar:g})"))
sys.exit(0 if worst <= bar else 1)
PY
    }
    status=0
    for kind in f32 b16; do
      declare -n dtype=$kind
      "$here/llama-train" "${base[@]}" "${dtype[@]}" --training.local_batch_size 8 --job.dump_folder "$work/one-$kind" \
        > "$work/one-$kind.log" 2>&1 || { echo "nccl: the one-process $kind run failed"; tail -n 20 "$work/one-$kind.log"; exit 1; }
    done
    # A pipeline order read from a file (PyTorch's CSV: the V placement, whole and split
    # backwards mixed), and FSDP 2's third step recorded on both ranks (profiling).
    printf '%s\n' 0F0,0F1,3F0,3I0,3W0,3F1,3B1,0I0,0B1,0W0 1F0,2F0,1F1,2F1,2I0,1B0,2B1,1I1,1W1,2W0 > "$work/order.csv"
    layouts=(
      "f32 fsdp2 2 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4 --profiling.enable_profiling true --profiling.profile_freq 3 --profiling.enable_memory_snapshot true"
      "f32 pp2_csv 2 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule PipelineScheduleMulti --parallelism.pipeline_parallel_schedule_csv $work/order.csv --parallelism.pipeline_parallel_microbatch_size 4 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
      "f32 tp2 2 --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
      "f32 pp2_1f1b 2 --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
      "f32 pp2_interleaved 2 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
      "f32 fsdp2_tp2 4 --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4"
      "f32 hsdp2x2 4 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 2"
      "f32 pp2_tp2 4 --parallelism.pipeline_parallel_degree 2 --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
      "f32 cp2 2 --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
      "f32 cp2_allgather 2 --parallelism.context_parallel_degree 2 --parallelism.context_parallel_rotate_method allgather --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
      "f32 cp2_fsdp2 4 --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4"
      "b16 fsdp2 2 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4"
      "b16 tp2 2 --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
      "b16 cp2 2 --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8"
    )
    for l in "${layouts[@]}"; do
      read -r -a words <<< "$l"
      kind=${words[0]} name=${words[0]}-${words[1]} n=${words[2]}
      declare -n dtype=$kind
      t0=$(date +%s)
      start "$name" "$n" "${dtype[@]}" "${words[@]:3}"
      if ! wait_all; then
        echo "nccl: $name on $n processes failed"; tail -n 8 "$work/$name".rank*.log; status=1; continue
      fi
      bar=1e-5; [ "$kind" = b16 ] && bar=1e-3
      compare "$name" "one-$kind" "$bar" || status=1
      echo "nccl: $name took $(( $(date +%s) - t0 )) s"
    done
    # The profile of FSDP 2's third step: a Chrome trace per rank, its collectives (NCCL's,
    # their host side) and layers inside the step.
    python3 - "$work/f32-fsdp2/profile_trace/iteration_3" <<'PY' || status=1
import json, os, sys
d = sys.argv[1]
for r in (0, 1):
    ev = json.load(open(os.path.join(d, "rank%d_trace.json" % r)))["traceEvents"]
    names = [e["name"] for e in ev if e["ph"] == "X"]
    need = ["step 3", "all_gather", "reduce_scatter", "optimizer", "layers.0 forward", "layers.0 backward"]
    missing = [n for n in need if n not in names]
    print("nccl: profile rank %d: %d spans%s" % (r, len(names), ", missing %s" % missing if missing else ""))
    if missing:
        sys.exit(1)
PY
    # Its memory snapshots (the CUDA caching allocator's, each process its own): whole, and
    # rank 0's peaks beside llama-plan's replay of the same step.
    snaps=("$work/f32-fsdp2/memory_snapshot/iteration_3/"rank{0,1}_memory_snapshot.pickle)
    if checked=$(python3 "$here/memory_snapshot.py" check "${snaps[@]}" 2>&1); then
      sed 's/^/nccl: memory snapshot: /' <<< "$checked"
    else
      echo "nccl: memory snapshot: $checked"; status=1
    fi
    python3 - "$here" "${snaps[0]}" "$here/fsdp2-plan.pickle" <<'PY' || status=1
import pickle, sys
sys.path.insert(0, sys.argv[1])
import memory_snapshot
def replay(path):
    s = pickle.load(open(path, "rb"))
    return memory_snapshot.Replay(s["device_traces"][memory_snapshot.devices(s)[0]])
got, want = replay(sys.argv[2]), replay(sys.argv[3])
print("nccl: memory snapshot rank 0: held at most %.1f MiB (predicted %.1f), in use at most %.1f MiB (predicted %.1f)"
      % (got.peak_held / 2**20, want.peak_held / 2**20, got.peak / 2**20, want.peak / 2**20))
PY
    # The launchers themselves, FSDP 2 in float32 against one process: torchrun (the image's
    # PyTorch; --standalone serves its agent store on MASTER_PORT, rank 0's store then
    # listens on the next port), and Open MPI's mpirun where the image has one (the NCCL
    # unique id then travels by MPI_Bcast, through the Open MPI libraries of the bundle).
    fsdp2=(--parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4 --comm.share_gpu true)
    if python3 -c "import torch.distributed.run" 2> /dev/null; then
      NCCL_DEBUG=INFO timeout 180 python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python \
        "$here/llama-train" "${base[@]}" "${f32[@]}" "${fsdp2[@]}" --job.dump_folder "$work/f32-torchrun" \
        > "$work/f32-torchrun.rank0.log" 2>&1 && compare f32-torchrun one-f32 1e-5 ||
        { echo "nccl: torchrun failed"; tail -n 8 "$work/f32-torchrun.rank0.log"; status=1; }
    else
      echo "nccl: torchrun: this image's python3 has no torch.distributed.run"
    fi
    if command -v mpirun > /dev/null && mpirun --version 2>&1 | grep -q "Open MPI"; then
      echo "nccl: mpirun: $(mpirun --version 2>&1 | head -n 1)"
      timeout 180 mpirun --allow-run-as-root --oversubscribe -np 2 -x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH \
        "$here/llama-train" "${base[@]}" "${f32[@]}" "${fsdp2[@]}" --job.dump_folder "$work/f32-mpirun" \
        > "$work/f32-mpirun.rank0.log" 2>&1 && compare f32-mpirun one-f32 1e-5 ||
        { echo "nccl: mpirun failed"; tail -n 8 "$work/f32-mpirun.rank0.log"; status=1; }
    else
      echo "nccl: mpirun: none in this image, or not Open MPI's ($(mpirun --version 2>&1 | head -n 1)); the bundle does not carry a launcher"
    fi
    # kill -9 of rank 1 once rank 0 has logged 3 steps.
    base+=(--comm.train_timeout_seconds 30)
    start kill 2 "${f32[@]}" --training.steps 100000 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4
    for _ in $(seq 1 240); do
      logged=$(grep -c '"loss"' "$work/kill/metrics.jsonl" 2>/dev/null)
      [ "${logged:-0}" -ge 3 ] && break
      sleep 0.5
    done
    # ${pids[1]} is rank 1's `timeout`: the rank is its child (killing the timeout alone
    # left the rank training, as on 2026-12-04).
    pkill -9 -P "${pids[1]}" || kill -9 "${pids[1]}"
    t0=$(date +%s)
    wait "${pids[0]}"
    rc=$?
    took=$(( $(date +%s) - t0 ))
    wait "${pids[1]}" 2> /dev/null
    said=$(grep -m 1 "rank 0: NCCL" "$work/kill.rank0.log")
    if [ "$rc" -ne 0 ] && [ "$took" -le 45 ] && [ -n "$said" ]; then
      echo "nccl: kill -9 of rank 1: rank 0 exited $rc after $took s: $said"
    else
      echo "nccl: kill -9 of rank 1: rank 0 exited $rc after $took s, saying: ${said:-nothing naming its rank and collective}"
      tail -n 5 "$work/kill.rank0.log"
      status=1
    fi
    # The survivor's flight record (comm.trace_buf_size), written by the watchdog: the
    # collective it waits for, rank 1 absent.
    if report=$(python3 "$here/comm_trace.py" "$work/kill/comm_traces" 2>&1) && grep -q "^rank 0 waits for" <<< "$report"; then
      echo "nccl: kill -9 of rank 1: flight record: $(grep -m 1 "^rank 0 waits for" <<< "$report")"
    else
      echo "nccl: kill -9 of rank 1: no flight record of rank 0: $report"; status=1
    fi
    # Saved under FSDP 4 at steps 3 and 6; step 6's save removed, the run resumed from step 3
    # under TP 2 x FSDP 2: metrics.jsonl then holds steps 1-3 saved and 4-6 resumed.
    ck=(--checkpoint.enable true --checkpoint.interval 3 --checkpoint.async_mode async)
    start ckpt 4 "${f32[@]}" "${ck[@]}" --parallelism.data_parallel_shard_degree 4 --training.local_batch_size 2
    if wait_all && rm -rf "$work/ckpt/checkpoint/step-6"; then
      start ckpt 4 "${f32[@]}" "${ck[@]}" --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 \
        --training.local_batch_size 4
      wait_all && compare ckpt one-f32 1e-5 || { echo "nccl: the resumed run failed"; tail -n 8 "$work"/ckpt.rank*.log; status=1; }
      grep -o '"checkpoint_seconds": *[0-9.e-]*' "$work/ckpt/metrics.jsonl" | sort | uniq -c | sed 's/^/nccl: /'
      # Start-up memory: rank 0's device memory after the model's initialisation under
      # FSDP 4 (the run that saved: its first step's metrics) against one process's.
      python3 - "$work/one-f32/metrics.jsonl" "$work/ckpt/metrics.jsonl" <<'PY' || status=1
import json, sys
def first(path):
    return next(json.loads(l)["memory_after_init_bytes"] for l in open(path) if "memory_after_init_bytes" in l)
one, fsdp = first(sys.argv[1]), first(sys.argv[2])
print(f"nccl: memory after init_weights, rank 0 of FSDP 4: {fsdp / 2**20:.1f} MiB, one process: {one / 2**20:.1f} MiB "
      f"({fsdp / one:.2f} of it; a quarter of the parameters and gradients, and what is not sharded)")
sys.exit(0 if fsdp < 0.5 * one else 1)
PY
    else
      echo "nccl: the FSDP 4 run that saves failed"; tail -n 8 "$work"/ckpt.rank*.log; status=1
    fi
    # What NCCL said of itself: its version and the transport of each connection.
    grep -hoE "NCCL version [0-9.]+[^ ]*|via NET/[A-Za-z]+[^ ]*|Duplicate GPU.*" "$work"/*.rank*.log | sort | uniq -c | head -n 8
    exit "$status" ;;
  float8)
    # The float8 GEMMs' own rates and their casts' (what [gemm.fp8_efficiency] is to be
    # measured by), then issue 51's targets: 8B tensorwise >= 1.35x and rowwise >= 1.2x
    # tessera's own bf16 tokens/s, 3B tensorwise >= 1.25x; MFU against the bf16 peak.
    status=0
    "$here/bench-kernels" --sections float8 --flavors llama3.2_3b,llama3_8b --trials 3 --commit "$commit" \
      --json "$out/kernels-float8.json" 2>&1 | tee "$out/kernels-float8.txt" || status=1
    for recipe in tensorwise rowwise; do
      "$here/bench-train" --flavors llama3.2_1b,llama3.2_3b --ac none --steps 10 --warmup 3 --float8 "$recipe" \
        --markdown --commit "$commit" --json "$out/train-float8-$recipe.json" 2>&1 |
        tee "$out/train-float8-$recipe.txt" || status=1
    done
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    if [ "${mib:-0}" -ge 120000 ]; then
      for recipe in tensorwise rowwise; do
        "$here/bench-train" --flavors llama3_8b --ac full --state-dtype bfloat16 --steps 5 --warmup 2 --float8 "$recipe" \
          --markdown --commit "$commit" --json "$out/train8b-float8-$recipe.json" 2>&1 |
          tee "$out/train8b-float8-$recipe.txt" || status=1
      done
    else
      echo "float8: llama3_8b skipped: it needs about 110 GiB and this GPU has ${mib:-?} MiB" | tee "$out/train8b-float8.txt"
    fi
    # Issue 51's short curve on the GPU: Llama 3.2 1B on the embedded corpus (batch 1 x seq
    # 2048, no checkpointing, 300 steps), bf16 against tensorwise and rowwise on cuBLASLt's
    # float8 matmul, from the same seed: the final loss within 2% of bf16's, no step diverging.
    python3 "$here/float8_curves.py" --train "$here/llama-train" --config "$here/configs/llama3.2_1b.toml" \
      --device cuda --emulate false --steps 300 --recipes tensorwise,rowwise --set model.tokenizer=synthetic_bpe \
      --set training.dataset=synthetic --set training.local_batch_size=1 --set training.global_batch_size=1 \
      --set training.seq_len=2048 --set parallelism.data_parallel_shard_degree=1 \
      --set activation_checkpoint.mode=none --set lr_scheduler.warmup_steps=30 --markdown \
      --json "$out/float8-curves.json" 2>&1 | tee "$out/float8-curves.txt" || status=1
    exit "$status" ;;
  generate)
    # Sampling through the KV cache (the decoding attention's runs of keys) against the
    # whole window: Llama 3.2 1B in bf16 after a short prompt and a long one, then the debug
    # model in float32, whose two modes must give the same tokens.
    status=0
    for prompt in 16 2048; do
      "$here/bench-generate-gpu" --flavor llama3.2_1b --prompt "$prompt" --tokens 256 --commit "$commit" 2>&1 |
        tee -a "$out/generate.txt" || status=1
    done
    "$here/bench-generate-gpu" --dtype float32 --prompt 64 --tokens 128 --commit "$commit" 2>&1 |
      tee -a "$out/generate.txt" || status=1
    # llama-generate --device cuda on a model the GPU trained: float32 greedy, the CPU's text;
    # bf16 printed beside.
    work=$(mktemp -d)
    "$here/llama-train" --sample-tokens 0 --config "$here/configs/debug_model.toml" --training.device cuda \
      --training.steps 20 --checkpoint.enable false --job.dump_folder "$work/g" > "$work/train.log" 2>&1 ||
      { echo "generate: the debug model's run failed"; tail -n 5 "$work/train.log"; exit 1; }
    sample() { "$here/llama-generate" --checkpoint "$work/g/model.safetensors" --prompt "Nora" --max-new-tokens 64 \
      --temperature 0 "$@" 2>> "$out/generate-errors.txt"; }
    cpu=$(sample --device cpu); gpu=$(sample --device cuda); gpu16=$(sample --device cuda --dtype bfloat16)
    { echo "cpu:           $cpu"; echo "cuda float32:  $gpu"; echo "cuda bfloat16: $gpu16"; } | tee -a "$out/generate.txt"
    verdict="generate: llama-generate on the GPU writes the CPU's text"
    [ "$cpu" = "$gpu" ] || { verdict="generate: llama-generate's GPU text differs from the CPU's"; status=1; }
    echo "$verdict" | tee -a "$out/generate.txt"
    exit "$status" ;;
  llama)
    "$here/llama-train" --config "$here/configs/debug_model.toml" --training.device cuda --training.steps 100 \
      --job.dump_folder "$out/llama-train" 2>&1 | tail -n 40 | tee "$out/llama-train.txt" ;;
  offload)
    status=0
    work=$(mktemp -d)
    for o in false true; do
      "$here/llama-train" --sample-tokens 0 --config "$here/configs/debug_model.toml" --training.device cuda \
        --training.steps 10 --training.enable_cpu_offload "$o" --job.dump_folder "$work/offload-$o" 2>&1 | tail -n 12 \
        | tee "$out/offload-debug-$o.txt" || status=1
    done
    python3 - "$work/offload-false/metrics.jsonl" "$work/offload-true/metrics.jsonl" <<'PY' | tee "$out/offload-debug.txt" || status=1
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f) if '"loss"' in l] for f in sys.argv[1:3])
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
print(f"offload: {len(b)} steps, largest relative loss difference {worst:.3g} (limit 1e-5)")
sys.exit(0 if len(a) == len(b) == 10 and worst <= 1e-5 else 1)
PY
    timeout 400 "$here/llama-train" --sample-tokens 0 --config "$here/configs/llama3.2_3b.toml" --training.device cuda --training.steps 3 \
      --training.seq_len 8192 --training.local_batch_size 1 --training.global_batch_size 1 \
      --activation_checkpoint.mode full --training.enable_cpu_offload true --metrics.log_freq 1 \
      --job.dump_folder "$work/offload-3b" 2>&1 | tail -n 12 | tee "$out/offload-3b.txt" || status=1
    cp "$work/offload-3b/metrics.jsonl" "$out/offload-3b-metrics.jsonl" 2>/dev/null
    # And under the early step (nothing clipped): each unit's update on the host's cores
    # beside the backward the device was given meanwhile (offload-early-plan-*.json).
    timeout 400 "$here/llama-train" --sample-tokens 0 --config "$here/configs/llama3.2_3b.toml" --training.device cuda --training.steps 3 \
      --training.seq_len 8192 --training.local_batch_size 1 --training.global_batch_size 1 \
      --activation_checkpoint.mode full --training.enable_cpu_offload true --metrics.log_freq 1 \
      --optimizer.early_step_in_backward true --training.max_norm 0 \
      --job.dump_folder "$work/offload-early-3b" 2>&1 | tail -n 12 | tee "$out/offload-early-3b.txt" || status=1
    cp "$work/offload-early-3b/metrics.jsonl" "$out/offload-early-3b-metrics.jsonl" 2>/dev/null
    cp "$here/offload-plan-$machine.json" "$here/offload-early-plan-$machine.json" "$out/" 2>/dev/null
    exit "$status" ;;
  all)
    # Every step in one command, for a loan of a few minutes: the measurements still open
    # first (eager, gemms), then the suite, the training steps, the PyTorch comparison, the debug
    # model, the kernels. Each step runs under its own cap and the time left of SECONDS
    # (default 540); the last takes what is left. Each step's output goes to its own log,
    # and after every step the logs and files are packed into $out/results.tar.gz with a
    # line a step in $out/summary.txt: a loan that returns a few files returns them all,
    # also when the loan's own limit cuts the command short. nvidia-smi logs the clocks and
    # power through it all, each step (and part of gemms) marked: bench/gpu_clocks.py's
    # table at the end says what clock each step's rates were measured at.
    total=${2:-540}
    start=$(date +%s)
    work=$(mktemp -d)
    : > "$out/summary.txt"
    export MARKS="$work/marks.txt"
    : > "$MARKS"
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
      --format=csv,noheader,nounits -lms 250 > "$work/clocks.csv" 2> "$work/clocks.err" &
    logger=$!
    steps=("eager 150" "gemms 150" "test 150" "train 145" "torch 105" "llama 40" "generate 40" "kernels 0")
    # run.sh all SECONDS STEP:CAP ...: those steps in that order instead (a cap of 0: what is left).
    (( $# > 2 )) && { steps=(); for s in "${@:3}"; do steps+=("${s/:/ }"); done; }
    for s in "${steps[@]}"; do
      read -r name cap <<< "$s"
      left=$(( total - ($(date +%s) - start) ))
      if (( left < 20 )); then echo "$name: skipped, ${left} s left" | tee -a "$out/summary.txt"; continue; fi
      limit=$left
      (( cap > 0 && cap < left )) && limit=$cap
      t0=$(date +%s)
      echo "== $name (at most ${limit} s)"
      mark "$name"
      step=("$name")
      [ "$name" = torch ] && step+=("$limit")  # the torch step plans its runs within its cap
      OUT="$work" timeout -k 10 "$limit" bash "$here/run.sh" "${step[@]}" > "$work/$name.log" 2>&1
      rc=$?
      why=""; (( rc == 124 || rc == 137 )) && why=" (stopped at its ${limit} s)"
      echo "$name: exit $rc in $(( $(date +%s) - t0 )) s$why" | tee -a "$out/summary.txt"
      # A step stopped at its cap may leave processes of its own (nccl's ranks run under
      # timeouts of their own): none may run beside the next step's timings.
      pkill -9 -f "^$here/" 2> /dev/null && echo "$name: processes it left were killed" | tee -a "$out/summary.txt"
      tar -czf "$out/results.tar.gz" -C "$work" --exclude=./llama-train --exclude=checkpoint --exclude="*.safetensors" --exclude="*.bin" .  # no checkpoints, no saved models
    done
    mark "end"
    sleep 1
    kill "$logger" 2> /dev/null
    python3 "$here/gpu_clocks.py" --csv "$work/clocks.csv" --marks "$MARKS" --json "$work/clocks.json" > "$work/clocks.txt" 2>&1
    tar -czf "$out/results.tar.gz" -C "$work" --exclude=./llama-train --exclude=checkpoint --exclude="*.safetensors" --exclude="*.bin" .
    # The end of the reply (a loan returns the last 12,000 characters): what each step
    # found, the shortest and most asked-for last; the whole of it is in the archive.
    for f in "$work"/eager*.txt "$work"/gemms-torch.txt "$work"/torch.txt; do
      [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -vE "UserWarning|_warn_once" "$f" | tail -n 16; }
    done
    grep -hE "\| +(profiled step|class |GEMMs|attention|memory-bound|loss head|optimizer|host synchron|no profile)" \
      "$work"/train.txt "$work"/train8b.txt 2>/dev/null
    grep -hE "^\[doctest\] (test cases|assertions|Status)|^\| 20" "$work"/test.log "$work"/train.log "$work"/float8.log 2>/dev/null
    grep -hE "^nccl:|^ +[0-9]+ (NCCL version|via|Duplicate)" "$work"/nccl.log 2>/dev/null
    echo "-- clocks.txt"; cat "$work/clocks.txt"
    cat "$out/summary.txt" ;;
  *) echo "usage: run.sh test|kernels|train|float8|torch|titan|eager|gemms|llama|generate|offload|nccl|all [SECONDS]" >&2; exit 2 ;;
esac
EOF
chmod +x "$bundle/run.sh"
tar -cJf "$bundle.tar.xz" "$bundle"
echo "gpu_bundle: $(du -h "$bundle.tar.xz" | cut -f1) in $bundle.tar.xz ($(du -sh "$bundle" | cut -f1) unpacked), commit $(cat "$bundle/COMMIT")"
