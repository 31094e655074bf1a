#!/usr/bin/env bash
# Install the Debian packages the local SLURM test cluster needs (CI runs this as root).
# Idempotent: only missing packages are installed; `apt-get update` runs at most once.
# Exit 0 when everything is installed, 1 when not root / no apt-get / install failed
# (the slurm tests then skip and print why).
set -euo pipefail
PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

[[ $(id -u) -eq 0 ]] || { echo "install-packages: not root, cannot install ${PKGS[*]}" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "install-packages: no apt-get on this machine" >&2; exit 1; }

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-packages: all present (${PKGS[*]})"
  exit 0
fi
echo "install-packages: installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-packages: installed ${missing[*]}"
