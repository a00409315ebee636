#!/usr/bin/env bash
# A real one-machine SLURM cluster with two nodes (n1, n2), for the test suite (tests/test_slurm.py).
#
# Usage: tools/slurm_cluster.sh start DIR    start munged, slurmctld and two slurmd; print the
#                                            SLURM_CONF to export (DIR/slurm.conf)
#        tools/slurm_cluster.sh stop DIR     cancel every job, stop the daemons DIR's cluster
#                                            started (by their pid files), never others
#        tools/slurm_cluster.sh check        exit 0 when the binaries are installed, else say which
#                                            is missing and exit 1
#
# Everything lives under DIR: its own munge key and socket (the machine's munged, if any, is left
# alone), slurm.conf, pid files, spool and state directories, logs. Ports are free ones found at
# start. Needs root (SlurmUser=root; jobs run as the submitting user) and Debian's packages:
#   apt-get install -y slurmd slurmctld slurm-client munge
# The settings are those of docs/DESIGN.md section 6 (checked on a 2-core machine).
set -euo pipefail

BINARIES=(munged slurmctld slurmd sbatch srun scontrol scancel squeue sinfo)

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

find_binary() {
    # sbin directories are not on every PATH (a non-login root shell).
    command -v "$1" 2>/dev/null || { [[ -x /usr/sbin/$1 ]] && echo "/usr/sbin/$1"; } || true
}

check() {
    local missing=()
    for name in "${BINARIES[@]}"; do
        [[ -n $(find_binary "$name") ]] || missing+=("$name")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        echo "slurm_cluster.sh: not installed: ${missing[*]} (apt-get install -y slurmd slurmctld slurm-client munge)" >&2
        return 1
    fi
    if [[ $(id -u) -ne 0 ]]; then
        echo "slurm_cluster.sh: needs root (slurmd runs jobs as their user; SlurmUser=root)" >&2
        return 1
    fi
}

port_is_free() {
    # A refused connection means nothing listens there.
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_ports() {
    # $1 consecutive free ports from a pseudo-random start in 20000..59999, printed as "first".
    local count=$1 first attempt i ok
    for attempt in $(seq 1 200); do
        first=$((20000 + (RANDOM * 32768 + RANDOM + attempt) % 40000))
        ok=1
        for ((i = 0; i < count; i++)); do
            if ! port_is_free $((first + i)); then ok=0; break; fi
        done
        if [[ $ok == 1 ]]; then echo "$first"; return 0; fi
    done
    echo "slurm_cluster.sh: no $count free consecutive ports found" >&2
    return 1
}

wait_for() {
    # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds.
    local seconds=$1 what=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        if [[ $SECONDS -ge $deadline ]]; then
            echo "slurm_cluster.sh: $what did not come up within ${seconds}s; logs in $DIR/log" >&2
            tail -n 20 "$DIR"/log/*.log >&2 || true
            return 1
        fi
        sleep 0.5
    done
}

nodes_idle() {
    [[ $(SLURM_CONF=$DIR/slurm.conf "$(find_binary sinfo)" -h -N -o '%t' | sort -u | tr -d '\n') == idle ]]
}

start() {
    check
    mkdir -p "$DIR"/{log,state,munge}
    DIR=$(cd "$DIR" && pwd)
    if [[ -f $DIR/slurmctld.pid ]] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
        echo "slurm_cluster.sh: a cluster already runs from $DIR (stop it first)" >&2
        return 1
    fi
    local host
    host=$(hostname -s)
    # munge: a key of this cluster's own, root's like the daemon (it refuses a key others can read).
    if [[ ! -f $DIR/munge/munge.key ]]; then
        head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    fi
    chmod 0700 "$DIR/munge"
    chmod 0400 "$DIR/munge/munge.key"
    "$(find_binary munged)" --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
    local ctld_port node_port
    ctld_port=$(free_ports 1)
    node_port=$(free_ports 2)
    cat >"$DIR/slurm.conf" <<EOF
# Written by tools/slurm_cluster.sh: a one-machine cluster with two nodes.
ClusterName=dstree
SlurmctldHost=$host
SlurmctldPort=$ctld_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdSpoolDir=$DIR/spool-%n
StateSaveLocation=$DIR/state
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
JobRequeue=1
KillWait=30
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=n[1-2] NodeHostname=$host Port=$node_port-$((node_port + 1)) CPUs=1 RealMemory=10000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF=$DIR/slurm.conf
    # -i: ignore (and clear) any state a previous cluster left in DIR/state.
    "$(find_binary slurmctld)" -i
    wait_for 30 slurmctld "$(find_binary scontrol)" ping
    for node in n1 n2; do
        "$(find_binary slurmd)" -N "$node"
    done
    wait_for 60 "the nodes" nodes_idle
    echo "$DIR/slurm.conf"
}

stop_pid_file() {
    # Stop the daemon whose pid DIR's pid file holds (SIGTERM, then SIGKILL after 10 s).
    local file=$1 pid
    [[ -f $file ]] || return 0
    pid=$(cat "$file")
    if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

job_processes() {
    # Processes of this cluster's jobs: SLURM_JOB_ID and this cluster's SLURM_CONF in their environment.
    local environ pid
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}
        pid=${pid%/environ}
        if tr '\0' '\n' 2>/dev/null <"$environ" | grep -qx "SLURM_CONF=$DIR/slurm.conf" &&
            tr '\0' '\n' 2>/dev/null <"$environ" | grep -q '^SLURM_JOB_ID='; then
            echo "$pid"
        fi
    done
}

stop() {
    [[ -d $DIR ]] || return 0
    DIR=$(cd "$DIR" && pwd)
    export SLURM_CONF=$DIR/slurm.conf
    if [[ -f $DIR/slurmctld.pid ]] && [[ -n $(find_binary scancel) ]]; then
        # Every job of this cluster, then a moment for their steps to end before slurmd goes.
        "$(find_binary scancel)" --full --signal=KILL --quiet -u "$(id -un)" 2>/dev/null || true
        "$(find_binary scancel)" --quiet -u "$(id -un)" 2>/dev/null || true
        for _ in $(seq 1 50); do
            [[ -z $("$(find_binary squeue)" -h -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
    # proctrack/linuxproc follows parent links only: a process whose parent died (a rank whose torchrun
    # was killed) escapes the job's clean-up. Such processes still carry the job's environment.
    local pid
    for pid in $(job_processes); do
        kill -9 "$pid" 2>/dev/null || true
    done
    for file in "$DIR"/slurmd-*.pid; do
        [[ -e $file ]] && stop_pid_file "$file"
    done
    stop_pid_file "$DIR/slurmctld.pid"
    stop_pid_file "$DIR/munge/munged.pid"
}

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    usage >&2
    exit 2
fi
case $1 in
    check) check ;;
    start | stop)
        if [[ $# -ne 2 ]]; then
            usage >&2
            exit 2
        fi
        DIR=$2
        "$1"
        ;;
    *)
        usage >&2
        exit 2
        ;;
esac
