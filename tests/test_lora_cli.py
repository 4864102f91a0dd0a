"""LoRA through the commands, in this process: generate takes a LoRA checkpoint's own [lora] and base, reads a peft
folder on a HF base (or refuses), a resume with another lora.alpha is refused, the exports of an MoE trained with
aux_free say that its routing bias is left out (naming the folder the user gets), and no export lands in a step
folder."""

import contextlib
import logging
import shutil

import pytest

from helpers import tiny_argv

pytestmark = pytest.mark.slow  # trains LoRA checkpoints through the commands

BATCH = ("--training.global_batch_size", "8", "--training.local_batch_size", "8", "--validation.enable", "false")
GREEDY = ("--prompt", "ab", "--max-new-tokens", "6", "--temperature", "0")


def _train(folder, *extra):
    from titanlite.cli.train import main

    assert main(tiny_argv(folder, "--training.steps", "2", *BATCH, "--checkpoint.enable", *extra)) == 0


def _generate(capsys, *argv):
    from titanlite.cli.generate import main

    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@contextlib.contextmanager
def _logged():
    """The titanlite log lines written inside the block (setup_logging's force=True drops caplog's handler)."""
    lines, handler = [], logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("titanlite").addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger("titanlite").removeHandler(handler)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A HF base (2 trained steps of the tiny model) and a LoRA run on it: rank 4, alpha 8 (the default is 32)."""
    tmp = tmp_path_factory.mktemp("lora_cli")
    _train(tmp / "base", "--checkpoint.last_save_in_hf")
    base = tmp / "base" / "checkpoint" / "hf-step-2"
    lora = ("--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8", "--optimizer.lr", "0.05")
    _train(tmp / "lora", *lora, "--checkpoint.initial_load_path", str(base))
    return tmp, base, tmp / "lora" / "checkpoint" / "step-2"


def test_generate_takes_the_checkpoints_own_lora_and_refuses_another(lora_run, capsys):
    _, _, step = lora_run
    code, own, err = _generate(capsys, "--config", str(step / "job_config.toml"), "--checkpoint", str(step), *GREEDY)
    assert code == 0, err
    with _logged() as log:
        code, out, err = _generate(capsys, "--checkpoint", str(step), "--model.flavor", "tiny", "--lora.enable", "true",
                                   *GREEDY)  # fmt: skip
    assert code == 0, err
    assert out == own  # rank 4, alpha 8: the checkpoint's, not the config's 16 and 32
    assert any("lora.alpha = 8.0 as --checkpoint" in line and "(the config gives 32.0)" in line for line in log), log
    code, _, err = _generate(capsys, "--checkpoint", str(step), "--model.flavor", "tiny", "--lora.alpha", "32", *GREEDY)
    assert code == 2 and "--lora.alpha 32.0 conflicts with" in err and "lora.alpha = 8.0" in err, err


def test_generate_on_a_hf_base_reads_the_peft_folder_or_refuses(lora_run, capsys):
    from titanlite.cli.checkpoint import main as export

    tmp, base, step = lora_run
    adapter = tmp / "adapter"
    if not adapter.exists():
        assert export(["export", "--checkpoint", str(step), "--format", "peft", "--output", str(adapter)]) == 0
    code, from_checkpoint, err = _generate(capsys, "--checkpoint", str(step), "--model.flavor", "tiny", *GREEDY)
    assert code == 0, err
    hf = ("--checkpoint", str(base), "--lora.enable", "true")
    code, out, err = _generate(capsys, *hf, "--lora.initial_adapter_path", str(adapter), *GREEDY)
    assert code == 0, err
    assert out == from_checkpoint  # the adapters read from the folder, rank and alpha from its adapter_config.json
    code, _, err = _generate(capsys, *hf, *GREEDY)
    assert code == 2 and "lora.initial_adapter_path = '' names none" in err, err
    code, _, err = _generate(capsys, *hf, "--lora.initial_adapter_path", str(tmp / "nothere"), *GREEDY)
    assert code == 2 and f"lora.initial_adapter_path = '{tmp / 'nothere'}' does not exist" in err, err


def test_the_merged_export_says_how_many_tensors_its_folder_holds(lora_run, tmp_path, capsys):
    from safetensors import safe_open

    from titanlite.cli.checkpoint import main as export

    _, _, step = lora_run
    out = tmp_path / "merged"
    capsys.readouterr()
    assert export(["export", "--checkpoint", str(step), "--format", "hf", "--output", str(out)]) == 0
    held = 0
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            held += len(list(f.keys()))
    assert held == 21  # 2 blocks of 9, the embedding, the final norm and the output projection
    assert f"HuggingFace folder, {held} tensors" in capsys.readouterr().out


def test_a_lora_resume_with_another_alpha_is_refused(lora_run, tmp_path, capsys):
    from titanlite.cli.train import main

    tmp, base, _ = lora_run
    shutil.copytree(tmp / "lora", tmp_path / "lora")
    lora = ("--lora.enable", "true", "--lora.rank", "4", "--checkpoint.initial_load_path", str(base))
    capsys.readouterr()
    argv = tiny_argv(tmp_path / "lora", "--training.steps", "3", *BATCH, "--checkpoint.enable", *lora)
    assert main([*argv, "--lora.alpha", "16"]) == 2
    err = capsys.readouterr().err
    assert "lora.alpha = 16.0, but" in err and "was trained with lora.alpha = 8.0" in err, err


def test_lora_exports_of_an_aux_free_moe_say_the_routing_bias_is_left_out(tmp_path):
    from titanlite.cli.checkpoint import main as export

    moe = ("--model.name", "qwen3_moe", "--moe.load_balance", "aux_free")
    _train(tmp_path / "base", *moe)
    lora = ("--lora.enable", "true", "--lora.rank", "2", "--training.steps", "1")
    _train(tmp_path / "lora", *moe, *lora, "--checkpoint.initial_load_path", str(tmp_path / "base/checkpoint/step-2"))
    step = tmp_path / "lora" / "checkpoint" / "step-1"
    for fmt in ("peft", "hf"):
        out = tmp_path / f"out-{fmt}"
        with _logged() as log:
            assert export(["export", "--checkpoint", str(step), "--format", fmt, "--output", str(out)]) == 0
        text = "\n".join(log)
        assert f"{out}: the routing bias learned with [moe] load_balance = 'aux_free'" in text, (fmt, text)
        assert ".exporting-" not in text


def test_an_export_inside_a_step_folder_is_refused(tmp_path):
    from titanlite.checkpoint.export_target import check_target
    from titanlite.errors import ConfigError

    step = tmp_path / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    for output in (step / "my-adapter", step / "a" / "b"):
        with pytest.raises(ConfigError, match="is inside the checkpoint folder .*step-2.*keep_latest_k"):
            check_target(output, True, False, step)
    check_target(tmp_path / "checkpoint" / "hf-step-2", True, False, step)  # beside the steps, as last_save_in_hf


def test_generate_names_the_base_of_a_lora_checkpoint_when_it_moved(lora_run, tmp_path, capsys):
    tmp, base, _ = lora_run
    shutil.copytree(base, tmp_path / "base")
    lora = ("--lora.enable", "true", "--lora.rank", "4", "--model.flavor", "hf")  # the shape from the base's config
    _train(tmp_path / "run", *lora, "--checkpoint.initial_load_path", str(tmp_path / "base"))
    step = tmp_path / "run" / "checkpoint" / "step-2"
    (tmp_path / "base").rename(tmp_path / "moved")
    code, _, err = _generate(capsys, "--config", str(step / "job_config.toml"), "--checkpoint", str(step), *GREEDY)
    assert code == 2 and f"trained on the base {tmp_path / 'base'}, which is not there any more" in err, err
