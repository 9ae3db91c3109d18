//! A mount that outlives its daemon (takeover.rs): killed, the daemon is replaced by a new one
//! on the same FUSE connection, and `mosaicfs upgrade` replaces it on purpose; processes on
//! the mount see no error and no wrong byte.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A mount in the background, as containers/storage and mount(8) make it: the command
/// returns with the mount live, served by a daemon beside its holder.
struct Background {
    dir: tempfile::TempDir,
    mnt: PathBuf,
    log: PathBuf,
}

impl Background {
    /// `fill` builds the lower layer; `opts` are added to the layers' options; `env` goes to
    /// the daemon.
    fn mount(fill: impl FnOnce(&Path), opts: &str, env: &[(&str, &str)]) -> Background {
        let dir = tempfile::Builder::new()
            .prefix("mosaicfs-restart")
            .tempdir_in("/tmp")
            .unwrap();
        let p = dir.path();
        for d in ["l", "u", "w", "m"] {
            fs::create_dir(p.join(d)).unwrap();
        }
        fill(&p.join("l"));
        let log = p.join("log");
        let options = format!(
            "lowerdir={0}/l,upperdir={0}/u,workdir={0}/w,upper=disk,log_file={1}{2}",
            p.display(),
            log.display(),
            if opts.is_empty() {
                String::new()
            } else {
                format!(",{opts}")
            }
        );
        let out = {
            let _forking = forking();
            Command::new(BIN)
                .args(["-o", &options])
                .arg(p.join("m"))
                // /dev/fuse, also where the suite runs again with io_uring switched on
                // (tests/with-uring.sh): a mount over io_uring does not survive its daemon.
                .env("MOSAICFS_URING", "off")
                .envs(env.iter().copied())
                .env("MOSAICFS_LOG", "info")
                .stdin(Stdio::null())
                .output()
                .unwrap()
        };
        assert!(
            out.status.success(),
            "mount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Background {
            mnt: p.join("m"),
            log,
            dir,
        }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    fn status(&self) -> String {
        let _forking = forking();
        let out = Command::new(BIN)
            .arg("status")
            .arg(&self.mnt)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A field of the status report: the number after `key` on the line starting `line`.
    fn field(&self, line: &str, key: &str) -> u64 {
        let status = self.status();
        let l = status
            .lines()
            .find(|l| l.starts_with(line))
            .unwrap_or_else(|| panic!("no '{line}' line in: {status}"));
        let at = l.find(key).unwrap_or_else(|| panic!("no '{key}' in: {l}")) + key.len();
        l[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }

    fn daemon(&self) -> i32 {
        self.field("daemon:", "pid ") as i32
    }

    fn holder(&self) -> i32 {
        self.field("restart:", "holder pid ") as i32
    }

    fn takeovers(&self) -> u64 {
        self.field("restart:", "daemons before this one: ")
    }

    /// Kills the serving daemon with SIGKILL and waits until another serves the mount.
    fn kill_daemon(&self) {
        let (old, before) = (self.daemon(), self.takeovers());
        // SAFETY: kill(2) of the daemon the status report named.
        assert_eq!(unsafe { libc::kill(old, libc::SIGKILL) }, 0);
        let start = Instant::now();
        while self
            .status_quietly()
            .is_none_or(|s| !s.contains(&format!("daemons before this one: {}", before + 1)))
        {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no daemon took over: {}",
                fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_ne!(self.daemon(), old);
    }

    fn status_quietly(&self) -> Option<String> {
        let _forking = forking();
        let out = Command::new(BIN)
            .arg("status")
            .arg(&self.mnt)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let holder = self.status_quietly().and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("restart:"))?;
            let at = l.find("holder pid ")? + "holder pid ".len();
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<i32>()
                .ok()
        });
        let start = Instant::now();
        while rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::empty()).is_err()
            && start.elapsed() < Duration::from_secs(10)
            && is_mounted(&self.mnt)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::DETACH);
        // The holder ends once the connection has: nothing of the mount is left running.
        if let Some(pid) = holder {
            let start = Instant::now();
            while Path::new(&format!("/proc/{pid}/comm")).exists()
                && fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| !s.contains(") Z "))
                && start.elapsed() < Duration::from_secs(10)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Runs `op` in a thread of its own until the daemon logs `marker` (it holds `op`'s request),
/// kills the daemon and returns what `op` got once the next daemon answered.
fn across_a_kill<T: Send + 'static>(
    m: &Background,
    marker: &str,
    op: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(op());
    });
    let start = Instant::now();
    while !fs::read_to_string(&m.log)
        .unwrap_or_default()
        .contains(marker)
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the request never came"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(rx.try_recv().is_err(), "answered before the kill");
    m.kill_daemon();
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the request held by the killed daemon was never answered")
}

fn lower_tree(l: &Path) {
    fs::write(l.join("image"), pattern(3 << 20, 7)).unwrap();
    fs::create_dir(l.join("dir")).unwrap();
    for i in 0..300 {
        fs::write(l.join(format!("dir/f{i:03}")), format!("file {i}\n")).unwrap();
    }
    fs::write(l.join("dir/note"), "lower note\n").unwrap();
}

/// kill -9 of the daemon: every kind of reference a process holds into the mount goes on
/// working with a new daemon — a read descriptor mid-file, a writer (written, fsynced, read
/// back), a directory being listed, a working directory inside the mount — and new opens,
/// creates and listings work.
#[test]
fn a_killed_daemon_is_replaced_and_its_processes_see_no_error() {
    let m = Background::mount(lower_tree, "restart=on", &[]);
    assert!(
        m.status().contains("restart: yes, holder pid"),
        "{}",
        m.status()
    );
    let holder = m.holder();
    let image = pattern(3 << 20, 7);

    let mut reader = fs::File::open(m.path("image")).unwrap();
    let mut head = vec![0u8; 1 << 20];
    reader.read_exact(&mut head).unwrap();
    let mut writer = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("dir/note"))
        .unwrap();
    writer.write_all(b"upper").unwrap();
    let mut listing = fs::read_dir(m.path("dir")).unwrap();
    let mut names: Vec<String> = listing
        .by_ref()
        .take(100)
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    // A shell inside the mount: it waits for the kill, then uses its working directory.
    let marker = m.dir.path().join("go");
    let shell = {
        let _forking = forking();
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while [ ! -e {0} ]; do sleep 0.01; done; cat f007 && ls | wc -l && \
                 echo made > made-here && cat made-here",
                marker.display()
            ))
            .current_dir(m.path("dir"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };

    m.kill_daemon();
    assert_eq!(m.holder(), holder, "the same holder started the new daemon");
    assert_eq!(m.takeovers(), 1);

    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    head.extend_from_slice(&rest);
    assert!(head == image, "the read descriptor read the file on");
    writer.write_all(b" and more").unwrap();
    writer.sync_all().unwrap();
    writer.seek(SeekFrom::Start(0)).unwrap();
    let mut note = String::new();
    writer.read_to_string(&mut note).unwrap();
    assert_eq!(note, "upper and more", "a write that returned is kept");
    names.extend(listing.map(|e| e.unwrap().file_name().into_string().unwrap()));
    names.sort();
    let mut want: Vec<String> = (0..300).map(|i| format!("f{i:03}")).collect();
    want.push("note".into());
    want.sort();
    assert_eq!(names, want, "the open directory listed on, each name once");
    fs::write(marker, "").unwrap();
    let out = shell.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the shell in the mount failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "file 7\n301\nmade\n",
        "the shell's working directory kept working"
    );
    assert_eq!(
        fs::read_to_string(m.dir.path().join("u/dir/made-here")).unwrap(),
        "made\n"
    );
    fs::write(m.path("new"), "new file").unwrap();
    assert_eq!(fs::read_to_string(m.path("new")).unwrap(), "new file");
    assert_eq!(names_of(&m.path("")), ["dir", "image", "new"]);
}

/// Copy-after-write's pending blocks outlive a daemon killed before it filled them: the bytes
/// of writes that returned sit in memory the holder keeps too (file/partial/arena.rs), and the
/// next daemon writes them into the file before it serves. Without that, they die with the
/// daemon and their blocks read the lower file again.
#[test]
fn blocks_left_pending_by_a_killed_daemon_are_written_by_the_next() {
    let m = Background::mount(
        lower_tree,
        "restart=on,copy_after_write=always,caw_workers=0,complete_after=0",
        &[],
    );
    let mut want = pattern(3 << 20, 7);
    let offsets = [5usize, 3 * 4096 + 100, (1 << 20) + 17, (3 << 20) - 3];
    for (i, &off) in offsets.iter().enumerate() {
        want[off..off + 2].copy_from_slice(format!("w{i}").as_bytes());
    }
    // The writer is a process that starts none: a process started while it holds the file
    // would close its copy at the exec, and that close (FLUSH) fills pending blocks.
    let script = format!(
        "import os, sys\n\
         fd = os.open('{}', os.O_RDWR)\n\
         for i, off in enumerate({offsets:?}):\n    os.pwrite(fd, b'w%d' % i, off)\n\
         print('written', flush=True)\n\
         sys.stdin.readline()\n\
         os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n\
         sys.stdout.buffer.write(os.pread(fd, {}, 0))\n\
         os.fsync(fd)\n",
        m.path("image").display(),
        want.len()
    );
    let mut writer = {
        let _forking = forking();
        Command::new("python3")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut out = writer.stdout.take().unwrap();
    let mut line = [0u8; 8];
    out.read_exact(&mut line).unwrap();
    assert_eq!(&line, b"written\n");
    assert!(
        m.status().contains("copy-after-write pending: 16384 bytes"),
        "the four writes are not pending: {}",
        m.status()
    );

    m.kill_daemon();
    assert!(
        m.status().contains("copy-after-write pending: 0 bytes"),
        "{}",
        m.status()
    );
    // The next daemon writes them before it serves (its status answers a moment before).
    let start = Instant::now();
    while !fs::read_to_string(&m.log)
        .unwrap_or_default()
        .contains("writing 4 copy-after-write blocks the daemon before left pending")
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the next daemon wrote no left block: {}",
            fs::read_to_string(&m.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    writer.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut got = Vec::new();
    out.read_to_end(&mut got).unwrap();
    assert!(writer.wait().unwrap().success());
    assert!(
        got == want,
        "a write that returned before the kill was lost"
    );
    // Each block is in the upper file whole: the written bytes over the lower file's.
    let upper = fs::read(m.dir.path().join("u/image")).unwrap();
    for off in offsets {
        let b = off / 4096 * 4096;
        assert!(
            upper[b..b + 4096] == want[b..b + 4096],
            "block at {b} in the upper file"
        );
    }
    assert_eq!(fs::read(m.path("image")).unwrap(), want);
}

fn names_of(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    n.sort();
    n
}

/// A request the daemon had read and not answered when it was killed is answered by the next
/// one (FUSE_NOTIFY_RESEND): the process that made it waits and gets the right answer, not an
/// error. Without the resend it would wait forever.
#[test]
fn a_request_held_by_a_killed_daemon_is_answered_by_the_next() {
    let m = Background::mount(
        |l| fs::write(l.join("stuck"), "held across the kill").unwrap(),
        "restart=on",
        &[("MOSAICFS_TEST_HANG", "stuck")],
    );
    let path = m.path("stuck");
    let got = across_a_kill(&m, "holding the lookup", move || {
        fs::read_to_string(path).map_err(|e| e.to_string())
    });
    assert_eq!(got.as_deref(), Ok("held across the kill"));
}

/// `mosaicfs upgrade`, six times in a row, while a process appends numbered lines and reads
/// them back: no write fails, none is lost or doubled, every upgrade is a new daemon. (Six:
/// daemons that hand over within 2 s of their start are not failed starts, five of which
/// make the holder give the mount up.)
#[test]
fn upgrades_under_load_lose_nothing() {
    upgrades_under_load("restart=on");
}

/// The same with the tree in the daemon: each daemon writes it out as it hands over.
#[test]
fn upgrades_of_a_memory_upper_under_load_lose_nothing() {
    upgrades_under_load("upper=memory");
}

/// Six upgrades while a shell appends a line and reads it back, as fast as it can.
fn upgrades_under_load(opts: &str) {
    let m = Background::mount(|_| {}, opts, &[]);
    let stop = m.dir.path().join("stop");
    let script = format!(
        "i=0; while [ ! -e {stop} ]; do echo $i >> {f} || exit 1; \
         tail -n 1 {f} | grep -qx $i || exit 2; i=$((i+1)); done; echo $i",
        stop = stop.display(),
        f = m.path("log").display()
    );
    let writer = {
        let _forking = forking();
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut pids = vec![m.daemon()];
    for round in 1..=6 {
        std::thread::sleep(Duration::from_millis(100));
        let out = run(Command::new(BIN).arg("upgrade").arg(&m.mnt));
        assert!(out.contains("took over from pid"), "{out}");
        assert_eq!(m.takeovers(), round);
        pids.push(m.daemon());
    }
    fs::write(&stop, "").unwrap();
    let out = writer.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the writer failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let n: usize = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let lines = fs::read_to_string(m.path("log")).unwrap();
    let want: String = (0..n).map(|i| format!("{i}\n")).collect();
    assert!(lines == want, "{n} lines written, the file differs");
    pids.dedup();
    assert_eq!(pids.len(), 7, "each upgrade started a new daemon: {pids:?}");
}

/// upper=memory: the tree lives in the daemon, and what it changed since the last fsync lives
/// in its change log too, which the holder keeps (memory_upper/changes.rs): a daemon killed
/// with changes no fsync made durable is followed by one that serves every one of them, as is
/// an upgrade. And once the mount is gone, a new mount has them all.
#[test]
fn a_memory_upper_outlives_kills_and_upgrades_with_every_change() {
    let m = Background::mount(
        |l| {
            fs::write(l.join("lower"), "lower data\n").unwrap();
            fs::create_dir(l.join("dir")).unwrap();
            for i in 0..50 {
                fs::write(l.join(format!("dir/f{i:02}")), format!("{i}\n")).unwrap();
            }
        },
        "upper=memory",
        &[],
    );
    let status = m.status();
    assert!(status.contains("restart: yes, holder pid"), "{status}");
    let mut durable = fs::File::create(m.path("durable")).unwrap();
    durable.write_all(b"fsynced").unwrap();
    durable.sync_all().unwrap();
    drop(durable);
    // Changes that no fsync made durable.
    let changes = || {
        fs::write(m.path("made"), "made in memory\n").unwrap();
        fs::create_dir(m.path("newdir")).unwrap();
        fs::rename(m.path("dir/f00"), m.path("newdir/moved")).unwrap();
        fs::remove_file(m.path("dir/f01")).unwrap();
        fs::hard_link(m.path("made"), m.path("newdir/link")).unwrap();
        std::os::unix::fs::symlink("made", m.path("sym")).unwrap();
        fs::set_permissions(m.path("newdir"), fs::Permissions::from_mode(0o751)).unwrap();
        set_xattr(&m.path("made"), "user.kept", b"yes");
        fs::write(m.path("big"), pattern(3 << 20, 9)).unwrap();
    };
    changes();
    let mut writer = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("lower"))
        .unwrap();
    writer.write_all(b"LOWER").unwrap();
    let mut listing = fs::read_dir(m.path("dir")).unwrap();
    let mut listed: Vec<String> = listing
        .by_ref()
        .take(10)
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let check = |what: &str| {
        assert_eq!(
            fs::read_to_string(m.path("made")).unwrap(),
            "made in memory\n",
            "{what}"
        );
        assert_eq!(fs::read_to_string(m.path("newdir/moved")).unwrap(), "0\n");
        assert!(!m.path("dir/f00").exists() && !m.path("dir/f01").exists());
        assert_eq!(fs::metadata(m.path("made")).unwrap().nlink(), 2, "{what}");
        assert_eq!(fs::read_link(m.path("sym")).unwrap(), Path::new("made"));
        assert_eq!(
            fs::metadata(m.path("newdir")).unwrap().permissions().mode() & 0o7777,
            0o751
        );
        assert_eq!(
            get_xattr(&m.path("made"), "user.kept").as_deref(),
            Some(&b"yes"[..])
        );
        assert!(
            fs::read(m.path("big")).unwrap() == pattern(3 << 20, 9),
            "{what}: big"
        );
        assert_eq!(fs::read_to_string(m.path("durable")).unwrap(), "fsynced");
    };

    m.kill_daemon();
    check("after the kill");
    writer.write_all(b" and more").unwrap();
    writer.seek(SeekFrom::Start(0)).unwrap();
    let mut text = String::new();
    writer.read_to_string(&mut text).unwrap();
    assert_eq!(text, "LOWER and more");
    listed.extend(listing.map(|e| e.unwrap().file_name().into_string().unwrap()));
    listed.sort();
    let want: Vec<String> = (2..50).map(|i| format!("f{i:02}")).collect();
    assert_eq!(listed, want, "the listing went on across the kill");

    // More changes, then an upgrade, then a kill again.
    fs::write(m.path("second"), "after the first kill\n").unwrap();
    run(Command::new(BIN).arg("upgrade").arg(&m.mnt));
    assert_eq!(m.takeovers(), 2);
    check("after the upgrade");
    fs::remove_file(m.path("second")).unwrap();
    fs::write(m.path("third"), "after the upgrade\n").unwrap();
    m.kill_daemon();
    check("after the second kill");
    assert!(!m.path("second").exists());
    assert_eq!(
        fs::read_to_string(m.path("third")).unwrap(),
        "after the upgrade\n"
    );
    drop(writer);

    // The layer outlives the mount: a new mount finds every change.
    let start = Instant::now();
    while rustix::mount::unmount(&m.mnt, rustix::mount::UnmountFlags::empty()).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the mount stays busy"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _forking = forking();
    run(Command::new(BIN)
        .arg("-o")
        .arg(format!(
            "lowerdir={0}/l,upperdir={0}/u,workdir={0}/w,upper=memory",
            m.dir.path().display()
        ))
        .arg(&m.mnt)
        .env("MOSAICFS_URING", "off"));
    drop(_forking);
    check("after a new mount");
    assert_eq!(
        fs::read_to_string(m.path("lower")).unwrap(),
        "LOWER and more"
    );
    assert_eq!(fs::read_dir(m.path("dir")).unwrap().count(), 48);
    assert_eq!(
        fs::read_to_string(m.path("third")).unwrap(),
        "after the upgrade\n"
    );
}

/// kill -9 of the holder: the daemon starts another, which `status` names, and a kill of the
/// daemon after that is survived as before (the new holder restarts it), twice over.
#[test]
fn a_holder_that_ends_is_replaced() {
    let m = Background::mount(lower_tree, "restart=on", &[]);
    for _ in 0..2 {
        let old = m.holder();
        // SAFETY: kill(2) of the holder the status report named.
        assert_eq!(unsafe { libc::kill(old, libc::SIGKILL) }, 0);
        let start = Instant::now();
        while m.holder() == old {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no holder replaced pid {old}: {}",
                fs::read_to_string(&m.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let new = m.holder();
        // The holder names itself once it runs (`status` names it as soon as it is started,
        // when its name is still the executable's, "exe").
        let comm = || fs::read_to_string(format!("/proc/{new}/comm")).unwrap_or_default();
        while comm().trim() != "mosaicfs-holder" {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "holder {new} is named {:?}",
                comm()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        m.kill_daemon();
        assert_eq!(m.holder(), new, "the new holder started the next daemon");
        assert_eq!(fs::read_to_string(m.path("dir/f007")).unwrap(), "file 7\n");
    }
}

/// An upgrade to something that is not mosaicfs is refused before the daemon stops, and the
/// mount goes on being served by the same daemon.
#[test]
fn an_upgrade_to_a_broken_binary_is_refused() {
    let m = Background::mount(|l| fs::write(l.join("a"), "a").unwrap(), "restart=on", &[]);
    let pid = m.daemon();
    let out = Command::new(BIN)
        .args(["upgrade", "--binary", "/bin/false"])
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not answer as mosaicfs does"), "{err}");
    assert_eq!(m.daemon(), pid);
    assert_eq!(fs::read_to_string(m.path("a")).unwrap(), "a");
}

/// Where the mount does not survive its daemon, the status says why, `restart=on` refuses the
/// mount with that reason, and `upgrade` says what to do instead.
#[test]
fn a_mount_that_cannot_survive_its_daemon_says_why() {
    let mut m = Mount::new(1);
    m.mount();
    let status = common::status(&m);
    assert!(
        status.contains("restart: no (-f: the daemon runs in the foreground"),
        "{status}"
    );
    // Its workers read requests straight: no next daemon to leave one to.
    assert!(
        status.contains("transport: ") && !status.contains("pipes"),
        "{status}"
    );
    let out = Command::new(BIN)
        .arg("upgrade")
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot be upgraded in place") && err.contains("unmount"),
        "{err}"
    );
    m.unmount();
    let refused = m.refused(&format!("{},restart=on", m.options()));
    assert!(
        refused.contains("restart=on: this mount cannot survive its daemon: -f"),
        "{refused}"
    );
    // A memory upper whose filestore is in memory too dies with its daemon (an upper dir of
    // its own: the one above holds a kept memory layer in the memory run of the suite).
    let fresh = tempfile::tempdir().unwrap();
    for d in ["upper", "work"] {
        fs::create_dir(fresh.path().join(d)).unwrap();
    }
    let out = {
        let _forking = forking();
        Command::new(BIN)
            .arg("-o")
            .arg(format!(
                "lowerdir={},upperdir={1}/upper,workdir={1}/work,restart=on,upper=memory,\
                 filestore=memory",
                m.lower(0).display(),
                fresh.path().display()
            ))
            .arg(&m.mnt)
            .env("MOSAICFS_URING", "off")
            .output()
            .unwrap()
    };
    assert!(!out.status.success(), "mounted");
    let refused = String::from_utf8_lossy(&out.stderr);
    assert!(
        refused.contains("filestore=memory: the layer lives only in its daemon"),
        "{refused}"
    );
}

/// Rootless, as the users who pick a FUSE overlay run it (a user namespace, no passthrough):
/// the default mount survives kill -9 of its daemon, with a descriptor open across it, and its
/// workers read requests through pipes (the daemon logs when it cannot make one: a user's
/// pipes are held to `pipe-user-pages-soft`).
#[test]
fn a_rootless_mount_survives_its_daemon_by_default() {
    let d = tempfile::Builder::new()
        .prefix("mosaicfs-restart-rootless")
        .tempdir_in("/tmp")
        .unwrap();
    let p = d.path().display().to_string();
    for sub in ["l", "u", "w", "m"] {
        fs::create_dir(d.path().join(sub)).unwrap();
    }
    fs::write(d.path().join("l/f"), "lower\n").unwrap();
    let script = format!(
        "set -e; {bin} -o lowerdir={p}/l,upperdir={p}/u,workdir={p}/w,upper=disk,log_file={p}/log {p}/m; \
         exec 3>>{p}/m/f; echo before >&3; \
         {bin} status {p}/m > {p}/status-before; \
         pid=$(sed -n 's/^daemon: pid \\([0-9]*\\),.*/\\1/p' {p}/status-before); \
         kill -9 $pid; \
         i=0; until {bin} status {p}/m 2>/dev/null | grep -q 'daemons before this one: 1'; do \
           i=$((i+1)); [ $i -lt 3000 ] || exit 9; sleep 0.01; done; \
         echo after >&3; exec 3>&-; cat {p}/m/f > {p}/content; \
         {bin} status {p}/m > {p}/status-after; umount {p}/m",
        bin = BIN
    );
    // /dev/fuse as the transport (io_uring, where the suite runs again with the kernel's
    // switch on, is what a mount that survives its daemon cannot use).
    run(Command::new("unshare")
        .args(["-Urm", "sh", "-c", &script])
        .env("MOSAICFS_URING", "off"));
    let before = fs::read_to_string(d.path().join("status-before")).unwrap();
    assert!(before.contains("restart: yes, holder pid"), "{before}");
    assert!(before.contains("passthrough: none"), "{before}");
    assert!(before.contains("requests read through pipes"), "{before}");
    assert_eq!(
        fs::read_to_string(d.path().join("content")).unwrap(),
        "lower\nbefore\nafter\n"
    );
    let after = fs::read_to_string(d.path().join("status-after")).unwrap();
    assert!(after.contains("daemons before this one: 1"), "{after}");
    let log = fs::read_to_string(d.path().join("log")).unwrap();
    assert!(!log.contains("cannot make a pipe"), "{log}");
}

/// Files removed while open — made in the upper layer, copied up, or only in the lower layer
/// (a running program a package upgrade replaced) — read and write on through their
/// descriptors after the daemon is killed: the next daemon finds them by the work dir's
/// records, which go when the files are closed (an upper file's blocks are freed then).
#[test]
fn files_removed_while_open_outlive_the_daemon() {
    removed_while_open_across_a_kill("restart=on");
}

/// The same on a memory upper, whose removed objects are recorded in the layer itself (a name
/// in its work root, carried to the next daemon by the change log), and an upgrade after the
/// kill (it no longer waits for them to be closed).
#[test]
fn files_of_a_memory_upper_removed_while_open_outlive_the_daemon() {
    removed_while_open_across_a_kill("restart=on,upper=memory");
}

fn removed_while_open_across_a_kill(opts: &str) {
    let memory = opts.contains("upper=memory");
    let m = Background::mount(
        |l| {
            fs::write(l.join("lower-only"), "lower data\n").unwrap();
            fs::write(l.join("copied"), "other\n").unwrap();
        },
        opts,
        &[],
    );
    let mut made = fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(m.path("made"))
        .unwrap();
    made.write_all(b"unlinked data\n").unwrap();
    fs::remove_file(m.path("made")).unwrap();
    let mut lower = fs::File::open(m.path("lower-only")).unwrap();
    fs::remove_file(m.path("lower-only")).unwrap();
    let mut copied = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("copied"))
        .unwrap();
    copied.write_all(b"XX").unwrap();
    fs::remove_file(m.path("copied")).unwrap();
    // Closed only after the kill, never touched by the next daemon: the kernel's FORGET of a
    // node that daemon never found removes its record.
    let untouched = fs::File::create(m.path("untouched")).unwrap();
    fs::remove_file(m.path("untouched")).unwrap();

    m.kill_daemon();
    drop(untouched);

    let read_all = |f: &mut fs::File| {
        let mut s = String::new();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_to_string(&mut s).unwrap();
        s
    };
    assert_eq!(read_all(&mut made), "unlinked data\n");
    made.write_all(b"more\n").unwrap();
    made.sync_all().unwrap();
    assert_eq!(read_all(&mut made), "unlinked data\nmore\n");
    assert_eq!(read_all(&mut lower), "lower data\n");
    assert_eq!(read_all(&mut copied), "XXher\n");
    assert_eq!(
        made.metadata().unwrap().len(),
        19,
        "fstat of a removed file"
    );
    // An upgrade keeps the records too (until 2026-12-01 the daemon that handed over removed
    // them on its way out, and the next answered ESTALE).
    run(Command::new(BIN).arg("upgrade").arg(&m.mnt));
    made.write_all(b"after\n").unwrap();
    assert_eq!(read_all(&mut made), "unlinked data\nmore\nafter\n");
    assert_eq!(read_all(&mut copied), "XXher\n");
    assert_eq!(read_all(&mut lower), "lower data\n");
    drop((made, lower, copied));
    if memory {
        // The layer's records go with the kernel's last reference: the two roots and the
        // whiteout of "lower-only" are left.
        let start = Instant::now();
        while !m.status().contains("memory, 3 objects") {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "records left after the close: {}\n{}",
                m.status(),
                fs::read_to_string(&m.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        return;
    }
    let orphans = m.dir.path().join("w/mosaicfs-orphans");
    let start = Instant::now();
    loop {
        let left: Vec<String> = fs::read_dir(&orphans)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.parse::<u64>().is_ok())
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "upper records left after the close: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The fsstress-style checker (six processes of namespace and data operations, two renaming
/// their parents) while the daemon is killed eight times: not one unexpected result. Requests
/// in flight at a kill are served again by the next daemon; one the dead daemon had done
/// (a create, an unlink) finds its work done and answers as the first time would have.
#[test]
fn fsstress_sees_nothing_of_eight_kills() {
    // The default options: as root, files pass through (takeover.rs: fresh node ids).
    fsstress_across_eight_kills("");
}

/// The same on a memory upper: every change the dead daemon made since the last fsync comes
/// back from the change log its holder kept (memory_upper/changes.rs).
#[test]
fn fsstress_on_a_memory_upper_sees_nothing_of_eight_kills() {
    fsstress_across_eight_kills("upper=memory");
}

fn fsstress_across_eight_kills(opts: &str) {
    const STRESS: &str = env!("CARGO_BIN_EXE_mosaicfs-fsstress");
    let m = Background::mount(|_| {}, opts, &[]);
    let stress = {
        let _forking = forking();
        Command::new(STRESS)
            .arg("-d")
            .arg(&m.mnt)
            .args(["-p", "6", "-n", "4000", "-r", "2", "-s", "11"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let pid = stress.id() as i32;
    let mut kills = 0;
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: kill(pid, 0) only asks whether the process (a child not yet reaped) runs.
    while kills < 8 && unsafe { libc::kill(pid, 0) } == 0 {
        m.kill_daemon();
        kills += 1;
        std::thread::sleep(Duration::from_millis(50 + 70 * (kills % 4)));
    }
    let out = stress.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "after {kills} kills: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(kills >= 3, "the workload ended before the kills: {kills}");
}

/// As root, where files pass through (the default there): descriptors passing through to lower
/// and upper files stay open across kills, and the same files open again, passing through, in
/// each new daemon — whose kernel inodes must not be the old daemons' (bound to backing files
/// they registered: the open would fail with EIO). Three kills: node ids the second daemon made
/// are found by the third.
#[test]
fn files_passing_through_outlive_three_daemons() {
    let m = Background::mount(
        |l| {
            fs::write(l.join("image"), pattern(1 << 20, 3)).unwrap();
            fs::write(l.join("small"), "lower small\n").unwrap();
        },
        "",
        &[],
    );
    let status = m.status();
    if !status.contains("complete files served by passthrough: yes") {
        eprintln!("skipped: no FUSE passthrough here: {status}");
        return;
    }
    fs::write(m.path("made"), "made in the upper\n").unwrap();
    let mut reader = fs::File::open(m.path("image")).unwrap();
    let mut writer = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("made"))
        .unwrap();
    let mut contents = String::from("made in the upper\n");
    for round in 0..3 {
        m.kill_daemon();
        let mut image = Vec::new();
        reader.seek(SeekFrom::Start(0)).unwrap();
        reader.read_to_end(&mut image).unwrap();
        assert!(
            image == pattern(1 << 20, 3),
            "round {round}: the old reader"
        );
        writer.seek(SeekFrom::End(0)).unwrap();
        writer
            .write_all(format!("round {round}\n").as_bytes())
            .unwrap();
        contents.push_str(&format!("round {round}\n"));
        // New opens of the same files, in the new daemon.
        assert_eq!(fs::read_to_string(m.path("made")).unwrap(), contents);
        assert!(fs::read(m.path("image")).unwrap() == pattern(1 << 20, 3));
        let mut again = fs::OpenOptions::new()
            .append(true)
            .open(m.path("small"))
            .unwrap();
        again.write_all(b"+").unwrap();
    }
    assert_eq!(
        fs::read_to_string(m.path("small")).unwrap(),
        "lower small\n+++"
    );
    let opens = m.status();
    assert!(opens.contains("daemons before this one: 3"), "{opens}");
}

/// A node id a daemon that took over handed out by a lookup, and that no daemon opened, is
/// opened by the daemon after it: the kernel never bound it to a backing file. That is how a
/// takeover inside the kernel's one retry of an open (after an ESTALE) must end: the retry's
/// lookup was answered by the daemon that died, its open comes to the next. An O_PATH
/// descriptor holds such a node id here, and /proc/self/fd opens it without a lookup (which
/// the kernel cannot retry). One that daemon opened, and whose opener still passes through
/// to its backing file, is answered ESTALE, not opened under a binding the kernel refuses
/// (EIO). Without the record of opens, the first open got ESTALE; without its mark of an
/// open, the second got EIO.
#[test]
fn a_node_id_no_daemon_opened_is_opened_after_a_second_takeover() {
    use std::os::unix::fs::OpenOptionsExt;
    let m = Background::mount(
        |l| {
            fs::write(l.join("unopened"), "lower unopened\n").unwrap();
        },
        "",
        &[],
    );
    if !m
        .status()
        .contains("complete files served by passthrough: yes")
    {
        eprintln!("skipped: no FUSE passthrough here");
        return;
    }
    fs::write(m.path("opened"), pattern(1 << 20, 5)).unwrap();
    // The second daemon: its lookups hand out node ids of its own.
    m.kill_daemon();
    let path_only = |name: &str| {
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(m.path(name))
            .unwrap()
    };
    let unopened = path_only("unopened");
    let opened = path_only("opened");
    let mut held = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("opened"))
        .unwrap();
    let through_fd = |f: &fs::File| {
        use std::os::fd::AsRawFd;
        fs::read(format!("/proc/self/fd/{}", f.as_raw_fd()))
    };
    // The third daemon gets the opens of both node ids.
    m.kill_daemon();
    assert_eq!(through_fd(&unopened).unwrap(), b"lower unopened\n");
    let e = through_fd(&opened).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    // The descriptor the second daemon opened still reads, and a new open by name works.
    let mut bytes = Vec::new();
    held.read_to_end(&mut bytes).unwrap();
    assert!(
        bytes == pattern(1 << 20, 5),
        "the descriptor the second daemon opened"
    );
    assert!(fs::read(m.path("opened")).unwrap() == pattern(1 << 20, 5));
}

/// An append the dead daemon had made but not answered is sent again and made once: the
/// kernel's offset, the end of the file when it sent the write, is where it goes the second
/// time (appending again doubled it: fsstress found a file 1,668 bytes too long).
#[test]
fn an_append_done_before_the_kill_is_not_made_twice() {
    let m = Background::mount(
        |l| fs::write(l.join("log"), "first\n").unwrap(),
        // Writes through the daemon, as every write is on a rootless mount.
        "passthrough=off",
        &[("MOSAICFS_TEST_HANG_WRITE", "HELD")],
    );
    let path = m.path("log");
    let written = across_a_kill(&m, "holding the answer to a write done", move || {
        let mut f = fs::OpenOptions::new().append(true).open(path).unwrap();
        f.write_all(b"HELD line\n").map_err(|e| e.to_string())
    });
    assert_eq!(written, Ok(()));
    assert_eq!(
        fs::read_to_string(m.path("log")).unwrap(),
        "first\nHELD line\n"
    );
}

/// A RENAME_EXCHANGE the dead daemon had done but not answered is sent again and not done a
/// second time, which would swap the names back (resend.rs: the work dir's record of requests
/// in progress says it was done).
#[test]
fn an_exchange_done_before_the_kill_is_not_undone() {
    exchange_across_a_kill("b");
}

/// A RENAME_EXCHANGE the dead daemon had carried out but not yet recorded as done is not done a
/// second time either: it noted the objects at both names before the swap, and the next daemon
/// finds them swapped (resend.rs `Slot::note`). Without the note the names swap back.
#[test]
fn an_exchange_killed_before_its_record_is_not_undone() {
    exchange_across_a_kill("before-done:b");
}

/// Exchanges "a" and "b" while the daemon holds the answer where `hang` says
/// (`MOSAICFS_TEST_HANG_CHANGE`) and is killed there; the exchange is done once.
fn exchange_across_a_kill(hang: &str) {
    let m = Background::mount(
        |l| {
            fs::write(l.join("a"), "A").unwrap();
            fs::write(l.join("b"), "B").unwrap();
        },
        "restart=on",
        &[("MOSAICFS_TEST_HANG_CHANGE", hang)],
    );
    let (a, b) = (m.path("a"), m.path("b"));
    let got = across_a_kill(&m, "holding the answer to a change", move || {
        let flags = rustix::fs::RenameFlags::EXCHANGE;
        rustix::fs::renameat_with(rustix::fs::CWD, &a, rustix::fs::CWD, &b, flags)
            .map_err(|e| e.to_string())
    });
    assert_eq!(got, Ok(()));
    assert_eq!(fs::read_to_string(m.path("a")).unwrap(), "B");
    assert_eq!(fs::read_to_string(m.path("b")).unwrap(), "A");
}

/// The resident bytes of each request buffer of the daemon `pid` (the anonymous mappings of
/// 16 MiB and a page a worker reads requests into).
fn request_buffers_resident(pid: u32) -> Vec<u64> {
    let smaps = fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut out = Vec::new();
    let mut in_buffer = false;
    for line in smaps.lines() {
        let kb = |l: &str| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap();
        if line.starts_with("Size:") {
            in_buffer = kb(line) == (16 << 10) + 4;
        } else if in_buffer && line.starts_with("Rss:") {
            out.push(kb(line) << 10);
        }
    }
    out
}

/// A worker's request buffer keeps resident what its own WRITEs filled through a batch of
/// FORGETs, and gives back only what the batch filled beyond: the kernel faults a page of the
/// buffer in as it copies a request there, and a daemon killed meanwhile had that request
/// end with EIO instead of being sent to the next daemon (a WRITE failed so under a hundred
/// kills without passthrough, its buffer's pages given back after a batch of FORGETs).
#[test]
fn a_batch_of_forgets_gives_back_no_page_a_write_filled() {
    let mut m = Mount::new(1);
    for i in 0..3000 {
        write(m.lower(0).join(format!("f{i}")), "x");
    }
    m.env
        .push(("MOSAICFS_TEST_SLOW_RELEASE".into(), "500".into()));
    // One worker reading /dev/fuse (over io_uring, WRITEs land in the ring's buffers).
    m.extra = opts(&["threaded=0", "passthrough=off", "uring=off"]);
    m.mount();
    let mut f = fs::File::create(m.path("big")).unwrap();
    f.write_all(&vec![7u8; 1 << 20]).unwrap();
    drop(f);
    let after_write: u64 = request_buffers_resident(m.pid()).iter().sum();
    assert!(
        after_write >= 1 << 20,
        "one 1 MiB WRITE: {after_write} resident"
    );
    // 3,000 lookups, then their FORGETs while the one worker is held 500 ms on a RELEASE:
    // the kernel hands them over in one batch of 48 KiB, past the buffer's first page.
    for i in 0..3000 {
        fs::symlink_metadata(m.path(&format!("f{i}"))).unwrap();
    }
    drop(fs::File::open(m.path("f0")).unwrap());
    fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let after_forgets = request_buffers_resident(m.pid());
    assert!(
        after_forgets.iter().sum::<u64>() >= after_write,
        "pages the WRITE filled were given back: {after_forgets:?}, {after_write} before"
    );
    assert_eq!(fs::read(m.path("big")).unwrap(), vec![7u8; 1 << 20]);
}

/// A WRITE the kernel is handing to a worker when the daemon is killed goes to the next daemon
/// instead of failing. Read from /dev/fuse, a request is copied into the worker's buffer, and a
/// page of it faulted in while SIGKILL is pending ends that request with EIO; workers read
/// requests through a pipe instead (fuser's request_pipe.rs), and copy them from there once the
/// request waits in the kernel for the next daemon. Here the first fault on the one worker's
/// buffer past its first page is held (userfaultfd, `MOSAICFS_TEST_HOLD_FAULT`) and the daemon
/// killed meanwhile, twice: the daemon that took over reads through a pipe too (it learns the
/// connection's `max_write` from what the first one saved). Without the pipe the write failed
/// with EIO at the first kill; without the saved `max_write`, at the second.
#[test]
fn a_write_being_handed_over_as_the_daemon_is_killed_goes_to_the_next() {
    let m = Background::mount(
        |_| {},
        "restart=on,passthrough=off,threaded=0",
        &[("MOSAICFS_TEST_HOLD_FAULT", "3000")],
    );
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let (path, written) = (m.path("big"), data.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(fs::write(path, written).map_err(|e| e.to_string()));
    });
    for held in 1..=2 {
        let start = Instant::now();
        while fs::read_to_string(&m.log)
            .unwrap_or_default()
            .matches("holding a fault of a request buffer")
            .count()
            < held
        {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "daemon {held} never took the write: {:?}",
                rx.try_recv()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(rx.try_recv().is_err(), "answered before kill {held}");
        m.kill_daemon();
    }
    let got = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the write was never answered");
    assert_eq!(got, Ok(()));
    assert_eq!(fs::read(m.path("big")).unwrap(), data);
}

/// The biggest WRITEs fit a worker's pipe, which holds a request's header and data in pages of
/// its own (fuser's request_pipe.rs `slots_for`; a request that finds no free page fails with
/// EIO): 1 MiB at an offset off a page boundary through the page cache, whose data spans one
/// page more, and with O_DIRECT from a buffer off a page boundary. And the default `max_write`
/// is one a pipe can hold: workers read through pipes, not /dev/fuse (the daemon says when
/// it cannot make one).
#[test]
fn the_biggest_writes_fit_a_workers_pipe() {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let m = Background::mount(|_| {}, "restart=on,passthrough=off,threaded=0", &[]);
    let data: Vec<u8> = (0..(1u32 << 20) + 8192).map(|i| (i % 253) as u8).collect();
    let f = fs::File::create(m.path("cached")).unwrap();
    f.write_all_at(&data[..1 << 20], 100).unwrap();
    drop(f);
    let mut want = vec![0u8; 100];
    want.extend_from_slice(&data[..1 << 20]);
    assert_eq!(fs::read(m.path("cached")).unwrap(), want);
    let f = fs::OpenOptions::new()
        .create(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("direct"))
        .unwrap();
    let from = 4096 - (data.as_ptr() as usize % 4096) + 100;
    f.write_all_at(&data[from..from + (1 << 20)], 0).unwrap();
    drop(f);
    assert_eq!(
        fs::read(m.path("direct")).unwrap(),
        &data[from..from + (1 << 20)]
    );
    let log = fs::read_to_string(&m.log).unwrap();
    assert!(!log.contains("cannot make a pipe"), "{log}");
    let status = m.status();
    assert!(status.contains("requests read through pipes"), "{status}");
}

/// A mount in the background of one lower file `f` of `len` bytes of `pattern(.., seed)` whose
/// write-only writers pass through (`partial_passthrough=on`) and which never completes files
/// by itself, and such a writer of `f`; `None` where pre-content events cannot be had.
fn passing_writer(len: usize, seed: u64, env: &[(&str, &str)]) -> Option<(Background, fs::File)> {
    let m = Background::mount(
        |l| fs::write(l.join("f"), pattern(len, seed)).unwrap(),
        "complete_after=0,complete_ratio=0,copy_whole=0,partial_passthrough=on",
        env,
    );
    let status = m.status();
    if !status.contains("partial files' writers: passthrough") {
        eprintln!("skipped: no pre-content events here: {status}");
        return None;
    }
    assert!(status.contains("restart: yes"), "{status}");
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    Some((m, f))
}

/// A partial file's writer passing through to the upper file (`partial_passthrough`): a write
/// that waits on its pre-content event as the daemon is killed goes on once the next daemon
/// filled its block; a later write into a hole is filled by that daemon, which never opened
/// the file; an upgrade keeps the file marked. Each written block holds the lower file's bytes
/// around the written ones. Before, such a mount did not survive its daemon at all, and with a
/// guardian the waiting write got EIO.
#[test]
fn a_partial_files_writer_passing_through_outlives_a_kill_and_an_upgrade() {
    use std::os::unix::fs::FileExt;
    let len = 8 << 20;
    // Each fill the reader makes waits 1.5 s first: the kill lands while a write waits.
    let Some((m, f)) = passing_writer(len, 6, &[("MOSAICFS_TEST_SLOW_FILL", "1500")]) else {
        return;
    };
    let mut want = pattern(len, 6);
    let write = |want: &mut Vec<u8>, f: &fs::File, bytes: &[u8], off: usize| {
        f.write_all_at(bytes, off as u64).unwrap();
        want[off..off + bytes.len()].copy_from_slice(bytes);
    };
    write(&mut want, &f, b"filled", 10);
    assert!(m.status().contains("marked-files=1"), "{}", m.status());
    let waiting = {
        let f = f.try_clone().unwrap();
        std::thread::spawn(move || f.write_all_at(b"waits", 4 << 20))
    };
    std::thread::sleep(Duration::from_millis(500));
    m.kill_daemon();
    waiting
        .join()
        .unwrap()
        .expect("the write that waited on the killed daemon");
    want[4 << 20..(4 << 20) + 5].copy_from_slice(b"waits");
    let log = fs::read_to_string(&m.log).unwrap();
    assert!(
        log.contains("answering the pre-content events the daemon before left: 1"),
        "{log}"
    );
    // Into a hole, through the descriptor opened before the kill: an event on a file the new
    // daemon never opened.
    write(&mut want, &f, b"later", (6 << 20) + 1);
    // A binary that answers as mosaicfs does but cannot take the group over is refused.
    let old = m.dir.path().join("old-mosaicfs");
    fs::write(&old, "#!/bin/sh\necho mosaicfs 0.1.0\n").unwrap();
    fs::set_permissions(&old, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = {
        let _forking = forking();
        Command::new(BIN)
            .args(["upgrade", "--binary"])
            .arg(&old)
            .arg(&m.mnt)
            .output()
            .unwrap()
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("does not take over the pre-content events"),
        "{err}"
    );
    let out = run(Command::new(BIN).arg("upgrade").arg(&m.mnt));
    assert!(out.contains("took over from pid"), "{out}");
    write(&mut want, &f, b"after the upgrade", (7 << 20) + 4000);
    write(&mut want, &f, b"FILLED", 10);
    assert!(fs::read(m.path("f")).unwrap() == want, "the merged view");
    let upper = fs::read(m.dir.path().join("u/f")).unwrap();
    for off in [0, 4 << 20, 6 << 20, (7 << 20) + 4000] {
        let b = off / 4096 * 4096;
        let e = (b + 8192).min(upper.len());
        assert!(
            upper[b..e] == want[b..e],
            "the blocks at {b} in the upper file hold the lower bytes around the written"
        );
    }
    assert!(
        m.status().contains("marked-files=1"),
        "the file stays marked: {}",
        m.status()
    );
    drop(f);
    assert!(
        fs::read(m.path("f")).unwrap() == want,
        "after the writer's close"
    );
}

/// A daemon killed between its read of a pre-content event and the event's record: the next
/// daemon cannot know which events wait, so it fills the marked file whole and answers every
/// number the dead daemon could have held. The write that waited goes on, with the lower
/// file's bytes around it.
#[test]
fn an_event_read_and_not_recorded_by_a_killed_daemon_is_answered_by_the_next() {
    use std::os::unix::fs::FileExt;
    let len = 4 << 20;
    let Some((m, f)) = passing_writer(len, 9, &[("MOSAICFS_TEST_SLOW_RECORD", "1500")]) else {
        return;
    };
    let waiting = {
        let f = f.try_clone().unwrap();
        std::thread::spawn(move || f.write_all_at(b"waits", (2 << 20) + 3))
    };
    std::thread::sleep(Duration::from_millis(500));
    m.kill_daemon();
    waiting
        .join()
        .unwrap()
        .expect("the write whose event was read and not recorded");
    let log = fs::read_to_string(&m.log).unwrap();
    assert!(
        log.contains("some unrecorded, so every marked file (1) is filled first"),
        "{log}"
    );
    let mut want = pattern(len, 9);
    want[(2 << 20) + 3..(2 << 20) + 8].copy_from_slice(b"waits");
    assert!(fs::read(m.path("f")).unwrap() == want, "the merged view");
    assert!(
        fs::read(m.dir.path().join("u/f")).unwrap() == want,
        "the upper file is filled whole"
    );
    drop(f);
}

/// A holder that gives the mount up (its daemons fail to start: here the upper dir is gone)
/// becomes the pre-content guardian: a writer passing through gets EIO for a hole instead of
/// writing into it, and the guardian ends once no file of the mount is open.
#[test]
fn a_holder_that_gives_up_guards_the_writers_passing_through() {
    use std::os::unix::fs::FileExt;
    let Some((m, f)) = passing_writer(2 << 20, 4, &[]) else {
        return;
    };
    f.write_all_at(b"filled", 5).unwrap();
    let (holder, daemon) = (m.holder(), m.daemon());
    let upper = m.dir.path().join("u");
    fs::rename(&upper, m.dir.path().join("u.gone")).unwrap();
    // SAFETY: kill(2) of the daemon the status report named.
    assert_eq!(unsafe { libc::kill(daemon, libc::SIGKILL) }, 0);
    let is_guardian = || {
        fs::read(format!("/proc/{holder}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains("__guardian"))
    };
    let start = Instant::now();
    while !is_guardian() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the holder did not become the guardian: {}",
            fs::read_to_string(&m.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let hole = f.write_all_at(b"hole", 1 << 20);
    assert_eq!(hole.map_err(|e| e.raw_os_error()), Err(Some(libc::EIO)));
    f.write_all_at(b"FILLED", 5).unwrap();
    drop(f);
    let start = Instant::now();
    while is_guardian()
        && fs::read_to_string(format!("/proc/{holder}/stat")).is_ok_and(|s| !s.contains(") Z "))
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the guardian stays with no file of its mount open"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    fs::rename(m.dir.path().join("u.gone"), &upper).unwrap();
}
