"""The multi-token-prediction layers of a DeepSeek-V3 or GLM-4.5 folder (model.layers.{num_hidden_layers}.*, which
titanlite does not train) reach the HF export unchanged: byte for byte under their own names, listed in the index,
num_nextn_predict_layers kept; from a run (last_save_in_hf) and from its checkpoint (python -m titanlite.checkpoint
export); without the folder the export says so and its config.json says 0. transformers loads either export."""

import json
import logging
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from test_frontier_moe import VOCAB, _titanlite_from, hf_frontier_model  # noqa: E402

INDEX = "model.safetensors.index.json"
MTP = 3  # the tiny models have 3 layers: their MTP layer is model.layers.3


def add_mtp_layer(folder):
    """Write DeepSeek's MTP layer layout (embed_tokens, enorm, hnorm, eh_proj, shared_head, a whole decoder layer)
    into the folder as its checkpoints have it: bf16, in two more files listed in the index; config.json counts it.
    Returns the MTP tensors."""
    index = json.loads((folder / INDEX).read_text())
    g = torch.Generator().manual_seed(7)
    mtp = {}
    for name, file in index["weight_map"].items():
        if name.startswith("model.layers.2."):  # a MoE decoder layer's tensors, new values
            with safe_open(str(folder / file), framework="pt") as h:
                shape = h.get_slice(name).get_shape()
            mtp[name.replace("layers.2.", f"layers.{MTP}.")] = torch.randn(shape, generator=g).to(torch.bfloat16)
    hidden = 64
    for part, shape in {"embed_tokens.weight": (VOCAB, hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                        "eh_proj.weight": (hidden, 2 * hidden), "shared_head.norm.weight": (hidden,),
                        "shared_head.head.weight": (VOCAB, hidden)}.items():  # fmt: skip
        mtp[f"model.layers.{MTP}.{part}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    names = sorted(mtp)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: mtp[n] for n in part}, str(folder / f"mtp-{i}.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(part, f"mtp-{i}.safetensors"))
    (folder / INDEX).write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return mtp


def exported(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a folder, by the file its index names."""
    out = {}
    for name, file in json.loads((folder / INDEX).read_text())["weight_map"].items():
        with safe_open(str(folder / file), framework="pt") as h:
            out[name] = h.get_tensor(name)
    assert {f.name for f in folder.glob("*.safetensors")} == set(
        json.loads((folder / INDEX).read_text())["weight_map"].values()
    )
    return out


def assert_carried(out, mtp, caplog, source):
    tensors = exported(out)
    for name, t in mtp.items():  # byte for byte: the folder's bf16 in an fp32 export
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    said = [r.getMessage() for r in caplog.records if "carried the 1 multi-token-prediction layer(s)" in r.getMessage()]
    assert len(said) == 1 and f"of {source} unchanged ({len(mtp)} tensors" in said[0] and "untrained" in said[0]
    return tensors


def loads_in_transformers(out, family, expected, x):
    """transformers' class loads the export with the expected logits, nothing missing; returns the keys it did not
    use (the MTP layer is not part of the class: it ignores model.layers.61.* of DeepSeek-V3's depth silently and
    reports a tiny model's model.layers.3.* as UNEXPECTED)."""
    cls = transformers.DeepseekV3ForCausalLM if family == "deepseek_v3" else transformers.Glm4MoeForCausalLM
    back, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert (back.eval()(x).logits - expected).abs().max() < 1e-5
    return info["unexpected_keys"]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_an_export_carries_the_mtp_layer_byte_for_byte(tmp_path, family, caplog):
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer

    hf = hf_frontier_model(tmp_path / "hf", family)
    mtp = add_mtp_layer(tmp_path / "hf")
    ours = _titanlite_from(tmp_path / "hf")
    assert ours.args.n_layers == 3
    with caplog.at_level(logging.INFO, logger="titanlite"):
        start = str(tmp_path / "hf")
        n = save_hf_sharded(ours, tmp_path / "out", torch.float32, ByteTokenizer(), 60_000, started_from=start)
    tensors = assert_carried(tmp_path / "out", mtp, caplog, tmp_path / "hf")
    assert n == len(tensors) == len(json.loads((tmp_path / "hf" / INDEX).read_text())["weight_map"])
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x).logits
    unused = loads_in_transformers(tmp_path / "out", family, expected, x)
    assert unused and all(k.startswith(f"model.layers.{MTP}.") for k in unused)


def test_the_export_command_carries_them_and_says_so_when_the_folder_is_gone(tmp_path, caplog, capsys):
    """From the checkpoint of a run started from the folder: carried; the folder moved away: the export goes on
    without them, one warning says why and how to carry them, and config.json says 0."""
    import torch.distributed as dist

    from titanlite.cli.checkpoint import main as checkpoint_main

    from helpers import make_trainer, tiny_argv

    hf_frontier_model(tmp_path / "hf", "deepseek_v3")
    mtp = add_mtp_layer(tmp_path / "hf")
    argv = tiny_argv(tmp_path / "run", "--model.name", "deepseek_v3", "--model.flavor", "hf",
                     "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--training.steps", "2",
                     "--training.local_batch_size", "2", "--training.global_batch_size", "2",
                     "--model.vocab_size", str(VOCAB), "--checkpoint.enable",
                     "--checkpoint.last_save_in_hf")  # fmt: skip
    try:
        with caplog.at_level(logging.INFO, logger="titanlite"):
            make_trainer(argv).train()
    finally:  # the in-process trainer's process group: later tests build their own
        if dist.is_initialized():
            dist.destroy_process_group()
    assert_carried(tmp_path / "run" / "checkpoint" / "hf-step-2", mtp, caplog, tmp_path / "hf")

    export = ["export", "--checkpoint", str(tmp_path / "run" / "checkpoint"), "--format", "hf", "--output"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert checkpoint_main([*export, str(tmp_path / "exported")]) == 0
    tensors = assert_carried(tmp_path / "exported", mtp, caplog, tmp_path / "hf")
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    ours = _titanlite_from(tmp_path / "exported")
    with torch.no_grad():
        expected = ours(x)
    unused = loads_in_transformers(tmp_path / "exported", "deepseek_v3", expected, x)
    assert unused and all(k.startswith(f"model.layers.{MTP}.") for k in unused)
    assert f"HuggingFace folder, {len(tensors)} tensors" in capsys.readouterr().out

    shutil.move(tmp_path / "hf", tmp_path / "elsewhere")  # another machine: the folder is not at that path
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert checkpoint_main([*export, str(tmp_path / "without")]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "any multi-token-prediction layers (num_nextn_predict_layers)" in warned[0]
    assert f"{tmp_path / 'hf'}, is not there" in warned[0] and "make that folder available" in warned[0]
    assert json.loads((tmp_path / "without" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert not any(n.startswith(f"model.layers.{MTP}.") for n in exported(tmp_path / "without"))
    assert loads_in_transformers(tmp_path / "without", "deepseek_v3", expected, x) == set()


@pytest.mark.slow
def test_a_lora_run_merged_into_its_base_carries_them_too(tmp_path, caplog):
    import torch.distributed as dist

    from titanlite.cli.checkpoint import main as checkpoint_main

    from helpers import make_trainer, tiny_argv

    hf_frontier_model(tmp_path / "hf", "deepseek_v3")
    mtp = add_mtp_layer(tmp_path / "hf")
    argv = tiny_argv(tmp_path / "run", "--model.name", "deepseek_v3", "--model.flavor", "hf",
                     "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--training.steps", "1",
                     "--training.local_batch_size", "2", "--training.global_batch_size", "2",
                     "--model.vocab_size", str(VOCAB), "--checkpoint.enable", "--lora.enable")  # fmt: skip
    try:
        make_trainer(argv).train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    export = ["export", "--checkpoint", str(tmp_path / "run" / "checkpoint"), "--format", "hf", "--output"]
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert checkpoint_main([*export, str(tmp_path / "merged")]) == 0
    assert_carried(tmp_path / "merged", mtp, caplog, tmp_path / "hf")
