"""`python -m titanlite.checkpoint export --checkpoint DIR --output FILE [--dtype bfloat16]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titanlite.checkpoint.consolidated import export
from titanlite.dtypes import TORCH_DTYPES
from titanlite.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """Export a checkpoint's model as one consolidated state-dict file; 0 done, 2 bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.checkpoint", description="Export the model of a titanlite checkpoint."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's model as one consolidated state-dict file")
    ex.add_argument("--checkpoint", required=True, help="a step-N folder, or a checkpoint folder (its newest)")
    ex.add_argument("--output", required=True, help="file to write (torch.save of {fqn: tensor})")
    ex.add_argument(
        "--dtype", choices=list(TORCH_DTYPES), default=None, help="cast floating tensors (default: as saved)"
    )
    args = parser.parse_args(argv)
    try:
        sd = export(Path(args.checkpoint), Path(args.output), args.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    numel = sum(v.numel() for v in sd.values())
    print(f"wrote {args.output}: {len(sd)} tensors, {numel:,} values, dtype {args.dtype or 'as saved'}")
    return 0
