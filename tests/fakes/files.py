"""A fake Azure Files account: shares, directories, files with metadata, ranges and rename.

Enough of the File REST API for the scripts upload and Delete File, with the service's rules:
paths are case-insensitive and case-preserving (``Training/x.py`` is ``training/x.py``), a file or
directory needs its parent directory, a file is created at its full size and then written in
ranges of at most 4 MiB that must fit inside it (``x-ms-range``, ``x-ms-write: update``,
``Content-Length`` equal to the range), every request carries ``x-ms-version``. Errors carry
``x-ms-error-code`` like Azure, in the XML error body the File service uses.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tests.fakes.transport import Recorder, Request, Response

ETAG = '"0x8DC0000000000001"'
MODIFIED = "Sun, 22 Nov 2026 00:00:00 GMT"
MAX_RANGE = 4 * 1024 * 1024  # Put Range: at most 4 MiB per request
_SHARE_NAME = re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$")


def _error(status: int, code: str, message: str | None = None) -> Response:
    body = (
        '<?xml version="1.0" encoding="utf-8"?>'
        f"<Error><Code>{code}</Code><Message>{message or code}</Message></Error>"
    )
    return Response(status, body, {"x-ms-error-code": code, "Content-Type": "application/xml"})


def _key(path: str) -> str:
    return path.strip("/").casefold()


class FakeFiles:
    host = "retrainfiles.file.core.windows.net"
    account = "retrainfiles"

    def __init__(self) -> None:
        self.requests = Recorder()
        # share -> case-folded path -> {"name": as created, "data": bytes, "metadata": dict}
        self.entries: dict[str, dict[str, dict[str, Any]]] = {}
        self.dirs: dict[str, dict[str, str]] = {}  # share -> case-folded path -> as created
        self._lock = threading.Lock()

    # Views by the names as created (what a listing shows).
    @property
    def shares(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {s: {e["name"]: e for e in files.values()} for s, files in self.entries.items()}

    @property
    def directories(self) -> dict[str, set[str]]:
        return {s: set(d.values()) for s, d in self.dirs.items()}

    def __call__(self, req: Request) -> Response:
        self.requests.add(req)
        auth = req.headers.get("Authorization", "")
        if not (auth.startswith(f"SharedKey {self.account}:") or auth.startswith("Bearer ")):
            return _error(403, "AuthenticationFailed")
        if auth.startswith("Bearer ") and req.headers.get("x-ms-file-request-intent") != "backup":
            return _error(403, "AuthorizationFailure")  # Entra ID on Files needs the intent
        if "x-ms-version" not in req.headers:
            return _error(400, "MissingRequiredHeader", "x-ms-version is required")
        share, _, path = req.path.lstrip("/").partition("/")
        with self._lock:
            return self._route(req, share, unquote(path))

    def _route(self, req: Request, share: str, path: str) -> Response:
        headers = {"ETag": ETAG, "Last-Modified": MODIFIED}
        if not path and req.query.get("restype") == "share" and req.method == "PUT":
            if not _SHARE_NAME.match(share):
                return _error(400, "InvalidResourceName", f"share name {share!r}")
            if share in self.entries:
                return _error(409, "ShareAlreadyExists")
            self.entries[share], self.dirs[share] = {}, {}
            return Response(201, None, headers)
        if share not in self.entries:
            return _error(404, "ShareNotFound")
        files, dirs = self.entries[share], self.dirs[share]
        key = _key(path)
        parent = key.rsplit("/", 1)[0] if "/" in key else ""
        if parent and parent not in dirs:
            return _error(404, "ParentNotFound")
        if req.query.get("restype") == "directory" and req.method == "PUT":
            if key in dirs or key in files:
                return _error(409, "ResourceAlreadyExists")
            dirs[key] = path
            return Response(201, None, headers)
        if req.method == "PUT" and req.query.get("comp") == "range":
            return self._put_range(req, files.get(key), headers)
        if req.method == "PUT" and req.query.get("comp") == "rename":
            source_url = req.headers.get("x-ms-file-rename-source")
            if not source_url:
                return _error(400, "MissingRequiredHeader", "x-ms-file-rename-source")
            source = _key(unquote(urlparse(source_url).path).lstrip("/").partition("/")[2])
            if source not in files:
                return _error(404, "ResourceNotFound")
            replace = req.headers.get("x-ms-file-rename-replace-if-exists") == "true"
            if key in files and key != source and not replace:
                return _error(409, "ResourceAlreadyExists")
            entry = files.pop(source)
            files[key] = {**entry, "name": path}
            return Response(200, None, headers)
        if req.method == "PUT" and req.headers.get("x-ms-type", "").lower() == "file":
            if "x-ms-content-length" not in req.headers:
                return _error(400, "MissingRequiredHeader", "x-ms-content-length")
            if key in dirs:
                return _error(409, "ResourceAlreadyExists")
            size = int(req.headers["x-ms-content-length"])
            meta = {k[10:]: v for k, v in req.headers.items() if k.lower().startswith("x-ms-meta-")}
            files[key] = {"name": path, "data": bytes(size), "metadata": meta}
            return Response(201, None, headers)
        if req.method == "DELETE" and not req.query.get("restype"):  # Delete File: 202
            if key not in files:
                return _error(404, "ResourceNotFound")
            del files[key]
            return Response(202, None, {})
        if req.method in ("HEAD", "GET") and key in files:
            entry = files[key]
            data: bytes = entry["data"]
            props = {
                **headers,
                "x-ms-type": "File",
                "Content-Length": str(len(data)),
                "Content-Type": "application/octet-stream",
                **{f"x-ms-meta-{k}": v for k, v in entry["metadata"].items()},
            }
            return Response(200, data if req.method == "GET" else None, props)
        return _error(404, "ResourceNotFound")

    @staticmethod
    def _put_range(req: Request, entry: dict[str, Any] | None, headers: dict[str, str]) -> Response:
        if entry is None:
            return _error(404, "ResourceNotFound")
        given = req.headers.get("x-ms-range") or req.headers.get("Range")
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", given or "")
        if match is None or req.headers.get("x-ms-write") != "update":
            return _error(400, "InvalidHeaderValue", "x-ms-range bytes=a-b and x-ms-write")
        start, end = int(match.group(1)), int(match.group(2))
        if end - start + 1 > MAX_RANGE:
            return _error(413, "RequestBodyTooLarge", "a range is at most 4 MiB")
        if (
            end >= len(entry["data"])
            or int(req.headers.get("Content-Length", -1)) != len(req.body)
            or len(req.body) != end - start + 1
        ):
            return _error(416, "InvalidRange")
        data = bytearray(entry["data"])
        data[start : end + 1] = req.body
        entry["data"] = bytes(data)
        return Response(201, None, headers)

    def file_paths(self, share: str) -> list[str]:
        return sorted(e["name"] for e in self.entries.get(share, {}).values())

    def materialize(self, share: str, target: Path) -> None:
        """Write the share's files to a directory: what a node's SMB mount would show."""
        for entry in self.entries.get(share, {}).values():
            path = entry["name"]
            if path.rsplit("/", 1)[-1].startswith(".upload-"):
                continue
            out = target / path
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(entry["data"])
