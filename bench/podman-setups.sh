# Sourced by the Podman benchmarks: `podman_for SETUP ARGS...` runs podman on the storage of one
# setup under $root — containers/storage's kernel overlay driver (overlay), or the overlay
# driver with a mount_program: fuse-overlayfs 1.10, fuse-overlayfs 2.0 ($fo2) or mosaicfs
# ($bin) — with runc, cgroupfs and file events, as on a host without systemd.
podman_for() {
  local setup=$1; shift
  local opts=()
  case $setup in
    mosaicfs) opts=(--storage-opt overlay.mount_program="$bin") ;;
    fuse-overlayfs) opts=(--storage-opt overlay.mount_program=/usr/bin/fuse-overlayfs) ;;
    fuse-overlayfs-2.0) opts=(--storage-opt overlay.mount_program="$fo2") ;;
    overlay) opts=() ;;
  esac
  podman --root "$root/$setup/root" --runroot "$root/$setup/runroot" --storage-driver overlay \
    "${opts[@]}" --runtime runc --cgroup-manager cgroupfs --events-backend file "$@"
}
