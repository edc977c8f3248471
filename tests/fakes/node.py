"""A Batch node for the fake Batch service that really runs the task: the executor used by the
end-to-end Azure flow test.

It does what a node's agent does for a task: mounts (the fake Files share as it is now, and an
NFS directory) under ``$AZ_BATCH_NODE_MOUNTS_DIR``, resource files fetched through their URLs,
the task's environment settings plus Batch's variables, the coordination command then the
command line, without a shell. The container image is not run (no engine here): the commands
run with this checkout's virtualenv, which has what the image has. One node: the host list is
``localhost``.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests

from backends.taskspec import node_environment
from tests.fakes.batch import Attempt
from tests.fakes.files import FakeFiles


class LocalNode:
    def __init__(self, root: Path, files: FakeFiles, share: str, nfs_dir: Path) -> None:
        self.root, self.files, self.share, self.nfs_dir = root, files, share, nfs_dir
        self.commands: list[str] = []  # every command line this node ran
        self._ids = itertools.count(1)

    def __call__(self, task: dict[str, Any], env: dict[str, str]) -> Attempt:
        mounts = self.root / "mounts"
        scripts = mounts / "scripts"
        shutil.rmtree(scripts, ignore_errors=True)
        self.files.materialize(self.share, scripts)
        self.nfs_dir.mkdir(parents=True, exist_ok=True)
        if not (mounts / "nfs").exists():
            (mounts / "nfs").symlink_to(self.nfs_dir.resolve(), target_is_directory=True)
        task_dir = self.root / "tasks" / f"{task['id']}-{next(self._ids)}"
        wd = task_dir / "wd"
        for sub in ("wd", "shared"):
            (task_dir / sub).mkdir(parents=True)
        for resource in task.get("resourceFiles", []):
            reply = requests.get(resource["httpUrl"], timeout=60)
            reply.raise_for_status()  # a SAS without read permission fails here
            (wd / resource["filePath"]).write_bytes(reply.content)
        bindir = str(Path(sys.executable).parent)
        node_env = node_environment(os.environ)  # what a node has, none of our secrets
        node_env.update(env)
        node_env.update(
            {
                "PATH": f"{bindir}{os.pathsep}{node_env.get('PATH', '')}",
                "AZ_BATCH_HOST_LIST": "localhost",
                "AZ_BATCH_NODE_MOUNTS_DIR": str(mounts.resolve()),
                "AZ_BATCH_TASK_DIR": str(task_dir.resolve()),
                "AZ_BATCH_TASK_WORKING_DIR": str(wd.resolve()),
                "AZ_BATCH_TASK_SHARED_DIR": str((task_dir / "shared").resolve()),
            }
        )
        output: list[str] = []
        code = 0
        commands = [task.get("multiInstanceSettings", {}).get("coordinationCommandLine")]
        for command in [*commands, task["commandLine"]]:
            if not command:
                continue
            self.commands.append(command)
            proc = subprocess.run(
                shlex.split(command),
                cwd=wd,
                env=node_env,
                capture_output=True,
                text=True,
                check=False,
                timeout=600,
            )
            output.append(proc.stdout + proc.stderr)
            code = proc.returncode
            if code != 0:
                break
        files = {p.relative_to(wd).as_posix(): p.read_bytes() for p in wd.rglob("*") if p.is_file()}
        return Attempt(code, "".join(output), files)
