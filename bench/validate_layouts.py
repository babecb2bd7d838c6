#!/usr/bin/env python3
"""llama-plan against published measurements of Llama training layouts.

    validate_layouts.py LLAMA_PLAN [--jobs N] [--sheets NAME,...] [--json OUT]

Plans every run transcribed in tests/plan/layouts/ (torchtitan's FSDP table on 64 A100s
and the five sheets of Hagemann et al.: ZeRO-1 x tensor x pipeline layouts of Llama 13B,
30B and 65B on 64-256 A100s) with llama-plan on the A100 80GB profile of the cluster each
ran on (MACHINES below), and prints how the predictions hold against the measurements:

  fit         out of memory predicted right, over the runs whose outcome is a figure or an OOM
  top         for each sheet, the measured MFU of the layout llama-plan ranks first among the
              sheet's FlashAttention-2 layouts, against the sheet's best
  spearman    rank correlation of predicted and measured MFU over each sheet's
              FlashAttention-2 runs that ran
  relative    predicted MFU against each torchtitan row and each sheet's best run, both by the
              source's own count of FLOPs: both count the embeddings (torchtitan's table was made
              when its train.py counted every parameter, train.py:188 at 1ea476e9f), llama-plan
              does not, so a run's predicted MFU is its measured MFU times the predicted
              tokens/s over the measured (the measured step time over the predicted one)

and, from the measurements alone (no plan), how far each sheet agrees with itself:

  kernel order  the pairs of runs of one layout (tp, pp, micro-batch, checkpointing) with
              two attention kernels, and those where the faster kernel (KERNEL_ORDER) took a
              step over 5% longer than the slower one. The kernels change only the attention
              and the RMSNorm, and the faster ones hold no more memory, so no model of the
              layout can predict such a pair; a sheet with many ranks its runs by something
              the layout does not hold

The issue's targets: fit >= 90%, top within 5 MFU points, spearman >= 0.8, relative
within +-15%. --check holds them (exit 1 when one fails), each where it is met and, where
it is not yet, at the figure the planner reached (REACHED below): the suite's plan_layouts
test runs `--check --fa2`, the sheets' FlashAttention-2 runs and torchtitan's table (the
runs the top and spearman figures are over, and every sheet's best; half the plans) on
every sheet but 65B (tests/meson.build says why).
"""
import argparse
import concurrent.futures
import csv
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAYOUTS = os.path.join(ROOT, "tests", "plan", "layouts")
CONFIGS = os.path.join(ROOT, "examples", "configs")

# Hagemann et al.'s models: Llama 1 shapes, a vocabulary of 131,072, untied (the sheets' README).
MODELS = {
    "13b": dict(dim=5120, n_layers=40, n_heads=40, ffn_hidden=13824),
    "30b": dict(dim=6656, n_layers=60, n_heads=52, ffn_hidden=17920),
    "65b": dict(dim=8192, n_layers=80, n_heads=64, ffn_hidden=22016),
}
FA2 = ("flash_attention2", "flash_attention2+RMS_kernel")
# The cluster each source ran on. The sheets: DGX A100 nodes with a 200 Gb/s HDR NIC per GPU
# (the paper). torchtitan's table does not name its cluster; its multi-node launch script at the
# table's commit (multinode_trainer.slurm at 395a52627, by the table's author, "verified ... on
# 20 nodes / 160 A100s") is "optimized for AWS with EFA", sets FI_PROVIDER=efa "for A100" and
# asks 96 CPUs a node: AWS p4de.24xlarge (A100 80GB, 96 vCPUs, 4 x 100 Gb/s EFA).
MACHINES = {"hagemann": "a100-80gb-sxm", "torchtitan": "a100-80gb-p4de"}
# The sheets' kernel column as llama-plan's keys for the runtime's memory (plan/scaling_memory.hpp).
KERNELS = {
    "torch": ["--plan.attention", "torch"],
    "fused": ["--plan.attention", "fused"],
    "flash_attention": ["--plan.attention", "flash1"],
    "flash_attentionv1.0.8": ["--plan.attention", "flash1"],
    "flash_attention2": ["--plan.attention", "flash2"],
    "flash_attention2+RMS_kernel": ["--plan.attention", "flash2", "--plan.rmsnorm", "fused"],
}

# The sheets' kernels from slowest to fastest (the paper's order; FlashAttention 1 appears
# under two names). A faster kernel does less work and holds no more memory on one layout.
KERNEL_ORDER = {"torch": 0, "fused": 1, "flash_attention": 2, "flash_attentionv1.0.8": 2, "flash_attention2": 3,
                "flash_attention2+RMS_kernel": 4}


def kernel_order(rows, tolerance=0.05):
    """Pairs of runs of one layout with kernels of different speed, and those where the faster
    kernel's step is longer than the slower one's by more than `tolerance` (worst first)."""
    by_layout = {}
    for r in rows:
        if r["outcome"] == "ran" and r["kernel"] in KERNEL_ORDER:
            key = (r["tp"], r["pp"], r["micro_batch"], r["checkpointing"])
            by_layout.setdefault(key, []).append(r)
    pairs, inverted = 0, []
    for key, runs in by_layout.items():
        for slow in runs:
            for fast in runs:
                if KERNEL_ORDER[fast["kernel"]] <= KERNEL_ORDER[slow["kernel"]]:
                    continue
                pairs += 1
                ratio = float(fast["step_seconds"]) / float(slow["step_seconds"])
                if ratio > 1 + tolerance:
                    inverted.append((ratio, key, slow, fast))
    inverted.sort(key=lambda x: -x[0])
    return pairs, inverted


# The targets (llama-plan, part 2): fit, top (MFU points below the sheet's best),
# spearman, relative (each sheet's best run and each torchtitan row).
TARGETS = dict(fit=0.90, top=5.0, spearman=0.8, relative=0.15)
# Where a target is not met yet, the bound --check holds instead: the figure reached on
# 2026-11-28 (docs/planning.md says what is left), rounded outward. None: not held (no
# figure to hold, such as a first choice that ran out of memory).
REACHED = {
    ("hagemann_13b_seq2k_64gpus", "top"): 14.5,    # picks tp1 pp2 mb2 (56.5) against 70.6
    ("hagemann_30b_seq2k_256gpus", "spearman"): 0.78,  # 0.79
}


class Check:
    """Each figure against its target, or where REACHED names a bound, against that."""

    def __init__(self):
        self.lines, self.failed = [], 0

    def hold(self, sheet, what, value, ok_target, ok_reached=None):
        key = (sheet, what)
        if ok_target(TARGETS[what]):
            state = "target met"
        elif key in REACHED and REACHED[key] is None:
            state = "target not met (not held)"
        elif key in REACHED and ok_reached(REACHED[key]):
            state = "target not met, held at %s" % REACHED[key]
        else:
            state = "FAILED"
            self.failed += 1
        self.lines.append("  %-28s %-9s %-10s %s" % (sheet, what, value, state))


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def sheet_meta(name):
    # hagemann_13b_seq2k_64gpus
    _, model, seq, gpus = name.split("_")
    return model, int(seq[3:-1]) * 1024, int(gpus[:-4])


def hagemann_args(model, seq, row):
    gpus, tp, pp, mb = int(row["gpus"]), int(row["tp"]), int(row["pp"]), int(row["micro_batch"])
    dp = gpus // (tp * pp)
    global_batch = 4194304 // seq
    m = MODELS[model]
    args = ["--machine", MACHINES["hagemann"], "--config", os.path.join(CONFIGS, "llama2_13b.toml"),
            "--model.flavor", "llama2_13b",
            "--model.dim", str(m["dim"]), "--model.n_layers", str(m["n_layers"]), "--model.n_heads", str(m["n_heads"]),
            "--model.n_kv_heads", str(m["n_heads"]), "--model.ffn_hidden", str(m["ffn_hidden"]),
            "--model.vocab_size", "131072", "--model.max_seq_len", str(seq), "--training.seq_len", str(seq),
            "--training.mixed_precision_param", "bfloat16", "--gpus", str(gpus), "--plan.zero1", "true",
            "--parallelism.tensor_parallel_degree", str(tp), "--parallelism.pipeline_parallel_degree", str(pp),
            "--training.global_batch_size", str(global_batch),
            "--activation_checkpoint.mode", row["checkpointing"], "--plan.runtime", "scaling"] + KERNELS[row["kernel"]]
    if pp > 1:  # the data-parallel rank's share of the batch, in microbatches of mb through 1F1B
        args += ["--training.local_batch_size", str(global_batch // dp), "--parallelism.pipeline_parallel_schedule", "1F1B",
                 "--parallelism.pipeline_parallel_microbatch_size", str(mb)]
    else:  # mb sequences at a time, accumulated
        args += ["--training.local_batch_size", str(mb)]
    return args


def torchtitan_args(row):
    ac = row["checkpointing"]
    args = ["--machine", MACHINES["torchtitan"], "--config", os.path.join(CONFIGS, row["flavor"] + ".toml"), "--gpus", "64",
            "--parallelism.data_parallel_shard_degree", "64", "--parallelism.tensor_parallel_degree", "1",
            "--parallelism.pipeline_parallel_degree", "1", "--training.seq_len", row["seq"],
            "--training.local_batch_size", row["local_batch"], "--training.global_batch_size", "-1",
            "--training.mixed_precision_param", "bfloat16", "--plan.runtime", "torchtitan",
            # The train_configs that made the table: fused_rmsnorm for 8B and 13B, rmsnorm for 70B.
            "--plan.rmsnorm", "torch" if row["flavor"].endswith("70b") else "fused"]
    if ac.startswith("selective"):
        args += ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                 "op" if ac == "selective_op" else "2"]
    else:
        args += ["--activation_checkpoint.mode", ac]
    return args


def plan(binary, args):
    r = subprocess.run([binary, "--json"] + args, capture_output=True, text=True,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    return json.loads(r.stdout)


def spearman(xs, ys):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx > 0 and vy > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("llama_plan")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sheets", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--fa2", action="store_true", help="the sheets' FlashAttention-2 runs only, and torchtitan's")
    ap.add_argument("--check", action="store_true", help="hold the targets (or REACHED); exit 1 if one fails")
    a = ap.parse_args()
    check = Check()

    jobs = []  # (sheet, row, args)
    for name in sorted(os.listdir(LAYOUTS)):
        if not name.endswith(".csv"):
            continue
        sheet = name[:-4]
        if a.sheets and sheet not in a.sheets.split(","):
            continue
        for row in read_csv(os.path.join(LAYOUTS, name)):
            if sheet.startswith("torchtitan"):
                jobs.append((sheet, row, torchtitan_args(row)))
            elif row["outcome"] in ("ran", "oom") and (not a.fa2 or row["kernel"] in FA2):
                model, seq, _ = sheet_meta(sheet)
                jobs.append((sheet, row, hagemann_args(model, seq, row)))
    # One plan per distinct layout (the sheets repeat a layout once per kernel).
    distinct = {}
    for _, _, args in jobs:
        distinct.setdefault(tuple(args), None)
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for key, result in zip(distinct, pool.map(lambda k: plan(a.llama_plan, list(k)), distinct)):
            distinct[key] = result

    results = []
    for sheet, row, args in jobs:
        p = distinct[tuple(args)]
        results.append({"sheet": sheet, "row": row, "plan": p})
    errors = [r for r in results if "error" in r["plan"]]
    for r in errors[:10]:
        print("plan failed: %s %s: %s" % (r["sheet"], r["row"], r["plan"]["error"]))

    ok = [r for r in results if "error" not in r["plan"]]
    right = sum(1 for r in ok if r["plan"]["fits"] == (r["row"]["outcome"] == "ran"))
    print("fit: %d of %d right (%.1f%%)" % (right, len(ok), 100 * right / max(1, len(ok))))
    check.hold("all runs planned", "fit", "%.1f%%" % (100 * right / max(1, len(ok))),
               lambda t: right >= t * len(ok))
    summary = {"fit_right": right, "fit_runs": len(ok), "sheets": {}}
    for sheet in sorted({r["sheet"] for r in ok}):
        rows = [r for r in ok if r["sheet"] == sheet]
        wrong = [r for r in rows if r["plan"]["fits"] != (r["row"]["outcome"] == "ran")]
        s = {"runs": len(rows), "fit_wrong": len(wrong)}
        if sheet.startswith("torchtitan"):
            print("%s: fit %d/%d" % (sheet, len(rows) - len(wrong), len(rows)))
            for r in rows:
                if r["row"]["outcome"] != "ran":
                    continue
                # The table's MFU counts every parameter (embeddings and output included), llama-plan's
                # leaves the embeddings out: compared on one count, the tokens/s.
                measured = 100 * float(r["row"]["mfu"])
                measured_tps = float(r["row"]["tokens_per_sec"])
                rel = r["plan"]["tokens_per_sec"] / measured_tps - 1
                print("  %-11s seq %s batch %s %-15s measured %5.1f%% predicted %5.1f%% (%+.0f%%; %.0f against %.0f tokens/s)%s" % (
                    r["row"]["flavor"], r["row"]["seq"], r["row"]["local_batch"], r["row"]["checkpointing"], measured,
                    measured * (1 + rel), 100 * rel, r["plan"]["tokens_per_sec"], measured_tps,
                    "" if r["plan"]["fits"] else "  predicted OOM"))
                s.setdefault("rows", []).append({"flavor": r["row"]["flavor"], "checkpointing": r["row"]["checkpointing"],
                                                 "local_batch": r["row"]["local_batch"], "relative": rel})
            worst = max((abs(x["relative"]) for x in s.get("rows", [])), default=0)
            check.hold(sheet, "relative", "%+.1f%%" % (100 * worst), lambda t: worst <= t, lambda b: worst <= b)
            summary["sheets"][sheet] = s
            continue
        ran = [r for r in rows if r["row"]["outcome"] == "ran"]
        best = max(ran, key=lambda r: float(r["row"]["mfu"]))
        sheet_rows = read_csv(os.path.join(LAYOUTS, sheet + ".csv"))  # every run, not only those planned
        sheet_best = max(float(x["mfu"]) for x in sheet_rows if x["outcome"] == "ran")
        if float(best["row"]["mfu"]) != sheet_best:
            print("%s: the sheet's best run is not among those planned (--fa2 leaves it out)" % sheet)
            check.failed += 1
        best_mfu = 100 * float(best["row"]["mfu"])
        fa2 = [r for r in ran if r["row"]["kernel"] in FA2]
        rho = spearman([r["plan"]["mfu_pct"] for r in fa2], [float(r["row"]["mfu"]) for r in fa2]) if len(fa2) > 2 else float("nan")
        # The planner's first choice among the sheet's FlashAttention-2 layouts (all tried, fitting or not).
        # Each layout with each FlashAttention-2 kernel is a choice (the kernels' memory differs,
        # their traced time does not: a tie goes to the fused RMSNorm, which does less work).
        layouts = {}
        for r in rows:
            if r["row"]["kernel"] not in FA2:
                continue
            key = (r["row"]["tp"], r["row"]["pp"], r["row"]["micro_batch"], r["row"]["checkpointing"], r["row"]["kernel"])
            measured = 100 * float(r["row"]["mfu"]) if r["row"]["outcome"] == "ran" else None
            prev = layouts.get(key)
            layouts[key] = (r["plan"], max(filter(None, [measured, prev[1] if prev else None]), default=None))
        fitting = [(k, v) for k, v in layouts.items() if v[0]["fits"]]
        top = max(fitting, key=lambda kv: (kv[1][0]["mfu_pct"], "RMS" in kv[0][4])) if fitting else None
        top_measured = top[1][1] if top else None
        # The sheet's count of FLOPs for both: measured MFU x measured step / predicted step.
        best_predicted = best_mfu * float(best["row"]["step_seconds"]) / best["plan"]["step_seconds"]
        rel = best_predicted / best_mfu - 1
        s.update(best_measured=best_mfu, best_predicted=best_predicted, relative=rel, spearman=rho,
                 top_layout=top[0] if top else None, top_measured=top_measured)
        print("%s: fit %d/%d | best run %s (tp %s pp %s mb %s %s, %s): measured %.1f%%, predicted %.1f%% (%+.0f%%) | "
              "spearman %.2f over %d FA2 runs | planner's top %s: measured %s" % (
                  sheet, len(rows) - len(wrong), len(rows), best["row"]["trial"], best["row"]["tp"], best["row"]["pp"],
                  best["row"]["micro_batch"], best["row"]["checkpointing"], best["row"]["kernel"], best_mfu,
                  best_predicted, 100 * rel, rho, len(fa2), top[0] if top else "none",
                  "%.1f%%" % top_measured if top_measured is not None else "OOM"))
        pairs, inverted = kernel_order(sheet_rows)
        s.update(kernel_pairs=pairs, kernel_inverted=len(inverted))
        print("  kernel order: %d pairs of one layout with two kernels, %d with the faster kernel's step over 5%% longer%s" % (
            pairs, len(inverted), "" if not inverted else " (worst %.2fx: tp %s pp %s mb %s %s, %s %.1f s against %s %.1f s)" % (
                inverted[0][0], *inverted[0][1], inverted[0][3]["kernel"], float(inverted[0][3]["step_seconds"]),
                inverted[0][2]["kernel"], float(inverted[0][2]["step_seconds"]))))
        check.hold(sheet, "relative", "%+.1f%%" % (100 * rel), lambda t: abs(rel) <= t)
        check.hold(sheet, "spearman", "%.2f" % rho, lambda t: rho >= t, lambda b: rho >= b)
        gap = best_mfu - top_measured if top_measured is not None else None
        check.hold(sheet, "top", "OOM" if gap is None else "%.1f" % gap,
                   lambda t: gap is not None and gap <= t, lambda b: gap is not None and gap <= b)
        summary["sheets"][sheet] = s
    if a.check:
        print("against the targets (fit >= %.0f%%, top within %.0f points, spearman >= %.1f, relative within %.0f%%):" % (
            100 * TARGETS["fit"], TARGETS["top"], TARGETS["spearman"], 100 * TARGETS["relative"]))
        print("\n".join(check.lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1)
    return 1 if errors or (a.check and check.failed) else 0


if __name__ == "__main__":
    sys.exit(main())
