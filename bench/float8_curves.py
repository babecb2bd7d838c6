#!/usr/bin/env python3
"""Float8 loss curves on the CPU: the debug model (examples/configs/debug_model.toml,
250 steps) trained by llama-train in bf16 and with each float8 recipe emulated
(model.converters = ["float8"], float8.emulate = true), from the same seed and data.

    python3 bench/float8_curves.py --train build/examples/llama-train [--steps 250] [--markdown]

Prints each run's loss at every 25th step and the final loss's gap to bf16; PASS where the
final loss is within 2% of bf16's and no step diverges (every loss finite, none more than
10% above bf16's at the same step). Exit status 1 on a MISS or a failed run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def run(train: str, folder: Path, steps: int, extra: list[str]) -> list[float]:
    args = [train, "--config", str(ROOT / "examples" / "configs" / "debug_model.toml"), "--job.dump_folder", str(folder),
            "--training.steps", str(steps), "--training.mixed_precision_param", "bfloat16", "--metrics.log_freq", "1",
            "--metrics.peak_tflops", "1", "--checkpoint.enable", "false"] + extra
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"float8_curves: {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    losses = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        losses[row["step"]] = row["loss"]
    return [losses[s] for s in sorted(losses)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", required=True, help="the llama-train binary")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--markdown", action="store_true", help="also print the table for bench/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {"bf16": run(args.train, Path(tmp) / "bf16", args.steps, [])}
        for recipe in RECIPES:
            curves[recipe] = run(args.train, Path(tmp) / recipe, args.steps,
                                 ["--model.converters", "float8", "--float8.recipe_name", recipe, "--float8.emulate", "true"])
    base = curves["bf16"]
    marks = [s for s in range(1, args.steps + 1) if s == 1 or s % 25 == 0]
    status = 0
    header = "| step | " + " | ".join(curves) + " |"
    lines = [header, "|---:|" + "---:|" * len(curves)]
    for s in marks:
        lines.append(f"| {s} | " + " | ".join(f"{c[s - 1]:.4f}" for c in curves.values()) + " |")
    verdicts = []
    for recipe in RECIPES:
        c = curves[recipe]
        final_gap = (c[-1] - base[-1]) / base[-1]
        worst = max((c[i] - base[i]) / base[i] for i in range(len(c)))
        finite = all(math.isfinite(v) for v in c)
        ok = finite and abs(final_gap) < 0.02 and worst < 0.10
        status |= 0 if ok else 1
        verdicts.append(f"{recipe}: final loss {c[-1]:.4f} against bf16 {base[-1]:.4f} ({100 * final_gap:+.2f}%), "
                        f"largest step above bf16 {100 * worst:+.2f}%: {'PASS' if ok else 'MISS'}")
    print("\n".join(lines if args.markdown else lines[:2] + lines[-3:]))
    print("\n".join(verdicts))
    return status


if __name__ == "__main__":
    sys.exit(main())
