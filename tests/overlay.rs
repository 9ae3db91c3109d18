//! The merged view and every namespace operation, on real mounts.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirEntryExt, FileExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

#[test]
fn upper_layer_wins_over_lower_and_top_lower_over_bottom() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(2);
    write(m.lower(1).join("a"), "bottom");
    write(m.lower(0).join("a"), "top");
    write(m.lower(1).join("only-bottom"), "b");
    write(m.upper.join("u"), "upper");
    write(m.lower(0).join("u"), "lower");
    m.mount();
    assert_eq!(fs::read_to_string(m.path("a")).unwrap(), "top");
    assert_eq!(fs::read_to_string(m.path("only-bottom")).unwrap(), "b");
    assert_eq!(fs::read_to_string(m.path("u")).unwrap(), "upper");
    assert_eq!(names(&m.mnt), ["a", "only-bottom", "u"]);
}

#[test]
fn whiteouts_of_every_format_hide_lower_names_and_never_show() {
    let mut m = Mount::new(2);
    for n in ["chr", "wh", "xattr", "kept"] {
        write(m.lower(1).join(n), n);
    }
    mknod_whiteout(m.lower(0), "chr");
    write(m.lower(0).join(".wh.wh"), "");
    write(m.lower(0).join("xattr"), "");
    set_xattr(&m.lower(0).join("xattr"), "trusted.overlay.whiteout", b"");
    // As kernel overlayfs writes them: the directory is marked as holding xattr whiteouts.
    set_xattr(m.lower(0), "trusted.overlay.opaque", b"x");
    m.mount();
    assert_eq!(names(&m.mnt), ["kept"]);
    for n in ["chr", "wh", "xattr", ".wh.wh"] {
        assert_eq!(errno_of(fs::metadata(m.path(n))), libc::ENOENT, "{n}");
    }
}

#[test]
fn whiteout_files_in_the_bottom_layer_hide_nothing_and_never_show() {
    // Nothing lies below the bottom layer: its `.wh.NAME` and `.wh..wh..opq` files are not
    // looked for at lookups there (namei.rs `merge_lower`), but they must stay out of view.
    let mut m = Mount::new(2);
    write(m.lower(1).join("kept"), "k");
    write(m.lower(1).join(".wh.kept"), "");
    write(m.lower(1).join(".wh.gone"), "");
    write(m.lower(1).join("d/inside"), "i");
    write(m.lower(1).join("d/.wh..wh..opq"), "");
    m.mount();
    assert_eq!(names(&m.mnt), ["d", "kept"]);
    assert_eq!(fs::read_to_string(m.path("kept")).unwrap(), "k");
    assert_eq!(names(m.path("d")), ["inside"]);
    for n in ["gone", ".wh.kept", ".wh.gone", "d/.wh..wh..opq"] {
        assert_eq!(errno_of(fs::metadata(m.path(n))), libc::ENOENT, "{n}");
    }
}

#[test]
fn opaque_directories_of_every_format_hide_lower_contents() {
    let mut m = Mount::new(2);
    for d in ["t", "u", "f", "w"] {
        write(m.lower(1).join(d).join("hidden"), "x");
        fs::create_dir(m.lower(0).join(d)).unwrap();
        write(m.lower(0).join(d).join("shown"), "y");
    }
    set_xattr(&m.lower(0).join("t"), "trusted.overlay.opaque", b"y");
    set_xattr(&m.lower(0).join("u"), "user.overlay.opaque", b"y");
    set_xattr(&m.lower(0).join("f"), "user.fuseoverlayfs.opaque", b"y");
    write(m.lower(0).join("w/.wh..wh..opq"), "");
    m.mount();
    for d in ["t", "u", "f", "w"] {
        assert_eq!(names(m.path(d)), ["shown"], "{d}");
        assert!(!m.path(d).join("hidden").exists());
    }
    let xattrs = list_xattr(&m.path("t"));
    assert!(xattrs.iter().all(|x| !x.contains("overlay")), "{xattrs:?}");
}

/// The same marks on directories of the upper layer (one written by another overlay): the
/// `.wh..wh..opq` file is looked for only where a lower directory of that name lies below, and
/// must hide it there.
#[test]
fn opaque_upper_directories_of_every_format_hide_lower_contents() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    for d in ["t", "w"] {
        write(m.lower(0).join(d).join("hidden"), "x");
        write(m.upper.join(d).join("shown"), "y");
    }
    set_xattr(&m.upper.join("t"), "trusted.overlay.opaque", b"y");
    write(m.upper.join("w/.wh..wh..opq"), "");
    write(m.upper.join("only-upper/.wh..wh..opq"), "");
    write(m.upper.join("only-upper/shown"), "y");
    m.mount();
    for d in ["t", "w", "only-upper"] {
        assert_eq!(names(m.path(d)), ["shown"], "{d}");
        assert_eq!(
            errno_of(fs::metadata(m.path(d).join("hidden"))),
            libc::ENOENT,
            "{d}"
        );
    }
    // Still opaque once emptied: the lower file does not come back.
    fs::remove_file(m.path("w/shown")).unwrap();
    assert!(names(m.path("w")).is_empty());
    fs::remove_dir(m.path("w")).unwrap();
    assert_eq!(errno_of(fs::metadata(m.path("w"))), libc::ENOENT);
}

#[test]
fn merged_directories_list_each_name_once() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(2);
    write(m.lower(1).join("d/a"), "1");
    write(m.lower(1).join("d/b"), "1");
    write(m.lower(0).join("d/b"), "2");
    write(m.lower(0).join("d/c"), "2");
    write(m.upper.join("d/c"), "3");
    write(m.upper.join("d/e"), "3");
    m.mount();
    assert_eq!(names(m.path("d")), ["a", "b", "c", "e"]);
    assert_eq!(fs::read_to_string(m.path("d/b")).unwrap(), "2");
    assert_eq!(fs::read_to_string(m.path("d/c")).unwrap(), "3");
}

/// The listing of a directory only lower layers hold is kept by the kernel across opens (no
/// second READDIR), and every change through the mount shows in the next listing.
#[test]
fn lower_directory_listings_are_kept_and_changes_show_at_once() {
    let mut m = Mount::with(|l| {
        for i in 0..50 {
            write(l.join(format!("d/f{i:02}")), "x");
        }
        write(l.join("e/x"), "x");
    });
    let listings = |m: &Mount| requests(m, "READDIR") + requests(m, "READDIRPLUS");
    assert_eq!(names(m.path("e")), ["x"]);
    // A host under memory pressure may drop the kept listing between two listings: one of a
    // few pairs must be served by the kernel alone.
    let kept = (0..5).any(|_| {
        assert_eq!(names(m.path("d")).len(), 50);
        let before = listings(&m);
        assert_eq!(names(m.path("d")).len(), 50);
        listings(&m) == before
    });
    assert!(kept, "every second listing reached the daemon");
    fs::remove_file(m.path("d/f00")).unwrap();
    write(m.path("d/new"), "n");
    fs::rename(m.path("e/x"), m.path("d/moved")).unwrap();
    fs::create_dir(m.path("d/sub")).unwrap();
    let d = names(m.path("d"));
    assert_eq!(d.len(), 52, "{d:?}");
    assert!(!d.contains(&"f00".to_string()), "{d:?}");
    for n in ["new", "moved", "sub"] {
        assert!(d.contains(&n.to_string()), "{n} missing: {d:?}");
    }
    assert!(names(m.path("e")).is_empty(), "renamed away, still listed");
    fs::remove_dir(m.path("d/sub")).unwrap();
    assert_eq!(names(m.path("d")).len(), 51);
    m.remount();
    assert_eq!(names(m.path("d")).len(), 51);
}

#[test]
fn seekdir_and_telldir_offsets_are_stable() {
    let m = Mount::with(|l| {
        for i in 0..300 {
            write(l.join(format!("d/f{i:03}")), "x");
        }
    });
    let path = std::ffi::CString::new(m.path("d").to_str().unwrap()).unwrap();
    // SAFETY: plain libc directory stream calls on a valid, NUL-terminated path.
    unsafe {
        let d = libc::opendir(path.as_ptr());
        assert!(!d.is_null());
        let mut seen = Vec::new();
        let mut mark = None;
        loop {
            let e = libc::readdir(d);
            if e.is_null() {
                break;
            }
            let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr())
                .to_string_lossy()
                .into_owned();
            seen.push(name.clone());
            if seen.len() == 150 {
                mark = Some((libc::telldir(d), name));
            }
        }
        let (pos, _) = mark.clone().unwrap();
        libc::seekdir(d, pos);
        let e = libc::readdir(d);
        let after = std::ffi::CStr::from_ptr((*e).d_name.as_ptr())
            .to_string_lossy()
            .into_owned();
        assert_eq!(after, seen[150]);
        libc::closedir(d);
        assert_eq!(seen.len(), 302);
    }
}

/// The names of the next entries of the directory `fd` (getdents64 with a small buffer, a
/// few entries per call, each call one READDIR when the kernel has no cached listing), or
/// none at its end.
fn getdents(fd: &fs::File) -> Vec<String> {
    use std::os::fd::AsRawFd;
    let mut buf = vec![0u8; 400];
    // SAFETY: getdents64 writes at most buf.len() bytes into buf.
    let n = unsafe {
        libc::syscall(
            libc::SYS_getdents64,
            fd.as_raw_fd(),
            buf.as_mut_ptr(),
            buf.len(),
        )
    };
    assert!(n >= 0, "getdents64: {}", std::io::Error::last_os_error());
    let mut names = Vec::new();
    let mut at = 0;
    while at < n as usize {
        let reclen = u16::from_ne_bytes([buf[at + 16], buf[at + 17]]) as usize;
        let name = &buf[at + 19..at + reclen];
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        names.push(String::from_utf8_lossy(&name[..end]).into_owned());
        at += reclen;
    }
    names
}

/// A directory changed between two reads of one open listing: every name there throughout
/// is returned exactly once (offsets are cookies of names, readdir.rs), whichever snapshot the
/// rest is served from — here a fresh one, since another listing after the change replaced
/// the daemon's and the kernel's.
#[test]
fn a_directory_changed_while_it_is_read_neither_skips_nor_repeats_a_name() {
    let m = Mount::with(|l| {
        for i in 0..300 {
            write(l.join(format!("d/low{i:03}")), "x");
        }
    });
    for i in 0..300 {
        write(m.path(&format!("d/up{i:03}")), "x");
    }
    let dir = fs::File::open(m.path("d")).unwrap();
    let mut seen = getdents(&dir);
    assert!(!seen.is_empty() && seen.len() < 20, "{seen:?}");
    let first: std::collections::HashSet<String> = seen.iter().cloned().collect();
    let mut removed = Vec::new();
    for i in (0..300).step_by(3) {
        for name in [format!("low{i:03}"), format!("up{i:03}")] {
            if !first.contains(&name) {
                fs::remove_file(m.path(&format!("d/{name}"))).unwrap();
                removed.push(name);
            }
        }
        write(m.path(&format!("d/new{i:03}")), "n");
    }
    assert_eq!(names(m.path("d")).len(), 600 - removed.len() + 100);
    loop {
        let more = getdents(&dir);
        if more.is_empty() {
            break;
        }
        seen.extend(more);
    }
    let mut counts = std::collections::HashMap::new();
    for n in &seen {
        *counts.entry(n.as_str()).or_insert(0) += 1;
    }
    let twice: Vec<_> = counts.iter().filter(|(_, c)| **c > 1).collect();
    assert!(twice.is_empty(), "returned twice: {twice:?}");
    for i in 0..300 {
        for name in [format!("low{i:03}"), format!("up{i:03}")] {
            if !removed.contains(&name) {
                assert!(counts.contains_key(name.as_str()), "{name} skipped");
            }
        }
    }
}

/// The inode number a listing of `dir` gives for `name` (libc's readdir, which shows `..`).
fn listed_ino(dir: &Path, name: &str) -> Option<u64> {
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    // SAFETY: plain libc directory stream calls on a valid, NUL-terminated path; the stream is
    // closed before returning.
    unsafe {
        let d = libc::opendir(path.as_ptr());
        assert!(!d.is_null(), "opendir {dir:?}");
        let mut found = None;
        loop {
            let e = libc::readdir(d);
            if e.is_null() {
                break;
            }
            if std::ffi::CStr::from_ptr((*e).d_name.as_ptr()).to_bytes() == name.as_bytes() {
                found = Some((*e).d_ino);
            }
        }
        libc::closedir(d);
        found
    }
}

/// A directory moved to another parent lists its new parent as `..` at once, though the
/// kernel keeps listings (the daemon has it drop the moved directory's).
#[test]
fn a_moved_directory_lists_its_new_parent() {
    let m = Mount::with(|l| write(l.join("low/d/f"), "x"));
    for d in ["a/d", "b"] {
        fs::create_dir_all(m.path(d)).unwrap();
    }
    write(m.path("a/d/f"), "y");
    let ino = |p: &str| fs::metadata(m.path(p)).unwrap().ino();
    assert_eq!(listed_ino(&m.path("a/d"), ".."), Some(ino("a")));
    assert_eq!(listed_ino(&m.path("low/d"), ".."), Some(ino("low")));
    fs::rename(m.path("a/d"), m.path("b/d")).unwrap();
    fs::rename(m.path("low/d"), m.path("a/low-d")).unwrap();
    assert_eq!(listed_ino(&m.path("b/d"), ".."), Some(ino("b")));
    assert_eq!(listed_ino(&m.path("a/low-d"), ".."), Some(ino("a")));
    assert_eq!(names(m.path("b/d")), ["f"]);
}

/// Listings cost no OPENDIR or RELEASEDIR (the daemon answers the first OPENDIR with ENOSYS,
/// FUSE_NO_OPENDIR_SUPPORT), the listing of an unchanged directory no READDIR either, upper
/// directories included, and a change through the mount shows in the next listing. Symlink
/// targets are read once (FUSE_CACHE_SYMLINKS).
#[test]
fn listings_and_symlinks_are_kept_by_the_kernel_until_they_change() {
    let m = Mount::with(|l| {
        write(l.join("d/a"), "x");
        std::os::unix::fs::symlink("target/of/link", l.join("link")).unwrap();
    });
    fs::create_dir(m.path("u")).unwrap();
    for i in 0..40 {
        write(m.path(&format!("u/f{i}")), "x");
    }
    let listings = |m: &Mount| requests(m, "READDIR") + requests(m, "READDIRPLUS");
    // A host under memory pressure may drop a kept listing between two listings: one of a few
    // pairs must be served by the kernel alone.
    let kept = (0..5).any(|_| {
        assert_eq!(names(m.path("u")).len(), 40);
        assert_eq!(names(m.path("d")), ["a"]);
        let before = listings(&m);
        assert_eq!(names(m.path("u")).len(), 40);
        assert_eq!(names(m.path("d")), ["a"]);
        listings(&m) == before
    });
    assert!(
        kept,
        "every listing of an unchanged directory reached the daemon"
    );
    assert_eq!(
        requests(&m, "OPENDIR"),
        1,
        "only the first OPENDIR, answered ENOSYS"
    );
    assert_eq!(requests(&m, "RELEASEDIR"), 0);
    fs::remove_file(m.path("u/f0")).unwrap();
    write(m.path("d/b"), "y");
    let u = names(m.path("u"));
    assert_eq!(u.len(), 39);
    assert!(!u.contains(&"f0".to_string()));
    assert_eq!(names(m.path("d")), ["a", "b"]);

    for _ in 0..5 {
        assert_eq!(
            fs::read_link(m.path("link")).unwrap(),
            Path::new("target/of/link")
        );
    }
    // The first reads the target; the kernel keeps it (memory pressure may drop it once).
    assert!(
        requests(&m, "READLINK") < 5,
        "every readlink reached the daemon"
    );
    // A copy-up of the symlink (chown -h) keeps its target.
    sh(&format!("chown -h 1:1 {}", m.path("link").display()));
    assert_eq!(
        fs::read_link(m.path("link")).unwrap(),
        Path::new("target/of/link")
    );
}

#[test]
fn create_write_read_and_unlink_in_lower_directories() {
    let mut m = Mount::with(|l| write(l.join("dir/old"), "old"));
    write(m.path("dir/new"), "new");
    assert_eq!(fs::read_to_string(m.path("dir/new")).unwrap(), "new");
    fs::remove_file(m.path("dir/old")).unwrap();
    assert_eq!(names(m.path("dir")), ["new"]);
    m.remount();
    assert_eq!(names(m.path("dir")), ["new"]);
    assert_eq!(
        fs::read_to_string(m.lower(0).join("dir/old")).unwrap(),
        "old",
        "lower untouched"
    );
    assert!(
        !disk_upper() || m.upper.join("dir").is_dir(),
        "directory copied up"
    );
}

#[test]
fn recreating_a_deleted_lower_name_shows_only_the_new_object() {
    let m = Mount::with(|l| {
        write(l.join("f"), "lower");
        write(l.join("d/inner"), "x");
    });
    fs::remove_file(m.path("f")).unwrap();
    write(m.path("f"), "new");
    assert_eq!(fs::read_to_string(m.path("f")).unwrap(), "new");
    fs::remove_dir_all(m.path("d")).unwrap();
    fs::create_dir(m.path("d")).unwrap();
    assert!(
        names(m.path("d")).is_empty(),
        "deleted lower contents stay hidden"
    );
    fs::remove_file(m.path("f")).unwrap();
    assert!(!m.path("f").exists(), "lower file stays deleted");
}

#[test]
fn special_files_can_be_made() {
    let m = Mount::with(|_| {});
    sh(&format!(
        "mkfifo {0}/fifo && mknod {0}/chr c 1 3 && mknod {0}/blk b 7 0",
        m.mnt.display()
    ));
    let sock = std::os::unix::net::UnixListener::bind(m.path("sock")).unwrap();
    assert!(
        fs::symlink_metadata(m.path("fifo"))
            .unwrap()
            .file_type()
            .is_fifo()
    );
    let chr = fs::symlink_metadata(m.path("chr")).unwrap();
    assert!(chr.file_type().is_char_device());
    assert_eq!(chr.rdev(), libc::makedev(1, 3));
    assert!(
        fs::symlink_metadata(m.path("blk"))
            .unwrap()
            .file_type()
            .is_block_device()
    );
    assert!(
        fs::symlink_metadata(m.path("sock"))
            .unwrap()
            .file_type()
            .is_socket()
    );
    drop(sock);
}

#[test]
fn a_char_device_0_0_made_through_the_mount_is_a_device_not_a_whiteout() {
    let mut m = Mount::with(|_| {});
    rustix::fs::mknodat(
        rustix::fs::CWD,
        m.path("null0"),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let check = |m: &Mount| {
        let md = fs::symlink_metadata(m.path("null0")).unwrap();
        assert!(md.file_type().is_char_device());
        assert_eq!(md.rdev(), 0);
        assert_eq!(names(&m.mnt), ["null0"]);
    };
    check(&m);
    m.remount();
    check(&m);
    fs::remove_file(m.path("null0")).unwrap();
    assert!(names(&m.mnt).is_empty());
}

#[test]
fn symlinks_and_hard_links() {
    let m = Mount::with(|l| write(l.join("target"), "t"));
    std::os::unix::fs::symlink("target", m.path("link")).unwrap();
    assert_eq!(fs::read_link(m.path("link")).unwrap(), Path::new("target"));
    assert_eq!(fs::read_to_string(m.path("link")).unwrap(), "t");
    fs::hard_link(m.path("target"), m.path("hard")).unwrap();
    let (a, b) = (
        fs::metadata(m.path("target")).unwrap(),
        fs::metadata(m.path("hard")).unwrap(),
    );
    assert_eq!(a.ino(), b.ino());
    assert_eq!(a.nlink(), 2);
    fs::write(m.path("hard"), "changed").unwrap();
    assert_eq!(fs::read_to_string(m.path("target")).unwrap(), "changed");
}

#[test]
fn copy_up_of_a_lower_hard_link_keeps_every_name_one_file() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("o/orig"), "x");
    fs::create_dir_all(m.lower(0).join("usr/lib")).unwrap();
    fs::create_dir_all(m.lower(0).join("usr/share")).unwrap();
    fs::hard_link(m.lower(0).join("o/orig"), m.lower(0).join("usr/lib/link")).unwrap();
    fs::hard_link(m.lower(0).join("o/orig"), m.lower(0).join("usr/share/l3")).unwrap();
    fs::set_permissions(m.lower(0).join("o/orig"), fs::Permissions::from_mode(0o664)).unwrap();
    m.mount();
    // Every name is known to the kernel as one inode before the change (as after `ls -R`).
    for d in ["o", "usr/lib", "usr/share"] {
        names(m.path(d));
    }
    let ino = fs::metadata(m.path("o/orig")).unwrap().ino();
    fs::set_permissions(m.path("usr/lib/link"), fs::Permissions::from_mode(0o644)).unwrap();
    m.unmount();
    if disk_upper() {
        let upper_ino = fs::metadata(m.upper.join("usr/lib/link")).unwrap().ino();
        for name in ["o/orig", "usr/lib/link", "usr/share/l3"] {
            let meta = fs::metadata(m.upper.join(name)).unwrap();
            assert_eq!(
                (meta.ino(), meta.mode() & 0o777),
                (upper_ino, 0o644),
                "{name} in upper"
            );
        }
    }
    m.mount();
    for name in ["o/orig", "usr/lib/link", "usr/share/l3"] {
        let meta = fs::metadata(m.path(name)).unwrap();
        assert_eq!(
            (meta.ino(), meta.mode() & 0o777),
            (ino, 0o644),
            "{name} merged"
        );
    }
    assert_eq!(fs::read_to_string(m.path("usr/share/l3")).unwrap(), "x");
}

#[test]
fn lower_hard_link_seen_after_remount_joins_its_copied_up_name() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("a"), "data");
    fs::hard_link(m.lower(0).join("a"), m.lower(0).join("b")).unwrap();
    m.mount();
    // Only `a` is looked up, so only `a` is copied up.
    fs::set_permissions(m.path("a"), fs::Permissions::from_mode(0o600)).unwrap();
    m.unmount();
    assert!(!disk_upper() || m.upper.join("a").exists() && !m.upper.join("b").exists());
    m.mount();
    // `b` first (a lower file), then `a` (its copy-up, same inode number): `b` joins `a`.
    assert_eq!(fs::metadata(m.path("b")).unwrap().mode() & 0o777, 0o644);
    assert_eq!(fs::metadata(m.path("a")).unwrap().mode() & 0o777, 0o600);
    fs::write(m.path("b"), "changed").unwrap();
    m.unmount();
    m.mount();
    for name in ["a", "b"] {
        assert_eq!(
            fs::read_to_string(m.path(name)).unwrap(),
            "changed",
            "{name}"
        );
        assert_eq!(
            fs::metadata(m.path(name)).unwrap().mode() & 0o777,
            0o600,
            "{name}"
        );
    }
}

#[test]
fn merged_directory_link_count_is_two_plus_its_subdirectories() {
    let mut m = Mount::new(2);
    for d in ["p/s1", "p/s2"] {
        fs::create_dir_all(m.lower(1).join(d)).unwrap();
    }
    fs::create_dir_all(m.lower(0).join("p/s3")).unwrap();
    write(m.lower(0).join("p/file"), "f");
    m.mount();
    let nlink = |m: &Mount| fs::metadata(m.path("p")).unwrap().nlink();
    assert_eq!(nlink(&m), 5, "s1, s2 from one layer, s3 from another");
    fs::create_dir(m.path("p/new")).unwrap();
    assert_eq!(nlink(&m), 6, "after mkdir");
    fs::remove_dir(m.path("p/s1")).unwrap();
    assert_eq!(nlink(&m), 5, "after rmdir of a lower subdirectory");
    fs::rename(m.path("p/s2"), m.path("moved")).unwrap();
    assert_eq!(nlink(&m), 4, "after moving one out");
    fs::rename(m.path("moved"), m.path("p/back")).unwrap();
    assert_eq!(nlink(&m), 5, "after moving it back");
    fs::remove_file(m.path("p/file")).unwrap();
    assert_eq!(nlink(&m), 5, "files do not count");
    m.remount();
    assert_eq!(nlink(&m), 5, "after remount");
    m.unmount();
    m.extra = vec!["static_nlink".into()];
    m.mount();
    assert_eq!(nlink(&m), 1, "static_nlink");
}

#[test]
fn rmdir_judges_emptiness_on_the_merged_view() {
    let m = Mount::with(|l| write(l.join("d/f"), "x"));
    assert_eq!(errno_of(fs::remove_dir(m.path("d"))), libc::ENOTEMPTY);
    fs::remove_file(m.path("d/f")).unwrap();
    fs::remove_dir(m.path("d")).unwrap();
    assert!(!m.path("d").exists());
    assert_eq!(errno_of(fs::remove_dir(m.path("nope"))), libc::ENOENT);
}

#[test]
fn renaming_a_lower_directory_keeps_its_contents_across_remount() {
    let mut m = Mount::with(|l| {
        write(l.join("a/b/c"), "deep");
        write(l.join("a/x"), "x");
    });
    fs::rename(m.path("a"), m.path("z")).unwrap();
    assert!(!m.path("a").exists());
    assert_eq!(fs::read_to_string(m.path("z/b/c")).unwrap(), "deep");
    fs::rename(m.path("z/b"), m.path("b2")).unwrap();
    assert_eq!(fs::read_to_string(m.path("b2/c")).unwrap(), "deep");
    fs::remove_file(m.path("z/x")).unwrap();
    m.remount();
    assert_eq!(names(&m.mnt), ["b2", "z"]);
    assert!(names(m.path("z")).is_empty());
    assert_eq!(fs::read_to_string(m.path("b2/c")).unwrap(), "deep");
}

/// `redirect_dir=off` (fuse-overlayfs' only behaviour, kernel overlayfs' default on many
/// distributions): a directory with lower parts cannot move (EXDEV, nothing changed; `mv`
/// copies the tree), while new directories and files move as ever and redirects made before
/// are still followed. `nofollow` stops following them: the renamed directory shows its upper
/// part only. Unknown values are refused.
#[test]
fn redirect_dir_off_refuses_to_move_lower_directories_and_nofollow_ignores_redirects() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("a/b/c"), "deep");
    write(m.lower(0).join("moved/x"), "x");
    m.mount();
    fs::rename(m.path("moved"), m.path("renamed")).unwrap();
    write(m.path("renamed/new"), "upper");
    m.unmount();

    m.mount_with(&format!("{},redirect_dir=off", m.options()));
    assert_eq!(errno_of(fs::rename(m.path("a"), m.path("z"))), libc::EXDEV);
    assert_eq!(
        errno_of(fs::rename(m.path("a/b"), m.path("a/b2"))),
        libc::EXDEV
    );
    assert_eq!(names(&m.mnt), ["a", "renamed"]);
    assert_eq!(fs::read_to_string(m.path("a/b/c")).unwrap(), "deep");
    fs::create_dir(m.path("fresh")).unwrap();
    fs::rename(m.path("fresh"), m.path("fresh2")).unwrap();
    fs::rename(m.path("a/b/c"), m.path("c")).unwrap();
    assert_eq!(fs::read_to_string(m.path("c")).unwrap(), "deep");
    // Made before, under the default: still followed.
    assert_eq!(fs::read_to_string(m.path("renamed/x")).unwrap(), "x");
    m.unmount();

    m.mount_with(&format!("{},redirect_dir=nofollow", m.options()));
    assert_eq!(names(m.path("renamed")), ["new"]);
    m.unmount();

    let bad = m.refused(&format!("{},redirect_dir=maybe", m.options()));
    assert!(
        bad.contains("redirect_dir' takes on, follow, off or nofollow"),
        "{bad}"
    );
    let bad = m.refused(&format!(
        "{},redirect_dir=nofollow,metacopy=on",
        m.options()
    ));
    assert!(bad.contains("redirect_dir=nofollow"), "{bad}");
}

#[test]
fn rename_replaces_files_and_empty_directories() {
    let m = Mount::with(|l| {
        write(l.join("src"), "s");
        write(l.join("dst"), "d");
        fs::create_dir_all(l.join("emptydir")).unwrap();
        write(l.join("full/f"), "f");
    });
    fs::rename(m.path("src"), m.path("dst")).unwrap();
    assert_eq!(fs::read_to_string(m.path("dst")).unwrap(), "s");
    assert!(!m.path("src").exists());
    fs::create_dir(m.path("newdir")).unwrap();
    fs::rename(m.path("newdir"), m.path("emptydir")).unwrap();
    assert!(m.path("emptydir").is_dir());
    assert_eq!(
        errno_of(fs::rename(m.path("emptydir"), m.path("full"))),
        libc::ENOTEMPTY
    );
    assert_eq!(
        errno_of(fs::rename(m.path("dst"), m.path("full"))),
        libc::EISDIR
    );
    assert_eq!(
        errno_of(fs::rename(m.path("full"), m.path("dst"))),
        libc::ENOTDIR
    );
}

fn renameat2(from: &Path, to: &Path, flags: rustix::fs::RenameFlags) -> std::io::Result<()> {
    rustix::fs::renameat_with(rustix::fs::CWD, from, rustix::fs::CWD, to, flags).map_err(Into::into)
}

/// A lower layer holding `d/f`, `d/sub/g` and `x/xf`.
fn renames_base(l: &Path) {
    write(l.join("d/f"), "f");
    write(l.join("d/sub/g"), "g");
    write(l.join("x/xf"), "xf");
}

/// Renames in the same directory and to another one, nested: what makes redirects.
fn rename_around(mnt: &Path) {
    fs::rename(mnt.join("d"), mnt.join("e")).unwrap();
    fs::rename(mnt.join("e/sub"), mnt.join("e/sub2")).unwrap();
    fs::create_dir(mnt.join("y")).unwrap();
    fs::rename(mnt.join("x"), mnt.join("y/x2")).unwrap();
    write(mnt.join("e/new"), "new");
}

#[test]
fn an_upper_layer_with_renamed_directories_reads_the_same_when_stacked_as_a_lower_one() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // containers/storage stacks each container's layer under the next image's.
    let mut first = Mount::new(1);
    renames_base(first.lower(0));
    first.mount();
    rename_around(&first.mnt);
    let seen = tree(&first.mnt);
    first.unmount();
    let mut second = Mount::new(2);
    second.lowers = vec![first.upper.clone(), first.lower(0).to_path_buf()];
    second.mount();
    assert_eq!(tree(&second.mnt), seen);
    // And renamed once more on top, across a remount.
    fs::rename(second.path("e"), second.path("z")).unwrap();
    second.remount();
    let mut moved: Vec<_> = seen
        .iter()
        .map(|(p, c)| match p.strip_prefix('e') {
            Some(rest) => (format!("z{rest}"), c.clone()),
            None => (p.clone(), c.clone()),
        })
        .collect();
    moved.sort();
    assert_eq!(tree(&second.mnt), moved);
}

#[test]
fn redirects_written_by_kernel_overlayfs_are_followed() {
    let d = tempfile::tempdir_in("/tmp").unwrap();
    let (l, u, w, k) = (
        d.path().join("l"),
        d.path().join("u"),
        d.path().join("w"),
        d.path().join("k"),
    );
    for p in [&u, &w, &k] {
        fs::create_dir(p).unwrap();
    }
    renames_base(&l);
    let opts = format!(
        "lowerdir={},upperdir={},workdir={},redirect_dir=on",
        l.display(),
        u.display(),
        w.display()
    );
    run(Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o", &opts])
        .arg(&k));
    rename_around(&k);
    let seen = tree(&k);
    run(Command::new("umount").arg(&k));
    // Relative ("d", "sub") and absolute ("/x") redirects, as kernel overlayfs wrote them.
    assert_eq!(
        get_xattr(&u.join("e"), "trusted.overlay.redirect").unwrap(),
        b"d"
    );
    assert_eq!(
        get_xattr(&u.join("y/x2"), "trusted.overlay.redirect").unwrap(),
        b"/x"
    );
    let mut m = Mount::new(2);
    m.lowers = vec![u.clone(), l.clone()];
    m.mount();
    assert_eq!(tree(&m.mnt), seen);
    m.unmount();
    // Kernel overlayfs' redirects in the user namespace (`userxattr`, rootless) too.
    for (dir, key) in [
        ("e", "redirect"),
        ("e/sub2", "redirect"),
        ("y/x2", "redirect"),
    ] {
        let v = get_xattr(&u.join(dir), &format!("trusted.overlay.{key}")).unwrap();
        rustix::fs::lremovexattr(u.join(dir), format!("trusted.overlay.{key}").as_str()).unwrap();
        set_xattr(&u.join(dir), &format!("user.overlay.{key}"), &v);
    }
    m.mount();
    assert_eq!(tree(&m.mnt), seen);
}

#[test]
fn rename_whiteout_leaves_a_device_at_the_old_name() {
    // What kernel overlayfs nested on mosaicfs does for every rename and removal it makes.
    let mut m = Mount::with(|l| {
        write(l.join("f"), "lower f");
        write(l.join("d/in"), "in");
    });
    renameat2(
        &m.path("f"),
        &m.path("g"),
        rustix::fs::RenameFlags::WHITEOUT,
    )
    .unwrap();
    renameat2(
        &m.path("d"),
        &m.path("e"),
        rustix::fs::RenameFlags::WHITEOUT,
    )
    .unwrap();
    let check = |m: &Mount| {
        assert_eq!(fs::read_to_string(m.path("g")).unwrap(), "lower f");
        assert_eq!(names(m.path("e")), ["in"]);
        for old in ["f", "d"] {
            let md = fs::symlink_metadata(m.path(old)).unwrap();
            assert!(
                md.file_type().is_char_device() && md.rdev() == 0,
                "{old}: {md:?}"
            );
        }
        assert_eq!(names(&m.mnt), ["d", "e", "f", "g"]);
    };
    check(&m);
    m.remount();
    check(&m);
    // The device is a real one of the merged view: it can go, and the lower file stays hidden.
    fs::remove_file(m.path("f")).unwrap();
    assert!(!m.path("f").exists());
}

#[test]
fn a_rename_over_a_directory_that_fails_changes_neither_name() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // The target holds whiteouts in the upper layer; one of them cannot be removed (immutable,
    // as a hostile or damaged layer may have it). Removing them in place before the rename
    // brought lower entries back for good when the rename then failed.
    let mut m = Mount::new(1);
    for i in 0..8 {
        write(m.lower(0).join(format!("t/w{i}")), "lower");
    }
    fs::create_dir(m.upper.join("t")).unwrap();
    for i in 0..8 {
        write(m.upper.join(format!("t/.wh.w{i}")), "");
    }
    let last = fs::read_dir(m.upper.join("t"))
        .unwrap()
        .last()
        .unwrap()
        .unwrap()
        .path();
    if !std::process::Command::new("chattr")
        .arg("+i")
        .arg(&last)
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("chattr +i does not work here: skipped");
        return;
    }
    m.mount();
    fs::create_dir(m.path("s")).unwrap();
    write(m.path("s/new"), "new");
    assert!(names(m.path("t")).is_empty());
    let r = fs::rename(m.path("s"), m.path("t"));
    let list = |p: &Path| p.exists().then(|| names(p));
    let (src, dst) = (list(&m.path("s")), list(&m.path("t")));
    m.unmount();
    sh(&format!("chattr -R -i {}", m.dir.path().display()));
    let new = Some(vec!["new".to_string()]);
    match r {
        Ok(()) => assert_eq!((src, dst), (None, new)),
        Err(e) => assert_eq!((src, dst), (new, Some(vec![])), "{e}"),
    }
}

#[test]
fn rename_noreplace_and_exchange() {
    let m = Mount::with(|l| {
        write(l.join("a"), "A");
        write(l.join("b"), "B");
        write(l.join("d/in"), "in");
    });
    assert_eq!(
        errno_of(renameat2(
            &m.path("a"),
            &m.path("b"),
            rustix::fs::RenameFlags::NOREPLACE
        )),
        libc::EEXIST
    );
    renameat2(
        &m.path("a"),
        &m.path("c"),
        rustix::fs::RenameFlags::NOREPLACE,
    )
    .unwrap();
    renameat2(
        &m.path("c"),
        &m.path("b"),
        rustix::fs::RenameFlags::EXCHANGE,
    )
    .unwrap();
    assert_eq!(fs::read_to_string(m.path("b")).unwrap(), "A");
    assert_eq!(fs::read_to_string(m.path("c")).unwrap(), "B");
    renameat2(
        &m.path("d"),
        &m.path("c"),
        rustix::fs::RenameFlags::EXCHANGE,
    )
    .unwrap();
    assert_eq!(fs::read_to_string(m.path("c/in")).unwrap(), "in");
    assert_eq!(fs::read_to_string(m.path("d")).unwrap(), "B");
}

#[test]
fn rename_noreplace_onto_a_removed_lower_name() {
    // The removed names are whiteouts in the upper layer: nothing there to the merged view, so
    // RENAME_NOREPLACE moves onto them (it gave EEXIST, the whiteout's).
    let mut m = Mount::with(|l| {
        write(l.join("a"), "A");
        write(l.join("b"), "B");
        write(l.join("d/in"), "in");
        write(l.join("e/in"), "e");
    });
    fs::remove_file(m.path("b")).unwrap();
    fs::remove_dir_all(m.path("e")).unwrap();
    let noreplace = rustix::fs::RenameFlags::NOREPLACE;
    renameat2(&m.path("a"), &m.path("b"), noreplace).unwrap();
    renameat2(&m.path("d"), &m.path("e"), noreplace).unwrap();
    write(m.path("new"), "N");
    fs::remove_file(m.path("b")).unwrap();
    renameat2(&m.path("new"), &m.path("b"), noreplace).unwrap();
    let check = |m: &Mount| {
        assert_eq!(names(&m.mnt), ["b", "e"]);
        assert_eq!(fs::read_to_string(m.path("b")).unwrap(), "N");
        assert_eq!(names(m.path("e")), ["in"]);
        assert_eq!(fs::read_to_string(m.path("e/in")).unwrap(), "in");
    };
    check(&m);
    assert_eq!(
        errno_of(renameat2(&m.path("e"), &m.path("b"), noreplace)),
        libc::EEXIST,
        "an existing name still refuses"
    );
    m.remount();
    check(&m);
}

#[test]
fn setattr_changes_mode_owner_times_and_size() {
    let m = Mount::with(|l| write(l.join("f"), "0123456789"));
    let f = m.path("f");
    fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(&f, Some(1234), Some(5678)).unwrap();
    let t = std::time::UNIX_EPOCH + std::time::Duration::new(1_000_000_000, 5);
    fs::File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_times(fs::FileTimes::new().set_modified(t).set_accessed(t))
        .unwrap();
    let md = fs::metadata(&f).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o640);
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_000_000_000, 5));
    fs::File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(4)
        .unwrap();
    assert_eq!(fs::read_to_string(&f).unwrap(), "0123");
    assert_eq!(
        fs::read_to_string(m.lower(0).join("f")).unwrap(),
        "0123456789"
    );
}

#[test]
fn xattrs_round_trip_and_internal_ones_are_hidden() {
    let m = Mount::with(|l| write(l.join("f"), "x"));
    let f = m.path("f");
    set_xattr(&f, "user.test", b"value");
    assert_eq!(get_xattr(&f, "user.test").unwrap(), b"value");
    let names = list_xattr(&f);
    assert!(names.contains(&"user.test".to_string()));
    assert!(
        names
            .iter()
            .all(|n| !n.contains("mosaicfs") && !n.contains("overlay")),
        "{names:?}"
    );
    assert!(get_xattr(&f, "trusted.mosaicfs.partial").is_none());
    rustix::fs::lremovexattr(&f, "user.test").unwrap();
    assert!(get_xattr(&f, "user.test").is_none());
}

#[test]
fn a_nested_overlays_xattrs_are_stored_escaped_and_mean_nothing_to_this_one() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), "data");
    write(m.lower(0).join("d/x"), "x");
    // As kernel overlayfs (6.7+) writes an overlay nested on top of it into a layer.
    set_xattr(
        &m.lower(0).join("f"),
        "trusted.overlay.overlay.origin",
        b"o",
    );
    m.mount();
    let f = m.path("f");
    assert_eq!(get_xattr(&f, "trusted.overlay.origin").unwrap(), b"o");
    assert_eq!(list_xattr(&f), ["trusted.overlay.origin"]);
    // What a nested overlayfs, fuse-overlayfs or mosaicfs sets on the files of its layers.
    let d = m.path("d");
    let nested = [
        "trusted.overlay.opaque",
        "user.overlay.opaque",
        "user.fuseoverlayfs.opaque",
        "trusted.mosaicfs.redirect",
        "user.mosaicfs.partial",
    ];
    for n in nested {
        set_xattr(&d, n, b"y");
    }
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
    set_xattr(&f, "trusted.mosaicfs.partial", b"not a mark of this mount");
    let check = |m: &Mount| {
        let d = m.path("d");
        for n in nested {
            assert_eq!(get_xattr(&d, n).as_deref(), Some(&b"y"[..]), "{n}");
        }
        let mut listed = list_xattr(&d);
        listed.sort();
        let mut want = nested.map(String::from).to_vec();
        want.sort();
        assert_eq!(listed, want);
        // Not opaque, not redirected, not partial for this overlay.
        assert_eq!(names(&d), ["x"]);
        assert_eq!(fs::read_to_string(m.path("f")).unwrap(), "data");
        assert_eq!(
            get_xattr(&m.path("f"), "trusted.overlay.origin").unwrap(),
            b"o"
        );
    };
    check(&m);
    if !disk_upper() {
        m.unmount();
        m.mount();
        check(&m);
        return;
    }
    let up = m.upper.join("d");
    assert_eq!(
        get_xattr(&up, "trusted.overlay.overlay.opaque").unwrap(),
        b"y"
    );
    assert_eq!(
        get_xattr(&up, "user.mosaicfs.mosaicfs.partial").unwrap(),
        b"y"
    );
    assert!(get_xattr(&up, "trusted.overlay.opaque").is_none());
    // Copy-up kept the lower file's escaped name.
    assert_eq!(
        get_xattr(&m.upper.join("f"), "trusted.overlay.overlay.origin").unwrap(),
        b"o"
    );
    m.unmount();
    m.mount();
    check(&m);
    rustix::fs::lremovexattr(m.path("d"), "trusted.overlay.opaque").unwrap();
    assert!(get_xattr(&m.path("d"), "trusted.overlay.opaque").is_none());
    assert!(get_xattr(&up, "trusted.overlay.overlay.opaque").is_none());
}

#[test]
fn posix_acls_are_stored_and_enforced() {
    let m = Mount::with(|l| write(l.join("f"), "secret"));
    sh(&format!(
        "chmod 600 {0}/f && setfacl -m u:4321:r {0}/f",
        m.mnt.display()
    ));
    let acl = sh(&format!("getfacl -c {}/f", m.mnt.display()));
    assert!(acl.contains("user:4321:r"), "{acl}");
    let out = std::process::Command::new("cat")
        .arg(m.path("f"))
        .uid(4321)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ACL grants read: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new("cat")
        .arg(m.path("f"))
        .uid(4322)
        .output()
        .unwrap();
    assert!(!out.status.success(), "no ACL entry, mode 600: denied");
}

/// generic/375: an owner who is not in the object's group (and lacks CAP_FSETID) setting an
/// access ACL loses the set-group-ID bit, as chmod would take it; a group member keeps it. The
/// daemon sets ACLs with credentials that keep it, so the kernel's word (FUSE_SETXATTR_EXT's
/// kill-sgid flag) decides.
#[test]
fn setting_an_acl_clears_set_group_id_for_an_owner_outside_the_group() {
    use std::os::unix::process::CommandExt;
    let m = Mount::with(|l| {
        write(l.join("lower"), "x");
        fs::create_dir(l.join("dir")).unwrap();
    });
    write(m.path("new"), "x");
    for name in ["new", "lower", "dir"] {
        let p = m.path(name);
        std::os::unix::fs::chown(&p, Some(100), Some(100)).unwrap();
        for (gid, keeps) in [(100, true), (101, false)] {
            fs::set_permissions(&p, fs::Permissions::from_mode(0o2755)).unwrap();
            let out = std::process::Command::new("setfacl")
                .args(["-m", "u::rwx,g::rwx,o::rwx"])
                .arg(&p)
                .uid(100)
                .gid(gid)
                .output()
                .unwrap();
            assert!(out.status.success(), "{name}: {out:?}");
            let mode = mode_shown(&p);
            let want = if keeps { 0o2777 } else { 0o777 };
            assert_eq!(mode, want, "{name}, caller's group {gid}: mode {mode:o}");
        }
    }
}

/// generic/319: in a directory with a default ACL, the ACL decides a new object's group bits
/// and the umask plays no part, also for a name that held a lower file (built in the work dir,
/// away from the ACL), as on kernel overlayfs. Without a default ACL the umask applies.
#[test]
fn a_default_acl_decides_new_objects_modes_not_the_umask() {
    let m = Mount::with(|l| {
        fs::create_dir_all(l.join("acl")).unwrap();
        write(l.join("acl/was_file"), b"");
        fs::create_dir(l.join("acl/was_dir")).unwrap();
    });
    let d = m.path("acl");
    sh(&format!(
        "setfacl -d -m u::rwx,g::rwx,o::- {0} && cd {0} && umask 022 && \
         rm -r was_file was_dir && mkdir sub was_dir && touch file was_file && mkfifo fifo && \
         mkdir ../plain && touch ../plainf",
        d.display()
    ));
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &str| {
        fs::symlink_metadata(m.path(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    for (p, want) in [
        ("acl/sub", 0o770),
        ("acl/was_dir", 0o770),
        ("acl/file", 0o660),
        ("acl/was_file", 0o660),
        ("acl/fifo", 0o660),
        ("plain", 0o755),
        ("plainf", 0o644),
    ] {
        assert_eq!(mode(p), want, "{p}: {:o}", mode(p));
    }
    for dir in ["acl/sub", "acl/was_dir"] {
        let acl = sh(&format!("getfacl -c {}", m.path(dir).display()));
        assert!(
            acl.contains("default:group::rwx"),
            "{dir} inherits the default: {acl}"
        );
    }
}

/// generic/003: `noatime`, `relatime` (the default) and `strictatime` decide whether reading a
/// file through the mount changes its access time, as on a native mount — also for reads the
/// kernel serves by passthrough from the layer file the daemon opened.
#[test]
fn atime_options_decide_what_a_read_changes() {
    use std::time::{Duration, SystemTime};
    let now = SystemTime::now();
    let long_ago = SystemTime::UNIX_EPOCH + Duration::from_secs(946_684_800);
    let set = |p: &std::path::Path, atime: SystemTime, mtime: SystemTime| {
        let times = fs::FileTimes::new().set_accessed(atime).set_modified(mtime);
        fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_times(times)
            .unwrap();
    };
    // (option, is "old" updated, is "recent" updated): "old" was read long ago, "recent" after
    // its last change (a minute ahead: setting the times makes the ctime now, and relatime
    // updates an atime not newer than the ctime).
    for (option, old_moves, recent_moves) in [
        ("", true, false),
        ("noatime", false, false),
        ("strictatime", true, true),
    ] {
        let mut m = Mount::new(1);
        if !option.is_empty() {
            m.extra.push(option.into());
        }
        for dir in [m.lower(0).to_path_buf(), m.upper.clone()] {
            for (name, atime) in [("old", long_ago), ("recent", now + Duration::from_secs(60))] {
                let p = dir.join(format!(
                    "{name}-{}",
                    dir.file_name().unwrap().to_str().unwrap()
                ));
                write(&p, b"data");
                set(&p, atime, now - Duration::from_secs(120));
            }
        }
        if !disk_upper() {
            // The memory store keeps its own files: only the lower layer is checked.
            for e in fs::read_dir(&m.upper).unwrap() {
                fs::remove_file(e.unwrap().path()).unwrap();
            }
        }
        m.mount();
        for e in fs::read_dir(&m.mnt).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            let layer = if name.ends_with("lower0") {
                m.lower(0)
            } else {
                &m.upper
            };
            let before = fs::metadata(layer.join(&name)).unwrap().accessed().unwrap();
            let _ = fs::read(m.path(&name)).unwrap();
            let after = fs::metadata(layer.join(&name)).unwrap().accessed().unwrap();
            let moves = if name.starts_with("old") {
                old_moves
            } else {
                recent_moves
            };
            assert_eq!(
                after != before,
                moves,
                "{option}: {name} read through the mount"
            );
        }
    }
}

/// statx's birth time, or `None` when the file system reports none.
fn btime(p: &std::path::Path) -> Option<(i64, u32)> {
    let sx = rustix::fs::statx(
        rustix::fs::CWD,
        p,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::BTIME,
    )
    .unwrap();
    (sx.stx_mask & rustix::fs::StatxFlags::BTIME.bits() != 0)
        .then_some((sx.stx_btime.tv_sec, sx.stx_btime.tv_nsec))
}

/// generic/528: statx reports the birth time of the file where it lives, as kernel overlayfs
/// shows the real file's: a lower file's, a new file's in the upper layer.
#[test]
fn statx_reports_the_birth_time_of_the_layers_file() {
    let m = Mount::with(|l| {
        write(l.join("lower"), b"lower");
        fs::create_dir(l.join("dir")).unwrap();
    });
    assert!(
        btime(&m.lower(0).join("lower")).is_some(),
        "/tmp records birth times"
    );
    assert_eq!(btime(&m.path("lower")), btime(&m.lower(0).join("lower")));
    write(m.path("dir/new"), b"new");
    if disk_upper() {
        let upper = btime(&m.upper.join("dir/new"));
        assert!(upper.is_some());
        assert_eq!(
            btime(&m.path("dir/new")),
            upper,
            "a new file's is its upper file's"
        );
    }
}

use std::os::unix::process::CommandExt;

#[test]
fn new_files_belong_to_the_caller() {
    let m = Mount::with(|l| fs::create_dir(l.join("shared")).unwrap());
    fs::set_permissions(m.path("shared"), fs::Permissions::from_mode(0o777)).unwrap();
    let status = std::process::Command::new("sh")
        .args([
            "-c",
            &format!(
                "touch {0}/shared/mine && mkdir {0}/shared/dir",
                m.mnt.display()
            ),
        ])
        .uid(1000)
        .gid(1001)
        .status()
        .unwrap();
    assert!(status.success());
    for n in ["shared/mine", "shared/dir"] {
        let md = fs::metadata(m.path(n)).unwrap();
        assert_eq!((md.uid(), md.gid()), (1000, 1001), "{n}");
    }
}

#[test]
fn statfs_reports_the_upper_file_system() {
    let m = Mount::with(|_| {});
    let a = rustix::fs::statvfs(&m.mnt).unwrap();
    let b = rustix::fs::statvfs(&m.upper).unwrap();
    assert_eq!(a.f_blocks, b.f_blocks);
    assert!(a.f_namemax >= 255);
}

#[test]
fn fsync_flock_and_fcntl_locks_work() {
    let m = Mount::with(|l| write(l.join("f"), "x"));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.sync_all().unwrap();
    f.sync_data().unwrap();
    rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    let g = fs::File::open(m.path("f")).unwrap();
    assert!(rustix::fs::flock(&g, rustix::fs::FlockOperation::NonBlockingLockShared).is_err());
    rustix::fs::flock(&f, rustix::fs::FlockOperation::Unlock).unwrap();
    rustix::fs::flock(&g, rustix::fs::FlockOperation::NonBlockingLockShared).unwrap();
    let lock = libc::flock {
        l_type: libc::F_WRLCK as i16,
        l_whence: 0,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    // SAFETY: fcntl with a valid fd and a pointer to a live flock struct.
    assert_eq!(
        unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::F_SETLK, &lock) },
        0
    );
    fs::File::open(m.mnt.clone()).unwrap().sync_all().unwrap();
}

/// Maps the first `len` bytes of `f` (a file at least that long) shared and writable, stores
/// `byte` at `at` through the mapping, msyncs it when `sync`, and unmaps it.
fn write_through_map(f: &fs::File, len: usize, at: usize, byte: u8, sync: bool) {
    // SAFETY: a fresh shared mapping of `len` bytes of `f`, written inside its bounds and
    // unmapped before returning, while `f` stays open.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(f),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        *(p as *mut u8).add(at) = byte;
        if sync {
            assert_eq!(libc::msync(p, len, libc::MS_SYNC), 0);
        }
        libc::munmap(p, len);
    }
}

/// What stat(1) shows: a statx asking for `mask` only, which FUSE answers from the attributes
/// it cached (std's metadata asks for the birth time too, which always goes to the daemon and
/// would hide a stale cache).
fn statx_shown(p: &Path, mask: u32) -> libc::statx {
    let path = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statx with a NUL-terminated path and a zeroed statx buffer it fills.
    unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        assert_eq!(
            libc::statx(libc::AT_FDCWD, path.as_ptr(), 0, mask, &mut stx),
            0
        );
        stx
    }
}

#[test]
fn shared_writable_mmap_reaches_the_file() {
    let m = Mount::with(|l| write(l.join("f"), vec![b'a'; 8192]));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    write_through_map(&f, 8192, 5000, b'Z', true);
    drop(f);
    let data = fs::read(m.path("f")).unwrap();
    assert_eq!(data[5000], b'Z');
    assert_eq!(data.iter().filter(|b| **b == b'a').count(), 8191);
}

/// A write through a shared mapping shows in stat's mtime and ctime right after the writer
/// closes, as on the layer's own file system: the page fault changes the layer file's times
/// behind FUSE's back when the file passes through (xfstests generic/080, 215 saw the times
/// from before the write).
#[test]
fn a_write_through_a_shared_mapping_updates_mtime_and_ctime() {
    let m = Mount::with(|l| write(l.join("lower"), vec![b'a'; 8192]));
    write(m.path("new"), vec![b'a'; 8192]);
    let times = |p: &Path| {
        let stx = statx_shown(p, libc::STATX_MTIME | libc::STATX_CTIME);
        (
            (stx.stx_mtime.tv_sec, stx.stx_mtime.tv_nsec),
            (stx.stx_ctime.tv_sec, stx.stx_ctime.tv_nsec),
        )
    };
    for name in ["new", "lower"] {
        let p = m.path(name);
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        drop(f);
        let before = times(&p);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        write_through_map(&f, 8192, 100, b'Z', false);
        drop(f);
        let after = times(&p);
        assert!(after.0 > before.0, "{name}: mtime {before:?} -> {after:?}");
        assert!(after.1 > before.1, "{name}: ctime {before:?} -> {after:?}");
        assert_eq!(fs::read(&p).unwrap()[100], b'Z', "{name}");
    }
}

#[test]
fn inode_numbers_survive_copy_up_and_remount() {
    let mut m = Mount::with(|l| {
        write(l.join("f"), "x");
        write(l.join("d/g"), "y");
        fs::hard_link(l.join("f"), l.join("f2")).unwrap();
    });
    let ino = |p: &str, m: &Mount| fs::symlink_metadata(m.path(p)).unwrap().ino();
    let (f, d, g) = (ino("f", &m), ino("d", &m), ino("d/g", &m));
    assert_eq!(ino("f2", &m), f, "lower hard links share one inode");
    assert_eq!(fs::metadata(m.path("f")).unwrap().nlink(), 2);
    fs::set_permissions(m.path("f"), fs::Permissions::from_mode(0o600)).unwrap();
    write(m.path("d/g"), "changed");
    assert_eq!((ino("f", &m), ino("d", &m), ino("d/g", &m)), (f, d, g));
    m.remount();
    assert_eq!((ino("f", &m), ino("d", &m), ino("d/g", &m)), (f, d, g));
    write(m.path("new"), "n");
    let n = ino("new", &m);
    m.remount();
    assert_eq!(ino("new", &m), n);
    let mut all: Vec<u64> = ["f", "d", "d/g", "new", "."]
        .iter()
        .map(|p| ino(p, &m))
        .collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 5, "unique in the mount");
}

#[test]
fn open_unlinked_file_has_no_links_and_keeps_its_data() {
    let m = Mount::with(|l| write(l.join("lowerfile"), "lower"));
    write(m.path("upperfile"), "upper");
    for name in ["upperfile", "lowerfile"] {
        let mut f = fs::File::open(m.path(name)).unwrap();
        fs::remove_file(m.path(name)).unwrap();
        assert_eq!(f.metadata().unwrap().nlink(), 0, "{name}");
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert!(s == "upper" || s == "lower");
    }
}

#[test]
fn a_lower_hard_link_open_under_a_removed_name_stays_readable_after_its_other_name_is_seen() {
    let m = Mount::with(|l| {
        write(l.join("d/x"), "content");
        fs::hard_link(l.join("d/x"), l.join("d/y")).unwrap();
    });
    let f = fs::File::open(m.path("d/x")).unwrap();
    fs::remove_file(m.path("d/x")).unwrap();
    // The lookup of the other name finds the object the kernel still has open.
    assert_eq!(fs::metadata(m.path("d/y")).unwrap().nlink(), 1);
    let mut buf = [0u8; 16];
    let n = f.read_at(&mut buf, 0).expect("the open file reads on");
    assert_eq!(&buf[..n], b"content");
    assert_eq!(f.metadata().unwrap().nlink(), 1, "y is still a name of it");
}

#[test]
fn overlong_names_give_enametoolong() {
    let m = Mount::with(|_| {});
    let long = "x".repeat(256);
    assert_eq!(errno_of(fs::write(m.path(&long), "x")), libc::ENAMETOOLONG);
    assert_eq!(errno_of(fs::metadata(m.path(&long))), libc::ENAMETOOLONG);
    write(m.path(&"y".repeat(255)), "ok");
}

#[test]
fn append_and_seek_on_lower_files() {
    let m = Mount::with(|l| write(l.join("log"), "line1\n"));
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(m.path("log"))
        .unwrap();
    f.write_all(b"line2\n").unwrap();
    drop(f);
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("log"))
        .unwrap();
    f.seek(SeekFrom::Start(4)).unwrap();
    f.write_all(b"X").unwrap();
    drop(f);
    assert_eq!(fs::read_to_string(m.path("log")).unwrap(), "lineX\nline2\n");
}

#[test]
fn read_only_overlay_without_upper() {
    let mut m = Mount::new(2);
    write(m.lower(0).join("a"), "A");
    write(m.lower(1).join("b"), "B");
    let opts = format!("lowerdir={}:{}", m.lower(0).display(), m.lower(1).display());
    m.mount_with(&opts);
    assert_eq!(names(&m.mnt), ["a", "b"]);
    assert_eq!(errno_of(fs::write(m.path("c"), "x")), libc::EROFS);
    assert_eq!(
        errno_of(fs::OpenOptions::new().write(true).open(m.path("a"))),
        libc::EROFS
    );
}

#[test]
fn lower_symlinks_never_lead_outside_the_layer() {
    let m = Mount::with(|l| {
        std::os::unix::fs::symlink("/etc", l.join("escape")).unwrap();
        std::os::unix::fs::symlink("../../..", l.join("up")).unwrap();
    });
    // Through the mount, the kernel resolves symlinks in the merged view; the daemon never
    // follows them itself, so creating below them goes to the real /etc only via the kernel,
    // and a name inside the symlink is not a directory of the layer.
    assert_eq!(fs::read_link(m.path("escape")).unwrap(), Path::new("/etc"));
    assert!(
        fs::symlink_metadata(m.path("up"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(
        m.path("escape/passwd").exists(),
        "kernel follows the link to the host /etc"
    );
    assert!(!m.upper.join("etc").exists());
}

#[test]
fn uid_and_gid_mapping_shift_ids_both_ways() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), "x");
    std::os::unix::fs::chown(m.lower(0).join("f"), Some(5), Some(7)).unwrap();
    m.extra = vec![
        "uidmapping=0:100000:65536".into(),
        "gidmapping=0:200000:65536".into(),
    ];
    m.mount();
    let md = fs::metadata(m.path("f")).unwrap();
    assert_eq!(
        (md.uid(), md.gid()),
        (100005, 200007),
        "disk ids shown shifted"
    );
    std::os::unix::fs::chown(m.path("f"), Some(100001), Some(200002)).unwrap();
    if !disk_upper() {
        return;
    }
    let disk = fs::metadata(m.upper.join("f")).unwrap();
    assert_eq!((disk.uid(), disk.gid()), (1, 2), "stored unshifted");
    write(m.path("new"), "n");
    let disk = fs::metadata(m.upper.join("new")).unwrap();
    assert_eq!(
        disk.uid(),
        65534,
        "root of the host is unmapped in this mapping"
    );
}

/// An idmapped mount of `dir` at `at` whose ids are those of a user namespace mapping 0 to
/// 100000 (65536 ids): a file that is uid 5 on disk shows as 100005 there.
struct IdmappedMount {
    at: PathBuf,
    ns_holder: std::process::Child,
}

impl IdmappedMount {
    fn new(dir: &Path, at: &Path) -> IdmappedMount {
        let _forking = forking();
        let mut ns_holder = Command::new("unshare")
            .args(["--user", "--", "sleep", "600"])
            .spawn()
            .unwrap();
        let ns = format!("/proc/{}/ns/user", ns_holder.id());
        let started = std::time::Instant::now();
        while fs::read_link(&ns).ok() == fs::read_link("/proc/self/ns/user").ok() {
            assert!(
                started.elapsed().as_secs() < 10,
                "unshare made no user namespace"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for map in ["uid_map", "gid_map"] {
            fs::write(
                format!("/proc/{}/{map}", ns_holder.id()),
                "0 100000 65536\n",
            )
            .unwrap();
        }
        let userns = fs::File::open(&ns).unwrap();
        let tree = rustix::mount::open_tree(
            rustix::fs::CWD,
            dir,
            rustix::mount::OpenTreeFlags::OPEN_TREE_CLONE
                | rustix::mount::OpenTreeFlags::OPEN_TREE_CLOEXEC,
        )
        .unwrap();
        const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
        // struct mount_attr: attr_set, attr_clr, propagation, userns_fd.
        let attr: [u64; 4] = [MOUNT_ATTR_IDMAP, 0, 0, userns.as_raw_fd() as u64];
        // SAFETY: `tree` is a live descriptor, the path is an empty C string, and `attr` has
        // the layout and size of the kernel's struct mount_attr.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                attr.as_ptr(),
                std::mem::size_of_val(&attr),
            )
        };
        if r != 0 {
            let _ = ns_holder.kill();
            let _ = ns_holder.wait();
            panic!(
                "mount_setattr(MOUNT_ATTR_IDMAP): {}",
                std::io::Error::last_os_error()
            );
        }
        rustix::mount::move_mount(
            &tree,
            "",
            rustix::fs::CWD,
            at,
            rustix::mount::MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .unwrap();
        IdmappedMount {
            at: at.to_path_buf(),
            ns_holder,
        }
    }
}

impl Drop for IdmappedMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
        let _ = self.ns_holder.kill();
        let _ = self.ns_holder.wait();
    }
}

/// A lower layer on an idmapped mount (containers/storage idmaps image layers and passes
/// uidmapping= too) shows its owners as that mount shows them: uidmapping= does not shift
/// them a second time. Which layers are idmapped is asked of the kernel per layer (statmount).
#[test]
fn a_lower_layer_on_an_idmapped_mount_is_not_shifted_twice() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), "x");
    std::os::unix::fs::chown(m.lower(0).join("f"), Some(5), Some(7)).unwrap();
    let shifted = m.dir.path().join("idmapped");
    fs::create_dir(&shifted).unwrap();
    let _idmapped = IdmappedMount::new(m.lower(0), &shifted);
    let md = fs::metadata(shifted.join("f")).unwrap();
    assert_eq!((md.uid(), md.gid()), (100005, 100007), "the idmapped view");
    m.lowers = vec![shifted.clone()];
    m.extra = vec![
        "uidmapping=0:100000:65536".into(),
        "gidmapping=0:100000:65536".into(),
    ];
    m.mount();
    let md = fs::metadata(m.path("f")).unwrap();
    assert_eq!(
        (md.uid(), md.gid()),
        (100005, 100007),
        "owners of an idmapped lower layer are shown as that mount shows them"
    );
    m.unmount();
}

#[test]
fn o_tmpfile_makes_an_unnamed_file() {
    let m = Mount::with(|l| fs::create_dir(l.join("dir")).unwrap());
    let fd = rustix::fs::open(
        m.path("dir"),
        rustix::fs::OFlags::TMPFILE | rustix::fs::OFlags::RDWR,
        rustix::fs::Mode::from_raw_mode(0o640),
    )
    .expect("O_TMPFILE works on mosaicfs");
    let mut f = fs::File::from(fd);
    f.write_all_at(b"unnamed data", 0).unwrap();
    let md = f.metadata().unwrap();
    assert_eq!(md.nlink(), 0, "no name");
    assert_eq!(md.mode() & 0o777, 0o640);
    assert_eq!(md.len(), 12);
    assert!(
        names(m.path("dir")).is_empty(),
        "invisible in the directory"
    );
    assert!(
        !disk_upper() || names(m.upper.join("dir")).is_empty(),
        "nothing named in the upper layer either"
    );
    let mut back = String::new();
    std::io::Seek::seek(&mut f, SeekFrom::Start(0)).unwrap();
    f.read_to_string(&mut back).unwrap();
    assert_eq!(back, "unnamed data");
    // Metadata changes reach it through its descriptor (kernel overlayfs nested on mosaicfs
    // copies up through O_TMPFILE and sets owner, mode, times and xattrs so).
    f.set_permissions(fs::Permissions::from_mode(0o604))
        .unwrap();
    std::os::unix::fs::fchown(&f, Some(4321), Some(4322)).unwrap();
    f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1000))
        .unwrap();
    rustix::fs::fsetxattr(&f, "user.k", b"v", rustix::fs::XattrFlags::empty()).unwrap();
    let md = f.metadata().unwrap();
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid(), md.mtime()),
        (0o604, 4321, 4322, 1000)
    );
    let mut buf = [0u8; 8];
    let n = rustix::fs::fgetxattr(&f, "user.k", &mut buf[..]).unwrap();
    assert_eq!(&buf[..n], b"v");
    // linkat(2) through /proc gives it a name.
    let proc = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&f));
    rustix::fs::linkat(
        rustix::fs::CWD,
        proc.as_str(),
        rustix::fs::CWD,
        m.path("dir/named"),
        rustix::fs::AtFlags::SYMLINK_FOLLOW,
    )
    .unwrap();
    assert_eq!(
        fs::read_to_string(m.path("dir/named")).unwrap(),
        "unnamed data"
    );
    if disk_upper() {
        assert_eq!(
            fs::read_to_string(m.upper.join("dir/named")).unwrap(),
            "unnamed data"
        );
    }
    assert_eq!(get_xattr(&m.path("dir/named"), "user.k").unwrap(), b"v");
    assert_eq!(f.metadata().unwrap().nlink(), 1);
}

#[test]
fn a_file_unlinked_while_open_still_takes_metadata_changes() {
    let m = Mount::with(|l| write(l.join("f"), "lower"));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    f.write_all_at(b"L", 0).unwrap();
    fs::remove_file(m.path("f")).unwrap();
    f.set_permissions(fs::Permissions::from_mode(0o640))
        .unwrap();
    rustix::fs::fsetxattr(&f, "user.k", b"v", rustix::fs::XattrFlags::empty()).unwrap();
    assert_eq!(f.metadata().unwrap().mode() & 0o7777, 0o640);
    let mut back = String::new();
    (&f).read_to_string(&mut back).unwrap();
    assert_eq!(back, "Lower");
}

#[test]
fn a_copied_up_file_moved_into_a_new_directory_keeps_its_inode_number_in_listings() {
    let mut m = Mount::with(|l| write(l.join("f"), "x"));
    let ino = fs::metadata(m.path("f")).unwrap().ino();
    fs::create_dir(m.path("newdir")).unwrap();
    fs::rename(m.path("f"), m.path("newdir/f")).unwrap();
    let listed = |m: &Mount| {
        fs::read_dir(m.path("newdir"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .ino()
    };
    assert_eq!(fs::metadata(m.path("newdir/f")).unwrap().ino(), ino);
    assert_eq!(listed(&m), ino, "readdir d_ino agrees with stat");
    m.remount();
    assert_eq!(
        fs::metadata(m.path("newdir/f")).unwrap().ino(),
        ino,
        "after remount"
    );
    assert_eq!(listed(&m), ino);
}

#[test]
fn paths_reused_after_directory_renames_and_removals_reach_the_new_directory() {
    let mut m = Mount::with(|l| write(l.join("lowerdir/keep"), "k"));
    for round in 0..3 {
        fs::create_dir_all(m.path("a/sub")).unwrap();
        write(m.path("a/sub/one"), "1");
        fs::rename(m.path("a"), m.path(&format!("moved{round}"))).unwrap();
        fs::create_dir_all(m.path("a/sub")).unwrap();
        write(m.path("a/sub/two"), "2");
        assert_eq!(names(m.path("a/sub")), ["two"], "round {round}");
        assert_eq!(names(m.path(&format!("moved{round}/sub"))), ["one"]);
        fs::remove_dir_all(m.path("a")).unwrap();
        fs::create_dir(m.path("a")).unwrap();
        write(m.path("a/three"), "3");
        assert_eq!(names(m.path("a")), ["three"]);
        fs::remove_dir_all(m.path("a")).unwrap();
    }
    fs::rename(m.path("lowerdir"), m.path("renamed-lower")).unwrap();
    fs::create_dir(m.path("lowerdir")).unwrap();
    write(m.path("lowerdir/new"), "n");
    assert_eq!(names(m.path("lowerdir")), ["new"]);
    assert_eq!(names(m.path("renamed-lower")), ["keep"]);
    m.remount();
    assert_eq!(names(m.path("lowerdir")), ["new"]);
    assert_eq!(names(m.path("renamed-lower")), ["keep"]);
    assert_eq!(names(m.path("moved2/sub")), ["one"]);
}

/// The permission bits stat(1) shows for `%a` (`statx_shown`).
fn mode_shown(p: &Path) -> u32 {
    u32::from(statx_shown(p, libc::STATX_MODE).stx_mode) & 0o7777
}

#[test]
fn writes_by_unprivileged_users_clear_set_id_bits_and_root_writes_keep_them() {
    let m = Mount::with(|l| {
        write(l.join("byuser"), "x");
        write(l.join("byroot"), "x");
        write(l.join("trunc"), "x");
        write(l.join("otrunc"), "x");
        write(l.join("otrunc-root"), "x");
        write(l.join("falloc"), "x");
        write(l.join("falloc-root"), "x");
    });
    write(m.path("falloc-new"), "x");
    let all = [
        "byuser",
        "byroot",
        "trunc",
        "otrunc",
        "otrunc-root",
        "falloc",
        "falloc-root",
        "falloc-new",
    ];
    for f in all {
        fs::set_permissions(m.path(f), fs::Permissions::from_mode(0o6777)).unwrap();
    }
    let as_user = |cmd: &str| {
        let st = std::process::Command::new("sh")
            .args(["-c", cmd])
            .uid(1000)
            .gid(1000)
            .status()
            .unwrap();
        assert!(st.success(), "{cmd}");
    };
    as_user(&format!("echo more >> {}", m.path("byuser").display()));
    assert_eq!(mode_shown(&m.path("byuser")), 0o0777);
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(m.path("byroot"))
        .unwrap();
    f.write_all(b"root").unwrap();
    drop(f);
    assert_eq!(mode_shown(&m.path("byroot")), 0o6777, "root keeps them");
    as_user(&format!("truncate -s 0 {}", m.path("trunc").display()));
    assert_eq!(mode_shown(&m.path("trunc")), 0o0777);
    // open(O_TRUNC) truncates in the OPEN request (FUSE_ATOMIC_O_TRUNC): same rules.
    as_user(&format!("echo new > {}", m.path("otrunc").display()));
    assert_eq!(mode_shown(&m.path("otrunc")), 0o0777);
    write(m.path("otrunc-root"), "root");
    assert_eq!(
        mode_shown(&m.path("otrunc-root")),
        0o6777,
        "root keeps them"
    );
    assert_eq!(fs::read_to_string(m.path("otrunc")).unwrap(), "new\n");
    // fallocate too (xfstests generic/683): FALLOCATE carries no kill flag, the daemon decides.
    for f in ["falloc", "falloc-new"] {
        as_user(&format!("fallocate -l 8192 {}", m.path(f).display()));
        assert_eq!(mode_shown(&m.path(f)), 0o0777, "{f}");
    }
    sh(&format!(
        "fallocate -l 8192 {}",
        m.path("falloc-root").display()
    ));
    assert_eq!(
        mode_shown(&m.path("falloc-root")),
        0o6777,
        "root keeps them"
    );
    // Set-group-id without group execute goes only for a caller outside the file's group
    // (root's group here), as on a local file system.
    let cases = [
        ("sgid-out-write", 1000, "echo more >> {}", 0o0666),
        ("sgid-out-trunc", 1000, "echo new > {}", 0o0666),
        ("sgid-out-falloc", 1000, "fallocate -l 8192 {}", 0o0666),
        ("sgid-in-write", 0, "echo more >> {}", 0o2666),
        ("sgid-in-falloc", 0, "fallocate -l 8192 {}", 0o2666),
    ];
    for (f, gid, cmd, want) in cases {
        write(m.path(f), "x");
        fs::set_permissions(m.path(f), fs::Permissions::from_mode(0o2666)).unwrap();
        let st = std::process::Command::new("sh")
            .args(["-c", &cmd.replace("{}", &m.path(f).display().to_string())])
            .uid(1000)
            .gid(gid)
            .status()
            .unwrap();
        assert!(st.success(), "{f}");
        assert_eq!(mode_shown(&m.path(f)), want, "{f}");
    }
}

#[test]
fn long_listings_with_attributes_then_every_entry_still_works() {
    let m = Mount::with(|l| {
        for i in 0..1500 {
            write(l.join(format!("big/lower{i:04}")), format!("{i}"));
        }
    });
    for i in 0..1500 {
        write(m.path(&format!("big/upper{i:04}")), "u");
    }
    for round in 0..2 {
        // `ls -l`: a listing (READDIRPLUS, many replies) and a stat of every entry.
        let mut n = 0;
        for e in fs::read_dir(m.path("big")).unwrap() {
            let e = e.unwrap();
            let md = fs::symlink_metadata(e.path()).unwrap();
            assert_eq!(md.ino(), e.ino(), "round {round}: {:?}", e.file_name());
            n += 1;
        }
        assert_eq!(n, 3000);
    }
    for i in (0..1500).step_by(3) {
        fs::remove_file(m.path(&format!("big/lower{i:04}"))).unwrap();
        fs::remove_file(m.path(&format!("big/upper{i:04}"))).unwrap();
    }
    assert_eq!(names(m.path("big")).len(), 2000);
    assert_eq!(fs::read_to_string(m.path("big/lower0001")).unwrap(), "1");
}

/// A short form of bench/sustained.py's SQLite rows: a database baked into the lower layer,
/// updated through the mount with small transactions (rollback journal, then WAL), whole after
/// each phase and after a remount: completed as a file in sustained use through the daemon
/// (the default, where passthrough serves complete files), and kept a partial file throughout.
#[test]
fn a_sqlite_database_in_a_lower_layer_survives_updates_and_a_remount() {
    sqlite_updates_survive(&[], false);
    sqlite_updates_survive(&["copy_whole=0", "complete_busy=off"], true);
}

fn sqlite_updates_survive(options: &[&str], stays_partial: bool) {
    let python = |db: &Path, code: &str| {
        let prelude =
            "import sqlite3, sys\ncon = sqlite3.connect(sys.argv[1], isolation_level=None)";
        run(std::process::Command::new("python3")
            .args(["-c", &format!("{prelude}\n{code}")])
            .arg(db))
        .trim()
        .to_string()
    };
    let check = "print(con.execute('PRAGMA integrity_check').fetchone()[0], \
                 con.execute('SELECT count(*), sum(k) FROM t').fetchone())";
    let mut m = Mount::new(1);
    m.extra = opts(options);
    python(
        &m.lower(0).join("db"),
        "con.execute('PRAGMA page_size=4096')\ncon.execute('CREATE TABLE t(id INTEGER PRIMARY KEY, k INTEGER, v BLOB)')\n\
         con.execute('BEGIN')\ncon.executemany('INSERT INTO t VALUES(?,?,randomblob(300))', ((i, i) for i in range(20000)))\n\
         con.execute('CREATE INDEX tk ON t(k)')\ncon.execute('COMMIT')",
    );
    m.mount();
    let db = m.path("db");
    for mode in ["DELETE", "WAL"] {
        python(
            &db,
            &format!(
                "con.execute('PRAGMA journal_mode={mode}')\nfor i in range(300):\n    \
                 con.execute('BEGIN')\n    con.execute('UPDATE t SET k=k+1, v=randomblob(300) WHERE id=?', ((i * 7919) % 20000,))\n    \
                 con.execute('INSERT INTO t(k, v) VALUES(1, randomblob(300))')\n    con.execute('COMMIT')"
            ),
        );
    }
    // 20,000 rows plus 300 per phase; every k was 0..19999, 600 of them were incremented and
    // 600 rows with k = 1 were added.
    let want = format!("ok (20600, {})", (0..20000u64).sum::<u64>() + 1200);
    assert_eq!(python(&db, check), want);
    if !stays_partial && disk_upper() {
        // Completion runs in the background, and an unmount stops it (the file stays a valid
        // partial file): wait for it, however loaded the machine.
        let start = std::time::Instant::now();
        while get_xattr(&m.upper.join("db"), "trusted.mosaicfs.partial").is_some() {
            assert!(start.elapsed().as_secs() < 120, "never completed");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    m.remount();
    assert_eq!(python(&db, check), want);
    assert!(
        !disk_upper()
            || get_xattr(&m.upper.join("db"), "trusted.mosaicfs.partial").is_some()
                == stays_partial,
        "partial file with {options:?}"
    );
}

/// Opens (making it first with `create`) the chain `dd/dd/...` `depth` levels below `root`,
/// one name at a time: the whole path is longer than any one system call takes.
fn deep_dir(root: &Path, depth: usize, create: bool) -> std::os::fd::OwnedFd {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let mut fd = rustix::fs::open(root, flags, Mode::empty()).unwrap();
    for level in 0..depth {
        if create {
            rustix::fs::mkdirat(&fd, "dd", Mode::from_raw_mode(0o755)).unwrap();
        }
        fd = rustix::fs::openat(&fd, "dd", flags, Mode::empty())
            .unwrap_or_else(|e| panic!("level {level}: {e}"));
    }
    fd
}

fn at(dir: &std::os::fd::OwnedFd, name: &str) -> std::path::PathBuf {
    use std::os::fd::AsRawFd;
    Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name)
}

/// A write 4,000 directories below the root of a lower layer copies up every ancestor. Each
/// parent's copy-up used to run inside its child's, a stack frame per level: the worker
/// thread ran out of stack and the daemon died (ECONNABORTED) — a layer from any image could
/// take the mount down.
#[test]
fn a_write_four_thousand_directories_deep_copies_up_every_ancestor() {
    const DEPTH: usize = 4000;
    let mut m = Mount::new(1);
    let bottom = deep_dir(m.lower(0), DEPTH, true);
    write(at(&bottom, "file"), pattern(10_000, 3));
    drop(bottom);
    m.mount();
    let d = deep_dir(&m.mnt, DEPTH, false);
    write_at(at(&d, "file"), 5000, b"Y");
    let mut want = pattern(10_000, 3);
    want[5000] = b'Y';
    assert!(fs::read(at(&d, "file")).unwrap() == want);
    drop(d);
    m.remount();
    let d = deep_dir(&m.mnt, DEPTH, false);
    assert!(fs::read(at(&d, "file")).unwrap() == want, "after a remount");
    drop(d);
    m.unmount();
}

#[test]
fn trees_deeper_than_path_max_work_in_every_layer() {
    // 2,000 levels of "dd/": a 6,000-byte path below the layer root (PATH_MAX is 4,096).
    const DEPTH: usize = 2000;
    let old = pattern(100_000, 7);
    let mut m = Mount::new(1);
    let bottom = deep_dir(m.lower(0), DEPTH, true);
    write(at(&bottom, "file"), &old);
    fs::create_dir(at(&bottom, "sub")).unwrap();
    write(at(&bottom, "sub/inner"), b"inner");
    drop(bottom);
    m.mount();

    let d = deep_dir(&m.mnt, DEPTH, false);
    assert_eq!(names(at(&d, "")), ["file", "sub"]);
    // A write into the lower file copies it up; the rest still reads from below.
    write_at(at(&d, "file"), 5000, b"Y");
    write(at(&d, "new"), b"new");
    fs::rename(at(&d, "new"), at(&d, "renamed")).unwrap();
    fs::create_dir(at(&d, "made")).unwrap();
    fs::rename(at(&d, "made"), at(&d, "made2")).unwrap();
    std::os::unix::fs::symlink("target", at(&d, "link")).unwrap();
    set_xattr(&at(&d, "file"), "user.deep", b"1");
    fs::set_permissions(at(&d, "file"), fs::Permissions::from_mode(0o600)).unwrap();
    // Moving a lower directory records its old path, which may not fit in an xattr: then
    // EXDEV (as kernel overlayfs gives), so that `mv` copies; never a half-done move.
    let moved = match fs::rename(at(&d, "sub"), at(&d, "sub2")) {
        Ok(()) => "sub2",
        Err(e) => {
            assert_eq!(e.raw_os_error(), Some(libc::EXDEV), "{e}");
            "sub"
        }
    };
    drop(d);

    m.remount();
    let d = deep_dir(&m.mnt, DEPTH, false);
    let mut want = old.clone();
    want[5000] = b'Y';
    assert!(
        fs::read(at(&d, "file")).unwrap() == want,
        "deep file lost data"
    );
    assert_eq!(fs::read(at(&d, "renamed")).unwrap(), b"new");
    assert_eq!(
        fs::read(at(&d, &format!("{moved}/inner"))).unwrap(),
        b"inner"
    );
    assert_eq!(fs::read_link(at(&d, "link")).unwrap(), Path::new("target"));
    assert_eq!(
        get_xattr(&at(&d, "file"), "user.deep").as_deref(),
        Some(&b"1"[..])
    );
    let meta = fs::metadata(at(&d, "file")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    fs::remove_file(at(&d, "file")).unwrap();
    fs::remove_dir_all(at(&d, moved)).unwrap();
    let mut left = names(at(&d, ""));
    left.sort();
    assert_eq!(left, ["link", "made2", "renamed"]);
    drop(d);
    // The lower layer is as it was.
    let below = deep_dir(m.lower(0), DEPTH, false);
    assert!(fs::read(at(&below, "file")).unwrap() == old);
}

/// `lsattr` works as on fuse-overlayfs and kernel overlayfs: FS_IOC_GETFLAGS answers the flags
/// of the file or directory in the layer it lives in (before, lsattr failed with ENOTTY).
#[test]
fn lsattr_reads_the_flags_of_the_layer() {
    use rustix::fs::{IFlags, ioctl_getflags, ioctl_setflags};
    let m = Mount::with(|l| {
        fs::create_dir(l.join("d")).unwrap();
        write(l.join("d/f"), "lower");
        let f = fs::File::open(l.join("d/f")).unwrap();
        let flags = ioctl_getflags(&f).unwrap();
        ioctl_setflags(&f, flags | IFlags::NODUMP).unwrap();
    });
    let flags = |p: &Path| ioctl_getflags(fs::File::open(p).unwrap()).unwrap();
    assert!(
        flags(&m.path("d/f")).contains(IFlags::NODUMP),
        "the lower file's flag"
    );
    assert_eq!(flags(&m.path("d/f")), flags(&m.lower(0).join("d/f")));
    assert_eq!(flags(&m.path("d")), flags(&m.lower(0).join("d")));
    write(m.path("new"), "upper");
    if disk_upper() {
        assert_eq!(flags(&m.path("new")), flags(&m.upper.join("new")));
    }
    // Setting them is tests/fileattr.rs.
}

/// open(O_RDONLY | O_TRUNC) of a running program fails with ETXTBSY and truncates nothing, as
/// on a local file system. The kernel checks for a running program only after FUSE_OPEN,
/// which truncates (atomic O_TRUNC): the daemon must refuse it itself. Before, the program
/// lost its text and, when its execve was still reading it, the open even succeeded
/// (pjdfstest open::etxtbsy, now and then).
#[test]
fn a_running_program_is_not_truncated_by_an_open_that_fails() {
    use std::os::unix::fs::OpenOptionsExt;
    let mut m = Mount::new(1);
    let sleep = fs::read("/bin/sleep").unwrap();
    fs::write(m.lower(0).join("lower-prog"), &sleep).unwrap();
    fs::set_permissions(
        m.lower(0).join("lower-prog"),
        fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    m.mount();
    fs::write(m.path("made-prog"), &sleep).unwrap();
    fs::set_permissions(m.path("made-prog"), fs::Permissions::from_mode(0o755)).unwrap();
    for name in ["made-prog", "lower-prog"] {
        let prog = m.path(name);
        // A sibling test thread that forks while the program's write descriptor was open
        // holds a copy until its child execs: ETXTBSY for a moment, as on any file system.
        let mut tries = 0;
        let mut child = loop {
            match Command::new(&prog).arg("30").spawn() {
                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 100 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                r => break r.unwrap(),
            }
        };
        // Running once its executable is the program (execve has finished).
        let exe = format!("/proc/{}/exe", child.id());
        for _ in 0..500 {
            if fs::read_link(&exe).is_ok_and(|p| p == prog) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        for (what, write, truncate) in
            [("O_WRONLY", true, false), ("O_RDONLY|O_TRUNC", false, true)]
        {
            let r = fs::OpenOptions::new()
                .read(!write)
                .write(write)
                .custom_flags(if truncate { libc::O_TRUNC } else { 0 })
                .open(&prog);
            assert_eq!(errno_of(r), libc::ETXTBSY, "{name}: {what}");
        }
        assert_eq!(
            fs::read(&prog).unwrap(),
            sleep,
            "{name}: the running program was changed"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "{name}: the program died"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        // Not running any more: the same opens truncate (O_WRONLY at once; O_RDONLY once the
        // program's RELEASE, which the kernel sends after the exit, has arrived).
        let f = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&prog)
            .unwrap();
        assert_eq!(f.metadata().unwrap().len(), 0, "{name}");
        fs::write(&prog, b"x").unwrap();
        let mut tries = 0;
        let f = loop {
            match fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_TRUNC)
                .open(&prog)
            {
                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 100 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                r => break r.unwrap(),
            }
        };
        assert_eq!(f.metadata().unwrap().len(), 0, "{name}");
    }
}

/// A lookup that revalidates a directory this mount made takes what it needs from the
/// directory's node (namei.rs `known_upper_dir`) instead of reading its marks and the lower
/// layers again: with `timeout=0` each path walk revalidates every component. What the marks
/// say still holds: an opaque directory made over a removed lower one keeps hiding it.
#[test]
fn revalidating_a_known_upper_directory_reads_no_lower_layer() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("o/x"), "lower");
    m.extra.push("timeout=0".into());
    m.mount();
    fs::create_dir(m.path("d")).unwrap();
    write(m.path("d/f"), "upper");
    fs::remove_dir_all(m.path("o")).unwrap();
    fs::create_dir(m.path("o")).unwrap();
    let walks: u64 = 300;
    let trace = syscalls_during(m.pid(), || {
        for _ in 0..walks {
            assert_eq!(fs::metadata(m.path("d/f")).unwrap().len(), 5);
            assert_eq!(errno_of(fs::metadata(m.path("o/x"))), libc::ENOENT);
        }
    });
    // One failed stat per walk: "x" in the upper "o". Reading the layers again added one of
    // "d" in the lower layer per walk.
    let failed = failed_calls(&trace, "newfstatat");
    assert!(failed < walks * 3 / 2, "{failed} failed stats:\n{trace}");
    assert!(names(m.path("o")).is_empty());
    // A directory moved inside the mount is found at its new name, with its entries.
    fs::rename(m.path("d"), m.path("e")).unwrap();
    assert_eq!(fs::read_to_string(m.path("e/f")).unwrap(), "upper");
    assert_eq!(errno_of(fs::metadata(m.path("d/f"))), libc::ENOENT);
}
