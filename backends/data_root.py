"""The listing behind ``core.data_versions``: what lies directly below a data root, read from
Blob storage (Azure or Azurite).

One listing of the root's top level (folders and files, not their contents), then one
properties read per folder for its marker. A root holding years of versions of millions of
images costs a page of folder names and a request per version, not a listing of every image:
the sensor does this every ten minutes, and every run once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from backends.blob import container_client
from core.config import DataLocation
from core.data_versions import Complete, DataRoot, DataVersion, Survey, choose
from imagedata.images import SPLITS
from staging.blob import folder

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient


def _marker(container: ContainerClient, name: str) -> Any | None:
    """The marker blob's properties, None when it does not exist."""
    from azure.core.exceptions import ResourceNotFoundError

    try:
        return container.get_blob_client(name).get_blob_properties()
    except ResourceNotFoundError:
        return None


def survey(container: ContainerClient, prefix: str) -> Survey:
    """What lies directly below ``prefix`` in ``container``: files, split folders, complete
    versions (with their markers) and folders still arriving."""
    root = DataRoot(container.container_name, prefix.strip("/"))
    start = folder(root.prefix) or ""
    files: list[str] = []
    splits: list[str] = []
    candidates: list[str] = []
    for item in container.walk_blobs(name_starts_with=start or None, delimiter="/"):
        name = str(item.name)
        if name.endswith("/"):
            sub = name[len(start) : -1]
            (splits if sub in SPLITS else candidates).append(sub)
        else:
            files.append(name)
    with ThreadPoolExecutor(max_workers=16) as pool:
        markers = list(pool.map(lambda v: _marker(container, root.marker(v)), candidates))
    complete, incomplete = [], []
    for name, props in zip(candidates, markers, strict=True):
        if props is None:
            incomplete.append(name)
        else:
            complete.append(Complete(name, str(props.etag).strip('"'), props.last_modified))
    own = root.marker(None)
    root_marker = None
    if own in files:
        props = _marker(container, own)
        root_marker = str(props.etag).strip('"') if props is not None else None
    return Survey(root, files, splits, complete, incomplete, root_marker)


def resolve(location: DataLocation, retries: int = 3) -> DataVersion:
    """The data a run over ``location`` trains: its ``version``, or the newest complete one, or
    the whole root when it holds no versions (``core.data_versions.choose``)."""
    container = container_client(location, retries)
    return choose(survey(container, location.prefix), location.version)
