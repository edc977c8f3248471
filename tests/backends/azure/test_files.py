"""Azure Files upload of the training scripts: the real azure-storage-file-share client against
the fake Files service."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.azure.clients import share_service
from backends.azure.files import HASH_KEY, AzureFilesShare, BlobContainerShare, ShareError
from backends.share import collect_files, file_sha256
from core.config import PipelineConfig
from tests.azure_helpers import ROOT, azure_config


def _entra_config(tmp_path: Path) -> PipelineConfig:
    """No key block: the upload authenticates with Entra ID (the pool mount still needs one)."""
    config = azure_config(tmp_path)
    share = config.share.model_copy(update={"account_key_secret": None})
    return config.model_copy(update={"share": share})


def _tree(tmp_path: Path) -> dict[str, Path]:
    for rel, text in {
        "training/train.py": "print('train')\n",
        "training/data/formats.py": "X = 1\n",
        "staging/sync.py": "Y = 2\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return collect_files(tmp_path, ["training", "staging"])


def test_upload_creates_share_and_directories_and_records_hashes(
    fake_azure_account, tmp_path: Path
) -> None:
    config = _entra_config(tmp_path)
    files = _tree(tmp_path / "src")
    share = AzureFilesShare(share_service(config.share), config.share.name)

    report = share.upload(files)

    fake = fake_azure_account.files
    assert sorted(report.uploaded) == sorted(files)
    assert fake.file_paths(config.share.name) == sorted(files)  # no temp names left behind
    stored = fake.shares[config.share.name]
    for rel, path in files.items():
        assert stored[rel]["data"] == path.read_bytes()
        assert stored[rel]["metadata"][HASH_KEY] == file_sha256(path)
    assert fake.directories[config.share.name] == {"training", "training/data", "staging"}
    # Entra ID on the File REST API: every request carried a token with the backup intent.
    assert all(r.headers["x-ms-file-request-intent"] == "backup" for r in fake.requests.all())
    # Each file went up under a temporary name and was renamed over its final one.
    renames = [r for r in fake.requests.all() if r.query.get("comp") == "rename"]
    assert sorted(r.path.split("/", 2)[2] for r in renames) == sorted(files)
    assert all(".upload-" in r.headers["x-ms-file-rename-source"] for r in renames)
    assert all(r.headers["x-ms-file-rename-replace-if-exists"] == "true" for r in renames)


def test_second_upload_sends_nothing_and_a_change_sends_one_file(
    fake_azure_account, tmp_path: Path
) -> None:
    config = _entra_config(tmp_path)
    files = _tree(tmp_path / "src")
    share = AzureFilesShare(share_service(config.share), config.share.name)
    first = share.upload(files)
    fake = fake_azure_account.files
    before = len(fake.requests.all())

    again = share.upload(files)
    writes = [r for r in fake.requests.all()[before:] if r.method == "PUT"]
    assert again.uploaded == [] and again.unchanged == len(files)
    assert writes == [r for r in writes if r.query.get("restype") == "share"]  # only the ensure
    assert again.digest == first.digest

    files["training/train.py"].write_text("print('changed')\n")
    changed = share.upload(files)
    assert changed.uploaded == ["training/train.py"]
    assert changed.digest != first.digest
    assert fake.shares[config.share.name]["training/train.py"]["data"] == b"print('changed')\n"


def test_real_scripts_upload_with_an_account_key(fake_azure_account, tmp_path: Path) -> None:
    """The packages the pipeline ships, signed with Shared Key when a key block is named."""
    from azure.core.credentials import AzureNamedKeyCredential
    from azure.storage.fileshare import ShareServiceClient

    from backends.azure import clients

    config = azure_config(tmp_path)
    service = ShareServiceClient(
        str(config.share.account_url),
        credential=AzureNamedKeyCredential("retrainfiles", "a2V5LWZvci10ZXN0cw=="),
        **clients._transport(),
    )
    files = collect_files(ROOT, ["training", "staging"])
    report = AzureFilesShare(service, config.share.name).upload(files)
    assert len(report.uploaded) == len(files) > 10
    auth = {
        r.headers["Authorization"].split(":")[0] for r in fake_azure_account.files.requests.all()
    }
    assert auth == {"SharedKey retrainfiles"}


def test_paths_are_case_insensitive_on_the_share(fake_azure_account, tmp_path: Path) -> None:
    """A directory that differs only in case is the same directory; two files that differ only
    in case would be one file, so the upload refuses them before sending anything."""
    from backends.azure.files import ShareError

    config = _entra_config(tmp_path)
    share = AzureFilesShare(share_service(config.share), config.share.name)
    files = _tree(tmp_path / "src")
    share.upload(files)
    other = tmp_path / "other" / "Training" / "extra.py"
    other.parent.mkdir(parents=True)
    other.write_text("Z = 3\n")
    share.upload({"Training/extra.py": other})
    fake = fake_azure_account.files
    assert "Training/extra.py" in fake.file_paths(config.share.name)
    assert fake.directories[config.share.name] == {"training", "training/data", "staging"}

    clash = tmp_path / "clash"
    (clash / "training").mkdir(parents=True)
    (clash / "training" / "Train.py").write_text("print('other')\n")
    before = len(fake.requests.all())
    with pytest.raises(ShareError, match=r"training/Train\.py and training/train\.py"):
        share.upload({**files, "training/Train.py": clash / "training" / "Train.py"})
    assert len(fake.requests.all()) == before


def test_blob_scripts_upload_once_and_name_a_missing_container(
    azurite: str, tmp_path: Path
) -> None:
    """The scripts container the nodes mount with blobfuse, on Azurite: each file goes up with
    its hash, an unchanged tree costs no upload, a changed file alone is replaced; a container
    that is not there is named (the orchestrator's role cannot create one)."""
    from azure.storage.blob import ContainerClient

    files = _tree(tmp_path / "src")
    missing = BlobContainerShare(ContainerClient.from_connection_string(azurite, "no-scripts"))
    with pytest.raises(ShareError, match="no-scripts does not exist"):
        missing.upload(files)
    container = ContainerClient.from_connection_string(azurite, "scripts-blob")
    container.create_container()
    share = BlobContainerShare(container)
    first = share.upload(files)
    assert sorted(first.uploaded) == sorted(files)
    for rel, path in files.items():
        blob = container.get_blob_client(rel)
        assert blob.download_blob().readall() == path.read_bytes()
        assert blob.get_blob_properties().metadata[HASH_KEY] == file_sha256(path)
    again = share.upload(files)
    assert again.uploaded == [] and again.unchanged == len(files) and again.digest == first.digest
    files["staging/sync.py"].write_text("Y = 3\n")
    changed = share.upload(files)
    assert changed.uploaded == ["staging/sync.py"] and changed.digest != first.digest
