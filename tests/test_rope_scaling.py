"""RoPE scaling for long contexts as transformers computes it: YaRN (Qwen3's recipe, DeepSeek's mscale) and linear,
read from config.json's rope_parameters or a hand-added rope_scaling block; logits equal to transformers' at
positions past the original context, export and reload, greedy generation; and set for built-in flavors."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 300
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
                 "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}  # fmt: skip
CASES = {
    "qwen3_yarn": ("qwen3", YARN, "rope_parameters"),
    "qwen3_yarn_added_by_hand": ("qwen3", YARN, "rope_scaling"),  # as Qwen3's model card tells users
    "llama3_yarn_mscale": ("llama3", DEEPSEEK_YARN, "rope_parameters"),
    "mistral_linear": ("mistral", {"rope_type": "linear", "factor": 2.0}, "rope_parameters"),
}


def _folder(tmp, family, rope, where, positions=512):
    """A random transformers model of the family with this RoPE scaling, saved; sharp attention so that RoPE
    matters. where: rope_parameters (transformers 5) or a rope_scaling block added to config.json afterwards."""
    torch.manual_seed(0)
    cls, config_cls = {
        "llama3": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
    }[family]
    params = (
        {**rope, "rope_theta": 10000.0}
        if where == "rope_parameters"
        else {"rope_type": "default", "rope_theta": 10000.0}
    )
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=positions,
                        rms_norm_eps=1e-6, rope_parameters=params,
                        **({"sliding_window": None} if family == "mistral" else {}))  # fmt: skip
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.save_pretrained(tmp)
    if where == "rope_scaling":
        data = json.loads((tmp / "config.json").read_text())
        data["rope_scaling"] = dict(rope)
        (tmp / "config.json").write_text(json.dumps(data))
    return transformers.AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()


def _titanlite(folder):
    from titanlite.checkpoint.hf_io import load_hf_weights
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import hf_args

    model = Transformer(hf_args(folder))
    load_hf_weights(model, folder)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_past_the_original_context_and_export_round_trips(tmp_path, case):
    from titanlite.checkpoint.hf_io import save_hf_sharded
    from titanlite.data.tokenizers import ByteTokenizer

    family, rope, where = CASES[case]
    hf = _folder(tmp_path / "hf", family, rope, where)
    ours = _titanlite(tmp_path / "hf")
    assert ours.args.rope_scaling.rope_type == rope["rope_type"]
    x = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(1))  # past 64 (and 32) positions
    with torch.no_grad():
        expected = hf(x).logits
        assert (ours(x) - expected).abs().max() < 1e-5
        unscaled = _titanlite_without_scaling(tmp_path / "hf")(x)
        assert (unscaled - expected)[:, 100:].abs().max() > 1e-2  # the scaling matters there
    save_hf_sharded(ours, tmp_path / "out", torch.float32, ByteTokenizer())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(x).logits - expected).abs().max() < 1e-5


def _titanlite_without_scaling(folder):
    from titanlite.checkpoint.hf_io import load_hf_weights
    from titanlite.models.decoder import Transformer
    from titanlite.models.registry import hf_args

    model = Transformer(hf_args(folder).with_overrides(rope_scaling=None))
    load_hf_weights(model, folder)
    return model.eval()


def test_a_qwen3_yarn_folder_generates_as_transformers_does(tmp_path):
    from titanlite.generation import generate

    hf = _folder(tmp_path, "qwen3", YARN, "rope_scaling")
    prompt = torch.randint(0, VOCAB, (1, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = generate(_titanlite(tmp_path), prompt[0].tolist(), 40, temperature=0.0)
    assert ours == theirs[0, 90:].tolist()


def test_scaling_set_for_a_built_in_flavor_and_bad_values():
    from titanlite.config import ConfigError, load
    from titanlite.models.registry import model_args

    cfg = load(["--model.name", "qwen3", "--model.flavor", "tiny", "--model.rope_scaling", "yarn",
                "--model.rope_factor", "4", "--model.rope_original_context", "64"])  # fmt: skip
    s = model_args(cfg.model, VOCAB, 256).rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert s.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    linear = model_args(load(["--model.rope_scaling", "linear", "--model.rope_factor", "2"]).model, VOCAB, 256)
    assert (linear.rope_scaling.rope_type, linear.rope_scaling.factor) == ("linear", 2.0)
    none = model_args(load(["--model.flavor", "3.1-8B", "--model.rope_scaling", "none"]).model, VOCAB, 256)
    assert none.rope_scaling is None
    with pytest.raises(ConfigError, match="model.rope_factor"):
        model_args(load(["--model.rope_scaling", "yarn"]).model, VOCAB, 256)
    # Qwen's recipe: original context 32,768 (the flavor's 40,960 positions include room for the reply)
    for name, flavor in (("qwen3", "8B"), ("qwen3_moe", "30B-A3B")):
        qwen = load(["--model.name", name, "--model.flavor", flavor, "--model.rope_scaling", "yarn",
                     "--model.rope_factor", "4"])  # fmt: skip
        assert model_args(qwen.model, VOCAB, 256).rope_scaling.original_max_position_embeddings == 32768
        assert model_args(qwen.model, VOCAB, 256).position_limit() == 131072
    unused = [
        (["--model.rope_factor", "4"], r"model.rope_factor = 4.0 does nothing with model.rope_scaling = ''"),
        (["--model.rope_scaling", "none", "--model.rope_factor", "4"], "does nothing with model.rope_scaling = 'none'"),
        (["--model.rope_scaling", "linear", "--model.rope_factor", "2", "--model.rope_original_context", "64"],
         r"model.rope_original_context = 64 is read by model.rope_scaling = 'yarn' only \(it is 'linear'\)"),
        (["--model.rope_original_context", "64"], "model.rope_original_context = 64 is read by"),
    ]  # fmt: skip
    for argv, message in unused:
        with pytest.raises(ConfigError, match=message):
            model_args(load(argv).model, VOCAB, 256)
    with pytest.raises(ConfigError, match="model.rope_scaling"):
        load(["--model.rope_scaling", "ntk"])


def test_generate_reaches_the_context_the_scaling_reaches(tmp_path):
    """A folder of 64 positions with YaRN x16 generates up to 1,024 positions, not to the config's seq_len (256);
    past that, one line names the key that raises the cap (issue 41, item 19)."""
    from titanlite.cli.generate import main
    from titanlite.models.registry import hf_args

    from helpers import capture_logs

    _folder(tmp_path, "qwen3", {**YARN, "factor": 16.0}, "rope_parameters", positions=64)
    assert hf_args(tmp_path).position_limit() == 1024
    assert hf_args(tmp_path).with_overrides(context_length=16384, rope_scaling=None).position_limit() == 16384
    argv = ["--checkpoint", str(tmp_path), "--prompt", "a", "--temperature", "0"]
    logs = capture_logs()
    assert main([*argv, "--max-new-tokens", "700"]) == 0
    assert any("Generated 700 tokens" in m for m in logs)
    assert main([*argv, "--max-new-tokens", "1100"]) == 0
    stop = [m for m in logs if "Stopped after" in m]
    assert len(stop) == 1 and "the sequence reached 1024 positions, the model's limit" in stop[0]
    assert "--training.seq_len N raises it" in stop[0]


def test_yarn_over_a_qwen3_folder_takes_qwen_s_original_context(tmp_path):
    """A Qwen3 folder as released (40,960 positions) with the YaRN x4 override: original context 32,768 as in Qwen's
    recipe, reaching 131,072; another folder's original context is its max_position_embeddings (issue 41, item 7)."""
    from titanlite.config import load
    from titanlite.models.registry import model_args

    for positions, original in ((40960, 32768), (512, 512)):
        folder = tmp_path / str(positions)
        _folder(folder, "qwen3", YARN, "rope_scaling", positions=positions)
        data = json.loads((folder / "config.json").read_text())
        data.pop("rope_scaling")
        (folder / "config.json").write_text(json.dumps(data))
        cfg = load(["--model.name", "qwen3", "--model.flavor", "hf", "--model.rope_scaling", "yarn",
                    "--model.rope_factor", "4"])  # fmt: skip
        scaling = model_args(cfg.model, VOCAB, 256, folder).rope_scaling
        assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("yarn", original)
