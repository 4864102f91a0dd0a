"""Checkpoints in object storage (checkpoint.folder = "s3://..."), against moto's S3 server on this machine used
through s3fs as a real endpoint (the `s3` fixture): save, exact resume, resume at another topology, async saves,
retention, incomplete and corrupt step folders, the lease, exports to and from s3, an endpoint that goes down."""

from __future__ import annotations

import json
import logging
import os
import uuid

import pytest

from helpers import (
    assert_same_hf_weights,
    capture_logs,
    ckpt_argv,
    full_model,
    make_trainer,
    run_distributed,
    run_module,
    subprocess_env,
    tiny_argv,
    wait_for_endpoint,
)

pytestmark = pytest.mark.slow  # each test talks to a server process; most spawn ranks

OFF = ["--checkpoint.enable", "false"]


def _prefix() -> str:
    return f"s3://titanlite-test/{uuid.uuid4().hex[:8]}"


def _objects(url: str) -> list[str]:
    import fsspec

    fs = fsspec.filesystem("s3", use_listings_cache=False)
    root = url.removeprefix("s3://")
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


def _steps(url: str) -> dict[str, bool]:
    """step-N -> committed, for the step folders under url."""
    names = _objects(url)
    return {n.split("/")[0]: f"{n.split('/')[0]}/.committed" in names for n in names if n.startswith("step-")}


def _two_ranks(tmp, url):
    base = ckpt_argv(tmp, "--training.local_batch_size", "2", "--checkpoint.interval", "2")
    s3 = ["--checkpoint.folder", url, "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2"]
    out = {"ref": make_trainer(base + OFF).train()}
    out["saved"] = make_trainer(base + s3 + ["--checkpoint.last_save_in_hf"]).train()
    out["after_save"], out["hf"] = _steps(url), [n for n in _objects(url) if n.startswith("hf-step-6/")]
    from titanlite.storage import location

    if os.environ["RANK"] == "0":  # rank 0 commits the last save after the others have returned
        out["crc32"] = sorted(json.loads((location(url) / "step-6" / "manifest.json").read_text()).get("crc32", {}))
    t = make_trainer(base + s3 + ["--checkpoint.load_step", "4"])
    out["step"], out["resumed"] = t.step, t.train()
    out["after_resume"] = _steps(url)
    return out


def _one_rank(tmp, url, down_flag):
    """FSDP 2's checkpoint resumed on one process; incomplete and corrupt step folders; the endpoint down during
    a save; exports to and from s3 and a run started from them."""
    from pathlib import Path

    import fsspec

    from titanlite.cli.checkpoint import main as export_main

    fs = fsspec.filesystem("s3", use_listings_cache=False)
    base = ckpt_argv(tmp, "--training.local_batch_size", "4", "--checkpoint.interval", "2")
    out = {"ref": make_trainer(base + OFF).train()}
    t = make_trainer(base + ["--checkpoint.folder", f"{url}/a", "--checkpoint.load_step", "4"])
    out["other_topology"] = (t.step, t.train())

    # b: step-6 loses its commit marker (a save cut short), step-4's shard file is truncated: step-2 is resumed.
    b = f"{url}/b"
    make_trainer(base + ["--checkpoint.folder", b]).train()
    root = b.removeprefix("s3://")
    fs.rm(f"{root}/step-6/.committed")
    shard = fs.cat_file(f"{root}/step-4/__0_0.distcp")
    fs.pipe_file(f"{root}/step-4/__0_0.distcp", shard[: len(shard) // 2])
    logs = capture_logs()
    t = make_trainer(base + ["--checkpoint.folder", b])
    out["b_step"], out["b_logs"] = t.step, list(logs)
    out["b_resumed"] = t.train()  # saves step-4 and step-6 again over the bad ones
    out["b_after"] = _steps(b)

    # c: saves every step; the endpoint is down for the whole save of step 2 and while step 4 is committed (step-1
    # and step-3 are complete then); on_save_error = continue.
    c = f"{url}/c"
    t = make_trainer(
        base + ["--checkpoint.folder", c, "--checkpoint.on_save_error", "continue", "--checkpoint.interval", "1"]
    )
    save, commit = t.checkpointer.save, t.checkpointer._commit

    def down_during(call, step_down):
        def wrapped(step, *args, **kwargs):
            if step == step_down:
                Path(down_flag).touch()
            try:
                return call(step, *args, **kwargs)
            finally:
                Path(down_flag).unlink(missing_ok=True)
                wait_for_endpoint(os.environ["AWS_ENDPOINT_URL"])

        return wrapped

    t.checkpointer.save = down_during(save, 2)
    t.checkpointer._commit = down_during(commit, 4)
    del logs[:]
    out["c_losses"] = t.train()
    out["c_errors"] = [m for m in logs if "could not be" in m]
    out["c_after"] = _steps(c)
    t = make_trainer(base + ["--checkpoint.folder", c])
    out["c_resumed_step"] = t.step

    # Exports: s3 checkpoint -> s3 HF folder and -> a local one; a run started from the s3 HF folder and one from
    # the s3 DCP folder read in place hold the checkpoint's weights.
    hf = f"{url}/hf"
    out["export"] = export_main(["export", "--checkpoint", b, "--output", hf, "--format", "hf"])
    out["export_local"] = export_main(["export", "--checkpoint", b, "--output", str(tmp / "hf"), "--format", "hf"])
    fs.get(f"{hf.removeprefix('s3://')}/", str(tmp / "hf_from_s3"), recursive=True)
    out["hf_objects"] = _objects(hf)
    weights = full_model(make_trainer(base + ["--checkpoint.folder", b, "--checkpoint.load_step", "6"]))
    for name, start in (("from_hf", hf), ("from_dcp", f"{b}/step-6")):
        t = make_trainer(base + OFF + ["--checkpoint.initial_load_path", start])
        mine = full_model(t)
        out[name] = all(bool((mine[k] == weights[k]).all()) for k in weights)
    return out


def test_s3_checkpoints_resume_exactly_and_on_another_topology(tmp_path, s3, monkeypatch):
    s3.use(monkeypatch)
    url = _prefix()
    r = run_distributed(_two_ranks, 2, tmp_path, f"{url}/a")[0]
    assert r["saved"] == r["ref"]  # async saves to s3 do not touch training
    assert r["after_save"] == {"step-4": True, "step-6": True}  # keep_latest_k 2 removed step-2
    assert r["crc32"] == ["__0_0.distcp", "__1_0.distcp"]  # computed as the async writer uploaded them
    assert "hf-step-6/config.json" in r["hf"] and "hf-step-6/model-00001-of-00001.safetensors" in r["hf"]
    assert r["step"] == 4 and r["resumed"] == {s: r["ref"][s] for s in (5, 6)}  # exact: bit-identical losses
    assert r["after_resume"] == {"step-4": True, "step-6": True}  # step-6 written again over the old one

    one = run_distributed(_one_rank, 1, tmp_path, url, str(s3.down))[0]
    step, resumed = one["other_topology"]
    assert step == 4 and sorted(resumed) == [5, 6]
    for s in (5, 6):
        assert abs(resumed[s] - one["ref"][s]) < 1e-5 and abs(one["ref"][s] - r["ref"][s]) < 1e-5

    # An incomplete step folder is removed at start, a corrupt one skipped, with a message each; never resumed from.
    assert one["b_step"] == 2
    logs = "\n".join(one["b_logs"])
    assert "Removing incomplete checkpoint" in logs and "step-6 (a save that did not finish: no .committed)" in logs
    assert "__0_0.distcp has" in logs and "truncated" in logs
    assert one["b_resumed"] == {s: one["ref"][s] for s in (3, 4, 5, 6)}
    assert one["b_after"] == {"step-2": True, "step-4": True, "step-6": True}

    # The endpoint down: the job trains on, says why each save failed, and resumes from the intact one.
    assert one["c_losses"] == one["ref"]
    assert len(one["c_errors"]) == 2, one["c_errors"]
    assert all("s3://" in m and "cannot be reached" in m for m in one["c_errors"]), one["c_errors"]
    # what could not be done with the store down is said so, not guessed: the listing and the removal failed
    for m in one["c_errors"]:
        assert "which earlier checkpoint is intact is unknown" in m and "could not be listed" in m, m
        assert "could not be removed" in m and "no earlier complete" not in m and "was removed" not in m, m
    assert all(one["c_after"].get(f"step-{s}") for s in (1, 3, 5, 6)), one["c_after"]
    assert not one["c_after"].get("step-2") and not one["c_after"].get("step-4")
    assert one["c_resumed_step"] == 6

    # Exports to and from s3: the same tensors as a local export, config.json uploaded; starts from s3 exact.
    assert one["export"] == 0 and one["export_local"] == 0
    assert "config.json" in one["hf_objects"] and any(n.endswith(".safetensors") for n in one["hf_objects"])
    assert_same_hf_weights(tmp_path / "hf", tmp_path / "hf_from_s3")
    assert one["from_hf"] and one["from_dcp"]

    # generate reads a checkpoint folder in s3 (its newest committed step, copied here) as the local HF export.
    greedy = ("--prompt", "The cat", "--max-new-tokens", "8", "--temperature", "0", "--model.flavor", "tiny")
    env = subprocess_env(TITANLITE_CACHE=str(tmp_path / "cache"))
    remote = run_module("titanlite.generate", "--checkpoint", f"{url}/b", *greedy, env=env)
    local = run_module("titanlite.generate", "--checkpoint", tmp_path / "hf", *greedy, env=env)
    assert remote.returncode == 0 and local.returncode == 0, (remote.stderr[-2000:], local.stderr[-2000:])
    assert remote.stdout == local.stdout and len(remote.stdout) > len("The cat")


def test_s3_lease_refuses_a_second_job_and_is_taken_over_when_stale(tmp_path, s3, monkeypatch):
    from titanlite.errors import ConfigError
    from titanlite.runtime import run_control
    from titanlite.storage import create_exclusive, location

    s3.use(monkeypatch)
    folder = location(f"{_prefix()}/ckpt")
    # Of two jobs creating the lease at the same moment, one wins (S3's conditional write).
    assert [create_exclusive(folder / "race", "a"), create_exclusive(folder / "race", "b")] == [True, False]
    assert (folder / "race").read_text() == "a"

    other = {"host": "node-7", "pid": 4242, "run_id": "r1", "started": "then"}
    (folder / run_control.LOCK_NAME).write_text(json.dumps(other))
    lock = run_control.FolderLock(folder, "checkpoint.folder")
    with pytest.raises(ConfigError, match="in use by another titanlite job .host node-7, pid 4242"):
        lock.acquire()
    # A live job on this host with the same run id (another job started with the same RDZV_ID) is another job too.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    import os
    import socket

    twin = {"host": socket.gethostname(), "pid": os.getppid(), "run_id": "r1", "started": "then"}
    (folder / run_control.LOCK_NAME).write_text(json.dumps(twin))
    with pytest.raises(ConfigError, match="in use by another titanlite job"):
        lock.acquire()
    (folder / run_control.LOCK_NAME).write_text(json.dumps(other))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setattr(run_control, "STALE_AFTER", 0.0)  # node-7's heartbeat is now too old
    logs = capture_logs()
    lock.acquire()
    assert any("Taking over the lock of a titanlite job that is gone (host node-7" in m for m in logs)
    lease = location(str(folder)) / run_control.LOCK_NAME
    assert json.loads(lease.read_text())["pid"] != 4242

    lock.heartbeat()  # rewrites the lease: its age restarts
    assert run_control.read_lock(folder)["age"] < 5
    lease.write_text(json.dumps(other))  # another job took it over meanwhile
    logging.getLogger("titanlite").setLevel(logging.INFO)
    lock.heartbeat()
    assert not lock.held and any("the lock was taken over by another job (host node-7" in m for m in logs)
    assert run_control.LOCK_LOST.is_set()  # the loop stops at the end of its step without saving (manager.py)
    run_control.LOCK_LOST.clear()
    lock.release()  # not ours any more: left as it is
    assert json.loads(lease.read_text())["host"] == "node-7"


def test_remote_inputs_are_copied_once_per_machine_and_again_when_changed(tmp_path, s3, monkeypatch):
    from titanlite.checkpoint.remote_inputs import local_copy, stage_remote_inputs
    from titanlite.config import load
    from titanlite.storage import location

    s3.use(monkeypatch)
    monkeypatch.setenv("TITANLITE_CACHE", str(tmp_path / "cache"))
    url = _prefix()
    adapter = location(f"{url}/adapter")
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"x" * 1000)
    logs = capture_logs()
    first = local_copy(str(adapter), "lora.initial_adapter_path")
    assert sorted(p.name for p in first.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert local_copy(str(adapter), "lora.initial_adapter_path") == first  # the same machine: no second copy
    assert sum("Copied lora.initial_adapter_path" in m for m in logs) == 1
    (adapter / "adapter_model.safetensors").write_bytes(b"y" * 999)  # changed in the bucket: copied again
    assert (local_copy(str(adapter), "lora.initial_adapter_path") / "adapter_model.safetensors").read_bytes() == (
        b"y" * 999
    )
    # The config points at the copies, except a DCP folder (read in place by every rank, its shards).
    (location(f"{url}/dcp") / ".metadata").write_bytes(b"...")
    cfg = load(["--lora.initial_adapter_path", str(adapter), "--checkpoint.initial_load_path", f"{url}/dcp"])
    stage_remote_inputs(cfg)
    assert cfg.lora.initial_adapter_path == str(first) and cfg.checkpoint.initial_load_path == f"{url}/dcp"


def _multipart(tmp, url):
    """The debug model's checkpoint (one shard of ~58 MB: a multipart upload in s3fs's 50 MiB parts) saved at steps 1
    and 2; step-2's shard then copied with another part size, and then changed in place with its size kept."""
    import fsspec

    from titanlite.checkpoint.integrity import MANIFEST
    from titanlite.storage import location

    fs = fsspec.filesystem("s3", use_listings_cache=False)
    argv = tiny_argv(tmp, "--model.flavor", "debugmodel", "--training.steps", "2", "--training.local_batch_size", "1",
                     "--training.global_batch_size", "1", "--checkpoint.enable", "--checkpoint.interval", "1",
                     "--checkpoint.folder", url)  # fmt: skip
    make_trainer(argv).train()
    shard = f"{url.removeprefix('s3://')}/step-2/__0_0.distcp"
    manifest = json.loads((location(url) / "step-2" / MANIFEST).read_text())
    out = {"etag": manifest["files"]["__0_0.distcp"][1], "crc32": manifest.get("crc32", {}), "size": fs.size(shard)}
    logs = capture_logs()
    data = fs.cat_file(shard)
    with fs.open(shard, "wb", block_size=8 << 20) as f:  # a copy by another tool: the same bytes, other parts
        f.write(data)
    out["copied_etag"] = fs.info(shard)["ETag"]
    out["copy_step"] = make_trainer(argv).step
    changed = bytearray(data)
    changed[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # inside a tensor's bytes: it still loads
    fs.pipe_file(shard, bytes(changed))
    out["changed_step"] = make_trainer(argv).step
    out["logs"], out["steps"] = list(logs), _steps(url)
    out["abandoned"] = sorted({n.split("/")[0] for n in _objects(url) if n.startswith("abandoned-")})
    return out


def test_s3_multipart_shards_are_checked_by_the_crc_of_their_bytes(tmp_path, s3, monkeypatch):
    """A shard over 50 MiB is uploaded in parts, and its ETag depends on the part size: its CRC-32, computed as it was
    written, is what a copy with other parts keeps and a change of its bytes does not."""
    s3.use(monkeypatch)
    r = run_distributed(_multipart, 1, tmp_path, f"{_prefix()}/m")[0]
    assert r["size"] > 50 << 20 and r["etag"].endswith("-2"), r["etag"]  # two parts of 50 MiB
    assert set(r["crc32"]) == {"__0_0.distcp"}
    assert r["copied_etag"].strip('"') != r["etag"].removeprefix("etag:") and r["copy_step"] == 2  # read and accepted
    logs = "\n".join(r["logs"])
    assert r["changed_step"] == 1, logs  # not resumed from: the one before is
    assert "Skipping corrupt checkpoint" in logs and "__0_0.distcp does not match its checksum" in logs
    # the corrupt step-2 is set aside (copied within the store), so that this run's saves are never counted after it
    assert r["abandoned"] == ["abandoned-step-2"] and r["steps"] == {"step-1": True}


def _lora_on_a_base_in_s3(tmp, base_url):
    """2 LoRA steps on a HF base in object storage, saved; what the checkpoint records of the base."""
    argv = ckpt_argv(tmp, "--training.steps", "2", "--model.flavor", "hf", "--checkpoint.initial_load_path", base_url,
                     "--lora.enable", "true", "--lora.rank", "4")  # fmt: skip
    make_trainer(argv).train()
    step = tmp / "checkpoint" / "step-2"
    return json.loads((step / "lora_base.json").read_text())["path"], (step / "job_config.toml").read_text()


def test_inputs_in_object_storage_are_recorded_by_their_url_and_fetched_again_elsewhere(tmp_path, s3, monkeypatch):
    """Issue 62 item 4: a LoRA checkpoint on a base in s3 records the base's URL (lora_base.json, job_config.toml),
    not this machine's cache copy; exported on a machine with another cache, the base is fetched there again; an
    uncommitted step folder in s3 left by a crash is removed at start."""
    import fsspec
    from test_model_families import hf_family_model

    from titanlite.cli.checkpoint import main as checkpoint_command

    s3.use(monkeypatch)
    monkeypatch.setenv("TITANLITE_CACHE", str(tmp_path / "cache-here"))
    url = _prefix()
    hf_family_model(tmp_path / "base", "llama3")
    fs = fsspec.filesystem("s3", use_listings_cache=False)
    fs.put(f"{tmp_path / 'base'}/", f"{url.removeprefix('s3://')}/base", recursive=True)
    recorded, job_config = run_distributed(_lora_on_a_base_in_s3, 1, tmp_path / "run", f"{url}/base")[0]
    assert recorded == f"{url}/base" and f'initial_load_path = "{url}/base"' in job_config
    assert "cache-here" not in job_config
    monkeypatch.setenv("TITANLITE_CACHE", str(tmp_path / "cache-elsewhere"))  # another machine
    step = tmp_path / "run" / "checkpoint" / "step-2"
    assert checkpoint_command(["export", "--checkpoint", str(step), "--output", str(tmp_path / "merged"),
                               "--format", "hf"]) == 0  # fmt: skip
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "cache-elsewhere" / "remote").is_dir()

    from titanlite.checkpoint.catalog import remove_temporaries
    from titanlite.storage import location

    fs.pipe_file(f"{url.removeprefix('s3://')}/ckpt/step-3/__0_0.distcp", b"half a save")
    (location(f"{url}/ckpt/step-1") / ".committed").write_text("1\n")
    remove_temporaries(location(f"{url}/ckpt"))
    assert _steps(f"{url}/ckpt") == {"step-1": True}


def _backend_in_s3(tmp, folder, url):
    """A transformers-backend model (Phi-3) saving into object storage: 4 steps, then a resume from step 2."""
    base = ckpt_argv(tmp, "--training.steps", "4", "--training.local_batch_size", "4", "--checkpoint.interval", "2",
                     "--model.flavor", "hf", "--checkpoint.initial_load_path", str(folder),
                     "--checkpoint.folder", url)  # fmt: skip
    ref = make_trainer(base).train()
    t = make_trainer(base + ["--checkpoint.load_step", "2"])
    return ref, t.step, t.train()


def test_a_transformers_backend_model_checkpoints_in_object_storage_and_resumes_exactly(tmp_path, s3, monkeypatch):
    from test_transformers_backend import hf_folder

    s3.use(monkeypatch)
    url = _prefix()
    folder, _ = hf_folder(tmp_path, "phi3")
    ref, step, resumed = run_distributed(_backend_in_s3, 1, tmp_path / "run", folder, f"{url}/backend")[0]
    assert step == 2 and resumed == {s: ref[s] for s in (3, 4)}  # bit-identical
    assert _steps(f"{url}/backend") == {"step-2": True, "step-4": True}
