"""What a run's training starts from: ``training.init_from``, read and checked without I/O.

The values a config may give, each naming a place the pipeline already reads, so that no new
endpoint (and no credential) comes in with it:

``null``
    random weights (from scratch).
``champion``
    the model serving the run's data root (its ``model.pt``, checked against the MD5 the trainer
    recorded for it); from scratch when the root has no champion yet.
``nfs:<path>``
    a file below the NFS folder the nodes mount (``nfs.local_dir`` on the local target), e.g.
    ``nfs:weights/resnet50-11ad3fa6.pth``: put it there yourself.
``output:<blob>`` / ``data:<blob>``
    a blob in the configured output or data container, e.g. ``output:weights/resnet50.pth``.
``https://<account>/<container>/<blob>``
    the same, as a URL: accepted only when it points into the configured data or output
    container (``data.account_url``/``output.account_url``); any other account is refused.

A run resolves ``champion``, ``data:`` and a URL before anything is provisioned
(``tasks/init_from.py``) into one of the two forms the training task reads: ``output:<blob>``
or ``nfs:<path>``. The resolved value is what the run's config, its checkpoint key and its
up-to-date fingerprint hold, so a new champion is a new input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

Kind = Literal["champion", "nfs", "output", "data", "url"]
CHAMPION = "champion"
MAX_PATH = 1024


class InitFromValueError(ValueError):
    """``training.init_from`` is not one of the forms above; the message says which it is
    closest to."""


@dataclass(frozen=True)
class InitFrom:
    """A parsed ``training.init_from``."""

    kind: Kind
    path: str = ""  # the file below NFS, the blob, or the URL

    @property
    def resolved(self) -> bool:
        """Whether the training task can read it as it is (the others a run resolves first)."""
        return self.kind in ("nfs", "output")

    def __str__(self) -> str:
        return (
            CHAMPION
            if self.kind == CHAMPION
            else self.path
            if self.kind == "url"
            else (f"{self.kind}:{self.path}")
        )


def _relative(value: str, what: str) -> str:
    path = value.strip("/")
    parts = path.split("/")
    if not path or len(path) > MAX_PATH:
        raise InitFromValueError(f"{what} needs a file name after the ':' (at most {MAX_PATH})")
    if any(p in ("", ".", "..") for p in parts) or "\\" in path:
        raise InitFromValueError(
            f"{what} {path!r} must be a plain relative path: no '..', '.', empty segment or "
            "backslash"
        )
    if not path.isprintable():
        raise InitFromValueError(f"{what} {path!r} must have no control characters")
    return path


def parse_init_from(value: str) -> InitFrom:
    """``value`` as one of the forms in the module docstring; InitFromValueError otherwise."""
    text = value.strip()
    if text == CHAMPION:
        return InitFrom("champion")
    if text.startswith(("https://", "http://")):
        parts = urlsplit(text)
        if parts.query or parts.fragment or parts.username or parts.password:
            raise InitFromValueError(
                "an init_from URL must have no query, fragment, user or password (a SAS token "
                "there would be stored with every run): the pipeline reads it with the "
                "configured account's credentials"
            )
        return InitFrom("url", text)
    kind, sep, rest = text.partition(":")
    if sep and kind in ("nfs", "output", "data"):
        return InitFrom(kind, _relative(rest, f"init_from {kind}:"))  # type: ignore[arg-type]
    raise InitFromValueError(
        f"init_from {text[:80]!r} is not null, 'champion', 'nfs:<path>', 'output:<blob>', "
        "'data:<blob>' or a URL into the configured data or output container"
    )


def url_location(url: str, accounts: dict[str, tuple[str | None, str]]) -> InitFrom:
    """The ``data:``/``output:`` form of ``url``, given each role's (account URL, container);
    InitFromValueError when it points anywhere else (another account or container)."""
    parts = urlsplit(url)
    for role, (account, container) in accounts.items():
        if account is None:
            continue
        base = urlsplit(account.rstrip("/"))
        if (parts.scheme, parts.netloc.lower()) != (base.scheme, base.netloc.lower()):
            continue
        below = unquote(parts.path)
        head = f"{base.path.rstrip('/')}/{container}/"
        if below.startswith(head):
            return InitFrom(role, _relative(below[len(head) :], f"init_from {role}:"))  # type: ignore[arg-type]
    allowed = [f"{a.rstrip('/')}/{c}/" for a, c in accounts.values() if a is not None]
    raise InitFromValueError(
        f"init_from {parts.scheme}://{parts.netloc}{parts.path} is outside the accounts this "
        f"pipeline reads ({', '.join(allowed) or 'no account URL is configured'}): use "
        "'data:<blob>' or 'output:<blob>' for a blob in the configured containers"
    )
