//! The command line: errors, background mode, the mount helper and unmounting.

mod common;

use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn layers() -> (tempfile::TempDir, String) {
    let d = tempfile::Builder::new()
        .prefix("mosaicfs-cli")
        .tempdir_in("/tmp")
        .unwrap();
    for s in ["l", "u", "w", "m"] {
        fs::create_dir(d.path().join(s)).unwrap();
    }
    let p = d.path().display().to_string();
    (d, p)
}

fn wait_unmounted(mnt: &std::path::Path) {
    let start = Instant::now();
    while is_mounted(mnt) {
        assert!(start.elapsed() < Duration::from_secs(10), "still mounted");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn version_and_help() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("mosaicfs version"));
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    // Every mount option, as the man page has it.
    for option in [
        "lowerdir=A:B:...",
        "copy_whole=",
        "upper=memory",
        "uring=",
        "metrics=",
    ] {
        assert!(help.contains(option), "{option} in --help:\n{help}");
    }
    // Each command's help, both ways of asking; an unknown one is an error.
    for cmd in ["status", "sync", "complete", "fsck", "export"] {
        for args in [vec!["help", cmd], vec![cmd, "--help"]] {
            let out = Command::new(BIN).args(&args).output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{args:?}: {text}");
            assert!(
                text.starts_with(&format!("usage: mosaicfs {cmd}")),
                "{args:?}: {text}"
            );
            assert!(text.lines().count() > 3, "{args:?}: {text}");
        }
    }
    let out = Command::new(BIN).arg("help").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("lowerdir=A:B:..."));
    let (code, err) = run(&["help", "bogus"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("no help for 'bogus'") && err.contains("fsck"),
        "{err}"
    );
}

/// A mount unmounted before its daemon read the kernel's INIT request (a container that ends
/// at once, or any quick umount: the mount point shows the mount before the daemon has read
/// anything) ends the daemon cleanly: exit 0 and a line that says so. It used to fail with
/// "cannot mount on ...: FUSE device disconnected during handshake" (seen in make test).
#[test]
fn a_mount_unmounted_before_its_first_request_ends_the_daemon_cleanly() {
    let mut m = Mount::new(1);
    m.env
        .push(("MOSAICFS_TEST_HANDSHAKE_PAUSE_MS".into(), "500".into()));
    m.mount();
    let log = m.unmount();
    assert!(
        log.contains("unmounted before the kernel's first request"),
        "{log}"
    );
    assert!(!log.contains("cannot mount"), "{log}");
}

/// What kernel overlayfs refuses at mount, or what would fail every write after it, is refused
/// before mounting with one line saying what to do.
#[test]
fn a_mount_whose_connection_ends_during_the_check_is_named_dead() {
    // The command's statfs of the mount point waits on a daemon that answers nothing (stopped)
    // and dies: statfs gets ECONNABORTED, not ENOTCONN, and a stat answered from the kernel's
    // cache still sees a directory. It must be named a dead mount, not mounted over (seen once
    // in make test: "cannot be used: Software caused connection abort").
    let mut m = Mount::new(1);
    m.mount();
    let daemon = m.pid() as i32;
    let _ = unsafe { libc::kill(daemon, libc::SIGSTOP) };
    let cmd = Command::new(BIN)
        .args(["-o", &m.options(), m.mnt.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Until its statfs waits for the stopped daemon: for its answer, or (over io_uring, where
    // a stopped daemon leaves no ring entry to carry it) for the request to be taken.
    let wchan = format!("/proc/{}/wchan", cmd.id());
    let start = Instant::now();
    while !fs::read_to_string(&wchan)
        .is_ok_and(|w| w.contains("request_wait_answer") || w.contains("fuse_get_req"))
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "statfs never waited: {:?}",
            fs::read_to_string(&wchan)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The daemon dies with the request queued: its last /dev/fuse descriptor ends the
    // connection.
    let _ = unsafe { libc::kill(daemon, libc::SIGKILL) };
    let out = cmd.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        let _ = rustix::mount::unmount(&m.mnt, rustix::mount::UnmountFlags::DETACH);
    }
    m.kill9();
    assert!(!out.status.success(), "mounted over a dead mount");
    assert!(err.contains("holds a dead FUSE mount"), "{err}");
}

#[test]
fn bad_layouts_are_refused_before_mounting() {
    let (d, p) = layers();
    fs::create_dir_all(format!("{p}/l/up")).unwrap();
    fs::create_dir_all(format!("{p}/l/wk")).unwrap();
    let refused = |opts: String, want: &str| {
        let (code, err) = run(&["-f", "-o", &opts, &format!("{p}/m")]);
        assert_ne!(code, 0, "{opts} must fail");
        assert!(err.contains(want), "{opts}: expected '{want}' in: {err}");
        assert!(err.trim().lines().count() <= 2, "short message: {err}");
        assert!(!is_mounted(std::path::Path::new(&format!("{p}/m"))));
    };
    // An upper or work dir inside a lower layer (kernel overlayfs: "overlapping layers").
    refused(
        format!("lowerdir={p}/l,upperdir={p}/l/up,workdir={p}/w"),
        "upperdir '",
    );
    refused(
        format!("lowerdir={p}/l,upperdir={p}/l/up,workdir={p}/w"),
        "is inside lowerdir #1",
    );
    refused(
        format!("lowerdir={p}/l,upperdir={p}/u,workdir={p}/l/wk"),
        "workdir '",
    );

    // The same upper dir with another work dir while it is mounted: at once, naming the mount.
    let mut m = Mount::new(1);
    m.mount();
    let w2 = m.dir.path().join("work2");
    fs::create_dir(&w2).unwrap();
    let other = d.path().join("m");
    let started = Instant::now();
    let (code, err) = run(&[
        "-f",
        "-o",
        &format!(
            "lowerdir={},upperdir={},workdir={}",
            m.lower(0).display(),
            m.upper.display(),
            w2.display()
        ),
        other.to_str().unwrap(),
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains(&format!("upperdir '{}' is in use", m.upper.display()))
            && err.contains(&format!("serving '{}'", m.mnt.display())),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited for a live mount"
    );
    assert!(!is_mounted(&other));

    // A dead mount (its daemon killed) at the mount point. (In the background: a mount made
    // wrongly returns instead of serving.)
    let mut daemon = m.take_daemon();
    daemon.kill().unwrap();
    daemon.wait().unwrap();
    let (code, err) = run(&["-o", &m.options(), m.mnt.to_str().unwrap()]);
    if code == 0 {
        sh(&format!("umount {}", m.mnt.display()));
    }
    assert_ne!(code, 0, "mounted over a dead mount");
    assert!(
        err.contains("holds a dead FUSE mount") && err.contains("umount"),
        "{err}"
    );
    sh(&format!("umount -l {}", m.mnt.display()));

    // An upper layer on a read-only file system.
    let ro = d.path().join("ro");
    fs::create_dir(&ro).unwrap();
    let tmpfs = Tmpfs::mount(&ro, "4m");
    for s in ["u", "w"] {
        fs::create_dir(ro.join(s)).unwrap();
    }
    sh(&format!("mount -o remount,ro {}", ro.display()));
    refused(
        format!("lowerdir={p}/l,upperdir={0}/u,workdir={0}/w", ro.display()),
        "is on a read-only file system",
    );
    sh(&format!("mount -o remount,rw {}", ro.display()));
    tmpfs.unmount().unwrap();

    // A root-owned upper layer mounted by another user.
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    fs::set_permissions(d.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(BIN)
        .args([
            "-f",
            "-o",
            &format!("lowerdir={p}/l,upperdir={p}/u,workdir={p}/w"),
        ])
        .arg(format!("{p}/m"))
        .uid(1000)
        .gid(1000)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("upperdir '{p}/u' is not writable by uid 1000")),
        "{err}"
    );
}

/// `-d` logs every request; a daemon in the background logs to `log_file=`, or else to the
/// system log (/dev/log), since its standard error is /dev/null.
#[test]
fn debug_logs_every_request_and_background_daemons_log_somewhere() {
    let (d, p) = layers();
    fs::write(d.path().join("l/a"), "a").unwrap();
    let work = |mnt: &str| {
        let _ = fs::read_dir(format!("{p}/{mnt}")).unwrap().count();
        fs::create_dir(format!("{p}/{mnt}/made")).unwrap();
        fs::remove_dir(format!("{p}/{mnt}/made")).unwrap();
    };
    let opts = format!("lowerdir={p}/l,upperdir={p}/u,workdir={p}/w");

    let child = Command::new(BIN)
        .args(["-d", "-o", &opts, &format!("{p}/m")])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !is_mounted(&d.path().join("m")) {
        assert!(start.elapsed() < Duration::from_secs(20), "not mounted");
        std::thread::sleep(Duration::from_millis(10));
    }
    work("m");
    sh(&format!("umount {p}/m"));
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    for request in [
        "LOOKUP name \"made\"",
        "MKDIR name \"made\"",
        "RMDIR name \"made\"",
    ] {
        assert!(log.contains(request), "-d logs {request}: {log}");
    }

    // Waits for the background daemon's last line ("shut down") in what `read` returns.
    let wait_for_end = |read: &mut dyn FnMut() -> String| -> String {
        let start = Instant::now();
        loop {
            let text = read();
            if text.contains("shut down") || start.elapsed() > Duration::from_secs(20) {
                return text;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let logged = format!("{p}/daemon.log");
    let out = Command::new(BIN)
        .env("MOSAICFS_LOG", "debug")
        .args([
            "-o",
            &format!("{opts},log_file={logged}"),
            &format!("{p}/m"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    work("m");
    sh(&format!("umount {p}/m"));
    let text = wait_for_end(&mut || fs::read_to_string(&logged).unwrap_or_default());
    assert!(text.contains("MKDIR name \"made\""), "{text}");
    assert!(text.contains(" mosaicfs["), "{text}");
    let (code, err) = run(&[
        "-o",
        &format!("{opts},log_file=/nonexistent/x.log"),
        &format!("{p}/m"),
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("log_file='/nonexistent/x.log': cannot open it"),
        "{err}"
    );

    // The system log, where this machine has none running: a listener of the test's own.
    if std::path::Path::new("/dev/log").exists() {
        return;
    }
    struct Listener(std::os::unix::net::UnixDatagram);
    impl Drop for Listener {
        fn drop(&mut self) {
            let _ = fs::remove_file("/dev/log");
        }
    }
    let syslog = Listener(std::os::unix::net::UnixDatagram::bind("/dev/log").unwrap());
    // Read as a system logger does, all the time: its queue holds only a few lines.
    let got = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (sock, got, stop) = (syslog.0.try_clone().unwrap(), got.clone(), stop.clone());
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(n) = sock.recv(&mut buf) {
                    let mut g = got.lock().unwrap();
                    g.push_str(&String::from_utf8_lossy(&buf[..n]));
                    g.push('\n');
                }
            }
        })
    };
    let out = Command::new(BIN)
        .env("MOSAICFS_LOG", "debug")
        .args(["-o", &opts, &format!("{p}/m")])
        .output()
        .unwrap();
    assert!(out.status.success());
    work("m");
    sh(&format!("umount {p}/m"));
    let text = wait_for_end(&mut || got.lock().unwrap().clone());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    assert!(
        text.contains("<31>mosaicfs["),
        "daemon facility, debug: {text}"
    );
    assert!(text.contains("MKDIR name \"made\""), "{text}");
}

#[test]
fn bad_input_is_one_clear_line_and_mounts_nothing() {
    let (_d, p) = layers();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "-o".into(),
                format!("upperdir={p}/u,workdir={p}/w"),
                format!("{p}/m"),
            ],
            "no lowerdir",
        ),
        (
            vec!["-o".into(), format!("lowerdir={p}/nope"), format!("{p}/m")],
            "does not exist",
        ),
        (
            vec![
                "-o".into(),
                format!("lowerdir={p}/l,upperdir={p}/u"),
                format!("{p}/m"),
            ],
            "workdir",
        ),
        (
            vec![
                "-o".into(),
                format!("lowerdir={p}/l,upperdir={p}/u,workdir={p}/u/w"),
                format!("{p}/m"),
            ],
            "must not contain",
        ),
        // A lower layer that is, or lies inside, the upper or work dir (kernel overlayfs:
        // "overlapping lowerdir path").
        (
            vec![
                "-o".into(),
                format!("lowerdir={p}/u,upperdir={p}/u,workdir={p}/w"),
                format!("{p}/m"),
            ],
            "is inside upperdir",
        ),
        (
            vec![
                "-o".into(),
                format!("lowerdir={p}/l:{p}/w/x,upperdir={p}/u,workdir={p}/w"),
                format!("{p}/m"),
            ],
            "lowerdir #2",
        ),
        (
            vec![
                "-o".into(),
                format!("lowerdir={p}/l,bogus=1"),
                format!("{p}/m"),
            ],
            "unknown mount option 'bogus=1'",
        ),
        (
            vec!["-o".into(), format!("lowerdir={p}/l"), format!("{p}/nomnt")],
            "mount point",
        ),
        (
            vec![
                "-o".into(),
                format!("lowerdir={p}/l,timeout=x"),
                format!("{p}/m"),
            ],
            "timeout",
        ),
    ];
    fs::create_dir_all(format!("{p}/u/w")).unwrap();
    fs::create_dir_all(format!("{p}/w/x")).unwrap();
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (code, err) = run(&args);
        assert_ne!(code, 0, "{args:?} must fail");
        assert!(err.contains(want), "{args:?}: expected '{want}' in: {err}");
        assert!(err.trim().lines().count() <= 2, "short message: {err}");
        assert!(!is_mounted(std::path::Path::new(&format!("{p}/m"))));
    }
    // A malformed default in the environment is an error too, not a silent `auto`.
    let out = Command::new(BIN)
        .env("MOSAICFS_URING", "yes please")
        .args([
            "-f",
            "-o",
            &format!("lowerdir={p}/l,upperdir={p}/u/u,workdir={p}/u/w"),
        ])
        .arg(format!("{p}/m"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("MOSAICFS_URING takes on, auto or off, not 'yes please'"),
        "{err}"
    );
    assert!(!is_mounted(std::path::Path::new(&format!("{p}/m"))));
}

#[test]
fn a_work_dir_leftover_that_cannot_be_removed_is_named_with_what_to_do() {
    let (d, p) = layers();
    let junk = d.path().join("w/mosaicfs-work/copyup-1-1");
    fs::create_dir_all(junk.parent().unwrap()).unwrap();
    fs::write(&junk, "x").unwrap();
    if !Command::new("chattr")
        .arg("+i")
        .arg(&junk)
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("chattr +i does not work here: skipped");
        return;
    }
    let (code, err) = run(&[
        "-o",
        &format!("lowerdir={p}/l,upperdir={p}/u,workdir={p}/w"),
        &format!("{p}/m"),
    ]);
    sh(&format!("chattr -i {}", junk.display()));
    assert_ne!(code, 0);
    assert!(
        err.contains("copyup-1-1' is left from an interrupted operation")
            && err.contains("remove it by hand"),
        "{err}"
    );
    assert!(!is_mounted(std::path::Path::new(&format!("{p}/m"))));
}

#[test]
fn upper_and_work_on_different_file_systems_are_refused() {
    let (d, p) = layers();
    let tmpfs = d.path().join("t");
    fs::create_dir(&tmpfs).unwrap();
    sh(&format!("mount -t tmpfs tmpfs {}", tmpfs.display()));
    fs::create_dir(tmpfs.join("w")).unwrap();
    let (code, err) = run(&[
        "-o",
        &format!(
            "lowerdir={p}/l,upperdir={p}/u,workdir={}/w",
            tmpfs.display()
        ),
        &format!("{p}/m"),
    ]);
    sh(&format!("umount {}", tmpfs.display()));
    assert_ne!(code, 0);
    assert!(err.contains("different file systems"), "{err}");
}

#[test]
fn background_mode_returns_once_live_and_umount_ends_the_daemon() {
    let (_d, p) = layers();
    fs::write(format!("{p}/l/hello"), "hi").unwrap();
    let mnt = std::path::PathBuf::from(format!("{p}/m"));
    let status = Command::new(BIN)
        .args([
            "-o",
            &format!("lowerdir={p}/l,upperdir={p}/u,workdir={p}/w"),
            &format!("{p}/m"),
        ])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(is_mounted(&mnt), "live when the command returns");
    assert_eq!(fs::read_to_string(mnt.join("hello")).unwrap(), "hi");
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        mounts
            .lines()
            .any(|l| l.contains(&format!("{p}/m fuse.mosaicfs"))),
        "{mounts}"
    );
    let pids = sh(&format!("pgrep -f '[m]osaicfs -o lowerdir={p}/l' || true"));
    assert!(!pids.trim().is_empty(), "a daemon serves the mount");
    sh(&format!("umount {p}/m"));
    wait_unmounted(&mnt);
    let start = Instant::now();
    while !sh(&format!("pgrep -f '[m]osaicfs -o lowerdir={p}/l' || true"))
        .trim()
        .is_empty()
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "daemon did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn mount_fuse_form_and_fusermount3_unmount() {
    let (_d, p) = layers();
    let mnt = std::path::PathBuf::from(format!("{p}/m"));
    let status = Command::new(BIN)
        .args([
            "mysource",
            &format!("{p}/m"),
            "-o",
            &format!("lowerdir={p}/l,upperdir={p}/u,workdir={p}/w"),
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        mounts
            .lines()
            .any(|l| l.starts_with(&format!("mysource {p}/m fuse.mosaicfs"))),
        "{mounts}"
    );
    if Command::new("fusermount3")
        .arg("--version")
        .output()
        .is_ok()
    {
        sh(&format!("fusermount3 -u {p}/m"));
    } else {
        sh(&format!("umount {p}/m"));
    }
    wait_unmounted(&mnt);
}

#[test]
fn mount_t_fuse_mosaicfs_through_the_helper() {
    // `make install` puts the helper in place; install it here if the test runs alone.
    let helper = std::path::Path::new("/usr/sbin/mount.fuse.mosaicfs");
    if !helper.exists() {
        std::os::unix::fs::symlink(BIN, helper).unwrap();
    }
    let (_d, p) = layers();
    fs::write(format!("{p}/l/f"), "via mount(8)").unwrap();
    sh(&format!(
        "mount -t fuse.mosaicfs overlay {p}/m -o lowerdir={p}/l,upperdir={p}/u,workdir={p}/w"
    ));
    assert_eq!(
        fs::read_to_string(format!("{p}/m/f")).unwrap(),
        "via mount(8)"
    );
    sh(&format!("mount -o remount,ro {p}/m"));
    assert_eq!(errno_of(fs::write(format!("{p}/m/g"), "x")), libc::EROFS);
    sh(&format!("mount -o remount,rw {p}/m"));
    fs::write(format!("{p}/m/g"), "x").unwrap();
    sh(&format!("umount {p}/m"));
    wait_unmounted(std::path::Path::new(&format!("{p}/m")));
}

#[test]
fn ignored_options_warn_once_and_still_mount() {
    let mut m = Mount::new(1);
    m.extra = vec![
        "ino32_t".into(),
        "context=\"system_u:object_r:container_file_t:s0:c1,c2\"".into(),
        "volatile".into(),
        "xino=auto".into(),
    ];
    m.mount();
    write(m.path("x"), "ok");
    let log = m.unmount();
    assert_eq!(log.matches("warning").count(), 2, "{log}");
    assert!(log.contains("ino32_t") && log.contains("context"), "{log}");
}

#[test]
fn lower_paths_may_be_symlinks_with_dotdot_and_escaped_colons() {
    let (d, p) = layers();
    let weird = d.path().join("a:b");
    fs::create_dir(&weird).unwrap();
    fs::write(weird.join("w"), "colon").unwrap();
    std::os::unix::fs::symlink(&weird, d.path().join("link")).unwrap();
    fs::write(format!("{p}/l/x"), "plain").unwrap();
    let opts = format!("lowerdir={p}/link/../a\\:b:{p}/l/../l,upperdir={p}/u,workdir={p}/w");
    let mut child = Command::new(BIN)
        .args(["-f", "-o", &opts, &format!("{p}/m")])
        .spawn()
        .unwrap();
    let mnt = std::path::PathBuf::from(format!("{p}/m"));
    let start = Instant::now();
    while !is_mounted(&mnt) {
        assert!(child.try_wait().unwrap().is_none(), "daemon exited");
        assert!(start.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(fs::read_to_string(mnt.join("w")).unwrap(), "colon");
    assert_eq!(fs::read_to_string(mnt.join("x")).unwrap(), "plain");
    sh(&format!("umount {p}/m"));
    assert!(child.wait().unwrap().success());
}

#[test]
fn the_mount_reads_ahead_as_configured() {
    let mut m = Mount::new(1);
    m.extra = vec!["read_ahead_kb=2048".into()];
    m.mount();
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dev = info
        .lines()
        .rev()
        .find(|l| l.split(' ').nth(4) == Some(m.mnt.to_str().unwrap()))
        .unwrap()
        .split(' ')
        .nth(2)
        .unwrap()
        .to_string();
    // With -f the mount shows before the daemon has set it: wait a little.
    let path = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    let start = Instant::now();
    while fs::read_to_string(&path).unwrap().trim() != "2048" {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "read_ahead_kb stays {}",
            fs::read_to_string(&path).unwrap()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn status_reports_a_live_mount_and_explains_a_dead_one() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), vec![1u8; 100_000]);
    m.extra = vec!["copy_whole=0".into()];
    m.mount();
    // One open: a second one would count as 1 or 2 writable opens depending on whether the
    // kernel's asynchronous RELEASE of the first had arrived (the count lives with the open
    // state, which a release of the last handle of a complete file drops).
    // Read-write: served by the daemon (a write-only writer would pass through, write=0).
    // Held open: the daemon lists the partial files it holds, and by default lets go of one
    // at its last close (nothing would complete it while closed).
    let open = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    std::os::unix::fs::FileExt::write_at(&open, b"x", 10).unwrap();
    let out = Command::new(BIN)
        .arg("status")
        .arg(&m.mnt)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!("mount: {}", m.mnt.display())),
        "{text}"
    );
    assert!(
        text.contains("copy-ups=1") && text.contains("write=1"),
        "{text}"
    );
    // The daemon's memory, resident and as its allocator sees it.
    let resident: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("memory: "))
        .and_then(|l| l.split(" KiB resident").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no memory line: {text}"));
    assert!((100..1 << 22).contains(&resident), "{text}");
    assert!(
        text.contains("KiB freed and kept by the allocator"),
        "{text}"
    );
    let workers: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("FUSE workers: "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no workers line: {text}"));
    assert!(workers >= 1, "{text}");
    // Each partial file, and why it is not complete yet: a disk upper's complete files pass
    // through, so sustained use would complete it; a memory upper's never do.
    let waiting = if disk_upper() {
        "waiting: sustained use: 1000 requests through the daemon with no 10 s gap (now 1), \
         then its last close"
    } else {
        "waiting: stays partial: complete files would not pass through here (upper=memory"
    };
    assert!(
        text.contains("1 of 25 blocks present")
            && text.contains("writable opens 1, writers served by the daemon; ")
            && text.contains(waiting),
        "{text}"
    );
    drop(open);
    m.unmount();
    let out = Command::new(BIN)
        .arg("status")
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a mount point"));
}

#[test]
fn mounts_in_a_user_namespace_with_user_xattrs() {
    // Rootless Podman runs the mount program as root of a user namespace, where trusted.*
    // xattrs are refused: mosaicfs must fall back to user.* rather than fail to mount.
    let (d, p) = layers();
    fs::write(d.path().join("l/big"), vec![7u8; 100_000]).unwrap();
    fs::write(d.path().join("l/gone"), "x").unwrap();
    let script = format!(
        "set -e; {BIN} -o lowerdir={p}/l,upperdir={p}/u,workdir={p}/w,copy_whole=0 {p}/m; \
         printf Y | dd of={p}/m/big bs=1 seek=50000 conv=notrunc 2>/dev/null; \
         rm {p}/m/gone; chmod 600 {p}/m/big; cat {p}/m/big | wc -c; umount {p}/m"
    );
    let out = common::run(Command::new("unshare").args(["-Urm", "sh", "-c", &script]));
    assert_eq!(out.trim(), "100000");
    let big = d.path().join("u/big");
    assert!(
        get_xattr(&big, "user.mosaicfs.partial").is_some(),
        "user.* mark"
    );
    assert!(get_xattr(&big, "trusted.mosaicfs.partial").is_none());
    let data = fs::read(&big).unwrap();
    assert_eq!(data[50_000], b'Y');
    assert!(
        !d.path()
            .join("l/big")
            .metadata()
            .unwrap()
            .permissions()
            .readonly()
    );
}

/// /dev/fuse's mode set for one test and put back as it was, however the test ends: later
/// runs see the machine as it was. One test at a time changes it.
struct DevFuseMode {
    before: u32,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

impl DevFuseMode {
    fn set(mode: u32) -> DevFuseMode {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        static CHANGING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let guard = CHANGING.lock().unwrap_or_else(|e| e.into_inner());
        let before = fs::metadata("/dev/fuse").unwrap().mode() & 0o7777;
        fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(mode)).unwrap();
        DevFuseMode {
            before,
            _one_at_a_time: guard,
        }
    }
}

impl Drop for DevFuseMode {
    fn drop(&mut self) {
        use std::os::unix::fs::PermissionsExt;
        let _ = fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(self.before));
    }
}

#[test]
fn a_user_who_cannot_open_dev_fuse_is_told_so_and_how_to_fix_it() {
    // The mount's failure names the mount point; the call that failed was /dev/fuse's open.
    let _mode = DevFuseMode::set(0o600);
    let (d, p) = layers();
    sh(&format!("chown -R nobody:nogroup {p}"));
    let out = Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups"])
        .args([BIN, "-o", "lowerdir=l,upperdir=u,workdir=w", "m"])
        .current_dir(d.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot open /dev/fuse") && err.contains("chmod 0666 /dev/fuse"),
        "{err}"
    );
}

#[test]
fn an_unprivileged_user_mounts_through_fusermount3() {
    // As with fuse-overlayfs: mount(2) is refused to a plain user, so the setuid fusermount3
    // mounts, and mosaicfs' own xattrs are user.* ones. Distributions ship /dev/fuse as 0666;
    // this machine's is 0600, which keeps every unprivileged FUSE mount out.
    use std::os::unix::fs::MetadataExt;
    let _mode = DevFuseMode::set(0o666);
    let (d, p) = layers();
    fs::write(d.path().join("l/a"), "lower\n").unwrap();
    fs::write(d.path().join("l/gone"), "x").unwrap();
    fs::create_dir(d.path().join("run")).unwrap();
    sh(&format!("chown -R nobody:nogroup {p}"));
    // The control socket goes to the user's runtime dir: `status` works as the user.
    let script = format!(
        "set -e; cd {p}; export XDG_RUNTIME_DIR={p}/run; \
         {BIN} -o lowerdir=l,upperdir=u,workdir=w m; echo more >> m/a; \
         echo new > m/n; echo again >> m/n; rm m/gone; cat m/a m/n; ls m; \
         {BIN} status m > status.txt; fusermount3 -u m"
    );
    let out = Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups"])
        .args(["sh", "-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "as nobody: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "lower\nmore\nnew\nagain\na\nn\n"
    );
    wait_unmounted(&d.path().join("m"));
    let status = fs::read_to_string(d.path().join("status.txt")).unwrap();
    assert!(
        status.starts_with("mount: m\n") && status.contains(&format!("upper: {p}/u\n")),
        "{status}"
    );
    let a = d.path().join("u/a");
    assert!(
        get_xattr(&a, "user.mosaicfs.origin").is_some(),
        "user.* xattrs"
    );
    assert_eq!(
        fs::metadata(&a).unwrap().uid(),
        65534,
        "created as the user"
    );
}

/// The man page covers every option of docs/USAGE.md's table and every command of the usage
/// text, and (where groff is installed) formats without a warning.
#[test]
fn the_man_page_covers_every_option_and_command() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let man = std::fs::read_to_string(root.join("docs/mosaicfs.1")).unwrap();
    // Option names as roff shows them: hyphens escaped, fonts switched around values.
    let text = man
        .replace("\\-", "-")
        .replace("\\fR", "")
        .replace("\\fB", "")
        .replace("\\c\n", "");
    let usage = std::fs::read_to_string(root.join("docs/USAGE.md")).unwrap();
    let table = usage
        .split("### Options")
        .nth(1)
        .and_then(|s| s.split("\n\n").nth(2))
        .expect("docs/USAGE.md's option table");
    let mut missing = Vec::new();
    for row in table.lines().filter(|l| l.starts_with("| `")) {
        let first_column = row.split(" | ").next().unwrap();
        for name in first_column.split('`').skip(1).step_by(2) {
            let name = name.split(['=', ' ']).next().unwrap();
            if !name.is_empty()
                && !name.ends_with('-')
                && !name.contains("*")
                && !text.contains(name)
            {
                missing.push(name.to_string());
            }
        }
    }
    let (_, usage) = run(&["--help"]);
    for line in usage.lines() {
        if let Some(cmd) = line
            .trim()
            .strip_prefix("mosaicfs ")
            .and_then(|l| l.split(' ').next())
            && cmd.chars().all(|c| c.is_ascii_lowercase())
            && !text.contains(&format!("mosaicfs {cmd}"))
            && !text.contains(&format!(".B {cmd}"))
        {
            missing.push(format!("command {cmd}"));
        }
    }
    assert!(missing.is_empty(), "not in docs/mosaicfs.1: {missing:?}");
    if std::process::Command::new("groff")
        .arg("-v")
        .output()
        .is_ok()
    {
        let out = std::process::Command::new("groff")
            .args(["-man", "-ww", "-z"])
            .arg(root.join("docs/mosaicfs.1"))
            .output()
            .unwrap();
        assert!(
            out.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A daemon removes its control socket at exit only while the path is still its socket: the
/// device number of a FUSE mount is reused at once, and a new mount on it may have bound its
/// own socket there before the old daemon exits (status then found no daemon).
#[test]
fn an_exiting_daemon_leaves_a_newer_mounts_control_socket_alone() {
    let mut m = Mount::new(1);
    m.mount();
    let dev = Command::new("mountpoint")
        .arg("-d")
        .arg(&m.mnt)
        .output()
        .unwrap();
    let dev = String::from_utf8_lossy(&dev.stdout)
        .trim()
        .replace(':', "-");
    let sock = std::path::PathBuf::from(format!("/run/mosaicfs/{dev}.sock"));
    assert!(sock.exists(), "{}", sock.display());
    // What a newer mount on the same device number does.
    fs::remove_file(&sock).unwrap();
    let newer = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    m.unmount();
    assert!(
        sock.exists(),
        "the exiting daemon removed the newer mount's socket"
    );
    drop(newer);
    fs::remove_file(&sock).unwrap();
}

/// A signal detaches the daemon's own mount, not whatever the path leads to: after its mount
/// was lazily unmounted (a file still open keeps the daemon serving it), a newer overlay
/// mounted at the same path outlives the old daemon's SIGTERM.
#[test]
fn a_signal_leaves_a_newer_mount_at_the_same_path_alone() {
    let mut old = Mount::new(1);
    write(old.lower(0).join("f"), "old");
    old.mount();
    let held = fs::File::open(old.path("f")).unwrap();
    rustix::mount::unmount(&old.mnt, rustix::mount::UnmountFlags::DETACH).unwrap();
    let mut newer = Mount::new(1);
    write(newer.lower(0).join("f"), "newer");
    newer.mnt = old.mnt.clone();
    newer.mount();
    let mut daemon = old.take_daemon();
    // SAFETY: kill(2) on the daemon this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) }, 0);
    // The handler has run once the signal is no longer pending.
    let status = format!("/proc/{}/status", daemon.id());
    let start = Instant::now();
    while fs::read_to_string(&status).unwrap().lines().any(|l| {
        (l.starts_with("SigPnd:") || l.starts_with("ShdPnd:")) && !l.ends_with("0000000000000000")
    }) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "signal still pending"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        is_mounted(&newer.mnt),
        "the old daemon's signal detached the newer mount"
    );
    assert_eq!(fs::read_to_string(newer.path("f")).unwrap(), "newer");
    // The old daemon ends when its last file closes.
    drop(held);
    let start = Instant::now();
    let exit = loop {
        if let Some(st) = daemon.try_wait().unwrap() {
            break st;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "old daemon still running"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");
    assert_eq!(fs::read_to_string(newer.path("f")).unwrap(), "newer");
    newer.unmount();
}

/// SIGTERM, SIGINT and SIGHUP unmount the file system and the daemon exits 0, data written
/// before on disk (the handler detaches the mount itself: no thread waits for signals).
#[test]
fn a_signal_unmounts_and_the_daemon_exits_cleanly() {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        let mut m = Mount::new(1);
        m.mount();
        write(m.path("f"), "kept");
        let mut child = m.take_daemon();
        // SAFETY: kill(2) on the daemon this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
        let start = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "signal {sig}: still running"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "signal {sig}: {status:?}");
        assert!(!is_mounted(&m.mnt), "signal {sig}: still mounted");
        m.mount();
        assert_eq!(fs::read_to_string(m.path("f")).unwrap(), "kept");
        m.unmount();
    }
}
