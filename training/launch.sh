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
ssh=()
if [ "${#nodes[@]}" -gt 1 ]; then  # remote ranks start over the sshd prepare_node.sh runs
  ssh=(--ssh-port "${RETRAIN_SSH_PORT:-2222}"
       --ssh-identity-file "$AZ_BATCH_NODE_MOUNTS_DIR/nfs/.retrain-ssh/id_ed25519")
fi
echo "launch: $np processes on ${#nodes[@]} node(s): $hosts"
exec horovodrun -np "$np" -H "$hosts" $controller "${ssh[@]}" ${RETRAIN_HOROVOD_ARGS:-} \
  "${RETRAIN_PYTHON:-python}" -m training.train "$@"
