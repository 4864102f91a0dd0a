"""The JobConfig sections as dataclasses: each field's default, doc line and validity check, side by side.

A field is declared with `setting(default, doc, check=predicate, valid="what is accepted")`; `--help`, the
docs/config.md reference and `loader.validate` all read that metadata. Checks that need the world size live in
`titanlite.plan`. No torch here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanlite.config.dpo import Dpo
from titanlite.config.fault_tolerance import FaultTolerance
from titanlite.config.fields import DTYPE, POSITIVE, non_negative, one_of, positive, setting
from titanlite.config.float8 import Float8
from titanlite.config.lora import Lora
from titanlite.config.optimizer import Optimizer
from titanlite.config.parallelism import Parallelism
from titanlite.models.registry import BACKEND, FAMILIES

CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


@dataclass
class Job:
    config_file: str = setting("", "TOML file to read; a bare name is looked up in train_configs/")
    dump_folder: str = setting("./outputs", "local folder for checkpoints, TensorBoard logs and other outputs")
    description: str = setting("", "free text describing the job, printed at start")
    print_config: bool = setting(False, "print the resolved configuration at start (rank 0)")


@dataclass
class Model:
    name: str = setting(
        "llama3",
        "model family: llama3, qwen3, qwen2, mistral, qwen3_moe or mixtral (docs/model_families.md, docs/moe.md); "
        "transformers: any causal LM that transformers implements, as its own class, from the HuggingFace folder in "
        "checkpoint.initial_load_path (model.flavor = hf; a folder no family implements goes there by itself)",
        one_of(*FAMILIES, BACKEND),
        " or ".join([*FAMILIES, BACKEND]),
    )
    flavor: str = setting(
        "debugmodel",
        "model size: debugmodel and tiny (every family); llama3: 8B, 70B (Llama 3), 3.1-8B, 3.1-70B, 405B (3.1), "
        "1B, 3B (3.2), 3.3-70B; qwen3: 0.6B, 1.7B, 4B, 8B, 14B, 32B; qwen3_moe: 30B-A3B, 235B-A22B; hf = the shape "
        "of the HuggingFace folder in "
        "checkpoint.initial_load_path (its config.json's family must be model.name; a model_type no family "
        "implements: the transformers backend)",
    )
    tokenizer_path: str = setting(
        "", "HuggingFace tokenizer: a tokenizer.json or a folder with one (a HF model folder); '' = built-in bytes"
    )
    vocab_size: int = setting(
        0,
        "embedding rows; 0 = the flavor's, or the tokenizer's size when the flavor has none",
        non_negative,
        "0 or a number > 0",
    )
    tie_embeddings: bool | None = setting(
        None,
        "share the input embedding and output projection weights; unset = the flavor's (tied: Llama 1B, 3B; "
        "Qwen3 up to 4B; hf per config.json)",
    )
    attention: str = setting(
        "causal",
        "causal: every token attends to all earlier tokens of its sequence; block_causal: only to earlier tokens "
        "of its own document, with RoPE positions restarting at each document (packed documents, chat data)",
        one_of("causal", "block_causal"),
        "causal or block_causal",
    )
    rope_scaling: str = setting(
        "",
        "RoPE scaling for a context longer than pretraining's: '' = the flavor's (or the HF folder's config.json); "
        "none; linear (positions interpolated by rope_factor); yarn (YaRN, Qwen3's recipe for 128k: rope_factor "
        "and rope_original_context); overrides the folder's (docs/long_context.md)",
        one_of("", "none", "linear", "yarn"),
        "'' (the flavor's), none, linear or yarn",
    )
    rope_factor: float = setting(
        0.0,
        "linear, yarn only: how many times the pretraining context the model should reach (4.0: 32,768 -> 131,072)",
        lambda v: v == 0 or v >= 1,
        "0 (unset) or a number >= 1",
    )
    rope_original_context: int = setting(
        0,
        "yarn only: the context the model was pretrained at; 0 = the flavor's (Qwen3: 32,768 as in Qwen's recipe, "
        "not its 40,960 positions; a released Qwen3 folder likewise) or the HF folder's max_position_embeddings",
        non_negative,
        "0 or a number > 0",
    )


@dataclass
class Training:
    dataset: str = setting(
        "builtin",
        "'builtin' (embedded offline text), a local file/folder, a HF hub name or a prepared token store; "
        "a mixture as 'name:weight,name:weight' (or a TOML list of 'name:weight')",
        list_ok=True,
    )
    dataset_split: str = setting("train", "split to read from a HF hub dataset")
    dataset_config: str = setting("", "configuration name of a HF hub dataset")
    dataset_text_field: str = setting("text", "record field that holds the text")
    local_batch_size: int = setting(8, "sequences per microbatch on each data-parallel rank", positive, POSITIVE)
    global_batch_size: int = setting(
        -1,
        "sequences per optimizer step over all ranks; -1 = local x dp degree",
        lambda v: v == -1 or v > 0,
        "-1 or a number > 0",
    )
    seq_len: int = setting(256, "tokens per sequence", positive, POSITIVE)
    loss_chunk_tokens: int = setting(
        1024,
        "the output projection and the loss are computed this many tokens at a time (their gradients too), so "
        "the vocabulary-sized logits of a whole microbatch never exist (with tensor parallelism: each rank's share "
        "of the vocabulary); 0 = all at once. Not used with a compiled loss (compile with inductor, tp 1)",
        non_negative,
        "0 or a number > 0",
    )
    steps: int = setting(200, "optimizer steps to train for", positive, POSITIVE)
    max_norm: float = setting(
        1.0, "clip the global gradient norm to this; 0 disables clipping", non_negative, "a number >= 0"
    )
    mixed_precision_param: str = setting(
        "bfloat16", "dtype parameters are cast to for compute: float32, bfloat16, float16", **DTYPE
    )
    mixed_precision_reduce: str = setting(
        "float32", "dtype gradients are reduced in: float32, bfloat16, float16", **DTYPE
    )
    seed: int = setting(
        42,
        "seed for weight init and any randomness; the same on every rank",
        lambda v: 0 <= v < 2**63,
        "a whole number from 0 to 2**63 - 1",
    )
    enable_cpu_offload: bool = setting(False, "keep sharded parameters, gradients and optimizer state in CPU memory")
    hang_timeout_seconds: float = setting(
        1800.0,
        "a rank that stays this long in one phase (a stopped process, a stuck collective) ends the job with a "
        "report of what every rank was doing; longer than the slowest step, save or validation; 0: never",
        non_negative,
        "a number of seconds >= 0 (0 turns the check off)",
    )
    deterministic: bool = setting(
        False, "deterministic kernels (slower on GPU); without it GPU runs are not bitwise repeatable (CUDA atomics)"
    )
    loss_on: str = setting(
        "assistant",
        "chat data: the tokens that count in the loss: assistant (every reply), last_assistant (the last reply of "
        "each conversation) or all",
        one_of("assistant", "last_assistant", "all"),
        "assistant, last_assistant or all",
    )


@dataclass
class Data:
    store: str = setting(
        "auto",
        "auto: tokenize each dataset once into a memory-mapped token store (built by the job's ranks when "
        "missing, reused by later runs) and let each rank read only its own sequences; none: every rank "
        "streams and tokenizes the whole global batch (small jobs)",
        one_of("auto", "none"),
        "auto or none",
    )
    store_folder: str = setting(
        "",
        "where token stores are kept; '' = <TITANLITE_CACHE or ~/.cache/titanlite>/token_stores (multi-node: "
        "a folder every node sees)",
    )
    remote_cache_mib: int = setting(
        256,
        "a token store in object storage (training.dataset = 's3://...'): MiB of fetched 1 MiB chunks each rank "
        "keeps, the least recently used dropped first",
        positive,
        POSITIVE,
    )
    remote_chunk_kib: int = setting(
        64,
        "a token store in object storage: KiB per ranged read (the unit of the cache); smaller fetches fewer "
        "bytes a rank does not use, larger makes fewer requests",
        positive,
        POSITIVE,
    )
    shuffle: bool = setting(True, "shuffle the documents each epoch with training.seed (token stores; any topology)")
    prefetch: int = setting(
        2,
        "steps prepared ahead in a background thread; 0 = prepare each step in the training loop",
        non_negative,
        "a number >= 0",
    )
    format: str = setting(
        "text",
        "text: documents packed back to back into windows; chat: conversations rendered with a chat template, "
        "packed whole (never split) and padded, the loss on training.loss_on; preference: (prompt, chosen, "
        "rejected) pairs for [dpo], each response after the shared prompt, one pair per two padded sequences",
        one_of("text", "chat", "preference"),
        "text, chat or preference",
    )
    messages_field: str = setting("messages", "chat: the record field with the list of {role, content} messages")
    prompt_field: str = setting("prompt", "chat: without a messages field, the user's prompt ...")
    response_field: str = setting("response", "chat: ... and the assistant's response")
    system_field: str = setting("system", "chat: an optional system message beside prompt/response")
    chosen_field: str = setting("chosen", "preference: the preferred response (a string or assistant messages)")
    rejected_field: str = setting("rejected", "preference: the dispreferred response (a string or messages)")
    pair_truncation: str = setting(
        "response",
        "preference: a pair longer than training.seq_len + 1 tokens: response (cut both responses at their end; "
        "a prompt that leaves no room for a response drops the pair), prompt (cut the prompt at its start so the "
        "longer response fits; a response longer than that drops the pair) or drop; dropped pairs are counted in "
        "the log",
        one_of("response", "prompt", "drop"),
        "response, prompt or drop",
    )
    chat_template: str = setting(
        "",
        "chat: '' = the tokenizer's chat_template (tokenizer_config.json; the byte tokenizer: titanlite's), "
        "'builtin' = titanlite's simple template, or a .jinja file",
    )
    text_unit: str = setting(
        "line",
        ".txt files: one document per line, per paragraph (blank-line separated) or per file",
        one_of("line", "paragraph", "file"),
        "line, paragraph or file",
    )


@dataclass
class LRScheduler:
    warmup_steps: int = setting(10, "steps of linear warmup from ~0 to the peak lr", non_negative, "a number >= 0")
    decay_type: str = setting(
        "cosine",
        "decay after warmup: linear, cosine or constant",
        one_of("linear", "cosine", "constant"),
        "linear, cosine or constant",
    )
    min_lr_factor: float = setting(
        0.1, "final lr as a fraction of the peak lr", lambda v: 0 <= v <= 1, "a number in [0, 1]"
    )


@dataclass
class Checkpoint:
    enable: bool = setting(False, "save sharded checkpoints and resume from the newest one")
    folder: str = setting(
        "checkpoint",
        "checkpoint folder under job.dump_folder, or in object storage: s3://bucket/prefix (any fsspec URL; "
        "pip install 'titanlite[s3]'; credentials from the AWS variables, docs/checkpoints.md)",
    )
    interval: int = setting(500, "save every this many steps (and at the last step)", positive, POSITIVE)
    keep_latest_k: int = setting(
        0,
        "keep only the newest k complete checkpoints; 0 keeps all (the newest is never deleted)",
        non_negative,
        "a number >= 0 (0 keeps all)",
    )
    load_step: int = setting(
        -1,
        "step to resume from; -1 = the newest complete checkpoint, if any",
        lambda v: v >= -1,
        "-1 (newest) or a step >= 0",
    )
    exclude_from_loading: list[str] = setting(
        [],
        "parts not restored on resume: any of model, optimizer, lr_scheduler, dataloader, train_state",
        lambda v: set(v) <= set(CHECKPOINT_PARTS),
        "a list of " + ", ".join(CHECKPOINT_PARTS),
    )
    on_save_error: str = setting(
        "stop",
        "when a save fails (disk full, I/O error): stop (end the run with one message; the newest complete "
        "checkpoint is where a relaunch resumes) or continue (log it and train on without that checkpoint)",
        one_of("stop", "continue"),
        "stop or continue",
    )
    async_mode: str = setting(
        "disabled",
        "disabled (a save blocks) or async (written in a background thread while training goes on)",
        one_of("disabled", "async"),
        "disabled or async",
    )
    allow_data_change: bool = setting(
        False,
        "resume even when the tokenizer or the training data changed since the checkpoint (its data position "
        "then points into other data); without it such a resume is refused",
    )
    last_save_model_only: bool = setting(False, "at the last step save only the model, in export_dtype (for export)")
    export_dtype: str = setting(
        "float32", "dtype of the model-only and HuggingFace last saves: float32, bfloat16, float16", **DTYPE
    )
    last_save_in_hf: bool = setting(
        False,
        "after the last step also write the model as a HuggingFace folder <folder>/hf-step-N (every rank "
        "writes its shards), in export_dtype, with config.json and the tokenizer files",
    )
    initial_load_path: str = setting(
        "",
        "model weights to start a new run from: a DCP folder (step-N), a consolidated file, or a HuggingFace model "
        "folder (config.json + *.safetensors), local or an s3:// URL; unused when resuming",
    )


@dataclass
class Metrics:
    log_freq: int = setting(10, "print (and record) metrics every this many steps", positive, POSITIVE)
    enable_tensorboard: bool = setting(False, "write TensorBoard scalars under <dump_folder>/<save_tb_folder>")
    save_tb_folder: str = setting("tb", "TensorBoard folder under job.dump_folder")
    enable_wandb: bool = setting(
        False,
        "log the same scalars and the resolved config to Weights & Biases (rank 0; needs the wandb extra; "
        "WANDB_* variables apply, WANDB_MODE=offline needs no network); a resumed job continues its W&B run",
    )
    wandb_project: str = setting("", "W&B project; '' = WANDB_PROJECT, else 'titanlite'")
    wandb_entity: str = setting("", "W&B entity (user or team); '' = WANDB_ENTITY, else your default entity")
    wandb_run_name: str = setting("", "W&B run name; '' = WANDB_NAME, else one W&B picks")
    peak_flops: float = setting(
        0.0,
        "peak FLOP/s of one device for MFU; 0 = look the GPU model up (n/a on CPU)",
        non_negative,
        "0 (look up) or a number > 0",
    )


@dataclass
class Validation:
    enable: bool = setting(False, "evaluate loss and perplexity on held-out data every `freq` steps")
    dataset: str = setting(
        "", "held-out data: '' = training.dataset's held-out split; or a local file/folder, HF hub name"
    )
    dataset_split: str = setting("validation", "split of the held-out data (builtin: validation; HF hub: a split name)")
    freq: int = setting(100, "validate every this many steps (and after the last step)", positive, POSITIVE)
    steps: int = setting(
        10,
        "global batches per validation, the same ones each time; -1 = one pass over the data",
        lambda v: v == -1 or v > 0,
        "-1 (one pass) or a number > 0",
    )


@dataclass
class Profiling:
    enable_profiling: bool = setting(False, "write a torch.profiler trace every `profile_freq` steps")
    save_traces_folder: str = setting("profile_traces", "trace folder under job.dump_folder")
    profile_freq: int = setting(
        10, "profile one step in every this many (traces and memory snapshots)", positive, POSITIVE
    )
    enable_memory_snapshot: bool = setting(False, "dump a CUDA memory snapshot every `profile_freq` steps (GPU only)")
    save_memory_snapshot_folder: str = setting("memory_snapshot", "memory snapshot folder under job.dump_folder")


@dataclass
class ActivationCheckpoint:
    mode: str = setting(
        "none",
        "recompute activations in backward, per transformer block: none, full or selective",
        one_of("none", "full", "selective"),
        "none, full or selective",
    )
    selective_ac_option: str = setting(
        "2",
        "selective mode: an integer k (checkpoint every k-th block) or 'op' (every block, but keep "
        "matmul and attention outputs and recompute only the cheap ops)",
        lambda v: v == "op" or (v.isdigit() and int(v) >= 1),
        "'op' or an integer >= 1 (checkpoint every k-th block)",
    )
    selective_op_policy: str = setting(
        "all_matmuls",
        "selective 'op': which outputs each block keeps; all_matmuls (every matmul and attention output: least "
        "recompute) or every_second_matmul (TorchTitan's: attention and every other matmul, the rest recomputed: "
        "less memory, about a third of the block's matmul FLOPs again in backward)",
        one_of("all_matmuls", "every_second_matmul"),
        "all_matmuls or every_second_matmul",
    )


@dataclass
class Compile:
    enable: bool = setting(False, "torch.compile each transformer block (before sharding)")
    backend: str = setting(
        "inductor",
        "torch.compile backend: inductor, aot_eager or eager",
        one_of("inductor", "aot_eager", "eager"),
        "inductor, aot_eager or eager",
    )


LOAD_BALANCE = ("aux_loss", "aux_free", "none")


@dataclass
class MoE:
    load_balance: str = setting(
        "aux_loss",
        "Mixture-of-Experts models: aux_loss (transformers' load-balancing loss, weighted by aux_loss_coef), "
        "aux_free (DeepSeek-V3's per-expert routing bias, moved each step against the load its expert got) or none",
        one_of(*LOAD_BALANCE),
        ", ".join(LOAD_BALANCE),
    )
    aux_loss_coef: float = setting(
        -1.0,
        "aux_loss: the weight of the load-balancing loss; -1 = the model's (config.json's router_aux_loss_coef; "
        "0.001 for Qwen3-MoE, 0.02 for Mixtral)",
        lambda v: v == -1 or v >= 0,
        "-1 (the model's) or a number >= 0",
    )
    bias_update_rate: float = setting(
        1e-3, "aux_free: how far each optimizer step moves an expert's routing bias", positive, POSITIVE
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: MoE = field(default_factory=MoE)
    lora: Lora = field(default_factory=Lora)
    dpo: Dpo = field(default_factory=Dpo)
    float8: Float8 = field(default_factory=Float8)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict:
        """The configuration as nested plain dicts (TOML-shaped)."""
        return dataclasses.asdict(self)


# Section name -> its dataclass, read off JobConfig (declared once, above).
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
