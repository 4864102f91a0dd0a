"""A resume whose data position would point into other data is refused: the tokenizer or a training source
changed since the checkpoint (checkpoint/data_identity.py); checkpoint.allow_data_change goes on with a warning."""

import json

import pytest

from titanlite.cli.train import main as train

from helpers import ckpt_argv

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 7) for i in range(120)]


def _write(path, docs):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))


def _run(tmp_path, capsys, steps, *extra):
    argv = ckpt_argv(tmp_path / "run", "--training.steps", str(steps), "--checkpoint.interval", "2", *extra)
    code = train(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_changed_training_data_is_refused_unless_allowed(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    _write(data, DOCS)
    assert _run(tmp_path, capsys, 2, "--training.dataset", str(data))[0] == 0
    saved = json.loads((tmp_path / "run" / "checkpoint" / "step-2" / "data_identity.json").read_text())
    assert saved["sources"][0]["documents"] == len(DOCS)

    _write(data, DOCS[:-1] + ["an edited last document"])  # edited in place: same file, other content
    code, text = _run(tmp_path, capsys, 4, "--training.dataset", str(data))
    assert code == 2, text[-2000:]
    assert f"cannot resume from {tmp_path / 'run' / 'checkpoint' / 'step-2'}" in text
    assert f"training data {str(data)!r} changed since the checkpoint" in text
    assert "checkpoint.allow_data_change = true" in text and "Traceback" not in text
    assert not (tmp_path / "run" / "checkpoint" / "step-4").exists()

    code, text = _run(tmp_path, capsys, 4, "--training.dataset", str(data), "--checkpoint.allow_data_change")
    assert code == 0, text[-2000:]
    assert "with other data (checkpoint.allow_data_change = true)" in text


def test_another_tokenizer_of_the_same_vocabulary_size_is_refused(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    data = tmp_path / "data.jsonl"
    _write(data, DOCS)
    args = ("--training.dataset", str(data), "--model.tokenizer_path", str(path))
    assert _run(tmp_path, capsys, 2, *args)[0] == 0

    spec = json.loads(path.read_text())  # the same vocabulary, two tokens' ids swapped
    vocab = spec["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(spec))
    code, text = _run(tmp_path, capsys, 4, *args)
    assert code == 2, text[-2000:]
    assert "the tokenizer is not the one the checkpoint was trained with" in text and "Traceback" not in text
