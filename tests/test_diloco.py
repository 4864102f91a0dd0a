"""fault_tolerance.mode = "diloco": replica groups (torchrun jobs, gloo, CPU) with a torchft lighthouse on localhost.

Two groups against DiLoCo computed by hand from two single-process trainers (the inner steps are titanlite's, the
outer Nesterov step is the paper's formula written here); an exact resume mid-round; a group killed mid-round is
dropped from the next sync and heals at the one after its restart; the outer state in the checkpoint; refusals.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch
from test_fault_tolerance import _lighthouse, _scalars, _tensors, _wait_for

from helpers import faults_env, job, load_everything, make_trainer, run_distributed, subprocess_env, torchrun_cmd

torchft = pytest.importorskip("torchft")

OUTER_LR, OUTER_MOMENTUM, EVERY = 0.7, 0.9, 3


def _argv(folder, group: int, lighthouse: str, *extra) -> list[str]:
    from helpers import tiny_argv

    return tiny_argv(
        folder,
        "--training.global_batch_size", "8", "--training.local_batch_size", "2", "--training.steps", "8",
        "--fault_tolerance.enable", "true", "--fault_tolerance.group_count", "2",
        "--fault_tolerance.replica_id", str(group), "--fault_tolerance.lighthouse", lighthouse,
        "--fault_tolerance.timeout_seconds", "3", "--fault_tolerance.mode", "diloco",
        "--fault_tolerance.sync_every", str(EVERY), "--fault_tolerance.outer_lr", str(OUTER_LR),
        "--fault_tolerance.outer_momentum", str(OUTER_MOMENTUM), *extra,
    )  # fmt: skip


def _by_hand(tmp: str, lighthouse: str) -> tuple[dict, dict]:
    """Each group's inner steps in a trainer of its own (its part of each batch, titanlite's train_step without
    replica groups); at each round's end and the last step, DiLoCo's outer step by the paper's formulas:
    delta = global - mean(local), m = mu m + delta, global -= lr (delta + mu m) (Nesterov). The losses by group and
    step, and the final global weights."""
    import titanlite.trainer as trainer_module
    from titanlite.parallel.ft import NoReplicaGroups

    trainer_module.replica_groups = lambda cfg, state, env, **services: NoReplicaGroups()
    trainer_module.outer_optimizer = lambda cfg, model: None
    trainers = [make_trainer(_argv(Path(tmp) / f"ref{g}", g, lighthouse)) for g in (0, 1)]
    params = [dict(t.model.named_parameters()) for t in trainers]
    weights = {n: p.full_tensor().detach().clone() for n, p in params[0].items()}
    momentum = {n: torch.zeros_like(w) for n, w in weights.items()}
    losses: dict[int, dict[int, float]] = {0: {}, 1: {}}
    for step in range(1, 9):
        for g, t in enumerate(trainers):
            data = t.dataloader.next_step()
            t.step += 1
            losses[g][step] = t.global_loss(t.train_step(data.microbatches, None))
        if step % EVERY and step != 8:
            continue
        with torch.no_grad():
            for n in weights:
                delta = weights[n] - (params[0][n].full_tensor() + params[1][n].full_tensor()) / 2
                momentum[n] = OUTER_MOMENTUM * momentum[n] + delta
                weights[n] = weights[n] - OUTER_LR * (delta + OUTER_MOMENTUM * momentum[n])
                for p in (params[0][n], params[1][n]):
                    p.to_local().copy_(weights[n])  # one process: the local shard is the whole tensor
    return losses, weights


def _run_groups(tmp: Path, lighthouse, *extra, env=None, timeout=240):
    logs = [tmp / f"group{g}.log" for g in (0, 1)]
    procs = [
        job(torchrun_cmd(*_argv(tmp / f"group{g}", g, lighthouse.address(), *extra), nproc=1),
            env=env or subprocess_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
        for g, log in enumerate(logs)
    ]  # fmt: skip
    with procs[0] as p0, procs[1] as p1:
        assert p0.wait(timeout=timeout) == 0 and p1.wait(timeout=timeout) == 0, logs[0].read_text()[-3000:]
    return [log.read_text() for log in logs]


@pytest.mark.slow
def test_two_groups_match_diloco_by_hand_and_resume_mid_round_exactly(tmp_path):
    """fp32, 8 steps, a sync every 3 (at 3, 6 and the last step): each group's losses and the final weights equal
    the hand-computed DiLoCo within 1e-5; resumed from the checkpoint of step 4 (mid-round), both groups end with
    the same weights, bit for bit, as without the stop; the checkpoint holds the global weights, the outer momentum
    and the step of the last sync; each sync reports its bytes."""
    lighthouse = _lighthouse()
    extra = ("--fault_tolerance.min_replicas", "2", "--checkpoint.enable", "--checkpoint.interval", "4",
             "--metrics.enable_tensorboard")  # fmt: skip
    try:
        ref_losses, ref_weights = run_distributed(_by_hand, 1, str(tmp_path), lighthouse.address())[0]
        logs = _run_groups(tmp_path, lighthouse, *extra)
        first = [_tensors(load_everything(tmp_path / f"group{g}" / "checkpoint" / "step-8")["model"]) for g in (0, 1)]
        first_losses = [_scalars(tmp_path / f"group{g}")["loss"] for g in (0, 1)]
        at_4 = load_everything(tmp_path / "group0" / "checkpoint" / "step-4")
        for g in (0, 1):
            shutil.rmtree(tmp_path / f"group{g}" / "checkpoint" / "step-8")
            shutil.rmtree(tmp_path / f"group{g}" / "tb")
        resumed_logs = _run_groups(tmp_path, lighthouse, *extra)
    finally:
        lighthouse.shutdown()
    for g in (0, 1):
        resumed = _scalars(tmp_path / f"group{g}")["loss"]  # (the first run's were removed: steps 5 to 8, resumed)
        assert sorted(first_losses[g]) == list(range(1, 9)) and sorted(resumed) == [5, 6, 7, 8]
        assert "Resuming from" in resumed_logs[g] and logs[g].count("DiLoCo: outer step after step") == 3
        assert "2 of 2 groups averaged (0.50 MiB all-reduced per rank)" in logs[g]
        for s in range(1, 9):  # the losses differ between the groups: each trains its own part between syncs
            assert abs(first_losses[g][s] - ref_losses[g][s]) < 1e-5, (g, s, first_losses[g][s], ref_losses[g][s])
        for s, loss in resumed.items():
            assert abs(loss - ref_losses[g][s]) < 1e-5, (g, s, loss, ref_losses[g][s])
        for k, w in first[g].items():
            torch.testing.assert_close(w, ref_weights[k.lstrip(".")], rtol=0, atol=1e-5, msg=k)
        again = _tensors(load_everything(tmp_path / f"group{g}" / "checkpoint" / "step-8")["model"])
        assert all(torch.equal(again[k], first[g][k]) for k in first[g]), g
    assert all(torch.equal(first[0][k], first[1][k]) for k in first[0])
    outer = at_4["optimizer"]["diloco"]
    assert outer["synced_step"] == 3 and outer["global"].keys() == outer["momentum"].keys()
    assert all(m.abs().sum() > 0 for m in outer["momentum"].values())  # the momentum of the sync at step 3


@pytest.mark.slow
def test_a_group_killed_mid_round_is_left_out_and_heals_at_a_sync_after_its_restart(tmp_path):
    """Group 1 is SIGKILLed at step 5 of 21 (mid-round): group 0's sync at step 6 goes on without it (1 of 2 groups).
    Restarted, group 1 resumes its checkpoint of step 4 and meets group 0 at a later sync, where it heals (global
    weights, outer momentum, optimizer, schedule, data position) and adds nothing; both end bit-identical. An MoE
    (aux_free): the routing biases, moved by each group during a round, are averaged at each sync."""
    lighthouse = _lighthouse()
    common = ("--training.steps", "21", "--checkpoint.enable", "--checkpoint.interval", "4",
              "--model.name", "qwen3_moe", "--moe.load_balance", "aux_free")  # fmt: skip
    env0 = faults_env("", TITANLITE_STEP_PAUSE="0.6")
    logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
    cmd = [torchrun_cmd(*_argv(tmp_path / f"group{g}", g, lighthouse.address(), *common), nproc=1) for g in (0, 1)]
    try:
        with job(cmd[0], env=env0, stdout=open(logs[0], "w"), stderr=subprocess.STDOUT) as p0:
            with job(cmd[1], env=faults_env("kill:step:5:0"), stdout=open(logs[1], "w"),
                     stderr=subprocess.STDOUT) as p1:  # fmt: skip
                assert p1.wait(timeout=120) != 0
            alone = "outer step after step 6: the pseudo-gradients of 1 of 2 groups"
            _wait_for(logs[0], lambda steps, t: alone in t, "group 0's sync at step 6 without group 1")
            with job(cmd[1], env=subprocess_env(), stdout=open(logs[1], "w"), stderr=subprocess.STDOUT) as p1:
                assert p1.wait(timeout=180) == 0, logs[1].read_text()[-3000:]
            assert p0.wait(timeout=180) == 0, logs[0].read_text()[-3000:]
    finally:
        lighthouse.shutdown()
    text0, text1 = logs[0].read_text(), logs[1].read_text()
    assert "Resuming from" in text1 and "healed from a live group at step" in text1, text1[-3000:]
    healed = int(text1.split("healed from a live group at step ")[1].split(" ")[0])
    assert healed % EVERY == 0 and healed > 6, healed
    assert f"outer step after step {healed}: the pseudo-gradients of 1 of 2 groups" in text0  # group 1 added none
    assert "outer step after step 21: the pseudo-gradients of 2 of 2 groups" in text0
    final = [load_everything(tmp_path / f"group{g}" / "checkpoint" / "step-21") for g in (0, 1)]
    _same_global_state(*final)
    model = _tensors(final[0]["model"])
    assert any(k.endswith("expert_bias") and v.any() for k, v in model.items())


def _same_global_state(a: dict, b: dict) -> None:
    """Two groups' checkpoints after a sync: the same weights, global weights, outer momentum, schedule, data
    position and step (each group's AdamW state is its own: it trained its own data)."""
    pairs = [(a["model"], b["model"]), (a["optimizer"]["diloco"], b["optimizer"]["diloco"])]
    for x, y in pairs:
        tx, ty = _tensors(x), _tensors(y)
        assert tx.keys() == ty.keys() and all(torch.equal(tx[k], ty[k]) for k in tx)
    assert a["optimizer"]["diloco"]["synced_step"] == b["optimizer"]["diloco"]["synced_step"]
    assert a["lr_scheduler"] == b["lr_scheduler"] and a["dataloader"] == b["dataloader"]
    assert a["train_state"]["step"] == b["train_state"]["step"]


@pytest.mark.slow
def test_a_stop_at_the_last_sync_saves_the_round_and_the_relaunch_makes_that_sync(tmp_path):
    """min_replicas = 2; group 1 is SIGKILLed at step 7, group 0 waits at the job's last sync (step 8) and gets a
    scheduler's SIGTERM there: it saves step 8 before the sync and exits 0. Relaunched, group 0 still owes that sync
    (no 'nothing to train') and group 1, resumed at step 4, heals in it: group 0's round is averaged alone, and both
    save step 8 with the same weights."""
    lighthouse = _lighthouse()
    extra = ("--fault_tolerance.min_replicas", "2", "--checkpoint.enable", "--checkpoint.interval", "4")
    logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
    cmd = [torchrun_cmd(*_argv(tmp_path / f"group{g}", g, lighthouse.address(), *extra), nproc=1) for g in (0, 1)]
    cmd[0][cmd[0].index("torch.distributed.run")] = "titanlite.cli.launch"  # as run_train.sh starts it
    try:
        with job(cmd[0], env=subprocess_env(), stdout=open(logs[0], "w"), stderr=subprocess.STDOUT) as p0:
            with job(cmd[1], env=faults_env("kill:step:7:0"), stdout=open(logs[1], "w"),
                     stderr=subprocess.STDOUT) as p1:  # fmt: skip
                assert p1.wait(timeout=120) != 0
            _wait_for(logs[0], lambda steps, t: "step:     7" in t, "group 0's step 7")
            time.sleep(3)  # at the sync of step 8 by now, waiting for a second group
            p0.send_signal(signal.SIGTERM)
            assert p0.wait(timeout=60) == 0, logs[0].read_text()[-3000:]
        stopped = logs[0].read_text()
        assert "Stopped by a stop signal while waiting" in stopped and "outer step after step 8" not in stopped
        assert load_everything(tmp_path / "group0" / "checkpoint" / "step-8")["optimizer"]["diloco"]["synced_step"] == 6
        texts = _run_groups(tmp_path, lighthouse, *extra)
    finally:
        lighthouse.shutdown()
    assert "nothing to train" not in texts[0] and "outer step after step 8: the pseudo-gradients of 1 of 2" in texts[0]
    assert "Resuming from" in texts[1] and "healed from a live group at step 8" in texts[1], texts[1][-3000:]
    final = [load_everything(tmp_path / f"group{g}" / "checkpoint" / "step-8") for g in (0, 1)]
    _same_global_state(*final)
    assert final[0]["optimizer"]["diloco"]["synced_step"] == 8


def test_the_outer_step_is_nesterov_on_the_mean_pseudo_gradient_and_a_fresh_state_starts_from_the_weights():
    """OuterOptimizer alone (one process, no torchft): two syncs with given pseudo-gradient sums match the formulas;
    a checkpoint without the outer state starts it from the loaded weights (and says so)."""
    from titanlite.config import load
    from titanlite.parallel.ft.diloco import OuterOptimizer

    ft = load(["--fault_tolerance.mode", "diloco"]).fault_tolerance
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)  # frozen: not in the outer state
    outer = OuterOptimizer(model, ft)
    assert list(outer.globals) == ["weight"] and outer.payload_bytes() == 6 * 4
    w0 = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # this group's inner steps moved it by +1
    (flat,) = outer.pseudo_gradients()
    assert torch.allclose(flat, -torch.ones(6))
    other = -3 * torch.ones(6)  # a second group moved by +3: mean pseudo-gradient -2
    outer.outer_step([flat + other], 2, step=3)
    m = torch.full((2, 3), -2.0)
    expected = w0 - ft.outer_lr * (-2.0 + ft.outer_momentum * m)
    torch.testing.assert_close(model.weight.detach(), expected)
    outer.outer_step([torch.zeros(6)], 1, step=6)  # no movement: momentum alone
    m = ft.outer_momentum * m
    expected = expected - ft.outer_lr * (0 + ft.outer_momentum * m)
    torch.testing.assert_close(model.weight.detach(), expected)
    assert outer.synced_step == 6
    fresh = OuterOptimizer(model, ft)
    with torch.no_grad():
        model.weight.zero_()
    assert "holds no outer state" in fresh.after_load(step=7) and fresh.synced_step == 7
    assert torch.equal(fresh.globals["weight"], torch.zeros(2, 3))


def test_diloco_needs_fault_tolerance_and_valid_outer_settings():
    from titanlite.config import ConfigError, load
    from titanlite.parallel.ft import problem

    dims = types.SimpleNamespace(dp_replicate=1)
    message = problem(load(["--fault_tolerance.mode", "diloco"]), dims)
    assert "fault_tolerance.mode = 'diloco'" in message and "fault_tolerance.enable = true" in message
    for key, value, valid in (
        ("mode", "local_sgd", "sync or diloco"),
        ("sync_every", "0", "an integer >= 1"),
        ("outer_momentum", "1", "from 0 to below 1"),
        ("outer_lr", "0", "a number > 0"),
    ):
        with pytest.raises(ConfigError, match=f"fault_tolerance.{key} = .*{valid}"):
            load([f"--fault_tolerance.{key}", value])


@pytest.mark.slow
def test_the_dry_run_counts_the_outer_state_as_two_more_fp32_copies(capsys):
    """AdamW's 2 states + the global weights + the outer momentum: the optimizer row doubles (1 without momentum)."""
    from test_dry_run import _main, _table

    base = ("--job.config_file", "llama8b_fsdp", "--training.global_batch_size", "16", *FT_ON)
    rows = {}
    for name, extra in (
        ("sync", ()),
        ("diloco", DILOCO),
        ("plain", (*DILOCO, "--fault_tolerance.outer_momentum", "0")),
    ):
        code, out, _ = _main(capsys, 8, *base, *extra)
        assert code == 0, out
        rows[name] = _table(out)["optimizer"]
    assert "AdamW, 3 x fp32 per parameter (with DiLoCo's global weights)" in out  # (the last: no momentum)
    assert rows["diloco"] == pytest.approx(2 * rows["sync"], rel=0.02)
    assert rows["plain"] == pytest.approx(1.5 * rows["sync"], rel=0.02)


FT_ON = ("--fault_tolerance.enable", "true", "--fault_tolerance.group_count", "2")
DILOCO = ("--fault_tolerance.mode", "diloco")
