"""What each decoder layer of a transformers backend model keeps for backward, measured: the model's own forward runs
on fake tensors (torch's FakeTensorMode: shapes and dtypes, no memory, no compute) at the run's sequence length, and
the tensors autograd saves are counted per layer, once each (a mask several layers save counts in the first), the
weights left out (FSDP's buffers count them). For selective 'op' checkpointing, the outputs its policy keeps
(parallel/ac.py) and the layer's input are counted instead; full checkpointing keeps the layer's input.

The layer kinds no formula of titanlite knows (Gated DeltaNet, Mamba, MLA with an indexer, a fused MoE) are counted as
transformers runs them on this machine: where a kernel package is not installed (flash-linear-attention,
causal_conv1d), that is transformers' PyTorch fallback, which keeps more than the fused kernels do.
"""

from __future__ import annotations

import contextlib
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.compat import one_sequence_per_row
from titanlite.dtypes import dtype_bytes
from titanlite.models.family import BACKEND
from titanlite.parallel.ac import AC_MATMULS, AC_SAVE_OPS

MODES = ("none", "full", "op", "op_every_second")
_cache: dict[tuple, list[dict[str, int]]] = {}


def layer_bytes_for(cfg, plan) -> list[dict[str, int]] | None:
    """A transformers backend model's per-layer activation bytes per token for this job (layer_activation_bytes),
    or None: a native family's, or under tensor parallelism (each rank's share: the native formula)."""
    if plan.model_args.family != BACKEND or plan.dims.tp > 1:
        return None
    t = cfg.training
    lora = cfg.lora if cfg.lora.enable else None
    return layer_activation_bytes(plan.model_args, t.seq_len, dtype_bytes(t.mixed_precision_param), lora)


def layer_activation_bytes(args, seq_len: int, act_bytes: int, lora_cfg=None) -> list[dict[str, int]]:
    """Per decoder layer, the bytes per token it keeps for backward in each AC mode (MODES), for sequences of seq_len
    tokens computed in a dtype of act_bytes bytes; lora_cfg: the [lora] section when adapters train on a frozen base.
    Measured once per process for each of these."""
    shape = json.dumps(args.hf_config, sort_keys=True, default=str), args.vocab_size, args.attention
    key = (shape, seq_len, act_bytes, None if lora_cfg is None else repr(lora_cfg))
    if key not in _cache:
        _cache[key] = _measure(args, seq_len, act_bytes, lora_cfg)
    return _cache[key]


def _measure(args, seq_len: int, act_bytes: int, lora_cfg) -> list[dict[str, int]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from titanlite.models.lora import apply_lora
    from titanlite.models.transformers_backend.model import BackendModel

    n = args.n_layers
    saved: list[dict] = [{} for _ in range(n)]  # per layer: storage -> bytes (autograd's saved tensors)
    kept = {"op": [0] * n, "op_every_second": [0] * n}  # per layer: bytes of the outputs selective AC keeps
    inputs = [0] * n
    held: list[torch.Tensor] = []  # what autograd saved, held here (not in its graph) until the count is done
    with torch.device("meta"):
        model = BackendModel(args).to(torch.float32 if act_bytes == 4 and not args.hf_experts else torch.bfloat16)
        if lora_cfg is not None:
            apply_lora(model, lora_cfg)
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        model.to_empty(device="cpu")
        layer = _LayerOf(model.layers)

        def size(t: torch.Tensor, whole: bool = False) -> int:
            """Bytes of t (whole: of all its storage, which a saved view keeps alive) in the run's dtype."""
            nbytes = t.untyped_storage().nbytes() if whole else t.numel() * t.element_size()
            return nbytes * act_bytes // 2 if t.element_size() == 2 else nbytes

        counted = {_storage(p) for p in model.parameters()}  # storages counted in a layer, and weights (never)

        def pack(t: torch.Tensor) -> int:
            if layer.now is not None and (key := _storage(t)) not in counted:
                counted.add(key)
                saved[layer.now][key] = size(t, whole=True)
            held.append(t)
            return len(held) - 1

        def record_input(i: int, a, kw) -> None:
            inputs[i] = size(a[0] if a else kw["hidden_states"])

        for i, block in enumerate(model.layers):
            block.register_forward_pre_hook(lambda m, a, kw, i=i: record_input(i, a, kw), with_kwargs=True)
        tokens = torch.zeros(1, seq_len, dtype=torch.long)
        # a causal run's rows are one sequence each: no mask (sdpa's is_causal), as transformers finds outside fake
        # tensors; block_causal's packed rows are masked, as here
        single = one_sequence_per_row() if args.attention == "causal" else contextlib.nullcontext()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, held.__getitem__)
        with layer, single, _SelectiveKept(layer, kept, size), hooks:
            model.model(input_ids=tokens, use_cache=False)
    held.clear()
    out = []
    for i in range(n):
        bytes_ = {
            "none": sum(saved[i].values()),
            "full": inputs[i],
            **{mode: inputs[i] + kept[mode][i] for mode in kept},
        }
        out.append({mode: -(-b // seq_len) for mode, b in bytes_.items()})
    return out


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: counted by identity)
        return ("tensor", id(t))


class _LayerOf(contextlib.AbstractContextManager):
    """Which decoder layer's forward is running (`now`; None outside them), by hooks on each."""

    def __init__(self, layers):
        self.now, self.handles = None, []
        for i, block in enumerate(layers):
            self.handles.append(block.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "now", i)))
            self.handles.append(block.register_forward_hook(lambda m, a, o: setattr(self, "now", None)))

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class _SelectiveKept(TorchDispatchMode):
    """The outputs selective 'op' checkpointing keeps, per layer: every op of AC_SAVE_OPS ('op'), or attention and the
    1st, 3rd, ... matmul of the layer ('op_every_second')."""

    def __init__(self, layer: _LayerOf, kept: dict, size):
        super().__init__()
        self.layer, self.kept, self.size, self.matmuls = layer, kept, size, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        i = self.layer.now
        if i is not None and func in AC_SAVE_OPS:
            tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
            count = sum(self.size(t) for t in tensors)
            self.kept["op"][i] += count
            if func in AC_MATMULS:
                self.matmuls[i] = self.matmuls.get(i, 0) + 1
            if func not in AC_MATMULS or self.matmuls[i] % 2 == 1:
                self.kept["op_every_second"][i] += count
        return out
