#!/usr/bin/env bash
# Application command of the multi-instance training task (runs on the primary node only).
# Starts the trainer on every node Batch allocated with the engine the task names
# (RETRAIN_ENGINE): Horovod through one horovodrun here, or DDP through one torchrun per node;
# the trainer's own arguments are passed through unchanged.
set -euo pipefail
ppn=${RETRAIN_PROCESSES_PER_NODE:?set by the task spec}
engine=${RETRAIN_ENGINE:-horovod}
py=${RETRAIN_PYTHON:-python}
IFS=',' read -ra nodes <<< "${AZ_BATCH_HOST_LIST:?set by Batch for multi-instance tasks}"
np=$(( ${#nodes[@]} * ppn ))
case $engine in
  horovod|ddp) ;;
  *) echo "launch: RETRAIN_ENGINE is '$engine'; choose horovod or ddp" >&2; exit 2 ;;
esac

iface=${RETRAIN_NETWORK_INTERFACE:-eth0}
if [ "${#nodes[@]}" -gt 1 ]; then
  # Remote ranks start over the sshd and keys prepare_node.sh set up for this task.
  state="${AZ_BATCH_TASK_SHARED_DIR:?}/.retrain-ssh"
  if [ ! -x "$state/bin/ssh" ] || [ ! -f "$state/id_ed25519" ]; then
    echo "launch: $state has no SSH client setup: prepare_node.sh did not run on this node" >&2
    exit 1
  fi
  export PATH="$state/bin:$PATH"
  # The sshd each node's coordination command started must still be serving: Batch does not
  # document whether a coordination command's background service outlives the container it
  # ran in, and the pipeline assumes it does (docs/azure.md, "Training across nodes"). Check
  # every other node first, so a wrong assumption fails here, naming the node, not as a hang.
  for node in "${nodes[@]}"; do
    master=${AZ_BATCH_MASTER_NODE:-}
    [ "$node" != "${master%:*}" ] || continue
    if ! out=$(ssh "$node" true 2>&1 < /dev/null); then
      echo "launch: node $node: no sshd answers on port ${RETRAIN_SSH_PORT:-2222} ($out); the one its coordination command started is gone (docs/azure.md, \"sshd outlives the coordination command\")" >&2
      exit 1
    fi
  done
  # Every rank, the rendezvous, Gloo and NCCL use this interface, not whatever a host name
  # resolves to; with MPI, OpenMPI's own channels too (a container also sees docker0, the same
  # address on every node).
  export OMPI_MCA_btl_tcp_if_include=$iface OMPI_MCA_oob_tcp_if_include=$iface
  export GLOO_SOCKET_IFNAME=$iface NCCL_SOCKET_IFNAME=$iface
fi

if [ "$engine" = horovod ]; then
  hosts=""
  for node in "${nodes[@]}"; do hosts+="${hosts:+,}${node}:${ppn}"; done
  controller=--gloo
  if [ "${RETRAIN_HOROVOD_CONTROLLER:-gloo}" = mpi ]; then controller=--mpi; fi
  across=()
  if [ "${#nodes[@]}" -gt 1 ]; then
    across=(--network-interfaces "$iface" --ssh-port "${RETRAIN_SSH_PORT:-2222}"
            --ssh-identity-file "$state/id_ed25519")
  fi
  echo "launch: $np processes on ${#nodes[@]} node(s): $hosts (horovodrun)"
  exec horovodrun -np "$np" -H "$hosts" $controller "${across[@]}" ${RETRAIN_HOROVOD_ARGS:-} \
    "$py" -m training.train "$@"
fi

# DDP. torchrun restarts every rank of the job (from the newest checkpoint) when one fails, up
# to this many times, before the task fails and Batch's own retries take over.
restarts=${RETRAIN_MAX_RESTARTS:-2}
[[ $restarts =~ ^[0-9]+$ ]] || { echo "launch: RETRAIN_MAX_RESTARTS is '$restarts', not a count" >&2; exit 2; }
if [ "${#nodes[@]}" -eq 1 ]; then
  echo "launch: $np processes on 1 node(s) (torchrun)"
  exec "$py" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$ppn" \
    --max-restarts "$restarts" -m training.train "$@"
fi

# More than one node: one torchrun per node, meeting at a c10d rendezvous that the primary's
# torchrun hosts on its own address (not Batch's port in AZ_BATCH_MASTER_NODE).
primary=${AZ_BATCH_MASTER_NODE:?set by Batch for multi-instance tasks}
primary=${primary%:*}
port=${RETRAIN_RENDEZVOUS_PORT:-29400}
run_id="${AZ_BATCH_JOB_ID:-retrain}-${AZ_BATCH_TASK_ID:-train}"
torchrun_words() {  # $1: the node's address, $2: whether it hosts the rendezvous; the rest: the trainer's
  local address=$1 host=$2
  shift 2
  printf '%s\0' "$py" -m torch.distributed.run --nnodes "${#nodes[@]}" --nproc-per-node "$ppn" \
    --rdzv-backend c10d --rdzv-endpoint "$primary:$port" --rdzv-id "$run_id" \
    --rdzv-conf "is_host=$host" --local-addr "$address" --max-restarts "$restarts" \
    -m training.train "$@"
}
# What the remote torchrun inherits, as horovodrun forwards it: the import path, the tools'
# PATH, the collectives' and threads' tuning, and where a Spot node reads its preemption
# notices. Every value is quoted for the remote shell.
forward=()
for name in $(compgen -e); do
  case $name in
    PATH|PYTHONPATH|PYTHONUNBUFFERED|LD_LIBRARY_PATH|CUDA_VISIBLE_DEVICES|OMP_NUM_THREADS|\
    MKL_NUM_THREADS|NCCL_*|GLOO_*|TORCH_*|RETRAIN_SCHEDULED_EVENTS_URL) forward+=("$name=${!name}") ;;
  esac
done
quoted() { local out="" word; for word in "$@"; do out+="$(printf '%q' "$word") "; done; printf '%s' "$out"; }

echo "launch: $np processes on ${#nodes[@]} node(s): ${AZ_BATCH_HOST_LIST} (torchrun per node, rendezvous $primary:$port)"
pids=()
for node in "${nodes[@]}"; do
  if [ "$node" = "$primary" ]; then
    mapfile -d '' words < <(torchrun_words "$node" true "$@")
    "${words[@]}" < /dev/null &
  else
    mapfile -d '' words < <(torchrun_words "$node" false "$@")
    # The remote torchrun stops when this ssh ends (its session's stdin closes), so a node
    # that failed here leaves nothing running there.
    # (The working directory as horovodrun sets it: the trainer's paths are absolute.)
    remote="cd $(printf '%q' "$PWD") 2> /dev/null; exec 3<&0 && { env $(quoted "${forward[@]}" "${words[@]}") & t=\$!;"
    remote+=" { cat <&3 > /dev/null; kill \$t 2> /dev/null; } & wait \$t; }"
    ssh "$node" "$remote" < <(sleep 2147483647) &
  fi
  pids+=("$!")
done

# Every node's exit status; the first to fail stops the others, and the task fails.
status=0
left=${#pids[@]}
while [ "$left" -gt 0 ]; do
  code=0
  wait -n -p done_pid "${pids[@]}" || code=$?
  for i in "${!pids[@]}"; do
    if [ "${pids[$i]}" = "${done_pid:-}" ]; then
      echo "launch: node ${nodes[$i]} exited $code"
      unset "pids[$i]"
    fi
  done
  left=$(( left - 1 ))
  if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$code
    for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
  fi
done
exit "$status"
