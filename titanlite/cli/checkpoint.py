"""`python -m titanlite.checkpoint export`: write a checkpoint's model as one consolidated file or a HF folder.

    python -m titanlite.checkpoint export --checkpoint DIR --output FILE [--dtype bfloat16] [--overwrite]
    python -m titanlite.checkpoint export --checkpoint DIR --output FOLDER --format hf [--dtype bfloat16] [--overwrite]
    python -m titanlite.checkpoint export --checkpoint DIR --output FOLDER --format peft [--overwrite]

DIR is a step-N folder or a checkpoint folder (its newest step), local or in object storage (s3://...; so may the
output be: docs/checkpoints.md). The HF export reads the model's shape
and the tokenizer from the job_config.toml and model_args.json saved in the step folder. A LoRA checkpoint
exports its adapters as a peft folder (adapter_config.json + adapter_model.safetensors), or, as hf, merged into
its base. An existing output file, or a folder that holds a model, is replaced only with --overwrite (whole, never
mixed); a folder holding anything else, or the checkpoint itself, never is; a failed export leaves no partial output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titanlite.checkpoint.backend_export import export_backend
from titanlite.checkpoint.catalog import read_metadata
from titanlite.checkpoint.consolidated import export, model_prefix, resolve_step
from titanlite.checkpoint.export_target import check_target, write_atomically
from titanlite.checkpoint.hf_io import DEFAULT_MAX_FILE_BYTES, export_hf
from titanlite.checkpoint.lora_export import export_merged, export_peft, lora_base_of
from titanlite.checkpoint.remote_export import local_export
from titanlite.checkpoint.resume import saved_job_config, saved_model_args
from titanlite.data.tokenizers import build_tokenizer
from titanlite.dtypes import TORCH_DTYPES
from titanlite.errors import ConfigError
from titanlite.model_builder import build_model
from titanlite.models.args import args_from_dict
from titanlite.models.hf_names import hf_shapes
from titanlite.models.registry import BACKEND, FAMILIES


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.checkpoint", description="Export the model of a titanlite checkpoint."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's model as one consolidated file or a HF folder")
    ex.add_argument("--checkpoint", required=True, help="a step-N folder, or a checkpoint folder (its newest)")
    ex.add_argument("--output", required=True, help="file (consolidated) or folder (hf) to write")
    ex.add_argument(
        "--format",
        choices=("consolidated", "hf", "peft"),
        default="consolidated",
        help="consolidated: torch.save of {name: tensor}; hf: config.json + sharded safetensors (a LoRA checkpoint: "
        "merged into its base); peft: a LoRA checkpoint's adapters as a peft adapter folder",
    )
    ex.add_argument(
        "--dtype", choices=list(TORCH_DTYPES), default=None, help="cast floating tensors (default: as saved)"
    )
    ex.add_argument(
        "--overwrite", action="store_true", help="replace an existing output file, or a folder that holds a model"
    )
    ex.add_argument(
        "--max-shard-size",
        type=int,
        default=DEFAULT_MAX_FILE_BYTES,
        help="hf: bytes per safetensors file at most (default 5 GiB)",
    )
    return parser.parse_args(argv)


def export_to_hf(checkpoint: Path, output: Path, dtype: str | None, max_file_bytes: int) -> int:
    """The HF export of a step folder; returns the number of tensors written."""
    step = resolve_step(checkpoint)
    try:
        metadata = read_metadata(step)
    except ValueError as e:
        raise ConfigError(f"--checkpoint {step} is not a usable DCP checkpoint: {e}") from None
    if lora_base_of(step) is not None:
        cast = TORCH_DTYPES[dtype] if dtype else None
        return write_atomically(output, True, lambda tmp: export_merged(step, tmp, cast, max_file_bytes, _lora_model))
    saved_args, cfg = saved_model_args(step), saved_job_config(step)
    if saved_args is None or cfg is None:
        raise ConfigError(
            f"--checkpoint {step} has no readable model_args.json / job_config.toml (saved by titanlite since "
            f"HF export exists); export --format consolidated, or save it again with this version"
        )
    if saved_args.get("family") == BACKEND:  # transformers' own class writes its folder
        tokenizer, cast = build_tokenizer(cfg.model.tokenizer_path), TORCH_DTYPES[dtype] if dtype else None
        return write_atomically(
            output, True, lambda tmp: export_backend(step, model_prefix(metadata), tmp, saved_args, cast, tokenizer,
                                                     max_file_bytes, cfg.checkpoint.initial_load_path)
        )  # fmt: skip
    try:
        args = args_from_dict(saved_args)
        hf_shapes(args)  # every field a shape needs is there and of the right type
        if args.family not in FAMILIES:
            raise ValueError(f"family {args.family!r} is not one of {', '.join(FAMILIES)}")
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ConfigError(
            f"{step / 'model_args.json'} does not describe a model ({type(e).__name__}: {e}); it is damaged: "
            "export --format consolidated, or use another step"
        ) from None
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    cast = TORCH_DTYPES[dtype] if dtype else None
    start = cfg.checkpoint.initial_load_path  # the MTP layers are carried from there (hf_carried.py)
    return write_atomically(
        output,
        True,
        lambda tmp: export_hf(step, model_prefix(metadata), tmp, args, cast, tokenizer, max_file_bytes, start),
    )


def main(argv: list[str] | None = None) -> int:
    """Export; 0 done, 1 the output could not be written (disk full, ...), 2 bad input."""
    args = _parse(argv)
    try:
        if args.max_shard_size <= 0:
            raise ConfigError(f"--max-shard-size {args.max_shard_size} is not valid; expected bytes > 0")
        folder = args.format != "consolidated"
        with local_export(args.checkpoint, args.output, folder, args.overwrite) as (checkpoint, output):
            what = _export(args, Path(checkpoint), Path(output))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # after the checks: the disk filled up, the folder went away, ...
        print(f"error: writing --output {args.output} failed: {e}; nothing was written there", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {what}, dtype {args.dtype or 'as saved'}")
    return 0


def _export(args: argparse.Namespace, checkpoint: Path, output: Path) -> str:
    """Write the export of `checkpoint` to `output` (both local); what was written, for the closing line."""
    check_target(output, args.format != "consolidated", args.overwrite, checkpoint)
    if args.format == "peft":
        step = resolve_step(checkpoint)
        cast = TORCH_DTYPES[args.dtype] if args.dtype else None
        n = write_atomically(output, True, lambda tmp: export_peft(step, tmp, cast))
        return f"peft adapter folder, {n} tensors"
    if args.format == "hf":
        n = export_to_hf(checkpoint, output, args.dtype, args.max_shard_size)
        return f"HuggingFace folder, {n} tensors"
    sd = export(checkpoint, output, args.dtype)
    return f"{len(sd)} tensors, {sum(v.numel() for v in sd.values()):,} values"


def _lora_model(cfg, args):
    """A LoRA run's model with its adapters, unsharded, on the meta device."""
    return build_model(cfg, args, None, inference=True).model
