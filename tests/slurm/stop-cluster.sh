#!/usr/bin/env bash
# Stop daemons of the local test cluster by their PID files, in reverse start order.
#   stop-cluster.sh                     stop every daemon with a PID file under the prefix
#   stop-cluster.sh slurmd slurmctld    stop only these (e.g. the STARTED: list of start-cluster.sh)
# Never matches processes by name: only the PIDs recorded under the prefix are signalled.
set -uo pipefail
PREFIX=${MINIFIELD_SLURM_PREFIX:-/tmp/minifield-slurm}
ORDER=(slurmd slurmctld slurmdbd mariadb munged)
if (($#)); then WANT=" $* "; else WANT=" ${ORDER[*]} "; fi
status=0
stop_pid() { # stop_pid <name>
  local name=$1 f="$PREFIX/run/$1.pid" p
  [[ -s $f ]] || { echo "$name: no PID file"; return; }
  p=$(cat "$f")
  if ! kill -0 "$p" 2>/dev/null; then echo "$name: pid $p not running"; rm -f "$f"; return; fi
  kill "$p"
  for _ in $(seq 1 75); do
    kill -0 "$p" 2>/dev/null || { echo "$name: stopped pid $p"; rm -f "$f"; return; }
    sleep 0.2
  done
  echo "$name: pid $p ignored SIGTERM for 15 s, sending SIGKILL"
  kill -9 "$p" 2>/dev/null; rm -f "$f"; status=1
}
for d in "${ORDER[@]}"; do
  [[ $WANT == *" $d "* ]] && stop_pid "$d"
done
exit $status
