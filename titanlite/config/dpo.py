"""The [dpo] section: preference fine-tuning on (prompt, chosen, rejected) pairs (docs/preference.md). No torch
here."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import POSITIVE, fraction, non_negative, one_of, positive, setting

DPO_LOSSES = ("sigmoid", "ipo", "simpo")
REFERENCES = ("base", "copy", "precomputed")


@dataclass
class Dpo:
    enable: bool = setting(
        False,
        "train on preference pairs (data.format = 'preference') with a DPO-family loss instead of the token "
        "cross-entropy; training.local_batch_size and global_batch_size count pairs",
    )
    beta: float = setting(
        0.1,
        "how far the policy may move from the reference (DPO's beta; IPO's tau; SimPO's reward scale)",
        positive,
        POSITIVE,
    )
    loss: str = setting(
        "sigmoid",
        "sigmoid (DPO), ipo (IPO: a squared loss on the per-token log-ratio margin, as TRL's) or simpo (SimPO: "
        "reference-free, on the mean log-probability of each response, with dpo.gamma)",
        one_of(*DPO_LOSSES),
        " or ".join(DPO_LOSSES),
    )
    gamma: float = setting(0.5, "simpo: the target reward margin (TRL's simpo_gamma)", non_negative, "a number >= 0")
    label_smoothing: float = setting(
        0.0,
        "sigmoid and simpo: the assumed share of pairs whose labels are flipped (conservative DPO, cDPO); 0 = none",
        lambda v: fraction(v) and v < 0.5,
        "0 <= p < 0.5",
    )
    reference: str = setting(
        "base",
        "the reference model: base (with LoRA or QLoRA: the same model with its adapters switched off, no second "
        "copy), copy (a frozen copy of the initial weights, sharded as the policy) or precomputed (every pair's "
        "reference log-probabilities computed once before the first step and kept in the checkpoints); simpo "
        "uses none",
        one_of(*REFERENCES),
        " or ".join(REFERENCES),
    )


def dpo_problem(cfg) -> str | None:
    """Why [dpo] cannot train this job as configured, or None."""
    d, fmt = cfg.dpo, cfg.data.format
    if not d.enable:
        if fmt == "preference":
            return (
                "data.format = 'preference' reads (prompt, chosen, rejected) pairs, which only [dpo] trains on; set "
                "dpo.enable = true, or data.format = 'chat' to fine-tune on the chosen replies"
            )
        return None
    if fmt != "preference":
        return (
            f"dpo.enable = true trains on preference pairs, but data.format = {fmt!r}; set data.format = 'preference' "
            "(records with prompt, chosen and rejected fields: data.prompt_field, chosen_field, rejected_field)"
        )
    if d.loss != "simpo" and d.reference == "base" and not cfg.lora.enable:
        return (
            "dpo.reference = 'base' is the model with its LoRA adapters switched off, but lora.enable = false (the "
            "policy is the whole model, so it has no base apart from itself); valid: lora.enable = true, or "
            "dpo.reference = 'copy' (a frozen copy of the initial weights) or 'precomputed'"
        )
    if d.label_smoothing and d.loss == "ipo":
        return (
            f"dpo.label_smoothing = {d.label_smoothing} with dpo.loss = 'ipo': IPO's squared loss has no label "
            "smoothing; valid: dpo.label_smoothing = 0, or dpo.loss = 'sigmoid' (conservative DPO) or 'simpo'"
        )
    p = cfg.parallelism
    for key, value in (
        ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree),
        ("parallelism.context_parallel_degree", p.context_parallel_degree),
    ):
        if value > 1:
            return (
                f"{key} = {value} with dpo.enable = true: a pair's loss needs each whole sequence's log-probability in "
                "one place, which this parallelism splits; valid: 1 (use FSDP, HSDP or tensor parallelism for DPO)"
            )
    if cfg.fault_tolerance.enable:
        return "fault_tolerance.enable = true with dpo.enable = true is not supported yet; set one of them to false"
    return None
