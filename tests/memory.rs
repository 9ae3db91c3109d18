//! The memory upper (`upper=memory`, issue #13): what it promises beyond what the rest of the
//! suite checks on it (the suite also runs with MOSAICFS_TEST_UPPER=memory).

mod common;

use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::process::Command;

use common::*;

const FILESTORE: &str = ".mosaicfs-filestore";
const IMAGE: &str = ".mosaicfs-tree";

fn memory_mount(fill: impl FnOnce(&std::path::Path), extra: &[&str]) -> Mount {
    let mut m = Mount::new(1);
    fill(m.lower(0));
    m.extra = std::iter::once("upper=memory")
        .chain(extra.iter().copied())
        .map(String::from)
        .collect();
    m.mount();
    m
}

/// `mosaicfs sync MNT`, asserting success.
fn sync(m: &Mount) {
    run(Command::new(BIN).arg("sync").arg(&m.mnt));
}

/// Every file of `dir` with its bytes.
fn files_of(dir: &std::path::Path) -> Vec<(std::ffi::OsString, Vec<u8>)> {
    let mut files: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), fs::read(e.path()).unwrap())
        })
        .collect();
    files.sort();
    files
}

fn filestore_bytes(m: &Mount) -> u64 {
    allocated(&m.upper.join(FILESTORE))
}

/// The whole of `p` read with O_DIRECT: every byte from the daemon, none from the page cache.
fn read_direct(p: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(p)?;
    let len = f.metadata()?.len() as usize;
    let mut raw = vec![0u8; len + 8192];
    let start = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[start..start + len.next_multiple_of(4096)];
    let mut done = 0;
    while done < len {
        match f.read_at(&mut buf[done..], done as u64)? {
            0 => break,
            n => done += n,
        }
    }
    Ok(buf[..done].to_vec())
}

#[test]
fn first_write_to_a_lower_file_stores_only_its_block_in_the_filestore() {
    let data = pattern(16 << 20, 3);
    let mut m = memory_mount(|l| write(l.join("big"), &data), &[]);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("big"))
        .unwrap();
    f.write_all_at(b"X", 5 << 20).unwrap();
    drop(f);
    let mut want = data;
    want[5 << 20] = b'X';
    assert!(fs::read(m.path("big")).unwrap() == want, "merged content");
    let status = run(Command::new(BIN).arg("status").arg(&m.mnt));
    assert!(
        status.contains("changes since the last image or journal entry: yes"),
        "{status}"
    );
    sync(&m);
    let status = run(Command::new(BIN).arg("status").arg(&m.mnt));
    assert!(
        status.contains("upper store: memory, 2 objects, 4096 bytes of file data"),
        "{status}"
    );
    assert!(
        status.contains("changes since the last image or journal entry: none"),
        "{status}"
    );
    let json = run(Command::new(BIN).args(["status", "--json"]).arg(&m.mnt));
    assert!(json.contains("\"changes_pending\": false"), "{json}");
    assert!(
        filestore_bytes(&m) <= 8192,
        "one block, not the file: {} bytes in the filestore",
        filestore_bytes(&m)
    );
    m.remount();
    assert!(fs::read(m.path("big")).unwrap() == want, "after a remount");
    assert_eq!(
        names(&m.upper),
        [FILESTORE, ".mosaicfs-journal", IMAGE],
        "the upper dir holds the layer's files only"
    );
}

#[test]
fn chown_and_chmod_of_a_lower_tree_store_no_data() {
    let mut m = memory_mount(
        |l| {
            for i in 0..20 {
                write(l.join(format!("d/f{i}")), pattern(100_000, i));
            }
        },
        &[],
    );
    sh(&format!(
        "chown -R 123:456 {0}/d && chmod -R g+w {0}/d",
        m.mnt.display()
    ));
    sync(&m);
    assert_eq!(filestore_bytes(&m), 0, "metadata only");
    m.remount();
    let md = fs::metadata(m.path("d/f7")).unwrap();
    assert_eq!((md.uid(), md.gid(), md.mode() & 0o777), (123, 456, 0o664));
    assert!(fs::read(m.path("d/f7")).unwrap() == pattern(100_000, 7));
}

#[test]
fn after_a_crash_the_layer_is_as_of_the_last_sync_plus_what_was_fsynced() {
    let mut m = memory_mount(|l| write(l.join("lower"), "l"), &[]);
    write(m.path("synced"), "by mosaicfs sync");
    fs::remove_file(m.path("lower")).unwrap();
    sync(&m);
    let f = fs::File::create(m.path("fsynced")).unwrap();
    f.write_all_at(b"by fsync", 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    write(m.path("lost"), "neither");
    fs::remove_file(m.path("synced")).unwrap();
    write(m.path("synced"), "rewritten, not synced");
    m.kill9();
    m.mount();
    assert_eq!(
        fs::read_to_string(m.path("synced")).unwrap(),
        "by mosaicfs sync"
    );
    assert_eq!(fs::read_to_string(m.path("fsynced")).unwrap(), "by fsync");
    assert!(!m.path("lost").exists());
    assert!(!m.path("lower").exists(), "the whiteout was synced");
}

#[test]
fn a_volatile_mount_keeps_what_an_unmount_wrote_but_not_fsyncs_across_a_crash() {
    let mut m = memory_mount(|_| {}, &["volatile"]);
    write(m.path("a"), "kept by the unmount");
    m.remount();
    let f = fs::File::create(m.path("b")).unwrap();
    f.sync_all().unwrap();
    drop(f);
    m.kill9();
    m.mount();
    assert_eq!(
        fs::read_to_string(m.path("a")).unwrap(),
        "kept by the unmount"
    );
    assert!(!m.path("b").exists(), "volatile: an fsync promises nothing");
}

/// An unmount does not wait for the daemon (containers/storage mounts the layer again at
/// once for commit and diff): the next mount waits for the image the last one writes.
#[test]
fn a_mount_right_after_an_unmount_sees_every_change() {
    let mut m = memory_mount(|_| {}, &[]);
    // A sibling test's fork copies the descriptor being written; until its exec, the mount is
    // busy and the unmount fails with EBUSY (seen once in CI). No forks until the unmount.
    let forks = no_forks();
    for i in 0..3000 {
        write(m.path(&format!("f{i}")), format!("{i}"));
    }
    let daemon = m.take_daemon();
    rustix::mount::unmount(&m.mnt, rustix::mount::UnmountFlags::empty()).unwrap();
    drop(forks);
    m.mount();
    assert_eq!(names(&m.mnt).len(), 3000);
    assert_eq!(fs::read_to_string(m.path("f2999")).unwrap(), "2999");
    let out = daemon.wait_with_output().unwrap();
    assert!(out.status.success());
}

#[test]
fn blocks_reserved_past_the_end_of_a_file_survive_a_remount_and_a_crash() {
    // fallocate(FALLOC_FL_KEEP_SIZE) maps blocks past the end; the image and the journal
    // hold them, and the next mount refused both as damaged ("maps blocks past its end").
    let keep_size = rustix::fs::FallocateFlags::KEEP_SIZE;
    let mut m = memory_mount(|_| {}, &[]);
    let reserve = |name: &str, len: u64| {
        let f = fs::File::create(m.path(name)).unwrap();
        f.write_all_at(b"data", 0).unwrap();
        rustix::fs::fallocate(&f, keep_size, 0, len).unwrap();
        f.sync_all().unwrap(); // into the journal
    };
    reserve("imaged", 1 << 20);
    sync(&m); // into the image
    reserve("journaled", 256 << 10);
    m.kill9();
    m.mount();
    for (name, len) in [("imaged", 1u64 << 20), ("journaled", 256 << 10)] {
        let md = fs::metadata(m.path(name)).unwrap();
        assert_eq!(md.len(), 4, "{name}: the size stays");
        assert!(
            md.blocks() * 512 >= len,
            "{name}: {} blocks reserved",
            md.blocks()
        );
        assert_eq!(fs::read(m.path(name)).unwrap(), b"data");
        fs::File::options()
            .write(true)
            .open(m.path(name))
            .unwrap()
            .set_len(8192)
            .unwrap();
        let mut want = b"data".to_vec();
        want.resize(8192, 0);
        assert_eq!(
            fs::read(m.path(name)).unwrap(),
            want,
            "{name}: reserved blocks read as zeros"
        );
    }
    m.remount();
    assert_eq!(fs::metadata(m.path("imaged")).unwrap().len(), 8192);
}

#[test]
fn a_damaged_image_is_refused_naming_the_upper_dir_and_what_to_do() {
    let mut m = memory_mount(|_| {}, &[]);
    write(m.path("f"), "data");
    m.unmount();
    let image = m.upper.join(IMAGE);
    let mut bytes = fs::read(&image).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 0xff;
    fs::write(&image, &bytes).unwrap();
    let err = m.refused(&m.options());
    assert!(
        err.contains(&m.upper.display().to_string()) && err.contains("move"),
        "{err}"
    );
    assert_eq!(
        fs::read(&image).unwrap(),
        bytes,
        "the image is left as it was"
    );
}

#[test]
fn a_memory_layer_and_a_disk_layer_are_never_mistaken_for_each_other() {
    let mut m = memory_mount(|_| {}, &[]);
    write(m.path("f"), "data");
    m.unmount();
    let disk_opts = m.options().replace(",upper=memory", "");
    assert!(m.refused(&disk_opts).contains("upper=memory"));

    let d = Mount::new(1);
    write(d.upper.join("file"), "of a disk layer");
    let memory_opts = format!("{},upper=memory", d.options().replace(",upper=memory", ""));
    assert!(d.refused(&memory_opts).contains("upper=disk"));
}

#[test]
fn size_caps_the_layer_with_enospc_and_keeps_what_was_written() {
    let m = memory_mount(|_| {}, &["size=1M"]);
    write(m.path("kept"), pattern(512 << 10, 1));
    let f = fs::File::create(m.path("big")).unwrap();
    let e = f.write_all_at(&pattern(1 << 20, 2), 0).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    drop(f);
    assert!(fs::read(m.path("kept")).unwrap() == pattern(512 << 10, 1));
    let st = rustix::fs::statvfs(&m.mnt).unwrap();
    assert_eq!(st.f_blocks * st.f_frsize, 1 << 20, "df shows the cap");
    fs::remove_file(m.path("kept")).unwrap();
    sync(&m);
    // The removed file's data is held until the kernel lets go of its inode, milliseconds
    // after the unlink (ROBUSTNESS.md, "Calls racing the removal of their object").
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while let Err(e) = fs::write(m.path("after"), pattern(768 << 10, 3)) {
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert!(
            std::time::Instant::now() < deadline,
            "no room 2 s after the removal"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(fs::read(m.path("after")).unwrap() == pattern(768 << 10, 3));
}

#[test]
fn a_filestore_elsewhere_or_in_memory() {
    let mut m = Mount::new(1);
    let store = m.dir.path().join("elsewhere/store");
    fs::create_dir(store.parent().unwrap()).unwrap();
    m.extra = vec![
        "upper=memory".into(),
        format!("filestore={}", store.display()),
    ];
    m.mount();
    write(m.path("f"), pattern(100_000, 4));
    m.remount();
    assert!(fs::read(m.path("f")).unwrap() == pattern(100_000, 4));
    assert!(
        allocated(&store) >= 100_000,
        "the data is in the named file"
    );
    assert!(!m.upper.join(FILESTORE).exists());
    m.unmount();

    let mut v = Mount::new(1);
    v.extra = vec!["upper=memory".into(), "filestore=memory".into()];
    v.mount();
    write(v.path("f"), "gone with the daemon");
    v.remount();
    assert!(!v.path("f").exists(), "filestore=memory keeps nothing");
    assert!(names(&v.upper).is_empty());
}

/// A removed file's data stays while something may still reach it — an open descriptor, or
/// the kernel's inode, which a call that looked the name up before the removal may be about
/// to use (ROBUSTNESS.md, "Calls racing the removal of their object"); the kernel lets go of
/// it milliseconds after the unlink. The first sync after that punches the data out.
#[test]
fn removed_data_leaves_the_filestore_after_the_next_sync() {
    let m = memory_mount(|_| {}, &[]);
    write(m.path("f"), pattern(4 << 20, 5));
    sync(&m);
    assert!(filestore_bytes(&m) >= 4 << 20);
    fs::remove_file(m.path("f")).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        sync(&m);
        let left = filestore_bytes(&m);
        if left < 64 << 10 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{left} bytes left 2 s after the removal"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Reads are answered from a mapping of the filestore, copied by the kernel alone (filestore.rs,
/// `Mapping`). A filestore truncated under the daemon by someone else must cost each read of
/// what it held an EIO — not the daemon (SIGBUS in a copy of its own), and not zeros passed
/// off as the file's data (what a pread past the end gives).
#[test]
fn reads_of_a_filestore_truncated_under_the_daemon_fail_with_eio_and_the_mount_lives() {
    let mut m = memory_mount(|_| {}, &[]);
    // Two written ranges with a hole between them, which reads as zeros.
    let mut want = vec![0u8; 1 << 20];
    want[..300_000].copy_from_slice(&pattern(300_000, 6));
    want[700_000..].copy_from_slice(&pattern((1 << 20) - 700_000, 7));
    write(m.path("f"), &want[..300_000]);
    write_at(m.path("f"), 700_000, &want[700_000..]);
    assert!(
        read_direct(&m.path("f")).unwrap() == want,
        "content, hole included"
    );

    fs::OpenOptions::new()
        .write(true)
        .open(m.upper.join(FILESTORE))
        .unwrap()
        .set_len(0)
        .unwrap();
    assert_eq!(errno_of(read_direct(&m.path("f"))), libc::EIO);

    write(m.path("g"), "written after");
    assert_eq!(read_direct(&m.path("g")).unwrap(), b"written after");
    let log = m.unmount();
    assert!(
        log.contains("filestore could not be read"),
        "the daemon says why: {log}"
    );
}

#[test]
fn an_unmounted_memory_layer_exports_offline_and_fsck_says_it_checks_disk_layers() {
    let mut m = memory_mount(
        |l| {
            write(l.join("gone"), "lower");
            write(l.join("big"), pattern(1 << 20, 6));
        },
        &[],
    );
    write(m.path("new/file"), "made in memory");
    fs::remove_file(m.path("gone")).unwrap();
    write_at(m.path("big"), 4096, b"patched");
    m.unmount();
    let before = files_of(&m.upper);
    let tar = m.dir.path().join("layer.tar");
    run(Command::new(BIN)
        .args(["export", "-q", "-o"])
        .arg(&tar)
        .arg(format!("--lowerdir={}", m.lower(0).display()))
        .arg(format!("--upperdir={}", m.upper.display()))
        .arg(format!("--workdir={}", m.work.display())));
    let listed = sh(&format!("tar -tf {}", tar.display()));
    for want in ["new/file", ".wh.gone", "big"] {
        assert!(
            listed.lines().any(|l| l.trim_start_matches("./") == want),
            "{want} in {listed}"
        );
    }
    let x = m.dir.path().join("x");
    fs::create_dir(&x).unwrap();
    sh(&format!("tar -xf {} -C {}", tar.display(), x.display()));
    assert_eq!(
        fs::read_to_string(x.join("new/file")).unwrap(),
        "made in memory"
    );
    let mut want = pattern(1 << 20, 6);
    want[4096..4103].copy_from_slice(b"patched");
    assert!(fs::read(x.join("big")).unwrap() == want, "the merged bytes");
    let after = files_of(&m.upper);
    assert!(before == after, "an export changes nothing in the layer");

    let _forking = forking();
    let out = Command::new(BIN)
        .arg("fsck")
        .arg(format!("--lowerdir={}", m.lower(0).display()))
        .arg(format!("--upperdir={}", m.upper.display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("memory upper layer"));
}

#[test]
fn a_memory_upper_dir_given_as_a_lower_layer_is_refused_and_a_namesake_file_is_not() {
    let mut m = memory_mount(|_| {}, &[]);
    write(m.path("f"), "in the image");
    m.unmount();
    let mut stacked = Mount::new(0);
    stacked.lowers = vec![m.upper.clone()];
    let err = stacked.refused(&stacked.options());
    assert!(
        err.contains(&m.upper.display().to_string()) && err.contains("memory upper layer"),
        "{err}"
    );

    let plain = memory_mount(|l| write(l.join(IMAGE), "just a file of an image"), &[]);
    assert_eq!(
        fs::read_to_string(plain.path(IMAGE)).unwrap(),
        "just a file of an image"
    );
}

/// A close of a complete file sends no FLUSH (nothing can wait in copy-after-write buffers for
/// it): one request less per file a container writes, which a memory upper's files, never
/// passed through, would otherwise pay. A partial file's close still sends one, and what the
/// writes left pending is whole after it.
#[test]
fn closes_of_complete_files_send_no_flush_and_partial_files_still_do() {
    let m = memory_mount(
        |l| fs::write(l.join("lower"), vec![7u8; 4 << 20]).unwrap(),
        &[],
    );
    for i in 0..20 {
        fs::write(m.path(&format!("made{i}")), format!("file {i}")).unwrap();
    }
    assert_eq!(
        requests(&m, "FLUSH"),
        0,
        "closes of files made in the mount"
    );
    write_at(m.path("lower"), 5000, b"abc");
    assert!(requests(&m, "FLUSH") >= 1, "the close of a partial file");
    let data = fs::read(m.path("lower")).unwrap();
    assert_eq!(data.len(), 4 << 20);
    assert_eq!(&data[5000..5003], b"abc");
    assert!(data[..5000].iter().chain(&data[5003..]).all(|&b| b == 7));
    for i in 0..20 {
        assert_eq!(
            fs::read_to_string(m.path(&format!("made{i}"))).unwrap(),
            format!("file {i}")
        );
    }
}

/// Names made or moved into `dir` while `during` runs, as inotify reports them.
fn names_made_in(dir: &std::path::Path, during: impl FnOnce()) -> Vec<String> {
    use std::os::unix::ffi::OsStrExt;
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    assert!(fd >= 0);
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let mask = libc::IN_CREATE | libc::IN_MOVED_TO;
    assert!(unsafe { libc::inotify_add_watch(fd, path.as_ptr(), mask) } >= 0);
    during();
    let mut names = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        let mut at = 0;
        while at < n as usize {
            // struct inotify_event: wd, mask, cookie, len (4 bytes each), then the name.
            let len = u32::from_ne_bytes(buf[at + 12..at + 16].try_into().unwrap()) as usize;
            let name = &buf[at + 16..at + 16 + len];
            let end = name.iter().position(|&b| b == 0).unwrap_or(len);
            names.push(String::from_utf8_lossy(&name[..end]).into_owned());
            at += 16 + len;
        }
    }
    unsafe { libc::close(fd) };
    names
}

/// umount(2) does not wait for a FUSE daemon, and containers/storage removes a layer's
/// directory right after unmounting it (podman build deletes each step's container). A name
/// the daemon made in the upper dir while making the last changes durable (the image it
/// wrote, `.mosaicfs-tree.new` renamed over `.mosaicfs-tree`) failed that removal with
/// ENOTEMPTY: "error deleting build container". An unmount writes into files already there.
#[test]
fn an_unmount_makes_no_name_in_the_upper_dir_and_the_next_mount_sees_every_change() {
    let mut m = memory_mount(|l| write(l.join("lower"), "from the image"), &[]);
    write(m.path("new"), "made");
    fs::create_dir(m.path("dir")).unwrap();
    write(m.path("dir/inner"), "inner");
    fs::remove_file(m.path("lower")).unwrap();
    let upper = m.upper.clone();
    let made = names_made_in(&upper, || {
        m.unmount();
    });
    assert_eq!(made, Vec::<String>::new(), "names made by the unmount");
    let before: Vec<_> = names(&upper);
    // The next mount folds what the unmount wrote into an image; an unmount of a layer in
    // which nothing changed writes nothing at all (the image and journal keep their bytes).
    m.mount();
    assert_eq!(fs::read_to_string(m.path("new")).unwrap(), "made");
    assert_eq!(fs::read_to_string(m.path("dir/inner")).unwrap(), "inner");
    assert!(!m.path("lower").exists(), "the whiteout survived");
    let files = files_of(&upper);
    let made = names_made_in(&upper, || {
        assert_eq!(names(&m.mnt), ["dir", "new"]);
        m.unmount();
    });
    assert_eq!(made, Vec::<String>::new());
    assert_eq!(files_of(&upper), files, "an unmount with no change wrote");
    assert_eq!(names(&upper), before);
}

/// A mount folds the journal the last unmount wrote into a new image. On a full disk it
/// cannot: that must not refuse the mount nor lose a change (the image and journal are the
/// layer), and the fold happens at the next mount with room.
#[test]
fn a_mount_that_cannot_fold_the_journal_on_a_full_disk_serves_the_layer() {
    let mut s = SmallUpper::new("4m");
    s.mount(",upper=memory");
    for i in 0..300 {
        write(
            s.m.path(&format!("file-with-a-long-name-{i}")),
            format!("{i}"),
        );
    }
    s.m.unmount();
    let journal = s.upper().join(".mosaicfs-journal");
    assert!(
        fs::metadata(&journal).unwrap().len() > 20,
        "the unmount's entry"
    );
    // Fill the file system.
    let filler = s.upper().parent().unwrap().join("filler");
    let mut f = fs::File::create(&filler).unwrap();
    while std::io::Write::write_all(&mut f, &[7u8; 4096]).is_ok() {}
    drop(f);
    s.mount(",upper=memory");
    assert_eq!(names(&s.m.mnt).len(), 300);
    assert_eq!(
        fs::read_to_string(s.m.path("file-with-a-long-name-299")).unwrap(),
        "299"
    );
    fs::remove_file(&filler).unwrap();
    write(s.m.path("after"), "after");
    let log = s.m.unmount();
    assert!(
        log.contains("could not be folded into a new image") && log.contains("free space"),
        "{log}"
    );
    s.mount(",upper=memory");
    assert_eq!(names(&s.m.mnt).len(), 301);
    assert_eq!(fs::read_to_string(s.m.path("after")).unwrap(), "after");
    assert_eq!(
        fs::metadata(&journal).unwrap().len(),
        20,
        "folded at this mount"
    );
    s.m.unmount();
}
