"""A HuggingFace safetensors model folder as titanlite reads it: its index, every tensor's file and shape (from the
headers), and the check that they are the tensors a model shape needs (no torch tensors are read)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.hf_names import OUTPUT, hf_shapes, quantized_variants
from titanlite.models.registry import FAMILIES

INDEX = "model.safetensors.index.json"
IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)  # buffers some old exports store


def safetensors_module():
    try:
        import safetensors.torch  # lazy: an optional package (pip install safetensors), HF folders only

        return safetensors
    except ImportError as e:
        raise ConfigError(
            "reading or writing HuggingFace weights needs the safetensors package: pip install safetensors"
        ) from e


def save_safetensors(tensors: dict, path: pathlib.Path) -> None:
    """Write a safetensors file with the permissions the umask gives a new file, as config.json gets (safetensors
    writes through a private temporary file: 0600)."""
    safetensors_module().torch.save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def read_index(folder: pathlib.Path) -> dict[str, str] | None:
    """The weight_map (tensor name -> file name) of a folder's model.safetensors.index.json, None without one;
    ConfigError naming the index when it is not JSON, has no weight_map, or names a file that is not there."""
    path = folder / INDEX
    if not path.is_file():
        return None
    expected = 'a JSON object {"weight_map": {tensor name: file name}} as save_pretrained writes'
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e}); expected {expected}") from None
    weights = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weights, dict) or not all(
        isinstance(v, str) and pathlib.PurePath(v).name == v for v in weights.values()
    ):
        raise ConfigError(f"{path} has no valid weight_map; expected {expected}, file names without folders")
    absent = sorted({f for f in weights.values() if not (folder / f).is_file()})
    if absent:
        first = next(n for n, f in weights.items() if f == absent[0])
        raise ConfigError(
            f"{path} names {len(absent)} file(s) that are not in {folder}: {', '.join(absent[:3])} (with {first}, "
            "...); download or copy the missing files"
        )
    return weights


def read_hf_tensors(folder: pathlib.Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor in a folder's *.safetensors files: name -> (file name, shape); ConfigError for a bad file,
    a tensor in two files, or an index that does not say where the tensors are."""
    st = safetensors_module()
    weights = read_index(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{folder} has no *.safetensors file (HF weights are model.safetensors, or "
            f"model-0000N-of-0000M.safetensors with {INDEX})"
        )
    out = {}
    for f in files:
        try:
            with st.safe_open(str(f), framework="pt") as h:
                found = {key: tuple(h.get_slice(key).get_shape()) for key in h.keys()}
        except Exception as e:  # safetensors raises its own SafetensorError for truncated or foreign files
            raise ConfigError(
                f"{f} is not a readable safetensors file ({type(e).__name__}: {e}); it may be "
                f"truncated: download or export it again"
            ) from None
        for key, shape in found.items():
            if key in out:  # every file is read: which copy would load is a matter of chance
                raise ConfigError(
                    f"{folder}: tensor {key} is in both {out[key][0]} and {f.name}; remove the stale file"
                    + (f" ({INDEX} names {weights[key]})" if weights and key in weights else "")
                )
            out[key] = (f.name, shape)
    for key, name in (weights or {}).items():
        if key not in out or out[key][0] != name:
            where = f"it is in {out[key][0]}" if key in out else "no file holds it"
            raise ConfigError(f"{folder / INDEX} says {key} is in {name}, but {where}; the folder is inconsistent")
    return out


def check_hf_weights(folder: pathlib.Path, args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ConfigError naming every missing, unexpected or mis-shaped tensor of a folder for this model shape; else the
    folder's tensors (read_hf_tensors')."""
    found = read_hf_tensors(folder)
    expected = quantized_variants(hf_shapes(args), found, args)  # gpt-oss's MXFP4 experts, where the folder has them
    missing = [n for n in expected if n not in found]
    mtp = FAMILIES[args.family].hf.mtp_keys  # multi-token-prediction layers after the model's: skipped
    zero_sized = zero_sized_shapes(args)
    unexpected = [
        n
        for n in found
        if n not in expected
        and not n.endswith(IGNORED_HF_TENSORS)
        and not (n == OUTPUT and args.tie_embeddings)
        and not (mtp and layer_index(n) >= args.n_layers)
        and not (n in zero_sized and math.prod(found[n][1]) == 0)
    ]
    wrong = [
        f"{n} has shape {found[n][1]} in {found[n][0]} but the model needs {expected[n]}"
        for n in expected
        if n in found and found[n][1] != expected[n]
    ]
    problems = []
    for what, items in (("missing tensors", missing), ("unexpected tensors", unexpected), ("wrong shapes", wrong)):
        if items:
            more = f" (and {len(items) - 5} more)" if len(items) > 5 else ""
            problems.append(f"{what}: {'; '.join(items[:5])}{more}")
    if problems:
        raise ConfigError(
            f"{folder} does not fit the model ({FAMILIES[args.family].hf.architecture}: dim {args.dim}, "
            f"{args.n_layers} layers, vocab {args.vocab_size}, tied embeddings {args.tie_embeddings}, qk-norm "
            f"{args.qk_norm}, q/k/v biases {args.qkv_bias}): {' | '.join(problems)}; are these tensors of "
            f"another family than its config.json says?"
        )
    return found


def zero_sized_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The HF tensors of parts config.json sizes to zero, which the model has no tensor for, with their empty shapes:
    transformers builds and saves them (a DeepSeek-V3 with n_shared_experts = 0 holds (0, dim) shared-expert
    weights)."""
    if (
        not args.n_experts
        or args.n_shared_experts
        or "n_shared_experts" not in FAMILIES[args.family].hf.extra_keys(args)
    ):
        return {}
    one, two = (hf_shapes(dataclasses.replace(args, n_shared_experts=n)) for n in (1, 2))
    return {n: tuple(0 if a != b else a for a, b in zip(one[n], two[n])) for n in one.keys() - hf_shapes(args).keys()}


def layer_index(hf_name: str) -> int:
    """The block a HF tensor belongs to (model.layers.<i>.), -1 for the others."""
    parts = hf_name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1
