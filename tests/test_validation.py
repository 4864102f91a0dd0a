"""Validation data selection, one-pass mode and config errors (single process, no process group)."""

import math

import pytest

from titanlite.config import ConfigError, load

from helpers import compute_device


def _held_out(argv):
    from titanlite.data.build import validation_specs

    return [(s.name, s.split) for s, _ in validation_specs(load(argv))]


def test_held_out_source(tmp_path):
    f = tmp_path / "train.txt"
    f.write_text("hello\n")
    assert _held_out([]) == [("builtin", "validation")]
    assert _held_out(["--validation.dataset", str(f)]) == [(str(f), "validation")]
    assert _held_out(["--training.dataset", "owner/name"]) == [("owner/name", "validation")]
    with pytest.raises(ConfigError, match=r"validation.dataset = '' would validate on training.dataset = .*train.txt"):
        _held_out(["--training.dataset", str(f)])
    with pytest.raises(ConfigError, match="validation.dataset_split = 'train' is the training split"):
        _held_out(["--training.dataset", "owner/name", "--validation.dataset_split", "train"])
    # a folder whose files name their splits has a held-out split
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for split in ("train", "validation"):
        (tmp_path / "hub" / "data" / f"{split}-00000-of-00001.jsonl").write_text('{"text": "x"}\n')
    assert _held_out(["--training.dataset", str(tmp_path / "hub")]) == [(str(tmp_path / "hub"), "validation")]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--validation.steps", "0"], "validation.steps = 0 is not valid; expected -1 (one pass) or a number > 0"),
        (["--validation.freq", "0"], "validation.freq = 0"),
        (["--profiling.profile_freq", "0"], "profiling.profile_freq = 0"),
        (["--metrics.peak_flops", "-1"], "metrics.peak_flops = -1.0"),
    ],
)
def test_bad_values(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load(argv)


def test_missing_held_out_file_names_validation(tmp_path):
    from titanlite.data.build import check_data
    from titanlite.data.tokenizers import ByteTokenizer

    cfg = load(
        ["--validation.enable", "--validation.dataset", str(tmp_path / "nope.txt"), "--training.global_batch_size", "8"]
    )
    with pytest.raises(ConfigError, match=r"validation.dataset = .*nope.txt.*no such file"):
        check_data(cfg, ByteTokenizer())


@pytest.mark.parametrize("store", ["auto", "none"])
def test_one_pass_over_a_held_out_file(tmp_path, store):
    from titanlite.data.build import build_loader
    from titanlite.data.tokenizers import ByteTokenizer
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import model_args
    from titanlite.validate import Validator

    docs = [f"document number {i}: " + "some held-out text " * (i % 5 + 1) for i in range(40)]
    (tmp_path / "val.txt").write_text("\n".join(docs) + "\n")
    stream_tokens = sum(len(d.encode()) + 2 for d in docs)  # BOS + text + EOS
    argv = [
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--validation.enable",
        "--validation.dataset",
        str(tmp_path / "val.txt"),
        "--validation.steps",
        "-1",
        "--data.store",
        store,
    ]
    cfg = load(argv)
    tok = ByteTokenizer()
    model = Transformer(model_args(cfg.model, tok.vocab_size, 32))
    model.init_weights(0)
    model.to(compute_device())
    model.init_buffers()
    v = Validator(cfg, build_loader(cfg, tok, "validation", dp_rank=0, dp_degree=1))
    r1, r2 = v.evaluate(model, compute_device()), v.evaluate(model, compute_device())
    full_batches = stream_tokens // (4 * 33)  # batches that fit without wrapping around
    assert r1.batches == full_batches and r1.tokens == full_batches * 4 * 32
    assert r1.loss == r2.loss and math.isclose(r1.perplexity, math.exp(r1.loss))
    assert 4.0 < r1.loss < 8.0  # untrained, vocab 258: about ln(258) = 5.55
    cfg.validation.steps = 3
    r3 = Validator(cfg, build_loader(cfg, tok, "validation", dp_rank=0, dp_degree=1)).evaluate(model, compute_device())
    assert r3.batches == 3 and r3.tokens == 3 * 4 * 32
