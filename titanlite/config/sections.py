"""The JobConfig sections as dataclasses: each field's default, doc line and validity check, side by side.

A field is declared with `_f(default, doc, check=predicate, valid="what is accepted")`; `--help`, the
docs/config.md reference and `loader.validate` all read that metadata. Checks that need the world size live in
`titanlite.plan`. No torch here.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from titanlite.models.registry import FAMILIES

DTYPE_NAMES = ("float32", "bfloat16", "float16")
GRADIENT_SYNC = ("every_microbatch", "delay_all_reduce", "last_microbatch_only")
CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


def _f(default, doc: str, check=None, valid: str = "", list_ok: bool = False):
    """A dataclass field with its doc line and an optional validity predicate (with `valid` describing it).

    list_ok: a str field that also takes a TOML list (its items joined with commas).
    """
    meta = {"doc": doc, "check": check, "valid": valid, "list_ok": list_ok}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


def _fraction(v) -> bool:
    return 0 <= v < 1


def _one_of(*options):
    return lambda v: v in options


_POSITIVE = "a number > 0"
_DTYPE = dict(check=_one_of(*DTYPE_NAMES), valid=" or ".join(DTYPE_NAMES))


@dataclass
class Job:
    config_file: str = _f("", "TOML file to read; a bare name is looked up in train_configs/")
    dump_folder: str = _f("./outputs", "folder for checkpoints, TensorBoard logs and other outputs")
    description: str = _f("", "free text describing the job, printed at start")
    print_config: bool = _f(False, "print the resolved configuration at start (rank 0)")


@dataclass
class Model:
    name: str = _f(
        "llama3",
        "model family: llama3, qwen3, qwen2 or mistral (docs/model_families.md)",
        _one_of(*FAMILIES),
        " or ".join(FAMILIES),
    )
    flavor: str = _f(
        "debugmodel",
        "model size: debugmodel and tiny (every family); llama3: 8B, 70B (Llama 3), 3.1-8B, 3.1-70B, 405B (3.1), "
        "1B, 3B (3.2), 3.3-70B; qwen3: 0.6B, 1.7B, 4B, 8B, 14B, 32B; hf = the shape of the HuggingFace folder in "
        "checkpoint.initial_load_path (its config.json's family must be model.name)",
    )
    tokenizer_path: str = _f(
        "", "HuggingFace tokenizer: a tokenizer.json or a folder with one (a HF model folder); '' = built-in bytes"
    )
    vocab_size: int = _f(
        0,
        "embedding rows; 0 = the flavor's, or the tokenizer's size when the flavor has none",
        _non_negative,
        "0 or a number > 0",
    )
    tie_embeddings: bool | None = _f(
        None,
        "share the input embedding and output projection weights; unset = the flavor's (tied: Llama 1B, 3B; "
        "Qwen3 up to 4B; hf per config.json)",
    )
    attention: str = _f(
        "causal",
        "causal: every token attends to all earlier tokens of its sequence; block_causal: only to earlier tokens "
        "of its own document, with RoPE positions restarting at each document (packed documents, chat data)",
        _one_of("causal", "block_causal"),
        "causal or block_causal",
    )


@dataclass
class Training:
    dataset: str = _f(
        "builtin",
        "'builtin' (embedded offline text), a local file/folder, a HF hub name or a prepared token store; "
        "a mixture as 'name:weight,name:weight' (or a TOML list of 'name:weight')",
        list_ok=True,
    )
    dataset_split: str = _f("train", "split to read from a HF hub dataset")
    dataset_config: str = _f("", "configuration name of a HF hub dataset")
    dataset_text_field: str = _f("text", "record field that holds the text")
    local_batch_size: int = _f(8, "sequences per microbatch on each data-parallel rank", _positive, _POSITIVE)
    global_batch_size: int = _f(
        -1,
        "sequences per optimizer step over all ranks; -1 = local x dp degree",
        lambda v: v == -1 or v > 0,
        "-1 or a number > 0",
    )
    seq_len: int = _f(256, "tokens per sequence", _positive, _POSITIVE)
    loss_chunk_tokens: int = _f(
        1024,
        "the output projection and the loss are computed this many tokens at a time (their gradients too), so "
        "the vocabulary-sized logits of a whole microbatch never exist (with tensor parallelism: each rank's share "
        "of the vocabulary); 0 = all at once. Not used with a compiled loss (compile with inductor, tp 1)",
        _non_negative,
        "0 or a number > 0",
    )
    steps: int = _f(200, "optimizer steps to train for", _positive, _POSITIVE)
    max_norm: float = _f(
        1.0, "clip the global gradient norm to this; 0 disables clipping", _non_negative, "a number >= 0"
    )
    mixed_precision_param: str = _f(
        "bfloat16", "dtype parameters are cast to for compute: float32, bfloat16, float16", **_DTYPE
    )
    mixed_precision_reduce: str = _f("float32", "dtype gradients are reduced in: float32, bfloat16, float16", **_DTYPE)
    seed: int = _f(
        42,
        "seed for weight init and any randomness; the same on every rank",
        lambda v: 0 <= v < 2**63,
        "a whole number from 0 to 2**63 - 1",
    )
    enable_cpu_offload: bool = _f(False, "keep sharded parameters, gradients and optimizer state in CPU memory")
    hang_timeout_seconds: float = _f(
        1800.0,
        "a rank that stays this long in one phase (a stopped process, a stuck collective) ends the job with a "
        "report of what every rank was doing; longer than the slowest step, save or validation; 0: never",
        _non_negative,
        "a number of seconds >= 0 (0 turns the check off)",
    )
    deterministic: bool = _f(
        False, "deterministic kernels (slower on GPU); without it GPU runs are not bitwise repeatable (CUDA atomics)"
    )
    loss_on: str = _f(
        "assistant",
        "chat data: the tokens that count in the loss: assistant (every reply), last_assistant (the last reply of "
        "each conversation) or all",
        _one_of("assistant", "last_assistant", "all"),
        "assistant, last_assistant or all",
    )


@dataclass
class Data:
    store: str = _f(
        "auto",
        "auto: tokenize each dataset once into a memory-mapped token store (built by the job's ranks when "
        "missing, reused by later runs) and let each rank read only its own sequences; none: every rank "
        "streams and tokenizes the whole global batch (small jobs)",
        _one_of("auto", "none"),
        "auto or none",
    )
    store_folder: str = _f(
        "",
        "where token stores are kept; '' = <TITANLITE_CACHE or ~/.cache/titanlite>/token_stores (multi-node: "
        "a folder every node sees)",
    )
    shuffle: bool = _f(True, "shuffle the documents each epoch with training.seed (token stores; any topology)")
    prefetch: int = _f(
        2,
        "steps prepared ahead in a background thread; 0 = prepare each step in the training loop",
        _non_negative,
        "a number >= 0",
    )
    format: str = _f(
        "text",
        "text: documents packed back to back into windows; chat: conversations rendered with a chat template, "
        "packed whole (never split) and padded, the loss on training.loss_on",
        _one_of("text", "chat"),
        "text or chat",
    )
    messages_field: str = _f("messages", "chat: the record field with the list of {role, content} messages")
    prompt_field: str = _f("prompt", "chat: without a messages field, the user's prompt ...")
    response_field: str = _f("response", "chat: ... and the assistant's response")
    system_field: str = _f("system", "chat: an optional system message beside prompt/response")
    chat_template: str = _f(
        "",
        "chat: '' = the tokenizer's chat_template (tokenizer_config.json; the byte tokenizer: titanlite's), "
        "'builtin' = titanlite's simple template, or a .jinja file",
    )
    text_unit: str = _f(
        "line",
        ".txt files: one document per line, per paragraph (blank-line separated) or per file",
        _one_of("line", "paragraph", "file"),
        "line, paragraph or file",
    )


@dataclass
class Optimizer:
    name: str = _f("AdamW", "optimizer: AdamW or Adam", _one_of("AdamW", "Adam"), "AdamW or Adam")
    lr: float = _f(8e-4, "peak learning rate", _positive, _POSITIVE)
    beta1: float = _f(0.9, "Adam beta1", _fraction, "a number in [0, 1)")
    beta2: float = _f(0.95, "Adam beta2", _fraction, "a number in [0, 1)")
    eps: float = _f(1e-8, "Adam epsilon", _positive, _POSITIVE)
    weight_decay: float = _f(0.1, "decoupled weight decay", _non_negative, "a number >= 0")


@dataclass
class LRScheduler:
    warmup_steps: int = _f(10, "steps of linear warmup from ~0 to the peak lr", _non_negative, "a number >= 0")
    decay_type: str = _f(
        "cosine",
        "decay after warmup: linear, cosine or constant",
        _one_of("linear", "cosine", "constant"),
        "linear, cosine or constant",
    )
    min_lr_factor: float = _f(0.1, "final lr as a fraction of the peak lr", lambda v: 0 <= v <= 1, "a number in [0, 1]")


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = _f(
        -1,
        "ranks each parameter is sharded over (FSDP); -1 = what replicate leaves",
        lambda v: v == -1 or v >= 1,
        "-1 or a number >= 1",
    )
    data_parallel_replicate_degree: int = _f(
        1, "replica groups (HSDP when > 1 with shard > 1; DDP-like with shard 1)", lambda v: v >= 1, "a number >= 1"
    )
    tensor_parallel_degree: int = _f(
        1,
        "ranks each block's matmuls are split over (tensor parallelism, the innermost mesh dimension: keep it "
        "within a node); world = replicate x shard x tp",
        lambda v: v >= 1,
        "a number >= 1",
    )
    enable_sequence_parallel: bool = _f(
        True, "with tp > 1: norms and the residual stream split over the sequence (less activation memory)"
    )
    enable_loss_parallel: bool = _f(
        True, "with tp > 1: the output projection and the loss stay split over the vocabulary (no full logits)"
    )
    fsdp_reshard_after_forward: str = _f(
        "default",
        "free gathered params after forward: default, always, never, or an int (reshard group size)",
        lambda v: v in ("default", "always", "never") or (v.isdigit() and int(v) >= 1),
        "default, always, never, or an integer >= 1",
    )
    hsdp_delay_all_reduce: bool = _f(
        False,
        "HSDP with accumulation: all-reduce across replicas only on the last microbatch "
        "(shorthand for gradient_sync = delay_all_reduce)",
    )
    gradient_sync: str = _f(
        "every_microbatch",
        "gradient reduction with accumulation: every_microbatch; delay_all_reduce (replicas "
        "all-reduce on the last microbatch only; reduce-scatter on each); last_microbatch_only (no reduction "
        "before the last microbatch; holds unsharded gradients, model size x reduce dtype, per rank)",
        _one_of(*GRADIENT_SYNC),
        ", ".join(GRADIENT_SYNC),
    )


@dataclass
class Checkpoint:
    enable: bool = _f(False, "save sharded checkpoints and resume from the newest one")
    folder: str = _f("checkpoint", "checkpoint folder under job.dump_folder")
    interval: int = _f(500, "save every this many steps (and at the last step)", _positive, _POSITIVE)
    keep_latest_k: int = _f(
        0,
        "keep only the newest k complete checkpoints; 0 keeps all (the newest is never deleted)",
        _non_negative,
        "a number >= 0 (0 keeps all)",
    )
    load_step: int = _f(
        -1,
        "step to resume from; -1 = the newest complete checkpoint, if any",
        lambda v: v >= -1,
        "-1 (newest) or a step >= 0",
    )
    exclude_from_loading: list[str] = _f(
        [],
        "parts not restored on resume: any of model, optimizer, lr_scheduler, dataloader, train_state",
        lambda v: set(v) <= set(CHECKPOINT_PARTS),
        "a list of " + ", ".join(CHECKPOINT_PARTS),
    )
    on_save_error: str = _f(
        "stop",
        "when a save fails (disk full, I/O error): stop (end the run with one message; the newest complete "
        "checkpoint is where a relaunch resumes) or continue (log it and train on without that checkpoint)",
        _one_of("stop", "continue"),
        "stop or continue",
    )
    async_mode: str = _f(
        "disabled",
        "disabled (a save blocks) or async (written in a background thread while training goes on)",
        _one_of("disabled", "async"),
        "disabled or async",
    )
    allow_data_change: bool = _f(
        False,
        "resume even when the tokenizer or the training data changed since the checkpoint (its data position "
        "then points into other data); without it such a resume is refused",
    )
    last_save_model_only: bool = _f(False, "at the last step save only the model, in export_dtype (for export)")
    export_dtype: str = _f(
        "float32", "dtype of the model-only and HuggingFace last saves: float32, bfloat16, float16", **_DTYPE
    )
    last_save_in_hf: bool = _f(
        False,
        "after the last step also write the model as a HuggingFace folder <folder>/hf-step-N (every rank "
        "writes its shards), in export_dtype, with config.json and the tokenizer files",
    )
    initial_load_path: str = _f(
        "",
        "model weights to start a new run from: a DCP folder (step-N), a consolidated file, or a HuggingFace model "
        "folder (config.json + *.safetensors); unused when resuming",
    )


@dataclass
class Metrics:
    log_freq: int = _f(10, "print (and record) metrics every this many steps", _positive, _POSITIVE)
    enable_tensorboard: bool = _f(False, "write TensorBoard scalars under <dump_folder>/<save_tb_folder>")
    save_tb_folder: str = _f("tb", "TensorBoard folder under job.dump_folder")
    enable_wandb: bool = _f(
        False,
        "log the same scalars and the resolved config to Weights & Biases (rank 0; needs the wandb extra; "
        "WANDB_* variables apply, WANDB_MODE=offline needs no network); a resumed job continues its W&B run",
    )
    wandb_project: str = _f("", "W&B project; '' = WANDB_PROJECT, else 'titanlite'")
    wandb_entity: str = _f("", "W&B entity (user or team); '' = WANDB_ENTITY, else your default entity")
    wandb_run_name: str = _f("", "W&B run name; '' = WANDB_NAME, else one W&B picks")
    peak_flops: float = _f(
        0.0,
        "peak FLOP/s of one device for MFU; 0 = look the GPU model up (n/a on CPU)",
        _non_negative,
        "0 (look up) or a number > 0",
    )


@dataclass
class Validation:
    enable: bool = _f(False, "evaluate loss and perplexity on held-out data every `freq` steps")
    dataset: str = _f("", "held-out data: '' = training.dataset's held-out split; or a local file/folder, HF hub name")
    dataset_split: str = _f("validation", "split of the held-out data (builtin: validation; HF hub: a split name)")
    freq: int = _f(100, "validate every this many steps (and after the last step)", _positive, _POSITIVE)
    steps: int = _f(
        10,
        "global batches per validation, the same ones each time; -1 = one pass over the data",
        lambda v: v == -1 or v > 0,
        "-1 (one pass) or a number > 0",
    )


@dataclass
class Profiling:
    enable_profiling: bool = _f(False, "write a torch.profiler trace every `profile_freq` steps")
    save_traces_folder: str = _f("profile_traces", "trace folder under job.dump_folder")
    profile_freq: int = _f(
        10, "profile one step in every this many (traces and memory snapshots)", _positive, _POSITIVE
    )
    enable_memory_snapshot: bool = _f(False, "dump a CUDA memory snapshot every `profile_freq` steps (GPU only)")
    save_memory_snapshot_folder: str = _f("memory_snapshot", "memory snapshot folder under job.dump_folder")


@dataclass
class ActivationCheckpoint:
    mode: str = _f(
        "none",
        "recompute activations in backward, per transformer block: none, full or selective",
        _one_of("none", "full", "selective"),
        "none, full or selective",
    )
    selective_ac_option: str = _f(
        "2",
        "selective mode: an integer k (checkpoint every k-th block) or 'op' (every block, but keep "
        "matmul and attention outputs and recompute only the cheap ops)",
        lambda v: v == "op" or (v.isdigit() and int(v) >= 1),
        "'op' or an integer >= 1 (checkpoint every k-th block)",
    )
    selective_op_policy: str = _f(
        "all_matmuls",
        "selective 'op': which outputs each block keeps; all_matmuls (every matmul and attention output: least "
        "recompute) or every_second_matmul (TorchTitan's: attention and every other matmul, the rest recomputed: "
        "less memory, about a third of the block's matmul FLOPs again in backward)",
        _one_of("all_matmuls", "every_second_matmul"),
        "all_matmuls or every_second_matmul",
    )


@dataclass
class Compile:
    enable: bool = _f(False, "torch.compile each transformer block (before sharding)")
    backend: str = _f(
        "inductor",
        "torch.compile backend: inductor, aot_eager or eager",
        _one_of("inductor", "aot_eager", "eager"),
        "inductor, aot_eager or eager",
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


def fields_of(section_cls) -> dict[str, dataclasses.Field]:
    """The fields of a section dataclass, by name."""
    return {f.name: f for f in dataclasses.fields(section_cls)}


def field_type(fld: dataclasses.Field, unwrap_optional: bool = False):
    """The field's type as an object (annotations are strings under `from __future__ import annotations`);
    with unwrap_optional, X for `X | None`."""
    t = fld.type
    if isinstance(t, str):
        t = eval(t, {"list": list, "dict": dict, "str": str, "int": int, "float": float, "bool": bool})
    if unwrap_optional and type(None) in typing.get_args(t):
        (t,) = [a for a in typing.get_args(t) if a is not type(None)]
    return t
