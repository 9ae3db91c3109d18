//! Block-level copy-on-write: partial files, on real mounts.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};

use common::*;

const MIB: usize = 1 << 20;

/// Whether the file has any data extent (SEEK_DATA finds one).
fn has_data(p: &std::path::Path) -> bool {
    let f = fs::File::open(p).unwrap();
    rustix::fs::seek(&f, rustix::fs::SeekFrom::Data(0)).is_ok()
}

fn lower_with(name: &str, data: &[u8]) -> Mount {
    let data = data.to_vec();
    let name = name.to_string();
    let mut m = Mount::new(1);
    write(m.lower(0).join(name), data);
    // Partial files of every size: small ones would be copied whole when opened for writing.
    m.extra = vec!["copy_whole=0".into()];
    m.mount();
    m
}

#[test]
fn a_read_only_open_copies_nothing_up() {
    let m = lower_with("ro", b"read only");
    let mut back = String::new();
    fs::File::open(m.path("ro"))
        .unwrap()
        .read_to_string(&mut back)
        .unwrap();
    assert_eq!(back, "read only");
    assert!(!m.upper.join("ro").exists());
}

#[test]
fn an_open_for_writing_copies_up_before_any_write() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // As overlayfs does: a tool that looks at the upper layer after open(O_WRONLY) or O_RDWR
    // finds the file there — a partial file without a single block of data.
    let data = pattern(MIB, 3);
    let m = lower_with("wo", &data);
    write(m.lower(0).join("rw"), &data);
    let held = [
        fs::OpenOptions::new()
            .write(true)
            .open(m.path("wo"))
            .unwrap(),
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.path("rw"))
            .unwrap(),
    ];
    for name in ["wo", "rw"] {
        let up = m.upper.join(name);
        assert_eq!(fs::metadata(&up).unwrap().len(), MIB as u64, "{name}");
        assert!(!has_data(&up), "{name}: the open copied data");
    }
    drop(held);
    let mut m = m;
    m.remount();
    assert!(fs::read(m.path("wo")).unwrap() == data);
    assert!(fs::read(m.path("rw")).unwrap() == data);
}

#[test]
fn first_write_to_lower_copies_one_block() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(64 * MIB, 1);
    let m = lower_with("big", &base);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("big"))
        .unwrap();
    assert!(
        !has_data(&m.upper.join("big")),
        "opening for write copies no data"
    );
    f.write_all_at(b"X", 1_000_000).unwrap();
    drop(f);
    let upper = m.upper.join("big");
    assert_eq!(
        fs::metadata(&upper).unwrap().len(),
        64 * MIB as u64,
        "partial file has the full size"
    );
    assert!(
        allocated(&upper) <= 8192,
        "one block (plus at most an xattr block): {}",
        allocated(&upper)
    );
    let mut want = base.clone();
    want[1_000_000] = b'X';
    assert!(fs::read(m.path("big")).unwrap() == want, "merged content");
    assert!(
        fs::read(m.lower(0).join("big")).unwrap() == base,
        "lower untouched"
    );
}

#[test]
fn metadata_changes_copy_no_data() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(16 * MIB, 2);
    let m = lower_with("f", &base);
    let f = m.path("f");
    std::os::unix::fs::chown(&f, Some(1000), Some(1000)).unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
    set_xattr(&f, "user.tag", b"v");
    sh(&format!("touch -d @1000000 {}", f.display()));
    let upper = m.upper.join("f");
    assert!(!has_data(&upper), "no data block in the upper file");
    let md = fs::metadata(&f).unwrap();
    assert_eq!(
        (md.uid(), md.mode() & 0o777, md.mtime()),
        (1000, 0o600, 1000000)
    );
    assert!(fs::read(&f).unwrap() == base);
}

#[test]
fn chown_recursive_of_a_tree_writes_no_data() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let m = Mount::with(|l| {
        for i in 0..50 {
            write(
                l.join(format!("tree/d{}/f{i}", i % 5)),
                pattern(256 * 1024, i),
            );
        }
    });
    sh(&format!("chown -R 1234:1234 {}", m.path("tree").display()));
    let used = sh(&format!("du -sk {}", m.upper.display()));
    let kib: u64 = used.split_whitespace().next().unwrap().parse().unwrap();
    // ext4 keeps xattrs that do not fit in the inode in one 4 KiB block per file.
    assert!(
        kib < 400,
        "only metadata in the upper layer, not 12.5 MiB: {kib} KiB"
    );
    for i in 0..50u64 {
        assert!(!has_data(&m.upper.join(format!("tree/d{}/f{i}", i % 5))));
        let p = m.path(&format!("tree/d{}/f{i}", i % 5));
        assert_eq!(fs::metadata(&p).unwrap().uid(), 1234);
        assert!(fs::read(&p).unwrap() == pattern(256 * 1024, i));
    }
}

#[test]
fn truncate_down_then_up_reads_zeros_not_lower_data() {
    let base = pattern(100_000, 3);
    let m = lower_with("f", &base);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.set_len(5000).unwrap();
    f.set_len(50_000).unwrap();
    let got = fs::read(m.path("f")).unwrap();
    assert_eq!(got.len(), 50_000);
    assert!(got[..5000] == base[..5000]);
    assert!(
        got[5000..].iter().all(|b| *b == 0),
        "bytes past the shrink point are zeros"
    );
    f.set_len(0).unwrap();
    assert_eq!(fs::read(m.path("f")).unwrap().len(), 0);
    f.write_all_at(b"abc", 10).unwrap();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"\0\0\0\0\0\0\0\0\0\0abc");
    assert!(
        get_xattr(&m.upper.join("f"), "trusted.mosaicfs.partial").is_none(),
        "nothing of the lower file is left: complete"
    );
}

#[test]
fn appends_and_writes_past_eof() {
    let base = pattern(10_000, 4);
    let m = lower_with("f", &base);
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all(b"tail").unwrap();
    drop(f);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"far", 20_000).unwrap();
    let mut want = base.clone();
    want.extend_from_slice(b"tail");
    want.resize(20_000, 0);
    want.extend_from_slice(b"far");
    assert!(fs::read(m.path("f")).unwrap() == want);
}

#[test]
fn o_trunc_on_a_lower_file_makes_an_empty_complete_file() {
    let m = lower_with("f", &pattern(1 << 20, 5));
    fs::write(m.path("f"), "short").unwrap();
    assert_eq!(fs::read_to_string(m.path("f")).unwrap(), "short");
    assert!(get_xattr(&m.upper.join("f"), "trusted.mosaicfs.partial").is_none());
}

fn fallocate(
    f: &fs::File,
    mode: rustix::fs::FallocateFlags,
    off: u64,
    len: u64,
) -> std::io::Result<()> {
    rustix::fs::fallocate(f, mode, off, len).map_err(Into::into)
}

#[test]
fn fallocate_modes_keep_content_exact() {
    use rustix::fs::FallocateFlags as F;
    let base = pattern(64 * 1024, 6);
    let m = lower_with("f", &base);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    let mut want = base.clone();
    fallocate(&f, F::empty(), 1000, 10_000).unwrap();
    assert!(
        fs::read(m.path("f")).unwrap() == want,
        "allocation keeps lower data"
    );
    fallocate(&f, F::KEEP_SIZE | F::PUNCH_HOLE, 20_000, 9_000).unwrap();
    want[20_000..29_000].fill(0);
    assert!(
        fs::read(m.path("f")).unwrap() == want,
        "punched range reads zeros, not lower data"
    );
    fallocate(&f, F::ZERO_RANGE, 40_001, 3).unwrap();
    want[40_001..40_004].fill(0);
    assert!(fs::read(m.path("f")).unwrap() == want);
    fallocate(&f, F::empty(), 60_000, 10_000).unwrap();
    want.resize(70_000, 0);
    assert!(
        fs::read(m.path("f")).unwrap() == want,
        "allocation past EOF extends with zeros"
    );
    fallocate(&f, F::KEEP_SIZE | F::PUNCH_HOLE, 30_000, 1 << 20).unwrap();
    want[30_000..].fill(0);
    assert!(fs::read(m.path("f")).unwrap() == want, "punch to the end");
    assert_eq!(
        fallocate(&f, F::COLLAPSE_RANGE, 0, 4096)
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EOPNOTSUPP)
    );
}

#[test]
fn copy_file_range_and_mmap_writes_give_exact_content() {
    let base = pattern(256 * 1024, 7);
    let m = lower_with("f", &base);
    let src = fs::File::open(m.path("f")).unwrap();
    let dst = fs::File::create(m.path("copy")).unwrap();
    let n =
        rustix::fs::copy_file_range(&src, Some(&mut 1000), &dst, Some(&mut 0), 100_000).unwrap();
    assert!(n > 0);
    assert!(fs::read(m.path("copy")).unwrap() == base[1000..1000 + n]);
    let rw = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    // SAFETY: maps 256 KiB of a 256 KiB file, unmapped before the file is closed.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            256 * 1024,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&rw),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        std::ptr::write_bytes((p as *mut u8).add(70_000), b'M', 10);
        libc::msync(p, 256 * 1024, libc::MS_SYNC);
        libc::munmap(p, 256 * 1024);
    }
    let mut want = base.clone();
    want[70_000..70_010].fill(b'M');
    assert!(fs::read(m.path("f")).unwrap() == want);
}

#[test]
fn with_passthrough_upper_a_reader_of_the_lower_file_sees_later_writes() {
    // Lower files are read through the daemon then, and all handles share one open state (by
    // default a reader opened before the write keeps the lower bytes: tests/passthrough.rs).
    let base = pattern(100_000, 8);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), base.clone());
    m.extra = vec!["passthrough=upper".into()];
    m.mount();
    let mut reader = fs::File::open(m.path("f")).unwrap();
    let writer = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    writer.write_all_at(b"NEW", 50_000).unwrap();
    let mut buf = [0u8; 3];
    reader.seek(SeekFrom::Start(50_000)).unwrap();
    reader.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"NEW");
}

#[test]
fn hard_links_to_a_partial_file_share_its_content() {
    let base = pattern(50_000, 9);
    let m = lower_with("f", &base);
    fs::hard_link(m.path("f"), m.path("g")).unwrap();
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("g"))
        .unwrap();
    f.write_all_at(b"via-g", 100).unwrap();
    let mut want = base.clone();
    want[100..105].copy_from_slice(b"via-g");
    assert!(fs::read(m.path("f")).unwrap() == want);
    assert_eq!(fs::metadata(m.path("f")).unwrap().nlink(), 2);
}

#[test]
fn partial_files_survive_remount() {
    let base = pattern(3 * MIB, 10);
    let mut m = lower_with("f", &base);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"one", 5).unwrap();
    f.write_all_at(&pattern(10_000, 11), 2 * MIB as u64 + 77)
        .unwrap();
    drop(f);
    let want = fs::read(m.path("f")).unwrap();
    m.remount();
    assert!(fs::read(m.path("f")).unwrap() == want);
    fs::rename(m.path("f"), m.path("moved")).unwrap();
    m.remount();
    assert!(
        fs::read(m.path("moved")).unwrap() == want,
        "a renamed partial file still finds its lower"
    );
}

#[test]
fn a_changed_lower_file_is_refused_with_eio() {
    let mut m = lower_with("f", &pattern(100_000, 12));
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .write_all_at(b"x", 10)
        .unwrap();
    m.unmount();
    fs::write(m.lower(0).join("f"), pattern(100_000, 13)).unwrap();
    m.mount();
    assert_eq!(errno_of(fs::read(m.path("f"))), libc::EIO);
    let log = m.unmount();
    assert!(
        log.contains("changed since the partial file was made") && log.contains('f'),
        "{log}"
    );
}

#[test]
fn a_damaged_mark_is_refused_with_eio() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = lower_with("f", &pattern(100_000, 14));
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .write_all_at(b"x", 10)
        .unwrap();
    m.unmount();
    set_xattr(
        &m.upper.join("f"),
        "trusted.mosaicfs.partial",
        b"v1\nlayer=1\nvalid=banana\npath=f",
    );
    m.mount();
    assert_eq!(errno_of(fs::read(m.path("f"))), libc::EIO);
    let log = m.unmount();
    assert!(log.contains("damaged") && log.contains("f"), "{log}");
}

/// The mark of `f` in the upper layer, rewritten by `edit`.
fn edit_mark(m: &Mount, edit: impl FnOnce(String) -> String) {
    let f = m.upper.join("f");
    let mark = String::from_utf8(get_xattr(&f, "trusted.mosaicfs.partial").unwrap()).unwrap();
    set_xattr(&f, "trusted.mosaicfs.partial", edit(mark).as_bytes());
}

#[test]
fn marks_carry_their_block_size_and_v1_marks_still_read() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(300_000, 21);
    let mut m = lower_with("f", &base);
    write_at(m.path("f"), 10_000, b"v2");
    m.unmount();
    let mark = get_xattr(&m.upper.join("f"), "trusted.mosaicfs.partial").unwrap();
    assert!(mark.starts_with(b"v2\n") && mark.windows(11).any(|w| w == b"\nblock=4096"));
    // As mosaicfs wrote it before block sizes were stored.
    edit_mark(&m, |v2| {
        v2.replacen("v2", "v1", 1).replace("block=4096\n", "")
    });
    // Reopened for writing below: it must stay partial, not be completed by the open.
    m.extra.push("complete_on_reopen=0".into());
    m.mount();
    let mut want = base.clone();
    want[10_000..10_002].copy_from_slice(b"v2");
    assert!(fs::read(m.path("f")).unwrap() == want);
    // A truncate rewrites the mark: as v2.
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .set_len(200_000)
        .unwrap();
    m.unmount();
    let mark = get_xattr(&m.upper.join("f"), "trusted.mosaicfs.partial").unwrap();
    assert!(
        mark.starts_with(b"v2\n"),
        "{}",
        String::from_utf8_lossy(&mark)
    );
}

#[test]
fn a_partial_file_is_read_and_written_in_the_block_size_of_its_mark() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // Made where blocks were 8 KiB (a coarser upper file system): one whole 8 KiB block
    // written, the rest holes.
    let base = pattern(64 * 1024, 22);
    let mut m = lower_with("f", &base);
    write_at(m.path("f"), 9000, b"w");
    m.unmount();
    let f = m.upper.join("f");
    let mut want = base.clone();
    want[9000] = b'w';
    {
        let up = fs::OpenOptions::new().write(true).open(&f).unwrap();
        up.write_all_at(&want[8192..16384], 8192).unwrap();
    }
    edit_mark(&m, |v2| v2.replace("block=4096", "block=8192"));
    m.extra.push("complete_on_reopen=0".into());
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == want);
    write_at(m.path("f"), 20_000, b"x");
    want[20_000] = b'x';
    m.unmount();
    // The block written was an 8 KiB one, filled from the lower file around the byte.
    let up = fs::File::open(&f).unwrap();
    let start = rustix::fs::seek(&up, rustix::fs::SeekFrom::Data(16384)).unwrap();
    let end = rustix::fs::seek(&up, rustix::fs::SeekFrom::Hole(start)).unwrap();
    assert_eq!((start, end), (16384, 24576));
    m.mount();
    assert!(fs::read(m.path("f")).unwrap() == want);
}

#[test]
fn a_mark_finer_than_the_upper_file_system_allocates_is_refused_and_nothing_is_lost() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(64 * 1024, 23);
    let mut m = lower_with("f", &base);
    write_at(m.path("f"), 100, b"z");
    m.unmount();
    edit_mark(&m, |v2| v2.replace("block=4096", "block=2048"));
    let before = fs::read(m.upper.join("f")).unwrap();
    m.mount();
    assert_eq!(errno_of(fs::read(m.path("f"))), libc::EIO);
    assert_eq!(
        errno_of(fs::OpenOptions::new().write(true).open(m.path("f"))),
        libc::EIO
    );
    let log = m.unmount();
    assert!(
        log.contains("2048-byte blocks, but the upper file system allocates 4096 bytes"),
        "{log}"
    );
    assert!(fs::read(m.upper.join("f")).unwrap() == before);
}

#[test]
fn after_kill_9_every_block_is_old_or_new_and_synced_writes_are_there() {
    const BS: usize = 4096;
    let base = pattern(4 * MIB, 15);
    let mut m = lower_with("f", &base);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    let new = pattern(4 * MIB, 16);
    // Unaligned writes over many blocks; the first half is fsynced.
    let mut synced = Vec::new();
    for i in 0..200usize {
        let off = (i * 20_011) % (4 * MIB - 5000);
        let len = 1 + (i * 37) % 5000;
        f.write_all_at(&new[off..off + len], off as u64).unwrap();
        if i == 99 {
            f.sync_all().unwrap();
            synced = fs::read(m.path("f")).unwrap();
        }
    }
    m.kill9();
    drop(f);
    m.mount();
    let after = fs::read(m.path("f")).unwrap();
    assert_eq!(after.len(), base.len());
    for (b, chunk) in after.chunks(BS).enumerate() {
        let (o, s) = (
            &base[b * BS..b * BS + chunk.len()],
            &synced[b * BS..b * BS + chunk.len()],
        );
        // Each byte is either the lower byte or a byte some write put there; and every byte
        // the fsync covered is at least as new as at the fsync.
        for (i, byte) in chunk.iter().enumerate() {
            let pos = b * BS + i;
            assert!(
                *byte == o[i] || *byte == new[pos],
                "block {b} byte {i} is neither old nor new"
            );
            if s[i] != o[i] {
                assert_eq!(*byte, s[i], "fsynced byte {pos} lost");
            }
        }
    }
}

fn seek(f: &fs::File, off: u64, data: bool) -> Option<u64> {
    let whence = if data {
        rustix::fs::SeekFrom::Data(off)
    } else {
        rustix::fs::SeekFrom::Hole(off)
    };
    rustix::fs::seek(f, whence).ok()
}

/// Checks SEEK_DATA/SEEK_HOLE answers against the content: a reported hole reads as zeros, and
/// data is never reported past the end. (Whether the kernel asks the daemon is its choice.)
fn check_seek_consistency(path: &std::path::Path) {
    let content = fs::read(path).unwrap();
    let f = fs::File::open(path).unwrap();
    let size = content.len() as u64;
    for off in (0..size).step_by(4093) {
        let hole = seek(&f, off, false).expect("SEEK_HOLE below EOF succeeds");
        assert!(hole >= off && hole <= size);
        let next_data = seek(&f, hole, true).unwrap_or(size).min(size);
        assert!(
            content[hole as usize..next_data as usize]
                .iter()
                .all(|b| *b == 0),
            "hole at {hole}..{next_data} holds data"
        );
        if let Some(d) = seek(&f, off, true) {
            assert!(d >= off && d < size);
            assert!(
                content[off as usize..d as usize].iter().all(|b| *b == 0),
                "data skipped before {d}"
            );
        }
    }
}

#[test]
fn seek_data_and_seek_hole_agree_with_the_merged_content() {
    let base = pattern(1 << 20, 17);
    let m = lower_with("f", &base);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"x", 10).unwrap();
    check_seek_consistency(&m.path("f"));
    f.set_len(100_000).unwrap();
    f.set_len(1 << 20).unwrap();
    f.write_all_at(b"y", 500_000).unwrap();
    check_seek_consistency(&m.path("f"));
    assert_eq!(seek(&f, 2 << 20, true), None, "SEEK_DATA past EOF is ENXIO");
    // Precise answers: the lower data is dense, the shrink made [100000, 1 MiB) a hole but for
    // the block written at 500000.
    assert_eq!(seek(&f, 0, false), Some(100_000));
    assert_eq!(seek(&f, 200_000, true), Some(500_000 / 4096 * 4096));
    assert_eq!(seek(&f, 500_000, false), Some(500_000 / 4096 * 4096 + 4096));
    assert_eq!(seek(&f, 600_000, true), None);
}

/// generic/448 (seek_sanity 18.01-18.04): SEEK_DATA and SEEK_HOLE from a negative offset give
/// ENXIO, as on ext4 and kernel overlayfs, on every kind of open file.
#[test]
fn seek_data_and_hole_from_a_negative_offset_give_enxio() {
    let m = Mount::with(|l| {
        write(l.join("lower"), pattern(1 << 20, 3));
        write(l.join("partial"), pattern(8 << 20, 4));
    });
    write(m.path("upper"), b"upper file");
    write_at(m.path("partial"), 4096, b"p");
    for name in ["lower", "partial", "upper"] {
        let f = fs::OpenOptions::new()
            .read(true)
            .write(name != "lower")
            .open(m.path(name))
            .unwrap();
        for whence in [libc::SEEK_DATA, libc::SEEK_HOLE] {
            // SAFETY: lseek on an open descriptor.
            let r = unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&f), -1, whence) };
            let e = std::io::Error::last_os_error().raw_os_error();
            assert_eq!((r, e), (-1, Some(libc::ENXIO)), "{name}, whence {whence}");
        }
    }
}

#[test]
fn an_upper_file_system_without_holes_is_reported_and_still_correct() {
    // A FUSE file system reports no holes (the kernel answers SEEK_DATA with "all data"):
    // fuse-overlayfs serves as an upper file system without sparse-file support.
    let dir = tempfile::Builder::new()
        .prefix("mosaicfs-nosparse")
        .tempdir_in("/tmp")
        .unwrap();
    let p = dir.path();
    for d in ["fl", "fu", "fw", "host", "lower", "mnt"] {
        fs::create_dir(p.join(d)).unwrap();
    }
    sh(&format!(
        "fuse-overlayfs -o lowerdir={0}/fl,upperdir={0}/fu,workdir={0}/fw {0}/host",
        p.display()
    ));
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // The mosaicfs daemon on top exits after its unmount returns, holding files of the
            // host mount until then: EBUSY for a moment.
            let start = std::time::Instant::now();
            while is_mounted(&self.0) && start.elapsed() < std::time::Duration::from_secs(10) {
                let _ = std::process::Command::new("umount")
                    .arg(&self.0)
                    .stderr(std::process::Stdio::null())
                    .status();
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }
    let _host = Unmount(p.join("host"));
    fs::create_dir(p.join("host/upper")).unwrap();
    fs::create_dir(p.join("host/work")).unwrap();
    let base = pattern(300_000, 18);
    write(p.join("lower/f"), &base);
    let out = std::process::Command::new(BIN)
        .args([
            "-o",
            &format!(
                "lowerdir={0}/lower,upperdir={0}/host/upper,workdir={0}/host/work",
                p.display()
            ),
        ])
        .arg(p.join("mnt"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _mnt = Unmount(p.join("mnt"));
    let warning = String::from_utf8_lossy(&out.stderr);
    assert!(
        warning.contains("does not report holes") && warning.contains("copied up whole"),
        "{warning}"
    );
    write_at(p.join("mnt/f"), 4094, b"edge");
    let mut want = base.clone();
    want[4094..4098].copy_from_slice(b"edge");
    assert!(fs::read(p.join("mnt/f")).unwrap() == want);
    assert!(
        get_xattr(&p.join("host/upper/f"), "trusted.mosaicfs.partial").is_none(),
        "a whole, unmarked copy"
    );
    assert!(fs::read(p.join("host/upper/f")).unwrap() == want);
}

#[test]
fn a_full_upper_file_system_fails_writes_cleanly_and_loses_nothing() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut s = SmallUpper::new("1m");
    let base = pattern(8 << 20, 19);
    write(s.lower().join("big"), &base);
    write(s.lower().join("small"), b"small");
    s.mount("");
    let f = fs::OpenOptions::new()
        .write(true)
        .open(s.m.path("big"))
        .unwrap();
    let n = f.write_at(&vec![b'y'; 2 << 20], 0).unwrap();
    assert!(n < 2 << 20, "the disk cannot hold 2 MiB: a short write");
    let e = f.write_all_at(&vec![b'z'; 1 << 20], 4 << 20).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    drop(f);
    assert_eq!(
        errno_of(fs::write(s.m.path("new"), vec![0u8; 1 << 20])),
        libc::ENOSPC
    );
    let got = fs::read(s.m.path("big")).unwrap();
    assert!(
        got[..n].iter().all(|b| *b == b'y'),
        "what was written is there"
    );
    assert!(
        got[n..] == base[n..],
        "everything else is the lower file, nothing zeroed"
    );
    assert_eq!(fs::read(s.m.path("small")).unwrap(), b"small");
    assert_eq!(
        fs::read(s.lower().join("big")).unwrap(),
        base,
        "lower untouched"
    );
    s.m.unmount();
}

#[test]
fn upper_dir_stacked_as_lower_keeps_partial_files_readable() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // An upper dir reused as a lower layer (a layer commit done by moving the dir) holds
    // partial files: they must read through to the layer below, never as zeros.
    let base = pattern(8 * MIB, 21);
    let mut first = lower_with("big", &base);
    let mut want = base.clone();
    fs::OpenOptions::new()
        .write(true)
        .open(first.path("big"))
        .unwrap()
        .write_all_at(b"first", 1_000_000)
        .unwrap();
    want[1_000_000..1_000_005].copy_from_slice(b"first");
    first.unmount();
    assert!(
        get_xattr(&first.upper.join("big"), "trusted.mosaicfs.partial").is_some(),
        "the first upper holds a partial file"
    );

    let mut stacked = Mount::new(0);
    stacked.lowers = vec![first.upper.clone(), first.lower(0).to_path_buf()];
    stacked.mount();
    assert!(
        fs::read(stacked.path("big")).unwrap() == want,
        "read through two layers"
    );
    let f = fs::File::open(stacked.path("big")).unwrap();
    assert_eq!(
        rustix::fs::seek(&f, rustix::fs::SeekFrom::Data(0)).unwrap(),
        0
    );
    drop(f);

    // A write makes a partial file over the partial file: a chain of three layers.
    fs::OpenOptions::new()
        .write(true)
        .open(stacked.path("big"))
        .unwrap()
        .write_all_at(b"second", 5_000_000)
        .unwrap();
    want[5_000_000..5_000_006].copy_from_slice(b"second");
    assert!(
        fs::read(stacked.path("big")).unwrap() == want,
        "chained partial files"
    );
    stacked.remount();
    assert!(
        fs::read(stacked.path("big")).unwrap() == want,
        "after remount"
    );
    assert!(
        fs::read(first.lower(0).join("big")).unwrap() == base,
        "bottom layer untouched"
    );
}
