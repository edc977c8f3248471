"""Score a trained model: ``python -m training.score --model O/model.pt --data-dir D``.

Runs in one process on held-out data (a folder needs only the split it scores: ``D/test/<class>/``
for the default) and writes accuracy, per-class precision/recall/F1 and the
confusion matrix (scikit-learn computes them, the same way everyone reading the numbers would).
The model file carries its class names and input size, so the scorer needs no training args;
a dataset whose classes differ from the model's is refused rather than scored wrongly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from common.atomic import atomic_write_json
from imagedata.data import open_dataset
from imagedata.dataset import DatasetError
from imagedata.images import SPLITS
from training.architectures import ARCHITECTURES
from training.model_file import ModelFileError, check_class_names, check_input_size
from training.models import MODEL_FORMAT_VERSION, build_model, upgrade_state_dict


def load_model(path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model in ``path`` and what it was saved with; ModelFileError names what is wrong
    with a file that is not a model the trainer wrote (nothing is scored from it)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ModelFileError(f"model file {path} does not exist") from exc
    except Exception as exc:
        raise ModelFileError(
            f"model file {path} cannot be read ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(saved, dict):
        raise ModelFileError(
            f"model file {path} holds a {type(saved).__name__}, not the trainer's dict"
        )
    missing = {"state_dict", "class_names", "model_name", "input_size"} - set(saved)
    if missing:
        raise ModelFileError(
            f"model file {path} lacks {sorted(missing)}: not written by training.train"
        )
    names, model_name = check_class_names(path, saved["class_names"]), saved["model_name"]
    check_input_size(path, saved["input_size"])
    if model_name not in ARCHITECTURES:
        raise ModelFileError(
            f"model file {path}: model_name {model_name!r} is not one of {sorted(ARCHITECTURES)}"
        )
    if not isinstance(saved["state_dict"], dict):
        raise ModelFileError(f"model file {path}: state_dict is not a dict of tensors")
    version = saved.get("format_version", 1)
    if type(version) is not int or version > MODEL_FORMAT_VERSION:
        raise ModelFileError(
            f"model file {path} has format version {version!r}: written by a later trainer "
            f"than this one (which reads up to {MODEL_FORMAT_VERSION})"
        )
    model = build_model(model_name, len(names))
    try:
        model.load_state_dict(upgrade_state_dict(model_name, saved["state_dict"]))
    except (RuntimeError, TypeError, KeyError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[:3]
        raise ModelFileError(
            f"model file {path}: its weights do not fit a {model_name} for {len(names)} "
            f"classes ({' '.join(first)})"
        ) from None
    return model.eval(), saved


@torch.no_grad()
def predict(
    model: torch.nn.Module, dataset: Any, batch_size: int = 256
) -> tuple[list[int], list[int]]:
    truth: list[int] = []
    predicted: list[int] = []
    for images, labels in DataLoader(dataset, batch_size=batch_size):
        predicted += model(images.float()).argmax(1).tolist()
        truth += labels.tolist()
    return truth, predicted


def score(
    model_path: Path,
    data_dir: str,
    split: str = "test",
    seed: int = 0,
    known_classes_only: bool = False,
) -> dict[str, Any]:
    """The model's scores on ``split``. ``known_classes_only``: a dataset whose classes differ
    from the model's (a class added or removed since it was trained) is scored on the images of
    the classes the model knows, in the model's class order, and the report names the classes
    left out; without it such a dataset is refused rather than scored wrongly."""
    from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

    model, saved = load_model(model_path)
    info = open_dataset(data_dir, saved["input_size"], seed=seed, required_splits=(split,))
    if split not in info.splits:
        raise DatasetError(f"split {split!r} not found in {data_dir} (have {sorted(info.splits)})")
    names: list[str] = saved["class_names"]
    differ = info.class_names != names
    if differ and not known_classes_only:
        raise DatasetError(
            f"classes in {data_dir} {info.class_names} differ from the model's {names}"
        )
    truth, predicted = predict(model, info.splits[split].dataset)
    unknown = [c for c in info.class_names if c not in names]
    if differ:
        # The data's class indices, as the model's; images of classes it does not know are left out.
        index = {i: names.index(c) for i, c in enumerate(info.class_names) if c in names}
        kept = [(index[t], p) for t, p in zip(truth, predicted, strict=True) if t in index]
        if not kept:
            raise DatasetError(
                f"no {split} image in {data_dir} is of a class the model knows ({names}); "
                f"the data's classes are {info.class_names}"
            )
        truth, predicted = [t for t, _ in kept], [p for _, p in kept]
    labels = list(range(len(names)))
    precision, recall, f1, support = precision_recall_fscore_support(
        truth, predicted, labels=labels, zero_division=0
    )
    report = {
        "accuracy": float(accuracy_score(truth, predicted)),
        "num_images": len(truth),
        "split": split,
        "model_name": saved["model_name"],
        "class_names": names,
        "per_class": {
            name: {
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(support[i]),
            }
            for i, name in enumerate(names)
        },
        "confusion_matrix": confusion_matrix(truth, predicted, labels=labels).tolist(),
        "skipped_images": info.splits[split].skipped,
    }
    if differ:
        report["classes_not_scored"] = unknown  # in the data, unknown to the model
        report["classes_not_in_data"] = [c for c in names if c not in info.class_names]
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.score", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--split", default="test", choices=SPLITS)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0, help="must match training for synthetic:N")
    p.add_argument(
        "--known-classes-only",
        action="store_true",
        help="score only the images of the classes the model knows when the data's classes "
        "differ from the model's (a champion scored on a version that added or removed a "
        "class); without it such data is refused",
    )
    p.add_argument(
        "--error-output",
        type=Path,
        help="when the model or data is refused (exit 2), the reason as JSON here: for a "
        "cluster task whose outputs, not logs, the orchestrator reads",
    )
    args = p.parse_args(argv)
    try:
        result = score(args.model, args.data_dir, args.split, args.seed, args.known_classes_only)
    except (DatasetError, ModelFileError) as exc:
        if args.error_output:
            atomic_write_json({"error": str(exc)}, args.error_output)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    atomic_write_json(result, args.output)
    print(
        f"{args.split} accuracy {result['accuracy']:.4f} on {result['num_images']} images "
        f"-> {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
