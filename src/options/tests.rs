//! Tests of the command line and the mount options.

use super::*;

fn parse(args: &[&str]) -> std::result::Result<Options, String> {
    match parse_args(args.iter().map(OsString::from)).map_err(|e| e.to_string())? {
        Command::Mount(o) => Ok(*o),
        c => panic!("unexpected {c:?}"),
    }
}

#[test]
fn fuse_overlayfs_form_parses() {
    let o = parse(&["-o", "lowerdir=/a:/b,upperdir=/u,workdir=/w", "/mnt"]).unwrap();
    assert_eq!(o.lowerdirs, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
    assert_eq!(o.upperdir, Some("/u".into()));
    assert_eq!(o.mountpoint, PathBuf::from("/mnt"));
    assert!(!o.read_only);
}

#[test]
fn copy_after_write_is_on_off_or_always() {
    let o = |v: &str| parse(&["-o", &format!("lowerdir=/a,{v}"), "/mnt"]);
    let d = o("ro").unwrap();
    assert_eq!((d.caw_memory, d.caw_always), (Some(64 << 20), false));
    let a = o("copy_after_write=always").unwrap();
    assert_eq!((a.caw_memory, a.caw_always), (Some(64 << 20), true));
    let off = o("copy_after_write=0").unwrap();
    assert_eq!((off.caw_memory, off.caw_always), (None, false));
    let bad = o("copy_after_write=sometimes").unwrap_err();
    assert!(bad.contains("always") && bad.contains("sometimes"), "{bad}");
    // One size syntax: caw_memory takes 64M like copy_whole=4M; a bare number is MiB.
    for (v, bytes) in [
        ("64M", 64 << 20),
        ("1G", 1 << 30),
        ("512K", 512 << 10),
        ("32", 32 << 20),
    ] {
        let m = o(&format!("caw_memory={v}")).unwrap();
        assert_eq!(m.caw_memory, Some(bytes), "caw_memory={v}");
    }
    assert!(o("caw_memory=lots").is_err());
}

#[test]
fn mount_fuse_form_takes_source_first() {
    let o = parse(&["overlay", "/mnt", "-o", "lowerdir=/a"]).unwrap();
    assert_eq!(o.fsname, "overlay");
    assert!(o.read_only, "no upperdir means read-only");
}

#[test]
fn quoted_values_keep_commas() {
    let o = parse(&[
        "-o",
        "lowerdir=/a,context=\"system_u:object_r:x:s0:c1,c2\"",
        "/m",
    ])
    .unwrap();
    assert_eq!(o.warnings.len(), 1);
    assert_eq!(o.lowerdirs, vec![PathBuf::from("/a")]);
}

#[test]
fn a_double_colon_starts_the_data_only_layers() {
    let o = parse(&["-o", "lowerdir=/a:/b::/d1::/d2", "/m"]).unwrap();
    assert_eq!(o.lowerdirs, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
    assert_eq!(o.datadirs, vec![PathBuf::from("/d1"), PathBuf::from("/d2")]);
    assert!(o.follows_metacopy(), "data-only layers imply metacopy");
    let e = parse(&["-o", "lowerdir=/a::/d,metacopy=off", "/m"]).unwrap_err();
    assert!(e.contains("need metacopy"), "{e}");
    let e = parse(&["-o", "lowerdir=::/d", "/m"]).unwrap_err();
    assert!(e.contains("only data-only layers"), "{e}");
    let o = parse(&["-o", "lowerdir=/a,verity=require", "/m"]).unwrap();
    assert_eq!(o.verity, Verity::Require);
    assert!(parse(&["-o", "lowerdir=/a,verity=maybe", "/m"]).is_err());
    assert!(
        !parse(&["-o", "lowerdir=/a", "/m"])
            .unwrap()
            .follows_metacopy()
    );
}

#[test]
fn escaped_colon_stays_in_lower_path() {
    let o = parse(&["-o", r"lowerdir=/a\:b:/c", "/m"]).unwrap();
    assert_eq!(
        o.lowerdirs,
        vec![PathBuf::from("/a:b"), PathBuf::from("/c")]
    );
}

#[test]
fn a_misspelled_command_is_named_with_the_commands() {
    let e = parse(&["statsu", "/mnt/x"]).unwrap_err();
    assert!(
        e.contains("'statsu' is not a mosaicfs command (did you mean 'status'?)")
            && e.contains("fsck"),
        "{e}"
    );
    let e = parse(&["frobnicate"]).unwrap_err();
    assert!(e.contains("not a mosaicfs command. Commands:"), "{e}");
    // mount.fuse's form, source then mount point then -o, is still a mount.
    assert!(parse(&["overlay", "/mnt", "-o", "lowerdir=/a"]).is_ok());
}

#[test]
fn completion_pays_by_default_and_the_old_rules_are_choices() {
    let d = parse(&["-o", "lowerdir=/a", "/m"]).unwrap().completion;
    assert_eq!((d.after_idle, d.ratio, d.on_reopen_below), (None, 0.0, 0));
    assert_eq!((d.copy_whole(true), d.copy_whole(false)), (1 << 20, 0));
    assert!(d.when_busy(true) && !d.when_busy(false));
    let o = parse(&[
        "-o",
        "lowerdir=/a,complete_after=10,complete_busy=on,copy_whole=4M",
        "/m",
    ])
    .unwrap()
    .completion;
    assert_eq!(o.after_idle, Some(Duration::from_secs(10)));
    assert!(o.when_busy(false));
    assert_eq!(o.copy_whole(false), 4 << 20);
    let e = parse(&["-o", "lowerdir=/a,complete_busy=sometimes", "/m"]).unwrap_err();
    assert!(
        e.contains("complete_busy") && e.contains("auto, on or off"),
        "{e}"
    );
}

#[test]
fn unknown_option_is_an_error_naming_it() {
    let e = parse(&["-o", "lowerdir=/a,frobnicate", "/m"]).unwrap_err();
    assert!(e.contains("frobnicate"), "{e}");
}

#[test]
fn upper_without_work_is_an_error() {
    assert!(parse(&["-o", "lowerdir=/a,upperdir=/u", "/m"]).is_err());
}

#[test]
fn every_fuse_overlayfs_option_is_accepted() {
    let all = "lowerdir=/a,upperdir=/u,workdir=/w,uidmapping=0:100000:65536,gidmapping=0:100000:65536,\
        squash_to_root,squash_to_uid=1,squash_to_gid=1,static_nlink,noacl,xino=auto,ino32_t,\
        redirect_dir=on,context=\"x\",timeout=5,threaded=1,fsync=0,volatile,fast_ino=1,writeback=1,\
        noxattrs=0,plugins=/p,xattr_permissions=1,allow_other,default_permissions,ro,max_write=131072,\
        nosuid,nodev,noexec,noatime";
    let o = parse(&["-o", all, "/m"]).unwrap();
    assert_eq!(o.uid_map.to_inside(5), 100005, "disk id 5 shows as 100005");
    assert_eq!(o.uid_map.to_outside(100005), 5);
    assert_eq!(
        o.uid_map.to_inside(70000),
        65534,
        "unmapped ids show as the overflow id"
    );
    assert!(o.skip_fsync && o.read_only && !o.acl);
    assert_eq!(
        o.writeback,
        Switch::On,
        "fuse-overlayfs' writeback=1 asks for the cache"
    );
    assert_eq!(
        o.xattr_permissions,
        crate::stat_override::XattrPermissions::Privileged
    );
    let e = parse(&["-o", "lowerdir=/a,xattr_permissions=3", "/m"]).unwrap_err();
    assert!(e.contains("xattr_permissions=3 is not valid"), "{e}");
}

#[test]
fn containers_storage_mapping_syntax_parses() {
    let o = parse(&[
        "-o",
        "lowerdir=/a,,volatile,uidmapping=:0:100000:65536,gidmapping=:0:100000:65536",
        "/m",
    ])
    .unwrap();
    assert_eq!(o.uid_map.to_inside(0), 100000);
    assert_eq!(o.gid_map.to_outside(100001), 1);
    assert!(o.skip_fsync);
}

#[test]
fn remount_needs_no_layers() {
    match parse_args(["-o", "remount,ro", "/m"].iter().map(OsString::from)).unwrap() {
        Command::Remount(o) => assert!(o.read_only),
        c => panic!("unexpected {c:?}"),
    }
}

#[test]
fn bad_numbers_are_named() {
    let e = parse(&["-o", "lowerdir=/a,timeout=soon", "/m"]).unwrap_err();
    assert!(e.contains("timeout") && e.contains("soon"), "{e}");
    let e = parse(&["-o", "lowerdir=/a,uidmapping=0:1", "/m"]).unwrap_err();
    assert!(e.contains("uidmapping"), "{e}");
}

#[test]
fn writeback_takes_auto_on_or_off() {
    let o = parse(&["-o", "lowerdir=/a", "/m"]).unwrap();
    assert_eq!(o.writeback, Switch::Off);
    let o = parse(&["-o", "lowerdir=/a,writeback=auto", "/m"]).unwrap();
    assert_eq!(o.writeback, Switch::Auto);
    let e = parse(&["-o", "lowerdir=/a,writeback=later", "/m"]).unwrap_err();
    assert!(
        e.to_string().contains("'writeback' takes auto, on or off"),
        "{e}"
    );
}
