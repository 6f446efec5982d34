#!/usr/bin/env bash
# Install what tests/rig.py (the multi-node test rig) and tests/slurm_rig.py need. Idempotent and fast when
# everything is already there (no apt call at all then). Needs root; without root it only
# reports what is missing and exits 0 so that the rig's tests skip with a clear reason.
set -euo pipefail

# binary -> Debian package that provides it
declare -A NEED=(
  [/usr/sbin/sshd]=openssh-server
  [/usr/bin/ssh]=openssh-client
  [/usr/bin/ssh-keygen]=openssh-client
  [/usr/sbin/ip]=iproute2
  [/usr/sbin/tc]=iproute2  # link shaping (Cluster.shape)
  [/usr/sbin/iptables]=iptables
  [/usr/bin/fuser]=psmisc
  [/usr/bin/nsenter]=util-linux
  # tests/slurm_rig.py: a real Slurm (munged, slurmctld, slurmd and the client commands)
  [/usr/sbin/munged]=munge
  [/usr/sbin/slurmctld]=slurmctld
  [/usr/sbin/slurmd]=slurmd
  [/usr/bin/sbatch]=slurm-client
  # tests/test_sagemaker.py: distribution mpi (Open MPI's mpirun; mpi4py builds against libopenmpi-dev)
  [/usr/bin/mpirun]=openmpi-bin
  [/usr/bin/mpicc]=libopenmpi-dev
  # tests/test_sagemaker.py: a private /opt/ml for users other than root
  [/usr/bin/bwrap]=bubblewrap
  # tests/test_docs_browser.py: the built site in a real browser (measured with recommends on a busy 2-core
  # machine: 114 packages, 113 MB fetched, 479 MB on disk, 2 min 21 s; without them, as below, less)
  [/usr/bin/chromium]=chromium
)

missing=()
for bin in "${!NEED[@]}"; do
  if [[ ! -x "$bin" ]] && ! command -v "$(basename "$bin")" >/dev/null 2>&1; then
    pkg=${NEED[$bin]}
    [[ " ${missing[*]-} " == *" $pkg "* ]] || missing+=("$pkg")
  fi
done

if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "rig_setup: not root, cannot install: ${missing[*]} (the rig's tests will skip)" >&2
  elif ! command -v apt-get >/dev/null 2>&1; then
    echo "rig_setup: no apt-get, cannot install: ${missing[*]} (the rig's tests will skip)" >&2
  else
    echo "rig_setup: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# sshd refuses to start without its privilege-separation directory.
if [[ $(id -u) -eq 0 ]]; then
  mkdir -p -m 0755 /run/sshd
fi
echo "rig_setup: ok" >&2
