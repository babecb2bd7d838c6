#!/usr/bin/env python3
"""Float8 loss curves: a model trained by llama-train in bf16 and with each float8 recipe
(model.converters = ["float8"]), from the same seed and data, on the CPU with the GEMMs
emulated (the default: the debug model, examples/configs/debug_model.toml, 250 steps) or
on a GPU on cuBLASLt's float8 matmul (--device cuda --emulate false).

    python3 bench/float8_curves.py --train build/examples/llama-train [--steps 250] [--markdown]
    python3 bench/float8_curves.py --train llama-train --device cuda --emulate false \\
        --config configs/llama3.2_1b.toml --steps 300 --recipes tensorwise,rowwise \\
        --set training.seq_len=2048 --set training.local_batch_size=1 ...

Prints each run's loss at every 25th step and the final loss's gap to bf16; PASS where the
final loss is within 2% of bf16's and no step diverges (every loss finite, none more than
10% above bf16's at the same step). --json FILE writes the curves and verdicts. Exit
status 1 on a MISS or a failed run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def run(train: str, config: str, folder: Path, steps: int, extra: list[str]) -> list[float]:
    args = [train, "--sample-tokens", "0", "--config", config, "--job.dump_folder", str(folder), "--training.steps", str(steps),
            "--training.mixed_precision_param", "bfloat16", "--metrics.log_freq", "1", "--metrics.peak_tflops", "1",
            "--checkpoint.enable", "false", "--checkpoint.export_dtype", "bfloat16"] + extra
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"float8_curves: {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    losses = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        losses[row["step"]] = row["loss"]
    shutil.rmtree(folder)  # the final model save, gigabytes at 1B: only the losses are kept
    return [losses[s] for s in sorted(losses)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", required=True, help="the llama-train binary")
    parser.add_argument("--config", default=str(ROOT / "examples" / "configs" / "debug_model.toml"),
                        help="the run's config (default: the debug model)")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="training.device")
    parser.add_argument("--emulate", default="true", choices=["true", "false"],
                        help="float8.emulate: true (the CPU, and any GPU) or false (cuBLASLt's float8 matmul)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated float8 recipes to run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config key for every run (training.seq_len=2048); repeatable")
    parser.add_argument("--json", help="write the curves and verdicts here")
    parser.add_argument("--markdown", action="store_true", help="also print the table for bench/RESULTS.md")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        if r not in RECIPES:
            parser.error(f"--recipes: unknown recipe '{r}' (expected {', '.join(RECIPES)})")
    common = ["--training.device", args.device]
    for kv in args.set:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            parser.error(f"--set {kv}: expected KEY=VALUE")
        common += ["--" + key, value]
    with tempfile.TemporaryDirectory() as tmp:
        curves = {"bf16": run(args.train, args.config, Path(tmp) / "bf16", args.steps, common)}
        for recipe in recipes:
            curves[recipe] = run(args.train, args.config, Path(tmp) / recipe, args.steps,
                                 common + ["--model.converters", "float8", "--float8.recipe_name", recipe,
                                           "--float8.emulate", args.emulate])
    base = curves["bf16"]
    marks = [s for s in range(1, args.steps + 1) if s == 1 or s % 25 == 0]
    status = 0
    header = "| step | " + " | ".join(curves) + " |"
    lines = [header, "|---:|" + "---:|" * len(curves)]
    for s in marks:
        lines.append(f"| {s} | " + " | ".join(f"{c[s - 1]:.4f}" for c in curves.values()) + " |")
    verdicts = {}
    for recipe in recipes:
        c = curves[recipe]
        final_gap = (c[-1] - base[-1]) / base[-1]
        worst = max((c[i] - base[i]) / base[i] for i in range(len(c)))
        finite = all(math.isfinite(v) for v in c)
        ok = finite and abs(final_gap) < 0.02 and worst < 0.10
        status |= 0 if ok else 1
        verdicts[recipe] = {"final": c[-1], "bf16_final": base[-1], "final_gap": final_gap, "worst_step_gap": worst,
                            "pass": ok}
    print(f"float8 curves: {Path(args.config).name}, {args.steps} steps on {args.device}, "
          f"float8.emulate = {args.emulate}" + (f", {' '.join(args.set)}" if args.set else ""))
    print("\n".join(lines if args.markdown else lines[:2] + lines[2:][-3:]))
    for recipe, v in verdicts.items():
        print(f"{recipe}: final loss {v['final']:.4f} against bf16 {v['bf16_final']:.4f} ({100 * v['final_gap']:+.2f}%), "
              f"largest step above bf16 {100 * v['worst_step_gap']:+.2f}%: {'PASS' if v['pass'] else 'MISS'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "steps": args.steps, "device": args.device,
                                               "emulate": args.emulate, "set": args.set, "curves": curves,
                                               "verdicts": verdicts}, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
