package suite

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/namespaces"
	"github.com/containerd/containerd/snapshots"
)

// A snapshotter killed (SIGKILL) in the middle of Prepare, Commit and Remove calls comes back
// with metadata and directories in step: every snapshot it lists has its directory and
// answers Mounts, and no directory is left that no snapshot names.
func TestKilledSnapshotterComesBackConsistent(t *testing.T) {
	ctx := namespaces.WithNamespace(context.Background(), "crash")
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	for round := 0; round < 5; round++ {
		sn, cleanup, err := newMosaicfs(ctx, root)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for w := 0; w < 4; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				for i := 0; ; i++ {
					key := fmt.Sprintf("r%d-w%d-%d", round, w, i)
					if _, err := sn.Prepare(ctx, key+"-a", ""); err != nil {
						return // the snapshotter is gone
					}
					if err := sn.Commit(ctx, key, key+"-a"); err != nil {
						return
					}
					if _, err := sn.Prepare(ctx, key+"-child", key); err != nil {
						return
					}
					if i%2 == 0 {
						if sn.Remove(ctx, key+"-child") != nil || sn.Remove(ctx, key) != nil {
							return
						}
					}
				}
			}(w)
		}
		time.Sleep(time.Duration(50+round*37) * time.Millisecond)
		killSnapshotter(t, root)
		wg.Wait()
		cleanup() // the process is gone already; this closes the client
	}

	sn, cleanup, err := newMosaicfs(ctx, root)
	if err != nil {
		t.Fatal(err)
	}
	defer cleanup()
	named := map[string]bool{}
	err = sn.Walk(ctx, func(ctx context.Context, info snapshots.Info) error {
		if info.Kind != snapshots.KindCommitted {
			if _, err := sn.Mounts(ctx, info.Name); err != nil {
				return fmt.Errorf("mounts of %s: %v", info.Name, err)
			}
		}
		named[info.Name] = true
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(filepath.Join(root, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != len(named) {
		t.Fatalf("%d snapshot directories for %d snapshots after the kills", len(entries), len(named))
	}
	if len(named) == 0 {
		t.Fatal("no snapshot survived: the kills came before any work")
	}
	for _, e := range entries {
		if _, err := os.Stat(filepath.Join(root, "snapshots", e.Name(), "fs")); err != nil {
			t.Fatalf("snapshot directory %s has no layer: %v", e.Name(), err)
		}
	}
}

// killSnapshotter sends SIGKILL to the mosaicfs-snapshotter serving root.
func killSnapshotter(t *testing.T, root string) {
	t.Helper()
	out, err := exec.Command("pgrep", "-f", "--", "--root "+root+"$").Output()
	if err != nil {
		t.Fatalf("no snapshotter serves %s: %v", root, err)
	}
	var pid int
	fmt.Sscan(string(out), &pid)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
}
