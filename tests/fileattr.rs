//! Inode flags through the mount (chattr, lsattr, FS_IOC_FSGETXATTR): shown, set, kept in the
//! kernel's `overlay.protattr` format, and immutable and append-only enforced as a local file
//! system enforces them.

mod common;

use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use common::*;

/// The flags `lsattr -d` shows for `p`: the first column.
fn lsattr(p: &Path) -> String {
    let out = sh(&format!("lsattr -d '{}'", p.display()));
    out.split_whitespace().next().unwrap_or("").to_string()
}

fn chattr(flags: &str, p: &Path) {
    sh(&format!("chattr {flags} '{}'", p.display()));
}

fn eperm<T: std::fmt::Debug>(what: &str, r: std::io::Result<T>) {
    assert_eq!(errno_of(r), libc::EPERM, "{what}");
}

fn set_times(p: &Path, now: bool) -> std::io::Result<()> {
    let f = fs::File::open(p)?;
    let times = match now {
        true => fs::FileTimes::new().set_modified(std::time::SystemTime::now()),
        false => fs::FileTimes::new().set_modified(std::time::UNIX_EPOCH),
    };
    if now {
        // utimensat(UTIME_NOW): a touch.
        let name = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a C string path and a null times pointer (both times now).
        let r = unsafe { libc::utimensat(libc::AT_FDCWD, name.as_ptr(), std::ptr::null(), 0) };
        return if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        };
    }
    f.set_times(times)
}

#[test]
fn immutable_files_and_directories_refuse_every_change_until_the_flag_goes() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), "lower data");
    write(m.lower(0).join("d/inside"), "in d");
    m.mount();
    let (f, d) = (m.path("f"), m.path("d"));
    chattr("+i", &f);
    chattr("+i", &d);
    assert!(lsattr(&f).contains('i'), "{}", lsattr(&f));
    assert!(lsattr(&d).contains('i'));

    eperm(
        "open for writing",
        fs::OpenOptions::new().write(true).open(&f),
    );
    eperm("append", fs::OpenOptions::new().append(true).open(&f));
    eperm(
        "truncate",
        fs::OpenOptions::new().write(true).truncate(true).open(&f),
    );
    eperm(
        "chmod",
        fs::set_permissions(&f, fs::Permissions::from_mode(0o600)),
    );
    eperm("chown", std::os::unix::fs::chown(&f, Some(1), None));
    eperm("utimes", set_times(&f, false));
    eperm("truncate", truncate(&f));
    eperm("touch", set_times(&f, true));
    eperm("setxattr", try_set_xattr(&f, "user.x", b"1"));
    eperm("unlink", fs::remove_file(&f));
    eperm("rename", fs::rename(&f, m.path("g")));
    eperm("link", fs::hard_link(&f, m.path("g")));
    // In the directory: nothing made, removed or moved; its files stay writable.
    eperm("create in it", fs::File::create(d.join("new")));
    eperm("mkdir in it", fs::create_dir(d.join("sub")));
    eperm(
        "symlink in it",
        std::os::unix::fs::symlink("x", d.join("l")),
    );
    eperm("unlink in it", fs::remove_file(d.join("inside")));
    eperm("rename out", fs::rename(d.join("inside"), m.path("out")));
    eperm("rename in", fs::rename(&f, d.join("f")));
    eperm("rmdir", fs::remove_dir_all(&d));
    write(d.join("inside"), "rewritten");
    assert_eq!(fs::read_to_string(&f).unwrap(), "lower data");

    // Kept across a remount, in the upper object's xattr as kernel overlayfs keeps it.
    m.remount();
    eperm(
        "open for writing after a remount",
        fs::OpenOptions::new().write(true).open(&f),
    );
    if disk_upper() {
        let key = "trusted.overlay.protattr";
        assert_eq!(
            get_xattr(&m.upper.join("f"), key).as_deref(),
            Some(&b"i"[..])
        );
        assert!(
            !list_xattr(&f).iter().any(|n| n.contains("protattr")),
            "the merged view hides it"
        );
    }
    chattr("-i", &f);
    chattr("-i", &d);
    assert!(!lsattr(&f).contains('i'));
    write(&f, "writable again");
    fs::File::create(d.join("new")).unwrap();
    fs::rename(&f, d.join("f")).unwrap();
    if disk_upper() {
        let key = "trusted.overlay.protattr";
        assert_eq!(
            get_xattr(&m.upper.join("d/f"), key),
            None,
            "removed with the flag"
        );
    }
    m.unmount();
}

#[test]
fn append_only_files_take_appends_only_and_directories_keep_their_entries() {
    append_only_files_take_appends_only(&[]);
}

/// The same under the kernel's writeback cache (`writeback=auto`, nothing passing through): a
/// write to an append-only file must reach the daemon before it returns, or the daemon could
/// refuse it only when the kernel writes the page back, after the writer was told it succeeded.
#[test]
fn append_only_files_take_appends_only_under_the_writeback_cache() {
    append_only_files_take_appends_only(&["passthrough=off", "writeback=auto"]);
}

fn append_only_files_take_appends_only(options: &[&str]) {
    let mut m = Mount::new(1);
    m.extra = options.iter().map(|o| o.to_string()).collect();
    write(m.lower(0).join("log"), "one\n");
    fs::create_dir(m.lower(0).join("d")).unwrap();
    write(m.lower(0).join("d/kept"), "kept");
    m.mount();
    let (log, d) = (m.path("log"), m.path("d"));
    chattr("+a", &log);
    chattr("+a", &d);
    assert!(lsattr(&log).contains('a'));

    let mut a = fs::OpenOptions::new().append(true).open(&log).unwrap();
    a.write_all(b"two\n").unwrap();
    eperm(
        "open for writing",
        fs::OpenOptions::new().write(true).open(&log),
    );
    eperm(
        "truncate at open",
        fs::OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_TRUNC)
            .open(&log),
    );
    eperm("truncate", truncate(&log));
    eperm(
        "chmod",
        fs::set_permissions(&log, fs::Permissions::from_mode(0o600)),
    );
    eperm("utimes", set_times(&log, false));
    set_times(&log, true).expect("a touch is allowed");
    eperm("unlink", fs::remove_file(&log));
    // O_APPEND cleared by fcntl: the write is refused, as the kernel refuses the fcntl.
    // SAFETY: F_SETFL on a descriptor this test owns.
    let r = unsafe { libc::fcntl(a.as_raw_fd(), libc::F_SETFL, 0) };
    assert_eq!(r, 0);
    eperm("write without O_APPEND", a.write_all(b"three\n"));
    drop(a);
    assert_eq!(fs::read_to_string(&log).unwrap(), "one\ntwo\n");

    // Written, then made append-only while still open: under the writeback cache the kernel
    // sends the data and the times of those writes afterwards, which the flag must not refuse.
    let mut fresh = fs::File::create(m.path("fresh")).unwrap();
    fresh.write_all(b"written before the flag").unwrap();
    chattr("+a", &m.path("fresh"));
    fresh
        .sync_all()
        .expect("the writes made before the flag reach the layer");
    drop(fresh);
    set_times(&m.path("fresh"), true).expect("a touch is allowed");
    assert_eq!(
        fs::read_to_string(m.path("fresh")).unwrap(),
        "written before the flag"
    );
    chattr("-a", &m.path("fresh"));

    // The directory: new entries yes, none removed or moved out.
    write(d.join("new"), "new");
    eperm("unlink in it", fs::remove_file(d.join("kept")));
    eperm("rename out", fs::rename(d.join("new"), m.path("new")));
    m.remount();
    eperm(
        "unlink in it after a remount",
        fs::remove_file(d.join("new")),
    );
    chattr("-a", &d);
    fs::remove_file(d.join("new")).unwrap();
    m.unmount();
}

#[test]
fn flags_of_a_lower_inode_show_and_hold_and_other_flags_reach_the_upper_inode() {
    // The lower layer's own inode flags (chattr on the layer, ext4 here): shown and enforced,
    // and kept by a copy-up of its directory.
    let mut m = Mount::new(1);
    write(m.lower(0).join("d/frozen"), "frozen");
    write(m.lower(0).join("plain"), "plain");
    fs::create_dir(m.lower(0).join("ad")).unwrap();
    chattr("+i", &m.lower(0).join("d/frozen"));
    chattr("+a", &m.lower(0).join("ad"));
    let unfreeze = Unfreeze(vec![m.lower(0).join("d/frozen"), m.lower(0).join("ad")]);
    m.mount();
    assert!(lsattr(&m.path("d/frozen")).contains('i'));
    eperm(
        "write a lower immutable file",
        fs::OpenOptions::new().write(true).open(m.path("d/frozen")),
    );
    eperm("unlink it", fs::remove_file(m.path("d/frozen")));
    // Copied up by a new entry, the append-only directory stays append-only.
    write(m.path("ad/new"), "x");
    m.remount();
    eperm(
        "unlink in a copied-up append-only dir",
        fs::remove_file(m.path("ad/new")),
    );

    // Flags other than those two go to the upper inode: nodump ('d'). A memory upper keeps
    // none of them.
    if !disk_upper() {
        let st = Command::new("chattr")
            .arg("+d")
            .arg(m.path("plain"))
            .status();
        assert!(!st.unwrap().success(), "a memory upper has no inode flags");
        chattr("+i", &m.path("plain"));
        assert!(lsattr(&m.path("plain")).contains('i'));
        chattr("-i", &m.path("plain"));
    } else {
        chattr("+d", &m.path("plain"));
        assert!(lsattr(&m.path("plain")).contains('d'));
        assert!(lsattr(&m.upper.join("plain")).contains('d'));
        // Immutable and append-only never sit on the upper inode (the daemon writes it).
        chattr("+i", &m.path("plain"));
        assert!(!lsattr(&m.upper.join("plain")).contains('i'));
        // FS_IOC_FSGETXATTR (xfs_io's chattr) sees the same.
        let f = fs::File::open(m.path("plain")).unwrap();
        let mut fsx = [0u8; 28];
        // SAFETY: FS_IOC_FSGETXATTR fills one 28-byte struct fsxattr.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), 0x801c_581f, fsx.as_mut_ptr()) };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        let xflags = u32::from_ne_bytes(fsx[..4].try_into().unwrap());
        assert_eq!(xflags & 0x88, 0x88, "immutable and nodump: {xflags:#x}");
        chattr("-i", &m.path("plain"));
    }
    m.unmount();
    drop(unfreeze);
}

#[test]
fn kernel_overlayfs_enforces_the_flags_mosaicfs_kept() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    write(m.lower(0).join("a"), "a");
    m.mount();
    write(m.path("made"), "made here");
    chattr("+i", &m.path("made"));
    m.unmount();
    let ovl = m.path("");
    // Root's mounts keep trusted.* xattrs, which kernel overlayfs reads without `userxattr`.
    let kernel = format!(
        "lowerdir={},upperdir={},workdir={}",
        m.lower(0).display(),
        m.upper.display(),
        m.work.display()
    );
    run(Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o", &kernel])
        .arg(&ovl));
    let r = fs::OpenOptions::new().write(true).open(ovl.join("made"));
    let flags = lsattr(&ovl.join("made"));
    run(Command::new("umount").arg(&ovl));
    eperm("kernel overlayfs: open for writing", r);
    assert!(flags.contains('i'), "{flags}");
    m.mount();
    chattr("-i", &m.path("made"));
    m.unmount();
}

/// Clears the immutable and append-only flags of lower files when the test ends (else the
/// layers could not be removed).
struct Unfreeze(Vec<std::path::PathBuf>);

impl Drop for Unfreeze {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = Command::new("chattr").arg("-ia").arg(p).status();
        }
    }
}

/// truncate(2) by path to 0.
fn truncate(p: &Path) -> std::io::Result<()> {
    let path = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a C string path.
    match unsafe { libc::truncate(path.as_ptr(), 0) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}
