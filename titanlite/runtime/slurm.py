"""A training job under SLURM: run_train.sh reads the job's shape from SLURM's variables (nodes, this node's number,
the first node for the rendezvous, the job id) instead of hand-set NNODES and RDZV_ENDPOINT, and refuses a step that
would not run on every node.

`python -m titanlite.runtime.slurm` prints the launcher's settings as shell `export` lines (run_train.sh evaluates
them), or one line naming what is wrong and exits 2. No torch here: it runs before every launch.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping

from titanlite.errors import ConfigError

DEFAULT_PORT_BASE = 20000  # the rendezvous port: this plus the job id modulo PORT_SPAN, unless RDZV_PORT is given
PORT_SPAN = 20000


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (node[1-4] -> node1), as `scontrol show hostnames` expands it."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def _whole(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key, "")
    return int(value) if value.isdigit() else None


def launch_settings(env: Mapping[str, str], hosts: Callable[[str], str] = first_host) -> dict[str, str]:
    """The launcher's environment for this SLURM step: NNODES, RDZV_ENDPOINT, RDZV_ID, the node's number, NGPU from
    the step's GPUs, and TITANLITE_FIRST_NODE_LOGS (the workers off global rank 0's node log errors only: one copy of
    each line in the job's output). ConfigError naming the variable when the step cannot train as one job."""
    job, nodes = env["SLURM_JOB_ID"], _whole(env, "SLURM_JOB_NUM_NODES") or _whole(env, "SLURM_NNODES") or 1
    if nodes > 1 and "SLURM_STEP_ID" not in env:
        raise ConfigError(
            f"run_train.sh runs in SLURM job {job} of {nodes} nodes but outside srun (no SLURM_STEP_ID): it would "
            "train on the first node alone; start it on every node with srun (slurm/train.sbatch does)"
        )
    if "SLURM_STEP_ID" in env:
        nodes = _whole(env, "SLURM_STEP_NUM_NODES") or nodes
        tasks = _whole(env, "SLURM_STEP_NUM_TASKS") or nodes
        if tasks != nodes:
            raise ConfigError(
                f"SLURM step {job}.{env['SLURM_STEP_ID']} runs {tasks} tasks on {nodes} node(s) "
                f"(SLURM_STEP_NUM_TASKS={tasks}): run_train.sh starts a node's NGPU processes itself, so it needs "
                "one task per node; submit with --ntasks-per-node=1 (slurm/train.sbatch sets it)"
            )
    given = env.get("NNODES", "")
    if given and given != str(nodes):
        raise ConfigError(
            f"NNODES={given}, but SLURM job {job} runs this step on {nodes} node(s) (SLURM_STEP_NUM_NODES / "
            "SLURM_JOB_NUM_NODES); leave NNODES unset under SLURM, or ask sbatch for that many nodes (-N)"
        )
    out = {"NNODES": str(nodes), "TITANLITE_NODE_ID": env.get("SLURM_NODEID", "0")}
    if nodes > 1:
        port = env.get("RDZV_PORT") or str(DEFAULT_PORT_BASE + int(job) % PORT_SPAN)
        nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]  # (a step may run on some nodes)
        out["RDZV_ENDPOINT"] = env.get("RDZV_ENDPOINT") or f"{hosts(nodelist)}:{port}"
        out["RDZV_ID"] = env.get("RDZV_ID") or f"slurm-{job}.{env.get('SLURM_STEP_ID', '0')}"
        # The node that holds global rank 0 speaks for the job; the workers of the others log errors only. The
        # rendezvous, not SLURM_NODEID, decides which node that is: the workers read torchrun's GROUP_RANK.
        out["TITANLITE_FIRST_NODE_LOGS"] = "1"
    if not env.get("NGPU") and (_whole(env, "SLURM_GPUS_ON_NODE") or 0) > 0:
        out["NGPU"] = env["SLURM_GPUS_ON_NODE"]
    if out["TITANLITE_NODE_ID"] != "0":  # torchrun's own agent lines: errors only, except on SLURM's first node
        out["LOGLEVEL"] = "ERROR"
    return out


def main() -> int:
    """Print `export` lines of launch_settings(os.environ); exit status 2 and one line for a misfit step."""
    try:
        settings = launch_settings(os.environ)
    except ConfigError as e:
        print(f"run_train.sh: {e}", file=sys.stderr)
        return 2
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"run_train.sh: cannot expand SLURM_JOB_NODELIST with scontrol ({e}); set RDZV_ENDPOINT", file=sys.stderr)
        return 2
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in settings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
