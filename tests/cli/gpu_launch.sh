#!/usr/bin/env bash
# llama-train's multi-process GPU launch, as far as a machine without a GPU can check it:
# the CUDA build links libnccl (one process per GPU over NCCL), and the launches it
# refuses end with exit status 1 and one line naming the reason, before any rank waits
# for another: --thread-ranks under torchrun, torchrun on the CPU, bad launcher values,
# comm.share_gpu on the CPU.
#   gpu_launch.sh LLAMA_TRAIN CONFIGS_DIR CUDA(true|false)
set -uo pipefail
train=$1
configs=$2
cuda=$3
failures=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "$cuda" = true ]; then
  # ldd's output is taken whole first: `ldd | grep -q` under pipefail fails whenever grep
  # stops reading before ldd has written everything (ldd then dies of SIGPIPE).
  libs=$(ldd "$train")
  if grep -q 'libnccl\.so' <<< "$libs"; then
    echo "ok: llama-train links $(grep -o 'libnccl\.so[^ ]*' <<< "$libs" | head -1)"
  else
    echo "FAIL: llama-train was built with CUDA but does not link libnccl:"
    echo "$libs"
    failures=$((failures + 1))
  fi
else
  echo "note: a build without CUDA: no NCCL to link"
fi

# expect_refusal TEXT ENV... -- ARGS...: exit status 1 within 60 s, TEXT on stderr.
expect_refusal() {
  local text=$1
  shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local err="$work/err"
  env -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u SLURM_PROCID -u PMI_RANK -u PMIX_RANK \
    "${envs[@]}" timeout 60 "$train" --config "$configs/debug_model.toml" --job.dump_folder "$work/out" \
    --training.steps 1 "$@" > /dev/null 2> "$err"
  local rc=$?
  if [ $rc -ne 1 ] || ! grep -qF -- "$text" "$err"; then
    echo "FAIL: ${envs[*]} llama-train $*: exit $rc, expected 1 with: $text"
    cat "$err"
    failures=$((failures + 1))
  elif [ -e "$work/out" ]; then
    echo "FAIL: ${envs[*]} llama-train $*: the refusal wrote $work/out"
    failures=$((failures + 1))
  else
    echo "ok: ${envs[*]} llama-train $*: $(grep -F -- "$text" "$err" | head -1)"
  fi
}

torchrun=(RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555)
expect_refusal "--thread-ranks 2 under a torchrun-style launch of 2 processes: use one or the other" \
  "${torchrun[@]}" -- --thread-ranks 2
expect_refusal "a torchrun-style launch of 2 ranks (RANK=1, WORLD_SIZE=2) needs the NCCL engine" \
  "${torchrun[@]}" -- --training.device cpu
expect_refusal "launch: LOCAL_RANK=2 is outside [0, 2) (LOCAL_WORLD_SIZE=2)" \
  RANK=1 WORLD_SIZE=4 LOCAL_RANK=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 --
expect_refusal "launch: SLURM_TASKS_PER_NODE=\"4(2)\" is not a list of task counts" \
  SLURM_PROCID=0 SLURM_NTASKS=4 SLURM_TASKS_PER_NODE="4(2)" --
# Ranks sharing a GPU are for NCCL processes: on the CPU the key is refused by name.
expect_refusal "comm.share_gpu = true: this run is on the CPU" -- --training.device cpu --comm.share_gpu true
if [ "$cuda" = true ]; then
  expect_refusal "training.device = \"cuda\": no CUDA device is visible" \
    "${torchrun[@]}" CUDA_VISIBLE_DEVICES= -- --training.device cuda
  expect_refusal "comm.init_timeout_seconds" "${torchrun[@]}" -- --comm.init_timeout_seconds 0
fi

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all gpu launch checks passed"
