"""DiLoCo against fully synchronous replica groups on the debug model (CPU, gloo, one machine).

    python benchmarks/diloco.py [--steps 150] [--every 10 30] [--outer-lr 0.7]     # about 5 minutes

Two fault-tolerant groups of one process each (a torchft lighthouse in this process) train
train_configs/debug_model.toml for --steps steps, each on its half of every global batch: once with
fault_tolerance.mode = "sync" (the gradients averaged at every step) and once per --every value with
mode = "diloco" (an outer Nesterov step every that many inner steps and at the last one). Prints, per run, the
validation loss of the final weights (every group holds the same ones), the wall time, and the bytes each process
all-reduces across groups per step (sync: the gradients at every step; diloco: the pseudo-gradients once a round).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fault_tolerance import _env, _torchrun

VALIDATION = re.compile(r"validation at step (\d+): loss: +([\d.]+)")
PAYLOAD = re.compile(r"\(([\d.]+) MiB all-reduced per rank\)")
PARAMS = re.compile(r"Model llama3 debugmodel: ([\d,]+) parameters")


def run(mode: str, every: int, opts, tmp: Path) -> dict:
    """Both groups of one run; their final validation losses, wall time and bytes per step."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=3000)  # fmt: skip
    logs, procs = [], []
    t0 = time.perf_counter()
    for g in (0, 1):
        argv = [
            "--job.config_file", "debug_model.toml", "--job.dump_folder", str(tmp / f"{mode}{every}_{g}"),
            "--training.steps", str(opts.steps), "--checkpoint.enable", "false",
            "--validation.enable", "true", "--validation.freq", str(opts.steps), "--validation.steps", "8",
            "--fault_tolerance.enable", "true", "--fault_tolerance.group_count", "2",
            "--fault_tolerance.replica_id", str(g), "--fault_tolerance.lighthouse", lighthouse.address(),
            "--fault_tolerance.min_replicas", "2", "--fault_tolerance.mode", mode,
            "--fault_tolerance.sync_every", str(every), "--fault_tolerance.outer_lr", str(opts.outer_lr),
        ]  # fmt: skip
        log = tmp / f"{mode}{every}_{g}.log"
        logs.append(log)
        procs.append(subprocess.Popen(_torchrun(1, *argv), env=_env(), stdout=open(log, "w"),
                                      stderr=subprocess.STDOUT))  # fmt: skip
    codes = [p.wait(timeout=3600) for p in procs]
    seconds = time.perf_counter() - t0
    lighthouse.shutdown()
    texts = [log.read_text() for log in logs]
    if any(codes):
        raise SystemExit(f"{mode} run failed ({codes}):\n{texts[0][-3000:]}")
    losses = [float(VALIDATION.findall(t)[-1][1]) for t in texts]
    params = int(PARAMS.search(texts[0]).group(1).replace(",", ""))
    if mode == "sync":
        per_step = params * 4  # fp32 gradients of every parameter, every step
    else:
        per_step = float(PAYLOAD.search(texts[0]).group(1)) * 2**20 / every
    return {"losses": losses, "seconds": seconds, "bytes_per_step": per_step}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="steps of each run (the debug config's)")
    p.add_argument("--every", type=int, nargs="+", default=[10, 30], help="DiLoCo's sync_every values to run")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate")
    opts = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, every in [("sync", 1)] + [("diloco", h) for h in opts.every]:
            r = run(mode, every, opts, Path(tmp))
            name = "sync (every step)" if mode == "sync" else f"diloco, sync_every {every}"
            rows.append((name, r))
            print(f"{name}: done in {r['seconds']:.0f} s", file=sys.stderr, flush=True)
    base = rows[0][1]["losses"][0]
    print(f"debug model, 2 groups x 1 process, {opts.steps} steps, outer lr {opts.outer_lr}, momentum 0.9")
    print("| run | validation loss (group 0 / 1) | vs sync | wall s | MiB all-reduced per step per process |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        a, b = r["losses"]
        print(f"| {name} | {a:.4f} / {b:.4f} | {a - base:+.4f} | {r['seconds']:.0f} | "
              f"{r['bytes_per_step'] / 2**20:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
