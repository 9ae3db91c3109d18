package suite

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/containerd/containerd/mount"
	"github.com/containerd/containerd/namespaces"
	"github.com/containerd/containerd/snapshots"
)

// mountSnapshot mounts what the snapshotter answered, as containerd does, and returns the
// mount point and its unmount.
func mountSnapshot(t *testing.T, m []mount.Mount) (string, func()) {
	t.Helper()
	dir := t.TempDir()
	if err := mount.All(m, dir); err != nil {
		t.Fatalf("mounting %+v: %v", m, err)
	}
	return dir, func() {
		if err := mount.UnmountAll(dir, 0); err != nil {
			t.Fatalf("unmount %s: %v", dir, err)
		}
	}
}

func fsType(t *testing.T, dir string) string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 8 && f[4] == dir {
			for i, x := range f {
				if x == "-" {
					return f[i+1]
				}
			}
		}
	}
	t.Fatalf("%s is not a mount point", dir)
	return ""
}

// A 1-byte write into a 64 MiB file of a parent layer copies blocks, not the file: the active
// snapshot's usage stays small, and a child stacked on the committed result reads every byte
// right (the partial file is read through the layer below it).
func TestActiveSnapshotsCopyBlocksAndStackedChildrenReadThem(t *testing.T) {
	ctx := namespaces.WithNamespace(context.Background(), "blocks")
	sn, cleanup, err := newMosaicfs(ctx, filepath.Join(t.TempDir(), "root"))
	if err != nil {
		t.Fatal(err)
	}
	defer cleanup()

	big := bytes.Repeat([]byte("0123456789abcdef"), 4<<20) // 64 MiB
	m, err := sn.Prepare(ctx, "base-active", "")
	if err != nil {
		t.Fatal(err)
	}
	dir, unmount := mountSnapshot(t, m)
	if err := os.WriteFile(filepath.Join(dir, "big"), big, 0644); err != nil {
		t.Fatal(err)
	}
	unmount()
	if err := sn.Commit(ctx, "base", "base-active"); err != nil {
		t.Fatal(err)
	}

	m, err = sn.Prepare(ctx, "child-active", "base", snapshots.WithLabels(map[string]string{"l": "1"}))
	if err != nil {
		t.Fatal(err)
	}
	dir, unmount = mountSnapshot(t, m)
	if got := fsType(t, dir); got != "fuse.mosaicfs" {
		t.Fatalf("an active snapshot with a parent mounted as %q, want fuse.mosaicfs", got)
	}
	f, err := os.OpenFile(filepath.Join(dir, "big"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("X"), 10<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	unmount()
	usage, err := sn.Usage(ctx, "child-active")
	if err != nil {
		t.Fatal(err)
	}
	if usage.Size > 1<<20 {
		t.Fatalf("a 1-byte write into a 64 MiB lower file made the layer use %d bytes", usage.Size)
	}
	if err := sn.Commit(ctx, "child", "child-active"); err != nil {
		t.Fatal(err)
	}
	committed, err := sn.Usage(ctx, "child")
	if err != nil || committed.Size != usage.Size {
		t.Fatalf("committed usage %+v (%v), active %+v", committed, err, usage)
	}

	for _, view := range []bool{false, true} {
		key := "grandchild"
		if view {
			key = "grandchild-view"
			m, err = sn.View(ctx, key, "child")
		} else {
			m, err = sn.Prepare(ctx, key, "child")
		}
		if err != nil {
			t.Fatal(err)
		}
		dir, unmount = mountSnapshot(t, m)
		got, err := os.ReadFile(filepath.Join(dir, "big"))
		unmount()
		if err != nil {
			t.Fatal(err)
		}
		want := append([]byte{}, big...)
		want[10<<20] = 'X'
		if !bytes.Equal(got, want) {
			t.Fatalf("view=%v: the stacked layer read wrong bytes (%d bytes, want %d)", view, len(got), len(want))
		}
		if err := sn.Remove(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
}

// containerd's id-mapping labels (container 0 is host 100000) become mosaicfs'
// uidmapping/gidmapping options: a layer file owned by 0 shows as 100000 through the mount, so
// that the user-namespaced container sees it as its root's.
func TestIdMappingLabelsShiftOwners(t *testing.T) {
	ctx := namespaces.WithNamespace(context.Background(), "idmap")
	sn, cleanup, err := newMosaicfs(ctx, filepath.Join(t.TempDir(), "root"))
	if err != nil {
		t.Fatal(err)
	}
	defer cleanup()
	m, err := sn.Prepare(ctx, "base-active", "")
	if err != nil {
		t.Fatal(err)
	}
	dir, unmount := mountSnapshot(t, m)
	if err := os.WriteFile(filepath.Join(dir, "owned"), []byte("x"), 0644); err != nil {
		t.Fatal(err)
	}
	unmount()
	if err := sn.Commit(ctx, "base", "base-active"); err != nil {
		t.Fatal(err)
	}
	m, err = sn.Prepare(ctx, "mapped", "base", snapshots.WithLabels(map[string]string{
		"containerd.io/snapshot/uidmapping": "0:100000:65536",
		"containerd.io/snapshot/gidmapping": "0:100000:65536",
	}))
	if err != nil {
		t.Fatal(err)
	}
	dir, unmount = mountSnapshot(t, m)
	defer unmount()
	st, err := os.Stat(filepath.Join(dir, "owned"))
	if err != nil {
		t.Fatal(err)
	}
	if sys := st.Sys().(*syscall.Stat_t); sys.Uid != 100000 || sys.Gid != 100000 {
		t.Fatalf("a layer file owned by 0:0 shows as %d:%d with the labels 0:100000:65536, want 100000:100000", sys.Uid, sys.Gid)
	}
}
