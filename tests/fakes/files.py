"""A fake Azure Files account: shares, directories, files with metadata, ranges and rename.

Enough of the File REST API for the scripts upload: create share and directory (409 when they
exist), create file with metadata, put range, get properties (HEAD), rename with replace, get
(for materializing the share as a node's mount). Errors carry ``x-ms-error-code`` like Azure.
"""

from __future__ import annotations

import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

from tests.fakes.transport import Recorder, Request, Response

ETAG = '"0x8DC0000000000001"'
MODIFIED = "Sun, 22 Nov 2026 00:00:00 GMT"


def _error(status: int, code: str) -> Response:
    body = (
        '<?xml version="1.0" encoding="utf-8"?>'
        f"<Error><Code>{code}</Code><Message>{code}</Message></Error>"
    )
    return Response(status, body, {"x-ms-error-code": code, "Content-Type": "application/xml"})


class FakeFiles:
    host = "retrainfiles.file.core.windows.net"
    account = "retrainfiles"

    def __init__(self) -> None:
        self.requests = Recorder()
        self.shares: dict[str, dict[str, dict[str, object]]] = {}  # share -> path -> entry
        self.directories: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def __call__(self, req: Request) -> Response:
        self.requests.add(req)
        auth = req.headers.get("Authorization", "")
        if not (auth.startswith(f"SharedKey {self.account}:") or auth.startswith("Bearer ")):
            return _error(403, "AuthenticationFailed")
        if auth.startswith("Bearer ") and req.headers.get("x-ms-file-request-intent") != "backup":
            return _error(403, "AuthorizationFailure")  # Entra ID on Files needs the intent
        share, _, path = req.path.lstrip("/").partition("/")
        with self._lock:
            return self._route(req, share, path)

    def _route(self, req: Request, share: str, path: str) -> Response:
        headers = {"ETag": ETAG, "Last-Modified": MODIFIED}
        if not path and req.query.get("restype") == "share" and req.method == "PUT":
            if share in self.shares:
                return _error(409, "ShareAlreadyExists")
            self.shares[share], self.directories[share] = {}, set()
            return Response(201, None, headers)
        if share not in self.shares:
            return _error(404, "ShareNotFound")
        files, dirs = self.shares[share], self.directories[share]
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if req.query.get("restype") == "directory" and req.method == "PUT":
            if path in dirs:
                return _error(409, "ResourceAlreadyExists")
            if parent and parent not in dirs:
                return _error(404, "ParentNotFound")
            dirs.add(path)
            return Response(201, None, headers)
        if req.method == "PUT" and req.query.get("comp") == "range":
            entry = files[path]
            start, end = (int(x) for x in req.headers["x-ms-range"].split("=", 1)[1].split("-"))
            data = bytearray(entry["data"])  # type: ignore[arg-type]
            data[start : end + 1] = req.body
            entry["data"] = bytes(data)
            return Response(201, None, headers)
        if req.method == "PUT" and req.query.get("comp") == "rename":
            source = unquote(urlparse(req.headers["x-ms-file-rename-source"]).path)
            source = source.lstrip("/").partition("/")[2]
            if source not in files:
                return _error(404, "ResourceNotFound")
            if path in files and req.headers.get("x-ms-file-rename-replace-if-exists") != "true":
                return _error(409, "ResourceAlreadyExists")
            files[path] = files.pop(source)
            return Response(200, None, headers)
        if req.method == "PUT" and req.headers.get("x-ms-type", "").lower() == "file":
            if parent and parent not in dirs:
                return _error(404, "ParentNotFound")
            size = int(req.headers["x-ms-content-length"])
            meta = {k[10:]: v for k, v in req.headers.items() if k.lower().startswith("x-ms-meta-")}
            files[path] = {"data": bytes(size), "metadata": meta}
            return Response(201, None, headers)
        if req.method in ("HEAD", "GET") and path in files:
            entry = files[path]
            data: bytes = entry["data"]  # type: ignore[assignment]
            props = {
                **headers,
                "x-ms-type": "File",
                "Content-Length": str(len(data)),
                "Content-Type": "application/octet-stream",
                **{f"x-ms-meta-{k}": v for k, v in entry["metadata"].items()},  # type: ignore[union-attr]
            }
            return Response(200, data if req.method == "GET" else None, props)
        return _error(404, "ResourceNotFound")

    def file_paths(self, share: str) -> list[str]:
        return sorted(self.shares.get(share, {}))

    def materialize(self, share: str, target: Path) -> None:
        """Write the share's files to a directory: what a node's SMB mount would show."""
        for path, entry in self.shares.get(share, {}).items():
            if path.rsplit("/", 1)[-1].startswith(".upload-"):
                continue
            out = target / path
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(entry["data"])  # type: ignore[arg-type]
