#!/usr/bin/env bash
# Coordination command of the multi-instance training task: Batch runs it on every node, waits
# for all of them to exit 0, then runs the application command (launch.sh) on the primary only.
# A node that cannot train fails here, and says which node it is and why.
#
# More than one node: horovodrun (or, for ddp, launch.sh's own ssh) on the primary starts the
# other nodes' ranks over SSH, so each node starts an sshd of its own for this task and
# returns; the daemon keeps serving after this script exits (see docs/azure.md, "Multi-node training"). Nothing depends on $HOME or on the
# user's ~/.ssh: sshd and ssh are told where their keys are, and every file lives in a folder of
# this task, so what a dead node or an earlier attempt left behind is never read:
#   $AZ_BATCH_TASK_SHARED_DIR/.retrain-ssh       node-local: host key, sshd config and log; on
#                                                the primary also the private key and the ssh
#                                                client config launch.sh uses
#   <nfs>/.retrain-ssh/<job id>/<task id>/       shared: the primary's public key only
set -euo pipefail
node=${AZ_BATCH_NODE_ID:-$(hostname)}
fail() { echo "prepare_node: node $node: $*" >&2; exit 1; }

for mount in nfs scripts; do
  [ -d "${AZ_BATCH_NODE_MOUNTS_DIR:?}/$mount" ] || fail "$AZ_BATCH_NODE_MOUNTS_DIR/$mount is not mounted"
done
py=${RETRAIN_PYTHON:-python}
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
# The engine's own import only: a ddp image needs no Horovod build.
case ${RETRAIN_ENGINE:-horovod} in
  ddp) modules="torch.distributed" ;;
  *) modules="horovod.torch" ;;
esac
"$py" -c "import sys, torch, $modules; print('prepare_node: torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'python', sys.executable)" \
  || fail "cannot import $modules and torch with $py"
# A GPU node whose GPUs torch cannot use (a lost or mismatched driver, a container started
# without them) would train on the CPU, slowly and without a word: fail here instead.
if command -v nvidia-smi > /dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true)
  if [ "${gpus:-0}" -gt 0 ]; then
    seen=$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2> /dev/null) || seen=0
    if [ "$seen" != "$gpus" ]; then
      fail "nvidia-smi lists $gpus GPU(s) but torch sees $seen ($("$py" -c "import torch; print('torch', torch.__version__, 'built for CUDA', torch.version.cuda)" 2>&1 | tail -1)); check the driver and the container's GPU access"
    fi
    echo "prepare_node: node $node: $gpus GPU(s), all visible to torch"
  fi
fi

IFS=',' read -ra hosts <<< "${AZ_BATCH_HOST_LIST:-localhost}"
[ "${#hosts[@]}" -gt 1 ] || exit 0

# Every rank binds the same interface; its address here, and the host name resolving to it.
iface=${RETRAIN_NETWORK_INTERFACE:-eth0}
address=$("$py" -m training.node_address --interface "$iface" --node "$node") || exit 1
node="$node ($address)"

port=${RETRAIN_SSH_PORT:-2222}
state="${AZ_BATCH_TASK_SHARED_DIR:?}/.retrain-ssh"
shared="$AZ_BATCH_NODE_MOUNTS_DIR/nfs/.retrain-ssh/${AZ_BATCH_JOB_ID:?}/${AZ_BATCH_TASK_ID:?}"
rm -rf "$state"
mkdir -p "$state/bin" "$shared"
chmod 700 "$state"
if [ "${AZ_BATCH_IS_CURRENT_NODE_MASTER:-}" = true ]; then
  # The private key never leaves the primary; the others trust its public half on NFS. The
  # application command starts only after every node's coordination command has exited, so the
  # key is in place before any rank is started over SSH.
  ssh-keygen -q -t ed25519 -N '' -C "retrain $AZ_BATCH_JOB_ID/$AZ_BATCH_TASK_ID" -f "$state/id_ed25519"
  cp "$state/id_ed25519.pub" "$shared/.authorized_keys.$$"
  mv -f "$shared/.authorized_keys.$$" "$shared/authorized_keys"
fi
ssh-keygen -q -t ed25519 -N '' -f "$state/host_key"
cat > "$state/sshd_config" <<EOF
Port $port
AddressFamily inet
HostKey $state/host_key
AuthorizedKeysFile $shared/authorized_keys
PidFile $state/sshd.pid
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
PrintMotd no
EOF
ssh_bin=$(command -v ssh) || fail "no ssh client in the image (openssh-client)"
[ -x /usr/sbin/sshd ] || fail "no sshd in the image (/usr/sbin/sshd: openssh-server)"
cat > "$state/ssh_config" <<EOF
Host *
  Port $port
  IdentityFile "$state/id_ed25519"
  IdentitiesOnly yes
  BatchMode yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  ConnectTimeout 10
EOF
# horovodrun, mpirun and launch.sh call `ssh` by name; launch.sh puts this one first on PATH.
printf '#!/bin/sh\nexec %q -F %q "$@"\n' "$ssh_bin" "$state/ssh_config" > "$state/bin/ssh"
chmod 755 "$state/bin/ssh"

mkdir -p /run/sshd  # sshd's privilege separation directory
# In the foreground of a session of its own (sshd detaches before it binds its port, so a
# detached start would report success on a taken port): it outlives this script, as Batch's
# coordination commands are meant to leave a service running, and says when it listens.
setsid /usr/sbin/sshd -D -f "$state/sshd_config" -E "$state/sshd.log" < /dev/null > /dev/null 2>&1 &
sshd_pid=$!
for _ in $(seq 100); do
  grep -q "Server listening on" "$state/sshd.log" 2>/dev/null && break
  if ! kill -0 "$sshd_pid" 2>/dev/null; then
    fail "sshd cannot serve port $port: $(tr '\n' ' ' < "$state/sshd.log")(set RETRAIN_SSH_PORT to a free port)"
  fi
  sleep 0.1
done
grep -q "Server listening on" "$state/sshd.log" || fail "sshd did not start listening on port $port within 10 s"
echo "prepare_node: node $node: sshd on port $port for ${#hosts[@]} nodes"
