"""Config: TOML + CLI precedence, --help, and a clear message for each kind of bad input."""

import pytest

from titanlite import config
from titanlite.config import ConfigError, load

from helpers import run_module


@pytest.fixture
def toml_file(tmp_path):
    p = tmp_path / "job.toml"
    p.write_text(
        "[training]\nsteps = 50\nseq_len = 64\n[checkpoint]\nenable = true\n"
        "[parallelism]\ndata_parallel_replicate_degree = 2\n"
    )
    return p


def test_defaults_toml_cli_precedence(toml_file):
    cfg = load([])
    assert cfg.training.steps == 200 and cfg.training.seq_len == 256  # defaults
    cfg = load(["--job.config_file", str(toml_file)])
    assert cfg.training.steps == 50 and cfg.checkpoint.enable is True  # TOML over defaults
    cfg = load(
        [
            "--job.config_file",
            str(toml_file),
            "--training.steps=20",
            "--training.seq_len",
            "32",
            "--parallelism.data_parallel_replicate_degree",
            "1",
        ]
    )
    assert (cfg.training.steps, cfg.training.seq_len) == (20, 32)  # CLI over TOML
    assert cfg.parallelism.data_parallel_replicate_degree == 1
    # the config file may come after other overrides and the CLI still wins
    cfg = load(["--training.steps", "7", "--job.config_file", str(toml_file)])
    assert cfg.training.steps == 7


def test_bool_flags(toml_file):
    assert load(["--checkpoint.enable"]).checkpoint.enable is True
    assert load(["--checkpoint.enable", "--training.steps", "3"]).checkpoint.enable is True
    assert load(["--job.config_file", str(toml_file), "--checkpoint.enable", "false"]).checkpoint.enable is False
    assert load(["--checkpoint.enable=no"]).checkpoint.enable is False


def test_every_shipped_config_loads():
    from titanlite.config.loader import shipped_configs

    names = shipped_configs()
    assert "debug_model.toml" in names and "llama3_8b_finetune.toml" in names
    for name in names:
        load(["--job.config_file", name])


def test_config_name_resolves_in_train_configs():
    cfg = load(["--job.config_file", "llama8b_hsdp.toml"])
    assert cfg.model.flavor == "8B" and cfg.parallelism.data_parallel_replicate_degree == 2
    assert load(["--job.config_file", "llama8b_fsdp"]).parallelism.data_parallel_replicate_degree == 1


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--trainig.steps", "3"], ["unknown section [trainig]", "did you mean 'training'"]),
        (["--training.stepz", "3"], ["unknown key training.stepz", "did you mean 'steps'"]),
        (["--training.steps", "many"], ["training.steps = 'many'", "int"]),
        (["--checkpoint.enable", "maybe"], ["unexpected argument 'maybe'"]),
        (["--checkpoint.enable=maybe"], ["checkpoint.enable = 'maybe'", "true or false"]),
        (["--training.steps", "0"], ["training.steps = 0", "> 0"]),
        (["--optimizer.lr", "-1"], ["optimizer.lr = -1.0", "> 0"]),
        (["--training.mixed_precision_param", "fp8"], ["training.mixed_precision_param = 'fp8'", "bfloat16"]),
        (["--parallelism.data_parallel_shard_degree", "0"], ["data_parallel_shard_degree = 0", "-1"]),
        (["--parallelism.fsdp_reshard_after_forward", "sometimes"], ["fsdp_reshard_after_forward", "never"]),
        (["--model.flavor", "9B"], ["model.flavor = '9B'", "8B"]),
        (["--job.config_file", "nope.toml"], ["job.config_file = 'nope.toml'", "debug_model.toml"]),
        (["--training.steps"], ["--training.steps needs a value"]),
        (["training.steps", "3"], ["unexpected argument"]),
    ],
)
def test_bad_input_messages(argv, needles):
    with pytest.raises(ConfigError) as e:
        load(argv)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_bad_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[training]\nsteps = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(["--job.config_file", str(p)])
    p.write_text("[training]\nstepz = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key training.stepz in .*bad.toml.*did you mean 'steps'"):
        load(["--job.config_file", str(p)])
    p.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="training.steps = 'ten'"):
        load(["--job.config_file", str(p)])


def test_help_lists_every_field_with_doc():
    text = config.help_text()
    for sec_name, values in config.JobConfig().to_dict().items():
        for key in values:
            assert f"--{sec_name}.{key} " in text
    assert "TOML file to read" in text


def test_cli_check_exits_2_without_traceback():
    r = run_module("titanlite.config", "--world-size", "4", "--parallelism.data_parallel_shard_degree", "3")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "data_parallel_shard_degree = 3" in r.stderr and "world size is 4" in r.stderr


def test_to_toml_round_trips(tmp_path):
    cfg = load(["--training.steps", "9", "--model.tokenizer_path", 'a"b'])
    p = tmp_path / "out.toml"
    p.write_text(config.to_toml(cfg))
    assert load(["--job.config_file", str(p)]).to_dict() == {
        **cfg.to_dict(),
        "job": {**cfg.to_dict()["job"], "config_file": str(p)},
    }


def test_docs_config_reference_is_current():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    assert config.markdown_reference().strip() in page, (
        "docs/config.md config reference is stale: paste the output of `python -m titanlite.config --markdown`"
    )


def test_ranks_compare_the_settings_they_were_started_with():
    """check_same_config names each differing key with the ranks that hold each value; where a node's config file
    lies is not compared, and the settings are those given (before start-up resolves machine-local copies)."""
    from titanlite.config.compare import check_same_config, digest, given_settings

    one, other = load(["--optimizer.lr", "0.001"]), load(["--optimizer.lr", "0.002"])
    other.job.config_file = "/elsewhere/debug_model.toml"
    ranks = [given_settings(one), given_settings(one), given_settings(other)]
    assert "job.config_file" not in ranks[2]

    def gather(mine):  # what every rank sends: first the digests, then the settings
        return ranks if isinstance(mine, dict) else [digest(r) for r in ranks]

    check_same_config(ranks[0], lambda mine: [mine, mine])  # the same everywhere: nothing to say
    with pytest.raises(ConfigError, match=r"optimizer.lr \(0.001 on ranks 0-1, 0.002 on rank 2\); start every node"):
        check_same_config(ranks[0], gather)
