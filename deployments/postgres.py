"""A PostgreSQL server for the Prefect server of the local service, with its data in a folder of
the project (``.service/postgres``) and no network listener.

Prefect recommends PostgreSQL for anything shared: SQLite serializes writers, and the service's
workers, relay, sensor and UI all write at once. Debian's ``postgresql`` package provides the
binaries (``make setup`` installs it as root). The server listens on a Unix socket inside its
data folder only (``listen_addresses=''``), so no port can collide and only the folder's owner
(and root) can connect; authentication inside is ``trust`` for the one role, ``prefect``.

PostgreSQL refuses to run as root: as root, the server and ``initdb`` run as the ``postgres``
user the package creates. Where that user cannot reach the state folder (a checkout in a
private folder, as ``/root`` is), the data folder goes below that user's home instead
(``~postgres/retrain/<digest of the state folder>``, mode 0700, owned by it alone), the same one
at every start of that state folder. Such a folder outlives its state folder, so its owner is
recorded beside it (``<digest>.owner.json``: the state folder and that folder's own id): a new
state folder at the same path (a new checkout where an old one was) is refused it by name
instead of silently given the old database, and ``remove`` (``make service
SERVICE_ARGS=--clean``) deletes it with its record.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLE = "prefect"
DATABASE = "prefect"
SOCKET_PORT = 5432  # names the socket file only (.s.PGSQL.5432): nothing listens on a port
_SOCKET_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less the terminating NUL


class PostgresError(RuntimeError):
    """PostgreSQL is missing, or its folder cannot be set up; the message says what to do."""


def binaries() -> Path:
    """The folder of ``initdb`` and ``postgres``: Debian keeps them out of PATH, under
    /usr/lib/postgresql/<version>/bin (the newest installed version is used)."""
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if debian:
        return debian[-1].parent
    found = shutil.which("postgres")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    raise PostgresError(
        "PostgreSQL is not installed: `make setup` installs Debian's postgresql when run as "
        "root (or: apt-get install postgresql)"
    )


def _reachable(folder: Path, user: str) -> bool:
    """Whether ``user`` may pass through every existing folder from ``/`` to ``folder`` (those
    not made yet are made by this process, with its umask's search bits)."""
    try:
        account = pwd.getpwnam(user)
    except KeyError:
        return True  # Cluster._as_owner names the missing user
    groups = {account.pw_gid, *(g.gr_gid for g in _groups_of(user))}
    for part in [folder, *folder.parents]:
        try:
            st = part.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == account.pw_uid:
            bit = stat.S_IXUSR
        elif st.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def _groups_of(user: str) -> list[Any]:
    import grp

    return [g for g in grp.getgrall() if user in g.gr_mem]


def _in_home_of(user: str, data_dir: Path) -> Path:
    """The data folder of ``data_dir``'s state below ``user``'s home: one per state folder."""
    home = Path(pwd.getpwnam(user).pw_dir)
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:16]
    return home / "retrain" / digest


@dataclass(frozen=True)
class Cluster:
    """One PostgreSQL data folder and how to run its server."""

    data_dir: Path
    bin_dir: Path
    user: str | None  # the account the server runs as; None: this process's own
    in_home: bool = False  # below the server account's home (the state folder is private)

    @classmethod
    def at(cls, data_dir: Path) -> Cluster:
        data_dir = data_dir.resolve()
        user = "postgres" if os.geteuid() == 0 else None
        in_home = user is not None and not _reachable(data_dir.parent, user)
        if in_home:
            data_dir = _in_home_of(str(user), data_dir)
        socket = data_dir / f".s.PGSQL.{SOCKET_PORT}"
        if len(os.fsencode(socket)) > _SOCKET_PATH_MAX:
            raise PostgresError(
                f"{data_dir} is too deep for PostgreSQL's socket ({socket} is over "
                f"{_SOCKET_PATH_MAX} bytes): choose a shorter state folder"
            )
        return cls(data_dir, binaries(), user, in_home)

    @property
    def url(self) -> str:
        """The SQLAlchemy URL Prefect's ``PREFECT_API_DATABASE_CONNECTION_URL`` takes."""
        return f"postgresql+asyncpg://{ROLE}@/{DATABASE}?host={self.data_dir}&port={SOCKET_PORT}"

    def _as_owner(self) -> dict[str, Any]:
        """Popen arguments that run a command as the server's account."""
        if self.user is None:
            return {}
        try:
            account = pwd.getpwnam(self.user)
        except KeyError:
            raise PostgresError(
                f"there is no {self.user} user to run PostgreSQL as (it refuses to run as "
                "root): install Debian's postgresql package, which creates it"
            ) from None
        return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}

    @property
    def owner_file(self) -> Path:
        """Where the owner of a data folder below the server account's home is recorded."""
        return self.data_dir.with_name(f"{self.data_dir.name}.owner.json")

    def claim(self, state: Path, service_id: str, adopt: bool) -> str | None:
        """Check that a data folder outside ``state`` is that state folder's (its recorded
        owner is ``service_id``), recording it for a new folder, or for an old one that
        predates the records when ``adopt`` (its state folder was used before); PostgresError
        names the folder and its owner otherwise. A folder inside the state folder goes with
        it: nothing to check. Returns a note for the status line."""
        if not self.in_home:
            return None
        exists = (self.data_dir / "PG_VERSION").exists()
        try:
            owner = json.loads(self.owner_file.read_text())
        except FileNotFoundError:
            owner = None
        except (OSError, ValueError):
            owner = {}
        if isinstance(owner, dict) and owner.get("service_id") == service_id:
            return None
        if exists and not (owner is None and adopt):
            made_by = (
                f"the service of state folder {owner.get('state', '?')} (id "
                f"{owner.get('service_id', '?')}, {owner.get('created', '?')})"
                if isinstance(owner, dict) and owner
                else "an earlier service whose state folder is gone (no owner recorded)"
            )
            raise PostgresError(
                f"the PostgreSQL data folder {self.data_dir} was made by {made_by}, not by this "
                f"state folder ({state}): it is not reused. Remove it, with that service's "
                f"database, by `python -m deployments.service --state {state} --clean` (make "
                f'service SERVICE_ARGS="--clean" for the default state folder)'
            )
        from datetime import UTC, datetime

        self.owner_file.parent.mkdir(parents=True, exist_ok=True)
        self.owner_file.write_text(
            json.dumps(
                {
                    "state": str(state),
                    "service_id": service_id,
                    "created": datetime.now(UTC).isoformat(timespec="seconds"),
                }
            )
        )
        return (
            f"data folder of an earlier start adopted ({self.owner_file.name})" if exists else None
        )

    def remove(self) -> str | None:
        """Delete the data folder and its owner record (the server must be stopped); what was
        removed, or None when there was nothing."""
        found = [p for p in (self.data_dir, self.owner_file) if p.exists()]
        for path in found:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        return f"PostgreSQL data folder {self.data_dir} removed" if found else None

    def environment(self) -> dict[str, str]:
        return {"PATH": f"{self.bin_dir}:/usr/bin:/bin", "LC_ALL": "C", "HOME": str(self.data_dir)}

    def initialise(self) -> bool:
        """Create the data folder once (``initdb``); False when it already holds a cluster."""
        if (self.data_dir / "PG_VERSION").exists():
            return False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        owner = self._as_owner()
        folders = [self.data_dir]
        if self.in_home:
            folders.append(self.data_dir.parent)  # ~postgres/retrain: the server's own too
        for folder in folders:
            if owner:
                os.chown(folder, owner["user"], owner["group"])
            folder.chmod(0o700)
        proc = subprocess.run(
            [
                str(self.bin_dir / "initdb"),
                "--pgdata",
                str(self.data_dir),
                "--auth",
                "trust",
                "--username",
                ROLE,
                "--encoding",
                "UTF8",
                "--locale",
                "C",
                "--no-instructions",
            ],
            env=self.environment(),
            capture_output=True,
            text=True,
            check=False,
            **owner,
        )
        if proc.returncode != 0:
            hint = (
                f" (the {self.user} user must be able to reach {self.data_dir}: every folder "
                "above it needs o+x)"
                if self.user and "ermission denied" in proc.stderr
                else ""
            )
            raise PostgresError(f"initdb {self.data_dir} failed{hint}: {proc.stderr.strip()}")
        return True

    def server_command(self) -> list[str]:
        """The server in the foreground (its supervisor stops it with SIGINT: a fast shutdown)."""
        return [
            str(self.bin_dir / "postgres"),
            "-D",
            str(self.data_dir),
            "-p",
            str(SOCKET_PORT),
            "-k",
            str(self.data_dir),
            "-c",
            "listen_addresses=",
        ]

    def popen_options(self) -> dict[str, Any]:
        """What the server's process needs besides its command and environment: the account
        it runs as and its working folder."""
        return {**self._as_owner(), "cwd": str(self.data_dir)}

    def accepting(self) -> bool:
        """Whether the server accepts connections (``pg_isready`` on its socket)."""
        proc = subprocess.run(
            [
                str(self.bin_dir / "pg_isready"),
                "--host",
                str(self.data_dir),
                "--port",
                str(SOCKET_PORT),
                "--username",
                ROLE,
                "--dbname",
                "postgres",
                "--quiet",
            ],
            env=self.environment(),
            check=False,
        )
        return proc.returncode == 0

    def sync_url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` for a synchronous client (psycopg): the MLflow
        server's backend store."""
        return f"postgresql+psycopg://{ROLE}@/{database}?host={self.data_dir}&port={SOCKET_PORT}"

    def create_database(self, database: str = DATABASE) -> bool:
        """``database`` (the ``prefect`` one by default), once; False when it exists. Each
        server creates its tables in its own (its migrations) when it starts."""
        proc = subprocess.run(
            [
                str(self.bin_dir / "createdb"),
                "--host",
                str(self.data_dir),
                "--port",
                str(SOCKET_PORT),
                "--username",
                ROLE,
                database,
            ],
            env=self.environment(),
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == 0:
            return True
        if "already exists" in proc.stderr:
            return False
        raise PostgresError(f"createdb {database} failed: {proc.stderr.strip()}")
