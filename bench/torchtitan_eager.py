#!/usr/bin/env python3
"""torchtitan_eager: torchtitan's eager Llama step on one GPU, timed and profiled, against
llama-plan's prediction of it (`--plan.runtime torchtitan`).

llama-plan predicts torchtitan's published Llama table on 64 A100s 7 to 18% fast
(docs/validation.md, "The eager step, counted"). Its model of that step is a list of eager
PyTorch kernels read from torchtitan's code at the commit that made the table
(plan/torchtitan_time.hpp, plan/eager.hpp). This script runs a step written to those
same kernels on one GPU, so that a machine with a GPU can say whether the list and its
prices hold, class by class, before any cluster is involved:

  model       torchtitan's Llama as the table ran it (1ea476e9f): separate q, k and v
              projections; rotary embedding as a complex multiply over float32 copies;
              key and value heads repeated to every query head (expand and reshape) before
              scaled_dot_product_attention; SwiGLU as silu(w1 x) * w3 x; RMSNorm in eager
              PyTorch, `norm(x.float()).type_as(x) * weight` (the table's 70B configs;
              its 8B and 13B ones used a Triton kernel, not reproduced here); the logits
              cast to float32 for the cross-entropy
  precision   FSDP2's mixed precision on one rank: float32 parameters and AdamW state,
              bfloat16 copies of the parameters computed with (cast in before each step),
              bfloat16 gradients cast to float32 for the optimizer; no collectives
  optimizer   gradient clipping and AdamW, both foreach (torchtitan's defaults then)

With --fsdp2 the same model runs under FSDP2 itself on a one-rank mesh, as torchtitan
wrapped it: fully_shard on each block (all but the last resharded after the forward) and
on the model, MixedPrecisionPolicy(bfloat16 parameters, float32 reduction), DTensor
parameters, clipping and AdamW foreach over them. One rank's collectives move nothing,
but FSDP2 still makes every copy around them (the casts into the all-gather, its split
into the parameters, the gradients into the float32 reduce-scatter) and every DTensor
dispatch; its step over the emulated one (--baseline-json, that run's --json) is what
FSDP2 and DTensor cost on one GPU, where llama-plan counts FSDP2's copies only.

It reports the median step (CUDA events), the forward-backward and the optimizer phases
apart, and from one profiled step the GPU's kernel time by class (GEMMs, attention, the
rest) and how much of the step the GPU was busy: an eager step whose host cannot keep
ahead of the GPU shows as idle time, which llama-plan does not price beyond a launch's
floor. With --plan-json (llama-plan --json for the same model, batch and sequence on this
GPU's profile) it prints the prediction beside each figure.

    python3 bench/torchtitan_eager.py --flavor llama2_13b --n-layers 6 --batch 2 --seq 4096 \\
        [--plan-json plan.json] [--json out.json]
    python3 bench/torchtitan_eager.py ... --fsdp2 --baseline-json out.json [--json fsdp2.json]
    python3 bench/torchtitan_eager.py --self-test      # the CPU, a few seconds

Differences from the planned step, each under a percent of it at the sizes above: the
casts of the mixed precision (FSDP2 makes them around its collectives, which one rank
does not have, so llama-plan's trace on one GPU has none: 12 bytes a parameter), and
the optimizer's reading of the moments (foreach AdamW as torch of the day runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import math
import os
import re
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_llama as tl  # noqa: E402 - the flavors, the optimizer's settings, the error type

PROG = "torchtitan_eager"
BenchError = tl.BenchError
torch = nn = F = None


def _import_torch():
    global torch, nn, F
    tl._import_torch()
    torch, nn, F = tl.torch, tl.nn, tl.F


def _define_model():
    class RMSNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def rotary(x, freqs):
        """x (batch, seq, heads, hd) turned pair by pair (2i, 2i + 1) by the complex
        frequencies (seq, hd / 2): a complex multiply over a float32 copy."""
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(3).type_as(x)

    def repeat_kv(x, rep):
        if rep == 1:
            return x
        b, s, kv, hd = x.shape
        return x[:, :, :, None, :].expand(b, s, kv, rep, hd).reshape(b, s, kv * rep, hd)

    class Attention(nn.Module):
        def __init__(self, a):
            super().__init__()
            self.n_heads, self.n_kv, self.hd = a.n_heads, a.kv_heads(), a.head_dim()
            self.wq = nn.Linear(a.dim, self.n_heads * self.hd, bias=False)
            self.wk = nn.Linear(a.dim, self.n_kv * self.hd, bias=False)
            self.wv = nn.Linear(a.dim, self.n_kv * self.hd, bias=False)
            self.wo = nn.Linear(self.n_heads * self.hd, a.dim, bias=False)

        def forward(self, x, freqs):
            b, s, _ = x.shape
            q = rotary(self.wq(x).view(b, s, self.n_heads, self.hd), freqs)
            k = rotary(self.wk(x).view(b, s, self.n_kv, self.hd), freqs)
            v = self.wv(x).view(b, s, self.n_kv, self.hd)
            rep = self.n_heads // self.n_kv
            q, k, v = q.transpose(1, 2), repeat_kv(k, rep).transpose(1, 2), repeat_kv(v, rep).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))

    FeedForward = tl.transformer_class().FeedForward  # w2(silu(w1 x) * w3 x), torch_llama.py's

    class Block(nn.Module):
        def __init__(self, a):
            super().__init__()
            self.attention_norm = RMSNorm(a.dim, a.norm_eps)
            self.attention = Attention(a)
            self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
            self.feed_forward = FeedForward(a)

        def forward(self, x, freqs):
            h = x + self.attention(self.attention_norm(x), freqs)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self, a, seq):
            super().__init__()
            self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
            self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
            self.norm = RMSNorm(a.dim, a.norm_eps)
            self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
            inv = torch.tensor(tl.rope_inv_freq(a.head_dim(), a.rope_theta, a.rope_scaling), dtype=torch.float64)
            angle = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
            self.register_buffer("freqs", torch.polar(torch.ones_like(angle), angle).to(torch.complex64),
                                 persistent=False)

        def forward(self, tokens, targets):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h, self.freqs[: tokens.shape[1]])
            logits = self.output(self.norm(h))
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    return Transformer


class MixedPrecisionStep:
    """One training step as FSDP2's mixed precision runs it on one rank: the float32
    parameters (the optimizer's) cast into the model's bfloat16 ones, forward and backward
    in bfloat16, the bfloat16 gradients cast to float32, clipping and AdamW, foreach."""

    def __init__(self, model, max_norm, sdpa_context):
        self.model, self.max_norm, self.sdpa_context = model, max_norm, sdpa_context
        self.master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
        for p in self.master:
            p.grad = torch.zeros_like(p)
        with torch.no_grad():  # the parameters only: Module.to(dtype) would cast the complex frequencies too
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
        self.low = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.master, lr=tl.ADAMW_LR, betas=tl.ADAMW_BETAS, eps=tl.ADAMW_EPS,
                                           weight_decay=tl.ADAMW_WEIGHT_DECAY, foreach=True, fused=False)

    def __call__(self, tokens, targets, marks=None):
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.low], self.master)
        with self.sdpa_context():
            loss = self.model(tokens, targets)
            loss.backward()
        if marks:
            marks.record()
        with torch.no_grad():
            torch._foreach_copy_([p.grad for p in self.master], [p.grad for p in self.low])
        for p in self.low:
            p.grad = None
        if self.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.master, self.max_norm, foreach=True)
        self.optimizer.step()
        return loss.detach()


def _fully_shard_api():
    """FSDP2's fully_shard and MixedPrecisionPolicy: public since torch 2.6, under
    torch.distributed._composable.fsdp before (torchtitan's torch of the day)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:
            raise BenchError(f"--fsdp2: torch {torch.__version__} has no FSDP2 (fully_shard)") from None
    return fully_shard, MixedPrecisionPolicy


class FSDP2Step:
    """One training step as torchtitan ran it, on a one-rank mesh: the model wrapped by
    FSDP2 as torchtitan wrapped it (each block, all but the last resharded after its
    forward, then the model; bfloat16 parameters in the forward and backward, gradients
    reduced in float32), the loss's backward, then clipping and AdamW, foreach, over the
    float32 DTensor parameters. The process group (one rank) is the caller's."""

    def __init__(self, model, max_norm, sdpa_context, device_type):
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard, MixedPrecisionPolicy = _fully_shard_api()
        self.model, self.max_norm, self.sdpa_context = model, max_norm, sdpa_context
        mesh = init_device_mesh(device_type, (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        n = len(model.layers)
        for i, block in enumerate(model.layers):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        self.params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=tl.ADAMW_LR, betas=tl.ADAMW_BETAS, eps=tl.ADAMW_EPS,
                                           weight_decay=tl.ADAMW_WEIGHT_DECAY, foreach=True, fused=False)

    def __call__(self, tokens, targets, marks=None):
        self.optimizer.zero_grad()
        with self.sdpa_context():
            loss = self.model(tokens, targets)
            loss.backward()
        if marks:
            marks.record()
        if self.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.optimizer.step()
        return loss.detach()


@contextlib.contextmanager
def one_rank_group(cuda):
    """A process group of this one rank (NCCL on a GPU, gloo on the CPU), for FSDP2."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise BenchError("--fsdp2: a process group is already initialized; run this script on its own")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class HostMarks:
    """The host's clock at a step's start, after its backward and at its end (the CPU)."""

    def __init__(self):
        self.t = [time.perf_counter()]

    def record(self):
        self.t.append(time.perf_counter())

    def seconds(self):
        self.t.append(time.perf_counter())
        return (self.t[1] - self.t[0], self.t[2] - self.t[1])


class Marks:
    """CUDA events at a step's start, after its backward and at its end."""

    def __init__(self):
        self.start, self.backward, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(3))

    def record(self):
        self.backward.record()

    def seconds(self):
        return (self.start.elapsed_time(self.backward) / 1e3, self.backward.elapsed_time(self.end) / 1e3)


KERNEL_CLASSES = (  # first match wins: cuDNN's attention kernels have gemm-like names too
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn", re.I)),
    ("GEMMs", re.compile(r"gemm|nvjet|cutlass|xmma|matmul|_mma_", re.I)),
    ("memory copies", re.compile(r"^memcpy|^memset", re.I)),
    ("collectives", re.compile(r"nccl", re.I)),
)


TOP_KERNELS = 40  # the kernels --json lists by name, longest in all first


def kernel_class(name):
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return cls
    return "other kernels"


def profile_step(step, tokens, targets):
    """Kernel time by class over one step, and the step's wall time, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step(tokens, targets)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out = device_time_by_class(prof.key_averages())
    busy = out["kernel_seconds"]
    return {"wall_seconds": wall, "busy_fraction": busy / wall if wall > 0 else None, **out}


def device_time_by_class(events):
    """The device's time from torch.profiler's key_averages(): by class, the costliest
    kernels by name, and the annotated regions apart. The device's events are kernels and
    copies, and the spans of the annotated regions (record_function: FSDP2 marks its
    copies and collectives so, the optimizer its step) over the kernels they hold: those
    are kept apart, or every kernel in one would be counted twice."""
    classes, kernels, regions = {}, {}, {}
    for e in events:
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if not us or str(getattr(e, "device_type", "")).split(".")[-1] not in ("CUDA", "PrivateUse1"):
            continue
        entry = {"seconds": us / 1e6, "count": e.count}
        if getattr(e, "is_user_annotation", False):
            regions[e.key] = entry
            continue
        kernels[e.key] = entry
        c = classes.setdefault(kernel_class(e.key), {"seconds": 0.0, "count": 0})
        c["seconds"] += entry["seconds"]
        c["count"] += e.count
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["seconds"])[:TOP_KERNELS]
    return {"kernel_seconds": sum(c["seconds"] for c in classes.values()), "classes": classes, "regions": regions,
            "top_kernels": [{"name": name, "class": kernel_class(name), **v} for name, v in top]}


def choose_attention(a, ns, cuda):
    """cuDNN's attention where it runs this shape (llama-plan's GPU profiles price cuDNN's),
    else flash; the CPU's math path for the self-test's sizes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not cuda:
        return SDPBackend.MATH
    q = torch.randn(ns.batch, a.n_heads, ns.seq, a.head_dim(), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            torch.cuda.synchronize()
            return backend
        except RuntimeError:
            continue
    raise BenchError("neither cuDNN's nor the flash attention of this torch runs "
                     f"batch {ns.batch} x seq {ns.seq} x {a.n_heads} heads of {a.head_dim()}")


def read_plan(path, ns):
    j = tl.read_json(path, "--plan-json")
    if not isinstance(j, dict):
        raise BenchError(f"--plan-json {path}: not a JSON object (llama-plan --json for one layout)")
    for key in ("step_seconds", "tokens_per_sec"):
        if key not in j:
            raise BenchError(f"--plan-json {path}: no '{key}' (llama-plan --json for one layout)")
    # One device's plan has its time by class under breakdown; a layout's (--plan.runtime,
    # --gpus) under each pipeline position: one here.
    if "breakdown" in j:
        j["time"] = j["breakdown"]["time"]
    elif len(j.get("positions", [])) == 1 and "time" in j["positions"][0]:
        j["time"] = j["positions"][0]["time"]
        j["costliest"] = j["positions"][0].get("costliest", [])
    else:
        raise BenchError(f"--plan-json {path}: no time by class for one position (llama-plan --json for one GPU)")
    # The run it plans must be this one (its depth, --model.n_layers, the JSON does not name).
    for key, want in (("flavor", ns.flavor), ("training.seq_len", ns.seq), ("training.local_batch_size", ns.batch)):
        if key in j and j[key] != want:
            raise BenchError(f"--plan-json {path}: {key} is {j[key]}, this run's is {want}")
    return j


def read_baseline(path, ns):
    """The emulated run's --json, for --fsdp2 to set its step against: the same run."""
    j = tl.read_json(path, "--baseline-json")
    if not isinstance(j, dict) or "step_seconds" not in j:
        raise BenchError(f"--baseline-json {path}: no 'step_seconds' (this script's --json of a run without --fsdp2)")
    if j.get("fsdp2"):
        raise BenchError(f"--baseline-json {path}: a run with --fsdp2; the baseline is the run without")
    for key, want in (("flavor", ns.flavor), ("n_layers", ns.n_layers), ("batch", ns.batch), ("seq", ns.seq),
                      ("tiny", ns.tiny)):
        if j.get(key, False) != want:
            raise BenchError(f"--baseline-json {path}: {key} is {j.get(key)}, this run's is {want}")
    return j


def tiny(a):
    """`a` at width 64 (4 heads, the same share of key/value heads, a vocabulary of 256):
    its blocks and tensors, each a few thousand elements, so that a step is the host's
    own work."""
    kv = max(1, 4 * a.kv_heads() // a.n_heads)
    return dataclasses.replace(a, dim=64, n_heads=4, n_kv_heads=kv, vocab_size=256, multiple_of=64)


def run(ns):
    a = dataclasses.replace(tl.model_flavor(ns.flavor), n_layers=ns.n_layers)
    if ns.tiny:
        a = tiny(a)
    if ns.seq > a.max_seq_len:
        raise BenchError(f"seq {ns.seq} exceeds {ns.flavor}'s max_seq_len {a.max_seq_len}")
    if a.tie_embeddings:
        raise BenchError(f"{ns.flavor} ties its embeddings; torchtitan's table ran untied models")
    plan = read_plan(ns.plan_json, ns) if ns.plan_json else None
    baseline = read_baseline(ns.baseline_json, ns) if ns.baseline_json else None
    cuda = ns.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise BenchError(f"--device cuda: no CUDA device is visible to torch {torch.__version__}")
    if not ns.fsdp2:
        return measure(ns, a, plan, None, cuda)
    with one_rank_group(cuda):
        return measure(ns, a, plan, baseline, cuda)


def measure(ns, a, plan, baseline, cuda):
    backend = choose_attention(a, ns, cuda)

    def sdpa_context():
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(backend)

    dev = torch.device(ns.device)
    torch.manual_seed(ns.seed)
    with dev:
        model = _define_model()(a, ns.seq)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    step = (FSDP2Step(model, ns.max_norm, sdpa_context, dev.type) if ns.fsdp2
            else MixedPrecisionStep(model, ns.max_norm, sdpa_context))
    gen = torch.Generator(device=dev).manual_seed(ns.seed + 1)
    data = torch.randint(0, a.vocab_size, (ns.batch, ns.seq + 1), device=dev, generator=gen)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    losses = [step(tokens, targets) for _ in range(ns.warmup)]
    times, phases = [], []
    for _ in range(ns.steps):
        if cuda:
            m = Marks()
            m.start.record()
            losses.append(step(tokens, targets, m))
            m.end.record()
            torch.cuda.synchronize()
            fb, opt = m.seconds()
            times.append(fb + opt)
            phases.append((fb, opt))
        else:
            m = HostMarks()
            losses.append(step(tokens, targets, m))
            fb, opt = m.seconds()
            times.append(fb + opt)
            phases.append((fb, opt))
    losses = [float(x) for x in losses]
    if not all(math.isfinite(x) for x in losses):
        raise BenchError(f"the loss is not finite: {losses}")
    median = statistics.median(times)
    out = {
        "flavor": ns.flavor, "n_layers": a.n_layers, "batch": ns.batch, "seq": ns.seq, "device": tl.device_name(ns.device),
        "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "num_params": a.num_params(), "step_seconds": median, "step_seconds_all": times,
        "tokens_per_sec": ns.batch * ns.seq / median, "losses": losses,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "attention": str(backend).split(".")[-1], "fsdp2": ns.fsdp2, "tiny": ns.tiny,
    }
    if phases:
        out["forward_backward_seconds"] = statistics.median(p[0] for p in phases)
        out["optimizer_seconds"] = statistics.median(p[1] for p in phases)
    if cuda:
        out["profile"] = profile_step(step, tokens, targets)
    print(f"{PROG}: {out['device']}, torch {out['torch']}: {ns.flavor} with {a.n_layers} layers "
          f"({a.num_params():,} parameters), batch {ns.batch} x seq {ns.seq}, attention {out['attention']}, "
          f"{'FSDP2 on one rank' if ns.fsdp2 else 'mixed precision emulated'}, median of {ns.steps} steps"
          f"{' (--tiny: width 64, the host work)' if ns.tiny else ''}")
    print(f"  step {median * 1e3:.2f} ms, {out['tokens_per_sec']:.0f} tokens/s")
    print(f"  forward and backward {out['forward_backward_seconds'] * 1e3:.2f} ms, "
          f"{'clipping and AdamW' if ns.fsdp2 else 'the casts, clipping and AdamW'} "
          f"{out['optimizer_seconds'] * 1e3:.2f} ms")
    if cuda:
        p = out["profile"]
        print(f"  one profiled step: {p['wall_seconds'] * 1e3:.2f} ms, kernels {p['kernel_seconds'] * 1e3:.2f} ms "
              f"(the GPU busy {100 * p['busy_fraction']:.1f}% of it)")
        for name, c in sorted(p["classes"].items(), key=lambda kv: -kv[1]["seconds"]):
            print(f"    {name:<16} {c['seconds'] * 1e3:9.2f} ms  ({c['count']} kernels)")
        for k in p["top_kernels"][:8]:
            print(f"      {k['seconds'] * 1e3:8.2f} ms x{k['count']:<4} {k['name'][:100]}")
        if p["regions"]:
            print("    annotated regions on the device (their kernels are counted above):")
            for name, c in sorted(p["regions"].items(), key=lambda kv: -kv[1]["seconds"])[:8]:
                print(f"      {c['seconds'] * 1e3:8.2f} ms x{c['count']:<4} {name[:100]}")
    if baseline:
        base = baseline["step_seconds"]
        out["baseline"] = {"step_seconds": base, "fsdp2_over_emulated": median / base}
        line = f"  over the emulated step ({base * 1e3:.2f} ms): x{median / base:.3f}, {(median - base) * 1e3:+.2f} ms"
        if "forward_backward_seconds" in baseline and "optimizer_seconds" in baseline:
            line += (f" (forward and backward {(out['forward_backward_seconds'] - baseline['forward_backward_seconds']) * 1e3:+.2f}"
                     f" ms, optimizer {(out['optimizer_seconds'] - baseline['optimizer_seconds']) * 1e3:+.2f} ms)")
        print(line)
    if plan:
        t = plan["time"]
        out["plan"] = {"step_seconds": plan["step_seconds"], "tokens_per_sec": plan["tokens_per_sec"],
                       "time": t, "measured_over_predicted": median / plan["step_seconds"]}
        print(f"  llama-plan ({plan.get('machine', '?')}): step {plan['step_seconds'] * 1e3:.2f} ms; measured / "
              f"predicted {median / plan['step_seconds']:.3f}")
        for name, c in t.items():
            print(f"    predicted {name:<22} {c['seconds'] * 1e3:9.2f} ms  ({c['count']} operations)")
        if plan.get("costliest"):  # to set beside the costliest kernels measured (--json has both)
            out["plan"]["costliest"] = plan["costliest"]
            for o in plan["costliest"][:8]:
                print(f"      {o['seconds'] * 1e3:8.2f} ms x{o['count']:<4} {o['what'][:100]}")
    if ns.json:
        tl.write_json(ns.json, out)
    return 0


def self_test():
    """The debug flavor on the CPU: the model's shapes, the rotary turn, the repeated heads,
    three steps of the mixed-precision step with the loss going down and the float32
    parameters moving, the same three steps under FSDP2 on one rank giving the same
    losses, and the kernel classes."""
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    def check(cond, what):
        if not cond:
            raise BenchError(f"self-test failed: {what}")

    a = dataclasses.replace(tl.model_flavor("debugmodel"), n_layers=2, n_kv_heads=4)
    torch.manual_seed(0)
    model = _define_model()(a, 32)
    # The rotary turn keeps each pair's length and turns position 0 by nothing.
    x = torch.randn(1, 32, 2, a.head_dim())
    r = torch.view_as_real(torch.view_as_complex(x.reshape(1, 32, 2, -1, 2)) * model.freqs[None, :, None, :]).flatten(3)
    check(torch.allclose(r[:, 0], x[:, 0]), "rotary: position 0 is turned")
    check(torch.allclose(r.reshape(1, 32, 2, -1, 2).norm(dim=-1), x.reshape(1, 32, 2, -1, 2).norm(dim=-1), atol=1e-5),
          "rotary: a pair's length changes")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    twin = _define_model()(a, 32)  # the same weights, for FSDP2 below
    twin.load_state_dict(model.state_dict())
    step = MixedPrecisionStep(model, 1.0, contextlib.nullcontext)
    check(all(p.dtype == torch.bfloat16 for p in model.parameters()), "the model's parameters are not bfloat16")
    check(model.freqs.dtype == torch.complex64, f"the rotary frequencies became {model.freqs.dtype}")
    check(all(p.dtype == torch.float32 for p in step.master), "the optimizer's parameters are not float32")
    data = torch.randint(0, a.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    before = [p.detach().clone() for p in step.master]
    losses = [float(step(tokens, targets)) for _ in range(3)]
    check(all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], f"the loss does not go down: {losses}")
    check(all(not torch.equal(b, p) for b, p in zip(before, step.master)), "a float32 parameter did not move")
    # FSDP2 on one rank runs the same step: its float32 DTensor parameters, the same losses.
    with one_rank_group(False):
        fsdp2 = FSDP2Step(twin, 1.0, contextlib.nullcontext, "cpu")
        check(all(type(p).__name__ == "DTensor" and p.dtype == torch.float32 for p in fsdp2.params),
              "FSDP2's parameters are not float32 DTensors")
        fsdp2_losses = [float(fsdp2(tokens, targets)) for _ in range(3)]
    check(all(abs(x - y) <= 2e-3 * abs(y) for x, y in zip(fsdp2_losses, losses)),
          f"FSDP2's losses {fsdp2_losses} are not the emulated step's {losses}")
    # --tiny keeps the flavor's blocks and its share of key/value heads.
    t = tiny(tl.model_flavor("llama3_8b"))
    check(t.dim == 64 and t.n_layers == 32 and t.n_heads // t.kv_heads() == 4 and t.vocab_size == 256,
          f"--tiny of llama3_8b: {t}")
    # The repeated heads: query head h reads key/value head h // rep.
    k = torch.randn(1, 3, 2, 4)
    att = model.layers[0].attention
    check(att.n_heads // att.n_kv == 4, "debug model with 4 kv heads: 4 query heads each")
    rep = k[:, :, :, None, :].expand(1, 3, 2, 2, 4).reshape(1, 3, 4, 4)
    check(torch.equal(rep[:, :, 1], k[:, :, 0]) and torch.equal(rep[:, :, 2], k[:, :, 1]), "repeated heads out of order")
    for name, cls in [("sm90_xmma_gemm_bf16bf16_bf16f32", "GEMMs"), ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNN", "GEMMs"),
                      ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
                      ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
                      ("void pytorch_flash::flash_fwd_kernel<...>", "attention"), ("Memcpy DtoD (Device -> Device)",
                                                                                   "memory copies"),
                      ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
                       "other kernels")]:
        check(kernel_class(name) == cls, f"kernel class of {name}: {kernel_class(name)}, expected {cls}")
    # The device's time: an annotated region's span is kept apart from the kernels it holds.
    ev = lambda key, us, n, region=False: types.SimpleNamespace(key=key, self_device_time_total=us, count=n,
                                                               device_type="DeviceType.CUDA", is_user_annotation=region)
    t = device_time_by_class([ev("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 3000, 3),
                              ev("void at::native::multi_tensor_apply_kernel<...>", 1000, 8),
                              ev("Optimizer.step#AdamW.step", 1100, 1, True),
                              types.SimpleNamespace(key="aten::mm", self_device_time_total=0, count=3, device_type="DeviceType.CPU")])
    check(abs(t["kernel_seconds"] - 4e-3) < 1e-12 and set(t["classes"]) == {"GEMMs", "other kernels"}
          and t["regions"] == {"Optimizer.step#AdamW.step": {"seconds": 1.1e-3, "count": 1}}
          and [k["class"] for k in t["top_kernels"]] == ["GEMMs", "other kernels"], f"device time by class: {t}")
    # Out of memory is one line and exit status 1, whatever raised it.
    real_run = globals()["run"]
    try:
        globals()["run"] = lambda ns: (_ for _ in ()).throw(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main(["--device", "cpu", "--flavor", "debugmodel", "--seq", "64", "--n-layers", "2"])
        check(status == 1 and err.getvalue().strip() == f"{PROG}: out of memory: debugmodel with 2 blocks at batch 2 x seq "
              "64 (fewer --n-layers fit)", f"the out-of-memory line: {status}, {err.getvalue()!r}")
    finally:
        globals()["run"] = real_run
    print(f"{PROG}: self-test passed (losses {', '.join(f'{v:.4f}' for v in losses)}; "
          f"under FSDP2 {', '.join(f'{v:.4f}' for v in fsdp2_losses)})")
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(prog="torchtitan_eager.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="llama2_13b", help="model flavor, as tessera names them (default llama2_13b)")
    p.add_argument("--n-layers", type=int, default=6, help="blocks (default 6: what one 80 GB GPU holds at 13B's width)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2, the table's 13B rows)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--max-norm", type=float, default=tl.MAX_NORM, help="gradient clipping (default 1.0; <= 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fsdp2", action="store_true",
                   help="run the model under FSDP2 itself on a one-rank mesh, as torchtitan wrapped it")
    p.add_argument("--baseline-json", metavar="PATH",
                   help="with --fsdp2: the --json of the same run without it, to print the step over it")
    p.add_argument("--tiny", action="store_true",
                   help="the flavor's blocks and tensors at width 64: the step is the host's work (--device cpu)")
    p.add_argument("--plan-json", metavar="PATH", help="llama-plan --json for the same run: printed beside")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--self-test", action="store_true", help="check this script on the CPU and exit")
    ns = p.parse_args(argv)
    for key in ("batch", "seq", "steps", "n_layers"):
        if getattr(ns, key) <= 0:
            raise BenchError(f"--{key.replace('_', '-')} must be positive, got {getattr(ns, key)}")
    if ns.warmup < 0:
        raise BenchError(f"--warmup must not be negative, got {ns.warmup}")
    if ns.tiny and ns.plan_json:
        raise BenchError("--tiny runs no model llama-plan predicted: leave out --plan-json")
    if ns.baseline_json and not ns.fsdp2:
        raise BenchError("--baseline-json is the emulated run's, for a run with --fsdp2")
    return ns


def main(argv=None):
    try:
        ns = parse_args(sys.argv[1:] if argv is None else argv)
        if not ns.self_test:
            tl.model_flavor(ns.flavor)
            tl.set_allocator_conf(ns.device)
        _import_torch()
        if ns.self_test:
            return self_test()
        try:
            return run(ns)
        except Exception as e:  # noqa: BLE001 - out of memory is one line; anything else re-raised
            if not tl._is_oom(e):
                raise
            raise BenchError(f"out of memory: {ns.flavor} with {ns.n_layers} blocks at batch {ns.batch} x seq "
                             f"{ns.seq} (fewer --n-layers fit)") from None
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
