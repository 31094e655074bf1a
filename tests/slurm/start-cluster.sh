#!/usr/bin/env bash
# Start a single-node SLURM cluster on this machine (Debian 12, root, no systemd,
# no cgroups): munged, MariaDB + slurmdbd (so `sacct` works), slurmctld, slurmd.
# Fake GPUs are declared as generic resources backed by harmless character devices.
#
# Idempotent: (re)writes configs, starts only daemons whose PID file is not alive.
# The last line printed is `STARTED: <names>` listing the daemons THIS invocation
# started (or restarted), so a caller stops exactly those with stop-cluster.sh.
#
# Environment:
#   MINIFIELD_SLURM_PREFIX=/tmp/minifield-slurm   state, logs, PID files, configs
#   MINIFIELD_SLURM_GPUS=2                        fake GPUs on the node (0 = none)
#   MINIFIELD_SLURM_DB_PORT=13306                 MariaDB port (loopback only)
# Packages: tests/slurm/install-packages.sh (run first).
set -euo pipefail

PREFIX=${MINIFIELD_SLURM_PREFIX:-/tmp/minifield-slurm}
FAKE_GPUS=${MINIFIELD_SLURM_GPUS:-2}
# MariaDB for slurmdbd on its own loopback port, clear of a system MariaDB on 3306
DB_PORT=${MINIFIELD_SLURM_DB_PORT:-13306}
T0=$(date +%s%N)
ts() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[%3d.%03ds] %s\n' $((ms/1000)) $((ms%1000)) "$*"; }
alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() { # wait_for <seconds> <cmd...>
  local n=$(( $1 * 5 )); shift
  for _ in $(seq 1 "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  return 1
}
fail() { echo "start-cluster: $*" >&2; exit 1; }
STARTED=()
# Always report what this invocation started, also when it fails half-way, so the
# caller can stop exactly those daemons.
trap 'echo "STARTED: ${STARTED[*]}"' EXIT

[[ $(id -u) -eq 0 ]] || fail "must run as root"
for cmd in munged slurmctld slurmd slurmdbd mariadbd sbatch sacct; do
  command -v "$cmd" >/dev/null || [[ -x /usr/sbin/$cmd ]] || fail "$cmd not installed (run tests/slurm/install-packages.sh)"
done

mkdir -p "$PREFIX"/{etc,log,run,state/ctld,state/d} /etc/slurm
chmod 1777 "$PREFIX/run"   # munged (user munge) and mariadbd (user mysql) write PID files here
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo)
REALMEM=$(( MEM_MB * 90 / 100 ))   # below what slurmd -C reports, or the node is drained

# Another controller on the standard ports (not started from this prefix) would
# answer our clients with its own state: refuse instead of testing the wrong cluster.
if ! alive "$PREFIX/run/slurmctld.pid" && (exec 3<>/dev/tcp/127.0.0.1/6817) 2>/dev/null; then
  fail "port 6817 is already taken by a slurmctld not started from $PREFIX; stop it first"
fi

# ---------------------------------------------------------------- munge
if [[ ! -s /etc/munge/munge.key ]]; then
  mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
    || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/log/munge && chown munge:munge /run/munge /var/log/munge && chmod 755 /run/munge
if alive "$PREFIX/run/munged.pid"; then
  ts "munged up (pid $(cat "$PREFIX/run/munged.pid"))"
elif munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  # a munged not started from this prefix (e.g. the package's init script) already
  # serves the default socket: use it, and leave it alone when stopping
  ts "munged already running (not ours)"
else
  touch "$PREFIX/log/munged.log"; chown munge:munge "$PREFIX/log/munged.log"
  runuser -u munge -- /usr/sbin/munged --pid-file="$PREFIX/run/munged.pid" \
    --log-file="$PREFIX/log/munged.log"
  STARTED+=(munged)
  wait_for 10 bash -c 'munge -n | unmunge' || fail "munge does not work"
  ts "munged up (pid $(cat "$PREFIX/run/munged.pid"))"
fi

# ---------------------------------------------------------------- configs
GRES_NODE=""; GRES_GLOBAL=""
if (( FAKE_GPUS > 0 )); then
  # /dev/null etc. are character devices, which is all Slurm checks; each fake
  # GPU needs a distinct file so Slurm can hand out distinct indices.
  DEVS=(/dev/null /dev/zero /dev/full /dev/urandom)
  (( FAKE_GPUS <= ${#DEVS[@]} )) || fail "at most ${#DEVS[@]} fake GPUs"
  GRES_NODE=" Gres=gpu:${FAKE_GPUS}"
  GRES_GLOBAL=$'GresTypes=gpu\nAccountingStorageTRES=gres/gpu'
  : > "$PREFIX/etc/gres.conf.new"
  for ((i = 0; i < FAKE_GPUS; i++)); do
    echo "NodeName=$HOST Name=gpu File=${DEVS[$i]}" >> "$PREFIX/etc/gres.conf.new"
  done
  mv "$PREFIX/etc/gres.conf.new" "$PREFIX/etc/gres.conf"
  ln -sfn "$PREFIX/etc/gres.conf" /etc/slurm/gres.conf
else
  rm -f "$PREFIX/etc/gres.conf"
  [[ -L /etc/slurm/gres.conf ]] && rm -f /etc/slurm/gres.conf
fi

cat > "$PREFIX/etc/slurm.conf.new" <<CONF
ClusterName=minifield
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$PREFIX/state/ctld
SlurmdSpoolDir=$PREFIX/state/d
SlurmctldPidFile=$PREFIX/run/slurmctld.pid
SlurmdPidFile=$PREFIX/run/slurmd.pid
SlurmctldLogFile=$PREFIX/log/slurmctld.log
SlurmdLogFile=$PREFIX/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: works in containers without cgroup delegation
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
MpiDefault=none
ReturnToService=2
# keep finished jobs visible to squeue/scontrol for 10 min
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
Waittime=0
$GRES_GLOBAL
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$REALMEM State=UNKNOWN$GRES_NODE
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
CONF_CHANGED=0
if ! cmp -s "$PREFIX/etc/slurm.conf.new" "$PREFIX/etc/slurm.conf"; then
  mv "$PREFIX/etc/slurm.conf.new" "$PREFIX/etc/slurm.conf"; CONF_CHANGED=1
else
  rm -f "$PREFIX/etc/slurm.conf.new"
fi
# Must be at the default path: Snakemake's slurm-jobstep plugin strips SLURM_*
# (SLURM_CONF included) from the environment before it calls srun inside a job.
ln -sfn "$PREFIX/etc/slurm.conf" /etc/slurm/slurm.conf
ts "slurm.conf written (changed=$CONF_CHANGED)"

# ---------------------------------------------------------------- mariadb + slurmdbd
DB="$PREFIX/mysql"; SOCK="$PREFIX/run/mysqld.sock"
if [[ ! -d $DB/mysql ]]; then
  mkdir -p "$DB"; chown mysql:mysql "$DB"
  mariadb-install-db --user=mysql --datadir="$DB" --skip-test-db \
    --auth-root-authentication-method=socket > "$PREFIX/log/mariadb-install.log" 2>&1 \
    || { tail "$PREFIX/log/mariadb-install.log" >&2; fail "mariadb-install-db failed"; }
fi
touch "$PREFIX/log/mariadb.err"; chown mysql:mysql "$PREFIX/log/mariadb.err"
if ! alive "$PREFIX/run/mariadb.pid"; then
  # loopback only, its own socket and port; setsid so it outlives this shell
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB" \
    --socket="$SOCK" --pid-file="$PREFIX/run/mariadb.pid" \
    --bind-address=127.0.0.1 --port="$DB_PORT" --log-error="$PREFIX/log/mariadb.err" \
    --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
    </dev/null >/dev/null 2>&1 &
  STARTED+=(mariadb)
fi
wait_for 60 mariadb-admin --socket="$SOCK" ping || { tail "$PREFIX/log/mariadb.err" >&2; fail "mariadb did not start"; }
wait_for 10 test -s "$PREFIX/run/mariadb.pid" || fail "mariadb wrote no PID file"
mariadb --socket="$SOCK" -uroot -e "
  CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
  CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
  FLUSH PRIVILEGES;"
ts "mariadb up (pid $(cat "$PREFIX/run/mariadb.pid"))"

cat > "$PREFIX/etc/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$PREFIX/log/slurmdbd.log
PidFile=$PREFIX/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
CONF
chmod 600 "$PREFIX/etc/slurmdbd.conf"
ln -sfn "$PREFIX/etc/slurmdbd.conf" /etc/slurm/slurmdbd.conf
if ! alive "$PREFIX/run/slurmdbd.pid"; then
  slurmdbd   # reads /etc/slurm/slurmdbd.conf (it has no -f option); daemonizes
  STARTED+=(slurmdbd)
fi
wait_for 60 sacctmgr -n show cluster || { tail "$PREFIX/log/slurmdbd.log" >&2; fail "slurmdbd does not answer"; }
sacctmgr -n show cluster format=cluster%40 | grep -qw minifield \
  || sacctmgr -i add cluster minifield >/dev/null
ts "slurmdbd up (pid $(cat "$PREFIX/run/slurmdbd.pid"))"

# ---------------------------------------------------------------- slurmctld + slurmd
if (( CONF_CHANGED )); then   # new config: restart what runs from this prefix
  for d in slurmd slurmctld; do
    if alive "$PREFIX/run/$d.pid"; then
      p=$(cat "$PREFIX/run/$d.pid"); kill "$p"
      for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    fi
  done
fi
if ! alive "$PREFIX/run/slurmctld.pid"; then
  slurmctld -f "$PREFIX/etc/slurm.conf"; STARTED+=(slurmctld)
fi
wait_for 30 scontrol ping || { tail "$PREFIX/log/slurmctld.log" >&2; fail "slurmctld does not answer"; }
if ! alive "$PREFIX/run/slurmd.pid"; then
  slurmd -f "$PREFIX/etc/slurm.conf"; STARTED+=(slurmd)
fi
node_ready() { sinfo -h -n "$HOST" -o %T | grep -Eq '^(idle|mixed|allocated)'; }
if ! wait_for 30 node_ready; then
  scontrol update nodename="$HOST" state=resume 2>/dev/null || true
  wait_for 15 node_ready || { sinfo -R >&2; tail "$PREFIX/log/slurmd.log" >&2; fail "node not ready"; }
fi
ts "slurmctld (pid $(cat "$PREFIX/run/slurmctld.pid")) + slurmd (pid $(cat "$PREFIX/run/slurmd.pid")) up"
sinfo -o '%P %D %T %c %m %G'
ts "local SLURM cluster ready"
