"""The dpserve Kubernetes operator (installed as ``dpserve_operator``).

It turns an ``InferenceDeployment`` custom resource into a coordinator Deployment, an engine
StatefulSet and their Services, PodDisruptionBudget and NetworkPolicies, and reports progress
in the resource's status. Pods run ``dpserve coordinator`` / ``dpserve engine``; this package
never imports the runtime (coordinator, engine, client) itself.

Modules: ``crd`` (the CRD, shipped as package data: the resource's names and the spec's
defaults, enums and bounds), ``spec`` (validation against it), ``manifests`` (pure spec →
objects), ``status`` (pure status computation), ``cluster`` (the only module that talks to the
API server), ``rbac`` (every API permission the operator needs, enforced by ``cluster`` and
mirrored by the Helm chart), ``handlers`` (kopf wiring) and ``main`` (entry point).
"""
