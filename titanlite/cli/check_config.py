"""`python -m titanlite.config [--world-size N] [overrides]`: validate a configuration and print it.

With --world-size it runs every check the run makes before its process group (titanlite.plan), as
run_train.sh does before starting torchrun. `--markdown` prints the config reference of docs/config.md.
"""

from __future__ import annotations

import os
import sys

from titanlite.config import load, markdown_reference, to_toml
from titanlite.errors import ConfigError
from titanlite.plan import validate_for_world
from titanlite.runtime.distributed import pick_device


def main(argv: list[str] | None = None) -> int:
    """Check the configuration; 0 valid, 2 a configuration error (one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--markdown"]:
        print(markdown_reference())
        return 0
    world = None
    try:
        if "--world-size" in argv:
            i = argv.index("--world-size")
            value = argv[i + 1] if i + 1 < len(argv) else ""
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--world-size {value!r} is not valid; expected a number >= 1")
            world = int(value)
            del argv[i : i + 2]
        cfg = load(argv)
        if world is not None:
            validate_for_world(cfg, world, device_type=pick_device(0).type)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("TITANLITE_QUIET_CHECK") != "1":
        print(to_toml(cfg))
    return 0
