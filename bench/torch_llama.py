#!/usr/bin/env python3
"""torch_llama: the PyTorch side of tessera's throughput comparison, the strongest fair baseline.

Trains a Llama 3 model written here in plain PyTorch on synthetic tokens and reports
tokens/s, the step time, MFU by torchtitan's formula and the peak of allocated device
memory, on the same flavor, batch, sequence length and activation checkpointing as
tessera's own benchmark: in PyTorch eager mode (kept as a reference row) and under
torch.compile in each of --compile-modes, the best compile mode marked. With
--tessera-json it reads tessera's figure for the same run and prints the ratios.

The model mirrors tessera's nn::Transformer and the flavors of
include/tessera/layer/args.hpp: token embedding, pre-norm blocks (RMSNorm, attention with
rotary embeddings and grouped-query heads, RMSNorm, SwiGLU feed-forward), a final RMSNorm
and the output head (the token embedding itself where the flavor ties them), then the
cross-entropy loss.

What the PyTorch side runs: what a PyTorch user would take for this model on one GPU.

- Attention (--attention, default auto): FlashAttention-3 (`flash_attn_interface`) where
  it is importable and runs; else SDPA's cuDNN backend
  (`sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`) where a probe of the run's own shapes
  (batch, sequence, query and key/value heads, head dim, bf16; forward and backward, the
  grouped key/value heads passed as the model passes them) runs; else SDPA's flash backend
  (FlashAttention-2). The record says which ran and why each other one was not taken. The
  CPU runs SDPA's math backend.
- torch.compile of the model and of the loss (--compile-scope model: one graph from the
  embedding to the loss; block: each block and the loss head compiled alone, as
  torchtitan does), in each of --compile-modes (default: `default` and
  `max-autotune-no-cudagraphs`); each mode's figures are kept and the fastest is marked.
- The loss head (--loss, default auto): Liger's fused linear cross-entropy
  (`LigerFusedLinearCrossEntropyLoss`) where liger_kernel is importable; else the output
  projection and the cross-entropy over --loss-chunks chunks of tokens
  (ChunkedLinearCrossEntropy below: each chunk's logits, loss and gradients are computed
  in the forward and the logits freed before the next chunk, so one chunk's logits exist
  at a time; torch.compile traces it). `full` is the plain head: the whole batch's float32
  logits, then F.cross_entropy.
- AdamW fused (`torch.optim.AdamW(fused=True)`), tessera's defaults, gradient clipping
  to --max-norm by `torch.nn.utils.clip_grad_norm_`.
- Precision: float32 parameters, gradients and AdamW moments; the forward, and the
  recomputation under activation checkpointing, under torch.autocast(bfloat16), so GEMMs
  and attention run in bf16 and norms, RoPE and the loss in float32. This is torchtitan's
  mixed precision on one GPU up to its 0.2 releases (training.mixed_precision_param
  bfloat16 without FSDP: torch.autocast); torchtitan 0.3 instead wraps the model in
  FSDP2 on a one-rank mesh with MixedPrecisionPolicy(param bfloat16, reduce float32),
  bf16 copies of float32 parameters for compute (bench/torchtitan_train.py runs
  torchtitan itself).

Timing, the same on both sides (tessera's bench-train is to match it):

  1. --warmup untimed steps (compilation happens in the first), then
     torch.cuda.synchronize().
  2. An event E0 recorded on the current stream; then --steps steps, each enqueued and
     followed by an event E(i+1) recorded on the same stream after the step's last call
     (the optimizer's zero_grad). Nothing inside the timed steps waits for the device:
     the loss and the gradient norm of each step stay device tensors.
  3. torch.cuda.synchronize() after the last event. Step i's time is
     E(i).elapsed_time(E(i+1)): the device's time from the end of step i-1 to the end of
     step i, including any time it waited for the host to enqueue work. The step time is
     the median of the --steps times; tokens/s = batch x seq / median.
  4. Then, once, every step's loss and gradient norm are read to the host.

The peak memory is torch.cuda.max_memory_allocated() over the timed steps (the counter
reset after the warm-up), as bench-train reports its allocator's peak.

Run `python3 bench/torch_llama.py --help` for the options and bench/README.md for the
comparison it serves. `--self-test` checks the script on the CPU with torch (under half a
minute); `--self-test-no-torch` checks its pure-Python logic (options, the choice of
attention and loss head, tessera's result file, the record of what ran) without torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import io
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

PROG = "torch_llama"


class BenchError(Exception):
    """An error reported as one line, `torch_llama: <message>`, with exit status 1."""


# ---------------------------------------------------------------------------------------
# Model arguments and flavors: the same fields, defaults and derived sizes as
# tessera::nn::ModelArgs and nn::model_flavors() in include/tessera/layer/args.hpp.


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    enabled: bool = False
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    flavor: str = "debugmodel"
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int = 0  # 0: same as n_heads
    vocab_size: int = 260
    multiple_of: int = 256
    ffn_dim_multiplier: float = 0.0  # 0: none
    ffn_hidden: int = 0  # > 0: the SwiGLU hidden size as given
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    depth_init: bool = True

    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads > 0 else self.n_heads

    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def ffn_hidden_dim(self) -> int:
        # ModelArgs::ffn_hidden_dim(): 2/3 of 4*dim in integer arithmetic, scaled by the
        # multiplier and truncated, then rounded up to a multiple of multiple_of.
        if self.ffn_hidden > 0:
            return self.ffn_hidden
        hidden = (2 * (4 * self.dim)) // 3
        if self.ffn_dim_multiplier > 0:
            hidden = int(self.ffn_dim_multiplier * float(hidden))
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def num_params(self) -> int:
        hd, kv = self.head_dim(), self.kv_heads()
        attn = self.dim * self.n_heads * hd + 2 * self.dim * kv * hd + self.n_heads * hd * self.dim
        ffn = 3 * self.dim * self.ffn_hidden_dim()
        block = attn + ffn + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * block + self.dim + head

    def num_embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int, causal_halved: bool = False) -> float:
        # ModelArgs::flops_per_token: 6 x (all parameters - the token embedding) +
        # 12 L H hd T. With tied embeddings num_params() holds the shared matrix once and
        # it is subtracted as the embedding, so the output head's FLOPs are not counted,
        # exactly as tessera counts them.
        n = float(self.num_params() - self.num_embedding_params())
        attn = 12.0 * float(self.n_layers * self.n_heads * self.head_dim() * seq_len)
        return 6.0 * n + (attn / 2 if causal_halved else attn)


def _llama3(name, dim, layers, heads, multiple_of, ffn_mult, scaling, max_seq, tied=False):
    return ModelArgs(flavor=name, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=8, vocab_size=128256,
                     multiple_of=multiple_of, ffn_dim_multiplier=ffn_mult, rope_theta=500000.0,
                     rope_scaling=scaling, max_seq_len=max_seq, tie_embeddings=tied)


_LLAMA31 = RopeScaling(True, 8.0, 1.0, 4.0, 8192)
_LLAMA32 = RopeScaling(True, 32.0, 1.0, 4.0, 8192)

FLAVORS = {
    a.flavor: a
    for a in [
        ModelArgs(flavor="debugmodel", dim=256, n_layers=6, n_heads=16, vocab_size=260, rope_theta=500000.0,
                  max_seq_len=2048),
        ModelArgs(flavor="llama2_7b", dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256,
                  rope_theta=10000.0, max_seq_len=4096),
        ModelArgs(flavor="llama2_13b", dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256,
                  rope_theta=10000.0, max_seq_len=4096),
        ModelArgs(flavor="llama2_70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                  multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=10000.0, max_seq_len=4096),
        _llama3("llama3_8b", 4096, 32, 32, 1024, 1.3, RopeScaling(), 8192),
        _llama3("llama3_70b", 8192, 80, 64, 4096, 1.3, RopeScaling(), 8192),
        _llama3("llama3.1_8b", 4096, 32, 32, 1024, 1.3, _LLAMA31, 131072),
        _llama3("llama3.1_70b", 8192, 80, 64, 4096, 1.3, _LLAMA31, 131072),
        _llama3("llama3.1_405b", 16384, 126, 128, 4096, 1.2, _LLAMA31, 131072),
        _llama3("llama3.2_1b", 2048, 16, 32, 256, 1.5, _LLAMA32, 131072, tied=True),
        _llama3("llama3.2_3b", 3072, 28, 24, 256, 1.0, _LLAMA32, 131072, tied=True),
    ]
}

# Parameter counts of the published checkpoints (tests/nn/test_model.cpp checks the same).
PUBLISHED_PARAMS = {"llama3.2_1b": 1235814400, "llama3.2_3b": 3212749824, "llama3_8b": 8030261248}


def model_flavor(name: str) -> ModelArgs:
    if name not in FLAVORS:
        raise BenchError(f"unknown flavor '{name}' (known: {', '.join(FLAVORS)})")
    return FLAVORS[name]


# tessera's optimizer defaults (OptimizerSection in include/tessera/train/job_config.hpp) and
# its gradient clipping (TrainingSection::max_norm).
ADAMW_LR = 8e-4
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
ADAMW_WEIGHT_DECAY = 0.1
MAX_NORM = 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> list[float]:
    """The rotary frequencies, with Llama 3.1's scaling of the long wavelengths."""
    freqs = [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
    if not scaling.enabled:
        return freqs
    old_len = float(scaling.original_max_position)
    low_wavelen = old_len / scaling.low_freq_factor  # longer than this: divided by factor
    high_wavelen = old_len / scaling.high_freq_factor  # shorter than this: kept
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen > low_wavelen:
            f = f / scaling.factor
        elif wavelen >= high_wavelen:
            t = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
            f = (1 - t) * f / scaling.factor + t * f
        out.append(f)
    return out


# ---------------------------------------------------------------------------------------
# What runs, decided without torch: the attention backend from the probes' answers, the
# loss head, the compile modes, tessera's row, the ratios and the record of what ran.
# --self-test-no-torch checks all of it.

ATTENTION_CHOICES = ("auto", "cudnn", "flash", "fa3", "math")
AUTO_ATTENTION_ORDER = ("fa3", "cudnn", "flash")  # auto takes the first that runs
ATTENTION_CALLS = {
    "fa3": "flash_attn_interface.flash_attn_func(causal=True) (FlashAttention-3)",
    "cudnn": "F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)",
    "flash": "F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.FLASH_ATTENTION) (FlashAttention-2)",
    "math": "F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.MATH)",
}
GQA_TEXT = {"mha": "no grouped heads", "native": "grouped key/value heads passed as they are (enable_gqa)",
            "repeat": "key/value heads repeated to the query heads"}

LOSS_CHOICES = ("auto", "full", "chunked", "liger")
LIGER_MODULE = "liger_kernel.transformers.fused_linear_cross_entropy"
LOSS_CALLS = {
    "full": "output projection over all tokens, float32 logits, F.cross_entropy",
    "chunked": "ChunkedLinearCrossEntropy: projection and cross-entropy by chunks of tokens, each chunk's "
               "gradients computed in the forward and its logits freed before the next",
    "liger": f"{LIGER_MODULE}.LigerFusedLinearCrossEntropyLoss",
}

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")

PRECISION = ("float32 parameters, gradients and AdamW moments; forward and backward (and the recomputation "
             "under activation checkpointing) under torch.autocast(bfloat16): torchtitan's mixed precision on "
             "one GPU up to 0.2 (mixed_precision_param bfloat16 without FSDP); torchtitan 0.3 uses FSDP2's "
             "MixedPrecisionPolicy(param bfloat16, reduce float32) on a one-rank mesh instead")

TIMING_METHOD = ("CUDA events on the current stream at step boundaries: E0 after the warm-up's "
                 "torch.cuda.synchronize(), E(i+1) after step i's last call; no host synchronisation inside the "
                 "timed steps (losses and gradient norms read once after the last event); step time "
                 "E(i).elapsed_time(E(i+1)); median of the timed steps")
TIMING_METHOD_CPU = "time.perf_counter() around each step (the CPU runs check the script; no figures)"


def choose_attention(requested: str, device: str, probe) -> dict:
    """The attention backend this run uses. `probe(name)` returns (gqa_form, why): the form
    ("mha", "native" or "repeat") in which backend `name` ran a forward and backward of
    the run's own shapes, or (None, the reason it did not); it is asked about "math" only
    for the form to use. auto takes fa3, then cudnn, then flash, the first that runs; on
    the CPU, math. The answer names the backend, the call, the GQA form, why it was taken
    and why each other backend was not."""
    if requested not in ATTENTION_CHOICES:
        raise BenchError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got {requested!r}")
    others = [b for b in ATTENTION_CALLS]

    def answer(backend, form, why, not_taken):
        return {"backend": backend, "call": ATTENTION_CALLS[backend], "gqa": form, "why": why,
                "not_taken": {b: not_taken[b] for b in others if b != backend}}

    if device != "cuda":
        if requested not in ("auto", "math"):
            raise BenchError(f"--attention {requested} runs on CUDA only; the CPU runs SDPA's math backend "
                             "(--attention auto or math)")
        form, _ = probe("math")
        return answer("math", form, "the CPU run: SDPA's math backend",
                      {b: "a CUDA backend; this is a CPU run" for b in others})
    if requested == "math":
        form, _ = probe("math")
        return answer("math", form, "asked for (--attention math)",
                      {b: "not asked for (--attention math)" for b in others})
    if requested != "auto":
        form, why = probe(requested)
        if form is None:
            raise BenchError(f"--attention {requested}: {why}")
        return answer(requested, form, f"asked for (--attention {requested}) and its probe ran",
                      {b: f"not asked for (--attention {requested})" for b in others})
    not_taken = {"math": "auto takes a fused backend; math is taken only when asked for"}
    for i, backend in enumerate(AUTO_ATTENTION_ORDER):
        form, why = probe(backend)
        if form is not None:
            for later in AUTO_ATTENTION_ORDER[i + 1:]:
                not_taken[later] = f"not tried: auto takes {backend} before it"
            taken = "the first of auto's order (fa3, cudnn, flash) whose probe of this run's shapes ran"
            return answer(backend, form, taken, not_taken)
        not_taken[backend] = why
    raise BenchError("--attention auto: no fused attention backend runs this model's attention: "
                     + "; ".join(f"{b}: {not_taken[b]}" for b in AUTO_ATTENTION_ORDER))


def choose_loss(requested: str, device: str, liger_error: str | None) -> dict:
    """The loss head: `liger_error` is None where liger_kernel's fused linear cross-entropy
    is importable, else why not. auto takes liger where importable on CUDA, else chunked."""
    if requested not in LOSS_CHOICES:
        raise BenchError(f"--loss must be one of {', '.join(LOSS_CHOICES)}, got {requested!r}")
    if requested == "liger" or requested == "auto":
        if device != "cuda":
            if requested == "liger":
                raise BenchError("--loss liger runs Liger's Triton kernels: CUDA only (the CPU takes --loss chunked)")
            return {"head": "chunked", "call": LOSS_CALLS["chunked"],
                    "why": "auto on the CPU: Liger's kernels are CUDA only"}
        if liger_error is not None:
            if requested == "liger":
                raise BenchError(f"--loss liger: {LIGER_MODULE} is not importable ({liger_error}); install "
                                 "liger-kernel (or carry its wheel to the device) or take --loss chunked")
            return {"head": "chunked", "call": LOSS_CALLS["chunked"],
                    "why": f"auto: {LIGER_MODULE} is not importable ({liger_error})"}
        return {"head": "liger", "call": LOSS_CALLS["liger"],
                "why": "asked for (--loss liger)" if requested == "liger" else "auto: liger_kernel is importable"}
    return {"head": requested, "call": LOSS_CALLS[requested], "why": f"asked for (--loss {requested})"}


def parse_compile_modes(text: str) -> list[str]:
    """--compile-modes: a comma-separated list of torch.compile modes, each once."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise BenchError("--compile-modes is empty; give one or more of " + ", ".join(COMPILE_MODES))
    for m in modes:
        if m not in COMPILE_MODES:
            raise BenchError(f"--compile-modes: unknown mode {m!r} (known: {', '.join(COMPILE_MODES)})")
    if len(set(modes)) != len(modes):
        raise BenchError(f"--compile-modes names a mode twice: {text!r}")
    return modes


def run_modes(mode: str, compile_modes: list[str]) -> list[str]:
    """The rows to run, in order: "eager" and "compile:<mode>" for each compile mode."""
    rows = ["eager"] if mode in ("eager", "both") else []
    if mode in ("compile", "both"):
        rows += [f"compile:{m}" for m in compile_modes]
    return rows


def mark_best(results: list[dict]) -> str | None:
    """Marks the compile row with the most tokens/s ("best": true) and returns its mode."""
    compiled = [r for r in results if r["mode"].startswith("compile:")]
    for r in results:
        r["best"] = False
    if not compiled:
        return None
    best = max(compiled, key=lambda r: r["tokens_per_sec"])
    best["best"] = True
    return best["mode"]


def read_json(path: str, option: str):
    """The JSON document at `path`, given as `option`; a BenchError naming both if it
    cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise BenchError(f"{option} {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise BenchError(f"{option} {path}: not JSON (line {e.lineno}: {e.msg})") from None


def write_json(path: str, obj, option: str = "--json") -> None:
    """`obj` as indented JSON at `path`, given as `option`; a BenchError naming both if
    it cannot be written."""
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise BenchError(f"{option} {path}: {e.strerror}") from None


# The fields of tessera's row that must equal this run's, with the names they go by
# (bench-train's --json: flavor, batch, seq_len, activation_checkpoint).
_TESSERA_KEYS = {"flavor": ("flavor",), "batch": ("batch", "local_batch_size"), "seq": ("seq", "seq_len"),
                 "ac": ("activation_checkpoint", "ac")}
# What tessera's row says it ran, carried into this script's record when present.
_TESSERA_RAN = ("path", "commit", "date", "device", "attention", "activation_checkpoint", "state_dtype",
                "precision", "timing", "step_seconds", "mfu_pct", "mfu_causal_pct", "peak_memory_bytes")


def _tessera_mismatch(row: dict, want: dict) -> str | None:
    for key, names in _TESSERA_KEYS.items():
        for name in names:
            if name in row and row[name] != want[key]:
                return f"{name} is {row[name]!r}, this run has {key} {want[key]!r}"
    return None


def read_tessera(paths, flavor: str, batch: int, seq: int, ac: str = "none") -> dict:
    """tessera's result for this run, from one or more files (`paths`: a path or a list).
    Each file holds a JSON object with tokens_per_sec (a positive number) or a list of
    them (bench-train's --json, one per flavor; run.sh train writes 1B and 3B to
    train.json and 8B to train8b.json). The row taken is the first whose flavor is this
    run's and whose batch (or local_batch_size), seq (or seq_len) and
    activation_checkpoint (or ac), where present, equal this run's; a row of this flavor
    that differs is refused naming the field, and a row that did not run (its "error")
    is refused with its reason."""
    if isinstance(paths, str):
        paths = [paths]
    want = {"flavor": flavor, "batch": batch, "seq": seq, "ac": ac}
    mismatches, errors = [], []
    for path in paths:
        data = read_json(path, "--tessera-json")
        rows = data if isinstance(data, list) else [data]
        for row in rows:
            if not isinstance(row, dict):
                raise BenchError(f"--tessera-json {path}: expected a JSON object (or a list of them) with "
                                 "tokens_per_sec")
            if row.get("flavor", flavor) != flavor and isinstance(data, list):
                continue
            bad = _tessera_mismatch(row, want)
            if bad:
                mismatches.append(f"--tessera-json {path}: {bad}")
                continue
            if "error" in row:
                errors.append(f"--tessera-json {path}: flavor {flavor!r} did not run: {row['error']}")
                continue
            tps = row.get("tokens_per_sec")
            if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not tps > 0:
                raise BenchError(f"--tessera-json {path}: tokens_per_sec must be a positive number, got {tps!r}")
            out = {"file": path, "tokens_per_sec": float(tps), "mfu": row.get("mfu")}
            out.update({k: row[k] for k in _TESSERA_RAN if k in row})
            out.setdefault("path", path)
            return out
    if errors:
        raise BenchError(errors[0])
    if mismatches:
        raise BenchError(mismatches[0])
    raise BenchError(f"--tessera-json {', '.join(paths)}: no entry for flavor {flavor!r}")


def ratios(tessera: dict, results: list[dict]) -> dict:
    """tessera's tokens/s over each row's, and over the best compile row's as
    "tessera/compile"."""
    out = {f"tessera/{r['mode']}": tessera["tokens_per_sec"] / r["tokens_per_sec"] for r in results}
    best = [r for r in results if r.get("best")]
    if best:
        out["tessera/compile"] = tessera["tokens_per_sec"] / best[0]["tokens_per_sec"]
    return out


def what_ran(*, attention: dict, loss: dict, compile_scope: str, compile_modes: list[str], best: str | None,
             ac: str, optimizer: str, max_norm: float, device: str, versions: dict, tessera: dict | None) -> dict:
    """The record of what each side ran, for the output and the JSON."""
    torch_side = {
        "attention": attention,
        "compile": {"scope": compile_scope, "modes": compile_modes, "best": best,
                    "what": "torch.compile of the model and its loss head"
                            + (" as one graph" if compile_scope == "model" else ": each block, and the loss head, alone")},
        "loss_head": loss,
        "precision": PRECISION,
        "activation_checkpointing": ac,
        "optimizer": {"name": "AdamW", "implementation": optimizer, "lr": ADAMW_LR, "betas": list(ADAMW_BETAS),
                      "eps": ADAMW_EPS, "weight_decay": ADAMW_WEIGHT_DECAY, "max_norm": max_norm},
        "timing": TIMING_METHOD if device == "cuda" else TIMING_METHOD_CPU,
        "versions": versions,
    }
    tessera_side = None
    if tessera is not None:
        tessera_side = {k: tessera.get(k) for k in ("path", "file", "commit", "attention", "activation_checkpoint",
                                                     "state_dtype", "precision", "timing")}
        if not tessera_side.get("timing"):
            tessera_side["timing"] = "as its own file states (bench/train_gpu.cpp's header gives the method)"
    return {"torch": torch_side, "tessera": tessera_side}


def describe(ran: dict) -> list[str]:
    """The record of what ran, as lines for the output."""
    t = ran["torch"]
    at, lo, co = t["attention"], t["loss_head"], t["compile"]
    skipped = "; ".join(f"{b}: {why}" for b, why in at["not_taken"].items())
    v = t["versions"]
    lines = [
        f"torch side: attention {at['backend']} ({at['call']}; {GQA_TEXT.get(at['gqa'], at['gqa'])}; {at['why']}; "
        f"not taken: {skipped})",
        f"torch side: loss head {lo['head']} ({lo['call']}"
        + (f", {lo['chunks']} chunks" if lo.get("chunks") else "") + f"; {lo['why']})",
        f"torch side: {co['what']} (scope {co['scope']}), modes {', '.join(co['modes']) or 'none'}"
        + (f", best {co['best']}" if co.get("best") else ""),
        f"torch side: precision {t['precision']}",
        f"torch side: AC {t['activation_checkpointing']}; AdamW {t['optimizer']['implementation']}; "
        f"timing {t['timing']}",
        "torch side: versions " + ", ".join(f"{k} {val}" for k, val in v.items()),
    ]
    ts = ran.get("tessera")
    if ts:
        lines.append(f"tessera side: {ts.get('path') or '-'} (commit {ts.get('commit') or '-'}): attention "
                     f"{ts.get('attention') or '-'}; AC {ts.get('activation_checkpoint') or '-'}; AdamW moments "
                     f"{ts.get('state_dtype') or '-'}; timing {ts.get('timing')}")
    return lines


def within_budget(started: float, now: float, budget: float | None) -> bool:
    """Whether a row may still start: --time-budget seconds since the script started."""
    return budget is None or now - started < budget


# ---------------------------------------------------------------------------------------
# The model. Everything below needs torch; it is imported by main() so that a missing
# torch is one clear line.

torch = None
nn = None
F = None


def set_allocator_conf(device: str) -> str:
    """The CUDA caching allocator's settings. Where the environment sets none, CUDA runs
    get expandable segments (as torchtitan's launch script sets them): large models
    then do not fail on fragmentation. Must run before torch initialises CUDA."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if name in os.environ:
            return f"{name}={os.environ[name]} (from the environment)"
    if device != "cuda":
        return ""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by this script)"


def _import_torch():
    global torch, nn, F
    try:
        import torch as _torch
        import torch.nn as _nn
        import torch.nn.functional as _F
    except ImportError as e:
        raise BenchError(f"PyTorch is not importable ({e}); install it with `pip install torch`") from None
    torch, nn, F = _torch, _nn, _F


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def import_error(module: str) -> str | None:
    """None where `module` imports, else why not (one line)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a broken install is as good as none here
        return f"{type(e).__name__}: {_first_line(e)}"
    return None


def _fa3():
    import flash_attn_interface

    return flash_attn_interface.flash_attn_func


def _liger_loss():
    return importlib.import_module(LIGER_MODULE).LigerFusedLinearCrossEntropyLoss()


_CHUNKED_CE = None


def chunked_cross_entropy():
    """ChunkedLinearCrossEntropy.apply(h, weight, targets, chunks, compute_dtype): the mean
    cross-entropy of h @ weight^T (h: (tokens, dim), weight: (vocab, dim), targets:
    (tokens,)), the tokens taken `chunks` at a time. The forward computes each chunk's
    logits in `compute_dtype` (None: as given), its loss in float32 and at once its
    gradients with respect to h and weight, then lets the chunk's logits go: one chunk's
    logits exist at a time, and nothing but the two gradients is kept for the backward,
    which scales them by the incoming gradient. The same arithmetic as the full head
    (bf16 logits upcast to float32, the softmax's gradient cast back to bf16 for the two
    GEMMs), with the weight's gradient summed over chunks in float32. A plain Python loop
    of torch operations: torch.compile traces it whole (the self-test checks fullgraph)."""
    global _CHUNKED_CE
    if _CHUNKED_CE is not None:
        return _CHUNKED_CE
    # torch.addmm(..., out_dtype=torch.float32) (CUDA, torch 2.8 on) accumulates the bf16
    # weight gradient of each chunk into the float32 sum in the GEMM itself.
    # Under torch.compile the plain sum is left to the compiler, which fuses it.
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2] if x.isdigit())
    addmm_out_dtype = version >= (2, 8)
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, weight, targets, chunks, compute_dtype):
            n = h.shape[0]
            cdt = h.dtype if compute_dtype is None else compute_dtype
            # The casts are this function's own: autocast would also cast the float32 sum.
            with torch.autocast(device_type=h.device.type, enabled=False):
                w = weight.to(cdt)
                grad_h = torch.empty_like(h)
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                total = torch.zeros((), dtype=torch.float32, device=h.device)
                size = (n + chunks - 1) // chunks
                for start in range(0, n, size):
                    hc = h[start:start + size].to(cdt)
                    tc = targets[start:start + size].unsqueeze(1)
                    logits = (hc @ w.t()).float()  # (chunk, vocab)
                    lse = torch.logsumexp(logits, dim=1, keepdim=True)
                    total = total + (lse - logits.gather(1, tc)).sum()
                    # d(mean loss)/d(logits) = (softmax - onehot(target)) / n
                    g = torch.exp(logits - lse)
                    g = g.scatter_add(1, tc, torch.full(tc.shape, -1.0, dtype=g.dtype, device=g.device))
                    g = (g * (1.0 / n)).to(cdt)
                    del logits, lse
                    grad_h[start:start + size] = (g @ w).to(h.dtype)
                    if cdt == torch.float32:
                        grad_w = torch.addmm(grad_w, g.t(), hc)
                    elif addmm_out_dtype and h.is_cuda and not compiling():
                        grad_w = torch.addmm(grad_w, g.t(), hc, out_dtype=torch.float32)
                    else:
                        grad_w = grad_w + (g.t() @ hc).float()
                    del g
            ctx.save_for_backward(grad_h, grad_w)
            ctx.weight_dtype = weight.dtype
            return total / n

        @staticmethod
        def backward(ctx, grad_out):
            grad_h, grad_w = ctx.saved_tensors
            return grad_h * grad_out, (grad_w * grad_out).to(ctx.weight_dtype), None, None, None

    _CHUNKED_CE = ChunkedLinearCrossEntropy
    return _CHUNKED_CE


def _define_model():
    """Defines the model classes once torch is imported; returns the Transformer class."""

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            # Normalised in float32 whatever the input type; the result has the input's type.
            if hasattr(F, "rms_norm"):
                return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight.float()).to(x.dtype)

    def rotate(x, cos, sin):
        """Rotary embedding of x (batch, seq, heads, head_dim): the pair (i, i + hd/2) of
        each head turned by position x frequency i (tessera's ops::RopeRotate layout)."""
        half = x.shape[-1] // 2
        xf = x.float()
        a, b = xf[..., :half], xf[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)

    class Attention(nn.Module):
        def __init__(self, args: ModelArgs, native_gqa: bool = True, backend: str = "sdpa"):
            super().__init__()
            self.n_heads, self.n_kv, self.hd = args.n_heads, args.kv_heads(), args.head_dim()
            self.wq = nn.Linear(args.dim, self.n_heads * self.hd, bias=False)
            self.wk = nn.Linear(args.dim, self.n_kv * self.hd, bias=False)
            self.wv = nn.Linear(args.dim, self.n_kv * self.hd, bias=False)
            self.wo = nn.Linear(self.n_heads * self.hd, args.dim, bias=False)
            self.native_gqa = native_gqa  # False: key/value heads repeated before SDPA
            # "sdpa" (the backend chosen by the step's sdpa_kernel) or "fa3": FlashAttention-3's function.
            self.fa3 = _fa3() if backend == "fa3" else None

        def forward(self, x, cos, sin):
            bsz, seq, _ = x.shape
            q = rotate(self.wq(x).view(bsz, seq, self.n_heads, self.hd), cos, sin)
            k = rotate(self.wk(x).view(bsz, seq, self.n_kv, self.hd), cos, sin)
            v = self.wv(x).view(bsz, seq, self.n_kv, self.hd)
            if self.fa3 is not None:
                # FlashAttention-3 takes (batch, seq, heads, head_dim) and fewer key/value heads.
                o = self.fa3(q, k, v, causal=True)
                o = o[0] if isinstance(o, tuple) else o
                return self.wo(o.reshape(bsz, seq, self.n_heads * self.hd))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads, seq, hd)
            if self.n_kv == self.n_heads:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif self.native_gqa:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                rep = self.n_heads // self.n_kv  # query head h reads key/value head h // rep
                o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                                   is_causal=True)
            return self.wo(o.transpose(1, 2).reshape(bsz, seq, self.n_heads * self.hd))

    class FeedForward(nn.Module):
        def __init__(self, args: ModelArgs):
            super().__init__()
            hidden = args.ffn_hidden_dim()
            self.w1 = nn.Linear(args.dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, args.dim, bias=False)
            self.w3 = nn.Linear(args.dim, hidden, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, args: ModelArgs, layer_id: int, native_gqa: bool, backend: str):
            super().__init__()
            self.layer_id = layer_id
            self.attention_norm = RMSNorm(args.dim, args.norm_eps)
            self.attention = Attention(args, native_gqa, backend)
            self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
            self.feed_forward = FeedForward(args)

        def forward(self, x, cos, sin):
            h = x + self.attention(self.attention_norm(x), cos, sin)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        """`loss`: the loss head, "full", "chunked" (`loss_chunks` chunks, the logits in
        `loss_dtype`: the step's autocast dtype, None for float32 runs) or "liger";
        `attention`: "sdpa" or "fa3"."""

        def __init__(self, args: ModelArgs, seq_len: int, ac: str = "none", gqa: str = "native",
                     attention: str = "sdpa", loss: str = "full", loss_chunks: int = 8, loss_dtype=None):
            super().__init__()
            self.args, self.ac = args, ac
            self.loss, self.loss_chunks, self.loss_dtype = loss, loss_chunks, loss_dtype
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(Block(args, i, gqa != "repeat", attention) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps)
            # Tied flavors read the embedding matrix as the output head: no second matrix.
            self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
            device = self.tok_embeddings.weight.device
            self.register_buffer("rope_cos", torch.empty(seq_len, args.head_dim() // 2, device=device), persistent=False)
            self.register_buffer("rope_sin", torch.empty(seq_len, args.head_dim() // 2, device=device), persistent=False)
            self.liger = _liger_loss() if loss == "liger" else None

        def init_weights(self):
            """tessera's initialisation (torchtitan's): trunc-normal 0.02 inputs, depth-scaled
            output projections, N(0, 1) embedding (trunc-normal 0.02 when tied), a
            dim^-1/2 output head, unit norm weights; and the rotary tables."""
            a = self.args
            with torch.no_grad():
                inv = torch.tensor(rope_inv_freq(a.head_dim(), a.rope_theta, a.rope_scaling), dtype=torch.float64)
                pos = torch.arange(self.rope_cos.shape[0], dtype=torch.float64)
                angle = torch.outer(pos, inv)
                self.rope_cos.copy_(torch.cos(angle).float())
                self.rope_sin.copy_(torch.sin(angle).float())
                if a.tie_embeddings:
                    nn.init.trunc_normal_(self.tok_embeddings.weight, std=0.02)
                else:
                    nn.init.normal_(self.tok_embeddings.weight, std=1.0)
                for layer in self.layers:
                    depth = 2.0 * (layer.layer_id + 1) if a.depth_init else 2.0 * a.n_layers
                    out_std = 0.02 / math.sqrt(depth)
                    at, ff = layer.attention, layer.feed_forward
                    for w in (at.wq.weight, at.wk.weight, at.wv.weight, ff.w1.weight):
                        nn.init.trunc_normal_(w, std=0.02)
                    for w in (at.wo.weight, ff.w2.weight, ff.w3.weight):
                        nn.init.trunc_normal_(w, std=out_std)
                    layer.attention_norm.weight.fill_(1.0)
                    layer.ffn_norm.weight.fill_(1.0)
                self.norm.weight.fill_(1.0)
                if self.output is not None:
                    std = a.dim ** -0.5
                    nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

        def trunk(self, tokens):
            seq = tokens.shape[1]
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                if self.ac == "full":
                    h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False)
                else:
                    h = layer(h, cos, sin)
            return h

        def head_loss(self, h, targets):
            """The final norm, the output head and the mean cross-entropy."""
            h = self.norm(h).flatten(0, 1)
            t = targets.flatten(0, 1)
            head = self.output.weight if self.output is not None else self.tok_embeddings.weight
            if self.loss == "chunked":
                return chunked_cross_entropy().apply(h, head, t, self.loss_chunks, self.loss_dtype)
            if self.loss == "liger":
                return self.liger(head, h, t)
            return F.cross_entropy(F.linear(h, head).float(), t)

        def forward(self, tokens, targets):
            # Compile scope "block" puts a compiled head_loss on the instance.
            return self.head_loss(self.trunk(tokens), targets)

    Transformer.FeedForward = FeedForward  # SwiGLU as torchtitan writes it: torchtitan_eager.py's too
    return Transformer


_TRANSFORMER = None


def transformer_class():
    global _TRANSFORMER
    if _TRANSFORMER is None:
        _TRANSFORMER = _define_model()
    return _TRANSFORMER


def _sdpa_has_gqa() -> bool:
    """Whether this torch's SDPA takes enable_gqa (2.5 on): tried on tiny CPU tensors."""
    q, kv = torch.zeros(1, 2, 1, 2), torch.zeros(1, 1, 1, 2)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    attr = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "math": "MATH"}[name]
    return getattr(SDPBackend, attr, None)


def attention_context(backend: str):
    """What each step runs inside: sdpa_kernel(the chosen SDPA backend), or nothing for
    FlashAttention-3. It covers the backward too: full AC recomputes each block's
    forward there, and the recomputation must pick the same kernel."""
    if backend == "fa3":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(_sdpa_backend(backend))


def make_probe(args: ModelArgs, batch: int, seq: int, device: str):
    """The probe choose_attention() asks: a forward and backward of the run's own
    attention (batch x heads x seq x head_dim in bf16, causal) under each backend, with
    the grouped key/value heads passed as they are (enable_gqa; FlashAttention-3 takes
    them so) and, where a backend refuses that, repeated. Answers (form, why)."""
    h, kv, hd = args.n_heads, args.kv_heads(), args.head_dim()
    shape = f"batch {batch}, seq {seq}, {h} query / {kv} key-value heads x {hd}, bf16"

    def native_or_repeat():
        if kv == h:
            return "mha"
        return "native" if _sdpa_has_gqa() else "repeat"

    def probe(backend: str):
        if backend == "math":
            return native_or_repeat(), ""
        if device != "cuda":
            return None, "a CUDA backend"
        if backend == "fa3":
            err = import_error("flash_attn_interface")
            if err is not None:
                return None, f"flash_attn_interface is not importable ({err})"
        elif _sdpa_backend(backend) is None:
            return None, f"this torch ({torch.__version__}) has no SDPBackend for {backend}"
        errors = []
        forms = ["mha"] if kv == h else (["native"] if backend == "fa3" else ["native", "repeat"])
        if "native" in forms and backend != "fa3" and not _sdpa_has_gqa():
            forms.remove("native")
            errors.append("native: this torch's SDPA has no enable_gqa")
        for form in forms:
            try:
                q = torch.randn(batch, seq, h, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(batch, seq, kv, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(batch, seq, kv, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                if backend == "fa3":
                    o = _fa3()(q, k, v, causal=True)
                    o = o[0] if isinstance(o, tuple) else o
                else:
                    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                    with attention_context(backend):
                        if form == "native":
                            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
                        elif form == "repeat":
                            o = F.scaled_dot_product_attention(qt, kt.repeat_interleave(h // kv, dim=1),
                                                               vt.repeat_interleave(h // kv, dim=1), is_causal=True)
                        else:
                            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                        o.float().sum().backward()
                if backend == "fa3":
                    o.float().sum().backward()
                torch.cuda.synchronize()
                return form, ""
            except Exception as e:  # noqa: BLE001 - a refusal is the answer; anything else is too
                errors.append(f"{form}: {_first_line(e)}")
            finally:
                q = k = v = o = None
                torch.cuda.empty_cache()
        return None, f"its forward and backward on {shape} failed ({'; '.join(errors)})"

    return probe


def count_params_on_meta(args: ModelArgs) -> int:
    """The parameters of the model as built here, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = transformer_class()(args, seq_len=1)
    return sum(p.numel() for p in model.parameters())


def versions() -> dict:
    """torch's version and those of the libraries the torch side may run."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover - Python 3.7
        return out
    for label, dists in (("triton", ("triton",)), ("liger_kernel", ("liger-kernel", "liger_kernel")),
                         ("flash_attn_3", ("flash-attn-3", "flash_attn_3", "flash_attn_interface"))):
        for d in dists:
            try:
                out[label] = metadata.version(d)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


# ---------------------------------------------------------------------------------------
# One row's run.


@dataclasses.dataclass
class Options:
    flavor: str
    batch: int
    seq: int
    steps: int
    warmup: int
    ac: str
    device: str
    peak_tflops: float
    seed: int
    compile_scope: str
    max_norm: float
    gqa: str = "native"  # the attention probe's answer
    attention: str = "math"  # the backend choose_attention() took: fa3, cudnn, flash or math
    loss: str = "full"  # the loss head choose_loss() took: full, chunked or liger
    loss_chunks: int = 8
    allocator: str = ""  # the CUDA caching allocator's settings, as the environment gives them


def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    while e is not None:
        text = str(e).lower()
        if (oom is not None and isinstance(e, oom)) or "out of memory" in text or "can't allocate memory" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def make_optimizer(model, device: str):
    """AdamW with tessera's defaults: fused where this torch has it for the device, else
    torch's default choice (foreach on CUDA). Returns (optimizer, implementation name)."""
    params = list(model.parameters())
    kw = dict(lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=ADAMW_WEIGHT_DECAY)
    try:
        return torch.optim.AdamW(params, fused=True, **kw), "fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, **kw), "default"


def build_model(opts: Options, args: ModelArgs):
    """A fresh model on the run's device, initialised from the run's seed."""
    torch.manual_seed(opts.seed)
    with torch.device(opts.device):
        model = transformer_class()(args, seq_len=opts.seq, ac=opts.ac, gqa=opts.gqa,
                                    attention="fa3" if opts.attention == "fa3" else "sdpa", loss=opts.loss,
                                    loss_chunks=opts.loss_chunks, loss_dtype=torch.bfloat16)
    model.init_weights()
    return model


def run_mode(opts: Options, args: ModelArgs, mode: str) -> dict:
    """Builds a fresh model (same seed), trains warmup + steps on one fixed batch of
    random tokens and returns the figures. `mode`: "eager" or "compile:<mode>". Raises
    on out of memory (see _is_oom)."""
    dev = torch.device(opts.device)
    cuda = opts.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(opts, args)
    gen = torch.Generator(device=dev).manual_seed(opts.seed + 1)
    data = torch.randint(0, args.vocab_size, (opts.batch, opts.seq + 1), device=dev, generator=gen)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    optimizer, opt_impl = make_optimizer(model, opts.device)
    params = list(model.parameters())

    forward = model
    if mode.startswith("compile:"):
        cmode = mode.split(":", 1)[1]
        kw = {} if cmode == "default" else {"mode": cmode}
        torch._dynamo.reset()  # each mode compiles afresh
        if opts.compile_scope == "block":
            for layer in model.layers:
                layer.compile(**kw)
            model.head_loss = torch.compile(model.head_loss, **kw)
        else:
            forward = torch.compile(model, **kw)

    def step():
        with attention_context(opts.attention):
            with torch.autocast(device_type=opts.device, dtype=torch.bfloat16):
                loss = forward(tokens, targets)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, opts.max_norm) if opts.max_norm > 0 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm

    losses, norms = [], []

    def keep(out):
        losses.append(out[0])
        if out[1] is not None:
            norms.append(out[1])

    warm_start = time.perf_counter()
    first_step_seconds = None
    for i in range(opts.warmup):
        keep(step())
        if i == 0:
            if cuda:
                torch.cuda.synchronize()
            first_step_seconds = time.perf_counter() - warm_start
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup_seconds = time.perf_counter() - warm_start

    times = []
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(opts.steps + 1)]
        events[0].record()
        for i in range(opts.steps):
            keep(step())
            events[i + 1].record()
        torch.cuda.synchronize()
        times = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(opts.steps)]
    else:
        for _ in range(opts.steps):
            t0 = time.perf_counter()
            keep(step())
            times.append(time.perf_counter() - t0)

    # The one read of the losses and gradient norms, after the last event.
    loss_values = torch.stack(losses).float().cpu().tolist()
    norm_values = torch.stack(norms).float().cpu().tolist() if norms else []
    step_seconds = statistics.median(times)
    tokens_per_sec = opts.batch * opts.seq / step_seconds
    result = {
        "mode": mode,
        "tokens_per_sec": tokens_per_sec,
        "step_seconds": step_seconds,
        "step_seconds_all": times,
        "warmup_seconds": warmup_seconds,
        "first_step_seconds": first_step_seconds,
        "losses": loss_values,
        "grad_norms": norm_values,
        "optimizer": opt_impl,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
    }
    if cuda:
        fpt = args.flops_per_token(opts.seq)
        fpt_half = args.flops_per_token(opts.seq, causal_halved=True)
        result["mfu"] = tokens_per_sec * fpt / (opts.peak_tflops * 1e12)
        result["mfu_causal_halved"] = tokens_per_sec * fpt_half / (opts.peak_tflops * 1e12)
    else:
        result["mfu"] = result["mfu_causal_halved"] = None
    del model, optimizer, forward, params
    return result


# ---------------------------------------------------------------------------------------
# Output.


def device_name(device: str) -> str:
    if device == "cuda":
        i = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(i)
        return f"{torch.cuda.get_device_name(i)} (cuda:{i}, {p.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda})"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {name} ({os.cpu_count()} hardware threads, {torch.get_num_threads()} torch threads)"


def gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def mode_line(r: dict, steps: int) -> str:
    losses = r["losses"]
    best = "  best" if r.get("best") else ""
    return (f"{r['mode']:<36} {r['tokens_per_sec']:>10.0f} tokens/s  step {r['step_seconds']:.4f} s (median of {steps})"
            f"  MFU {pct(r['mfu'])} (causal-halved {pct(r['mfu_causal_halved'])})"
            f"  peak memory {gib(r['peak_memory_bytes'])}  loss {losses[0]:.3f} -> {losses[-1]:.3f}"
            f"  [AdamW {r['optimizer']}; warm-up {r['warmup_seconds']:.1f} s]{best}")


def run(opts: Options, modes: list[str], json_path: str | None, tessera_paths, *, attention: str = "auto",
        loss: str = "auto", compile_modes: list[str] | None = None, time_budget: float | None = None,
        started: float | None = None, argv: list[str] | None = None) -> int:
    started = time.monotonic() if started is None else started
    compile_modes = list(compile_modes or [m.split(":", 1)[1] for m in modes if m.startswith("compile:")])
    args = model_flavor(opts.flavor)
    if opts.seq > args.max_seq_len:
        raise BenchError(f"seq {opts.seq} exceeds {opts.flavor}'s max_seq_len {args.max_seq_len}")
    if not 1 <= opts.loss_chunks <= opts.batch * opts.seq:
        raise BenchError(f"--loss-chunks must be between 1 and batch x seq ({opts.batch * opts.seq}), "
                         f"got {opts.loss_chunks}")
    tessera = read_tessera(tessera_paths, opts.flavor, opts.batch, opts.seq, opts.ac) if tessera_paths else None
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is visible to this torch "
                         f"({torch.__version__}, built for CUDA {torch.version.cuda})")
    if opts.device == "cuda" and not torch.cuda.is_bf16_supported():
        raise BenchError(f"--device cuda: {torch.cuda.get_device_name()} has no bfloat16 support")

    liger_error = import_error(LIGER_MODULE) if loss in ("auto", "liger") and opts.device == "cuda" else None
    loss_choice = choose_loss(loss, opts.device, liger_error)
    if loss_choice["head"] == "chunked":
        loss_choice["chunks"] = opts.loss_chunks
    if loss_choice["head"] == "liger":
        loss_choice["note"] = ("Liger's forward reads the count of targets to the host (.item()): one host "
                               "synchronisation inside each step, Liger's own")
    att = choose_attention(attention, opts.device, make_probe(args, opts.batch, opts.seq, opts.device))
    opts = dataclasses.replace(opts, gqa=att["gqa"], attention=att["backend"], loss=loss_choice["head"])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fpt = args.flops_per_token(opts.seq)
    fpt_half = args.flops_per_token(opts.seq, causal_halved=True)
    n_params = args.num_params()
    print(f"{PROG}: device {device_name(opts.device)}; torch {torch.__version__}; {date}")
    print(f"config: {opts.flavor} ({n_params:,} parameters, {args.n_layers} layers, dim {args.dim}, "
          f"{args.n_heads}/{args.kv_heads()} heads x {args.head_dim()}, ffn {args.ffn_hidden_dim()}, vocab "
          f"{args.vocab_size}{', tied embeddings' if args.tie_embeddings else ''}); batch {opts.batch} x seq "
          f"{opts.seq} = {opts.batch * opts.seq} tokens/step; AC {opts.ac}; AdamW lr {ADAMW_LR:g} betas {ADAMW_BETAS} "
          f"eps {ADAMW_EPS:g} wd {ADAMW_WEIGHT_DECAY:g}, clip {opts.max_norm:g}; median of {opts.steps} steps after "
          f"{opts.warmup} warm-up" + (f"; allocator {opts.allocator}" if opts.allocator else ""))
    peak = f"peak {opts.peak_tflops:g} TFLOP/s bf16 dense" if opts.device == "cuda" else "MFU n/a on the CPU"
    print(f"flops/token: {fpt:.6g} (6 N_non-embedding + 12 L H hd T, N_non-embedding "
          f"{n_params - args.num_embedding_params():,}); causal-halved {fpt_half:.6g}; {peak}")

    vers = versions()
    results, oom_modes, skipped, failed = [], [], [], []

    def record(complete: bool):
        best = mark_best(results)
        ran = what_ran(attention=att, loss=loss_choice, compile_scope=opts.compile_scope, compile_modes=compile_modes,
                       best=best, ac=opts.ac, optimizer=results[0]["optimizer"] if results else "fused",
                       max_norm=opts.max_norm, device=opts.device, versions=vers, tessera=tessera)
        rat = ratios(tessera, results) if tessera and results else None
        return best, ran, rat, {
            "device": device_name(opts.device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": vers.get("cudnn"), "date": date, "flavor": opts.flavor, "batch": opts.batch, "seq": opts.seq,
            "ac": opts.ac, "device_type": opts.device, "compile_scope": opts.compile_scope,
            "compile_modes": compile_modes, "best_compile": best, "allocator": opts.allocator,
            "precision": PRECISION, "attention": att, "loss_head": loss_choice, "gqa": opts.gqa,
            "timing": ran["torch"]["timing"], "what_ran": ran, "num_params": n_params, "flops_per_token": fpt,
            "flops_per_token_causal_halved": fpt_half,
            "peak_tflops": opts.peak_tflops if opts.device == "cuda" else None,
            "optimizer": ran["torch"]["optimizer"], "steps": opts.steps, "warmup": opts.warmup,
            "results": results, "out_of_memory": oom_modes, "failed": failed, "skipped": skipped,
            "complete": complete,
            "tessera": tessera, "ratios": rat, "argv": argv if argv is not None else sys.argv[1:],
        }

    for line in describe(record(False)[1]):
        print(line)
    for mode in modes:
        if not within_budget(started, time.monotonic(), time_budget):
            skipped.append({"mode": mode, "why": f"--time-budget {time_budget:g} s spent before it started"})
            print(f"{mode}: skipped, --time-budget {time_budget:g} s spent")
            continue
        try:
            r = run_mode(opts, args, mode)
        except Exception as e:  # noqa: BLE001 - a row that fails is reported; the others still run
            if _is_oom(e):
                oom_modes.append(mode)
                print(f"{PROG}: out of memory at batch {opts.batch} seq {opts.seq} ({mode})", file=sys.stderr)
            else:
                why = f"{type(e).__name__}: {_first_line(e)}"
                failed.append({"mode": mode, "why": why})
                print(f"{PROG}: {mode} failed: {why}", file=sys.stderr)
        else:
            results.append(r)
            mark_best(results)
            print(mode_line(r, opts.steps))
            if not all(math.isfinite(x) for x in r["losses"]):
                raise BenchError(f"{mode}: the loss is not finite ({r['losses']})")
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()
        if json_path:
            write_json(json_path, record(False)[3])  # what has run so far survives a cut

    best, ran, rat, doc = record(True)
    if best:
        print(f"best compile mode: {best}")
    if rat:
        parts = [f"tessera / {k.split('/', 1)[1]} {v:.3f}x" for k, v in rat.items()]
        print(f"tessera: {tessera['tokens_per_sec']:.0f} tokens/s ({tessera['path']}); " + ", ".join(parts))
    if json_path:
        write_json(json_path, doc)
    return 1 if oom_modes or failed else 0


# ---------------------------------------------------------------------------------------
# The self-tests: --self-test-no-torch (the pure-Python logic, no torch imported) and
# --self-test (the CPU, with torch).


def _check(cond, what):
    if not cond:
        raise BenchError(f"self-test failed: {what}")


def _expect_error(fn, text, what):
    try:
        fn()
    except BenchError as e:
        _check(text in str(e), f"{what}: the message '{e}' lacks '{text}'")
        return str(e)
    _check(False, f"{what} was accepted")


def self_test_no_torch() -> int:
    """Checks what needs no torch: the options and their one-line errors, the choice of
    attention backend from probe answers, the loss head, the compile rows and the best of
    them, tessera's rows (bench-train's lists, the 8B file beside the 1B/3B one, AC and
    shape mismatches, rows that did not run), the ratios and the record of what ran."""
    check = _check
    _check("torch" not in sys.modules, "torch was imported")

    # Options: defaults, and bad input as one line.
    ns = parse_args([])
    check((ns.attention, ns.loss, ns.loss_chunks, ns.compile_modes, ns.tessera_json, ns.time_budget)
          == ("auto", "auto", 8, list(COMPILE_MODES), [], None), f"defaults {ns}")
    ns = parse_args(["--flavor", "llama3_8b", "--ac", "full", "--compile-modes", "default", "--loss", "chunked",
                     "--loss-chunks", "16", "--attention", "cudnn", "--tessera-json", "a.json", "--tessera-json",
                     "b.json", "--time-budget", "100"])
    check((ns.compile_modes, ns.loss_chunks, ns.tessera_json, ns.time_budget) == (["default"], 16, ["a.json", "b.json"],
                                                                                  100.0), f"parsed {ns}")
    for argv, text in [(["--attention", "xformers"], "invalid choice: 'xformers'"),
                       (["--loss", "fused"], "invalid choice: 'fused'"),
                       (["--compile-modes", "reduce-overhead"], "unknown mode 'reduce-overhead'"),
                       (["--compile-modes", "default,default"], "names a mode twice"),
                       (["--compile-modes", ","], "--compile-modes is empty"),
                       (["--loss-chunks", "0"], "--loss-chunks must be positive"),
                       (["--time-budget", "-5"], "--time-budget must be positive"),
                       (["--steps", "0"], "--steps must be positive"),
                       (["--batch", "x"], "invalid int value: 'x'")]:
        _expect_error(lambda: parse_args(argv), text, f"options {argv}")
    for argv, text in [(["--flavor", "llama4_2t"], "unknown flavor 'llama4_2t'"), (["--bogus"], "unrecognized")]:
        status, err = _main_captured(argv)
        check(status == 1 and err.startswith(f"{PROG}: ") and text in err and len(err.strip().splitlines()) == 1,
              f"{argv} gives one line and status 1: {status} {err!r}")
    check("torch" not in sys.modules, "a bad flavor imported torch")
    check(run_modes("both", ["default", "max-autotune-no-cudagraphs"]) ==
          ["eager", "compile:default", "compile:max-autotune-no-cudagraphs"], "rows of --mode both")
    check(run_modes("compile", ["default"]) == ["compile:default"] and run_modes("eager", ["default"]) == ["eager"],
          "rows of --mode compile / eager")

    # The attention backend from the probes' answers.
    def probes(answers):
        asked = []

        def probe(name):
            asked.append(name)
            return answers.get(name, ("native", ""))
        return probe, asked

    probe, asked = probes({"fa3": (None, "flash_attn_interface is not importable (ModuleNotFoundError: x)"),
                           "cudnn": (None, "its forward and backward on batch 1, seq 8192 failed (native: no)")})
    a = choose_attention("auto", "cuda", probe)
    check(a["backend"] == "flash" and a["gqa"] == "native" and asked == ["fa3", "cudnn", "flash"], f"auto -> flash {a}")
    check("not importable" in a["not_taken"]["fa3"] and "failed" in a["not_taken"]["cudnn"]
          and "math" in a["not_taken"] and "flash" not in a["not_taken"], f"auto's reasons {a['not_taken']}")
    probe, asked = probes({"fa3": (None, "not importable"), "cudnn": ("repeat", "")})
    a = choose_attention("auto", "cuda", probe)
    check(a["backend"] == "cudnn" and a["gqa"] == "repeat" and asked == ["fa3", "cudnn"]
          and "auto takes cudnn before it" in a["not_taken"]["flash"], f"auto -> cudnn {a}")
    probe, asked = probes({})
    a = choose_attention("auto", "cuda", probe)
    check(a["backend"] == "fa3" and asked == ["fa3"] and a["call"].startswith("flash_attn_interface"), f"auto -> fa3 {a}")
    probe, asked = probes({"cudnn": (None, "its forward and backward failed (native: refused)")})
    _expect_error(lambda: choose_attention("cudnn", "cuda", probe), "--attention cudnn: its forward and backward failed",
                  "an explicit backend whose probe fails")
    probe, asked = probes({b: (None, f"{b} fails") for b in AUTO_ATTENTION_ORDER})
    _expect_error(lambda: choose_attention("auto", "cuda", probe), "fa3: fa3 fails; cudnn: cudnn fails; flash: flash fails",
                  "auto with no backend running")
    probe, asked = probes({"math": ("mha", "")})
    a = choose_attention("auto", "cpu", probe)
    check(a["backend"] == "math" and a["gqa"] == "mha" and asked == ["math"]
          and all("CPU" in a["not_taken"][b] for b in AUTO_ATTENTION_ORDER), f"auto on the CPU -> math {a}")
    _expect_error(lambda: choose_attention("flash", "cpu", probe), "runs on CUDA only", "--attention flash on the CPU")
    a = choose_attention("math", "cuda", probes({})[0])
    check(a["backend"] == "math" and a["not_taken"]["cudnn"] == "not asked for (--attention math)", f"math {a}")

    # The loss head.
    check(choose_loss("auto", "cuda", None)["head"] == "liger", "auto with liger importable")
    lo = choose_loss("auto", "cuda", "ModuleNotFoundError: No module named 'liger_kernel'")
    check(lo["head"] == "chunked" and "not importable" in lo["why"], f"auto without liger {lo}")
    _expect_error(lambda: choose_loss("liger", "cuda", "ModuleNotFoundError: x"), "--loss liger: " + LIGER_MODULE,
                  "--loss liger without liger")
    _expect_error(lambda: choose_loss("liger", "cpu", None), "CUDA only", "--loss liger on the CPU")
    check(choose_loss("auto", "cpu", None)["head"] == "chunked", "auto on the CPU")
    check(choose_loss("full", "cuda", None)["head"] == "full", "--loss full")

    # The best compile row, the ratios and the time budget.
    rows = [{"mode": "eager", "tokens_per_sec": 100.0}, {"mode": "compile:default", "tokens_per_sec": 150.0},
            {"mode": "compile:max-autotune-no-cudagraphs", "tokens_per_sec": 160.0}]
    check(mark_best(rows) == "compile:max-autotune-no-cudagraphs" and [r["best"] for r in rows] == [False, False, True],
          f"best {rows}")
    rat = ratios({"tokens_per_sec": 320.0}, rows)
    check(rat == {"tessera/eager": 3.2, "tessera/compile:default": 320.0 / 150.0,
                  "tessera/compile:max-autotune-no-cudagraphs": 2.0, "tessera/compile": 2.0}, f"ratios {rat}")
    check(mark_best(rows[:1]) is None and "tessera/compile" not in ratios({"tokens_per_sec": 1.0}, rows[:1]),
          "no compile row: no best")
    check(within_budget(0.0, 10.0, None) and within_budget(0.0, 10.0, 11.0) and not within_budget(0.0, 12.0, 11.0),
          "the time budget")

    # tessera's rows: run.sh train's two files, bench-train's fields.
    def row(flavor, ac, tps=1000.0, **kw):
        return dict({"flavor": flavor, "batch": 1, "seq_len": 8192, "activation_checkpoint": ac,
                     "attention": "cudnn (auto: it runs)", "state_dtype": "float32", "commit": "abc1234",
                     "path": "tessera bench-train", "tokens_per_sec": tps}, **kw)

    with tempfile.TemporaryDirectory() as d:
        def put(name, obj):
            p = os.path.join(d, name)
            with open(p, "w") as f:
                json.dump(obj, f)
            return p

        small = put("train.json", [row("llama3.2_1b", "none", 50000.0), row("llama3.2_3b", "none", 20000.0)])
        big = put("train8b.json", [row("llama3_8b", "full", 7900.0, state_dtype="bfloat16")])
        t = read_tessera([small, big], "llama3_8b", 1, 8192, "full")
        check(t["tokens_per_sec"] == 7900.0 and t["file"] == big and t["state_dtype"] == "bfloat16"
              and t["attention"].startswith("cudnn"), f"the 8B row from the second file {t}")
        check(read_tessera([small, big], "llama3.2_3b", 1, 8192, "none")["tokens_per_sec"] == 20000.0, "the 3B row")
        _expect_error(lambda: read_tessera([small, big], "llama3_8b", 1, 8192, "none"),
                      "activation_checkpoint is 'full', this run has ac 'none'", "an AC mismatch")
        _expect_error(lambda: read_tessera(small, "llama3_8b", 1, 8192, "full"), "no entry for flavor 'llama3_8b'",
                      "a flavor missing")
        _expect_error(lambda: read_tessera(small, "llama3.2_1b", 1, 4096, "none"), "seq_len is 8192, this run has seq 4096",
                      "a sequence mismatch")
        oom = put("oom.json", [{"flavor": "llama3_8b", "batch": 1, "seq_len": 8192, "activation_checkpoint": "full",
                                "error": "out of memory"}])
        _expect_error(lambda: read_tessera([oom], "llama3_8b", 1, 8192, "full"), "did not run: out of memory",
                      "a row that did not run")
        check(read_tessera([oom, big], "llama3_8b", 1, 8192, "full")["tokens_per_sec"] == 7900.0,
              "a row that ran is taken over one that did not")
        one = put("one.json", {"flavor": "debugmodel", "batch": 2, "seq": 64, "tokens_per_sec": 3000.0})
        check(read_tessera(one, "debugmodel", 2, 64)["tokens_per_sec"] == 3000.0, "a single object")
        for bad, text in [({"flavor": "debugmodel", "seq": 128, "tokens_per_sec": 1.0}, "seq is 128"),
                          ({"flavor": "llama3_8b", "tokens_per_sec": 1.0}, "flavor is 'llama3_8b'"),
                          ({"tokens_per_sec": "fast"}, "tokens_per_sec must be a positive number"),
                          ([{"flavor": "llama3_8b", "tokens_per_sec": 1.0}], "no entry for flavor 'debugmodel'"),
                          ([3], "expected a JSON object")]:
            p = put("bad.json", bad)
            msg = _expect_error(lambda: read_tessera(p, "debugmodel", 2, 64), text, f"tessera file {bad}")
            check(p in msg, f"the message '{msg}' names the file")
        _expect_error(lambda: read_tessera(os.path.join(d, "none.json"), "debugmodel", 2, 64), "none.json",
                      "a missing file")

        # The record of what ran.
        att = choose_attention("auto", "cuda", probes({"fa3": (None, "not importable")})[0])
        lo = dict(choose_loss("auto", "cuda", "not importable"), chunks=8)
        ran = what_ran(attention=att, loss=lo, compile_scope="model", compile_modes=list(COMPILE_MODES),
                       best="compile:default", ac="full", optimizer="fused", max_norm=1.0, device="cuda",
                       versions={"torch": "2.11.0", "cudnn": 91400}, tessera=t)
        ts = ran["torch"]
        check(ts["attention"]["backend"] == "cudnn" and ts["loss_head"]["head"] == "chunked"
              and ts["compile"]["best"] == "compile:default" and ts["precision"] == PRECISION
              and ts["timing"] == TIMING_METHOD and ts["optimizer"]["implementation"] == "fused"
              and ts["activation_checkpointing"] == "full", f"the torch side's record {ts}")
        check(ran["tessera"]["state_dtype"] == "bfloat16" and ran["tessera"]["commit"] == "abc1234", "tessera's side")
        text = "\n".join(describe(ran))
        for part in ("attention cudnn", "fa3: not importable", "loss head chunked", "8 chunks", "best compile:default",
                     "torch.autocast(bfloat16)", "AdamW fused", "CUDA events", "cudnn 91400", "tessera side:",
                     "AC full"):
            check(part in text, f"the printed record lacks {part!r}:\n{text}")
        json.dumps(ran)
    print(f"{PROG}: self-test without torch: OK")
    return 0


def _main_captured(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    return status, err.getvalue()


def self_test() -> int:
    """Checks the script on the CPU: shapes and counts of the big flavors on the meta
    device, the FLOP formula, the RoPE scaling, GQA, the chunked loss head against the
    full one (value and gradients, eager and traced by torch.compile), the choice of
    attention and loss head on the CPU, and bf16 training steps of the debug flavor (with
    and without activation checkpointing, with the full and the chunked head)."""
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    check = _check

    # Parameter counts: the analytic count, the model built on the meta device, the
    # published count.
    for name, published in PUBLISHED_PARAMS.items():
        a = model_flavor(name)
        analytic, built = a.num_params(), count_params_on_meta(a)
        check(analytic == published, f"{name}: analytic count {analytic} != published {published}")
        check(built == published, f"{name}: the model built on the meta device has {built} parameters, "
              f"published {published}")
        print(f"self-test: {name} parameters {built:,} (published {published:,}), ffn hidden {a.ffn_hidden_dim()}, "
              f"flops/token at seq 8192 {a.flops_per_token(8192):.6g}")
    check([model_flavor(n).ffn_hidden_dim() for n in ("llama3.2_1b", "llama3.2_3b", "llama3_8b", "llama2_13b",
                                                        "llama3.1_405b")] == [8192, 8192, 14336, 13824, 53248],
          "ffn hidden sizes")
    # 6 (8030261248 - 128256 x 4096) + 12 x 32 x 32 x 128 x 8192, worked by hand.
    check(model_flavor("llama3_8b").flops_per_token(8192) == 57914449920.0, "llama3_8b flops/token at seq 8192")
    check(model_flavor("llama3_8b").flops_per_token(8192, True) == 57914449920.0 - 6442450944.0,
          "llama3_8b causal-halved flops/token")
    # Tied: the shared matrix is subtracted once as the embedding, so the head is not counted.
    check(model_flavor("llama3.2_1b").flops_per_token(8192) == 6.0 * (1235814400 - 128256 * 2048) + 12.0 * 16 * 32 * 64 * 8192,
          "llama3.2_1b flops/token at seq 8192")

    # RoPE scaling (Llama 3.2: factor 32, wavelengths 2048..8192 interpolated).
    plain = rope_inv_freq(64, 500000.0, RopeScaling())
    scaled = rope_inv_freq(64, 500000.0, model_flavor("llama3.2_1b").rope_scaling)
    check(scaled[0] == plain[0], "rope: the shortest wavelength is kept")
    check(abs(scaled[-1] - plain[-1] / 32) < 1e-18, "rope: the longest wavelength is stretched by factor 32")
    mid = [i for i, f in enumerate(plain) if 2048 <= 2 * math.pi / f <= 8192]
    check(mid and all(plain[i] / 32 < scaled[i] < plain[i] for i in mid), "rope: wavelengths 2048..8192 interpolated")

    # Unknown flavors are named.
    _expect_error(lambda: model_flavor("llama4_2t"), "'llama4_2t'", "an unknown flavor")

    # The attention backend on the CPU: auto falls to math; GQA through enable_gqa equals
    # repeated key/value heads.
    gqa_args = dataclasses.replace(model_flavor("debugmodel"), n_heads=8, n_kv_heads=2, dim=128)
    att = choose_attention("auto", "cpu", make_probe(gqa_args, 2, 16, "cpu"))
    check(att["backend"] == "math" and set(att["not_taken"]) == {"fa3", "cudnn", "flash"}, f"CPU attention {att}")
    _expect_error(lambda: choose_attention("cudnn", "cpu", make_probe(gqa_args, 2, 16, "cpu")), "runs on CUDA only",
                  "--attention cudnn on the CPU")
    gqa = att["gqa"]
    torch.manual_seed(0)
    if gqa == "native":
        m = transformer_class()(gqa_args, seq_len=16)
        m.init_weights()
        x = torch.randn(2, 16, 128)
        at = m.layers[0].attention
        with attention_context("math"):
            y_native = at(x, m.rope_cos, m.rope_sin)
            at.native_gqa = False
            y_repeat = at(x, m.rope_cos, m.rope_sin)
        check(torch.allclose(y_native, y_repeat, atol=1e-6), "GQA with enable_gqa differs from repeated kv heads")
    else:
        print(f"self-test: this torch ({torch.__version__}) has no enable_gqa; key/value heads are repeated")
    check(choose_loss("auto", "cpu", None)["head"] == "chunked", "the CPU's loss head")

    # The chunked head against the full one in float32: the loss and both gradients to
    # 1e-5, with chunks of unequal length; then the same traced by torch.compile whole.
    torch.manual_seed(1)
    n_tok, dim, vocab = 37, 32, 300
    h0 = torch.randn(n_tok, dim, dtype=torch.float64).float()
    w0 = (0.2 * torch.randn(vocab, dim)).float()
    tgt = torch.randint(0, vocab, (n_tok,))

    def grads(fn):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        loss = fn(h, w)
        (2.5 * loss).backward()  # an incoming gradient other than 1
        return loss.detach(), h.grad, w.grad

    full = grads(lambda h, w: F.cross_entropy(F.linear(h, w).float(), tgt))
    ce = chunked_cross_entropy()
    for chunks in (1, 4, 37):
        got = grads(lambda h, w: ce.apply(h, w, tgt, chunks, None))
        for name, a, b in zip(("loss", "d/dh", "d/dW"), got, full):
            err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            check(err <= 1e-5, f"chunked head ({chunks} chunks) {name} differs from the full head by {err:.2e}")
    compiled = torch.compile(lambda h, w: ce.apply(h, w, tgt, 4, None), backend="aot_eager", fullgraph=True)
    got = grads(compiled)
    for name, a, b in zip(("loss", "d/dh", "d/dW"), got, full):
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        check(err <= 1e-5, f"chunked head under torch.compile(fullgraph=True) {name} differs by {err:.2e}")
    print(f"self-test: chunked head (1, 4, 37 chunks, and traced whole by torch.compile) = full head within 1e-5 "
          f"(loss {float(full[0]):.6f})")

    # Eager training steps of the debug flavor, bf16 autocast: without and with full AC,
    # the full and the chunked head.
    args = model_flavor("debugmodel")
    opts = Options(flavor="debugmodel", batch=2, seq=64, steps=2, warmup=1, ac="none", device="cpu",
                   peak_tflops=989.0, seed=0, compile_scope="model", max_norm=MAX_NORM, gqa=gqa, attention="math",
                   loss="full")
    plain_run = run_mode(opts, args, "eager")
    ac_run = run_mode(dataclasses.replace(opts, ac="full"), args, "eager")
    chunked_run = run_mode(dataclasses.replace(opts, loss="chunked", loss_chunks=3), args, "eager")
    losses, ln_v = plain_run["losses"], math.log(args.vocab_size)
    print("self-test: debugmodel batch 2 seq 64, 3 eager steps (bf16 autocast, CPU): loss "
          + " -> ".join(f"{l:.4f}" for l in losses) + f" (ln vocab = {ln_v:.4f}); with full AC "
          + " -> ".join(f"{l:.4f}" for l in ac_run["losses"]) + "; chunked head "
          + " -> ".join(f"{l:.4f}" for l in chunked_run["losses"]))
    check(len(losses) == 3 and all(math.isfinite(l) for l in losses), f"losses finite ({losses})")
    check(abs(losses[0] - ln_v) < 1.0, f"step-0 loss {losses[0]:.4f} near ln(vocab) {ln_v:.4f}")
    check(losses[-1] < losses[0], f"the loss falls ({losses})")
    check(all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(losses, ac_run["losses"])),
          f"full activation checkpointing changes the losses ({losses} vs {ac_run['losses']})")
    check(all(abs(a - b) <= 2e-3 * abs(a) for a, b in zip(losses, chunked_run["losses"])),
          f"the chunked head's losses differ from the full head's ({losses} vs {chunked_run['losses']})")
    check(len(plain_run["grad_norms"]) == 3 and all(math.isfinite(g) and g > 0 for g in plain_run["grad_norms"]),
          f"gradient norms {plain_run['grad_norms']}")
    check(plain_run["mfu"] is None and plain_run["peak_memory_bytes"] is None, "CPU figures are n/a")

    # A small model of the llama3.2 kind: tied embeddings, 4 query heads per kv head, the
    # factor-32 RoPE scaling; its parameters as counted analytically, full AC, the chunked head.
    small = dataclasses.replace(model_flavor("llama3.2_1b"), flavor="small-tied", dim=128, n_layers=2, n_heads=8,
                                vocab_size=512, multiple_of=64)
    check(count_params_on_meta(small) == small.num_params(), "small tied model: built and analytic counts differ")
    FLAVORS[small.flavor] = small
    try:
        tied_run = run_mode(dataclasses.replace(opts, flavor=small.flavor, ac="full", loss="chunked"), small, "eager")
    finally:
        del FLAVORS[small.flavor]
    tl_ = tied_run["losses"]
    print("self-test: tied GQA model (dim 128, 2 layers, 8/2 heads, vocab 512, full AC, chunked head): loss "
          + " -> ".join(f"{l:.4f}" for l in tl_) + f" (ln vocab = {math.log(512):.4f})")
    check(all(math.isfinite(l) for l in tl_) and abs(tl_[0] - math.log(512)) < 1.0 and tl_[-1] < tl_[0],
          f"tied model losses {tl_}")

    # Out of memory in one row: one line naming batch, seq and row, the others still run,
    # exit status 1. The error arrives wrapped, as torch.compile's errors do. The JSON
    # marks the best compile row and records what ran.
    def fake_run_mode(o, a, mode):
        if mode == "eager":
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB")
            except RuntimeError as inner:
                raise RuntimeError("backend compiler failed") from inner
        if mode == "compile:default" and o.batch == 4:
            raise RuntimeError("InductorError: no lowering\nthe rest of the trace")
        tps = {"compile:default": 100.0, "compile:max-autotune-no-cudagraphs": 120.0}[mode]
        return {"mode": mode, "tokens_per_sec": tps, "step_seconds": 1.0, "warmup_seconds": 0.0, "losses": [5.0],
                "optimizer": "fused", "peak_memory_bytes": None, "mfu": None, "mfu_causal_halved": None}

    real_run_mode = globals()["run_mode"]
    globals()["run_mode"] = fake_run_mode
    err, out = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory() as d:
        jp = os.path.join(d, "out.json")
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                status = run(dataclasses.replace(opts, batch=3, seq=32), run_modes("both", list(COMPILE_MODES)), jp,
                             None, attention="auto", loss="auto", compile_modes=list(COMPILE_MODES))
        finally:
            globals()["run_mode"] = real_run_mode
        doc = read_json(jp, "--json")
    check(status == 1, f"out of memory gives exit status 1, got {status}")
    check(err.getvalue().strip() == f"{PROG}: out of memory at batch 3 seq 32 (eager)", f"OOM line: {err.getvalue()!r}")
    check("\ncompile:default " in out.getvalue() and "best compile mode: compile:max-autotune-no-cudagraphs"
          in out.getvalue(), "the compile rows still ran after eager ran out of memory")
    # A row that fails otherwise: one line naming it and the first line of the error, the
    # others still run, exit status 1, the JSON lists it under "failed".
    err = io.StringIO()
    globals()["run_mode"] = fake_run_mode
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = run(dataclasses.replace(opts, batch=4, seq=32), ["compile:default",
                         "compile:max-autotune-no-cudagraphs"], None, None, compile_modes=list(COMPILE_MODES))
    finally:
        globals()["run_mode"] = real_run_mode
    check(status == 1 and err.getvalue().strip() == f"{PROG}: compile:default failed: RuntimeError: InductorError: "
          "no lowering", f"a failing row: {status} {err.getvalue()!r}")
    check(doc["best_compile"] == "compile:max-autotune-no-cudagraphs" and doc["out_of_memory"] == ["eager"]
          and doc["complete"] and doc["what_ran"]["torch"]["attention"]["backend"] == "math"
          and doc["loss_head"]["head"] == "chunked" and [r["best"] for r in doc["results"]] == [False, True],
          f"the JSON record {doc['best_compile']} {doc['loss_head']}")
    print("self-test: OK")
    return 0


# ---------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as BenchError: one line, `torch_llama: ...`, status 1."""

    def error(self, message):
        raise BenchError(message)


def parse_args(argv):
    p = _Parser(
        prog="torch_llama.py",
        description="Llama training throughput in PyTorch (eager and torch.compile), the reference for tessera's "
                    "bench figures: tokens/s, step time, MFU by torchtitan's formula, peak memory.")
    p.add_argument("--flavor", default="llama3_8b", help="model flavor, as tessera names them (default llama3_8b)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first; compilation happens here (default 3)")
    p.add_argument("--ac", choices=["none", "full"], default="none",
                   help="activation checkpointing: none, or full (every block recomputed in the backward)")
    p.add_argument("--mode", choices=["eager", "compile", "both"], default="both",
                   help="eager, torch.compile in each of --compile-modes, or both (default)")
    p.add_argument("--compile-modes", default=",".join(COMPILE_MODES),
                   help="torch.compile modes, comma-separated: default, max-autotune-no-cudagraphs "
                        "(default both; each mode's figures are kept, the fastest marked)")
    p.add_argument("--compile-scope", choices=["model", "block"], default="model",
                   help="torch.compile the whole model with its loss (default), or each block and the loss head "
                        "alone, as torchtitan does")
    p.add_argument("--attention", choices=list(ATTENTION_CHOICES), default="auto",
                   help="auto (fa3 where importable and running, else cudnn where a probe of this run's shapes "
                        "runs, else flash; math on the CPU), cudnn, flash, fa3 or math")
    p.add_argument("--loss", choices=list(LOSS_CHOICES), default="auto",
                   help="the loss head: auto (liger where importable, else chunked), full, chunked or liger")
    p.add_argument("--loss-chunks", type=int, default=8, help="chunks of tokens of --loss chunked (default 8)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the device's dense bf16 peak for MFU (default 989, H100/H200 SXM)")
    p.add_argument("--max-norm", type=float, default=MAX_NORM,
                   help="gradient clipping norm as tessera's training.max_norm (default 1.0; <= 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (after every row, and at the end)")
    p.add_argument("--tessera-json", metavar="PATH", action="append", default=[],
                   help="tessera's results (bench-train --json); the row of this flavor, batch, seq and AC is "
                        "taken; may be given more than once (run.sh's train.json and train8b.json)")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="start no row once this many seconds have passed since the script started")
    p.add_argument("--self-test", action="store_true", help="check this script on the CPU (debug flavor) and exit")
    p.add_argument("--self-test-no-torch", action="store_true",
                   help="check the options, the choices and the records without torch, and exit")
    ns = p.parse_args(argv)
    for key in ("batch", "seq", "steps", "loss_chunks"):
        if getattr(ns, key) <= 0:
            raise BenchError(f"--{key.replace('_', '-')} must be positive, got {getattr(ns, key)}")
    if ns.warmup < 0:
        raise BenchError(f"--warmup must not be negative, got {ns.warmup}")
    if not ns.peak_tflops > 0:
        raise BenchError(f"--peak-tflops must be positive, got {ns.peak_tflops}")
    if ns.time_budget is not None and not ns.time_budget > 0:
        raise BenchError(f"--time-budget must be positive, got {ns.time_budget:g}")
    ns.compile_modes = parse_compile_modes(ns.compile_modes)
    return ns


def main(argv=None) -> int:
    started = time.monotonic()
    try:
        argv = sys.argv[1:] if argv is None else argv
        ns = parse_args(argv)
        if ns.self_test_no_torch:
            return self_test_no_torch()
        if not ns.self_test:
            model_flavor(ns.flavor)  # an unknown name fails before torch is imported
        allocator = "" if ns.self_test else set_allocator_conf(ns.device)
        _import_torch()
        if ns.self_test:
            return self_test()
        opts = Options(flavor=ns.flavor, batch=ns.batch, seq=ns.seq, steps=ns.steps, warmup=ns.warmup, ac=ns.ac,
                       device=ns.device, peak_tflops=ns.peak_tflops, seed=ns.seed, compile_scope=ns.compile_scope,
                       max_norm=ns.max_norm, loss_chunks=ns.loss_chunks, allocator=allocator)
        return run(opts, run_modes(ns.mode, ns.compile_modes), ns.json, ns.tessera_json, attention=ns.attention,
                   loss=ns.loss, compile_modes=ns.compile_modes if ns.mode != "eager" else [],
                   time_budget=ns.time_budget, started=started, argv=argv)
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
