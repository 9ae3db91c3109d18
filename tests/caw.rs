//! Copy-after-write: partial-block writes return before the lower block is read.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use common::*;

fn has_data(p: &std::path::Path) -> bool {
    let f = fs::File::open(p).unwrap();
    rustix::fs::seek(&f, rustix::fs::SeekFrom::Data(0)).is_ok()
}

/// A mount whose pending blocks are filled only when something needs them. Every partial-block
/// write is deferred (`copy_after_write=always`): the lower file the test just wrote is in the
/// page cache, and by default such blocks are filled at once.
fn lazy_mount(data: &[u8], extra: &[&str]) -> Mount {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), data);
    m.extra = [
        "caw_workers=0",
        "complete_after=0",
        "copy_whole=0",
        "copy_after_write=always",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    m.mount();
    m
}

#[test]
fn a_partial_block_write_is_deferred_and_reads_see_it_merged() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(1 << 20, 1);
    let mut m = lazy_mount(&base, &[]);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    // A sibling test's fork would close a copy of `f` at exec: a FLUSH, which fills the block.
    let quiet = no_forks();
    f.write_all_at(b"abc", 10_000).unwrap();
    assert!(
        !has_data(&m.upper.join("f")),
        "nothing written to the upper file yet"
    );
    drop(quiet);
    let mut want = base.clone();
    want[10_000..10_003].copy_from_slice(b"abc");
    assert!(
        fs::read(m.path("f")).unwrap() == want,
        "reads merge the pending bytes"
    );
    f.sync_data().unwrap();
    assert!(has_data(&m.upper.join("f")), "fsync filled the block");
    let upper = fs::read(m.upper.join("f")).unwrap();
    assert!(
        upper[8192..12288] == want[8192..12288],
        "the whole block, filled from the lower file"
    );
    drop(f);
    let log = m.unmount();
    assert_eq!(served(&log, "blocks-deferred"), 1, "{log}");
}

/// Drops `p`'s pages from the page cache, as if nobody had read it for long.
fn evict(p: &std::path::Path) {
    let f = fs::File::open(p).unwrap();
    f.sync_all().unwrap();
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
}

/// Whether the page of `p` at `off` is in the page cache (mincore of a mapping of it, which
/// reads nothing).
fn cached(p: &std::path::Path, off: u64) -> bool {
    use std::os::fd::AsRawFd;
    let f = fs::File::open(p).unwrap();
    let page = 4096;
    // SAFETY: a fresh read-only shared mapping of one page of `f`, unmapped below; mincore
    // writes one byte into `vec`.
    unsafe {
        let at = libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            off as libc::off_t,
        );
        assert!(
            at != libc::MAP_FAILED,
            "{}",
            std::io::Error::last_os_error()
        );
        let mut vec = [0u8; 1];
        let r = libc::mincore(at, page, vec.as_mut_ptr());
        libc::munmap(at, page);
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        vec[0] & 1 != 0
    }
}

/// By default only a block whose lower data must be read from the disk is deferred; one in the
/// page cache is filled at once, which costs less than the hand-off (file/partial/caw.rs).
#[test]
fn a_block_whose_lower_data_is_cached_is_filled_at_once_and_a_cold_one_is_deferred() {
    // The cold block lies past any readahead the daemon's read of the warm one starts (this
    // machine's disk reads ahead 8 MiB): that readahead could bring it back between the
    // test's look and the daemon's.
    let base = pattern(40 << 20, 12);
    let cold_at = 9216 * 4096;
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    m.extra = opts(&["caw_workers=0", "complete_after=0", "copy_whole=0"]);
    m.mount();
    let f = fs::OpenOptions::new()
        .read(true) // a readable writer: the daemon path, where copy-after-write works
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"warm", 3 * 4096 + 10).unwrap();
    assert_eq!(
        counter(&m, "blocks_deferred"),
        0,
        "a cached block is filled"
    );
    if disk_upper() {
        assert!(
            has_data(&m.upper.join("f")),
            "the whole block is in the upper file"
        );
    }

    // The kernel may keep a page a moment longer (a busy machine once left it cached, and
    // the block was rightly filled at once), or read it in again just after the eviction (a
    // readahead still in flight; this machine's disk reads ahead 8 MiB): evicted again until
    // it is gone and stays gone for a while.
    let lower = m.lower(0).join("f");
    let mut tries = 0;
    loop {
        evict(&lower);
        let gone = !cached(&lower, cold_at);
        std::thread::sleep(Duration::from_millis(50));
        if (gone && !cached(&lower, cold_at)) || tries == 100 {
            break;
        }
        tries += 1;
    }
    let cold = !cached(&lower, cold_at);
    f.write_all_at(b"cold", cold_at + 10).unwrap();
    if cold {
        assert_eq!(
            counter(&m, "blocks_deferred"),
            1,
            "a cold block is deferred"
        );
    } else {
        eprintln!("the lower block stayed in the page cache: its deferral not checked");
    }
    drop(f);
    let mut want = base;
    want[3 * 4096 + 10..3 * 4096 + 14].copy_from_slice(b"warm");
    want[cold_at as usize + 10..cold_at as usize + 14].copy_from_slice(b"cold");
    assert!(fs::read(m.path("f")).unwrap() == want);
    m.remount();
    assert!(fs::read(m.path("f")).unwrap() == want, "after a remount");
}

#[test]
fn workers_fill_pending_blocks_in_the_background() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(1 << 20, 2);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    m.extra = opts(&[
        "complete_after=0",
        "copy_whole=0",
        "copy_after_write=always",
    ]);
    m.mount();
    let f = fs::OpenOptions::new()
        .read(true) // a readable writer: the daemon path, where copy-after-write works
        .write(true)
        .open(m.path("f"))
        .unwrap();
    for i in 0..50u64 {
        f.write_all_at(b"w", i * 8192 + 17).unwrap();
    }
    let start = std::time::Instant::now();
    loop {
        let upper = fs::read(m.upper.join("f")).unwrap();
        if (0..50usize).all(|i| upper[i * 8192 + 17] == b'w' && upper[i * 8192] == base[i * 8192]) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "workers did not fill the blocks"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(f);
    let log = m.unmount();
    assert_eq!(served(&log, "blocks-deferred"), 50, "{log}");
}

#[test]
fn kill_9_loses_only_unsynced_pending_writes_and_never_mixes_a_block() {
    let base = pattern(1 << 20, 3);
    let mut m = lazy_mount(&base, &[]);
    let f = fs::OpenOptions::new()
        .read(true) // a readable writer: the daemon path, where copy-after-write works
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"kep1", 4096 + 5).unwrap();
    f.write_all_at(b"kep2", 5 * 4096 + 5).unwrap();
    f.sync_data().unwrap(); // persists every write before it
    f.write_all_at(b"lost", 9 * 4096 + 5).unwrap();
    m.kill9();
    drop(f);
    m.mount();
    let got = fs::read(m.path("f")).unwrap();
    let mut want = base.clone();
    want[4096 + 5..4096 + 9].copy_from_slice(b"kep1");
    want[5 * 4096 + 5..5 * 4096 + 9].copy_from_slice(b"kep2");
    assert!(
        got == want,
        "synced writes kept, the unsynced one lost whole, nothing zeroed"
    );
}

#[test]
fn unmount_fills_every_pending_block() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(1 << 20, 4);
    let mut m = lazy_mount(&base, &[]);
    let f = fs::OpenOptions::new()
        .read(true) // a readable writer: the daemon path, where copy-after-write works
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"close", 300_000).unwrap();
    drop(f);
    m.unmount();
    let mut want = base.clone();
    want[300_000..300_005].copy_from_slice(b"close");
    let upper = fs::read(m.upper.join("f")).unwrap();
    let blk = 300_000 / 4096 * 4096;
    assert!(
        upper[blk..blk + 4096] == want[blk..blk + 4096],
        "block filled and written at unmount"
    );
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == want);
}

#[test]
fn past_the_memory_bound_writers_fill_synchronously() {
    let base = pattern(4 << 20, 5);
    let mut m = lazy_mount(&base, &["caw_memory=1"]);
    // A sibling test's fork would close a copy of `f` at exec: a FLUSH, which fills pending
    // blocks and frees their memory mid-way.
    let quiet = no_forks();
    let f = fs::OpenOptions::new()
        .read(true) // a readable writer: the daemon path, where copy-after-write works
        .write(true)
        .open(m.path("f"))
        .unwrap();
    for i in 0..400u64 {
        f.write_all_at(b"m", i * 4096 + 100).unwrap();
    }
    drop(quiet);
    let mut want = base.clone();
    for i in 0..400usize {
        want[i * 4096 + 100] = b'm';
    }
    assert!(fs::read(m.path("f")).unwrap() == want);
    drop(f);
    let log = m.unmount();
    assert_eq!(
        served(&log, "blocks-deferred"),
        256,
        "1 MiB of 4 KiB blocks, then synchronous: {log}"
    );
}

#[test]
fn o_sync_writes_are_on_disk_when_they_return() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(1 << 20, 6);
    let mut m = lazy_mount(&base, &[]);
    let f = fs::OpenOptions::new()
        .read(true) // a readable writer: the daemon path, where copy-after-write works
        .write(true)
        .custom_flags(libc::O_SYNC)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"sync", 50_000).unwrap();
    let upper = fs::read(m.upper.join("f")).unwrap();
    assert_eq!(&upper[50_000..50_004], b"sync");
    m.kill9();
    drop(f);
    m.mount();
    assert_eq!(&fs::read(m.path("f")).unwrap()[50_000..50_004], b"sync");
}

use std::os::unix::fs::OpenOptionsExt;

#[test]
fn concurrent_writers_and_readers_on_pending_blocks() {
    const N: usize = 4;
    const SPAN: usize = 256 * 1024;
    let base = pattern(SPAN, 7);
    let m = Arc::new(lazy_mount(&base, &[]));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut threads = Vec::new();
    for w in 0..N {
        let m = m.clone();
        threads.push(std::thread::spawn(move || {
            let f = fs::OpenOptions::new()
                .read(true) // a readable writer: the daemon path, where copy-after-write works
                .write(true)
                .open(m.path("f"))
                .unwrap();
            // Writer w owns the bytes at offsets = w (mod N) and writes them one at a time.
            for round in 0..3 {
                for off in (w..SPAN).step_by(N * 97) {
                    f.write_all_at(&[0x80 | w as u8 | (round << 4)], off as u64)
                        .unwrap();
                }
            }
        }));
    }
    for _ in 0..2 {
        let (m, stop, base) = (m.clone(), stop.clone(), base.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let got = fs::read(m.path("f")).unwrap();
                for (off, b) in got.iter().enumerate() {
                    let owner = off % N;
                    assert!(
                        *b == base[off] || (*b & 0x8f) == (0x80 | owner as u8),
                        "byte {off} is {b:#x}"
                    );
                }
            }
        }));
    }
    for t in threads.drain(..N) {
        t.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let got = fs::read(m.path("f")).unwrap();
    for (off, b) in got.iter().enumerate() {
        let written = (off % N..SPAN).step_by(N * 97).any(|o| o == off);
        if written {
            assert_eq!(*b, 0x80 | (off % N) as u8 | (2 << 4), "last round at {off}");
        } else {
            assert_eq!(*b, base[off], "untouched byte {off}");
        }
    }
}

#[test]
fn close_puts_pending_blocks_on_disk_before_any_unmount() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // An unmount does not wait for the daemon: whatever mounts the layers next (podman commit)
    // must find every closed file's data on disk. kill -9 right after close proves it.
    let base = pattern(1 << 20, 8);
    let mut m = lazy_mount(&base, &[]);
    let f = fs::OpenOptions::new()
        .read(true) // a readable writer: the daemon path, where copy-after-write works
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"closed", 123_456).unwrap();
    drop(f);
    m.kill9();
    m.mount();
    let mut want = base;
    want[123_456..123_462].copy_from_slice(b"closed");
    assert!(fs::read(m.path("f")).unwrap() == want);
}

#[test]
fn volatile_mounts_pass_no_fsync_to_disk_but_keep_the_data() {
    let base = pattern(1 << 20, 9);
    for (volatile, expect_to_disk) in [(true, 0u64), (false, 2u64)] {
        let mut m = Mount::new(1);
        write(m.lower(0).join("f"), &base);
        if volatile {
            m.extra = vec!["volatile".into()];
        }
        m.mount();
        let f = fs::OpenOptions::new()
            .read(true) // a readable writer: the daemon path, where copy-after-write works
            .write(true)
            .open(m.path("f"))
            .unwrap();
        f.write_all_at(b"v", 99).unwrap();
        f.sync_all().unwrap();
        f.sync_data().unwrap();
        assert_eq!(fs::read(m.path("f")).unwrap()[99], b'v');
        drop(f);
        let log = m.unmount();
        assert_eq!(served(&log, "fsyncs"), 2, "{log}");
        assert_eq!(
            served(&log, "to-disk"),
            expect_to_disk,
            "volatile={volatile}: {log}"
        );
    }
}
