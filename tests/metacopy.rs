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

/// A read-only FUSE file system of a few files in its root that answers FS_IOC_MEASURE_VERITY
/// with a digest of each file's bytes, as fs-verity would. This kernel has no fs-verity
/// (CONFIG_FS_VERITY is not set), but it passes that ioctl on to a FUSE daemon
/// (fs/fuse/ioctl.c), so the checks of `verity=` meet a real measurement here.
struct VerityStore {
    files: Vec<(&'static str, Vec<u8>)>,
}

/// FS_VERITY_HASH_ALG_SHA256's size; the value only has to follow the bytes.
fn digest_of(bytes: &[u8]) -> [u8; 32] {
    let mut d = [0u8; 32];
    for (lane, out) in d.chunks_mut(8).enumerate() {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ lane as u64;
        for b in bytes {
            h = (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        out.copy_from_slice(&h.to_le_bytes());
    }
    d
}

impl VerityStore {
    fn attr(&self, ino: u64) -> Option<fuser::FileAttr> {
        let (kind, perm, size) = match ino {
            1 => (fuser::FileType::Directory, 0o755, 0),
            n => (
                fuser::FileType::RegularFile,
                0o644,
                self.files.get(n as usize - 2)?.1.len() as u64,
            ),
        };
        let t = std::time::UNIX_EPOCH;
        Some(fuser::FileAttr {
            ino: fuser::INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind,
            perm,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
            nodeid: 0,
        })
    }
}

impl fuser::Filesystem for VerityStore {
    fn lookup(
        &self,
        _req: &fuser::Request,
        parent: fuser::INodeNo,
        name: &std::ffi::OsStr,
        reply: fuser::ReplyEntry,
    ) {
        let found = self.files.iter().position(|(n, _)| name == *n);
        match found
            .filter(|_| parent.0 == 1)
            .and_then(|i| self.attr(i as u64 + 2))
        {
            Some(a) => reply.entry(&std::time::Duration::ZERO, &a, fuser::Generation(0)),
            None => reply.error(fuser::Errno::ENOENT),
        }
    }

    fn getattr(
        &self,
        _req: &fuser::Request,
        ino: fuser::INodeNo,
        _fh: Option<fuser::FileHandle>,
        reply: fuser::ReplyAttr,
    ) {
        match self.attr(ino.0) {
            Some(a) => reply.attr(&std::time::Duration::ZERO, &a),
            None => reply.error(fuser::Errno::ENOENT),
        }
    }

    fn open(
        &self,
        _req: &fuser::Request,
        _ino: fuser::INodeNo,
        _flags: fuser::OpenFlags,
        reply: fuser::ReplyOpen,
    ) {
        reply.opened(fuser::FileHandle(0), fuser::FopenFlags::empty());
    }

    fn read(
        &self,
        _req: &fuser::Request,
        ino: fuser::INodeNo,
        _fh: fuser::FileHandle,
        offset: u64,
        size: u32,
        _flags: fuser::OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: fuser::ReplyData,
    ) {
        let Some((_, bytes)) = self.files.get(ino.0 as usize - 2) else {
            return reply.error(fuser::Errno::ENOENT);
        };
        let start = (offset as usize).min(bytes.len());
        let end = (start + size as usize).min(bytes.len());
        reply.data(&bytes[start..end]);
    }

    fn readdir(
        &self,
        _req: &fuser::Request,
        _ino: fuser::INodeNo,
        _fh: fuser::FileHandle,
        offset: u64,
        mut reply: fuser::ReplyDirectory,
    ) {
        for (i, (name, _)) in self.files.iter().enumerate().skip(offset as usize) {
            let ino = fuser::INodeNo(i as u64 + 2);
            if reply.add(ino, i as u64 + 1, fuser::FileType::RegularFile, name) {
                break;
            }
        }
        reply.ok();
    }

    fn ioctl(
        &self,
        _req: &fuser::Request,
        ino: fuser::INodeNo,
        _fh: fuser::FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        const FS_IOC_MEASURE_VERITY: u32 = 0xc004_6686;
        let file = self.files.get((ino.0 as usize).wrapping_sub(2));
        match file {
            Some((_, bytes)) if cmd == FS_IOC_MEASURE_VERITY && out_size >= 36 => {
                let mut out = vec![1, 0, 32, 0];
                out.extend(digest_of(bytes));
                reply.ioctl(0, &out);
            }
            _ => reply.error(fuser::Errno::ENOTTY),
        }
    }
}

#[test]
fn verity_checks_the_digest_of_each_data_file_against_its_measurement() {
    let good = b"the data the image was built with".to_vec();
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let data = dir.path().join("data");
    fs::create_dir(&data).unwrap();
    let store = VerityStore {
        files: vec![
            ("good", good.clone()),
            ("tampered", b"the data someone put there later!".to_vec()),
        ],
    };
    let _session = fuser::spawn_mount(store, &data, &fuser::Config::default()).unwrap();
    let mut m = Mount::new(1);
    let meta = m.lower(0).to_path_buf();
    let digest = digest_of(&good);
    metadata_only(&meta, "ok", good.len() as u64, "/good", Some(digest));
    metadata_only(
        &meta,
        "changed",
        good.len() as u64,
        "/tampered",
        Some(digest),
    );
    metadata_only(&meta, "no_digest", good.len() as u64, "/good", None);
    let opts = |v: &str, m: &Mount| {
        format!(
            "lowerdir={}::{},upperdir={},workdir={},verity={v}",
            meta.display(),
            data.display(),
            m.upper.display(),
            m.work.display()
        )
    };
    for verity in ["on", "require"] {
        m.mount_with(&opts(verity, &m));
        assert_eq!(fs::read(m.path("ok")).unwrap(), good, "verity={verity}");
        assert_eq!(
            errno_of(fs::read(m.path("changed"))),
            libc::EIO,
            "verity={verity}: a data file that does not match its digest"
        );
        let no_digest = fs::read(m.path("no_digest")).map_err(|e| e.raw_os_error());
        match verity {
            "on" => assert_eq!(no_digest.unwrap(), good),
            _ => assert_eq!(no_digest.unwrap_err(), Some(libc::EIO)),
        }
        // A copy-up checks too: a write into the changed file fails, nothing is copied.
        let w = fs::OpenOptions::new().write(true).open(m.path("changed"));
        assert_eq!(errno_of(w), libc::EIO, "verity={verity}: copy-up");
        m.unmount();
    }
    // verity=off reads what is there.
    m.mount_with(&opts("off", &m));
    assert_eq!(
        fs::read(m.path("changed")).unwrap(),
        b"the data someone put there later!"
    );
    m.unmount();
}
