"""Nothing on disk is overwritten by surprise: exports refuse an existing model unless --overwrite, replace a
folder whole, leave nothing behind when they fail; retention says when it removes an earlier run's step."""

import os
import stat

import pytest

from helpers import run_module, tiny_argv

JOB = ["--training.global_batch_size", "8", "--training.local_batch_size", "8", "--checkpoint.enable"]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    dump = tmp_path_factory.mktemp("export") / "job"
    r = run_module("titanlite.train", *tiny_argv(dump, "--training.steps", "2", *JOB))
    assert r.returncode == 0, r.stderr[-3000:]
    return dump / "checkpoint" / "step-2"


def _export(step, output, *extra):
    return run_module("titanlite.checkpoint", "export", "--checkpoint", step, "--output", output, *extra)


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.slow
def test_a_consolidated_export_never_replaces_a_file_unasked(step, tmp_path):
    out = tmp_path / "model.pt"
    out.write_bytes(b"someone's weights")
    r = _export(step, out)
    assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert out.read_bytes() == b"someone's weights"
    folder = tmp_path / "a_folder"
    folder.mkdir()
    r = _export(step, folder)
    assert r.returncode == 2 and "is a folder, but this export writes a file" in r.stderr, r.stderr
    r = _export(step, out, "--overwrite")
    assert r.returncode == 0 and out.read_bytes() != b"someone's weights", r.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert _mode(out) == 0o666 & ~umask  # a plain file's permissions, not a private temp file's
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


@pytest.mark.slow
def test_a_hf_export_replaces_a_model_folder_whole_and_only_when_asked(step, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"old shard")
    (out / "tokenizer.json").write_text("{}")
    r = _export(step, out, "--format", "hf")
    assert r.returncode == 2 and "already holds a model" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00009.safetensors", "tokenizer.json"]
    r = _export(step, out, "--format", "hf", "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert "model-00001-of-00009.safetensors" not in names and "tokenizer.json" not in names, names  # no mix
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names)
    umask = os.umask(0)
    os.umask(umask)
    assert _mode(out) == 0o777 & ~umask
    modes = {p.name: _mode(p) for p in out.iterdir()}  # the safetensors too (safetensors writes them 0600)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), modes
    # an empty folder is simply filled
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export(step, empty, "--format", "hf").returncode == 0


def test_safetensors_files_get_the_umasks_permissions(tmp_path):
    """The one writer of HF and peft safetensors files gives them the umask's permissions, as config.json gets."""
    import torch

    from titanlite.checkpoint.hf_folder import save_safetensors

    old = os.umask(0o027)
    try:
        save_safetensors({"a": torch.zeros(2)}, tmp_path / "adapter_model.safetensors")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "adapter_model.safetensors") == 0o640


def test_a_failed_export_leaves_no_partial_output_and_the_old_one_untouched(tmp_path):
    from titanlite.checkpoint.export_target import write_atomically

    def half_then_fail(tmp):
        (tmp / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(tmp_path / "new", True, half_then_fail)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("old")
    with pytest.raises(OSError):
        write_atomically(old, True, half_then_fail)
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and (old / "config.json").read_text() == "old"


@pytest.mark.slow
def test_retention_says_when_it_removes_or_replaces_an_earlier_runs_step(tmp_path):
    dump = tmp_path / "job"
    first = run_module("titanlite.train", *tiny_argv(dump, "--training.steps", "4", "--checkpoint.interval", "2", *JOB))
    assert first.returncode == 0, first.stderr[-3000:]
    keep_one = ["--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1"]
    second = run_module("titanlite.train", *tiny_argv(dump, "--training.steps", "6", *keep_one, *JOB))
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    removed = f"Removed old checkpoint {dump / 'checkpoint' / 'step-4'} (checkpoint.keep_latest_k = 1; "
    assert removed + "written by an earlier run)" in out
    # going back to an older step sets the newer ones aside (renamed, not replaced), with a warning
    third = run_module(
        "titanlite.train",
        *tiny_argv(dump, "--training.steps", "8", "--checkpoint.load_step", "6", "--checkpoint.interval", "2", *JOB),
    )
    assert third.returncode == 0, (third.stdout + third.stderr)[-3000:]
    fourth = run_module(
        "titanlite.train",
        *tiny_argv(dump, "--training.steps", "8", "--checkpoint.load_step", "6", "--checkpoint.interval", "2", *JOB),
    )
    out = fourth.stdout + fourth.stderr
    assert f"Set step-8 aside as {dump / 'checkpoint' / 'abandoned-step-8'}" in out and "Replacing" not in out, out
    assert (dump / "checkpoint" / "abandoned-step-8" / ".metadata").is_file()
