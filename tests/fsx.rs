//! fsx-style randomized test: a long seeded sequence of operations applied both to a mount and
//! to an in-memory model, compared byte for byte and by metadata after each step.
//!
//! Lower files are large (megabytes) so that writes, truncates and punches land in partial
//! files; renames, unlinks, creates, dropped kernel caches and remounts are in the mix. `FSX_OPS` sets the number of
//! operations per seed, `FSX_SEED` runs one given seed (the failing seed is printed).

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::FileExt;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type Model = BTreeMap<String, Vec<u8>>;

fn initial_lower(seed: u64) -> Model {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut m = Model::new();
    for (i, size) in [8 << 20, 3 << 20, 1 << 20, 65536, 4097, 100]
        .into_iter()
        .enumerate()
    {
        let mut data = vec![0u8; size];
        rng.fill(&mut data[..]);
        m.insert(format!("f{i}"), data);
    }
    m
}

/// An offset near a block boundary more often than not: edge blocks are where bugs live.
fn offset(rng: &mut StdRng, limit: usize) -> usize {
    let limit = limit.max(1);
    match rng.gen_range(0..3) {
        0 => rng.gen_range(0..limit),
        _ => {
            let blk = rng.gen_range(0..limit.div_ceil(4096).max(1)) * 4096;
            let jitter: i64 = rng.gen_range(-3..=3);
            (blk as i64 + jitter).clamp(0, limit as i64) as usize
        }
    }
}

struct Run {
    m: Mount,
    /// The read-only FUSE mount the lower layer is read through, if any (`Drop for Run`).
    _store: Option<FuseStore>,
    /// Partial files the daemon completed, summed over remounts.
    completions: u64,
    /// Blocks whose fill copy-after-write deferred, summed over remounts.
    deferred: u64,
    /// Copy-ups that cloned the lower file, summed over remounts.
    reflinks: u64,
    /// Files made complete when opened for writing, summed over remounts.
    at_open: u64,
    /// Pre-content events that filled blocks for a writer passing through, summed.
    event_fills: u64,
    /// Lower files opened for their data, summed over remounts.
    lower_opens: u64,
    model: Model,
    /// Permission bits of each file in the model.
    modes: BTreeMap<String, u32>,
    rng: StdRng,
    log: Vec<String>,
    /// Held by a remount, and by whatever kills the daemon while a kill is under way
    /// (`fsx_across_a_hundred_daemon_kills_matches_the_model`).
    quiet: std::sync::Arc<std::sync::Mutex<()>>,
    /// Writers kept open from one write to the next, closed before any other operation
    /// (`HOLD_WRITERS`); `None`: each write opens and closes its file.
    held: Option<BTreeMap<String, fs::File>>,
    /// Set while a held writer has written since the writers were last closed: a kill then
    /// may find blocks pending (`across_a_hundred_kills` waits for it).
    wrote: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// A pseudo-option of `start_run`: writes go through descriptors kept open across writes, so
/// that blocks stay pending between operations (a close fills a file's pending blocks).
const HOLD_WRITERS: &str = "fsx:hold-writers";

impl Run {
    fn pick(&mut self) -> Option<String> {
        if self.model.is_empty() {
            return None;
        }
        let i = self.rng.gen_range(0..self.model.len());
        self.model.keys().nth(i).cloned()
    }

    fn check_file(&self, name: &str) {
        let want = &self.model[name];
        let got = fs::read(self.m.path(name))
            .unwrap_or_else(|e| panic!("read {name}: {e}\n{}", self.trace()));
        assert_eq!(got.len(), want.len(), "size of {name}\n{}", self.trace());
        if let Some(pos) = got.iter().zip(want.iter()).position(|(a, b)| a != b) {
            panic!(
                "{name} differs at byte {pos} (block {})\n{}",
                pos / 4096,
                self.trace()
            );
        }
        let md = fs::metadata(self.m.path(name)).unwrap();
        assert_eq!(md.len(), want.len() as u64);
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            md.mode() & 0o7777,
            self.modes[name],
            "mode of {name}\n{}",
            self.trace()
        );
        assert_eq!(md.nlink(), 1, "links of {name}");
    }

    fn check_all(&self) {
        let mut names = names(&self.m.mnt);
        names.retain(|n| n != "lost+found");
        let want: Vec<String> = self.model.keys().cloned().collect();
        assert_eq!(names, want, "directory listing\n{}", self.trace());
        for n in self.model.keys() {
            self.check_file(n);
        }
    }

    /// Lets the completion worker complete the files that are due before an unmount lets go
    /// of them: `mosaicfs status` lists each as "due: ..." until then. On a busy host the
    /// worker may not have run yet; the bound is against a hang, not a measurement.
    fn settle_completions(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while status(&self.m).contains("; due: ") && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    fn close_writers(&mut self) {
        if let Some(held) = self.held.as_mut() {
            self.wrote
                .store(false, std::sync::atomic::Ordering::Relaxed);
            held.clear();
        }
    }

    fn remount(&mut self) {
        self.close_writers();
        let quiet = self.quiet.clone();
        let _no_kill = quiet.lock().unwrap_or_else(|e| e.into_inner());
        self.settle_completions();
        let log = self.m.unmount();
        self.completions += served(&log, "completions");
        self.deferred += served(&log, "blocks-deferred");
        self.reflinks += served(&log, "reflinks");
        self.at_open += served(&log, "at-open");
        self.event_fills += served(&log, "event-fills");
        self.lower_opens += served(&log, "lower-opens");
        self.m.mount();
    }

    fn trace(&self) -> String {
        let tail: Vec<&String> = self.log.iter().rev().take(15).collect();
        format!(
            "last operations (newest first):\n  {}",
            tail.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        )
    }

    fn step(&mut self, i: usize) {
        let op = self.rng.gen_range(0..100);
        if op >= 40 {
            self.close_writers();
        }
        match op {
            0..=39 => {
                let Some(name) = self.pick() else { return };
                let size = self.model[&name].len();
                let off = offset(&mut self.rng, size + 8192);
                let len = if self.rng.gen_bool(0.7) {
                    self.rng.gen_range(1..5000)
                } else {
                    self.rng.gen_range(1..70000)
                };
                let mut data = vec![0u8; len];
                self.rng.fill(&mut data[..]);
                self.log
                    .push(format!("{i}: write {name} off={off} len={len}"));
                let path = self.m.path(&name);
                let open = || fs::OpenOptions::new().write(true).open(&path).unwrap();
                let opened;
                let f = match self.held.as_mut() {
                    Some(held) => held.entry(name.clone()).or_insert_with(open),
                    None => {
                        opened = open();
                        &opened
                    }
                };
                f.write_all_at(&data, off as u64).unwrap();
                if self.held.is_some() {
                    self.wrote.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                let file = self.model.get_mut(&name).unwrap();
                if file.len() < off + len {
                    file.resize(off + len, 0);
                }
                file[off..off + len].copy_from_slice(&data);
            }
            40..=54 => {
                let Some(name) = self.pick() else { return };
                let size = self.model[&name].len();
                let off = offset(&mut self.rng, size);
                let len = self.rng.gen_range(1..100_000);
                self.log
                    .push(format!("{i}: read {name} off={off} len={len}"));
                let f = fs::File::open(self.m.path(&name)).unwrap();
                let mut buf = vec![0u8; len];
                let mut got = 0;
                while got < len {
                    let n = f.read_at(&mut buf[got..], (off + got) as u64).unwrap();
                    if n == 0 {
                        break;
                    }
                    got += n;
                }
                let want = &self.model[&name];
                let end = (off + len).min(want.len());
                let expect = if off < end { &want[off..end] } else { &[][..] };
                assert!(
                    &buf[..got] == expect,
                    "read {name} at {off}+{len} differs\n{}",
                    self.trace()
                );
            }
            55..=64 => {
                let Some(name) = self.pick() else { return };
                let size = self.model[&name].len();
                let new = match self.rng.gen_range(0..4) {
                    0 => 0,
                    1 => offset(&mut self.rng, size),
                    _ => offset(&mut self.rng, size * 2 + 10000),
                };
                self.log.push(format!("{i}: truncate {name} {size}->{new}"));
                fs::OpenOptions::new()
                    .write(true)
                    .open(self.m.path(&name))
                    .unwrap()
                    .set_len(new as u64)
                    .unwrap();
                self.model.get_mut(&name).unwrap().resize(new, 0);
            }
            65..=69 => {
                let Some(name) = self.pick() else { return };
                let size = self.model[&name].len();
                if size == 0 {
                    return;
                }
                let off = offset(&mut self.rng, size - 1).min(size - 1);
                let len = self.rng.gen_range(1..=(size - off).min(100_000));
                let zero = self.rng.gen_bool(0.5);
                self.log.push(format!(
                    "{i}: {} {name} off={off} len={len}",
                    if zero { "zero-range" } else { "punch" }
                ));
                let f = fs::OpenOptions::new()
                    .write(true)
                    .open(self.m.path(&name))
                    .unwrap();
                let mode = if zero {
                    rustix::fs::FallocateFlags::ZERO_RANGE | rustix::fs::FallocateFlags::KEEP_SIZE
                } else {
                    rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE
                };
                rustix::fs::fallocate(&f, mode, off as u64, len as u64).unwrap();
                self.model.get_mut(&name).unwrap()[off..off + len].fill(0);
            }
            70..=77 => {
                let Some(name) = self.pick() else { return };
                let mut data = vec![0u8; self.rng.gen_range(1..3000)];
                self.rng.fill(&mut data[..]);
                self.log
                    .push(format!("{i}: append {name} len={}", data.len()));
                let mut f = fs::OpenOptions::new()
                    .append(true)
                    .open(self.m.path(&name))
                    .unwrap();
                std::io::Write::write_all(&mut f, &data).unwrap();
                self.model.get_mut(&name).unwrap().extend_from_slice(&data);
            }
            78..=84 => {
                let Some(from) = self.pick() else { return };
                let to = format!("f{}", self.rng.gen_range(0..9));
                self.log.push(format!("{i}: rename {from} -> {to}"));
                fs::rename(self.m.path(&from), self.m.path(&to)).unwrap();
                let data = self.model.remove(&from).unwrap();
                let mode = self.modes.remove(&from).unwrap();
                self.model.insert(to.clone(), data);
                self.modes.insert(to, mode);
            }
            85..=88 => {
                let Some(name) = self.pick() else { return };
                self.log.push(format!("{i}: unlink {name}"));
                fs::remove_file(self.m.path(&name)).unwrap();
                self.model.remove(&name);
                self.modes.remove(&name);
            }
            89..=93 => {
                let name = format!("f{}", self.rng.gen_range(0..9));
                let mut data = vec![0u8; self.rng.gen_range(0..20000)];
                self.rng.fill(&mut data[..]);
                self.log
                    .push(format!("{i}: create {name} len={}", data.len()));
                let existed = self.model.contains_key(&name);
                fs::write(self.m.path(&name), &data).unwrap();
                self.model.insert(name.clone(), data);
                if !existed {
                    self.modes.insert(name, 0o644);
                }
            }
            94..=95 => {
                let Some(name) = self.pick() else { return };
                let mode = self.rng.gen_range(0o400..0o1000u32);
                self.log.push(format!("{i}: chmod {name} {mode:o}"));
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(self.m.path(&name), fs::Permissions::from_mode(mode)).unwrap();
                self.modes.insert(name, mode);
            }
            96 => {
                let Some(name) = self.pick() else { return };
                self.log.push(format!("{i}: check {name}"));
                self.check_file(&name);
            }
            97 => {
                // The kernel forgets every unused inode (as under memory pressure); the daemon
                // must find its open state of partial files again on the next open.
                self.log.push(format!("{i}: drop_caches"));
                fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
            }
            _ => {
                self.log.push(format!("{i}: remount"));
                self.remount();
                self.check_all();
            }
        }
    }
}

/// Runs one seed; returns how many partial files the daemon completed and how many block
/// fills copy-after-write deferred.
fn run_seed(seed: u64, ops: usize, options: &[&str]) -> (u64, u64) {
    let run = run_seed_in(std::path::Path::new("/tmp"), seed, ops, options);
    (run.completions, run.deferred)
}

/// A read-only mosaicfs mount of a directory: a lower layer on a FUSE file system, as a
/// store's client (squashfuse, glusterfs) gives it.
struct FuseStore {
    path: std::path::PathBuf,
    child: std::process::Child,
}

impl FuseStore {
    fn new(dir: &std::path::Path, at: std::path::PathBuf) -> FuseStore {
        fs::create_dir_all(&at).unwrap();
        let mut child = std::process::Command::new(BIN)
            .arg("-f")
            .arg("-o")
            .arg(format!("lowerdir={}", dir.display()))
            .arg(&at)
            .spawn()
            .unwrap();
        for _ in 0..500 {
            if is_mounted(&at) {
                return FuseStore { path: at, child };
            }
            assert!(
                child.try_wait().unwrap().is_none(),
                "the store mount failed"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("{} not mounted", at.display());
    }
}

impl Drop for Run {
    /// The mount on top goes first, then the store under it, and only then the layers'
    /// directory, which holds the store's mount point: dropping `m` whole first left that
    /// directory in /tmp after every run, its removal stopped by the store still mounted in it.
    fn drop(&mut self) {
        let Some(store) = self._store.take() else {
            return;
        };
        if std::thread::panicking() {
            self.m.kill9();
        } else {
            self.m.unmount();
        }
        drop(store);
    }
}

impl Drop for FuseStore {
    fn drop(&mut self) {
        sh(&format!("umount {}", self.path.display()));
        let _ = self.child.wait();
    }
}

/// `run_seed` with the layers in a new directory below `base`; returns the finished run.
fn run_seed_in(base: &std::path::Path, seed: u64, ops: usize, options: &[&str]) -> Run {
    run_seed_with(base, seed, ops, options, Lower::Plain, false)
}

/// What the lower layer is.
#[derive(PartialEq, Clone)]
enum Lower {
    Plain,
    /// Read through a FUSE mount of it, as a shared store's client.
    OnStore,
    /// Kernel overlayfs' metadata-only files, their data in a data-only layer (metacopy.rs).
    MetadataOnly,
}

/// `run_seed_in`, with the lower layer as `lower` says, and its files dropped from the page
/// cache every 100 operations if `cold`.
fn run_seed_with(
    base: &std::path::Path,
    seed: u64,
    ops: usize,
    options: &[&str],
    lower: Lower,
    cold: bool,
) -> Run {
    let mut run = start_run(Mount::new_in(base, 1), seed, options, &lower);
    for i in 0..ops {
        if cold && i % 100 == 0 {
            for name in initial_lower(seed).keys() {
                let f = fs::File::open(run.m.lower(0).join(name)).unwrap();
                f.sync_all().unwrap(); // dirty pages would stay
                rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            }
        }
        run.step(i);
        if i % 250 == 249 {
            run.check_all();
        }
    }
    run.check_all();
    run.remount();
    run.check_all();
    run
}

/// The layers of seed `seed` under `m`, mounted with `options`, and the model beside them.
fn start_run(mut m: Mount, seed: u64, options: &[&str], lower: &Lower) -> Run {
    let model = initial_lower(seed);
    let lower = lower.clone();
    // `MOSAICFS_TEST_*=V` entries are for the daemon's environment, the rest mount options.
    let hold = options.contains(&HOLD_WRITERS);
    let (env, opts): (Vec<&str>, Vec<&str>) = options
        .iter()
        .filter(|o| **o != HOLD_WRITERS)
        .partition(|o| o.starts_with("MOSAICFS_TEST_"));
    m.extra = opts.iter().map(|o| o.to_string()).collect();
    m.env.extend(
        env.iter()
            .filter_map(|e| e.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let data = m.dir.path().join("data");
    for (name, bytes) in &model {
        let path = m.lower(0).join(name);
        if lower == Lower::MetadataOnly {
            write(data.join(name), bytes);
            fs::File::create(&path)
                .unwrap()
                .set_len(bytes.len() as u64)
                .unwrap();
            set_xattr(&path, "trusted.overlay.metacopy", b"");
            set_xattr(
                &path,
                "trusted.overlay.redirect",
                format!("/{name}").as_bytes(),
            );
        } else {
            write(&path, bytes);
        }
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
    }
    if lower == Lower::MetadataOnly {
        // lowerdir=LOWER::DATA
        m.lowers.extend([std::path::PathBuf::new(), data]);
    }
    let store = (lower == Lower::OnStore).then(|| {
        let store = FuseStore::new(m.lower(0), m.dir.path().join("store"));
        m.lowers[0] = store.path.clone();
        store
    });
    m.mount();
    let modes = model.keys().map(|k| (k.clone(), 0o644)).collect();
    Run {
        m,
        _store: store,
        completions: 0,
        deferred: 0,
        reflinks: 0,
        at_open: 0,
        event_fills: 0,
        lower_opens: 0,
        model,
        modes,
        rng: StdRng::seed_from_u64(seed),
        log: vec![format!("seed {seed}")],
        quiet: Default::default(),
        held: hold.then(BTreeMap::new),
        wrote: Default::default(),
    }
}

/// Operations per seed: `FSX_OPS`, 2,000 unless set.
fn fsx_ops() -> usize {
    std::env::var("FSX_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
}

/// The one seed `FSX_SEED` asks for, if set.
fn fsx_seed() -> Option<u64> {
    std::env::var("FSX_SEED").ok().and_then(|s| s.parse().ok())
}

/// The seeds to run: `FSX_SEED` alone if set, else `default`.
fn fsx_seeds(default: &[u64]) -> Vec<u64> {
    fsx_seed().map_or_else(|| default.to_vec(), |s| vec![s])
}

#[test]
fn fsx_random_operations_match_the_model() {
    let ops = fsx_ops();
    let seeds = fsx_seeds(&[1, 2, 3]);
    for seed in seeds {
        eprintln!("fsx: seed {seed}, {ops} operations");
        run_seed(seed, ops, &[]);
    }
}

/// The same with write-only writers passing through (`partial_passthrough=on`, pre-content
/// events fill what they touch; fsx's writers are write-only), on a disk upper.
#[test]
fn fsx_with_writers_passing_through_matches_the_model() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let ops = fsx_ops();
    let seeds = fsx_seeds(&[4, 8]);
    for seed in seeds {
        eprintln!("fsx (partial_passthrough=on): seed {seed}, {ops} operations");
        let on = ["partial_passthrough=on"];
        let run = run_seed_in(std::path::Path::new("/tmp"), seed, ops, &on);
        assert!(run.event_fills > 0, "no writer passed through");
    }
}

/// The same under the kernel's writeback cache (`writeback=auto` where nothing passes through:
/// rootless, `passthrough=off`): writes reach the daemon later, gathered into pages,
/// O_APPEND is the kernel's, partly written pages are read through write-only handles, and
/// the kernel owns sizes until its pages are written back.
#[test]
fn fsx_under_the_writeback_cache_matches_the_model() {
    let ops = fsx_ops();
    let seeds = fsx_seeds(&[5, 6]);
    for seed in seeds {
        eprintln!("fsx (writeback cache): seed {seed}, {ops} operations");
        let run = run_seed_in(
            std::path::Path::new("/tmp"),
            seed,
            ops,
            &["passthrough=off", "writeback=auto"],
        );
        assert!(
            status(&run.m).contains("writeback cache: on"),
            "the writeback cache is off: {}",
            status(&run.m)
        );
    }
}

/// The same, with background completion racing every operation (files complete 1 ms after
/// their last write) and passthrough for completed files.
#[test]
fn fsx_with_eager_completion_matches_the_model() {
    let ops = fsx_ops();
    // Seed 41 keeps large partial files alive across many remounts (some seeds truncate every
    // file early, leaving nothing to complete).
    let seed = fsx_seed().unwrap_or(41);
    eprintln!("fsx (eager completion): seed {seed}, {ops} operations");
    let (completed, _) = run_seed(seed, ops, &["complete_after=0.001", "complete_ratio=10"]);
    assert!(completed > 0, "completion never ran");
}

/// The same with the sustained-use rule firing after 3 requests through the daemon (the
/// default rule, its threshold lowered): files complete while they are being read and
/// written, and after their last close.
#[test]
fn fsx_with_completion_of_busy_files_matches_the_model() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(41);
    eprintln!("fsx (busy files complete): seed {seed}, {ops} operations");
    let busy = [
        "MOSAICFS_TEST_BUSY_REQUESTS=3",
        "copy_whole=0",
        "partial_passthrough=off",
    ];
    let run = run_seed_in(std::path::Path::new("/tmp"), seed, ops, &busy);
    assert!(run.completions > 0, "no busy file was completed");
}

/// The same with every file copied whole when opened for writing (`copy_whole=` above the
/// largest file), with files completed only when reopened after a write (`complete_on_reopen=`),
/// and with neither (partial files of every size).
#[test]
fn fsx_with_whole_copies_at_open_and_without_matches_the_model() {
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(7);
    eprintln!("fsx (whole copies at open): seed {seed}, {ops} operations");
    // Whole copies at open and completion at reopen are for writers the daemon serves.
    let whole = ["copy_whole=64M", "partial_passthrough=off"];
    let run = run_seed_in(std::path::Path::new("/tmp"), seed, ops, &whole);
    assert!(run.at_open > 0, "no file was copied whole at open");
    eprintln!("fsx (completed when reopened): seed {seed}, {ops} operations");
    let reopen = [
        "copy_whole=0",
        "complete_on_reopen=64M",
        "complete_after=0",
        "complete_ratio=0",
        "partial_passthrough=off",
    ];
    let run = run_seed_in(std::path::Path::new("/tmp"), seed, ops, &reopen);
    assert!(run.completions > 0, "no file was completed when reopened");
    assert_eq!(run.at_open, 0, "an open copied a file");
    eprintln!("fsx (no whole copies): seed {seed}, {ops} operations");
    let none = ["copy_whole=0", "complete_on_reopen=0"];
    let run = run_seed_in(std::path::Path::new("/tmp"), seed, ops, &none);
    assert_eq!(run.at_open, 0, "{none:?} copied a file whole");
}

/// The same with pending blocks filled only when needed (no workers): every read merges
/// pending bytes, and close, truncate, punch and remount must flush them.
#[test]
fn fsx_with_lazy_copy_after_write_matches_the_model() {
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(5);
    eprintln!("fsx (lazy copy-after-write): seed {seed}, {ops} operations");
    let lazy = [
        "caw_workers=0",
        "complete_after=0",
        "copy_after_write=always",
        "partial_passthrough=off",
    ];
    let (_, deferred) = run_seed(seed, ops, &lazy);
    assert!(deferred > 0, "no write was deferred");
}

/// The default policy with lower files that keep leaving the page cache: a write to a block
/// whose lower data is cached fills it at once, one to a cold block defers it — both kinds
/// of block in the same files.
#[test]
fn fsx_with_cold_lower_files_defers_some_blocks_and_fills_others_at_once() {
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(13);
    eprintln!("fsx (cold lower files): seed {seed}, {ops} operations");
    let base = std::path::Path::new("/tmp");
    let opts = [
        "caw_workers=1",
        "complete_after=0",
        "copy_whole=0",
        "complete_on_reopen=0",
        "partial_passthrough=off",
    ];
    let run = run_seed_with(base, seed, ops, &opts, Lower::Plain, true);
    assert!(run.deferred > 0, "no write was deferred");
}

/// The same with owners and modes kept in xattrs (`xattr_permissions=2`): every chmod is an
/// xattr write, every copy-up records the lower file's mode.
#[test]
fn fsx_with_owners_and_modes_in_xattrs_matches_the_model() {
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(11);
    eprintln!("fsx (xattr_permissions=2): seed {seed}, {ops} operations");
    if !runs_on_disk_upper_only() {
        return;
    }
    run_seed(seed, ops, &["xattr_permissions=2"]);
}

/// The same without directory redirects (`redirect_dir=off`, fuse-overlayfs' behaviour): file
/// renames, the only ones fsx makes, go on as ever.
#[test]
fn fsx_with_redirect_dir_off_matches_the_model() {
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(17);
    eprintln!("fsx (redirect_dir=off): seed {seed}, {ops} operations");
    run_seed(seed, ops, &["redirect_dir=off"]);
}

/// The same with the lower layer on a FUSE file system, as on a shared store's client: its
/// files are read through the daemon and opened at their first read (`FileData::Unopened`).
#[test]
fn fsx_with_the_lower_layer_on_a_store_matches_the_model() {
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(2);
    eprintln!("fsx (lower layer on a FUSE store): seed {seed}, {ops} operations");
    let run = run_seed_with(
        std::path::Path::new("/tmp"),
        seed,
        ops,
        &[],
        Lower::OnStore,
        false,
    );
    assert!(run.lower_opens > 0, "no lower file was opened");
}

/// The same with the lower files metadata-only (kernel overlayfs' metacopy, a composefs
/// image's form), their data in a data-only layer: partial files read the data files.
#[test]
fn fsx_with_metadata_only_lower_files_matches_the_model() {
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(11);
    eprintln!("fsx (metadata-only lower files, data-only layer): seed {seed}, {ops} operations");
    let run = run_seed_with(
        std::path::Path::new("/tmp"),
        seed,
        ops,
        &[],
        Lower::MetadataOnly,
        false,
    );
    assert!(run.lower_opens > 0, "no data file was opened");
}

/// The same with lower and upper on one XFS: copy-up clones the lower file (reflink), and the
/// clones take every operation the partial files take.
#[test]
fn fsx_with_reflink_copy_up_matches_the_model() {
    let ops = fsx_ops();
    let seed = fsx_seed().unwrap_or(7);
    eprintln!("fsx (reflink copy-up on XFS): seed {seed}, {ops} operations");
    if !runs_on_disk_upper_only() {
        return;
    }
    let xfs = LoopFs::new("mkfs.xfs -q -f -m reflink=1", 512 << 20);
    let run = run_seed_in(&xfs.path, seed, ops, &[]);
    assert!(run.reflinks > 0, "no copy-up cloned a file");
}

/// The model while the daemon is killed with SIGKILL a hundred times, at random moments (a
/// mount in the background, whose holder starts the next daemon: takeover.rs): every byte,
/// size, mode and name as without the kills, and no operation sees an error. Requests in
/// flight at a kill are served again by the next daemon; remounts wait for a takeover to end.
#[test]
fn fsx_across_a_hundred_daemon_kills_matches_the_model() {
    across_a_hundred_kills(21, &["restart=on"]);
}

/// The same with every partial-block write left pending until something needs its block
/// (no copy-after-write workers), through writers kept open from one write to the next (a
/// close fills the file's pending blocks), and kills made mostly right after a write: a kill
/// may find blocks pending, and the next daemon writes what the last one left
/// (file/partial/arena.rs) before it serves. The model's files stop being partial after a
/// few hundred operations (truncated, replaced), so only some runs leave blocks to a next
/// daemon; tests/restart.rs `blocks_left_pending_by_a_killed_daemon_are_written_by_the_next`
/// leaves them every time.
#[test]
fn fsx_across_a_hundred_daemon_kills_with_blocks_pending_matches_the_model() {
    let log = across_a_hundred_kills(
        22,
        &[
            "restart=on",
            "caw_workers=0",
            "copy_after_write=always",
            "complete_after=0",
            "complete_on_reopen=0",
            "copy_whole=0",
            HOLD_WRITERS,
        ],
    );
    let left = log
        .matches("copy-after-write blocks the daemon before left pending")
        .count();
    eprintln!("fsx: {left} of the daemons found blocks left pending");
    let deferred: u64 = log
        .split("blocks-deferred=")
        .skip(1)
        .filter_map(|rest| rest.split(' ').next()?.parse::<u64>().ok())
        .sum();
    assert!(deferred > 0, "no write was deferred");
}

/// The same with write-only writers passing through (`partial_passthrough=on`: fsx's writers
/// are write-only), kept open from one write to the next: a kill finds writes waiting on
/// their pre-content events and files marked that the next daemon never opened, which it
/// fills and answers (file/partial/served.rs).
#[test]
fn fsx_across_a_hundred_daemon_kills_with_writers_passing_through_matches_the_model() {
    if !runs_on_disk_upper_only() {
        return; // a memory upper's files never pass through
    }
    let log = across_a_hundred_kills(
        23,
        &[
            "restart=on",
            "partial_passthrough=on",
            "complete_after=0",
            "complete_on_reopen=0",
            "copy_whole=0",
            HOLD_WRITERS,
        ],
    );
    let left = log
        .matches("answering the pre-content events the daemon before left")
        .count();
    eprintln!("fsx: {left} of the daemons found pre-content events left");
}

/// Runs the model across a hundred kills; the daemons' log.
fn across_a_hundred_kills(default_seed: u64, opts: &[&str]) -> String {
    let seed = fsx_seed().unwrap_or(default_seed);
    let mut m = Mount::new(1);
    m.background = true;
    let mut run = start_run(m, seed, opts, &Lower::Plain);
    let run_holds_writers = run.held.is_some();
    let mnt = run.m.mnt.clone();
    let quiet = run.quiet.clone();
    let wrote = run.wrote.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(seed ^ 0xdead);
            let mut kills = 0;
            while kills < 100 && !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(rng.gen_range(5..40)));
                // With writers held, mostly right after a write (briefly: never a stall).
                let start = std::time::Instant::now();
                while run_holds_writers
                    && !wrote.load(std::sync::atomic::Ordering::Relaxed)
                    && start.elapsed() < std::time::Duration::from_millis(100)
                {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                let _no_remount = quiet.lock().unwrap_or_else(|e| e.into_inner());
                let daemon = daemon_of(&mnt).expect("a daemon serves the mount");
                // SAFETY: kill(2) of the daemon of this mount.
                assert_eq!(unsafe { libc::kill(daemon, libc::SIGKILL) }, 0);
                let start = std::time::Instant::now();
                while daemon_of(&mnt).is_none_or(|d| d == daemon) {
                    assert!(
                        start.elapsed() < std::time::Duration::from_secs(30),
                        "no daemon took over after kill {kills}"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                kills += 1;
            }
            kills
        })
    };
    let mut i = 0;
    while !killer.is_finished() {
        run.step(i);
        if i % 250 == 249 {
            run.check_all();
        }
        i += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let kills = killer.join().unwrap();
    assert_eq!(kills, 100);
    eprintln!("fsx: seed {seed}, {i} operations across {kills} kills of the daemon");
    run.check_all();
    let log = std::fs::read_to_string(run.m.background_log()).unwrap_or_default();
    run.remount();
    run.check_all();
    log
}

/// The pid of the daemon serving `mnt` (not its holder), from /proc. Not from `mosaicfs
/// status`: a process started here closes this one's descriptors of the mount's files at its
/// exec, and each such close (FLUSH) fills their pending blocks before the kill.
fn daemon_of(mnt: &std::path::Path) -> Option<i32> {
    use std::os::unix::ffi::OsStrExt;
    let want = mnt.as_os_str().as_bytes();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ours = args.first() != Some(&&b"mosaicfs-holder"[..])
            && args.contains(&want)
            && !stat.contains(") Z ");
        ours.then_some(pid)
    })
}
