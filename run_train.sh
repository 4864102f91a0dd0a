#!/usr/bin/env bash
# Launch titanlite training with torchrun.
#
#   ./run_train.sh [--config NAME|FILE] [--dry-run [--dry-run-gpu-mem-gib N]] [--section.key value ...]
#
# --dry-run checks the job and prints each rank's memory for NGPU x NNODES ranks without starting it
# (NGPU unset: the visible GPUs, else 8); exit status 0 fits, 1 does not fit, 2 config error.
#
# Environment:
#   CONFIG_FILE   TOML file, relative to where this is run, or a name in train_configs/ (default debug_model);
#                 --config NAME|FILE wins over it
#   NGPU          processes on this node (default: visible GPUs, else 2 CPU processes)
#   NNODES        nodes (default 1); NODE_RANK is not needed: torchrun's rendezvous assigns ranks
#   RDZV_ENDPOINT host:port of the rendezvous (multi-node; default localhost:0 for one node)
#   RDZV_ID       job id shared by all nodes (default titanlite; on one node a new one per launch)
#   RDZV_JOIN_TIMEOUT  seconds a node waits at the rendezvous for all NNODES nodes (default 600)
#   LOG_RANK      local ranks whose output is shown (default 0; e.g. 0,1)
#   MAX_RESTARTS  torchrun --max-restarts (default 0)
#   Under SLURM (inside srun) NNODES, RDZV_ENDPOINT (the job's first node, port RDZV_PORT or 20000 + job id % 20000)
#   and RDZV_ID come from the job (titanlite/runtime/slurm.py); TITANLITE_IGNORE_SLURM=1 turns that off.
#
# Stopping: SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGUSR1 make every worker save at the end of its step and
# exit 0; this script then exits 0 too. A second Ctrl-C ends everything at once.
set -euo pipefail
# Paths are the user's: a relative --config, CONFIG_FILE or dump_folder means the folder this is run from.
# The checkout only has to be importable; a bare config name still finds its train_configs/.
TITANLITE_HOME=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$TITANLITE_HOME${PYTHONPATH:+:$PYTHONPATH}"

die() { echo "run_train.sh: $*" >&2; exit 2; }
whole() { [[ "$1" =~ ^[0-9]+$ ]]; }

CONFIG_FILE=${CONFIG_FILE:-debug_model}
args=()
dry_run=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --config) [[ $# -ge 2 ]] || die "--config needs a value"; CONFIG_FILE="$2"; shift 2 ;;
        --config=*) CONFIG_FILE="${1#*=}"; shift ;;
        --dry-run) dry_run=1; shift ;;
        *) args+=("$1"); shift ;;
    esac
done

for a in ${args[@]+"${args[@]}"}; do
    if [[ "$a" == "--help" || "$a" == "-h" ]]; then exec python -m titanlite.config --help; fi
done

if [[ "$dry_run" == 1 ]]; then
    # Check the job and size its memory for NGPU x NNODES ranks: no GPU, no torchrun, no real process group.
    exec python -m titanlite.dry_run --job.config_file "$CONFIG_FILE" ${args[@]+"${args[@]}"}
fi

# Under SLURM (srun on every node, slurm/train.sbatch): the nodes, this node's number, the rendezvous at the job's
# first node and the job id come from SLURM's variables; a step that cannot train as one job is refused.
if [[ -n "${SLURM_JOB_ID:-}" && -z "${TITANLITE_IGNORE_SLURM:-}" ]]; then
    slurm_settings=$(python -m titanlite.runtime.slurm) || exit 2
    eval "$slurm_settings"
fi

ngpu_given=${NGPU:+1}  # a default NGPU is the visible GPUs: only a given one can exceed them
if [[ -z "${NGPU:-}" ]]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    [[ "$NGPU" -gt 0 ]] || NGPU=2
fi
NNODES=${NNODES:-1}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}
# On one node a job id of its own (two jobs on one folder must not look like attempts of one run); several nodes
# share theirs, and each names it (or all keep this default).
if [[ "$NNODES" == 1 ]]; then RDZV_ID=${RDZV_ID:-titanlite-$$}; else RDZV_ID=${RDZV_ID:-titanlite}; fi
RDZV_JOIN_TIMEOUT=${RDZV_JOIN_TIMEOUT:-600}

whole "$NGPU" && [[ "$NGPU" -ge 1 ]] || die "NGPU=$NGPU is not valid: the processes on this node, a whole number >= 1 (e.g. NGPU=8)"
if [[ -n "$ngpu_given" && "${TITANLITE_DEVICE:-}" != cpu ]]; then  # NCCL: one GPU per process, never two on one
    gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    if [[ "$gpus" -gt 0 && "$NGPU" -gt "$gpus" ]]; then
        die "$(python -c "from titanlite.runtime.distributed import too_few_gpus; print(too_few_gpus($NGPU, $gpus))")"
    fi
fi
whole "$NNODES" && [[ "$NNODES" -ge 1 ]] || die "NNODES=$NNODES is not valid: the number of nodes, a whole number >= 1"
whole "$RDZV_JOIN_TIMEOUT" && [[ "$RDZV_JOIN_TIMEOUT" -ge 1 ]] || \
    die "RDZV_JOIN_TIMEOUT=$RDZV_JOIN_TIMEOUT is not valid: seconds to wait for every node at the rendezvous, a whole number >= 1"
whole "$MAX_RESTARTS" || die "MAX_RESTARTS=$MAX_RESTARTS is not valid: how often to restart failed workers, a whole number >= 0"
IFS=',' read -r -a log_ranks <<< "$LOG_RANK"
for r in ${log_ranks[@]+"${log_ranks[@]}"}; do
    whole "$r" && [[ "$r" -lt "$NGPU" ]] || \
        die "LOG_RANK=$LOG_RANK names no local rank: with NGPU=$NGPU the local ranks are 0 to $((NGPU - 1)) (e.g. LOG_RANK=0,1)"
done

# Check the configuration against the world size before starting any process.
TITANLITE_QUIET_CHECK=1 python -m titanlite.config --world-size $((NGPU * NNODES)) \
    --job.config_file "$CONFIG_FILE" ${args[@]+"${args[@]}"}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun forwards these to the workers, which save at the end of the step and exit 0.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}  # torchrun --signals-to-handle
if [[ "$MAX_RESTARTS" -gt 0 ]]; then
    # With torchrun's rendezvous store shared with the workers, a restarted worker can read the previous
    # attempt's addresses and fail to connect (pytorch#135712, #167288); give each attempt its own store.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
fi
# The workers write here how they ended (titanlite/runtime/exit_status.py): torchrun exits 1 after it forwarded a stop
# signal, even when every worker saved and exited 0, and then this script exits 0 instead; a worker's user error
# is printed once by the launcher, which exits 2. A temp folder that is full or read-only only loses this.
if TITANLITE_EXIT_STATUS_FILE=$(mktemp "${TMPDIR:-/tmp}/titanlite-exit.XXXXXX" 2> /dev/null); then
    export TITANLITE_EXIT_STATUS_FILE
    trap 'rm -f "$TITANLITE_EXIT_STATUS_FILE" "$TITANLITE_EXIT_STATUS_FILE".*' EXIT
else
    echo "run_train.sh: cannot create a file in ${TMPDIR:-/tmp}; workers' exit status is not recorded" >&2
    TITANLITE_EXIT_STATUS_FILE=""
fi

# torchrun (titanlite.cli.launch: torchrun's entry point with titanlite's endings and the hang watch, which runs
# there so that a frozen worker cannot stop it) runs in a session of its own, so that a terminal's Ctrl-C reaches
# only this script, which passes each signal on once; a second Ctrl-C kills the whole session. It is killed with
# this script however the script dies (kill -9 too), and the kernel kills its workers with it, frozen ones too.
python -m titanlite.cli.own_session $$ python -m titanlite.cli.launch --nnodes="$NNODES" --nproc_per_node="$NGPU" \
    --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="$RDZV_ID" --rdzv_conf="join_timeout=$RDZV_JOIN_TIMEOUT" \
    --max-restarts="$MAX_RESTARTS" --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
    -m titanlite.train --job.config_file "$CONFIG_FILE" ${args[@]+"${args[@]}"} &
torchrun_pid=$!
interrupts=0
forward() {
    if [[ "$1" == INT ]]; then
        interrupts=$((interrupts + 1))
        if [[ "$interrupts" -ge 2 ]]; then
            echo "run_train.sh: second Ctrl-C: stopping every process now, without saving" >&2
            kill -KILL -- "-$torchrun_pid" 2> /dev/null || kill -KILL "$torchrun_pid" 2> /dev/null || true
            exit 130
        fi
    fi
    kill -s "$1" "$torchrun_pid" 2> /dev/null || true
}
for sig in TERM INT HUP USR1 QUIT; do
    trap "forward $sig" "$sig"
done
rc=0
while true; do
    wait "$torchrun_pid" && rc=0 || rc=$?
    kill -0 "$torchrun_pid" 2> /dev/null || break  # a trapped signal interrupted `wait`: wait again
done
if [[ "$rc" -ne 0 ]] && grep -q '"status": "stopped"' "$TITANLITE_EXIT_STATUS_FILE" 2> /dev/null; then
    if [[ "${TITANLITE_NODE_ID:-0}" == 0 ]]; then  # (a SLURM job's first node speaks for all)
        echo "run_train.sh: the workers saved a checkpoint and exited 0 after the stop signal (torchrun's own exit" \
            "status $rc is its reaction to the signal); relaunch to resume" >&2
    fi
    rc=0
fi
exit "$rc"
