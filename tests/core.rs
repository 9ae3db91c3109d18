//! The overlay core driven directly, with no FUSE mount: layers opened as a mount opens them
//! (`LayerStack::open`, `Overlay::new`), requests made as fuse.rs makes them, over the disk
//! store and the memory store in a temp dir. Each test runs in milliseconds; the mount tests
//! (overlay.rs and the rest) stay the end-to-end layer. Root is needed only for the trusted.*
//! xattrs of the disk store, as for a mount.

use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mosaicfs::inode::Node;
use mosaicfs::layers::{LayerStack, MemorySpec, WorkLock};
use mosaicfs::options::{Command, parse_args};
use mosaicfs::overlay::SetAttr;
use mosaicfs::overlay::{Caller, Config, Overlay};
use mosaicfs::upper::ReadData;

const ROOT: u64 = 1;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    Disk,
    Memory,
    /// On disk, as on a file system where char devices cannot be made: whiteouts are
    /// `.wh.NAME` files (as after the upper layer refused the first one).
    WhFiles,
    /// On disk, as on a file system without RENAME_WHITEOUT (refused with EINVAL).
    NoRenameWhiteout,
}

const STORES: [Store; 2] = [Store::Disk, Store::Memory];

impl Store {
    /// The fault rules that make this store what it stands for.
    fn rules(self) -> &'static str {
        match self {
            Store::NoRenameWhiteout => "rename_whiteout:1+:EINVAL",
            _ => "",
        }
    }
}

/// Fault rules are the process's (`fault::set`): while the sweep sets them, no other test of
/// this file may run. Every `Core` holds this for its life.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// An overlay core over one lower layer, its upper and work dirs in a temp dir.
struct Core {
    _serial: Option<std::sync::MutexGuard<'static, ()>>,
    ov: Option<Arc<Overlay>>,
    store: Store,
    dir: tempfile::TempDir,
}

impl Core {
    fn new(store: Store, fill: impl FnOnce(&Path)) -> Core {
        let dir = tempfile::Builder::new()
            .prefix("mosaicfs-core")
            .tempdir_in("/tmp")
            .unwrap();
        for d in ["lower", "upper", "work"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        fill(&dir.path().join("lower"));
        let mut core = Core {
            _serial: Some(SERIAL.lock().unwrap_or_else(|e| e.into_inner())),
            ov: None,
            store,
            dir,
        };
        core.open();
        core
    }

    fn at(&self, d: &str) -> PathBuf {
        self.dir.path().join(d)
    }

    /// Opens the layers as a mount does (the options a mount would be given).
    fn open(&mut self) {
        let mut opts = format!(
            "lowerdir={},upperdir={},workdir={},copy_whole=0",
            self.at("lower").display(),
            self.at("upper").display(),
            self.at("work").display()
        );
        if self.store == Store::Memory {
            opts.push_str(",upper=memory");
        }
        let args = ["mosaicfs", "-o", &opts, "/nonexistent-mountpoint"];
        let Command::Mount(o) = parse_args(args.iter().map(|a| a.into())).unwrap() else {
            panic!("not a mount");
        };
        let memory = o.upper_kind == mosaicfs::options::UpperKind::Memory;
        let spec = memory.then(|| MemorySpec {
            filestore: o.filestore.clone().unwrap_or_default(),
            size_limit: o.size_limit,
            change_log: mosaicfs::layers::ChangeLogPlace::Off,
        });
        let layers = LayerStack::open(
            &o.lowerdirs,
            o.upperdir.as_deref(),
            o.workdir.as_deref(),
            false,
            o.xattr_permissions,
            WorkLock::Wait(std::time::Duration::from_secs(15)),
            spec.as_ref(),
        )
        .unwrap();
        if self.store == Store::WhFiles {
            layers.no_chardev_whiteouts();
        }
        self.ov = Some(Arc::new(
            Overlay::new(layers, Config::from_options(&o)).unwrap(),
        ));
    }

    /// What an unmount does, then the layers opened again.
    fn reopen(&mut self) {
        self.close();
        self.open();
    }

    fn close(&mut self) {
        if let Some(ov) = self.ov.take() {
            ov.shutdown();
        }
    }

    fn ov(&self) -> &Overlay {
        self.ov.as_deref().unwrap()
    }

    /// The node at `path` (from the root), as the kernel's lookups reach it.
    fn lookup(&self, path: &str) -> mosaicfs::error::Result<Arc<Node>> {
        let mut node = self.ov().node(ROOT)?;
        for name in path.split('/').filter(|c| !c.is_empty()) {
            node = self.ov().lookup(node.ino, OsStr::new(name))?.0;
        }
        Ok(node)
    }

    fn ino(&self, path: &str) -> u64 {
        self.lookup(path)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .ino
    }

    fn errno(&self, path: &str) -> i32 {
        self.lookup(path).err().map_or(0, |e| e.errno())
    }

    /// The names a listing of `path` shows, sorted, without `.` and `..`.
    fn names(&self, path: &str) -> Vec<String> {
        let mut out = Vec::new();
        self.ov()
            .readdir(self.ino(path), 0, 0, |e, _| {
                let n = e.name.to_string_lossy().into_owned();
                if n != "." && n != ".." {
                    out.push(n);
                }
                false
            })
            .unwrap();
        out.sort();
        out
    }

    fn read(&self, path: &str) -> Vec<u8> {
        let opened = self
            .ov()
            .open(self.ino(path), libc::O_RDONLY, None)
            .unwrap();
        let mut out = Vec::new();
        loop {
            let got = self
                .ov()
                .read(opened.fh, out.len() as u64, 1 << 17, |r| match r.unwrap() {
                    ReadData::Bytes(b) => b.to_vec(),
                    ReadData::Mapped(parts) => parts.iter().flat_map(|p| p.to_vec()).collect(),
                });
            if got.is_empty() {
                break;
            }
            out.extend_from_slice(&got);
        }
        self.ov().release(opened.fh);
        out
    }

    /// Writes `data` at `off` through a read-write handle, as a daemon-path writer does.
    fn write_at(&self, path: &str, off: u64, data: &[u8]) {
        let opened = self.ov().open(self.ino(path), libc::O_RDWR, None).unwrap();
        let n = self
            .ov()
            .write(opened.fh, off, data, false, false, None)
            .unwrap();
        assert_eq!(n as usize, data.len());
        self.ov().flush(opened.fh).unwrap();
        self.ov().release(opened.fh);
    }

    fn create(&self, dir: &str, name: &str, data: &[u8]) -> u64 {
        let (node, _, opened) = self
            .ov()
            .create(
                self.ino(dir),
                OsStr::new(name),
                0o644,
                libc::O_RDWR,
                &Caller::root(),
            )
            .unwrap();
        self.ov()
            .write(opened.fh, 0, data, false, false, None)
            .unwrap();
        self.ov().release(opened.fh);
        node.ino
    }

    /// Bytes the disk upper's file `rel` takes on disk; `None` for the memory store.
    fn allocated(&self, rel: &str) -> Option<u64> {
        (self.store == Store::Disk).then(|| {
            std::fs::metadata(self.at("upper").join(rel))
                .unwrap()
                .blocks()
                * 512
        })
    }
}

impl Core {
    /// The partial-file mark on the disk upper's file `rel`.
    fn partial_mark(&self, rel: &str) -> Option<Vec<u8>> {
        let path = self.at("upper").join(rel);
        let mut buf = vec![0u8; 4096];
        rustix::fs::getxattr(&path, "trusted.mosaicfs.partial", &mut buf)
            .ok()
            .map(|n| buf[..n].to_vec())
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.close();
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn lower_tree(l: &Path) {
    std::fs::create_dir_all(l.join("d/sub")).unwrap();
    std::fs::write(l.join("d/x"), b"x").unwrap();
    std::fs::write(l.join("d/y"), b"y").unwrap();
    std::fs::write(l.join("d/sub/z"), b"z").unwrap();
    std::fs::write(l.join("big"), pattern(1 << 20, 3)).unwrap();
    std::os::unix::fs::symlink("d/x", l.join("link")).unwrap();
}

/// Threads of this process named `name` (its first 15 bytes, as the kernel keeps it).
fn threads_named(name: &str) -> usize {
    let name = &name[..name.len().min(15)];
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// The control socket's thread ends as soon as the mount is gone (`stop_threads`, which FUSE's
/// `unmounted` calls), not only when the process exits: a daemon's descriptors close with its
/// last thread, and an engine unmounts a layer's file system right after the overlay.
#[test]
fn the_control_thread_ends_when_the_mount_is_gone() {
    let core = Core::new(Store::Disk, |_| {});
    let ov = core.ov.clone().unwrap();
    let before = threads_named("mosaicfs-control");
    let dev = format!("core-test-{}", std::process::id());
    let listener = mosaicfs::control::bind(&ov, &dev).expect("a control socket");
    listener.serve(ov.clone(), PathBuf::from("/nonexistent-mountpoint"));
    let until = |want: usize, what: &str| {
        let start = std::time::Instant::now();
        while threads_named("mosaicfs-control") != want {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(30),
                "{what}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    };
    // (A thread names itself once it runs.)
    until(before + 1, "the control thread never started");
    ov.stop_threads();
    until(before, "the control thread still runs");
    ov.shutdown();
}

#[test]
fn lookups_creates_and_listings_merge_the_layers() {
    for store in STORES {
        let mut c = Core::new(store, lower_tree);
        assert_eq!(c.names(""), ["big", "d", "link"], "{store:?}");
        assert_eq!(c.errno("nothing"), libc::ENOENT);
        assert_eq!(c.read("d/x"), b"x");
        c.create("d", "new", b"new data");
        let (sub, _) = c
            .ov()
            .mkdir(c.ino("d"), OsStr::new("made"), 0o755, &Caller::root())
            .unwrap();
        assert!(sub.is_dir());
        assert_eq!(c.names("d"), ["made", "new", "sub", "x", "y"], "{store:?}");
        let ino = c.ino("d/new");
        c.reopen();
        assert_eq!(c.read("d/new"), b"new data", "{store:?}");
        assert_eq!(c.ino("d/new"), ino, "{store:?}: the inode number stays");
        assert_eq!(c.names("d"), ["made", "new", "sub", "x", "y"], "{store:?}");
    }
}

/// A merged directory's link count is its subdirectories counted over its merged view, once,
/// and then kept right through every mkdir, rmdir and rename in it without listing it again:
/// a recount lists the whole directory, and one after each change made every rename, mkdir
/// and rmdir in a directory of n entries cost O(n) (2,000 files: 9.8 ms a rename, 0.15 ms
/// with the count kept; 16,000: 44 ms a mkdir).
#[test]
fn subdirectories_are_counted_once_and_kept_through_changes() {
    for store in STORES {
        let c = Core::new(store, lower_tree);
        let ov = c.ov();
        let root = Caller::root();
        let name = OsStr::new;
        c.create("d", "f", b"f");
        let (e, _) = ov.mkdir(ROOT, name("e"), 0o755, &root).unwrap();
        c.create("", "other", b"o");
        c.create("", "plain", b"p");
        let d = c.lookup("d").unwrap();
        let counted = |n: &Node| n.state().subdirs();
        let nlink = |n: &Node| ov.getattr(n.ino).unwrap().nlink;
        assert_eq!(nlink(&d), 3, "{store:?}: d holds sub");
        assert_eq!(counted(&d), Some(1), "{store:?}: counted");
        let step = |what: &str, want: u32| {
            assert_eq!(
                counted(&d),
                Some(want),
                "{store:?}: {what}: kept, not recounted"
            );
            assert_eq!(nlink(&d), u64::from(want) + 2, "{store:?}: {what}");
        };
        ov.rename(d.ino, name("f"), d.ino, name("g"), 0, &root)
            .unwrap();
        ov.rename(d.ino, name("g"), e.ino, name("g"), 0, &root)
            .unwrap();
        ov.rename(ROOT, name("other"), d.ino, name("x"), 0, &root)
            .unwrap();
        step("files moved in and out", 1);
        ov.mkdir(d.ino, name("s2"), 0o755, &root).unwrap();
        step("mkdir", 2);
        assert!(ov.mkdir(d.ino, name("s2"), 0o755, &root).is_err());
        assert_eq!(nlink(&d), 4, "{store:?}: a mkdir that failed");
        c.lookup("d/sub").unwrap();
        ov.rename(d.ino, name("sub"), e.ino, name("sub"), 0, &root)
            .unwrap();
        step("a lower subdirectory moved out", 1);
        ov.rename(d.ino, name("s2"), d.ino, name("s3"), 0, &root)
            .unwrap();
        step("a subdirectory renamed in place", 1);
        ov.mkdir(d.ino, name("s4"), 0o755, &root).unwrap();
        ov.rename(d.ino, name("s3"), d.ino, name("s4"), 0, &root)
            .unwrap();
        step("a subdirectory renamed over an empty one", 1);
        ov.mkdir(ROOT, name("s5"), 0o755, &root).unwrap();
        ov.rename(ROOT, name("s5"), d.ino, name("s6"), 0, &root)
            .unwrap();
        step("one moved in", 2);
        ov.rename(
            ROOT,
            name("plain"),
            d.ino,
            name("s6"),
            libc::RENAME_EXCHANGE,
            &root,
        )
        .unwrap();
        step("exchanged with a file", 1);
        assert_eq!(
            nlink(&c.lookup("").unwrap()),
            5,
            "{store:?}: d, e and s6 at the root"
        );
        ov.rmdir(d.ino, name("s4")).unwrap();
        step("rmdir", 0);
        assert_eq!(c.names("e"), ["g", "sub"], "{store:?}");
        assert_eq!(nlink(&e), 3, "{store:?}: e holds sub");
    }
}

/// The count stays exact while several callers make, move and remove subdirectories of two
/// directories at once and others ask for it: a count taken while a change is under way is
/// not kept, and each change moves the kept one by its own delta once.
#[test]
fn subdirectory_counts_stay_exact_under_concurrent_changes() {
    for store in STORES {
        let c = Core::new(store, lower_tree);
        let ov = c.ov();
        let root = Caller::root();
        let name = |s: String| std::ffi::OsString::from(s);
        let d = c.lookup("d").unwrap();
        let (e, _) = ov.mkdir(ROOT, OsStr::new("e"), 0o755, &root).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..3)
                .map(|t| {
                    let (d, e, root) = (&d, &e, &root);
                    s.spawn(move || {
                        for i in 0..150 {
                            let a = name(format!("a{t}-{i}"));
                            let b = name(format!("b{t}-{i}"));
                            ov.mkdir(d.ino, &a, 0o755, root).unwrap();
                            ov.lookup(d.ino, &a).unwrap();
                            ov.rename(d.ino, &a, e.ino, &b, 0, root).unwrap();
                            if i % 3 == 0 {
                                ov.rmdir(e.ino, &b).unwrap();
                            }
                            if i % 5 == 0 {
                                ov.mkdir(d.ino, &a, 0o755, root).unwrap();
                            }
                        }
                    })
                })
                .collect();
            s.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    ov.getattr(d.ino).unwrap();
                    ov.getattr(e.ino).unwrap();
                }
            });
            for w in workers {
                w.join().unwrap();
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        for (dir, node) in [("d", &d), ("e", &e)] {
            let listed = c
                .names(dir)
                .iter()
                .filter(|n| c.lookup(&format!("{dir}/{n}")).unwrap().is_dir())
                .count() as u64;
            let kept = ov.getattr(node.ino).unwrap().nlink;
            assert_eq!(kept, listed + 2, "{store:?}: {dir}");
        }
        assert_eq!(
            ov.getattr(d.ino).unwrap().nlink,
            3 + 3 * 30,
            "{store:?}: sub and a*"
        );
    }
}

/// A READDIRPLUS gives the kernel whole entries only where it lacks them: an entry it was given
/// moments ago under that name (made or looked up through the mount) goes as its name alone,
/// which spares the daemon its lookup. Entries it never got, one it forgot, and a directory
/// whose mode changed (the kernel drops that entry to check access again) come whole.
#[test]
fn a_listing_gives_whole_entries_only_where_the_kernel_lacks_them() {
    for store in STORES {
        let c = Core::new(store, lower_tree);
        let new = c.create("d", "new", b"new");
        c.lookup("d/x").unwrap();
        let (made, _) = c
            .ov()
            .mkdir(c.ino("d"), OsStr::new("made"), 0o700, &Caller::root())
            .unwrap();
        let (chmodded, _) = c
            .ov()
            .mkdir(c.ino("d"), OsStr::new("chmodded"), 0o700, &Caller::root())
            .unwrap();
        c.ov().access_changed(chmodded.ino);
        let whole = |path: &str| {
            let mut out = Vec::new();
            c.ov()
                .readdirplus(c.ino(path), 0, 0, |e, _, found| {
                    if found.is_some() {
                        out.push(e.name.to_string_lossy().into_owned());
                    }
                    false
                })
                .unwrap();
            out.sort();
            out
        };
        assert_eq!(whole("d"), ["chmodded", "sub", "y"], "{store:?}");
        assert!(made.is_dir());
        c.ov().forget(new, u64::MAX);
        assert_eq!(
            whole("d"),
            ["new"],
            "{store:?}: given whole, then forgotten"
        );
    }
}

#[test]
fn a_write_to_a_lower_file_copies_up_one_block_and_completion_the_rest() {
    for store in STORES {
        let mut c = Core::new(store, lower_tree);
        let mut want = pattern(1 << 20, 3);
        c.write_at("big", 8192 + 5, b"hello");
        want[8197..8202].copy_from_slice(b"hello");
        assert_eq!(c.read("big"), want, "{store:?}");
        if let Some(used) = c.allocated("big") {
            assert!(used <= 64 << 10, "{used} bytes for one changed block");
            assert!(c.partial_mark("big").is_some(), "a partial file");
        }
        c.reopen();
        assert_eq!(c.read("big"), want, "{store:?}: after a reopen");
        // Completion fills every other block from the lower file and drops the mark.
        let ino = c.ino("big");
        let opened = c.ov().open(ino, libc::O_RDWR, None).unwrap();
        let file = c
            .ov()
            .completer()
            .find(ino)
            .expect("a partial file is queued");
        c.ov().complete_file(&file).unwrap();
        drop(file);
        c.ov().release(opened.fh);
        if let Some(used) = c.allocated("big") {
            assert!(used >= 1 << 20, "{store:?}: completed: {used} bytes");
            assert!(c.partial_mark("big").is_none(), "complete: no mark");
        }
        assert_eq!(c.read("big"), want, "{store:?}: completed");
        c.reopen();
        assert_eq!(c.read("big"), want, "{store:?}: completed, after a reopen");
    }
}

#[test]
fn a_chown_copies_metadata_only() {
    for store in STORES {
        let mut c = Core::new(store, lower_tree);
        let set = SetAttr {
            uid: Some(4242),
            ..Default::default()
        };
        let attr = c.ov().setattr(c.ino("big"), set, &Caller::root()).unwrap();
        assert_eq!((attr.uid, attr.size), (4242, 1 << 20));
        if let Some(used) = c.allocated("big") {
            assert!(used < 64 << 10, "{store:?}: a chown copied {used} bytes");
        }
        c.reopen();
        assert_eq!(c.ov().getattr(c.ino("big")).unwrap().uid, 4242);
        assert_eq!(c.read("big"), pattern(1 << 20, 3), "{store:?}");
    }
}

#[test]
fn a_renamed_lower_directory_and_removed_names_stay_so() {
    for store in STORES {
        let mut c = Core::new(store, lower_tree);
        let ino = c.ino("d/sub/z");
        c.ov()
            .rename(
                ROOT,
                OsStr::new("d"),
                ROOT,
                OsStr::new("e"),
                0,
                &Caller::root(),
            )
            .unwrap();
        assert_eq!(c.errno("d"), libc::ENOENT, "{store:?}");
        assert_eq!(c.names("e"), ["sub", "x", "y"], "{store:?}");
        assert_eq!(
            c.ino("e/sub/z"),
            ino,
            "{store:?}: the moved tree keeps its numbers"
        );
        c.ov().unlink(c.ino("e"), OsStr::new("x")).unwrap();
        c.ov().unlink(ROOT, OsStr::new("link")).unwrap();
        assert_eq!(c.names("e"), ["sub", "y"], "{store:?}");
        c.reopen();
        assert_eq!(c.names(""), ["big", "e"], "{store:?}: after a reopen");
        assert_eq!(c.names("e"), ["sub", "y"], "{store:?}");
        assert_eq!(c.read("e/sub/z"), b"z", "{store:?}");
        // The name of the moved directory is free again, with nothing of the lower one.
        c.ov()
            .mkdir(ROOT, OsStr::new("d"), 0o755, &Caller::root())
            .unwrap();
        assert!(c.names("d").is_empty(), "{store:?}: {:?}", c.names("d"));
    }
}

impl Core {
    /// The node at `path`, or the error a lookup gives.
    fn try_ino(&self, path: &str) -> mosaicfs::error::Result<u64> {
        self.lookup(path).map(|n| n.ino)
    }

    /// Every name the merged view shows, with its kind, owner, mode, size and a checksum of
    /// its content (a symlink's target).
    fn view(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut todo = vec![String::new()];
        while let Some(dir) = todo.pop() {
            for name in self.names(&dir) {
                let path = if dir.is_empty() {
                    name
                } else {
                    format!("{dir}/{name}")
                };
                let node = self.lookup(&path).unwrap();
                let a = self.ov().getattr(node.ino).unwrap();
                let content = match a.mode & libc::S_IFMT {
                    libc::S_IFDIR => {
                        todo.push(path.clone());
                        String::new()
                    }
                    libc::S_IFREG => {
                        let data = self.read(&path);
                        format!(
                            "{} sum {}",
                            data.len(),
                            data.iter().map(|b| *b as u64).sum::<u64>()
                        )
                    }
                    libc::S_IFLNK => format!("-> {:?}", self.ov().readlink(node.ino).unwrap()),
                    _ => String::new(),
                };
                out.push(format!("{path} {:o} {}:{} {content}", a.mode, a.uid, a.gid));
            }
        }
        out.sort();
        out
    }
}

/// The changes of the fault sweep, each allowed to fail, but whole: a call that failed left
/// its names as they were, one that succeeded made its change. A block-level copy-up, a chown,
/// a create, a mkdir, a symlink, a hard link, an xattr, a rename of a lower directory,
/// removals, a truncate. Returns what broke that rule.
fn changes(c: &Core) -> Vec<String> {
    let ov = c.ov();
    let root = Caller::root();
    let name = OsStr::new;
    let mut broken = Vec::new();
    // After a call: `present` are the names that must show, `absent` those that must not.
    let mut whole = |what: &str, ok: bool, present: &[&str], absent: &[&str]| {
        let (present, absent) = if ok {
            (present, absent)
        } else {
            (absent, present)
        };
        for p in present {
            if c.try_ino(p).is_err() {
                broken.push(format!(
                    "{what} ({}): {p} is missing",
                    if ok { "done" } else { "failed" }
                ));
            }
        }
        for a in absent {
            if c.try_ino(a).is_ok() {
                broken.push(format!(
                    "{what} ({}): {a} shows",
                    if ok { "done" } else { "failed" }
                ));
            }
        }
    };
    let _ = (|| -> mosaicfs::error::Result<()> {
        let o = ov.open(c.try_ino("big")?, libc::O_RDWR, None)?;
        let r = ov.write(o.fh, 8197, b"hello", false, false, None);
        let _ = ov.flush(o.fh);
        ov.release(o.fh);
        r.map(drop)
    })();
    let _ = c.try_ino("d/x").and_then(|ino| {
        let set = SetAttr {
            uid: Some(4242),
            ..Default::default()
        };
        ov.setattr(ino, set, &root)
    });
    let made = c.try_ino("d").and_then(|d| {
        let (_, _, o) = ov.create(d, name("new"), 0o644, libc::O_RDWR, &root)?;
        let r = ov.write(o.fh, 0, b"new data", false, false, None);
        ov.release(o.fh);
        r.map(drop)
    });
    if made.is_err() && c.try_ino("d/new").is_ok() {
        // The create made the file and the write failed: the file stays, as on a disk.
    } else {
        whole("create", made.is_ok(), &["d/new"], &[]);
    }
    let ok = c
        .try_ino("d")
        .and_then(|d| ov.mkdir(d, name("made"), 0o755, &root))
        .is_ok();
    whole("mkdir", ok, &["d/made"], &[]);
    let ok = c
        .try_ino("d")
        .and_then(|d| ov.symlink(d, name("ln"), Path::new("x"), &root))
        .is_ok();
    whole("symlink", ok, &["d/ln"], &[]);
    let ok = c
        .try_ino("d/y")
        .and_then(|y| Ok((y, c.try_ino("d")?)))
        .and_then(|(y, d)| ov.link(y, d, name("y2")))
        .is_ok();
    whole("link", ok, &["d/y2"], &[]);
    let _ = c
        .try_ino("d/sub/z")
        .and_then(|z| ov.setxattr(z, name("user.k"), b"v", 0, false));
    let ok = ov
        .rename(ROOT, name("d"), ROOT, name("e"), 0, &root)
        .is_ok();
    whole("rename d e", ok, &["e", "e/sub/z"], &["d"]);
    let dir = if ok { "e" } else { "d" };
    let ok = c.try_ino(dir).and_then(|e| ov.unlink(e, name("x"))).is_ok();
    whole("unlink", ok, &[], &[&format!("{dir}/x")]);
    let ok = ov.unlink(ROOT, name("link")).is_ok();
    whole("unlink link", ok, &[], &["link"]);
    let _ = c.try_ino("big").and_then(|ino| {
        let set = SetAttr {
            size: Some(5000),
            ..Default::default()
        };
        ov.setattr(ino, set, &root)
    });
    broken
}

/// Each kind of change to the upper layer failing at one of its first calls, or at every call
/// from the first (`MOSAICFS_FAULT`'s rules, set in-process at the upper seam), on both stores
/// and on disk as where whiteouts cannot be char devices or made by RENAME_WHITEOUT:
/// each call fails or succeeds whole, and whatever the core shows afterwards is what the
/// layers show once reopened — nothing it showed was only in memory, nothing half made
/// appears later.
#[test]
fn every_failed_step_leaves_layers_that_reopen_as_they_were_shown() {
    let ops: Vec<&str> = mosaicfs::fault::op_names().collect();
    let stores = [Store::WhFiles, Store::NoRenameWhiteout];
    for store in STORES.into_iter().chain(stores) {
        // What the changes show when nothing fails.
        let reference = {
            let c = Core::new(store, lower_tree);
            mosaicfs::fault::set(store.rules()).unwrap();
            let broken = changes(&c);
            mosaicfs::fault::clear();
            assert_eq!(broken, Vec::<String>::new(), "{store:?}");
            c.view()
        };
        let mut differ = 0;
        for &op in &ops {
            for n in ["1", "2", "3", "1+"] {
                let mut c = Core::new(store, lower_tree);
                let spec = format!("{},{op}:{n}", store.rules());
                mosaicfs::fault::set(&spec).unwrap();
                let broken = changes(&c);
                mosaicfs::fault::clear();
                assert!(broken.is_empty(), "{store:?} {spec}: {broken:?}");
                let shown = c.view();
                differ += usize::from(shown != reference);
                c.reopen();
                assert_eq!(
                    c.view(),
                    shown,
                    "{store:?} {spec}: the reopened layers show another tree"
                );
            }
        }
        // The faults reach the changes: many sweep points leave another tree than the reference.
        assert!(
            differ >= 20,
            "{store:?}: only {differ} sweep points changed what shows"
        );
        eprintln!(
            "{store:?}: {differ} of {} sweep points changed what shows",
            ops.len() * 4
        );
    }
}
