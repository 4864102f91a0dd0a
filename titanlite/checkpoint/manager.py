"""CheckpointManager: sharded saves over torch.distributed.checkpoint (DCP), resume at any topology,
preemption signals, async saves and retention.

`<job.dump_folder>/<checkpoint.folder>/step-N` is one DCP checkpoint with a top-level key per part
(titanlite.checkpoint.parts); a model-only save (`last_save_model_only`) holds just "model". Every rank
writes its own shards and nobody gathers the full model. A save is written to `.tmp-step-N` and renamed
to `step-N` by rank 0 when its DCP save returns: DCP writes `.metadata` only after it has collected
every rank's write results, so a folder named `step-N` is always complete. Rank 0 adds the run's
config (`job_config.toml`) and the model's shape (`model_args.json`), so that a checkpoint can be
exported or inspected without the job's TOML.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titanlite.checkpoint.catalog import (
    STEP_PREFIX,
    TMP_PREFIX,
    CheckpointInfo,
    checkpoint_folder,
    complete_checkpoints,
    newest_usable,
    read_metadata,
    require_step,
    wanted_parts,
)
from titanlite.checkpoint.consolidated import check_model_fits, load_consolidated, model_prefix, saved_shapes
from titanlite.checkpoint.hf_io import load_hf_weights
from titanlite.checkpoint.parts import ModelPart, OptimizerPart, SchedulerPart, TrainStatePart
from titanlite.config import CHECKPOINT_PARTS, JobConfig, to_toml
from titanlite.dtypes import TORCH_DTYPES
from titanlite.errors import ConfigError
from titanlite.models.hf_config import is_hf_folder
from titanlite.models.llama_args import args_to_dict

logger = logging.getLogger("titanlite")

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class CheckpointManager:
    """Saves and restores the model, optimizer, LR schedule, data position and train state.

    `train_state` is any object with int attributes `step` and `tokens_seen` (the Trainer). When
    checkpointing is enabled, after `load()` SIGTERM and SIGUSR1 request a save-and-stop at the end of
    the step (`maybe_save` returns True); `close()` restores the previous handlers.
    """

    def __init__(
        self, cfg: JobConfig, *, model, optimizer, lr_scheduler, dataloader, train_state, device: torch.device
    ):
        self.cfg = cfg.checkpoint
        self.job_config_text = to_toml(cfg)
        self.enabled = cfg.checkpoint.enable
        self.folder = checkpoint_folder(cfg)
        self.wanted = wanted_parts(cfg)
        self.model = model
        self.parts = {
            "model": ModelPart(model),
            "optimizer": OptimizerPart(model, optimizer),
            "lr_scheduler": SchedulerPart(lr_scheduler, optimizer),
            "dataloader": dataloader,
            "train_state": TrainStatePart(train_state, device),
        }
        assert tuple(self.parts) == CHECKPOINT_PARTS
        self.rank = dist.get_rank()
        self.preempted = False
        self._stop_requested = False
        self._pending: tuple[int, object, float] | None = None  # (step, future, start time) of an async save
        # The async writer runs collectives from a background thread: give it its own (gloo, CPU) group so
        # they never interleave with the training collectives on the default group.
        self._async_pg = dist.new_group(backend="gloo") if self.enabled and self.cfg.async_mode == "async" else None
        self._old_handlers = {}

    def _install_signal_handlers(self) -> None:
        if self.enabled and not self._old_handlers and threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if not self._stop_requested:
            logger.warning(f"Received {signal.Signals(signum).name}: saving at the end of this step, then exiting")
        self._stop_requested = True

    # ------------------------------------------------------------------ loading

    def load(self) -> bool:
        """Resume from checkpoint.load_step or the newest usable checkpoint; else start from
        checkpoint.initial_load_path if set. True when a checkpoint was resumed."""
        box: list = [None, None]  # rank 0 decides for everyone: (CheckpointInfo | None, error message)
        if self.rank == 0 and self.enabled:
            try:
                self._remove_temporaries()
                if self.cfg.load_step >= 0:
                    box[0] = require_step(self.folder, self.cfg.load_step, self.wanted)
                else:
                    box[0] = newest_usable(self.folder, self.wanted)
            except ConfigError as e:
                box[1] = str(e)
        dist.broadcast_object_list(box, src=0)
        info, error = box
        if error:
            raise ConfigError(error)
        if info is not None:
            self._restore(info)
        elif self.cfg.initial_load_path:
            self._load_initial(Path(self.cfg.initial_load_path))
        # From here on a preemption signal is honoured at the end of a step (before: default action).
        self._install_signal_handlers()
        return info is not None

    def _restore(self, info: CheckpointInfo) -> None:
        t0 = time.perf_counter()
        if "model" in self.wanted:
            check_model_fits(
                get_model_state_dict(self.model), saved_shapes(read_metadata(info.path), "model."), str(info.path)
            )
        # DCP calls each part's state_dict() for the destination and load_state_dict() afterwards.
        dcp.load({name: part for name, part in self.parts.items() if name in self.wanted}, checkpoint_id=info.path)
        skipped = sorted(set(CHECKPOINT_PARTS) - self.wanted)
        note = f", not {skipped} (checkpoint.exclude_from_loading)" if skipped else ""
        logger.info(
            f"Resuming from {info.path} (step {info.step}): restored {sorted(self.wanted)}{note} "
            f"in {time.perf_counter() - t0:.2f} s"
        )

    def _load_initial(self, path: Path) -> None:
        """Model weights only, from a HF folder, a DCP folder (step-N or plain model keys) or a consolidated file."""
        if is_hf_folder(path):
            t0 = time.perf_counter()
            load_hf_weights(self.model, path)
            logger.info(
                f"Loaded initial model weights from the HuggingFace folder {path} in "
                f"{time.perf_counter() - t0:.1f} s (checkpoint.initial_load_path)"
            )
            return
        model_sd = get_model_state_dict(self.model)
        if path.is_dir():
            try:
                metadata = read_metadata(path)
            except ValueError as e:
                raise ConfigError(
                    f"checkpoint.initial_load_path = {str(path)!r} is not a readable DCP checkpoint: {e}"
                ) from None
            prefix = model_prefix(metadata)
            check_model_fits(model_sd, saved_shapes(metadata, prefix), str(path))
            dcp.load({"model": model_sd} if prefix else model_sd, checkpoint_id=path)
            set_model_state_dict(self.model, model_sd)
        else:
            full = load_consolidated(path)
            check_model_fits(model_sd, {k: tuple(v.shape) for k, v in full.items()}, str(path))
            # Every rank maps the file and keeps its own shard of each tensor.
            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
        logger.info(f"Loaded initial model weights from {path} (checkpoint.initial_load_path)")

    # ------------------------------------------------------------------ saving

    def maybe_save(self, step: int, last: bool, before_save=None) -> bool:
        """Call at the end of every optimizer step: saves when due (interval, last step, preemption).

        `before_save` runs first when a save is due (the Trainer's non-finite check: never save NaNs).
        True means a preemption signal reached some rank: every rank saved this step and should stop.
        """
        if not self.enabled:
            return False
        self._commit_if_done()
        stop = self._agree_on_stop()
        if stop or last or step % self.cfg.interval == 0:
            if before_save is not None:
                before_save()
            self.save(step, model_only=last and self.cfg.last_save_model_only and not stop)
        if stop:
            self.preempted = True
            logger.warning(
                f"Preempted: checkpoint of step {step} saved; exiting with status 0 so the job can "
                "be requeued (the next launch resumes from it)"
            )
        return stop

    def save(self, step: int, model_only: bool = False) -> None:
        """Write step-N (model-only in checkpoint.export_dtype if asked); async mode returns after staging."""
        self._wait_pending()  # one save at a time: the previous one is committed first
        if model_only:
            state = {"model": ModelPart(self.model, TORCH_DTYPES[self.cfg.export_dtype]).state_dict()}
        else:
            state = {name: part.state_dict() for name, part in self.parts.items()}
        writer = FileSystemWriter(self.folder / f"{TMP_PREFIX}{step}")
        t0 = time.perf_counter()
        if self._async_pg is None:
            dcp.save(state, storage_writer=writer)
            self._commit(step, t0)
        else:
            # FileSystemWriter stages synchronously (a CPU copy of every tensor) before async_save
            # returns, so the optimizer may change the live state at once; the write goes on in a thread.
            future = dcp.async_save(state, storage_writer=writer, process_group=self._async_pg)
            self._pending = (step, future, t0)
            logger.info(
                f"Checkpoint of step {step}: staged in {time.perf_counter() - t0:.2f} s, writing in the background"
            )

    def close(self) -> None:
        """Finish a pending async save and restore the signal handlers."""
        self._wait_pending()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        if self._async_pg is not None:
            dist.destroy_process_group(self._async_pg)
            self._async_pg = None

    def _agree_on_stop(self) -> bool:
        # A CPU tensor: on GPU jobs it goes over the gloo half of "cpu:gloo,cuda:nccl", no device sync.
        flag = torch.tensor([int(self._stop_requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _commit_if_done(self) -> None:
        if self._pending is not None and self._pending[1].done():
            self._wait_pending()

    def _wait_pending(self) -> None:
        if self._pending is not None:
            step, future, t0 = self._pending
            self._pending = None
            future.result()  # re-raises a failed write
            self._commit(step, t0)

    def _commit(self, step: int, t0: float) -> None:
        """Rank 0 renames .tmp-step-N to step-N (every rank has finished: DCP wrote the metadata)."""
        if self.rank != 0:
            return
        tmp, final = self.folder / f"{TMP_PREFIX}{step}", self.folder / f"{STEP_PREFIX}{step}"
        (tmp / "job_config.toml").write_text(self.job_config_text)
        if hasattr(self.model, "args"):
            (tmp / "model_args.json").write_text(json.dumps(args_to_dict(self.model.args), indent=2) + "\n")
        if final.exists():  # an earlier save of the same step (a rerun from an older checkpoint)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        logger.info(f"Saved checkpoint {final} ({time.perf_counter() - t0:.2f} s after the save began)")
        self._purge()

    def _purge(self) -> None:
        """Keep the newest keep_latest_k complete checkpoints, and always the newest full one."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        complete = complete_checkpoints(self.folder)  # unreadable or partial folders are never counted or removed
        if len(complete) <= k:
            return
        keep = {i.step for i in complete[-k:]}
        full = [i.step for i in complete if set(CHECKPOINT_PARTS) <= i.parts]
        if full:  # the newest checkpoint a resume can use survives model-only saves
            keep.add(full[-1])
        for info in complete:
            if info.step not in keep:
                shutil.rmtree(info.path, ignore_errors=True)
                logger.info(f"Removed old checkpoint {info.path} (checkpoint.keep_latest_k = {k})")

    def _remove_temporaries(self) -> None:
        """Delete saves that never completed (a crash or kill during a save); rank 0, before any save."""
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if p.name.startswith(TMP_PREFIX):
                logger.warning(f"Removing incomplete checkpoint {p} (a save that did not finish)")
                shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
