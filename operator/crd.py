"""The InferenceDeployment CRD, the one owner of the resource's facts.

``inferencedeployment.yaml`` beside this module is the CRD the cluster gets; it ships as
package data and the operator reads from it, instead of restating it, the resource's group,
version, kind and plural, and every default, enum, bound and required field of its spec
(``spec.py`` looks each field up here while it parses). ``crds/inferencedeployment.yaml`` is a
link to it; the Helm chart, which can only read files inside its own directory, carries a
byte-identical copy that tests/unit/test_crd.py holds to it.

Why the YAML owns the facts rather than Python classes that generate it: the CRD is the API's
contract, read by the API server, by ``kubectl explain`` and by the people reviewing a change
to it, and most of it (descriptions, printer columns, the status schema, the scale
subresource) is of no use to the parser. Generating it would move some 450 lines of schema
into Python literals only to write them back out as YAML; reading it costs one ``safe_load``
at import. What a structural schema cannot say (port collisions, GPU requests equal to limits,
name lengths, ...) stays as code in ``spec.py``. ``spec.coordinator.limits`` is the exception
the other way round: its fields and defaults belong to ``dpserve.limits``, and
``limits.crd_schema`` is tested equal to that part of this file.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.resources import files
from typing import Any, Final

import yaml

CRD_FILE: Final = "inferencedeployment.yaml"
CRD_TEXT: Final[str] = files("dpserve_operator").joinpath(CRD_FILE).read_text(encoding="utf-8")
CRD: Final[Mapping[str, Any]] = yaml.safe_load(CRD_TEXT)

GROUP: Final[str] = CRD["spec"]["group"]
KIND: Final[str] = CRD["spec"]["names"]["kind"]
PLURAL: Final[str] = CRD["spec"]["names"]["plural"]
# One served version; a second one would need a conversion plan before this changes.
(_VERSION,) = CRD["spec"]["versions"]
VERSION: Final[str] = _VERSION["name"]
API_VERSION: Final = f"{GROUP}/{VERSION}"

SCHEMA: Final[Mapping[str, Any]] = _VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA: Final[Mapping[str, Any]] = SCHEMA["properties"]["spec"]
STATUS_SCHEMA: Final[Mapping[str, Any]] = SCHEMA["properties"]["status"]


def spec_field(path: str) -> Mapping[str, Any]:
    """The schema of one field of the spec, by its dotted path (``engine.maxBatchSize``)."""
    node = SPEC_SCHEMA
    for key in path.split("."):
        node = node["properties"][key]
    return node
