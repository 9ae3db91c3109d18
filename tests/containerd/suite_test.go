// containerd's own snapshotter test suite (snapshots/testsuite, the one its built-in
// snapshotters pass) against mosaicfs-snapshotter, reached the way containerd reaches it: the
// proxy snapshotter over gRPC on a unix socket. The same suite runs on containerd's overlayfs
// snapshotter in the same run, as the reference. Every test of the suite gets a fresh root and
// a fresh mosaicfs-snapshotter process; the mounts it answers are made by mount.fuse3 running
// the installed `mosaicfs`, as containerd makes them.
//
// Run by tests/containerd/run.sh (part of `make test`), as root.
package suite

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/snapshots"
	"github.com/containerd/containerd/snapshots/overlay"
	"github.com/containerd/containerd/snapshots/proxy"
	"github.com/containerd/containerd/snapshots/testsuite"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func newMosaicfs(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
	bin := os.Getenv("MOSAICFS_SNAPSHOTTER")
	if bin == "" {
		return nil, nil, fmt.Errorf("set MOSAICFS_SNAPSHOTTER to the mosaicfs-snapshotter binary")
	}
	sock := filepath.Join(filepath.Dir(root), "snapshotter.sock")
	cmd := exec.Command(bin, "--address", sock, "--root", root)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	stop := func() error {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		return cmd.Wait()
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.Dial("unix", sock)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			stop()
			return nil, nil, fmt.Errorf("mosaicfs-snapshotter did not listen on %s: %v", sock, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	conn, err := grpc.Dial("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		stop()
		return nil, nil, err
	}
	sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "mosaicfs")
	return sn, func() error {
		sn.Close()
		conn.Close()
		if err := stop(); err != nil {
			return fmt.Errorf("mosaicfs-snapshotter did not exit cleanly on SIGTERM: %v", err)
		}
		return nil
	}, nil
}

func newOverlay(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
	sn, err := overlay.NewSnapshotter(root)
	if err != nil {
		return nil, nil, err
	}
	return sn, sn.Close, nil
}

func TestMosaicfsSnapshotter(t *testing.T) {
	testsuite.SnapshotterSuite(t, "mosaicfs", newMosaicfs)
}

func TestOverlayfsSnapshotterReference(t *testing.T) {
	testsuite.SnapshotterSuite(t, "overlayfs", newOverlay)
}
