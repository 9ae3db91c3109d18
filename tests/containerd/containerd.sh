# Sourced by tests/containerd/run.sh and bench/containerd.sh: a containerd of their own in
# directory $t (root, state, socket, log; the CRI plugin off), with proxy snapshotters.
#
#   start_containerd NAME=SOCKET...   writes $t/config.toml, starts containerd in the
#                                     background (its pid appended to $pids), waits for it
#   ctr_ ARGS...                      ctr on that containerd
ctr_() { ctr --address "$t/containerd.sock" "$@"; }

start_containerd() {
  {
    echo "version = 2"
    echo "root = \"$t/root\""
    echo "state = \"$t/state\""
    echo 'disabled_plugins = ["io.containerd.grpc.v1.cri"]'
    echo "[grpc]"
    echo "  address = \"$t/containerd.sock\""
    echo "[plugins.\"io.containerd.snapshotter.v1.overlayfs\"]"
    echo "  root_path = \"$t/overlayfs\""
    for plugin in "$@"; do
      echo "[proxy_plugins.${plugin%%=*}]"
      echo "  type = \"snapshot\""
      echo "  address = \"${plugin#*=}\""
    done
  } > "$t/config.toml"
  containerd --config "$t/config.toml" > "$t/containerd.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do ctr_ version >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "containerd did not start: $(tail -5 "$t/containerd.log")"
  return 1
}

# busybox-static in $1 (a layer directory), with the commands given after it.
busybox_layer() {
  local dir=$1; shift
  mkdir -p "$dir"/{bin,etc,tmp,data}
  cp "$(command -v busybox)" "$dir/bin/busybox"
  for c in "$@"; do ln -s busybox "$dir/bin/$c"; done
  echo "root:x:0:0:root:/:/bin/sh" > "$dir/etc/passwd"
}
