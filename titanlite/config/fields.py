"""How a config field is declared: its default, doc line and validity check side by side (`setting`), the checks
the sections share, and reading a section's fields back. No torch here."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def setting(default, doc: str, check=None, valid: str = "", list_ok: bool = False):
    """A dataclass field with its doc line and an optional validity predicate (with `valid` describing it).

    list_ok: a str field that also takes a TOML list (its items joined with commas).
    """
    meta = {"doc": doc, "check": check, "valid": valid, "list_ok": list_ok}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def positive(v) -> bool:
    return v > 0


def non_negative(v) -> bool:
    return v >= 0


def fraction(v) -> bool:
    return 0 <= v < 1


def one_of(*options):
    return lambda v: v in options


POSITIVE = "a number > 0"
DTYPE = dict(check=one_of(*DTYPE_NAMES), valid=" or ".join(DTYPE_NAMES))


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
