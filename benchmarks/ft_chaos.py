"""The chaos part of benchmarks/fault_tolerance.py (`--parts chaos`): three fault-tolerant replica groups while a
driver injects failures drawn from a seed and restarts what it broke, as a cluster scheduler would.

Each failure is one of: SIGKILL of a group's worker, SIGKILL of a group's launcher (torchrun and its worker), or
SIGSTOP of a group's worker (a frozen rank: the others time it out; the driver then kills and restarts the group, as
a health check would). One failure at a time: the next is injected once every group steps again. Measured from the
step lines of the groups' logs, as the driver's poll sees them (every 20 ms): seconds from each failure to the
survivors' next committed step, seconds from each restart to the restarted group's first committed step (start-up
and healing from a live group included), the steps the job committed, the share of their global batches trained (a
step a group missed skips its share), and the throughput in whole batches per second against the same groups without
failures. At the end the three groups' final weights and Adam moments are compared bit for bit.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path

import ft_runs
import torch

FAILURES = ("kill the worker", "kill the launcher", "freeze the worker")
GROUPS = 3
POLL = 0.02


class Group:
    """One replica group's launcher, restarted in place; its step lines with the time the driver first saw each."""

    def __init__(self, g: int, cmd: list[str], env: dict, tmp: Path, prefix: str):
        self.g, self.cmd, self.env, self.tmp, self.prefix = g, cmd, env, tmp, prefix
        self.attempt, self.seen, self.offset = -1, [], 0
        self.start()

    def start(self) -> float:
        self.attempt += 1
        self.log = self.tmp / f"{self.prefix}{self.g}.{self.attempt}.log"
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        self.offset = 0
        return time.time()

    def poll(self) -> None:
        """Record the step lines written since the last poll: (time seen, attempt, step, live groups)."""
        if not self.log.exists():
            return
        with open(self.log) as f:
            f.seek(self.offset)
            text = f.read()
        end = text.rfind("\n") + 1  # whole lines only
        self.offset += end
        now = time.time()
        self.seen += [(now, self.attempt, s, r) for s, _, _, r in ft_runs.step_lines(text[:end])]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)


def _until(groups: list[Group], pred, timeout: float = 240) -> float:
    start = time.time()
    while time.time() - start < timeout:
        for grp in groups:
            grp.poll()
        if pred():
            return time.time()
        time.sleep(POLL)
    raise SystemExit("chaos: timed out\n" + "\n".join(g.log.read_text()[-3000:] for g in groups))


def _stepped_without(survivors: list[Group], since: float) -> bool:
    """Whether a survivor committed a step without the victim since `since`."""
    return any(r == GROUPS - 1 and t > since for g in survivors for t, _, _, r in g.seen)


def _hold(groups: list[Group], seconds: float) -> None:
    """Wait, polling the logs (so that every step line gets the time it appeared)."""
    end = time.time() + seconds
    while time.time() < end:
        for grp in groups:
            grp.poll()
        time.sleep(POLL)


def _run(opts, tmp: Path, prefix: str, steps: int, failures: int) -> dict:
    lighthouse = ft_runs.start_lighthouse()
    env = ft_runs.run_env(opts.pause)
    batch = ("--training.global_batch_size", str(2 * GROUPS))
    commands = [
        ft_runs.torchrun(1, *ft_runs.train_argv(tmp / f"{prefix}{g}", steps),
                         *ft_runs.ft_args(g, lighthouse.address(), *batch, groups=GROUPS))
        for g in range(GROUPS)
    ]  # fmt: skip
    groups = [Group(g, command, env, tmp, prefix) for g, command in enumerate(commands)]
    rng, records = random.Random(opts.seed), []

    def all_live() -> bool:  # a step every group committed together, after the last injection
        return any(r == GROUPS and t > mark for grp in groups for t, _, _, r in grp.seen)

    try:
        mark = 0.0
        _until(groups, all_live)
        while len(records) < failures:
            pause = rng.uniform(opts.gap_min, opts.gap_max)
            _hold(groups, pause)
            top = max(s for grp in groups for _, _, s, _ in grp.seen)
            if top > steps - opts.margin:
                break
            victim, mode = groups[rng.randrange(GROUPS)], rng.choice(FAILURES)
            survivors = [grp for grp in groups if grp is not victim]
            worker = ft_runs.worker_of(victim.proc.pid)
            hit = time.time()
            if mode == "kill the worker":
                os.kill(worker, signal.SIGKILL)
            elif mode == "kill the launcher":
                os.killpg(victim.proc.pid, signal.SIGKILL)
            else:
                os.kill(worker, signal.SIGSTOP)
            on = _until(
                groups, lambda h=hit, ss=survivors: any(r == GROUPS - 1 and t > h for g in ss for t, _, _, r in g.seen)
            )
            victim.kill()  # what is left of it (a frozen worker, its launcher)
            restarted = victim.start()
            first = _until(groups, lambda v=victim: any(a == v.attempt for _, a, _, _ in v.seen))
            mark = first
            _until(groups, all_live)
            healed = "healed from a live group" in victim.log.read_text()
            records.append(dict(mode=mode, group=victim.g, to_survivors=on - hit, to_healed=first - restarted,
                                healed=healed))  # fmt: skip
        codes = [grp.proc.wait(timeout=900) for grp in groups]
        for grp in groups:
            grp.poll()
    finally:
        lighthouse.shutdown()
        for grp in groups:
            if grp.proc.poll() is None:
                grp.kill()
    times = [t for grp in groups for t, _, _, _ in grp.seen]
    committed = sorted({s for grp in groups for _, _, s, _ in grp.seen})
    live = {}  # step -> the groups that committed it (their share of its global batch was trained)
    for grp in groups:
        for _, _, s, r in grp.seen:
            live[s] = max(live.get(s, 0), r)
    same = {}
    for part in ("model", "optimizer"):
        parts = [ft_runs.tensors(tmp / f"{prefix}{g}" / "checkpoint" / f"step-{steps}", part) for g in range(GROUPS)]
        same[part] = all(p.keys() == parts[0].keys() and all(torch.equal(p[k], parts[0][k]) for k in p) for p in parts)
    shares = sum(live.values()) / (GROUPS * len(live))
    return dict(records=records, codes=codes, committed=committed, seconds=max(times) - min(times), same=same,
                shares=shares)  # fmt: skip


def chaos(opts, tmp: Path) -> list[str]:
    """The chaos run and its baseline (the same groups, no failures); the lines of the report."""
    base = _run(opts, tmp, "calm", opts.baseline_steps, 0)
    run = _run(opts, tmp, "chaos", opts.chaos_steps, opts.failures)
    rate = lambda r: (len(r["committed"]) - 1) / r["seconds"]  # noqa: E731
    batches = lambda r: rate(r) * r["shares"]  # noqa: E731  (whole global batches trained per second)
    lines = [
        f"\nchaos: {GROUPS} groups of 1 process, steps paced at {opts.pause} s, fault_tolerance.timeout_seconds 3, "
        f"lighthouse heartbeat timeout 1.5 s; seed {opts.seed}, a failure every {opts.gap_min}-{opts.gap_max} s once "
        "every group steps again",
        f"  baseline: {len(base['committed'])} steps in {base['seconds']:.1f} s ({rate(base):.2f} steps/s), exit "
        f"statuses {base['codes']}",
        f"  chaos: {len(run['records'])} failures, {len(run['committed'])} of {opts.chaos_steps} steps committed "
        f"(none lost: {run['committed'] == list(range(1, opts.chaos_steps + 1))}) in {run['seconds']:.1f} s "
        f"({rate(run):.2f} steps/s, {rate(run) / rate(base):.0%} of the baseline's); exit statuses {run['codes']}",
        f"  data: the steps trained {run['shares']:.1%} of their global batches (a step without a group skips that "
        f"group's share); throughput kept: {batches(run) / batches(base):.0%} of the baseline's batches per second",
        f"  final weights bit-identical across the groups: {run['same']['model']}; Adam moments: "
        f"{run['same']['optimizer']}",
        "",
        "  failure            count  to survivors' next step (s)     restart to first step (s)   healed",
        "                            median     max                  median     max",
    ]
    for mode in FAILURES:
        recs = [r for r in run["records"] if r["mode"] == mode]
        if not recs:
            continue
        a, b = [r["to_survivors"] for r in recs], [r["to_healed"] for r in recs]
        lines.append(
            f"  {mode:<18} {len(recs):>5}  {statistics.median(a):>9.2f} {max(a):>7.2f}"
            f"{'':<16}{statistics.median(b):>9.2f} {max(b):>7.2f}   {sum(r['healed'] for r in recs)}/{len(recs)}"
        )
    return lines
