"""The HuggingFace copy a run writes at its last step (checkpoint.last_save_in_hf): `<checkpoint folder>/hf-step-N`,
every rank writing its shards; in object storage written under job.dump_folder first, then uploaded by rank 0."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from titanlite.checkpoint.catalog import checkpoint_folder
from titanlite.checkpoint.hf_io import save_hf_sharded
from titanlite.dtypes import TORCH_DTYPES
from titanlite.storage import describe_failure, is_remote, remove_tree, upload

logger = logging.getLogger("titanlite")


def write_hf_copy(cfg, model, tokenizer, step: int, rank: int):
    """Write the model of step `step` as a HuggingFace folder (call on every rank); where it is (in object storage,
    when the upload failed: the local copy under job.dump_folder, with an error logged)."""
    out = checkpoint_folder(cfg) / f"hf-step-{step}"
    local = Path(cfg.job.dump_folder) / out.name if is_remote(out) else out
    t0 = time.perf_counter()
    dtype, started_from = TORCH_DTYPES[cfg.checkpoint.export_dtype], cfg.checkpoint.initial_load_path
    save_hf_sharded(model, local, dtype, tokenizer, started_from=started_from)
    if local != out and rank == 0:
        try:
            remove_tree(out)
            upload(local, out, last=("config.json", "model.safetensors.index.json"))
            remove_tree(local)
        except Exception as e:  # the checkpoints are saved; the HF copy stays in job.dump_folder
            logger.error(f"{describe_failure(out, 'checkpoint.last_save_in_hf', e)}; it is kept in {local}")
            return local
    logger.info(
        f"Wrote the HuggingFace model {out} ({cfg.checkpoint.export_dtype}) in {time.perf_counter() - t0:.1f} s"
    )
    return out
