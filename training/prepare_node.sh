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
