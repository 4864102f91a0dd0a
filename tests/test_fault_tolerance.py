"""[fault_tolerance]: replica groups as separate torchrun jobs with a torchft lighthouse on localhost (gloo, CPU).

Two groups give HSDP's losses; a group whose worker is SIGKILLed is dropped while the other trains on, and when
restarted it heals from the live group: both end with bit-identical weights.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch

from helpers import (
    _descendants,
    faults_env,
    full_model,
    job,
    load_everything,
    make_trainer,
    run_distributed,
    subprocess_env,
    tiny_argv,
    torchrun_cmd,
)

torchft = pytest.importorskip("torchft")

STEP_LINE = re.compile(r"step: +(\d+)  loss: +([\d.]+)  grad_norm: +([\d.]+).*?replicas: (\d)/2")


def _lighthouse():
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50, heartbeat_timeout_ms=1500
    )


def _group_argv(tmp: Path, group: int, lighthouse, *extra) -> list[str]:
    return tiny_argv(
        tmp / f"group{group}",
        "--training.global_batch_size", "8", "--training.local_batch_size", "2",
        "--fault_tolerance.enable", "true", "--fault_tolerance.group_count", "2",
        "--fault_tolerance.replica_id", str(group), "--fault_tolerance.lighthouse", lighthouse.address(),
        "--fault_tolerance.timeout_seconds", "3", *extra,
    )  # fmt: skip


def _steps(log: Path) -> list[tuple[int, float, int]]:
    """(step, loss, live groups) of each step line."""
    return [(int(s), float(loss), int(r)) for s, loss, _, r in STEP_LINE.findall(log.read_text())]


def _scalars(dump: Path) -> dict[str, dict[int, float]]:
    """The loss and grad_norm a run wrote to TensorBoard, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (dump / "tb").rglob("events.out.tfevents*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in ("loss", "grad_norm")}


def _hsdp_run(tmp):
    argv = tiny_argv(tmp, "--training.global_batch_size", "8", "--training.local_batch_size", "2")
    t = make_trainer(argv + ["--parallelism.data_parallel_replicate_degree", "2"])
    norms, log = {}, t.metrics.log
    t.metrics.log = lambda m: (norms.__setitem__(m.step, m.grad_norm), log(m))[1]
    return t.train(), norms, full_model(t)


@pytest.mark.slow
def test_two_groups_give_hsdps_losses(tmp_path):
    """Without failures, two fault-tolerant groups of one process each = HSDP(2 x 1) in one job (fp32, 10 steps):
    the same losses and, after the last step, the same weights within 1e-5."""
    ref_losses, ref_norms, ref_weights = run_distributed(_hsdp_run, 2, str(tmp_path / "hsdp"))[0]
    lighthouse = _lighthouse()
    env = subprocess_env()
    logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
    extra = ("--fault_tolerance.min_replicas", "2", "--checkpoint.enable", "--checkpoint.interval", "5",
             "--metrics.enable_tensorboard")  # fmt: skip

    def run_both(*more):
        procs = [
            job(torchrun_cmd(*_group_argv(tmp_path, g, lighthouse, *extra, *more), nproc=1), env=env,
                stdout=open(log, "w"), stderr=subprocess.STDOUT)
            for g, log in enumerate(logs)
        ]  # fmt: skip
        with procs[0] as p0, procs[1] as p1:
            assert p0.wait(timeout=240) == 0 and p1.wait(timeout=240) == 0, logs[0].read_text()[-3000:]

    try:
        run_both()
        first = {g: (_steps(log), _scalars(tmp_path / f"group{g}")) for g, log in enumerate(logs)}
        at_10 = [_tensors(load_everything(tmp_path / f"group{g}" / "checkpoint" / "step-10")["model"]) for g in (0, 1)]
        # The whole job resumed from disk, group 1 from an older checkpoint: it heals from group 0's step 10.
        shutil.rmtree(tmp_path / "group1" / "checkpoint" / "step-10")
        run_both("--training.steps", "12")
        resumed = {g: log.read_text() for g, log in enumerate(logs)}
    finally:
        lighthouse.shutdown()
    assert "healed from a live group at step 10" in resumed[1] and "healed" not in resumed[0], resumed[1][-3000:]
    final = [_tensors(load_everything(tmp_path / f"group{g}" / "checkpoint" / "step-12")) for g in (0, 1)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    for g in (0, 1):
        steps, tb = first[g]
        assert [s for s, _, _ in steps] == list(range(1, 11)) and all(r == 2 for _, _, r in steps), steps
        assert sorted(tb["loss"]) == list(range(1, 11))
        for s, loss in tb["loss"].items():  # TensorBoard keeps the full float32
            assert abs(loss - ref_losses[s]) < 1e-5, (s, loss, ref_losses[s])
        for s, norm in tb["grad_norm"].items():  # a mis-scaled gradient shows here (Adam's update hides it)
            assert abs(norm - ref_norms[s]) < 1e-5, (s, norm, ref_norms[s])
        weights = at_10[g]
        assert {k.lstrip(".") for k in weights} == set(ref_weights)
        for k, w in weights.items():
            torch.testing.assert_close(w, ref_weights[k.lstrip(".")], rtol=0, atol=1e-5, msg=k)


def _running_with(text: str) -> list[int]:
    """The live processes whose command line holds `text` (a test's folder: its jobs' workers and launchers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().split(") ")[1][0]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


def _worker_of(proc) -> int:
    """The training worker under a torchrun job (its only python descendant that is not the agent)."""
    for _ in range(100):
        kids = _descendants(proc.pid)
        if kids:
            return kids[-1]
        time.sleep(0.1)
    raise AssertionError("no worker started")


def _wait_for(log: Path, pred, what: str, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if log.exists() and pred(_steps(log), log.read_text()):
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-3000:] if log.exists() else ''}")


@pytest.mark.slow
def test_a_killed_group_is_dropped_and_heals_when_restarted(tmp_path):
    lighthouse = _lighthouse()
    env = faults_env("", TITANLITE_STEP_PAUSE="0.05")  # a pace: the survivor must still run when the group is back
    steps = "300"
    extra = (
        "--training.steps",
        steps,
        "--checkpoint.enable",
        "--checkpoint.interval",
        steps,
        "--metrics.log_freq",
        "1",
    )
    logs = {g: tmp_path / f"group{g}.log" for g in (0, 1)}

    def start(g):
        return job(torchrun_cmd(*_group_argv(tmp_path, g, lighthouse, *extra), nproc=1), env=env,
                   stdout=open(logs[g], "w"), stderr=subprocess.STDOUT)  # fmt: skip

    try:
        with start(0) as g0:
            with start(1) as g1:
                _wait_for(logs[1], lambda s, _: sum(r == 2 for *_, r in s) >= 3, "both groups stepping")
                killed_at = time.time()
                os.kill(_worker_of(g1), signal.SIGKILL)
                g1.wait(timeout=60)
            _wait_for(logs[0], lambda s, _: s and s[-1][2] == 1, "group 0 stepping alone", timeout=60)
            dropped_after = time.time() - killed_at
            logs[1].rename(tmp_path / "group1-killed.log")
            with start(1) as g1b:  # the same command again: the same dump folder, no checkpoint in it
                _wait_for(logs[1], lambda _, text: "healed from a live group" in text, "the healing", timeout=120)
                assert g0.wait(timeout=240) == 0, logs[0].read_text()[-3000:]
                assert g1b.wait(timeout=240) == 0, logs[1].read_text()[-3000:]
                assert not _running_with(str(tmp_path)), "processes of the job are left running"
    finally:
        lighthouse.shutdown()
    survivor = _steps(logs[0])
    # no step lost or repeated (a group that starts second heals from the first: its steps start later)
    assert [s for s, _, _ in survivor] == list(range(survivor[0][0], int(steps) + 1)), survivor
    assert any(r == 1 for *_, r in survivor) and survivor[-1][2] == 2, survivor  # dropped, then rejoined
    assert dropped_after < 30, dropped_after
    assert re.search(r"[1-9]\d* sequences of absent replica groups' parts were skipped", logs[0].read_text())
    a = load_everything(tmp_path / "group0" / "checkpoint" / f"step-{steps}")
    b = load_everything(tmp_path / "group1" / "checkpoint" / f"step-{steps}")
    for part in ("model", "optimizer"):  # the full weights and Adam's moments, bit for bit
        x, y = _tensors(a[part]), _tensors(b[part])
        assert x.keys() == y.keys() and x and all(torch.equal(x[k], y[k]) for k in x), part


def _tensors(tree, prefix="") -> dict:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _tensors(sub, f"{prefix}.{key}").items()}
    return {}


class _SumWith:
    """A stand-in for torchft's manager: its 'all-reduce' adds another group's vector."""

    def __init__(self, other):
        self.other = other

    def allreduce(self, tensor, reduce_op=None):
        tensor += self.other
        return types.SimpleNamespace(wait=lambda: None)

    def errored(self):
        return None


def _groups(cfg, other_vector):
    from titanlite.fault_tolerance import ReplicaGroups, shared_fingerprint

    rg = ReplicaGroups.__new__(ReplicaGroups)
    rg.cfg, rg.ft, rg.participants = cfg, cfg.fault_tolerance, 2
    rg.env = types.SimpleNamespace(world_size=1, device=torch.device("cpu"))
    rg.fingerprint = shared_fingerprint(cfg, 1)
    rg.manager = _SumWith(other_vector)
    return rg


def _vector(cfg, tokens=100.0):
    from titanlite.fault_tolerance import shared_fingerprint

    v = torch.zeros(cfg.fault_tolerance.group_count + 2, dtype=torch.float64)
    v[0], v[1 + cfg.fault_tolerance.replica_id], v[-1] = tokens, 1, shared_fingerprint(cfg, 1)
    return v


def test_each_step_checks_the_groups_ids_and_settings_in_the_token_sum():
    from titanlite.config import ConfigError, load

    ft = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_count", "2"]
    me = load(ft + ["--fault_tolerance.replica_id", "0"])
    peer = load(ft + ["--fault_tolerance.replica_id", "1", "--job.dump_folder", "elsewhere"])  # may differ
    assert _groups(me, _vector(peer, 50.0)).global_tokens(torch.tensor(100)).item() == 150
    with pytest.raises(ConfigError, match=r"fault_tolerance.replica_id = 0 is used by 2 live groups"):
        _groups(me, _vector(me)).global_tokens(torch.tensor(100))
    other = load(ft + ["--fault_tolerance.replica_id", "1", "--training.seq_len", "1024"])
    with pytest.raises(ConfigError, match=r"differ in their world size or in a setting"):
        _groups(me, _vector(other)).global_tokens(torch.tensor(100))


def test_a_step_waits_for_min_replicas_and_then_fails_with_a_message():
    from titanlite.config import load

    cfg = load(["--fault_tolerance.enable", "true", "--fault_tolerance.group_count", "2",
                "--fault_tolerance.min_replicas", "2", "--fault_tolerance.quorum_timeout_seconds", "0.3"])  # fmt: skip
    rg = _groups(cfg, None)
    quorums = []
    rg.manager = types.SimpleNamespace(start_quorum=lambda: quorums.append(1), num_participants=lambda: 1)
    rg.trainer = types.SimpleNamespace(step=0)
    with pytest.raises(RuntimeError, match=r"only 1 of the fault_tolerance.min_replicas = 2 replica groups are live"):
        rg.begin_step()
    assert len(quorums) > 1  # it asked again instead of computing a step that could not be committed
