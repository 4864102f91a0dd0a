"""Checkpoints: exact resume, resume on other topologies, async save, export/import, bad input (gloo, CPU)."""

import os
import shutil
import signal

import pytest
import torch

from helpers import capture_logs, ckpt_argv, full_model, load_everything, make_trainer, run_distributed, run_module

pytestmark = pytest.mark.slow  # multi-process (gloo) or torchrun tests


class _Crash(Exception):
    pass


def _interrupt_at(trainer, step, action):
    """Run action() when the trainer fetches the data of `step` (before that step computes anything)."""
    fetch = trainer.dataloader.next_step

    def next_step():
        if trainer.step == step:
            action()
        return fetch()

    trainer.dataloader.next_step = next_step


def _crash():
    raise _Crash


# ----------------------------------------------------------------------------- exact resume, other topologies


def _world4_resume(tmp):
    import torch.distributed as dist

    fsdp = ckpt_argv(tmp, "--training.local_batch_size", "1")  # FSDP(4), 2 microbatches
    hsdp = fsdp + ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.hsdp_delay_all_reduce"]
    off = ["--checkpoint.enable", "false"]
    out = {"ref_fsdp4": make_trainer(fsdp + off).train(), "ref_hsdp": make_trainer(hsdp + off).train()}

    # FSDP(4): saves step-3 on the interval, crashes in step 4, resumes.
    t = make_trainer(fsdp + ["--checkpoint.folder", "a", "--checkpoint.interval", "3"])
    _interrupt_at(t, 4, _crash)
    try:
        t.train()
    except _Crash:
        t.checkpointer.close()  # a crashed process would exit; this one goes on, so restore the signal handlers
    t = make_trainer(fsdp + ["--checkpoint.folder", "a", "--checkpoint.interval", "3"])
    out["fsdp4_resumed_step"] = t.step
    out["fsdp4_resumed"] = t.train()

    # HSDP(2x2) with the delayed all-reduce: SIGUSR1 on rank 1 during step 3 stops every rank after saving it.
    t = make_trainer(hsdp + ["--checkpoint.folder", "b"])
    _interrupt_at(t, 3, lambda: dist.get_rank() == 1 and os.kill(os.getpid(), signal.SIGUSR1))
    out["hsdp_preempted"] = t.train()
    out["hsdp_preempted_flag"] = t.checkpointer.preempted
    out["hsdp_resumed"] = make_trainer(hsdp + ["--checkpoint.folder", "b"]).train()

    # FSDP(4) checkpoint of step 3 -> HSDP(2x2) with delayed all-reduce.
    t = make_trainer(hsdp + ["--checkpoint.folder", "a", "--checkpoint.load_step", "3"])
    out["fsdp4_to_hsdp_position"] = t.dataloader.state_dict()["sequence_index"]
    out["fsdp4_to_hsdp"] = t.train()
    return out


def _resume_other_world(tmp, local_batch_size):
    base = ckpt_argv(tmp, "--training.local_batch_size", str(local_batch_size))
    ref = make_trainer(base + ["--checkpoint.enable", "false"]).train()
    t = make_trainer(base + ["--checkpoint.folder", "a", "--checkpoint.load_step", "3"])
    return {"ref": ref, "step": t.step, "resumed": t.train()}


def test_resume_is_exact_and_works_on_other_topologies(tmp_path):
    r = run_distributed(_world4_resume, 4, str(tmp_path))[0]
    ref = r["ref_fsdp4"]
    # exact: bit-identical losses after a crash + resume (FSDP(4), accumulation 2)
    assert r["fsdp4_resumed_step"] == 3
    assert r["fsdp4_resumed"] == {s: ref[s] for s in (4, 5, 6)}
    # preemption: every rank stopped after saving step 3; the resume is exact (HSDP, delayed all-reduce)
    assert r["hsdp_preempted_flag"] and sorted(r["hsdp_preempted"]) == [1, 2, 3]
    assert r["hsdp_resumed"] == {s: r["ref_hsdp"][s] for s in (4, 5, 6)}
    # FSDP(4) -> HSDP(2x2): resharded model/optimizer, the global data position, same losses
    assert r["fsdp4_to_hsdp_position"] == 3 * 8
    for s in (4, 5, 6):
        assert abs(r["fsdp4_to_hsdp"][s] - r["ref_hsdp"][s]) < 1e-5, s
    assert (tmp_path / "a" / "step-3").is_dir() and (tmp_path / "a" / "step-6").is_dir()

    # FSDP(4) -> FSDP(2) and -> a single process
    for world, local in ((2, 2), (1, 4)):
        w = run_distributed(_resume_other_world, world, str(tmp_path), local)[0]
        assert w["step"] == 3 and sorted(w["resumed"]) == [4, 5, 6]
        for s in (4, 5, 6):
            assert abs(w["resumed"][s] - w["ref"][s]) < 1e-5, (world, s, w["resumed"][s], w["ref"][s])
        assert abs(w["ref"][6] - ref[6]) < 1e-5  # and the topologies agree with each other


# ----------------------------------------------------------------------------- async, export, import


def _async_and_sync(tmp):
    base = ckpt_argv(tmp, "--training.steps", "4", "--training.local_batch_size", "4", "--checkpoint.interval", "2")
    sync = make_trainer(base + ["--checkpoint.folder", "sync"]).train()
    t = make_trainer(base + ["--checkpoint.folder", "async", "--checkpoint.async_mode", "async"])
    seen = {}
    _interrupt_at(t, 3, lambda: seen.setdefault("pending_in_step3", t.checkpointer._pending is not None))
    losses = t.train()
    return {"sync": sync, "async": losses, **seen, "pending_after": t.checkpointer._pending}


def _assert_same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, path


def _initial_loads(tmp, sources):
    import torch.distributed as dist

    out = {}
    for name, src in sources.items():
        t = make_trainer(
            ckpt_argv(
                tmp,
                "--training.local_batch_size",
                "4",
                "--checkpoint.folder",
                f"init-{name}",
                "--checkpoint.initial_load_path",
                src,
            )
        )
        model = full_model(t)  # a collective: every rank
        out[name] = {"step": t.step, "model": model if dist.get_rank() == 0 else None}
    try:  # a checkpoint of another model shape
        make_trainer(
            ckpt_argv(
                tmp, "--training.local_batch_size", "4", "--checkpoint.folder", "sync", "--model.vocab_size", "300"
            )
        )
    except Exception as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
    return out


def test_async_save_equals_sync_and_export_import(tmp_path):
    r = run_distributed(_async_and_sync, 2, str(tmp_path))[0]
    assert r["async"] == r["sync"]
    assert r["pending_in_step3"] is True  # step 3 trained while step 2 was being written
    assert r["pending_after"] is None  # the last save was awaited and committed
    for step in (2, 4):
        _assert_same(
            load_everything(tmp_path / "sync" / f"step-{step}"), load_everything(tmp_path / "async" / f"step-{step}")
        )
    assert not [p for p in (tmp_path / "async").iterdir() if p.name.startswith(".tmp")]

    saved = load_everything(tmp_path / "sync" / "step-4")
    assert set(saved) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    assert saved["train_state"]["step"] == 4 and saved["dataloader"]["sequence_index"] == 32
    model = saved["model"]
    assert "layers.0.attention.wq.weight" in model

    files = {}
    for dtype in ("", "bfloat16"):
        out = tmp_path / f"export{dtype}.pt"
        p = run_module(
            "titanlite.checkpoint",
            "export",
            "--checkpoint",
            tmp_path / "sync" / "step-4",
            "--output",
            out,
            *(["--dtype", dtype] if dtype else []),
        )
        assert p.returncode == 0, p.stderr
        files[dtype or "float32"] = out
    fp32 = torch.load(files["float32"], weights_only=True)
    bf16 = torch.load(files["bfloat16"], weights_only=True)
    _assert_same(fp32, model)
    assert bf16.keys() == model.keys() and all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert torch.equal(bf16["output.weight"], model["output.weight"].bfloat16())
    p = run_module("titanlite.checkpoint", "export", "--checkpoint", tmp_path / "nope", "--output", tmp_path / "x.pt")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "nope" in p.stderr

    sources = {"file": str(files["float32"]), "bf16": str(files["bfloat16"]), "dcp": str(tmp_path / "sync" / "step-4")}
    loads = run_distributed(_initial_loads, 2, str(tmp_path), sources)[0]
    for name in ("file", "dcp"):
        assert loads[name]["step"] == 0, name  # a new run, only the weights
        _assert_same(loads[name]["model"], model)
    assert all(torch.equal(loads["bf16"]["model"][k], bf16[k].float()) for k in model)
    msg = loads["mismatch"]
    assert msg.startswith("ConfigError") and "was saved by a model of another shape" in msg
    assert "vocab_size: 258 in the checkpoint, 300 in this run" in msg


# ----------------------------------------------------------------------------- retention, crash safety, bad input


def _save_model_only_last(tmp):
    make_trainer(
        ckpt_argv(
            tmp,
            "--training.steps",
            "4",
            "--training.local_batch_size",
            "4",
            "--checkpoint.interval",
            "1",
            "--checkpoint.keep_latest_k",
            "1",
            "--checkpoint.last_save_model_only",
            "--checkpoint.export_dtype",
            "bfloat16",
        )
    ).train()


def _resume_past_bad_folders(tmp, bf16_model):
    logs = capture_logs()
    base = ckpt_argv(
        tmp, "--training.local_batch_size", "4", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1"
    )
    # a new run from the bf16 model-only save (a DCP folder) gets its weights, upcast
    t = make_trainer(
        base + ["--checkpoint.folder", "fresh", "--checkpoint.initial_load_path", f"{tmp}/checkpoint/step-4"]
    )
    bf16_loaded = all(torch.equal(v, bf16_model[k].float()) for k, v in full_model(t).items())
    t = make_trainer(base)
    out = {"resumed_step": t.step, "logs": list(logs), "bf16_loaded": bf16_loaded}
    out["losses"] = t.train()
    trained = full_model(t)
    t = make_trainer(
        base
        + [
            "--checkpoint.load_step",
            "6",
            "--checkpoint.exclude_from_loading",
            "optimizer,lr_scheduler,dataloader,train_state",
        ]
    )
    out["excluded_step"] = t.step
    out["excluded_position"] = t.dataloader.state_dict()["sequence_index"]
    out["excluded_model_equal"] = all(torch.equal(v, trained[k]) for k, v in full_model(t).items())
    return out


def test_retention_crash_leftovers_and_bad_input(tmp_path):
    from titanlite.checkpoint.catalog import preflight, read_info
    from titanlite.config import ConfigError, load
    from titanlite.runtime.run_control import LOCK_NAME  # the last trainer of _resume_past_bad_folders never ends

    run_distributed(_save_model_only_last, 2, str(tmp_path))
    folder = tmp_path / "checkpoint"
    # keep_latest_k = 1 keeps the newest (the model-only save of the last step) and the newest full one
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-4"]
    assert read_info(folder / "step-4").parts == {"model"}
    assert read_info(folder / "step-3").parts == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    bf16_model = load_everything(folder / "step-4")["model"]
    assert all(v.dtype == torch.bfloat16 for v in bf16_model.values())

    # what a crash leaves behind: an unfinished save, a partial copy, a folder with a broken .metadata
    shutil.copytree(folder / "step-3", folder / ".tmp-step-5")
    shutil.copytree(folder / "step-3", folder / "step-6", ignore=shutil.ignore_patterns(".metadata"))
    (folder / "step-7").mkdir()
    (folder / "step-7" / ".metadata").write_bytes(b"not a pickle")

    def error(*extra):
        with pytest.raises(ConfigError) as e:
            preflight(load(ckpt_argv(tmp_path, *extra)))
        return str(e.value)

    msg = error("--checkpoint.load_step", "9")
    assert "no step-9" in msg and "complete checkpoints there: 3, 4" in msg
    assert "no .metadata" in error("--checkpoint.load_step", "6")
    assert "cannot be read" in error("--checkpoint.load_step", "7")
    assert "holds only ['model']" in error("--checkpoint.load_step", "4")
    (tmp_path / "a_file").write_text("")
    msg = error("--job.dump_folder", str(tmp_path / "a_file" / "out"))
    assert "job.dump_folder" in msg and "cannot write" in msg and "Not a directory" in msg
    assert "initial_load_path" in error("--checkpoint.initial_load_path", str(tmp_path / "missing.pt"))

    r = run_distributed(_resume_past_bad_folders, 2, str(tmp_path), bf16_model)[0]
    assert r["bf16_loaded"]
    logs = "\n".join(r["logs"])
    assert "Removing incomplete checkpoint" in logs and ".tmp-step-5" in logs
    assert "step-7: its .metadata cannot be read" in logs and "step-6: it has no .metadata" in logs
    assert "step-4 for resuming: it holds only ['model']" in logs
    assert r["resumed_step"] == 3 and sorted(r["losses"]) == [4, 5, 6]
    # the newest complete checkpoint survives keep_latest_k = 1; the unreadable step-7 is left alone
    assert sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME) == ["step-6", "step-7"]
    # exclude_from_loading: only the model comes back; step, data position and schedule start fresh
    assert r["excluded_step"] == 0 and r["excluded_position"] == 0 and r["excluded_model_equal"]


def test_optimizer_settings_reach_torch_load_so_fused_steps_stay_on_the_device(monkeypatch):
    """Checkpoints keep each optimizer group's parameters only, but torch's load reads `fused` from the groups it is
    given to keep each "step" on the parameter's device. Fused AdamW on a GPU with its step left on the host updates
    differently, and a resume there was not exact: the run's settings must reach that load."""
    from torch.optim import Optimizer

    from titanlite.checkpoint.parts import OptimizerPart

    model = torch.nn.Linear(16, 16)
    first = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.randn(2, 16)).sum().backward()
    first.step()
    saved = OptimizerPart(model, first).state_dict()
    assert all(set(group) == {"params"} for group in saved["param_groups"])
    seen = []
    load_value = Optimizer._process_value_according_to_param_policy

    def recorded(param, value, param_id, param_groups, key=None):
        if key == "step":
            seen.append(all(group.get("fused") for group in param_groups))
        return load_value(param, value, param_id, param_groups, key)

    monkeypatch.setattr(Optimizer, "_process_value_according_to_param_policy", staticmethod(recorded))
    second = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    OptimizerPart(model, second).load_state_dict(saved)
    assert seen == [True, True]  # the weight's and the bias's steps
    assert second.param_groups[0]["fused"] is True
