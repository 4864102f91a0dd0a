"""CheckpointManager: sharded saves over torch.distributed.checkpoint (DCP), resume at any topology,
stop signals, async saves, checksums, failed saves and retention.

`<job.dump_folder>/<checkpoint.folder>/step-N` is one DCP checkpoint with a top-level key per part
(titanlite.checkpoint.parts); a model-only save (`last_save_model_only`) holds just "model". Every rank
writes its own shards and nobody gathers the full model. A save is written to `.tmp-step-N` and renamed
to `step-N` by rank 0 when every rank has finished: DCP writes `.metadata` only after it has collected
every rank's write results, then each rank records its files' checksums and rank 0 adds the run's
config (`job_config.toml`), the model's shape (`model_args.json`) and `manifest.json`. So a folder named
`step-N` is always complete, and a resume can check it and say what changed since.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from titanlite.checkpoint.base_identity import FILE as LORA_BASE
from titanlite.checkpoint.base_identity import fingerprint
from titanlite.checkpoint.base_identity import write as write_lora_base
from titanlite.checkpoint.catalog import (
    STEP_PREFIX,
    TMP_PREFIX,
    CheckpointInfo,
    candidates,
    checkpoint_folder,
    complete_checkpoints,
    describe_steps,
    read_metadata,
    wanted_parts,
)
from titanlite.checkpoint.consolidated import check_model_fits, model_shapes, saved_shapes
from titanlite.checkpoint.data_identity import FILE as DATA_IDENTITY
from titanlite.checkpoint.data_identity import check_unchanged
from titanlite.checkpoint.data_identity import write as write_data_identity
from titanlite.checkpoint.initial import load_initial_weights
from titanlite.checkpoint.integrity import seal, write_rank_manifest
from titanlite.checkpoint.lora_io import check_lora_resume, load_peft_adapter
from titanlite.checkpoint.parts import ModelPart, OptimizerPart, SchedulerPart, TrainStatePart
from titanlite.checkpoint.resume import (
    check_model_matches,
    check_same_optimizer,
    describe_changes,
    problems_everywhere,
    saved_job_config,
)
from titanlite.checkpoint.safe_reading import UnsafeCheckpointError, safe_dcp_load
from titanlite.config import CHECKPOINT_PARTS, JobConfig, to_toml
from titanlite.dtypes import TORCH_DTYPES
from titanlite.errors import CheckpointSaveError, ConfigError
from titanlite.models.args import args_to_dict
from titanlite.optim import optimizer_hyperparameters, peak_lrs
from titanlite.runtime.run_control import StopSignals

logger = logging.getLogger("titanlite")

RUN_FILES = ("job_config.toml", "model_args.json", DATA_IDENTITY)


class CheckpointManager:
    """Saves and restores the model, optimizer, LR schedule, data position and train state.

    `train_state` is any object with int attributes `step` and `tokens_seen` (the Trainer). When
    checkpointing is enabled, after `load()` the stop signals (run_control.StopSignals) request a
    save-and-stop at the end of the step (`maybe_save` returns True); `close()` restores the handlers.
    """

    def __init__(
        self,
        cfg: JobConfig,
        *,
        model,
        optimizer,
        lr_scheduler,
        dataloader,
        train_state,
        device: torch.device,
        data_identity: dict | None = None,
        outer=None,
    ):
        self.job_cfg, self.cfg = cfg, cfg.checkpoint
        self.data_identity = data_identity  # what the data position counts in (data_identity.py)
        self.job_config_text = to_toml(cfg)
        self.enabled = cfg.checkpoint.enable
        self.folder = checkpoint_folder(cfg)
        self.wanted = wanted_parts(cfg)
        self.model, self.dataloader = model, dataloader
        self.saved_steps: set[int] = set()  # steps this run wrote (retention says when it removes older runs')
        # LoRA: checkpoints hold the adapters; the base is checkpoint.initial_load_path's, identified by fingerprint.
        self.lora = cfg.lora.enable
        self.lora_base = fingerprint(cfg.checkpoint.initial_load_path) if self.lora else None
        self.parts = {
            "model": ModelPart(model, trainable_only=self.lora),
            "optimizer": OptimizerPart(model, optimizer, optimizer_hyperparameters(cfg.optimizer), outer),
            "lr_scheduler": SchedulerPart(lr_scheduler, optimizer, peak_lrs(cfg.optimizer)),
            "dataloader": dataloader,
            "train_state": TrainStatePart(train_state, device),
        }
        assert tuple(self.parts) == CHECKPOINT_PARTS
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.preempted = False
        self.signals = StopSignals()
        self._pending: tuple[int, object, float] | None = None  # (step, future, start time) of an async save
        # The async writer runs collectives from a background thread: give it its own (gloo, CPU) group so
        # they never interleave with the training collectives on the default group.
        self._async_pg = dist.new_group(backend="gloo") if self.enabled and self.cfg.async_mode == "async" else None

    # ------------------------------------------------------------------ loading

    def load(self) -> bool:
        """Resume from checkpoint.load_step or the newest complete, intact checkpoint; else start from
        checkpoint.initial_load_path if set (with LoRA: the base always, then the adapters of the checkpoint or of
        lora.initial_adapter_path). True when a checkpoint was resumed."""
        info = self._choose() if self.enabled else None
        if self.cfg.initial_load_path and (info is None or self.lora):
            load_initial_weights(self.model, Path(self.cfg.initial_load_path))
        if info is not None:
            self._restore(info)
        elif self.lora and self.job_cfg.lora.initial_adapter_path:
            load_peft_adapter(self.model, self.job_cfg.lora.initial_adapter_path, self.job_cfg.lora)
        if self.enabled:  # from here on a stop signal is honoured at the end of a step (with a save)
            self.signals.install()
        return info is not None

    def _choose(self) -> CheckpointInfo | None:
        box: list = [[], None]  # rank 0 lists the candidates for everyone: (infos, error message)
        if self.rank == 0:
            try:
                self._remove_temporaries()
                box[0] = candidates(self.folder, self.cfg.load_step, self.wanted)
            except ConfigError as e:
                box[1] = str(e)
        dist.broadcast_object_list(box, src=0)
        if box[1]:
            raise ConfigError(box[1])
        for info in box[0]:
            problems = problems_everywhere(info.path)
            if not problems:
                return info
            what = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            if self.cfg.load_step >= 0:
                raise ConfigError(
                    f"checkpoint.load_step = {self.cfg.load_step}: {info.path} is corrupt: {what}; "
                    f"complete checkpoints there: {describe_steps(self.folder)}"
                )
            if self.rank == 0:
                logger.warning(
                    f"Skipping corrupt checkpoint {info.path}: {what}; trying the one before (nothing is deleted)"
                )
        return None

    def _restore(self, info: CheckpointInfo) -> None:
        t0 = time.perf_counter()
        check_lora_resume(info.path, self.job_cfg.lora, self.lora_base, self.model.args)
        if self.data_identity is not None:
            now = self.data_identity if "dataloader" in self.wanted else {**self.data_identity, "sources": []}
            check_unchanged(info.path, now, self.cfg.allow_data_change)
        if "model" in self.wanted:
            check_model_matches(info.path, self.model.args)
            check_model_fits(
                model_shapes(self.parts["model"].state_dict(), getattr(self.model, "pipeline_part", False)),
                saved_shapes(read_metadata(info.path), "model."),
                str(info.path),
                "; was it saved with another lora.rank or lora.targets?" if self.lora else None,
            )
        if "optimizer" in self.wanted:
            check_same_optimizer(info.path, self.job_cfg.optimizer.name)
        outer = self.parts["optimizer"].outer  # DiLoCo: loaded when the checkpoint holds it, else started afresh
        if outer is not None:
            outer.in_checkpoint = {k.split(".")[0] for k in saved_shapes(read_metadata(info.path), "optimizer.diloco.")}
        # DCP calls each part's state_dict() for the destination and load_state_dict() afterwards.
        try:
            safe_dcp_load({n: part for n, part in self.parts.items() if n in self.wanted}, info.path)
        except UnsafeCheckpointError:
            raise
        except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
            raise ConfigError(
                f"{info.path} could not be loaded into this run ({type(e).__name__}: "
                f"{str(e).strip()[:400]}); is it from another model or run?"
            ) from e
        finally:
            if outer is not None:
                outer.in_checkpoint = outer.PARTS  # every save holds it all
        skipped = sorted(set(CHECKPOINT_PARTS) - self.wanted)
        note = f", not {skipped} (checkpoint.exclude_from_loading)" if skipped else ""
        logger.info(
            f"Resuming from {info.path} (step {info.step}): restored {sorted(self.wanted)}{note} "
            f"in {time.perf_counter() - t0:.2f} s"
        )
        self._report_changes(info)

    def _report_changes(self, info: CheckpointInfo) -> None:
        saved = saved_job_config(info.path)
        if saved is None:
            return
        position = self.dataloader.state_dict().get("sequence_index", 0)
        old_len, new_len = saved.training.seq_len, self.job_cfg.training.seq_len
        if "dataloader" in self.wanted and old_len != new_len:  # keep the position in tokens, not sequences
            self.dataloader.load_state_dict({"sequence_index": math.ceil(position * (old_len + 1) / (new_len + 1))})
        scheduler = self.parts["lr_scheduler"]
        lr = scheduler.lr_scheduler.get_last_lr()[-1]  # optimizer.lr's group
        lines = describe_changes(saved, self.job_cfg, info.step, position, scheduler.replanned, lr)
        if lines and self.rank == 0:
            logger.warning(
                f"This run's config differs from that of {info.path}; the config wins:\n  " + "\n  ".join(lines)
            )

    # ------------------------------------------------------------------ saving

    def maybe_save(self, step: int, last: bool, before_save=None) -> bool:
        """Call at the end of every optimizer step: saves when due (interval, last step, stop signal).

        `before_save` runs first when a save is due (the Trainer's non-finite check: never save NaNs).
        True means a stop signal reached some rank: every rank saved this step and should stop.
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
                f"Stopped: checkpoint of step {step} saved; exiting with status 0 so the job can be "
                "requeued (the next launch resumes from it)"
            )
        return stop

    def save(self, step: int, model_only: bool = False) -> None:
        """Write step-N (model-only in checkpoint.export_dtype if asked); async mode returns after staging.

        A failed save (disk full, I/O error) removes its partial folder and then, by checkpoint.on_save_error,
        raises CheckpointSaveError on every rank or is logged and skipped.
        """
        self._wait_pending()  # one save at a time: the previous one is committed first
        if model_only:
            model = ModelPart(self.model, TORCH_DTYPES[self.cfg.export_dtype], trainable_only=self.lora)
            state = {"model": model.state_dict()}
        else:
            state = {name: part.state_dict() for name, part in self.parts.items()}
        tmp = self.folder / f"{TMP_PREFIX}{step}"
        writer = FileSystemWriter(tmp)
        t0 = time.perf_counter()
        if self._async_pg is None:
            error = None
            try:
                dcp.save(state, storage_writer=writer)
                write_rank_manifest(tmp, self.rank)
            except (Exception, dcp.api.CheckpointException) as e:
                error = e
            if not self._all_ok(error is None):  # also waits for every rank's manifest
                return self._failed(step, error)
            self._commit(step, t0)
        else:
            # FileSystemWriter stages synchronously (a CPU copy of every tensor) before async_save returns, so the
            # optimizer may change the live state at once; the write (and this rank's checksums) go on in a thread.
            future = dcp.async_save(state, storage_writer=writer, process_group=self._async_pg)
            future.add_done_callback(lambda f: f.exception() is None and write_rank_manifest(tmp, self.rank))
            self._pending = (step, future, t0)
            logger.info(
                f"Checkpoint of step {step}: staged in {time.perf_counter() - t0:.2f} s, writing in the background"
            )

    def close(self) -> None:
        """Finish a pending async save and restore the signal handlers."""
        self._wait_pending()
        self.signals.restore()
        if self._async_pg is not None:
            dist.destroy_process_group(self._async_pg)
            self._async_pg = None

    def _agree_on_stop(self) -> bool:
        return not self._all_ok(not self.signals.requested)

    @staticmethod
    def _all_ok(ok: bool) -> bool:
        """Whether `ok` holds on every rank (a collective)."""
        # A CPU tensor: on GPU jobs it goes over the gloo half of "cpu:gloo,cuda:nccl", no device sync.
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _commit_if_done(self) -> None:
        # Collective, so that every rank commits (or handles a failure) at the same step.
        if self._pending is not None and self._all_ok(self._pending[1].done()):
            self._wait_pending()

    def _wait_pending(self) -> None:
        if self._pending is not None:
            step, future, t0 = self._pending
            self._pending = None
            error = None
            try:
                future.result()
            except (Exception, dcp.api.CheckpointException) as e:
                error = e
            if not self._all_ok(error is None):
                return self._failed(step, error)
            self._commit(step, t0)

    def _failed(self, step: int, error: BaseException | None) -> None:
        """Remove the partial save; then stop (CheckpointSaveError) or go on, by checkpoint.on_save_error.

        Called on every rank together; error is None on a rank whose own part succeeded.
        """
        tmp = self.folder / f"{TMP_PREFIX}{step}"
        flags = [_is_disk_full(error) if error is not None else False, _first_line(error) if error else ""]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, flags)  # the cause as the ranks that failed saw it
        disk_full = any(f[0] for f in everyone)
        first = next((f[1] for f in everyone if f[1]), "")
        needed = _bytes_in(tmp)
        dist.barrier()  # everyone measured before rank 0 removes it
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        complete = complete_checkpoints(self.folder)
        previous = complete[-1] if complete else None
        if previous is not None:
            needed = max(needed, _bytes_in(previous.path))
        free = shutil.disk_usage(self.folder).free if self.folder.exists() else 0
        cause = "no space left on device" if disk_full else first or "a write failed"
        intact = (
            f"{previous.path.name} is intact and is where a relaunch resumes"
            if previous
            else "there is no earlier complete checkpoint"
        )
        message = (
            f"checkpoint of step {step} could not be written to {self.folder} ({cause}); a checkpoint takes "
            f"about {needed / 1e9:.2f} GB and {free / 1e9:.2f} GB are free; the partial {tmp.name} was "
            f"removed; {intact}"
        )
        if self.cfg.on_save_error == "continue":
            logger.error(f"{message}; training goes on without it (checkpoint.on_save_error = 'continue')")
            return None
        raise CheckpointSaveError(f"{message}; stopping (checkpoint.on_save_error = 'stop'; 'continue' trains on)")

    def _commit(self, step: int, t0: float) -> None:
        """Rank 0 seals .tmp-step-N (run files, checksums) and renames it to step-N."""
        if self.rank != 0:
            return
        tmp, final = self.folder / f"{TMP_PREFIX}{step}", self.folder / f"{STEP_PREFIX}{step}"
        (tmp / "job_config.toml").write_text(self.job_config_text)
        if self.data_identity is not None:
            write_data_identity(tmp, self.data_identity)
        if hasattr(self.model, "args"):
            (tmp / "model_args.json").write_text(json.dumps(args_to_dict(self.model.args), indent=2) + "\n")
        if self.lora_base is not None:
            write_lora_base(tmp, self.lora_base)
        seal(tmp, self.world, [".metadata", *RUN_FILES, *([LORA_BASE] if self.lora_base else [])])
        if final.exists():  # an earlier save of the same step (a rerun from an older checkpoint)
            logger.warning(
                f"Replacing {final}, written by an earlier run (this run resumed from an older checkpoint and "
                f"reached step {step} again)"
            )
            shutil.rmtree(final)
        os.rename(tmp, final)
        self.saved_steps.add(step)
        _fsync_dir(self.folder)
        logger.info(f"Saved checkpoint {final} ({time.perf_counter() - t0:.2f} s after the save began)")
        self._purge()

    def _purge(self) -> None:
        """Keep the newest keep_latest_k complete checkpoints, the newest full one and the one load_step names."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        complete = complete_checkpoints(self.folder)  # unreadable or partial folders are never counted or removed
        if len(complete) <= k:
            return
        keep = {i.step for i in complete[-k:]} | {self.cfg.load_step}  # a requeue may be told to load it again
        full = [i.step for i in complete if set(CHECKPOINT_PARTS) <= i.parts]
        if full:  # the newest checkpoint a resume can use survives model-only saves
            keep.add(full[-1])
        for info in complete:
            if info.step not in keep:
                shutil.rmtree(info.path, ignore_errors=True)
                earlier = "" if info.step in self.saved_steps else "; written by an earlier run"
                logger.info(f"Removed old checkpoint {info.path} (checkpoint.keep_latest_k = {k}{earlier})")

    def _remove_temporaries(self) -> None:
        """Delete saves that never completed (a crash, a kill or a full disk during a save); rank 0, at start."""
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if p.name.startswith(TMP_PREFIX):
                logger.warning(f"Removing incomplete checkpoint {p} (a save that did not finish)")
                shutil.rmtree(p, ignore_errors=True)


def _is_disk_full(error: BaseException) -> bool:
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> WrappedException(exc, ...)
        todo += [
            getattr(e, "__cause__", None),
            getattr(e, "__context__", None),
            getattr(e, "exc", None),
            *(failures.values() if isinstance(failures, dict) else ()),
        ]
    return "No space left on device" in str(error) or "unexpected pos" in str(error)


def _bytes_in(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*") if folder.is_dir() else ():
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:
            pass
    return total


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


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
