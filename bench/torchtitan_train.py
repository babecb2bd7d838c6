#!/usr/bin/env python3
"""torchtitan_train: torchtitan's own Llama 3 training step on one GPU, timed as torch_llama.py times.

bench/torch_llama.py writes the model in plain PyTorch and gives it what a PyTorch user
would take; this script runs torchtitan itself: its model, its parallelize function
(activation checkpointing, torch.compile of each block and of the loss, mixed
precision), its loss, its optimizer and LR scheduler containers, and its Trainer's
train_step, on synthetic tokens. Nothing of torchtitan is copied here; the script
registers a TrainSpec (torchtitan's extension point) that is torchtitan's own "llama3"
spec with the data loader replaced by one that yields one fixed batch of random tokens,
and no tokenizer or validator, then builds torchtitan's Trainer from a JobConfig made by
torchtitan's ConfigManager.

It drives torchtitan 0.2 (torchtitan.train.Trainer with a JobConfig; 0.2.2 dates from
February 2026, the torch 2.11 cycle, the H200 image's torch). torchtitan 0.3 replaced
that API (Trainer.Config and model registries) and was validated against torch 2.14;
with it, or where anything else stops torchtitan from running (an import, a version, its
own error, memory), the script prints one line saying why and writes
`{"ran": false, "why": ...}`, exit status 0: the comparison goes on without this row. Bad
options exit 1.

torchtitan imports, at module load, libraries for its data pipeline, tokenizer and
metrics logging that this run does not use (datasets, tokenizers, torchdata,
tensorboard, tomli). Where one is not installed the script puts a placeholder module in
its place, which fails if anything is called on it, and the record lists the
placeholders. tyro (with docstring_parser and typeguard) is used for real and must be
installed or carried.

What it runs (torchtitan's defaults unless given): Llama 3 8B ("8B": tessera's
llama3_8b shape), batch 1 x seq 8192, --ac full (activation_checkpoint.mode full),
compile.enable with components model and loss (each TransformerBlock compiled with
fullgraph, the cross-entropy compiled), attention by torchtitan's
ScaledDotProductAttentionWrapper (SDPA with backend priority cuDNN, flash, math),
training.mixed_precision_param bfloat16 on one GPU without FSDP: torch.autocast(bfloat16)
around forward and loss (torchtitan's maybe_enable_amp), float32 parameters, AdamW
fused (optimizer.implementation), gradient clipping to training.max_norm 1.0. Timed as
torch_llama.py's docstring says (CUDA events at step boundaries, no host
synchronisation of this script's inside the timed steps, the median): each step is
torchtitan's Trainer.train_step, which copies the batch to the GPU with a blocking copy
(a host synchronisation at its start, torchtitan's own); the losses are taken from its
forward_backward_step as device tensors and read after the last event; metrics logging
(which reads the loss) is set to step 1 only, a warm-up step.

    pip install --no-deps --target DIR torchtitan-0.2.2-py3-none-any.whl tyro-*.whl ...
    PYTHONPATH=DIR python3 bench/torchtitan_train.py --flavor llama3_8b --batch 1 --seq 8192 --ac full \\
        --tessera-json train8b.json --json titan.json
    python3 bench/torchtitan_train.py --self-test-no-torch     # the pure-Python logic, no torch
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_llama as tl  # noqa: E402 - the flavors, the timing method, tessera's rows, JSON

PROG = "torchtitan_train"
BenchError = tl.BenchError
SPEC_NAME = "tessera_llama3_synthetic"
# tessera's flavor names and torchtitan 0.2's llama3 flavors of the same shape.
TORCHTITAN_FLAVORS = {"llama3_8b": "8B", "llama3_70b": "70B", "llama3.1_405b": "405B"}
SUPPORTED_SERIES = "0.2"
# Modules torchtitan 0.2 imports at load for what this run does not use: its data
# pipeline (datasets, torchdata), tokenizer (tokenizers), metrics logging (tensorboard,
# through torch.utils.tensorboard) and TOML configs (tomli, before Python 3.11).
PLACEHOLDER_CANDIDATES = {"datasets": "datasets", "tokenizers": "tokenizers", "torchdata": "torchdata",
                          "torch.utils.tensorboard": "tensorboard", "tomli": "tomli"}

ATTENTION = ("torchtitan's ScaledDotProductAttentionWrapper: F.scaled_dot_product_attention under "
             "sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, MATH], set_priority=True)")
PRECISION = ("training.mixed_precision_param bfloat16 on one GPU without FSDP: torch.autocast(bfloat16) around the "
             "forward and the loss (torchtitan's maybe_enable_amp); float32 parameters, gradients and AdamW moments")


def version_gate(version: str | None) -> str | None:
    """None where this script drives the installed torchtitan, else why not."""
    if not version:
        return "torchtitan is not installed (carry its wheel: tools/gpu_bundle.sh's TESSERA_WHEELS)"
    if version == SUPPORTED_SERIES or version.startswith(SUPPORTED_SERIES + "."):
        return None
    return (f"torchtitan {version} is installed; this script drives torchtitan {SUPPORTED_SERIES}.x's Trainer and "
            "JobConfig (0.3 replaced them with Trainer.Config and model registries, and was validated against "
            "torch 2.14)")


def job_args(*, flavor: str, batch: int, seq: int, ac: str, compile_: bool, steps: int, dump_folder: str) -> list:
    """torchtitan's command line for the run (ConfigManager.parse_args)."""
    args = ["--model.name", SPEC_NAME, "--model.flavor", flavor, "--training.local_batch_size", str(batch),
            "--training.seq_len", str(seq), "--training.steps", str(steps), "--activation_checkpoint.mode", ac,
            "--metrics.log_freq", str(10 ** 9), "--job.dump_folder", dump_folder,
            "--training.mixed_precision_param", "bfloat16"]
    if compile_:
        args += ["--compile.enable", "--compile.components", "model,loss"]
    return args


def not_ran(why: str, stage: str, **extra) -> dict:
    return dict({"ran": False, "why": why, "stage": stage}, **extra)


class _Absent:
    """What a placeholder module hands out: a class that fails when used."""

    _what = "?"

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{self._what} is a placeholder ({PROG}: not installed, and this run was not to use it)")


class _PlaceholderModule(types.ModuleType):
    __path__: list = []  # a package: its submodules import as placeholders too

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (_Absent,), {"__module__": self.__name__, "_what": f"{self.__name__}.{name}"})
        setattr(self, name, cls)
        return cls


class Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves placeholder modules for `names` and their submodules, ahead of the real
    import machinery."""

    def __init__(self, names):
        self.names = set(names)

    def covers(self, fullname: str) -> bool:
        return any(fullname == n or fullname.startswith(n + ".") for n in self.names)

    def find_spec(self, fullname, path, target=None):
        if self.covers(fullname):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module):
        module.__version__ = "0+placeholder"


def missing_modules(candidates: dict, importable) -> list[str]:
    """The module names of `candidates` (name -> the module that must import for it) that
    `importable(module)` says cannot be imported."""
    return [name for name, probe in candidates.items() if not importable(probe)]


# ---------------------------------------------------------------------------------------
# The run (needs torch and torchtitan).


def _importable(module: str) -> bool:
    return tl.import_error(module) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env():
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def synthetic_loader_builder(vocab_size: int, batch: int, seq: int, seed: int):
    """A build_dataloader_fn for the TrainSpec: one fixed batch of uniform random tokens
    (CPU tensors, as torchtitan's loaders yield them), forever."""
    torch = tl.torch
    from torchtitan.components.dataloader import BaseDataLoader

    class SyntheticTokens(BaseDataLoader):
        def __init__(self):
            gen = torch.Generator().manual_seed(seed + 1)
            data = torch.randint(0, vocab_size, (batch, seq + 1), generator=gen)
            self.inputs, self.labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()

        def __iter__(self):
            while True:
                yield {"input": self.inputs.clone()}, self.labels.clone()

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    def build(**kwargs):
        return SyntheticTokens()

    return build


def run(ns, started: float) -> dict:
    """Runs torchtitan's step; the record (ran or not, and why)."""
    base = {"flavor": ns.flavor, "torchtitan_flavor": TORCHTITAN_FLAVORS[ns.flavor], "batch": ns.batch,
            "seq": ns.seq, "ac": ns.ac, "compile": not ns.no_compile, "steps": ns.steps, "warmup": ns.warmup,
            "argv": ns.argv}
    try:
        tl._import_torch()
    except BenchError as e:
        return not_ran(str(e), "import", **base)
    torch = tl.torch
    base.update(torch=torch.__version__, cuda=torch.version.cuda)
    if not torch.cuda.is_available():
        return not_ran(f"no CUDA device is visible to this torch ({torch.__version__})", "import", **base)

    try:
        from importlib import metadata
        version = metadata.version("torchtitan")
    except Exception:  # noqa: BLE001 - not installed, or installed without its metadata
        version = None
    base["torchtitan"] = version
    why = version_gate(version)
    if why:
        return not_ran(why, "import", **base)

    missing = missing_modules(PLACEHOLDER_CANDIDATES, _importable)
    if missing:
        sys.meta_path.insert(0, Placeholders(missing))
    base["placeholders"] = missing
    stage = "import"
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.models.llama3 import get_train_spec
        from torchtitan.protocols.train_spec import register_train_spec
        from torchtitan.train import Trainer

        stage = "build"
        args = tl.model_flavor(ns.flavor)
        spec = dataclasses.replace(get_train_spec(), build_dataloader_fn=synthetic_loader_builder(
            args.vocab_size, ns.batch, ns.seq, ns.seed), build_tokenizer_fn=None, build_validator_fn=None)
        register_train_spec(SPEC_NAME, spec)
        _single_process_env()
        dump = tempfile.mkdtemp(prefix="torchtitan_train.")
        job_config = ConfigManager().parse_args(job_args(
            flavor=TORCHTITAN_FLAVORS[ns.flavor], batch=ns.batch, seq=ns.seq, ac=ns.ac, compile_=not ns.no_compile,
            steps=ns.warmup + ns.steps, dump_folder=dump))
        trainer = Trainer(job_config)

        stage = "step"
        losses = []
        fwd_bwd = trainer.forward_backward_step

        def forward_backward_step(**kwargs):  # the loss as a device tensor, read at the end
            loss = fwd_bwd(**kwargs)
            losses.append(loss.detach())
            return loss

        trainer.forward_backward_step = forward_backward_step
        data_iterator = trainer.batch_generator(trainer.dataloader)

        def step():
            trainer.step += 1
            trainer.gc_handler.run(trainer.step)
            trainer.train_step(data_iterator)

        warm_start = time.perf_counter()
        for _ in range(ns.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        warmup_seconds = time.perf_counter() - warm_start
        events = [torch.cuda.Event(enable_timing=True) for _ in range(ns.steps + 1)]
        events[0].record()
        for i in range(ns.steps):
            step()
            events[i + 1].record()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - whatever stops torchtitan is this row's answer
        oom = tl._is_oom(e)
        why = f"{stage}: {'out of memory: ' if oom else ''}{type(e).__name__}: {tl._first_line(e)}"
        return not_ran(why, stage, **base)

    times = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(ns.steps)]
    loss_values = torch.stack(losses).float().cpu().tolist()
    step_seconds = statistics.median(times)
    tps = ns.batch * ns.seq / step_seconds
    fpt = args.flops_per_token(ns.seq)
    fpt_half = args.flops_per_token(ns.seq, causal_halved=True)
    ran = {"attention": ATTENTION, "precision": PRECISION,
           "compile": "each TransformerBlock torch.compile(fullgraph=True) and the loss torch.compile"
                      if not ns.no_compile else "none (eager)",
           "loss_head": "torchtitan's cross_entropy_loss over the full vocabulary (float32 logits)",
           "activation_checkpointing": ns.ac,
           "optimizer": f"torchtitan's OptimizersContainer AdamW, implementation "
                        f"{job_config.optimizer.implementation}, lr {job_config.optimizer.lr:g}, "
                        f"clip {job_config.training.max_norm:g}",
           "step": "torchtitan.train.Trainer.train_step (a blocking copy of the batch to the GPU at its start)",
           "timing": tl.TIMING_METHOD, "placeholders": missing}
    return dict(base, ran=True, why=None, what_ran=ran, device=tl.device_name("cuda"),
                cudnn=torch.backends.cudnn.version(), tokens_per_sec=tps, step_seconds=step_seconds,
                step_seconds_all=times, warmup_seconds=warmup_seconds, losses=loss_values,
                peak_memory_bytes=torch.cuda.max_memory_allocated(),
                peak_memory_reserved_bytes=torch.cuda.max_memory_reserved(),
                torchtitan_flops_per_token=getattr(trainer.metrics_processor, "num_flops_per_token", None),
                flops_per_token=fpt, mfu=tps * fpt / (ns.peak_tflops * 1e12),
                mfu_causal_halved=tps * fpt_half / (ns.peak_tflops * 1e12), peak_tflops=ns.peak_tflops,
                seconds=time.monotonic() - started)


# ---------------------------------------------------------------------------------------


def self_test_no_torch() -> int:
    """The options, the version gate, the placeholders and the not-ran record, without torch."""
    check = tl._check
    check("torch" not in sys.modules, "torch was imported")
    ns = parse_args([])
    check((ns.flavor, ns.batch, ns.seq, ns.ac, ns.no_compile, ns.steps, ns.warmup)
          == ("llama3_8b", 1, 8192, "full", False, 5, 2), f"defaults {ns}")
    for argv, text in [(["--flavor", "llama3.2_1b"], "invalid choice: 'llama3.2_1b'"), (["--steps", "0"],
                                                                                          "--steps must be positive"),
                       (["--ac", "op"], "invalid choice: 'op'")]:
        tl._expect_error(lambda: parse_args(argv), text, f"options {argv}")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["--batch", "-1"])
    check(status == 1 and err.getvalue().startswith(f"{PROG}: ") and len(err.getvalue().strip().splitlines()) == 1,
          f"bad input: one line, status 1 ({status} {err.getvalue()!r})")

    check(version_gate("0.2.2") is None and version_gate("0.2.0.dev20260101") is None, "0.2.x is driven")
    check("0.3 replaced" in (version_gate("0.3.0") or "") and "not installed" in (version_gate(None) or ""),
          "0.3 and none are refused, saying why")
    args = job_args(flavor="8B", batch=1, seq=8192, ac="full", compile_=True, steps=7, dump_folder="/d")
    pairs = dict(zip(args[::2], args[1::2]))
    check(pairs["--model.name"] == SPEC_NAME and pairs["--model.flavor"] == "8B" and pairs["--training.steps"] == "7"
          and pairs["--activation_checkpoint.mode"] == "full" and "--compile.enable" in args
          and "model,loss" in args, f"torchtitan's arguments {args}")
    check("--compile.enable" not in job_args(flavor="8B", batch=1, seq=8192, ac="full", compile_=False, steps=7,
                                             dump_folder="/d"), "no compile")

    # Placeholders: served for the names given and their submodules only, failing on use.
    name = "tessera_placeholder_probe"
    finder = Placeholders([name])
    sys.meta_path.insert(0, finder)
    try:
        mod = importlib.import_module(name + ".sub.deeper")
        from_import = importlib.import_module(name).Tokenizer
        check(mod.__name__ == name + ".sub.deeper" and issubclass(from_import, _Absent), "placeholder modules")
        try:
            from_import()
            check(False, "a placeholder class was instantiated")
        except RuntimeError as e:
            check(f"{name}.Tokenizer is a placeholder" in str(e), f"placeholder message {e}")
        check(not finder.covers("json") and finder.find_spec("jsonx", None) is None, "placeholders cover only their names")
    finally:
        sys.meta_path.remove(finder)
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
    check(missing_modules({"a": "x", "b": "y"}, lambda m: m == "y") == ["a"], "missing modules")
    rec = not_ran("torchtitan 0.3.0 is installed", "import", flavor="llama3_8b")
    check(rec["ran"] is False and rec["why"].startswith("torchtitan") and rec["stage"] == "import", f"record {rec}")
    json.dumps(rec)
    print(f"{PROG}: self-test without torch: OK")
    return 0


def parse_args(argv):
    p = tl._Parser(prog="torchtitan_train.py",
                   description="torchtitan's own Llama 3 training step on one GPU, timed as torch_llama.py times it.")
    p.add_argument("--flavor", choices=sorted(TORCHTITAN_FLAVORS), default="llama3_8b",
                   help="tessera's flavor name of a torchtitan llama3 flavor (default llama3_8b: torchtitan's 8B)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--ac", choices=["full", "selective", "none"], default="full",
                   help="activation_checkpoint.mode (default full, as tessera's 8B row)")
    p.add_argument("--no-compile", action="store_true", help="leave compile.enable off (torchtitan's eager step)")
    p.add_argument("--steps", type=int, default=5, help="timed steps; the median is reported (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first; compilation happens here (default 2)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the dense bf16 peak for MFU (default 989)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the record as JSON (also when torchtitan did not run)")
    p.add_argument("--tessera-json", metavar="PATH", action="append", default=[],
                   help="tessera's results (bench-train --json); the row of this flavor, batch, seq and AC")
    p.add_argument("--self-test-no-torch", action="store_true", help="check the pure-Python logic and exit")
    ns = p.parse_args(argv)
    for key in ("batch", "seq", "steps"):
        if getattr(ns, key) <= 0:
            raise BenchError(f"--{key} must be positive, got {getattr(ns, key)}")
    if ns.warmup < 1:
        raise BenchError(f"--warmup must be at least 1 (compilation and the first step's logging), got {ns.warmup}")
    if not ns.peak_tflops > 0:
        raise BenchError(f"--peak-tflops must be positive, got {ns.peak_tflops}")
    ns.argv = list(argv)
    return ns


def main(argv=None) -> int:
    started = time.monotonic()
    try:
        argv = sys.argv[1:] if argv is None else argv
        ns = parse_args(argv)
        if ns.self_test_no_torch:
            return self_test_no_torch()
        args = tl.model_flavor(ns.flavor)
        if ns.seq > args.max_seq_len:
            raise BenchError(f"seq {ns.seq} exceeds {ns.flavor}'s max_seq_len {args.max_seq_len}")
        tessera = tl.read_tessera(ns.tessera_json, ns.flavor, ns.batch, ns.seq, ns.ac) if ns.tessera_json else None
        tl.set_allocator_conf("cuda")
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        rec = run(ns, started)
        rec.update(date=date, tessera=tessera)
        if rec["ran"]:
            rec["ratio"] = {"tessera/torchtitan": tessera["tokens_per_sec"] / rec["tokens_per_sec"]} if tessera else None
            print(f"{PROG}: torchtitan {rec['torchtitan']} on {rec['device']}; torch {rec['torch']}; {date}")
            for k, v in rec["what_ran"].items():
                print(f"torchtitan side: {k}: {v}")
            print(f"torchtitan {rec['torchtitan_flavor']} ({ns.flavor}) batch {ns.batch} x seq {ns.seq}: "
                  f"{rec['tokens_per_sec']:.0f} tokens/s  step {rec['step_seconds']:.4f} s (median of {ns.steps})  "
                  f"MFU {tl.pct(rec['mfu'])} (causal-halved {tl.pct(rec['mfu_causal_halved'])})  peak memory "
                  f"{tl.gib(rec['peak_memory_bytes'])}  loss {rec['losses'][0]:.3f} -> {rec['losses'][-1]:.3f}  "
                  f"[warm-up {rec['warmup_seconds']:.1f} s]")
            if tessera:
                print(f"tessera: {tessera['tokens_per_sec']:.0f} tokens/s ({tessera['path']}); tessera / torchtitan "
                      f"{rec['ratio']['tessera/torchtitan']:.3f}x")
        else:
            print(f"{PROG}: did not run: {rec['why']}")
        if ns.json:
            tl.write_json(ns.json, rec)
        return 0
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
