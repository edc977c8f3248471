#!/usr/bin/env bash
# Coordination command of the multi-instance training task: runs on every node before the
# application command. Fails the task early, with a clear message, on a node that cannot train.
set -euo pipefail
for mount in nfs scripts; do
  if [ ! -d "${AZ_BATCH_NODE_MOUNTS_DIR:?}/$mount" ]; then
    echo "prepare_node: $AZ_BATCH_NODE_MOUNTS_DIR/$mount is not mounted" >&2
    exit 1
  fi
done
"${RETRAIN_PYTHON:-python}" -c "import horovod.torch, torch; print('prepare_node: torch', torch.__version__, 'cuda', torch.cuda.is_available())"

# More than one node: horovodrun on the primary starts the other ranks over SSH. Each node runs
# an sshd on RETRAIN_SSH_PORT inside the task's container (host network), trusting one key kept
# on the shared NFS; the first node to get there creates it.
IFS=',' read -ra hosts <<< "${AZ_BATCH_HOST_LIST:-localhost}"
if [ "${#hosts[@]}" -gt 1 ]; then
  port=${RETRAIN_SSH_PORT:-2222}
  keys="$AZ_BATCH_NODE_MOUNTS_DIR/nfs/.retrain-ssh"
  if mkdir "$keys.lock" 2>/dev/null; then
    mkdir -p "$keys" && chmod 700 "$keys"
    [ -f "$keys/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$keys/id_ed25519"
    touch "$keys/ready"
  fi
  for _ in $(seq 120); do [ -f "$keys/ready" ] && break; sleep 1; done
  mkdir -p ~/.ssh /run/sshd && chmod 700 ~/.ssh
  cp "$keys/id_ed25519.pub" ~/.ssh/authorized_keys
  printf 'Host *\n  Port %s\n  IdentityFile "%s"\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n' \
    "$port" "$keys/id_ed25519" > ~/.ssh/config
  [ -f /etc/ssh/ssh_host_ed25519_key ] || ssh-keygen -A
  /usr/sbin/sshd -p "$port"
  echo "prepare_node: sshd on port $port for ${#hosts[@]} nodes"
fi
