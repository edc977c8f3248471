"""Starting weights (training/weights.py): what is carried, by class name, and every file that
cannot start a training refused with a named error before a weight is applied."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from common.atomic import file_md5
from tests.training.torchvision_resnet import load_resnet_module
from training.models import MODEL_FORMAT_VERSION, NETWORK, build_model
from training.weights import InitFromError, carry, network_parameters, read_weights


def _model_file(
    path: Path, names: list[str], model: str = "cnn", size: int = 32, **extra: object
) -> torch.nn.Module:
    torch.manual_seed(1)
    net = build_model(model, len(names))
    torch.save(
        {
            "format_version": MODEL_FORMAT_VERSION,
            "state_dict": net.state_dict(),
            "class_names": names,
            "model_name": model,
            "input_size": size,
            **extra,
        },
        path,
    )
    return net


def _fresh(model: str, classes: int) -> torch.nn.Module:
    torch.manual_seed(2)
    return build_model(model, classes)


def test_shared_classes_are_carried_by_name_whatever_their_index(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    old = _model_file(path, ["cat", "dog", "eel"])
    new_names = ["ant", "cat", "eel", "fox"]  # dog removed; ant and fox new; cat/eel moved
    model = _fresh("cnn", len(new_names))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = read_weights(path)
    carried = carry(weights, model, "cnn", 32, new_names, run_id="r1")
    assert carried.classes_carried == ["cat", "eel"]
    assert carried.classes_new == ["ant", "fox"]
    assert carried.classes_dropped == ["dog"]
    assert carried.md5 == file_md5(path) and carried.run_id == "r1"
    got, want = model.state_dict(), old.state_dict()
    for key in want:
        if not key.startswith(f"{NETWORK}.head.3."):
            assert torch.equal(got[key], want[key]), key
    for row, name in enumerate(new_names):
        for part in ("weight", "bias"):
            key = f"{NETWORK}.head.3.{part}"
            source = {"cat": want[key][0], "eel": want[key][2]}.get(name, before[key][row])
            assert torch.equal(got[key][row], source), (name, part)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_a_torchvision_state_dict_starts_the_backbone(name: str, tmp_path: Path) -> None:
    """torchvision's format (its own resnet code writes it here; tests/training/
    torchvision_resnet.py): the backbone loads strictly, the 1000-class fc is replaced by a
    fresh head with a row per class of this data set."""
    theirs = getattr(load_resnet_module(), name)()
    path = tmp_path / f"{name}.pth"
    torch.save(theirs.state_dict(), path)
    model = _fresh(name, 5)
    head = {k: v.clone() for k, v in model.state_dict().items() if ".fc." in k}
    carried = carry(read_weights(path), model, name, 224, list("abcde"))
    assert carried.kind == "state dict" and carried.classes_new == list("abcde")
    assert carried.classes_carried == []
    network = model[int(NETWORK)].state_dict()
    for key, value in theirs.state_dict().items():
        if not key.startswith("fc."):
            assert torch.equal(network[key], value), key
    for key, value in head.items():
        assert torch.equal(model.state_dict()[key], value)


def test_the_classifier_is_its_own_optimizer_group() -> None:
    model = build_model("resnet18", 4)
    backbone, classifier = network_parameters(model, "resnet18")
    assert [p.shape for p in classifier] == [(4, 512), (4,)]
    assert len(backbone) + 2 == len(list(model.parameters()))


def _refused(path: Path, match: str, **kwargs: object) -> None:
    with pytest.raises(InitFromError, match=match) as caught:
        weights = read_weights(path)
        model = _fresh(str(kwargs.get("model", "cnn")), 3)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            carry(
                weights,
                model,
                str(kwargs.get("model", "cnn")),
                int(kwargs.get("size", 32)),  # type: ignore[call-overload]
                ["a", "b", "c"],
            )
        finally:  # nothing applied from a file that was refused
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert str(path) in str(caught.value)


def test_missing_file_and_folder(tmp_path: Path) -> None:
    _refused(tmp_path / "absent.pt", "does not exist")
    _refused(tmp_path, "is a folder")


def test_a_file_that_is_not_weights(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not weights")
    _refused(text, "cannot be read as PyTorch weights")
    listed = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], listed)
    _refused(listed, "holds a list: neither a state dict")
    mixed = tmp_path / "mixed.pt"
    torch.save({"weight": torch.zeros(2), "note": "x"}, mixed)
    _refused(mixed, "neither a state dict")
    # Code in a pickle is never run: weights_only refuses it.
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps(print))
    _refused(evil, "cannot be read as PyTorch weights")


def test_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    _model_file(path, ["a", "b", "c"])
    path.write_bytes(path.read_bytes()[:5000])
    _refused(path, "truncated")


def test_nans(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    net = build_model("cnn", 3)
    state = net.state_dict()
    state["1.features.0.weight"][0, 0, 0, 0] = float("nan")
    torch.save(
        {
            "state_dict": state,
            "class_names": ["a", "b", "c"],
            "model_name": "cnn",
            "input_size": 32,
        },
        path,
    )
    _refused(path, r"1\.features\.0\.weight holds NaN")


def test_wrong_shapes_and_networks(tmp_path: Path) -> None:
    wide = tmp_path / "wide.pt"
    state = build_model("cnn", 3).state_dict()
    state["1.features.0.weight"] = torch.zeros(16, 3, 3, 3)
    torch.save(state, wide)
    _refused(wide, r"1\.features\.0\.weight is \(16, 3, 3, 3\), the cnn's is \(32, 3, 3, 3\)")
    resnet = tmp_path / "resnet.pth"
    torch.save(build_model("resnet18", 3)[int(NETWORK)].state_dict(), resnet)
    _refused(resnet, "is not a cnn: its parameters differ")
    other = tmp_path / "other.pt"
    _model_file(other, ["a", "b"], model="resnet18", size=32)
    _refused(other, "is a resnet18; this training is a cnn")
    smaller = tmp_path / "smaller.pt"
    _model_file(smaller, ["a", "b"], size=64)
    _refused(smaller, "trained on 64 px images; this training reads 32 px")
    rows = tmp_path / "rows.pt"
    _model_file(rows, ["a", "b", "c"])
    saved = torch.load(rows, weights_only=True)
    saved["class_names"] = ["a", "b"]
    torch.save(saved, rows)
    _refused(rows, r"classifier 1\.head\.3\.weight is \(3, 128\), not one row")


def test_a_later_format_and_a_checkpoint(tmp_path: Path) -> None:
    later = tmp_path / "later.pt"
    _model_file(later, ["a", "b", "c"], format_version=MODEL_FORMAT_VERSION + 1)
    _refused(later, "written by a later trainer")
    checkpoint = tmp_path / "checkpoint-3.pt"
    torch.save({"format_version": 1, "model": {}, "optimizer": {}, "epoch": 3}, checkpoint)
    _refused(checkpoint, "is a training checkpoint")
