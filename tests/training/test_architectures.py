"""The table of networks: every row is offered everywhere a model is chosen, and built as it
says (its classifier where the row puts it, a row per class)."""

from __future__ import annotations

from dataclasses import fields
from typing import get_args, get_type_hints

import pytest
import torch

from training.architectures import ARCHITECTURES, MODEL_NAMES, ModelName
from training.args import TrainingSettings, default_input_size
from training.models import build_model, classifier_prefix


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_row_is_built_with_its_classifier_where_the_row_says(name: str) -> None:
    model = build_model(name, 3)
    state = model.state_dict()
    assert state[f"{classifier_prefix(name)}.weight"].shape[0] == 3
    assert state[f"{classifier_prefix(name)}.bias"].shape == (3,)
    size = default_input_size(name)
    assert size == ARCHITECTURES[name].input_size
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, size, size)).shape == (1, 3)


def test_the_choices_are_the_tables_rows() -> None:
    """The config's training.model, the trainer's --model, the flow's run form and the
    benchmarks offer exactly the table's names."""
    from bench.trainer import parser as bench_parser
    from flows.retrain import retrain

    assert get_args(ModelName) == MODEL_NAMES
    model = {f.name: f for f in fields(TrainingSettings)}["model"]
    assert get_args(get_type_hints(TrainingSettings)[model.name]) == MODEL_NAMES
    form = get_type_hints(retrain.fn)["model"]
    assert [a for a in get_args(form) if a is not type(None)] == [ModelName]
    for name in MODEL_NAMES:
        assert bench_parser().parse_args(["--model", name]).model == name
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["--model", "vgg"])
