"""The dry run's per-rank memory estimate against two measurements of real CPU runs at a reduced shape.

    python benchmarks/memory_estimate.py                       # every case; about 8 minutes here
    python benchmarks/memory_estimate.py --cases fsdp2_bf16_op --json out.json

The shape is wide, shallow and long (hidden 1024, 2 blocks, FFN 2816, vocabulary 32768, 1 x 2048 tokens per
microbatch), so that the model state and the activations, not the interpreter, make up the peak. Each case is
sized three ways:

- estimate: titanlite.sizing.report.estimate, what `--dry-run` prints (parameters, gradients, optimizer state, FSDP
  buffers, activations, and the step's peak);
- tracked: torch's FSDPMemTracker over one train_step of a titanlite Trainer (after a first step, so AdamW's
  state exists), on rank 0. Its categories map onto the estimate's parts: Sharded Param -> parameters,
  OptState -> optimizer, the largest Sharded Grad seen -> gradients, and at the step's peak Unsharded Param +
  All Gather + Unsharded Grad + Reduce Scatter -> FSDP buffers and Activation + Temp -> activations (the
  estimate's figures are those of its own peak moment). The loss in chunks makes the output projection's
  unsharded gradient inside the forward, where the tracker files it as an activation; the estimate counts it
  among the FSDP buffers, so it is moved there. At a peak in backward the tracker files the gradient a unit is
  making as Temp, so there only buffers+activations compare;
- rss: the peak resident memory of a real run (`titanlite.cli.train.main`, the embedded dataset, 3 steps),
  VmHWM less VmRSS just before the run, with glibc's mmap threshold fixed at 64 KiB so that a freed tensor
  leaves the process at once; less the host's share, which no estimate counts and which a GPU machine keeps in
  host memory (gloo, the data loader, Python objects): the same run's growth with a model too small to matter
  (TINY_SHAPE), less that model's estimate. The case's line gives the host's share (60-90 MiB per rank here).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import tempfile

import torch

import common

MiB = 1024**2
TOLERANCE = 0.10
PARTS = ("params", "grads", "optimizer", "fsdp_buffers", "activations", "buffers+activations", "peak")
FSDP_BUFFER_KINDS = ("Unsharded Param", "All Gather", "Unsharded Grad", "Reduce Scatter")

# The host's own share of a run's RSS is measured with this model shape (everything else as the case says).
TINY_SHAPE = {"layers": 1, "hidden": 128, "intermediate": 256, "vocab": 1024}

# name: (world size, description, overrides[, shape changes])
CASES = {
    "one_rank_fp32": (1, "1 rank, fp32, no AC", ""),
    "fsdp2_fp32": (2, "FSDP 2, fp32, no AC", ""),
    "fsdp2_bf16_op": (
        2,
        "FSDP 2, bf16 / fp32 reduce, selective op (every second matmul)",
        "--training.mixed_precision_param bfloat16 --activation_checkpoint.mode selective "
        "--activation_checkpoint.selective_ac_option op "
        "--activation_checkpoint.selective_op_policy every_second_matmul",
    ),
    "fsdp2_bf16_full_accum": (
        2,
        "FSDP 2, bf16 / fp32 reduce, full AC, 2 microbatches",
        "--training.mixed_precision_param bfloat16 --activation_checkpoint.mode full",
    ),
    "fsdp2_no_reshard": (
        2,
        "FSDP 2, fp32, reshard_after_forward never",
        "--parallelism.fsdp_reshard_after_forward never",
    ),
    "fsdp2_fp32_full_deep": (
        2,
        "FSDP 2, fp32, full AC, 6 blocks, vocab 4096",
        "--activation_checkpoint.mode full",
        {"layers": 6, "vocab": 4096},
    ),
    "fsdp2_fp32_last_only_accum": (
        2,
        "FSDP 2, fp32, 2 microbatches, gradient_sync last_microbatch_only",
        "--parallelism.gradient_sync last_microbatch_only",
    ),
    "tp2_bf16": (
        2,
        "TP 2 (sequence + loss parallel), bf16, no AC",
        "--training.mixed_precision_param bfloat16 --parallelism.tensor_parallel_degree 2",
    ),
    "cp2_fp32": (
        2,
        "CP 2 (each rank two chunks of the sequence, keys and values gathered), fp32, no AC, seq 4096, vocab 8192",
        "--parallelism.context_parallel_degree 2",
        {"seq_len": 4096, "vocab": 8192},  # 2048 tokens per rank, as the other cases
    ),
    "fsdp2_lora_bf16_base": (
        2,
        "FSDP 2, LoRA rank 16 on every projection, base in bf16, bf16 compute, no AC, vocab 8192",
        "--training.mixed_precision_param bfloat16 --lora.enable true --lora.base_dtype bfloat16 "
        "--checkpoint.initial_load_path {base}",
        {"vocab": 8192},
    ),
    "fsdp2_qlora_bf16_full": (
        2,
        "FSDP 2, QLoRA rank 16 on every projection, base in nf4 (the rest bf16), bf16 compute, full AC, vocab 4096",
        "--training.mixed_precision_param bfloat16 --lora.enable true --lora.base_dtype nf4 "
        "--checkpoint.initial_load_path {base} --activation_checkpoint.mode full",
        {"vocab": 4096},
    ),
    "backend_qwen3_5_fp32": (
        2,
        "transformers backend, Qwen3.5 (a Gated DeltaNet and a full-attention layer), FSDP 2, fp32, no AC, vocab 8192",
        "--model.name transformers --model.flavor hf --checkpoint.initial_load_path {qwen3_5}",
        {"vocab": 8192},
    ),
    "backend_gemma3_bf16_full": (
        2,
        "transformers backend, Gemma 3 (a sliding and a full layer), FSDP 2, bf16, full AC, 4 layers, vocab 8192",
        "--model.name transformers --model.flavor hf --checkpoint.initial_load_path {gemma3} "
        "--training.mixed_precision_param bfloat16 --activation_checkpoint.mode full",
        {"vocab": 8192, "layers": 4},
    ),
}

# transformers' text configs of the backend cases, at the benchmark's shape (their weights drawn from the seed)
BACKEND_CONFIGS = {
    "qwen3_5": lambda o: dict(
        model_type="qwen3_5_text", layer_types=(["linear_attention", "full_attention"] * o.layers)[: o.layers],
        linear_num_key_heads=o.hidden // 128, linear_num_value_heads=o.hidden // 64, linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
    "gemma3": lambda o: dict(
        model_type="gemma3_text", sliding_window=512,
        layer_types=(["sliding_attention", "full_attention"] * o.layers)[: o.layers],
    ),
}  # fmt: skip


def backend_folder(opts, kind: str) -> str:
    """A folder with the config.json alone of BACKEND_CONFIGS[kind] at the benchmark's shape, written once into the
    temp folder."""
    import transformers

    shape = f"{opts.layers}x{opts.hidden}x{opts.intermediate}x{opts.head_dim}-{opts.vocab}"
    path = os.path.join(tempfile.gettempdir(), f"titanlite-backend-{kind}-{shape}")
    if not os.path.exists(path):
        kw = BACKEND_CONFIGS[kind](opts)
        config = transformers.AutoConfig.for_model(
            kw.pop("model_type"), vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=opts.intermediate,
            num_hidden_layers=opts.layers, num_attention_heads=opts.hidden // opts.head_dim,
            num_key_value_heads=opts.hidden // opts.head_dim, head_dim=opts.head_dim,
            max_position_embeddings=opts.seq_len, tie_word_embeddings=False, **kw,
        )  # fmt: skip
        config.save_pretrained(f"{path}.{os.getpid()}.tmp")
        try:
            os.replace(f"{path}.{os.getpid()}.tmp", path)
        except OSError:  # another rank's is there already (the same config)
            shutil.rmtree(f"{path}.{os.getpid()}.tmp")
    return path


def _settings(name: str, opts) -> dict:
    """The trainer_config settings of one case."""
    overrides = CASES[name][2]
    if "{base}" in overrides:
        overrides = overrides.replace("{base}", common.lora_base(opts))
    for kind in BACKEND_CONFIGS:
        if f"{{{kind}}}" in overrides:
            overrides = overrides.replace(f"{{{kind}}}", backend_folder(opts, kind))
    accumulation = 2 if name.endswith("_accum") else 1
    backend = "--model.name transformers" in overrides  # (its vocabulary is its config.json's)
    extra = (*(() if backend else ("--model.vocab_size", str(opts.vocab))), *overrides.split())
    return dict(local_batch_size=1, accumulation=accumulation, replicate=1, extra=extra)


def estimate_parts(cfg, world: int) -> dict[str, int]:
    """The dry run's figures for this job, by part (bytes on rank 0)."""
    from titanlite.plan import validate_for_world
    from titanlite.sizing import report as sizing

    plan = validate_for_world(cfg, world, device_type=None)
    est = sizing.estimate(cfg, plan, world)
    # in backward the tracker files a QLoRA linear's dequantized weight among its temporaries, with the activations
    act = (
        est.activations["total"] if est.peak_moment == "end of forward" else est.backward.activations + est.dequantized
    )
    # last_microbatch_only: the unsharded gradients held between microbatches are FSDP's (Unsharded Grad)
    buffers = est.fsdp_buffers + (est.held_grads if est.held_grads != est.grads else 0)
    return {
        "params": est.params,
        "grads": est.grads,
        "optimizer": est.optimizer,
        "fsdp_buffers": buffers,
        "activations": act,
        "buffers+activations": buffers + act,
        "peak": est.gpu_total,
    }


def _output_grad_in_forward(trainer) -> int:
    """Bytes of the output projection's gradient that the loss in chunks makes in forward (this rank's rows)."""
    from titanlite.dtypes import dtype_bytes
    from titanlite.sizing.memory import gathered_numel

    if trainer.model.loss_chunk_tokens == 0 or not trainer.model.output.weight.requires_grad:  # a LoRA base's
        return 0
    return gathered_numel(trainer.model.output.weight) * dtype_bytes(trainer.cfg.training.mixed_precision_param)


def _tracked(opts, name: str) -> dict[str, int] | None:
    """One train_step of a Trainer under FSDPMemTracker, mapped onto the estimate's parts (rank 0's)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    common.register_shape(opts.layers, opts.hidden, opts.intermediate, opts.head_dim, opts.seq_len)
    settings = _settings(name, opts)
    with common.job_folder() as dump:
        trainer = common.build_trainer(opts, dump, **settings)
    sizes = [settings["local_batch_size"]] * settings["accumulation"]
    batch = common.random_microbatches(sizes, opts.seq_len, opts.vocab, seed=0)
    _create_optimizer_state(trainer)  # as the first step would leave it, without that step's compute
    tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
    tracker.track_inputs(tuple(batch[0]))
    with tracker:
        trainer.train_step(batch)
    peak = {k.value: v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items() if k != "Total"}
    grads, peak_in_backward = 0, False
    for stats in tracker.memory_tracking.values():
        for state, snaps in stats.snapshots.items():
            for snap in snaps:
                for by_kind in snap.values():
                    grads = max(grads, by_kind.get(_kind("SHARDED_GRAD"), 0))
                    if by_kind.get("Total") == sum(peak.values()) and "Backward" in state.value:
                        peak_in_backward = True
    moved = 0 if peak_in_backward else _output_grad_in_forward(trainer)  # reduced long before a backward peak
    return {
        "params": peak["Sharded Param"],
        "grads": grads,
        "optimizer": peak["OptState"],
        "fsdp_buffers": sum(peak.get(k, 0) for k in FSDP_BUFFER_KINDS) + moved,
        "activations": peak["Activation"] + peak["Temp"] - moved,
        "buffers+activations": sum(peak.get(k, 0) for k in FSDP_BUFFER_KINDS) + peak["Activation"] + peak["Temp"],
        "peak": sum(peak.values()),
        "peak_in_backward": peak_in_backward,
    }


def _create_optimizer_state(trainer) -> None:
    """AdamW allocates its moments at its first step: one step on zero gradients makes them, as a first training
    step would (the tracked step then holds them), at a fraction of the cost."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def _kind(name: str):
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    return _FSDPRefType[name]


def _status_bytes(key: str) -> int:
    """A Vm* line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _real_run(opts, argv: list[str]) -> int:
    """The peak RSS growth of a real training run on this rank (bytes)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD, fixed: large blocks are mapped and unmapped one by one
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    import titanlite.data  # noqa: F401  (imports are the interpreter's, not the run's)
    from titanlite.cli.train import main

    common.register_shape(opts.layers, opts.hidden, opts.intermediate, opts.head_dim, opts.seq_len)
    base = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"the training run ended with status {rc}")
    return _status_bytes("VmHWM") - base


def _rss_peak(opts, name: str, dump: str) -> tuple[int, int]:
    """The peak RSS growth of a real run of this case at opts' shape, and the estimate of its peak (bytes, rank 0)."""
    from titanlite.config import to_toml

    world = CASES[name][0]
    common.register_shape(opts.layers, opts.hidden, opts.intermediate, opts.head_dim, opts.seq_len)
    cfg = common.trainer_config(opts, dump, world, **_settings(name, opts))
    path = os.path.join(dump, f"job-{opts.hidden}.toml")
    with open(path, "w") as f:
        f.write(to_toml(cfg))
    argv = ["--job.config_file", path, "--training.steps", "3", "--metrics.log_freq", "1"]
    return common.spawn(_real_run, world, "cpu", opts, argv)[0], estimate_parts(cfg, world)["peak"]


def _case_opts(opts, name: str):
    """The options with the case's own shape changes."""
    return argparse.Namespace(**{**vars(opts), **(CASES[name][3] if len(CASES[name]) > 3 else {})})


def _tracked_cases(cases: list) -> list:
    """_tracked of each (opts, name), one after another in this world (one spawn for several cases)."""
    return [_tracked(opts, name) for opts, name in cases]


def tracked_all(opts, names: list[str]) -> dict[str, dict[str, int]]:
    """The tracked figures of each case, in one spawned world per world size."""
    out = {}
    for world in sorted({CASES[n][0] for n in names}):
        group = [n for n in names if CASES[n][0] == world]
        results = common.spawn(_tracked_cases, world, "cpu", [(_case_opts(opts, n), n) for n in group])[0]
        out.update(zip(group, results))
    return out


def measure(opts, name: str, rss: bool = True, tracked: dict | None = None) -> dict[str, dict[str, int]]:
    """Estimate, tracked (measured here unless given) and (with rss) rss figures of one case (bytes, rank 0)."""
    world = CASES[name][0]
    opts = _case_opts(opts, name)
    common.register_shape(opts.layers, opts.hidden, opts.intermediate, opts.head_dim, opts.seq_len)
    with tempfile.TemporaryDirectory() as dump:
        cfg = common.trainer_config(opts, dump, world, **_settings(name, opts))
        out = {"estimate": estimate_parts(cfg, world)}
        out["tracked"] = tracked or common.spawn(_tracked, world, "cpu", opts, name)[0]
        if not rss:
            out["rss"] = {}
            return out
        rss, _ = _rss_peak(opts, name, dump)
        # The same run with a model too small to matter: what it adds is the host's (gloo, data loader, Python),
        # which on a GPU machine stays in host memory.
        tiny = argparse.Namespace(**{**vars(opts), **TINY_SHAPE})
        tiny_rss, tiny_est = _rss_peak(tiny, name, dump)
        out["rss"] = {"peak": rss - (tiny_rss - tiny_est), "raw": rss, "host": tiny_rss - tiny_est}
    return out


def rows_of(name: str, res: dict) -> list[list[str]]:
    """Table rows of one case: each part's estimate, measurements and estimate / measured."""
    rows = []
    for part in PARTS:
        est = res["estimate"][part]
        cells = [f"  {part}", f"{est / MiB:.1f}"]
        for kind in ("tracked", "rss"):
            got = res[kind].get(part)
            cells += ["-", "-"] if got is None else [f"{got / MiB:.1f}", f"{est / got:.3f}" if got else "-"]
        rows.append(cells)
    host = f"host share of the rss {res['rss']['host'] / MiB:.0f} MiB" if res["rss"] else "no real run"
    where = "backward" if res["tracked"].get("peak_in_backward") else "forward"
    return [[f"{CASES[name][1]} (peak in {where}; {host})", "", "", "", "", ""]] + rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(p, layers=2, hidden=1024, intermediate=2816, seq_len=2048)
    p.add_argument("--vocab", type=int, default=32768, help="model vocabulary (embedding and output rows)")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES), help="which cases to run")
    p.add_argument("--json", help="also write the figures (bytes) to this file")
    p.add_argument("--no-rss", nargs="*", default=[], help="cases measured by the tracker only (no real run)")
    opts = p.parse_args(argv)
    if opts.device == "cuda":
        raise SystemExit("--device cuda: this script measures CPU runs (FSDPMemTracker and RSS)")
    print(common.machine_line("cpu"))
    print(
        f"shape: {opts.layers} blocks, hidden {opts.hidden}, FFN {opts.intermediate}, vocab {opts.vocab}, "
        f"1 x {opts.seq_len} tokens per microbatch; MiB on rank 0"
    )
    results, rows = {}, []
    tracked = tracked_all(opts, opts.cases)  # one spawned world per world size
    for name in opts.cases:
        results[name] = measure(opts, name, rss=name not in opts.no_rss, tracked=tracked[name])
        rows += rows_of(name, results[name])
    header = ["case / part", "estimate", "tracked", "est/tracked", "rss", "est/rss"]
    print(common.format_table(header, rows))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
