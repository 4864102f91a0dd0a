"""The reference model's log-probabilities of a microbatch's rows: the policy with its adapters switched off (LoRA
and QLoRA: no second copy), a frozen copy of the initial weights sharded as the policy, or every pair's values
computed once before the first step and kept in the run state (so in every checkpoint, whatever the topology)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from titanlite.checkpoint.initial import load_initial_weights
from titanlite.checkpoint.lora_io import load_peft_adapter
from titanlite.loss import IGNORE_INDEX
from titanlite.model_builder import build_model
from titanlite.models.eval_mode import eval_mode
from titanlite.models.lora import adapters_disabled
from titanlite.models.nf4 import materialize_nf4
from titanlite.preference.losses import model_sequence_logps
from titanlite.storage import location

logger = logging.getLogger("titanlite")


def _forward_logps(model: torch.nn.Module, inputs, extra: list, labels) -> torch.Tensor:
    return model_sequence_logps(model, inputs, extra, labels)[0]


class AdaptersOff:
    """reference = 'base': the policy's own forward with every adapter switched off."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.no_grad()
    def logps(self, inputs, extra: list, labels, pairs) -> torch.Tensor:
        """Log-probabilities of the rows (2b,) under the base."""
        with adapters_disabled(self.model), eval_mode(self.model):
            return _forward_logps(self.model, inputs, extra, labels)


class FrozenCopy:
    """reference = 'copy': a second model holding the initial weights, never trained (in eval mode)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        for p in model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def logps(self, inputs, extra: list, labels, pairs) -> torch.Tensor:
        """Log-probabilities of the rows (2b,) under the copy."""
        return _forward_logps(self.model, inputs, extra, labels)


class Precomputed:
    """reference = 'precomputed': a table per pair of every source, held in the run state (`state.reference_logps`,
    NaN where not computed) so that checkpoints keep it: the chosen and rejected log-probabilities, and the labels
    each row counted (a resume checks them against its own cut of the pairs)."""

    def __init__(self, state, name: str, layouts: list):
        self.state, self.name, self.layouts = state, name, layouts
        sizes = [layout.num_pairs for layout in layouts]
        self.offsets = torch.tensor([0, *sizes]).cumsum(0)[:-1]
        state.reference_logps[name] = torch.full((sum(sizes), 4), float("nan"))  # the shape a resume loads into
        self._on_device: tuple | None = None  # (the table it copies, the copy, the offsets) on the compute device

    @property
    def table(self) -> torch.Tensor:
        return self.state.reference_logps[self.name]

    def logps(self, inputs, extra: list, labels, pairs) -> torch.Tensor:
        """The table's values for the microbatch's pairs, as rows (the b chosen, then the b rejected)."""
        table, offsets = self._device_table(labels.device)
        keys = pairs.to(labels.device, non_blocking=True)  # (pinned with the microbatch on GPUs: no sync)
        rows = table[offsets[keys[:, 0]] + keys[:, 1]]
        return torch.cat([rows[:, 0], rows[:, 1]])  # (columns 2 and 3: the labels counted, for changed())

    def _device_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The table and the sources' offsets on the compute device, copied once per table (a load replaces it)."""
        if self._on_device is None or self._on_device[0] is not self.table or self._on_device[1].device != device:
            self._on_device = (self.table, self.table.to(device), self.offsets.to(device))
        return self._on_device[1], self._on_device[2]

    def missing(self) -> bool:
        """Whether some kept pair has no value yet (a fresh start, not a resume)."""
        table = self.table
        return any(bool(table[o + layout.kept].isnan().any()) for o, layout in zip(self.offsets, self.layouts))

    def changed(self) -> bool:
        """Whether a kept pair's rows count other labels than when its values were computed (training.seq_len or
        data.pair_truncation changed since): the values would be of other tokens."""
        for o, layout in zip(self.offsets, self.layouts):
            now = torch.from_numpy(layout.counted_tokens()[layout.kept]).to(self.table.dtype)
            if not torch.equal(self.table[o + layout.kept][:, 2:], now):
                return True
        return False

    @torch.no_grad()
    def compute(self, model: torch.nn.Module, local_batch_size: int, dp_rank: int, dp_degree: int, copies: int,
                device: torch.device, block_causal: bool) -> None:  # fmt: skip
        """Every kept pair's reference values with `model` (the initial weights), each dp rank its share of the pairs
        in microbatches as in training; then every rank holds the whole table (`copies`: ranks that compute the same
        values, the tp ranks of a dp rank)."""
        t0 = time.perf_counter()
        keys = [(s, int(p)) for s, layout in enumerate(self.layouts) for p in layout.kept]
        per_round = local_batch_size * dp_degree
        rounds = -(-len(keys) // per_round)
        table = torch.zeros_like(self.table, device=device)
        with eval_mode(model):
            for r in range(rounds):
                first = r * per_round + dp_rank * local_batch_size
                mine = keys[first : first + local_batch_size]
                real = len(mine)
                mine += [keys[0]] * (local_batch_size - real)  # every rank runs as many forwards (FSDP's collectives)
                windows = [self.layouts[s].read_pair(p) for s, p in mine]
                mb = self.layouts[0].microbatches(windows, [s for s, _ in mine], local_batch_size)[0]
                extra = [mb.positions.to(device)] if block_causal else []
                labels = mb.labels.to(device)
                logps = _forward_logps(model, mb.inputs.to(device), extra, labels)
                counted = (labels != IGNORE_INDEX).sum(dim=1).to(logps.dtype)
                index = (self.offsets[mb.pairs[:real, 0]] + mb.pairs[:real, 1]).to(device)
                table[index] = torch.stack([*logps.chunk(2), *counted.chunk(2)], dim=1)[:real]
        if dist.is_initialized():
            dist.all_reduce(table)
        table /= copies
        filled = torch.zeros(len(table), dtype=torch.bool)
        for o, layout in zip(self.offsets, self.layouts):
            filled[o + layout.kept] = True
        self.state.reference_logps[self.name] = torch.where(filled.unsqueeze(1), table.cpu(), float("nan"))
        logger.info(
            f"Reference log-probabilities of {len(keys):,} {self.name} preference pairs computed in "
            f"{time.perf_counter() - t0:.1f} s (dpo.reference = 'precomputed'); kept in the checkpoints"
        )


def frozen_copy_model(cfg, model_args, meshes, device: torch.device) -> torch.nn.Module:
    """A second model built and sharded as the policy, holding the initial weights (checkpoint.initial_load_path, or
    the seed's; with LoRA, lora.initial_adapter_path's adapters)."""
    # resharded after every forward: no backward ever frees the gathered weights of the units FSDP keeps gathered
    # for backward (the last one; every one with reshard "never")
    cfg = replace(cfg, parallelism=replace(cfg.parallelism, fsdp_reshard_after_forward="always"))
    model = build_model(cfg, model_args, meshes).model
    model.to_empty(device="cpu" if cfg.training.enable_cpu_offload else device)
    materialize_nf4(model)
    model.init_weights(cfg.training.seed)
    if cfg.checkpoint.initial_load_path:
        load_initial_weights(model, location(cfg.checkpoint.initial_load_path))
    if cfg.lora.enable and cfg.lora.initial_adapter_path:
        load_peft_adapter(model, cfg.lora.initial_adapter_path, cfg.lora)
    logger.info("Reference model (dpo.reference = 'copy'): built, sharded and loaded as the model, frozen")
    return model
