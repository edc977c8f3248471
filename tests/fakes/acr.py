"""Fake ACR: the ARM side of ACR Tasks (upload URL, scheduleRun, runs, log link) and the
registry's data plane (token exchange, tag properties).

The build source and the run log live in Azurite, as they live in the registry's storage on
Azure: the client uploads the context through the SAS URL it is given and reads the log blob
through the log link, with the real Blob SDK. The scheduleRun body is checked against the
ACR Tasks 2025-03-01-preview spec (``spec/``); a run is a ``QuickBuild`` that goes
``Queued`` -> ``Started`` -> ``Running`` -> ``Succeeded``/``Failed``, appending to its log blob
(an append blob) while it runs. A run checks that the uploaded context holds the Dockerfile it
was asked to build, then "pushes" the image: its tag exists from then on.
"""

from __future__ import annotations

import io
import itertools
import tarfile
import threading
from datetime import UTC, datetime
from typing import Any

from azure.storage.blob import ContainerClient

from tests.fakes.schema import Schema
from tests.fakes.transport import Recorder, Request, Response

ARM_HOST = "management.azure.com"
API_VERSION = "2025-03-01-preview"
SPEC = Schema.load("containerregistry-build-2025-03-01-preview.json")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _arm_error(status: int, code: str, message: str) -> Response:
    return Response(status, {"error": {"code": code, "message": message}})


class FakeAcr:
    registry_host = "retrainacr.azurecr.io"

    def __init__(self, storage: ContainerClient, sas: str) -> None:
        self.storage, self.sas = storage, sas  # where contexts and logs go (Azurite)
        self.requests = Recorder()
        self.tags: set[tuple[str, str]] = set()
        self.runs: dict[str, dict[str, Any]] = {}
        self.fail_builds = False
        self.polls_per_state = 1
        self.refused: list[Any] = []  # spec problems of the scheduleRun bodies refused
        self.allow_refusals = False  # a test that sends non-conforming bodies on purpose
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # -- ARM ----------------------------------------------------------------------------------
    def arm(self, req: Request) -> Response:
        self.requests.add(req)
        if req.headers.get("Authorization", "") != "Bearer fake-entra-token":
            return _arm_error(401, "AuthenticationFailed", "no token")
        if req.query.get("api-version") != API_VERSION:
            return _arm_error(400, "InvalidApiVersionParameter", f"api-version {API_VERSION}")
        parts = req.path.strip("/").split("/")
        registry = parts[7] if len(parts) > 7 else ""
        action = parts[8:]
        with self._lock:
            if action == ["listBuildSourceUploadUrl"] and req.method == "POST":
                name = f"source/{next(self._ids):04d}/context.tar.gz"
                return Response(
                    200,
                    {"uploadUrl": f"{self.storage.url}/{name}?{self.sas}", "relativePath": name},
                )
            if action == ["scheduleRun"] and req.method == "POST":
                body = req.json()
                problems = SPEC.check(body, "DockerBuildRequest")
                if problems:
                    self.refused.extend(problems)
                    return _arm_error(400, "InvalidRequestContent", str(problems[0]))
                return self._schedule(registry, body)
            if action[:1] == ["runs"] and len(action) == 2 and req.method == "GET":
                return self._advance(action[1])
            if action[:1] == ["runs"] and action[2:] == ["listLogSasUrl"]:
                log = f"{self.storage.url}/logs/{action[1]}.log?{self.sas}"
                return Response(200, {"logLink": log})
        return _arm_error(404, "NotFound", req.path)

    def _schedule(self, registry: str, body: dict[str, Any]) -> Response:
        run_id = f"cb{next(self._ids)}"
        context = self.storage.download_blob(body["sourceLocation"]).readall()
        with tarfile.open(fileobj=io.BytesIO(context), mode="r:gz") as tar:
            names = set(tar.getnames())
        now = _now()
        run = {
            "id": f"/subscriptions/x/resourceGroups/x/providers/Microsoft.ContainerRegistry/"
            f"registries/{registry}/runs/{run_id}",
            "name": run_id,
            "type": "Microsoft.ContainerRegistry/registries/runs",
            "properties": {
                "runId": run_id,
                "status": "Queued",
                "runType": "QuickBuild",
                "createTime": now,
                "lastUpdatedTime": now,
                "platform": body["platform"],
                "isArchiveEnabled": body.get("isArchiveEnabled", False),
            },
            "_request": body,
            "_context": names,
            "_polls": 0,
        }
        self.runs[run_id] = run
        return Response(200, self._public(run))

    def _advance(self, run_id: str) -> Response:
        """One state per ``polls_per_state`` reads; the log grows while the build runs."""
        run = self.runs[run_id]
        props = run["properties"]
        body = run["_request"]
        run["_polls"] += 1
        order = ["Queued", "Started", "Running", "Succeeded"]
        if run["_polls"] % (self.polls_per_state + 1) == 0 and props["status"] in order[:3]:
            props["status"] = order[order.index(props["status"]) + 1]
            props["lastUpdatedTime"] = _now()
            if props["status"] == "Started":
                props["startTime"] = props["lastUpdatedTime"]
                self._log(run_id, "Queued, starting the build agent\n", create=True)
            elif props["status"] == "Running":
                self._log(run_id, f"Step 1/20 : FROM cuda (building {body['imageNames'][0]})\n")
            elif props["status"] == "Succeeded":
                props["finishTime"] = props["lastUpdatedTime"]
                if self.fail_builds or body["dockerFilePath"] not in run["_context"]:
                    props["status"] = "Failed"
                    props["runErrorMessage"] = (
                        "failed to solve: dockerfile not found or build error"
                    )
                    self._log(run_id, "error: build failed\n")
                else:
                    repo, tag = body["imageNames"][0].split(":", 1)
                    self.tags.add((repo, tag))
                    props["outputImages"] = [
                        {"registry": self.registry_host, "repository": repo, "tag": tag}
                    ]
                    self._log(run_id, f"Step 20/20 : done\npushed {repo}:{tag}\n")
        elif props["status"] == "Running":
            self._log(run_id, f"Step {1 + run['_polls']}/20 : RUN ...\n")
        public = self._public(run)
        problems = SPEC.check(public, "Run", request=False)
        assert not problems, f"fake ACR answered a non-conforming Run: {problems}"
        return Response(200, public)

    def _log(self, run_id: str, text: str, create: bool = False) -> None:
        """The run log is an append blob the build writes to as it goes."""
        blob = self.storage.get_blob_client(f"logs/{run_id}.log")
        if create:
            blob.create_append_blob()
        blob.append_block(text.encode())

    @staticmethod
    def _public(run: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in run.items() if not k.startswith("_")}

    # -- registry data plane ------------------------------------------------------------------
    def registry(self, req: Request) -> Response:
        self.requests.add(req)
        host = self.registry_host
        if req.path == "/oauth2/exchange":
            return Response(200, {"refresh_token": "acr-refresh"})
        if req.path == "/oauth2/token":
            return Response(200, {"access_token": "acr-access"})
        parts = req.path.strip("/").split("/")
        if parts[:2] == ["acr", "v1"] and "_tags" in parts:
            i = parts.index("_tags")
            repo, tag = "/".join(parts[2:i]), parts[i + 1]
            if req.headers.get("Authorization") != "Bearer acr-access":
                challenge = (
                    f'Bearer realm="https://{host}/oauth2/token",service="{host}",'
                    f'scope="repository:{repo}:metadata_read"'
                )
                return Response(
                    401, {"errors": [{"code": "UNAUTHORIZED"}]}, {"WWW-Authenticate": challenge}
                )
            if (repo, tag) not in self.tags:
                return Response(
                    404, {"errors": [{"code": "TAG_UNKNOWN", "message": "tag unknown"}]}
                )
            return Response(
                200,
                {
                    "registry": host,
                    "imageName": repo,
                    "tag": {
                        "name": tag,
                        "digest": "sha256:" + "0" * 64,
                        "createdTime": "2026-11-22T00:00:00Z",
                        "lastUpdateTime": "2026-11-22T00:00:00Z",
                        "changeableAttributes": {
                            "deleteEnabled": True,
                            "writeEnabled": True,
                            "readEnabled": True,
                            "listEnabled": True,
                        },
                    },
                },
            )
        return Response(404, {"errors": [{"code": "NAME_UNKNOWN"}]})
