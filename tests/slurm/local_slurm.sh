#!/usr/bin/env bash
# A small SLURM cluster on this one machine (default 2 nodes), for the `slurm` tests and for trying
# the slurm profile by hand, multi-node jobs included.
#
#   tests/slurm/local_slurm.sh start   install (Debian's slurm-wlm + munge) if missing, write a
#                                      private slurm.conf, start munged, slurmctld and one slurmd
#                                      per node, wait until every node is idle, print
#                                      `export SLURM_CONF=...`
#   tests/slurm/local_slurm.sh stop    stop exactly the daemons `start` started, remove its state
#                                      and its /etc/hosts lines
#   tests/slurm/local_slurm.sh status  the nodes (sinfo through the private config) and our daemons
#
# Nodes: LOCAL_SLURM_NODES (default 2) nodes llmnode1, llmnode2, ..., each its own slurmd
# (`slurmd -N llmnodeK`) on port LOCAL_SLURM_SLURMD_PORT+K-1 (default 6818, 6819, ...), all at
# 127.0.0.1, with its own spool directory, pid file and log (%n in slurm.conf). A job asking for
# `--nodes=2` gets two SLURM nodes and srun starts one task in each slurmd: real multi-node launch
# and rendezvous, on one kernel. The launcher takes the first node's name as MASTER_ADDR, so the
# names must resolve: `start` adds one `127.0.0.1 llmnodeK` line per node to /etc/hosts, marked with
# a comment, and `stop` removes exactly the marked lines.
#
# Idempotent: `start` on a running cluster only checks it; `stop` without one does nothing. State,
# spool, logs and pid files live in $LOCAL_SLURM_DIR (default /tmp/llm-lifecycle-slurm). slurm.conf
# goes to /etc/slurm/slurm.conf, where every client finds it: the executor plugin clears SLURM_*
# variables (SLURM_CONF among them) before the srun of a job step. An existing slurm.conf that this
# script did not write (a real cluster's) is never touched: `start` refuses; so does `start` while
# our daemons run with a different configuration (another node count: `stop` first). A munged that
# was already running is used and left running. The machines this runs on have no systemd, so the
# daemons are started by hand (munged as user munge with /run/munge owned by munge).
# Each node declares more CPUs and memory than the machine may have (SlurmdParameters=
# config_overrides; LOCAL_SLURM_CPUS, default 16, and LOCAL_SLURM_MEMORY_MB, default 64000, per
# node), so that two 2-task training jobs can be scheduled side by side on 2 cores.
set -euo pipefail

DIR=${LOCAL_SLURM_DIR:-/tmp/llm-lifecycle-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by llm-lifecycle tests/slurm/local_slurm.sh"
HOSTS=/etc/hosts
HOSTS_MARK="# llm-lifecycle tests/slurm/local_slurm.sh node"  # ends each line `start` adds to $HOSTS
NODES=${LOCAL_SLURM_NODES:-2}
NODE_CPUS=${LOCAL_SLURM_CPUS:-16}
NODE_MEMORY_MB=${LOCAL_SLURM_MEMORY_MB:-64000}
SLURMD_PORT=${LOCAL_SLURM_SLURMD_PORT:-6818}
export SLURM_CONF=$CONF

log() { echo "local_slurm: $*" >&2; }

case "$NODES" in
    '' | *[!0-9]* | 0*) log "LOCAL_SLURM_NODES must be a positive number, not '$NODES'"; exit 2 ;;
esac
node_names() { local i; for i in $(seq "$NODES"); do echo "llmnode$i"; done; }

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

# the slurmd pid files of the configured nodes
slurmd_pids() { local n; for n in $(node_names); do echo "$DIR/slurmd-$n.pid"; done; }

all_alive() {
    local f
    alive "$DIR/slurmctld.pid" || return 1
    for f in $(slurmd_pids); do alive "$f" || return 1; done
}

any_alive() {
    local f
    for f in "$DIR/slurmctld.pid" "$DIR"/slurmd-*.pid "$DIR/slurmd.pid"; do alive "$f" && return 0; done
    return 1
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return  # a working munged (ours from an earlier start, or the machine's own)
    fi
    [ -s /etc/munge/munge.key ] || { mungekey --create --force 2>/dev/null || \
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid 9>&-  # 9: the lock, not theirs
    cp /run/munge/munged.pid "$DIR/munged.pid"  # ours: `stop` ends it
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    log "munged did not answer"; exit 1
}

# slurm.conf on stdout
render_conf() {
    local host i=0 n
    host=$(hostname -s)
    # MinJobAge: finished jobs stay visible to squeue (the executor's status command without
    # accounting) for 5 minutes. KillWait: a job over its time limit is killed 5 s after SIGTERM.
    # %n: the node name, so that every slurmd has its own spool directory, pid file and log.
    cat <<EOF
$MARK
ClusterName=llmlocal
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldPort=${LOCAL_SLURM_CTLD_PORT:-6817}
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
EOF
    for n in $(node_names); do
        echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i))" \
             "CPUs=$NODE_CPUS RealMemory=$NODE_MEMORY_MB State=UNKNOWN"
        i=$((i + 1))
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

check_conf_is_ours() {
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        log "$CONF exists and was not written by this script (a real cluster's?); not touching it"
        exit 1
    fi
}

write_conf() {
    local n
    mkdir -p "$DIR/state" "$DIR/log" /etc/slurm
    for n in $(node_names); do mkdir -p "$DIR/spool/$n"; done
    check_conf_is_ours
    render_conf >"$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
}

# $HOSTS rewritten as a whole: to a temporary file beside it, then renamed over it (atomic); where
# /etc/hosts is a bind mount (containers) rename fails, then the content is copied in place.
replace_hosts() {
    local new=$1
    chmod --reference="$HOSTS" "$new" 2>/dev/null || chmod 644 "$new"
    if ! mv -f "$new" "$HOSTS" 2>/dev/null; then
        cat "$new" >"$HOSTS"
        rm -f "$new"
    fi
}

# one `127.0.0.1 llmnodeK` line per node that has none of ours yet (so no duplicates on a second start)
add_hosts() {
    local n missing=() tmp
    for n in $(node_names); do
        grep -qE "^127\.0\.0\.1[[:space:]]+$n[[:space:]]+$HOSTS_MARK\$" "$HOSTS" || missing+=("$n")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    tmp=$(mktemp "$HOSTS.local_slurm.XXXXXX")
    cat "$HOSTS" >"$tmp"
    [ -z "$(tail -c1 "$tmp")" ] || echo >>"$tmp"  # the last line may lack its newline
    for n in "${missing[@]}"; do echo "127.0.0.1 $n $HOSTS_MARK" >>"$tmp"; done
    replace_hosts "$tmp"
    log "added ${missing[*]} to $HOSTS"
}

# remove exactly the lines add_hosts wrote (whatever the node count was then)
remove_hosts() {
    local tmp
    grep -qF "$HOSTS_MARK" "$HOSTS" 2>/dev/null || return 0
    tmp=$(mktemp "$HOSTS.local_slurm.XXXXXX")
    grep -vE "^127\.0\.0\.1[[:space:]]+llmnode[0-9]+[[:space:]]+$HOSTS_MARK\$" "$HOSTS" >"$tmp" || true
    replace_hosts "$tmp"
    log "removed the llmnode lines from $HOSTS"
}

wait_idle() {
    local states ready
    for _ in $(seq 120); do
        # one line per node; `idle*` (not responding) and `down`/`unknown` are not ready
        states=$(sinfo -h -N -o "%N %T" 2>/dev/null || true)
        ready=$(echo "$states" | grep -cE '^llmnode[0-9]+ (idle|mixed|allocated)$' || true)
        if [ "$ready" -eq "$NODES" ] && [ "$(echo "$states" | grep -c .)" -eq "$NODES" ]; then
            log "$NODES node(s) up: $(echo "$states" | tr '\n' ' ')"
            return
        fi
        sleep 0.5
    done
    log "not every node became idle; see $DIR/log"; sinfo -N -l >&2 || true; exit 1
}

start() {
    local n
    install_packages
    check_conf_is_ours
    mkdir -p "$DIR"
    if any_alive && ! { [ -f "$CONF" ] && cmp -s "$CONF" <(render_conf); }; then
        log "a cluster of ours runs with another configuration (LOCAL_SLURM_NODES?); run '$0 stop' first"
        exit 1
    fi
    add_hosts
    if all_alive; then
        wait_idle
        echo "export SLURM_CONF=$CONF"
        return
    fi
    start_munge
    write_conf
    alive "$DIR/slurmctld.pid" || /usr/sbin/slurmctld -f "$CONF" -i 9>&-  # -i: ignore stale state
    for n in $(node_names); do
        alive "$DIR/slurmd-$n.pid" || /usr/sbin/slurmd -f "$CONF" -N "$n" 9>&-
    done
    wait_idle
    echo "export SLURM_CONF=$CONF"
}

stop_pid() {
    local pid
    alive "$1" || return 0
    pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
}

stop() {
    local f
    if [ ! -d "$DIR" ]; then
        # nothing of ours runs; lines left in /etc/hosts by an interrupted run go, unless a cluster
        # of ours with another LOCAL_SLURM_DIR still owns slurm.conf (and needs them)
        { [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; } || remove_hosts
        return 0
    fi
    scancel --quiet --user "$(id -un)" 2>/dev/null || true
    # every slurmd pid file there is (slurmd.pid: a one-node cluster of an older version of this script)
    for f in "$DIR"/slurmd-*.pid "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
        stop_pid "$f"
    done
    rm -rf "$DIR"
    if [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; then rm -f "$CONF"; fi
    remove_hosts
}

status() {
    local f rc=0
    sinfo -N -l || rc=1
    for f in "$DIR/slurmctld.pid" $(slurmd_pids); do
        if alive "$f"; then echo "$(basename "$f" .pid): running (pid $(cat "$f"))"
        else echo "$(basename "$f" .pid): not running"; rc=1; fi
    done
    return $rc
}

# one start or stop at a time: two starts (a test fixture beside CI's) must not both write the
# config or /etc/hosts. The daemons are started with fd 9 closed, so that they do not hold the lock.
lock() { exec 9>"/tmp/llm-lifecycle-local-slurm.lock"; flock 9; }

case "${1:-}" in
    start) lock; start ;;
    stop) lock; stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
