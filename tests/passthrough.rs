//! FUSE passthrough: files wholly in one layer are read and written by the kernel directly.
//! The daemon's request counters prove that no READ or WRITE reached it.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::time::{Duration, Instant};

use common::*;

#[test]
fn complete_upper_files_never_send_reads_or_writes_to_the_daemon() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::with(|_| {});
    let data = vec![7u8; 4 << 20];
    fs::write(m.path("new"), &data).unwrap();
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("new"))
        .unwrap();
    f.write_all_at(b"patch", 100).unwrap();
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    assert_eq!(&back[100..105], b"patch");
    drop(f);
    assert_eq!(fs::read(m.path("new")).unwrap().len(), 4 << 20);
    let log = m.unmount();
    assert_eq!(served(&log, "read"), 0, "{log}");
    assert_eq!(served(&log, "write"), 0, "{log}");
    assert!(served(&log, "passthrough") >= 3, "{log}");
}

#[test]
fn partial_files_are_read_through_the_daemon_and_write_only_writers_pass_through() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), vec![1u8; 2 << 20]);
    write(m.lower(0).join("g"), vec![2u8; 2 << 20]);
    if disk_upper() {
        m.extra.push("partial_passthrough=on".into());
    }
    m.mount();
    // A read-write writer of a partial file goes through the daemon (a mapping of the file
    // would bypass pre-content events).
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .write_all_at(b"x", 5)
        .unwrap();
    assert_eq!(requests(&m, "WRITE"), 1);
    // A write-only one passes through where pre-content events work (a disk upper).
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("g"))
        .unwrap()
        .write_all_at(b"y", 5)
        .unwrap();
    let daemon_writes = requests(&m, "WRITE") - 1;
    assert_eq!(daemon_writes, if disk_upper() { 0 } else { 1 });
    let got = fs::read(m.path("f")).unwrap();
    assert_eq!(got[5], b'x');
    assert_eq!(fs::read(m.path("g")).unwrap()[4..7], [2, b'y', 2]);
    let log = m.unmount();
    assert!(
        served(&log, "read") >= 1,
        "partial file reads merge in the daemon: {log}"
    );
}

#[test]
fn a_small_file_opened_for_writing_is_copied_whole_and_skips_the_daemon() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let small = pattern(200_000, 4);
    let big = pattern(3 << 20, 5);
    let mut m = Mount::with(|l| {
        write(l.join("small"), &small);
        write(l.join("big"), &big);
    });
    for name in ["small", "big"] {
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.path(name))
            .unwrap();
        for i in 0..20u64 {
            f.write_all_at(b"w", i * 9000 + 1).unwrap();
        }
    }
    let mut want = small.clone();
    for i in 0..20 {
        want[i * 9000 + 1] = b'w';
    }
    assert!(fs::read(m.path("small")).unwrap() == want);
    // Complete and durable before the open returned: no mark, and its own bytes in the upper
    // layer (kernel overlayfs would read it the same).
    assert!(get_xattr(&m.upper.join("small"), "trusted.mosaicfs.partial").is_none());
    assert!(fs::read(m.upper.join("small")).unwrap() == want);
    // Above copy_whole= (1 MiB by default) the first write still copies a block, not the file.
    assert!(get_xattr(&m.upper.join("big"), "trusted.mosaicfs.partial").is_some());
    let log = m.unmount();
    assert_eq!(served(&log, "at-open"), 1, "{log}");
    assert_eq!(
        served(&log, "write"),
        20,
        "only the big file's writes: {log}"
    );
}

#[test]
fn open_with_o_trunc_copies_nothing_and_is_passthrough() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // FUSE_ATOMIC_O_TRUNC: the OPEN request truncates, so a lower file (or a partial one)
    // opened with O_TRUNC becomes an empty complete upper file before the open returns; none
    // of its bytes are copied, whatever completion would otherwise do at a reopen.
    let mut m = Mount::with(|l| {
        write(l.join("lower"), pattern(8 << 20, 8));
        write(l.join("partial"), pattern(8 << 20, 9));
    });
    let released = requests(&m, "RELEASE");
    // Read-write: a writer the daemon serves (a write-only one would pass through).
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("partial"))
        .unwrap()
        .write_all_at(b"block", 4 << 20)
        .unwrap();
    // The kernel sends RELEASE after close returns; an open that overtakes it finds the inode
    // still served through the daemon and is served so too (its write then counts below).
    let start = std::time::Instant::now();
    while requests(&m, "RELEASE") == released {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "no RELEASE"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    for name in ["lower", "partial"] {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(m.path(name))
            .unwrap();
        assert!(get_xattr(&m.upper.join(name), "trusted.mosaicfs.partial").is_none());
        assert_eq!(fs::metadata(m.path(name)).unwrap().len(), 0);
        f.write_all(name.as_bytes()).unwrap();
    }
    assert_eq!(fs::read(m.path("lower")).unwrap(), b"lower");
    assert_eq!(fs::read(m.upper.join("partial")).unwrap(), b"partial");
    // O_RDONLY | O_TRUNC truncates too (Linux does, given write permission).
    write(m.path("ro"), "data");
    drop(
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_TRUNC)
            .open(m.path("ro"))
            .unwrap(),
    );
    assert_eq!(fs::metadata(m.path("ro")).unwrap().len(), 0);
    let log = m.unmount();
    assert!(
        served(&log, "blocks-filled") <= 1,
        "only the edge block of the first write: {log}"
    );
    assert_eq!(served(&log, "at-open"), 0, "{log}");
    assert_eq!(
        served(&log, "write"),
        1,
        "only the partial file's first write: {log}"
    );
}

#[test]
fn writable_opens_of_set_id_files_go_through_the_daemon() {
    // A passthrough write reaches the upper file as the daemon, which would keep set-id bits
    // that an unprivileged writer must clear.
    let mut m = Mount::with(|l| write(l.join("tool"), "x"));
    fs::set_permissions(m.path("tool"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::OpenOptions::new()
        .append(true)
        .open(m.path("tool"))
        .unwrap()
        .write_all(b"y")
        .unwrap();
    let log = m.unmount();
    assert_eq!(served(&log, "write"), 1, "{log}");
}

#[test]
fn lower_reads_skip_the_daemon_and_a_writer_gets_a_new_kernel_inode() {
    let mut m = Mount::with(|l| write(l.join("big"), vec![3u8; 8 << 20]));
    let mut reader = fs::File::open(m.path("big")).unwrap();
    let mut all = Vec::new();
    reader.read_to_end(&mut all).unwrap();
    assert_eq!(all.len(), 8 << 20);
    let ino = reader.metadata().unwrap().ino();
    // The kernel inode is bound to the lower file: the writer is moved to a new one.
    let w = fs::OpenOptions::new()
        .write(true)
        .open(m.path("big"))
        .expect("a writer while a passthrough reader is open");
    w.write_all_at(b"new", 0).unwrap();
    drop(w);
    assert_eq!(&fs::read(m.path("big")).unwrap()[..4], b"new\x03");
    assert_eq!(
        fs::metadata(m.path("big")).unwrap().ino(),
        ino,
        "same inode number"
    );
    // The reader opened before the write keeps reading the lower file (as with fuse-overlayfs).
    let mut head = [0u8; 4];
    reader.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(head, [3u8; 4]);
    // Writers and readers of the new inode share the daemon's view of the partial file.
    let mut w = fs::OpenOptions::new()
        .append(true)
        .open(m.path("big"))
        .unwrap();
    w.write_all(b"tail").unwrap();
    drop(w);
    drop(reader);
    assert_eq!(fs::metadata(m.path("big")).unwrap().len(), (8 << 20) + 4);
    let log = m.unmount();
    // Only the read of the partial file (8 MiB) went through the daemon, not the first one.
    let read_bytes: u64 = log[log.rfind("read=").unwrap()..]
        .split(['(', ' '])
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    // (Under load the kernel may read some of its pages twice — once in ~20 runs of the suite
    // about 220 KiB more; the first read through the daemon would add another 8 MiB.)
    assert!((8 << 20..12 << 20).contains(&read_bytes), "{log}");
    assert!(served(&log, "passthrough") >= 1, "{log}");
    assert!(served(&log, "rebinds") >= 1, "{log}");
}

#[test]
fn a_reader_after_a_truncate_gets_the_new_size_not_the_lower_file() {
    let mut m = Mount::with(|l| write(l.join("f"), vec![5u8; 1 << 20]));
    let old = fs::File::open(m.path("f")).unwrap();
    // Copy-up by truncate(2): no writable open, so the kernel inode stays bound to the lower
    // file for `old`; a new reader must not be bound to it.
    let c = std::ffi::CString::new(m.path("f").as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::truncate(c.as_ptr(), 1000) }, 0);
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![5u8; 1000]);
    drop(old);
    m.unmount();
}

#[test]
fn with_passthrough_off_everything_goes_through_the_daemon() {
    let mut m = Mount::new(1);
    m.extra = vec!["passthrough=off".into()];
    m.mount();
    fs::write(m.path("new"), vec![1u8; 1 << 20]).unwrap();
    // A fresh mount has no cached pages: the read reaches the daemon.
    m.remount();
    assert_eq!(fs::read(m.path("new")).unwrap().len(), 1 << 20);
    let log = m.unmount();
    assert!(served(&log, "read") > 0, "{log}");
    assert_eq!(served(&log, "passthrough"), 0, "{log}");
}

#[test]
fn concurrent_readers_and_writers_of_lower_files_all_succeed() {
    // Each round holds a passthrough reader open while a writer opens the same file: every
    // writer goes through a new kernel inode, from several threads at once, with the kernel
    // dropping its inodes now and then.
    const FILES: usize = 100;
    let mut m = Mount::with(|l| {
        for i in 0..FILES {
            write(l.join(format!("f{i}")), vec![i as u8; 20_000]);
        }
    });
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let dir = m.mnt.clone();
            std::thread::spawn(move || {
                for round in 0..60u64 {
                    let k = ((t * 7919 + round * 104_729) as usize) % FILES;
                    let path = dir.join(format!("f{k}"));
                    let reader = fs::File::open(&path).unwrap();
                    let mut head = [0u8; 1];
                    reader.read_exact_at(&mut head, 0).unwrap();
                    if round % 10 == 0 {
                        fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
                    }
                    let off = 1000 + t;
                    fs::OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .unwrap()
                        .write_all_at(b"W", off)
                        .unwrap();
                    drop(reader);
                    let mut got = [0u8; 1];
                    fs::File::open(&path)
                        .unwrap()
                        .read_exact_at(&mut got, off)
                        .unwrap();
                    assert_eq!(&got, b"W", "{path:?}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let log = m.unmount();
    assert!(served(&log, "rebinds") >= 1, "{log}");
}

/// A passthrough reader of a lower file makes a writer's open move the object to a second
/// kernel inode (a rebind). The first inode still serves opens made through it (here a reopen
/// of an O_PATH descriptor through /proc): its page cache must not outlive an open, or it shows
/// data the writer has since overwritten through the second inode.
#[test]
fn an_open_of_the_first_kernel_inode_after_a_rebind_sees_the_latest_writes() {
    let log = reopen_the_first_kernel_inode_after_a_rebind(None);
    assert!(served(&log, "rebinds") >= 1, "{log}");
}

/// The same, with every RELEASE served 200 ms late, as one is when the worker thread that read
/// it is preempted: the reader's close has unbound the first inode in the kernel before its
/// RELEASE reaches the daemon, and the open through /proc that follows must wait for it, not
/// fail with ESTALE (which the kernel cannot retry for an open made through a descriptor).
#[test]
fn an_open_of_a_retired_kernel_inode_waits_for_a_release_on_its_way() {
    let start = Instant::now();
    reopen_the_first_kernel_inode_after_a_rebind(Some(200));
    assert!(start.elapsed() >= Duration::from_millis(200));
}

/// Opens a writer while a passthrough reader of the lower file is open (a rebind), closes the
/// reader and reopens the first kernel inode through /proc after each of two writes; returns
/// the daemon's log. `slow_release`: milliseconds each RELEASE waits in the daemon.
fn reopen_the_first_kernel_inode_after_a_rebind(slow_release: Option<u64>) -> String {
    use std::os::fd::AsRawFd;
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), pattern(4 << 20, 3));
    if let Some(ms) = slow_release {
        m.env
            .push(("MOSAICFS_TEST_SLOW_RELEASE".into(), ms.to_string()));
    }
    m.mount();
    let first = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(m.path("f"))
        .unwrap();
    let via_first = format!("/proc/self/fd/{}", first.as_raw_fd());
    let lower_reader = fs::File::open(&via_first).unwrap();
    let writer = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    drop(lower_reader);
    writer.write_all_at(b"AAAA", 0).unwrap();
    let read_first = || {
        let mut buf = [0u8; 4];
        fs::File::open(&via_first)
            .expect("an open through the first kernel inode")
            .read_exact(&mut buf)
            .unwrap();
        buf
    };
    assert_eq!(&read_first(), b"AAAA");
    writer.write_all_at(b"BBBB", 0).unwrap();
    assert_eq!(&read_first(), b"BBBB", "a new open shows the second write");
    drop(writer);
    assert_eq!(&fs::read(m.path("f")).unwrap()[..4], b"BBBB");
    drop(first);
    m.unmount()
}

/// The passthrough registration of a complete upper file outlives its last handle, so later
/// opens and closes need no FUSE_DEV_IOC_BACKING_OPEN/CLOSE; it goes with the kernel inode,
/// so an unlinked file's blocks are freed as soon as nothing holds the file open.
#[test]
fn a_complete_files_registration_serves_every_open_and_goes_with_its_inode() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut s = SmallUpper::new("64m");
    s.mount("");
    let empty = s.used();
    let data = pattern(16 << 20, 23);
    write(s.m.path("big"), &data);
    for i in 0..50 {
        let f = fs::OpenOptions::new()
            .read(true)
            .write(i % 2 == 0)
            .open(s.m.path("big"))
            .unwrap();
        let mut b = [0u8; 4096];
        f.read_exact_at(&mut b, 4096 * i).unwrap();
        assert_eq!(b[..], data[4096 * i as usize..][..4096]);
    }
    assert!(s.used() >= empty + (16 << 20));
    fs::remove_file(s.m.path("big")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.used() > empty + (1 << 20) {
        assert!(
            Instant::now() < deadline,
            "the unlinked file's blocks are still held: {} bytes used",
            s.used() - empty
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = s.m.unmount();
    assert_eq!(served(&log, "passthrough"), 51, "{log}");
    assert_eq!(
        served(&log, "backings"),
        1,
        "one registration for 51 opens: {log}"
    );
}

/// A lower file's registration kept after its last reader closed must not serve the file once
/// it was copied up: a reader after the write, passing through on the upper file, sees it.
#[test]
fn a_reader_after_a_copy_up_never_reads_through_the_lower_files_old_registration() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    let data = pattern(64 << 10, 29);
    write(m.lower(0).join("f"), &data);
    m.extra = vec!["copy_whole=1M".into()];
    m.mount();
    for _ in 0..3 {
        assert!(fs::read(m.path("f")).unwrap() == data);
    }
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"NEW", 4096).unwrap();
    drop(f);
    for _ in 0..3 {
        let got = fs::read(m.path("f")).unwrap();
        assert_eq!(&got[4096..4099], b"NEW");
        assert!(got[..4096] == data[..4096]);
    }
    assert!(
        fs::read(m.lower(0).join("f")).unwrap() == data,
        "the lower file is untouched"
    );
    let log = m.unmount();
    assert!(served(&log, "backings") >= 2, "{log}");
}
