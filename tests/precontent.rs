//! Partial files whose write-only writers pass through to the sparse upper file, told of
//! each first touch by fanotify pre-content events (src/file/partial/precontent.rs). These need a disk
//! upper (a memory upper's files have no descriptor to pass through to).

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::*;

fn is_partial(p: &std::path::Path) -> bool {
    get_xattr(p, "trusted.mosaicfs.partial").is_some()
}

fn write_only(m: &Mount, name: &str) -> fs::File {
    fs::OpenOptions::new()
        .write(true)
        .open(m.path(name))
        .unwrap()
}

/// A mount of one lower file `f` of `len` bytes of `pattern(.., seed)` that never completes
/// files by itself.
fn mounted(len: usize, seed: u64, env: &[(&str, &str)]) -> (Mount, Vec<u8>) {
    let base = pattern(len, seed);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    m.extra = opts(&[
        "complete_after=0",
        "complete_ratio=0",
        "copy_whole=0",
        "partial_passthrough=on",
    ]);
    for (k, v) in env {
        m.env.push((k.to_string(), v.to_string()));
    }
    m.mount();
    (m, base)
}

#[test]
fn a_one_byte_write_through_passthrough_fills_one_block_and_no_request_carries_data() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let (mut m, base) = mounted(64 << 20, 1, &[]);
    let f = write_only(&m, "f");
    f.write_all_at(b"x", 40_000_001).unwrap();
    // A second write into the same block, and one into a block of its own.
    f.write_all_at(b"y", 40_000_002).unwrap();
    f.write_all_at(b"z", 7).unwrap();
    drop(f);
    let mut want = base.clone();
    want[40_000_001] = b'x';
    want[40_000_002] = b'y';
    want[7] = b'z';
    assert_eq!(requests(&m, "WRITE"), 0, "the writes passed through");
    let upper = m.upper.join("f");
    assert!(is_partial(&upper));
    assert!(
        allocated(&upper) <= 16 << 10,
        "two blocks filled, not the file: {} bytes",
        allocated(&upper)
    );
    assert!(fs::read(m.path("f")).unwrap() == want, "merged view");
    // The upper file's filled blocks hold the lower data around the written bytes.
    let mut block = vec![0u8; 4096];
    fs::File::open(&upper)
        .unwrap()
        .read_exact_at(&mut block, 40_000_001 / 4096 * 4096)
        .unwrap();
    let at = 40_000_001 / 4096 * 4096;
    assert!(
        block == want[at..at + 4096],
        "the block was filled before the write"
    );
    let log = m.unmount();
    assert!(served(&log, "event-fills") >= 2, "{log}");
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == want, "after a remount");
}

#[test]
fn a_sequential_writer_fills_ahead_and_the_file_reads_right_at_every_step() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let (mut m, base) = mounted(8 << 20, 2, &[]);
    let f = write_only(&m, "f");
    let mut want = base.clone();
    // 1000-byte writes: none covers a block, so every block must be filled before its write.
    for i in 0..3000u64 {
        let data = [(i % 251) as u8; 1000];
        f.write_all_at(&data, i * 1000 + 3).unwrap();
        want[(i * 1000 + 3) as usize..(i * 1000 + 1003) as usize].copy_from_slice(&data);
    }
    drop(f);
    assert!(fs::read(m.path("f")).unwrap() == want);
    let log = m.unmount();
    let fills = served(&log, "event-fills");
    assert!(
        fills < 300,
        "3 MB written sequentially: {fills} events filled (a window, not a block, each)"
    );
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == want, "after a remount");
}

#[test]
fn completion_removes_the_mark_and_the_writer_already_open_runs_natively() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(4 << 20, 3);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    m.extra = opts(&[
        "complete_after=0.2",
        "complete_ratio=0",
        "copy_whole=0",
        "partial_passthrough=on",
    ]);
    m.mount();
    let f = write_only(&m, "f");
    f.write_all_at(b"first", 100).unwrap();
    let upper = m.upper.join("f");
    let start = Instant::now();
    while is_partial(&upper) {
        assert!(start.elapsed() < Duration::from_secs(20), "never completed");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Complete: the same descriptor writes on, with no event and no request.
    let status = || {
        run(std::process::Command::new(env!("CARGO_BIN_EXE_mosaicfs"))
            .arg("status")
            .arg(&m.mnt))
    };
    let before = status();
    for i in 0..100u64 {
        f.write_all_at(b"later", (1 << 20) | (i * 4096)).unwrap();
    }
    let after = status();
    let word = |s: &str, key: &str| -> u64 {
        let at = s.find(key).unwrap_or_else(|| panic!("no {key} in {s}")) + key.len();
        s[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(
        word(&before, "answered-at-once="),
        word(&after, "answered-at-once="),
        "events after the mark went: {after}"
    );
    assert_eq!(word(&after, "marked-files="), 0, "{after}");
    assert_eq!(requests(&m, "WRITE"), 0);
    drop(f);
    let mut want = base;
    want[100..105].copy_from_slice(b"first");
    for i in 0..100usize {
        want[(1 << 20) + i * 4096..(1 << 20) + i * 4096 + 5].copy_from_slice(b"later");
    }
    assert!(fs::read(&upper).unwrap() == want, "the upper file alone");
}

#[test]
fn truncation_extension_and_seek_while_a_writer_passes_through() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let (mut m, base) = mounted(1 << 20, 4, &[]);
    let f = write_only(&m, "f");
    // Past the end: the file grows through passthrough, beyond what the daemon saw.
    f.write_all_at(b"tail", (3 << 20) + 10).unwrap();
    let mut want = base.clone();
    want.resize((3 << 20) + 14, 0);
    want[(3 << 20) + 10..].copy_from_slice(b"tail");
    let reader = fs::File::open(m.path("f")).unwrap();
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut &reader, &mut got).unwrap();
    assert!(
        got == want,
        "a reader through the daemon sees the grown file"
    );
    // SEEK_HOLE must not find a hole where the lower file has data; SEEK_DATA finds the tail.
    let hole = rustix::fs::seek(&reader, rustix::fs::SeekFrom::Hole(0)).unwrap();
    assert_eq!(hole, 1 << 20, "the lower data runs to its end");
    let data = rustix::fs::seek(&reader, rustix::fs::SeekFrom::Data(2 << 20)).unwrap();
    assert_eq!(data, 3 << 20, "the block written past the old end");
    // Shrink below the lower data, then write past it again: zeros, never old lower bytes.
    f.set_len(1000).unwrap();
    f.write_all_at(b"again", 5000).unwrap();
    want.truncate(1000);
    want.resize(5005, 0);
    want[5000..].copy_from_slice(b"again");
    drop(reader);
    assert!(fs::read(m.path("f")).unwrap() == want);
    drop(f);
    m.unmount();
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == want, "after a remount");
}

#[test]
fn a_reader_and_a_mapping_opened_beside_a_passing_writer_see_its_writes() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let (mut m, base) = mounted(2 << 20, 5, &[]);
    let w = write_only(&m, "f");
    w.write_all_at(b"one", 70_000).unwrap();
    // A readable open cannot share the writer's passthrough binding: it gets a kernel inode
    // of its own, served by the daemon, and a mapping of it reads the merged content.
    let r = fs::File::open(m.path("f")).unwrap();
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 << 20,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&r),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    let mapped = unsafe { std::slice::from_raw_parts(map as *const u8, 2 << 20) };
    let mut want = base.clone();
    want[70_000..70_003].copy_from_slice(b"one");
    assert!(
        mapped == &want[..],
        "the mapping reads lower data and the write"
    );
    unsafe { libc::munmap(map, 2 << 20) };
    w.write_all_at(b"two", 1 << 20).unwrap();
    want[1 << 20..(1 << 20) + 3].copy_from_slice(b"two");
    drop(r);
    assert!(
        fs::read(m.path("f")).unwrap() == want,
        "a new open sees the second write"
    );
    drop(w);
    m.unmount();
}

#[test]
fn a_killed_daemon_never_lets_a_waiting_or_later_write_land_in_a_hole() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // Each fill waits 1.5 s first, so that the daemon can be killed while a write waits on
    // its event.
    let (mut m, base) = mounted(8 << 20, 6, &[("MOSAICFS_TEST_SLOW_FILL", "1500")]);
    let f = write_only(&m, "f");
    f.write_all_at(b"filled", 10).unwrap();
    let waiting = {
        let f = f.try_clone().unwrap();
        std::thread::spawn(move || f.write_all_at(b"waits", 4 << 20))
    };
    std::thread::sleep(Duration::from_millis(500));
    m.kill9();
    let waited = waiting.join().unwrap();
    assert_eq!(
        waited.as_ref().map_err(|e| e.raw_os_error()),
        Err(Some(libc::EIO)),
        "the write that waited on the dead daemon"
    );
    // The guardian answers for the dead daemon: a filled block takes writes, a hole does not.
    f.write_all_at(b"FILLED", 10).unwrap();
    let later = f.write_all_at(b"later", 6 << 20);
    assert_eq!(later.map_err(|e| e.raw_os_error()), Err(Some(libc::EIO)));
    // With no file of the dead mount open any more, the guardian goes by itself.
    let guardians = || {
        let work = m.work.to_string_lossy().into_owned();
        fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| fs::read(e.ok()?.path().join("cmdline")).ok())
            .filter(|c| {
                let c = String::from_utf8_lossy(c);
                c.contains("__guardian") && c.contains(&work)
            })
            .count()
    };
    assert_eq!(guardians(), 1, "the dead daemon's guardian");
    drop(f);
    let start = Instant::now();
    while guardians() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the guardian stays with no file of its mount open"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Nothing reads zeros where the lower file has data.
    m.env.clear();
    m.mount();
    let mut want = base;
    want[10..16].copy_from_slice(b"FILLED");
    assert!(fs::read(m.path("f")).unwrap() == want, "after the crash");
    let f = write_only(&m, "f");
    f.write_all_at(b"new", 6 << 20).unwrap();
    want[6 << 20..(6 << 20) + 3].copy_from_slice(b"new");
    drop(f);
    assert!(
        fs::read(m.path("f")).unwrap() == want,
        "the new mount's writer"
    );
    m.unmount();
}

#[test]
fn copy_file_range_o_direct_and_a_hard_link_into_a_passing_writer() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let (mut m, base) = mounted(4 << 20, 7, &[]);
    let src = m.path("src");
    fs::write(&src, pattern(20_000, 8)).unwrap();
    let mut want = base.clone();
    // copy_file_range into the middle of unwritten blocks of a write-only partial file.
    let from = fs::File::open(&src).unwrap();
    let to = write_only(&m, "f");
    let (mut off_in, mut off_out) = (100i64, 1_000_003i64);
    let n = unsafe {
        libc::copy_file_range(
            std::os::fd::AsRawFd::as_raw_fd(&from),
            &mut off_in,
            std::os::fd::AsRawFd::as_raw_fd(&to),
            &mut off_out,
            10_000,
            0,
        )
    };
    assert_eq!(n, 10_000, "{}", std::io::Error::last_os_error());
    want[1_000_003..1_010_003].copy_from_slice(&pattern(20_000, 8)[100..10_100]);
    drop((from, to));
    // O_DIRECT: whole aligned blocks, straight to the upper file.
    use std::os::unix::fs::OpenOptionsExt;
    let direct = fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("f"))
        .unwrap();
    let layout = std::alloc::Layout::from_size_align(8192, 4096).unwrap();
    let buf = unsafe { std::alloc::alloc(layout) };
    unsafe { std::ptr::write_bytes(buf, b'd', 8192) };
    let block = unsafe { std::slice::from_raw_parts(buf, 8192) };
    direct.write_all_at(block, 2 << 20).unwrap();
    want[2 << 20..(2 << 20) + 8192].fill(b'd');
    unsafe { std::alloc::dealloc(buf, layout) };
    drop(direct);
    // A hard link: the same partial file under two names; a write through one, read through
    // the other.
    fs::hard_link(m.path("f"), m.path("g")).unwrap();
    write_only(&m, "g")
        .write_all_at(b"linked", 3 << 20)
        .unwrap();
    want[3 << 20..(3 << 20) + 6].copy_from_slice(b"linked");
    let got = fs::read(m.path("f")).unwrap();
    let diff = got.iter().zip(&want).position(|(a, b)| a != b);
    assert!(
        got == want,
        "through the first name: {} bytes, first difference at {diff:?}",
        got.len()
    );
    assert!(fs::read(m.path("g")).unwrap() == want, "through the link");
    m.unmount();
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == want, "after a remount");
    assert!(is_partial(&m.upper.join("f")));
}
