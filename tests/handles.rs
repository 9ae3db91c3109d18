//! File handles (name_to_handle_at / open_by_handle_at) across the kernel forgetting the inode:
//! drop_caches and a remount, for objects of every layer, copied-up, renamed and hard-linked
//! ones included; ESTALE only for objects that are gone.

mod common;

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::*;

/// A file handle as name_to_handle_at(2) gives it: `struct file_handle` and its bytes.
struct Handle {
    buf: Vec<u8>,
}

const MAX_HANDLE_SZ: usize = 128;

fn handle_of(path: &Path) -> Handle {
    let mut buf = vec![0u8; 8 + MAX_HANDLE_SZ];
    buf[..4].copy_from_slice(&(MAX_HANDLE_SZ as u32).to_ne_bytes());
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut mount_id = 0;
    // SAFETY: `buf` holds a `struct file_handle` with room for MAX_HANDLE_SZ bytes, as its
    // `handle_bytes` says; the name is a C string.
    let r = unsafe {
        libc::name_to_handle_at(
            libc::AT_FDCWD,
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut mount_id,
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "name_to_handle_at {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    Handle { buf }
}

/// open_by_handle_at(2) of `h` on the file system of `mount_dir`.
fn open_handle(mount_dir: &Path, h: &Handle, flags: i32) -> std::io::Result<OwnedFd> {
    let dir = fs::File::open(mount_dir).unwrap();
    let mut buf = h.buf.clone();
    // SAFETY: `buf` is a `struct file_handle` name_to_handle_at filled in.
    let fd = unsafe { libc::open_by_handle_at(dir.as_raw_fd(), buf.as_mut_ptr().cast(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn read_fd(fd: OwnedFd) -> String {
    fs::read_to_string(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap()
}

fn ino_of_fd(fd: &OwnedFd) -> u64 {
    fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .unwrap()
        .ino()
}

fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

#[test]
fn file_handles_outlive_drop_caches_and_a_remount_for_objects_of_every_layer() {
    let mut m = Mount::new(1);
    let l = m.lower(0).to_path_buf();
    write(l.join("a/b/lower_file"), "lower");
    write(l.join("a/b/copied"), "to be copied up");
    write(l.join("to_move"), "moved from the lower layer");
    fs::create_dir_all(l.join("deep/er/still")).unwrap();
    write(l.join("deep/er/still/f"), "deep");
    m.mount();
    let root = m.path("");
    let p = |rel: &str| root.join(rel);
    write(p("a/new"), "upper only");
    fs::create_dir(p("c")).unwrap();
    write(p("c/f"), "linked");
    fs::hard_link(p("c/f"), p("c/f2")).unwrap();
    fs::remove_file(p("c/f")).unwrap();
    write_at(p("a/b/copied"), 0, b"TO");
    fs::rename(p("to_move"), p("c/moved")).unwrap();
    fs::rename(p("deep/er"), p("c/er")).unwrap();
    // Made without an open: the kernel holds a closed file's inode until the daemon has
    // answered its asynchronous RELEASE (fs/fuse/file.c `fuse_release_common`), and a
    // handle of an inode it still holds opens, removed or not, as on ext4.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        p("gone"),
        rustix::fs::FileType::RegularFile,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();

    // What each handle must open: (path when taken, expected content or None for a dir).
    let objects: Vec<(&str, Option<&str>)> = vec![
        ("a", None),
        ("a/b", None),
        ("a/b/lower_file", Some("lower")),
        ("a/b/copied", Some("TO be copied up")),
        ("a/new", Some("upper only")),
        ("c", None),
        ("c/f2", Some("linked")),
        ("c/moved", Some("moved from the lower layer")),
        ("c/er/still", None),
        ("c/er/still/f", Some("deep")),
    ];
    let handles: Vec<_> = objects.iter().map(|(rel, _)| handle_of(&p(rel))).collect();
    let inos: Vec<u64> = objects
        .iter()
        .map(|(rel, _)| fs::metadata(p(rel)).unwrap().ino())
        .collect();
    let gone = handle_of(&p("gone"));
    fs::remove_file(p("gone")).unwrap();
    // Renamed after the handle was taken: the handle follows the object.
    fs::rename(p("a/new"), p("c/new_renamed")).unwrap();

    let check = |m: &Mount, when: &str| {
        for (((rel, content), h), ino) in objects.iter().zip(&handles).zip(&inos) {
            let flags = match content {
                Some(_) => libc::O_RDONLY,
                None => libc::O_RDONLY | libc::O_DIRECTORY,
            };
            let fd = open_handle(&m.path(""), h, flags)
                .unwrap_or_else(|e| panic!("{when}: open_by_handle_at of {rel}: {e}"));
            assert_eq!(ino_of_fd(&fd), *ino, "{when}: {rel} opened another object");
            if let Some(content) = content {
                assert_eq!(read_fd(fd), *content, "{when}: {rel}");
            }
        }
        let e = open_handle(&m.path(""), &gone, libc::O_RDONLY).map(|_| ());
        assert_eq!(errno_of(e), libc::ESTALE, "{when}: a removed file's handle");
    };
    // While the kernel holds every inode.
    check(&m, "with caches");
    drop_caches();
    check(&m, "after drop_caches");
    drop_caches();
    // A directory handle first: the kernel reconnects it through its parents ("..").
    let fd = open_handle(&m.path(""), &handles[8], libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
    assert_eq!(names(format!("/proc/self/fd/{}", fd.as_raw_fd())), ["f"]);
    drop(fd);
    m.remount();
    check(&m, "after a remount");
    // Written through a handle opened after the remount: the write lands in the object.
    let fd = open_handle(&m.path(""), &handles[2], libc::O_WRONLY).unwrap();
    fs::write(format!("/proc/self/fd/{}", fd.as_raw_fd()), "LOWER").unwrap();
    drop(fd);
    assert_eq!(fs::read_to_string(p("a/b/lower_file")).unwrap(), "LOWER");
    m.unmount();
}

#[test]
fn a_handle_of_a_removed_file_stays_stale_when_its_number_is_given_to_a_new_file() {
    // Upper file systems give a freed inode number to the next new file (ext4 does at once);
    // the new file must not open through the old file's handle. (A memory upper never gives
    // a number out twice.)
    if !runs_on_disk_upper_only() {
        return;
    }
    let fs_ = LoopFs::new("mkfs.ext4 -q", 64 << 20);
    let mut m = Mount::new_in(&fs_.path, 1);
    m.mount();
    let mut reused = None;
    for i in 0..64 {
        let old = m.path(&format!("old{i}"));
        write(&old, "old");
        let ino = fs::metadata(&old).unwrap().ino();
        let h = handle_of(&old);
        fs::remove_file(&old).unwrap();
        drop_caches();
        let new = m.path(&format!("new{i}"));
        write(&new, "new");
        if fs::metadata(&new).unwrap().ino() == ino {
            reused = Some((h, new));
            break;
        }
    }
    let (h, new) = reused.expect("ext4 gave no freed number to a new file in 64 tries");
    drop_caches();
    let e = open_handle(&m.path(""), &h, libc::O_RDONLY).map(|_| ());
    assert_eq!(errno_of(e), libc::ESTALE);
    // The new file's handle carries the generation that tells it from the old file; after a
    // remount the daemon must give it that generation again (xfstests generic/477 on ext4):
    // it is taken from the object itself, not counted by one mount.
    let new_handle = handle_of(&new);
    m.remount();
    let fd = open_handle(&m.path(""), &new_handle, libc::O_RDONLY)
        .expect("the new file's handle after a remount");
    assert_eq!(read_fd(fd), "new");
    let e = open_handle(&m.path(""), &h, libc::O_RDONLY).map(|_| ());
    assert_eq!(
        errno_of(e),
        libc::ESTALE,
        "the old file's handle after a remount"
    );
    m.unmount();
}

/// Removing lower files leaves no node behind once the kernel forgets them: only a lower file
/// with other names keeps its node (the count of its removed names is nowhere else). Kept,
/// every lower file an `rm -rf` removed stayed in the daemon's memory until the unmount.
#[test]
fn removed_lower_files_leave_no_node_behind() {
    let mut m = Mount::new(1);
    let many = m.lower(0).join("many");
    fs::create_dir(&many).unwrap();
    for i in 0..500 {
        fs::write(many.join(format!("f{i}")), "x").unwrap();
    }
    fs::write(m.lower(0).join("linked"), "l").unwrap();
    fs::hard_link(m.lower(0).join("linked"), m.lower(0).join("linked2")).unwrap();
    m.mount();
    for i in 0..500 {
        fs::remove_file(m.path(&format!("many/f{i}"))).unwrap();
    }
    fs::remove_file(m.path("linked")).unwrap();
    drop_caches();
    let report = status(&m);
    let known: u64 = report
        .lines()
        .find_map(|l| l.strip_prefix("inodes known: "))
        .unwrap_or_else(|| panic!("no inode count in: {report}"))
        .trim()
        .parse()
        .unwrap();
    assert!(
        known < 100,
        "{known} inodes known after removing 500 lower files"
    );
    assert_eq!(fs::metadata(m.path("linked2")).unwrap().nlink(), 1);
    assert!(fs::read_dir(m.path("many")).unwrap().next().is_none());
}

/// A handle found by a scan of the tree opens whatever the scan had to record on its way: the
/// records of forgotten nodes are bounded, and a directory of more names than they hold once
/// pushed out the record of the very directory holding the object the scan was looking for,
/// so the object, found, answered ESTALE.
#[test]
fn handles_in_a_directory_of_more_names_than_the_records_hold_open_after_a_remount() {
    const FILES: usize = 40_000;
    let mut m = Mount::new(1);
    let big = m.lower(0).join("outer/big");
    fs::create_dir_all(&big).unwrap();
    for i in 0..FILES {
        fs::File::create(big.join(format!("f{i:05}"))).unwrap();
    }
    m.mount();
    let wanted: Vec<String> = (0..FILES)
        .step_by(FILES / 16)
        .map(|i| format!("outer/big/f{i:05}"))
        .chain(["outer/big".to_string()])
        .collect();
    let handles: Vec<_> = wanted.iter().map(|rel| handle_of(&m.path(rel))).collect();
    let inos: Vec<u64> = wanted
        .iter()
        .map(|rel| fs::metadata(m.path(rel)).unwrap().ino())
        .collect();
    for when in ["after a remount", "after drop_caches"] {
        match when {
            "after a remount" => m.remount(),
            _ => drop_caches(),
        }
        for ((rel, h), ino) in wanted.iter().zip(&handles).zip(&inos) {
            let fd = open_handle(&m.path(""), h, libc::O_RDONLY)
                .unwrap_or_else(|e| panic!("{when}: open_by_handle_at of {rel}: {e}"));
            assert_eq!(ino_of_fd(&fd), *ino, "{when}: {rel} opened another object");
            // Each handle after the first is looked for with the kernel's caches emptied
            // again, so that each is found from the records alone.
            drop(fd);
            drop_caches();
        }
    }
    m.unmount();
}

/// The kernel forgets a file before its directory, but the daemon's workers take FORGETs in
/// any order: a handle opened right after `drop_caches` may find the file still held and its
/// directory gone. It must open all the same (it answered ESTALE: the file's path led
/// nowhere; xfstests generic/467 under the writeback cache, one run in ten).
#[test]
fn a_handle_opens_while_its_files_forget_is_late_and_its_directorys_was_taken() {
    let mut m = Mount::new(1);
    m.env
        .push(("MOSAICFS_TEST_LATE_FORGET".into(), "1500".into()));
    m.mount();
    fs::create_dir_all(m.path("d/e")).unwrap();
    write(m.path("d/e/f"), "late");
    let h = handle_of(&m.path("d/e/f"));
    let ino = fs::metadata(m.path("d/e/f")).unwrap().ino();
    drop_caches();
    let fd = open_handle(&m.path(""), &h, libc::O_RDONLY)
        .expect("open_by_handle_at while the file's FORGET waits");
    assert_eq!(ino_of_fd(&fd), ino);
    let reopen = format!("/proc/self/fd/{}", fd.as_raw_fd());
    assert_eq!(fs::read_to_string(&reopen).unwrap(), "late");
    // Once the late FORGETs are taken, its directories are still there to open it by.
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(fs::read_to_string(&reopen).unwrap(), "late");
    drop(fd);
    m.unmount();
}
