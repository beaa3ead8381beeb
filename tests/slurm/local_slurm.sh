#!/usr/bin/env bash
# A one-node SLURM on this machine, for the `slurm` tests and for trying the slurm profile by hand.
#
#   tests/slurm/local_slurm.sh start   install (Debian's slurm-wlm + munge) if missing, write a
#                                      private slurm.conf, start munged/slurmctld/slurmd, wait until
#                                      the node is idle, print `export SLURM_CONF=...`
#   tests/slurm/local_slurm.sh stop    stop exactly the daemons `start` started, remove its state
#   tests/slurm/local_slurm.sh status  sinfo through the private config
#
# Idempotent: `start` on a running cluster only checks it; `stop` without one does nothing. State,
# spool, logs and pid files live in $LOCAL_SLURM_DIR (default /tmp/llm-lifecycle-slurm). slurm.conf
# goes to /etc/slurm/slurm.conf, where every client finds it: the executor plugin clears SLURM_*
# variables (SLURM_CONF among them) before the srun of a job step. An existing slurm.conf that this
# script did not write (a real cluster's) is never touched: `start` refuses. A munged that was
# already running is used and left running. The machines this runs on have no systemd,
# so the daemons are started by hand (munged as user munge with /run/munge owned by munge).
# The node declares more CPUs and memory than the machine may have (SlurmdParameters=
# config_overrides), so that two 2-task training jobs can be scheduled side by side on 2 cores.
set -euo pipefail

DIR=${LOCAL_SLURM_DIR:-/tmp/llm-lifecycle-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by llm-lifecycle tests/slurm/local_slurm.sh"
NODE_CPUS=${LOCAL_SLURM_CPUS:-16}
NODE_MEMORY_MB=${LOCAL_SLURM_MEMORY_MB:-64000}
export SLURM_CONF=$CONF

log() { echo "local_slurm: $*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    log "installing slurm-wlm and munge (Debian packages)"
    [ "$(id -u)" = 0 ] || { log "installing packages needs root (apt-get)"; exit 1; }
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return  # a working munged (ours from an earlier start, or the machine's own)
    fi
    [ -s /etc/munge/munge.key ] || { mungekey --create --force 2>/dev/null || \
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$DIR/munged.pid"  # ours: `stop` ends it
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    log "munged did not answer"; exit 1
}

write_conf() {
    local host
    host=$(hostname -s)
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" /etc/slurm
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        log "$CONF exists and was not written by this script (a real cluster's?); not touching it"
        exit 1
    fi
    # MinJobAge: finished jobs stay visible to squeue (the executor's status command without
    # accounting) for 5 minutes. KillWait: a job over its time limit is killed 5 s after SIGTERM.
    cat >"$CONF.tmp" <<EOF
$MARK
ClusterName=llmlocal
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${LOCAL_SLURM_CTLD_PORT:-6817}
SlurmdPort=${LOCAL_SLURM_SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=300
KillWait=5
OverTimeLimit=0
InactiveLimit=0
SlurmdParameters=config_overrides
NodeName=$host CPUs=$NODE_CPUS RealMemory=$NODE_MEMORY_MB State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

wait_idle() {
    for _ in $(seq 120); do
        state=$(sinfo -h -o %T 2>/dev/null | head -1 || true)
        case "$state" in idle|mixed|allocated) log "node is $state"; return ;; esac
        sleep 0.5
    done
    log "the node did not become idle; see $DIR/log"; sinfo -N -l >&2 || true; exit 1
}

start() {
    install_packages
    mkdir -p "$DIR"
    if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid"; then
        wait_idle
        echo "export SLURM_CONF=$CONF"
        return
    fi
    start_munge
    write_conf
    alive "$DIR/slurmctld.pid" || /usr/sbin/slurmctld -f "$CONF" -i  # -i: ignore stale state
    alive "$DIR/slurmd.pid" || /usr/sbin/slurmd -f "$CONF"
    wait_idle
    echo "export SLURM_CONF=$CONF"
}

stop() {
    [ -d "$DIR" ] || return 0
    scancel --quiet --user "$(id -un)" 2>/dev/null || true
    for daemon in slurmd slurmctld munged; do
        if alive "$DIR/$daemon.pid"; then
            pid=$(cat "$DIR/$daemon.pid")
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        fi
    done
    rm -rf "$DIR"
    if [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; then rm -f "$CONF"; fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) sinfo -N -l ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
