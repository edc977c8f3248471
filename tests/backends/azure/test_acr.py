"""Image builds with ACR Tasks: the real azure-mgmt-containerregistrytasks and
azure-containerregistry clients against the fake ARM and registry; the build context and the
run log go through Azurite, as through the registry's storage on Azure."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from backends.azure.acr import AcrBuilder, ImageBuildError
from backends.azure.clients import acr_tasks_client, registry_client
from backends.image import content_tag
from tests.azure_helpers import ROOT, azure_config

PREFIX = "/subscriptions/00000000-0000-0000-0000-000000000001/resourceGroups/retrain-rg"
REGISTRY = f"{PREFIX}/providers/Microsoft.ContainerRegistry/registries/retrainacr"


def _builder(tmp_path: Path) -> AcrBuilder:
    config = azure_config(tmp_path)
    return AcrBuilder(
        acr_tasks_client(config.azure),
        registry_client(str(config.image.registry)),
        "retrain-rg",
        "retrainacr.azurecr.io",
        poll_seconds=0.01,
    )


def test_missing_tag_is_built_remotely_and_an_existing_one_is_not(
    fake_azure_account, tmp_path: Path
) -> None:
    acr = fake_azure_account.acr
    tag = content_tag(ROOT)
    lines: list[str] = []

    first = _builder(tmp_path).build(ROOT, "retrain/horovod", tag, lines.append)

    assert first.built and first.reference == f"retrainacr.azurecr.io/retrain/horovod:{tag}"
    (schedule,) = [r for r in acr.requests.all() if r.path == f"{REGISTRY}/scheduleRun"]
    assert schedule.query["api-version"] == "2025-03-01-preview"
    body = schedule.json()
    assert body["type"] == "DockerBuildRequest"
    assert body["imageNames"] == [f"retrain/horovod:{tag}"] and body["isPushEnabled"] is True
    assert body["dockerFilePath"] == "docker/Dockerfile"
    assert body["platform"] == {"os": "Linux", "architecture": "amd64"}
    assert body["sourceLocation"].startswith("source/")
    # The context that went to the upload URL holds exactly what the tag hashes.
    context = acr.storage.download_blob(body["sourceLocation"]).readall()
    with tarfile.open(fileobj=io.BytesIO(context), mode="r:gz") as tar:
        names = set(tar.getnames())
    assert {"docker/Dockerfile", "training/train.py", "constraints.txt"} <= names
    assert not any("__pycache__" in n for n in names)
    assert f"pushed retrain/horovod:{tag}" in lines  # the run log, streamed
    assert all(
        r.headers["Authorization"] == "Bearer fake-entra-token"
        for r in acr.requests.all()
        if r.host == "management.azure.com"
    )

    before = len(acr.requests.all())
    second = _builder(tmp_path).build(ROOT, "retrain/horovod", tag, lines.append)
    assert not second.built and second.reason == "tag already in the registry"
    assert not [r for r in acr.requests.all()[before:] if r.path.endswith("scheduleRun")]


def test_failed_build_names_the_run_and_the_reason(fake_azure_account, tmp_path: Path) -> None:
    fake_azure_account.acr.fail_builds = True
    with pytest.raises(ImageBuildError) as err:
        _builder(tmp_path).build(ROOT, "retrain/horovod", "deadbeef", lambda _: None)
    assert "ACR run cb" in str(err.value) and "ended Failed" in str(err.value)
    assert "failed to solve" in str(err.value)


def test_context_archive_is_reproducible() -> None:
    from backends.image import context_archive

    assert context_archive(ROOT) == context_archive(ROOT)


def test_run_log_is_followed_while_the_build_runs(fake_azure_account, tmp_path: Path) -> None:
    """A QuickBuild goes Queued -> Started -> Running -> Succeeded and appends to its log blob
    as it runs; the builder streams each line once, in order."""
    acr = fake_azure_account.acr
    acr.polls_per_state = 3
    lines: list[str] = []
    result = _builder(tmp_path).build(ROOT, "retrain/horovod", "cafe0001", lines.append)
    assert result.built
    steps = [line for line in lines if line.startswith("Step ")]
    assert steps[0].startswith("Step 1/20") and steps[-1] == "Step 20/20 : done"
    assert len(steps) == len(set(steps)) > 3  # appended while running, none read twice
    (run,) = acr.runs.values()
    assert run["properties"]["runType"] == "QuickBuild"
    assert {"createTime", "startTime", "finishTime"} <= set(run["properties"])
    assert acr.refused == []


def test_schedule_run_body_is_checked_against_the_spec(fake_azure_account, tmp_path: Path) -> None:
    from azure.core.exceptions import HttpResponseError

    fake_azure_account.acr.allow_refusals = True
    builder = _builder(tmp_path)
    builder.timeout_seconds = 60  # the spec's minimum run timeout is 300 s
    with pytest.raises(HttpResponseError) as err:
        builder.build(ROOT, "retrain/horovod", "cafe0002", lambda _: None)
    assert err.value.status_code == 400 and "timeout" in str(err.value)
