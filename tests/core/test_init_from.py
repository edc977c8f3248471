"""training.init_from in the config (core/init_from.py) and in the training task's command
(backends/taskspec.py): the forms accepted, the accounts a URL may name, what the trainer gets."""

from __future__ import annotations

import shlex

import pytest

from backends.taskspec import TaskSpec, training_task
from core.config import ConfigError, load_config
from core.init_from import InitFromValueError, parse_init_from
from tests.conftest import ROOT
from training.args import parse_trainer_args

LOCAL = ROOT / "configs" / "local.yaml"
AZURITE = "http://127.0.0.1:10000/devstoreaccount1"


@pytest.mark.parametrize(
    ("value", "kind", "path"),
    [
        ("champion", "champion", ""),
        ("nfs:weights/resnet50.pth", "nfs", "weights/resnet50.pth"),
        ("output:/weights/r.pth", "output", "weights/r.pth"),
        ("data:imagenet/resnet18.pth", "data", "imagenet/resnet18.pth"),
        (f"{AZURITE}/c/w.pth", "url", f"{AZURITE}/c/w.pth"),
    ],
)
def test_the_forms_accepted(value: str, kind: str, path: str) -> None:
    parsed = parse_init_from(value)
    assert (parsed.kind, parsed.path) == (kind, path)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("champ", "is not null, 'champion'"),
        ("s3://bucket/w.pth", "is not null, 'champion'"),
        ("nfs:../etc/passwd", "plain relative path"),
        ("output:", "needs a file name"),
        ("data:a//b", "plain relative path"),
        (f"{AZURITE}/c/w.pth?sv=1&sig=secret", "no query"),
    ],
)
def test_what_is_refused(value: str, named: str) -> None:
    with pytest.raises(InitFromValueError, match=named) as caught:
        parse_init_from(value)
    assert "secret" not in str(caught.value)


def test_the_config_names_the_field_and_clears_it_with_null() -> None:
    with pytest.raises(ConfigError, match=r"training\.init_from: .*'champ' is not null"):
        load_config(LOCAL, ["training.init_from=champ"])
    assert load_config(LOCAL, ["training.init_from=null"]).training.init_from is None
    config = load_config(LOCAL, ["training.init_from=champion"])
    assert config.training.init_from == "champion"


def test_a_url_must_point_into_the_configured_containers() -> None:
    accounts = [f"data.account_url={AZURITE}", f"output.account_url={AZURITE}"]
    config = load_config(LOCAL, [*accounts, "output.container=models"])
    inside = f"{AZURITE}/models/weights/r50.pth"
    ok = load_config(LOCAL, [*accounts, "output.container=models", f"training.init_from={inside}"])
    assert ok.training.init_from == inside
    for outside in (
        "https://evil.blob.core.windows.net/models/r50.pth",  # another account
        f"{AZURITE}/other-container/r50.pth",  # a container the pipeline does not use
    ):
        with pytest.raises(ConfigError, match="outside the accounts this pipeline reads"):
            load_config(
                LOCAL, [*accounts, "output.container=models", f"training.init_from={outside}"]
            )
    assert config.init_from_accounts()["output"] == (AZURITE, "models")
    # With connection strings only, no URL can be checked: every URL is refused.
    with pytest.raises(ConfigError, match="no account URL is configured"):
        load_config(LOCAL, [f"training.init_from={inside}"])


def test_the_trainer_options_are_the_fields_own() -> None:
    with pytest.raises(ConfigError, match=r"--init-from is training\.init_from"):
        load_config(LOCAL, ["training.extra_args=[--init-from, x.pt]"])
    with pytest.raises(ConfigError, match=r"--init-from-run is training\.init_from"):
        load_config(LOCAL, ["training.extra_args=[--init-from-run=r]"])


def _script(overrides: list[str]) -> tuple[str, list[str], TaskSpec]:
    spec = training_task(load_config(LOCAL, overrides), "t", "key", "runs/r9")
    script = shlex.split(spec.command_line)[-1]
    words = shlex.split(script.split("; ", 1)[1])
    return script, words, spec


def test_an_output_blob_reaches_every_node_through_nfs() -> None:
    """A resource file lands on the primary node only; the task copies it into NFS (whole,
    then renamed) before the launcher starts, and the trainer reads it there."""
    script, words, spec = _script(["training.init_from=output:runs/r1/model.pt"])
    (resource,) = spec.resources
    assert (resource.blob, resource.file_path) == ("runs/r1/model.pt", "init-from/model.pt")
    trainer = parse_trainer_args(words[words.index("bash") + 2 :])
    place = str(trainer.init_from)
    assert place.startswith("$AZ_BATCH_NODE_MOUNTS_DIR/nfs/init-from/")
    assert place.endswith("/model.pt")
    assert trainer.init_from_run == "r1"
    copy = script[: script.index("bash ")]
    assert "cp -f" in copy and "mv -f" in copy and copy.index("cp -f") < copy.index("mv -f")


def test_an_nfs_file_is_read_where_it_is() -> None:
    _script_text, words, spec = _script(["training.init_from=nfs:weights/a b.pth"])
    trainer = parse_trainer_args(words[words.index("bash") + 2 :])
    assert str(trainer.init_from).endswith("/nfs/weights/a b.pth")
    assert trainer.init_from_run is None and not spec.resources


def test_without_init_from_the_task_is_unchanged() -> None:
    script, _words, spec = _script([])
    assert "--init-from" not in script and not spec.resources
