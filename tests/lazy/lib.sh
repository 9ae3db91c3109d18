# Sourced by tests/lazy/run.sh and bench/lazy.sh: a registry on 127.0.0.1, the layer store, an
# eStargz image, and Podman set up to take layers from the store. Needs $bin (mosaicfs) and
# tests/check.sh; sets $t (the work dir), $tool, $registry, $image, $big_mib, RUN and the
# cleanup trap (KEEP=1 keeps the work dir, the daemons and the mounts).
lazy_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH=$PATH:/usr/local/go/bin
# tests/deps.sh installs docker-registry and stargz-snapshotter (ctr-remote); run alone, this does.
if ! command -v docker-registry >/dev/null; then
  echo "lazy: installing docker-registry"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry >/dev/null
  # The package starts its own registry on :5000 where an init system runs; this one is ours.
  pkill -x docker-registry 2>/dev/null
fi
require_tools "lazy pull" "tests/deps.sh installs podman, runc, busybox-static, golang-go" \
  podman runc busybox go docker-registry python3 curl

t=$(mktemp -d /var/tmp/mosaicfs-lazy.XXXXXX)
pids=()
podman_roots=()
cleanup() {
  local root p
  for root in "${podman_roots[@]}"; do
    PODMAN_ROOT=$root podman rm -af >/dev/null 2>&1
    PODMAN_ROOT=$root podman rmi -af >/dev/null 2>&1
  done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  grep " $t/" /proc/self/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$t"
}
[ -n "${KEEP:-}" ] || trap cleanup EXIT

# The layer store and image maker: built once per source (go.sum pins every dependency).
cache=/var/tmp/mosaicfs-lazy-layers
tool=$cache/lazy-layers-$(cat "$lazy_dir/layers/go.mod" "$lazy_dir/layers/go.sum" "$lazy_dir/layers/main.go" | sha256sum | cut -c1-16)
if [ ! -x "$tool" ]; then
  echo "lazy: building the layer store (tests/lazy/layers; modules from the Go proxy)"
  mkdir -p "$cache"
  (cd "$lazy_dir/layers" && GOFLAGS=-mod=readonly go build -o "$tool.new" .) || { echo "lazy: go build failed"; exit 1; }
  mv "$tool.new" "$tool"
fi

# A registry on a free loopback port, its access log in $t/registry.log.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
registry=127.0.0.1:$port
printf '%s\n' "version: 0.1" "log: {level: warn, accesslog: {disabled: false}}" \
  "storage: {filesystem: {rootdirectory: $t/registry}}" "http: {addr: $registry}" > "$t/registry.yml"
docker-registry serve "$t/registry.yml" > "$t/registry.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf "http://$registry/v2/" >/dev/null && break; sleep 0.1; done
# Bytes the registry served for blob GETs since its log had $1 lines.
served_since() {
  tail -n +"$(($1 + 1))" "$t/registry.log" |
    awk '/"GET \/v2\/.*\/blobs\/sha256:/ { for (i = 1; i <= NF; i++) if ($i ~ /^[0-9][0-9][0-9]$/ && $(i+1) ~ /^[0-9]+$/) { n += $(i+1); break } } END { print n + 0 }'
}
log_lines() { wc -l < "$t/registry.log"; }

# The image: a busybox rootfs with 500 small files, and a layer holding one big file of random
# bytes (so that the registry cannot serve it in fewer bytes than its size).
big_mib=${LAZY_BIG_MIB:-64}
mkdir -p "$t/base"/{bin,etc,tmp,root,data/small} "$t/big/data"
cp "$(command -v busybox)" "$t/base/bin/busybox"
for c in sh ls cat echo dd wc od head tail stat test true sync cmp md5sum printf sleep; do ln -s busybox "$t/base/bin/$c"; done
echo "root:x:0:0:root:/root:/bin/sh" > "$t/base/etc/passwd"
echo "root:x:0:" > "$t/base/etc/group"
for i in $(seq 500); do echo "small file $i" > "$t/base/data/small/$i"; done
head -c "$((big_mib << 20))" /dev/urandom > "$t/big/data/big"
find "$t/base" "$t/big" -exec touch -h -d "2024-01-01 00:00:00" {} +
tar -C "$t/base" -cf "$t/base.tar" . && tar -C "$t/big" -cf "$t/big.tar" .
check "an eStargz image pushed to the registry on $registry" \
  "$tool" push -registry "$registry" -image lazy/test:1 "$t/base.tar" "$t/big.tar"
image=$registry/lazy/test:1

# start_store NAME: a layer store of its own (an empty cache) mounted at $t/NAME. Not in a
# subshell (not through check): cleanup stops the daemons listed in pids.
start_store() {
  "$tool" store -root "$t/$1-cache" "$t/$1" > "$t/$1.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do mountpoint -q "$t/$1" && return 0; sleep 0.1; done
  cat "$t/$1.log"; return 1
}

# Podman as a user would set it up, in a storage root of its own ($t/$PODMAN_ROOT, default
# root), with mount program $MOUNT_PROGRAM (default mosaicfs; empty: the kernel's overlayfs)
# and additional layer store $t/$LAYER_STORE (default store; empty: none, layers pulled whole).
podman() {
  local root=$t/${PODMAN_ROOT:-root} mount_program=${MOUNT_PROGRAM-$bin} store=${LAYER_STORE-store} opts=()
  [ -n "$mount_program" ] && opts+=(--storage-opt overlay.mount_program="$mount_program")
  [ -n "$store" ] && opts+=(--storage-opt overlay.additionallayerstore="$t/$store:ref")
  command podman --root "$root" --runroot "$root-run" --storage-driver overlay "${opts[@]}" \
    --runtime runc --cgroup-manager cgroupfs --events-backend file "$@"
}
RUN=(--network none --tls-verify=false --ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
