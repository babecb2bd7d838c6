#!/usr/bin/env bash
# llama-plan's own speed on the searches bench/RESULTS.md records ("llama-plan's own
# speed"): Llama 3.1 405B on 16,384 H100s, the issue's search within a minute, and Llama 3
# 8B on 64 H100s at a global batch of 128. One markdown row each: the elapsed seconds, the
# layouts priced and traced, the first layout; the 405B row says whether it is within the
# minute, and the script exits 1 when it is not.
#   plan_search_speed.sh LLAMA_PLAN CONFIGS_DIR
set -euo pipefail
plan=$1
configs=$2
status=0
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "| search | elapsed | priced, traces | first layout | within a minute |"
echo "|---|---|---|---|---|"
for entry in "llama3.1_405b:16384:" "llama3_8b:64:--training.global_batch_size 128"; do
  IFS=: read -r model gpus extra <<< "$entry"
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # $extra is a key and its value, or nothing
  "$plan" --config "$configs/$model.toml" --machine h100-sxm --gpus "$gpus" --search --json $extra > "$out"
  end=$(date +%s.%N)
  row=$(python3 - "$out" "$model" "$gpus" "$start" "$end" <<'EOF'
import json, sys
model, gpus, start, end = sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
j = json.load(open(sys.argv[1]))
first = j["layouts"][0]
keys = ("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
        "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree")
layout = " x ".join(str(first.get(k, "?")) for k in keys) + ", " + str(first.get("activation_checkpoint.mode", "?"))
seconds = end - start
within = ("yes" if seconds < 60 else "NO") if model == "llama3.1_405b" else ""
print("| %s on %s H100s | %.1f s | %s, %s | %s, %.0f tokens/s/GPU | %s |" % (
    model, gpus, seconds, j["search"]["priced"], j["search"]["dry_runs"], layout, first["tokens_per_sec"], within))
EOF
)
  echo "$row"
  case "$row" in *"| NO |") status=1 ;; esac
done
exit $status
