#!/usr/bin/env bash
# Launch titanlite training with torchrun.
#
#   ./run_train.sh [--config NAME|FILE] [--dry-run [--dry-run-gpu-mem-gib N]] [--section.key value ...]
#
# --dry-run checks the job and prints each rank's memory for NGPU x NNODES ranks without starting it
# (NGPU unset: the visible GPUs, else 8); exit status 0 fits, 1 does not fit, 2 config error.
#
# Environment:
#   CONFIG_FILE   TOML file (default train_configs/debug_model.toml); --config NAME wins over it
#   NGPU          processes on this node (default: visible GPUs, else 2 CPU processes)
#   NNODES        nodes (default 1); NODE_RANK is not needed: torchrun's rendezvous assigns ranks
#   RDZV_ENDPOINT host:port of the rendezvous (multi-node; default localhost:0 for one node)
#   RDZV_ID       job id shared by all nodes (default titanlite)
#   LOG_RANK      ranks whose output is shown (default 0; e.g. 0,1)
#   MAX_RESTARTS  torchrun --max-restarts (default 0)
set -euo pipefail
cd "$(dirname "$0")"

CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
args=()
dry_run=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --config) CONFIG_FILE="$2"; shift 2 ;;
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

if [[ -z "${NGPU:-}" ]]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    [[ "$NGPU" -gt 0 ]] || NGPU=2
fi
NNODES=${NNODES:-1}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}
RDZV_ID=${RDZV_ID:-titanlite}

# Check the configuration against the world size before starting any process.
TITANLITE_QUIET_CHECK=1 python -m titanlite.config --world-size $((NGPU * NNODES)) \
    --job.config_file "$CONFIG_FILE" ${args[@]+"${args[@]}"}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun forwards these to the workers; SIGUSR1 (a scheduler's "preempting soon") makes them save and exit.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}  # torchrun --signals-to-handle
if [[ "$MAX_RESTARTS" -gt 0 ]]; then
    # With torchrun's rendezvous store shared with the workers, a restarted worker can read the previous
    # attempt's addresses and fail to connect (pytorch#135712, #167288); give each attempt its own store.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
fi
exec torchrun --nnodes="$NNODES" --nproc_per_node="$NGPU" \
    --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="$RDZV_ID" \
    --max-restarts="$MAX_RESTARTS" --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
    -m titanlite.train --job.config_file "$CONFIG_FILE" ${args[@]+"${args[@]}"}
