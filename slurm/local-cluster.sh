#!/usr/bin/env bash
# A real one-node Slurm on this machine, for the harness's Slurm tests and for trying
# `harness submit --profile local`: munge, slurmctld and slurmd, no accounting.
#
#   slurm/local-cluster.sh up       install (apt, only if missing), configure, start; idempotent
#   slurm/local-cluster.sh down     stop the daemons this script started
#   slurm/local-cluster.sh status   exit 0 when the node answers and is usable, else 1
#
# Needs root and, to install, apt (Debian/Ubuntu packages slurm-wlm and munge). Each `up` that
# finds the cluster stopped starts from a fresh state directory ($HARNESS_SLURM_DIR, default
# /var/tmp/harness-slurm), so job ids restart at 1: use a fresh submitit folder per run.
# It writes /etc/slurm/slurm.conf, marked as its own, and refuses to replace one it did not write.
set -euo pipefail

STATE_DIR=${HARNESS_SLURM_DIR:-/var/tmp/harness-slurm}
CONF=/etc/slurm/slurm.conf
MARKER="# written by harness slurm/local-cluster.sh"
LOCK=/var/lock/harness-slurm.lock

die() { echo "local-cluster: $*" >&2; exit 1; }

need_root() { [[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts daemons)"; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "slurmctld, slurmd or munged missing and no apt-get to install them"
    echo "local-cluster: installing slurm-wlm and munge (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; } \
        || die "apt-get install slurm-wlm munge failed"
}

munge_up() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    munge_up && return
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key --force
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- munged --force 9>&-
    touch "$STATE_DIR/munged.started"  # `down` stops only a munged that `up` started
    for _ in $(seq 50); do munge_up && return; sleep 0.1; done
    die "munged did not start (see /var/log/munge/munged.log)"
}

write_config() {
    if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
        die "$CONF exists and was not written by this script; not replacing it"
    fi
    local host node
    host=$(hostname -s)
    node=$(slurmd -C | head -n 1)
    [[ $node == NodeName=* ]] || die "slurmd -C printed no NodeName line: $node"
    mkdir -p /etc/slurm
    cat >"$CONF.tmp" <<CONFIG
$MARKER
ClusterName=harness-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
MailProg=/bin/true
# Quick turnaround for tests: signals then SIGKILL 2 s apart, dead jobs leave the queue at once.
KillWait=2
MinJobAge=2
InactiveLimit=0
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd.log
$node State=UNKNOWN
# Cores may be shared by a few jobs: tests on two workers must not queue behind each other.
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONFIG
    mv "$CONF.tmp" "$CONF"
}

daemon_alive() {  # pid file of a daemon this script started
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

node_usable() {
    local state
    state=$(sinfo -h -N -o %t 2>/dev/null | head -n 1) || return 1
    [[ $state == idle* || $state == mix* || $state == alloc* ]]
}

up() {
    need_root
    install_packages
    exec 9>"$LOCK"
    flock 9
    if daemon_alive "$STATE_DIR/slurmctld.pid" && daemon_alive "$STATE_DIR/slurmd.pid" && node_usable; then
        echo "local-cluster: already up ($STATE_DIR)"
        return
    fi
    stop_daemons
    rm -rf "$STATE_DIR/state" "$STATE_DIR/spool" "$STATE_DIR"/*.log
    mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool"
    start_munge
    write_config
    slurmctld -i 9>&-  # the daemons must not hold the lock
    slurmd 9>&-
    for _ in $(seq 100); do
        if node_usable; then
            echo "local-cluster: up: partition debug, node $(hostname -s) ($STATE_DIR)"
            return
        fi
        sleep 0.2
    done
    die "the node did not become idle within 20 s: $(sinfo -h -N 2>&1 | head -n 3); see $STATE_DIR/*.log"
}

stop_daemons() {
    local name pidfile pid
    for name in slurmd slurmctld; do
        pidfile=$STATE_DIR/$name.pid
        daemon_alive "$pidfile" || continue
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    done
    if [[ -e $STATE_DIR/munged.started && -s /run/munge/munged.pid ]]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$STATE_DIR/munged.started"
    fi
    return 0
}

down() {
    need_root
    exec 9>"$LOCK"
    flock 9
    stop_daemons
    echo "local-cluster: down"
}

status() {
    if daemon_alive "$STATE_DIR/slurmctld.pid" && daemon_alive "$STATE_DIR/slurmd.pid" && node_usable; then
        sinfo
        return 0
    fi
    echo "local-cluster: not up"
    return 1
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
