"""The config.json keys of DeepSeek-V3-style routing and block layout (DeepSeek-V3, Kimi K2, Moonlight, GLM-4.5) <->
ModelArgs (no torch): shared experts, group-limited sigmoid routing with its scaling factor, dense first blocks;
and multi-token-prediction layers, which titanlite does not train (their weights are not loaded; an HF export carries
them over unchanged: checkpoint/hf_carried.py)."""

from __future__ import annotations

import json
import logging

from titanlite.errors import ConfigError
from titanlite.models.args import ModelArgs
from titanlite.models.config_fields import POSITIVE_INT, POSITIVE_NUMBER, field, is_int, is_positive_number
from titanlite.models.family import HFExperts

logger = logging.getLogger("titanlite")

# DeepSeek-V3's and GLM-4.5's names and keys for the routed experts (one HF tensor per expert) and the correction bias
SIGMOID_ROUTED_EXPERTS = HFExperts(
    count_keys=("n_routed_experts", "num_local_experts"),
    hidden_key="moe_intermediate_size",
    norm_topk_key="norm_topk_prob",
    norm_topk_default=True,
    router="mlp.gate.weight",
    weights={
        "w1": "mlp.experts.{e}.gate_proj.weight",
        "w3": "mlp.experts.{e}.up_proj.weight",
        "w2": "mlp.experts.{e}.down_proj.weight",
    },
    routing_bias="mlp.gate.e_score_correction_bias",
)


def _count(config: dict, key: str, file: str, default: int, low: int = 0) -> int:
    return field(config, key, file, default, lambda v: is_int(v) and v >= low, f"an integer >= {low}")


def routing_args(config: dict, file: str, defaults: dict) -> dict:
    """The routing and block-layout fields of a config.json (defaults: the HF class's for absent keys:
    n_shared_experts, n_group, topk_group, routed_scaling_factor, first_k_dense_replace); ConfigError naming the
    key, its value and what is valid."""
    experts = config.get("n_routed_experts", config.get("num_local_experts"))
    layers, top_k = config.get("num_hidden_layers"), config.get("num_experts_per_tok")
    n_group = _count(config, "n_group", file, defaults["n_group"], 1)
    topk_group = _count(config, "topk_group", file, defaults["topk_group"], 1)
    if is_int(experts) and experts % n_group:
        raise ConfigError(
            f"{file}: n_group = {n_group} is not valid; expected a divisor of the {experts} experts "
            f"(n_routed_experts), so that every group holds as many"
        )
    if topk_group > n_group:
        raise ConfigError(f"{file}: topk_group = {topk_group} is not valid; expected at most n_group = {n_group}")
    if is_int(experts) and is_int(top_k) and top_k > topk_group * (experts // n_group):
        raise ConfigError(
            f"{file}: num_experts_per_tok = {top_k} is more than the {topk_group * (experts // n_group)} experts of "
            f"the topk_group = {topk_group} groups it may choose from; expected at most that many"
        )
    first_dense = _count(config, "first_k_dense_replace", file, defaults["first_k_dense_replace"])
    if is_int(layers) and first_dense > layers:
        raise ConfigError(
            f"{file}: first_k_dense_replace = {first_dense} is not valid; expected at most num_hidden_layers = {layers}"
        )
    freq = config.get("moe_layer_freq", 1)
    if freq != 1:
        raise ConfigError(
            f"{file}: moe_layer_freq = {json.dumps(freq)[:40]}; titanlite puts experts in every block after the "
            f"first_k_dense_replace dense ones: expected 1"
        )
    scaling = field(
        config, "routed_scaling_factor", file, defaults["routed_scaling_factor"], is_positive_number, POSITIVE_NUMBER
    )
    return dict(
        score_func="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(scaling),
        n_shared_experts=_count(config, "n_shared_experts", file, defaults["n_shared_experts"]),
        dense_layers=tuple(range(first_dense)),
    )


def routing_keys(args: ModelArgs) -> dict:
    """config.json's keys for these arguments' routing and block layout (the inverse of routing_args)."""
    first_dense = len(args.dense_layers)
    if args.dense_layers != tuple(range(first_dense)):
        raise ValueError(f"dense_layers {args.dense_layers} are not the first blocks: no first_k_dense_replace says so")
    return {
        "n_routed_experts": args.n_experts,
        "n_shared_experts": args.n_shared_experts,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "routed_scaling_factor": args.routed_scaling_factor,
        "first_k_dense_replace": first_dense,
        "norm_topk_prob": args.norm_topk_prob,
        "num_nextn_predict_layers": 0,
    }


def note_mtp_layers(config: dict, file: str, keys: tuple[str, ...]) -> int:
    """The multi-token-prediction layers a config.json counts (0 when none), said once in the log: titanlite trains
    the main model, as transformers' class does, and does not load their weights (an HF export carries them)."""
    n = next((config[k] for k in keys if config.get(k) is not None), 0)
    if not (is_int(n) and n >= 0):
        raise ConfigError(f"{file}: {keys[0]} = {json.dumps(n)[:40]} is not valid; expected {POSITIVE_INT} or 0")
    if n and file not in _NOTED:
        _NOTED.add(file)
        logger.info(
            f"{file}: {keys[0]} = {n}: the multi-token-prediction layer's weights are not trained (titanlite trains "
            f"the main model, as transformers' class does); an HF export carries them over unchanged"
        )
    return n


_NOTED: set[str] = set()
