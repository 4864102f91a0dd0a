"""The bad-input catalogue for HF folders, checkpoints and exports: each case ends with exit status 2, a message
naming the file, key or value, no traceback, and nothing on disk changed (tests/bad_inputs.py).

The fixtures are made once per module (a tiny HF Llama folder in one file and in several, and a titanlite
checkpoint of the tiny flavor after 2 steps) and copied into each case's folder by its setup.
"""

import json
import shutil

import pytest
import torch

from bad_inputs import Case, check, read_only
from helpers import tiny_argv

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

FIXTURES = {}  # name -> folder, filled by the module fixture below
DROP = object()  # fields(key=DROP) removes the key
GEN = ("--prompt", "hi", "--max-new-tokens", "1", "--temperature", "0")
HF = "{tmp}/hf"
HF_CONFIG = "{tmp}/hf/config.json"
STEP = "{tmp}/ckpt/step-2"


@pytest.fixture(scope="module", autouse=True)
def fixtures(tmp_path_factory):
    """A tiny HF folder (one file, and sharded with an index) and a tiny-flavor checkpoint step-2."""
    root = tmp_path_factory.mktemp("fixtures")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=257,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(root / "hf", max_shard_size="10MB")
    model.save_pretrained(root / "hf-sharded", max_shard_size="100KB")
    assert len(list((root / "hf-sharded").glob("model-*.safetensors"))) > 2
    from titanlite.cli.train import main

    job = ("--training.global_batch_size", "8", "--training.local_batch_size", "8", "--checkpoint.enable")
    assert main(tiny_argv(root / "job", "--training.steps", "2", *job)) == 0
    FIXTURES.update(hf=root / "hf", hf_sharded=root / "hf-sharded", step=root / "job" / "checkpoint" / "step-2")
    yield
    FIXTURES.clear()


def hf(*edits, sharded=False):
    """Setup: the tiny HF folder (sharded: in several files with an index) as {tmp}/hf, then the edits."""

    def setup(tmp):
        shutil.copytree(FIXTURES["hf_sharded" if sharded else "hf"], tmp / "hf")
        for edit in edits:
            edit(tmp / "hf")

    return setup


def ckpt(*edits, step="step-2"):
    """Setup: the tiny checkpoint as {tmp}/ckpt/<step>, then the edits."""

    def setup(tmp):
        shutil.copytree(FIXTURES["step"], tmp / "ckpt" / step)
        for edit in edits:
            edit(tmp / "ckpt" / step)

    return setup


def both(*setups):
    """Setup: several setups in turn."""

    def setup(tmp):
        for s in setups:
            s(tmp)

    return setup


def fields(**values):
    """Edit: config.json with these fields set (DROP: removed)."""

    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        for key, value in values.items():
            if value is DROP:
                config.pop(key, None)
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))

    return edit


def write(name, data: str | bytes):
    """Edit: the file `name` holds data."""

    def edit(folder):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())

    return edit


def remove(name):
    """Edit: the file `name` is gone."""
    return lambda folder: (folder / name).unlink()


def truncate(pattern, size):
    """Edit: the first file matching pattern (in name order) cut to `size` bytes."""

    def edit(folder):
        path = sorted(folder.glob(pattern))[0]
        path.write_bytes(path.read_bytes()[:size])

    return edit


def second_shard(folder):
    return sorted(folder.glob("model-*.safetensors"))[1]


def drop_second_shard(folder):
    second_shard(folder).unlink()


def reshape_gate_proj(folder):
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        if "model.layers.0.mlp.gate_proj.weight" in tensors:
            tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 5)
            save_file(tensors, path, metadata={"format": "pt"})


def drop_lm_head(folder):
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        if tensors.pop("lm_head.weight", None) is not None:
            save_file(tensors, path, metadata={"format": "pt"})


def stale_copy(folder):
    shutil.copyfile(second_shard(folder), folder / "model-old.safetensors")


def gpt_oss_mxfp4(blocks_shape):
    """Setup: a tiny gpt-oss folder as {tmp}/hf whose experts are in MXFP4 (blocks and scales), the first layer's
    gate_up_proj_blocks of blocks_shape."""

    def setup(tmp):
        from safetensors.torch import load_file, save_file

        config = transformers.GptOssConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                           num_local_experts=4, num_experts_per_tok=2, sliding_window=4)  # fmt: skip
        transformers.GptOssForCausalLM(config).save_pretrained(tmp / "hf")
        path = tmp / "hf" / "model.safetensors"
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
            e, cols, rows = tensors.pop(name).shape
            shape = blocks_shape if name == "model.layers.0.mlp.experts.gate_up_proj" else (e, rows, cols // 32, 16)
            tensors[name + "_blocks"] = torch.zeros(shape, dtype=torch.uint8)
            tensors[name + "_scales"] = torch.full((e, rows, cols // 32), 127, dtype=torch.uint8)
        save_file(tensors, path, metadata={"format": "pt"})

    return setup


def generate(checkpoint, *extra):
    return ("--checkpoint", checkpoint, *GEN, *extra)


def check_hf(*extra):
    return ("--world-size", "1", "--model.flavor", "hf", "--checkpoint.initial_load_path", HF, *extra)


def export(checkpoint, output, *extra):
    return ("export", "--checkpoint", checkpoint, "--output", output, *extra)


INT = "expected a positive integer"
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32)  # fmt: skip
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", n_routed_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2, kv_lora_rank=32,
                   q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
GLM4_MOE = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32)  # fmt: skip
GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2)
MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
CASES = [
    # HF config.json: missing, mistyped, foreign fields; not JSON; not an object
    Case("hf-hidden-size-a-string", "hf", "generate", generate(HF), (HF_CONFIG, 'hidden_size = "4096"', INT),
         hf(fields(hidden_size="4096"))),
    Case("hf-layers-null", "hf", "config", check_hf(), (HF_CONFIG, "num_hidden_layers = null", INT),
         hf(fields(num_hidden_layers=None))),
    Case("hf-rope-theta-a-string", "hf", "config", check_hf(), (HF_CONFIG, 'rope_theta = "x"', "a positive number"),
         hf(fields(rope_theta="x"))),
    Case("hf-vocab-size-missing", "hf", "generate", generate(HF), (HF_CONFIG, "'vocab_size'", INT),
         hf(fields(vocab_size=DROP))),
    Case("hf-rope-scaling-a-list", "hf", "generate", generate(HF), (HF_CONFIG, "rope_scaling = [8.0]", "rope_type"),
         hf(fields(rope_parameters=DROP, rope_scaling=[8.0]))),
    Case("hf-rope-scaling-no-factor", "hf", "config", check_hf(), (HF_CONFIG, "'rope_scaling.factor'"),
         hf(fields(rope_parameters=DROP, rope_scaling={"rope_type": "llama3"}))),
    Case("hf-rope-type-unknown", "hf", "generate", generate(HF),
         (HF_CONFIG, "rope_parameters.rope_type = 'longrope'", "'default', 'llama3', 'linear', 'yarn'"),
         hf(fields(rope_parameters={"rope_type": "longrope", "factor": 4.0}))),
    Case("hf-yarn-mscale-negative", "hf", "config", check_hf(),
         (HF_CONFIG, "rope_parameters.mscale_all_dim = -1", "a number >= 0"),
         hf(fields(rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": -1}))),
    Case("hf-rope-scaling-drops-rope-parameters-theta", "hf", "generate", generate(HF),
         (HF_CONFIG, "both rope_parameters and rope_scaling", "rope_theta 1000000.0 vs 10000.0"),
         hf(fields(rope_theta=DROP, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}))),
    Case("hf-rope-scaling-yarn-beside-rope-parameters", "hf", "config", check_hf(),
         (HF_CONFIG, "both rope_parameters and rope_scaling", "rope_theta 1000000.0 vs"),
         hf(fields(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))),
    Case("hf-tie-override-would-discard-lm-head", "hf", "generate", generate(HF, "--model.tie_embeddings", "true"),
         ("model.tie_embeddings = true", "{tmp}/hf holds its own lm_head.weight", "leave model.tie_embeddings unset"),
         hf()),
    Case("hf-tie-override-would-discard-lm-head-training", "hf", "config", check_hf("--model.tie_embeddings", "true"),
         ("model.tie_embeddings = true", "{tmp}/hf holds its own lm_head.weight"), hf()),
    Case("hf-untie-override-without-lm-head", "hf", "config", check_hf("--model.tie_embeddings", "false"),
         ("model.tie_embeddings = false", "{tmp}/hf has no lm_head.weight"),
         hf(fields(tie_word_embeddings=True), drop_lm_head)),
    Case("generate-huge-vocab-is-checked-before-it-is-allocated", "checkpoint", "generate",
         generate(STEP, "--model.vocab_size", "100000000000", "--model.flavor", "tiny"),
         ("'tok_embeddings.weight' has shape (258, 64) in the checkpoint but (100000000000, 64) in the model",),
         ckpt()),
    Case("generate-tp-on-one-process", "config", "generate",
         generate(STEP, "--parallelism.tensor_parallel_degree", "2"),
         ("tensor_parallel_degree = 2 does not divide the world size 1", "--nproc N runs it on N"), ckpt()),
    Case("hf-pytorch-model-bin-only", "hf", "config", check_hf(),
         ("checkpoint.initial_load_path = '{tmp}/hf' has a config.json but no *.safetensors", "are pickles",
          "save_pretrained"), hf(remove("model.safetensors"), write("pytorch_model.bin", b"pickle"))),
    Case("hf-dtype-unknown", "hf", "generate", generate(HF), (HF_CONFIG, 'torch_dtype = "float17"', "bfloat16"),
         hf(fields(torch_dtype="float17"))),
    Case("hf-heads-not-a-divisor", "hf", "generate", generate(HF), (HF_CONFIG, "num_key_value_heads = 3"),
         hf(fields(num_key_value_heads=3))),
    Case("hf-tied-not-a-bool", "hf", "config", check_hf(), (HF_CONFIG, 'tie_word_embeddings = "yes"', "true or false"),
         hf(fields(tie_word_embeddings="yes"))),
    Case("hf-config-not-json", "hf", "generate", generate(HF), (HF_CONFIG, "cannot be read as JSON"),
         hf(write("config.json", "{not json"))),
    Case("hf-config-a-list", "hf", "config", check_hf(), (HF_CONFIG, "does not hold a JSON object but a list"),
         hf(write("config.json", "[1, 2]"))),
    Case("hf-config-missing", "hf", "generate", generate(HF), (HF, "has *.safetensors weights but no config.json"),
         hf(remove("config.json"))),
    Case("hf-config-missing-training", "hf", "config", check_hf(), (HF, "has no config.json"),
         hf(remove("config.json"))),
    Case("hf-weights-missing", "hf", "generate", generate(HF), (HF, "has a config.json but no *.safetensors weights"),
         hf(remove("model.safetensors"))),
    Case("hf-flavor-does-not-match", "hf", "generate", generate(HF, "--model.flavor", "debugmodel"),
         ("model.flavor = 'debugmodel' does not match", "dim 256 vs hidden_size 64"), hf()),
    # model families: an architecture titanlite does not implement, settings it refuses, the wrong family
    Case("hf-model-type-and-architectures-disagree", "hf", "config", check_hf(),
         (HF_CONFIG, "says model_type 'qwen3' (titanlite's qwen3 family, Qwen3ForCausalLM) but architectures "
                     "['LlamaForCausalLM']"), hf(fields(model_type="qwen3"))),
    Case("hf-architecture-with-remote-code", "hf", "generate", generate(HF),
         (HF_CONFIG, "auto_map: its model needs code from the folder (trust_remote_code), which titanlite never runs"),
         hf(fields(architectures=["GemmaForCausalLM"], model_type="gemma",
                   auto_map={"AutoModelForCausalLM": "modeling_gemma_x.GemmaX"}))),
    Case("hf-deepseek-v3-n-group-not-dividing-the-experts", "hf", "generate", generate(HF),
         (HF_CONFIG, "n_group = 3 is not valid", "a divisor of the 8 experts"),
         hf(fields(**DEEPSEEK_V3 | {"n_group": 3}))),
    Case("hf-deepseek-v3-topk-group-above-n-group", "hf", "config", check_hf("--model.name", "deepseek_v3"),
         (HF_CONFIG, "topk_group = 5 is not valid", "at most n_group = 4"),
         hf(fields(**DEEPSEEK_V3 | {"topk_group": 5}))),
    Case("hf-deepseek-v3-fp8-weights", "hf", "config", check_hf("--model.name", "deepseek_v3"),
         (HF_CONFIG, "quantization_config", "fp8_cast_bf16.py"),
         hf(fields(**DEEPSEEK_V3, quantization_config={"quant_method": "fp8"}))),
    Case("hf-glm4-moe-odd-partial-rotary", "hf", "config", check_hf("--model.name", "glm4_moe"),
         (HF_CONFIG, "partial_rotary_factor = 0.2", "= 3 features", "an even number"),
         hf(fields(**GLM4_MOE, partial_rotary_factor=0.2))),
    Case("hf-gpt-oss-unknown-layer-type", "hf", "config", check_hf("--model.name", "gpt_oss"),
         (HF_CONFIG, 'layer_types[1] = "chunked_attention" is not valid', "'sliding_attention' and 'full_attention'"),
         hf(fields(**GPT_OSS, layer_types=["sliding_attention", "chunked_attention"]))),
    Case("hf-gpt-oss-mxfp4-blocks-of-the-wrong-shape", "hf", "config", check_hf("--model.name", "gpt_oss"),
         ("model.layers.0.mlp.experts.gate_up_proj_blocks has shape (4, 64, 2, 8)", "the model needs (4, 64, 2, 16)"),
         gpt_oss_mxfp4(blocks_shape=(4, 64, 2, 8))),
    Case("hf-qwen3-moe-mlp-only-layer-out-of-range", "hf", "generate", generate(HF),
         (HF_CONFIG, "mlp_only_layers = [7]", "from 0 to num_hidden_layers - 1"),
         hf(fields(**QWEN3_MOE, mlp_only_layers=[7]))),
    Case("hf-qwen3-moe-top-k-above-experts", "hf", "config", check_hf("--model.name", "qwen3_moe"),
         (HF_CONFIG, "num_experts_per_tok = 8 is more than the 4 experts"),
         hf(fields(**QWEN3_MOE | {"num_experts_per_tok": 8}))),
    Case("hf-mixtral-sliding-window", "hf", "config", check_hf("--model.name", "mixtral"),
         (HF_CONFIG, "sliding_window = 4096", "sliding_window = null"),
         hf(fields(**MIXTRAL, sliding_window=4096))),
    Case("hf-mixtral-router-jitter", "hf", "generate", generate(HF),
         (HF_CONFIG, "router_jitter_noise = 0.1", "expected 0"), hf(fields(**MIXTRAL, router_jitter_noise=0.1))),
    Case("hf-mixtral-two-expert-counts", "hf", "config", check_hf("--model.name", "mixtral"),
         (HF_CONFIG, "num_local_experts = 4 and num_experts = 8", "expected one of them, or equal values"),
         hf(fields(**MIXTRAL, num_experts=8))),
    Case("hf-no-head-dim-and-an-odd-quotient", "hf", "config", check_hf(),
         (HF_CONFIG, "has no head_dim", "60 // 4 = 15", "an even positive integer"),
         hf(fields(head_dim=DROP, hidden_size=60, num_attention_heads=4))),
    Case("hf-mistral-sliding-window", "hf", "config", check_hf("--model.name", "mistral"),
         (HF_CONFIG, "sliding_window = 4096", "sliding_window = null"),
         hf(fields(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096))),
    Case("hf-mistral-sliding-window-absent", "hf", "generate", generate(HF),
         (HF_CONFIG, "sliding_window = 4096 (absent: MistralConfig's default)"),
         hf(fields(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=DROP))),
    Case("hf-qwen2-sliding-window", "hf", "generate", generate(HF),
         (HF_CONFIG, "use_sliding_window = true", "expected false"),
         hf(fields(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True))),
    Case("hf-qwen3-attention-bias", "hf", "config", check_hf("--model.name", "qwen3"),
         (HF_CONFIG, "attention_bias = true", "Qwen3ForCausalLM"),
         hf(fields(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=True))),
    Case("hf-family-is-not-model-name", "hf", "config", check_hf(),
         ("model.name = 'llama3', but {tmp}/hf/config.json describes a Qwen3ForCausalLM", "set model.name = 'qwen3'"),
         hf(fields(architectures=["Qwen3ForCausalLM"], model_type="qwen3"))),
    Case("hf-family-flavor-does-not-match", "hf", "config",
         ("--world-size", "1", "--model.name", "qwen3", "--model.flavor", "tiny", "--checkpoint.initial_load_path",
          HF), ("model.flavor = 'tiny' does not match", "head_dim 32 vs head_dim 16"),
         hf(fields(architectures=["Qwen3ForCausalLM"], model_type="qwen3"))),
    Case("hf-tensors-of-another-family", "hf", "config", check_hf("--model.name", "qwen3"),
         ("{tmp}/hf does not fit the model (Qwen3ForCausalLM", "another family than its config.json says",
          "missing tensors: model.layers.0.self_attn.q_norm.weight"),
         hf(fields(architectures=["Qwen3ForCausalLM"], model_type="qwen3"))),
    # the weights: index, shards, shapes
    Case("hf-index-names-a-missing-shard", "hf", "generate", generate(HF),
         ("{tmp}/hf/model.safetensors.index.json names 1 file(s) that are not in", "model-00002-of-"),
         hf(drop_second_shard, sharded=True)),
    Case("hf-index-not-json", "hf", "config", check_hf(),
         ("{tmp}/hf/model.safetensors.index.json cannot be read as JSON", "weight_map"),
         hf(write("model.safetensors.index.json", "{"), sharded=True)),
    Case("hf-shard-truncated", "hf", "generate", generate(HF),
         ("{tmp}/hf/model-00002-of-", "is not a readable safetensors file", "truncated"),
         hf(truncate("model-00002-of-*.safetensors", 100), sharded=True)),
    Case("hf-shard-not-safetensors", "hf", "config", check_hf(),
         ("{tmp}/hf/model.safetensors is not a readable safetensors file",),
         hf(write("model.safetensors", "<html>404 not found</html>"))),
    Case("hf-tensor-wrong-shape", "hf", "generate", generate(HF),
         ("model.layers.0.mlp.gate_proj.weight has shape (3, 5) in model-", "the model needs (96, 64)"),
         hf(reshape_gate_proj, sharded=True)),
    Case("hf-stale-shard-beside-the-index", "hf", "config", check_hf(),
         ("is in both model-00002-of-", "model-old.safetensors", "remove the stale file"),
         hf(stale_copy, sharded=True)),
    # the tokenizer files of a HF folder
    Case("hf-tokenizer-not-json", "hf", "generate", generate(HF),
         ("{tmp}/hf/tokenizer.json' is not a valid tokenizer.json",), hf(write("tokenizer.json", "{not json"))),
    Case("hf-tokenizer-missing", "hf", "generate", generate(HF, "--model.tokenizer_path", "{tmp}/hf/tokenizer.json"),
         ("model.tokenizer_path = '{tmp}/hf/tokenizer.json' does not exist",), hf()),
    Case("hf-vocab-smaller-than-tokenizer", "hf", "generate", generate(HF),
         ("vocab_size = 100 in {tmp}/hf/config.json is smaller than the tokenizer's 258",),
         hf(fields(vocab_size=100))),
    # checkpoints that are another model's, missing, incomplete or damaged
    Case("ckpt-another-models", "checkpoint", "generate", generate(STEP, "--model.flavor", "debugmodel"),
         ("'tok_embeddings.weight' has shape (258, 64) in the checkpoint but (258, 256) in the model",
          "--checkpoint '{tmp}/ckpt/step-2'", "dim: 64 in the checkpoint, 256 in this run",
          "--config {tmp}/ckpt/step-2/job_config.toml", "--model.flavor tiny"), ckpt()),
    Case("ckpt-missing", "checkpoint", "generate", generate("{tmp}/nope"), ("'{tmp}/nope' does not exist",)),
    Case("ckpt-default-missing", "checkpoint", "generate", (*GEN, "--job.dump_folder", "{tmp}/run"),
         ("--checkpoint was not given", "'{tmp}/run/checkpoint' does not exist")),
    Case("ckpt-empty-folder", "checkpoint", "generate", generate("{tmp}/ckpt"),
         ("'{tmp}/ckpt' is neither a DCP checkpoint",), lambda tmp: (tmp / "ckpt").mkdir()),
    Case("ckpt-not-a-checkpoint", "checkpoint", "generate", generate("{tmp}/notes"),
         ("'{tmp}/notes' is neither a DCP checkpoint",), write("notes/a.txt", "notes")),
    Case("ckpt-only-incomplete-steps", "checkpoint", "generate", generate("{tmp}/ckpt"),
         ("holds step-N folders but no complete checkpoint with a model (step-2, step-4)",),
         both(ckpt(remove(".metadata")), ckpt(remove(".metadata"), step="step-4"))),
    Case("ckpt-truncated", "checkpoint", "generate", generate(STEP, "--model.flavor", "tiny"),
         (f"{STEP} cannot be read", "__0_0.distcp has 1,000 bytes"), ckpt(truncate("__0_0.distcp", 1000))),
    Case("ckpt-metadata-garbage", "checkpoint", "generate", generate(STEP, "--model.flavor", "tiny"),
         (f"'{STEP}' is not a readable DCP checkpoint", "its .metadata cannot be read"),
         ckpt(write(".metadata", b"garbage"))),
    Case("ckpt-initial-weights-truncated", "checkpoint", "train",
         tuple(tiny_argv("{tmp}/run", "--checkpoint.initial_load_path", STEP, "--training.steps", "1")),
         (f"{STEP} cannot be read", "__0_0.distcp has 1,000 bytes"), ckpt(truncate("__0_0.distcp", 1000))),
    Case("ckpt-export-truncated", "checkpoint", "export", export(STEP, "{tmp}/model.pt"),
         (f"{STEP} cannot be read", "__0_0.distcp has 1,000 bytes"), ckpt(truncate("__0_0.distcp", 1000))),
    Case("ckpt-export-model-args-damaged", "checkpoint", "export", export(STEP, "{tmp}/out", "--format", "hf"),
         (f"{STEP}/model_args.json does not describe a model",), ckpt(write("model_args.json", '{"dim": "x"}'))),
    # generate's own numbers
    Case("gen-temperature-nan", "numeric", "generate", generate(STEP, "--temperature", "nan"),
         ("--temperature nan is not valid",), ckpt()),
    Case("gen-max-new-tokens-negative", "numeric", "generate", generate(STEP, "--max-new-tokens", "-1"),
         ("--max-new-tokens -1 is not valid",), ckpt()),
    Case("gen-max-new-tokens-not-a-number", "numeric", "generate", generate(STEP, "--max-new-tokens", "ten"),
         ("invalid int value: 'ten'", "--max-new-tokens"), ckpt()),
    # export targets and sources
    Case("export-file-to-a-folder", "export", "export", export(STEP, "{tmp}/out"),
         ("--output {tmp}/out is a folder, but this export writes a file",),
         both(ckpt(), lambda tmp: (tmp / "out").mkdir())),
    Case("export-folder-to-a-file", "export", "export", export(STEP, "{tmp}/out", "--format", "hf"),
         ("--output {tmp}/out is a file, but this export writes a folder",), both(ckpt(), write("out", "x"))),
    Case("export-below-a-file", "export", "export", export(STEP, "{tmp}/out/model.pt"),
         ("--output {tmp}/out/model.pt cannot be created: {tmp}/out is a file",), both(ckpt(), write("out", "x"))),
    Case("export-into-a-read-only-folder", "export", "export", export(STEP, "{tmp}/ro/model.pt"),
         ("--output {tmp}/ro/model.pt cannot be written: the folder {tmp}/ro is read-only",),
         both(ckpt(), lambda tmp: read_only(tmp / "ro"))),
    Case("export-over-an-existing-file", "export", "export", export(STEP, "{tmp}/model.pt"),
         ("--output {tmp}/model.pt already exists", "--overwrite"), both(ckpt(), write("model.pt", "weights"))),
    Case("export-over-a-folder-of-other-things", "export", "export",
         export(STEP, "{tmp}/docs", "--format", "hf", "--overwrite"),
         ("--output {tmp}/docs holds notes.txt and no model",),
         both(ckpt(), write("docs/notes.txt", "mine"))),
    Case("export-over-its-own-checkpoint", "export", "export", export(STEP, STEP, "--format", "hf", "--overwrite"),
         (f"--output {STEP} is the checkpoint being exported",), ckpt()),
    Case("export-over-the-checkpoint-folder", "export", "export",
         export(STEP, "{tmp}/ckpt", "--format", "hf", "--overwrite"),
         ("--output {tmp}/ckpt is a folder holding the checkpoint being exported",), ckpt()),
    Case("export-max-shard-size-zero", "export", "export", export(STEP, "{tmp}/out", "--format", "hf",
         "--max-shard-size", "0"), ("--max-shard-size 0 is not valid",), ckpt()),
    Case("export-step-missing", "export", "export", export("{tmp}/ckpt/step-99", "{tmp}/model.pt"),
         ("--checkpoint {tmp}/ckpt/step-99 does not exist",), ckpt()),
    Case("export-not-a-checkpoint", "export", "export", export("{tmp}/notes", "{tmp}/model.pt"),
         ("--checkpoint {tmp}/notes is not a usable DCP checkpoint", "no .metadata"), write("notes/a.txt", "notes")),
    Case("export-a-hf-folder", "export", "export", export(HF, "{tmp}/out", "--format", "hf"),
         ("--checkpoint {tmp}/hf is a HuggingFace model folder",), hf()),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path, capsys):
    check(case, tmp_path, capsys)


def test_the_catalogue_covers_hf_folders_checkpoints_and_exports():
    kinds = [c.kind for c in CASES]
    assert sum(k in ("hf", "checkpoint", "export") for k in kinds) >= 20
    assert {"hf", "checkpoint", "export"} <= set(kinds) and len({c.id for c in CASES}) == len(CASES)
