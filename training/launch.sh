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
echo "launch: $np processes on ${#nodes[@]} node(s): $hosts"
exec horovodrun -np "$np" -H "$hosts" $controller ${RETRAIN_HOROVOD_ARGS:-} \
  "${RETRAIN_PYTHON:-python}" -m training.train "$@"
