"""Muon against AdamW on the debug model (CPU, gloo): validation loss after the same tokens, each at its best lr of
a small sweep, and the step time Muon's whole-matrix gathers and Newton-Schulz add at world 2 and 4.

    python benchmarks/optimizers.py [--steps 100] [--adamw-lrs 1e-3 3e-3 1e-2] [--muon-lrs 1e-3 3e-3 1e-2 3e-2 1e-1]
    python benchmarks/optimizers.py --parts overhead [--overhead-steps 30] [--reps 2]

sweep: train_configs/debug_model.toml for --steps steps at world 2 (the same data and tokens for every run), one
run per optimizer and lr (Muon with muon_adjust_lr = match_rms_adamw, its default, so that AdamW's lrs carry over);
prints the validation loss of each and the best of each optimizer.
overhead: the same model at world 2 and 4, AdamW and Muon with each matrix orthogonalised on one rank and on every
rank, interleaved (A B C A B C, --reps times), --overhead-steps steps each; the median tokens/s per rank after the
first 5 steps, and each Muon's step time over AdamW's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VALIDATION = re.compile(r"validation at step (\d+): loss: +([\d.]+)")
TPS = re.compile(r"step: +(\d+) .*?tps: ([\d,]+)")


def _run(world: int, dump: Path, *args: str) -> str:
    env = {**os.environ, "TITANLITE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "-m", "titanlite.train", "--job.config_file", "debug_model.toml",
           "--job.dump_folder", str(dump), "--checkpoint.enable", "false", *args]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"run failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout + out.stderr


def sweep(opts, tmp: Path) -> list[str]:
    rows, best = [], {}
    for name, lrs in (("AdamW", opts.adamw_lrs), ("Muon", opts.muon_lrs)):
        for lr in lrs:
            text = _run(2, tmp / f"{name}{lr}", "--optimizer.name", name, "--optimizer.lr", str(lr),
                        "--training.steps", str(opts.steps), "--validation.enable", "true",
                        "--validation.freq", str(opts.steps), "--validation.steps", "8")  # fmt: skip
            loss = float(VALIDATION.findall(text)[-1][1])
            rows.append(f"| {name} | {lr:g} | {loss:.4f} |")
            best[name] = min(best.get(name, (9e9, 0)), (loss, lr))
            print(f"{name} lr {lr:g}: {loss:.4f}", file=sys.stderr, flush=True)
    tokens = opts.steps * 16 * 256
    out = [f"debug model, world 2, {opts.steps} steps ({tokens:,} tokens), validation loss after the last step",
           "| optimizer | lr | validation loss |", "|---|---|---|", *rows]  # fmt: skip
    if len(best) == 2:
        (al, alr), (ml, mlr) = best["AdamW"], best["Muon"]
        out.append(f"best: AdamW {al:.4f} at lr {alr:g}; Muon {ml:.4f} at lr {mlr:g} ({ml - al:+.4f})")
    return out


VARIANTS = {  # what the overhead part times, interleaved
    "AdamW": ("--optimizer.name", "AdamW"),
    "Muon, one rank per matrix": ("--optimizer.name", "Muon", "--optimizer.muon_newton_schulz", "one_rank"),
    "Muon, every rank": ("--optimizer.name", "Muon", "--optimizer.muon_newton_schulz", "every_rank"),
}


def overhead(opts, tmp: Path) -> list[str]:
    names = list(VARIANTS)
    out = ["| world | " + " | ".join(f"{n}: tokens/s per rank" for n in names) + " | step time over AdamW's |",
           "|---|" + "---|" * len(names) + "---|"]  # fmt: skip
    for world in (2, 4):
        tps = {n: [] for n in names}
        for rep in range(opts.reps):
            for i, name in enumerate(names):
                args = (*VARIANTS[name], "--training.steps", str(opts.overhead_steps), "--metrics.log_freq", "1",
                        "--training.local_batch_size", str(16 // world), "--validation.enable", "false")  # fmt: skip
                text = _run(world, tmp / f"over{world}_{i}_{rep}", *args)
                tps[name] += [int(v.replace(",", "")) for s, v in TPS.findall(text) if int(s) > 5]
        med = {n: statistics.median(v) for n, v in tps.items()}
        ratios = ", ".join(f"{med['AdamW'] / med[n]:.2f}" for n in names[1:])
        out.append(f"| {world} | " + " | ".join(f"{med[n]:,.0f}" for n in names) + f" | {ratios} |")
        print(out[-1], file=sys.stderr, flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["sweep", "overhead"], choices=["sweep", "overhead"])
    p.add_argument("--steps", type=int, default=100, help="sweep: steps of each run")
    p.add_argument("--adamw-lrs", type=float, nargs="*", default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--muon-lrs", type=float, nargs="*", default=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    p.add_argument("--overhead-steps", type=int, default=30, help="overhead: steps of each run")
    p.add_argument("--reps", type=int, default=2, help="overhead: A B C A B C repetitions")
    opts = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for part in opts.parts:
            print("\n".join({"sweep": sweep, "overhead": overhead}[part](opts, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
