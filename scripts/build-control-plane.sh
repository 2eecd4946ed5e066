#!/usr/bin/env bash
# Build a real Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler) plus etcd for the e2e tests, from Debian bookworm packages only.
#
# Why from source: no package registry we can reach ships kube-apiserver, but
# Debian's `kubernetes` source package (1.20.2) carries the full tree with
# vendor/, and bookworm ships a Go toolchain (golang-1.19) and etcd (3.4.23)
# as .debs. Nothing is installed system-wide except small build tools via apt
# (rsync, make, dpkg-dev); Go and etcd are unpacked into the cache. Two source
# patches: a newer vendored reflect2 (Go >= 1.18 crash) and loopback Pod IPs
# allowed in Endpoints and the pod proxy (see the comment at that step).
#
# Everything (~3 GB) lives under ${DPSERVE_CACHE:-$HOME/.cache/dpserve}/k8s/.
# A cold build takes 9-15 min on 2 cores. Re-running is cheap: when the four
# binaries exist with the current recipe stamp the script exits at once.
# Prints the bin dir as the last line of stdout.
set -euo pipefail

K8S_CACHE="${DPSERVE_CACHE:-$HOME/.cache/dpserve}/k8s"
BIN_DIR="$K8S_CACHE/bin"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler etcd)

# Bump when the recipe (versions, patches) changes: binaries stamped with an
# older recipe are rebuilt instead of being taken by the fast path.
BUILD_RECIPE="k8s-1.20.2+reflect2-1.0.2+loopback-endpoints-1+empty-strings-1"
STAMP="$BIN_DIR/.recipe"

binaries_present() {
  local name
  for name in "${BINARIES[@]}"; do
    [[ -x "$BIN_DIR/$name" ]] || return 1
  done
  [[ -f "$STAMP" && "$(<"$STAMP")" == "$BUILD_RECIPE" ]]
}

# Fast path: CI calls this before every test run.
if binaries_present; then
  echo "$BIN_DIR"
  exit 0
fi

K8S_VERSION="1.20.2"
GO_SERIES="1.19"
SUITE="bookworm"

DL_DIR="$K8S_CACHE/downloads"
APT_DIR="$K8S_CACHE/apt"
GO_ROOT_PARENT="$K8S_CACHE/go"
SRC_PARENT="$K8S_CACHE/src"
SRC_DIR="$SRC_PARENT/kubernetes-$K8S_VERSION"
ETCD_ROOT="$K8S_CACHE/etcd"
REFLECT2_ROOT="$K8S_CACHE/reflect2"

log() { echo "[build-control-plane] $*" >&2; }

mkdir -p "$K8S_CACHE"
# Two concurrent runs (e.g. a developer and CI on one machine) would trample
# each other's unpacked trees; serialise them.
exec 9>"$K8S_CACHE/.lock"
flock 9
if binaries_present; then
  echo "$BIN_DIR"
  exit 0
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
  SUDO=(sudo)
fi

# --- build tools from apt (only touch apt when something is missing) --------
ensure_tools() {
  local -a missing=()
  command -v rsync >/dev/null || missing+=(rsync)
  command -v make >/dev/null || missing+=(make)
  command -v dpkg-source >/dev/null || missing+=(dpkg-dev)
  command -v xz >/dev/null || missing+=(xz-utils)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v find >/dev/null || missing+=(findutils)
  command -v diff >/dev/null || missing+=(diffutils)
  [[ -r /usr/share/keyrings/debian-archive-keyring.gpg ]] || missing+=(debian-archive-keyring)
  if ((${#missing[@]})); then
    log "installing via apt: ${missing[*]}"
    "${SUDO[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

# --- a private apt configuration with deb + deb-src for bookworm main -------
# Kept separate from the system's lists so we neither need deb-src enabled
# system-wide nor disturb the machine's apt state.
# The Debian mirror of this machine's apt configuration (fails with a message when none).
# shellcheck source=scripts/apt-mirror.sh
source "$(dirname "$0")/apt-mirror.sh"

APT_OPTS=()
setup_private_apt() {
  local mirror
  mirror="$(debian_mirror)"
  mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  cat >"$APT_DIR/sources.list" <<EOF
deb [signed-by=$keyring] $mirror $SUITE main
deb-src [signed-by=$keyring] $mirror $SUITE main
EOF
  APT_OPTS=(
    -o "Dir::Etc::SourceList=$APT_DIR/sources.list"
    -o "Dir::Etc::SourceParts=/nonexistent"
    -o "Dir::State::Lists=$APT_DIR/lists"
    -o "Dir::Cache=$APT_DIR/cache"
  )
  # apt drops to the _apt user for downloads, which cannot write to our dirs.
  if [[ "$(id -u)" == 0 ]]; then
    APT_OPTS+=(-o "APT::Sandbox::User=root")
  fi
  if [[ ! -f "$APT_DIR/updated" ]]; then
    log "apt-get update (private lists, mirror $mirror)"
    apt-get "${APT_OPTS[@]}" update -qq >&2
    touch "$APT_DIR/updated"
  fi
}

# Download binary .debs into $DL_DIR (apt-get download writes to the cwd).
download_debs() {
  mkdir -p "$DL_DIR"
  local pkg
  for pkg in "$@"; do
    if ! compgen -G "$DL_DIR/${pkg}_*.deb" >/dev/null; then
      log "downloading $pkg"
      (cd "$DL_DIR" && apt-get "${APT_OPTS[@]}" download -qq "$pkg" >&2)
    fi
  done
}

unpack_deb_once() {  # <package> <dest>
  local pkg="$1" dest="$2" deb
  [[ -f "$dest/.unpacked-$pkg" ]] && return 0
  deb="$(compgen -G "$DL_DIR/${pkg}_*.deb" | head -n1)"
  mkdir -p "$dest"
  dpkg-deb -x "$deb" "$dest"
  touch "$dest/.unpacked-$pkg"
}

ensure_tools
setup_private_apt

# --- Go toolchain ------------------------------------------------------------
download_debs "golang-$GO_SERIES-go" "golang-$GO_SERIES-src" etcd-server golang-github-modern-go-reflect2-dev
# Both debs go into one root so that go-1.19's src symlink into
# usr/share/go-1.19 resolves.
unpack_deb_once "golang-$GO_SERIES-go" "$GO_ROOT_PARENT"
unpack_deb_once "golang-$GO_SERIES-src" "$GO_ROOT_PARENT"
GOROOT_DIR="$GO_ROOT_PARENT/usr/lib/go-$GO_SERIES"
[[ -x "$GOROOT_DIR/bin/go" ]] || { log "go binary missing under $GOROOT_DIR"; exit 1; }

# --- etcd ----------------------------------------------------------------------
unpack_deb_once etcd-server "$ETCD_ROOT"
# (not etc/init.d/etcd, which is a shell script of the same name)
ETCD_BIN="$ETCD_ROOT/usr/bin/etcd"
[[ -x "$ETCD_BIN" ]] || { log "etcd binary not found in etcd-server deb"; exit 1; }

# --- Kubernetes source -----------------------------------------------------------
if [[ ! -f "$SRC_DIR/.unpacked" ]]; then
  mkdir -p "$DL_DIR/src"
  # Debian's version string is "1.20.5+really1.20.2-...": match loosely, then
  # check the upstream version it really carries.
  if ! compgen -G "$DL_DIR/src/kubernetes_*.dsc" >/dev/null; then
    log "downloading kubernetes source package"
    (cd "$DL_DIR/src" && apt-get "${APT_OPTS[@]}" source --download-only -qq "kubernetes" >&2)
  fi
  dsc="$(compgen -G "$DL_DIR/src/kubernetes_*.dsc" | head -n1 || true)"
  if [[ -z "$dsc" ]] || ! grep -qE "^Version: (.*really)?${K8S_VERSION//./\\.}-" "$dsc"; then
    log "kubernetes ${K8S_VERSION} source package not found (got: ${dsc:-nothing}); Debian moved on?"
    exit 1
  fi
  rm -rf "$SRC_DIR"
  mkdir -p "$SRC_PARENT"
  log "unpacking $(basename "$dsc")"
  # --skip-debianization: Debian's patches target its own packaging build; we
  # want the upstream tree with its vendor/ directory as is.
  dpkg-source --no-check --skip-debianization -x "$dsc" "$SRC_DIR" >&2
  [[ -d "$SRC_DIR/vendor" ]] || { log "source tree has no vendor/ directory"; exit 1; }

  # reflect2 1.0.1 (vendored) reads runtime internals that changed in Go 1.18:
  # kube-apiserver segfaults on the first custom-resource create. 1.0.2 fixes it.
  unpack_deb_once golang-github-modern-go-reflect2-dev "$REFLECT2_ROOT"
  new_reflect2="$REFLECT2_ROOT/usr/share/gocode/src/github.com/modern-go/reflect2"
  old_reflect2="$SRC_DIR/vendor/github.com/modern-go/reflect2"
  [[ -d "$new_reflect2" && -d "$old_reflect2" ]] || { log "reflect2 sources not found"; exit 1; }
  find "$old_reflect2" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) -delete
  find "$new_reflect2" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' \
    -exec cp {} "$old_reflect2/" \;
  touch "$SRC_DIR/.unpacked"
fi

# Every Pod of the e2e node runs on this machine and reports podIP 127.0.0.1,
# but stock v1.20 refuses loopback addresses in two places:
#  - Endpoints validation ("may not be in the loopback range"), so the
#    endpoints controller cannot publish any Pod and the API server's service
#    proxy answers 503 "no endpoints available";
#  - the pod proxy (and node proxy) dialer check ("address not allowed").
# Both checks exist to stop a real cluster's users from reaching the node's
# own loopback; here loopback is the only network we may use. So this test
# build drops the loopback clause of both checks (link-local stays refused).

# patch_once <file> <marker> <regex that must match exactly one line> <sed script>
patch_once() {
  local file="$1" marker="$2" pattern="$3" script="$4"
  grep -q "$marker" "$file" && return 0
  [[ "$(grep -c "$pattern" "$file" || true)" == 1 ]] \
    || { log "unexpected $file: '$pattern' not found exactly once"; exit 1; }
  sed -i "$script" "$file"
  grep -q "$marker" "$file" || { log "patching $file failed"; exit 1; }
}
patch_once "$SRC_DIR/pkg/apis/core/validation/validation.go" "dpserve e2e" \
  '^[[:space:]]*if ip.IsLoopback() {$' \
  's#^\([[:space:]]*\)if ip.IsLoopback() {$#\1if false \&\& ip.IsLoopback() { // dpserve e2e: loopback allowed#'
patch_once "$SRC_DIR/pkg/proxy/util/utils.go" "dpserve e2e" \
  '^[[:space:]]*if ip.IsLoopback() || ip.IsLinkLocalUnicast()' \
  's#^\([[:space:]]*\)if ip.IsLoopback() || ip.IsLinkLocalUnicast()#\1if /* dpserve e2e: loopback allowed */ ip.IsLinkLocalUnicast()#'

# Custom-resource schema validation treats a value as null when it equals its type's zero
# value by reflect.DeepEqual; under Go >= 1.19 that holds for a decoded "" too, so this
# build (Go 1.19; upstream 1.20 used Go 1.15) rejects every empty string in a custom
# resource ("must be of type string: null"). Only a real nil is null.
for openapi_type in vendor/k8s.io/kube-openapi/pkg/validation/validate/type.go \
                    vendor/github.com/go-openapi/validate/type.go; do
  [[ -f "$SRC_DIR/$openapi_type" ]] || continue
  patch_once "$SRC_DIR/$openapi_type" "dpserve e2e" \
    '^[[:space:]]*if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {$' \
    's#^\([[:space:]]*\)if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {$#\1if data == nil { // dpserve e2e: a decoded "" is not null#'
done

# --- build -------------------------------------------------------------------------
# The tarball is not a git checkout; give hack/lib/version.sh the version info
# it would otherwise ask git for.
cat >"$K8S_CACHE/version.env" <<EOF
KUBE_GIT_COMMIT='0000000000000000000000000000000000000000'
KUBE_GIT_TREE_STATE='clean'
KUBE_GIT_VERSION='v$K8S_VERSION'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='20'
EOF

log "building kube-apiserver, kube-controller-manager, kube-scheduler (several minutes)"
(
  cd "$SRC_DIR"
  export GOROOT="$GOROOT_DIR"
  export PATH="$GOROOT_DIR/bin:$PATH"
  export GOCACHE="$K8S_CACHE/gocache"
  export GOPATH="$K8S_CACHE/gopath"
  export GOPROXY=off GOFLAGS= CGO_ENABLED=0 GOTOOLCHAIN=local
  export KUBE_GIT_VERSION_FILE="$K8S_CACHE/version.env"
  export KUBE_VERBOSE=1
  make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler" >&2
)

OUT_DIR="$SRC_DIR/_output/local/bin/linux/amd64"
mkdir -p "$BIN_DIR"
# Copy then rename so an interrupted run never leaves a half-written binary
# that the fast path above would accept.
install_bin() {  # <src> <name>
  cp "$1" "$BIN_DIR/.$2.tmp"
  chmod 0755 "$BIN_DIR/.$2.tmp"
  mv -f "$BIN_DIR/.$2.tmp" "$BIN_DIR/$2"
}
for name in kube-apiserver kube-controller-manager kube-scheduler; do
  [[ -x "$OUT_DIR/$name" ]] || { log "build produced no $OUT_DIR/$name"; exit 1; }
  install_bin "$OUT_DIR/$name" "$name"
done
install_bin "$ETCD_BIN" etcd
echo "$BUILD_RECIPE" >"$STAMP"

log "done: $("$BIN_DIR/kube-apiserver" --version), $("$BIN_DIR/etcd" --version | head -n1)"
echo "$BIN_DIR"
