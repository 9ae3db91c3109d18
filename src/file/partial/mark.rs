//! Partial files: upper-layer files that hold only some blocks of a lower file.
//!
//! A partial file is a sparse upper regular file of the file's full logical size, marked by the
//! `mosaicfs.partial` xattr (format in docs/FORMAT.md). Which blocks it holds is the allocation
//! map of the upper file (SEEK_DATA/SEEK_HOLE), cached here as a `BlockMap`.
//!
//! The invariant everything else relies on: **only whole, final blocks are ever written to a
//! partial file** below `valid` (the length of the lower prefix that is still the file's
//! content). So after a crash an allocated block always holds correct data, and a hole always
//! means "read the lower file" (below `valid`) or "zeros" (at or past `valid`). Blocks wholly at
//! or past `valid` may be written partially: zeros are their content either way.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::layers::{LayerId, XattrNames};
use crate::sys::{self, Attr};
use crate::upper::UpperFile;

/// What a partial file patches: the mark stored in its xattr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialMark {
    /// The lower layer holding the original file.
    pub layer: LayerId,
    /// Path of the original file, relative to that layer's root.
    pub path: PathBuf,
    /// Bytes `0..valid` not present in the upper file read from the lower file.
    pub valid: u64,
    /// Fingerprint of the lower file when the partial file was made: a changed lower is refused.
    pub lower_size: u64,
    pub lower_mtime: (i64, u32),
    /// The block size the file was written in: holes and allocated ranges mean something only
    /// at this grain. `None` for a v1 mark, made in the block size of its mount (4 KiB, or the
    /// upper file system's allocation grain if larger), which reads it in its own.
    pub block: Option<u64>,
}

/// What kernel overlayfs would do with a partial file if it were handed the layer (a user who
/// drops `mount_program`, or mounts the layers with `mount -t overlay`): read its holes as
/// zeros, silently. So every partial file also carries kernel overlayfs' metacopy xattr, which
/// it refuses to follow (EPERM) unless mounted with `metacopy=on`, and then finds its data
/// through the redirect, a path no layer can hold (its one component is longer than NAME_MAX),
/// and fails the lookup (EIO). Under `userxattr` metacopy is never allowed: EPERM. Rootless
/// daemons can set only the `user.` form. docs/FORMAT.md, "The guard of a partial file".
const GUARD_REDIRECT: &[u8] = b"/mosaicfs-partial-file.this-layer-holds-files-that-only-mosaicfs-\
reads.run-mosaicfs-complete-on-it-before-mounting-it-with-another-overlay.a-name-longer-than-name\
-max-so-that-no-layer-can-hold-it.a-name-longer-than-name-max-so-that-no-layer-can-hold-it.a-name\
-longer-than-name-max-so-that-no-layer-can-hold-it.end";

/// The guard's xattrs for a layer written with `names`, each with its value.
pub fn guard(names: &XattrNames) -> &'static [(&'static str, &'static [u8])] {
    if names.prefix == "trusted." {
        &[
            ("trusted.overlay.metacopy", b""),
            ("user.overlay.metacopy", b""),
            // Last: what tells this guard from a kernel overlayfs metacopy file's xattrs.
            ("trusted.overlay.redirect", GUARD_REDIRECT),
        ]
    } else {
        &[("user.overlay.metacopy", b"")]
    }
}

/// What fuse-overlayfs 1.10 (Debian 12's, and what containers/storage falls back to) would do
/// with a partial file: read its holes as zeros, as kernel overlayfs would, and it follows no
/// metacopy xattr. What it does not survive is an opaque xattr it cannot read: it asks for
/// `user.fuseoverlayfs.opaque` of every layer's root at mount with a 16-byte buffer, and any
/// error but "no such xattr" fails the mount ("cannot read upper dir", ERANGE), whether the
/// layer is its upper or a lower one. So an upper layer holding partial files carries this
/// value on its root: longer than 16 bytes, and not starting with `y` (mosaicfs and
/// fuse-overlayfs 2.0 read opaque xattrs by their first byte only, kernel overlayfs never reads
/// `user.fuseoverlayfs.*`). Set before the first mark of a mount, removed by `mosaicfs
/// complete` once no partial file is left. docs/FORMAT.md, "The guard of a partial file".
pub const LAYER_GUARD: (&str, &[u8]) = (
    "user.fuseoverlayfs.opaque",
    b"mosaicfs: this layer holds partial files that only mosaicfs reads; run 'mosaicfs complete' \
on it before mounting it with another overlay",
);

/// Whether the upper layer's root `root` carries `LAYER_GUARD`.
pub fn layer_guarded(root: &crate::upper::UpperDir) -> bool {
    let (key, value) = LAYER_GUARD;
    root.view()
        .get_xattr(None, key)
        .ok()
        .flatten()
        .is_some_and(|v| v == value)
}

/// Sets `LAYER_GUARD` on the upper layer's root `root`. A file system without `user.` xattrs
/// (or a root the mounting user does not own) cannot hold it: logged, not an error, since the
/// files' own guard still keeps kernel overlayfs out.
pub fn guard_layer(root: &crate::upper::UpperDir) -> Result<()> {
    let (key, value) = LAYER_GUARD;
    match root.set_xattr(None, std::ffi::OsStr::new(key), value, 0) {
        Err(e) if e.is(libc::EPERM) || e.is(libc::EOPNOTSUPP) || e.is(libc::EACCES) => {
            log::warn!(
                "the upper layer's root cannot hold {key} ({e}): fuse-overlayfs given this layer would read the holes of its partial files as zeros"
            );
            Ok(())
        }
        r => r,
    }
}

/// Removes `LAYER_GUARD` from the upper layer's root `root` (no partial file is left below it).
pub fn unguard_layer(root: &crate::upper::UpperDir) -> Result<()> {
    if !layer_guarded(root) {
        return Ok(());
    }
    match root.remove_xattr(None, std::ffi::OsStr::new(LAYER_GUARD.0)) {
        Err(e) if e.is(libc::ENODATA) => Ok(()),
        r => r,
    }
}

/// Marks are written in v2; v1 (no block size) is read.
const MARK_VERSION: &str = "v2";
const MARK_VERSIONS: [&str; 2] = ["v1", "v2"];
/// Block sizes a mark may carry: powers of two in this range.
const MARK_BLOCKS: std::ops::RangeInclusive<u64> = 512..=(64 << 20);

impl PartialMark {
    pub fn for_lower(layer: LayerId, path: PathBuf, lower: &Attr, block: u64) -> Self {
        PartialMark {
            layer,
            path,
            valid: lower.size,
            lower_size: lower.size,
            lower_mtime: lower.mtime,
            block: Some(block),
        }
    }

    /// The v2 text of the mark (v1 if its block size is unknown: a v1 mark not yet opened).
    pub fn encode(&self) -> Vec<u8> {
        let (version, block) = match self.block {
            Some(b) => (MARK_VERSION, format!("block={b}\n")),
            None => ("v1", String::new()),
        };
        let mut v = format!(
            "{version}\nlayer={}\nvalid={}\nsize={}\nmtime={}.{}\n{block}path=",
            self.layer, self.valid, self.lower_size, self.lower_mtime.0, self.lower_mtime.1
        )
        .into_bytes();
        v.extend_from_slice(self.path.as_os_str().as_bytes());
        v
    }

    /// The mark on the open file `file` (`key`: the mark's xattr name), whatever its length;
    /// `Ok(None)` without one, `Err` with the reason for one that does not parse (the caller
    /// names the file).
    pub fn load(
        file: &UpperFile,
        key: &str,
    ) -> Result<Option<std::result::Result<PartialMark, String>>> {
        match file.get_xattr(key)? {
            None => Ok(None),
            Some(raw) => Ok(Some(PartialMark::decode(&raw))),
        }
    }

    /// Writes the mark on the open file `file`, and the guard that makes other overlays refuse
    /// the file (`OTHER_OVERLAYS_GUARD`) before it: a mark never stands without its guard.
    pub fn store(&self, file: &UpperFile, names: &XattrNames) -> Result<()> {
        for (key, value) in guard(names) {
            match file.set_xattr(key, value, 0) {
                Ok(()) => {}
                // An upper file system without user xattrs: only the trusted guard stands.
                Err(e) if e.is(libc::EPERM) || e.is(libc::EOPNOTSUPP) => {
                    log::debug!("partial-file guard {key} not set: {e}");
                }
                Err(e) => return Err(e),
            }
        }
        file.set_xattr(&names.partial, &self.encode(), 0)
    }

    /// Removes the mark from `file`: the file is complete. The guard goes after the mark, so
    /// a crash in between leaves a complete file other overlays refuse, never a partial one
    /// they read.
    pub fn remove(file: &UpperFile, names: &XattrNames) -> Result<()> {
        file.remove_xattr(&names.partial)?;
        for (key, _) in guard(names) {
            match file.remove_xattr(key) {
                Err(e) if !(e.is(libc::ENODATA) || e.is(libc::EOPNOTSUPP)) => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// Parses a mark. Anything malformed is an error: a damaged mark must never be guessed at.
    pub fn decode(raw: &[u8]) -> std::result::Result<Self, String> {
        let path_at = find(raw, b"\npath=").ok_or("no path field")?;
        let (head, path) = (&raw[..path_at], &raw[path_at + 6..]);
        let head = std::str::from_utf8(head).map_err(|_| "header is not text")?;
        let mut lines = head.split('\n');
        let version = lines.next().unwrap_or_default();
        if !MARK_VERSIONS.contains(&version) {
            return Err(format!(
                "unknown format version '{version}' (this mosaicfs reads {})",
                MARK_VERSIONS.join(", ")
            ));
        }
        let (mut layer, mut valid, mut size, mut mtime, mut block) = (None, None, None, None, None);
        for line in lines {
            let (k, v) = line.split_once('=').ok_or("field without '='")?;
            match k {
                "block" if version != "v1" => {
                    let b = v.parse::<u64>().map_err(|_| "bad block size")?;
                    if !b.is_power_of_two() || !MARK_BLOCKS.contains(&b) {
                        return Err(format!("bad block size {b}"));
                    }
                    block = Some(b);
                }
                "layer" => layer = Some(v.parse::<LayerId>().map_err(|_| "bad layer")?),
                "valid" => valid = Some(v.parse::<u64>().map_err(|_| "bad valid")?),
                "size" => size = Some(v.parse::<u64>().map_err(|_| "bad size")?),
                "mtime" => {
                    let (s, n) = v.split_once('.').ok_or("bad mtime")?;
                    mtime = Some((
                        s.parse::<i64>().map_err(|_| "bad mtime")?,
                        n.parse::<u32>().map_err(|_| "bad mtime")?,
                    ));
                }
                _ => return Err(format!("unknown field '{k}'")),
            }
        }
        if path.is_empty()
            || path.starts_with(b"/")
            || path.split(|b| *b == b'/').any(|c| c == b"..")
        {
            return Err("bad lower path".into());
        }
        let mark = PartialMark {
            layer: layer.ok_or("no layer")?,
            valid: valid.ok_or("no valid length")?,
            lower_size: size.ok_or("no size")?,
            lower_mtime: mtime.ok_or("no mtime")?,
            path: PathBuf::from(OsString::from_vec(path.to_vec())),
            block,
        };
        if version != "v1" && block.is_none() {
            return Err("no block size".into());
        }
        if mark.layer == 0 || mark.valid > mark.lower_size {
            return Err("inconsistent fields".into());
        }
        Ok(mark)
    }

    /// Whether the lower file is still the one this mark was made from.
    pub fn matches(&self, lower: &Attr) -> bool {
        lower.is_reg() && lower.size == self.lower_size && lower.mtime == self.lower_mtime
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The set of blocks present in a partial file, as ranges `start..end` of block numbers.
#[derive(Debug, Default, Clone)]
pub struct BlockMap {
    ranges: BTreeMap<u64, u64>,
}

impl BlockMap {
    /// Reads the allocation map of `fd` (a file of `size` bytes) with SEEK_DATA/SEEK_HOLE.
    pub fn from_file(file: &UpperFile, size: u64, block: u64) -> Result<Self> {
        let mut map = BlockMap::default();
        let mut pos = 0;
        while pos < size {
            let Some(start) = file.seek_data(pos)? else {
                break;
            };
            if start >= size {
                break;
            }
            let end = file.seek_hole(start)?.min(size);
            map.insert(start / block, end.div_ceil(block));
            pos = end;
        }
        Ok(map)
    }

    pub fn contains(&self, blk: u64) -> bool {
        self.ranges
            .range(..=blk)
            .next_back()
            .is_some_and(|(_, end)| blk < *end)
    }

    /// Adds blocks `start..end`, merging with neighbours.
    pub fn insert(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        if let Some((&s, &e)) = self.ranges.range(..=start).next_back()
            && e >= start
        {
            start = s;
            end = end.max(e);
        }
        let overlapping: Vec<u64> = self.ranges.range(start..=end).map(|(s, _)| *s).collect();
        for s in overlapping {
            let e = self.ranges.remove(&s).unwrap();
            end = end.max(e);
        }
        self.ranges.insert(start, end);
        self.check_around(start);
    }

    /// The ranges next to the one at `start` neither overlap nor touch it (the test build
    /// checks it after each change; locally, so that a map of many ranges stays cheap).
    fn check_around(&self, start: u64) {
        if !cfg!(debug_assertions) {
            return;
        }
        let mut near = self
            .ranges
            .range(..start)
            .rev()
            .take(1)
            .chain(self.ranges.range(start..).take(2));
        let mut prev: Option<(u64, u64)> = None;
        for (&s, &e) in near.by_ref() {
            assert!(s < e, "block map: empty range {s}..{e}");
            if let Some((ps, pe)) = prev {
                assert!(
                    pe < s,
                    "block map: {ps}..{pe} and {s}..{e} overlap or touch"
                );
            }
            prev = Some((s, e));
        }
    }

    /// Removes every block at or after `from`.
    pub fn truncate(&mut self, from: u64) {
        let tail: Vec<u64> = self.ranges.range(from..).map(|(s, _)| *s).collect();
        for s in tail {
            self.ranges.remove(&s);
        }
        if let Some((_, e)) = self.ranges.range_mut(..from).next_back()
            && *e > from
        {
            *e = from;
        }
        self.check_around(from);
    }

    /// Present ranges overlapping blocks `start..end`, clipped to it.
    pub fn present_in(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if let Some((_, &e)) = self.ranges.range(..start).next_back()
            && e > start
        {
            out.push((start, e.min(end)));
        }
        for (&s, &e) in self.ranges.range(start..end) {
            out.push((s, e.min(end)));
        }
        out
    }

    /// The present range holding block `blk`, if any.
    pub fn range_of(&self, blk: u64) -> Option<(u64, u64)> {
        self.ranges
            .range(..=blk)
            .next_back()
            .filter(|(_, e)| blk < **e)
            .map(|(s, e)| (*s, *e))
    }

    /// The first present block at or after `blk`.
    pub fn next_present(&self, blk: u64) -> Option<u64> {
        if self.contains(blk) {
            return Some(blk);
        }
        self.ranges.range(blk..).next().map(|(s, _)| *s)
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    pub fn block_count(&self) -> u64 {
        self.ranges.iter().map(|(s, e)| e - s).sum()
    }
}

/// What the upper file system can do with sparse files, measured once at mount.
#[derive(Debug, Clone, Copy)]
pub struct SparseSupport {
    /// The block size partial files use: at least 4 KiB and at least the file system's
    /// allocation granularity, so that writing one block never allocates a neighbour.
    pub block: u64,
    pub sparse: bool,
}

/// Writes one block into the middle of a sparse probe file and checks that exactly that block
/// reads back as data. A file system that allocates at a coarser grain gets a larger block size;
/// one that does not report holes at all is reported as not sparse.
pub fn probe_sparse(work: BorrowedFd<'_>) -> Result<SparseSupport> {
    let probe = ProbeFile::create(work, "probe-sparse")?;
    let fd = &probe.fd;
    let grain = sys::fstat(fd.as_fd())?.blksize.max(4096) as u64;
    let size = 64 * 1024 * 1024u64;
    crate::sys::ftruncate(fd, size)?;
    let mut block = grain;
    while block <= 2 * 1024 * 1024 {
        let at = size / 2;
        sys::pwrite_full(fd.as_fd(), &vec![0xa5u8; block as usize], at)?;
        let start = sys::seek_data(fd.as_fd(), 0)?;
        let end = sys::seek_hole(fd.as_fd(), at)?;
        if start == Some(size) || start.is_none() {
            // Data written but not reported: SEEK_DATA does not work here.
            return Ok(SparseSupport {
                block: grain,
                sparse: false,
            });
        }
        if start == Some(0) && end == size {
            return Ok(SparseSupport {
                block: grain,
                sparse: false,
            });
        }
        if start == Some(at) && end == at + block {
            return Ok(SparseSupport {
                block,
                sparse: true,
            });
        }
        crate::sys::ftruncate(fd, 0)?;
        crate::sys::ftruncate(fd, size)?;
        block *= 2;
    }
    Err(Error::with_context(
        libc::EOPNOTSUPP,
        "sparse probe found no usable block size",
    ))
}

/// An empty file in the work directory, unlinked when dropped. It keeps its name while it is
/// probed: some FUSE upper file systems (fuse-overlayfs) serve attribute requests of an open
/// file by path and answer ENOENT once it is unlinked. A probe left by a crash is truncated and
/// reused by the next mount's.
struct ProbeFile<'a> {
    fd: rustix::fd::OwnedFd,
    work: BorrowedFd<'a>,
    name: &'static std::ffi::OsStr,
}

impl<'a> ProbeFile<'a> {
    fn create(work: BorrowedFd<'a>, name: &'static str) -> Result<Self> {
        use rustix::fs::{Mode, OFlags};
        let name = std::ffi::OsStr::new(name);
        let fd = crate::sys::openat(
            work,
            name,
            OFlags::CREATE | OFlags::TRUNC | OFlags::RDWR | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        Ok(ProbeFile { fd, work, name })
    }
}

impl Drop for ProbeFile<'_> {
    fn drop(&mut self) {
        let _ = crate::sys::unlinkat(self.work, self.name, rustix::fs::AtFlags::empty());
    }
}

/// Whether the upper file system clones extents (FICLONE): XFS with reflink, btrfs. Whether a
/// given lower layer's files can be cloned into it is found at the first copy-up.
/// File systems that never clone (ext2/3/4, tmpfs) are told by their type, without the two
/// probe files: each would cost an inode at every mount.
pub fn probe_reflink(work: BorrowedFd<'_>) -> bool {
    const EXT4_SUPER_MAGIC: i64 = 0xef53;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    // `f_type`'s type differs between architectures.
    #[allow(clippy::unnecessary_cast)]
    let never_clones = rustix::fs::fstatfs(work)
        .is_ok_and(|st| [EXT4_SUPER_MAGIC, TMPFS_MAGIC].contains(&(st.f_type as i64)));
    if never_clones {
        return false;
    }
    let (Ok(src), Ok(dst)) = (
        ProbeFile::create(work, "probe-reflink-src"),
        ProbeFile::create(work, "probe-reflink-dst"),
    ) else {
        return false;
    };
    sys::pwrite_full(src.fd.as_fd(), &[0x5a; 4096], 0).is_ok()
        && crate::sys::ioctl_ficlone(&dst.fd, &src.fd).is_ok()
}

/// Fuzzing (proptest, a few hundred cases per run of the suite; `PROPTEST_CASES=100000 cargo
/// test --release --lib fuzz` for a long run): the mark decoder on hostile bytes, and the block
/// map against a model.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn mark() -> impl Strategy<Value = PartialMark> {
        (
            1..=u16::MAX,
            proptest::collection::vec(any::<u8>(), 1..300),
            any::<u64>(),
            any::<u64>(),
            any::<i64>(),
            0..1_000_000_000u32,
            proptest::option::of(9..=26u32),
        )
            .prop_filter_map(
                "a lower path mosaicfs would write",
                |(layer, path, a, b, s, ns, bits)| {
                    let path: Vec<u8> = path
                        .into_iter()
                        .map(|c| if c == 0 { b'x' } else { c })
                        .collect();
                    let ok = path[0] != b'/' && !path.split(|c| *c == b'/').any(|c| c == b"..");
                    ok.then(|| PartialMark {
                        layer: layer as LayerId,
                        path: PathBuf::from(OsString::from_vec(path)),
                        valid: a.min(b),
                        lower_size: a.max(b),
                        lower_mtime: (s, ns),
                        block: bits.map(|b| 1u64 << b),
                    })
                },
            )
    }

    proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = PartialMark::decode(&raw);
        }

        #[test]
        fn a_damaged_mark_is_refused_or_read_whole(
            m in mark(), at in any::<prop::sample::Index>(), byte in any::<u8>()
        ) {
            let mut raw = m.encode();
            prop_assert_eq!(PartialMark::decode(&raw).unwrap(), m.clone());
            let i = at.index(raw.len());
            raw[i] = byte;
            // A damaged header is refused or still names a whole mark; never a guess.
            if let Ok(d) = PartialMark::decode(&raw) {
                prop_assert!(d.valid <= d.lower_size && d.layer != 0);
            }
        }

        #[test]
        fn the_block_map_agrees_with_a_set_of_blocks(
            ops in proptest::collection::vec((any::<bool>(), 0..200u64, 0..40u64), 1..60),
            probe in 0..260u64,
        ) {
            let mut map = BlockMap::default();
            let mut model = BTreeSet::new();
            for (insert, start, len) in ops {
                if insert {
                    map.insert(start, start + len);
                    model.extend(start..start + len);
                } else {
                    map.truncate(start);
                    model.retain(|b| *b < start);
                }
            }
            prop_assert_eq!(map.block_count(), model.len() as u64);
            for b in 0..260 {
                prop_assert_eq!(map.contains(b), model.contains(&b));
            }
            prop_assert_eq!(map.next_present(probe), model.range(probe..).next().copied());
            let clipped: u64 = map.present_in(probe, probe + 17).iter().map(|(s, e)| e - s).sum();
            prop_assert_eq!(clipped, model.range(probe..probe + 17).count() as u64);
            if let Some((s, e)) = map.range_of(probe) {
                prop_assert!((s..e).all(|b| model.contains(&b)) && s <= probe && probe < e);
                prop_assert!(s == 0 || !model.contains(&(s - 1)));
                prop_assert!(!model.contains(&e));
            } else {
                prop_assert!(!model.contains(&probe));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_redirect_names_a_path_no_layer_can_hold() {
        let path = GUARD_REDIRECT.strip_prefix(b"/").expect("absolute");
        assert!(!path.contains(&b'/'), "one component");
        assert!(path.len() > 255, "longer than NAME_MAX");
        assert!(
            guard(&XattrNames::new(false))
                .iter()
                .all(|(k, _)| k.starts_with("user."))
        );
    }

    #[test]
    fn mark_round_trips() {
        let m = PartialMark {
            layer: 2,
            path: PathBuf::from("usr/lib/x y\nz"),
            valid: 100,
            lower_size: 4096,
            lower_mtime: (1700000000, 123),
            block: Some(65536),
        };
        assert_eq!(PartialMark::decode(&m.encode()).unwrap(), m);
        assert!(m.encode().starts_with(b"v2\n"));
        // v1, as mosaicfs wrote marks before the block size was stored.
        let v1 = PartialMark::decode(b"v1\nlayer=2\nvalid=100\nsize=4096\nmtime=1.5\npath=a/b");
        assert_eq!(v1.unwrap().block, None);
    }

    #[test]
    fn damaged_marks_are_refused() {
        let good = PartialMark {
            layer: 1,
            path: PathBuf::from("a"),
            valid: 1,
            lower_size: 1,
            lower_mtime: (1, 1),
            block: Some(4096),
        }
        .encode();
        let head = "layer=1\nvalid=1\nsize=1\nmtime=1.1";
        for bad in [
            "",
            "block=0\n",
            "block=3000\n",
            "block=1\n",
            "block=x\n",
            "block=4096\nblock=\n",
        ] {
            let raw = format!("v2\n{head}\n{bad}path=a");
            assert!(PartialMark::decode(raw.as_bytes()).is_err(), "{raw:?}");
        }
        // A v1 mark never carried a block size: one there is damage.
        assert!(PartialMark::decode(format!("v1\n{head}\nblock=4096\npath=a").as_bytes()).is_err());
        assert!(PartialMark::decode(&good[..good.len() - 3]).is_err());
        assert!(PartialMark::decode(b"v9\nlayer=1\npath=a").is_err());
        assert!(PartialMark::decode(b"v1\nlayer=1\nvalid=5\nsize=1\nmtime=1.1\npath=a").is_err());
        assert!(
            PartialMark::decode(b"v1\nlayer=1\nvalid=1\nsize=1\nmtime=1.1\npath=../etc").is_err()
        );
        assert!(PartialMark::decode(b"garbage").is_err());
    }

    #[test]
    fn block_map_merges_and_truncates() {
        let mut m = BlockMap::default();
        m.insert(0, 2);
        m.insert(5, 7);
        m.insert(2, 5);
        assert_eq!(m.present_in(0, 100), vec![(0, 7)]);
        m.insert(10, 12);
        assert!(m.contains(11) && !m.contains(8) && m.contains(6));
        m.truncate(6);
        assert_eq!(m.present_in(0, 100), vec![(0, 6)]);
        assert_eq!(m.present_in(3, 4), vec![(3, 4)]);
        assert_eq!(m.block_count(), 6);
    }
}
