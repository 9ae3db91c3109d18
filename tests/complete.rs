//! Background completion of partial files.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::*;

fn is_partial(p: &std::path::Path) -> bool {
    get_xattr(p, "trusted.mosaicfs.partial").is_some()
}

fn wait_complete(p: &std::path::Path, limit: Duration) {
    let start = Instant::now();
    while is_partial(p) {
        assert!(
            start.elapsed() < limit,
            "{} not completed within {limit:?}",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Allocated bytes of `p` (what du counts).
fn allocated(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(p).unwrap().blocks() * 512
}

#[test]
fn by_default_a_written_file_stays_partial_longer_than_any_delay() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // Blocks, not files, also a while later: a file written, closed, opened read-write again
    // and written once more, then left alone past every delay the old defaults had
    // (complete_after=10, complete_on_reopen), keeps only the blocks written. Nothing in its
    // use makes a copy pay.
    let base = pattern(8 << 20, 11);
    let mut m = Mount::new(1);
    write(m.lower(0).join("image"), &base);
    m.mount();
    reopen_and_write(&m, "image", 4096, b"1");
    reopen_and_write(&m, "image", 6 << 20, b"2");
    std::thread::sleep(Duration::from_secs(12));
    let upper = m.upper.join("image");
    assert!(is_partial(&upper), "completed without a reason that pays");
    assert!(
        allocated(&upper) <= 4 * 4096,
        "the upper holds {} bytes for two bytes written",
        allocated(&upper)
    );
    let status = run(std::process::Command::new(env!("CARGO_BIN_EXE_mosaicfs"))
        .arg("status")
        .arg(&m.mnt));
    assert!(status.contains("completions=0"), "{status}");
    let mut want = base.clone();
    want[4096] = b'1';
    want[6 << 20] = b'2';
    assert!(fs::read(m.path("image")).unwrap() == want);
    let log = m.unmount();
    assert_eq!(served(&log, "completions"), 0, "{log}");
}

#[test]
fn a_file_in_sustained_use_through_the_daemon_is_completed_where_passthrough_serves_it() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // Rent or buy: 4 KiB writes into one block of a 64 MiB file, each a request through the
    // daemon, soon cost more than copying the file once. The handle that sent them stays on
    // the daemon path whatever the file becomes, so the copy waits for its close; then the
    // file is completed and its next open is served by passthrough. A file with a few writes
    // stays partial.
    let base = pattern(64 << 20, 12);
    let mut m = Mount::new(1);
    write(m.lower(0).join("hot"), &base);
    write(m.lower(0).join("cold"), &base);
    m.mount();
    let cold = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("cold"))
        .unwrap();
    for i in 0..100u64 {
        cold.write_all_at(&[7u8; 4096], i * 4096).unwrap();
    }
    let hot = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("hot"))
        .unwrap();
    let block = vec![5u8; 4096];
    // 64 MiB to copy: 3,125 requests pay for it (docs/PERFORMANCE.md).
    for _ in 0..5000 {
        hot.write_all_at(&block, 8192).unwrap();
    }
    std::thread::sleep(Duration::from_millis(1500)); // the worker looks once a second
    assert!(
        is_partial(&m.upper.join("hot")),
        "completed under a handle that cannot pass through"
    );
    drop(hot);
    wait_complete(&m.upper.join("hot"), Duration::from_secs(120));
    let mut want = base.clone();
    want[8192..12288].fill(5);
    assert!(
        fs::read(m.upper.join("hot")).unwrap() == want,
        "the upper file alone"
    );
    drop(cold);
    assert!(
        is_partial(&m.upper.join("cold")),
        "100 writes do not pay for a copy"
    );
    let log = m.unmount();
    assert_eq!(served(&log, "completions"), 1, "{log}");
}

#[test]
fn a_deleted_partial_file_is_let_go_at_its_last_close() {
    // Nothing completes files here (as on a rootless mount): the daemon must still let go of a
    // partial file deleted while open once it is closed, or its blocks stay allocated until
    // the unmount.
    let mut m = Mount::new(1);
    write(m.lower(0).join("big"), pattern(8 << 20, 14));
    m.extra = opts(&["complete_busy=off", "copy_whole=0"]);
    m.mount();
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("big"))
        .unwrap();
    f.write_all_at(b"x", 4096).unwrap();
    fs::remove_file(m.path("big")).unwrap();
    drop(f);
    let status = || {
        run(std::process::Command::new(env!("CARGO_BIN_EXE_mosaicfs"))
            .arg("status")
            .arg(&m.mnt))
    };
    // The kernel's RELEASE of the last handle is asynchronous.
    let start = Instant::now();
    while !status().contains("partial files open or waiting for completion: 0") {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "still held: {}",
            status()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_rootless_mount_never_completes_by_default() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // In a user namespace nothing passes through, so a complete file would be served exactly
    // as a partial one: however busy the file, completing it would only cost.
    let (d, p) = layer_dirs();
    write(d.path().join("l/big"), pattern(16 << 20, 13));
    let bin = env!("CARGO_BIN_EXE_mosaicfs");
    let script = format!(
        "set -e; {bin} -o lowerdir={p}/l,upperdir={p}/u,workdir={p}/w {p}/m; \
         dd if=/dev/zero of={p}/m/big bs=4096 count=4000 seek=1 conv=notrunc 2>/dev/null; \
         sleep 2; {bin} status {p}/m > {p}/status; umount {p}/m"
    );
    run(std::process::Command::new("unshare").args(["-Urm", "sh", "-c", &script]));
    let status = fs::read_to_string(d.path().join("status")).unwrap();
    assert!(
        status.contains("served by passthrough: no") && status.contains("completions=0"),
        "{status}"
    );
    assert!(get_xattr(&d.path().join("u/big"), "user.mosaicfs.partial").is_some());
}

#[test]
fn an_idle_partial_file_is_completed_and_kernel_overlayfs_reads_it() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(8 << 20, 1);
    let mut m = Mount::new(1);
    write(m.lower(0).join("db"), &base);
    m.extra = vec!["complete_after=0.3".into()];
    m.mount();
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("db"))
        .unwrap();
    f.write_all_at(b"new", 5_000_000).unwrap();
    drop(f);
    assert!(
        is_partial(&m.upper.join("db")),
        "partial right after the write"
    );
    wait_complete(&m.upper.join("db"), Duration::from_secs(10));
    let mut want = base.clone();
    want[5_000_000..5_000_003].copy_from_slice(b"new");
    assert!(
        fs::read(m.path("db")).unwrap() == want,
        "merged view unchanged by completion"
    );
    assert!(
        fs::read(m.upper.join("db")).unwrap() == want,
        "the upper file alone holds the content"
    );
    let log = m.unmount();
    assert_eq!(served(&log, "completions"), 1, "{log}");
    // Kernel overlayfs over the same layers reads the completed file.
    let work2 = m.dir.path().join("work2");
    fs::create_dir(&work2).unwrap();
    sh(&format!(
        "mount -t overlay overlay -o lowerdir={},upperdir={},workdir={} {}",
        m.lower(0).display(),
        m.upper.display(),
        work2.display(),
        m.mnt.display()
    ));
    let read = fs::read(m.path("db"));
    sh(&format!("umount {}", m.mnt.display()));
    assert!(
        read.unwrap() == want,
        "kernel overlayfs reads the completed file"
    );
}

/// Completion copies the lower file's data, not its holes: a sparse lower file completes to
/// a sparse upper one (a 1 GiB file with 16 MiB of data became 1.1 GiB before), with the same
/// content, also after a remount.
#[test]
fn completion_keeps_the_lower_files_holes() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    let size: u64 = 64 << 20;
    let lower = m.lower(0).join("sparse");
    let f = fs::File::create(&lower).unwrap();
    f.set_len(size).unwrap();
    f.write_all_at(&pattern(1 << 20, 2), 0).unwrap();
    f.write_all_at(&pattern(1 << 20, 3), 40 << 20).unwrap();
    f.write_all_at(b"tail", size - 4).unwrap();
    drop(f);
    let mut want = fs::read(&lower).unwrap();
    m.extra = vec!["complete_after=0.3".into()];
    m.mount();
    write_at(m.path("sparse"), 20 << 20, b"in a hole");
    write_at(m.path("sparse"), 100, b"in data");
    want[20 << 20..(20 << 20) + 9].copy_from_slice(b"in a hole");
    want[100..107].copy_from_slice(b"in data");
    wait_complete(&m.upper.join("sparse"), Duration::from_secs(20));
    let upper = m.upper.join("sparse");
    assert!(
        fs::read(&upper).unwrap() == want,
        "the upper file alone holds the content"
    );
    assert!(fs::read(m.path("sparse")).unwrap() == want, "merged view");
    let used = allocated(&upper);
    assert!(
        used < 6 << 20,
        "completed upper file allocates {used} bytes for 2 MiB of data and 3 written blocks"
    );
    m.unmount();
    m.mount();
    assert!(
        fs::read(m.path("sparse")).unwrap() == want,
        "after a remount"
    );
}

/// Writes `data` at `off` through a new descriptor, reporting whether the upper file was
/// partial right after the open returned (before the write).
fn reopen_and_write(m: &Mount, name: &str, off: u64, data: &[u8]) -> bool {
    // Read-write: the daemon path, where reopening is sustained use (a write-only open
    // passes through and needs no completion).
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path(name))
        .unwrap();
    let partial = is_partial(&m.upper.join(name));
    f.write_all_at(data, off).unwrap();
    partial
}

/// A mount whose lower layer holds `names`, each a 4 MiB file of `pattern(.., seed)`, where
/// only a reopen completes a file (`complete_on_reopen=`, an explicit choice; neither
/// idleness nor the share of blocks would).
fn mounted_for_reopens(names: &[&str], seed: u64) -> (Mount, Vec<u8>) {
    let base = pattern(4 << 20, seed);
    let mut m = Mount::new(1);
    for name in names {
        write(m.lower(0).join(name), &base);
    }
    m.extra = opts(&[
        "complete_after=600",
        "complete_ratio=0",
        "complete_on_reopen=256M",
        "complete_busy=off",
    ]);
    m.mount();
    (m, base)
}

#[test]
fn a_written_file_reopened_read_write_is_completed_in_the_background_never_in_its_open() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // Completion follows use: a file written, closed and opened read-write again (a database,
    // a log) is due for completion at once, so that later opens are served by passthrough;
    // but no open copies a file: the copy runs in the background. Neither idleness nor the
    // share of blocks would complete it here.
    let (mut m, base) = mounted_for_reopens(&["log", "owned"], 6);
    assert!(
        reopen_and_write(&m, "log", 4096, b"one"),
        "the first open copies up a partial file with no blocks of its own"
    );
    assert!(
        is_partial(&m.upper.join("log")),
        "the first write copies blocks, not the file"
    );
    reopen_and_write(&m, "log", 3 << 20, b"two");
    wait_complete(&m.upper.join("log"), Duration::from_secs(10));
    let mut want = base.clone();
    want[4096..4099].copy_from_slice(b"one");
    want[3 << 20..(3 << 20) + 3].copy_from_slice(b"two");
    assert!(fs::read(m.path("log")).unwrap() == want);
    assert!(
        fs::read(m.upper.join("log")).unwrap() == want,
        "the upper file alone"
    );
    // A metadata-only copy-up is not a write: the first write after it still copies blocks.
    sh(&format!("chown 1:1 {}", m.path("owned").display()));
    assert!(
        reopen_and_write(&m, "owned", 0, b"x"),
        "partial after chown"
    );
    assert!(is_partial(&m.upper.join("owned")));
    let log = m.unmount();
    assert_eq!(served(&log, "at-open"), 0, "no open copied a file: {log}");
}

#[test]
fn a_file_opened_read_write_before_is_due_at_its_next_writable_open() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // An open for writing that wrote nothing (a database opened read-write and only read)
    // copies up a partial file with no blocks; the next read-write open finds a file in
    // sustained use and the background completes it.
    let (mut m, base) = mounted_for_reopens(&["db", "once"], 9);
    drop(
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.path("db"))
            .unwrap(),
    );
    assert!(
        is_partial(&m.upper.join("db")),
        "the first writable open copies up a partial file, no data"
    );
    reopen_and_write(&m, "db", 1 << 20, b"sustained");
    wait_complete(&m.upper.join("db"), Duration::from_secs(10));
    let mut want = base.clone();
    want[1 << 20..(1 << 20) + 9].copy_from_slice(b"sustained");
    assert!(
        fs::read(m.upper.join("db")).unwrap() == want,
        "the upper file alone"
    );
    // One writable open is not sustained use: its write copies blocks, not the file.
    assert!(reopen_and_write(&m, "once", 0, b"x"));
    assert!(is_partial(&m.upper.join("once")));
    let log = m.unmount();
    assert_eq!(served(&log, "at-open"), 0, "{log}");
}

#[test]
fn write_only_reopens_pass_through_and_the_upper_keeps_only_the_touched_blocks() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // A writer that cannot map the file passes through to the sparse upper file from its
    // first open (pre-content events): no request per write, no copy at any open, and two
    // writable opens with a small write each are not sustained use.
    let (mut m, base) = mounted_for_reopens(&["f"], 11);
    m.unmount();
    m.extra.push("partial_passthrough=on".into());
    m.mount();
    let mut want = base.clone();
    for (i, off) in [5000u64, 3 << 20, 5000].into_iter().enumerate() {
        let started = Instant::now();
        let f = fs::OpenOptions::new()
            .write(true)
            .open(m.path("f"))
            .unwrap();
        let opened = started.elapsed();
        assert!(is_partial(&m.upper.join("f")), "open {i} copied nothing");
        f.write_all_at(b"written", off).unwrap();
        want[off as usize..off as usize + 7].copy_from_slice(b"written");
        drop(f);
        eprintln!("writable open {i}: {opened:?}");
    }
    assert_eq!(requests(&m, "WRITE"), 0, "every write passed through");
    assert!(fs::read(m.path("f")).unwrap() == want, "merged view");
    let used = allocated(&m.upper.join("f"));
    assert!(
        used <= 64 << 10,
        "the upper holds the touched blocks, not the 4 MiB file: {used} bytes"
    );
    let status = run(std::process::Command::new(env!("CARGO_BIN_EXE_mosaicfs"))
        .arg("status")
        .arg(&m.mnt));
    assert!(
        status.contains("passthrough (pre-content events)") && status.contains("waiting"),
        "{status}"
    );
    let log = m.unmount();
    assert_eq!(served(&log, "at-open"), 0, "{log}");
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == want, "after a remount");
}

#[test]
fn a_reopened_file_above_complete_on_reopen_is_completed_in_the_background() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(4 << 20, 7);
    let mut m = Mount::new(1);
    write(m.lower(0).join("log"), &base);
    write(m.lower(0).join("kept"), &base);
    m.extra = opts(&[
        "complete_after=600",
        "complete_ratio=0",
        "complete_on_reopen=1M",
    ]);
    m.mount();
    reopen_and_write(&m, "log", 0, b"one");
    // Never at the open (at-open=0 below): the open makes it due at once.
    reopen_and_write(&m, "log", 8192, b"two");
    wait_complete(&m.upper.join("log"), Duration::from_secs(5));
    let mut want = base.clone();
    want[..3].copy_from_slice(b"one");
    want[8192..8195].copy_from_slice(b"two");
    assert!(fs::read(m.path("log")).unwrap() == want);
    let log = m.unmount();
    assert_eq!(served(&log, "at-open"), 0, "{log}");
    // complete_on_reopen=0: reopening is no reason to complete.
    m.extra = opts(&[
        "complete_after=600",
        "complete_ratio=0",
        "complete_on_reopen=0",
    ]);
    m.mount();
    for i in 0..10u64 {
        assert!(reopen_and_write(&m, "kept", i * 4096, b"k") || i == 0);
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert!(is_partial(&m.upper.join("kept")));
    let status = run(std::process::Command::new(env!("CARGO_BIN_EXE_mosaicfs"))
        .arg("status")
        .arg(&m.mnt));
    assert!(
        status.contains("waiting: no write for 600 s") && !status.contains("open for writing"),
        "{status}"
    );
}

#[test]
fn a_mostly_rewritten_file_is_completed_by_ratio() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), pattern(1 << 20, 2));
    m.extra = vec![
        "complete_after=0".into(),
        "complete_ratio=50".into(),
        "copy_whole=0".into(),
    ];
    m.mount();
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(&vec![9u8; 100 * 4096], 0).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(is_partial(&m.upper.join("f")), "40% present: not yet");
    f.write_all_at(&vec![9u8; 60 * 4096], 100 * 4096).unwrap();
    wait_complete(&m.upper.join("f"), Duration::from_secs(5));
    let mut want = pattern(1 << 20, 2);
    want[..160 * 4096].fill(9);
    assert!(fs::read(m.path("f")).unwrap() == want);
}

#[test]
fn completion_racing_with_writes_loses_nothing() {
    let base = pattern(16 << 20, 3);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    m.extra = vec!["complete_after=0.01".into()];
    m.mount();
    let mut want = base.clone();
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    let mut x: u64 = 12345;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        let off = (x >> 20) as usize % (want.len() - 6000);
        let len = 1 + (x >> 8) as usize % 5000;
        let data: Vec<u8> = (0..len).map(|i| (i as u8) ^ (x as u8)).collect();
        f.write_all_at(&data, off as u64).unwrap();
        want[off..off + len].copy_from_slice(&data);
        std::thread::sleep(Duration::from_millis((x >> 40) % 15));
    }
    drop(f);
    wait_complete(&m.upper.join("f"), Duration::from_secs(20));
    assert!(fs::read(m.path("f")).unwrap() == want, "merged content");
    m.remount();
    assert!(fs::read(m.path("f")).unwrap() == want, "after remount");
}

#[test]
fn a_completed_file_is_served_by_passthrough() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), pattern(1 << 20, 4));
    m.extra = vec!["complete_after=0.1".into()];
    m.mount();
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .write_all_at(b"z", 1)
        .unwrap();
    wait_complete(&m.upper.join("f"), Duration::from_secs(10));
    m.remount();
    let got = fs::read(m.path("f")).unwrap();
    assert_eq!(got[1], b'z');
    let log = m.unmount();
    assert_eq!(served(&log, "read"), 0, "{log}");
    assert!(served(&log, "passthrough") >= 1, "{log}");
}

#[test]
fn kill_9_during_completion_leaves_a_correct_file() {
    let base = pattern(64 << 20, 5);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    m.extra = vec!["complete_after=0.01".into()];
    m.mount();
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .write_all_at(b"k", 33 << 20)
        .unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    m.kill9();
    m.extra = vec!["complete_after=0".into()];
    m.mount();
    let mut want = base;
    want[33 << 20] = b'k';
    assert!(fs::read(m.path("f")).unwrap() == want);
}

#[test]
fn a_file_written_again_after_the_kernel_forgot_it_keeps_both_writes_through_completion() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(1 << 20, 6);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    m.extra = vec!["complete_after=1".into()];
    m.mount();
    let write_at = |off: u64, data: &[u8]| {
        fs::OpenOptions::new()
            .write(true)
            .open(m.path("f"))
            .unwrap()
            .write_all_at(data, off)
            .unwrap();
    };
    write_at(0, b"first");
    // The kernel forgets the inode (memory pressure); the partial file waits for completion.
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    write_at(500_000, b"second");
    wait_complete(&m.upper.join("f"), Duration::from_secs(10));
    let mut want = base.clone();
    want[..5].copy_from_slice(b"first");
    want[500_000..500_006].copy_from_slice(b"second");
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert!(fs::read(m.path("f")).unwrap() == want, "merged view");
    assert!(
        fs::read(m.upper.join("f")).unwrap() == want,
        "completed upper file"
    );
}

#[test]
fn kill_9_while_a_reopen_completes_the_file_keeps_every_synced_byte() {
    // The completion a reopen does before it returns is the background one's: filled blocks,
    // fdatasync, then the mark goes. Killed half-way, the file is a valid partial file.
    let base = pattern(96 << 20, 8);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    m.extra = opts(&["complete_after=0", "complete_ratio=0"]);
    m.mount();
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"synced", 50 << 20).unwrap();
    f.sync_data().unwrap();
    drop(f);
    let path = m.path("f");
    let reopen = std::thread::spawn(move || {
        fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map(|f| f.write_all_at(b"late", 90 << 20))
    });
    std::thread::sleep(Duration::from_millis(40));
    m.kill9();
    let reopened = reopen.join().unwrap();
    m.extra = opts(&["complete_on_reopen=0", "complete_after=0"]);
    m.mount();
    let mut want = base;
    want[50 << 20..(50 << 20) + 6].copy_from_slice(b"synced");
    let got = fs::read(m.path("f")).unwrap();
    // The reopen may have finished before the kill; its write was never synced.
    if reopened.is_ok_and(|w| w.is_ok()) && got[90 << 20..(90 << 20) + 4] == *b"late" {
        want[90 << 20..(90 << 20) + 4].copy_from_slice(b"late");
    }
    assert!(
        got == want,
        "every synced byte, the lower file everywhere else"
    );
}

/// Completion copies no content the user changed, so the file's mtime stays what the user's
/// writes made it (it used to become the time of the completion: a file looked modified
/// seconds after the container last touched it). A write that only reaches a pending block
/// (copy-after-write) still sets the mtime at once.
#[test]
fn completion_keeps_the_mtime_and_a_deferred_write_sets_it() {
    if !runs_on_disk_upper_only() {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), pattern(4 << 20, 7));
    write(m.lower(0).join("g"), pattern(4 << 20, 8));
    m.extra = opts(&["complete_after=0.5"]);
    m.mount();
    let mtime = |p: &std::path::Path| {
        let md = fs::metadata(p).unwrap();
        (md.mtime(), md.mtime_nsec())
    };
    write_at(m.path("f"), 4096, &[1u8; 4096]);
    let written = mtime(&m.path("f"));
    let lower_g = mtime(&m.lower(0).join("g"));
    std::thread::sleep(Duration::from_millis(20));
    // One byte into a block of its own: copy-after-write keeps it pending.
    let g = fs::OpenOptions::new()
        .write(true)
        .open(m.path("g"))
        .unwrap();
    g.write_all_at(b"x", 100_000).unwrap();
    let after_deferred = mtime(&m.path("g"));
    assert!(after_deferred > lower_g, "the write set g's mtime");
    drop(g);
    wait_complete(&m.upper.join("f"), Duration::from_secs(20));
    wait_complete(&m.upper.join("g"), Duration::from_secs(20));
    assert_eq!(mtime(&m.path("f")), written, "completion kept f's mtime");
    assert_eq!(mtime(&m.upper.join("f")), written);
    assert_eq!(
        mtime(&m.path("g")),
        after_deferred,
        "the fill kept g's mtime"
    );
    m.remount();
    assert_eq!(mtime(&m.path("f")), written);
}
