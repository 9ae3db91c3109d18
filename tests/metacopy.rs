//! Kernel overlayfs' metadata-only lower files, data-only lower layers and `verity=`: a
//! composefs-style image — an EROFS metadata layer whose files carry `overlay.metacopy` and
//! absolute `overlay.redirect`s into a data directory — mounted by mosaicfs with a writable
//! layer on top, compared with kernel overlayfs on the same layers.

mod common;

use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// The metadata layer (an EROFS image, mounted) and the data-only layer.
struct Image {
    meta: PathBuf,
    data: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.meta).status();
    }
}

const BIG: usize = 8 << 20;

/// A metadata-only file `name` of `size` bytes in `src`, its data at `redirect` in the data
/// layer; `digest`: the `overlay.metacopy` value's digest (sha256), if any.
fn metadata_only(src: &Path, name: &str, size: u64, redirect: &str, digest: Option<[u8; 32]>) {
    let p = src.join(name);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::File::create(&p).unwrap().set_len(size).unwrap();
    let value = match digest {
        None => Vec::new(),
        Some(d) => [&[0u8, 36, 0, 1][..], &d].concat(),
    };
    set_xattr(&p, "trusted.overlay.metacopy", &value);
    set_xattr(&p, "trusted.overlay.redirect", redirect.as_bytes());
}

fn image() -> Option<Image> {
    if Command::new("mkfs.erofs").arg("--help").output().is_err() {
        println!("skipped: install erofs-utils (mkfs.erofs)");
        return None;
    }
    let dir = tempfile::Builder::new()
        .prefix("mosaicfs-metacopy")
        .tempdir_in("/var/tmp")
        .unwrap();
    let (src, data, meta) = (
        dir.path().join("src"),
        dir.path().join("data"),
        dir.path().join("meta"),
    );
    fs::create_dir_all(&meta).unwrap();
    write(data.join("ab/big"), pattern(BIG, 3));
    write(data.join("cd/small"), "small data");
    write(data.join("ef/digest"), "data with a digest");
    write(data.join("ef/unreferenced"), "never shows");
    metadata_only(&src, "dir/big", BIG as u64, "/ab/big", None);
    metadata_only(&src, "dir/small", 10, "/cd/small", None);
    metadata_only(&src, "digest", 18, "/ef/digest", Some([7; 32]));
    write(src.join("plain"), "a file with its own data");
    let img = dir.path().join("meta.img");
    sh(&format!(
        "mkfs.erofs {} {} >/dev/null && mount -t erofs -o loop,ro {} {}",
        img.display(),
        src.display(),
        img.display(),
        meta.display()
    ));
    Some(Image {
        meta,
        data,
        _dir: dir,
    })
}

/// What reading each file gives: its bytes or the error number.
fn reads(root: &Path) -> Vec<(String, Result<Vec<u8>, i32>)> {
    ["dir/big", "dir/small", "digest", "plain"]
        .iter()
        .map(|f| {
            let r = fs::read(root.join(f)).map_err(|e| e.raw_os_error().unwrap_or(0));
            (f.to_string(), r)
        })
        .collect()
}

fn names_of(root: &Path) -> (Vec<String>, Vec<String>) {
    (names(root), names(root.join("dir")))
}

#[test]
fn a_composefs_style_image_reads_as_on_kernel_overlayfs_for_every_verity_mode() {
    let Some(img) = image() else { return };
    let layers = format!("lowerdir={}::{}", img.meta.display(), img.data.display());
    for verity in ["off", "on", "require"] {
        // Kernel overlayfs, read-only, on the same layers.
        let k = tempfile::tempdir_in("/var/tmp").unwrap();
        run(Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o"])
            .arg(format!("{layers},metacopy=on,verity={verity}"))
            .arg(k.path()));
        let (kernel_names, kernel_reads) = (names_of(k.path()), reads(k.path()));
        // A metadata-only file occupies its data's blocks: du counts the data.
        let blocks = |p: &Path| fs::metadata(p).unwrap().blocks();
        let data_blocks = blocks(&img.data.join("ab/big"));
        assert_eq!(blocks(&k.path().join("dir/big")), data_blocks, "kernel");
        run(Command::new("umount").arg(k.path()));

        let mut m = Mount::new(0);
        m.mount_with(&format!(
            "{layers},upperdir={},workdir={},verity={verity}",
            m.upper.display(),
            m.work.display()
        ));
        assert_eq!(names_of(&m.mnt), kernel_names, "verity={verity}: the tree");
        assert_eq!(
            blocks(&m.path("dir/big")),
            data_blocks,
            "du counts the data"
        );
        assert!(
            !names(&m.mnt).contains(&"ef".to_string()),
            "data-only layers' names never show"
        );
        let ours = reads(&m.mnt);
        for ((name, got), (_, want)) in ours.iter().zip(&kernel_reads) {
            assert_eq!(
                got.as_ref().map(|b| b.len()),
                want.as_ref().map(|b| b.len()),
                "verity={verity}: {name}"
            );
            assert!(got == want, "verity={verity}: {name}: other bytes");
        }
        m.unmount();
    }
    // What each mode must give, so that kernel overlayfs agreeing is not both being wrong:
    // the data file of `digest` has no fs-verity (this kernel has no CONFIG_FS_VERITY), so
    // any mode that checks digests refuses it; `require` refuses files without a digest too.
    let mut m = Mount::new(0);
    let opts = |v: &str, m: &Mount| {
        format!(
            "{layers},upperdir={},workdir={},verity={v}",
            m.upper.display(),
            m.work.display()
        )
    };
    m.mount_with(&opts("off", &m));
    assert_eq!(fs::read(m.path("digest")).unwrap(), b"data with a digest");
    assert_eq!(fs::read(m.path("dir/big")).unwrap(), pattern(BIG, 3));
    m.unmount();
    m.mount_with(&opts("on", &m));
    assert_eq!(errno_of(fs::read(m.path("digest"))), libc::EIO);
    assert_eq!(fs::read(m.path("dir/small")).unwrap(), b"small data");
    m.unmount();
    m.mount_with(&opts("require", &m));
    assert_eq!(errno_of(fs::read(m.path("dir/small"))), libc::EIO);
    assert_eq!(
        fs::read(m.path("plain")).unwrap(),
        b"a file with its own data"
    );
    m.unmount();
}

#[test]
fn a_write_into_a_metadata_only_file_copies_a_block_of_its_data() {
    let Some(img) = image() else { return };
    let mut m = Mount::new(0);
    let opts = format!(
        "lowerdir={}::{},upperdir={},workdir={}",
        img.meta.display(),
        img.data.display(),
        m.upper.display(),
        m.work.display()
    );
    m.mount_with(&opts);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("dir/big"))
        .unwrap();
    f.write_all_at(b"X", 4 << 20).unwrap();
    drop(f);
    let mut want = pattern(BIG, 3);
    want[4 << 20] = b'X';
    assert!(fs::read(m.path("dir/big")).unwrap() == want, "merged bytes");
    assert!(
        stored_bytes(&m, "dir/big") < 1 << 20,
        "a block copied, not the file: {} bytes",
        stored_bytes(&m, "dir/big")
    );
    m.unmount();
    // The partial file names the data file: it reads right after a remount.
    m.mount_with(&opts);
    assert!(
        fs::read(m.path("dir/big")).unwrap() == want,
        "after a remount"
    );
    m.unmount();
}
