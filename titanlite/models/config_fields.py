"""Reading one field of a HuggingFace config.json: present or defaulted, of the right type, or a ConfigError that
names the file, the key, the value and what is valid. No torch."""

from __future__ import annotations

import json
import math

from titanlite.errors import ConfigError

REQUIRED = object()  # a field's default when config.json must hold it
POSITIVE_INT = "a positive integer"
POSITIVE_NUMBER = "a positive number"


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def is_number_at_least_0(v) -> bool:
    return is_positive_number(v) or (type(v) in (int, float) and v == 0)


def bad(file: str, key: str, value, expected: str) -> ConfigError:
    """The ConfigError of a field whose value is not valid."""
    shown = json.dumps(value)
    return ConfigError(f"{file}: {key} = {shown[:80]} is not valid; expected {expected}")


def field(config: dict, key: str, file: str, default, ok, expected: str, prefix: str = ""):
    """config[key] when ok(value); the default when it is absent or null (ConfigError when REQUIRED)."""
    value = config.get(key)
    if value is None:
        if default is REQUIRED:
            if key in config:
                raise bad(file, prefix + key, value, expected)
            raise ConfigError(f"{file} has no {prefix + key!r}, which titanlite needs; expected {expected}")
        return default
    if not ok(value):
        raise bad(file, prefix + key, value, expected)
    return value
