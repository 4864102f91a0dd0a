"""CheckpointManager: sharded saves over torch.distributed.checkpoint (DCP), resume at any topology,
stop signals, async saves, checksums, failed saves and retention.

`<job.dump_folder>/<checkpoint.folder>/step-N` is one DCP checkpoint with a top-level key per part
(titanlite.checkpoint.parts); a model-only save (`last_save_model_only`) holds just "model". Every rank
writes its own shards and nobody gathers the full model. A save is written to `.tmp-step-N` and renamed
to `step-N` by rank 0 when every rank has finished: DCP writes `.metadata` only after it has collected
every rank's write results, then each rank records its files' checksums and rank 0 adds the run's
config (`job_config.toml`), the model's shape (`model_args.json`), `manifest.json` and `.committed`. So a
folder named `step-N` is always complete, and a resume can check it and say what changed since. In object
storage (checkpoint.folder = "s3://..."), which cannot rename, the save goes to `step-N` itself and
`.committed`, written last, is what makes it complete (catalog.py). A resume from an older step sets the full
checkpoints newer than it aside (`abandoned-step-N`), so that neither a later resume nor retention counts them
before this run's saves.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint import save_failure
from titanlite.checkpoint.base_identity import FILE as LORA_BASE
from titanlite.checkpoint.base_identity import write as write_lora_base
from titanlite.checkpoint.catalog import (
    COMMITTED,
    STEP_PREFIX,
    TMP_PREFIX,
    CheckpointInfo,
    checkpoint_folder,
    describe_steps,
    read_metadata,
    remove_checkpoint,
    remove_old,
    set_aside_newer,
    wanted_parts,
)
from titanlite.checkpoint.consolidated import check_model_fits, model_shapes, saved_shapes
from titanlite.checkpoint.data_identity import FILE as DATA_IDENTITY
from titanlite.checkpoint.data_identity import check_unchanged
from titanlite.checkpoint.data_identity import write as write_data_identity
from titanlite.checkpoint.initial import load_initial_weights
from titanlite.checkpoint.integrity import seal, write_rank_manifest
from titanlite.checkpoint.lora_io import base_record, check_lora_resume, load_peft_adapter
from titanlite.checkpoint.parts import ModelPart, OptimizerPart, SchedulerPart, TrainStatePart
from titanlite.checkpoint.remote_inputs import as_given, url_of
from titanlite.checkpoint.resume import (
    check_model_matches,
    check_same_optimizer,
    describe_changes,
    intact_checkpoints,
    saved_job_config,
    unreadable,
)
from titanlite.checkpoint.safe_reading import UnsafeCheckpointError, safe_dcp_load
from titanlite.config import CHECKPOINT_PARTS, JobConfig, to_toml
from titanlite.dtypes import TORCH_DTYPES
from titanlite.errors import CheckpointSaveError, ConfigError
from titanlite.models.args import args_to_dict
from titanlite.optim import optimizer_hyperparameters, peak_lrs
from titanlite.run_state import LOADED, RunState
from titanlite.runtime.run_control import LOCK_LOST, StopSignals
from titanlite.storage import dcp_writer, fsync_folder, is_remote, location

logger = logging.getLogger("titanlite")

RUN_FILES = ("job_config.toml", "model_args.json", DATA_IDENTITY)


class CheckpointManager:
    """Saves and restores the run state (run_state.RunState): model, optimizer (with DiLoCo's outer state), LR
    schedule, data position, step and tokens seen. When
    checkpointing is enabled, after `load()` the stop signals (run_control.StopSignals) request a
    save-and-stop at the end of the step (`maybe_save` returns True); `close()` restores the handlers.
    """

    def __init__(
        self,
        cfg: JobConfig,
        state: RunState,
        device: torch.device,
        data_identity: dict | None = None,
    ):
        self.job_cfg, self.cfg = cfg, cfg.checkpoint
        self.data_identity = data_identity  # what the data position counts in (data_identity.py)
        self.job_config_text = to_toml(
            as_given(cfg)
        )  # inputs in object storage by their URLs, not this machine's copies
        self.enabled = cfg.checkpoint.enable
        self.folder = checkpoint_folder(cfg)
        self.wanted = wanted_parts(cfg)
        self.state, model, optimizer = state, state.model, state.optimizer
        self.model, self.dataloader = model, state.dataloader
        self.saved_steps: set[int] = set()  # steps this run wrote (retention says when it removes older runs')
        # LoRA: checkpoints hold the adapters; the base is checkpoint.initial_load_path's, identified by fingerprint
        # (and a 4-bit base by its block sizes).
        self.lora = cfg.lora.enable
        self.lora_base = base_record(cfg, getattr(model, "args", None)) if self.lora else None
        self.parts = {
            "model": ModelPart(model, trainable_only=self.lora),
            "optimizer": OptimizerPart(model, optimizer, optimizer_hyperparameters(cfg.optimizer), state.outer),
            "lr_scheduler": SchedulerPart(state.lr_scheduler, optimizer, peak_lrs(cfg.optimizer)),
            "dataloader": state.dataloader,
            "train_state": TrainStatePart(state, device),
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
        lora.initial_adapter_path), and tell the run state's listeners (weights replaced: LOADED). True when a
        checkpoint was resumed."""
        intact = intact_checkpoints(self.folder, self.cfg.load_step, self.wanted) if self.enabled else iter(())
        info = next(intact, None)
        if self.cfg.initial_load_path and (info is None or self.lora):
            load_initial_weights(self.model, location(self.cfg.initial_load_path))
        while info is not None and (damage := self._restore(info)) is not None:
            failed, info = info, next(intact, None)  # every part it loaded is loaded again from the next one
            if info is None:  # the state is half loaded: no fresh start from it either
                if self.cfg.load_step >= 0:
                    where = f"complete checkpoints there: {describe_steps(self.folder)}"
                    raise ConfigError(
                        f"checkpoint.load_step = {self.cfg.load_step}: {failed.path} is corrupt: {damage}; {where}"
                    )
                raise ConfigError(
                    f"{failed.path} is corrupt: {damage}; there is no earlier intact checkpoint to resume from"
                )
            if self.rank == 0:
                logger.warning(f"Skipping corrupt checkpoint {failed.path}: {damage}; trying the one before")
        if info is None and self.lora and self.job_cfg.lora.initial_adapter_path:
            load_peft_adapter(self.model, self.job_cfg.lora.initial_adapter_path, self.job_cfg.lora)
        if self.enabled:  # from here on a stop signal is honoured at the end of a step (with a save)
            self._set_aside_newer(info.step if info else -1)
            self.signals.install()
        self.state.weights_replaced(LOADED)
        return info is not None

    def _set_aside_newer(self, step: int) -> None:
        """Rank 0 moves the full checkpoints newer than the resumed step aside (catalog.set_aside_newer); ConfigError
        on every rank when one cannot be: this run's saves could be the ones retention removes."""
        box = [None]
        if self.rank == 0:
            try:
                set_aside_newer(self.folder, step)
            except Exception as e:
                box[0] = f"checkpoint.folder = {str(self.folder)!r}: {save_failure.cause_of(e, self.folder)}"
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise ConfigError(f"{box[0]}; a checkpoint newer than the step resumed from could not be set aside")

    def _restore(self, info: CheckpointInfo) -> str | None:
        """Load a checkpoint; what is damaged when a file of it cannot be read (resume.unreadable), else None."""
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
        if self.state.reference_logps:  # [dpo] precomputed tables: loaded when saved (preference/ says if one lacks)
            saved = saved_shapes(read_metadata(info.path), "train_state.reference_logps.")
            self.parts["train_state"].tables_saved = set(saved)
        # DCP calls each part's state_dict() for the destination and load_state_dict() afterwards.
        try:
            safe_dcp_load({n: part for n, part in self.parts.items() if n in self.wanted}, info.path)
        except UnsafeCheckpointError:
            raise
        except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
            if damage := unreadable(e):
                return damage
            raise ConfigError(
                f"{info.path} could not be loaded into this run ({type(e).__name__}: "
                f"{str(e).strip()[:400]}); is it from another model or run?"
            ) from e
        finally:
            if outer is not None:
                outer.in_checkpoint = outer.PARTS  # every save holds it all
            self.parts["train_state"].tables_saved = None
        skipped = sorted(set(CHECKPOINT_PARTS) - self.wanted)
        note = f", not {skipped} (checkpoint.exclude_from_loading)" if skipped else ""
        logger.info(
            f"Resuming from {info.path} (step {info.step}): restored {sorted(self.wanted)}{note} "
            f"in {time.perf_counter() - t0:.2f} s"
        )
        self._report_changes(info)
        return None

    def _report_changes(self, info: CheckpointInfo) -> None:
        saved = saved_job_config(info.path)
        if saved is None:
            return
        position = self.dataloader.state_dict().get("sequence_index", 0)
        old_len, new_len = saved.training.seq_len, self.job_cfg.training.seq_len
        pairs = self.job_cfg.data.format == "preference"  # a position in pairs: the same whatever the seq_len
        if "dataloader" in self.wanted and old_len != new_len and not pairs:  # keep the position in tokens
            self.dataloader.load_state_dict({"sequence_index": math.ceil(position * (old_len + 1) / (new_len + 1))})
        scheduler = self.parts["lr_scheduler"]
        lr = scheduler.lr_scheduler.get_last_lr()[-1]  # optimizer.lr's group
        lines = describe_changes(saved, as_given(self.job_cfg), info.step, position, scheduler.replanned, lr)
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
        stop = self._agree_on_stop()  # first: a job that lost its lock must not commit a pending save either
        self._commit_if_done()
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
        tmp = self._writing_folder(step)
        t0 = time.perf_counter()
        if is_remote(self.folder) and not self._all_ok((cleared := self._clear_old(step)) is None):
            return self._failed(step, cleared)
        crcs: dict[str, int] = {}  # of the objects uploaded, as the writer wrote them
        writer = dcp_writer(tmp, crcs)
        if self._async_pg is None:
            error = None
            try:
                dcp.save(state, storage_writer=writer)
                write_rank_manifest(tmp, self.rank, crcs)
            except (Exception, dcp.api.CheckpointException) as e:
                error = e
            if not self._all_ok(error is None):  # also waits for every rank's manifest
                return self._failed(step, error)
            self._commit(step, t0)
        else:
            # FileSystemWriter stages synchronously (a CPU copy of every tensor) before async_save returns, so the
            # optimizer may change the live state at once; the write (and this rank's checksums) go on in a thread.
            written = dcp.async_save(state, storage_writer=writer, process_group=self._async_pg)
            self._pending = (step, _then(written, lambda: write_rank_manifest(tmp, self.rank, crcs)), t0)
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
        """Whether a stop signal reached any rank; CheckpointSaveError when another job took over the checkpoint
        folder's lock (this job stalled past its heartbeat): it must not write over that job's checkpoints."""
        flags = torch.tensor([int(not self.signals.requested), int(not LOCK_LOST.is_set())], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if not flags[1]:
            raise CheckpointSaveError(
                f"another job took over the lock on {self.folder} (logged above); stopping without saving, so as not "
                "to write over its checkpoints"
            )
        return not bool(flags[0])

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
        tmp = self._writing_folder(step)
        flags = [error is not None and save_failure.is_disk_full(error), save_failure.first_line(error, self.folder)]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, flags)  # the cause as the ranks that failed saw it
        partial = 0 if is_remote(tmp) else save_failure.bytes_in(tmp)
        dist.barrier()  # everyone measured before rank 0 removes it
        after = [save_failure.clean_up(tmp, self.folder) if self.rank == 0 else None]
        dist.broadcast_object_list(after, src=0)
        cause = next((f[1] for f in everyone if f[1]), "")
        message = save_failure.describe(step, self.folder, partial, cause, any(f[0] for f in everyone), after[0])
        if self.cfg.on_save_error == "continue":
            logger.error(f"{message}; training goes on without it (checkpoint.on_save_error = 'continue')")
            return None
        raise CheckpointSaveError(f"{message}; stopping (checkpoint.on_save_error = 'stop'; 'continue' trains on)")

    def _writing_folder(self, step: int):
        """Where the save of `step` is written: `.tmp-step-N`, renamed when complete; in object storage `step-N`."""
        prefix = STEP_PREFIX if is_remote(self.folder) else TMP_PREFIX
        return self.folder / f"{prefix}{step}"

    def _clear_old(self, step: int) -> BaseException | None:
        """Object storage: rank 0 removes an earlier run's step-N (commit marker first), which this save replaces,
        before any rank writes into it; the error when it could not."""
        final = self.folder / f"{STEP_PREFIX}{step}"
        try:
            if self.rank == 0 and final.exists():
                logger.warning(f"Replacing {final}, written by an earlier run (this run reached step {step} again)")
                remove_checkpoint(final)
        except Exception as e:
            return e
        return None

    def _commit(self, step: int, t0: float) -> None:
        """Rank 0 seals the save of step N (run files, checksums, commit marker) and renames it to step-N; a failure
        leaves it unused and, by checkpoint.on_save_error, is logged or stops this rank (CheckpointSaveError)."""
        self.saved_steps.add(step)  # on every rank: fault tolerance asks each whether a step is saved already
        if self.rank != 0:
            return
        if LOCK_LOST.is_set():  # another job holds the folder now: its checkpoints are not this job's to touch
            logger.error(f"checkpoint of step {step} is not committed: another job took over the lock on {self.folder}")
            return
        try:
            self._seal(step, t0)
        except Exception as e:  # an I/O error or an object store that went away: the other ranks trained on
            after = save_failure.clean_up(self._writing_folder(step), self.folder)  # never resumed from either way
            message = (
                f"checkpoint of step {step} could not be committed in {self.folder} "
                f"({save_failure.first_line(e, self.folder)}); it is never resumed from; {after['removed']}; "
                f"{after['intact']}"
            )
            if self.cfg.on_save_error == "continue":
                logger.error(f"{message}; training goes on without it (checkpoint.on_save_error = 'continue')")
                return
            raise CheckpointSaveError(f"{message}; stopping (checkpoint.on_save_error = 'stop')") from e
        try:
            remove_old(self.folder, self.cfg.keep_latest_k, self.cfg.load_step, self.saved_steps)
        except Exception as e:  # retention is tried again after the next save
            logger.warning(f"Old checkpoints in {self.folder} were not removed this time: {e}")

    def _seal(self, step: int, t0: float) -> None:
        tmp, final = self._writing_folder(step), self.folder / f"{STEP_PREFIX}{step}"
        (tmp / "job_config.toml").write_text(self.job_config_text)
        if self.data_identity is not None:
            write_data_identity(tmp, self.data_identity)
        if hasattr(self.model, "args"):
            (tmp / "model_args.json").write_text(json.dumps(args_to_dict(self.model.args), indent=2) + "\n")
        if self.lora_base is not None:
            # a base in object storage by its URL (not this machine's copy): found again on another machine
            write_lora_base(tmp, {**self.lora_base, "path": url_of(self.lora_base["path"])})
        seal(tmp, self.world, [".metadata", *RUN_FILES, *([LORA_BASE] if self.lora_base else [])])
        (tmp / COMMITTED).write_text(f"{step}\n")  # last: in object storage the save is complete from here on
        if final != tmp and final.exists():  # an earlier save of the same step (a rerun from an older checkpoint)
            logger.warning(
                f"Replacing {final}, written by an earlier run (this run resumed from an older checkpoint and "
                f"reached step {step} again)"
            )
            remove_checkpoint(final)
        if final != tmp:
            os.rename(tmp, final)
            fsync_folder(self.folder)
        logger.info(f"Saved checkpoint {final} ({time.perf_counter() - t0:.2f} s after the save began)")


def _then(future: Future, after) -> Future:
    """A future done when `future` is and then after() has run (in the writer's thread), failing with either's
    error (a manifest that could not be written fails the save like a shard that could not)."""
    done: Future = Future()

    def chain(f: Future) -> None:
        try:
            if f.exception() is not None:
                raise f.exception()
            after()
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            done.set_exception(e)

    future.add_done_callback(chain)
    return done
