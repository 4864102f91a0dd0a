"""The step log line and TensorBoard scalars."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger("titanlite")


def setup_logging() -> None:
    """One format for every titanlite log line."""
    logging.basicConfig(level=logging.INFO, format="[titanlite] %(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", force=True)


@dataclass
class StepMetrics:
    """What one logged step reports; every value is a plain float, already reduced over ranks."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_sec: float  # per rank


class MetricsLogger:
    """Prints the step line and, when enabled, writes the same values to TensorBoard (rank 0 only)."""

    def __init__(self, metrics_cfg, dump_folder: str, rank: int, run_name: str | None = None):
        self.rank = rank
        self.writer = None
        if metrics_cfg.enable_tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            run = run_name or time.strftime("%Y%m%d-%H%M%S")
            self.tb_dir = os.path.join(dump_folder, metrics_cfg.save_tb_folder, run)
            self.writer = SummaryWriter(self.tb_dir)

    def log(self, m: StepMetrics) -> None:
        logger.info(f"step: {m.step:5d}  loss: {m.loss:8.4f}  grad_norm: {m.grad_norm:8.4f}  "
                    f"lr: {m.lr:.3e}  tps: {m.tokens_per_sec:,.0f}")
        if self.writer is not None:
            for key, value in (("loss", m.loss), ("grad_norm", m.grad_norm), ("lr", m.lr),
                               ("tokens_per_sec", m.tokens_per_sec)):
                self.writer.add_scalar(key, value, m.step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Throughput:
    """Tokens per second per rank between two logged steps."""

    def __init__(self):
        self.last_time = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def rate(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.last_time, 1e-9)
        self.last_time, self.tokens = now, 0
        return rate
