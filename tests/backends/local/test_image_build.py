"""The local target's build-image step: the cpu image built with buildah, pushed to a real
registry (docker-registry), skipped when the registry has its tag, as ACR Tasks is on Azure.

The session's image (``training_image``) is the one this step builds for this checkout; the
step is run here against the session's registry and against a registry it starts itself.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
import uuid
from pathlib import Path

import pytest

from backends.image import image_inputs
from backends.local.buildah import LocalImageBuilder
from backends.local.ports import free_port
from backends.oci import ImageRegistry
from backends.target import LocalTarget
from tests.conftest import ROOT
from tests.pipeline_helpers import make_config

# Every test here builds or serves the image (the session's build, a registry).
pytestmark = pytest.mark.processes

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _layers(registry: ImageRegistry, reference: str) -> list[str]:
    repository, tag = reference.split("/", 1)[1].rsplit(":", 1)
    request = urllib.request.Request(
        f"http://{registry.address}/v2/{repository}/manifests/{tag}", headers={"Accept": MANIFEST}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return [layer["digest"] for layer in json.loads(response.read())["layers"]]


def test_the_step_finds_the_image_by_its_tag_and_does_not_build_it_again(
    tmp_path: Path, image_registry: ImageRegistry, training_image: str
) -> None:
    config = make_config(tmp_path, f"image.registry={image_registry.address}")
    lines: list[str] = []
    result = LocalTarget(config).build_image(lines.append)
    assert result.reference == training_image
    assert result.built is False and result.reason == "tag already in the registry"
    assert lines == []  # nothing was built, so buildah said nothing


def test_the_step_runs_a_registry_of_its_own_when_none_listens(
    tmp_path: Path, image_registry: ImageRegistry, training_image: str
) -> None:
    """The configured address is free: the step serves the shared storage there for as long
    as it needs, finds the image pushed before, and stops the registry again."""
    address = f"127.0.0.1:{free_port()}"
    config = make_config(tmp_path, f"image.registry={address}")
    result = LocalTarget(config).build_image(lambda _: None)
    assert result.reference == f"{address}/{training_image.split('/', 1)[1]}"
    assert result.built is False
    assert not ImageRegistry(address).answers()


@pytest.mark.processes
def test_a_code_change_rebuilds_only_the_code_layer(
    tmp_path: Path, image_registry: ImageRegistry, training_image: str
) -> None:
    """Layers go from the least to the most often changed: an edit of the training code gives
    a new tag whose image shares every layer below the code with the unchanged one."""
    checkout = tmp_path / "checkout"
    for rel, source in image_inputs(ROOT).items():
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, checkout / rel)
    with open(checkout / "training" / "__init__.py", "a") as handle:
        # An edit no earlier session made (its tag must be new: a tag in the registry is
        # never built again).
        handle.write(f"# an edit of the code, nothing else: {uuid.uuid4().hex}\n")
    lines: list[str] = []
    changed = LocalImageBuilder(image_registry).build(checkout, "retrain/horovod", lines.append)
    assert changed.built is True and changed.reference != training_image
    before = _layers(image_registry, training_image)
    after = _layers(image_registry, changed.reference)
    assert len(before) == len(after)
    # The code layer differs, and the last one (which drops the build's mount points) with it;
    # everything below them (the OS, Python, torch, the packages, Horovod) is the same.
    assert before[:-2] == after[:-2] and before[-2] != after[-2]
    assert any("Using cache" in line for line in lines)


def test_a_config_for_azure_cannot_ask_for_buildah(tmp_path: Path) -> None:
    from core.config import ConfigError
    from tests.azure_helpers import azure_config

    with pytest.raises(ConfigError, match=r"image\.builder buildah builds the local target"):
        azure_config(tmp_path, "image.builder=buildah")


def test_builder_none_names_the_tag_and_builds_nothing(tmp_path: Path) -> None:
    config = make_config(tmp_path, "image.builder=none", "image.registry=127.0.0.1:9")
    result = LocalTarget(config).build_image(lambda _: None)
    assert result.built is False and "image.builder none" in result.reason
    # No registry was asked (nothing listens on port 9): the reference names the tag only.
    assert result.reference.startswith("retrain/horovod:")
