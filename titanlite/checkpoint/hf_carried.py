"""Tensors a HuggingFace export carries beside the trained model, added to the finished folder as more safetensors
files (the index, and config.json's num_nextn_predict_layers, updated):

- the multi-token-prediction (MTP) layers that DeepSeek-V3 and GLM-4.5 folders store after the model's
  (`model.layers.{num_hidden_layers + i}.*`), which titanlite does not train: copied byte for byte under their own
  names from the HF folder the run started from, so that vLLM and SGLang keep their speculative-decoding heads;
- the empty tensors of parts config.json sizes to zero (n_shared_experts = 0), which transformers builds and saves.

A transformers-backend model's export (carry_backend_tensors) carries the folder's tensors that its class sets aside
when it loads (`_keys_to_ignore_on_load_unexpected`: Qwen3.5's and Qwen3-Next's `mtp.*`, DeepSeek's and GLM's
layers past the model's, a multimodal folder's `model.visual.*`), under their own names.

The MTP layers are read when the export is written, from checkpoint.initial_load_path (through titanlite
checkpoints that started from one). Where that folder is not there, or is not the model the checkpoint was trained
from, the export goes on without them, says so, and its config.json says num_nextn_predict_layers = 0.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import re
import shutil
import struct

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import torch

from titanlite.checkpoint.export_target import shown
from titanlite.checkpoint.hf_folder import (
    INDEX,
    check_hf_weights,
    layer_index,
    safetensors_module,
    save_safetensors,
    zero_sized_shapes,
)
from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.config_fields import is_int
from titanlite.models.hf_config import CONFIG, is_hf_folder
from titanlite.models.registry import FAMILIES
from titanlite.storage import is_remote

logger = logging.getLogger("titanlite")

SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
MAX_CHAIN = 16  # titanlite checkpoints followed back to the HF folder they started from


def mtp_count(config: dict, keys: tuple[str, ...]) -> int:
    """The MTP layers a config.json counts (0 when none or not a count)."""
    n = next((config[k] for k in keys if config.get(k) is not None), 0)
    return n if is_int(n) and n > 0 else 0


def _source_folder(initial_load_path: str) -> tuple[pathlib.Path | None, str]:
    """(the HF folder the weights started from, or None with why not; "" when the run started from no weights):
    checkpoint.initial_load_path, followed through the job_config.toml of titanlite checkpoints that were
    themselves started from one."""
    path = initial_load_path
    for _ in range(MAX_CHAIN):
        if not path:
            return None, ""
        if is_remote(path):
            return None, f"it started from {path}, in object storage, which the export does not read back"
        folder = pathlib.Path(path).expanduser()
        if is_hf_folder(folder):
            return folder, ""
        if not (folder / "job_config.toml").is_file():
            return None, f"the folder it started from, {folder}, is not there (or holds no HF model)"
        try:
            path = tomllib.loads((folder / "job_config.toml").read_text())["checkpoint"]["initial_load_path"]
        except (OSError, ValueError, KeyError, TypeError):
            return None, f"{folder / 'job_config.toml'} does not say which weights that checkpoint started from"
    return None, f"checkpoint.initial_load_path goes through more than {MAX_CHAIN} checkpoints"


def _header(file: pathlib.Path) -> dict[str, int]:
    """Tensor name -> bytes, from a safetensors file's header."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _mtp_layers(args: ModelArgs, initial_load_path: str) -> tuple[pathlib.Path | None, int | None, dict, str]:
    """(source folder, MTP layers its config.json counts (None: unknown), tensor name -> file of those layers, why
    they are not carried)."""
    keys = FAMILIES[args.family].hf.mtp_keys
    folder, why = _source_folder(initial_load_path) if keys else (None, "")
    if folder is None:
        return None, None if why else 0, {}, why
    try:
        n = mtp_count(json.loads((folder / CONFIG).read_text()), keys)
        found = check_hf_weights(folder, args) if n else {}
    except (OSError, ValueError) as e:  # ConfigError included
        return folder, None, {}, f"{folder} is not the model this one was trained from ({str(e)[:300]})"
    mtp = {name: f for name, (f, _) in found.items() if args.n_layers <= layer_index(name) < args.n_layers + n}
    # transformers 5 saves num_nextn_predict_layers = 1 without the layer: nothing to carry, and the export says 0
    return folder, n if mtp else 0, mtp, ""


def carry_into_export(out: pathlib.Path, args: ModelArgs, initial_load_path: str, max_file_bytes: int) -> int:
    """Add the tensors an export carries (module docstring) to the HF folder `out` (written, with its index);
    returns how many were added."""
    zero = {name: torch.empty(shape) for name, shape in zero_sized_shapes(args).items()}
    folder, n, mtp, why = _mtp_layers(args, initial_load_path)
    if why:
        key = FAMILIES[args.family].hf.mtp_keys[0]
        what = f"the {n} multi-token-prediction layer(s)" if n else "any multi-token-prediction layers"
        logger.warning(
            f"{shown(out)}: {what} ({key}) of the folder this model was trained from are not in this export, and "
            f"its config.json says {key} = 0: {why}. To carry them (vLLM's and SGLang's speculative decoding "
            f"heads), make that folder available at the same path and export again (docs/hf.md)"
        )
        mtp, n = {}, 0
    groups = _groups(folder, mtp, max_file_bytes)
    if zero:
        groups = groups or [{}]
        groups[-1] = groups[-1] | dict.fromkeys(zero)
    if groups:
        _append_files(out, groups, lambda names: _read(folder, mtp, zero, names))
    if n:
        config = json.loads((out / CONFIG).read_text())
        config[FAMILIES[args.family].hf.mtp_keys[0]] = n
        (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        logger.info(
            f"{shown(out)}: carried the {n} multi-token-prediction layer(s) of {folder} unchanged ({len(mtp):,} "
            f"tensors, model.layers.{args.n_layers}.*): untrained, as titanlite trains the main model only"
        )
    return len(mtp) + len(zero)


def _groups(folder: pathlib.Path | None, mtp: dict[str, str], max_file_bytes: int) -> list[dict[str, None]]:
    """The MTP tensors in output files of at most max_file_bytes (each at least one tensor), in the folder's order."""
    sizes: dict[str, int] = {}
    for file in sorted(set(mtp.values())):
        sizes.update({k: v for k, v in _header(folder / file).items() if k in mtp})
    groups, used = [], 0
    for name in sorted(mtp, key=lambda k: (layer_index(k), k)):
        if not groups or (used and used + sizes[name] > max_file_bytes):
            groups.append({})
            used = 0
        groups[-1][name] = None
        used += sizes[name]
    return groups


def _read(folder, mtp: dict[str, str], zero: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """The tensors of one output file: MTP ones read from their source file as stored, empty ones made."""
    out = {n: zero[n] for n in names if n in zero}
    for file in sorted({mtp[n] for n in names if n in mtp}):
        with safetensors_module().safe_open(str(folder / file), framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in names if mtp.get(n) == file})
    return out


def _append_files(out: pathlib.Path, groups: list[dict], read) -> None:
    """Add one safetensors file per group after the folder's model-0000i-of-0000N files (renamed -of-0000M)."""
    index = json.loads((out / INDEX).read_text())
    weight_map: dict[str, str] = index["weight_map"]
    old = sorted(set(weight_map.values()))
    if not all(SHARD.fullmatch(f) for f in old):
        raise ConfigError(f"{out / INDEX} names files other than model-0000i-of-0000N.safetensors: {old[:3]}")
    total = len(old) + len(groups)
    renamed = {f: f"model-{int(SHARD.fullmatch(f).group(1)):05d}-of-{total:05d}.safetensors" for f in old}
    for before, after in renamed.items():
        (out / before).rename(out / after)
    weight_map = {k: renamed[f] for k, f in weight_map.items()}
    size = index.get("metadata", {}).get("total_size", 0)
    for i, group in enumerate(groups, start=len(old) + 1):
        file = f"model-{i:05d}-of-{total:05d}.safetensors"
        tensors = read(list(group))
        save_safetensors(tensors, out / file)
        weight_map.update(dict.fromkeys(tensors, file))
        size += sum(math.prod(t.shape) * t.element_size() for t in tensors.values())
    index["metadata"] = {**index.get("metadata", {}), "total_size": size}
    index["weight_map"] = weight_map
    (out / INDEX).write_text(json.dumps(index, indent=2))


def carry_backend_tensors(out: pathlib.Path, set_aside: list[str], initial_load_path: str, max_file_bytes: int) -> int:
    """Add to a transformers-backend export `out` the tensors of the folder the run started from that it does not
    train: those whose names match the class's set_aside patterns (re.search), and when that folder is a multimodal
    model's, every tensor outside its text model (its vision tower, projector, MTP head), the export then written in
    that folder's layout (multimodal_layout); returns how many were added."""
    folder, why = _source_folder(initial_load_path)
    if folder is None:
        if why:
            logger.warning(
                f"{shown(out)}: tensors of the starting folder that the model does not train are not in it: {why}"
            )
        return 0
    _ensure_index(out)
    headers = {file.name: _header(file) for file in sorted(folder.glob("*.safetensors"))}  # file -> name -> bytes
    text = multimodal_layout(out, folder, {n for header in headers.values() for n in header})
    have = set(json.loads((out / INDEX).read_text())["weight_map"])
    found: dict[str, str] = {}
    for file, header in headers.items():
        found.update({
            n: file for n in header
            if n not in have and (any(re.search(p, n) for p in set_aside) or (text and not n.startswith(text)))
        })  # fmt: skip
    if not found:
        return 0
    sizes = {n: headers[file][n] for n, file in found.items()}
    groups, used = [], 0
    for name in sorted(found):
        if not groups or (used and used + sizes[name] > max_file_bytes):
            groups.append({})
            used = 0
        groups[-1][name] = None
        used += sizes[name]
    _append_files(out, groups, lambda names: _read(folder, found, {}, names))
    logger.info(
        f"{shown(out)}: carried {len(found):,} tensors of {folder} that the model does not train unchanged (e.g. "
        f"{sorted(found)[0]})"
    )
    return len(found)


# Where a multimodal folder keeps its text model (transformers 5's layout, then Gemma 3's first releases'), and its
# output projection
TEXT_PREFIXES = (("model.language_model.", "lm_head."), ("language_model.model.", "language_model.lm_head."))


def _prefixed(name: str, model: str, head: str) -> str:
    """A text class's tensor name under a multimodal folder's prefixes (others unchanged)."""
    if name.startswith("model."):
        return model + name[len("model.") :]
    return head + name[len("lm_head.") :] if name.startswith("lm_head.") else name


def multimodal_layout(out: pathlib.Path, folder: pathlib.Path, names: set[str]) -> tuple[str, ...]:
    """When `folder` (the one the run started from, holding tensors `names`) is a multimodal model's, rename the
    export `out`'s text-model tensors as that folder names them and give it that folder's config.json (in the
    export's dtype) and processor settings, so that it loads as the multimodal model; the name prefixes of its text
    model ((): not multimodal)."""
    config = json.loads((folder / CONFIG).read_text())
    prefixes = next((p for p in TEXT_PREFIXES if f"{p[0]}embed_tokens.weight" in names), None)
    if "text_config" not in config or prefixes is None:
        return ()
    model, head = prefixes
    index = json.loads((out / INDEX).read_text())
    renamed = {n: _prefixed(n, model, head) for n in index["weight_map"]}
    for file in sorted(set(index["weight_map"].values())):
        with safetensors_module().safe_open(str(out / file), framework="pt") as h:
            tensors = {renamed[n]: h.get_tensor(n) for n in h.keys()}
        save_safetensors(tensors, out / file)
    index["weight_map"] = {renamed[n]: f for n, f in index["weight_map"].items()}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    dtype = json.loads((out / CONFIG).read_text()).get("dtype")
    for part in (config, config["text_config"]):
        part.update({key: dtype for key in ("dtype", "torch_dtype") if key in part or key == "dtype"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    for extra in sorted(folder.glob("*processor*.json")):  # its image (and video) processor's settings
        if not (out / extra.name).exists():
            shutil.copyfile(extra, out / extra.name)
    logger.info(
        f"{shown(out)}: written in the layout of {folder}, a multimodal model's: its text model as {model}*, its "
        "config.json, and its other tensors carried unchanged (it loads as that multimodal model)"
    )
    return model, head


def _ensure_index(out: pathlib.Path) -> None:
    """A folder that save_pretrained wrote as one model.safetensors: as model-00001-of-00001 with an index."""
    single = out / "model.safetensors"
    if (out / INDEX).is_file() or not single.is_file():
        return
    sizes = _header(single)
    single.rename(out / "model-00001-of-00001.safetensors")
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": dict.fromkeys(sizes, "model-00001-of-00001.safetensors"),
    }
    (out / INDEX).write_text(json.dumps(index, indent=2))
