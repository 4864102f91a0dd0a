"""The [optimizer] section: AdamW or Adam, or Muon for the blocks' matrices with AdamW for the rest
(docs/optimizers.md). No torch here."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import POSITIVE, fraction, non_negative, one_of, positive, setting

OPTIMIZER_NAMES = ("adamw", "adam", "muon")


@dataclass
class Optimizer:
    name: str = setting(
        "AdamW",
        "optimizer: AdamW, Adam, or Muon (the blocks' weight matrices, AdamW for the rest; docs/optimizers.md)",
        lambda v: v.lower() in OPTIMIZER_NAMES,
        "AdamW, Adam or Muon (any case)",
    )
    lr: float = setting(8e-4, "peak learning rate (Muon: of the AdamW part, and of Muon's unless muon_lr is set)",
                        positive, POSITIVE)  # fmt: skip
    beta1: float = setting(0.9, "Adam beta1", fraction, "a number in [0, 1)")
    beta2: float = setting(0.95, "Adam beta2", fraction, "a number in [0, 1)")
    eps: float = setting(1e-8, "Adam epsilon", positive, POSITIVE)
    weight_decay: float = setting(0.1, "decoupled weight decay", non_negative, "a number >= 0")
    muon_lr: float = setting(0.0, "Muon: the peak lr of the Muon matrices; 0 = optimizer.lr", non_negative,
                             "a number >= 0")  # fmt: skip
    muon_weight_decay: float = setting(
        -1.0, "Muon: the decoupled weight decay of the Muon matrices; -1 = optimizer.weight_decay",
        lambda v: v >= 0 or v == -1, "a number >= 0, or -1",
    )  # fmt: skip
    muon_momentum: float = setting(0.95, "Muon: momentum", fraction, "a number in [0, 1)")
    muon_nesterov: bool = setting(True, "Muon: Nesterov momentum")
    muon_ns_steps: int = setting(5, "Muon: Newton-Schulz iterations (coefficients 3.4445, -4.7750, 2.0315)",
                                 lambda v: 1 <= v < 100, "an integer from 1 to 99")  # fmt: skip
    muon_newton_schulz: str = setting(
        "every_rank",
        "Muon: where each matrix is orthogonalised: every_rank (each rank that holds a shard of it) or one_rank (one "
        "rank of its mesh, round-robin, the result broadcast before the next matrix)",
        one_of("one_rank", "every_rank"),
        "one_rank or every_rank",
    )
    muon_ns_dtype: str = setting(
        "bfloat16",
        "Muon: the Newton-Schulz iteration's dtype: bfloat16 (torch.optim.Muon's; another topology's losses drift by "
        "~1e-3 over 20 steps) or float32 (topology-invariant like AdamW; slower where bf16 matmuls are faster)",
        one_of("bfloat16", "float32"),
        "bfloat16 or float32",
    )
    muon_adjust_lr: str = setting(
        "match_rms_adamw",
        "Muon: the lr scale per matrix: match_rms_adamw (0.2 x sqrt(max(rows, cols)): reuses AdamW's lr and weight "
        "decay) or original (sqrt(max(1, rows / cols)))",
        one_of("match_rms_adamw", "original"),
        "match_rms_adamw or original",
    )
