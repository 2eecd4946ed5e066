"""scripts/helm: helm's install/uninstall arguments, mapped onto Helm's SDK calls."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("helm_sdk", ROOT / "scripts" / "helm_sdk.py")
assert _spec is not None and _spec.loader is not None
helm_sdk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helm_sdk)


def test_the_readme_install_line_parses_as_helm_reads_it() -> None:
    args = helm_sdk.build_parser().parse_args(
        shlex.split(
            "install dpserve-operator charts/dpserve-operator "
            "--namespace dpserve-system --create-namespace"
        )
    )
    assert (args.command, args.release, args.chart) == (
        "install",
        "dpserve-operator",
        Path("charts/dpserve-operator"),
    )
    assert (args.namespace, args.create_namespace, args.timeout) == ("dpserve-system", True, 300)
    assert helm_sdk.install_values(args) == {}


def test_set_and_values_files_merge_like_helm(tmp_path: Path) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text("watch:\n  allNamespaces: true\n  namespace: a\nimage:\n  tag: x\n")
    args = helm_sdk.build_parser().parse_args(
        ["install", "r", "chart", "-f", str(values_file),
         "--set", "watch.allNamespaces=false,watch.namespace=ml", "--set", "replicas=2"]
    )  # fmt: skip
    assert helm_sdk.install_values(args) == {
        "watch": {"allNamespaces": False, "namespace": "ml"},
        "image": {"tag": "x"},
        "replicas": 2,
    }


@pytest.mark.parametrize(("text", "seconds"), [("5m0s", 300), ("90s", 90), ("2m", 120), ("45", 45)])
def test_timeouts_are_go_durations(text: str, seconds: int) -> None:
    assert helm_sdk.parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["--set novalue", "--set =x", "--timeout 5 minutes"])
def test_bad_arguments_are_refused_naming_them(bad: str, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\n")
    option, _, value = bad.partition(" ")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "helm_sdk.py"), "--kubeconfig", str(kubeconfig),
         "install", "r", "chart", option, value],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result
    assert value.split("=")[0] in result.stderr or "duration" in result.stderr, result.stderr


def test_a_missing_kubeconfig_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nope"))
    assert helm_sdk.run(["uninstall", "r", "-n", "x"]) == 2


def test_install_prints_the_charts_notes_with_the_token_command() -> None:
    notes = helm_sdk.install_notes(
        ROOT / "charts" / "dpserve-operator", {}, "dpserve-operator", "dpserve-system"
    )
    assert "kubectl apply -f examples/inference.yaml" in notes
    assert "in namespace dpserve-system" in notes
    # The HTTP front wants the bearer token: the NOTES fetch it and send it.
    assert '{{index .data "http-api-token" | base64decode}}' in notes
    assert "Authorization: Bearer $TOKEN" in notes
    assert "kubectl delete namespace dpserve-system" in notes
