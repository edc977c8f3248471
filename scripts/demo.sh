#!/usr/bin/env bash
# The local demo: a real image dataset on disk, a 2-process Horovod training run, the scorer.
# Runs from `make demo`, which has already set up .venv and put it first on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

demo=.demo
data=$demo/data
run=$demo/run
if [ ! -d "$data/train" ]; then
  python -m training.make_images --source digits --output "$data.tmp"
  rm -rf "$data" && mv "$data.tmp" "$data"
fi
rm -rf "$run"

start=$(date +%s)
horovodrun -np 2 -H localhost:2 --gloo \
  python -m training.train --data-dir "$data" --output-dir "$run" --epochs 4 --timeline
python -m training.score --model "$run/model.pt" --data-dir "$data" --output "$run/score.json"

python - "$run" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
run, seconds = sys.argv[1], sys.argv[2]
metrics = json.load(open(f"{run}/metrics.json"))
score = json.load(open(f"{run}/score.json"))
print()
print(f"trained {metrics['model']} on {metrics['world_size']} Horovod workers in {seconds}s")
for e in metrics["epochs"]:
    print(f"  epoch {e['epoch']}: loss {e['train_loss']:.3f}  train acc {e['train_accuracy']:.3f}")
print(f"test accuracy {score['accuracy']:.4f} on {score['num_images']} held-out images "
      f"({len(score['class_names'])} classes, chance {1 / len(score['class_names']):.2f})")
print(f"throughput {metrics['images_per_sec']:.0f} images/sec "
      f"({metrics['images_per_sec_per_worker']:.0f} per worker)")
print(f"outputs: {run}/ (model.pt, metrics.json, score.json, tensorboard/, timeline.json)")
PY
