//! Concurrency: many processes changing the tree at once, with directories renamed above them,
//! must see only what a local file system gives (mosaicfs-fsstress checks every result against
//! a model of each process's subtree), and the tree must read right after a remount.

mod common;

use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use common::*;

const STRESS: &str = env!("CARGO_BIN_EXE_mosaicfs-fsstress");

/// Lower subtrees for the stress workers: files, nested dirs, a hard link and a symlink each.
fn stress_lower(l: &Path, workers: usize) {
    for i in 0..workers {
        let d = l.join(format!("top/g{}/w{i}", i % 4));
        write(d.join("sub/deep/g"), b"y\n");
        write(d.join("sub/f"), b"x\n");
        write(d.join("small"), format!("hello{i}\n"));
        write(d.join("big"), vec![i as u8; 5000 + 1000 * i]);
        std::fs::hard_link(d.join("small"), d.join("sub/small-link")).unwrap();
        std::os::unix::fs::symlink("small", d.join("sl")).unwrap();
    }
}

fn run_stress(args: &[&str]) -> (bool, String) {
    let out = Command::new(STRESS).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn stress_then_check(extra: &[&str], seed: &str) {
    let mut m = Mount::new(1);
    stress_lower(m.lower(0), 20);
    m.extra.extend(extra.iter().map(|s| s.to_string()));
    m.mount();
    let state = m.dir.path().join("state");
    let top = m.path("top");
    let (top, state) = (top.to_str().unwrap(), state.to_str().unwrap());
    let (ok, out) = run_stress(&[
        "-d", top, "-p", "20", "-n", "400", "-r", "2", "-s", seed, "--state", state,
    ]);
    let log = m.unmount();
    assert!(
        ok,
        "unexpected results under concurrency:\n{out}\ndaemon log:\n{log}"
    );
    assert!(
        !log.contains("warn"),
        "the daemon complained under concurrency:\n{log}"
    );
    m.mount();
    let (ok, out) = run_stress(&["-d", top, "-p", "20", "--check", "--state", state]);
    assert!(
        ok,
        "after a remount the tree differs from what the processes made:\n{out}"
    );
}

#[test]
fn twenty_processes_with_directories_renamed_above_them_get_no_unexpected_error() {
    stress_then_check(&[], "1");
}

#[test]
fn the_stress_run_holds_with_copy_after_write_filling_lazily_and_no_passthrough() {
    stress_then_check(&["caw_workers=0", "passthrough=off"], "2");
}

#[test]
fn a_lower_hard_link_counts_only_the_names_left_in_the_merged_view() {
    let m = Mount::with(|l| {
        write(l.join("a"), b"data");
        std::fs::hard_link(l.join("a"), l.join("b")).unwrap();
        std::fs::hard_link(l.join("a"), l.join("c")).unwrap();
    });
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(m.path("b")).unwrap().nlink(), 3);
    std::fs::remove_file(m.path("a")).unwrap();
    assert_eq!(std::fs::metadata(m.path("b")).unwrap().nlink(), 2);
    std::fs::rename(m.path("c"), m.path("d")).unwrap();
    assert_eq!(std::fs::metadata(m.path("b")).unwrap().nlink(), 2);
    std::fs::write(m.path("other"), b"x").unwrap();
    std::fs::rename(m.path("other"), m.path("b")).unwrap();
    assert_eq!(std::fs::metadata(m.path("d")).unwrap().nlink(), 1);
    assert_eq!(std::fs::read(m.path("d")).unwrap(), b"data");
}

/// What the mount knows of a lower hard link and the layers do not say — names of it this mount
/// removed, a name written (copied up) that the others must join — outlives the kernel
/// forgetting the inode, as it does under memory pressure (the stress run above, beside a loop
/// of drop_caches, saw a lower file's old content and names counted twice).
#[test]
fn a_lower_hard_link_keeps_what_the_mount_knows_after_the_kernel_forgets_it() {
    let m = Mount::with(|l| {
        write(l.join("a"), b"old");
        std::fs::hard_link(l.join("a"), l.join("b")).unwrap();
        write(l.join("x"), b"x");
        std::fs::hard_link(l.join("x"), l.join("y")).unwrap();
        std::fs::hard_link(l.join("x"), l.join("z")).unwrap();
        write(l.join("p"), b"p");
        std::fs::hard_link(l.join("p"), l.join("q")).unwrap();
        write(l.join("s"), b"s");
        std::fs::hard_link(l.join("s"), l.join("t")).unwrap();
    });
    // A write into the file, not over it (no truncation): a copy-up of the lower file.
    let write_at = |name: &str, data: &[u8]| {
        let f = std::fs::OpenOptions::new().write(true).open(m.path(name));
        f.unwrap().write_all_at(data, 0).unwrap();
    };
    let forget = || {
        for _ in 0..2 {
            // The kernel forgets every inode nothing holds; its FORGETs reach the daemon first.
            std::fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    // Both names looked up, the inode forgotten, then written through one name and that name
    // removed: the other keeps the written content.
    let _ = std::fs::symlink_metadata(m.path("s")).unwrap();
    let _ = std::fs::symlink_metadata(m.path("t")).unwrap();
    forget();
    write_at("s", b"S");
    std::fs::remove_file(m.path("s")).unwrap();
    forget();
    assert_eq!(
        std::fs::read(m.path("t")).unwrap(),
        b"S",
        "a name lost its join"
    );
    let nlink = |n: &str| std::fs::symlink_metadata(m.path(n)).unwrap().nlink();
    // Written through one name while the other was never looked up: still two names.
    write_at("p", b"P");
    assert_eq!(
        nlink("p"),
        2,
        "a lower name not looked up yet is not counted"
    );
    assert_eq!(std::fs::read(m.path("q")).unwrap(), b"P");
    assert_eq!(
        nlink("p"),
        2,
        "the name joined at its lookup is counted twice"
    );
    std::fs::remove_file(m.path("x")).unwrap();
    assert_eq!(nlink("y"), 2);
    write_at("a", b"new");
    forget();
    assert_eq!(
        nlink("y"),
        2,
        "a removed name of a lower hard link counts again"
    );
    assert_eq!(nlink("z"), 2);
    assert_eq!(
        std::fs::read(m.path("b")).unwrap(),
        b"new",
        "a name not joined to its copy"
    );
    assert_eq!(nlink("b"), 2);
    assert_eq!(
        std::fs::symlink_metadata(m.path("a")).unwrap().ino(),
        std::fs::symlink_metadata(m.path("b")).unwrap().ino()
    );
}

#[test]
fn files_held_open_past_the_daemon_limit_fail_only_further_opens() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // 2,500 lower files held open for writing by a daemon allowed 2,000 descriptors (partial
    // files, once written, take two each), so not all can be open at once.
    let mut m = Mount::new(1);
    for i in 0..2500 {
        write(m.lower(0).join(format!("many/f{i}")), format!("lower {i}"));
    }
    write(m.lower(0).join("other"), b"read me");
    m.nofile = Some(2000);
    m.mount();
    let mut held = Vec::new();
    let mut refused = 0;
    for i in 0..2500 {
        match std::fs::OpenOptions::new()
            .write(true)
            .open(m.path(&format!("many/f{i}")))
        {
            Ok(f) => held.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENFILE), "open f{i}: {e}");
                refused += 1;
            }
        }
    }
    assert!(
        refused > 0 && held.len() > 500,
        "{} held, {refused} refused",
        held.len()
    );
    // Everything else still works while they are held.
    assert_eq!(names(m.path("many")).len(), 2500);
    for i in (0..2500).step_by(7) {
        std::fs::metadata(m.path(&format!("many/f{i}"))).unwrap();
    }
    assert_eq!(std::fs::read(m.path("other")).unwrap(), b"read me");
    std::fs::write(m.path("new"), b"created").unwrap();
    std::fs::create_dir(m.path("newdir")).unwrap();
    std::fs::rename(m.path("new"), m.path("newdir/new")).unwrap();
    assert_eq!(std::fs::read(m.path("newdir/new")).unwrap(), b"created");
    // The held files work, and once they are closed every file opens again.
    use std::io::Write;
    held[0].write_all(b"LOWER").unwrap();
    drop(held);
    for i in 0..2500 {
        std::fs::OpenOptions::new()
            .append(true)
            .open(m.path(&format!("many/f{i}")))
            .unwrap_or_else(|e| panic!("open f{i} after the others closed: {e}"));
    }
    assert_eq!(std::fs::read(m.path("many/f0")).unwrap(), b"LOWER 0");
    let log = m.unmount();
    assert!(
        log.contains("RLIMIT_NOFILE") && log.matches("ENFILE").count() == 1,
        "one clear log line: {log}"
    );
}

#[test]
fn a_panicking_request_fails_with_eio_and_the_mount_goes_on() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("big"), vec![b'l'; 1 << 20]);
    m.env.push(("MOSAICFS_TEST_PANIC".into(), "boom".into()));
    m.mount();
    // A partial write whose block waits for copy-after-write while the panics happen.
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(m.path("big"))
        .unwrap();
    f.write_all_at(b"NEW", 5000).unwrap();
    // More panics than the daemon has worker threads: none of them may end one.
    for _ in 0..24 {
        assert_eq!(errno_of(std::fs::metadata(m.path("boom"))), libc::EIO);
    }
    std::fs::write(m.path("after"), b"still served").unwrap();
    assert_eq!(std::fs::read(m.path("after")).unwrap(), b"still served");
    let data = std::fs::read(m.path("big")).unwrap();
    assert_eq!(&data[4999..5004], b"lNEWl");
    drop(f);
    let log = m.unmount();
    assert!(
        log.contains("panicked") && log.contains("injected by MOSAICFS_TEST_PANIC"),
        "the panic is logged: {log}"
    );
    m.env.clear();
    m.mount();
    let data = std::fs::read(m.path("big")).unwrap();
    assert_eq!(&data[4999..5004], b"lNEWl");
    assert_eq!(data.len(), 1 << 20);
}

#[test]
fn whiteouts_are_owned_by_the_daemon_not_by_the_last_caller() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let m = Mount::with(|l| {
        std::fs::create_dir(l.join("d")).unwrap();
        for i in 0..40 {
            write(l.join(format!("d/low{i}")), b"x");
        }
        let mut p = std::fs::metadata(l.join("d")).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut p, 0o777);
        std::fs::set_permissions(l.join("d"), p).unwrap();
    });
    // A user creates a file (the worker thread then runs as that user) and removes a lower
    // file right after, on whatever thread serves it.
    let d = m.path("d");
    sh(&format!(
        "setpriv --reuid 1000 --regid 1000 --clear-groups sh -c \
         'for i in $(seq 0 39); do echo x > {0}/new$i; rm {0}/low$i; done'",
        d.display()
    ));
    use std::os::unix::fs::MetadataExt;
    for i in 0..40 {
        let w = std::fs::symlink_metadata(m.upper.join(format!("d/low{i}"))).unwrap();
        assert_eq!((w.uid(), w.gid()), (0, 0), "whiteout low{i}");
        let n = std::fs::metadata(m.upper.join(format!("d/new{i}"))).unwrap();
        assert_eq!((n.uid(), n.gid()), (1000, 1000), "new{i}");
    }
}

/// `umount` of the overlay, then at once of the file system holding its layers (what
/// fuse-overlayfs' test-mmap.sh does): the daemon must let go of the layers, and exit, within a
/// few seconds every time while another mount is busy, and at once (under 100 ms) in the
/// typical round. A single slow round is the machine (a loaded CI host once took 115 ms after
/// the daemon had exited); a daemon, or a ring, that holds the layers past its exit is slow in
/// every round, so the median catches it.
#[test]
fn hundreds_of_unmounts_under_load_let_go_of_the_layers_at_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    let mut busy = Mount::new(1);
    write(busy.lower(0).join("f"), vec![7u8; 1 << 20]);
    busy.mount();
    let stop = AtomicBool::new(false);
    let rounds = 200;
    let mut freed_after = Vec::with_capacity(rounds);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                use std::os::unix::fs::FileExt;
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(busy.path("f"))
                    .unwrap();
                f.write_all_at(b"load", (i * 4096) % (1 << 20)).unwrap();
                write(busy.path(&format!("d/n{}", i % 50)), b"x");
                i += 1;
            }
        });
        // However the rounds end (a failed assertion too), the load stops: the scope waits for it.
        struct StopOnExit<'a>(&'a AtomicBool);
        impl Drop for StopOnExit<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = StopOnExit(&stop);
        let mut m = Mount::new(1);
        let layers = m.dir.path().join("layers");
        std::fs::create_dir(&layers).unwrap();
        m.lowers = vec![layers.join("lower")];
        m.upper = layers.join("upper");
        m.work = layers.join("work");
        for round in 0..rounds {
            rustix::mount::mount(
                "tmpfs",
                &layers,
                "tmpfs",
                rustix::mount::MountFlags::empty(),
                None,
            )
            .unwrap();
            for d in [&m.lowers[0], &m.upper, &m.work] {
                std::fs::create_dir(d).unwrap();
            }
            write(m.lower(0).join("big"), vec![1u8; 256 << 10]);
            m.mount();
            // A block-level copy-up and a new file: work the daemon holds descriptors for.
            {
                use std::os::unix::fs::FileExt;
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(m.path("big"))
                    .unwrap();
                f.write_all_at(b"changed", 100_000).unwrap();
            }
            write(m.path("new"), b"new");
            let mut daemon = m.take_daemon();
            // A process another test thread is starting holds copies of this thread's
            // descriptors until its exec: the mount is busy that long.
            let asked = Instant::now();
            loop {
                match rustix::mount::unmount(&m.mnt, rustix::mount::UnmountFlags::empty()) {
                    Ok(()) => break,
                    Err(rustix::io::Errno::BUSY) if asked.elapsed() < Duration::from_secs(5) => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => panic!("round {round}: unmount of the mount: {e}"),
                }
            }
            let start = Instant::now();
            let mut busy_seen = Vec::new();
            // Held until the attempt that succeeds begins: how long that umount(2) call then
            // takes is the kernel's (under this load, RCU grace periods: up to a second here).
            let attempt = loop {
                let attempt = Instant::now();
                match rustix::mount::unmount(&layers, rustix::mount::UnmountFlags::empty()) {
                    Ok(()) => {
                        if attempt.elapsed() > Duration::from_millis(100) {
                            eprintln!(
                                "round {round}: umount(2) itself took {:?}",
                                attempt.elapsed()
                            );
                        }
                        break attempt;
                    }
                    Err(rustix::io::Errno::BUSY) if start.elapsed() < Duration::from_secs(5) => {
                        if start.elapsed() > Duration::from_millis(50) && busy_seen.is_empty() {
                            busy_seen = holders_of(&layers);
                            let st = std::fs::read_to_string(format!("/proc/{}/stat", daemon.id()))
                                .unwrap_or_default();
                            busy_seen.push(format!(
                                "daemon state: {}",
                                st.rsplit(')')
                                    .next()
                                    .unwrap_or("")
                                    .split_whitespace()
                                    .next()
                                    .unwrap_or("gone")
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => panic!("round {round}: unmount of the layers' file system: {e}"),
                }
            };
            let freed = attempt - start;
            freed_after.push(freed);
            let status = loop {
                if let Some(st) = daemon.try_wait().unwrap() {
                    break st;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "round {round}: the daemon still runs 5 s after the unmount"
                );
                std::thread::sleep(Duration::from_millis(1));
            };
            assert!(
                status.success(),
                "round {round}: daemon exited with {status}"
            );
            if freed > Duration::from_millis(100) {
                eprintln!(
                    "round {round}: the layers' file system stayed busy for {freed:?} after the \
                     unmount; held by: {}",
                    held_by(&busy_seen)
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    freed_after.sort();
    let (median, slowest) = (freed_after[rounds / 2], freed_after[rounds - 1]);
    eprintln!(
        "{rounds} unmounts; the layers were free {median:?} (median), {slowest:?} (slowest) after each"
    );
    assert!(
        median < Duration::from_millis(100),
        "the layers' file system stayed busy {median:?} after the typical unmount"
    );
    busy.unmount();
}

/// The processes with a descriptor, cwd or mapping below `dir`, as "pid comm: what".
fn holders_of(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = p.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
        let mut links: Vec<std::path::PathBuf> = std::fs::read_dir(p.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .collect();
        links.extend(std::fs::read_link(p.path().join("cwd")));
        let maps = std::fs::read_to_string(p.path().join("maps")).unwrap_or_default();
        links.extend(
            maps.lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .map(std::path::PathBuf::from),
        );
        for l in links.iter().filter(|l| l.starts_with(dir)) {
            out.push(format!("{pid} {}: {}", comm.trim(), l.display()));
        }
    }
    out
}

fn held_by(seen: &[String]) -> String {
    if seen.is_empty() {
        "no holder seen".into()
    } else {
        seen.join(", ")
    }
}

/// A rename over a file frees its upper inode before the rename has forgotten the name; a file
/// another process makes at that moment may get the same number. It is a new file with one
/// link, not the renamed-over one (which the kernel would then drop to 0 links: link(2) of the
/// new file failed with ENOENT, 1 run in 20 of mosaicfs-fsstress).
#[test]
fn a_new_file_on_the_number_a_rename_just_freed_is_a_new_inode() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let m = Mount::new(1);
    let mut m = m;
    m.mount();
    let stop = AtomicBool::new(false);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(4);
    std::thread::scope(|s| {
        for t in 0..2 {
            let (m, stop) = (&m, &stop);
            s.spawn(move || {
                let d = m.path(&format!("r{t}"));
                std::fs::create_dir(&d).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::fs::write(d.join("a"), b"a").unwrap();
                    std::fs::write(d.join("b"), b"b").unwrap();
                    std::fs::rename(d.join("a"), d.join("b")).unwrap();
                }
            });
        }
        let d = m.path("c");
        std::fs::create_dir(&d).unwrap();
        let mut i = 0u64;
        while std::time::Instant::now() < deadline {
            let (f, l) = (d.join(format!("f{i}")), d.join(format!("l{i}")));
            std::fs::write(&f, b"new").unwrap();
            if let Err(e) = std::fs::hard_link(&f, &l) {
                stop.store(true, Ordering::Relaxed);
                panic!("round {i}: link of a file just made: {e}");
            }
            std::fs::remove_file(&f).unwrap();
            std::fs::remove_file(&l).unwrap();
            i += 1;
        }
        stop.store(true, Ordering::Relaxed);
    });
}

/// The kernel looks a name up and then sends the open; another caller may remove the file in
/// between (leaving a whiteout, a char device 0/0, where a lower file had the name) or rename
/// another file over it. The open must then give ENOENT or the file the name holds now, never
/// an error of the object it found (ENXIO from the whiteout) nor the new file's data under the
/// old file's inode. Each file here holds its own inode number, so a reader tells the two apart.
#[test]
fn opens_racing_a_removal_or_a_rename_over_the_name_get_a_whole_file_or_enoent() {
    use std::os::unix::fs::MetadataExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    let m = Mount::with(|l| write(l.join("d/f"), "lower"));
    let (name, tmp) = (m.path("d/f"), m.path("d/tmp"));
    let stop = AtomicBool::new(false);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    std::thread::scope(|s| {
        let readers: Vec<_> = [false, true]
            .into_iter()
            .map(|writable| {
                let (name, stop) = (&name, &stop);
                s.spawn(move || {
                    let (mut opened, mut mismatched) = (0u64, Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        let f = match std::fs::OpenOptions::new()
                            .read(true)
                            .write(writable)
                            .open(name)
                        {
                            Ok(f) => f,
                            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                            Err(e) => panic!("open (writable: {writable}): {e}"),
                        };
                        let mut text = String::new();
                        std::io::Read::read_to_string(&mut &f, &mut text).unwrap();
                        let ino = f.metadata().unwrap().ino().to_string();
                        if text != "lower" && text != ino {
                            mismatched.push((text, ino));
                        }
                        opened += 1;
                    }
                    (opened, mismatched)
                })
            })
            .collect();
        let mut round = 0u64;
        while std::time::Instant::now() < deadline {
            let f = std::fs::File::create(&tmp).unwrap();
            std::io::Write::write_all(&mut &f, f.metadata().unwrap().ino().to_string().as_bytes())
                .unwrap();
            drop(f);
            std::fs::rename(&tmp, &name).unwrap();
            if round % 2 == 1 {
                std::fs::remove_file(&name).unwrap();
            }
            round += 1;
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            let (opened, mismatched) = r.join().unwrap();
            assert!(opened > 0, "no open got through in {round} rounds");
            assert!(
                mismatched.is_empty(),
                "{} of {opened} opens read another file's data than their inode's \
                 (data, inode): {:?}",
                mismatched.len(),
                &mismatched[..mismatched.len().min(5)]
            );
        }
    });
}

/// The upper file system gives a removed file's inode number to the next file made; the
/// kernel, shown that number as a new object while it still has the old one, fails every call
/// on its way to the old inode with EIO. And where a lower file has the name, a removal leaves
/// a whiteout (a char device) at the path the daemon stats. Calls on a name that is being
/// removed and made again must see the file or ENOENT, as on a local file system.
#[test]
fn calls_racing_the_removal_and_remaking_of_a_name_never_fail_with_eio() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let m = Mount::with(|l| write(l.join("lower-has-it"), "lower"));
    for name in ["upper-only", "lower-has-it"] {
        let name = m.path(name);
        let stop = AtomicBool::new(false);
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
        std::thread::scope(|s| {
            let callers: Vec<_> = (0..3)
                .map(|kind| {
                    let (name, stop) = (&name, &stop);
                    s.spawn(move || {
                        let mut done = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            let r = match kind {
                                0 => std::fs::set_permissions(
                                    name,
                                    std::fs::Permissions::from_mode(0o600),
                                ),
                                1 => try_set_xattr(name, "user.k", b"v"),
                                _ => std::fs::metadata(name).map(drop),
                            };
                            match r {
                                Ok(()) => done += 1,
                                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                                Err(e) => {
                                    stop.store(true, Ordering::Relaxed);
                                    panic!("call {kind} on {name:?} after {done} others: {e}");
                                }
                            }
                        }
                        done
                    })
                })
                .collect();
            while std::time::Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                std::fs::write(&name, b"x").unwrap();
                std::fs::remove_file(&name).unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            for c in callers {
                assert!(c.join().unwrap() > 0, "no call found {name:?}");
            }
        });
    }
}

/// Threads sharing a small pool of names in a few directories (lower files among them, one a
/// lower hard link), each doing any namespace or data call on any of them: every call must end
/// as on a local file system (the call's own errors only, never EIO, ESTALE, ENXIO or EXDEV),
/// the daemon must not complain, and a remount must show the tree the mount showed.
/// (mosaicfs-fsstress gives each process a subtree of its own; here they collide.)
#[test]
fn threads_colliding_on_shared_names_get_only_local_file_system_errors() {
    use rand::{Rng, SeedableRng};
    let mut m = Mount::with(|l| {
        for n in ["x", "y", "z"] {
            write(l.join("lower").join(n), vec![b'l'; 20000]);
            write(l.join("lower/sub").join(n), b"sub");
        }
        std::fs::hard_link(l.join("lower/x"), l.join("lower/sub/f")).unwrap();
        write(l.join("a/x"), "ax");
    });
    let dirs = ["", "a", "b", "a/c", "lower", "lower/sub"];
    for d in &dirs[1..] {
        std::fs::create_dir_all(m.path(d)).unwrap();
    }
    let names: Vec<std::path::PathBuf> = dirs
        .iter()
        .flat_map(|d| ["x", "y", "z", "c", "sub", "f"].map(|n| m.path("").join(d).join(n)))
        .collect();
    let allowed = [
        libc::ENOENT,
        libc::EEXIST,
        libc::ENOTEMPTY,
        libc::ENOTDIR,
        libc::EISDIR,
        libc::EINVAL,
        libc::ELOOP,
        libc::ENODATA,
        libc::EPERM,
        libc::EBUSY,
    ];
    let seed: u64 = std::env::var("MOSAICFS_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("seed {seed} (MOSAICFS_TEST_SEED)");
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (names, dirs) = (&names, &dirs);
                let m = &m;
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed + t);
                    let mut bad = Vec::new();
                    for _ in 0..4000 {
                        let p = &names[rng.gen_range(0..names.len())];
                        let q = &names[rng.gen_range(0..names.len())];
                        let op = rng.gen_range(0..16);
                        let r: std::io::Result<()> = (|| match op {
                            0 => std::fs::write(p, vec![b'c'; rng.gen_range(1..9000)]),
                            1 => {
                                let f = std::fs::OpenOptions::new().write(true).open(p)?;
                                f.write_all_at(b"pwrite", rng.gen_range(0..25000))
                            }
                            2 => {
                                let f = std::fs::OpenOptions::new().append(true).open(p)?;
                                (&f).write_all(b"appended")
                            }
                            3 => std::fs::OpenOptions::new()
                                .write(true)
                                .open(p)?
                                .set_len(rng.gen_range(0..30000)),
                            4 => std::fs::rename(p, q),
                            5 => std::fs::hard_link(p, q),
                            6 => std::fs::remove_file(p),
                            7 => std::fs::create_dir(p),
                            8 => std::fs::remove_dir(p),
                            9 => std::os::unix::fs::symlink("x", p),
                            10 => {
                                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o640))
                            }
                            11 => try_set_xattr(p, "user.k", b"v"),
                            12 => std::fs::read(p).map(drop),
                            13 => std::fs::symlink_metadata(p).map(drop),
                            14 => {
                                let d = m.path(dirs[rng.gen_range(0..dirs.len())]);
                                for e in std::fs::read_dir(d)? {
                                    let _ = std::fs::symlink_metadata(e?.path());
                                }
                                Ok(())
                            }
                            _ => std::fs::OpenOptions::new()
                                .write(true)
                                .truncate(true)
                                .open(p)
                                .map(drop),
                        })();
                        if let Err(e) = r
                            && !allowed.contains(&e.raw_os_error().unwrap_or(0))
                        {
                            bad.push(format!("op {op} on {p:?} ({q:?}): {e}"));
                        }
                    }
                    bad
                })
            })
            .collect();
        let bad: Vec<String> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert!(
            bad.is_empty(),
            "seed {seed}: errors a local file system would not give: {bad:#?}"
        );
    });
    let snapshot = |m: &Mount| {
        let mut out = Vec::new();
        let mut todo = vec![m.path("")];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let meta = std::fs::symlink_metadata(&p).unwrap_or_else(|e| {
                    // Which side is stale: the kernel's dentry (the daemon has the name) or
                    // the daemon's listing.
                    std::fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
                    panic!(
                        "seed {seed}: {p:?} listed, but lstat says {e}; after drop_caches: \
                         {:?}",
                        std::fs::symlink_metadata(&p).map(|m| m.ino())
                    )
                });
                let what = if meta.is_dir() {
                    todo.push(p.clone());
                    format!("dir {:o}", meta.mode())
                } else if meta.is_symlink() {
                    format!("-> {:?}", std::fs::read_link(&p).unwrap())
                } else {
                    let data = std::fs::read(&p).unwrap();
                    let sum = data
                        .iter()
                        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(*b as u64));
                    format!(
                        "{:o} {} {sum:x} {:?}",
                        meta.mode(),
                        data.len(),
                        get_xattr(&p, "user.k")
                    )
                };
                out.push((
                    p.strip_prefix(m.path("")).unwrap().display().to_string(),
                    what,
                ));
            }
        }
        out.sort();
        out
    };
    let before = snapshot(&m);
    let log = m.unmount();
    assert!(
        !log.contains("warn"),
        "seed {seed}: the daemon complained:\n{log}"
    );
    m.mount();
    assert_eq!(
        snapshot(&m),
        before,
        "seed {seed}: the remount shows another tree"
    );
}

/// A lookup of a directory racing with a move into it of a copied-up file: the move marks the
/// directory as holding entries with origins (dir.rs `note_origin_moved_into`), and a lookup
/// that read the directory before must not take the mark back when it records what it found.
/// Without the mark, lookups inside the directory stop reading origins and the moved file
/// shows its upper inode number instead of the one it had.
#[test]
fn a_file_moved_into_a_directory_being_looked_up_keeps_its_inode_number() {
    let rounds = 200;
    let mut m = Mount::new(1);
    for i in 0..rounds {
        write(m.lower(0).join(format!("a{i}")), b"lower");
    }
    m.extra.push("timeout=0".into());
    m.mount();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for i in 0..rounds {
        let dir = m.path(&format!("e{i}"));
        std::fs::create_dir(&dir).unwrap();
        let a = m.path(&format!("a{i}"));
        // chmod copies the metadata up: the upper file gets an origin.
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o600)).unwrap();
        let ino = std::fs::metadata(&a).unwrap().ino();
        stop.store(false, std::sync::atomic::Ordering::Relaxed);
        let lookers: Vec<_> = (0..2)
            .map(|_| {
                let (dir, stop) = (dir.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = std::fs::metadata(&dir);
                    }
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_micros(200));
        std::fs::rename(&a, dir.join("a")).unwrap();
        std::thread::sleep(std::time::Duration::from_micros(200));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for l in lookers {
            l.join().unwrap();
        }
        assert_eq!(
            std::fs::metadata(dir.join("a")).unwrap().ino(),
            ino,
            "round {i}: the moved file changed its inode number"
        );
    }
}

/// A writable open copies the lower file up under the name the kernel looked up; a rename
/// over that name meanwhile took it. The open must find what the name holds now (ESTALE
/// makes the kernel look it up again), not fail with the copy-up's EEXIST.
#[test]
fn a_writable_open_racing_a_rename_over_a_lower_file_gets_a_file_not_eexist() {
    let rounds = 300;
    let m = Mount::with(|l| {
        for i in 0..rounds {
            write(l.join(format!("d/f{i}")), "lower");
        }
    });
    let mut opened = 0;
    for i in 0..rounds {
        let (f, t) = (m.path(&format!("d/f{i}")), m.path(&format!("d/t{i}")));
        // Looked up before the race, as the kernel does before it sends OPEN.
        assert!(f.exists());
        write(&t, "upper");
        let start = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            let opener = s.spawn(|| {
                start.wait();
                std::fs::OpenOptions::new().read(true).write(true).open(&f)
            });
            start.wait();
            std::fs::rename(&t, &f).unwrap();
            match opener.join().unwrap() {
                Ok(file) => {
                    let mut text = String::new();
                    std::io::Read::read_to_string(&mut &file, &mut text).unwrap();
                    assert!(text == "lower" || text == "upper", "round {i}: {text:?}");
                    opened += 1;
                }
                Err(e) => panic!("round {i}: writable open racing a rename over it: {e}"),
            }
        });
    }
    assert_eq!(opened, rounds);
}

/// The file `name` of each of the daemon's threads (/proc/PID/task/TID/`name`).
fn per_thread(m: &Mount, name: &str) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{}/task", m.pid()))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join(name)).ok())
        .collect()
}

/// The daemon's threads by name (`comm`), e.g. "fuser-0", "mosaicfs-caw-0".
fn thread_names(m: &Mount) -> Vec<String> {
    per_thread(m, "comm")
        .iter()
        .map(|s| s.trim().to_string())
        .collect()
}

/// The daemon's threads once its session has started them all: the pool's supervisor
/// ("fuser-pool") starts after the workers, and a mount returns before either exists.
fn started_thread_names(m: &Mount) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let names = thread_names(m);
        if names.iter().any(|n| n == "fuser-pool") || std::time::Instant::now() > deadline {
            return names;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Whether the mount's requests come over io_uring (its workers are the rings').
fn over_io_uring(m: &Mount) -> bool {
    started_thread_names(m)
        .iter()
        .any(|n| n.starts_with("fuser-ring"))
}

/// How many of these threads are FUSE workers (over /dev/fuse or io_uring).
fn workers_among(names: &[String]) -> usize {
    names
        .iter()
        .filter(|n| n.starts_with("fuser-") && *n != "fuser-pool")
        .count()
}

/// The daemon's FUSE workers.
fn fuse_workers(m: &Mount) -> usize {
    workers_among(&thread_names(m))
}

#[test]
fn an_idle_mount_holds_one_worker_and_the_pool_grows_with_demand() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), "x");
    m.mount();
    let names = started_thread_names(&m);
    assert!(
        !names
            .iter()
            .any(|n| n.starts_with("mosaicfs-caw") || n.starts_with("mosaicfs-comple")),
        "copy-after-write and completion workers start at their first job: {names:?}"
    );
    // Over io_uring every queue needs its entries from the start; over /dev/fuse one worker
    // waits at mount.
    if names.iter().any(|n| n.starts_with("fuser-ring")) {
        return;
    }
    assert!(
        workers_among(&names) <= 2,
        "an idle mount's FUSE workers: {names:?}"
    );
    // Eight callers at once, each request answered by the daemon (xattrs are never cached),
    // until the pool has grown: the supervisor that adds workers is a thread like any other,
    // and on a busy machine it may run only after many requests.
    let path = m.path("f");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut names = thread_names(&m);
    while workers_among(&names) <= 2 && std::time::Instant::now() < deadline {
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..400 {
                        let _ = xattr_get(&path, "user.none");
                    }
                });
            }
        });
        names = thread_names(&m);
    }
    assert!(
        workers_among(&names) > 2,
        "eight callers at once and the pool did not grow: {names:?}"
    );
}

/// Workers added while every one was stuck leave once the pool has had idle workers for a
/// while (vendored fuser `WorkerPool::offer_retirement`): a pool grown in a burst does not keep
/// its threads, and their memory, for the life of the mount. Without it the pool stays at its
/// peak. The mount serves as before, and grows again when it must. Requests that come one
/// at a time after the burst find the extra workers waiting in their reads, and the last
/// request leaves them there: they leave all the same (they once looked whether they might
/// leave only between two requests, and one left waiting in its read stayed until a request
/// came its way, forever on a mount that then goes quiet).
#[test]
fn workers_added_while_all_were_stuck_leave_when_idle() {
    let mut m = Mount::new(1);
    for i in 0..32 {
        write(m.lower(0).join(format!("f{i}")), "x");
    }
    m.env
        .push(("MOSAICFS_TEST_SLOW_RELEASE".into(), "300".into()));
    m.env
        .push(("MOSAICFS_TEST_RETIRE_AFTER_MS".into(), "3000".into()));
    m.mount();
    if over_io_uring(&m) {
        return;
    }
    // Every RELEASE holds its worker 300 ms: 32 closes at once keep every worker stuck. The
    // most workers seen while a burst's closes are served: on a loaded machine the extra
    // workers may come late and leave (3 s idle) between two slower looks.
    let grow = |m: &Mount| {
        let mut most = 0;
        for _burst in 0..100 {
            let files: Vec<_> = (0..32)
                .map(|i| std::fs::File::open(m.path(&format!("f{i}"))).unwrap())
                .collect();
            drop(files);
            for _look in 0..100 {
                most = most.max(fuse_workers(m));
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if most > 8 {
                break;
            }
        }
        most
    };
    let grown = grow(&m);
    assert!(grown > 8, "the pool never grew past 8 workers: {grown}");
    // A few lone requests (lookups of names that are not there) before the extra workers may
    // leave, then nothing.
    for i in 0..10 {
        assert!(std::fs::symlink_metadata(m.path(&format!("none{i}"))).is_err());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while fuse_workers(&m) > 8 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let left = fuse_workers(&m);
    assert!(
        left <= 8,
        "{grown} workers, and {left} a minute after the burst"
    );
    assert_eq!(std::fs::read(m.path("f0")).unwrap(), b"x");
    assert!(grow(&m) > 8, "the pool grows again");
}

/// Workers the pool added by demand leave once the mount has been quiet a while (vendored
/// fuser `WorkerPool::shrink`), so that an idle mount holds one worker again after a burst;
/// and the signal that ends a leaving worker's read never reaches a request: callers that
/// keep coming in bursts while workers leave see every answer right. Without the shrink the
/// pool stays at its peak.
#[test]
fn workers_added_by_demand_leave_when_the_mount_is_quiet() {
    let mut m = Mount::new(1);
    for i in 0..8 {
        write(m.lower(0).join(format!("f{i}")), format!("lower {i}"));
    }
    m.env
        .push(("MOSAICFS_TEST_SHRINK_AFTER_MS".into(), "200".into()));
    m.mount();
    if over_io_uring(&m) {
        return;
    }
    // Callers in bursts, each request answered by the daemon (xattrs are never cached), and
    // files written and read back; a burst every 300 ms, longer than the quiet the pool waits.
    // Returns the most workers seen while the callers ran (on a loaded machine the workers
    // a burst added may have left again by its end).
    let burst = |m: &Mount, round: usize| {
        let callers_done = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            let sampler = s.spawn(|| {
                let mut most = 0;
                // Bounded: a caller that fails never counts itself done.
                let give_up = std::time::Instant::now() + std::time::Duration::from_secs(60);
                while callers_done.load(std::sync::atomic::Ordering::Acquire) < 4
                    && std::time::Instant::now() < give_up
                {
                    most = most.max(fuse_workers(m));
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                most.max(fuse_workers(m))
            });
            for t in 0..4 {
                let callers_done = &callers_done;
                let m = &m;
                s.spawn(move || {
                    for i in 0..100 {
                        let f = format!("f{}", (t + i) % 8);
                        assert!(xattr_get(&m.path(&f), "user.none").is_err());
                        let want = format!("lower {}", (t + i) % 8);
                        assert_eq!(std::fs::read_to_string(m.path(&f)).unwrap(), want);
                    }
                    let own = m.path(&format!("w{t}"));
                    let text = format!("round {round} thread {t}");
                    std::fs::write(&own, &text).unwrap();
                    assert_eq!(std::fs::read_to_string(&own).unwrap(), text);
                    std::fs::remove_file(&own).unwrap();
                    callers_done.fetch_add(1, std::sync::atomic::Ordering::Release);
                });
            }
            sampler.join().unwrap()
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut peak = 0;
    let mut round = 0;
    while std::time::Instant::now() < deadline && (round < 20 || peak < 2) {
        peak = peak.max(burst(&m, round));
        round += 1;
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    assert!(peak >= 2, "four callers at once and the pool never grew");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while fuse_workers(&m) > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let left = fuse_workers(&m);
    assert_eq!(
        left, 1,
        "{peak} workers at the peak, {left} after a quiet minute"
    );
    burst(&m, round);
}

/// A caller that sends one request at a time keeps the pool at one worker (vendored fuser
/// `GROW_LOAD_PERCENT`): the pool grows when its workers were busy most of the time since the
/// supervisor's last look, which one caller waiting for each answer never makes them. Each
/// request then finds the worker that served the last one, warm on its CPU; a lone `tar -x`
/// over two workers or more ran a fifth slower. The pool once grew whenever a request left
/// no worker idle and none was back a millisecond later, which a lone caller's next request
/// often found, and woke its supervisor for every such request. On a loaded machine a
/// worker that loses its CPU mid-request counts as busy, so the check is that one of a few
/// runs kept one worker; the old pool grew in every run.
#[test]
fn a_lone_caller_keeps_one_worker() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), "x");
    m.env
        .push(("MOSAICFS_TEST_SHRINK_AFTER_MS".into(), "200".into()));
    m.mount();
    if over_io_uring(&m) {
        return;
    }
    let path = m.path("f");
    let mut most_per_run = Vec::new();
    for _run in 0..5 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while fuse_workers(&m) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let done = std::sync::atomic::AtomicBool::new(false);
        let most = std::thread::scope(|s| {
            let sampler = s.spawn(|| {
                let mut most = 0;
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    most = most.max(fuse_workers(&m));
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                most.max(fuse_workers(&m))
            });
            // Each request answered by the daemon: xattrs are never cached.
            for _ in 0..5000 {
                assert!(xattr_get(&path, "user.none").is_err());
            }
            done.store(true, std::sync::atomic::Ordering::Release);
            sampler.join().unwrap()
        });
        most_per_run.push(most);
        if most == 1 {
            break;
        }
    }
    assert!(
        most_per_run.contains(&1),
        "one caller at a time, and the pool grew in every run: the most workers of each run \
         {most_per_run:?}"
    );
}

/// Context switches of all the daemon's threads so far (each wake-up of a sleeping thread is
/// one).
fn daemon_switches(m: &Mount) -> u64 {
    per_thread(m, "status")
        .iter()
        .flat_map(|s| s.lines().filter(|l| l.contains("ctxt_switches:")))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// An idle daemon sleeps: no thread wakes while no request comes (the pool's supervisor
/// ticked five times a second until it learned to sleep until a worker is busy), and a
/// request after the sleep is answered.
#[test]
fn an_idle_daemon_does_not_wake() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), "x");
    m.mount();
    assert_eq!(std::fs::read(m.path("f")).unwrap(), b"x");
    // Held open, so that the kernel keeps the file's inode: under memory pressure it would
    // forget it, and the FORGET is a request that wakes the daemon.
    let held = std::fs::File::open(m.path("f")).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let before = daemon_switches(&m);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let woke = daemon_switches(&m) - before;
    assert!(woke <= 2, "an idle daemon woke {woke} times in 1.5 s");
    assert!(xattr_get(&m.path("f"), "user.none").is_err());
    drop(held);
}

fn xattr_get(p: &Path, name: &str) -> std::io::Result<usize> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: both strings are NUL-terminated and the buffer is as long as said.
    let r = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// The daemon's environment, as `NAME=value` strings.
fn daemon_environment(m: &Mount) -> Vec<String> {
    std::fs::read(format!("/proc/{}/environ", m.pid()))
        .unwrap()
        .split(|&b| b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect()
}

/// The daemon runs without glibc's per-thread malloc cache (it re-executes itself at mount
/// with the tunable set: `exec_without_malloc_cache`), whose chunks kept a megabyte of heap
/// pages after the kernel forgot a walk's inodes; a tunable of the caller's own is kept, and
/// a tcache setting of the caller's wins.
#[test]
fn the_daemon_runs_without_the_malloc_cache_and_keeps_the_callers_tunables() {
    let tunables = |m: &Mount| {
        daemon_environment(m)
            .into_iter()
            .find_map(|v| v.strip_prefix("GLIBC_TUNABLES=").map(str::to_string))
    };
    // glibc cuts the copy /proc shows at the first tunable as it reads them (the daemon's own
    // environment, which its children get, has all): the first is the malloc cache's.
    let mut m = Mount::new(1);
    m.mount();
    assert_eq!(tunables(&m).as_deref(), Some("glibc.malloc.tcache_count=0"));
    m.unmount();
    let mut m = Mount::new(1);
    m.env.push((
        "GLIBC_TUNABLES".into(),
        "glibc.malloc.trim_threshold=131072".into(),
    ));
    m.mount();
    // Only the caller's shows, for the same reason.
    assert_eq!(
        tunables(&m).as_deref(),
        Some("glibc.malloc.trim_threshold=131072")
    );
    m.unmount();
    let mut m = Mount::new(1);
    m.env.push((
        "GLIBC_TUNABLES".into(),
        "glibc.malloc.tcache_count=3".into(),
    ));
    m.mount();
    assert_eq!(tunables(&m).as_deref(), Some("glibc.malloc.tcache_count=3"));
}
