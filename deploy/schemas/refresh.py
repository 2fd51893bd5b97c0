"""Rewrite deploy/schemas/*.json from the upstream schema files (see README.md there for where to
get them).

    python deploy/schemas/refresh.py --kserve-crds DIR --training-operator-crds DIR --kubernetes DIR

    --kserve-crds              kserve/kserve's config/crd/full/ (serving.kserve.io_*.yaml)
    --training-operator-crds   kubeflow/training-operator's manifests/base/crds/
                               (kubeflow.org_*.yaml)
    --kubernetes               a `vX.Y.Z-local-strict/` folder of JSON schemas made from Kubernetes'
                               OpenAPI spec by openapi2jsonschema (as kubernetes-validate ships
                               them)

Each output file is the schema of one kind at one version, named `<group>_<version>_<kind>.json`
(the core group is empty: `v1_configmap.json`), which is how tests/test_deploy_manifests.py finds a
document's schema. What is changed on the way, and why (validation is otherwise what upstream says):
  - descriptions are dropped: they are most of the bytes and validate nothing;
  - Kubernetes' `$ref`s into `_definitions.json` are inlined, so each file stands alone;
  - a CRD's structural schema is closed: `additionalProperties: false` wherever it lists
    `properties` and does not say `x-kubernetes-preserve-unknown-fields`. That is what the API
    server does with an unknown field under `fieldValidation=Strict` (kubectl's default since 1.27):
    refuses it, where the schema alone would let a misspelled field through to be silently pruned;
  - a CRD's `metadata` (upstream only `type: object`) gets Kubernetes' strict ObjectMeta, and its
    `status` goes (controllers write it, manifests never do);
  - `x-kubernetes-int-or-string: true` becomes an explicit integer-or-string choice.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

HERE = Path(__file__).parent
# (CRD file, the version our manifests use) for each custom kind we write.
CRDS = {
    "kserve": [
        ("serving.kserve.io_servingruntimes.yaml", "v1alpha1"),
        ("serving.kserve.io_inferenceservices.yaml", "v1beta1"),
    ],
    "training_operator": [("kubeflow.org_pytorchjobs.yaml", "v1")],
}
# the Kubernetes kinds our manifests use
CORE_KINDS = [
    "configmap-v1.json",
    "secret-v1.json",
    "service-v1.json",
    "deployment-apps-v1.json",
    "job-batch-v1.json",
]
# How a kind's file points into _definitions.json, and how _definitions.json points within itself.
DEFINITIONS_REFS = ("/api/_definitions.json#/$defs/", "#/$defs/")


def drop_descriptions(schema):
    """The schema without `description` keywords (a property *named* description stays)."""
    if isinstance(schema, list):
        return [drop_descriptions(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            out[key] = {name: drop_descriptions(sub) for name, sub in value.items()}
        else:
            out[key] = drop_descriptions(value)
    return out


def inline_refs(schema, definitions: dict, seen: tuple = ()):
    """Every `$ref` into Kubernetes' `_definitions.json` replaced by the definition itself (the
    kinds used here are not recursive; a cycle would be refused rather than expanded forever)."""
    if isinstance(schema, list):
        return [inline_refs(item, definitions, seen) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if ref is not None:
        prefix = next((p for p in DEFINITIONS_REFS if ref.startswith(p)), None)
        if prefix is None:
            raise ValueError(
                f"unexpected $ref {ref!r}: expected one of {DEFINITIONS_REFS} + <name>"
            )
        name = ref[len(prefix) :]
        if name in seen:
            raise ValueError(f"recursive definition {name}: cannot inline it")
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return {
            **inline_refs(definitions[name], definitions, (*seen, name)),
            **inline_refs(rest, definitions, seen),
        }
    return {key: inline_refs(value, definitions, seen) for key, value in schema.items()}


def close_structural(schema):
    """A CRD structural schema as the API server applies it with strict field validation (see the
    docstring)."""
    if isinstance(schema, list):
        return [close_structural(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: close_structural(sub) for name, sub in value.items()}
        else:
            out[key] = close_structural(value)
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def core_schema(folder: Path, name: str) -> dict:
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]
    return drop_descriptions(inline_refs(json.loads((folder / name).read_text()), definitions))


def crd_schema(path: Path, version: str, object_meta: dict) -> tuple[str, str, dict]:
    """(group, kind, schema) of one served version of a CRD."""
    crd = yaml.safe_load(path.read_text())
    found = [v for v in crd["spec"]["versions"] if v["name"] == version]
    if not found:
        raise ValueError(
            f"{path.name} has no version {version}; it has "
            f"{[v['name'] for v in crd['spec']['versions']]}"
        )
    schema = close_structural(drop_descriptions(found[0]["schema"]["openAPIV3Schema"]))
    schema["properties"].pop("status", None)
    schema["properties"]["metadata"] = object_meta
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [f"{group}/{version}"]}
    schema["properties"]["kind"] = {"type": "string", "enum": [kind]}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return group, kind, schema


def write(name: str, schema: dict) -> None:
    (HERE / name).write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {HERE / name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kserve-crds", type=Path, required=True)
    parser.add_argument("--training-operator-crds", type=Path, required=True)
    parser.add_argument("--kubernetes", type=Path, required=True)
    args = parser.parse_args()

    object_meta = None
    for name in CORE_KINDS:
        schema = core_schema(args.kubernetes, name)
        object_meta = object_meta or schema["properties"]["metadata"]
        kind = schema["x-kubernetes-group-version-kind"][0]
        group = kind["group"]
        write(
            f"{group + '_' if group else ''}{kind['version']}_{kind['kind'].lower()}.json", schema
        )
    for folder, crds in (
        (args.kserve_crds, CRDS["kserve"]),
        (args.training_operator_crds, CRDS["training_operator"]),
    ):
        for file, version in crds:
            group, kind, schema = crd_schema(folder / file, version, object_meta)
            write(f"{group}_{version}_{kind.lower()}.json", schema)


if __name__ == "__main__":
    main()
