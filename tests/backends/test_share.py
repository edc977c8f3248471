"""The local scripts share: files replaced whole with their mode, unchanged ones left alone."""

from __future__ import annotations

from pathlib import Path

from backends.share import HASHES, LocalShare


def test_files_land_whole_with_their_mode_and_unchanged_ones_are_skipped(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "training").mkdir(parents=True)
    script = source / "training" / "launch.sh"
    script.write_text("#!/bin/bash\necho hi\n")
    script.chmod(0o755)
    module = source / "training" / "train.py"
    module.write_text("print('train')\n")
    module.chmod(0o644)
    files = {"training/launch.sh": script, "training/train.py": module}
    share = LocalShare(tmp_path / "share")

    first = share.upload(files)
    assert sorted(first.uploaded) == sorted(files) and first.unchanged == 0
    landed = tmp_path / "share" / "training"
    assert (landed / "launch.sh").stat().st_mode & 0o777 == 0o755  # a node can run it
    assert (landed / "train.py").stat().st_mode & 0o777 == 0o644
    assert (landed / "train.py").read_text() == "print('train')\n"
    names = {p.name for p in (tmp_path / "share").rglob("*") if p.is_file()}
    assert names == {"launch.sh", "train.py", HASHES}  # no temp file left behind

    module.write_text("print('changed')\n")
    again = share.upload(files)
    assert again.uploaded == ["training/train.py"] and again.unchanged == 1
    assert (landed / "train.py").read_text() == "print('changed')\n"
    assert again.digest != first.digest
