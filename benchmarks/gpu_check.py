"""One command for a GPU machine: everything the GPU-correctness and GPU-throughput checks ask, in one report.

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_report [--sections suite,e2e,...]
    python benchmarks/gpu_check.py --tiny --out /tmp/r     # the same code on the CPU at toy sizes (a test runs it)

Each section runs in its own process with its own time limit, so a crash or a hang in one still leaves the
others' results (at --tiny they run one after another in this process: start-up would take most of the time);
each writes `<out>/<section>.json`, and the whole run writes `<out>/report.md` (the table to paste into
docs/performance.md) and `<out>/report.json`.

Sections:
  env        device, torch, CUDA and Triton versions
  suite      the test suite with TITANLITE_TEST_DEVICE=cuda (single-process tests on the GPU, multi-rank on gloo)
  e2e        the debug model in bf16: 40 steps straight against 20 + resume 20 (async save), validation,
             TensorBoard, the step line's memory, a memory snapshot and a profiler trace
  flex       block-causal attention: FlexAttention against masked SDPA, forward and backward, fp32 and bf16,
             eager and compiled; the block mask is built once per forward
  compile    fp32 losses with and without per-block compile
  bf16       200 steps of the debug model in bf16 against fp32
  mfu        tokens/s, MFU and peak memory of the big shapes (compile off/on), against the dry run's estimate
  profile    where the time of one step of the 1B shape goes (kernels by category)
  attention  block-causal against causal step time on the 1B shape
  chunked    the 1B shape at seq 8192: the loss in chunks of 1024 tokens against the whole loss, and compiled
  float8     [float8] tensorwise and rowwise on the 1B shape with compile; 200 debug-model steps against bf16
  moe        a Qwen3-30B-A3B-shaped model cut to fit, compile off/on; the grouped GEMM against a per-expert loop
  generate   KV-cache generation against no cache, 512 new tokens on the 1B flavor
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This checkout first, then whatever the machine already had on the path (wheels carried to a GPU machine).
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
SECTIONS = (
    "env", "suite", "e2e", "flex", "compile", "bf16", "mfu", "profile", "attention", "chunked", "float8", "moe",
    "generate",
)  # fmt: skip
TIMEOUTS = {"suite": 900, "mfu": 900, "bf16": 300, "profile": 400, "attention": 400, "chunked": 900,
            "float8": 900, "moe": 900}  # seconds; others 300  # fmt: skip


# ---------------------------------------------------------------------------------------------- helpers


def _device(opts):
    import torch

    return torch.device("cpu" if opts.tiny else "cuda")


def _trainer(argv, opts):
    from titanlite.config import load
    from titanlite.trainer import Trainer

    os.environ["TITANLITE_DEVICE"] = _device(opts).type
    return Trainer(load(argv))


def _recorded(trainer) -> list:
    """Wrap the trainer's metrics logger so every logged StepMetrics is kept (returned list fills as it trains)."""
    seen = []
    log = trainer.metrics.log

    def keep(m):
        seen.append(m)
        return log(m)

    trainer.metrics.log = keep
    return seen


def _debug_argv(dump, opts, *extra):
    steps = "6" if opts.tiny else "40"
    return [
        "--job.config_file",
        "debug_model",
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        steps,
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        *(["--training.seq_len", "64", "--model.flavor", "tiny"] if opts.tiny else []),
        *extra,
    ]


def _max_abs(a: dict, b: dict) -> float:
    return max(abs(a[k] - b[k]) for k in a)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- sections


def section_env(opts) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), sm=f"{p.major}.{p.minor}")
    else:
        out["device"] = f"CPU ({os.cpu_count()} cores)"
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def section_suite(opts) -> dict:
    """The test suite with single-process tests on the GPU; returns the counts and the failures' names."""
    env = {**os.environ, "TITANLITE_TEST_DEVICE": _device(opts).type, "PYTHONPATH": PYTHONPATH}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]
    try:
        import xdist  # noqa: F401  (the GPU image has pytest-xdist: the gloo tests run beside each other)

        if opts.workers > 1:
            cmd += ["-n", str(opts.workers)]
    except ImportError:
        pass
    cmd += opts.suite_args or (["tests/test_config.py", "-k", "bool_flags"] if opts.tiny else ["tests"])
    t0 = time.perf_counter()
    path = Path(opts.out) / "suite.log"
    limit = opts.deadline_at - time.time() - 20 if opts.deadline_at else None
    p, _ = _run_logged(cmd, env, path, limit)  # streamed: a run cut short still leaves what it printed
    log = path.read_text()
    summary = log.splitlines()[-1] if log.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    if not counts:  # cut short at the deadline: count pytest's progress characters
        progress = "".join(re.findall(r"^([.FEsx]+)\s*(?:\[\s*\d+%\])?$", log, re.M))
        counts = {"cut_short": 1, "passed": progress.count("."), "failed": progress.count("F"),
                  "errors": progress.count("E"), "skipped": progress.count("s")}  # fmt: skip
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)
    skipped = re.findall(r"^SKIPPED \[\d+\] (.*)$", log, re.M)
    return dict(
        command=" ".join(cmd[2:]),
        returncode=p.returncode,
        counts=counts,
        failed=failed,
        skipped=skipped,
        seconds=round(time.perf_counter() - t0),
    )


def section_e2e(opts) -> dict:
    """The debug model in bf16 on one GPU: straight run against 20 + resume, with every observer on."""
    import torch

    device = _device(opts)
    half = 3 if opts.tiny else 20
    base = Path(tempfile.mkdtemp(dir=opts.out, prefix="e2e-"))
    observers = [
        "--training.deterministic",  # exact resume on a GPU needs deterministic kernels (see docs)
        "true",
        "--training.mixed_precision_param",
        "bfloat16",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        str(half),
        "--checkpoint.async_mode",
        "async",
        "--validation.enable",
        "true",
        "--validation.freq",
        str(half),
        "--validation.steps",
        "2",
        "--metrics.enable_tensorboard",
        "true",
        "--profiling.enable_profiling",
        "true",
        "--profiling.enable_memory_snapshot",
        "true",
        "--profiling.profile_freq",
        str(half),
    ]
    straight = _trainer(_debug_argv(base / "straight", opts, *observers), opts)
    lines = _recorded(straight)
    t0 = time.perf_counter()
    ref = straight.train()
    seconds = time.perf_counter() - t0
    files = {
        "tensorboard": sorted(str(p.relative_to(base)) for p in (base / "straight").rglob("events.out.tfevents*")),
        "memory_snapshot": sorted(str(p.relative_to(base)) for p in (base / "straight").rglob("*.pickle")),
        "trace": sorted(str(p.relative_to(base)) for p in (base / "straight" / "profile_traces").rglob("*")),
        "checkpoints": sorted(p.name for p in (base / "straight" / "checkpoint").glob("step-*")),
    }
    mem = lines[-1].memory if lines else {}
    out = dict(
        device=str(device),
        steps=len(ref),
        seconds=round(seconds, 1),
        first_loss=ref[min(ref)],
        last_loss=ref[max(ref)],
        validation=straight.val_losses,
        step_line_memory_gib=mem,
        files=files,
    )
    # The same run again, and a resume from the straight run's own step-`half` checkpoint (the same schedule):
    # with deterministic kernels and without (each after the straight run of its own setting).
    for deterministic in ("true", "false"):
        plain = ["--training.deterministic", deterministic, "--training.mixed_precision_param", "bfloat16",
                 "--checkpoint.enable", "true", "--checkpoint.interval", str(half)]  # fmt: skip
        tag = f"deterministic_{deterministic}"
        torch.use_deterministic_algorithms(deterministic == "true")  # the Trainer only ever turns it on
        first = ref if deterministic == "true" else _trainer(_debug_argv(base / f"{tag}-a", opts, *plain), opts).train()
        source = base / ("straight" if deterministic == "true" else f"{tag}-a")
        again = _trainer(_debug_argv(base / f"{tag}-b", opts, *plain), opts).train()
        shutil.copytree(source / "checkpoint" / f"step-{half}", base / f"{tag}-r" / "checkpoint" / f"step-{half}")
        resumed_trainer = _trainer(_debug_argv(base / f"{tag}-r", opts, *plain), opts)
        resumed_from = resumed_trainer.step
        resumed = resumed_trainer.train()
        after = {k: v for k, v in first.items() if k > half}
        out[tag] = dict(
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            repeat_exact=again == first,
            repeat_max_abs_diff=_max_abs(first, again),
            resumed_from=resumed_from,
            resume_exact=after == resumed,
            resume_max_abs_diff=_max_abs(after, resumed),
        )
    out["resume_exact"] = out["deterministic_true"]["resume_exact"]
    return out


def _flex_case(device, dtype, compiled: bool, tiny: bool):
    """Logits and gradients of one packed batch with the SDPA mask and with FlexAttention (same weights)."""
    import torch

    from titanlite.loss import summed_cross_entropy
    from titanlite.models.args import ModelArgs
    from titanlite.models.decoder import Transformer

    seq, batch = (64, 2) if tiny else (2048, 2)
    args = ModelArgs(
        dim=64 if tiny else 512,
        n_layers=2,
        n_heads=4 if tiny else 8,
        n_kv_heads=2 if tiny else 4,
        multiple_of=32,
        vocab_size=512,
        max_seq_len=seq,
        attention="block_causal",
    )
    g = torch.Generator().manual_seed(0)
    model = Transformer(args)
    model.init_weights(0)
    model.to(device, dtype)
    model.init_buffers()
    if compiled:
        for block in model.layers:
            block.compile(fullgraph=False)
    tokens = torch.randint(0, 512, (batch, seq), generator=g)
    positions = torch.cat(  # documents of random lengths packed into each row
        [torch.cat([torch.arange(n) for n in _doc_lengths(seq, g)])[None] for _ in range(batch)]
    )
    labels = torch.roll(tokens, -1, 1)
    tokens, positions, labels = tokens.to(device), positions.to(device), labels.to(device)
    import titanlite.models.decoder as llama

    out = {}
    masks_built = {}
    real_build = llama.block_causal_mask
    for kernel in ("sdpa", "flex"):
        model.attention_kernel = kernel
        model.zero_grad()
        calls = [0]

        def counting(*a, calls=calls, **k):
            calls[0] += 1
            return real_build(*a, **k)

        llama.block_causal_mask = counting
        no_backward = tiny and kernel == "flex"  # FlexAttention has no backward on the CPU
        try:
            with torch.set_grad_enabled(not no_backward):
                logits = model(tokens, positions)
                loss = summed_cross_entropy(logits, labels)
            if not no_backward:
                loss.backward()
        finally:
            llama.block_causal_mask = real_build
        masks_built[kernel] = calls[0]
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        out[kernel] = (logits.detach().float(), grads)
    return out, masks_built


def _doc_lengths(seq: int, g) -> list[int]:
    import torch

    cuts = sorted(torch.randperm(seq - 1, generator=g)[:6].add(1).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [seq])]


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# (relative logits error, relative gradient error) FlexAttention may show against masked SDPA: fp32 to 1e-5;
# bf16 at what rounding to 8 mantissa bits gives (docs/performance.md).
FLEX_TOLERANCE = {True: (1e-5, 1e-5), False: (2e-3, 1e-2)}


def section_flex(opts) -> dict:
    """FlexAttention (the GPU block-causal kernel) against masked SDPA: relative errors of logits and gradients."""
    import torch

    device = _device(opts)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for compiled in (False, True):
            if opts.tiny and compiled:
                continue
            res, masks = _flex_case(device, dtype, compiled, opts.tiny)
            (ls, gs), (lf, gf) = res["sdpa"], res["flex"]
            grad_err = max((_rel(gf[n], gs[n]) for n in gs if n in gf), default=None)
            logits_tol, grads_tol = FLEX_TOLERANCE[dtype is torch.float32]
            rows.append(
                dict(
                    within_tolerance=_rel(lf, ls) < logits_tol and (grad_err is None or grad_err < grads_tol),
                    dtype=str(dtype).split(".")[-1],
                    compiled=compiled,
                    logits_max_abs=float((lf - ls).abs().max()),
                    logits_rel=_rel(lf, ls),
                    grads_max_rel=grad_err,
                    block_masks_per_forward=masks["flex"],
                )
            )
    return dict(rows=rows)


def section_compile(opts) -> dict:
    """fp32 losses of the debug model with and without per-block compile."""
    dump = Path(tempfile.mkdtemp(dir=opts.out, prefix="compile-"))
    backend = ["--compile.backend", "aot_eager"] if opts.tiny else []
    argv = ["--training.mixed_precision_param", "float32", "--training.steps", "6" if opts.tiny else "20"]
    eager = _trainer(_debug_argv(dump / "eager", opts, *argv), opts).train()
    t = _trainer(_debug_argv(dump / "compiled", opts, *argv, "--compile.enable", "true", *backend), opts)
    compiled = t.train()
    return dict(steps=len(eager), max_abs_diff=_max_abs(eager, compiled), last_loss=eager[max(eager)])


def section_bf16(opts) -> dict:
    """200 steps of the debug model in bf16 against fp32 (same seed and data)."""
    dump = Path(tempfile.mkdtemp(dir=opts.out, prefix="bf16-"))
    steps = "10" if opts.tiny else "200"
    losses = {}
    for dtype in ("float32", "bfloat16"):
        argv = _debug_argv(dump / dtype, opts, "--training.steps", steps, "--training.mixed_precision_param", dtype)
        losses[dtype] = _trainer(argv, opts).train()
    f, b = losses["float32"], losses["bfloat16"]
    last = sorted(f)[-20:]
    mean_f, mean_b = statistics.mean(f[k] for k in last), statistics.mean(b[k] for k in last)
    rel = {k: abs(b[k] - f[k]) / f[k] for k in f}
    return dict(
        steps=len(f),
        fp32_last20_mean=mean_f,
        bf16_last20_mean=mean_b,
        last20_rel_diff=abs(mean_b - mean_f) / mean_f,
        max_step_rel_diff=max(rel.values()),
        max_step_rel_diff_at=max(rel, key=rel.get),
        median_step_rel_diff=statistics.median(rel.values()),
        curve_every_20={k: (round(f[k], 4), round(b[k], 4)) for k in sorted(f) if k % 20 == 0 or k == 1},
    )


def _mfu_shapes(opts) -> list[dict]:
    if opts.tiny:
        return [dict(name="debugmodel", flavor="debugmodel", seq=64, batch=2, ac="op", compile=False)]
    shapes = []
    for compiled in (False, True):
        for baseline in (True, False):
            shapes.append(
                dict(name="Llama 3.2 1B", flavor="1B", seq=8192, batch=2, ac="op", compile=compiled, baseline=baseline)
            )
    for compiled in (False, True):
        shapes.append(dict(name="8B-shaped", flavor="8B", cut=True, seq=8192, batch=2, ac="op", compile=compiled))
    return [s for s in shapes if not opts.mfu_only or s["flavor"] in opts.mfu_only.split(",")]


def _shape_argv(shape, dump, opts) -> list[str]:
    ac = ["--activation_checkpoint.mode", "none"]
    if shape["ac"] == "full":
        ac = ["--activation_checkpoint.mode", "full"]
    elif shape["ac"] != "none":
        ac = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", shape["ac"]]
    steps, log = ("4", "2") if opts.tiny else (str(opts.mfu_steps), "5")
    extra = [*(["--training.loss_chunk_tokens", str(shape["chunk"])] if "chunk" in shape else [])]
    extra += ["--float8.enable", "true", "--float8.recipe", shape["float8"]] if shape.get("float8") else []
    return [
        "--model.name",
        shape.get("model", "llama3"),
        "--model.flavor",
        shape["flavor"],
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        str(shape["seq"]),
        "--training.local_batch_size",
        str(shape["batch"]),
        "--training.global_batch_size",
        str(shape["batch"]),
        "--training.steps",
        steps,
        "--metrics.log_freq",
        log,
        "--training.mixed_precision_param",
        "float32" if opts.tiny else "bfloat16",
        "--training.mixed_precision_reduce",
        "float32",
        "--lr_scheduler.warmup_steps",
        "2",
        *ac,
        *(["--compile.enable", "true"] if shape["compile"] else []),
        *extra,
    ]


def _register_cut_flavor(shape, opts) -> None:
    """A flavor of shape["flavor"]'s shape cut to as many blocks as the dry run says fit this GPU (under 85% of it)."""
    import torch

    from titanlite.config import load
    from titanlite.models.registry import FAMILIES
    from titanlite.plan import validate_for_world
    from titanlite.sizing.report import estimate

    flavors = FAMILIES[shape.get("model", "llama3")].flavors
    full = flavors[shape["flavor"]]
    cut = f"{shape['flavor']}-cut"
    budget = torch.cuda.get_device_properties(0).total_memory * 0.85
    best = 1
    for layers in range(1, full.n_layers + 1):
        flavors[cut] = dataclasses.replace(full, n_layers=layers)
        cfg = load(_shape_argv({**shape, "flavor": cut}, "/tmp/unused", opts))
        if estimate(cfg, validate_for_world(cfg, 1, device_type=None), 1).gpu_total > budget:
            break
        best = layers
    flavors[cut] = dataclasses.replace(full, n_layers=best)
    shape.update(flavor=cut, layers=best, name=f"{shape['name']}, {best} of {full.n_layers} blocks")


def _use_baseline() -> None:
    """The training step as it was before the GPU measurements: foreach AdamW, and the loss never compiled."""
    import torch

    import titanlite.trainer as trainer
    from titanlite.loss import summed_cross_entropy
    from titanlite.optim import optimizer_hyperparameters

    def foreach_adamw(model, opt_cfg):
        return torch.optim.AdamW(
            model.parameters(), lr=opt_cfg.lr, foreach=True, **optimizer_hyperparameters(opt_cfg)[-1]
        )

    trainer.build_optimizer = foreach_adamw
    trainer.training_loss = lambda compiled: summed_cross_entropy


def _one_shape(opts, shape) -> dict:
    import torch

    from titanlite.config import load
    from titanlite.plan import validate_for_world
    from titanlite.sizing.report import GIB, estimate

    if shape.get("cut") and not opts.tiny:
        _register_cut_flavor(shape, opts)
    if shape.get("baseline"):
        _use_baseline()
    dump = Path(tempfile.mkdtemp(dir=opts.out, prefix="mfu-"))
    argv = _shape_argv(shape, dump, opts)
    cfg = load(argv)
    est = estimate(cfg, validate_for_world(cfg, 1, device_type=None), 1)
    t = _trainer(argv, opts)
    logged = _recorded(t)
    t0 = time.perf_counter()
    t.train()
    wall = time.perf_counter() - t0
    last = logged[-1]
    peak_alloc = max((m.memory.get("max_allocated", 0.0) for m in logged), default=0.0)
    peak_reserved = max((m.memory.get("max_reserved", 0.0) for m in logged), default=0.0)
    out = dict(
        shape=shape,
        params_b=round(est.total_params / 1e9, 3),
        tokens_per_sec=round(last.tokens_per_sec),
        tflops=round(last.tflops, 1),
        mfu=None if last.mfu is None else round(last.mfu, 2),
        measured_peak_allocated_gib=round(peak_alloc, 2),
        measured_peak_reserved_gib=round(peak_reserved, 2),
        estimate_gib=round(est.gpu_total / GIB, 2),
        estimate_parts_gib={
            "state": round((est.params + est.grads + est.optimizer) / GIB, 2),
            "fsdp_buffers": round(est.fsdp_buffers / GIB, 2),
            **{f"act_{k}": round(v / GIB, 2) for k, v in est.activations.items()},
        },
        wall_seconds=round(wall, 1),
        windows=[(m.step, round(m.tokens_per_sec), None if m.mfu is None else round(m.mfu, 2)) for m in logged],
        losses=[(m.step, round(m.loss, 4)) for m in logged],
    )
    if peak_alloc:
        out["estimate_over_measured"] = round(est.gpu_total / GIB / peak_alloc, 3)
    del t
    if torch.distributed.is_initialized():  # the next shape's estimate makes its own (fake) process group
        torch.distributed.destroy_process_group()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _shape_set(name: str, opts) -> list[dict]:
    """The training shapes a throughput section runs, each in its own process."""
    if name == "mfu":
        return _mfu_shapes(opts)
    tiny = dict(name="debugmodel", flavor="debugmodel", seq=64, batch=2, ac="op", compile=False)
    one_b = dict(name="Llama 3.2 1B", flavor="1B", seq=8192, batch=2, ac="op")
    if name == "chunked":  # with compile on the loss is compiled whole (model_builder.compiled_loss): one row
        if opts.tiny:
            return [{**tiny, "chunk": 16}, {**tiny, "chunk": 0}]
        return [{**one_b, "compile": False, "chunk": 1024}, {**one_b, "compile": False, "chunk": 0},
                {**one_b, "compile": True, "chunk": 1024}]  # fmt: skip
    if name == "float8":  # the bf16 baseline is the chunked section's compiled row (the same run)
        if opts.tiny:
            return [tiny]  # a CPU refuses [float8]: the row checks the plumbing only
        return [{**one_b, "compile": True, "float8": recipe} for recipe in ("tensorwise", "rowwise")]
    if name == "moe":
        if opts.tiny:
            return [{**tiny, "model": "qwen3_moe"}]
        moe = dict(
            name="Qwen3-30B-A3B-shaped", model="qwen3_moe", flavor="30B-A3B", cut=True, seq=8192, batch=1, ac="op"
        )
        return [{**moe, "compile": False}, {**moe, "compile": True}]
    raise ValueError(name)


def _part(section: str, opts, timeout=None) -> dict:
    """A part of a section: in its own process on a GPU (memory, compile caches); inline at --tiny (start-up time)."""
    return globals()[f"section_{section}"](opts) if opts.tiny else _child(section, opts, timeout=timeout)


def _shape_rows(name: str, opts) -> list[dict]:
    if opts.tiny:
        return [_one_shape(opts, shape) for shape in _shape_set(name, opts)]
    rows = []
    for i, shape in enumerate(_shape_set(name, opts)):
        r = _child("shape_one", opts, extra=["--shape-set", name, "--shape-index", str(i)], timeout=420)
        rows.append(r if "error" not in r else {"shape": shape, **r})
    return rows


def section_mfu(opts) -> dict:
    """Throughput, MFU and peak memory of each shape, each in a fresh process (compile caches, memory)."""
    return dict(rows=_shape_rows("mfu", opts))


def section_shape_one(opts) -> dict:
    return _one_shape(opts, _shape_set(opts.shape_set, opts)[opts.shape_index])


def section_chunked(opts) -> dict:
    """The 1B flavor at seq 8192: the loss in chunks of 1024 tokens against the whole-microbatch loss (compile off),
    and the compiled loss (compile on); tokens/s, peak memory and the dry run's estimate of each."""
    return dict(rows=_shape_rows("chunked", opts))


def _curve_stats(ref: dict, other: dict) -> dict:
    last = sorted(ref)[-20:]
    mean_r, mean_o = statistics.mean(ref[k] for k in last), statistics.mean(other[k] for k in last)
    rel = {k: abs(other[k] - ref[k]) / ref[k] for k in ref}
    return dict(
        ref_last20_mean=mean_r,
        last20_mean=mean_o,
        last20_rel_diff=abs(mean_o - mean_r) / mean_r,
        median_step_rel_diff=statistics.median(rel.values()),
        max_step_rel_diff=max(rel.values()),
        curve_every_20={k: (round(ref[k], 4), round(other[k], 4)) for k in sorted(ref) if k % 20 == 0 or k == 1},
    )


def section_float8_curve(opts) -> dict:
    """200 bf16 steps of the debug model against float8 (tensorwise, rowwise): the same seed and data."""
    dump = Path(tempfile.mkdtemp(dir=opts.out, prefix="float8-"))
    steps = "6" if opts.tiny else "200"
    base = ["--training.steps", steps, "--training.mixed_precision_param", "bfloat16"]
    bf16 = _trainer(_debug_argv(dump / "bf16", opts, *base), opts).train()
    out = {"steps": len(bf16)}
    for recipe in () if opts.tiny else ("tensorwise", "rowwise"):
        argv = _debug_argv(dump / recipe, opts, *base, "--float8.enable", "true", "--float8.recipe", recipe)
        out[recipe] = _curve_stats(bf16, _trainer(argv, opts).train())
    return out


def section_float8(opts) -> dict:
    """Float8 (torchao) on the 1B flavor with compile: tokens/s and peak against bf16 (the chunked section's compiled
    row), and 200 steps of the debug model's loss against bf16."""
    return dict(rows=_shape_rows("float8", opts), curve=_part("float8_curve", opts, timeout=300))


def section_moe_gemm(opts) -> dict:
    """One MoE layer's experts (Qwen3-30B-A3B's: 128, top-8, dim 2048, hidden 768), forward and backward: the grouped
    GEMM against a per-expert loop over the same tokens, bf16, timed with CUDA events (median of interleaved reps)."""
    import torch
    from moe import per_expert_loop  # benchmarks/moe.py: the experts one at a time

    from titanlite.models.moe import GroupedExperts

    device = _device(opts)
    n, top_k, dim, hidden, tokens = (8, 2, 64, 32, 256) if opts.tiny else (128, 8, 2048, 768, 8192)
    dtype = torch.float32 if opts.tiny else torch.bfloat16
    torch.manual_seed(0)
    experts = GroupedExperts(n, dim, hidden).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    counts = torch.bincount(torch.randint(0, n, (tokens * top_k,)), minlength=n).to(device)
    x = torch.randn(tokens * top_k, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    fns = {"grouped": lambda e, t, c: e(t, c), "loop": per_expert_loop}
    with torch.no_grad():
        diff = _rel(fns["grouped"](experts, x, counts).float(), per_expert_loop(experts, x, counts).float())

    def timed(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn(experts, x, counts).backward(grad)
        _sync(device)
        return time.perf_counter() - t0

    for fn in fns.values():
        timed(fn)
    times = {k: [] for k in fns}
    for rep in range(2 if opts.tiny else 10):
        for k in fns if rep % 2 == 0 else reversed(list(fns)):
            times[k].append(timed(fns[k]))
    return dict(
        experts=n, top_k=top_k, dim=dim, hidden=hidden, tokens=tokens, dtype=str(dtype),
        grouped_ms=round(statistics.median(times["grouped"]) * 1e3, 3),
        loop_ms=round(statistics.median(times["loop"]) * 1e3, 3),
        loop_over_grouped=round(statistics.median(a / b for a, b in zip(times["loop"], times["grouped"])), 2),
        outputs_rel_diff=diff,
    )  # fmt: skip


def section_moe(opts) -> dict:
    """A Qwen3-30B-A3B-shaped model cut to the blocks that fit, bf16, compile off/on (MFU over active parameters),
    and the grouped GEMM against the per-expert loop."""
    return dict(rows=_shape_rows("moe", opts), gemm=_part("moe_gemm", opts, timeout=200))


def section_generate(opts) -> dict:
    """benchmarks/kv_cache.py: KV-cache generation against the no-cache loop, 512 new tokens on the 1B flavor."""
    args = ["--flavor", "tiny", "--new-tokens", "16", "--reps", "1", "--device", "cpu"]
    if not opts.tiny:
        args = ["--flavor", "1B", "--prompt-len", "32", "--new-tokens", "512", "--reps", "3", "--device", "cuda"]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    script = str(ROOT / "benchmarks" / "kv_cache.py")
    p = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    text = p.stdout + (p.stderr[-3000:] if p.returncode else "")
    m = re.search(r"no KV cache / KV cache total time: ([\d.]+)", text)
    return dict(
        command="benchmarks/kv_cache.py " + " ".join(args), speedup=float(m.group(1)) if m else None, output=text
    )


_CATEGORIES = (  # kernel-name patterns, first match wins
    ("attention", r"flash|fmha|attention|sdpa|cudnn.*(fprop|bprop)|flex"),
    ("matmul (gemm)", r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul|\bmm\b"),
    ("loss (log_softmax / nll)", r"log_softmax|logsoftmax|nll_loss|cross_entropy"),
    ("optimizer", r"adam|foreach|multi_tensor|_fused_adam"),
    ("copies and casts", r"copy|cast|convert|to_copy|memcpy|memset"),
    ("norms", r"rms_norm|rmsnorm|norm"),
    ("reductions", r"reduce|sum|norm_kernel"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_poi|silu|mul|add"),
)


def section_profile(opts) -> dict:
    """One step of the 1B shape (compile off and on) under torch.profiler: GPU time by kernel and by category."""
    out = {}
    for compiled in (False, True):
        if opts.tiny and compiled:
            continue
        out["compiled" if compiled else "eager"] = _child(
            "profile_one", opts, extra=["--profile-compiled"] if compiled else [], timeout=300
        )
    return out


def section_profile_one(opts) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    shape = {**_mfu_shapes(opts)[0], "compile": bool(opts.profile_compiled), "baseline": False}
    dump = Path(tempfile.mkdtemp(dir=opts.out, prefix="profile-"))
    t = _trainer(_shape_argv(shape, dump, opts), opts)
    device = t.device
    for _ in range(2):  # warm-up (compile, allocator)
        d = t.dataloader.next_step()
        t.train_step(d.microbatches, d.global_valid_tokens)
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    d = t.dataloader.next_step()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        t.train_step(d.microbatches, d.global_valid_tokens)
        _sync(device)
    step_s = time.perf_counter() - t0
    kernels = []
    for e in prof.key_averages():
        if device.type == "cuda":
            # Device work only: kernels and copies, not CPU ops, annotations (their time is their kernels')
            # or CUPTI's "Command Buffer Full" (the host waiting for room in the launch queue).
            if e.device_type != torch.autograd.DeviceType.CUDA or "#" in e.key or e.key == "Command Buffer Full":
                continue
            us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        else:
            us = e.self_cpu_time_total
        if us > 0:
            kernels.append((e.key, us, e.count))
    kernels.sort(key=lambda k: -k[1])
    total = sum(us for _, us, _ in kernels) or 1
    by_cat: dict[str, float] = {}
    for name, us, _ in kernels:
        cat = next((c for c, pat in _CATEGORIES if re.search(pat, name, re.I)), "other")
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    name = "compiled" if opts.profile_compiled else "eager"
    (Path(opts.out) / f"profile_{name}.txt").write_text(
        prof.key_averages().table(
            sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total",
            row_limit=60,
            max_name_column_width=90,
        )
    )
    return dict(
        step_seconds=round(step_s, 3),
        device_busy_seconds=round(total / 1e6, 3),
        device_idle_pct=round(100 * max(0.0, 1 - total / 1e6 / step_s), 1),
        by_category_pct={k: round(100 * v / total, 1) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        top_kernels=[(n[:110], round(us / 1e3, 2), c) for n, us, c in kernels[:25]],
    )


def section_attention(opts) -> dict:
    """benchmarks/attention.py on the 1B shape at seq 8192: block-causal (FlexAttention) against causal."""
    args = ["--flavor", "tiny", "--seq-len", "64", "--batch", "2", "--reps", "2", "--device", "cpu"]
    if not opts.tiny:
        args = ["--flavor", "1B", "--seq-len", "8192", "--batch", "1", "--reps", "6", "--device", "cuda"]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    text = p.stdout + (p.stderr[-3000:] if p.returncode else "")
    m = re.search(r"block_causal / causal: ([\d.]+)", text)
    return dict(
        command="benchmarks/attention.py " + " ".join(args), ratio=float(m.group(1)) if m else None, output=text
    )


# ---------------------------------------------------------------------------------------------- running


def _run_logged(cmd, env, log: Path, timeout):
    """Run cmd with its output in `log`, in a process group of its own: past `timeout` seconds the whole group is
    killed. (the finished Popen, whether it timed out)"""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return p, True
    return p, False


def _child(section: str, opts, extra=(), timeout=None) -> dict:
    """Run one section in a fresh process (its own process group: a timeout ends its children too), within the
    run's --deadline; its JSON result, or {'error': ...}."""
    result = Path(opts.out) / f"{section}{'-' + '-'.join(extra).replace('--', '') if extra else ''}.json"
    if opts.deadline_at:
        left = opts.deadline_at - time.time() - 5
        if left < 15:
            return {"error": "skipped: --deadline reached"}
        timeout = left if timeout is None else min(timeout, left)
    cmd = [sys.executable, __file__, "--section", section, "--out", opts.out, "--result", str(result), *extra]
    cmd += ["--tiny"] if opts.tiny else []
    cmd += ["--workers", str(opts.workers), "--mfu-steps", str(opts.mfu_steps), "--deadline-at", str(opts.deadline_at)]
    cmd += ["--mfu-only", opts.mfu_only] if opts.mfu_only else []
    cmd += [f"--suite-args={shlex.join(opts.suite_args)}"] if opts.suite_args else []
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    log = Path(opts.out) / f"{result.stem}.log"
    p, timed_out = _run_logged(cmd, env, log, timeout)
    if timed_out:
        return {"error": f"timed out after {round(timeout)} s", "log_tail": log.read_text()[-2000:]}
    if p.returncode != 0 or not result.exists():
        return {"error": f"exit status {p.returncode}", "log_tail": log.read_text()[-3000:]}
    r = json.loads(result.read_text())
    r["section_seconds"] = round(time.perf_counter() - t0, 1)
    return r


def _inline(section: str, opts) -> dict:
    """One section in this process (--tiny); its JSON result, or {'error': ...} with the traceback."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        r = json.loads(json.dumps(globals()[f"section_{section}"](opts), default=str))
    except Exception as e:  # a section's failure is its report, as a child's is
        return {"error": f"{type(e).__name__}: {e}", "log_tail": traceback.format_exc()[-3000:]}
    finally:
        if dist.is_initialized():  # (a trainer's one-process group: the next section starts without one)
            dist.destroy_process_group()
    r["section_seconds"] = round(time.perf_counter() - t0, 1)
    (Path(opts.out) / f"{section}.json").write_text(json.dumps(r, indent=1))
    return r


def _markdown(results: dict) -> str:
    env = results.get("env", {})
    head = f"{env.get('device')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, Python {env.get('python')}"
    lines = [f"# GPU check: {head}", ""]
    for name, r in results.items():
        if name == "env":
            continue
        lines.append(f"## {name}")
        lines.append("```")
        lines.append(json.dumps(r, indent=1, default=str)[:6000])
        lines.append("```")
    suite = results.get("suite", {})
    if "counts" in suite:
        c = suite["counts"]
        short = (env.get("device") or "").replace("NVIDIA ", "").split()[0]
        lines.append(
            f"{short}: {c.get('passed', 0)} passed, {c.get('skipped', 0)} skipped, {c.get('failed', 0)} failed"
        )
    for section in ("mfu", "chunked", "float8", "moe"):
        for r in results.get(section, {}).get("rows", []):
            if "mfu" not in r:
                continue
            s = r["shape"]
            when = f"compile {'on' if s['compile'] else 'off'}{' (before)' if s.get('baseline') else ''}"
            when += f", loss_chunk_tokens {s['chunk']}" if "chunk" in s else ""
            when += f", float8 {s['float8']}" if s.get("float8") else ""
            lines.append(
                f"{env.get('device')}, {s['name']}, seq {s['seq']}, batch {s['batch']}, AC {s['ac']}, {when}: "
                f"{r['tokens_per_sec']:,} tokens/s, MFU {r['mfu']}%, peak {r['measured_peak_allocated_gib']} GiB "
                f"(estimate {r['estimate_gib']} GiB)"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_report", help="folder for the report, logs and profiler tables")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    p.add_argument("--tiny", action="store_true", help="CPU, toy sizes: checks that the script itself works")
    p.add_argument("--workers", type=int, default=6, help="pytest-xdist workers for the suite (if installed)")
    p.add_argument("--suite-args", type=shlex.split, default=None, help="pytest arguments instead of 'tests'")
    p.add_argument("--suite-timeout", type=int, default=TIMEOUTS["suite"], help="seconds the suite may take")
    p.add_argument("--mfu-steps", type=int, default=15, help="steps per throughput shape (logged every 5)")
    p.add_argument("--mfu-only", default="", help="comma-separated flavors of the throughput shapes to run")
    p.add_argument(
        "--deadline",
        type=float,
        default=0,
        help="seconds the whole run may take (0: no limit); a section "
        "is given what is left, and skipped when nothing is",
    )
    p.add_argument("--deadline-at", type=float, default=0, help=argparse.SUPPRESS)
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--shape-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--shape-set", default="mfu", help=argparse.SUPPRESS)
    p.add_argument("--profile-compiled", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.out = str(Path(opts.out).resolve())
    if opts.deadline and not opts.deadline_at:
        opts.deadline_at = time.time() + opts.deadline
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    if opts.section:  # a child: one section, its result as JSON
        from titanlite.observe.metrics import setup_logging

        setup_logging()
        result = globals()[f"section_{opts.section}"](opts)
        Path(opts.result).write_text(json.dumps(result, indent=1, default=str))
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown (process groups, compile workers)
    results = {}
    if opts.tiny:  # the sections run here: as a child's environment has it
        from titanlite.observe.metrics import setup_logging

        os.environ.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        setup_logging()
    for name in opts.sections.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"--sections: {name!r} is not one of {', '.join(SECTIONS)}")
        print(f"[gpu_check] {name} ...", flush=True)
        limit = opts.suite_timeout if name == "suite" else TIMEOUTS.get(name, 300)
        results[name] = _inline(name, opts) if opts.tiny else _child(name, opts, timeout=limit)
        print(f"[gpu_check] {name}: {json.dumps(results[name], default=str)[:1500]}", flush=True)
        (Path(opts.out) / "report.json").write_text(json.dumps(results, indent=1, default=str))
    report = _markdown(results)
    (Path(opts.out) / "report.md").write_text(report)
    print(report[-4000:])
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
