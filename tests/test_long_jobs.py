"""A week-long job on a shared cluster: failed saves, corrupt checkpoints, config changes on resume,
settings that must apply, degenerate runs and bad input (gloo, CPU). Faults are injected by the tests
themselves (a patched writer inside the worker, bytes flipped on disk), never by hooks in titanlite."""

import errno
import json
import os
import subprocess
import sys

import pytest

from titanlite.config import load
from titanlite.errors import CheckpointSaveError, ConfigError

from helpers import (
    capture_logs,
    ckpt_argv,
    make_trainer,
    run_distributed,
    run_job,
    run_module,
    subprocess_env,
    tiny_argv,
)


def _full_argv(tmp, *extra):
    return ckpt_argv(tmp, "--training.local_batch_size", "4", "--checkpoint.interval", "2", *extra)


def _precheck(tmp, *extra):
    """The pre-launch check (`python -m titanlite.config`) of a 2-rank run of _full_argv."""
    return run_module(
        "titanlite.config", "--world-size", "2", *_full_argv(tmp, *extra), env=subprocess_env(TITANLITE_QUIET_CHECK="1")
    )


# ----------------------------------------------------------------------------- 1. disk full during a save


def _disk_full_on_rank1_at(step):
    """Fault injection for this process: rank 1's writer fails with ENOSPC when the save of `step` writes."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if dist.get_rank() == 1 and f".tmp-step-{step}" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, plan, planner)

    FileSystemWriter.write_data = failing
    return lambda: setattr(FileSystemWriter, "write_data", write)


def _disk_full(tmp):
    out = {}
    undo = _disk_full_on_rank1_at(4)
    try:
        make_trainer(_full_argv(tmp)).train()
    except CheckpointSaveError as e:
        out["stop"] = str(e)
    out["after_stop"] = sorted(p.name for p in (tmp / "checkpoint").iterdir())
    undo()
    t = make_trainer(_full_argv(tmp))  # the relaunch
    out["resumed_step"] = t.step
    logs = capture_logs()
    undo = _disk_full_on_rank1_at(4)
    t = make_trainer(_full_argv(tmp / "b", "--checkpoint.on_save_error", "continue"))
    out["continue_losses"] = t.train()
    undo()
    out["continue_logs"] = list(logs)
    out["continue_folders"] = sorted(p.name for p in (tmp / "b" / "checkpoint").iterdir())
    return out


@pytest.mark.slow
def test_disk_full_during_a_save(tmp_path):
    r = run_distributed(_disk_full, 2, tmp_path)[0]
    msg = r["stop"]
    assert "checkpoint of step 4 could not be written to" in msg and "no space left on device" in msg
    assert "step-2 is intact and is where a relaunch resumes" in msg and "GB are free" in msg
    assert ".tmp-step-4 was removed" in msg and "stopping" in msg
    assert [n for n in r["after_stop"] if "step" in n] == ["step-2"]  # the partial folder is gone
    assert r["resumed_step"] == 2
    assert sorted(r["continue_losses"]) == [1, 2, 3, 4, 5, 6]  # went on without that checkpoint
    assert "training goes on without it" in "\n".join(r["continue_logs"])
    assert [n for n in r["continue_folders"] if "step" in n] == ["step-2", "step-6"]


# ----------------------------------------------------------------------------- 2. corrupt checkpoints


def _train_six(tmp):
    make_trainer(_full_argv(tmp)).train()


def _resume_from(tmp, *extra):
    logs = capture_logs()
    try:
        t = make_trainer(_full_argv(tmp, *extra))
    except ConfigError as e:
        return {"error": str(e)}
    return {"step": t.step, "logs": list(logs)}


@pytest.mark.slow
def test_corrupt_checkpoints_are_skipped_or_refused(tmp_path):
    run_distributed(_train_six, 2, tmp_path)
    folder = tmp_path / "checkpoint"
    assert (folder / "step-6" / "manifest.json").is_file()
    victim = sorted((folder / "step-6").glob("__1_*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 65536] = bytes(b ^ 0xFF for b in data[mid : mid + 65536])  # 64 KiB of flipped bytes
    victim.write_bytes(bytes(data))
    r = run_distributed(_resume_from, 2, tmp_path)[0]
    assert r["step"] == 4  # the previous complete checkpoint
    logs = "\n".join(r["logs"])
    assert f"Skipping corrupt checkpoint {folder / 'step-6'}" in logs and victim.name in logs and "checksum" in logs
    # nothing deleted: set aside, so that a later resume and retention never count it before this run's saves
    assert not (folder / "step-6").exists() and (folder / "abandoned-step-6" / victim.name).exists()
    assert "Set step-6 aside as" in logs
    os.rename(folder / "abandoned-step-6", folder / "step-6")
    # damage that no manifest shows (saved before checksums) but that breaks loading: skipped the same way
    (folder / "step-6" / "manifest.json").rename(folder / "manifest.json")
    tail = victim.read_bytes()
    victim.write_bytes(tail[:-300] + bytes(300))
    r = run_distributed(_resume_from, 2, tmp_path)[0]
    logs = "\n".join(r["logs"])
    assert r["step"] == 4 and f"Skipping corrupt checkpoint {folder / 'step-6'}: a saved item cannot be read" in logs
    assert "Traceback" not in logs and "RANK" not in logs
    os.rename(folder / "abandoned-step-6", folder / "step-6")
    r = run_distributed(_resume_from, 2, tmp_path, "--checkpoint.load_step", "6")[0]
    assert r["error"].startswith("checkpoint.load_step = 6: ") and "a saved item cannot be read" in r["error"]
    assert "\n" not in r["error"] and "complete checkpoints there: 2, 4, 6" in r["error"]
    victim.write_bytes(tail)
    (folder / "manifest.json").rename(folder / "step-6" / "manifest.json")
    # an explicit load_step that is corrupt: one clear message
    r = run_distributed(_resume_from, 2, tmp_path, "--checkpoint.load_step", "6")[0]
    assert "checkpoint.load_step = 6" in r["error"] and "is corrupt" in r["error"] and victim.name in r["error"]
    # a checkpoint of another model shape is refused by the pre-launch check, from its metadata alone
    check = _precheck(tmp_path, "--model.vocab_size", "300")
    assert check.returncode == 2 and "Traceback" not in check.stderr, check.stderr
    assert (
        "was saved by a model of another shape" in check.stderr and "vocab_size: 258 in the checkpoint" in check.stderr
    )
    # truncated and missing files: the pre-launch check sees them from the manifest's sizes
    victim.write_bytes(bytes(data)[:1000])
    check = _precheck(tmp_path, "--checkpoint.load_step", "6")
    assert check.returncode == 2 and "Traceback" not in check.stderr and "truncated" in check.stderr
    victim.unlink()
    r = run_distributed(_resume_from, 2, tmp_path)[0]
    assert r["step"] == 4 and "is missing" in "\n".join(r["logs"])


# ----------------------------------------------------------------------------- 3, 10, 11. changed settings on resume


def _changed_settings(tmp):
    base = ckpt_argv(tmp, "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "2")
    first = make_trainer(base)
    first.train()
    last_lr = first.optimizer.param_groups[0]["lr"]
    logs = capture_logs()
    # train further: 6 -> 12 steps with the same lr: the lr goes on from where it was
    t = make_trainer(base + ["--training.steps", "12"])
    further = {"lr_resumed": t.optimizer.param_groups[0]["lr"], "lr_before": last_lr}
    t.train()
    further["lrs"] = [t.lr_scheduler.lr_lambdas[0](s) for s in range(6, 13)]
    # the config wins for hyperparameters
    t = make_trainer(
        base
        + [
            "--training.steps",
            "12",
            "--optimizer.lr",
            "1e-2",
            "--optimizer.weight_decay",
            "0.0",
            "--optimizer.beta1",
            "0.8",
            "--checkpoint.load_step",
            "6",
        ]
    )
    group = t.optimizer.param_groups[0]
    hyper = {
        "lr": group["lr"],
        "betas": group["betas"],
        "weight_decay": group["weight_decay"],
        "factor": t.lr_scheduler.lr_lambdas[0](6),
    }
    try:  # untying the embeddings of a tied run
        make_trainer(base + ["--model.tie_embeddings", "--checkpoint.load_step", "6"])
    except ConfigError as e:
        hyper["tie_error"] = str(e)
    return {"further": further, "hyper": hyper, "logs": list(logs)}


@pytest.mark.slow
def test_config_changes_on_resume(tmp_path):
    r = run_distributed(_changed_settings, 2, tmp_path)[0]
    f = r["further"]
    assert abs(f["lr_resumed"] - f["lr_before"]) < 1e-12  # no jump when training further
    assert all(a >= b - 1e-12 for a, b in zip(f["lrs"], f["lrs"][1:]))  # and it keeps decaying
    h = r["hyper"]
    assert h["betas"] == (0.8, 0.95) and h["weight_decay"] == 0.0
    assert abs(h["lr"] - 1e-2 * h["factor"]) < 1e-12  # the new peak lr, at the schedule's position
    logs = "\n".join(r["logs"])
    assert "the config wins" in logs and "optimizer.lr: 0.003 -> 0.01" in logs
    assert "training.steps: 6 -> 12" in logs and "(no jump)" in logs
    assert "optimizer.weight_decay: 0.1 -> 0.0" in logs
    assert "tie_embeddings: False in the checkpoint, True in this run" in h["tie_error"]


def test_tie_embeddings_false_unties_the_flavors_that_tie():
    from titanlite.models.registry import model_args

    for argv, tied in (([], True), (["--model.tie_embeddings", "false"], False), (["--model.tie_embeddings"], True)):
        assert model_args(load(["--model.flavor", "1B", *argv]).model, 258, 256).tie_embeddings is tied
    assert model_args(load(["--model.flavor", "tiny", "--model.tie_embeddings"]).model, 258, 256).tie_embeddings


def _keep_load_step(tmp):
    base = ckpt_argv(
        tmp,
        "--training.local_batch_size",
        "4",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "1",
        "--lr_scheduler.decay_type",
        "constant",
    )
    make_trainer(base + ["--training.steps", "3", "--checkpoint.keep_latest_k", "0"]).train()
    make_trainer(base + ["--checkpoint.load_step", "2"]).train()  # a requeue told to load step 2
    return sorted(p.name for p in (tmp / "checkpoint").iterdir() if p.name.startswith("step"))


@pytest.mark.slow
def test_keep_latest_k_never_deletes_the_step_to_load(tmp_path):
    assert run_distributed(_keep_load_step, 2, tmp_path)[0] == ["step-2", "step-6"]


def _resume_older_then_keep_one(tmp):
    base = ckpt_argv(tmp, "--training.local_batch_size", "8", "--training.steps", "8", "--checkpoint.interval", "2")
    make_trainer(base).train()  # step-2, 4, 6, 8
    logs = capture_logs()
    # back to step 4, saving every 3 steps up to 7 with keep_latest_k = 1: the old step-6 and step-8 are newer than
    # anything this run saves, and retention counted them first (it removed this run's step-6 and step-7)
    make_trainer(base + ["--checkpoint.load_step", "4", "--checkpoint.interval", "3", "--training.steps", "7",
                         "--checkpoint.keep_latest_k", "1"]).train()  # fmt: skip
    folders = sorted(p.name for p in (tmp / "checkpoint").iterdir() if "step" in p.name)
    return {"folders": folders, "logs": list(logs), "next": make_trainer(base).step}


@pytest.mark.slow
def test_a_resume_from_an_older_step_sets_the_newer_ones_aside(tmp_path):
    r = run_distributed(_resume_older_then_keep_one, 1, tmp_path)[0]
    assert r["folders"] == ["abandoned-step-6", "abandoned-step-8", "step-4", "step-7"], r["folders"]
    folder = tmp_path / "checkpoint"
    assert (
        f"Set step-8 aside as {folder / 'abandoned-step-8'}: it is newer than the step this run resumes from (4)"
        in ("\n".join(r["logs"]))
    )
    assert r["next"] == 7  # a later resume goes on from this run's newest save, not the abandoned step-8


# ----------------------------------------------------------------------------- 8. degenerate runs, 12. input gaps


def test_degenerate_runs_are_warned_about(tmp_path):
    from titanlite.data.build import build_loader
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.observe.summary import degenerate_run_warnings

    (tmp_path / "small.jsonl").write_text(json.dumps({"text": "a short document"}) + "\n")
    cfg = load(
        [
            "--training.dataset",
            str(tmp_path / "small.jsonl"),
            "--training.global_batch_size",
            "8",
            "--training.steps",
            "5",
            "--lr_scheduler.warmup_steps",
            "10",
            "--training.mixed_precision_param",
            "float16",
            "--data.store_folder",
            str(tmp_path / "s"),
        ]
    )
    loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
    text = "\n".join(degenerate_run_warnings(cfg, "cpu", loader))
    assert "holds 18 tokens, fewer than one global batch" in text and "same tokens again" in text
    assert "lr_scheduler.warmup_steps = 10 >= training.steps = 5" in text
    assert "'float16' on a CPU" in text and "10x slower" in text
    assert not degenerate_run_warnings(
        load(["--training.global_batch_size", "8"]),
        "cpu",
        build_loader(load(["--training.global_batch_size", "8"]), ByteTokenizer(), "training", dp_rank=0, dp_degree=1),
    )


def test_toml_with_a_utf8_bom(tmp_path):
    p = tmp_path / "job.toml"
    p.write_bytes("\ufeff[training]\nsteps = 7\n".encode())
    assert load(["--job.config_file", str(p)]).training.steps == 7


@pytest.mark.parametrize("store", ["auto", "none"])
def test_a_bad_record_in_a_second_file_names_the_file_and_line(tmp_path, store):
    from titanlite.data.build import build_loader
    from titanlite.data.tokenizers import ByteTokenizer

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(20)))
    (folder / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "fine"}) + "\n{broken\n")
    cfg = load(
        [
            "--training.dataset",
            str(folder),
            "--training.global_batch_size",
            "4",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--data.store",
            store,
            "--data.store_folder",
            str(tmp_path / "s"),
            "--data.prefetch",
            "0",
        ]
    )
    with pytest.raises(ConfigError, match=r"line 3 of .*b\.jsonl is not a JSON record") as e:
        loader = build_loader(cfg, ByteTokenizer(), "training", dp_rank=0, dp_degree=1)
        for _ in range(30):  # streaming: the bad record is reached mid-run
            loader.next_step()
    assert "Traceback" not in str(e.value) and len(str(e.value).splitlines()) == 1


@pytest.mark.slow
def test_a_data_error_mid_run_is_one_line_and_exit_2(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(20)))
    (folder / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    r = run_module(
        "titanlite.train",
        *tiny_argv(
            tmp_path,
            "--training.dataset",
            folder,
            "--data.store",
            "none",
            "--training.steps",
            "40",
            "--training.global_batch_size",
            "4",
            "--training.local_batch_size",
            "4",
        ),
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "config error: training.dataset" in r.stderr and "line 2 of" in r.stderr and "Traceback" not in r.stderr


def test_stop_signals_save_at_the_end_of_the_step_and_a_second_ctrl_c_exits(monkeypatch):
    import signal

    from titanlite.runtime import run_control

    exits = []
    monkeypatch.setattr(run_control.os, "_exit", exits.append)
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1):
        s = run_control.StopSignals()
        s._on_signal(sig, None)
        assert s.requested and not exits
    monkeypatch.setattr(run_control.time, "monotonic", iter([100.0, 100.5, 103.0]).__next__)
    s = run_control.StopSignals()
    s._on_signal(signal.SIGINT, None)  # Ctrl-C: save at the end of the step
    s._on_signal(signal.SIGINT, None)  # the same Ctrl-C forwarded by torchrun half a second later
    assert s.requested and not exits
    s._on_signal(signal.SIGINT, None)  # a second Ctrl-C, three seconds later: exit at once
    assert exits == [130]


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs (a real full disk); the test is skipped where this machine does not allow mounting."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here; test_disk_full_during_a_save covers the handling")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_really_full_disk(small_disk):
    argv = tiny_argv(
        small_disk,
        "--training.steps",
        "6",
        "--training.local_batch_size",
        "4",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "0",
        "--validation.enable",
        "false",
    )
    r = run_job(["./run_train.sh", *argv], env=subprocess_env(NGPU="2", LOG_RANK="0,1"), timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "no space left on device" in out and "is where a relaunch resumes" in out, out[-3000:]
    assert not list((small_disk / "checkpoint").glob(".tmp-step-*"))  # the space is given back
    intact = sorted((small_disk / "checkpoint").glob("step-*"))
    assert intact and all((p / "manifest.json").is_file() for p in intact)


def test_dump_folder_lock_refuses_a_live_job_even_when_both_start_at_once(tmp_path, monkeypatch):
    import socket

    from titanlite.runtime import run_control

    other = {"host": socket.gethostname(), "pid": os.getppid(), "run_id": "", "started": "then"}  # alive
    # A second job on the folder is refused, naming the first.
    (tmp_path / run_control.LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(ConfigError, match=f"in use by another titanlite job .*pid {os.getppid()}"):
        run_control.FolderLock(tmp_path).acquire()
    # Both start at once: the other job writes its lock just after this one looked and saw none.
    (tmp_path / run_control.LOCK_NAME).unlink()
    real_read, looks = run_control.read_lock, []

    def other_job_locks_after_the_first_look(folder):
        looks.append(folder)
        holder = real_read(folder)
        if len(looks) == 1:
            (tmp_path / run_control.LOCK_NAME).write_text(json.dumps(other))
        return holder

    monkeypatch.setattr(run_control, "read_lock", other_job_locks_after_the_first_look)
    with pytest.raises(ConfigError, match=f"pid {os.getppid()}"):
        run_control.FolderLock(tmp_path).acquire()
    assert json.loads((tmp_path / run_control.LOCK_NAME).read_text())["pid"] == os.getppid()  # not overwritten
    monkeypatch.setattr(run_control, "read_lock", real_read)
    # A lock whose job is gone, or an unreadable one, is taken over; release removes it.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for text in (json.dumps({**other, "pid": dead.pid}), ""):
        (tmp_path / run_control.LOCK_NAME).write_text(text)
        lock = run_control.FolderLock(tmp_path)
        lock.acquire()
        assert json.loads((tmp_path / run_control.LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
        assert not (tmp_path / run_control.LOCK_NAME).exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_the_compiler_probe_reports_only_a_missing_compiler(monkeypatch):
    """Only inductor's 'no C++ compiler' error means there is none: any other error of the probe propagates, so a
    test that should run never skips (nor a job is refused) because of a bug."""
    import torch._inductor.cpp_builder as cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    from titanlite.compat import cpp_compiler_error

    def raises(error):
        def probe():
            raise error

        return probe

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", raises(InvalidCxxCompiler()))
    assert isinstance(cpp_compiler_error(), InvalidCxxCompiler)
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", raises(AttributeError("no attribute 'cxx'")))
    with pytest.raises(AttributeError, match="no attribute 'cxx'"):
        cpp_compiler_error()
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "g++")
    assert cpp_compiler_error() is None
    monkeypatch.undo()

    from types import SimpleNamespace

    import torch._inductor.config as inductor_config

    from titanlite.parallel.compile import compile_problem

    # CXX naming something that is not a compiler (inductor reads it into its config at import): its probe raises
    # OSError, a refusal naming CXX
    # (torch's own config patch(): pytest 9.2's monkeypatch undo deletes the config entry instead of restoring it)
    monkeypatch.setenv("CXX", "/etc/hostname")
    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        with inductor_config.patch({"cpp.cxx": ("/etc/hostname",)}):
            problem = compile_problem(SimpleNamespace(enable=True, backend="inductor"), "cpu")
    finally:
        monkeypatch.undo()
        cpp_builder.cpp_compiler_search.cache_clear()
    assert problem and "CXX = '/etc/hostname' cannot run" in problem and "install g++" in problem
