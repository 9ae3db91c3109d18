//! FUSE over io_uring (`uring=`, vendored fuser's uring.rs): requests really travel through
//! the rings, the data is exact, a panic, kill -9 and unmount leave nothing behind, and the
//! option's errors say what to do. The whole suite runs once more over io_uring in CI
//! (`MOSAICFS_URING=auto`, .ci/run).
//!
//! The tests switch the kernel's `fuse.enable_uring` and restore it: one at a time.

mod common;
use common::*;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

static PARAMETER: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Sets `fuse.enable_uring` while held; the value before comes back on drop.
struct Uring {
    before: Option<String>,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

impl Uring {
    /// `None` when this kernel has no FUSE over io_uring (the tests then have nothing to do).
    fn set(on: bool) -> Option<Uring> {
        let guard = PARAMETER.lock().unwrap_or_else(|e| e.into_inner());
        let before = fs::read_to_string(PARAM).ok()?;
        fs::write(PARAM, if on { "Y" } else { "N" }).unwrap();
        Some(Uring {
            before: Some(before.trim().to_string()),
            _one_at_a_time: guard,
        })
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        if let Some(b) = self.before.take() {
            let _ = fs::write(PARAM, b);
        }
    }
}

fn status(mnt: &Path) -> String {
    run(Command::new(BIN).arg("status").arg(mnt))
}

#[test]
fn requests_travel_over_io_uring_and_data_is_exact() {
    let Some(_u) = Uring::set(true) else { return };
    let mut m = Mount::new(1);
    let lower: Vec<u8> = (0..(3 << 20)).map(|i| (i * 7 % 251) as u8).collect();
    write(m.lower(0).join("big"), &lower);
    write(m.lower(0).join("small"), b"lower");
    // No `uring=` and no MOSAICFS_URING: the default (`auto`) takes io_uring when the kernel
    // has it on.
    m.env.push(("MOSAICFS_URING".into(), String::new()));
    m.extra.push("timeout=0".into());
    m.mount();
    assert!(
        status(&m.mnt).contains("transport: io_uring"),
        "{}",
        status(&m.mnt)
    );
    // Each ring worker runs on the CPU of its queue: a request is queued on its caller's CPU,
    // and answering it there wakes no other CPU (1.4x more metadata ops/s with 2 processes).
    let mut ring_threads = 0;
    for task in fs::read_dir(format!("/proc/{}/task", m.pid())).unwrap() {
        let task = task.unwrap().path();
        let comm = fs::read_to_string(task.join("comm")).unwrap();
        let Some(qid) = comm
            .trim()
            .strip_prefix("fuser-ring")
            .and_then(|r| r.split('-').next())
        else {
            continue;
        };
        // A worker pins itself as it starts: on a busy machine it may not have run yet.
        let cpus = || {
            fs::read_to_string(task.join("status"))
                .unwrap()
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .unwrap()
                .trim()
                .to_string()
        };
        let since = std::time::Instant::now();
        while cpus() != qid && since.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(cpus(), qid, "{comm}");
        ring_threads += 1;
    }
    assert!(ring_threads >= 2, "{ring_threads} ring workers");
    let mnt = m.mnt.clone();
    let trace = syscalls_during(m.pid(), || {
        for _ in 0..200 {
            fs::metadata(mnt.join("small")).unwrap();
        }
    });
    // Each stat is a LOOKUP and a GETATTR (timeouts 0): both through the rings, none read
    // from /dev/fuse.
    assert!(calls(&trace, "io_uring_enter") >= 300, "{trace}");
    assert!(calls(&trace, "read") < 20, "{trace}");
    // A partial file: writes and reads of it go through the daemon, some larger than a page,
    // one as large as the largest request (1 MiB).
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("big"))
        .unwrap();
    let mut want = lower.clone();
    let big = vec![0x5au8; 1 << 20];
    f.write_all_at(&big, 12345).unwrap();
    want[12345..12345 + (1 << 20)].copy_from_slice(&big);
    f.write_all_at(b"tail", want.len() as u64 - 2).unwrap();
    want.truncate(want.len() - 2);
    want.extend_from_slice(b"tail");
    f.sync_all().unwrap();
    drop(f);
    assert!(fs::read(m.path("big")).unwrap() == want);
    // Names, directories, xattrs, links: the rest of the request types.
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..50 {
        write(m.path(&format!("d/file-with-a-long-name-{i:04}")), b"x");
    }
    assert_eq!(names(m.path("d")).len(), 50);
    set_xattr(&m.path("small"), "user.k", b"v");
    assert_eq!(get_xattr(&m.path("small"), "user.k").unwrap(), b"v");
    fs::rename(m.path("small"), m.path("d/moved")).unwrap();
    fs::hard_link(m.path("d/moved"), m.path("link")).unwrap();
    assert_eq!(fs::read(m.path("link")).unwrap(), b"lower");
    fs::remove_dir_all(m.path("d")).unwrap();
    m.unmount();
    m.mount();
    assert!(fs::read(m.path("big")).unwrap() == want);
    assert_eq!(fs::read(m.path("link")).unwrap(), b"lower");
}

/// FORGETs stay on /dev/fuse; its reader pauses after one so that the kernel hands the next
/// ones over together (`FORGET_PAUSE`, vendored fuser's session.rs): one read and one wake-up
/// per forgotten inode cost the 4-process metadata mix 4 % of its throughput.
///
/// The bound does not depend on the machine's pace: the reader sleeps `PAUSE` after each
/// FORGET it reads, so while the files are being removed it reads at most one per `PAUSE`,
/// and once they are all gone one more read takes the rest. Without the pause it reads one per
/// removed file whenever a removal takes longer than its wake-up (here ~50 µs against 2 ms).
#[test]
fn forgets_beside_the_rings_arrive_in_batches() {
    const PAUSE: Duration = Duration::from_millis(2);
    let Some(_u) = Uring::set(true) else { return };
    let mut m = Mount::new(1);
    m.extra.push("uring=on".into());
    m.mount();
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    let files: u32 = 400;
    for i in 0..files {
        fs::write(d.join(format!("f{i}")), b"x").unwrap();
    }
    let forgets = || requests(&m, "FORGET") + requests(&m, "BATCH_FORGET");
    let before = forgets();
    let start = std::time::Instant::now();
    for i in 0..files {
        // The last link gone and no descriptor open: the kernel evicts the inode and forgets it.
        fs::remove_file(d.join(format!("f{i}"))).unwrap();
    }
    let removing = start.elapsed();
    let known = || -> u64 {
        let s = status(&m.mnt);
        let n = s
            .split("inodes known: ")
            .nth(1)
            .expect("inodes known in status");
        n.split_whitespace().next().unwrap().parse().unwrap()
    };
    while known() > 10 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the daemon still knows {} inodes",
            known()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let reads = forgets() - before;
    let most = (removing.as_micros() / PAUSE.as_micros()) as u64 + 3;
    assert!(
        reads <= most,
        "{reads} FORGET/BATCH_FORGET requests for {files} forgotten inodes removed in {removing:?}: \
         at most {most} with a pause of {PAUSE:?} after each"
    );
    if most >= u64::from(files) {
        eprintln!("removing {files} files took {removing:?}: too slow here to tell batches apart");
    }
}

#[test]
fn a_panic_kill_9_and_unmount_over_io_uring_leave_a_working_next_mount() {
    let Some(_u) = Uring::set(true) else { return };
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), b"lower");
    m.extra.push("uring=on".into());
    m.env.push(("MOSAICFS_TEST_PANIC".into(), "boom".into()));
    m.mount();
    // More panics than there are ring entries: each ends its request with EIO, no entry is lost.
    for _ in 0..40 {
        assert_eq!(errno_of(fs::metadata(m.path("boom"))), libc::EIO);
    }
    write(m.path("after"), b"still served");
    assert_eq!(fs::read(m.path("after")).unwrap(), b"still served");
    if !disk_upper() {
        // A memory upper keeps across a crash what the last sync wrote (README).
        run(Command::new(BIN).arg("sync").arg(&m.mnt));
    }
    m.kill9();
    m.env.clear();
    m.mount();
    assert!(status(&m.mnt).contains("transport: io_uring"));
    assert_eq!(fs::read(m.path("after")).unwrap(), b"still served");
    // An unmount with requests in flight ends every worker: the daemon exits.
    let p = m.path("f");
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let p = p.clone();
            std::thread::spawn(move || {
                for _ in 0..200 {
                    if fs::metadata(&p).is_err() {
                        break;
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(20));
    let mut daemon = m.take_daemon();
    let _ = rustix::mount::unmount(&m.mnt, rustix::mount::UnmountFlags::DETACH);
    for r in readers {
        r.join().unwrap();
    }
    let start = std::time::Instant::now();
    while daemon.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the daemon did not end after the unmount"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    m.mount();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"lower");
}

/// Once the daemon has exited after an unmount, nothing holds the upper layer's file system:
/// containers/storage unmounts or removes it right away. The kernel's passthrough backing
/// files live as long as the /dev/fuse file; a ring holding that file (a fixed file) keeps it
/// until the ring's asynchronous teardown, and an unmount of the upper file system then failed
/// with EBUSY for about 100 ms.
#[test]
fn the_upper_file_system_is_free_as_soon_as_the_daemon_has_exited() {
    let Some(_u) = Uring::set(true) else { return };
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), b"lower");
    let fs_dir = m.dir.path().join("fs");
    fs::create_dir(&fs_dir).unwrap();
    let tmpfs = Tmpfs::mount(&fs_dir, "64m");
    m.upper = fs_dir.join("upper");
    m.work = fs_dir.join("work");
    for d in [&m.upper, &m.work] {
        fs::create_dir(d).unwrap();
    }
    m.extra.push("uring=on".into());
    m.mount();
    for i in 0..4 {
        write(m.path(&format!("new{i}")), b"upper");
        assert_eq!(fs::read(m.path(&format!("new{i}"))).unwrap(), b"upper");
    }
    assert_eq!(fs::read(m.path("f")).unwrap(), b"lower");
    m.unmount();
    tmpfs
        .unmount()
        .expect("the upper layer's file system is busy after the daemon exited");
}

#[test]
fn uring_on_says_how_to_enable_it_and_auto_falls_back() {
    let Some(_u) = Uring::set(false) else { return };
    let mut m = Mount::new(1);
    let err = m.refused(&format!("{},uring=on", m.options()));
    assert!(
        err.contains("enable_uring") && err.contains("uring=auto") && err.lines().count() == 1,
        "{err}"
    );
    m.extra.push("uring=auto".into());
    m.mount();
    assert!(status(&m.mnt).contains("transport: /dev/fuse"));
    write(m.path("f"), b"served");
    m.unmount();
    // lower_timeout= needs answers before the worker: refused with uring=on, /dev/fuse with
    // auto even while the kernel has io_uring on.
    drop(_u);
    let Some(_u) = Uring::set(true) else { return };
    let out = Command::new(BIN)
        .args([
            "-f",
            "-o",
            &format!("{},uring=on,lower_timeout=5", m.options()),
        ])
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("lower_timeout"));
    m.extra.push("lower_timeout=5".into());
    m.mount();
    assert!(status(&m.mnt).contains("transport: /dev/fuse"));
    m.unmount();
    let out = Command::new(BIN)
        .args(["-f", "-o", &format!("{},uring=maybe", m.options())])
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("option 'uring' takes on, auto or off"));
}

/// The nice of the autogroup of the daemon serving `mnt` (None: no autogroups here).
fn autogroup_nice_of_daemon(mnt: &Path) -> Option<i32> {
    let out = Command::new("pgrep")
        .arg("-n")
        .arg("-f")
        .arg(mnt)
        .output()
        .unwrap();
    let pid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let text = fs::read_to_string(format!("/proc/{pid}/autogroup")).ok()?;
    text.split_whitespace().last()?.parse().ok()
}

/// A daemon in the background (as mount(8) starts it) is in an autogroup of its own; over
/// io_uring it raises it to nice -10, since at 0 its callers' wake-ups of the pinned ring
/// workers did not preempt (null round trip 38-40 us against 29-34 us); over /dev/fuse it
/// leaves it at 0, where -10 was slower (docs/PERFORMANCE.md).
#[test]
fn a_background_daemon_raises_its_own_autogroup_over_io_uring_only() {
    if !Path::new("/proc/self/autogroup").exists() {
        return;
    }
    for (on, want) in [(true, -10), (false, 0)] {
        let Some(_u) = Uring::set(on) else { return };
        let m = Mount::new(1);
        let mode = if on { "uring=on" } else { "uring=off" };
        let opts = format!("{},{mode}", m.options());
        run(Command::new(BIN).arg("-o").arg(&opts).arg(&m.mnt));
        let nice = autogroup_nice_of_daemon(&m.mnt);
        run(Command::new("umount").arg(&m.mnt));
        assert_eq!(
            nice,
            Some(want),
            "{mode}: the background daemon's autogroup"
        );
    }
}
