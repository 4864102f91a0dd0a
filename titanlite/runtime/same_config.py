"""Every rank of a job runs one configuration: compared as soon as the process group is up, before any collective
that a difference could break or any step it would change (docs/parallelism.md#multi-node)."""

from __future__ import annotations

import torch.distributed as dist

from titanlite.config.compare import describe_by_rank, digest, flat_settings
from titanlite.errors import ConfigError

# Keys that may differ between nodes: where each node's config file lies (its values are compared), and what only
# rank 0 shows. Paths that the ranks read or write (data, checkpoints, the dump folder) must be the same on every node.
NODE_LOCAL = ("job.config_file", "job.description", "job.print_config")


def check_same_config(cfg) -> None:
    """ConfigError on every rank, naming each key whose value differs between the ranks with the ranks that hold each
    value, when their resolved configurations differ (a digest is compared first); nothing in a group of one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = flat_settings(cfg, skip=NODE_LOCAL)
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(mine))
    if len(set(digests)) == 1:
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    raise ConfigError(
        f"the ranks of this job were started with different configurations: {describe_by_rank(everyone)}; start "
        "every node with the same config file and overrides (run_train.sh's CONFIG_FILE or --config, and its "
        "--section.key arguments)"
    )
