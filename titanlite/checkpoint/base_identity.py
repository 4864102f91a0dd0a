"""Which base model a LoRA checkpoint was trained on, so that its adapters are never resumed, exported or sampled
on another one.

A LoRA checkpoint holds the adapters, not the base; each save records `lora_base.json`: the base's path
(checkpoint.initial_load_path), its config (a HF folder's config.json, a titanlite checkpoint's model_args.json)
and a fingerprint: a SHA-256 over its tensors' names, dtypes and shapes (as its files' headers or metadata list
them) and bytes sampled from every weight file. Reading it costs a few MiB whatever the model's size. No torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from titanlite.errors import ConfigError

FILE = "lora_base.json"
SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 4096


def _sample(path: Path, start: int, digest) -> None:
    size = path.stat().st_size
    span = max(size - start, 0)
    with open(path, "rb") as f:
        for i in range(SAMPLES_PER_FILE):
            f.seek(start + span * i // SAMPLES_PER_FILE)
            digest.update(f.read(SAMPLE_BYTES))
    digest.update(str(size).encode())


def _safetensors_header(path: Path) -> tuple[bytes, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    layout = {k: (v["dtype"], v["shape"]) for k, v in sorted(header.items())}
    return json.dumps(layout, sort_keys=True).encode(), 8 + n


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fingerprint(path: str | Path) -> dict:
    """{path, config, tensors}: what identifies the base model at `path` (a HF folder, a DCP folder or a file)."""
    path = Path(path).expanduser()
    digest = hashlib.sha256()
    config = None
    if path.is_dir():
        config = _read_json(path / "config.json") or _read_json(path / "model_args.json")
        weights = sorted(path.glob("*.safetensors"))
        if weights:
            for f in weights:
                header, start = _safetensors_header(f)
                digest.update(header)
                _sample(f, start, digest)
        else:
            if (path / ".metadata").is_file():
                digest.update((path / ".metadata").read_bytes())
            for f in sorted(path.glob("*.distcp")):
                _sample(f, 0, digest)
    else:
        _sample(path, 0, digest)
    return {"path": str(path.resolve()), "config": config, "tensors": digest.hexdigest()}


def write(folder: Path, identity: dict) -> None:
    """Record the base in a checkpoint folder."""
    (folder / FILE).write_text(json.dumps(identity, indent=2) + "\n")


def read(folder: Path) -> dict | None:
    """The base a checkpoint folder records (None: not a LoRA checkpoint)."""
    return _read_json(Path(folder) / FILE) if (Path(folder) / FILE).is_file() else None


def check_same_base(saved: dict, now: dict, where: str) -> None:
    """ConfigError naming both bases when `now` is not the base `saved` records."""
    if saved.get("tensors") == now["tensors"] and saved.get("config") == now["config"]:
        return
    what = "its weights differ"
    if saved.get("config") != now["config"] and isinstance(saved.get("config"), dict) and now["config"]:
        keys = sorted(
            k for k in set(saved["config"]) | set(now["config"]) if saved["config"].get(k) != now["config"].get(k)
        )
        what = (
            "its config differs ("
            + ", ".join(f"{k}: {saved['config'].get(k)!r} then, {now['config'].get(k)!r} now" for k in keys[:4])
            + ")"
        )
    raise ConfigError(
        f"{where} holds LoRA adapters trained on the base {saved.get('path')} (fingerprint "
        f"{str(saved.get('tensors'))[:12]}); checkpoint.initial_load_path = {now['path']} is another base "
        f"(fingerprint {now['tensors'][:12]}: {what}). Adapters only mean something on their own base: point "
        "checkpoint.initial_load_path at it, or start a new job.dump_folder"
    )
