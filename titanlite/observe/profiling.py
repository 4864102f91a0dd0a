"""`[profiling]`: a torch.profiler trace and, on GPU, a CUDA memory snapshot every `profile_freq` steps.

Traces: <dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json (open in
https://ui.perfetto.dev or chrome://tracing). Snapshots: <dump_folder>/<save_memory_snapshot_folder>/
iteration_<step>/rank<r>_memory_snapshot.pickle (open in https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

logger = logging.getLogger("titanlite")

WARMUP_STEPS = 3  # profiler warm-up before the traced step (fewer when profile_freq is small)
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Writes what `[profiling]` asks for: `start()`, then `step(n)` after each training step n, then `stop()`."""

    def __init__(self, prof_cfg, dump_folder: str, rank: int, device: torch.device, start_step: int = 0):
        self.cfg, self.rank, self.device = prof_cfg, rank, device
        self.trace_dir = os.path.join(dump_folder, prof_cfg.save_traces_folder)
        self.snapshot_dir = os.path.join(dump_folder, prof_cfg.save_memory_snapshot_folder)
        self._step = start_step
        self._prof = None
        self.snapshots = prof_cfg.enable_memory_snapshot and device.type == "cuda"
        if prof_cfg.enable_memory_snapshot and not self.snapshots:
            logger.info(
                f"profiling.enable_memory_snapshot: skipped, CUDA memory snapshots need a GPU "
                f"(running on {device.type})"
            )
        if prof_cfg.enable_profiling:
            freq = prof_cfg.profile_freq
            warmup = min(WARMUP_STEPS, freq - 1)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities,
                # skip_first aligns the cycle with global steps: a resumed run traces steps freq, 2 freq, ...
                schedule=torch.profiler.schedule(
                    wait=freq - 1 - warmup, warmup=warmup, active=1, skip_first=-start_step % freq
                ),
                on_trace_ready=self._save_trace,
            )
            logger.info(f"Profiling every {freq} steps to {self.trace_dir}")
        if self.snapshots:
            logger.info(f"Memory snapshots every {prof_cfg.profile_freq} steps to {self.snapshot_dir}")

    def start(self) -> Profiler:
        """Start recording (when enabled); returns self."""
        if self._prof is not None:
            self._prof.start()
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        return self

    def stop(self) -> None:
        """Stop recording."""
        if self._prof is not None:
            self._prof.stop()
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)

    def step(self, step: int) -> None:
        """Training step `step` finished."""
        self._step = step
        if self._prof is not None:
            with warnings.catch_warnings():  # "clears events at the end of each cycle": what we want
                warnings.filterwarnings("ignore", message=".*Profiler clears events")
                self._prof.step()
        if self.snapshots and step % self.cfg.profile_freq == 0:
            path = self._path(self.snapshot_dir, "memory_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(path)
            logger.info(f"Memory snapshot: {path}")

    def _path(self, root: str, suffix: str) -> str:
        folder = os.path.join(root, f"iteration_{self._step}")
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, f"rank{self.rank}_{suffix}")

    def _save_trace(self, prof) -> None:
        path = self._path(self.trace_dir, "trace.json")
        prof.export_chrome_trace(path)
        logger.info(f"Profiler trace: {path}")
