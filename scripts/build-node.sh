#!/usr/bin/env bash
# Build the node half of the test cluster: kubelet and kube-proxy from the same unpacked
# Debian `kubernetes` 1.20.2 tree that scripts/build-control-plane.sh builds the control
# plane from, and the pause binary from that tree's build/pause (static, as upstream builds
# it). Runs build-control-plane.sh first (it unpacks and patches the tree; fast when done).
#
# Cached under ${DPSERVE_CACHE:-$HOME/.cache/dpserve}/k8s/node-bin with its own recipe stamp,
# so this step never forces a control-plane rebuild. A cold build takes a few minutes on 2
# cores (the Go build cache from the control plane is shared). Prints the bin dir last.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
K8S_CACHE="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/k8s"
BIN_DIR="$K8S_CACHE/node-bin"
SRC_DIR="$K8S_CACHE/src/kubernetes-1.20.2"
GOROOT_DIR="$K8S_CACHE/go/usr/lib/go-1.19"
BINARIES=(kubelet kube-proxy pause)
# Bump when the recipe changes.
BUILD_RECIPE="node-1.20.2+pause-3.4-1"
STAMP="$BIN_DIR/.recipe"

log() { echo "[build-node] $*" >&2; }

binaries_present() {
  local name
  for name in "${BINARIES[@]}"; do
    [[ -x "$BIN_DIR/$name" ]] || return 1
  done
  [[ -f "$STAMP" && "$(<"$STAMP")" == "$BUILD_RECIPE" ]]
}

if binaries_present; then
  echo "$BIN_DIR"
  exit 0
fi

bash "$HERE/build-control-plane.sh" >/dev/null

# The same lock as the control-plane build: both write into one source tree.
exec 9>"$K8S_CACHE/.lock"
flock 9
if binaries_present; then
  echo "$BIN_DIR"
  exit 0
fi

if ! command -v gcc >/dev/null || [[ ! -f /usr/lib/x86_64-linux-gnu/libc.a ]]; then
  log "installing gcc and libc6-dev (the pause binary is linked statically)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >&2
fi

log "building kubelet, kube-proxy (several minutes)"
(
  cd "$SRC_DIR"
  export GOROOT="$GOROOT_DIR"
  export PATH="$GOROOT_DIR/bin:$PATH"
  export GOCACHE="$K8S_CACHE/gocache"
  export GOPATH="$K8S_CACHE/gopath"
  export GOPROXY=off GOFLAGS= CGO_ENABLED=0 GOTOOLCHAIN=local
  export KUBE_GIT_VERSION_FILE="$K8S_CACHE/version.env"
  make WHAT="cmd/kubelet cmd/kube-proxy" >&2
)

OUT_DIR="$SRC_DIR/_output/local/bin/linux/amd64"
mkdir -p "$BIN_DIR"
install_bin() {  # <src> <name>: copy then rename, never a half-written binary
  cp "$1" "$BIN_DIR/.$2.tmp"
  chmod 0755 "$BIN_DIR/.$2.tmp"
  mv -f "$BIN_DIR/.$2.tmp" "$BIN_DIR/$2"
}
for name in kubelet kube-proxy; do
  [[ -x "$OUT_DIR/$name" ]] || { log "build produced no $OUT_DIR/$name"; exit 1; }
  install_bin "$OUT_DIR/$name" "$name"
done

# build/pause/Makefile: CFLAGS = -Os -Wall -Werror -static -DVERSION=v$(TAG)-$(REV)
gcc -Os -Wall -Werror -static -DVERSION=v3.4-dpserve \
  -o "$BIN_DIR/.pause.build" "$SRC_DIR/build/pause/linux/pause.c"
install_bin "$BIN_DIR/.pause.build" pause
rm -f "$BIN_DIR/.pause.build"
echo "$BUILD_RECIPE" >"$STAMP"

log "done: $("$BIN_DIR/kubelet" --version), $("$BIN_DIR/kube-proxy" --version)"
echo "$BIN_DIR"
