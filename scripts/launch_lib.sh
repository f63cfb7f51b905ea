# Shell functions shared by run_local.sh, demo.sh and slurm_launch.sh (sourced, not run).

# gpu_count PYTHON: torch's CUDA device count; 0 without importing torch (1-3 s) on a host with no GPU device
# node at all (NVIDIA /dev/nvidiaN, ROCm /dev/kfd, WSL /dev/dxg), where torch could find none either.
gpu_count() {
  if compgen -G '/dev/nvidia[0-9]*' >/dev/null || [[ -e /dev/kfd || -e /dev/dxg ]]; then
    "$1" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
  else
    echo 0
  fi
}

# torchrun_signal_flags PYTHON SHUTDOWN_TIMEOUT WHO: the signal flags this torch's torchrun accepts,
# one word per line. --signals-to-handle (torch >= 2.9) lets SIGUSR1 reach the trainers and
# --shutdown-timeout (the 2026 releases) bounds their save; an older torchrun rejects both at argument
# parsing, so each is passed only when `torchrun --help` lists it, and a missing one is said on stderr.
torchrun_signal_flags() {
  local help
  help=$("$1" -m torch.distributed.run --help 2>/dev/null || true)
  if grep -q -- '--signals-to-handle' <<<"$help"; then
    printf '%s\n' --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
  else
    echo "$3: this torchrun has no --signals-to-handle (torch < 2.9): it forwards SIGTERM, SIGINT, SIGHUP and" \
         "SIGQUIT to the trainers, not SIGUSR1" >&2
  fi
  if grep -q -- '--shutdown-timeout' <<<"$help"; then
    printf '%s\n' --shutdown-timeout "$2"
  else
    echo "$3: this torchrun has no --shutdown-timeout: after a signal the trainers get its built-in 30 s to save," \
         "not $2 s" >&2
  fi
}

# route_ifname HOST [PEER]: the network interface this node uses to reach HOST; when HOST is this node
# (a local route, "dev lo"), the one it uses to reach PEER instead. "lo" only for a HOST alone (a
# one-node job); empty when it cannot be told (no getent/ip, an unresolvable name).
route_ifname() {
  local host dev ip seen=""
  for host in "$@"; do
    ip=$(getent ahostsv4 "$host" 2>/dev/null | awk 'NR==1 {print $1}')
    [[ -n "$ip" ]] || continue
    dev=$(ip -o route get "$ip" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' | head -1)
    if [[ -n "$dev" && "$dev" != lo ]]; then echo "$dev"; return 0; fi
    seen+=$dev
  done
  if [[ $# -eq 1 && "$seen" == lo ]]; then echo lo; fi
  return 0
}
