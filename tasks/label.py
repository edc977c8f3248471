"""Label a folder of new images in Blob storage with a trained model (by default the champion of
the config's data root, ``data.container`` + ``data.prefix``: the dataset whose classes it gives):
the images are downloaded as staging downloads data (path-safe, verified), labelled by
``training.predict`` (the trainer's own decoding and preprocessing), and the predictions go to
the output container as a CSV, with a table and a link as the run's artifacts.

It runs on the orchestrator, on its CPU (or its GPU when it has one): for a folder of thousands
of images, not for a dataset; those are scored on the pool (``training.score``).
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from backends.blob import container_client
from core.config import BlobLocation, PipelineConfig
from core.links import output_link
from core.text import markdown_text
from imagedata.images import is_image_name
from registry.layout import labels_blob
from registry.migrate import migrate_legacy_records
from registry.store import champion_of, download, recorded_model_md5, run_file

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

    from staging.listing import PinnedBlob

TABLE_ROWS = 200  # what the run's table shows; the CSV holds every image


@dataclass(frozen=True)
class Labelled:
    csv_blob: str
    link: str
    model: str
    labelled: int
    skipped: list[str]
    chosen: str = ""  # whose model: the champion of which data root, or the run asked for


@task(name="label-images", cache_policy=NONE)
def label_images(
    config: PipelineConfig,
    images: BlobLocation,
    labelling_id: str,
    run_id: str | None = None,
    top_k: int = 3,
) -> Labelled:
    from staging.sync import sync_to_directory
    from training.predict import Prediction, predict, write_csv

    logger = get_run_logger()
    retries = config.retries.storage_retries
    outputs = container_client(config.output, retries)
    base, root = config.output.prefix, config.data.root
    migrate_legacy_records(outputs, base, root, logger.info)
    if run_id is None:
        champion = champion_of(outputs, base, root)
        model, chosen = champion.model, f"the champion of data root {root.where}"
        chosen += f" (run {champion.run_id})"
    else:
        model, chosen = run_file(base, run_id, "model.pt"), f"run {run_id}"
    logger.info("labelling with the model of %s", chosen)
    source = container_client(images, retries)
    files, unusable = image_blobs(source, images.prefix)
    with tempfile.TemporaryDirectory(prefix="label-") as work:
        folder = Path(work) / "images"
        report = sync_to_directory(source, images.prefix, folder, listing=list(files.values()))
        logger.info("downloaded %d files from %s", report.total_files, where(images))
        model_file = download(
            outputs, model, Path(work) / "model.pt", recorded_model_md5(outputs, model)
        )
        logger.info("model %s, checked against %s", model, model_file.checked)
        by_path = {str(folder / path): blob.name for path, blob in files.items()}
        predictions, skipped = predict(model_file.path, list(map(Path, by_path)), top_k)
        predictions = [Prediction(by_path[p.image], p.top) for p in predictions]
        for path, why in skipped:
            # The reason may quote the file's path here (Pillow's messages do): the blob's name
            # stands in for it, and nothing of this machine's folders reaches the artifacts.
            name = by_path[str(path)]
            unusable.append(f"{name}: {why.replace(str(path), name).replace(work, '...')}")
    for line in unusable:
        logger.warning("skipped %s", line)
    if not predictions:
        raise ValueError(f"no readable image under {where(images)} ({len(unusable)} skipped)")
    text = io.StringIO()
    write_csv(predictions, text, top_k)
    blob = labels_blob(base, labelling_id)
    outputs.upload_blob(blob, text.getvalue().encode(), overwrite=True)
    link = output_link(config.output, outputs, blob)
    create_table_artifact(
        [
            {"image": p.image, "label": p.top[0][0], "probability": round(p.top[0][1], 4)}
            for p in predictions[:TABLE_ROWS]
        ],
        key="labels",
        description=f"the likeliest class of each image under {where(images)} (the first "
        f"{TABLE_ROWS}; every image and its top {top_k} are in the CSV)",
    )
    create_link_artifact(
        link,
        link_text="predictions.csv",
        key="labels-csv",
        description=f"{len(predictions)} images labelled by {model}, {chosen}",
    )
    if unusable:
        create_markdown_artifact(
            # Names as text: a blob's name is whoever uploaded it's, and in a code span a
            # backtick in it would end the span (and what follows would render).
            "\n".join(
                [
                    "## Images that could not be labelled",
                    "",
                    *(f"- {markdown_text(s)}" for s in unusable),
                ]
            ),
            key="labels-skipped",
            description=f"{len(unusable)} images skipped",
        )
    return Labelled(blob, link, model, len(predictions), unusable, chosen)


def image_blobs(container: ContainerClient, prefix: str) -> tuple[dict[str, PinnedBlob], list[str]]:
    """The image blobs below ``prefix`` that can be downloaded as files (by their path below
    it), and one line for each
    image that cannot, saying why: a name no file can have (``a//b.png``, ``../x.png``), or one
    whose path another image needs as a folder. Such a name is skipped, not the whole run."""
    from staging.listing import pin
    from staging.sync import UnsafeBlobNameError, safe_relative_path

    prefix = prefix.strip("/")
    below = container.list_blobs(name_starts_with=f"{prefix}/" if prefix else None)
    blobs = [pin(b) for b in below if is_image_name(b.name)]
    usable: dict[str, PinnedBlob] = {}
    skipped: list[str] = []
    for blob in blobs:
        try:
            usable[str(safe_relative_path(blob.name, prefix))] = blob
        except UnsafeBlobNameError as exc:
            skipped.append(f"{blob.name}: not a name a file can have ({exc})")
    kept = {}
    for path, blob in usable.items():
        clash = next((p for p in PurePosixPath(path).parents if str(p) in usable), None)
        if clash is not None:
            skipped.append(f"{blob.name}: needs {clash} as a folder, but that is an image")
        else:
            kept[path] = blob
    return kept, skipped


def where(location: BlobLocation) -> str:
    return f"{location.container}/{location.prefix}".rstrip("/")


def images_location(config: PipelineConfig, container: str, prefix: str) -> BlobLocation:
    """The new images' place, read with the data location's credentials (validated: a bad
    container name is named)."""
    fields: dict[str, Any] = {
        **config.data.model_dump(exclude={"version"}),
        "container": container,
        "prefix": prefix,
    }
    return BlobLocation.model_validate(fields)
