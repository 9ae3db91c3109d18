//! `mosaicfs export`: the upper layer as an OCI image layer (a tar stream).
//!
//! The export reads the layer through an `Overlay` — the live mount's own (over its control
//! socket) or one opened read-only on unmounted dirs — so it writes what the merged view
//! shows: partial files whole, metadata-only copy-ups with their new owner and mode, and a
//! directory renamed from a lower layer (a redirect, which no tar can express) as an opaque
//! directory holding the whole tree the merged view shows below it.
//!
//! Which entries: as kernel overlayfs' upper dir would give them to containers/storage — every
//! object of the upper layer, a `.wh.NAME` file per whiteout, a `.wh..wh..opq` file in each
//! opaque directory. The walk visits the upper layer only (lower layers are read where an
//! upper entry needs them), in name order, so the same layer always gives the same stream.
//! Data is streamed a megabyte at a time; memory grows with the number of entries exported,
//! never with file sizes. Files with holes become sparse entries.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::Arc;

use crate::error::{Error, Result as FsResult};
use crate::file::OpenFile;
use crate::inode::{Ino, Node, ROOT_INO};
use crate::layers::{
    LayerStack, OPAQUE_WHITEOUT, WHITEOUT_PREFIX, WORK_SUBDIR, WorkLock, lock_work_dir,
};
use crate::options::{Compression, ExportArgs, ExportFrom, Options};
use crate::overlay::{Config, Overlay};
use crate::sys::Attr;
use crate::tar::{Entry, Kind, TarWriter};

/// How much of a file one read takes.
const CHUNK: u64 = 1 << 20;

enum Item {
    /// An object of the merged view; the walk holds one reference to its inode.
    Object(Arc<Node>),
    /// A whiteout hiding this name; the entry's path ends in `.wh.NAME`.
    Whiteout,
    /// The opaque marker of the directory this is the path of.
    Opaque,
    /// A lower name of a copied-up hard link (`plan_lower_links`), after the copy's entry.
    LowerLink(Arc<Node>),
}

/// What to export, in archive order: found by `plan`, written by `write`.
pub struct Plan<'a> {
    ov: &'a Overlay,
    items: Vec<(Vec<u8>, Item)>,
    /// Nodes looked up on the way to others, one reference each.
    held: Vec<Arc<Node>>,
    /// Bytes of regular files, for progress.
    pub data_bytes: u64,
}

impl Drop for Plan<'_> {
    fn drop(&mut self) {
        for (_, item) in self.items.drain(..) {
            if let Item::Object(node) = item {
                self.ov.forget(node.ino, 1);
            }
        }
        for node in self.held.drain(..) {
            self.ov.forget(node.ino, 1);
        }
    }
}

/// What `write` did.
#[derive(Default)]
pub struct Summary {
    pub entries: u64,
    pub whiteouts: u64,
    pub data_bytes: u64,
    /// Sizes of the regular files done, holes included: the progress bar's measure, as its
    /// total is the plan's sum of sizes (counting data alone, it ended short of the total
    /// for sparse files).
    pub file_bytes: u64,
    pub sparse_files: u64,
    pub hard_links: u64,
    /// What could not go into the archive, one line each (sockets; files that changed).
    pub warnings: Vec<String>,
}

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    if dir.is_empty() {
        name.to_vec()
    } else {
        [dir, b"/", name].concat()
    }
}

fn shown(path: &[u8]) -> String {
    format!("/{}", String::from_utf8_lossy(path))
}

fn failed(path: &[u8], e: impl std::fmt::Display) -> Error {
    crate::message!("{}: {e}", shown(path))
}

/// Finds every entry to export.
pub fn plan(ov: &Overlay) -> FsResult<Plan<'_>> {
    let mut plan = Plan {
        ov,
        items: Vec::new(),
        held: Vec::new(),
        data_bytes: 0,
    };
    if !ov.layers().has_upper {
        return Err("the mount has no upper layer: there is nothing to export".into());
    }
    plan_dir(&mut plan, ROOT_INO, b"", false)?;
    plan_lower_links(&mut plan)?;
    Ok(plan)
}

/// Lower names of copied-up hard links. A file with several lower names, copied up through
/// one of them (a chown, a write), is one inode in the merged view: its other names, which
/// stay in the lower layer, show the copy (`namei.rs`, joined links). The archive gives them
/// as hard links to the copy. They are found by a walk of the lower layers' directories,
/// matching entries' inode numbers (no stat per file), done when the layer has copied-up
/// files at all: a read of every lower directory, what any diff of a layer costs.
fn plan_lower_links(plan: &mut Plan) -> FsResult<()> {
    let ov = plan.ov;
    // Copied-up regular files, by merged inode number (the lower file's). Whether the lower
    // file had other names is not known without its path, which a copy-up does not keep.
    let mut wanted: HashMap<Ino, Arc<Node>> = HashMap::new();
    for (_, item) in &plan.items {
        if let Item::Object(node) = item {
            let st = node.state();
            if st.kind == libc::S_IFREG && st.upper && st.has_origin {
                wanted.insert(node.st_ino(), node.clone());
            }
        }
    }
    if wanted.is_empty() {
        return Ok(());
    }
    let exported: std::collections::HashSet<Vec<u8>> =
        plan.items.iter().map(|(p, _)| p.clone()).collect();
    let mut found = Vec::new();
    for layer in ov.layers().lower_ids() {
        let mut todo = vec![std::path::PathBuf::new()];
        while let Some(dir) = todo.pop() {
            let entries = crate::sys::read_dir(ov.layers().root(layer), &dir)
                .map_err(|e| failed(dir.as_os_str().as_bytes(), e))?;
            for e in entries {
                let path = dir.join(&e.name);
                match e.kind {
                    libc::S_IFDIR => todo.push(path),
                    libc::S_IFREG | 0 if wanted.contains_key(&ov.map_ino(layer, e.ino)) => {
                        let p = path.into_os_string().into_vec();
                        if !exported.contains(&p) {
                            found.push((p, ov.map_ino(layer, e.ino)));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    found.sort();
    found.dedup();
    for (path, st_ino) in found {
        // The name counts where the merged view shows the lower file under it (not whited
        // out, not hidden by an opaque or moved directory). It is resolved without a lookup,
        // which would link it into the upper layer (`join_copied_up_link`): an export changes
        // nothing, and a read-only overlay shows the lower name as a mount would.
        let (dir, name) = match path.iter().rposition(|&c| c == b'/') {
            Some(i) => (&path[..i], &path[i + 1..]),
            None => (&b""[..], &path[..]),
        };
        let Some(parent) = resolve_dir(plan, dir)? else {
            continue;
        };
        let entry = ov
            .dir_view(&parent)
            .and_then(|view| ov.resolve(&view, std::ffi::OsStr::from_bytes(name)))
            .map_err(|e| failed(&path, e))?;
        if entry.is_some_and(|e| e.found.ino == st_ino) {
            plan.items
                .push((path, Item::LowerLink(wanted[&st_ino].clone())));
        }
    }
    Ok(())
}

/// The directory at merged path `path`, if there is one. Every node on the way stays
/// referenced until the plan ends (`held`): a node's path is resolved through its parents.
fn resolve_dir(plan: &mut Plan, path: &[u8]) -> FsResult<Option<Arc<Node>>> {
    let mut node = plan.ov.node(ROOT_INO).map_err(|e| failed(path, e))?;
    for part in path.split(|&c| c == b'/').filter(|p| !p.is_empty()) {
        match plan.ov.lookup(node.ino, std::ffi::OsStr::from_bytes(part)) {
            Ok((n, _)) => {
                plan.held.push(n.clone());
                node = n;
            }
            Err(e) if e.is(libc::ENOENT) || e.is(libc::ENOTDIR) => return Ok(None),
            Err(e) => return Err(failed(path, e)),
        }
    }
    Ok((node.kind() == libc::S_IFDIR).then_some(node))
}

/// Adds the entries of directory `ino` (archive path `path`). `whole`: every entry the merged
/// view shows (below a redirect); otherwise only the upper layer's objects and whiteouts.
fn plan_dir(plan: &mut Plan, ino: Ino, path: &[u8], whole: bool) -> FsResult<()> {
    let ov = plan.ov;
    let node = ov.node(ino).map_err(|e| failed(path, e))?;
    let view = ov.dir_view(&node).map_err(|e| failed(path, e))?;
    // (name in the archive, is a whiteout)
    let mut names: Vec<(OsString, bool)> = if whole {
        ov.list_view(&view)
            .map_err(|e| failed(path, e))?
            .into_iter()
            .map(|e| (e.name, false))
            .collect()
    } else {
        let Some(upper) = &view.upper else {
            return Ok(());
        };
        let (objects, whiteouts) = ov
            .layer_entries(upper.view())
            .map_err(|e| failed(path, e))?;
        let mut names: Vec<(OsString, bool)> =
            objects.into_iter().map(|(e, _)| (e.name, false)).collect();
        names.extend(whiteouts.into_iter().map(|n| {
            let wh = [WHITEOUT_PREFIX, n.as_bytes()].concat();
            (OsString::from_vec(wh), true)
        }));
        names
    };
    names.sort();
    names.dedup();
    for (name, whiteout) in names {
        if whiteout {
            plan.items
                .push((join(path, name.as_bytes()), Item::Whiteout));
            continue;
        }
        let child_path = join(path, name.as_bytes());
        let (child, attr) = match ov.lookup(ino, &name) {
            Ok(found) => found,
            // Gone since the listing (a live mount): nothing to export.
            Err(e) if e.is(libc::ENOENT) => continue,
            Err(e) => return Err(failed(&child_path, e)),
        };
        let (upper, kind) = {
            let st = child.state();
            (st.upper, st.kind)
        };
        plan.items
            .push((child_path.clone(), Item::Object(child.clone())));
        match kind {
            libc::S_IFREG => plan.data_bytes += attr.size,
            libc::S_IFDIR => {
                let mut below_whole = whole;
                if !whole && upper {
                    let (dir, entry) =
                        ov.upper_entry(&child).map_err(|e| failed(&child_path, e))?;
                    let flags = ov
                        .layers()
                        .dir_flags(dir.view(), Some(&entry), true)
                        .map_err(|e| failed(&child_path, e))?;
                    below_whole = flags.redirect.is_some();
                    if flags.opaque || below_whole {
                        let opq = join(&child_path, OPAQUE_WHITEOUT.as_bytes());
                        plan.items.push((opq, Item::Opaque));
                    }
                }
                if upper || below_whole {
                    plan_dir(plan, child.ino, &child_path, below_whole)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Writes the archive of `plan` to `out`. `progress` hears the file bytes written so far.
/// The plan's inode references are kept to the end: a path is resolved through its parents.
pub fn write<W: Write>(
    plan: Plan,
    out: W,
    progress: &mut dyn FnMut(u64),
) -> FsResult<(W, Summary)> {
    let ov = plan.ov;
    let mut tar = TarWriter::new(out);
    let mut sum = Summary::default();
    // The archive path of the first entry of each inode with several links.
    let mut links: HashMap<u64, Vec<u8>> = HashMap::new();
    // Directory mtimes, which whiteouts and opaque markers take as theirs.
    let mut dir_mtime: HashMap<&[u8], i64> = HashMap::new();
    let io = |path: &[u8], e: std::io::Error| failed(path, format!("writing the archive: {e}"));
    for (path, item) in &plan.items {
        match item {
            Item::Whiteout | Item::Opaque => {
                let parent = match path.iter().rposition(|&c| c == b'/') {
                    Some(i) => &path[..i],
                    None => &b""[..],
                };
                let mtime = match dir_mtime.get(parent) {
                    Some(t) => *t,
                    None => ov.getattr(ROOT_INO).map(|a| a.mtime.0).unwrap_or(0),
                };
                let e = Entry {
                    path,
                    kind: Kind::File {
                        size: 0,
                        sparse: None,
                    },
                    // As containers/storage writes them.
                    mode: 0,
                    uid: 0,
                    gid: 0,
                    mtime,
                    xattrs: &[],
                };
                tar.entry(&e).map_err(|e| io(path, e))?;
                sum.whiteouts += 1;
            }
            Item::Object(node) | Item::LowerLink(node) => {
                match write_object(ov, &mut tar, node, path, &mut links, &mut sum, progress) {
                    Ok(Some(attr)) if attr.is_dir() => {
                        dir_mtime.insert(path, attr.mtime.0);
                    }
                    Ok(_) => {}
                    // Removed while the archive was written (a live mount).
                    Err(Failure::Fs(e)) if e.is(libc::ENOENT) => sum.warnings.push(format!(
                        "{}: removed while exporting; left out",
                        shown(path)
                    )),
                    Err(Failure::Fs(e)) => return Err(failed(path, e)),
                    Err(Failure::Io(e)) => return Err(io(path, e)),
                }
            }
        }
    }
    let out = tar
        .finish()
        .map_err(|e| crate::message!("writing the archive: {e}"))?;
    Ok((out, sum))
}

enum Failure {
    Fs(Error),
    Io(std::io::Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Fs(e)
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        Failure::Io(e)
    }
}

/// The merged view's xattrs of `ino`, by name.
fn xattrs(ov: &Overlay, ino: Ino) -> FsResult<Vec<(Vec<u8>, Vec<u8>)>> {
    let list = match ov.listxattr(ino) {
        Ok(l) => l,
        Err(e) if e.is(libc::ENOTSUP) || e.is(libc::EPERM) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for name in list.split(|&c| c == 0).filter(|n| !n.is_empty()) {
        match ov.getxattr(ino, std::ffi::OsStr::from_bytes(name)) {
            Ok(v) => out.push((name.to_vec(), v)),
            Err(e) if e.is(libc::ENODATA) || e.is(libc::ENOTSUP) => {}
            Err(e) => return Err(e),
        }
    }
    out.sort();
    Ok(out)
}

/// Writes one object; returns its attributes, or `None` for what a tar cannot hold.
fn write_object<W: Write>(
    ov: &Overlay,
    tar: &mut TarWriter<W>,
    node: &Arc<Node>,
    path: &[u8],
    links: &mut HashMap<u64, Vec<u8>>,
    sum: &mut Summary,
    progress: &mut dyn FnMut(u64),
) -> Result<Option<Attr>, Failure> {
    let attr = ov.getattr(node.ino)?;
    let xattrs = xattrs(ov, node.ino)?;
    let mut e = Entry {
        path,
        kind: Kind::Fifo,
        mode: attr.mode & 0o7777,
        uid: attr.uid,
        gid: attr.gid,
        mtime: attr.mtime.0,
        xattrs: &xattrs,
    };
    let rdev = (libc::major(attr.rdev), libc::minor(attr.rdev));
    let target;
    let dir_path;
    match attr.file_type() {
        libc::S_IFDIR => {
            dir_path = [path, b"/"].concat();
            e.path = &dir_path;
            e.kind = Kind::Dir;
        }
        libc::S_IFLNK => {
            target = ov.readlink(node.ino)?.into_vec();
            e.kind = Kind::Symlink(&target);
        }
        libc::S_IFCHR => e.kind = Kind::Char(rdev.0, rdev.1),
        libc::S_IFBLK => e.kind = Kind::Block(rdev.0, rdev.1),
        libc::S_IFIFO => {}
        libc::S_IFREG => {
            // Every name of a file after the first is a hard link to it. Not only where nlink
            // says so: a copied-up file's lower names (`plan_lower_links`) are not counted.
            if let Some(first) = links.get(&attr.ino) {
                let first = first.clone();
                e.kind = Kind::Link(&first);
                // The first entry carries the file's xattrs.
                e.xattrs = &[];
                tar.entry(&e)?;
                sum.entries += 1;
                sum.hard_links += 1;
                return Ok(Some(attr));
            }
            links.insert(attr.ino, path.to_vec());
            write_file(ov, tar, node, e, attr.size, sum, progress)?;
            return Ok(Some(attr));
        }
        _ => {
            sum.warnings.push(format!(
                "{}: a socket, which a tar archive cannot hold; left out",
                shown(path)
            ));
            return Ok(None);
        }
    }
    tar.entry(&e)?;
    sum.entries += 1;
    Ok(Some(attr))
}

/// Writes a regular file: its header, then its data regions read through the overlay.
fn write_file<W: Write>(
    ov: &Overlay,
    tar: &mut TarWriter<W>,
    node: &Arc<Node>,
    e: Entry,
    size: u64,
    sum: &mut Summary,
    progress: &mut dyn FnMut(u64),
) -> Result<(), Failure> {
    // The file's open state, without a handle: a handle would count as a kernel open in the
    // passthrough binding of the inode (file/mod.rs, `IoMode`).
    let file = ov.open_file(node)?;
    let r = (|| {
        let regions = data_regions(ov, &file, size)?;
        let sparse = regions.len() != 1 || regions[0] != (0, size);
        let e = Entry {
            kind: Kind::File {
                size,
                sparse: sparse.then_some(&regions[..]),
            },
            ..e
        };
        tar.entry(&e)?;
        sum.entries += 1;
        if sparse {
            sum.sparse_files += 1;
        }
        let mut shrank = false;
        for &(start, len) in &regions {
            let mut off = start;
            while off < start + len {
                let n = CHUNK.min(start + len - off);
                let got = if shrank {
                    0
                } else {
                    ov.read_file(&file, off, n as u32, |r| -> Result<u64, Failure> {
                        let b = r?;
                        tar.data(b)?;
                        Ok(b.len() as u64)
                    })?
                };
                if got < n {
                    // The file shrank while it was read (a live mount): zeros keep the
                    // archive's sizes right, as tar(1) does.
                    shrank = true;
                    let zeros = vec![0u8; (n - got) as usize];
                    tar.data(&zeros)?;
                }
                off += n;
                sum.data_bytes += n;
                progress(sum.file_bytes + off);
            }
        }
        sum.file_bytes += size;
        progress(sum.file_bytes);
        if shrank {
            sum.warnings.push(format!(
                "{}: shrank while exporting; padded with zeros",
                shown(e.path)
            ));
        }
        Ok(())
    })();
    drop(file);
    if ov.config().read_only {
        // Nothing completes a partial file of a read-only overlay; its queue would only hold
        // descriptors (offline export of a layer of many partial files).
        drop(ov.completer().drain());
    }
    r
}

/// The data regions of an open file (SEEK_DATA/SEEK_HOLE on the merged content), ending with
/// an empty region at the end of the file when it ends in a hole, as GNU tar writes them.
fn data_regions(ov: &Overlay, file: &OpenFile, size: u64) -> FsResult<Vec<(u64, u64)>> {
    let whole = vec![(0, size)];
    if size == 0 {
        return Ok(whole);
    }
    let mut regions = Vec::new();
    let mut off = 0u64;
    while off < size {
        let data = match ov.seek_file(file, off as i64, libc::SEEK_DATA) {
            Ok(d) => d as u64,
            Err(e) if e.is(libc::ENXIO) => break,
            // No hole information: the whole file is data.
            Err(e) if e.is(libc::EINVAL) || e.is(libc::EOPNOTSUPP) => return Ok(whole),
            Err(e) => return Err(e),
        };
        if data >= size {
            break;
        }
        let hole = (ov.seek_file(file, data as i64, libc::SEEK_HOLE)? as u64).min(size);
        regions.push((data, hole - data));
        off = hole;
    }
    if regions.last().is_none_or(|&(o, l)| o + l < size) {
        regions.push((size, 0));
    }
    Ok(regions)
}

// ---------------------------------------------------------------------------------------------
// The command: where the layer comes from, where the archive goes.
//
// A live mount is exported by its own daemon, which has the layer's state (pending blocks,
// open partial files) and writes the tar stream into the control socket (control.rs) in
// frames: a tag byte, a little-endian u64 length, the payload.

const FRAME_TOTAL: u8 = b'T';
const FRAME_DATA: u8 = b'D';
const FRAME_WARNING: u8 = b'W';
const FRAME_ERROR: u8 = b'E';
const FRAME_SUMMARY: u8 = b'S';

fn send_frame(out: &mut impl Write, tag: u8, payload: &[u8]) -> std::io::Result<()> {
    out.write_all(&[tag])?;
    out.write_all(&(payload.len() as u64).to_le_bytes())?;
    out.write_all(payload)
}

/// The tar stream cut into data frames of up to a megabyte.
struct DataFrames<W: Write> {
    out: W,
    buf: Vec<u8>,
}

impl<W: Write> DataFrames<W> {
    fn send(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            send_frame(&mut self.out, FRAME_DATA, &self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }
}

impl<W: Write> Write for DataFrames<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= CHUNK as usize {
            self.send()?;
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.send()?;
        self.out.flush()
    }
}

/// Serves an export request on the control socket (a thread of its own).
pub fn serve(ov: &Overlay, conn: std::os::unix::net::UnixStream) {
    let mut out = std::io::BufWriter::new(conn);
    let r = plan(ov).and_then(|plan| {
        let mut head = plan.data_bytes.to_le_bytes().to_vec();
        head.extend_from_slice(&(plan.items.len() as u64).to_le_bytes());
        send_frame(&mut out, FRAME_TOTAL, &head).map_err(|e| e.to_string())?;
        let frames = DataFrames {
            out: &mut out,
            buf: Vec::with_capacity(CHUNK as usize),
        };
        let (_, sum) = write(plan, frames, &mut |_| {})?;
        Ok(sum)
    });
    let _ = match r {
        Ok(sum) => (|| {
            for w in &sum.warnings {
                send_frame(&mut out, FRAME_WARNING, w.as_bytes())?;
            }
            let figures: Vec<u8> = [
                sum.entries,
                sum.whiteouts,
                sum.data_bytes,
                sum.sparse_files,
                sum.hard_links,
            ]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
            send_frame(&mut out, FRAME_SUMMARY, &figures)?;
            out.flush()
        })(),
        Err(e) => {
            send_frame(&mut out, FRAME_ERROR, e.to_string().as_bytes()).and_then(|()| out.flush())
        }
    };
}

/// The archive's way out: compressed or not.
enum Sink<W: Write> {
    Plain(W),
    Gzip(flate2::write::GzEncoder<W>),
    Zstd(zstd::Encoder<'static, W>),
}

impl<W: Write> Sink<W> {
    fn new(out: W, c: Compression) -> std::io::Result<Self> {
        Ok(match c {
            Compression::None => Sink::Plain(out),
            Compression::Gzip => Sink::Gzip(flate2::write::GzEncoder::new(
                out,
                flate2::Compression::default(),
            )),
            Compression::Zstd => Sink::Zstd(zstd::Encoder::new(out, 3)?),
        })
    }

    fn finish(self) -> std::io::Result<W> {
        let mut out = match self {
            Sink::Plain(w) => w,
            Sink::Gzip(g) => g.finish()?,
            Sink::Zstd(z) => z.finish()?,
        };
        out.flush()?;
        Ok(out)
    }
}

impl<W: Write> Write for Sink<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Sink::Plain(w) => w.write(b),
            Sink::Gzip(w) => w.write(b),
            Sink::Zstd(w) => w.write(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Sink::Plain(w) => w.flush(),
            Sink::Gzip(w) => w.flush(),
            Sink::Zstd(w) => w.flush(),
        }
    }
}

/// The progress bar: drawn on a terminal, nothing otherwise.
fn progress_bar(quiet: bool) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if quiet || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(0);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// `mosaicfs export`; returns the exit status.
pub fn run(a: &ExportArgs) -> i32 {
    use std::io::IsTerminal;
    if a.output.is_none() && std::io::stdout().is_terminal() {
        eprintln!(
            "mosaicfs export: refusing to write an archive to a terminal: use -o FILE or a pipe"
        );
        return 2;
    }
    let bar = progress_bar(a.quiet);
    let started = std::time::Instant::now();
    // A regular file is written under a temporary name and renamed when complete: an
    // interrupted export never leaves a truncated archive under the name asked for. Anything
    // else that exists (/dev/null, a FIFO, a tape) is written in place, never replaced.
    let in_place = |p: &std::path::Path| std::fs::metadata(p).is_ok_and(|m| !m.is_file());
    let temp = a.output.as_ref().filter(|p| !in_place(p)).map(|p| {
        let mut name = p.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".mosaicfs-export-{}", std::process::id()));
        p.with_file_name(name)
    });
    let dest: Box<dyn Write> = match (&temp, &a.output) {
        (Some(path), _) | (None, Some(path)) => {
            let file = if temp.is_some() {
                std::fs::File::create(path)
            } else {
                std::fs::OpenOptions::new().write(true).open(path)
            };
            match file {
                Ok(f) => Box::new(std::io::BufWriter::with_capacity(CHUNK as usize, f)),
                Err(e) => {
                    eprintln!(
                        "mosaicfs export: cannot write '{}': {e}",
                        a.output.as_deref().unwrap_or(path).display()
                    );
                    return 1;
                }
            }
        }
        (None, None) => Box::new(std::io::BufWriter::with_capacity(
            CHUNK as usize,
            std::io::stdout().lock(),
        )),
    };
    let r = Sink::new(dest, a.compression)
        .map_err(|e| crate::message!("cannot start the compressor: {e}"))
        .and_then(|sink| match &a.from {
            ExportFrom::Mount(mnt) => export_live(mnt, sink, &bar),
            ExportFrom::Dirs(o) => export_offline(o, sink, &bar),
        })
        .and_then(|(sink, sum)| {
            drop(
                sink.finish()
                    .map_err(|e| crate::message!("writing the archive: {e}"))?,
            );
            if let (Some(t), Some(out)) = (&temp, &a.output) {
                std::fs::File::open(t)
                    .and_then(|f| f.sync_all())
                    .and_then(|()| std::fs::rename(t, out))
                    .map_err(|e| {
                        crate::message!("cannot put the archive at '{}': {e}", out.display())
                    })?;
            }
            Ok(sum)
        });
    bar.finish_and_clear();
    match r {
        Ok(sum) => {
            for w in &sum.warnings {
                eprintln!("mosaicfs export: {w}");
            }
            if !a.quiet {
                eprintln!(
                    "mosaicfs export: {} entries ({} whiteouts, {} hard links, {} sparse files), \
                     {} bytes of file data in {:.1} s",
                    sum.entries + sum.whiteouts,
                    sum.whiteouts,
                    sum.hard_links,
                    sum.sparse_files,
                    sum.data_bytes,
                    started.elapsed().as_secs_f64()
                );
            }
            0
        }
        Err(e) => {
            if let Some(t) = &temp {
                let _ = std::fs::remove_file(t);
            }
            eprintln!("mosaicfs export: {e}");
            1
        }
    }
}

type Exported<W> = FsResult<(Sink<W>, Summary)>;

fn export_offline<W: Write>(
    o: &Options,
    sink: Sink<W>,
    bar: &indicatif::ProgressBar,
) -> Exported<W> {
    // A mount of the layer would change it under the export: with its work dir given, take
    // the work dir's lock as the mount does (a work dir never mounted has no lock to take).
    let _lock = match &o.workdir {
        Some(w) if w.join(WORK_SUBDIR).is_dir() => {
            let fd = rustix::fs::open(
                w,
                rustix::fs::OFlags::RDONLY
                    | rustix::fs::OFlags::DIRECTORY
                    | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| {
                crate::message!("workdir '{}': {}", w.display(), std::io::Error::from(e))
            })?;
            Some(lock_work_dir(fd.as_fd(), w, WorkLock::Tool).map_err(|e| {
                crate::message!(
                    "{e}\n(to export a layer while it is mounted: mosaicfs export MOUNTPOINT)"
                )
            })?)
        }
        _ => None,
    };
    let mut layers = LayerStack::open(
        &o.lowerdirs,
        o.upperdir.as_deref(),
        o.workdir.as_deref(),
        true,
        o.xattr_permissions,
        WorkLock::Tool,
        None,
    )?;
    layers.add_data_layers(&o.datadirs)?;
    let mut config = Config::from_options(o);
    config.read_only = true;
    let ov = Overlay::new(layers, config)?;
    let plan = plan(&ov)?;
    bar.set_length(plan.data_bytes);
    let (sink, sum) = write(plan, sink, &mut |done| bar.set_position(done))?;
    ov.shutdown();
    Ok((sink, sum))
}

fn export_live<W: Write>(
    mnt: &std::path::Path,
    mut sink: Sink<W>,
    bar: &indicatif::ProgressBar,
) -> Exported<W> {
    use std::io::Read;
    let conn = crate::control_socket::connect(mnt, "export")?;
    let mut conn = std::io::BufReader::with_capacity(CHUNK as usize, conn);
    let lost = |e: std::io::Error| {
        crate::message!(
            "the daemon of '{}' stopped answering ({e}); the archive is incomplete",
            mnt.display()
        )
    };
    let mut sum = Summary::default();
    let mut received = 0u64;
    let mut payload = Vec::new();
    loop {
        let mut head = [0u8; 9];
        conn.read_exact(&mut head).map_err(lost)?;
        let len = u64::from_le_bytes(head[1..].try_into().expect("8 bytes"));
        payload.clear();
        (&mut conn)
            .take(len)
            .read_to_end(&mut payload)
            .map_err(lost)?;
        if payload.len() as u64 != len {
            return Err(lost(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let u64_at = |i: usize| {
            payload
                .get(i * 8..i * 8 + 8)
                .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        };
        match head[0] {
            FRAME_TOTAL => bar.set_length(u64_at(0)),
            FRAME_DATA => {
                sink.write_all(&payload)
                    .map_err(|e| crate::message!("writing the archive: {e}"))?;
                received += len;
                bar.set_position(received.min(bar.length().unwrap_or(0)));
            }
            FRAME_WARNING => sum
                .warnings
                .push(String::from_utf8_lossy(&payload).into_owned()),
            FRAME_ERROR => return Err(String::from_utf8_lossy(&payload).into_owned().into()),
            FRAME_SUMMARY => {
                sum.entries = u64_at(0);
                sum.whiteouts = u64_at(1);
                sum.data_bytes = u64_at(2);
                sum.sparse_files = u64_at(3);
                sum.hard_links = u64_at(4);
                return Ok((sink, sum));
            }
            t => {
                return Err(crate::message!(
                    "unexpected frame {t:#x} from the daemon of '{}'",
                    mnt.display()
                ));
            }
        }
    }
}
