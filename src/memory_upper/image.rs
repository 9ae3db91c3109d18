//! The tree image: every node of a memory upper layer, written whole by `MemoryUpper::sync`
//! and read at mount. Format (version 1) in docs/FORMAT.md, "Memory upper: the tree image".
//!
//! Written to `IMAGE_NAME.new`, fsynced, renamed over `IMAGE_NAME`, and the directory fsynced:
//! at any moment the directory holds one whole image, the old or the new. The decoder trusts
//! nothing: a checksum covers the image, and the tree it describes must be one tree (every
//! node reached once from the root, link counts that match, no filestore block used twice).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::fmt;
use std::hash::BuildHasherDefault;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::atomic::Ordering;

use rustix::fs::{Mode, OFlags};

use super::filestore::BLOCK;
use super::{Body, Ino, MemoryUpper, Meta, Node, ROOT, WORK, is_root};
use crate::error::Result;
use crate::sys;

/// The image's name in the upper directory.
pub const IMAGE_NAME: &str = ".mosaicfs-tree";
const IMAGE_NEW: &str = ".mosaicfs-tree.new";
pub const MAGIC: &[u8; 8] = b"MOSAICTR";
const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 4 + 8 + 8 + 8 + 8 + 4;

pub(super) const KIND_DIR: u8 = 1;
pub(super) const KIND_FILE: u8 = 2;
pub(super) const KIND_SYMLINK: u8 = 3;
pub(super) const KIND_SPECIAL: u8 = 4;
/// Blocks in a file of the largest size (`i64::MAX` bytes): no extent of a sound image ends later.
const MAX_FILE_BLOCKS: u64 = (i64::MAX as u64).div_ceil(BLOCK);

/// Why a layer could not be loaded.
#[derive(Debug)]
pub enum ImageError {
    /// The image is damaged or not one mosaicfs writes.
    Damaged(String),
    /// Reading the image or the filestore failed.
    Io(crate::error::Error),
    /// The change log a daemon before kept cannot be applied (memory_upper/changes.rs): the
    /// tree it describes is lost, the layer on disk is as of its last commit.
    ChangeLog(String),
}

impl ImageError {
    pub fn io(e: impl Into<crate::error::Error>) -> ImageError {
        ImageError::Io(e.into())
    }
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageError::Damaged(why) => write!(f, "the tree image {IMAGE_NAME} is damaged: {why}"),
            ImageError::Io(e) => write!(f, "{e}"),
            ImageError::ChangeLog(why) => {
                write!(
                    f,
                    "the changes the daemon before made cannot be rebuilt: {why}"
                )
            }
        }
    }
}

pub(super) fn damaged<T>(why: impl Into<String>) -> std::result::Result<T, ImageError> {
    Err(ImageError::Damaged(why.into()))
}

pub(super) struct ImageNode {
    pub ino: Ino,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u64,
    pub rdev: u64,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    pub xattrs: BTreeMap<OsString, Vec<u8>>,
    pub body: ImageBody,
}

pub(super) enum ImageBody {
    Dir {
        parent: Ino,
        entries: BTreeMap<OsString, Ino>,
    },
    File {
        size: u64,
        extents: BTreeMap<u64, u64>,
    },
    Symlink(OsString),
    Special,
}

/// The image of `up`. The caller holds every quiesce shard: nothing changes meanwhile. Every
/// extent written out is frozen from now on.
pub(super) fn encode(up: &MemoryUpper, generation: u64) -> Vec<u8> {
    let mut nodes: Vec<_> = up
        .nodes
        .shards
        .iter()
        .flat_map(|s| s.read().unwrap().values().cloned().collect::<Vec<_>>())
        .collect();
    nodes.sort_by_key(|n| n.ino);
    let mut body = Vec::new();
    for n in &nodes {
        encode_node(n, &mut body);
    }
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    put_u32(&mut out, VERSION);
    put_u32(&mut out, BLOCK as u32);
    put_u64(&mut out, generation);
    put_u64(&mut out, nodes.len() as u64);
    put_u64(&mut out, up.next_ino.load(Ordering::Relaxed));
    put_u64(&mut out, body.len() as u64);
    put_u32(&mut out, crc(&body));
    out.extend_from_slice(&body);
    out
}

/// Appends the record of node `n` to `body`; its extents are frozen from now on (the record
/// is about to be written). The caller holds every quiesce shard.
pub(super) fn encode_node(n: &Node, body: &mut Vec<u8>) {
    let m = n.meta.lock().unwrap().clone();
    put_attrs(n, &m, body);
    match &n.body {
        Body::Dir(d, parent) => {
            let d = d.read().unwrap();
            put_u64(body, parent.load(Ordering::Relaxed));
            put_u32(body, d.entries.len() as u32);
            for (name, &ino) in &d.entries {
                put_bytes(body, name.as_bytes());
                put_u64(body, ino);
            }
        }
        Body::File(f) => {
            let mut f = f.write().unwrap();
            put_u64(body, f.size());
            // Runs of neighbouring blocks mapped to neighbouring filestore blocks.
            let mut runs: Vec<(u64, u64, u64)> = Vec::new();
            for (k, b) in f.freeze() {
                match runs.last_mut() {
                    Some((k0, b0, n)) if *k0 + *n == k && *b0 + *n == b => *n += 1,
                    _ => runs.push((k, b, 1)),
                }
            }
            put_u32(body, runs.len() as u32);
            for (k, b, n) in runs {
                put_u64(body, k);
                put_u64(body, b);
                put_u64(body, n);
            }
        }
        Body::Symlink(t) => put_bytes(body, t.as_bytes()),
        Body::Special => {}
    }
}

/// The first part of a node's record, which the image and the change log (changes.rs) share:
/// its number, its kind and its attributes `m`.
pub(super) fn put_attrs(n: &Node, m: &Meta, out: &mut Vec<u8>) {
    put_u64(out, n.ino);
    out.push(match &n.body {
        Body::Dir(..) => KIND_DIR,
        Body::File(_) => KIND_FILE,
        Body::Symlink(_) => KIND_SYMLINK,
        Body::Special => KIND_SPECIAL,
    });
    for v in [m.mode, m.uid, m.gid] {
        put_u32(out, v);
    }
    put_u64(out, m.nlink);
    put_u64(out, m.rdev);
    for (s, ns) in [m.atime, m.mtime, m.ctime] {
        put_u64(out, s as u64);
        put_u32(out, ns);
    }
    put_u32(out, m.xattrs.len() as u32);
    for (k, v) in &m.xattrs {
        put_bytes(out, k.as_bytes());
        put_bytes(out, v);
    }
}

/// A node's number, kind and attributes as `put_attrs` wrote them, its mode checked against
/// its kind; its body is read next.
pub(super) struct Attrs {
    pub ino: Ino,
    pub kind: u8,
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u64,
    rdev: u64,
    times: [(i64, u32); 3],
    xattrs: BTreeMap<OsString, Vec<u8>>,
}

pub(super) fn read_attrs(r: &mut Reader<'_>) -> std::result::Result<Attrs, ImageError> {
    let ino = r.u64()?;
    let kind = r.u8()?;
    let (mode, uid, gid) = (r.u32()?, r.u32()?, r.u32()?);
    let (nlink, rdev) = (r.u64()?, r.u64()?);
    let mut times = [(0i64, 0u32); 3];
    for t in &mut times {
        *t = (r.u64()? as i64, r.u32()?);
    }
    let mut xattrs = BTreeMap::new();
    for _ in 0..r.u32()? {
        let k = OsString::from_vec(r.bytes()?.to_vec());
        xattrs.insert(k, r.bytes()?.to_vec());
    }
    let want_type = match kind {
        KIND_DIR => libc::S_IFDIR,
        KIND_FILE => libc::S_IFREG,
        KIND_SYMLINK => libc::S_IFLNK,
        KIND_SPECIAL => mode & libc::S_IFMT,
        _ => return damaged(format!("node {ino} has unknown kind {kind}")),
    };
    let special = [libc::S_IFCHR, libc::S_IFBLK, libc::S_IFIFO, libc::S_IFSOCK];
    if mode & libc::S_IFMT != want_type || (kind == KIND_SPECIAL && !special.contains(&want_type)) {
        return damaged(format!("node {ino}: mode {mode:o} does not fit its kind"));
    }
    Ok(Attrs {
        ino,
        kind,
        mode,
        uid,
        gid,
        nlink,
        rdev,
        times,
        xattrs,
    })
}

impl Attrs {
    pub fn with_body(self, body: ImageBody) -> ImageNode {
        let [atime, mtime, ctime] = self.times;
        ImageNode {
            ino: self.ino,
            mode: self.mode,
            uid: self.uid,
            gid: self.gid,
            nlink: self.nlink,
            rdev: self.rdev,
            atime,
            mtime,
            ctime,
            xattrs: self.xattrs,
            body,
        }
    }
}

/// Writes `bytes` as the image in `dir`, durably and atomically.
pub(super) fn write(dir: &OwnedFd, bytes: &[u8]) -> Result<()> {
    let flags =
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let fd = sys::openat(dir, IMAGE_NEW, flags, Mode::from_raw_mode(0o600))?;
    sys::pwrite_full(fd.as_fd(), bytes, 0)?;
    sys::fsync(&fd)?;
    let (new, name) = (
        std::ffi::OsStr::new(IMAGE_NEW),
        std::ffi::OsStr::new(IMAGE_NAME),
    );
    sys::rename_at(
        dir.as_fd(),
        new,
        dir.as_fd(),
        name,
        rustix::fs::RenameFlags::empty(),
    )?;
    sys::fsync(dir)?;
    Ok(())
}

/// The image in `dir`, or `None` if there is none.
pub(super) fn read(dir: &OwnedFd) -> Result<Option<Vec<u8>>> {
    let flags = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let fd = match rustix::fs::openat(dir, IMAGE_NAME, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let len = rustix::fs::fstat(&fd)?.st_size as usize;
    let mut buf = vec![0u8; len];
    let got = sys::pread_full(fd.as_fd(), &mut buf, 0)?;
    buf.truncate(got);
    Ok(Some(buf))
}

/// An image as written, not yet checked as a tree.
pub(super) struct Image {
    pub generation: u64,
    pub next_ino: Ino,
    pub nodes: Vec<ImageNode>,
}

pub(super) fn decode_image(
    bytes: &[u8],
    store_blocks: u64,
) -> std::result::Result<Image, ImageError> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return damaged("it does not start with mosaicfs' header");
    }
    let mut h = Reader {
        b: &bytes[8..HEADER],
    };
    let version = h.u32()?;
    if version != VERSION {
        return damaged(format!(
            "version {version}, and this mosaicfs reads version {VERSION} (use the mosaicfs that wrote it)"
        ));
    }
    let block = h.u32()?;
    if u64::from(block) != BLOCK {
        return damaged(format!("block size {block}, not {BLOCK}"));
    }
    let generation = h.u64()?;
    let count = h.u64()?;
    let next_ino = h.u64()?;
    let body_len = h.u64()?;
    let sum = h.u32()?;
    let body = &bytes[HEADER..];
    if body.len() as u64 != body_len {
        return damaged(format!(
            "{} bytes of a {body_len}-byte body (a torn write?)",
            body.len()
        ));
    }
    if crc(body) != sum {
        return damaged("its checksum does not match");
    }
    let mut r = Reader { b: body };
    let nodes = read_nodes(&mut r, count, store_blocks)?;
    if !r.b.is_empty() {
        return damaged("bytes after the last node");
    }
    Ok(Image {
        generation,
        next_ino,
        nodes,
    })
}

/// `count` node records from `r`.
/// `count` nodes, which map at most `store_blocks` blocks together: in one consistent tree no
/// two file blocks share a filestore block (`check_tree`), so more is a forgery, refused before
/// its extents are expanded (an extent of 2^30 blocks is 24 bytes of image and would take
/// tens of GiB of map; found by fuzzing).
pub(super) fn read_nodes(
    r: &mut Reader<'_>,
    count: u64,
    store_blocks: u64,
) -> std::result::Result<Vec<ImageNode>, ImageError> {
    let mut nodes = Vec::new();
    let mut budget = store_blocks;
    for _ in 0..count {
        nodes.push(read_node(r, &mut budget)?);
    }
    Ok(nodes)
}

fn read_node(r: &mut Reader<'_>, budget: &mut u64) -> std::result::Result<ImageNode, ImageError> {
    let attrs = read_attrs(r)?;
    let (ino, kind) = (attrs.ino, attrs.kind);
    let body = match kind {
        KIND_DIR => {
            let parent = r.u64()?;
            let mut entries = BTreeMap::new();
            for _ in 0..r.u32()? {
                let name = OsString::from_vec(r.bytes()?.to_vec());
                if super::check_name(&name).is_err() {
                    return damaged(format!("directory {ino} holds the name {name:?}"));
                }
                if entries.insert(name, r.u64()?).is_some() {
                    return damaged(format!("directory {ino} holds a name twice"));
                }
            }
            ImageBody::Dir { parent, entries }
        }
        KIND_FILE => {
            let size = r.u64()?;
            let mut extents = BTreeMap::new();
            for _ in 0..r.u32()? {
                let (k, b, n) = (r.u64()?, r.u64()?, r.u64()?);
                // Blocks past the end are legitimate: fallocate(FALLOC_FL_KEEP_SIZE) reserves
                // them (zeroed) without changing the size. None lies past the largest size, in
                // the file or in the filestore (a file too).
                let past = |first: u64| first.checked_add(n).is_none_or(|e| e > MAX_FILE_BLOCKS);
                if n == 0 || past(k) || past(b) {
                    return damaged(format!("file {ino} maps blocks past the largest file size"));
                }
                *budget = budget.checked_sub(n).ok_or_else(|| {
                    ImageError::Damaged(format!(
                        "file {ino} maps more blocks than the filestore holds: the filestore is \
                         not the one this image was written with, or the image is forged"
                    ))
                })?;
                for i in 0..n {
                    if extents.insert(k + i, b + i).is_some() {
                        return damaged(format!("file {ino} maps a block twice"));
                    }
                }
            }
            ImageBody::File { size, extents }
        }
        KIND_SYMLINK => ImageBody::Symlink(OsString::from_vec(r.bytes()?.to_vec())),
        _ => ImageBody::Special,
    };
    Ok(attrs.with_body(body))
}

/// The nodes form two trees, from `ROOT` and from `WORK`, with link counts that match their names,
/// and no filestore block is used twice or lies past the filestore's end. Returns the used blocks.
pub(super) fn check_tree(
    nodes: &[ImageNode],
    next_ino: Ino,
    store_len: u64,
) -> std::result::Result<Vec<u64>, ImageError> {
    let by_ino: NumberMap<&ImageNode> = nodes.iter().map(|n| (n.ino, n)).collect();
    if by_ino.len() != nodes.len() {
        return damaged("two nodes have one number");
    }
    for root in [ROOT, WORK] {
        match by_ino.get(&root) {
            Some(n) if matches!(n.body, ImageBody::Dir { .. }) => {}
            _ => return damaged(format!("it has no root directory {root}")),
        }
    }
    let mut names: NumberMap<u64> = NumberMap::default();
    let mut subdirs: NumberMap<u64> = NumberMap::default();
    for n in nodes {
        if n.ino >= next_ino || n.ino < ROOT {
            return damaged(format!("node {} is numbered outside 1..{next_ino}", n.ino));
        }
        if let ImageBody::Dir { entries, .. } = &n.body {
            for (name, ino) in entries {
                let Some(child) = by_ino.get(ino) else {
                    return damaged(format!("{name:?} in directory {} names no node", n.ino));
                };
                *names.entry(*ino).or_default() += 1;
                if let ImageBody::Dir { parent, .. } = child.body {
                    if parent != n.ino {
                        return damaged(format!("directory {ino}'s parent is not {}", n.ino));
                    }
                    *subdirs.entry(n.ino).or_default() += 1;
                }
            }
        }
    }
    for n in nodes {
        let refs = names.get(&n.ino).copied().unwrap_or(0);
        let (want_refs, want_nlink) = match n.body {
            ImageBody::Dir { .. } => (
                u64::from(!is_root(n.ino)),
                2 + subdirs.get(&n.ino).copied().unwrap_or(0),
            ),
            _ => (refs.max(1), refs),
        };
        if refs != want_refs || n.nlink != want_nlink {
            return damaged(format!(
                "node {} has {} names and link count {}",
                n.ino, refs, n.nlink
            ));
        }
    }
    // Every node reachable from a root (no loop of directories hanging off nothing).
    let mut seen: HashSet<Ino, BuildHasherDefault<NumberHasher>> =
        [ROOT, WORK].into_iter().collect();
    let mut todo = vec![ROOT, WORK];
    while let Some(ino) = todo.pop() {
        if let ImageBody::Dir { entries, .. } = &by_ino[&ino].body {
            for child in entries.values() {
                if seen.insert(*child) {
                    todo.push(*child);
                }
            }
        }
    }
    if seen.len() != nodes.len() {
        return damaged("some nodes cannot be reached from the roots");
    }
    let used = blocks_of(nodes);
    if used.windows(2).any(|w| w[0] == w[1]) {
        return damaged("two files share a filestore block");
    }
    if used.last().is_some_and(|&b| (b + 1) * BLOCK > store_len) {
        return damaged(format!(
            "it refers to data past the filestore's end ({store_len} bytes): the filestore is not the one this image was written with"
        ));
    }
    Ok(used)
}

/// The filestore blocks `nodes` map, sorted.
pub(super) fn blocks_of(nodes: &[ImageNode]) -> Vec<u64> {
    let mut used = Vec::new();
    for n in nodes {
        if let ImageBody::File { extents, .. } = &n.body {
            used.extend(extents.values().copied());
        }
    }
    used.sort_unstable();
    used
}

/// A map keyed by node numbers, hashed by one multiplication: a tree check of 100,000 nodes
/// spent half its time in SipHash, which guards against keys chosen to collide — and a forged
/// image's numbers collide at worst into slower buckets of a check that then refuses it.
type NumberMap<V> = HashMap<Ino, V, BuildHasherDefault<NumberHasher>>;

#[derive(Default)]
struct NumberHasher(u64);

impl std::hash::Hasher for NumberHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(super) struct Reader<'a> {
    pub b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], ImageError> {
        if self.b.len() < n {
            return damaged("it ends in the middle of a node");
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> std::result::Result<u8, ImageError> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> std::result::Result<u32, ImageError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> std::result::Result<u64, ImageError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// A length (u32) and that many bytes.
    pub fn bytes(&mut self) -> std::result::Result<&'a [u8], ImageError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

pub(super) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u32(out, b.len() as u32);
    out.extend_from_slice(b);
}

/// Checks an image as a mount would load it, against the filestore `store` it maps: the
/// memory upper's tree invariant (`check_tree`), asserted at each image in the test build.
#[cfg(debug_assertions)]
pub(super) fn check_encoded(
    bytes: &[u8],
    store: std::os::fd::BorrowedFd<'_>,
) -> std::result::Result<(), ImageError> {
    let store_len = rustix::fs::fstat(store).map_err(ImageError::io)?.st_size as u64;
    let image = decode_image(bytes, store_len / BLOCK)?;
    check_tree(&image.nodes, image.next_ino, store_len).map(|_| ())
}

/// Makes the header of `image` name its body's length and checksum: a forged image that the
/// checksum no longer stops, so that a fuzzer reaches the decoder behind it
/// (`crate::fuzzing`; journal.rs `fit_checksums` does the same for a journal).
pub fn fit_checksums(image: &mut [u8]) {
    if image.len() >= HEADER {
        let (head, body) = image.split_at_mut(HEADER);
        head[40..48].copy_from_slice(&(body.len() as u64).to_le_bytes());
        head[48..52].copy_from_slice(&crc(body).to_le_bytes());
    }
}

pub(super) fn crc(b: &[u8]) -> u32 {
    let mut c = flate2::Crc::new();
    c.update(b);
    c.sum()
}
