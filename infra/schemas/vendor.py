"""Copy the ARM resource schemas infra/main.json needs from a checkout of
Azure/azure-resource-manager-schemas, pruned to the resource types the template declares and the
definitions they reach. Run from the project root:

    python infra/schemas/vendor.py PATH-TO-azure-resource-manager-schemas

Each file records the repository, its path there, the commit and the file's blob id
(``x-vendored-from``); README.md beside this script lists them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent / "main.json"
REPO = "Azure/azure-resource-manager-schemas"
FILES = {  # namespace -> schema file name (a provider's types may span several files)
    "Microsoft.Network/privateDnsZones": "Microsoft.Network.privateDns.json",
    "Microsoft.Network": "Microsoft.Network.NRP.json",
}


def _resources(template: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for resource in template.get("resources", []):
        found.append(resource)
        props = resource.get("properties")
        inner = props.get("template") if isinstance(props, dict) else None
        inner = inner if isinstance(inner, dict) and "$schema" in inner else None
        if isinstance(inner, dict):
            found += _resources(inner)
    return found


def schema_file(kind: str, api: str) -> str:
    namespace = kind.split("/")[0]
    for prefix, name in FILES.items():
        if kind.startswith(prefix):
            return f"schemas/{api}/{name}"
    return f"schemas/{api}/{namespace}.json"


def _refs(value: Any) -> set[str]:
    if isinstance(value, dict):
        out = {value["$ref"]} if isinstance(value.get("$ref"), str) else set()
        for item in value.values():
            out |= _refs(item)
        return out
    if isinstance(value, list):
        return set().union(*(_refs(v) for v in value)) if value else set()
    return set()


def prune(doc: dict[str, Any], kinds: set[str]) -> dict[str, Any]:
    out = {
        k: v for k, v in doc.items() if not k.endswith("resourceDefinitions") and k != "definitions"
    }
    keep: dict[str, dict[str, Any]] = {}
    for key, defs in doc.items():
        if not key.endswith("resourceDefinitions"):
            continue
        chosen = {
            name: d
            for name, d in defs.items()
            if set(d.get("properties", {}).get("type", {}).get("enum", [])) & kinds
        }
        if chosen:
            out[key] = chosen
            keep[key] = chosen
    definitions = doc.get("definitions", {})
    wanted: set[str] = set()
    todo = [r for d in keep.values() for r in _refs(d)]
    while todo:
        ref = todo.pop()
        if not ref.startswith("#/definitions/"):
            continue
        name = ref.split("/", 2)[2]
        if name in wanted or name not in definitions:
            continue
        wanted.add(name)
        todo += list(_refs(definitions[name]))
    out["definitions"] = {k: definitions[k] for k in sorted(wanted)}
    return out


def main(checkout: str) -> None:
    git = ["git", "-C", checkout]
    commit = subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()
    template = json.loads(TEMPLATE.read_text())
    by_file: dict[str, set[str]] = {}
    for resource in _resources(template):
        path = schema_file(resource["type"], resource["apiVersion"])
        by_file.setdefault(path, set()).add(resource["type"])
    by_file["schemas/common/definitions.json"] = set()
    for path, kinds in sorted(by_file.items()):
        blob = subprocess.check_output([*git, "rev-parse", f"HEAD:{path}"], text=True).strip()
        doc = json.loads(subprocess.check_output([*git, "show", f"HEAD:{path}"]))
        vendored = prune(doc, kinds) if kinds else doc
        vendored["x-vendored-from"] = {
            "repository": REPO,
            "path": path,
            "commit": commit,
            "blob": blob,
        }
        target = HERE / path.removeprefix("schemas/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(vendored, indent=1, sort_keys=False) + "\n")
        print(f"{path} ({blob[:12]}): {', '.join(sorted(kinds)) or 'whole'}")


if __name__ == "__main__":
    main(sys.argv[1])
