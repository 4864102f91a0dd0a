"""The config reference generated from the field docs: `--help` text and the Markdown tables of docs/config.md."""

from __future__ import annotations

from titanlite.config.fields import field_type, fields_of
from titanlite.config.sections import SECTIONS, JobConfig


def help_text() -> str:
    """Every section and field with its type, default and doc line."""
    out = [
        "usage: run_train.sh [--config NAME] [--section.key value ...]",
        "       python -m titanlite.train --job.config_file FILE [--section.key value ...]",
        "",
        "Booleans work as bare flags (--checkpoint.enable) or with a value (--checkpoint.enable false).",
        "",
    ]
    defaults = JobConfig()
    for section, cls in SECTIONS.items():
        out.append(f"[{section}]")
        for name, fld in fields_of(cls).items():
            t = field_type(fld, unwrap_optional=True)
            tname = getattr(t, "__name__", str(t))
            default = getattr(getattr(defaults, section), name)
            out.append(f"  --{section}.{name} ({tname}, default {default!r})")
            out.append(f"      {fld.metadata.get('doc', '')}")
        out.append("")
    return "\n".join(out)


def markdown_reference() -> str:
    """Every section and field as Markdown tables (the config reference in docs/config.md)."""
    out, defaults = [], JobConfig()
    for section, cls in SECTIONS.items():
        out += [f"**[{section}]**", "", "| key | default | meaning |", "|---|---|---|"]
        for name, fld in fields_of(cls).items():
            v = getattr(getattr(defaults, section), name)
            shown = str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)
            shown = "(unset)" if v is None else shown
            out.append(f"| `{name}` | `{shown}` | {fld.metadata.get('doc', '')} |")
        out.append("")
    return "\n".join(out)
