#!/usr/bin/env python3
"""torch_gemms: PyTorch's bf16 GEMMs on the shapes bench-kernels timed, by the same method.

On an H100 (2026-11-27, bench/RESULTS.md) the GEMMs of torchtitan's eager step ran at
800 to 830 TFLOP/s on the Llama 2 13B and Llama 3 8B shapes, where bench-kernels timed
tessera's cuBLASLt GEMMs of the same shapes at 660 to 745 in the same session, and the
machine profiles price them from those figures. This script takes bench-kernels' --json,
times torch.matmul (bf16 in and out, as bench-kernels' bf16 section) on each of its bf16
shapes the way bench-kernels times them (CUDA events around N back-to-back calls, N so
that a trial lasts at least --trial-ms, the median of --trials trials after a warm-up
call; uniform random operands, the same number of operand sets rotated), and prints
PyTorch's rate beside tessera's heuristic choice and its best candidate. bench-kernels'
GEMMs are a training step's own (its weight gradients and logits written in fp32, the
"C" column); PyTorch's run writes bf16 throughout, as autograd does for bf16 weights, so
on those rows the two differ by the output's bytes as well. Where the two
agree, the gap is in the method (back-to-back GEMMs against GEMMs between other kernels);
where PyTorch is faster here too, it is in the library or the algorithm chosen (run it
against bench-kernels' --json made with PyTorch's own cuBLASLt to tell which).

    python3 bench/torch_gemms.py --kernels-json kernels.json [--json out.json]
    python3 bench/torch_gemms.py --self-test      # the CPU, a few seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_llama as tl  # noqa: E402 - the error type, JSON in and out

PROG = "torch_gemms"
BenchError = tl.BenchError


def read_shapes(path: str) -> tuple[list[dict], dict]:
    """bench-kernels' bf16 GEMM entries and its options, checked."""
    j = tl.read_json(path, "--kernels-json")
    if not isinstance(j, dict) or not isinstance(j.get("gemm"), list):
        raise BenchError(f"--kernels-json {path}: no 'gemm' list (bench-kernels --json with the gemm section)")
    shapes = []
    for i, g in enumerate(j["gemm"]):
        if not isinstance(g, dict) or g.get("dtype") != "bf16":
            continue
        for key in ("m", "n", "k", "trans_a", "trans_b", "beta", "flavor", "pass", "heuristic_tflops", "best_tflops"):
            if key not in g:
                raise BenchError(f"--kernels-json {path}: gemm[{i}] has no '{key}'")
        if min(g["m"], g["n"], g["k"]) <= 0:
            raise BenchError(f"--kernels-json {path}: gemm[{i}] is {g['m']} x {g['n']} x {g['k']}")
        shapes.append(g)
    if not shapes:
        raise BenchError(f"--kernels-json {path}: no bf16 GEMMs (run bench-kernels with --dtypes bf16)")
    return shapes, j.get("options", {})


def operands(torch, g: dict, device: str, sets: int):
    """`sets` operand sets (A, B, C) of one entry: C[m, n] (+)= op(A) op(B), row-major,
    A stored [k, m] when transposed and B stored [n, k] when transposed (bench-kernels')."""
    m, n, k = g["m"], g["n"], g["k"]
    out = []
    for _ in range(sets):
        a = torch.rand(k, m, device=device, dtype=torch.bfloat16).t() if g["trans_a"] else \
            torch.rand(m, k, device=device, dtype=torch.bfloat16)
        b = torch.rand(n, k, device=device, dtype=torch.bfloat16).t() if g["trans_b"] else \
            torch.rand(k, n, device=device, dtype=torch.bfloat16)
        out.append((a - 0.5, b - 0.5, torch.rand(m, n, device=device, dtype=torch.bfloat16)))
    return out


def call(torch, g: dict, abc):
    a, b, c = abc
    if g["beta"]:
        c.addmm_(a, b)  # C += A B: bench-kernels' accumulating passes
    else:
        torch.matmul(a, b, out=c)


def time_entry(torch, g: dict, device: str, trial_ms: float, trials: int, sets: int) -> dict:
    """Seconds per call: events around N back-to-back calls, N so a trial lasts trial_ms."""
    data = operands(torch, g, device, sets)
    cuda = device == "cuda"

    def run(n):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(n):
                call(torch, g, data[i % sets])
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        import time
        t0 = time.perf_counter()
        for i in range(n):
            call(torch, g, data[i % sets])
        return time.perf_counter() - t0

    run(1)  # the warm-up call: the library's choice and any module load
    once = max(run(1), 1e-7)
    n = max(1, min(256, int(trial_ms / 1e3 / once)))
    times = [run(n) / n for _ in range(trials)]
    med = statistics.median(times)
    return {"seconds": med, "calls_per_trial": n, "trials": trials,
            "trial_spread": (max(times) - min(times)) / med if med > 0 else None}


def cublas_version() -> str:
    """The cuBLAS PyTorch loads: its wheel's version, where it came as one."""
    try:
        from importlib import metadata
        for name in ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12"):
            try:
                return f"{name} {metadata.version(name)}"
            except metadata.PackageNotFoundError:
                continue
    except ImportError:
        pass
    return "the system's"


def compare(shapes: list[dict], options: dict, device: str, trials: int | None, sets: int | None,
            limit: int | None = None) -> dict:
    try:
        import torch
    except ImportError as e:
        raise BenchError(f"PyTorch is not importable ({e}); install it with `pip install torch`") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("no CUDA device visible to PyTorch")
    trial_ms = float(options.get("trial_ms", 20.0))
    trials = trials or int(options.get("trials", 5))
    rows = []
    for g in shapes[:limit]:
        t = time_entry(torch, g, device, trial_ms, trials, sets or int(g.get("operand_sets", 1)))
        flops = 2.0 * g["m"] * g["n"] * g["k"]
        tflops = flops / t["seconds"] / 1e12
        rows.append({"flavor": g["flavor"], "where": g.get("where", ""), "count": g.get("count"),
                     "result": g.get("result", "bf16"), "pass": g["pass"], "m": g["m"],
                     "n": g["n"], "k": g["k"], "torch": t, "torch_tflops": tflops,
                     "tessera_heuristic_tflops": g["heuristic_tflops"], "tessera_best_tflops": g["best_tflops"],
                     "torch_over_heuristic": tflops / g["heuristic_tflops"] if g["heuristic_tflops"] else None,
                     "torch_over_best": tflops / g["best_tflops"] if g["best_tflops"] else None})
    return {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
            "cublas": cublas_version() if device == "cuda" else None, "trial_ms": trial_ms, "trials": trials,
            "rows": rows}


def report(out: dict, tessera_note: str) -> None:
    print(f"{PROG}: {out['device']}, torch {out['torch']}, cuBLAS {out['cublas']}; tessera: {tessera_note}")
    print(f"  {'flavor':<12} {'pass':<14} {'C':<5} {'m x n x k':<24} {'tessera':>8} {'best':>8} {'torch':>8} "
          f"{'torch/tessera':>14}")
    for r in out["rows"]:
        shape = f"{r['m']} x {r['n']} x {r['k']}"
        print(f"  {r['flavor']:<12} {r['pass']:<14} {r['result']:<5} {shape:<24} {r['tessera_heuristic_tflops']:8.1f} "
              f"{r['tessera_best_tflops']:8.1f} {r['torch_tflops']:8.1f} {r['torch_over_heuristic']:13.3f}x")
    ratios = [r["torch_over_heuristic"] for r in out["rows"] if r["torch_over_heuristic"]]
    if ratios:
        out["median_torch_over_heuristic"] = statistics.median(ratios)
        print(f"  median torch / tessera's heuristic choice: {out['median_torch_over_heuristic']:.3f}x over "
              f"{len(ratios)} shapes (TFLOP/s = 2 m n k / time)")


def self_test() -> int:
    """The script on the CPU: tiny shapes of each kind, PyTorch's product checked."""
    try:
        import torch
    except ImportError:
        print(f"{PROG}: self-test skipped: PyTorch is not importable")
        return 0
    torch.manual_seed(0)
    shapes = []
    for ta, tb, beta in ((False, True, 0), (False, False, 1), (True, False, 1)):
        shapes.append({"m": 24, "n": 16, "k": 40, "trans_a": ta, "trans_b": tb, "beta": beta, "flavor": "tiny",
                       "pass": f"t{int(ta)}{int(tb)} b{beta}", "heuristic_tflops": 1.0, "best_tflops": 1.0,
                       "dtype": "bf16", "operand_sets": 2})
    for g in shapes:
        a, b, c = operands(torch, g, "cpu", 1)[0]
        if tuple(a.shape) != (g["m"], g["k"]) or tuple(b.shape) != (g["k"], g["n"]):
            raise BenchError(f"self-test failed: operands of {g['pass']} are {tuple(a.shape)} and {tuple(b.shape)}")
        want = a.float() @ b.float() + (c.float() if g["beta"] else 0)
        call(torch, g, (a, b, c))
        err = ((c.float() - want).norm() / want.norm()).item()
        if not err < 2e-2:
            raise BenchError(f"self-test failed: {g['pass']} is off by {err:.2e} relative")
    out = compare(shapes, {"trial_ms": 1.0, "trials": 3}, "cpu", None, None)
    if len(out["rows"]) != 3 or not all(r["torch_tflops"] > 0 for r in out["rows"]):
        raise BenchError(f"self-test failed: rows {out['rows']}")
    print(f"{PROG}: self-test passed (3 shapes, torch {torch.__version__})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels-json", metavar="PATH", help="bench-kernels --json with its bf16 gemm section")
    p.add_argument("--json", metavar="PATH", help="write the comparison as JSON")
    p.add_argument("--trials", type=int, help="trials a shape (default: bench-kernels')")
    p.add_argument("--operand-sets", type=int, help="operand sets rotated (default: bench-kernels' for each shape)")
    p.add_argument("--self-test", action="store_true", help="check this script on the CPU and exit")
    ns = p.parse_args(argv)
    try:
        if ns.self_test:
            return self_test()
        if not ns.kernels_json:
            raise BenchError("--kernels-json PATH is required (bench-kernels --json)")
        if ns.trials is not None and ns.trials < 1:
            raise BenchError(f"--trials {ns.trials}: at least 1")
        if ns.operand_sets is not None and ns.operand_sets < 1:
            raise BenchError(f"--operand-sets {ns.operand_sets}: at least 1")
        shapes, options = read_shapes(ns.kernels_json)
        out = compare(shapes, options, "cuda", ns.trials, ns.operand_sets)
        k = tl.read_json(ns.kernels_json, "--kernels-json")
        d = k.get("device") if isinstance(k.get("device"), dict) else {}
        note = f"bench-kernels at {k.get('commit', '?')} on {d.get('name', '?')}, cuBLASLt {d.get('cublaslt', '?')}"
        report(out, note)
        if ns.json:
            tl.write_json(ns.json, out)
        return 0
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
