//! `xattr_permissions=1|2` (fuse-overlayfs): owners, modes and privileged xattrs of the merged
//! view kept in xattrs a rootless daemon may write, and layers that carry them read so.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::process::Command;

use common::*;

const KEY: &str = "user.containers.override_stat";
/// A VFS_CAP_REVISION_2 capability (effective, cap_net_admin permitted).
const CAP: [u8; 20] = [
    1, 0, 0, 2, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];
const OTHER_CAP: [u8; 20] = [
    1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];

fn owner(p: &std::path::Path) -> (u32, u32, u32) {
    let m = fs::symlink_metadata(p).unwrap();
    (m.uid(), m.gid(), m.mode() & 0o7777)
}

fn key_value(p: &std::path::Path) -> String {
    String::from_utf8(get_xattr(p, KEY).expect("override value")).unwrap()
}

#[test]
fn xattr_permissions_2_keeps_owners_modes_and_privileged_xattrs_in_user_xattrs() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    write(m.lower(0).join("low"), b"lower");
    fs::set_permissions(m.lower(0).join("low"), fs::Permissions::from_mode(0o644)).unwrap();
    fs::create_dir(m.lower(0).join("shared")).unwrap();
    fs::set_permissions(m.lower(0).join("shared"), fs::Permissions::from_mode(0o777)).unwrap();
    write(m.upper.join("file"), b"upper");
    fs::set_permissions(m.upper.join("file"), fs::Permissions::from_mode(0o644)).unwrap();
    set_xattr(&m.upper.join("file"), "security.capability", &CAP);
    m.extra = opts(&["xattr_permissions=2"]);
    m.mount();
    assert!(
        get_xattr(&m.upper, KEY).is_some(),
        "the upper root says how it is kept"
    );

    // The upper file's real capability is neither shown nor changed; a new one is kept apart.
    let file = m.path("file");
    assert_eq!(get_xattr(&file, "security.capability"), None);
    assert!(!list_xattr(&file).iter().any(|n| n.starts_with("security.")));
    set_xattr(&file, "security.capability", &OTHER_CAP);
    assert_eq!(
        get_xattr(&file, "security.capability").as_deref(),
        Some(&OTHER_CAP[..])
    );
    assert_eq!(
        get_xattr(&m.upper.join("file"), "security.capability").as_deref(),
        Some(&CAP[..])
    );
    assert_eq!(
        get_xattr(
            &m.upper.join("file"),
            "user.containers.override_security.capability"
        )
        .as_deref(),
        Some(&OTHER_CAP[..])
    );
    set_xattr(&file, "trusted.t", b"t");
    assert_eq!(
        get_xattr(&m.upper.join("file"), "user.containers.override_trusted.t").as_deref(),
        Some(&b"t"[..])
    );
    // The key itself, set through the mount (an overlay nested on top), is only a name.
    set_xattr(&file, KEY, b"0:0:4777:file");
    assert_eq!(owner(&file).2, 0o644, "a merged-view value changes nothing");
    assert_eq!(
        get_xattr(&file, KEY).as_deref(),
        Some(&b"0:0:4777:file"[..])
    );

    // chgrp keeps the owner, chmod keeps both; the inode keeps the daemon's.
    run(Command::new("chgrp").arg("1").arg(&file));
    assert_eq!(owner(&file), (0, 1, 0o644));
    fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(owner(&file), (0, 1, 0o600));
    assert_eq!(owner(&m.upper.join("file")), (0, 0, 0o644));
    run(Command::new("chown").arg("4000:5000").arg(&file));
    assert_eq!(owner(&file), (4000, 5000, 0o600));
    // As on a local file system, chown drops the file capability — the merged view's only.
    assert_eq!(get_xattr(&file, "security.capability"), None);
    assert_eq!(
        get_xattr(&m.upper.join("file"), "security.capability").as_deref(),
        Some(&CAP[..])
    );
    set_xattr(&file, "security.capability", &OTHER_CAP);

    // A lower file's copy-up carries what it showed; chown writes no inode owner.
    run(Command::new("chown").arg("1000:1000").arg(m.path("low")));
    assert_eq!(owner(&m.path("low")), (1000, 1000, 0o644));
    assert_eq!(owner(&m.upper.join("low")).0, 0);
    assert_eq!(key_value(&m.upper.join("low")), "1000:1000:0644:file");

    // A new object is its creator's in the merged view, the daemon's on disk.
    let made = m.path("shared/made");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 022; echo x > {0}; mkdir {0}.d",
            made.display()
        ))
        .uid(1234)
        .gid(4321)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(owner(&made), (1234, 4321, 0o644));
    assert_eq!(owner(&m.path("shared/made.d")), (1234, 4321, 0o755));
    assert_eq!(owner(&m.upper.join("shared/made")).0, 0);
    // The creator, not the daemon, is who the kernel checks: another user cannot write it.
    let denied = Command::new("sh")
        .arg("-c")
        .arg(format!("echo y >> {}", made.display()))
        .uid(999)
        .gid(999)
        .status()
        .unwrap();
    assert!(!denied.success());
    // A setgid directory (as the merged view shows it) gives new objects its group.
    let sgid = m.path("shared/sgid");
    fs::create_dir(&sgid).unwrap();
    run(Command::new("chgrp").arg("77").arg(&sgid));
    fs::set_permissions(&sgid, fs::Permissions::from_mode(0o2777)).unwrap();
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 022; echo x > {0}/f; mkdir {0}/d",
            sgid.display()
        ))
        .uid(1234)
        .gid(4321)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(owner(&sgid.join("f")), (1234, 77, 0o644));
    assert_eq!(owner(&sgid.join("d")), (1234, 77, 0o2755));

    m.remount();
    assert_eq!(owner(&m.path("file")), (4000, 5000, 0o600));
    assert_eq!(owner(&m.path("shared/made")), (1234, 4321, 0o644));
    assert_eq!(
        get_xattr(&m.path("file"), "security.capability").as_deref(),
        Some(&OTHER_CAP[..])
    );
    m.unmount();

    // Stacked below another mount, without the option, the layer reads the same.
    let mut top = Mount::new(1);
    fs::remove_dir(top.lower(0)).unwrap();
    std::os::unix::fs::symlink(&m.upper, top.lower(0)).unwrap();
    top.mount();
    assert_eq!(owner(&top.path("low")), (1000, 1000, 0o644));
    assert_eq!(owner(&top.path("shared/made")), (1234, 4321, 0o644));
}

#[test]
fn layers_marked_by_containers_storage_show_their_recorded_owners() {
    if !runs_on_disk_upper_only() {
        return;
    }
    // containers/storage's force_mask and fuse-overlayfs leave the key on the layer root and a
    // value on each object; a device may be kept as a regular file.
    let mut m = Mount::new(1);
    let l = m.lower(0).to_path_buf();
    set_xattr(&l, KEY, b"0:0:0755:dir");
    write(l.join("f"), b"f");
    set_xattr(&l.join("f"), KEY, b"5:6:0640:file");
    write(l.join("null"), b"");
    set_xattr(&l.join("null"), KEY, b"0:0:0666:char-1-3");
    fs::create_dir(l.join("d")).unwrap();
    set_xattr(&l.join("d"), KEY, b"7:8:0700:file");
    write(l.join("damaged"), b"");
    set_xattr(&l.join("damaged"), KEY, b"five:6:0640");
    m.mount();
    assert_eq!(owner(&m.path("f")), (5, 6, 0o640));
    let null = fs::symlink_metadata(m.path("null")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &null.file_type()
    ));
    assert_eq!(null.rdev(), libc::makedev(1, 3));
    // A value cannot change what an object is, only its owner and mode.
    let d = fs::symlink_metadata(m.path("d")).unwrap();
    assert!(d.is_dir());
    assert_eq!((d.uid(), d.gid(), d.mode() & 0o7777), (7, 8, 0o700));
    // A damaged value shows the inode's own owner, never a guess.
    assert_eq!(owner(&m.path("damaged")).0, 0);
    // Copied up to an upper layer that keeps owners on its inodes, the file keeps them.
    fs::set_permissions(m.path("f"), fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(owner(&m.path("f")), (5, 6, 0o600));
    assert_eq!(owner(&m.upper.join("f")), (5, 6, 0o600));
}
