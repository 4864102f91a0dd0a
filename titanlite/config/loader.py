"""Loading a JobConfig: defaults, then the TOML file, then `--section.key value` overrides, then validation.

Precedence: command line over TOML over the defaults in `sections`. No torch here, so config errors
are reported in well under a second and before any process group exists.
"""

from __future__ import annotations

import difflib
import math
import sys
import typing
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from titanlite.config.fields import field_type, fields_of
from titanlite.config.parallelism import Parallelism
from titanlite.config.reference import help_text
from titanlite.config.sections import SECTIONS, JobConfig
from titanlite.errors import ConfigError
from titanlite.models.registry import flavors

# The shipped configs: train_configs/ of a source checkout, or the copy installed with the package.
_SOURCE_CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"
_PACKAGED_CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"
CONFIG_DIR = _SOURCE_CONFIGS if _SOURCE_CONFIGS.is_dir() else _PACKAGED_CONFIGS


def gradient_sync_mode(parallelism: Parallelism) -> str:
    """The gradient_sync in effect: hsdp_delay_all_reduce = true means delay_all_reduce."""
    if not parallelism.hsdp_delay_all_reduce:
        return parallelism.gradient_sync
    if parallelism.gradient_sync not in ("every_microbatch", "delay_all_reduce"):
        raise ConfigError(
            f"parallelism.hsdp_delay_all_reduce = true contradicts parallelism.gradient_sync = "
            f"{parallelism.gradient_sync!r}; set only one of them (hsdp_delay_all_reduce = true is "
            f"gradient_sync = 'delay_all_reduce')"
        )
    return "delay_all_reduce"


def _closest(word: str, options) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _coerce(key: str, value, typ, list_ok: bool = False):
    """Convert a TOML or command-line value to the field's type, or raise ConfigError naming the key."""
    if type(None) in typing.get_args(typ):  # X | None: unset stays None
        (inner,) = [a for a in typing.get_args(typ) if a is not type(None)]
        return None if value is None else _coerce(key, value, inner, list_ok)
    origin = typing.get_origin(typ)
    if list_ok and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
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
            number = float(value)
            if math.isfinite(number):
                return number
            raise ConfigError(f"{key} = {value!r} is not valid; expected a finite number")
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        if origin is list:
            (inner,) = typing.get_args(typ)
            if isinstance(value, str) and value.lstrip().startswith("["):
                items = ",".join(v.strip(" \"'") for v in value.strip()[1:].rstrip("]").split(","))
                raise ConfigError(
                    f"{key} = {value!r} is a bracketed list; on the command line a list is comma-separated, e.g. "
                    f"--{key} {items or 'a,b'} (brackets are for TOML files)"
                )
            if isinstance(value, str):
                value = [v for v in (s.strip() for s in value.split(",")) if v]
            if not isinstance(value, list):
                raise ValueError
            return [_coerce(key, v, inner) for v in value]
    except ConfigError:
        raise
    except (ValueError, TypeError):
        pass
    else:
        raise TypeError(f"unsupported field type {typ} for {key}")
    name = getattr(typ, "__name__", str(typ))
    hint = " (true or false)" if typ is bool else ""
    raise ConfigError(f"{key} = {value!r} is not a valid {name}{hint}")


def shipped_configs() -> list[str]:
    """The names of the TOML files that ship with titanlite."""
    return sorted(p.name for p in CONFIG_DIR.glob("*.toml"))


def resolve_config_file(name: str) -> Path:
    """The path of a config file given as a path or as a name inside train_configs/."""
    candidates = [Path(name)]
    if not Path(name).is_absolute():
        candidates += [CONFIG_DIR / name, CONFIG_DIR / f"{name}.toml"]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(
        f"job.config_file = {name!r}: no such file (looked in the current folder and {CONFIG_DIR}); "
        f"configs shipped: {', '.join(shipped_configs()) or 'none found'}"
    )


def _apply(cfg: JobConfig, section: str, key: str, value, origin: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown section [{section}] in {origin}{_closest(section, SECTIONS)}; "
            f"valid sections: {', '.join(SECTIONS)}"
        )
    fields = fields_of(SECTIONS[section])
    if key not in fields:
        raise ConfigError(
            f"unknown key {section}.{key} in {origin}{_closest(key, fields)}; "
            f"valid keys of [{section}]: {', '.join(fields)}"
        )
    fld = fields[key]
    setattr(
        getattr(cfg, section),
        key,
        _coerce(f"{section}.{key}", value, field_type(fld), fld.metadata.get("list_ok", False)),
    )


def _parse_cli(argv: list[str]) -> list[tuple[str, str, object]]:
    """`--section.key value`, `--section.key=value` and bare boolean flags -> (section, key, raw value)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.key value "
                f"or --section.key=value (see --help)"
            )
        name, eq, value = arg[2:].partition("=")
        section, _, key = name.partition(".")
        i += 1
        if not eq:
            fld = fields_of(SECTIONS[section]).get(key) if section in SECTIONS else None
            is_bool = fld is not None and field_type(fld, unwrap_optional=True) is bool
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
    for section, cls in SECTIONS.items():
        for key, fld in fields_of(cls).items():
            check = fld.metadata.get("check")
            value = getattr(getattr(cfg, section), key)
            if check is not None and not check(value):
                raise ConfigError(f"{section}.{key} = {value!r} is not valid; expected {fld.metadata['valid']}")
    gradient_sync_mode(cfg.parallelism)
    if "://" in cfg.job.dump_folder and not cfg.job.dump_folder.startswith("file://"):
        raise ConfigError(
            f"job.dump_folder = {cfg.job.dump_folder!r} is not valid; expected a local or mounted folder (for "
            "object storage set checkpoint.folder = 's3://bucket/prefix')"
        )
    known = flavors(cfg.model.name)
    if cfg.model.flavor not in known:
        raise ConfigError(
            f"model.flavor = {cfg.model.flavor!r} is not a {cfg.model.name} flavor"
            f"{_closest(cfg.model.flavor, known)}; valid: {', '.join(known)}"
        )


def read_toml(path: Path) -> dict:
    """The parsed TOML file; ConfigError naming the file when it is not valid TOML."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a BOM (Windows editors) is not TOML
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file = {str(path)!r} is not valid TOML: {e}") from None


def load(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults, then the TOML file named by --job.config_file, then the other overrides.

    `--help` prints every key (help_text) and exits.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    overrides = _parse_cli(argv)
    cfg = JobConfig()
    config_file = next((v for s, k, v in reversed(overrides) if (s, k) == ("job", "config_file")), "")
    if config_file:
        path = resolve_config_file(str(config_file))
        for section, table in read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{path}: top-level key {section!r} must be a [section] table{_closest(section, SECTIONS)}"
                )
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
            if v is None:  # unset (TOML has no null): the key is left out
                continue
            if isinstance(v, bool):
                v = str(v).lower()
            elif isinstance(v, str):
                v = '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            elif isinstance(v, list):
                v = "[" + ", ".join(f'"{x}"' if isinstance(x, str) else str(x) for x in v) + "]"
            lines.append(f"{k} = {v}")
        lines.append("")
    return "\n".join(lines)
