"""The unprivileged account ``make service`` runs its worker as when it is started as root, and
the folders that account is given: nothing else of the host.

A flow run executes whatever its deployment says (a pull step may run a shell command), so the
worker that starts flow runs must not be root. Started as root, the service runs its worker
(and with it every flow run), the relay and the outputs gateway as an account of their own:
the one ``--user`` names, else ``retrain-<digest of the state folder>``, created as a system
account with no login shell and no home (each service's account is its own, so the flow runs of
one cannot read another's processes' environment). PostgreSQL already runs as ``postgres``.

That account gets, through POSIX ACLs naming it alone (``setfacl``: a folder's mode, and with
it everybody else's access, is left as it is), what it needs: passage through the folders above
the checkout, the config and the state folder; reading the checkout; writing its own home in the
state folder and the local target's folders (``work_dir``, ``share.local_dir``,
``nfs.local_dir``), with default ACLs so files made there later stay reachable by it. Each grant
is recorded in the state folder, so ``--clean`` takes it back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCOUNT_FILE = "account.json"  # in the state folder: the account and whether we made it
GRANTS_FILE = "access.json"  # in the state folder: every ACL entry given to it, to take back
HOME = "account-home"  # in the state folder: the account's HOME, caches and Prefect home
_MADE_BY = "make service of "  # the GECOS field of an account the service created


class AccountError(RuntimeError):
    """The account cannot be used or made; the message names it and what to do."""


@dataclass(frozen=True)
class Account:
    """The account the service's unprivileged components run as."""

    name: str
    uid: int
    gid: int
    home: Path  # below the state folder: its own, mode 0700

    def popen(self) -> dict[str, Any]:
        """Popen arguments that run a process as this account (no supplementary groups)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def environment(self) -> dict[str, str]:
        """Where its processes keep their own files: its home, never root's."""
        return {
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "PREFECT_HOME": str(self.home / "prefect"),
            # Its own temporary folder: /tmp holds folders of root's that Prefect reuses by
            # name (its runner's storage), which this account could not write.
            "TMPDIR": str(self.home / "tmp"),
        }


def default_name(state: Path) -> str:
    """The account of the service of ``state``: one per state folder."""
    return "retrain-" + hashlib.sha256(os.fsencode(state)).hexdigest()[:8]


def service_account(state: Path, name: str | None) -> tuple[Account | None, str | None]:
    """The account the service's worker runs as, made when it is the default one and missing,
    with a note for the status line; (None, None) when this process is not root (its
    components then run as this user, who is not root either)."""
    if os.geteuid() != 0:
        if name:
            raise AccountError(f"--user {name}: only a service started as root changes account")
        return None, None
    note = None
    wanted = name or default_name(state)
    try:
        entry = pwd.getpwnam(wanted)
    except KeyError:
        if name:
            raise AccountError(
                f"--user {name}: there is no such account (create it, or leave --user out and "
                "the service makes one of its own)"
            ) from None
        _create(wanted, state)
        entry = pwd.getpwnam(wanted)
        note = f"account {wanted} created"
    if entry.pw_uid == 0:
        raise AccountError(f"--user {wanted}: uid 0 is root, and flow runs must not run as root")
    _record(state, wanted, created=note is not None)
    home = state / HOME
    for folder in (home, home / "tmp"):
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
        folder.chmod(0o700)
    return Account(wanted, entry.pw_uid, entry.pw_gid, home), note


def _create(name: str, state: Path) -> None:
    if shutil.which("useradd") is None:
        raise AccountError(f"useradd is missing: cannot create the account {name} (--user NAME)")
    done = subprocess.run(
        [
            "useradd",
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            "--comment",
            f"{_MADE_BY}{state}"[:200],
            name,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise AccountError(f"useradd {name} failed: {done.stderr.strip()}")


def _record(state: Path, name: str, created: bool) -> None:
    path = state / ACCOUNT_FILE
    earlier = _read_json(path)
    if isinstance(earlier, dict) and earlier.get("name") == name:
        created = created or bool(earlier.get("created"))
    state.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": name, "created": created}))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def can_pass(folder: Path, uid: int, gids: Iterable[int]) -> bool:
    """Whether the account (``uid`` in ``gids``) may pass through every existing folder from
    ``/`` to ``folder``, by their modes (an ACL entry already given counts as its mask allows
    it: ``setfacl`` is asked again, which changes nothing)."""
    groups = set(gids)
    for part in [folder, *folder.parents]:
        try:
            st = part.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def _setfacl(*args: str) -> None:
    if shutil.which("setfacl") is None:
        raise AccountError(
            "setfacl is missing: `make setup` installs Debian's acl package as root "
            "(apt-get install acl); the service gives its account access to its folders with it"
        )
    done = subprocess.run(["setfacl", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AccountError(f"setfacl {' '.join(args)} failed: {done.stderr.strip()}")


def grant(
    account: Account, state: Path, reads: Iterable[Path], writes: Iterable[Path]
) -> list[str]:
    """Give ``account`` passage to, reading of ``reads`` and writing of ``writes`` (folders,
    made when missing), by ACL entries naming it; each recorded for ``revoke``. Returns what
    was given, for the status line."""
    given: list[dict[str, Any]] = list(_read_json(state / GRANTS_FILE) or [])
    seen = {(g["path"], g["entry"]) for g in given}
    said: list[str] = []

    def add(path: Path, entry: str, recursive: bool = False) -> None:
        args = ["-R"] if recursive else []
        _setfacl(*args, "-m", entry.format(user=account.name), str(path))
        if (str(path), entry) not in seen:
            seen.add((str(path), entry))
            given.append({"path": str(path), "entry": entry, "recursive": recursive})

    def passage(path: Path) -> None:
        for folder in reversed(path.parents):
            if folder != Path("/") and not _others_pass(folder):
                add(folder, "u:{user}:x")

    for path in reads:
        path = path.resolve()
        passage(path)
        if not os.access(path, os.F_OK):
            continue
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            if not (mode & stat.S_IROTH and mode & stat.S_IXOTH):
                add(path, "u:{user}:rx")
                said.append(f"read {path}")
        elif not mode & stat.S_IROTH:
            add(path, "u:{user}:r")
            said.append(f"read {path}")
    for path in writes:
        path = path.resolve()
        path.mkdir(parents=True, exist_ok=True)
        passage(path)
        add(path, "u:{user}:rwX,d:u:{user}:rwX", recursive=True)
        said.append(f"write {path}")
    (state / GRANTS_FILE).write_text(json.dumps(given, indent=1))
    return said


def allow_read(account: Account, path: Path) -> None:
    """Let ``account`` read the file ``path`` (removed with it: not recorded)."""
    _setfacl("-m", f"u:{account.name}:r", str(path))


def _others_pass(folder: Path) -> bool:
    try:
        return bool(folder.stat().st_mode & stat.S_IXOTH)
    except FileNotFoundError:
        return True


def revoke(state: Path) -> list[str]:
    """Take back every ACL entry ``grant`` recorded for the state's account, and remove the
    account when the service made it; what was done."""
    done: list[str] = []
    record = _read_json(state / ACCOUNT_FILE)
    if not isinstance(record, dict) or not record.get("name"):
        return done
    name = str(record["name"])
    for entry in _read_json(state / GRANTS_FILE) or []:
        path = Path(entry["path"])
        if not path.exists():
            continue
        removal = f"u:{name}" + (f",d:u:{name}" if "d:u:" in entry["entry"] else "")
        args = ["-R"] if entry.get("recursive") else []
        with contextlib.suppress(AccountError):
            _setfacl(*args, "-x", removal, str(path))
    if (state / GRANTS_FILE).exists():
        done.append(f"the access given to {name} taken back")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return done
    if record.get("created") and entry.pw_gecos.startswith(_MADE_BY):
        subprocess.run(["userdel", name], capture_output=True, check=False)
        done.append(f"account {name} removed")
    return done
