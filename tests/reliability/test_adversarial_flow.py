"""The data path end to end, as the new-data trigger drives it: data versions under new
prefixes through the local flow, and the gate's pinned listing reaching the Azure staging task.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client, upload_directory
from flows.retrain import retrain
from imagedata.make_images import write_digits
from imagedata.shards import INDEX, SHARD_DIR, open_shards
from imagedata.staged_folder import MANIFEST
from tests.pipeline_helpers import make_config
from tests.reliability import report

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


def _images(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.png")}


def _two_versions(tmp_path: Path) -> tuple[Path, Path]:
    """v1, and v2 = v1 plus images of other digits (the layout an uploader of versions uses)."""
    v1, more, v2 = tmp_path / "v1", tmp_path / "more", tmp_path / "v2"
    write_digits(v1, test_fraction=0.25, seed=0, per_class=20)
    write_digits(more, test_fraction=0.25, seed=0, per_class=30)
    shutil.copytree(v1, v2)
    taken = {p.name for p in v1.rglob("*.png")}  # file names are the digit's index
    for path in more.rglob("*.png"):
        if path.name not in taken:
            target = v2 / path.relative_to(more)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    return v1, v2


def _seed_version(config: Any, source: Path, prefix: str) -> None:
    container = container_client(config.data, create=True)
    upload_directory(container, source, prefix)
    container.upload_blob(f"{prefix}/_SUCCESS", b"", overwrite=True)  # written last


def test_new_data_version_trains_on_every_image_and_compares_on_one_test_split(
    tmp_path: Path,
) -> None:
    v1, v2 = _two_versions(tmp_path)
    config = make_config(tmp_path, "data.prefix=images", "training.epochs=1")
    _seed_version(config, v1, "images/v1")
    first = retrain(config=config, return_state=True)  # v1, the only complete version
    assert first.is_completed(), first.message
    _seed_version(config, v2, "images/v2")
    # As the on-new-data deployment starts it: the data root and the event's version.
    second = retrain(config=config, data_prefix="images", data_version="v2", return_state=True)
    assert second.is_completed(), second.message
    result = second.result()

    expected = _images(v2)
    data = config.nfs.local_dir / "data"
    assert _images(data) == expected  # every v2 image on disk, byte for byte, and no other
    manifest = json.loads((data / MANIFEST).read_text())
    assert manifest["prefix"] == "images/v2"
    assert {f["path"] for f in manifest["files"].values()} == set(expected)
    index = json.loads((data / SHARD_DIR / INDEX).read_text())
    assert sum(s["count"] for s in index["splits"].values()) == len(expected)
    packed = open_shards(data, 32)
    assert not isinstance(packed, str), packed
    steps = {s["step"]: s for s in result["steps"]}
    assert steps["stage-data"]["details"]["deleted"] == 0

    outputs = container_client(config.output)
    prefix = f"runs/{result['run_id']}"
    metrics = json.loads(outputs.download_blob(f"{prefix}/metrics.json").readall())
    score = json.loads(outputs.download_blob(f"{prefix}/score.json").readall())
    assert metrics["dataset"]["num_train"] + score["num_images"] == len(expected)
    assert metrics["dataset"]["kind"] == "image-folders (packed shards)"

    # The champion (trained on v1) was scored again on v2's test split, and the decision
    # rests on those two numbers.
    decision = json.loads(outputs.download_blob(f"{prefix}/promotion.json").readall())
    champion = decision["champion_before"]
    assert champion["run_id"] == first.result()["run_id"]
    assert champion["data_version"] != decision["challenger"]["data_version"]
    rescored = decision["champion_on_this_test_split"]
    assert rescored["test_images"] == decision["challenger"]["test_images"] == score["num_images"]
    assert 0.0 <= rescored["accuracy"] <= 1.0
    baseline = rescored["accuracy"] + config.promotion.min_improvement
    # Promoted when better by the margin and no class's recall dropped by more than allowed.
    worst = max(c["drop"] for c in decision["per_class"].values())
    allowed = config.promotion.max_class_drop
    assert allowed is not None
    assert decision["promoted"] is (score["accuracy"] > baseline and worst <= allowed)
    # Both data versions of the one data root named (its champion is the one challenged).
    v1_where, v2_where = (f"{config.data.container}/images/{v}" for v in ("v1", "v2"))
    assert decision["challenger"]["data"] == v2_where and champion["data"] == v1_where
    assert (
        f"both scored on the test split of {v2_where}; the champion was trained on {v1_where}"
        in decision["reason"]
    )
    report.record(
        "adversarial",
        "flow: images/v1 then images/v2 (v1 + new images) into one NFS folder",
        f"all {len(expected)} v2 images on disk, in the shards and the manifest; champion "
        "re-scored on v2's test split",
        champion_v1_score=champion["accuracy"],
        champion_on_v2_test=round(rescored["accuracy"], 4),
        challenger=round(score["accuracy"], 4),
    )


@pytest.fixture
def nodes(fake_azure_account: Any, tmp_path: Path) -> Iterator[Any]:
    """The pool's nodes as emulated hosts, running the tasks the fake Batch service gets."""
    from tests.fakes.node import PoolNodes
    from tests.nodes_helpers import require_emulated_nodes

    require_emulated_nodes()
    with PoolNodes(tmp_path / "pool", None, tmp_path / "nfs", lambda _: None) as pool:
        pool.attach(fake_azure_account.batch)
        fake_azure_account.batch.allocation_ticks = 1
        yield pool


def test_azure_staging_task_stages_the_gates_listing_only(
    fake_azure_account: Any, nodes: Any, tmp_path: Path
) -> None:
    """On Azure the pinned listing reaches the staging task on the node as a resource file:
    a blob uploaded after the gate is not staged, and a blob changed after the gate fails the
    step with the blob named; no secret is on a command line."""
    from prefect import flow
    from prefect.blocks.system import Secret

    from backends.target import AzureTarget
    from core.run import Run
    from tasks.provision import ensure_pool, stage_data, upload_scripts
    from tasks.validate import validate_data
    from tests.azure_helpers import azure_config
    from tests.backends.azure.test_batch import make_cluster

    # The blocks the example config names (the share key mounts the scripts on the nodes).
    Secret(value="c2hhcmUta2V5LXZhbHVl").save("retrain-files-key", overwrite=True)
    Secret(value="registry-password-value").save("retrain-acr-pull", overwrite=True)
    fakes = fake_azure_account
    config = azure_config(tmp_path, "validation.min_images_per_class=1", "nfs.shards=false")
    source = tmp_path / "src"
    write_digits(source, test_fraction=0.5, seed=0, per_class=8)
    container = container_client(config.data, create=True)
    upload_directory(container, source, config.data.prefix)
    nodes.scripts = lambda target: fakes.files.materialize(config.share.name, target)
    cluster = make_cluster(config)
    cls = max((source / "train").iterdir(), key=lambda d: len(list(d.iterdir())))
    late = f"{config.data.prefix}/train/{cls.name}/late.png"
    first, second = (p.read_bytes() for p in sorted(cls.iterdir())[:2])

    @flow
    def gate_then_stage(run_id: str, after_gate: dict[str, bytes]) -> dict[str, Any]:
        run = Run(run_id, f"runs/{run_id}", tmp_path / run_id)
        validate_data(config, run)
        for name, data in after_gate.items():
            container.upload_blob(name, data, overwrite=True)
        target = AzureTarget(config)
        upload_scripts(target)
        ensure_pool(cluster)
        return stage_data.with_options(retries=0)(target, cluster, run).record.as_dict()

    staged = gate_then_stage("r1", {late: first})  # uploaded after the gate
    assert staged["details"]["files"] == sum(1 for _ in source.rglob("*.png"))
    assert not (tmp_path / "nfs" / "data" / "train" / cls.name / "late.png").exists()

    state = gate_then_stage("r2", {late: second}, return_state=True)  # late.png changed
    assert state.is_failed()
    assert f"blob '{late}' changed or was deleted after the data gate" in state.message
    bodies = [
        b for job in fakes.batch.jobs for b in fakes.batch.bodies("POST", f"/jobs/{job}/tasks")
    ]
    stage_bodies = [b for b in bodies if b["id"].startswith("stage-")]
    assert stage_bodies and all(
        any(r["filePath"] == "data-listing.json" for r in b["resourceFiles"])
        and "--listing" in b["commandLine"]
        and "sig=" not in b["commandLine"]
        for b in stage_bodies
    )
    report.record(
        "adversarial",
        "Azure staging: blob uploaded after the gate; blob changed after the gate",
        "late blob not staged; changed blob fails the step, named; listing sent as a "
        "resource file, no secret on the command line",
    )
