"""Job configuration: dataclass sections, loaded from TOML and `--section.key value` overrides.

Precedence: command line over TOML over the defaults below. Every field carries a doc line
(`field(metadata={"doc": ...})`) that `--help` prints. This module imports no torch, so config
errors are reported in well under a second and before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


class ConfigError(ValueError):
    """A user mistake in the configuration: the message names the key, the value and what is valid."""


def _f(default, doc: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


DTYPES = ("float32", "bfloat16", "float16")
GRADIENT_SYNC = ("every_microbatch", "delay_all_reduce", "last_microbatch_only")


@dataclass
class Job:
    config_file: str = _f("", "TOML file to read; a bare name is looked up in train_configs/")
    dump_folder: str = _f("./outputs", "folder for checkpoints, TensorBoard logs and other outputs")
    description: str = _f("", "free text describing the job, printed at start")
    print_config: bool = _f(False, "print the resolved configuration at start (rank 0)")


@dataclass
class Model:
    name: str = _f("llama3", "model family; only llama3 is built in")
    flavor: str = _f("debugmodel", "model size from the family's flavors (debugmodel, 1B, 8B, 70B, ...)")
    tokenizer_path: str = _f("", "HuggingFace tokenizer.json (file or folder); empty = built-in byte tokenizer")
    vocab_size: int = _f(0, "embedding rows; 0 = the flavor's, or the tokenizer's size when the flavor has none")
    tie_embeddings: bool = _f(False, "share the input embedding and output projection weights")


@dataclass
class Training:
    dataset: str = _f("builtin", "'builtin' (embedded offline text), a local file/folder, or a HF hub name")
    dataset_split: str = _f("train", "split to read from a HF hub dataset")
    dataset_config: str = _f("", "configuration name of a HF hub dataset")
    dataset_text_field: str = _f("text", "record field that holds the text")
    local_batch_size: int = _f(8, "sequences per microbatch on each data-parallel rank")
    global_batch_size: int = _f(-1, "sequences per optimizer step over all ranks; -1 = local x dp degree")
    seq_len: int = _f(256, "tokens per sequence")
    steps: int = _f(200, "optimizer steps to train for")
    max_norm: float = _f(1.0, "clip the global gradient norm to this; 0 disables clipping")
    mixed_precision_param: str = _f("bfloat16", "dtype parameters are cast to for compute: float32, bfloat16, float16")
    mixed_precision_reduce: str = _f("float32", "dtype gradients are reduced in: float32, bfloat16, float16")
    seed: int = _f(42, "seed for weight init and any randomness; the same on every rank")
    enable_cpu_offload: bool = _f(False, "keep sharded parameters, gradients and optimizer state in CPU memory")
    deterministic: bool = _f(False, "use deterministic algorithms (slower on GPU)")


@dataclass
class Optimizer:
    name: str = _f("AdamW", "optimizer: AdamW or Adam")
    lr: float = _f(8e-4, "peak learning rate")
    beta1: float = _f(0.9, "Adam beta1")
    beta2: float = _f(0.95, "Adam beta2")
    eps: float = _f(1e-8, "Adam epsilon")
    weight_decay: float = _f(0.1, "decoupled weight decay")


@dataclass
class LRScheduler:
    warmup_steps: int = _f(10, "steps of linear warmup from ~0 to the peak lr")
    decay_type: str = _f("cosine", "decay after warmup: linear, cosine or constant")
    min_lr_factor: float = _f(0.1, "final lr as a fraction of the peak lr")


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = _f(-1, "ranks each parameter is sharded over (FSDP); -1 = what replicate leaves")
    data_parallel_replicate_degree: int = _f(1, "replica groups (HSDP when > 1 with shard > 1; DDP-like with shard 1)")
    fsdp_reshard_after_forward: str = _f(
        "default", "free gathered params after forward: default, always, never, or an int (reshard group size)")
    hsdp_delay_all_reduce: bool = _f(
        False, "HSDP with accumulation: all-reduce across replicas only on the last microbatch "
        "(shorthand for gradient_sync = delay_all_reduce)")
    gradient_sync: str = _f(
        "every_microbatch", "gradient reduction with accumulation: every_microbatch; delay_all_reduce (replicas "
        "all-reduce on the last microbatch only; reduce-scatter on each); last_microbatch_only (no reduction "
        "before the last microbatch; holds unsharded gradients, model size x reduce dtype, per rank)")


@dataclass
class Checkpoint:
    enable: bool = _f(False, "save sharded checkpoints and resume from the newest one")
    folder: str = _f("checkpoint", "checkpoint folder under job.dump_folder")
    interval: int = _f(500, "save every this many steps (and at the last step)")
    keep_latest_k: int = _f(0, "keep only the newest k complete checkpoints; 0 keeps all (the newest is never deleted)")
    load_step: int = _f(-1, "step to resume from; -1 = the newest complete checkpoint, if any")
    exclude_from_loading: list[str] = _f(
        [], "parts not restored on resume: any of model, optimizer, lr_scheduler, dataloader, train_state")
    async_mode: str = _f("disabled", "disabled (a save blocks) or async (written in a background thread while training goes on)")
    last_save_model_only: bool = _f(False, "at the last step save only the model, in export_dtype (for export)")
    export_dtype: str = _f("float32", "dtype of the model-only last save: float32, bfloat16, float16")
    initial_load_path: str = _f(
        "", "model weights to start a new run from: a DCP folder (step-N) or a consolidated file; unused when resuming")


@dataclass
class Metrics:
    log_freq: int = _f(10, "print (and record) metrics every this many steps")
    enable_tensorboard: bool = _f(False, "write TensorBoard scalars under <dump_folder>/<save_tb_folder>")
    save_tb_folder: str = _f("tb", "TensorBoard folder under job.dump_folder")
    peak_flops: float = _f(0.0, "peak FLOP/s of one device for MFU; 0 = look the GPU model up (n/a on CPU)")


@dataclass
class Validation:
    enable: bool = _f(False, "evaluate loss and perplexity on held-out data every `freq` steps")
    dataset: str = _f("", "held-out data: '' = training.dataset's held-out split; or a local file/folder, HF hub name")
    dataset_split: str = _f("validation", "split of the held-out data (builtin: validation; HF hub: a split name)")
    freq: int = _f(100, "validate every this many steps (and after the last step)")
    steps: int = _f(10, "global batches per validation, the same ones each time; -1 = one pass over the data")


@dataclass
class Profiling:
    enable_profiling: bool = _f(False, "write a torch.profiler trace every `profile_freq` steps")
    save_traces_folder: str = _f("profile_traces", "trace folder under job.dump_folder")
    profile_freq: int = _f(10, "profile one step in every this many (traces and memory snapshots)")
    enable_memory_snapshot: bool = _f(False, "dump a CUDA memory snapshot every `profile_freq` steps (GPU only)")
    save_memory_snapshot_folder: str = _f("memory_snapshot", "memory snapshot folder under job.dump_folder")


@dataclass
class ActivationCheckpoint:
    mode: str = _f("none", "recompute activations in backward, per transformer block: none, full or selective")
    selective_ac_option: str = _f(
        "2", "selective mode: an integer k (checkpoint every k-th block) or 'op' (every block, but keep "
             "matmul and attention outputs and recompute only the cheap ops)")


@dataclass
class Compile:
    enable: bool = _f(False, "torch.compile each transformer block (before sharding)")
    backend: str = _f("inductor", "torch.compile backend: inductor, aot_eager or eager")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
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


CONFIG_DIR = Path(__file__).resolve().parent.parent / "train_configs"

# Checks run after loading: (section, key) -> (predicate, description of valid values).
_CHECKS: dict[tuple[str, str], tuple[typing.Callable, str]] = {}


def check(section: str, key: str, valid: str):
    """Register a validity predicate for one field; `valid` describes what is accepted."""
    def deco(fn):
        _CHECKS[(section, key)] = (fn, valid)
        return fn
    return deco


def _positive(v):
    return v > 0


for _sec, _key in [("training", "local_batch_size"), ("training", "seq_len"), ("training", "steps"),
                   ("metrics", "log_freq"), ("checkpoint", "interval"), ("optimizer", "eps")]:
    check(_sec, _key, "a number > 0")(_positive)
check("training", "global_batch_size", "-1 or a number > 0")(lambda v: v == -1 or v > 0)
check("training", "max_norm", "a number >= 0")(lambda v: v >= 0)
check("training", "mixed_precision_param", " or ".join(DTYPES))(lambda v: v in DTYPES)
check("training", "mixed_precision_reduce", " or ".join(DTYPES))(lambda v: v in DTYPES)
check("optimizer", "name", "AdamW or Adam")(lambda v: v in ("AdamW", "Adam"))
check("optimizer", "lr", "a number > 0")(_positive)
check("optimizer", "beta1", "a number in [0, 1)")(lambda v: 0 <= v < 1)
check("optimizer", "beta2", "a number in [0, 1)")(lambda v: 0 <= v < 1)
check("optimizer", "weight_decay", "a number >= 0")(lambda v: v >= 0)
check("lr_scheduler", "warmup_steps", "a number >= 0")(lambda v: v >= 0)
check("lr_scheduler", "decay_type", "linear, cosine or constant")(lambda v: v in ("linear", "cosine", "constant"))
check("lr_scheduler", "min_lr_factor", "a number in [0, 1]")(lambda v: 0 <= v <= 1)
check("parallelism", "data_parallel_shard_degree", "-1 or a number >= 1")(lambda v: v == -1 or v >= 1)
check("parallelism", "data_parallel_replicate_degree", "a number >= 1")(lambda v: v >= 1)
check("parallelism", "fsdp_reshard_after_forward", "default, always, never, or an integer >= 1")(
    lambda v: v in ("default", "always", "never") or (v.isdigit() and int(v) >= 1))
check("parallelism", "gradient_sync", ", ".join(GRADIENT_SYNC))(lambda v: v in GRADIENT_SYNC)
check("model", "name", "llama3")(lambda v: v == "llama3")
CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
check("checkpoint", "keep_latest_k", "a number >= 0 (0 keeps all)")(lambda v: v >= 0)
check("checkpoint", "load_step", "-1 (newest) or a step >= 0")(lambda v: v >= -1)
check("checkpoint", "exclude_from_loading", "a list of " + ", ".join(CHECKPOINT_PARTS))(
    lambda v: set(v) <= set(CHECKPOINT_PARTS))
check("checkpoint", "async_mode", "disabled or async")(lambda v: v in ("disabled", "async"))
check("checkpoint", "export_dtype", " or ".join(DTYPES))(lambda v: v in DTYPES)
check("model", "vocab_size", "0 or a number > 0")(lambda v: v >= 0)
check("activation_checkpoint", "mode", "none, full or selective")(lambda v: v in ("none", "full", "selective"))
check("activation_checkpoint", "selective_ac_option", "'op' or an integer >= 1 (checkpoint every k-th block)")(
    lambda v: v == "op" or (v.isdigit() and int(v) >= 1))
check("compile", "backend", "inductor, aot_eager or eager")(lambda v: v in ("inductor", "aot_eager", "eager"))
check("metrics", "peak_flops", "0 (look up) or a number > 0")(lambda v: v >= 0)
check("validation", "freq", "a number > 0")(_positive)
check("validation", "steps", "-1 (one pass) or a number > 0")(lambda v: v == -1 or v > 0)
check("profiling", "profile_freq", "a number > 0")(_positive)


def gradient_sync_mode(parallelism: Parallelism) -> str:
    """The gradient_sync in effect: hsdp_delay_all_reduce = true means delay_all_reduce."""
    if not parallelism.hsdp_delay_all_reduce:
        return parallelism.gradient_sync
    if parallelism.gradient_sync not in ("every_microbatch", "delay_all_reduce"):
        raise ConfigError(
            f"parallelism.hsdp_delay_all_reduce = true contradicts parallelism.gradient_sync = "
            f"{parallelism.gradient_sync!r}; set only one of them (hsdp_delay_all_reduce = true is "
            f"gradient_sync = 'delay_all_reduce')")
    return "delay_all_reduce"


def _sections() -> dict[str, type]:
    return {f.name: f.type if isinstance(f.type, type) else globals()[f.type] for f in dataclasses.fields(JobConfig)}


def _fields(section_cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _field_type(fld: dataclasses.Field) -> type:
    t = fld.type
    if isinstance(t, str):
        t = eval(t, globals())  # annotations are strings under `from __future__ import annotations`
    return t


def _closest(word: str, options) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _coerce(key: str, value, typ):
    """Convert a TOML or command-line value to the field's type, or raise ConfigError naming the key."""
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        if origin is list:
            (inner,) = typing.get_args(typ)
            if isinstance(value, str):
                value = [v for v in (s.strip() for s in value.split(",")) if v]
            if not isinstance(value, list):
                raise ValueError
            return [_coerce(key, v, inner) for v in value]
    except (ValueError, TypeError):
        pass
    else:
        raise TypeError(f"unsupported field type {typ} for {key}")
    name = getattr(typ, "__name__", str(typ))
    hint = " (true or false)" if typ is bool else ""
    raise ConfigError(f"{key} = {value!r} is not a valid {name}{hint}")


def resolve_config_file(name: str) -> Path:
    """The path of a config file given as a path or as a name inside train_configs/."""
    candidates = [Path(name)]
    if not Path(name).is_absolute():
        candidates += [CONFIG_DIR / name, CONFIG_DIR / f"{name}.toml"]
    for c in candidates:
        if c.is_file():
            return c
    known = sorted(p.name for p in CONFIG_DIR.glob("*.toml"))
    raise ConfigError(
        f"job.config_file = {name!r}: no such file (looked in the current folder and {CONFIG_DIR}); "
        f"configs shipped: {', '.join(known)}")


def _apply(cfg: JobConfig, section: str, key: str, value, origin: str) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown section [{section}] in {origin}{_closest(section, sections)}; "
                          f"valid sections: {', '.join(sections)}")
    fields = _fields(sections[section])
    if key not in fields:
        raise ConfigError(f"unknown key {section}.{key} in {origin}{_closest(key, fields)}; "
                          f"valid keys of [{section}]: {', '.join(fields)}")
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, _field_type(fields[key])))


def _parse_cli(argv: list[str]) -> list[tuple[str, str, object]]:
    """`--section.key value`, `--section.key=value` and bare boolean flags -> (section, key, raw value)."""
    sections = _sections()
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key value "
                              f"or --section.key=value (see --help)")
        name, eq, value = arg[2:].partition("=")
        section, _, key = name.partition(".")
        i += 1
        if not eq:
            fld = _fields(sections[section]).get(key) if section in sections else None
            is_bool = fld is not None and _field_type(fld) is bool
            nxt = argv[i] if i < len(argv) else None
            if is_bool and (nxt is None or nxt.lower() not in _TRUE + _FALSE):
                value = True  # bare flag
            elif nxt is None:
                raise ConfigError(f"--{name} needs a value")
            else:
                value, i = nxt, i + 1
        out.append((section, key, value))
    return out


def validate(cfg: JobConfig) -> None:
    """Raise ConfigError for the first out-of-range field; checks that need no world size."""
    for (section, key), (pred, valid) in _CHECKS.items():
        value = getattr(getattr(cfg, section), key)
        if not pred(value):
            raise ConfigError(f"{section}.{key} = {value!r} is not valid; expected {valid}")
    gradient_sync_mode(cfg.parallelism)
    from titanlite.models import flavors  # torch-free
    known = flavors(cfg.model.name)
    if cfg.model.flavor not in known:
        raise ConfigError(f"model.flavor = {cfg.model.flavor!r} is not a {cfg.model.name} flavor"
                          f"{_closest(cfg.model.flavor, known)}; valid: {', '.join(known)}")


def load(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults, then the TOML file named by --job.config_file, then the other overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    overrides = _parse_cli(argv)
    cfg = JobConfig()
    config_file = next((v for s, k, v in reversed(overrides) if (s, k) == ("job", "config_file")), "")
    if config_file:
        path = resolve_config_file(str(config_file))
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"job.config_file = {str(path)!r} is not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table"
                                  f"{_closest(section, _sections())}")
            for key, value in table.items():
                _apply(cfg, section, key, value, str(path))
        cfg.job.config_file = str(path)
    for section, key, value in overrides:
        if (section, key) != ("job", "config_file"):
            _apply(cfg, section, key, value, "the command line")
    validate(cfg)
    return cfg


def to_toml(cfg: JobConfig) -> str:
    """The configuration as TOML text (for printing the resolved config)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if isinstance(v, bool):
                v = str(v).lower()
            elif isinstance(v, str):
                v = '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            elif isinstance(v, list):
                v = "[" + ", ".join(f'"{x}"' if isinstance(x, str) else str(x) for x in v) + "]"
            lines.append(f"{k} = {v}")
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    """Every section and field with its type, default and doc line."""
    out = ["usage: run_train.sh [--config NAME] [--section.key value ...]",
           "       python -m titanlite.train --job.config_file FILE [--section.key value ...]", "",
           "Booleans work as bare flags (--checkpoint.enable) or with a value (--checkpoint.enable false).", ""]
    defaults = JobConfig()
    for section, cls in _sections().items():
        out.append(f"[{section}]")
        for name, fld in _fields(cls).items():
            t = _field_type(fld)
            tname = getattr(t, "__name__", str(t))
            default = getattr(getattr(defaults, section), name)
            out.append(f"  --{section}.{name} ({tname}, default {default!r})")
            out.append(f"      {fld.metadata.get('doc', '')}")
        out.append("")
    return "\n".join(out)


def markdown_reference() -> str:
    """Every section and field as Markdown tables (the README's config reference)."""
    out, defaults = [], JobConfig()
    for section, cls in _sections().items():
        out += [f"**[{section}]**", "", "| key | default | meaning |", "|---|---|---|"]
        for name, fld in _fields(cls).items():
            v = getattr(getattr(defaults, section), name)
            shown = str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)
            out.append(f"| `{name}` | `{shown}` | {fld.metadata.get('doc', '')} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """`python -m titanlite.config [--world-size N] [overrides]`: validate a configuration and print it.

    `python -m titanlite.config --markdown` prints the config reference for the README.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--markdown"]:
        print(markdown_reference())
        return 0
    world = None
    if "--world-size" in argv:
        i = argv.index("--world-size")
        world = int(argv[i + 1])
        del argv[i:i + 2]
    try:
        cfg = load(argv)
        if world is not None:  # every check the run makes before its process group (imports torch)
            from titanlite.distributed import pick_device
            from titanlite.train import validate_for_world
            validate_for_world(cfg, world, device_type=pick_device(0).type)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("TITANLITE_QUIET_CHECK") != "1":
        print(to_toml(cfg))
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so that ConfigError is the one other modules raise.
    from titanlite.config import main as _main
    raise SystemExit(_main())
