#!/usr/bin/env bash
# Application command of the multi-instance training task (runs on the primary node only).
# Builds the Horovod host list from the nodes Batch allocated and starts the trainer on all of
# them; the trainer's own arguments are passed through unchanged.
set -euo pipefail
ppn=${RETRAIN_PROCESSES_PER_NODE:?set by the task spec}
IFS=',' read -ra nodes <<< "${AZ_BATCH_HOST_LIST:?set by Batch for multi-instance tasks}"
hosts=""
for node in "${nodes[@]}"; do hosts+="${hosts:+,}${node}:${ppn}"; done
np=$(( ${#nodes[@]} * ppn ))
controller=--gloo
if [ "${RETRAIN_HOROVOD_CONTROLLER:-gloo}" = mpi ]; then controller=--mpi; fi
across=()
if [ "${#nodes[@]}" -gt 1 ]; then
  # Remote ranks start over the sshd and keys prepare_node.sh set up for this task.
  state="${AZ_BATCH_TASK_SHARED_DIR:?}/.retrain-ssh"
  if [ ! -x "$state/bin/ssh" ] || [ ! -f "$state/id_ed25519" ]; then
    echo "launch: $state has no SSH client setup: prepare_node.sh did not run on this node" >&2
    exit 1
  fi
  export PATH="$state/bin:$PATH"
  # Every rank, the rendezvous and NCCL use this interface, not whatever a host name resolves
  # to; with MPI, OpenMPI's own channels too (a container also sees docker0, the same address on
  # every node).
  iface=${RETRAIN_NETWORK_INTERFACE:-eth0}
  export OMPI_MCA_btl_tcp_if_include=$iface OMPI_MCA_oob_tcp_if_include=$iface
  across=(--network-interfaces "$iface" --ssh-port "${RETRAIN_SSH_PORT:-2222}"
          --ssh-identity-file "$state/id_ed25519")
fi
echo "launch: $np processes on ${#nodes[@]} node(s): $hosts"
exec horovodrun -np "$np" -H "$hosts" $controller "${across[@]}" ${RETRAIN_HOROVOD_ARGS:-} \
  "${RETRAIN_PYTHON:-python}" -m training.train "$@"
