//! Commands on layers that no mount is using: `mosaicfs complete` and `mosaicfs fsck`.
//!
//! `complete` opens the layers as a mount does — the same `LayerStack` and `Overlay`, in this
//! process, without FUSE — so it sees the tree a mount shows and changes it only through the
//! mount's own code (copy-up, completion), with the same crash safety: every step leaves a
//! layer that mounts, and running the command again finishes the job. `fsck` reads the upper
//! directory itself, since its job is to find what a mount would trip over. Both take the work
//! dir's lock (layers/work_dir.rs, `WorkLock`), so neither runs under a live mount.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::OFlags;

use crate::error::Result;
use crate::file::partial::mark::PartialMark;
use crate::inode::{Ino, ROOT_INO};
use crate::layers::{LayerStack, WORK_SUBDIR, WorkLock, XattrNames};
use crate::options::{Redirects, ToolArgs};
use crate::overlay::Redirect;
use crate::overlay::{Config, Overlay};
use crate::sys;
use crate::upper::UpperDir;

/// Exit statuses, as fsck(8) has them.
pub const CLEAN: i32 = 0;
pub const REPAIRED: i32 = 1;
pub const LEFT: i32 = 4;
pub const FAILED: i32 = 8;

/// Kernel overlayfs' names for what mosaicfs writes as `NS.mosaicfs.redirect`.
fn kernel_redirect(names: &XattrNames) -> String {
    format!("{}overlay.redirect", names.prefix)
}

// ---------------------------------------------------------------------------------------------
// complete

/// `mosaicfs complete`: every partial file of the upper layer made whole, every directory
/// redirect made one kernel overlayfs follows (or its lower tree copied in, `--redirects=copy`),
/// and mosaicfs' own xattrs removed, so that kernel overlayfs and fuse-overlayfs show the tree
/// mosaicfs showed. Prints what it did; returns the exit status.
pub fn complete(t: &ToolArgs) -> i32 {
    let o = &t.opts;
    let overlay = match LayerStack::open(
        &o.lowerdirs,
        o.upperdir.as_deref(),
        o.workdir.as_deref(),
        false,
        o.xattr_permissions,
        WorkLock::Tool,
        None,
    )
    .and_then(|mut layers| {
        layers.add_data_layers(&o.datadirs)?;
        Overlay::new(layers, Config::from_options(o))
    }) {
        Ok(ov) => ov,
        Err(e) => {
            eprintln!("mosaicfs complete: {e}");
            return FAILED;
        }
    };
    let mut run = Completion {
        overlay: Arc::new(overlay),
        redirects: t.redirects,
        done: Default::default(),
        left: Vec::new(),
        partial_left: 0,
    };
    let progress = Progress::start(&run.overlay);
    let visited = run.visit(ROOT_INO, Path::new(""), false);
    drop(progress);
    let unguarded = || -> Result<()> {
        if run.partial_left == 0 && run.overlay.layers().memory.is_none() {
            crate::file::partial::mark::unguard_layer(&run.overlay.layers().upper_root()?)?;
        }
        Ok(())
    };
    if let Err(e) =
        visited.and_then(|()| unguarded().map_err(|e| crate::message!("upperdir /: {e}")))
    {
        eprintln!("mosaicfs complete: {e}");
        return FAILED;
    }
    let d = &run.done;
    println!(
        "mosaicfs complete: {} partial files made whole, {} redirects {}, {} xattrs of mosaicfs removed",
        d.files,
        d.redirects,
        match t.redirects {
            Redirects::Kernel => "given to kernel overlayfs",
            Redirects::Copy => "replaced by copies of their lower trees",
        },
        d.xattrs
    );
    for l in &run.left {
        println!("left as is: {l}");
    }
    if run.left.is_empty() { CLEAN } else { LEFT }
}

/// What `complete` has filled so far, on a terminal (nothing otherwise): a large file takes
/// seconds per GiB, and a silent command looks hung.
struct Progress {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    fn start(ov: &Arc<Overlay>) -> Progress {
        use std::io::IsTerminal;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        if !std::io::stderr().is_terminal() {
            return Progress { stop, thread: None };
        }
        let (ov, flag) = (ov.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let bar = indicatif::ProgressBar::new_spinner();
            let block = ov.sparse().block;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let filled = ov.stats().blocks_filled.get() * block;
                bar.set_message(format!(
                    "completing: {} files whole, {} filled from lower files",
                    ov.stats().completions.get(),
                    indicatif::HumanBytes(filled)
                ));
                bar.tick();
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            bar.finish_and_clear();
        });
        Progress {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Default)]
struct Done {
    files: u64,
    redirects: u64,
    xattrs: u64,
}

struct Completion {
    overlay: Arc<Overlay>,
    redirects: Redirects,
    done: Done,
    /// What could not be converted, one line each.
    left: Vec<String>,
    /// Partial files left partial (their lower file is gone or changed): the layer keeps its
    /// guard against fuse-overlayfs (`partial::LAYER_GUARD`).
    partial_left: u64,
}

impl Completion {
    /// Converts directory `ino` (merged path `path`) and every upper object below it. With
    /// `copy`, its lower entries are first copied up and it is then made opaque: a directory
    /// below a redirect that is being replaced by a copy.
    fn visit(&mut self, ino: Ino, path: &Path, copy: bool) -> Result<()> {
        let ov = self.overlay.clone();
        let at = |e: crate::error::Error| crate::message!("{}: {e}", shown(path));
        let node = ov.node(ino).map_err(at)?;
        let (dir, name) = ov.upper_entry(&node).map_err(at)?;
        let names = &ov.layers().xattr;
        let redirect = dir
            .view()
            .get_xattr(Some(&name), &names.redirect)
            .map_err(at)?;
        let copy = copy || (redirect.is_some() && self.redirects == Redirects::Copy);
        if let (Some(target), Redirects::Kernel, false) = (&redirect, self.redirects, copy) {
            // The kernel's key first: a crash in between leaves both, which read the same.
            let kernel = kernel_redirect(names);
            dir.set_xattr(Some(&name), OsStr::new(&kernel), target, 0)
                .map_err(at)?;
            let ours = OsStr::new(&names.redirect);
            dir.remove_xattr(Some(&name), ours).map_err(at)?;
            self.done.redirects += 1;
        }
        let entries = ov.list_dir(ino).map_err(at)?;
        for e in entries.iter().filter(|e| e.name != "." && e.name != "..") {
            let child_path = path.join(&e.name);
            let at = |err: crate::error::Error| crate::message!("{}: {err}", shown(&child_path));
            let (child, _) = ov.lookup(ino, &e.name).map_err(at)?;
            if copy && !child.state().upper {
                ov.copy_up(&child).map_err(at)?;
            }
            let (upper, kind) = {
                let st = child.state();
                (st.upper, st.kind)
            };
            if !upper {
                continue;
            }
            match kind {
                libc::S_IFDIR => self.visit(child.ino, &child_path, copy)?,
                libc::S_IFREG => self.complete_file(&child, &child_path)?,
                libc::S_IFCHR => self.check_device(&child, &child_path)?,
                _ => {}
            }
            self.strip(&child, &child_path)?;
        }
        if copy {
            // Every entry is in the upper layer now: hide the lower parts, then drop the
            // redirect that pointed at them.
            ov.layers().make_opaque(&dir, &name).map_err(at)?;
            self.drop_whiteouts(&dir, &name).map_err(at)?;
            for key in [names.redirect.clone(), kernel_redirect(names)] {
                match dir.remove_xattr(Some(&name), OsStr::new(&key)) {
                    Err(e) if !e.is(libc::ENODATA) => return Err(at(e)),
                    _ => {}
                }
            }
            if redirect.is_some() {
                self.done.redirects += 1;
            }
        }
        if ino == ROOT_INO {
            self.strip(&node, path)?;
        }
        Ok(())
    }

    /// Removes the whiteouts of the directory `name` in `dir`, made opaque: they hide nothing
    /// there, and kernel overlayfs lists those of an opaque directory as entries it cannot
    /// stat (`c?????????`). `.wh..wh..opq` stays: it may be what makes the directory opaque.
    fn drop_whiteouts(&mut self, dir: &crate::upper::UpperDir, name: &OsStr) -> Result<()> {
        let d = dir.open_dir(name)?;
        for e in d.read_dir()? {
            let n = e.name.as_os_str();
            let is_wh_file = n.as_bytes().starts_with(crate::layers::WHITEOUT_PREFIX)
                && n != crate::layers::OPAQUE_WHITEOUT;
            let attr = d.stat_at(n)?;
            if is_wh_file || self.overlay.layers().is_whiteout(d.view(), n, &attr)? {
                d.unlink(n)?;
            }
        }
        Ok(())
    }

    fn complete_file(&mut self, node: &Arc<crate::inode::Node>, path: &Path) -> Result<()> {
        let ov = self.overlay.clone();
        let at = |e: crate::error::Error| crate::message!("{}: {e}", shown(path));
        let f = match ov.open_file(node) {
            Ok(f) => f,
            Err(e) if e.is(libc::EIO) => {
                self.partial_left += 1;
                self.left.push(format!(
                    "{}: a partial file whose lower file is gone or changed, or whose mark is \
                     damaged (see 'mosaicfs fsck'); kernel overlayfs would read zeros in its holes",
                    shown(path)
                ));
                return Ok(());
            }
            Err(e) => return Err(at(e)),
        };
        if f.is_partial() {
            ov.complete_file(&f).map_err(at)?;
            if f.is_partial() {
                return Err(crate::message!(
                    "{}: still partial after completion",
                    shown(path)
                ));
            }
            self.done.files += 1;
        }
        // Completion keeps each file it registers open; this one is done.
        drop(ov.completer().drain());
        Ok(())
    }

    /// A char device 0/0 that is a real device (`mosaicfs.device`): other overlays read it
    /// as a whiteout, and nothing else can stand for it.
    fn check_device(&mut self, node: &crate::inode::Node, path: &Path) -> Result<()> {
        let (dir, name) = self
            .overlay
            .upper_entry(node)
            .map_err(|e| crate::message!("{}: {e}", shown(path)))?;
        let device = &self.overlay.layers().xattr.device;
        if dir
            .view()
            .get_xattr(Some(&name), device)
            .ok()
            .flatten()
            .is_some()
        {
            self.left.push(format!(
                "{}: a char device 0/0, which kernel overlayfs and fuse-overlayfs take for a \
                 whiteout (the file will not show there)",
                shown(path)
            ));
        }
        Ok(())
    }

    /// Removes mosaicfs' own xattrs (origin, origins) from an upper object: other overlays
    /// would show them. The mark and the redirect are gone already, and so is the guard of a
    /// partial file, unless a crash came between the mark's removal and the guard's.
    fn strip(&mut self, node: &crate::inode::Node, path: &Path) -> Result<()> {
        let ov = self.overlay.clone();
        let at = |e: crate::error::Error| crate::message!("{}: {e}", shown(path));
        let (dir, name) = ov.upper_entry(node).map_err(at)?;
        let names = &ov.layers().xattr;
        let guard = crate::file::partial::mark::guard(names);
        let (witness, value) = guard[guard.len() - 1];
        // Only our own guard: a kernel overlayfs metacopy file holds the same names.
        let left = dir.view().get_xattr(Some(&name), witness).ok().flatten();
        let guard_left = left.is_some_and(|v| v == value && node.state().kind == libc::S_IFREG);
        let guard_keys = guard
            .iter()
            .map(|(k, _)| k.to_string())
            .filter(|_| guard_left);
        for key in [names.origin.clone(), names.origins.clone()]
            .into_iter()
            .chain(guard_keys)
        {
            match dir.remove_xattr(Some(&name), OsStr::new(&key)) {
                Ok(()) => self.done.xattrs += 1,
                // Symlinks and devices cannot carry user.* xattrs at all.
                Err(e) if e.is(libc::ENODATA) || e.is(libc::EPERM) || e.is(libc::EOPNOTSUPP) => {}
                Err(e) => return Err(at(e)),
            }
        }
        Ok(())
    }
}

fn shown(path: &Path) -> String {
    if path.as_os_str().is_empty() {
        "/".into()
    } else {
        format!("/{}", path.display())
    }
}

// ---------------------------------------------------------------------------------------------
// fsck

/// One thing wrong with the layer.
struct Problem {
    /// Where: a path in the upper layer, or in the work dir.
    at: String,
    what: String,
    /// What the user can do (or what `--repair` does).
    fix: String,
    repair: Option<Repair>,
}

enum Repair {
    /// Remove this xattr of the object at `rel` in the upper layer: mounts ignore it anyway.
    DropXattr(PathBuf, String),
    /// Remove this entry of the work dir's scratch space.
    RemoveOrphan(OsString),
    /// Give the partial file at `rel` the guard that makes other overlays refuse it.
    Guard(PathBuf),
    /// Give the upper layer's root the guard that keeps fuse-overlayfs from the layer.
    LayerGuard,
    /// Remove the `.wh.NAME` file at `rel`, beside the `NAME` it would hide.
    RemoveWhFile(PathBuf),
}

struct Check {
    upper: OwnedFd,
    lowers: LayerStack,
    names: XattrNames,
    /// The other namespace's names: marks there are another kind of mount's.
    other: Option<XattrNames>,
    problems: Vec<Problem>,
    objects: u64,
    partial_files: u64,
}

/// `mosaicfs fsck`: checks every partial-file mark (it parses, its lower file exists and is
/// the one the mark was made from), every origin and redirect, and the work dir for objects
/// left by a crash; with `--repair` removes what mounts ignore anyway and what a crash left.
/// Prints one line per problem, with what to do; returns the exit status.
pub fn fsck(t: &ToolArgs) -> i32 {
    match run_fsck(t) {
        Ok(status) => status,
        Err(e) => {
            eprintln!("mosaicfs fsck: {e}");
            FAILED
        }
    }
}

fn run_fsck(t: &ToolArgs) -> Result<i32> {
    let o = &t.opts;
    let upper_path = o.upperdir.as_deref().expect("checked by parse_tool");
    let upper = rustix::fs::open(
        upper_path,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| crate::message!("upperdir '{}': {e}", upper_path.display()))?;
    let mut lowers = LayerStack::open(
        &o.lowerdirs,
        None,
        None,
        true,
        o.xattr_permissions,
        WorkLock::Tool,
        None,
    )?;
    lowers.add_data_layers(&o.datadirs)?;
    // The work dir's lock, held while checking and repairing (a live mount changes the layer).
    let work = match &o.workdir {
        Some(w) => open_work(w)?,
        None => None,
    };
    // After the lock: a layer a mount is using is refused as that first.
    if sys::stat_opt(upper.as_fd(), OsStr::new(crate::memory_upper::IMAGE_NAME))
        .is_ok_and(|a| a.is_some())
    {
        return Err(crate::message!(
            "upperdir '{}' holds a memory upper layer (upper=memory): every mount checks its \
             image whole (checksum, tree, blocks) and refuses a damaged one with the reason; \
             fsck checks disk layers",
            upper_path.display()
        ));
    }

    let trusted = trusted_namespace();
    let mut c = Check {
        upper,
        lowers,
        names: XattrNames::new(trusted),
        other: trusted.then(|| XattrNames::new(false)),
        problems: Vec::new(),
        objects: 0,
        partial_files: 0,
    };
    c.walk(Path::new(""))?;
    if let Some((w, _)) = &work {
        c.orphans(w.as_fd())?;
    }
    let (guard_key, guard_value) = crate::file::partial::mark::LAYER_GUARD;
    let guarded = sys::get_xattr(c.upper.as_fd(), None, guard_key)
        .map_err(|e| crate::message!("upperdir '{}': {e}", upper_path.display()))?
        .is_some_and(|v| v == guard_value);
    if c.partial_files > 0 && !guarded {
        c.problem(
            Path::new(""),
            format!("holds partial files but not {guard_key} (written before mosaicfs guarded layers): fuse-overlayfs given this layer reads their holes as zeros"),
            "run 'mosaicfs complete' before mounting the layer with another overlay; --repair adds the guard",
            Some(Repair::LayerGuard),
        );
    } else if c.partial_files == 0 && guarded {
        // Harmless for the data: it only keeps fuse-overlayfs from a layer it could now read.
        let done = if t.repair {
            sys::remove_xattr(c.upper.as_fd(), None, guard_key)
                .map(|()| " (removed)".to_string())
                .unwrap_or_else(|e| format!(" (removal failed: {e})"))
        } else {
            "; --repair removes it".to_string()
        };
        println!(
            "note: upper /: no partial file left, but {guard_key} still keeps fuse-overlayfs from the layer{done}"
        );
    }
    let mut repaired = 0;
    for p in &c.problems {
        let mut line = format!("{}: {}; {}", p.at, p.what, p.fix);
        if t.repair
            && let Some(r) = &p.repair
        {
            let work = work.as_ref().map(|(w, _)| w.try_clone().map(Arc::new));
            let work = work
                .transpose()
                .map_err(|e| crate::message!("work dir: {e}"))?;
            match c.repair(r, work.map(UpperDir::Disk).as_ref()) {
                Ok(()) => {
                    repaired += 1;
                    line += " (repaired)";
                }
                Err(e) => line += &format!(" (repair failed: {e})"),
            }
        }
        println!("{line}");
    }
    let total = c.problems.len();
    println!(
        "mosaicfs fsck: {}: {} objects, {} partial files, {} problems{}",
        upper_path.display(),
        c.objects,
        c.partial_files,
        total,
        if t.repair {
            format!(", {repaired} repaired")
        } else if c.problems.iter().any(|p| p.repair.is_some()) {
            " (run with --repair to fix those that say so)".to_string()
        } else {
            String::new()
        }
    );
    Ok(if total == 0 {
        CLEAN
    } else if repaired == total {
        REPAIRED
    } else {
        LEFT
    })
}

/// Whether mounts by this user keep their marks in `trusted.*`: root of the initial user
/// namespace (root of another one gets EPERM from trusted.* and uses `user.*`).
fn trusted_namespace() -> bool {
    rustix::process::geteuid().is_root()
        && std::fs::read_to_string("/proc/self/uid_map")
            .is_ok_and(|m| m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"])
}

/// The work dir's scratch space and its lock; `None` when no mount has made it yet.
fn open_work(work: &Path) -> Result<Option<(OwnedFd, OwnedFd)>> {
    let root = rustix::fs::open(
        work,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| crate::message!("workdir '{}': {e}", work.display()))?;
    if sys::stat_opt(root.as_fd(), OsStr::new(WORK_SUBDIR))
        .map_err(|e| crate::message!("workdir '{}': {e}", work.display()))?
        .is_none()
    {
        return Ok(None);
    }
    let lock = crate::layers::lock_work_dir(root.as_fd(), work, WorkLock::Tool)?;
    let sub = sys::open_dir(root.as_fd(), Path::new(WORK_SUBDIR))
        .map_err(|e| crate::message!("workdir '{}': {e}", work.display()))?;
    Ok(Some((sub, lock)))
}

impl Check {
    fn walk(&mut self, rel: &Path) -> Result<()> {
        let at = |e: crate::error::Error| crate::message!("upperdir, {}: {e}", shown(rel));
        let dir = sys::open_dir(self.upper.as_fd(), rel).map_err(at)?;
        for e in sys::read_dir(self.upper.as_fd(), rel).map_err(at)? {
            let path = rel.join(&e.name);
            self.objects += 1;
            let kind = match e.kind {
                0 => {
                    sys::stat_at(dir.as_fd(), &e.name)
                        .map_err(|err| crate::message!("upperdir, {}: {err}", shown(&path)))?
                        .mode
                        & libc::S_IFMT
                }
                k => k,
            };
            self.check_object(dir.as_fd(), &e.name, &path, kind);
            self.check_wh_file(dir.as_fd(), &e.name, &path);
            match kind {
                libc::S_IFREG => self.check_mark(dir.as_fd(), &e.name, &path),
                libc::S_IFDIR => {
                    self.check_dir(dir.as_fd(), &e.name, &path);
                    self.walk(&path)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A `.wh.NAME` whiteout beside `NAME` itself: what a crash leaves in the middle of a
    /// removal or rename where whiteouts are `.wh.` files (dir.rs makes the whiteout first).
    /// A mount of mosaicfs shows `NAME` (a whiteout hides only the layers below), as before
    /// the operation; fuse-overlayfs hides it.
    fn check_wh_file(&mut self, dir: BorrowedFd<'_>, name: &OsStr, rel: &Path) {
        let Some(hidden) = name.as_bytes().strip_prefix(crate::layers::WHITEOUT_PREFIX) else {
            return;
        };
        let hidden = OsStr::from_bytes(hidden);
        if name == crate::layers::OPAQUE_WHITEOUT || hidden.is_empty() {
            return;
        }
        if let Ok(Some(_)) = sys::stat_opt(dir, hidden) {
            self.problem(
                rel,
                format!(
                    "a whiteout beside {:?}, which it would hide: left by a removal or rename \
                     that stopped half way; mosaicfs shows the object, fuse-overlayfs hides it",
                    hidden
                ),
                "--repair removes the whiteout (what mosaicfs shows stays)",
                Some(Repair::RemoveWhFile(rel.to_owned())),
            );
        }
    }

    fn problem(&mut self, rel: &Path, what: String, fix: &str, repair: Option<Repair>) {
        self.problems.push(Problem {
            at: format!("upper {}", shown(rel)),
            what,
            fix: fix.to_string(),
            repair,
        });
    }

    fn check_object(&mut self, dir: BorrowedFd<'_>, name: &OsStr, rel: &Path, kind: u32) {
        let origin = self.names.origin.clone();
        self.check_value(
            dir,
            name,
            rel,
            &origin,
            |v| std::str::from_utf8(v).is_ok_and(|s| s.parse::<u64>().is_ok()),
            "is not a number",
            "mounts ignore it (the object's inode number is its upper one); --repair removes it",
        );
        if kind != libc::S_IFREG
            && let Ok(Some(_)) = sys::get_xattr(dir, Some(name), &self.names.partial)
        {
            let key = self.names.partial.clone();
            self.problem(
                rel,
                format!("a partial-file mark on something that is not a regular file ({key})"),
                "mounts ignore it; --repair removes it",
                Some(Repair::DropXattr(rel.to_owned(), key)),
            );
        }
    }

    fn check_mark(&mut self, dir: BorrowedFd<'_>, name: &OsStr, rel: &Path) {
        let raw = match sys::get_xattr(dir, Some(name), &self.names.partial) {
            Ok(Some(raw)) => raw,
            Ok(None) => {
                if let Some(other) = &self.other
                    && let Ok(Some(_)) = sys::get_xattr(dir, Some(name), &other.partial)
                {
                    let key = other.partial.clone();
                    self.problem(
                        rel,
                        format!("a partial-file mark in {key}, which only a mount without trusted.* xattrs (rootless) reads; a mount by root reads the file's holes as zeros"),
                        "mount and check this layer as the user (or in the user namespace) that wrote it",
                        None,
                    );
                }
                return;
            }
            Err(e) => {
                self.problem(
                    rel,
                    format!("cannot read its xattrs: {e}"),
                    "check the upper file system (its own fsck)",
                    None,
                );
                return;
            }
        };
        self.partial_files += 1;
        let (guard_key, _) = crate::file::partial::mark::guard(&self.names)[0];
        if let Ok(None) = sys::get_xattr(dir, Some(name), guard_key) {
            self.problem(
                rel,
                format!("a partial file without {guard_key} (written before mosaicfs guarded partial files): kernel overlayfs given this layer reads its holes as zeros"),
                "run 'mosaicfs complete' before mounting the layer with another overlay; --repair adds the guard",
                Some(Repair::Guard(rel.to_owned())),
            );
        }
        let mark = match PartialMark::decode(&raw) {
            Ok(m) => m,
            Err(why) => {
                self.problem(
                    rel,
                    format!("damaged partial-file mark ({why}): mounts refuse to open the file (EIO)"),
                    "nothing here can tell which of its holes are lower data: restore the file from a backup of the layer, or delete it from the upper dir (the lower file then shows again)",
                    None,
                );
                return;
            }
        };
        // Data-only layers (after `::`) count: a mark may name a data file (metacopy.rs).
        let count = self.lowers.last_layer();
        if mark.layer as usize > count {
            self.problem(
                rel,
                format!(
                    "its mark names lower layer {} but {count} are given",
                    mark.layer
                ),
                "pass the lowerdir list the layer is mounted with",
                None,
            );
            return;
        }
        let lower_root = self.lowers.root(mark.layer);
        let where_ = format!(
            "'{}/{}'",
            self.lowers.layer(mark.layer).path.display(),
            mark.path.display()
        );
        let lower = sys::open_beneath(lower_root, &mark.path, OFlags::PATH | OFlags::NOFOLLOW, 0)
            .and_then(|fd| sys::fstat(fd.as_fd()));
        match lower {
            Ok(a) if mark.matches(&a) => {}
            Ok(_) => self.problem(
                rel,
                format!("its lower file {where_} changed since the partial file was made (size or mtime differ): mounts refuse to open it (EIO)"),
                "put back the lower layer the file was written over; its data cannot be merged with another",
                None,
            ),
            Err(e) => self.problem(
                rel,
                format!("its lower file {where_} cannot be opened ({e}): mounts refuse to open it (EIO)"),
                "put back the lower layer the file was written over, or pass the lowerdir list the layer is mounted with",
                None,
            ),
        }
    }

    fn check_dir(&mut self, dir: BorrowedFd<'_>, name: &OsStr, rel: &Path) {
        let keys = std::iter::once(self.names.redirect.clone())
            .chain(crate::layers::REDIRECT_XATTRS.map(String::from));
        for key in keys {
            let Ok(Some(v)) = sys::get_xattr(dir, Some(name), &key) else {
                continue;
            };
            let ours = key == self.names.redirect;
            match Redirect::parse(&v) {
                None => self.problem(
                    rel,
                    format!(
                        "{key} '{}' is no redirect any overlay writes: mounts ignore it",
                        String::from_utf8_lossy(&v)
                    ),
                    if ours {
                        "--repair removes it"
                    } else {
                        "remove it by hand if no other overlay needs it"
                    },
                    ours.then(|| Repair::DropXattr(rel.to_owned(), key.clone())),
                ),
                Some(Redirect::Absolute(target)) => {
                    let found = (1..=self.lowers.lower_count())
                        .any(|l| sys::open_dir(self.lowers.root(l as u16), &target).is_ok());
                    if !found {
                        self.problem(
                            rel,
                            format!(
                                "{key} points at '/{}', which no lower layer has: the directory shows only its upper entries",
                                target.display()
                            ),
                            "pass the lowerdir list the layer is mounted with",
                            None,
                        );
                    }
                }
                Some(Redirect::Sibling(_)) => {}
            }
            break; // the first one found is the one mounts follow
        }
        let origins = self.names.origins.clone();
        self.check_value(
            dir,
            name,
            rel,
            &origins,
            |v| v == b"y",
            "is not 'y'",
            "mounts take it as set; --repair removes it (moved copy-ups then list with their upper inode numbers)",
        );
    }

    /// A problem, repaired by removing the xattr, when `key` is there and `valid` refuses it.
    #[allow(clippy::too_many_arguments)]
    fn check_value(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &OsStr,
        rel: &Path,
        key: &str,
        valid: impl Fn(&[u8]) -> bool,
        what: &str,
        fix: &str,
    ) {
        if let Ok(Some(v)) = sys::get_xattr(dir, Some(name), key)
            && !valid(&v)
        {
            self.problem(
                rel,
                format!("{key} {what} ('{}')", String::from_utf8_lossy(&v)),
                fix,
                Some(Repair::DropXattr(rel.to_owned(), key.to_string())),
            );
        }
    }

    fn orphans(&mut self, work: BorrowedFd<'_>) -> Result<()> {
        for e in sys::read_dir(work, Path::new("")).map_err(|e| crate::message!("workdir: {e}"))? {
            self.problems.push(Problem {
                at: format!("work {WORK_SUBDIR}/{}", e.name.to_string_lossy()),
                what: "left by an operation a crash interrupted (never visible in the merged view)"
                    .into(),
                fix: "the next mount removes it; so does --repair".into(),
                repair: Some(Repair::RemoveOrphan(e.name)),
            });
        }
        Ok(())
    }

    fn repair(&self, r: &Repair, work: Option<&UpperDir>) -> Result<()> {
        match r {
            Repair::DropXattr(rel, key) => {
                let (parent, name) = match (rel.parent(), rel.file_name()) {
                    (Some(p), Some(n)) => (p, n),
                    _ => (Path::new(""), OsStr::from_bytes(b".")),
                };
                let dir = sys::open_dir(self.upper.as_fd(), parent)?;
                sys::remove_xattr(dir.as_fd(), Some(name), key)
            }
            Repair::Guard(rel) => {
                let parent = rel.parent().unwrap_or(Path::new(""));
                let name = rel.file_name().unwrap_or_default();
                let dir = sys::open_dir(self.upper.as_fd(), parent)?;
                for (key, value) in crate::file::partial::mark::guard(&self.names) {
                    sys::set_xattr(dir.as_fd(), Some(name), key, value, 0)?;
                }
                Ok(())
            }
            Repair::LayerGuard => {
                let (key, value) = crate::file::partial::mark::LAYER_GUARD;
                sys::set_xattr(self.upper.as_fd(), None, key, value, 0)
            }
            Repair::RemoveWhFile(rel) => {
                let parent = rel.parent().unwrap_or(Path::new(""));
                let dir = sys::open_dir(self.upper.as_fd(), parent)?;
                let name = rel.file_name().unwrap_or_default();
                Ok(sys::unlinkat(
                    dir.as_fd(),
                    name,
                    rustix::fs::AtFlags::empty(),
                )?)
            }
            Repair::RemoveOrphan(name) => match work {
                Some(w) => w.remove_tree(name),
                None => Ok(()),
            },
        }
    }
}
