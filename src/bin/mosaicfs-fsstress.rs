//! An fsstress-style concurrency checker for any directory (mosaicfs, kernel overlayfs, tmpfs).
//!
//! In the style of LTP's fsstress (which the package registries here do not carry), written for
//! this project: `-p` worker processes each run `-n` random namespace and data operations in a
//! subtree of their own, `DIR/gG/wI`, while `-r` renamer processes rename, chmod and list the
//! group directories `DIR/gG` above them. Each worker reaches its subtree through a directory
//! descriptor opened once (it follows the renames, as a process's cwd would), so no operation a
//! worker makes can legitimately fail: every worker keeps an exact model of its subtree, and any
//! error, or any result that differs from the model (contents, sizes, link counts, modes,
//! listings), is reported as unexpected.
//!
//! `--state S` saves each worker's final model in S; `--check` (later, e.g. after a remount)
//! compares the tree with those models and checks it for itself: every entry stats and reads,
//! readdir agrees with lookup, and link counts agree with the names found.
//!
//! Exit status: 0 when nothing unexpected happened, 1 otherwise, 2 for bad usage.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;

const USAGE: &str = "usage: mosaicfs-fsstress -d DIR [-p PROCS] [-n OPS] [-r RENAMERS] [-s SEED] \
[--state STATEDIR] [--check]";

#[derive(Clone, Debug)]
struct Args {
    dir: PathBuf,
    procs: usize,
    ops: usize,
    renamers: usize,
    seed: u64,
    state: Option<PathBuf>,
    check: bool,
    /// Internal: run as worker I / renamer I.
    role: Option<(String, usize)>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        dir: PathBuf::new(),
        procs: 20,
        ops: 500,
        renamers: 2,
        seed: 1,
        state: None,
        check: false,
        role: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let num = |s: String| s.parse::<u64>().map_err(|_| format!("not a number: {s}"));
        match arg.as_str() {
            "-d" => a.dir = PathBuf::from(val("-d")?),
            "-p" => a.procs = num(val("-p")?)? as usize,
            "-n" => a.ops = num(val("-n")?)? as usize,
            "-r" => a.renamers = num(val("-r")?)? as usize,
            "-s" => a.seed = num(val("-s")?)?,
            "--state" => a.state = Some(PathBuf::from(val("--state")?)),
            "--check" => a.check = true,
            "--worker" | "--renamer" => {
                let i = num(val(&arg)?)? as usize;
                a.role = Some((arg.trim_start_matches('-').to_string(), i));
            }
            "-h" | "--help" => return Err(USAGE.into()),
            _ => return Err(format!("unknown argument {arg}\n{USAGE}")),
        }
    }
    if a.dir.as_os_str().is_empty() {
        return Err(format!("-d DIR is required\n{USAGE}"));
    }
    if a.procs == 0 {
        return Err("-p must be at least 1".into());
    }
    Ok(a)
}

/// splitmix64: small, seedable, good enough to pick operations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let b = self.next() as u8;
        (0..n)
            .map(|i| b.wrapping_add((i * 7 % 251) as u8))
            .collect()
    }
}

/// Groups of worker subtrees; a renamer moves whole groups.
fn groups(procs: usize) -> usize {
    procs.clamp(1, 4)
}

fn worker_root(dir: &Path, procs: usize, i: usize) -> PathBuf {
    dir.join(format!("g{}", i % groups(procs)))
        .join(format!("w{i}"))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("mosaicfs-fsstress: {e}");
            return ExitCode::from(2);
        }
    };
    let errors = match &args.role {
        Some((role, i)) if role == "worker" => run_worker(&args, *i),
        Some((_, i)) => run_renamer(&args, *i),
        None if args.check => check(&args),
        None => run_all(&args),
    };
    if errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn spawn(args: &Args, role: &str, i: usize) -> Child {
    let mut c = Command::new(std::env::current_exe().expect("own path"));
    c.arg("-d")
        .arg(&args.dir)
        .args(["-p", &args.procs.to_string(), "-n", &args.ops.to_string()])
        .args([
            "-s",
            &args.seed.to_string(),
            &format!("--{role}"),
            &i.to_string(),
        ]);
    if let Some(s) = &args.state {
        c.arg("--state").arg(s);
    }
    c.spawn().expect("spawn a worker process")
}

fn stop_file(args: &Args) -> PathBuf {
    let mut name = args.dir.as_os_str().to_os_string();
    name.push(".fsstress-stop");
    match &args.state {
        Some(s) => s.join("stop"),
        None => PathBuf::from(name),
    }
}

fn run_all(args: &Args) -> usize {
    let start = Instant::now();
    if let Some(s) = &args.state {
        std::fs::create_dir_all(s).expect("state dir");
    }
    let stop = stop_file(args);
    let _ = std::fs::remove_file(&stop);
    for i in 0..args.procs {
        if let Err(e) = std::fs::create_dir_all(worker_root(&args.dir, args.procs, i)) {
            eprintln!(
                "mosaicfs-fsstress: cannot create the worker dirs in {:?}: {e}",
                args.dir
            );
            return 1;
        }
    }
    let workers: Vec<Child> = (0..args.procs).map(|i| spawn(args, "worker", i)).collect();
    let renamers: Vec<Child> = (0..args.renamers)
        .map(|i| spawn(args, "renamer", i))
        .collect();
    let mut failed = 0;
    for mut w in workers {
        if !w.wait().is_ok_and(|s| s.success()) {
            failed += 1;
        }
    }
    let _ = std::fs::write(&stop, b"");
    for mut r in renamers {
        if !r.wait().is_ok_and(|s| s.success()) {
            failed += 1;
        }
    }
    let _ = std::fs::remove_file(&stop);
    println!(
        "mosaicfs-fsstress: {} processes x {} operations, {} renamers, {:.2} s, {} processes saw unexpected results",
        args.procs,
        args.ops,
        args.renamers,
        start.elapsed().as_secs_f64(),
        failed
    );
    failed
}

// ---------------------------------------------------------------------------------------------
// The model of one worker's subtree.

#[derive(Clone, Debug, PartialEq)]
enum Obj {
    Dir {
        mode: u32,
    },
    /// A regular file: an index into `Model::files`.
    File(usize),
    Symlink(String),
}

#[derive(Clone, Debug, Default)]
struct FileObj {
    data: Vec<u8>,
    mode: u32,
}

#[derive(Default)]
struct Model {
    /// Every name below the root, by relative path ("a/b/c").
    names: BTreeMap<String, Obj>,
    files: Vec<FileObj>,
}

impl Model {
    fn nlink(&self, id: usize) -> u64 {
        self.names.values().filter(|o| **o == Obj::File(id)).count() as u64
    }
    fn subdirs(&self, dir: &str) -> u64 {
        self.children(dir)
            .filter(|(_, o)| matches!(o, Obj::Dir { .. }))
            .count() as u64
    }
    fn children<'a>(&'a self, dir: &'a str) -> impl Iterator<Item = (&'a String, &'a Obj)> + 'a {
        self.names.iter().filter(move |(p, _)| parent_of(p) == dir)
    }
    fn pick(&self, rng: &mut Rng, want: impl Fn(&Obj) -> bool) -> Option<String> {
        let v: Vec<&String> = self
            .names
            .iter()
            .filter(|(_, o)| want(o))
            .map(|(p, _)| p)
            .collect();
        (!v.is_empty()).then(|| v[rng.below(v.len())].clone())
    }
    /// A directory ("" is the root) to put a new name in.
    fn pick_dir(&self, rng: &mut Rng) -> String {
        if rng.below(4) == 0 {
            return String::new();
        }
        self.pick(rng, |o| matches!(o, Obj::Dir { .. }))
            .unwrap_or_default()
    }
    fn under(&self, dir: &str) -> Vec<String> {
        let prefix = format!("{dir}/");
        self.names
            .keys()
            .filter(|p| p.starts_with(&prefix))
            .cloned()
            .collect()
    }
    /// Save as text: one line per name.
    fn save(&self, path: &Path) -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        for (p, o) in &self.names {
            match o {
                Obj::Dir { mode } => writeln!(f, "D\t{mode:o}\t{p}")?,
                Obj::File(id) => {
                    let fo = &self.files[*id];
                    writeln!(
                        f,
                        "F\t{:o}\t{}\t{:016x}\t{id}\t{p}",
                        fo.mode,
                        fo.data.len(),
                        hash(&fo.data)
                    )?
                }
                Obj::Symlink(t) => writeln!(f, "L\t{t}\t{p}")?,
            }
        }
        f.flush()
    }
}

fn parent_of(p: &str) -> &str {
    p.rfind('/').map_or("", |i| &p[..i])
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

fn hash(b: &[u8]) -> u64 {
    // FNV-1a
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// A path relative to a worker's root; "" is the root itself.
fn rel(p: &str) -> &str {
    if p.is_empty() { "." } else { p }
}

// ---------------------------------------------------------------------------------------------
// Workers.

struct Worker {
    id: usize,
    root: std::rc::Rc<OwnedFd>,
    model: Model,
    rng: Rng,
    errors: usize,
    serial: usize,
}

macro_rules! unexpected {
    ($w:expr, $($arg:tt)*) => {{
        $w.errors += 1;
        eprintln!("mosaicfs-fsstress: worker {}: {}", $w.id, format!($($arg)*));
    }};
}

fn open_root(path: &Path) -> std::io::Result<OwnedFd> {
    // A renamer may have moved a group away for a moment.
    let start = Instant::now();
    loop {
        match rustix::fs::open(
            path,
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => return Ok(fd),
            Err(Errno::NOENT) if start.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn run_worker(args: &Args, id: usize) -> usize {
    let root_path = worker_root(&args.dir, args.procs, id);
    let root = match open_root(&root_path) {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!("mosaicfs-fsstress: worker {id}: cannot open {root_path:?}: {e}");
            return 1;
        }
    };
    let mut w = Worker {
        id,
        model: Model::default(),
        rng: Rng(args.seed.wrapping_mul(1_000_003).wrapping_add(id as u64)),
        errors: 0,
        serial: 0,
        root: std::rc::Rc::new(root),
    };
    if let Err(e) = scan(w.root.as_fd(), "", &mut w.model, &mut HashMap::new()) {
        eprintln!("mosaicfs-fsstress: worker {id}: cannot read its subtree: {e}");
        return 1;
    }
    for _ in 0..args.ops {
        w.step();
    }
    // A last pass over everything: each name stats and reads as the model says.
    let names: Vec<String> = w.model.names.keys().cloned().collect();
    for p in names {
        w.verify(&p);
    }
    w.verify_listing("");
    if let Some(s) = &args.state
        && let Err(e) = w.model.save(&s.join(format!("w{id}")))
    {
        unexpected!(w, "cannot save the model: {e}");
    }
    w.errors
}

/// Reads the tree below `dir` into the model (hard links: one object per inode).
fn scan(
    root: BorrowedFd<'_>,
    dir: &str,
    m: &mut Model,
    inos: &mut HashMap<u64, usize>,
) -> std::io::Result<()> {
    for name in list(root, dir)? {
        let p = join(dir, &name);
        let st = rustix::fs::statat(root, p.as_str(), AtFlags::SYMLINK_NOFOLLOW)?;
        let mode = st.st_mode & 0o7777;
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                m.names.insert(p.clone(), Obj::Dir { mode });
                scan(root, &p, m, inos)?;
            }
            libc::S_IFREG => {
                let id = match inos.get(&st.st_ino) {
                    Some(id) => *id,
                    None => {
                        let data = read_all(root, &p)?;
                        m.files.push(FileObj { data, mode });
                        inos.insert(st.st_ino, m.files.len() - 1);
                        m.files.len() - 1
                    }
                };
                m.names.insert(p, Obj::File(id));
            }
            libc::S_IFLNK => {
                let t = rustix::fs::readlinkat(root, p.as_str(), Vec::new())?;
                m.names
                    .insert(p, Obj::Symlink(t.to_string_lossy().into_owned()));
            }
            _ => {}
        }
    }
    Ok(())
}

fn list(root: BorrowedFd<'_>, dir: &str) -> std::io::Result<Vec<String>> {
    let fd = rustix::fs::openat(
        root,
        rel(dir),
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for e in rustix::fs::Dir::read_from(&fd)? {
        let e = e?;
        let n = e.file_name().to_string_lossy().into_owned();
        if n != "." && n != ".." {
            names.push(n);
        }
    }
    names.sort();
    Ok(names)
}

fn read_all(root: BorrowedFd<'_>, p: &str) -> std::io::Result<Vec<u8>> {
    let fd = rustix::fs::openat(
        root,
        p,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    )?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    loop {
        let n = rustix::io::pread(&fd, &mut buf, out.len() as u64)?;
        if n == 0 {
            return Ok(out);
        }
        out.extend_from_slice(&buf[..n]);
    }
}

/// Opens `p` below `root` (an existing file: no creation mode).
fn open_rel(root: BorrowedFd<'_>, p: &str, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(root, p, flags, Mode::empty())
}

fn write_all_at(fd: BorrowedFd<'_>, mut buf: &[u8], mut off: u64) -> rustix::io::Result<()> {
    while !buf.is_empty() {
        let n = rustix::io::pwrite(fd, buf, off)?;
        buf = &buf[n..];
        off += n as u64;
    }
    Ok(())
}

const OPS: &[(&str, usize)] = &[
    ("create", 10),
    ("write", 8),
    ("append", 5),
    ("read", 8),
    ("truncate", 4),
    ("stat", 8),
    ("readdir", 5),
    ("rename", 6),
    ("rename_dir", 3),
    ("unlink", 5),
    ("mkdir", 6),
    ("rmdir", 3),
    ("link", 4),
    ("symlink", 3),
    ("chmod", 4),
    ("fsync", 2),
    ("xattr", 3),
];

impl Worker {
    fn fresh(&mut self, dir: &str, tag: &str) -> String {
        self.serial += 1;
        join(dir, &format!("{tag}{}-{}", self.id, self.serial))
    }

    fn step(&mut self) {
        let total: usize = OPS.iter().map(|(_, w)| w).sum();
        let mut r = self.rng.below(total);
        let op = OPS
            .iter()
            .find(|(_, w)| {
                if r < *w {
                    true
                } else {
                    r -= w;
                    false
                }
            })
            .map(|(n, _)| *n)
            .unwrap();
        let root = self.root.clone();
        if let Err((what, e)) = self.op(op, root.as_fd()) {
            unexpected!(self, "{op} {what}: {e}");
        }
    }

    fn file(&mut self) -> Option<(String, usize)> {
        let p = self
            .model
            .pick(&mut self.rng, |o| matches!(o, Obj::File(_)))?;
        match self.model.names[&p] {
            Obj::File(id) => Some((p, id)),
            _ => None,
        }
    }

    /// Does operation `op` on the tree and on the model. One piece: one arm per operation, each
    /// a system call and the model's change beside it, read best side by side.
    fn op(&mut self, op: &str, root: BorrowedFd<'_>) -> Result<(), (String, std::io::Error)> {
        let e = |p: &str| {
            let p = p.to_string();
            move |e: Errno| (p, std::io::Error::from(e))
        };
        match op {
            "create" => {
                let dir = self.model.pick_dir(&mut self.rng);
                let p = self.fresh(&dir, "f");
                let n = self.rng.below(20000);
                let data = self.rng.bytes(n);
                let fd = rustix::fs::openat(
                    root,
                    p.as_str(),
                    OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o644),
                )
                .map_err(e(&p))?;
                write_all_at(fd.as_fd(), &data, 0).map_err(e(&p))?;
                self.model.files.push(FileObj { data, mode: 0o644 });
                self.model
                    .names
                    .insert(p, Obj::File(self.model.files.len() - 1));
            }
            "write" | "append" => {
                let Some((p, id)) = self.file() else {
                    return Ok(());
                };
                let n = 1 + self.rng.below(12000);
                let data = self.rng.bytes(n);
                let len = self.model.files[id].data.len();
                if op == "append" {
                    let fd = open_rel(root, &p, OFlags::WRONLY | OFlags::APPEND | OFlags::CLOEXEC)
                        .map_err(e(&p))?;
                    let mut rest = &data[..];
                    while !rest.is_empty() {
                        let k = rustix::io::write(&fd, rest).map_err(e(&p))?;
                        rest = &rest[k..];
                    }
                    self.model.files[id].data.extend_from_slice(&data);
                } else {
                    let off = self.rng.below(len + 4096);
                    let fd = open_rel(root, &p, OFlags::RDWR | OFlags::CLOEXEC).map_err(e(&p))?;
                    write_all_at(fd.as_fd(), &data, off as u64).map_err(e(&p))?;
                    let f = &mut self.model.files[id].data;
                    if f.len() < off + n {
                        f.resize(off + n, 0);
                    }
                    f[off..off + n].copy_from_slice(&data);
                }
            }
            "read" => {
                let Some((p, _)) = self.file() else {
                    return Ok(());
                };
                self.verify(&p);
            }
            "truncate" => {
                let Some((p, id)) = self.file() else {
                    return Ok(());
                };
                let len = self.model.files[id].data.len();
                let to = self.rng.below(len * 2 + 100);
                let fd = open_rel(root, &p, OFlags::WRONLY | OFlags::CLOEXEC).map_err(e(&p))?;
                rustix::fs::ftruncate(&fd, to as u64).map_err(e(&p))?;
                self.model.files[id].data.resize(to, 0);
            }
            "stat" => {
                let p = self.model.pick(&mut self.rng, |_| true).unwrap_or_default();
                self.verify_stat(&p);
            }
            "readdir" => {
                let d = self.model.pick_dir(&mut self.rng);
                self.verify_listing(&d);
            }
            "rename" => {
                let Some(src) = self
                    .model
                    .pick(&mut self.rng, |o| !matches!(o, Obj::Dir { .. }))
                else {
                    return Ok(());
                };
                // Onto a fresh name or over another non-directory.
                let dst = match self
                    .model
                    .pick(&mut self.rng, |o| !matches!(o, Obj::Dir { .. }))
                {
                    Some(d) if self.rng.below(3) == 0 && d != src => d,
                    _ => {
                        let dir = self.model.pick_dir(&mut self.rng);
                        self.fresh(&dir, "r")
                    }
                };
                rustix::fs::renameat(root, src.as_str(), root, dst.as_str())
                    .map_err(e(&format!("{src} -> {dst}")))?;
                // Two names of one file: rename(2) leaves both. (Two symlinks with the same
                // target are two inodes: the source name goes.)
                let same_file = matches!(
                    (self.model.names.get(&src), self.model.names.get(&dst)),
                    (Some(Obj::File(a)), Some(Obj::File(b))) if a == b
                );
                if !same_file {
                    let o = self.model.names.remove(&src).unwrap();
                    self.model.names.insert(dst, o);
                }
            }
            "rename_dir" => {
                let Some(src) = self
                    .model
                    .pick(&mut self.rng, |o| matches!(o, Obj::Dir { .. }))
                else {
                    return Ok(());
                };
                let mut dir = self.model.pick_dir(&mut self.rng);
                if dir == src || dir.starts_with(&format!("{src}/")) {
                    dir = String::new();
                }
                let dst = self.fresh(&dir, "m");
                rustix::fs::renameat(root, src.as_str(), root, dst.as_str())
                    .map_err(e(&format!("{src} -> {dst}")))?;
                let moved = self.model.under(&src);
                let o = self.model.names.remove(&src).unwrap();
                self.model.names.insert(dst.clone(), o);
                for p in moved {
                    let o = self.model.names.remove(&p).unwrap();
                    self.model
                        .names
                        .insert(format!("{dst}{}", &p[src.len()..]), o);
                }
            }
            "unlink" => {
                let Some(p) = self
                    .model
                    .pick(&mut self.rng, |o| !matches!(o, Obj::Dir { .. }))
                else {
                    return Ok(());
                };
                rustix::fs::unlinkat(root, p.as_str(), AtFlags::empty()).map_err(e(&p))?;
                self.model.names.remove(&p);
            }
            "mkdir" => {
                let dir = self.model.pick_dir(&mut self.rng);
                let p = self.fresh(&dir, "d");
                rustix::fs::mkdirat(root, p.as_str(), Mode::from_raw_mode(0o755)).map_err(e(&p))?;
                self.model.names.insert(p, Obj::Dir { mode: 0o755 });
            }
            "rmdir" => {
                let empty: Vec<String> = self
                    .model
                    .names
                    .iter()
                    .filter(|(p, o)| {
                        matches!(o, Obj::Dir { .. }) && self.model.children(p).next().is_none()
                    })
                    .map(|(p, _)| p.clone())
                    .collect();
                if empty.is_empty() {
                    return Ok(());
                }
                let p = empty[self.rng.below(empty.len())].clone();
                rustix::fs::unlinkat(root, p.as_str(), AtFlags::REMOVEDIR).map_err(e(&p))?;
                self.model.names.remove(&p);
            }
            "link" => {
                let Some((src, id)) = self.file() else {
                    return Ok(());
                };
                let dir = self.model.pick_dir(&mut self.rng);
                let dst = self.fresh(&dir, "l");
                rustix::fs::linkat(root, src.as_str(), root, dst.as_str(), AtFlags::empty())
                    .map_err(e(&format!("{src} -> {dst}")))?;
                self.model.names.insert(dst.clone(), Obj::File(id));
                self.verify_stat(&dst);
                self.verify_stat(&src);
            }
            "symlink" => {
                let dir = self.model.pick_dir(&mut self.rng);
                let p = self.fresh(&dir, "s");
                let target = format!("target-{}", self.rng.below(1000));
                rustix::fs::symlinkat(target.as_str(), root, p.as_str()).map_err(e(&p))?;
                self.model.names.insert(p.clone(), Obj::Symlink(target));
                self.verify(&p);
            }
            "chmod" => {
                let Some(p) = self
                    .model
                    .pick(&mut self.rng, |o| !matches!(o, Obj::Symlink(_)))
                else {
                    return Ok(());
                };
                let mode = [0o600, 0o640, 0o644, 0o700, 0o755, 0o750][self.rng.below(6)];
                rustix::fs::chmodat(
                    root,
                    p.as_str(),
                    Mode::from_raw_mode(mode),
                    AtFlags::empty(),
                )
                .map_err(e(&p))?;
                match self.model.names.get_mut(&p).unwrap() {
                    Obj::Dir { mode: m } => *m = mode,
                    Obj::File(id) => self.model.files[*id].mode = mode,
                    Obj::Symlink(_) => {}
                }
                self.verify_stat(&p);
            }
            "fsync" => {
                let Some((p, _)) = self.file() else {
                    return Ok(());
                };
                let fd = open_rel(root, &p, OFlags::RDWR | OFlags::CLOEXEC).map_err(e(&p))?;
                rustix::fs::fsync(&fd).map_err(e(&p))?;
            }
            "xattr" => {
                let Some((p, _)) = self.file() else {
                    return Ok(());
                };
                let v = format!("v{}", self.rng.below(1000));
                rustix::fs::setxattr(
                    self.abs(&p).as_path(),
                    "user.fsstress",
                    v.as_bytes(),
                    rustix::fs::XattrFlags::empty(),
                )
                .map_err(e(&p))?;
                let mut buf = [0u8; 64];
                let n = rustix::fs::getxattr(self.abs(&p).as_path(), "user.fsstress", &mut buf[..])
                    .map_err(e(&p))?;
                if &buf[..n] != v.as_bytes() {
                    unexpected!(
                        self,
                        "xattr {p}: read back {:?}, wrote {v}",
                        String::from_utf8_lossy(&buf[..n])
                    );
                }
            }
            _ => unreachable!(),
        }
        Ok(())
    }

    /// A path to `p` that goes through the root descriptor (for calls without an *at form).
    fn abs(&self, p: &str) -> PathBuf {
        PathBuf::from(format!(
            "/proc/self/fd/{}/{p}",
            std::os::fd::AsRawFd::as_raw_fd(&*self.root)
        ))
    }

    fn verify_stat(&mut self, p: &str) {
        let root = self.root.as_fd();
        let st = match rustix::fs::statat(root, rel(p), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(e) => return unexpected!(self, "stat {p}: {}", std::io::Error::from(e)),
        };
        let kind = st.st_mode & libc::S_IFMT;
        let mode = st.st_mode & 0o7777;
        match self.model.names.get(p).cloned() {
            None if p.is_empty() => {}
            None => unexpected!(self, "stat {p}: exists, but the model has no such name"),
            Some(Obj::Dir { mode: m }) => {
                if kind != libc::S_IFDIR || mode != m {
                    unexpected!(
                        self,
                        "stat {p}: mode {:o}, expected a directory with {m:o}",
                        st.st_mode
                    );
                }
                let subdirs = self.model.subdirs(p);
                if st.st_nlink != 1 && st.st_nlink != subdirs + 2 {
                    unexpected!(
                        self,
                        "stat {p}: st_nlink {}, expected {} (2 + subdirectories)",
                        st.st_nlink,
                        subdirs + 2
                    );
                }
            }
            Some(Obj::File(id)) => {
                let want = self.model.nlink(id);
                let f = &self.model.files[id];
                if kind != libc::S_IFREG || mode != f.mode || st.st_size as usize != f.data.len() {
                    unexpected!(
                        self,
                        "stat {p}: mode {:o} size {}, expected a file with {:o} size {}",
                        st.st_mode,
                        st.st_size,
                        f.mode,
                        f.data.len()
                    );
                }
                if st.st_nlink != want {
                    unexpected!(self, "stat {p}: st_nlink {}, expected {want}", st.st_nlink);
                }
            }
            Some(Obj::Symlink(_)) => {
                if kind != libc::S_IFLNK {
                    unexpected!(self, "stat {p}: mode {:o}, expected a symlink", st.st_mode);
                }
            }
        }
    }

    /// Stats `p` and reads it (a file's bytes, a symlink's target, a directory's listing).
    fn verify(&mut self, p: &str) {
        self.verify_stat(p);
        let root = self.root.as_fd();
        match self.model.names.get(p).cloned() {
            Some(Obj::File(id)) => match read_all(root, p) {
                Ok(data) => {
                    let want = &self.model.files[id].data;
                    if data != *want {
                        let at = data.iter().zip(want.iter()).position(|(a, b)| a != b);
                        unexpected!(
                            self,
                            "read {p}: {} bytes differ from the {} written (first at {at:?})",
                            data.len(),
                            want.len()
                        );
                    }
                }
                Err(e) => unexpected!(self, "read {p}: {e}"),
            },
            Some(Obj::Symlink(t)) => match rustix::fs::readlinkat(root, p, Vec::new()) {
                Ok(got) if got.to_string_lossy() == t => {}
                Ok(got) => unexpected!(self, "readlink {p}: {got:?}, expected {t}"),
                Err(e) => unexpected!(self, "readlink {p}: {}", std::io::Error::from(e)),
            },
            Some(Obj::Dir { .. }) => self.verify_listing(p),
            None => {}
        }
    }

    fn verify_listing(&mut self, dir: &str) {
        let want: Vec<String> = self
            .model
            .children(dir)
            .map(|(p, _)| p[p.rfind('/').map_or(0, |i| i + 1)..].to_string())
            .collect();
        match list(self.root.as_fd(), dir) {
            Ok(got) if got == want => {}
            Ok(got) => unexpected!(self, "readdir {dir:?}: {got:?}, expected {want:?}"),
            Err(e) => unexpected!(self, "readdir {dir:?}: {e}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Renamers: move, chmod and list the group directories above the workers.

fn run_renamer(args: &Args, id: usize) -> usize {
    let stop = stop_file(args);
    let mut rng = Rng(args.seed ^ 0x5eed ^ ((id as u64) << 32));
    let mut errors = 0;
    let mut rounds = 0u64;
    let groups = groups(args.procs);
    let report = |what: String, e: std::io::Error, errors: &mut usize| {
        *errors += 1;
        eprintln!("mosaicfs-fsstress: renamer {id}: {what}: {e}");
    };
    while !stop.exists() {
        rounds += 1;
        // Renamer k owns the groups g with g % renamers == k, so no two renamers race on one name.
        let g = id + args.renamers.max(1) * rng.below(groups.div_ceil(args.renamers.max(1)));
        if g >= groups {
            continue;
        }
        let from = args.dir.join(format!("g{g}"));
        let to = args.dir.join(format!("g{g}.moved-{id}"));
        if let Err(e) = std::fs::rename(&from, &to) {
            report(format!("rename {from:?}"), e, &mut errors);
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = if rounds.is_multiple_of(2) {
            0o755
        } else {
            0o775
        };
        if let Err(e) = std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode)) {
            report(format!("chmod {to:?}"), e, &mut errors);
        }
        if let Err(e) = std::fs::read_dir(&to).and_then(|d| d.collect::<Result<Vec<_>, _>>()) {
            report(format!("readdir {to:?}"), e, &mut errors);
        }
        if let Err(e) = std::fs::rename(&to, &from) {
            report(format!("rename {to:?} back"), e, &mut errors);
            return errors.max(1);
        }
        std::thread::sleep(Duration::from_micros(rng.below(2000) as u64));
    }
    errors
}

// ---------------------------------------------------------------------------------------------
// --check: the tree against the saved models, and against itself.

/// One piece: one walk of the tree, each check beside the walk's step it looks at.
fn check(args: &Args) -> usize {
    let mut errors = 0;
    let mut report = |msg: String| {
        errors += 1;
        eprintln!("mosaicfs-fsstress: check: {msg}");
    };
    // The whole tree: stat and read every entry, lookups agree with readdir, link counts agree.
    let root = match rustix::fs::open(
        &args.dir,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(e) => {
            report(format!(
                "cannot open {:?}: {}",
                args.dir,
                std::io::Error::from(e)
            ));
            return errors;
        }
    };
    let mut links: HashMap<u64, (u64, u64, String)> = HashMap::new();
    let mut stack = vec![String::new()];
    let mut entries = 0u64;
    while let Some(dir) = stack.pop() {
        let names = match list(root.as_fd(), &dir) {
            Ok(n) => n,
            Err(e) => {
                report(format!("readdir {dir:?}: {e}"));
                continue;
            }
        };
        let mut subdirs = 0;
        for n in names {
            entries += 1;
            let p = join(&dir, &n);
            let st = match rustix::fs::statat(root.as_fd(), p.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(e) => {
                    report(format!(
                        "readdir lists {p:?}, but lookup fails: {}",
                        std::io::Error::from(e)
                    ));
                    continue;
                }
            };
            match st.st_mode & libc::S_IFMT {
                libc::S_IFDIR => {
                    subdirs += 1;
                    stack.push(p);
                }
                libc::S_IFREG => {
                    if let Err(e) = read_all(root.as_fd(), &p) {
                        report(format!("read {p:?}: {e}"));
                    }
                    let l = links
                        .entry(st.st_ino)
                        .or_insert((st.st_nlink, 0, p.clone()));
                    l.1 += 1;
                    if l.0 != st.st_nlink {
                        report(format!(
                            "{p:?} and {:?} are one inode with st_nlink {} and {}",
                            l.2, st.st_nlink, l.0
                        ));
                    }
                }
                libc::S_IFLNK => {
                    if let Err(e) = rustix::fs::readlinkat(root.as_fd(), p.as_str(), Vec::new()) {
                        report(format!("readlink {p:?}: {}", std::io::Error::from(e)));
                    }
                }
                _ => {}
            }
        }
        match rustix::fs::statat(root.as_fd(), rel(&dir), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if st.st_nlink != 1 && st.st_nlink != subdirs + 2 => report(format!(
                "directory {dir:?}: st_nlink {}, but {subdirs} subdirectories",
                st.st_nlink
            )),
            Ok(_) => {}
            Err(e) => report(format!("stat {dir:?}: {}", std::io::Error::from(e))),
        }
    }
    for (ino, (nlink, seen, p)) in &links {
        if nlink != seen {
            report(format!(
                "{p:?} (inode {ino}): st_nlink {nlink}, but {seen} names found"
            ));
        }
    }
    // Each worker's subtree against its saved model.
    let mut models = 0;
    if let Some(state) = &args.state {
        for i in 0..args.procs {
            let saved = match std::fs::read_to_string(state.join(format!("w{i}"))) {
                Ok(s) => s,
                Err(e) => {
                    report(format!("model of worker {i}: {e}"));
                    continue;
                }
            };
            models += 1;
            let wroot = worker_root(&args.dir, args.procs, i);
            let fd = match rustix::fs::open(
                &wroot,
                OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(e) => {
                    report(format!("{wroot:?}: {}", std::io::Error::from(e)));
                    continue;
                }
            };
            let mut now = Model::default();
            if let Err(e) = scan(fd.as_fd(), "", &mut now, &mut HashMap::new()) {
                report(format!("{wroot:?}: {e}"));
                continue;
            }
            let tmp = std::env::temp_dir().join(format!(
                "mosaicfs-fsstress-check-{}-{i}",
                std::process::id()
            ));
            let same = now
                .save(&tmp)
                .ok()
                .and_then(|_| std::fs::read_to_string(&tmp).ok());
            let _ = std::fs::remove_file(&tmp);
            let strip = |s: &str| -> Vec<String> {
                // File ids differ between runs; hard links are checked by st_nlink above.
                s.lines()
                    .map(|l| {
                        let f: Vec<&str> = l.split('\t').collect();
                        if f[0] == "F" {
                            format!("{}\t{}\t{}\t{}\t{}", f[0], f[1], f[2], f[3], f[5])
                        } else {
                            l.to_string()
                        }
                    })
                    .collect()
            };
            let (want, got) = (strip(&saved), strip(&same.unwrap_or_default()));
            if want != got {
                let missing: Vec<&String> =
                    want.iter().filter(|l| !got.contains(l)).take(5).collect();
                let extra: Vec<&String> =
                    got.iter().filter(|l| !want.contains(l)).take(5).collect();
                report(format!(
                    "worker {i}'s subtree differs from its model: missing {missing:?}, unexpected {extra:?}"
                ));
            }
        }
    }
    println!(
        "mosaicfs-fsstress: checked {entries} entries, {} inodes, {models} worker models: {errors} problems",
        links.len()
    );
    errors
}
