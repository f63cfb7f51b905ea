#!/usr/bin/env bash
# A real two-node SLURM cluster on this host, for the tests (tests/slurm_cluster.py) and for trying the
# scripts/slurm_*.sbatch jobs by hand:
#
#   bash scripts/slurm_test_cluster.sh --install-only   # apt-get install slurm-wlm munge if absent (root)
#   bash scripts/slurm_test_cluster.sh start DIR        # munged, slurmctld, slurmd -N n1, slurmd -N n2
#   SLURM_CONF=DIR/slurm.conf sbatch --gpus-per-node=0 ... scripts/slurm_gpt_2bw.sbatch
#   bash scripts/slurm_test_cluster.sh stop DIR         # ends the daemons it started (their pids)
#
# Everything lives in DIR (configuration, munge key and socket, state, spool, logs, pid files); nothing of
# the host's own SLURM or munge set-up is read or changed. The nodes n1 and n2 are this host (NodeAddr
# the loopback address, one port each); their names are added to /etc/hosts only when they do not resolve (root).
# A requeued job waits cred_expire (here 5 s, SLURM's default 120 s) before it starts again.
# Exit status: 0 done; 3 not possible here (not root, packages missing and not installable), one line why.
set -euo pipefail
NODES=(n1 n2)
CPUS_PER_NODE=${CPUS_PER_NODE:-4}
LOOPBACK=$(getent ahostsv4 localhost 2>/dev/null | awk 'NR==1 {print $1}')
LOOPBACK=${LOOPBACK:-localhost}
START_TIMEOUT=${START_TIMEOUT:-60}

cannot() { echo "slurm_test_cluster: $*" >&2; exit 3; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return 0
  fi
  [[ $(id -u) == 0 ]] || cannot "slurm-wlm/munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || cannot "slurm-wlm/munge are not installed and there is no apt-get"
  local t0=$SECONDS
  # policy-rc.d-less containers would start the packages' own services: the tests run their own daemons
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge \
       >/tmp/slurm_test_cluster.apt.log 2>&1; then
    apt-get update -q >/dev/null 2>&1 || cannot "apt-get update failed (no package source reachable)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge \
      >/tmp/slurm_test_cluster.apt.log 2>&1 || cannot "apt-get install slurm-wlm munge failed (/tmp/slurm_test_cluster.apt.log)"
  fi
  echo "slurm_test_cluster: installed slurm-wlm and munge in $((SECONDS - t0)) s" >&2
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])'; }

resolve_nodes() {
  local missing=()
  for n in "${NODES[@]}"; do getent hosts "$n" >/dev/null || missing+=("$n"); done
  (( ${#missing[@]} == 0 )) && return 0
  [[ $(id -u) == 0 && -w /etc/hosts ]] || cannot "node names ${missing[*]} do not resolve and /etc/hosts is not writable"
  echo "$LOOPBACK ${missing[*]}  # slurm_test_cluster.sh" >> /etc/hosts
}

write_conf() {  # DIR
  local d=$1 host
  host=$(hostname -s)
  mkdir -p "$d/state" "$d/spool" "$d/log"
  cat > "$d/slurm.conf.tmp" <<EOF
ClusterName=m2bwtest
SlurmctldHost=$host($LOOPBACK)
SlurmctldPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/munge.socket,cred_expire=5
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool/%n
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.%n.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
MinJobAge=600
SlurmdTimeout=60
SchedulerParameters=sched_interval=2,bf_interval=1
InactiveLimit=0
EOF
  for n in "${NODES[@]}"; do
    echo "NodeName=$n NodeHostname=$host NodeAddr=$LOOPBACK Port=$(free_port) CPUs=$CPUS_PER_NODE RealMemory=4000 State=UNKNOWN" \
      >> "$d/slurm.conf.tmp"
  done
  echo "PartitionName=test Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >> "$d/slurm.conf.tmp"
  mv "$d/slurm.conf.tmp" "$d/slurm.conf"
}

wait_idle() {  # DIR
  local deadline=$((SECONDS + START_TIMEOUT)) states
  while :; do
    states=$(SLURM_CONF="$1/slurm.conf" sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)
    [[ $(grep -c ' idle$' <<<"$states") == "${#NODES[@]}" ]] && return 0
    (( SECONDS < deadline )) || cannot "nodes not idle after $START_TIMEOUT s: ${states:-no answer} (logs in $1/log)"
    sleep 0.3
  done
}

start() {  # DIR
  local d=$1 t0=$SECONDS
  [[ $(id -u) == 0 ]] || cannot "the test cluster runs its daemons as root (SlurmUser=root): not root"
  install
  resolve_nodes
  mkdir -p "$d" && chmod 700 "$d"
  write_conf "$d"
  dd if=/dev/urandom of="$d/munge.key" bs=1024 count=1 status=none && chmod 400 "$d/munge.key"
  munged --force --key-file="$d/munge.key" --socket="$d/munge.socket" --pid-file="$d/munged.pid" \
    --log-file="$d/log/munged.log" --seed-file="$d/munged.seed"
  export SLURM_CONF=$d/slurm.conf
  slurmctld -f "$SLURM_CONF"
  for n in "${NODES[@]}"; do slurmd -f "$SLURM_CONF" -N "$n"; done
  wait_idle "$d"
  echo "slurm_test_cluster: nodes ${NODES[*]} idle after $((SECONDS - t0)) s (SLURM_CONF=$SLURM_CONF)" >&2
}

stop() {  # DIR: the daemons whose pid files DIR holds, newest first
  local d=$1 pids=() f pid
  for f in "$d"/slurmd.*.pid "$d/slurmctld.pid" "$d/munged.pid"; do
    [[ -f "$f" ]] || continue
    pid=$(cat "$f")
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && pids+=("$pid") && kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    (( alive )) || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}

case "${1:-}" in
  --install-only) install ;;
  start) start "${2:?usage: slurm_test_cluster.sh start DIR}" ;;
  stop) stop "${2:?usage: slurm_test_cluster.sh stop DIR}" ;;
  *) echo "usage: slurm_test_cluster.sh --install-only | start DIR | stop DIR" >&2; exit 2 ;;
esac
