"""`make service`'s PostgreSQL from a private state folder: as root the server runs as the
postgres user, who cannot enter a 0700 folder of root's (a checkout under /root)."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from deployments.postgres import Cluster
from deployments.service import postgres_component
from deployments.supervisor import Supervisor

pytestmark = pytest.mark.processes


def test_a_private_state_folder_gets_a_data_folder_the_server_owns_alone() -> None:
    private = Path(tempfile.mkdtemp(prefix="retrain-private-"))  # mode 0700, root's
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    cluster = Cluster.at(private / "state" / "postgres")
    supervisor = Supervisor(private / "logs", say=lambda line: None)
    try:
        if os.geteuid() != 0:  # the server runs as this user, who reaches its own folder
            assert cluster.data_dir == (private / "state" / "postgres").resolve()
            assert not cluster.in_home
        else:
            owner = pwd.getpwnam("postgres")
            assert cluster.in_home and cluster.data_dir.is_relative_to(owner.pw_dir)
            # The same state folder finds the same data folder at every start.
            assert Cluster.at(private / "state" / "postgres").data_dir == cluster.data_dir
        supervisor.start(postgres_component(cluster))
        assert cluster.accepting()
        assert cluster.create_database("probe")
        st = cluster.data_dir.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700
        if os.geteuid() == 0:
            assert st.st_uid == pwd.getpwnam("postgres").pw_uid
            parent = cluster.data_dir.parent.stat()
            assert stat.S_IMODE(parent.st_mode) == 0o700 and parent.st_uid == st.st_uid
    finally:
        supervisor.stop()
        shutil.rmtree(private, ignore_errors=True)
        if cluster.in_home:
            shutil.rmtree(cluster.data_dir, ignore_errors=True)
