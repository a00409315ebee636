#!/usr/bin/env bash
# Launch ds_tree training with the DeepSpeed launcher, on one machine or (with HOSTFILE) several.
#
# Usage: launch/train.sh CONFIG.yaml [key=value ...]
#
# Environment (defaults in brackets; docs/LAUNCH.md has the full table):
#   NGPU         ranks per node [GPUs listed by nvidia-smi; 2 without a GPU: the CPU quickstart]
#   NNODES       nodes [1]; more than 1 needs HOSTFILE
#   HOSTFILE     DeepSpeed hostfile ("host slots=N" per line) for multi-node runs [unset]
#   MASTER_ADDR  address of rank 0 [unset: the launcher picks it]
#   MASTER_PORT  port of rank 0 [29500]
#   SP_SIZE      ranks per sequence-parallel group: adds parallel.sequence_parallel_size=SP_SIZE
#                (a multiple of it must make up the world size) [unset: the config's]
#   DEEPSPEED    launcher binary [.venv/bin/deepspeed if it exists, else deepspeed]
#   PYTHON       interpreter of the dry run [.venv/bin/python if it exists, else python3]
#   DRY_RUN=1    validate the config (the trainer's dry run, with WORLD_SIZE=NGPU*NNODES),
#                print the launch command, exit without launching
#
# CONFIG is taken relative to the directory you call from; other relative paths (in the config and
# the overrides) are resolved against the repository root: the script runs from there.
#
# Signals: SIGTERM, SIGINT and SIGUSR1 to this script (SIGHUP as SIGTERM) are forwarded to the
# ranks, which save a checkpoint of their current step and exit 75 (checkpoint.preempt_signals;
# docs/LAUNCH.md); the script waits for them and exits with the launcher's code, never 0 while a
# rank did not finish. With HOSTFILE (pdsh) the signal goes to the DeepSpeed launcher, which kills
# the remote ranks without a checkpoint.
set -euo pipefail

usage() {
    # The header comment above, without its '#'.
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

if [[ $# -ge 1 && ($1 == -h || $1 == --help) ]]; then
    usage
    exit 0
fi
if [[ $# -lt 1 ]]; then
    usage >&2
    exit 2
fi
CONFIG=$1
shift

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ! -f $CONFIG ]]; then
    echo "train.sh: $CONFIG: no such config file (a relative path is taken from $PWD)" >&2
    exit 2
fi
# The caller's file, also after the cd below (shown as given when called from the repository).
if [[ $CONFIG != /* && $PWD != "$REPO_DIR" ]]; then
    CONFIG=$PWD/$CONFIG
fi
cd "$REPO_DIR"

# GPUs on this machine: 0 when nvidia-smi is absent or lists none.
DETECTED_GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
    DETECTED_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [[ $DETECTED_GPUS -gt 0 ]]; then
    NGPU=${NGPU:-$DETECTED_GPUS}
else
    NGPU=${NGPU:-2}
    # CPU: one thread per rank (2.5x faster with 2 ranks on 2 cores), and a cache for the
    # shared-memory comm op DeepSpeed builds on the first run (~30 s).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$REPO_DIR/.cache/torch_extensions}
fi
# Models and tokenizers are local; nothing is ever downloaded from a hub.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

NNODES=${NNODES:-1}
HOSTFILE=${HOSTFILE:-}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-29500}
DRY_RUN=${DRY_RUN:-0}
if [[ -z ${DEEPSPEED:-} ]]; then
    if [[ -x .venv/bin/deepspeed ]]; then DEEPSPEED=.venv/bin/deepspeed; else DEEPSPEED=deepspeed; fi
fi
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

if ! [[ $NGPU =~ ^[1-9][0-9]*$ && $NNODES =~ ^[1-9][0-9]*$ ]]; then
    echo "train.sh: NGPU and NNODES must be positive integers (got NGPU=$NGPU NNODES=$NNODES)" >&2
    exit 2
fi
if [[ $NNODES -gt 1 && -z $HOSTFILE ]]; then
    echo "train.sh: NNODES=$NNODES needs HOSTFILE (one 'host slots=$NGPU' line per node)" >&2
    exit 2
fi
if [[ -n $HOSTFILE && ! -f $HOSTFILE ]]; then
    echo "train.sh: HOSTFILE=$HOSTFILE: no such file" >&2
    exit 2
fi
if ! [[ $MASTER_PORT =~ ^[1-9][0-9]{0,4}$ && $MASTER_PORT -le 65535 ]]; then
    echo "train.sh: MASTER_PORT must be an integer in 1..65535 (got MASTER_PORT=$MASTER_PORT)" >&2
    exit 2
fi
if [[ -n ${SP_SIZE:-} ]]; then
    if ! [[ $SP_SIZE =~ ^[1-9][0-9]*$ ]]; then
        echo "train.sh: SP_SIZE must be a positive integer (got SP_SIZE=$SP_SIZE)" >&2
        exit 2
    fi
    # Last, so it overrides the config and any parallel.sequence_parallel_size given on the command line.
    set -- "$@" "parallel.sequence_parallel_size=$SP_SIZE"
fi

launch=("$DEEPSPEED")
if [[ -n $HOSTFILE ]]; then
    launch+=(--hostfile "$HOSTFILE" --num_nodes "$NNODES")
fi
launch+=(--num_gpus "$NGPU" --master_port "$MASTER_PORT")
if [[ -n $MASTER_ADDR ]]; then
    launch+=(--master_addr "$MASTER_ADDR")
fi
launch+=(--module ds_tree.train --config "$CONFIG" "$@")

if [[ $DRY_RUN == 1 ]]; then
    WORLD_SIZE=$((NGPU * NNODES))
    echo "train.sh: dry run: validating $CONFIG for $WORLD_SIZE ranks ($NNODES node(s) x $NGPU)"
    # RANK too, as a launcher would set it (the dry run reads WORLD_SIZE).
    RANK=0 LOCAL_RANK=0 WORLD_SIZE=$WORLD_SIZE "$PYTHON" -m ds_tree.train --config "$CONFIG" --dry-run "$@"
    echo "train.sh: dry run: would run (in $REPO_DIR):"
    command_line=$(printf ' %q' "${launch[@]}")
    echo "${command_line:1}"
    exit 0
fi

# Not exec: the DeepSpeed launcher exits on SIGTERM while its ranks train on (reparented), and exits
# 0 when its per-node launcher is killed. It runs in a session of its own, so signals to this
# script's process group (a terminal's Ctrl-C, timeout, kill -- -PGID) reach it only through here.
setsid --wait "${launch[@]}" &
LAUNCHER_PID=$!

rank_pids() {
    # The ranks (python -m ds_tree.train) in the launcher's session, also once their launch process is gone
    # and they were reparented; not the launcher, its launch processes, nor what a rank starts itself
    # (torch.compile's compile workers: on a GPU they outlive a preempted rank by a moment, and taken for
    # ranks they made a run that saved its checkpoint and exited 75 look unfinished).
    local ranks children pid
    ranks=$(pgrep -s "$LAUNCHER_PID" -f -- '-m ds_tree[.]train( |$)' || true)
    children=" $(pgrep -P "$LAUNCHER_PID" | tr '\n' ' ') "
    for pid in $ranks; do
        if [[ $pid != "$LAUNCHER_PID" && $children != *" $pid "* ]]; then echo "$pid"; fi
    done
}

FORWARDED=
# shellcheck disable=SC2329 # called by the traps below
forward() {
    local signal=$1 ranks
    FORWARDED=$signal
    ranks=$(rank_pids | tr '\n' ' ')
    if [[ -n $HOSTFILE || -z ${ranks// /} ]]; then
        # pdsh: only the launcher reaches the remote ranks; or no rank has started yet.
        echo "train.sh: SIG$signal: forwarded to the launcher (pid $LAUNCHER_PID)" >&2
        kill -s "$signal" "$LAUNCHER_PID" 2>/dev/null || true
    else
        echo "train.sh: SIG$signal: forwarded to the ranks (pids ${ranks% }); waiting for them" >&2
        # shellcheck disable=SC2086 # one pid a word
        kill -s "$signal" $ranks 2>/dev/null || true
    fi
    return 0
}
trap 'forward TERM' TERM HUP
trap 'forward INT' INT
trap 'forward USR1' USR1

# wait returns early (over 128) when a trapped signal arrives: wait again until the launcher is done.
SIGNALLED=
while :; do
    FORWARDED=
    status=0
    wait "$LAUNCHER_PID" || status=$?
    [[ -n $FORWARDED ]] || break
    SIGNALLED=$FORWARDED
done

# Ranks the launcher left behind (its per-node launcher was killed): stop them with a checkpoint
# (SIGTERM), wait for them, and fail whatever the launcher said.
leftover=$(rank_pids | tr '\n' ' ')
if [[ -n ${leftover// /} ]]; then
    echo "train.sh: the launcher exited ($status) while ranks still ran (pids ${leftover% }): sending them" \
        "SIGTERM (they save their step and exit); waiting for them" >&2
    # shellcheck disable=SC2086 # one pid a word
    kill -s TERM $leftover 2>/dev/null || true
    while [[ -n $(pgrep -s "$LAUNCHER_PID" || true) ]]; do
        sleep 0.5
    done
    echo "train.sh: failed: the launcher did not see its ranks finish" >&2
    exit 1
fi
if [[ -n $SIGNALLED && $status -eq 0 ]]; then
    echo "train.sh: SIG$SIGNALLED was forwarded, and the ranks finished the run" >&2
fi
exit "$status"
