"""Validators for rendered Kubernetes objects, as strict as `kubectl apply --validate=strict`.

- Built-in kinds: `kubernetes-validate` (pinned in the test extra) with the OpenAPI schemas of
  Kubernetes `K8S_VERSION`, strict (unknown fields are errors).
- LeaderWorkerSet: its CRD's openAPIV3Schema (tests/fixtures/lws/), strict as the DGD's, and its
  pod templates as Kubernetes PodTemplates.
- DynamoGraphDeployment: the CRD's openAPIV3Schema (tests/fixtures/dynamo/, Dynamo 0.6.0) made
  strict as its README says: an object schema with `properties` and neither
  `additionalProperties` nor `x-kubernetes-preserve-unknown-fields: true` takes no other key,
  and `x-kubernetes-int-or-string: true` takes an integer or a string.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

K8S_VERSION = "1.33.0"
DGD_SCHEMA = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo" / "dgd-v1alpha1.schema.json"
LWS_SCHEMA = Path(__file__).resolve().parents[1] / "fixtures" / "lws" / "lws-v1.schema.json"


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def _dgd_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_strict(json.loads(DGD_SCHEMA.read_text())))


def dgd_errors(doc: dict[str, Any]) -> list[str]:
    """Every violation of the strict CRD schema, as `path: message`."""
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in sorted(_dgd_validator().iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


@cache
def _lws_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_strict(json.loads(LWS_SCHEMA.read_text())))


def k8s_errors(doc: dict[str, Any]) -> list[str]:
    """The violation of Kubernetes' own schema for the object's kind (strict), if any; a
    LeaderWorkerSet's, every violation of its strict CRD schema and of its pod templates'."""
    if doc.get("kind") == "LeaderWorkerSet":
        errors = [
            f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in _lws_validator().iter_errors(doc)
        ]
        template = doc.get("spec", {}).get("leaderWorkerTemplate", {})
        for role in ("leaderTemplate", "workerTemplate"):
            pods = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()}}
            errors += k8s_errors({**pods, "template": template.get(role, {})})
        return errors
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: {e.message} at {list(e.path)}"]
    return []
