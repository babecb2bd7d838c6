#!/usr/bin/env python3
"""torch_llama: the PyTorch side of tessera's throughput comparison.

Trains a Llama 3 model written here in plain PyTorch on synthetic tokens and reports
tokens/s, the step time, MFU by torchtitan's formula and the peak of allocated device
memory, in PyTorch eager mode and under torch.compile, on the same flavor, batch and
sequence length as tessera's own benchmark. With --tessera-json it reads tessera's figure
for the same run and prints the ratios tessera / torch.compile and tessera / eager.

The model mirrors tessera's nn::Transformer and the flavors of
include/tessera/layer/args.hpp: token embedding, pre-norm blocks (RMSNorm, attention with
rotary embeddings and grouped-query heads, RMSNorm, SwiGLU feed-forward), a final RMSNorm
and the output head (the token embedding itself where the flavor ties them), then the
cross-entropy loss. Precision is torchtitan's FSDP2 mixed precision: float32 parameters,
gradients and AdamW state, forward and backward under torch.autocast(bfloat16).

Run `python3 bench/torch_llama.py --help` for the options and bench/README.md for the
comparison it serves. `--self-test` checks the script on the CPU in a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
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
        def __init__(self, args: ModelArgs, native_gqa: bool = True):
            super().__init__()
            self.n_heads, self.n_kv, self.hd = args.n_heads, args.kv_heads(), args.head_dim()
            self.wq = nn.Linear(args.dim, self.n_heads * self.hd, bias=False)
            self.wk = nn.Linear(args.dim, self.n_kv * self.hd, bias=False)
            self.wv = nn.Linear(args.dim, self.n_kv * self.hd, bias=False)
            self.wo = nn.Linear(self.n_heads * self.hd, args.dim, bias=False)
            self.native_gqa = native_gqa  # False: key/value heads repeated before SDPA

        def forward(self, x, cos, sin):
            bsz, seq, _ = x.shape
            q = rotate(self.wq(x).view(bsz, seq, self.n_heads, self.hd), cos, sin)
            k = rotate(self.wk(x).view(bsz, seq, self.n_kv, self.hd), cos, sin)
            v = self.wv(x).view(bsz, seq, self.n_kv, self.hd)
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
        def __init__(self, args: ModelArgs, layer_id: int, native_gqa: bool):
            super().__init__()
            self.layer_id = layer_id
            self.attention_norm = RMSNorm(args.dim, args.norm_eps)
            self.attention = Attention(args, native_gqa)
            self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
            self.feed_forward = FeedForward(args)

        def forward(self, x, cos, sin):
            h = x + self.attention(self.attention_norm(x), cos, sin)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self, args: ModelArgs, seq_len: int, ac: str = "none", gqa: str = "native"):
            super().__init__()
            self.args, self.ac = args, ac
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(Block(args, i, gqa != "repeat") for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps)
            # Tied flavors read the embedding matrix as the output head: no second matrix.
            self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
            device = self.tok_embeddings.weight.device
            self.register_buffer("rope_cos", torch.empty(seq_len, args.head_dim() // 2, device=device), persistent=False)
            self.register_buffer("rope_sin", torch.empty(seq_len, args.head_dim() // 2, device=device), persistent=False)

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

        def forward(self, tokens, targets):
            seq = tokens.shape[1]
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                if self.ac == "full":
                    h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False)
                else:
                    h = layer(h, cos, sin)
            h = self.norm(h)
            head = self.output.weight if self.output is not None else self.tok_embeddings.weight
            logits = F.linear(h, head)
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

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


def choose_gqa(args: ModelArgs, device: str) -> str:
    """How attention runs the flavor's grouped-query heads: "mha" (none to group),
    "native" (SDPA's enable_gqa) or "repeat" (key/value heads repeated before SDPA, where
    this torch has no enable_gqa or, on CUDA, its flash backend refuses it). On CUDA a small
    forward and backward under the flash backend decides; if neither form runs there, the
    flash backend cannot serve this flavor and that is an error."""
    if args.kv_heads() == args.n_heads:
        return "mha"
    if not _sdpa_has_gqa():
        return "repeat"
    if device != "cuda":
        return "native"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, kv, hd, t = args.n_heads, args.kv_heads(), args.head_dim(), 256
    q = torch.randn(1, h, t, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv, t, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv, t, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    errors = []
    for form in ("native", "repeat"):
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                if form == "native":
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    o = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, dim=1),
                                                       v.repeat_interleave(h // kv, dim=1), is_causal=True)
                o.sum().backward()
            torch.cuda.synchronize()
            return form
        except RuntimeError as e:
            errors.append(f"{form}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
    raise BenchError(f"the flash SDPA backend refuses {args.flavor}'s attention ({h} query / {kv} key-value heads "
                     f"x {hd}, bf16): " + "; ".join(errors))


def count_params_on_meta(args: ModelArgs) -> int:
    """The parameters of the model as built here, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = transformer_class()(args, seq_len=1)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------
# One mode's run.


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
    gqa: str = "native"  # choose_gqa()'s answer
    allocator: str = ""  # the CUDA caching allocator's settings, as the environment gives them


def _sdpa_context(device: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION if device == "cuda" else SDPBackend.MATH)


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


def run_mode(opts: Options, args: ModelArgs, mode: str) -> dict:
    """Builds a fresh model (same seed), trains warmup + steps on one fixed batch of
    random tokens and returns the figures. Raises on out of memory (see _is_oom)."""
    dev = torch.device(opts.device)
    cuda = opts.device == "cuda"
    torch.manual_seed(opts.seed)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with dev:
        model = transformer_class()(args, seq_len=opts.seq, ac=opts.ac, gqa=opts.gqa)
    model.init_weights()
    gen = torch.Generator(device=dev).manual_seed(opts.seed + 1)
    data = torch.randint(0, args.vocab_size, (opts.batch, opts.seq + 1), device=dev, generator=gen)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    optimizer, opt_impl = make_optimizer(model, opts.device)
    params = list(model.parameters())

    forward = model
    if mode == "compile":
        if opts.compile_scope == "block":
            for layer in model.layers:
                layer.compile()
        else:
            forward = torch.compile(model)

    def step():
        # The SDPA backend choice covers the backward too: full AC recomputes each block's
        # forward there, and the recomputation must pick the same kernel.
        with _sdpa_context(opts.device):
            with torch.autocast(device_type=opts.device, dtype=torch.bfloat16):
                loss = forward(tokens, targets)
            loss.backward()
        if opts.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, opts.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = []
    warm_start = time.perf_counter()
    for _ in range(opts.warmup):
        losses.append(step())
    if cuda:
        torch.cuda.synchronize()
    warmup_seconds = time.perf_counter() - warm_start

    times = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(opts.steps)]
        for start, end in events:
            start.record()
            losses.append(step())
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for _ in range(opts.steps):
            t0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t0)

    step_seconds = statistics.median(times)
    tokens_per_sec = opts.batch * opts.seq / step_seconds
    result = {
        "mode": mode,
        "tokens_per_sec": tokens_per_sec,
        "step_seconds": step_seconds,
        "step_seconds_all": times,
        "warmup_seconds": warmup_seconds,
        "losses": [float(l) for l in losses],
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
    return result


# ---------------------------------------------------------------------------------------
# tessera's figure and the ratios.


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


def read_tessera(path: str, flavor: str, batch: int, seq: int) -> dict:
    """tessera's result for this run: a JSON object with tokens_per_sec (a positive number);
    flavor, batch (or local_batch_size) and seq (or seq_len), where present, must match. A
    list of such objects (bench-train's --json, one per flavor) gives the one of `flavor`."""
    data = read_json(path, "--tessera-json")
    if isinstance(data, list):
        mine = [d for d in data if isinstance(d, dict) and d.get("flavor") == flavor]
        if not mine:
            raise BenchError(f"--tessera-json {path}: no entry for flavor {flavor!r}")
        data = mine[0]
        if "error" in data:
            raise BenchError(f"--tessera-json {path}: flavor {flavor!r} did not run: {data['error']}")
    if not isinstance(data, dict):
        raise BenchError(f"--tessera-json {path}: expected a JSON object with tokens_per_sec")
    tps = data.get("tokens_per_sec")
    if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not tps > 0:
        raise BenchError(f"--tessera-json {path}: tokens_per_sec must be a positive number, got {tps!r}")
    want = {"flavor": flavor, "batch": batch, "seq": seq}
    aliases = {"flavor": ("flavor",), "batch": ("batch", "local_batch_size"), "seq": ("seq", "seq_len")}
    for key, names in aliases.items():
        for name in names:
            if name in data and data[name] != want[key]:
                raise BenchError(f"--tessera-json {path}: {name} is {data[name]!r}, this run has {key} {want[key]!r}")
    return {"path": path, "tokens_per_sec": float(tps), "mfu": data.get("mfu")}


def ratios(tessera: dict, results: list[dict]) -> dict:
    return {f"tessera/{r['mode']}": tessera["tokens_per_sec"] / r["tokens_per_sec"] for r in results}


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
    return (f"{r['mode']:<8} {r['tokens_per_sec']:>10.0f} tokens/s  step {r['step_seconds']:.4f} s (median of {steps})"
            f"  MFU {pct(r['mfu'])} (causal-halved {pct(r['mfu_causal_halved'])})"
            f"  peak memory {gib(r['peak_memory_bytes'])}  loss {losses[0]:.3f} -> {losses[-1]:.3f}"
            f"  [AdamW {r['optimizer']}; warm-up {r['warmup_seconds']:.1f} s]")


def run(opts: Options, modes: list[str], json_path: str | None, tessera_path: str | None) -> int:
    args = model_flavor(opts.flavor)
    if opts.seq > args.max_seq_len:
        raise BenchError(f"seq {opts.seq} exceeds {opts.flavor}'s max_seq_len {args.max_seq_len}")
    tessera = read_tessera(tessera_path, opts.flavor, opts.batch, opts.seq) if tessera_path else None
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is visible to this torch "
                         f"({torch.__version__}, built for CUDA {torch.version.cuda})")
    if opts.device == "cuda" and not torch.cuda.is_bf16_supported():
        raise BenchError(f"--device cuda: {torch.cuda.get_device_name()} has no bfloat16 support")

    opts = dataclasses.replace(opts, gqa=choose_gqa(args, opts.device))
    gqa_text = {"mha": "no grouped heads", "native": "GQA by enable_gqa",
                "repeat": "GQA by repeated key/value heads"}[opts.gqa]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fpt = args.flops_per_token(opts.seq)
    fpt_half = args.flops_per_token(opts.seq, causal_halved=True)
    n_params = args.num_params()
    attention = ("SDPA flash backend (sdpa_kernel(FLASH_ATTENTION))" if opts.device == "cuda" else
                 "SDPA math backend (CPU: no flash path is used here)")
    print(f"{PROG}: device {device_name(opts.device)}; torch {torch.__version__}; {date}")
    print(f"config: {opts.flavor} ({n_params:,} parameters, {args.n_layers} layers, dim {args.dim}, "
          f"{args.n_heads}/{args.kv_heads()} heads x {args.head_dim()}, ffn {args.ffn_hidden_dim()}, vocab "
          f"{args.vocab_size}{', tied embeddings' if args.tie_embeddings else ''}); batch {opts.batch} x seq "
          f"{opts.seq} = {opts.batch * opts.seq} tokens/step; AC {opts.ac}; fp32 parameters, bf16 autocast; "
          f"{attention}, {gqa_text}; AdamW lr {ADAMW_LR:g} betas {ADAMW_BETAS} eps {ADAMW_EPS:g} wd {ADAMW_WEIGHT_DECAY:g}, "
          f"clip {opts.max_norm:g}; median of {opts.steps} steps after {opts.warmup} warm-up"
          + (f"; compile scope {opts.compile_scope}" if "compile" in modes else "")
          + (f"; allocator {opts.allocator}" if opts.allocator else ""))
    peak = f"peak {opts.peak_tflops:g} TFLOP/s bf16 dense" if opts.device == "cuda" else "MFU n/a on the CPU"
    print(f"flops/token: {fpt:.6g} (6 N_non-embedding + 12 L H hd T, N_non-embedding "
          f"{n_params - args.num_embedding_params():,}); causal-halved {fpt_half:.6g}; {peak}")

    results, oom_modes = [], []
    for mode in modes:
        try:
            r = run_mode(opts, args, mode)
        except Exception as e:  # noqa: BLE001 - out of memory is reported; anything else re-raised
            if not _is_oom(e):
                raise
            oom_modes.append(mode)
            print(f"{PROG}: out of memory at batch {opts.batch} seq {opts.seq} ({mode})", file=sys.stderr)
        else:
            results.append(r)
            print(mode_line(r, opts.steps))
            if not all(math.isfinite(x) for x in r["losses"]):
                raise BenchError(f"{mode}: the loss is not finite ({r['losses']})")
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()

    rat = None
    if tessera and results:
        rat = ratios(tessera, results)
        parts = [f"tessera / {k.split('/', 1)[1]} {v:.3f}x" for k, v in rat.items()]
        print(f"tessera: {tessera['tokens_per_sec']:.0f} tokens/s ({tessera['path']}); " + ", ".join(parts))

    if json_path:
        out = {
            "device": device_name(opts.device), "torch": torch.__version__, "cuda": torch.version.cuda, "date": date,
            "flavor": opts.flavor, "batch": opts.batch, "seq": opts.seq, "ac": opts.ac, "device_type": opts.device,
            "compile_scope": opts.compile_scope, "allocator": opts.allocator, "precision": "fp32 parameters, bf16 autocast",
            "attention": attention, "gqa": opts.gqa, "num_params": n_params, "flops_per_token": fpt,
            "flops_per_token_causal_halved": fpt_half,
            "peak_tflops": opts.peak_tflops if opts.device == "cuda" else None,
            "optimizer": {"lr": ADAMW_LR, "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS,
                          "weight_decay": ADAMW_WEIGHT_DECAY, "max_norm": opts.max_norm},
            "steps": opts.steps, "warmup": opts.warmup, "results": results, "out_of_memory": oom_modes,
            "tessera": tessera, "ratios": rat, "argv": sys.argv[1:],
        }
        write_json(json_path, out)
    return 1 if oom_modes else 0


# ---------------------------------------------------------------------------------------
# The CPU self-test.


def self_test() -> int:
    """Checks the script on the CPU: shapes and counts of the big flavors on the meta
    device, the FLOP formula, the RoPE scaling, GQA, and three bf16 training steps of the
    debug flavor (with and without activation checkpointing)."""
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    def check(cond, what):
        if not cond:
            raise BenchError(f"self-test failed: {what}")

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
    try:
        model_flavor("llama4_2t")
        check(False, "an unknown flavor was accepted")
    except BenchError as e:
        check("'llama4_2t'" in str(e) and "llama3_8b" in str(e), f"unknown flavor message: {e}")

    # GQA through enable_gqa equals repeated key/value heads.
    gqa_args = dataclasses.replace(model_flavor("debugmodel"), n_heads=8, n_kv_heads=2, dim=128)
    torch.manual_seed(0)
    gqa = choose_gqa(gqa_args, "cpu")
    if gqa == "native":
        m = transformer_class()(gqa_args, seq_len=16)
        m.init_weights()
        x = torch.randn(2, 16, 128)
        at = m.layers[0].attention
        y_native = at(x, m.rope_cos, m.rope_sin)
        at.native_gqa = False
        y_repeat = at(x, m.rope_cos, m.rope_sin)
        check(torch.allclose(y_native, y_repeat, atol=1e-6), "GQA with enable_gqa differs from repeated kv heads")
    else:
        print(f"self-test: this torch ({torch.__version__}) has no enable_gqa; key/value heads are repeated")

    # Three eager training steps of the debug flavor, bf16 autocast, without and with full AC.
    args = model_flavor("debugmodel")
    opts = Options(flavor="debugmodel", batch=2, seq=64, steps=2, warmup=1, ac="none", device="cpu",
                   peak_tflops=989.0, seed=0, compile_scope="model", max_norm=MAX_NORM)
    plain_run = run_mode(opts, args, "eager")
    ac_run = run_mode(dataclasses.replace(opts, ac="full"), args, "eager")
    losses, ln_v = plain_run["losses"], math.log(args.vocab_size)
    print("self-test: debugmodel batch 2 seq 64, 3 eager steps (bf16 autocast, CPU): loss "
          + " -> ".join(f"{l:.4f}" for l in losses) + f" (ln vocab = {ln_v:.4f}); with full AC "
          + " -> ".join(f"{l:.4f}" for l in ac_run["losses"]))
    check(len(losses) == 3 and all(math.isfinite(l) for l in losses), f"losses finite ({losses})")
    check(abs(losses[0] - ln_v) < 1.0, f"step-0 loss {losses[0]:.4f} near ln(vocab) {ln_v:.4f}")
    check(losses[-1] < losses[0], f"the loss falls ({losses})")
    check(all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(losses, ac_run["losses"])),
          f"full activation checkpointing changes the losses ({losses} vs {ac_run['losses']})")
    check(plain_run["mfu"] is None and plain_run["peak_memory_bytes"] is None, "CPU figures are n/a")

    # A small model of the llama3.2 kind: tied embeddings, 4 query heads per kv head, the
    # factor-32 RoPE scaling; its parameters as counted analytically, full AC.
    small = dataclasses.replace(model_flavor("llama3.2_1b"), flavor="small-tied", dim=128, n_layers=2, n_heads=8,
                                vocab_size=512, multiple_of=64)
    check(count_params_on_meta(small) == small.num_params(), "small tied model: built and analytic counts differ")
    FLAVORS[small.flavor] = small
    try:
        tied_run = run_mode(dataclasses.replace(opts, flavor=small.flavor, ac="full", gqa=gqa), small, "eager")
    finally:
        del FLAVORS[small.flavor]
    tl = tied_run["losses"]
    print("self-test: tied GQA model (dim 128, 2 layers, 8/2 heads, vocab 512, full AC): loss "
          + " -> ".join(f"{l:.4f}" for l in tl) + f" (ln vocab = {math.log(512):.4f})")
    check(all(math.isfinite(l) for l in tl) and abs(tl[0] - math.log(512)) < 1.0 and tl[-1] < tl[0],
          f"tied model losses {tl}")

    # Out of memory in one mode: one line naming batch, seq and mode, the other mode still
    # runs, exit status 1. The error arrives wrapped, as torch.compile's errors do.
    def fake_run_mode(o, a, mode):
        if mode == "eager":
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB")
            except RuntimeError as inner:
                raise RuntimeError("backend compiler failed") from inner
        return {"mode": mode, "tokens_per_sec": 100.0, "step_seconds": 1.0, "warmup_seconds": 0.0, "losses": [5.0],
                "optimizer": "fused", "peak_memory_bytes": None, "mfu": None, "mfu_causal_halved": None}

    real_run_mode = globals()["run_mode"]
    globals()["run_mode"] = fake_run_mode
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            status = run(dataclasses.replace(opts, batch=3, seq=32), ["eager", "compile"], None, None)
    finally:
        globals()["run_mode"] = real_run_mode
    check(status == 1, f"out of memory gives exit status 1, got {status}")
    check(err.getvalue().strip() == f"{PROG}: out of memory at batch 3 seq 32 (eager)", f"OOM line: {err.getvalue()!r}")
    check("\ncompile " in out.getvalue(), "the compile mode still ran after eager ran out of memory")

    # tessera's result file and the ratios.
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "tessera.json")
        with open(p, "w") as f:
            json.dump({"flavor": "debugmodel", "batch": 2, "seq_len": 64, "tokens_per_sec": 3000.0}, f)
        t = read_tessera(p, "debugmodel", 2, 64)
        rat = ratios(t, [{"mode": "eager", "tokens_per_sec": 1500.0}, {"mode": "compile", "tokens_per_sec": 6000.0}])
        check(rat == {"tessera/eager": 2.0, "tessera/compile": 0.5}, f"ratios {rat}")
        # bench-train's list, one entry per flavor: the run's own is taken.
        with open(p, "w") as f:
            json.dump([{"flavor": "llama3_8b", "batch": 1, "seq_len": 8192, "tokens_per_sec": 10.0},
                       {"flavor": "debugmodel", "batch": 2, "seq_len": 64, "tokens_per_sec": 3000.0}], f)
        check(read_tessera(p, "debugmodel", 2, 64)["tokens_per_sec"] == 3000.0, "the list entry of the flavor")
        for bad, text in [({"flavor": "debugmodel", "seq": 128, "tokens_per_sec": 1.0}, "seq is 128"),
                          ({"flavor": "llama3_8b", "tokens_per_sec": 1.0}, "flavor is 'llama3_8b'"),
                          ({"tokens_per_sec": "fast"}, "tokens_per_sec must be a positive number"),
                          ([{"flavor": "llama3_8b", "tokens_per_sec": 1.0}], "no entry for flavor 'debugmodel'"),
                          ([{"flavor": "debugmodel", "error": "out of memory"}], "did not run: out of memory")]:
            with open(p, "w") as f:
                json.dump(bad, f)
            try:
                read_tessera(p, "debugmodel", 2, 64)
                check(False, f"{bad} was accepted")
            except BenchError as e:
                check(text in str(e) and p in str(e), f"message '{e}' lacks '{text}' or the path")
    print("self-test: OK")
    return 0


# ---------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(
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
    p.add_argument("--mode", choices=["eager", "compile", "both"], default="both", help="default both")
    p.add_argument("--compile-scope", choices=["model", "block"], default="model",
                   help="torch.compile the whole model (default) or each block alone, as torchtitan does")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the device's dense bf16 peak for MFU (default 989, H100/H200 SXM)")
    p.add_argument("--max-norm", type=float, default=MAX_NORM,
                   help="gradient clipping norm as tessera's training.max_norm (default 1.0; <= 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--tessera-json", metavar="PATH",
                   help="tessera's result for the same flavor/batch/seq (JSON with tokens_per_sec): print the ratios")
    p.add_argument("--self-test", action="store_true", help="check this script on the CPU (debug flavor) and exit")
    ns = p.parse_args(argv)
    for key in ("batch", "seq", "steps"):
        if getattr(ns, key) <= 0:
            raise BenchError(f"--{key} must be positive, got {getattr(ns, key)}")
    if ns.warmup < 0:
        raise BenchError(f"--warmup must not be negative, got {ns.warmup}")
    if not ns.peak_tflops > 0:
        raise BenchError(f"--peak-tflops must be positive, got {ns.peak_tflops}")
    return ns


def main(argv=None) -> int:
    try:
        ns = parse_args(sys.argv[1:] if argv is None else argv)
        if not ns.self_test:
            model_flavor(ns.flavor)  # an unknown name fails before torch is imported
        allocator = "" if ns.self_test else set_allocator_conf(ns.device)
        _import_torch()
        if ns.self_test:
            return self_test()
        opts = Options(flavor=ns.flavor, batch=ns.batch, seq=ns.seq, steps=ns.steps, warmup=ns.warmup, ac=ns.ac,
                       device=ns.device, peak_tflops=ns.peak_tflops, seed=ns.seed, compile_scope=ns.compile_scope,
                       max_norm=ns.max_norm, allocator=allocator)
        modes = ["eager", "compile"] if ns.mode == "both" else [ns.mode]
        return run(opts, modes, ns.json, ns.tessera_json)
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
