//! Overlays mounted on top of mosaicfs, as nested containers (podman in podman) do: kernel
//! overlayfs, fuse-overlayfs and mosaicfs itself, with their layers in a mosaicfs mount. Each
//! keeps its own bookkeeping (`trusted.overlay.*`, `user.fuseoverlayfs.*`, `trusted.mosaicfs.*`
//! xattrs, whiteout devices made by RENAME_WHITEOUT or mknod, O_TMPFILE copy-ups) on files of
//! this mount, which must store it for them without reading it as its own.
mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The inner overlay's lower layer, in the outer mount's lower layer: the inner overlay's
/// copy-ups read lower files of the outer one.
fn outer_mount() -> Mount {
    let mut outer = Mount::new(1);
    let il = outer.lower(0).join("il");
    write(il.join("a"), "lowerfile\n");
    write(il.join("dir/y"), "y");
    write(il.join("big"), pattern(1 << 20, 7));
    outer.mount();
    for d in ["iu", "iw", "merged"] {
        fs::create_dir(outer.path(d)).unwrap();
    }
    outer
}

/// What a container does to its root: appends, chmod, a deletion, a new and a renamed
/// directory, an xattr, a small write into a big file.
fn change(merged: &Path) {
    fs::OpenOptions::new()
        .append(true)
        .open(merged.join("a"))
        .unwrap()
        .write_all(b"more\n")
        .unwrap();
    fs::set_permissions(merged.join("a"), fs::Permissions::from_mode(0o600)).unwrap();
    set_xattr(&merged.join("a"), "user.t", b"1");
    fs::remove_file(merged.join("dir/y")).unwrap();
    fs::create_dir(merged.join("d2")).unwrap();
    // mv: kernel overlayfs (without redirect_dir) and fuse-overlayfs answer EXDEV for a lower
    // directory, and mv copies it then.
    run(Command::new("mv")
        .arg(merged.join("dir"))
        .arg(merged.join("d3")));
    write(merged.join("d3/x"), "x");
    write_at(merged.join("big"), 5000, b"Z");
}

fn check(merged: &Path, what: &str) {
    assert_eq!(names(merged), ["a", "big", "d2", "d3"], "{what}");
    assert_eq!(
        fs::read_to_string(merged.join("a")).unwrap(),
        "lowerfile\nmore\n",
        "{what}"
    );
    let md = fs::metadata(merged.join("a")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o600, "{what}");
    assert_eq!(
        get_xattr(&merged.join("a"), "user.t").as_deref(),
        Some(&b"1"[..]),
        "{what}"
    );
    assert_eq!(names(merged.join("d3")), ["x"], "{what}");
    assert!(names(merged.join("d2")).is_empty(), "{what}");
    let mut want = pattern(1 << 20, 7);
    want[5000] = b'Z';
    assert!(fs::read(merged.join("big")).unwrap() == want, "{what}: big");
}

/// An overlay other than mosaicfs on the layers `outer` holds; unmounted on drop.
struct Inner {
    mnt: PathBuf,
    daemon: Option<Child>,
}

impl Inner {
    /// Mount options and mount point of an overlay on `outer`'s `il`, `iu` and `iw`.
    fn options(outer: &Mount) -> (String, PathBuf) {
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            outer.path("il").display(),
            outer.path("iu").display(),
            outer.path("iw").display()
        );
        (opts, outer.path("merged"))
    }

    fn kernel(outer: &Mount) -> Inner {
        let (opts, mnt) = Inner::options(outer);
        let out = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &opts])
            .arg(&mnt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kernel overlayfs refused mosaicfs as its layers: {} {}",
            String::from_utf8_lossy(&out.stderr),
            sh("dmesg | tail -3")
        );
        Inner { mnt, daemon: None }
    }

    fn fuse_overlayfs(outer: &Mount) -> Option<Inner> {
        if Command::new("fuse-overlayfs")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("fuse-overlayfs is not installed (apt-get install fuse-overlayfs): skipped");
            return None;
        }
        let (opts, mnt) = Inner::options(outer);
        let daemon = Command::new("fuse-overlayfs")
            .args(["-f", "-o", &opts])
            .arg(&mnt)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !is_mounted(&mnt) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "fuse-overlayfs did not mount"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(Inner {
            mnt,
            daemon: Some(daemon),
        })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let start = Instant::now();
        while rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::empty()).is_err()
            && start.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(mut d) = self.daemon.take() {
            d.wait().unwrap();
        }
    }
}

/// The outer mount after the inner overlay unmounted: its upper layer holds the inner one's
/// bookkeeping escaped, and its merged view shows the inner whiteout as a device.
fn check_outer(outer: &mut Mount) {
    let wh = fs::symlink_metadata(outer.path("iu/dir")).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_char_device(&wh.file_type()) && wh.rdev() == 0,
        "the inner overlay's whiteout of the renamed directory is a device 0/0 in the merged view"
    );
    outer.remount();
    let wh = fs::symlink_metadata(outer.path("iu/dir")).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_char_device(&wh.file_type()),
        "and stays one after a remount"
    );
}

#[test]
fn kernel_overlayfs_on_mosaicfs() {
    let mut outer = outer_mount();
    {
        let inner = Inner::kernel(&outer);
        change(&inner.mnt);
        check(&inner.mnt, "kernel overlayfs, mounted");
    }
    let escaped = get_xattr(&outer.upper.join("iu"), "trusted.overlay.overlay.uuid")
        .or_else(|| get_xattr(&outer.upper.join("iu/a"), "trusted.overlay.overlay.origin"));
    assert!(
        !disk_upper()
            || escaped.is_some()
            || list_xattr(&outer.upper.join("iu"))
                .iter()
                .any(|n| n.starts_with("trusted.overlay.overlay.")),
        "kernel overlayfs' xattrs are stored escaped"
    );
    check_outer(&mut outer);
    let inner = Inner::kernel(&outer);
    check(
        &inner.mnt,
        "kernel overlayfs, remounted on a remounted mosaicfs",
    );
}

#[test]
fn fuse_overlayfs_on_mosaicfs() {
    let mut outer = outer_mount();
    {
        let Some(inner) = Inner::fuse_overlayfs(&outer) else {
            return;
        };
        change(&inner.mnt);
        check(&inner.mnt, "fuse-overlayfs, mounted");
    }
    check_outer(&mut outer);
    let inner = Inner::fuse_overlayfs(&outer).unwrap();
    check(
        &inner.mnt,
        "fuse-overlayfs, remounted on a remounted mosaicfs",
    );
}

#[test]
fn mosaicfs_on_mosaicfs_keeps_partial_files_of_both() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut outer = outer_mount();
    let mut inner = Mount::new_in(&outer.mnt, 1);
    inner.lowers[0] = outer.path("il");
    inner.extra = opts(&["copy_whole=0"]);
    inner.mount();
    change(&inner.mnt);
    check(&inner.mnt, "mosaicfs, mounted");
    inner.unmount();
    // The inner partial file's mark, escaped on the outer layer; the file is the inner
    // overlay's, not a partial file of the outer one.
    let rel = inner.upper.strip_prefix(&outer.mnt).unwrap().join("big");
    let on_outer = outer.upper.join(&rel);
    assert!(get_xattr(&on_outer, "trusted.mosaicfs.mosaicfs.partial").is_some());
    assert!(get_xattr(&on_outer, "trusted.mosaicfs.partial").is_none());
    assert!(
        allocated(&on_outer) < 1 << 20,
        "the inner copy-up stayed block-level"
    );
    check_outer_mosaicfs(&mut outer, &inner);
    inner.mount();
    check(&inner.mnt, "mosaicfs, remounted on a remounted mosaicfs");
    inner.unmount();
}

fn check_outer_mosaicfs(outer: &mut Mount, inner: &Mount) {
    let rel = inner.upper.strip_prefix(&outer.mnt).unwrap().join("dir");
    let wh = fs::symlink_metadata(outer.mnt.join(&rel)).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &wh.file_type()
    ));
    outer.remount();
    let wh = fs::symlink_metadata(outer.mnt.join(&rel)).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &wh.file_type()
    ));
}
