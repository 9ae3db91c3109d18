//! Test fixture: real mosaicfs mounts over real directories, unmounted on drop.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_mosaicfs");

/// Held (shared) while a test thread forks a process. A fork copies every open descriptor of
/// the test binary, and the child's exec closes them again: each close of a descriptor of a
/// mosaicfs file sends the daemon a FLUSH, which fills pending copy-after-write blocks, and until
/// then the copy keeps the mount busy (an unmount fails with EBUSY). A test that counts those
/// FLUSHes, or unmounts without retrying, takes it exclusively (`no_forks`) so that sibling
/// tests cannot.
static FORKS: std::sync::RwLock<()> = std::sync::RwLock::new(());

pub fn forking() -> std::sync::RwLockReadGuard<'static, ()> {
    FORKS.read().unwrap_or_else(|e| e.into_inner())
}

/// No other test thread forks while this is held.
pub fn no_forks() -> std::sync::RwLockWriteGuard<'static, ()> {
    FORKS.write().unwrap_or_else(|e| e.into_inner())
}

/// A mounted overlay: `lowers[0]` is the top lower layer.
pub struct Mount {
    pub dir: tempfile::TempDir,
    pub lowers: Vec<PathBuf>,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub mnt: PathBuf,
    pub extra: Vec<String>,
    /// RLIMIT_NOFILE (soft and hard) for the daemon, when a test needs it smaller.
    pub nofile: Option<u64>,
    /// Environment variables for the daemon.
    pub env: Vec<(String, String)>,
    /// Mounted in the background, as mount(8) and container engines mount it: the daemon
    /// beside its holder (it survives being killed), logging to `log_file` in `dir`.
    pub background: bool,
    child: Option<Child>,
    /// Mounted in the background and not yet unmounted.
    in_background: bool,
    /// How much of the background log earlier unmounts returned.
    log_seen: usize,
}

/// The upper store the suite runs against: `MOSAICFS_TEST_UPPER=memory` mounts every
/// read-write overlay with `upper=memory` (the test matrix of .ci/run); unset, the default
/// (disk).
pub fn upper_store() -> Option<String> {
    std::env::var("MOSAICFS_TEST_UPPER")
        .ok()
        .filter(|s| !s.is_empty())
}

/// Whether the upper layer is a directory of objects the test can look into: false in the
/// memory run of the matrix, where it holds the store's image and filestore instead. Checks
/// of what lies in the upper dir are made only when true.
pub fn disk_upper() -> bool {
    upper_store().is_none_or(|s| s == "disk")
}

/// For a test that is about the upper dir's objects (it fills the upper dir before the
/// mount, or stacks it as a lower layer): false, saying so, in the memory run.
pub fn runs_on_disk_upper_only() -> bool {
    let disk = disk_upper();
    if !disk {
        eprintln!("skipped in the memory run: this test is about a disk upper dir's objects");
    }
    disk
}

pub fn is_mounted(mnt: &Path) -> bool {
    let info = fs::read("/proc/self/mountinfo").unwrap();
    let want = mnt.as_os_str().as_bytes();
    info.split(|b| *b == b'\n').any(|line| {
        let fields: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
        fields.len() > 4 && fields[4] == want
    })
}

impl Mount {
    /// Layers made empty; fill them with `lower(i)` / `upper` before `mount()`.
    pub fn new(nlower: usize) -> Mount {
        Mount::new_in(Path::new("/tmp"), nlower)
    }

    /// `new`, with the layers and the mount point in a new directory below `base`.
    pub fn new_in(base: &Path, nlower: usize) -> Mount {
        let dir = tempfile::Builder::new()
            .prefix("mosaicfs-test")
            .tempdir_in(base)
            .unwrap();
        let lowers: Vec<PathBuf> = (0..nlower)
            .map(|i| dir.path().join(format!("lower{i}")))
            .collect();
        for l in &lowers {
            fs::create_dir(l).unwrap();
        }
        let (upper, work, mnt) = (
            dir.path().join("upper"),
            dir.path().join("work"),
            dir.path().join("mnt"),
        );
        for d in [&upper, &work, &mnt] {
            fs::create_dir(d).unwrap();
        }
        Mount {
            dir,
            lowers,
            upper,
            work,
            mnt,
            extra: Vec::new(),
            nofile: None,
            env: Vec::new(),
            background: false,
            child: None,
            in_background: false,
            log_seen: 0,
        }
    }

    /// A mounted overlay whose single lower layer is built by `fill`.
    pub fn with(fill: impl FnOnce(&Path)) -> Mount {
        let mut m = Mount::new(1);
        fill(&m.lowers[0]);
        m.mount();
        m
    }

    pub fn lower(&self, i: usize) -> &Path {
        &self.lowers[i]
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    pub fn options(&self) -> String {
        let lowers: Vec<String> = self
            .lowers
            .iter()
            .map(|l| l.display().to_string())
            .collect();
        let mut o = format!(
            "lowerdir={},upperdir={},workdir={}",
            lowers.join(":"),
            self.upper.display(),
            self.work.display()
        );
        for e in &self.extra {
            o.push(',');
            o.push_str(e);
        }
        if let Some(store) = upper_store()
            && !o.contains(",upper=")
        {
            o.push_str(&format!(",upper={store}"));
        }
        o
    }

    pub fn mount(&mut self) {
        let opts = self.options();
        self.mount_with(&opts);
    }

    pub fn mount_with(&mut self, opts: &str) {
        assert!(
            self.child.is_none() && !self.in_background,
            "already mounted"
        );
        let with_store;
        let opts = match upper_store() {
            Some(store) if opts.contains("upperdir=") && !opts.contains("upper=") => {
                with_store = format!("{opts},upper={store}");
                &with_store
            }
            _ => opts,
        };
        if self.background {
            let opts = format!("{opts},log_file={}", self.background_log().display());
            let _forking = forking();
            let out = Command::new(BIN)
                .env("MOSAICFS_LOG", "info")
                .args(["-o", &opts])
                .arg(&self.mnt)
                .stdin(Stdio::null())
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .output()
                .expect("run mosaicfs");
            assert!(
                out.status.success(),
                "mosaicfs failed to mount: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            self.in_background = true;
            return;
        }
        let _forking = forking();
        let mut cmd = Command::new(BIN);
        cmd.env("MOSAICFS_LOG", "info")
            .args(["-f", "-o", opts])
            .arg(&self.mnt)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(n) = self.nofile {
            use std::os::unix::process::CommandExt;
            let lim = rustix::process::Rlimit {
                current: Some(n),
                maximum: Some(n),
            };
            // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    rustix::process::setrlimit(rustix::process::Resource::Nofile, lim)
                        .map_err(std::io::Error::from)
                });
            }
        }
        let child = cmd.spawn().expect("spawn mosaicfs");
        self.child = Some(child);
        let start = Instant::now();
        while !is_mounted(&self.mnt) {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                let out = self.child.take().unwrap().wait_with_output().unwrap();
                panic!(
                    "mosaicfs exited with {status}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "mount did not come up"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the daemon with `opts` and expects it to refuse the mount: returns what it
    /// printed on stderr.
    pub fn refused(&self, opts: &str) -> String {
        let _forking = forking();
        let out = Command::new(BIN)
            .args(["-f", "-o", opts])
            .arg(&self.mnt)
            .output()
            .unwrap();
        assert!(!out.status.success(), "mounted with {opts}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// Where a daemon in the background logs.
    pub fn background_log(&self) -> PathBuf {
        self.dir.path().join("daemon.log")
    }

    /// The pid after `key` on the status line starting `line`, if the mount answers.
    fn status_pid(&self, line: &str, key: &str) -> Option<i32> {
        status_number(&status(self), line, key).map(|n| n as i32)
    }

    /// Unmounts a mount in the background and waits for its daemon and holder to end;
    /// returns what the daemon logged since it was mounted.
    fn unmount_background(&mut self) -> String {
        self.in_background = false;
        let pids = [
            self.status_pid("daemon:", "pid "),
            self.status_pid("restart:", "holder pid "),
        ];
        let start = Instant::now();
        while let Err(e) = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::empty()) {
            if e != rustix::io::Errno::BUSY || start.elapsed() > Duration::from_secs(10) {
                let _ = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::DETACH);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Gone, or a zombie (PID 1 may not reap here): its last words are in the log.
        let ended = |pid: i32| {
            fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.contains(") Z "))
        };
        for pid in pids.into_iter().flatten() {
            while !ended(pid) {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "process {pid} of the mount did not end"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let log = fs::read(self.background_log()).unwrap_or_default();
        let new = log.get(self.log_seen..).unwrap_or_default();
        self.log_seen = log.len();
        String::from_utf8_lossy(new).into_owned()
    }

    /// Unmounts and waits for the daemon; returns what it printed on stderr.
    pub fn unmount(&mut self) -> String {
        if self.in_background {
            return self.unmount_background();
        }
        let Some(child) = self.child.take() else {
            return String::new();
        };
        let start = Instant::now();
        loop {
            match rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::empty()) {
                Ok(()) => break,
                Err(rustix::io::Errno::BUSY) if start.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => {
                    let _ = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::DETACH);
                    eprintln!("unmount {}: {e}", self.mnt.display());
                    break;
                }
            }
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "daemon failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// The daemon process, for a test that unmounts and waits by itself.
    pub fn take_daemon(&mut self) -> Child {
        self.child.take().expect("mounted")
    }

    pub fn remount(&mut self) {
        self.unmount();
        self.mount();
    }

    /// Kills the daemon with SIGKILL and detaches the dead mount.
    pub fn kill9(&mut self) {
        if self.in_background {
            self.in_background = false;
            // The holder first: it would start another daemon.
            for pid in [
                self.status_pid("restart:", "holder pid "),
                self.status_pid("daemon:", "pid "),
            ]
            .into_iter()
            .flatten()
            {
                // SAFETY: kill(2) of a process of this mount, as its status named it.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        let _ = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::DETACH);
    }

    pub fn pid(&self) -> u32 {
        match &self.child {
            Some(child) => child.id(),
            None => self
                .status_pid("daemon:", "pid ")
                .expect("a daemon serves the mount") as u32,
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.in_background {
            // The daemon and its holder end with the connection.
            let _ = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::DETACH);
        }
        if let Some(mut child) = self.child.take() {
            let _ = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::DETACH);
            let start = Instant::now();
            while child.try_wait().ok().flatten().is_none()
                && start.elapsed() < Duration::from_secs(5)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A fresh file system of `fs_type` made by `mkfs` on a loop image, mounted until dropped.
pub struct LoopFs {
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoopFs {
    pub fn new(mkfs: &str, size: u64) -> LoopFs {
        let dir = tempfile::Builder::new()
            .prefix("mosaicfs-loop")
            .tempdir_in("/var/tmp")
            .unwrap();
        let (img, path) = (dir.path().join("img"), dir.path().join("fs"));
        fs::create_dir(&path).unwrap();
        fs::File::create(&img).unwrap().set_len(size).unwrap();
        sh(&format!("{mkfs} {} >/dev/null 2>&1", img.display()));
        sh(&format!(
            "mount -o loop {} {}",
            img.display(),
            path.display()
        ));
        LoopFs { path, _dir: dir }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

pub fn write(p: impl AsRef<Path>, data: impl AsRef<[u8]>) {
    if let Some(parent) = p.as_ref().parent() {
        fs::create_dir_all(parent).unwrap();
    }
    fs::write(p, data).unwrap();
}

/// Writes `data` at `off` into the existing file `p` (open for writing, write, close).
pub fn write_at(p: impl AsRef<Path>, off: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(data, off).unwrap();
}

pub fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("expected an error").raw_os_error().unwrap()
}

pub fn names(dir: impl AsRef<Path>) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Every path below `dir` with its file's content (`/` for a directory), sorted: a tree to
/// compare two views by.
pub fn tree(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            if fs::symlink_metadata(&p).unwrap().is_dir() {
                out.push((rel, "/".to_string()));
                todo.push(p);
            } else {
                out.push((
                    rel,
                    String::from_utf8_lossy(&fs::read(&p).unwrap()).into_owned(),
                ));
            }
        }
    }
    out.sort();
    out
}

pub fn get_xattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    match rustix::fs::lgetxattr(p, name, &mut buf[..]) {
        Ok(n) => Some(buf[..n].to_vec()),
        Err(_) => None,
    }
}

/// setxattr(2), its error returned (`set_xattr` panics on one).
pub fn try_set_xattr(p: &Path, name: &str, value: &[u8]) -> std::io::Result<()> {
    let path = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: C strings and a buffer of `value.len()` bytes.
    let r = unsafe {
        libc::setxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

pub fn set_xattr(p: &Path, name: &str, value: &[u8]) {
    rustix::fs::lsetxattr(p, name, value, rustix::fs::XattrFlags::empty()).unwrap();
}

pub fn list_xattr(p: &Path) -> Vec<String> {
    let mut buf = vec![0u8; 65536];
    let n = rustix::fs::llistxattr(p, &mut buf[..]).unwrap();
    buf[..n]
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

pub fn mknod_whiteout(dir: &Path, name: &str) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        dir.join(name),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::empty(),
        0,
    )
    .unwrap();
}

/// Runs a shell command, asserting success; returns stdout.
pub fn sh(cmd: &str) -> String {
    run(Command::new("sh").arg("-c").arg(cmd))
}

/// Runs `cmd` to its end (not while a mount is being set up, see `forking`); its stdout.
/// Panics with its output if it fails.
pub fn run(cmd: &mut Command) -> String {
    let out = {
        let _forking = forking();
        cmd.output().unwrap()
    };
    assert!(
        out.status.success(),
        "`{cmd:?}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// Disk usage of a file in bytes (allocated blocks).
pub fn allocated(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(p).unwrap().blocks() * 512
}

/// Bytes the upper layer stores for its object `rel`: the file's allocation on a disk upper;
/// on a memory upper the filestore's, which holds every file's data (an upper bound).
pub fn stored_bytes(m: &Mount, rel: &str) -> u64 {
    if disk_upper() {
        allocated(&m.upper.join(rel))
    } else {
        allocated(&m.upper.join(".mosaicfs-filestore"))
    }
}

/// The request counters the daemon logs when it unmounts ("requests: read=N ... write=M ...").
pub fn served(log: &str, what: &str) -> u64 {
    let key = format!("{what}=");
    let at = log
        .rfind(&key)
        .unwrap_or_else(|| panic!("no '{key}' in daemon log: {log}"));
    log[at + key.len()..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The value of metric line `key` (its name and labels) in `mosaicfs status --prometheus` of
/// `m`, if the report has it.
/// What `mosaicfs status` says of the mount of `m`.
pub fn status(m: &Mount) -> String {
    let _forking = forking();
    let out = Command::new(BIN)
        .arg("status")
        .arg(&m.mnt)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The number after `key` on the line of a `mosaicfs status` report that starts with `line`.
pub fn status_number(status: &str, line: &str, key: &str) -> Option<u64> {
    let l = status.lines().find(|l| l.starts_with(line))?;
    let at = l.find(key)? + key.len();
    l[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

fn metric(m: &Mount, key: &str) -> Option<u64> {
    let _forking = forking();
    let out = Command::new(BIN)
        .args(["status", "--prometheus"])
        .arg(&m.mnt)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| {
        l.strip_prefix(key)?
            .strip_prefix(' ')
            .map(|n| n.parse().unwrap())
    })
}

/// A counter of `mosaicfs status` (its Prometheus name without prefix and `_total`).
pub fn counter(m: &Mount, name: &str) -> u64 {
    metric(m, &format!("mosaicfs_{name}_total"))
        .unwrap_or_else(|| panic!("no counter {name} in mosaicfs status"))
}

/// How many requests of FUSE opcode `op` (the kernel's name, e.g. "READDIRPLUS") the daemon
/// of `m` has answered.
pub fn requests(m: &Mount, op: &str) -> u64 {
    metric(
        m,
        &format!("mosaicfs_request_duration_seconds_count{{op=\"{op}\"}}"),
    )
    .unwrap_or(0)
}

/// Mount options for `Mount::extra`.
pub fn opts(list: &[&str]) -> Vec<String> {
    list.iter().map(|o| o.to_string()).collect()
}

/// `len` bytes of a pseudo-random pattern, the same for the same seed.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The system calls the daemon `pid` makes while `work` runs, as `strace -f -c` sums them
/// (its threads' syscall counters are not available; /proc/PID/task/*/syscall is a snapshot).
pub fn syscalls_during(pid: u32, work: impl FnOnce()) -> String {
    let out = std::env::temp_dir().join(format!("mosaicfs-strace-{pid}"));
    let mut tracer = Command::new("strace")
        .args(["-f", "-c", "-o"])
        .arg(&out)
        .args(["-p", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("strace");
    std::thread::sleep(Duration::from_millis(500));
    work();
    std::thread::sleep(Duration::from_millis(200));
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    tracer.wait().unwrap();
    let s = fs::read_to_string(&out).unwrap_or_default();
    let _ = fs::remove_file(&out);
    s
}

/// The `strace -c` line of `syscall`: `% time, seconds, usecs/call, calls[, errors], syscall`.
fn strace_line<'a>(strace: &'a str, syscall: &str) -> Option<Vec<&'a str>> {
    strace
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.last() == Some(&syscall))
}

/// How many calls of `syscall` a `syscalls_during` summary counts.
pub fn calls(strace: &str, syscall: &str) -> u64 {
    strace_line(strace, syscall)
        .and_then(|f| f.get(3)?.parse().ok())
        .unwrap_or(0)
}

/// How many of them failed.
pub fn failed_calls(strace: &str, syscall: &str) -> u64 {
    strace_line(strace, syscall)
        .filter(|f| f.len() == 6)
        .and_then(|f| f[4].parse().ok())
        .unwrap_or(0)
}

/// A tmpfs mounted for as long as the value lives.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` (e.g. "4m") on the existing directory `at`.
    pub fn mount(at: &Path, size: &str) -> Tmpfs {
        sh(&format!(
            "mount -t tmpfs -o size={size} tmpfs {}",
            at.display()
        ));
        Tmpfs(at.to_path_buf())
    }

    /// Unmounts it now; fails if anything still holds it (EBUSY).
    pub fn unmount(self) -> rustix::io::Result<()> {
        rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::empty())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Layers whose upper and work dirs sit on a tmpfs of `size` (e.g. "4m"), a small file system
/// a test can fill or watch the space of: fill `lower()`, then `mount(extra)`. Fields go in
/// order: the mount, the tmpfs, the directory holding both.
pub struct SmallUpper {
    pub m: Mount,
    _tmpfs: Tmpfs,
    dir: tempfile::TempDir,
}

impl SmallUpper {
    pub fn new(size: &str) -> SmallUpper {
        let dir = tempfile::Builder::new()
            .prefix("mosaicfs-small")
            .tempdir_in("/tmp")
            .unwrap();
        let p = dir.path();
        for d in ["lower", "up", "mnt"] {
            fs::create_dir(p.join(d)).unwrap();
        }
        let tmpfs = Tmpfs::mount(&p.join("up"), size);
        fs::create_dir(p.join("up/u")).unwrap();
        fs::create_dir(p.join("up/w")).unwrap();
        let mut m = Mount::new(0);
        m.mnt = p.join("mnt");
        SmallUpper {
            m,
            _tmpfs: tmpfs,
            dir,
        }
    }

    pub fn lower(&self) -> PathBuf {
        self.dir.path().join("lower")
    }

    /// The upper dir, on the tmpfs.
    pub fn upper(&self) -> PathBuf {
        self.dir.path().join("up/u")
    }

    /// What the tmpfs holds, in bytes.
    pub fn used(&self) -> u64 {
        let s = rustix::fs::statvfs(self.dir.path().join("up")).unwrap();
        (s.f_blocks - s.f_bfree) * s.f_frsize
    }

    /// Mounts with `extra` after the layer options ("" or ",opt=value,...").
    pub fn mount(&mut self, extra: &str) {
        self.m.mount_with(&format!(
            "lowerdir={0}/lower,upperdir={0}/up/u,workdir={0}/up/w{extra}",
            self.dir.path().display()
        ));
    }
}

/// A directory holding empty `l`, `u`, `w` and `m` (lower, upper and work dirs, mount point)
/// for a mount a test makes itself (in a user namespace, say), and its path as a string.
pub fn layer_dirs() -> (tempfile::TempDir, String) {
    let d = tempfile::tempdir().unwrap();
    for dir in ["l", "u", "w", "m"] {
        fs::create_dir(d.path().join(dir)).unwrap();
    }
    let p = d.path().display().to_string();
    (d, p)
}
