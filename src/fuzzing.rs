//! Fuzz targets: every decoder of data a layer can hand mosaicfs, as a function of arbitrary
//! bytes that panics when the decoder breaks a promise. A decoder may refuse anything; what it
//! accepts it must read back the same after encoding it again, and nothing may panic, hang or
//! allocate more than the input justifies.
//!
//! The same functions run three ways: under libFuzzer (`fuzz/`, `fuzz/run.sh`, a nightly
//! toolchain), over the corpus kept in `fuzz/corpus/` with a few thousand mutations of it in
//! `make test` (tests/fuzz.rs, any toolchain), and in each decoder's own unit tests.

use std::os::fd::OwnedFd;
use std::path::Path;

use crate::file::partial::mark::PartialMark;
use crate::memory_upper::{MemoryUpper, fit_image_checksums, fit_journal_checksums};
use crate::stat_override::OverrideStat;

/// A fuzz target: its name (the directory of its corpus) and its function, which says whether
/// the decoder accepted the input.
pub type Target = (&'static str, fn(&[u8]) -> bool);

/// Every target, by name.
pub const TARGETS: &[Target] = &[
    ("partial_mark", partial_mark),
    ("memory_image", memory_image),
    ("memory_journal", memory_journal),
    ("stat_override", stat_override),
    ("redirect", redirect),
    ("origin", origin),
    ("metacopy", metacopy),
    ("posix_acl", posix_acl),
];

/// The partial-file mark (`trusted.mosaicfs.partial`): a mark that decodes encodes to bytes
/// that decode to the same mark.
pub fn partial_mark(data: &[u8]) -> bool {
    let Ok(mark) = PartialMark::decode(data) else {
        return false;
    };
    let again = PartialMark::decode(&mark.encode()).expect("an encoded mark decodes");
    assert_eq!(again, mark);
    assert!(mark.valid <= mark.lower_size && mark.layer != 0);
    true
}

/// The memory upper's image (`.mosaicfs-tree`), loaded as a mount would, with a filestore of
/// 256 blocks, its checksum made to fit; a layer that loads is walked from its root.
pub fn memory_image(data: &[u8]) -> bool {
    let mut image = data.to_vec();
    fit_image_checksums(&mut image);
    let Ok(up) = MemoryUpper::from_bytes(&image, None, filestore()) else {
        return false;
    };
    walk(&up);
    true
}

/// The memory upper's journal after an image: the input is a 4-byte little-endian length, the
/// image, and the journal; checksums are made to fit.
pub fn memory_journal(data: &[u8]) -> bool {
    let Some(len) = data.get(..4) else {
        return false;
    };
    let len = u32::from_le_bytes(len.try_into().unwrap()) as usize;
    let Some(image) = data.get(4..4usize.saturating_add(len)) else {
        return false;
    };
    let (mut image, mut journal) = (image.to_vec(), data[4 + len..].to_vec());
    fit_image_checksums(&mut image);
    fit_journal_checksums(&mut journal);
    let Ok(up) = MemoryUpper::from_bytes(&image, Some(&journal), filestore()) else {
        return false;
    };
    walk(&up);
    true
}

/// The owner, mode and type override of `xattr_permissions=` (`user.containers.override_stat`
/// and the privileged key): a value that parses encodes to one that parses the same.
pub fn stat_override(data: &[u8]) -> bool {
    let Ok(v) = OverrideStat::parse(data) else {
        return false;
    };
    assert_eq!(v.mode & !0o7777, 0);
    let kind = v.kind.map_or(libc::S_IFREG, |(k, _)| k);
    let again = OverrideStat::parse(v.encode(kind).as_bytes()).expect("encoded value parses");
    assert_eq!((again.uid, again.gid, again.mode), (v.uid, v.gid, v.mode));
    // A value without a type reads back with the type it was encoded for.
    assert_eq!(again.kind, Some(v.kind.unwrap_or((kind, 0))));
    let mut a = crate::sys::Attr {
        mode: libc::S_IFDIR | 0o755,
        ..Default::default()
    };
    v.apply(&mut a);
    assert_eq!(
        a.mode & libc::S_IFMT,
        libc::S_IFDIR,
        "a value never retypes a directory"
    );
    true
}

/// A directory's redirect xattr (`overlay.redirect`): what it names stays inside the layer.
pub fn redirect(data: &[u8]) -> bool {
    use crate::overlay::Redirect;
    use std::path::Component;
    match Redirect::parse(data) {
        Some(Redirect::Absolute(p)) => {
            assert!(p.file_name().is_some());
            assert!(
                p.components().all(|c| matches!(c, Component::Normal(_))),
                "{p:?} leaves the layer"
            );
        }
        Some(Redirect::Sibling(n)) => {
            assert!(!n.is_empty() && n != ".." && n != ".");
            assert!(
                !Path::new(&n)
                    .components()
                    .any(|c| !matches!(c, Component::Normal(_)))
            );
        }
        None => return false,
    }
    true
}

/// The origin xattr a copied-up object keeps its inode number in.
pub fn origin(data: &[u8]) -> bool {
    let Some(ino) = crate::overlay::origin_number(data) else {
        return false;
    };
    assert!(ino > 1 && ino < crate::inode::ALIAS_BASE);
    true
}

/// A metadata-only file's `overlay.metacopy` value.
pub fn metacopy(data: &[u8]) -> bool {
    match crate::overlay::parse_metacopy(data, Path::new("fuzz")) {
        Ok(Some((algorithm, digest))) => {
            assert_ne!(algorithm, 0);
            assert_eq!(digest.len() + 4, data.len());
            true
        }
        Ok(None) => true,
        Err(_) => false,
    }
}

/// A parent directory's default ACL (`system.posix_acl_default`), as a new object inherits
/// it, and an access ACL set or changed by chmod.
pub fn posix_acl(data: &[u8]) -> bool {
    for mode in [libc::S_IFREG | 0o644, libc::S_IFDIR | 0o777] {
        if let Ok(i) = crate::acl::inherit(mode, 0o022, Some(data)) {
            assert_eq!(i.mode & libc::S_IFMT, mode & libc::S_IFMT);
            assert_eq!(i.mode & !(libc::S_IFMT | 0o777), 0);
        }
    }
    if let Ok((mode, _)) = crate::acl::set_access(data, libc::S_IFREG | 0o600) {
        assert_eq!(mode & libc::S_IFMT, libc::S_IFREG);
    }
    match crate::acl::chmod(data, 0o750) {
        Ok(v) => {
            assert_eq!(v.len(), data.len());
            true
        }
        Err(_) => false,
    }
}

/// An empty filestore of 256 blocks (1 MiB, sparse) for a loaded image to map.
fn filestore() -> OwnedFd {
    let fd = rustix::fs::memfd_create("mosaicfs-fuzz", rustix::fs::MemfdFlags::CLOEXEC)
        .expect("memfd_create");
    rustix::fs::ftruncate(&fd, 256 * crate::memory_upper::BLOCK).expect("ftruncate");
    fd
}

/// Every name, attribute, link target and data block of a loaded layer.
fn walk(up: &MemoryUpper) {
    let mut dirs = vec![crate::memory_upper::ROOT];
    let mut seen = 0usize;
    while let Some(dir) = dirs.pop() {
        let entries = up.read_dir(dir).expect("a loaded directory lists");
        for (name, ino, _) in entries {
            seen += 1;
            assert!(seen <= 1 << 20, "a loop in a loaded tree");
            assert_eq!(up.lookup(dir, &name).unwrap(), Some(ino));
            let attr = up.stat(ino).expect("a named node stats");
            match attr.mode & libc::S_IFMT {
                libc::S_IFDIR => dirs.push(ino),
                libc::S_IFLNK => {
                    up.read_link(ino).expect("a symlink reads");
                }
                libc::S_IFREG => {
                    let node = up.node(ino).unwrap();
                    let mut buf = vec![0u8; 4096];
                    for off in [0, attr.size.saturating_sub(1)] {
                        up.read(&node, &mut buf, off).expect("a loaded file reads");
                    }
                }
                _ => {}
            }
        }
    }
}
