#!/usr/bin/env python3
"""torchtitan_eager: torchtitan's eager Llama step on one GPU, timed and profiled, against
llama-plan's prediction of it (`--plan.runtime torchtitan`).

llama-plan predicts torchtitan's published Llama table on 64 A100s 7 to 18% fast
(docs/planning.md, "The eager step, counted"). Its model of that step is a list of eager
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

It reports the median step (CUDA events), the forward-backward and the optimizer phases
apart, and from one profiled step the GPU's kernel time by class (GEMMs, attention, the
rest) and how much of the step the GPU was busy: an eager step whose host cannot keep
ahead of the GPU shows as idle time, which llama-plan does not price beyond a launch's
floor. With --plan-json (llama-plan --json for the same model, batch and sequence on this
GPU's profile) it prints the prediction beside each figure.

    python3 bench/torchtitan_eager.py --flavor llama2_13b --n-layers 6 --batch 2 --seq 4096 \\
        [--plan-json plan.json] [--json out.json]
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
        freqs = model.freqs  # Module.to(dtype) would cast the complex frequencies too
        model.to(torch.bfloat16)
        model.freqs = freqs
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
)


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
    classes = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if not us or str(getattr(e, "device_type", "")).split(".")[-1] not in ("CUDA", "PrivateUse1"):
            continue
        c = classes.setdefault(kernel_class(e.key), {"seconds": 0.0, "count": 0})
        c["seconds"] += us / 1e6
        c["count"] += e.count
    busy = sum(c["seconds"] for c in classes.values())
    return {"wall_seconds": wall, "kernel_seconds": busy, "busy_fraction": busy / wall if wall > 0 else None,
            "classes": classes}


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
    else:
        raise BenchError(f"--plan-json {path}: no time by class for one position (llama-plan --json for one GPU)")
    # The run it plans must be this one (its depth, --model.n_layers, the JSON does not name).
    for key, want in (("flavor", ns.flavor), ("training.seq_len", ns.seq), ("training.local_batch_size", ns.batch)):
        if key in j and j[key] != want:
            raise BenchError(f"--plan-json {path}: {key} is {j[key]}, this run's is {want}")
    return j


def run(ns):
    a = dataclasses.replace(tl.model_flavor(ns.flavor), n_layers=ns.n_layers)
    if ns.seq > a.max_seq_len:
        raise BenchError(f"seq {ns.seq} exceeds {ns.flavor}'s max_seq_len {a.max_seq_len}")
    if a.tie_embeddings:
        raise BenchError(f"{ns.flavor} ties its embeddings; torchtitan's table ran untied models")
    plan = read_plan(ns.plan_json, ns) if ns.plan_json else None
    cuda = ns.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise BenchError(f"--device cuda: no CUDA device is visible to torch {torch.__version__}")
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
    step = MixedPrecisionStep(model, ns.max_norm, sdpa_context)
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
            t0 = time.perf_counter()
            losses.append(step(tokens, targets))
            times.append(time.perf_counter() - t0)
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
        "attention": str(backend).split(".")[-1],
    }
    if phases:
        out["forward_backward_seconds"] = statistics.median(p[0] for p in phases)
        out["optimizer_seconds"] = statistics.median(p[1] for p in phases)
        out["profile"] = profile_step(step, tokens, targets)
    print(f"{PROG}: {out['device']}, torch {out['torch']}: {ns.flavor} with {a.n_layers} layers "
          f"({a.num_params():,} parameters), batch {ns.batch} x seq {ns.seq}, attention {out['attention']}, "
          f"median of {ns.steps} steps")
    print(f"  step {median * 1e3:.2f} ms, {out['tokens_per_sec']:.0f} tokens/s")
    if phases:
        print(f"  forward and backward {out['forward_backward_seconds'] * 1e3:.2f} ms, "
              f"the casts, clipping and AdamW {out['optimizer_seconds'] * 1e3:.2f} ms")
        p = out["profile"]
        print(f"  one profiled step: {p['wall_seconds'] * 1e3:.2f} ms, kernels {p['kernel_seconds'] * 1e3:.2f} ms "
              f"(the GPU busy {100 * p['busy_fraction']:.1f}% of it)")
        for name, c in sorted(p["classes"].items(), key=lambda kv: -kv[1]["seconds"]):
            print(f"    {name:<16} {c['seconds'] * 1e3:9.2f} ms  ({c['count']} kernels)")
    if plan:
        t = plan["time"]
        out["plan"] = {"step_seconds": plan["step_seconds"], "tokens_per_sec": plan["tokens_per_sec"],
                       "time": t, "measured_over_predicted": median / plan["step_seconds"]}
        print(f"  llama-plan ({plan.get('machine', '?')}): step {plan['step_seconds'] * 1e3:.2f} ms; measured / "
              f"predicted {median / plan['step_seconds']:.3f}")
        for name, c in t.items():
            print(f"    predicted {name:<22} {c['seconds'] * 1e3:9.2f} ms  ({c['count']} operations)")
    if ns.json:
        try:
            with open(ns.json, "w") as f:
                json.dump(out, f, indent=2)
                f.write("\n")
        except OSError as e:
            raise BenchError(f"--json {ns.json}: {e.strerror}") from None
    return 0


def self_test():
    """The debug flavor on the CPU: the model's shapes, the rotary turn, the repeated heads,
    three steps of the mixed-precision step with the loss going down and the float32
    parameters moving, and the kernel classes."""
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
    # The repeated heads: query head h reads key/value head h // rep.
    k = torch.randn(1, 3, 2, 4)
    att = model.layers[0].attention
    check(att.n_heads // att.n_kv == 4, "debug model with 4 kv heads: 4 query heads each")
    rep = k[:, :, :, None, :].expand(1, 3, 2, 2, 4).reshape(1, 3, 4, 4)
    check(torch.equal(rep[:, :, 1], k[:, :, 0]) and torch.equal(rep[:, :, 2], k[:, :, 1]), "repeated heads out of order")
    for name, cls in [("sm90_xmma_gemm_bf16bf16_bf16f32", "GEMMs"), ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNN", "GEMMs"),
                      ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
                      ("void pytorch_flash::flash_fwd_kernel<...>", "attention"), ("Memcpy DtoD (Device -> Device)",
                                                                                   "memory copies"),
                      ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
                       "other kernels")]:
        check(kernel_class(name) == cls, f"kernel class of {name}: {kernel_class(name)}, expected {cls}")
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
    print(f"{PROG}: self-test passed (losses {', '.join(f'{v:.4f}' for v in losses)})")
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
    p.add_argument("--plan-json", metavar="PATH", help="llama-plan --json for the same run: printed beside")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--self-test", action="store_true", help="check this script on the CPU and exit")
    ns = p.parse_args(argv)
    for key in ("batch", "seq", "steps", "n_layers"):
        if getattr(ns, key) <= 0:
            raise BenchError(f"--{key.replace('_', '-')} must be positive, got {getattr(ns, key)}")
    if ns.warmup < 0:
        raise BenchError(f"--warmup must not be negative, got {ns.warmup}")
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
