"""Fake Azure Resource Manager: what `make azure-up` and `make azure-down` talk to.

It answers as ARM does (REST shapes of the Resources 2025-04-01 spec): the subscription, resource
providers (registration, the regions of each resource type), Compute's VM sizes and regional
usages (quota), the name checks of Storage and the registry, subscription-scope deployments
(what-if as a long-running operation, PUT with an ``Azure-AsyncOperation`` to poll, outputs,
operations), resources listed and deleted by id, and Microsoft Graph's lookup of the Batch
service principal. Strict as the service: every deployment and what-if body is checked against
the vendored Resources spec, every role assignment the template declares against the
Authorization spec, and the template itself is evaluated (tests/fakes/arm_template.py), so an
unknown function, parameter, variable, property path or dependency fails the deployment with
ARM's error codes. A deployment creates its resources one by one in dependency order; a test
can make one resource type fail: as on Azure, the deployment goes on with every resource that
does not depend on the failure (by ``dependsOn`` or by reading it) and fails at the end, naming
each failed operation.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import uuid
from typing import Any

from tests.fakes.arm_template import Scope, TemplateError, bind_parameters, evaluate
from tests.fakes.schema import SPEC_DIR, Schema
from tests.fakes.transport import Recorder, Request, Response

ARM_HOST = "management.azure.com"
GRAPH_HOST = "graph.microsoft.com"
DEPLOYMENTS = Schema.load("resources-deployments-2025-04-01.json")
ROLE_ASSIGNMENTS = Schema.load("authorization-roleassignments-2022-04-01.json")
BATCH_APP_ID = "ddbf3205-c6bd-46ae-8127-60eb93363864"


def _provider_specs() -> dict[str, tuple[str, Schema, str]]:
    """Resource type (lower case) -> (API version, its provider's vendored REST spec, the PUT
    body's definition), from tests/fakes/spec/arm/ (each file's ``x-put-bodies``)."""
    found = {}
    for path in sorted((SPEC_DIR / "arm").glob("*.json")):
        doc = json.loads(path.read_text())
        schema = Schema(doc)
        for kind, (api, definition) in doc["x-put-bodies"].items():
            found[kind.lower()] = (api, schema, definition)
    return found


PROVIDER_SPECS = _provider_specs()
# Resource types the template declares whose provider's REST spec is not vendored, and why.
UNCHECKED = {
    "microsoft.resources/resourcegroups": "the Resources spec is vendored for deployments only",
    "microsoft.operationalinsights/workspaces": "outside the providers this check covers",
    "microsoft.insights/diagnosticsettings": "outside the providers this check covers",
}

# Properties a resource provider takes but never returns (secrets): a GET, and so what-if,
# does not show them.
WRITE_ONLY = {"administratorLoginPassword", "value", "endpointUrl", "accountKey", "sharedKey"}
DATA_TYPES = (  # resources that hold data: azure-down keeps them unless told otherwise
    "microsoft.storage/storageaccounts",
    "microsoft.dbforpostgresql/flexibleservers",
)


def _error(status: int, code: str, message: str) -> Response:
    return Response(status, {"error": {"code": code, "message": message}})


class FakeArm:
    def __init__(
        self, subscription_id: str, tenant_id: str = "72f988bf-0000-4000-8000-00000000beef"
    ) -> None:
        self.subscription_id, self.tenant_id = subscription_id, tenant_id
        self.requests = Recorder()
        self.resources: dict[str, dict[str, Any]] = {}  # lower-cased id -> resource
        self.deployments: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.registered = {"Microsoft.Resources", "Microsoft.Authorization"}
        self.providers_regions: dict[str, list[str]] = {}  # "Microsoft.App/managedEnvironments"
        self.skus: list[dict[str, Any]] = [
            _sku("Standard_NC24ads_A100_v4", "StandardNCADSA100v4Family", 24),
            _sku("Standard_ND96asr_v4", "standardNDASv4_A100Family", 96),
        ]
        self.usages: dict[str, tuple[int, int]] = {
            "cores": (0, 350),
            "lowPriorityCores": (0, 100),
            "StandardNCADSA100v4Family": (0, 48),
            "standardNDASv4_A100Family": (0, 0),
        }
        self.taken_names: set[str] = set()  # global names someone else owns
        self.deployer_object_id = "5d7e1f00-0000-4000-8000-00000000dee9"  # who signs in
        self.fail_type: str | None = None  # a resource type whose creation fails
        self.polls_before_done = 1
        self.refused: list[Any] = []
        self.acr: Any = None  # a FakeAcr: ACR Tasks' ARM actions go to it
        self._ids = itertools.count(1)
        self._failed: set[str] = set()  # lower-cased ids of this deployment's failures
        self._failures: list[_Failed] = []
        self._lock = threading.Lock()

    # -- routing ------------------------------------------------------------------------------
    def graph(self, req: Request) -> Response:
        self.requests.add(req)
        if req.path == f"/v1.0/servicePrincipals(appId='{BATCH_APP_ID}')":
            return Response(200, {"id": "batch-sp-object-id", "appId": BATCH_APP_ID})
        return _error(404, "Request_ResourceNotFound", req.path)

    def vault(self, req: Request) -> Response:
        """Key Vault's data plane (``GET /secrets/{name}``), as Azure RBAC guards it: the caller
        (the deployer) needs Key Vault Secrets User or Officer on the vault or on the secret."""
        self.requests.add(req)
        if req.headers.get("Authorization", "") != "Bearer fake-entra-token":
            return _error(401, "Unauthorized", "no bearer token")
        vault = req.host.split(".", 1)[0].lower()
        parts = req.path.strip("/").split("/")
        if req.method != "GET" or len(parts) != 2 or parts[0] != "secrets":
            return _error(400, "BadParameter", req.path)
        secret = next(
            (
                r
                for k, r in self.resources.items()
                if k.endswith(f"/vaults/{vault}/secrets/{parts[1].lower()}")
            ),
            None,
        )
        if secret is None:
            return _error(
                404, "SecretNotFound", f"A secret with (name/id) {parts[1]} was not found"
            )
        vault_id = secret["id"].rsplit("/secrets/", 1)[0].lower()
        readers = ("4633458b-17de-408a-b874-0445c86b69e6", "b86a8fe4-44ce-4948-aee5-eccb2c155cd7")
        allowed = any(
            r["type"] == "Microsoft.Authorization/roleAssignments"
            and r["properties"]["principalId"] == self.deployer_object_id
            and r["properties"]["roleDefinitionId"].rsplit("/", 1)[1] in readers
            and r["id"].lower().split("/providers/microsoft.authorization/")[0]
            in (vault_id, secret["id"].lower())
            for r in self.resources.values()
        )
        if not allowed:
            return Response(
                403,
                {
                    "error": {
                        "code": "Forbidden",
                        "message": "Caller is not authorized to perform action on resource.",
                        "innererror": {"code": "ForbiddenByRbac"},
                    }
                },
            )
        return Response(200, {"value": secret["properties"]["value"], "id": req.path})

    def __call__(self, req: Request) -> Response:
        self.requests.add(req)
        if req.headers.get("Authorization", "") != "Bearer fake-entra-token":
            return _error(401, "AuthenticationFailed", "no bearer token")
        if "api-version" not in req.query:
            return _error(400, "MissingApiVersionParameter", "api-version is required")
        with self._lock:
            try:
                return self._route(req)
            except TemplateError as exc:
                return _error(400, "InvalidTemplate", str(exc))

    def _route(self, req: Request) -> Response:
        path = req.path.rstrip("/")
        sub = f"/subscriptions/{self.subscription_id}"
        if not path.lower().startswith(sub.lower()):
            return _error(
                404, "SubscriptionNotFound", f"The subscription {path} could not be found."
            )
        rest = path[len(sub) :]
        parts = rest.strip("/").split("/") if rest else []
        if not parts:
            return Response(200, self._subscription())
        if parts[0] == "operations":
            return self._operation(parts[1])
        if parts[:1] == ["providers"] and len(parts) >= 2:
            return self._provider(req, parts[1:])
        if parts[0].lower() == "resourcegroups" and len(parts) == 3 and parts[2] == "resources":
            return self._list_group(parts[1])
        if parts[0].lower() == "resourcegroups" and len(parts) == 2 and req.method == "DELETE":
            return self._delete_group(parts[1])
        tasks = ("/listBuildSourceUploadUrl", "/scheduleRun", "/runs/")
        if self.acr is not None and "/registries/" in path and any(t in path for t in tasks):
            return self.acr.arm(req)  # type: ignore[no-any-return]
        if req.method == "DELETE":
            return self._delete(path)
        if req.method == "GET":
            found = self.resources.get(path.lower())
            if found is None:
                return _error(404, "ResourceNotFound", f"The Resource '{path}' was not found.")
            return Response(200, _public(found))
        return _error(404, "NotFound", path)

    def _subscription(self) -> dict[str, Any]:
        return {
            "id": f"/subscriptions/{self.subscription_id}",
            "subscriptionId": self.subscription_id,
            "tenantId": self.tenant_id,
            "displayName": "retrain tests",
            "state": "Enabled",
        }

    def _provider(self, req: Request, parts: list[str]) -> Response:
        namespace = parts[0]
        if namespace == "Microsoft.Resources" and parts[1:2] == ["deployments"]:
            return self._deployment(req, parts[2], parts[3:])
        if namespace == "Microsoft.Compute" and parts[1:] == ["skus"]:
            location = req.query.get("$filter", "").split("'")[1::2]
            wanted = location[0] if location else None
            skus = [s for s in self.skus if wanted is None or wanted in s["locations"]]
            return Response(200, {"value": skus})
        if (
            namespace == "Microsoft.Compute"
            and parts[1:2] == ["locations"]
            and parts[3:] == ["usages"]
        ):
            return Response(200, {"value": [_usage(k, *v) for k, v in self.usages.items()]})
        if parts[1:] == ["checkNameAvailability"] and req.method == "POST":
            name = req.json()["name"]
            free = name not in self.taken_names
            return Response(
                200,
                {
                    "nameAvailable": free,
                    "reason": None if free else "AlreadyExists",
                    "message": None if free else f"The name {name} is already in use.",
                },
            )
        if parts[1:] == ["register"] and req.method == "POST":
            self.registered.add(namespace)
            return Response(200, self._provider_json(namespace))
        if len(parts) == 1 and req.method == "GET":
            return Response(200, self._provider_json(namespace))
        return _error(404, "NotFound", "/".join(parts))

    def _provider_json(self, namespace: str) -> dict[str, Any]:
        types = [
            {"resourceType": kind.split("/", 1)[1], "locations": regions}
            for kind, regions in self.providers_regions.items()
            if kind.split("/", 1)[0] == namespace
        ]
        state = "Registered" if namespace in self.registered else "NotRegistered"
        return {
            "id": f"/subscriptions/{self.subscription_id}/providers/{namespace}",
            "namespace": namespace,
            "registrationState": state,
            "resourceTypes": types,
        }

    # -- deployments --------------------------------------------------------------------------
    def _deployment(self, req: Request, name: str, action: list[str]) -> Response:
        base = f"https://{ARM_HOST}/subscriptions/{self.subscription_id}"
        if action == ["whatIf"] and req.method == "POST":
            body = self._checked(req.json(), "DeploymentWhatIf")
            if isinstance(body, Response):
                return body
            result = self._what_if(body)
            return self._async(result, base, location=True)
        if action == ["operations"]:
            deployment = self.deployments.get(name)
            items = deployment["_operations"] if deployment else []
            return Response(200, {"value": items})
        if action:
            return _error(404, "NotFound", "/".join(action))
        if req.method == "PUT":
            body = self._checked(req.json(), "Deployment")
            if isinstance(body, Response):
                return body
            if "location" not in body:
                return _error(400, "InvalidDeployment", "a subscription deployment needs location")
            return self._deploy(name, body, base)
        deployment = self.deployments.get(name)
        if deployment is None:
            return _error(404, "DeploymentNotFound", f"Deployment '{name}' could not be found.")
        return Response(200, _public(deployment))

    def _checked(self, body: Any, definition: str) -> Any:
        problems = DEPLOYMENTS.check(body, definition)
        if problems:
            self.refused.extend(problems)
            return _error(400, "InvalidRequestContent", str(problems[0]))
        return body

    def _async(self, result: dict[str, Any], base: str, location: bool) -> Response:
        op = f"op{next(self._ids)}"
        self.operations[op] = {"result": result, "polls": 0}
        url = f"{base}/operations/{op}?api-version=2025-04-01"
        headers = {"Location" if location else "Azure-AsyncOperation": url, "Retry-After": "0"}
        return Response(202, None, headers)

    def _operation(self, op: str) -> Response:
        entry = self.operations.get(op)
        if entry is None:
            return _error(404, "NotFound", op)
        entry["polls"] += 1
        if entry["polls"] <= self.polls_before_done:
            return (
                Response(200, {"status": "Running"})
                if entry.get("async")
                else Response(202, None, {"Retry-After": "0"})
            )
        return Response(200, entry["result"])

    def _scope(self, template: dict[str, Any], group: str | None, location: str) -> Scope:
        return Scope(
            parameters={},
            variables=template.get("variables", {}),
            subscription_id=self.subscription_id,
            tenant_id=self.tenant_id,
            resource_group=group,
            location=location,
            reference=self._reference,
            list_keys=self._list_keys,
            deployer={
                "objectId": self.deployer_object_id,
                "tenantId": self.tenant_id,
                "userPrincipalName": "dev@example.com",
            },
        )

    def _plan(
        self, template: dict[str, Any], given: dict[str, Any], group: str | None, location: str
    ) -> list[tuple[dict[str, Any], Scope, str]]:
        """(resource, scope, id) of every resource the template deploys, nested ones expanded
        in place, in an order that honours dependsOn."""
        scope = self._scope(template, group, location)
        bind_parameters(template, given, scope)
        resources = template.get("resources", [])
        ids = [self._id(r, scope) for r in resources]
        known = {i.lower() for i in ids}
        order: list[int] = []
        state: dict[int, str] = {}

        def visit(i: int) -> None:
            if state.get(i) == "done":
                return
            if state.get(i) == "visiting":
                raise TemplateError(f"circular dependency at {ids[i]}")
            state[i] = "visiting"
            for dep in resources[i].get("dependsOn", []):
                target = str(evaluate(dep, scope)).lower()
                if target not in known:
                    raise TemplateError(
                        f"the resource '{target}' is not defined in the template "
                        f"(a dependency of {ids[i]})"
                    )
                visit(next(j for j, x in enumerate(ids) if x.lower() == target))
            state[i] = "done"
            order.append(i)

        for i in range(len(resources)):
            visit(i)
        return [(resources[i], scope, ids[i]) for i in order]

    def _depends(self, resource: dict[str, Any], scope: Scope) -> set[str]:
        return {str(evaluate(d, scope)).lower() for d in resource.get("dependsOn", [])}

    def _id(self, resource: dict[str, Any], scope: Scope) -> str:
        kind = resource["type"]
        name = str(evaluate(resource["name"], scope))
        if kind == "Microsoft.Resources/resourceGroups":
            return f"/subscriptions/{self.subscription_id}/resourceGroups/{name}"
        namespace, *types = kind.split("/")
        names = name.split("/")
        if len(names) != len(types):
            raise TemplateError(f"the resource name '{name}' does not fit its type {kind}")
        path = "/".join(f"{t}/{n}" for t, n in zip(types, names, strict=True))
        if "scope" in resource:
            return f"{evaluate(resource['scope'], scope)}/providers/{namespace}/{path}"
        group = resource.get("resourceGroup")
        group = evaluate(group, scope) if group else scope.resource_group
        if group is None:
            return f"/subscriptions/{self.subscription_id}/providers/{namespace}/{path}"
        group_id = f"/subscriptions/{self.subscription_id}/resourceGroups/{group}"
        return f"{group_id}/providers/{namespace}/{path}"

    def _body(self, resource: dict[str, Any], scope: Scope) -> dict[str, Any]:
        keys = ("location", "sku", "kind", "identity", "properties", "tags")
        return {k: evaluate(resource[k], scope) for k in keys if k in resource}

    def _walk(
        self,
        template: dict[str, Any],
        given: dict[str, Any],
        group: str | None,
        location: str,
        apply: bool,
        out: list[dict[str, Any]],
    ) -> None:
        for resource, scope, rid in self._plan(template, given, group, location):
            if apply and self._depends(resource, scope) & self._failed:
                self._failed.add(rid.lower())  # ARM never starts what depends on a failure
                continue
            try:
                self._walk_one(resource, scope, rid, group, location, apply, out)
            except _Unavailable:
                self._failed.add(rid.lower())  # reads a resource that failed: not started
            except _Failed as exc:
                self._failed.add(rid.lower())
                self._failures.append(exc)

    def _walk_one(
        self,
        resource: dict[str, Any],
        scope: Scope,
        rid: str,
        group: str | None,
        location: str,
        apply: bool,
        out: list[dict[str, Any]],
    ) -> None:
        if "condition" in resource and not evaluate(resource["condition"], scope):
            return
        kind = resource["type"]
        if kind == "Microsoft.Resources/deployments":
            self._nested(resource, scope, rid, group, location, apply, out)
            return
        existing = self.resources.get(rid.lower())
        if not apply:
            if existing is None:
                out.append(_change(rid, "Create", None, None))
                return
            after = _visible(self._body(resource, scope))
            before = _visible({k: existing[k] for k in after if k in existing})
            out.append(_change(rid, "NoChange" if before == after else "Modify", before, after))
            return
        body = self._body(resource, scope)
        if kind == "Microsoft.Authorization/roleAssignments":
            problems = ROLE_ASSIGNMENTS.check(
                {"properties": body["properties"]}, "RoleAssignmentCreateParameters"
            )
            if problems:
                self.refused.extend(problems)
                raise _Failed(rid, "InvalidRequestContent", str(problems[0]))
        self._check_body(resource, rid, body)
        if self.fail_type and kind.lower() == self.fail_type.lower():
            raise _Failed(rid, "ResourceDeploymentFailure", f"{kind} could not be created")
        self.resources[rid.lower()] = {
            "id": rid,
            "name": rid.rsplit("/", 1)[1],
            "type": kind,
            **body,
            "_runtime": _runtime(kind, rid, body),
        }
        out.append(_change(rid, "Create" if existing is None else "Modify", None, None))

    def _check_body(self, resource: dict[str, Any], rid: str, body: dict[str, Any]) -> None:
        """The resource's body against its provider's PUT body schema, at the API version the
        template names (role assignments: above, against the Authorization spec)."""
        kind = resource["type"].lower()
        spec = PROVIDER_SPECS.get(kind)
        if spec is None:
            if kind not in UNCHECKED and kind != "microsoft.authorization/roleassignments":
                raise _Failed(rid, "NoRegisteredProviderFound", f"no vendored spec for {kind}")
            return
        api, schema, definition = spec
        if resource["apiVersion"] != api:
            raise _Failed(
                rid,
                "NoRegisteredProviderFound",
                f"{resource['type']} at {resource['apiVersion']}: the vendored spec is {api}",
            )
        problems = schema.check(body, definition)
        if problems:
            self.refused.extend(problems)
            raise _Failed(rid, "InvalidRequestContent", f"{resource['type']}: {problems[0]}")

    def _nested(
        self,
        resource: dict[str, Any],
        scope: Scope,
        rid: str,
        group: str | None,
        location: str,
        apply: bool,
        out: list[dict[str, Any]],
    ) -> None:
        """A nested deployment into a resource group: its resources in its own order; in
        ``Complete`` mode, what the group holds and the template does not declare is deleted
        (what-if: ``Delete``), in ``Incremental`` mode left alone (what-if: ``Ignore``), as
        "Azure Resource Manager deployment modes" says."""
        props = resource["properties"]
        if str((props.get("expressionEvaluationOptions") or {}).get("scope")).lower() != "inner":
            raise TemplateError("nested templates here use inner scope")
        params = evaluate(props.get("parameters", {}), scope)
        mode = str(evaluate(props.get("mode", "Incremental"), scope))
        if mode not in ("Incremental", "Complete"):
            raise TemplateError(f"the deployment mode '{mode}' is not Incremental or Complete")
        inner_group = str(evaluate(resource.get("resourceGroup", ""), scope)) or group
        template = props["template"]
        planned = self._plan(template, params, inner_group, location)
        if not apply and self.resources.get(_group_id(self, inner_group)) is None:
            # What-if of a group that does not exist yet: everything in it is new.
            for inner, inner_scope, inner_id in planned:
                if "condition" in inner and not evaluate(inner["condition"], inner_scope):
                    continue
                if inner["type"] != "Microsoft.Resources/deployments":
                    out.append(_change(inner_id, "Create", None, None))
            return
        failures = len(self._failures) + len(self._failed)
        nested: list[dict[str, Any]] = []
        self._walk(template, params, inner_group, location, apply, nested)
        out.extend(nested)
        # Declared resources (with a false condition too: ARM keeps those) and their children.
        declared = {i.lower() for _, _, i in planned}
        undeclared = [
            r["id"]
            for r in self._tracked(inner_group)
            if r["id"].lower() not in declared
            and not any(r["id"].lower().startswith(d + "/") for d in declared)
        ]
        for other in undeclared:
            if not apply:
                out.append(_change(other, "Delete" if mode == "Complete" else "Ignore", None, None))
            elif mode == "Complete":
                self._delete(other)
        if not apply or len(self._failures) + len(self._failed) > failures:
            if apply:
                self._failed.add(rid.lower())  # a failed resource fails its deployment
            return
        inner_scope = self._scope(template, inner_group, location)
        bind_parameters(template, params, inner_scope)
        outputs = {
            k: {"type": v["type"], "value": evaluate(v["value"], inner_scope)}
            for k, v in template.get("outputs", {}).items()
        }
        self.resources[rid.lower()] = {
            "id": rid,
            "name": rid.rsplit("/", 1)[1],
            "type": resource["type"],
            "properties": {"outputs": outputs, "provisioningState": "Succeeded"},
        }

    def _what_if(self, body: dict[str, Any]) -> dict[str, Any]:
        changes: list[dict[str, Any]] = []
        self._failed, self._failures = set(), []
        props = body["properties"]
        self._walk(
            props["template"], props.get("parameters", {}), None, body["location"], False, changes
        )
        return {"status": "Succeeded", "properties": {"changes": changes}}

    def _deploy(self, name: str, body: dict[str, Any], base: str) -> Response:
        props = body["properties"]
        deployments = f"/subscriptions/{self.subscription_id}/providers/Microsoft.Resources"
        deployment_id = f"{deployments}/deployments/{name}"
        record: dict[str, Any] = {
            "id": deployment_id,
            "name": name,
            "type": "Microsoft.Resources/deployments",
            "location": body["location"],
            "properties": {"provisioningState": "Running", "mode": props["mode"]},
            "_operations": [],
        }
        self.deployments[name] = record
        done: list[dict[str, Any]] = []
        self._failed, self._failures = set(), []
        try:
            template = props["template"]
            self._walk(template, props.get("parameters", {}), None, body["location"], True, done)
            if self._failures:
                raise self._failures[0]
            scope = self._scope(template, None, body["location"])
            bind_parameters(template, props.get("parameters", {}), scope)
            outputs = {
                k: {"type": v["type"], "value": evaluate(v["value"], scope)}
                for k, v in template.get("outputs", {}).items()
            }
            record["properties"].update(provisioningState="Succeeded", outputs=outputs)
            status: dict[str, Any] = {"status": "Succeeded"}
        except (_Failed, TemplateError) as exc:
            # ARM goes on with what does not depend on a failure, then fails the deployment
            # naming every failed operation.
            failures = self._failures if isinstance(exc, _Failed) else []
            details = [{"code": f.code, "message": str(f)} for f in failures] or [
                {"code": "InvalidTemplate", "message": str(exc)}
            ]
            error = {
                "code": "DeploymentFailed",
                "message": "At least one resource deployment operation failed.",
                "details": details,
            }
            record["properties"].update(provisioningState="Failed", error=error)
            for failure in failures:
                record["_operations"].append(
                    {
                        "id": f"{deployment_id}/operations/{next(self._ids)}",
                        "operationId": str(uuid.uuid4()),
                        "properties": {
                            "provisioningState": "Failed",
                            "provisioningOperation": "Create",
                            "statusCode": "BadRequest",
                            "statusMessage": {
                                "status": "Failed",
                                "error": {"code": failure.code, "message": str(failure)},
                            },
                            "targetResource": {"id": failure.resource_id},
                        },
                    }
                )
            status = {"status": "Failed", "error": error}
        record["_created"] = [c["resourceId"] for c in done]
        op = f"op{next(self._ids)}"
        self.operations[op] = {"result": status, "polls": 0, "async": True}
        headers = {"Azure-AsyncOperation": f"{base}/operations/{op}?api-version=2025-04-01"}
        public = _public(record)
        public["properties"] = {"provisioningState": "Accepted", "mode": props["mode"]}
        return Response(201, public, {**headers, "Retry-After": "0"})

    # -- what templates read --------------------------------------------------------------------
    def _reference(self, rid: str, api: str | None) -> Any:
        found = self.resources.get(rid.lower())
        if found is None and rid.lower() in self._failed:
            raise _Unavailable(rid)
        if found is None:
            raise TemplateError(f"ResourceNotFound: the resource '{rid}' is not found")
        if found["type"] == "Microsoft.Resources/deployments":
            return found["properties"]
        return _union_runtime(found.get("properties", {}), found.get("_runtime", {}))

    def _list_keys(self, rid: str) -> Any:
        found = self.resources.get(rid.lower())
        if found is None and rid.lower() in self._failed:
            raise _Unavailable(rid)
        if found is None:
            raise TemplateError(f"ResourceNotFound: listKeys of '{rid}'")
        return {
            "keys": [{"keyName": "key1", "value": "fake-account-key"}],
            "primarySharedKey": "fake-shared-key",
        }

    # -- resource groups ------------------------------------------------------------------------
    def _tracked(self, group: str | None) -> list[dict[str, Any]]:
        """What "Resources - List By Resource Group" answers: the group's tracked resources
        (those with a location: a storage account, not its containers; a Batch account, not its
        pools), never role assignments."""
        prefix = _group_id(self, group) + "/"
        return [
            r
            for key, r in self.resources.items()
            if key.startswith(prefix)
            and "location" in r
            and "/providers/microsoft.authorization/" not in key
        ]

    def _list_group(self, group: str) -> Response:
        return Response(200, {"value": [_public(r) for r in self._tracked(group)]})

    def _delete(self, path: str) -> Response:
        key = path.lower()
        if key not in self.resources:
            return Response(204)
        for other in [k for k in self.resources if k == key or k.startswith(key + "/")]:
            del self.resources[other]
        return Response(200)

    def _delete_group(self, group: str) -> Response:
        prefix = _group_id(self, group)
        for key in [k for k in self.resources if k == prefix or k.startswith(prefix + "/")]:
            del self.resources[key]
        return Response(200)


class _Unavailable(TemplateError):
    """An expression reads a resource whose creation failed: ARM does not start what reads it
    (``reference()`` makes an implicit dependency)."""


class _Failed(Exception):
    def __init__(self, resource_id: str, code: str, message: str) -> None:
        super().__init__(message)
        self.resource_id, self.code = resource_id, code


def _group_id(fake: FakeArm, group: str | None) -> str:
    return f"/subscriptions/{fake.subscription_id}/resourcegroups/{(group or '').lower()}"


def _sku(name: str, family: str, vcpus: int) -> dict[str, Any]:
    return {
        "resourceType": "virtualMachines",
        "name": name,
        "family": family,
        "locations": ["westeurope"],
        "capabilities": [{"name": "vCPUs", "value": str(vcpus)}],
        "restrictions": [],
    }


def _usage(name: str, current: int, limit: int) -> dict[str, Any]:
    return {
        "name": {"value": name, "localizedValue": name},
        "currentValue": current,
        "limit": limit,
        "unit": "Count",
    }


def _public(resource: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in resource.items() if not k.startswith("_")}


def _visible(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _visible(v) for k, v in value.items() if k not in WRITE_ONLY}
    if isinstance(value, list):
        return [_visible(v) for v in value]
    return value


def _change(rid: str, kind: str, before: Any, after: Any) -> dict[str, Any]:
    change: dict[str, Any] = {"resourceId": rid, "changeType": kind}
    if before is not None:
        change["before"] = before
    if after is not None:
        change["after"] = after
    return change


def _runtime(kind: str, rid: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the provider adds to a resource it creates, which templates read back."""
    name = rid.rsplit("/", 1)[1]
    stable = str(uuid.uuid5(uuid.NAMESPACE_URL, rid.lower()))
    location = body.get("location", "westeurope")
    kind = kind.lower()
    if kind == "microsoft.managedidentity/userassignedidentities":
        return {"principalId": stable, "clientId": str(uuid.uuid5(uuid.NAMESPACE_DNS, rid.lower()))}
    if kind == "microsoft.containerregistry/registries":
        return {"loginServer": f"{name}.azurecr.io"}
    if kind == "microsoft.keyvault/vaults":
        return {"vaultUri": f"https://{name}.vault.azure.net/"}
    if kind == "microsoft.batch/batchaccounts":
        return {"accountEndpoint": f"{name}.{location}.batch.azure.com"}
    if kind == "microsoft.operationalinsights/workspaces":
        return {"customerId": stable}
    if kind == "microsoft.dbforpostgresql/flexibleservers":
        return {"fullyQualifiedDomainName": f"{name}.postgres.database.azure.com"}
    domain = f"happy-sea-1.{location}.azurecontainerapps.io"  # the environment's
    if kind == "microsoft.app/managedenvironments":
        return {"defaultDomain": domain}
    if kind == "microsoft.app/containerapps":
        ingress = (body.get("properties", {}).get("configuration") or {}).get("ingress")
        if ingress:
            return {"configuration": {"ingress": {"fqdn": f"{name}.{domain}"}}}
    return {}


def _union_runtime(properties: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(properties)
    for key, value in runtime.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _union_runtime(merged[key], value)
        else:
            merged[key] = value
    return merged
