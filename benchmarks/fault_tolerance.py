"""Fault-tolerant HSDP on this machine: two replica groups against HSDP in one job, and a group killed and restarted.

    python benchmarks/fault_tolerance.py [--group-size 2] [--steps 300] [--pause 0.05]
    python benchmarks/fault_tolerance.py --chaos [--seed 0] [--failures 24]     # about 10 minutes
    python benchmarks/fault_tolerance.py --parts parity --overrides "--parallelism.tensor_parallel_degree 2"

parity: two groups of --group-size processes each (FSDP inside, gloo, a torchft lighthouse in this process) and one
HSDP(2 x group-size) job train the tiny model 10 fp32 steps on the same data; prints whether the step lines (loss
and gradient norm) are equal and the largest weight difference after the last step.

kill: two groups of one process train --steps steps (each step paced by --pause seconds, so that the survivor still
runs when the killed group is back); group 1's worker is SIGKILLed after a few steps together and restarted with
the same command once group 0 steps alone. Prints how long group 0 took to step alone after the kill, how long
the restarted group took to heal after its launch, and whether both groups' final weights and Adam moments are
bit-identical.

chaos (benchmarks/ft_chaos.py): three groups of one process while failures drawn from --seed (a worker or a
launcher SIGKILLed, a worker SIGSTOPped) hit a random group every --gap-min to --gap-max seconds and the group is
restarted; the recovery times per kind of failure, the steps committed, the throughput against the same groups
without failures, and whether the groups end bit-identical.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from ft_chaos import chaos
from ft_runs import ft_args, run_env, start_lighthouse, step_lines, tensors, torchrun, train_argv, worker_of

import common


def parity(opts, tmp: Path) -> list[str]:
    n = opts.group_size
    more = opts.overrides.split()
    ref = subprocess.run(torchrun(2 * n, *train_argv(tmp / "hsdp", 10), *more,
                                   "--parallelism.data_parallel_replicate_degree", "2"), env=run_env(),
                         capture_output=True, text=True)  # fmt: skip
    if ref.returncode:
        raise SystemExit(ref.stderr[-3000:])
    lighthouse = start_lighthouse()
    try:
        logs = [tmp / f"parity{g}.log" for g in (0, 1)]
        procs = [
            subprocess.Popen(
                torchrun(
                    n,
                    *train_argv(tmp / f"parity{g}", 10),
                    *ft_args(g, lighthouse.address(), "--fault_tolerance.min_replicas", "2"),
                ),
                env=run_env(),
                stdout=open(log, "w"),
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for g, log in enumerate(logs)
        ]
        if any(p.wait(timeout=600) for p in procs):
            raise SystemExit(logs[0].read_text()[-3000:])
    finally:
        lighthouse.shutdown()
    want = sorted({s[:3] for s in step_lines(ref.stdout + ref.stderr)})
    hsdp = tensors(tmp / "hsdp" / "checkpoint" / "step-10", "model")
    lines = [f"\nparity: two groups of {n} process(es) against replicate 2 x {n} in one job, 10 fp32 steps"
             f"{', ' + opts.overrides if more else ''}"]  # fmt: skip
    for g, log in enumerate(logs):
        got = sorted({s[:3] for s in step_lines(log.read_text())})
        weights = tensors(tmp / f"parity{g}" / "checkpoint" / "step-10", "model")
        diff = max((weights[k] - hsdp[k]).abs().max().item() for k in hsdp)
        lines.append(
            f"  group {g}: step lines equal: {got == want} ({len(got)} steps); largest weight difference {diff:.3g}"
        )
    return lines


def _wait(log: Path, pred, timeout: float = 180) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if log.exists() and pred(log.read_text()):
            return time.time()
        time.sleep(0.05)
    raise SystemExit(f"timed out: {log.read_text()[-3000:] if log.exists() else log}")


def kill(opts, tmp: Path) -> list[str]:
    lighthouse = start_lighthouse()
    logs = [tmp / f"kill{g}.log" for g in (0, 1)]
    env = run_env(opts.pause)

    def start(g, log):
        cmd = torchrun(1, *train_argv(tmp / f"kill{g}", opts.steps), *ft_args(g, lighthouse.address()))
        return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    try:
        g0, g1 = start(0, logs[0]), start(1, logs[1])
        _wait(logs[1], lambda t: sum(s[3] == 2 for s in step_lines(t)) >= 3)
        killed = time.time()
        os.kill(worker_of(g1.pid), signal.SIGKILL)
        g1.wait(timeout=60)
        alone = _wait(logs[0], lambda t: (s := step_lines(t)) and s[-1][3] == 1) - killed
        logs[1].rename(tmp / "kill1-first.log")
        launched = time.time()
        g1 = start(1, logs[1])
        healed = _wait(logs[1], lambda t: "healed from a live group" in t) - launched
        codes = g0.wait(timeout=600), g1.wait(timeout=600)
    finally:
        lighthouse.shutdown()
        for p in (g0, g1):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    same = {}
    for part in ("model", "optimizer"):
        a, b = (tensors(tmp / f"kill{g}" / "checkpoint" / f"step-{opts.steps}", part) for g in (0, 1))
        same[part] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [s[0] for s in step_lines(logs[0].read_text())]
    whole = steps == list(range(steps[0], opts.steps + 1))
    return [
        f"\nkill: groups of 1 process, {opts.steps} steps paced at {opts.pause} s, fault_tolerance.timeout_seconds 3, "
        f"lighthouse heartbeat timeout 1.5 s; exit statuses {codes}",
        f"  group 0 stepping alone {alone:.1f} s after group 1's worker was SIGKILLed",
        f"  the restarted group 1 healed {healed:.1f} s after its launch (start-up included)",
        f"  group 0's steps {steps[0]}..{steps[-1]}, none lost or repeated: {whole}",
        f"  final weights bit-identical: {same['model']}; Adam moments: {same['optimizer']}",
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["parity", "kill"], choices=["parity", "kill", "chaos"])
    p.add_argument("--chaos", action="store_true", help="run the chaos part only (as --parts chaos)")
    p.add_argument("--seed", type=int, default=0, help="chaos: the seed of the failures, their groups and times")
    p.add_argument("--failures", type=int, default=24, help="chaos: failures to inject")
    p.add_argument("--chaos-steps", type=int, default=3000, help="chaos: steps of the run (enough to outlast them)")
    p.add_argument("--baseline-steps", type=int, default=300, help="chaos: steps of the run without failures")
    p.add_argument("--gap-min", type=float, default=1.0, help="chaos: least seconds between failures")
    p.add_argument("--gap-max", type=float, default=4.0, help="chaos: most seconds between failures")
    p.add_argument("--margin", type=int, default=100, help="chaos: no failure within this many steps of the end")
    p.add_argument("--group-size", type=int, default=2, help="parity: processes per group")
    p.add_argument("--steps", type=int, default=300, help="kill: steps of the run")
    p.add_argument("--pause", type=float, default=0.05, help="kill: seconds each step is paced by")
    p.add_argument("--overrides", default="", help="parity: config overrides for every run (one string)")
    opts = p.parse_args(argv)
    if opts.chaos:
        opts.parts = ["chaos"]
    print(common.machine_line("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        for part in opts.parts:
            if part == "chaos":
                print("\n".join(chaos(opts, Path(tmp))), flush=True)
                continue
            print("\n".join({"parity": parity, "kill": kill}[part](opts, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
