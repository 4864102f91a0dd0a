"""Sharded checkpoints over torch.distributed.checkpoint (DCP): save, resume at any topology, export.

`<job.dump_folder>/<checkpoint.folder>/step-N` is one DCP checkpoint with the top-level keys "model"
(plain FQNs, as `get_model_state_dict` gives them), "optimizer", "lr_scheduler", "dataloader" and
"train_state"; a model-only save (`last_save_model_only`) holds just "model". Every rank writes its
own shards and nobody gathers the full model. A save is written to `.tmp-step-N` and renamed to
`step-N` by rank 0 when its DCP save returns: DCP writes the `.metadata` file only after it has
collected every rank's write results, so a folder named `step-N` is always complete.

The data position and the train state are global (the same on every rank), so DCP may store them
once; the model and optimizer are DTensors that DCP reshards. A checkpoint therefore resumes under
any number of ranks, FSDP or HSDP, and the loader re-slices the same global sample order.

`python -m titanlite.checkpoint export --checkpoint DIR --output FILE [--dtype bfloat16]` writes
the model of a checkpoint as one consolidated state-dict file (`torch.save` of {fqn: tensor}).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.config import CHECKPOINT_PARTS, ConfigError, JobConfig

logger = logging.getLogger("titanlite")

PARTS = CHECKPOINT_PARTS  # model, optimizer, lr_scheduler, dataloader, train_state
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- finding checkpoints


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete, readable checkpoint folder and the top-level parts it holds."""

    step: int
    path: Path
    parts: frozenset[str]


def checkpoint_folder(cfg: JobConfig) -> Path:
    """`<job.dump_folder>/<checkpoint.folder>` (an absolute checkpoint.folder is used as is)."""
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def step_folders(folder: Path) -> dict[int, Path]:
    """Folders named step-N in `folder` (complete or not), by step."""
    out = {}
    if folder.is_dir():
        for p in folder.iterdir():
            suffix = p.name[len(STEP_PREFIX):]
            if p.name.startswith(STEP_PREFIX) and suffix.isdigit() and p.is_dir():
                out[int(suffix)] = p
    return out


def read_info(path: Path, step: int = -1) -> CheckpointInfo:
    """The parts a checkpoint folder holds; ValueError saying why when it is incomplete or unreadable."""
    if not (path / ".metadata").is_file():
        raise ValueError("it has no .metadata file (an incomplete or partial copy)")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # truncated or foreign files raise anything from pickle or torch
        raise ValueError(f"its .metadata cannot be read ({type(e).__name__}: {e})") from None
    return CheckpointInfo(step, path, frozenset(k.split(".", 1)[0] for k in metadata.state_dict_metadata))


def complete_checkpoints(folder: Path) -> list[CheckpointInfo]:
    """Every complete, readable checkpoint in the folder, oldest first."""
    out = []
    for step, path in sorted(step_folders(folder).items()):
        try:
            out.append(read_info(path, step))
        except ValueError:
            pass
    return out


def describe_steps(folder: Path) -> str:
    """'2, 4, 6' or 'none', for error messages listing the complete checkpoints."""
    return ", ".join(str(i.step) for i in complete_checkpoints(folder)) or "none"


def require_step(folder: Path, step: int, wanted: set[str]) -> CheckpointInfo:
    """The checkpoint of an exact step holding the wanted parts, else ConfigError naming what exists."""
    path = step_folders(folder).get(step)
    if path is None:
        raise ConfigError(f"checkpoint.load_step = {step}: there is no step-{step} in {folder}; "
                          f"complete checkpoints there: {describe_steps(folder)}")
    try:
        info = read_info(path, step)
    except ValueError as e:
        raise ConfigError(f"checkpoint.load_step = {step}: {path} is not a usable checkpoint: {e}; "
                          f"complete checkpoints there: {describe_steps(folder)}") from None
    missing = sorted(wanted - info.parts)
    if missing:
        raise ConfigError(f"checkpoint.load_step = {step}: {path} holds only {sorted(info.parts)} (a model-only "
                          f"save?), not {missing}; add them to checkpoint.exclude_from_loading to load it anyway")
    return info


def newest_usable(folder: Path, wanted: set[str]) -> CheckpointInfo | None:
    """The newest complete checkpoint holding the wanted parts; others are skipped with a warning."""
    for step, path in sorted(step_folders(folder).items(), reverse=True):
        try:
            info = read_info(path, step)
        except ValueError as e:
            logger.warning(f"Skipping checkpoint {path}: {e}")
            continue
        if wanted <= info.parts:
            return info
        logger.info(f"Skipping checkpoint {path} for resuming: it holds only {sorted(info.parts)} (model-only save)")
    return None


def preflight(cfg: JobConfig) -> None:
    """Checks that need no process group: the checkpoint folder is writable, load_step and
    initial_load_path exist. Raises ConfigError, so a bad setting fails at start-up."""
    c = cfg.checkpoint
    if c.initial_load_path and not Path(c.initial_load_path).exists():
        raise ConfigError(f"checkpoint.initial_load_path = {c.initial_load_path!r} does not exist; valid: a DCP "
                          f"checkpoint folder (step-N) or a consolidated state-dict file")
    if not c.enable:
        return
    folder = checkpoint_folder(cfg)
    probe = folder / f".write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"checkpoint.folder = {c.folder!r} (under job.dump_folder = {cfg.job.dump_folder!r}): "
                          f"cannot write to {folder}: {e.strerror or e}; choose a writable folder") from None
    if c.load_step >= 0:
        require_step(folder, c.load_step, set(PARTS) - set(c.exclude_from_loading))


# ----------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves and restores the model, optimizer, LR schedule, data position and train state.

    `train_state` is any object with int attributes `step` and `tokens_seen` (the Trainer). When
    checkpointing is enabled, after `load()` SIGTERM and SIGUSR1 request a save-and-stop at the end of
    the step (`maybe_save` returns True); `close()` restores the previous handlers.
    """

    def __init__(self, cfg: JobConfig, *, model, optimizer, lr_scheduler, dataloader, train_state,
                 device: torch.device):
        self.cfg = cfg.checkpoint
        self.enabled = cfg.checkpoint.enable
        self.folder = checkpoint_folder(cfg)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state, self.device = dataloader, train_state, device
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
        wanted = set(PARTS) - set(self.cfg.exclude_from_loading)
        box: list = [None, None]  # rank 0 decides for everyone: (CheckpointInfo | None, error message)
        if self.rank == 0 and self.enabled:
            try:
                self._remove_temporaries()
                if self.cfg.load_step >= 0:
                    box[0] = require_step(self.folder, self.cfg.load_step, wanted)
                else:
                    box[0] = newest_usable(self.folder, wanted)
            except ConfigError as e:
                box[1] = str(e)
        dist.broadcast_object_list(box, src=0)
        info, error = box
        if error:
            raise ConfigError(error)
        if info is not None:
            self._restore(info, wanted)
        elif self.cfg.initial_load_path:
            self._load_initial(Path(self.cfg.initial_load_path))
        # From here on a preemption signal is honoured at the end of a step (before: default action).
        self._install_signal_handlers()
        return info is not None

    def _restore(self, info: CheckpointInfo, wanted: set[str]) -> None:
        t0 = time.perf_counter()
        metadata = FileSystemReader(info.path).read_metadata()
        state: dict = {}
        if "model" in wanted:
            state["model"] = get_model_state_dict(self.model)
            check_model_fits(state["model"], _saved_shapes(metadata, "model."), str(info.path))
        if "optimizer" in wanted:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if "lr_scheduler" in wanted:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if "dataloader" in wanted:
            state["dataloader"] = self.dataloader.state_dict()
        if "train_state" in wanted:
            state["train_state"] = self._train_state_dict()
        dcp.load(state, checkpoint_id=info.path)
        if "model" in state:
            set_model_state_dict(self.model, state["model"])
        if "optimizer" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            # The optimizer's lr must be the schedule's even when the optimizer state was not loaded.
            for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                group["lr"] = lr
        if "dataloader" in state:
            self.dataloader.load_state_dict(state["dataloader"])
        if "train_state" in state:
            self._load_train_state(state["train_state"])
        skipped = f", not {sorted(set(PARTS) - wanted)} (checkpoint.exclude_from_loading)" if wanted != set(PARTS) else ""
        logger.info(f"Resuming from {info.path} (step {info.step}): restored {sorted(state)}{skipped} "
                    f"in {time.perf_counter() - t0:.2f} s")

    def _load_initial(self, path: Path) -> None:
        """Model weights only, from a DCP folder (step-N or plain model keys) or a consolidated file."""
        model_sd = get_model_state_dict(self.model)
        if path.is_dir():
            try:
                metadata = FileSystemReader(path).read_metadata()
            except Exception as e:
                raise ConfigError(f"checkpoint.initial_load_path = {str(path)!r} is not a readable DCP checkpoint "
                                  f"({type(e).__name__}: {e})") from None
            prefix = "model." if any(k.startswith("model.") for k in metadata.state_dict_metadata) else ""
            check_model_fits(model_sd, _saved_shapes(metadata, prefix), str(path))
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
        _test_kill_point("step", step)
        self._commit_if_done()
        stop = self._agree_on_stop()
        if stop or last or step % self.cfg.interval == 0:
            if before_save is not None:
                before_save()
            self.save(step, model_only=last and self.cfg.last_save_model_only and not stop)
        if stop:
            self.preempted = True
            logger.warning(f"Preempted: checkpoint of step {step} saved; exiting with status 0 so the job can "
                           "be requeued (the next launch resumes from it)")
        return stop

    def save(self, step: int, model_only: bool = False) -> None:
        """Write step-N (model-only in checkpoint.export_dtype if asked); async mode returns after staging."""
        self._wait_pending()  # one save at a time: the previous one is committed first
        if model_only:
            dtype = DTYPES[self.cfg.export_dtype]
            model_sd = get_model_state_dict(self.model)
            state = {"model": {k: v.to(dtype) if v.is_floating_point() else v for k, v in model_sd.items()}}
        else:
            state = self._full_state()
        _test_kill_point("save", step)
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
            logger.info(f"Checkpoint of step {step}: staged in {time.perf_counter() - t0:.2f} s, writing in the background")

    def close(self) -> None:
        """Finish a pending async save and restore the signal handlers."""
        self._wait_pending()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        if self._async_pg is not None:
            dist.destroy_process_group(self._async_pg)
            self._async_pg = None

    def _full_state(self) -> dict:
        return {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": self.dataloader.state_dict(),
            "train_state": self._train_state_dict(),
        }

    def _train_state_dict(self) -> dict:
        # Every rank has the same seed and draws no rank-specific random numbers, so these values are
        # global; DCP stores a non-DTensor value once, which is then what every rank gets back.
        device_mod = getattr(torch, self.device.type) if self.device.type != "cpu" else None
        return {
            "step": self.train_state.step,
            "tokens_seen": self.train_state.tokens_seen,
            "rng_cpu": torch.get_rng_state().numpy().tobytes(),
            "rng_device_type": self.device.type,
            "rng_device": device_mod.get_rng_state().numpy().tobytes() if device_mod else b"",
            "rng_python": random.getstate(),
        }

    def _load_train_state(self, ts: dict) -> None:
        self.train_state.step = int(ts["step"])
        self.train_state.tokens_seen = int(ts["tokens_seen"])
        torch.set_rng_state(torch.frombuffer(bytearray(ts["rng_cpu"]), dtype=torch.uint8))
        if ts["rng_device"] and ts["rng_device_type"] == self.device.type:
            getattr(torch, self.device.type).set_rng_state(torch.frombuffer(bytearray(ts["rng_device"]), dtype=torch.uint8))
        random.setstate(ts["rng_python"])

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
        full = [i.step for i in complete if set(PARTS) <= i.parts]
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


# ----------------------------------------------------------------------------- model weights


def _saved_shapes(metadata, prefix: str) -> dict[str, tuple | None]:
    """Full shapes of the saved keys under prefix (None for a non-tensor value), prefix removed."""
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            out[key[len(prefix):]] = tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
    return out


def check_model_fits(model_sd: dict, saved: dict[str, tuple | None], source: str) -> None:
    """ConfigError naming the first key whose saved shape differs from the model's (or is missing)."""
    hint = "; was it saved with another model.flavor, model.vocab_size or model.tie_embeddings?"
    for name, value in model_sd.items():
        model_shape = tuple(value.shape)
        if name not in saved:
            raise ConfigError(f"{source} does not fit the model: '{name}' (shape {model_shape} in the model) is "
                              f"not in the checkpoint{hint}")
        if saved[name] != model_shape:
            raise ConfigError(f"{source} does not fit the model: '{name}' has shape {saved[name]} in the "
                              f"checkpoint but {model_shape} in the model{hint}")
    extra = [k for k in saved if k not in model_sd]
    if extra:
        raise ConfigError(f"{source} does not fit the model: the checkpoint has '{extra[0]}' (shape "
                          f"{saved[extra[0]]}), which the model does not{hint}")


def load_consolidated(path: Path) -> dict[str, torch.Tensor]:
    """A consolidated state-dict file ({fqn: tensor}, or {"model": {...}}), memory-mapped."""
    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise ConfigError(f"checkpoint.initial_load_path = {str(path)!r} is not a readable state-dict file "
                          f"({type(e).__name__}: {e})") from None
    if isinstance(sd, dict) and isinstance(sd.get("model"), dict):
        sd = sd["model"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConfigError(f"checkpoint.initial_load_path = {str(path)!r} does not hold a state dict of tensors")
    return sd


def export(checkpoint: Path, output: Path, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Write the model of a DCP checkpoint (step-N, or the newest in a checkpoint folder) as one
    consolidated file {fqn: tensor}, optionally cast to dtype; returns the state dict. One process."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / ".metadata").exists() and step_folders(checkpoint):
        info = newest_usable(checkpoint, {"model"})
        if info is None:
            raise ConfigError(f"--checkpoint {checkpoint}: no complete checkpoint in it")
        checkpoint = info.path
    try:
        read_info(checkpoint)
        metadata = FileSystemReader(checkpoint).read_metadata()
    except (ValueError, OSError) as e:
        raise ConfigError(f"--checkpoint {checkpoint} is not a usable DCP checkpoint: {e}") from None
    prefix = "model." if any(k.startswith("model.") for k in metadata.state_dict_metadata) else ""
    flat = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not flat:
        raise ConfigError(f"--checkpoint {checkpoint} holds no model tensors")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=FileSystemReader(checkpoint), no_dist=True)
    cast = DTYPES[dtype] if dtype else None
    sd = {k[len(prefix):]: (v.to(cast) if cast and v.is_floating_point() else v) for k, v in flat.items()}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    torch.save(sd, tmp)
    os.replace(tmp, output)
    return sd


def main(argv: list[str] | None = None) -> int:
    """`python -m titanlite.checkpoint export --checkpoint DIR --output FILE [--dtype bfloat16]`."""
    parser = argparse.ArgumentParser(prog="python -m titanlite.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's model as one consolidated state-dict file")
    ex.add_argument("--checkpoint", required=True, help="a step-N folder, or a checkpoint folder (its newest)")
    ex.add_argument("--output", required=True, help="file to write (torch.save of {fqn: tensor})")
    ex.add_argument("--dtype", choices=list(DTYPES), default=None, help="cast floating tensors (default: as saved)")
    args = parser.parse_args(argv)
    try:
        sd = export(Path(args.checkpoint), Path(args.output), args.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    numel = sum(v.numel() for v in sd.values())
    print(f"wrote {args.output}: {len(sd)} tensors, {numel:,} values, dtype {args.dtype or 'as saved'}")
    return 0


# ----------------------------------------------------------------------------- helpers


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


def _test_kill_point(where: str, step: int) -> None:
    """TEST ONLY: SIGKILL this process at a named point when TITANLITE_TEST_KILL_AT asks for it.

    TITANLITE_TEST_KILL_AT is a comma-separated list of WHERE:STEP:RANK, the i-th entry applying to
    torchrun restart i (TORCHELASTIC_RESTART_COUNT). WHERE is "step" (end of the step, before its save
    decision) or "save" (a save has begun, before this rank writes anything).
    """
    spec = os.environ.get("TITANLITE_TEST_KILL_AT")
    if not spec:
        return
    entries = spec.split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(entries) or not entries[attempt]:
        return
    kill_where, kill_step, kill_rank = entries[attempt].split(":")
    if kill_where == where and int(kill_step) == step and int(kill_rank) == dist.get_rank():
        logger.warning(f"TITANLITE_TEST_KILL_AT: killing rank {kill_rank} at {where} {step} (restart {attempt})")
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from titanlite.checkpoint import main as _main
    raise SystemExit(_main())
