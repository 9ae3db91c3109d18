//! Lower layers on the stores container images live in past one machine (issue #16): EROFS
//! images (the kernel's), squashfs images through squashfuse and directories over sshfs (both
//! FUSE, so passthrough stacks twice). On each, the overlay tests that make sense for a
//! read-only lower layer: the merged view with whiteouts in every format the store can hold,
//! block-level and metadata-only copy-up, hard links as the store reports them, unique and
//! stable inode numbers, a renamed lower directory — before and after a remount.
//!
//! A store whose tools are not installed is skipped with one line saying which package to
//! install (`.ci/run` installs them all).

mod common;

use std::collections::HashMap;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn wait_mounted(p: &Path, child: &mut Child) {
    let start = Instant::now();
    while !is_mounted(p) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the store's daemon exited ({status}) before {} was mounted",
                p.display()
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{} not mounted",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A lower layer on a store, mounted until dropped.
struct Store {
    path: PathBuf,
    /// The store's FUSE daemon (and sshd), run in the foreground as children to wait for.
    children: Vec<Child>,
    /// Whether the store can hold xattrs (and so xattr whiteouts and opaque marks).
    xattrs: bool,
    /// Whether the store reports hard links (one inode number for both names).
    hard_links: bool,
    /// Whether the store keeps an object's inode number after its client forgot the inode:
    /// not so for clients that number inodes as they look them up (sshfs, high-level
    /// squashfuse), whose numbers change when the kernel drops their inodes (memory pressure,
    /// drop_caches) and so may between two mounts of the overlay.
    stable_inos: bool,
    _dir: tempfile::TempDir,
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg(&self.path)
            .stderr(Stdio::null())
            .status();
        if is_mounted(&self.path) {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
        for c in self.children.iter_mut().rev() {
            let start = Instant::now();
            while c.try_wait().ok().flatten().is_none() && start.elapsed() < Duration::from_secs(5)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn store_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("mosaicfs-store")
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// The layer tree, with whiteouts of the kinds the store can hold hiding entries of the
/// layer below (`bottom`).
/// `ns`: the xattr namespace of the overlay marks the store holds (`trusted.`, `user.`), none
/// if it holds no xattrs.
fn build_layer(dir: &Path, ns: Option<&str>) {
    write(dir.join("big"), pattern(8 << 20, 11));
    write(dir.join("d/a"), pattern(300_000, 12));
    write(dir.join("d/sub/b"), b"bee");
    write(dir.join("h1"), b"linked");
    fs::hard_link(dir.join("h1"), dir.join("h2")).unwrap();
    std::os::unix::fs::symlink("d/a", dir.join("sym")).unwrap();
    mknod_whiteout(dir, "wh_dev");
    write(dir.join(".wh.wh_file"), b"");
    write(dir.join("opq/new"), b"new");
    if let Some(ns) = ns {
        write(dir.join("wh_x"), b"");
        // Kernel overlayfs checks that the xattr exists; its value is empty where it writes
        // one. squashfuse 0.1.105 drops xattrs with empty values: its layer's has one byte.
        let value: &[u8] = if ns == "user." { b"y" } else { b"" };
        set_xattr(&dir.join("wh_x"), &format!("{ns}overlay.whiteout"), value);
        set_xattr(dir, &format!("{ns}overlay.opaque"), b"x");
        set_xattr(&dir.join("opq"), &format!("{ns}overlay.opaque"), b"y");
        set_xattr(&dir.join("big"), "user.layer", b"store");
    } else {
        write(dir.join("opq/.wh..wh..opq"), b"");
    }
}

fn build_bottom(dir: &Path) {
    for n in ["wh_dev", "wh_file", "wh_x", "kept"] {
        write(dir.join(n), n.as_bytes());
    }
    write(dir.join("opq/old"), b"old");
}

/// The merged view a mount over `build_layer` on `build_bottom` shows.
fn expected_names(xattrs: bool) -> Vec<String> {
    let mut v: Vec<String> = ["big", "d", "h1", "h2", "kept", "opq", "sym"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if !xattrs {
        // The store cannot hold the xattr whiteout: the bottom's file shows.
        v.push("wh_x".into());
    }
    v.sort();
    v
}

/// For a store built as an image: its directory, the tree to build it from, the image file
/// and the mount point.
fn image_dirs() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let dir = store_dir();
    let (src, img, path) = (
        dir.path().join("src"),
        dir.path().join("img"),
        dir.path().join("fs"),
    );
    fs::create_dir_all(&src).unwrap();
    fs::create_dir_all(&path).unwrap();
    (dir, src, img, path)
}

/// An image the kernel mounts read-only through a loop device (`fstype`), built by `mkfs`
/// (a command with `{src}` and `{img}` in it) from the layer tree, after `extra` adds to it.
fn kernel_image(mkfs: &str, fstype: &str, extra: impl FnOnce(&Path)) -> Store {
    let (dir, src, img, path) = image_dirs();
    build_layer(&src, Some("trusted."));
    extra(&src);
    let mkfs = mkfs
        .replace("{src}", &src.display().to_string())
        .replace("{img}", &img.display().to_string());
    sh(&format!(
        "{mkfs} >/dev/null && mount -t {fstype} -o loop,ro {} {}",
        img.display(),
        path.display()
    ));
    Store {
        path,
        children: Vec::new(),
        xattrs: true,
        hard_links: true,
        stable_inos: true,
        _dir: dir,
    }
}

fn erofs() -> Option<Store> {
    if !have("mkfs.erofs") {
        println!("EROFS store skipped: install erofs-utils (mkfs.erofs)");
        return None;
    }
    Some(kernel_image("mkfs.erofs {img} {src}", "erofs", |_| {}))
}

/// A squashfs image mounted by the kernel: it holds `user.`, `trusted.` and `security.`
/// xattrs but no ACLs, and answers EOPNOTSUPP for `system.posix_acl_*`, which the kernel asks
/// the daemon for at every permission check (unionmount-testsuite `--squashfs` found every
/// open of a lower file failing with it).
fn squashfs() -> Option<Store> {
    if !have("mksquashfs") {
        println!("squashfs store skipped: install squashfs-tools (mksquashfs)");
        return None;
    }
    let mkfs = "mksquashfs {src} {img} -quiet -no-progress -xattrs";
    Some(kernel_image(mkfs, "squashfs", |src| {
        // Owned by another user: root's access is then decided by the group bits and the ACL.
        write(src.join("d/sub/theirs"), b"not root's");
        std::os::unix::fs::chown(src.join("d/sub/theirs"), Some(1), Some(1)).unwrap();
    }))
}

fn squashfuse() -> Option<Store> {
    if !have("squashfuse") || !have("mksquashfs") {
        println!("squashfuse store skipped: install squashfuse and squashfs-tools");
        return None;
    }
    let (dir, src, img, path) = image_dirs();
    // squashfuse 0.1.105 shows an image's trusted.* xattrs as security.* and cannot read
    // them: its marks are the user.* ones (as rootless overlays write them).
    build_layer(&src, Some("user."));
    sh(&format!(
        "mksquashfs {} {} -quiet -no-progress -xattrs >/dev/null",
        src.display(),
        img.display()
    ));
    let mut child = Command::new("squashfuse")
        .arg("-f")
        .arg(&img)
        .arg(&path)
        .spawn()
        .unwrap();
    wait_mounted(&path, &mut child);
    Some(Store {
        path,
        children: vec![child],
        xattrs: true,
        // squashfuse gives each name its own inode number (nlink 2 on both).
        hard_links: false,
        stable_inos: false,
        _dir: dir,
    })
}

fn sshfs() -> Option<Store> {
    if !have("sshfs") || !Path::new("/usr/sbin/sshd").exists() {
        println!("sshfs store skipped: install sshfs and openssh-server");
        return None;
    }
    let dir = store_dir();
    let d = dir.path();
    let (src, path) = (d.join("src"), d.join("fs"));
    fs::create_dir_all(&src).unwrap();
    fs::create_dir_all(&path).unwrap();
    // sshfs carries no xattrs (without xattr support on the server side of SFTP).
    build_layer(&src, None);
    sh(&format!(
        "ssh-keygen -q -t ed25519 -N '' -f {0}/host && ssh-keygen -q -t ed25519 -N '' -f {0}/user \
         && cp {0}/user.pub {0}/authorized && mkdir -p /run/sshd",
        d.display()
    ));
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    fs::write(
        d.join("sshd_config"),
        format!(
            "ListenAddress 127.0.0.1\nPort {port}\nHostKey {0}/host\nAuthorizedKeysFile {0}/authorized\n\
             PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nPidFile none\n\
             Subsystem sftp internal-sftp\n",
            d.display()
        ),
    )
    .unwrap();
    let mut sshd = Command::new("/usr/sbin/sshd")
        .args(["-D", "-e", "-f"])
        .arg(d.join("sshd_config"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(sshd.try_wait().unwrap().is_none(), "sshd exited");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "sshd does not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut child = Command::new("sshfs")
        .arg("-f")
        .arg(format!("root@127.0.0.1:{}", src.display()))
        .arg(&path)
        .args([
            "-o",
            &format!(
                "port={port},IdentityFile={}/user,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR",
                d.display()
            ),
        ])
        .spawn()
        .unwrap();
    wait_mounted(&path, &mut child);
    Some(Store {
        path,
        children: vec![sshd, child],
        xattrs: false,
        hard_links: false,
        stable_inos: false,
        _dir: dir,
    })
}

/// A one-brick GlusterFS volume on a local directory, mounted with the glusterfs FUSE client.
/// glusterd runs as a child with its state in the test's directory; the volume is stopped
/// (which ends the brick process) and the client unmounted on drop.
struct Gluster {
    store: Option<Store>,
    volume: String,
    brick: PathBuf,
    host: String,
    /// Mounts of other clients of the volume (`other_client`).
    others: Vec<PathBuf>,
    /// One glusterd per machine (it listens on port 24007): one volume at a time.
    _one: std::sync::MutexGuard<'static, ()>,
}

static GLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Gluster {
    fn new() -> Option<Gluster> {
        if !have("glusterd") || !have("glusterfs") {
            println!("GlusterFS store skipped: install glusterfs-server and glusterfs-client");
            return None;
        }
        // glusterd refuses loopback addresses for bricks.
        let host = sh("hostname -I 2>/dev/null | awk '{print $1}'")
            .trim()
            .to_string();
        if host.is_empty() {
            println!("GlusterFS store skipped: this machine has no non-loopback address");
            return None;
        }
        let one = GLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        let dir = store_dir();
        let d = dir.path().to_path_buf();
        let (brick, path, state) = (d.join("brick"), d.join("fs"), d.join("glusterd"));
        for p in [&brick, &path, &state] {
            fs::create_dir_all(p).unwrap();
        }
        let glusterd = Command::new("glusterd")
            .arg("-N")
            .arg(format!("--log-file={}", d.join("glusterd.log").display()))
            .args(["--xlator-option"])
            .arg(format!("management.working-directory={}", state.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let cli = |args: &str| {
            Command::new("sh")
                .args(["-c", &format!("gluster --mode=script {args}")])
                .output()
                .unwrap()
        };
        let start = Instant::now();
        while !cli("volume list").status.success() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "glusterd does not answer"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let volume = format!(
            "mosaicfs{}",
            d.file_name()
                .unwrap()
                .to_string_lossy()
                .replace(|c: char| !c.is_ascii_alphanumeric(), "")
        );
        for cmd in [
            format!("volume create {volume} {host}:{} force", brick.display()),
            format!("volume start {volume}"),
        ] {
            let out = cli(&cmd);
            assert!(
                out.status.success(),
                "gluster {cmd}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        let mut client = Command::new("glusterfs")
            .args([
                "-N",
                &format!("--volfile-server={host}"),
                &format!("--volfile-id={volume}"),
            ])
            .arg(&path)
            .spawn()
            .unwrap();
        wait_mounted(&path, &mut client);
        Some(Gluster {
            store: Some(Store {
                path,
                children: vec![glusterd, client],
                xattrs: true,
                hard_links: true,
                stable_inos: true,
                _dir: dir,
            }),
            volume,
            brick,
            host,
            others: Vec::new(),
            _one: one,
        })
    }

    /// Mounts the volume once more, as another client (another node of a cluster) would.
    fn other_client(&mut self) -> PathBuf {
        let store = self.store.as_mut().unwrap();
        let path = store
            ._dir
            .path()
            .join(format!("other{}", self.others.len()));
        fs::create_dir(&path).unwrap();
        let mut client = Command::new("glusterfs")
            .args([
                "-N",
                &format!("--volfile-server={}", self.host),
                &format!("--volfile-id={}", self.volume),
            ])
            .arg(&path)
            .spawn()
            .unwrap();
        wait_mounted(&path, &mut client);
        store.children.push(client);
        self.others.push(path.clone());
        path
    }

    /// The brick's server process, to stop (SIGSTOP) and continue.
    fn brick_pid(&self) -> i32 {
        sh(&format!(
            "pgrep -f '^[^ ]*glusterfsd .*--brick-name {} '",
            self.brick.display()
        ))
        .trim()
        .parse()
        .expect("the brick process")
    }
}

impl Drop for Gluster {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        for p in self.others.iter().chain([&store.path]) {
            let _ = Command::new("umount").arg(p).status();
        }
        let _ = Command::new("sh")
            .args([
                "-c",
                &format!(
                    "pkill -CONT -f 'brick-name {0}'; gluster --mode=script volume stop {1} force; \
                     gluster --mode=script volume delete {1}",
                    self.brick.display(),
                    self.volume
                ),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        drop(store);
    }
}

/// Inode number of every path of the merged view.
fn inode_numbers(root: &Path) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                todo.push(p.clone());
            }
            out.insert(p.strip_prefix(root).unwrap().display().to_string(), m.ino());
        }
    }
    out
}

fn check_store(store: &Store, what: &str) {
    let mut m = Mount::new(2);
    m.lowers[0] = store.path.clone();
    build_bottom(m.lower(1));
    m.mount();
    let xattrs = store.xattrs;
    assert_eq!(names(&m.mnt), expected_names(xattrs), "{what}: merged view");
    assert_eq!(
        names(m.path("opq")),
        vec!["new"],
        "{what}: opaque directory"
    );
    assert_eq!(
        fs::read(m.path("d/a")).unwrap(),
        pattern(300_000, 12),
        "{what}"
    );
    assert_eq!(fs::read_link(m.path("sym")).unwrap(), PathBuf::from("d/a"));
    // Lower files of a store's client (FUSE) are read through the daemon, and its page cache
    // is kept across opens: the second read sends no READ, and the file is opened in the
    // store only for the first (opens wait for a read). Others pass through.
    let on_store = sh(&format!("stat -f -c %T {}", store.path.display()))
        .trim()
        .starts_with("fuse");
    let (reads, lower_opens) = (counter(&m, "reads"), counter(&m, "lower_opens"));
    for _ in 0..2 {
        assert_eq!(fs::read(m.path("d/sub/b")).unwrap(), b"bee");
    }
    let (reads, passthrough, lower_opens) = (
        counter(&m, "reads") - reads,
        counter(&m, "opens_passthrough"),
        counter(&m, "lower_opens") - lower_opens,
    );
    if on_store {
        assert_eq!(
            (reads, passthrough, lower_opens),
            (1, 0, 1),
            "{what}: reads, passthrough opens, opens in the store"
        );
        // An open not read yet still answers what needs the data: SEEK_HOLE at the end.
        let f = fs::File::open(m.path("d/a")).unwrap();
        let end = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_HOLE) };
        assert_eq!(end, 300_000, "{what}: SEEK_HOLE of a file opened, not read");
    } else {
        assert_eq!(reads, 0, "{what}: reads through the daemon");
        assert!(passthrough > 0, "{what}: no passthrough open");
    }
    if xattrs {
        assert_eq!(
            get_xattr(&m.path("big"), "user.layer").as_deref(),
            Some(&b"store"[..])
        );
    }

    // Inode numbers: unique across the layers' devices, and the same after a remount.
    let inos = inode_numbers(&m.mnt);
    let mut seen: HashMap<u64, &String> = HashMap::new();
    for (p, ino) in &inos {
        if let Some(other) = seen.insert(*ino, p) {
            let linked = [p.as_str(), other.as_str()];
            assert!(
                store.hard_links && linked.contains(&"h1") && linked.contains(&"h2"),
                "{what}: {p} and {other} share inode number {ino}"
            );
        }
    }
    assert_eq!(
        inos["h1"] == inos["h2"],
        store.hard_links,
        "{what}: hard links as the store reports them"
    );

    // Block-level copy-up: one byte written, one block in the upper layer.
    write_at(m.path("big"), 4 << 20, b"!");
    let mut want = pattern(8 << 20, 11);
    want[4 << 20] = b'!';
    assert_eq!(
        fs::read(m.path("big")).unwrap(),
        want,
        "{what}: partial file"
    );
    assert!(stored_bytes(&m, "big") <= 64 << 10, "{what}: copied whole");
    // Metadata-only copy-up: a chown copies no data.
    std::os::unix::fs::chown(m.path("d/a"), Some(1000), Some(1000)).unwrap();
    assert_eq!(fs::metadata(m.path("d/a")).unwrap().uid(), 1000);
    // (At most the block ext4 gives xattrs that do not fit in the inode: the mark.)
    assert!(stored_bytes(&m, "d/a") <= 4096, "{what}: chown copied data");
    assert_eq!(fs::read(m.path("d/a")).unwrap(), pattern(300_000, 12));
    // A write through one name of a hard link shows through the other.
    write_at(m.path("h1"), 0, b"L");
    if store.hard_links {
        assert_eq!(fs::read(m.path("h2")).unwrap(), b"Linked", "{what}");
    }
    // A renamed lower directory.
    fs::rename(m.path("d"), m.path("e")).unwrap();
    assert_eq!(fs::read(m.path("e/sub/b")).unwrap(), b"bee");
    assert!(!m.path("d").exists());

    m.remount();
    let after = inode_numbers(&m.mnt);
    // A file mosaicfs copied up keeps the number its origin records, on every store. A lower
    // object's number is derived from the store's, so it is as stable as the store keeps it.
    let kept: &[&str] = if store.stable_inos {
        &["big", "h1", "kept", "opq", "sym"]
    } else {
        &["big"]
    };
    for p in kept {
        assert_eq!(
            after[*p], inos[*p],
            "{what}: inode number of {p} changed at remount"
        );
    }
    if store.stable_inos {
        assert_eq!(
            after["e/sub/b"], inos["d/sub/b"],
            "{what}: renamed directory's file"
        );
    }
    assert_eq!(
        fs::read(m.path("big")).unwrap(),
        want,
        "{what}: after remount"
    );
    assert_eq!(fs::read(m.path("e/a")).unwrap(), pattern(300_000, 12));
    assert_eq!(fs::metadata(m.path("e/a")).unwrap().uid(), 1000);
    assert!(!m.path("d").exists() && !m.path("wh_dev").exists() && !m.path("wh_file").exists());
    m.unmount();
}

#[test]
fn a_lower_layer_on_erofs() {
    if let Some(s) = erofs() {
        check_store(&s, "erofs");
    }
}

#[test]
fn a_lower_layer_on_squashfs() {
    let Some(s) = squashfs() else { return };
    // Before: every open of a lower file not owned by the opener failed with EOPNOTSUPP.
    let mut m = Mount::new(1);
    m.lowers[0] = s.path.clone();
    m.mount();
    assert_eq!(fs::read(m.path("d/sub/theirs")).unwrap(), b"not root's");
    let acl = Command::new("getfattr")
        .args(["-n", "system.posix_acl_access"])
        .arg(m.path("d/sub/theirs"))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&acl.stderr).contains("No such attribute"),
        "a layer without ACLs: the file has none ({acl:?})"
    );
    m.unmount();
    check_store(&s, "squashfs");
}

#[test]
fn a_lower_layer_on_squashfuse() {
    if let Some(s) = squashfuse() {
        check_store(&s, "squashfuse");
    }
}

#[test]
fn a_lower_layer_on_sshfs() {
    if let Some(s) = sshfs() {
        check_store(&s, "sshfs");
    }
}

/// GlusterFS: the overlay tests, then a stopped brick with reads of its files in flight: the
/// rest of the mount (files of the upper layer, of another lower layer, entries of the stopped
/// layer the kernel has cached — lower-only objects for `lower_cache=`) is served as fast as before — the daemon adds workers while all of them are blocked — and
/// once the brick continues, the blocked reads finish with the right bytes, no remount.
#[test]
fn a_lower_layer_on_glusterfs_and_a_brick_that_stops() {
    let Some(g) = Gluster::new() else { return };
    let store = g.store.as_ref().unwrap();
    build_layer(&store.path, Some("trusted."));
    check_store(store, "glusterfs");
    for i in 0..8 {
        write(
            store.path.join(format!("slow/f{i}")),
            pattern(1 << 20, 100 + i),
        );
    }
    let mut m = Mount::new(2);
    m.lowers[0] = store.path.clone();
    build_bottom(m.lower(1));
    m.mount();
    write(m.path("upper_file"), b"in the upper layer");
    // A file of the other lower layer, open before the brick stops. (Looking a name up in a
    // directory the stopped layer is part of needs that layer, as creating a name there does.)
    let kept = fs::File::open(m.path("kept")).unwrap();

    // Names the kernel knows: each read sends its own OPEN and READ, which the daemon serves
    // by opening and reading the file on the stopped layer — six requests blocked at once (six
    // first lookups of names in one new directory would wait in the kernel for one).
    for i in 0..6 {
        let _ = fs::metadata(m.path(&format!("slow/f{i}"))).unwrap();
    }
    // A lower-only object looked up before: cached by the kernel for lower_cache (60 s).
    // Held open, so that the kernel keeps its name and inode whatever the memory pressure
    // (drop_caches would otherwise make the next stat a LOOKUP, which needs every layer of
    // the directory, the stopped one included).
    let big_held = fs::File::open(m.path("big")).unwrap();
    let big_ino = big_held.metadata().unwrap().ino();
    // A file read before: opened and stat'ed (its READs made the kernel ask for its
    // attributes again) without the store. Held open for the same reason.
    assert_eq!(fs::read(m.path("slow/f6")).unwrap(), pattern(1 << 20, 106));
    let f6_held = fs::File::open(m.path("slow/f6")).unwrap();
    let brick = g.brick_pid();
    sh(&format!("kill -STOP {brick}"));
    std::thread::sleep(Duration::from_millis(1200));
    let readers: Vec<_> = (0..6)
        .map(|i| {
            let p = m.path(&format!("slow/f{i}"));
            std::thread::spawn(move || fs::read(p))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    assert_eq!(
        fs::read(m.path("upper_file")).unwrap(),
        b"in the upper layer"
    );
    write_at(m.path("upper_file"), 0, b"IN");
    assert_eq!(fs::metadata(m.path("upper_file")).unwrap().len(), 18);
    let mut buf = [0u8; 4];
    std::os::unix::fs::FileExt::read_exact_at(&kept, &mut buf, 0).unwrap();
    assert_eq!(&buf, b"kept");
    assert_eq!(fs::metadata(m.path("big")).unwrap().ino(), big_ino);
    let f6 = fs::File::open(m.path("slow/f6")).unwrap();
    assert_eq!(f6.metadata().unwrap().len(), 1 << 20);
    drop(f6);
    let served_in = t.elapsed();
    drop((big_held, f6_held));
    let blocked = readers.iter().all(|r| !r.is_finished());
    sh(&format!("kill -CONT {brick}"));
    // Generous for a loaded machine, and still far below what a stall costs: a request that
    // waited on the stopped brick would take GlusterFS' 42 s ping timeout.
    eprintln!("requests that do not need the stopped layer took {served_in:?}");
    assert!(
        served_in < Duration::from_secs(20),
        "requests that do not need the stopped layer took {served_in:?}"
    );
    assert!(
        blocked,
        "the reads did not wait for the stopped brick: the test tests nothing"
    );
    for (i, r) in readers.into_iter().enumerate() {
        assert_eq!(
            r.join().unwrap().unwrap(),
            pattern(1 << 20, 100 + i as u64),
            "slow/f{i}"
        );
    }
    assert_eq!(fs::read(m.path("slow/f7")).unwrap(), pattern(1 << 20, 107));
    drop(kept);
    m.unmount();
    drop(g);
}

/// A stopped GlusterFS layer and more requests on it than the mount has worker threads, no
/// `lower_timeout=`: once a request has waited on the layer for a second, the layer takes no
/// more waiting threads than the pool less a reserve — requests past that fail with EIO at
/// once — so the rest of the mount is served throughout; when the brick continues, the stuck
/// requests finish and the layer is served again.
#[test]
fn a_stopped_layer_never_takes_every_worker_thread() {
    let Some(g) = Gluster::new() else { return };
    let store = g.store.as_ref().unwrap();
    const N: usize = 100;
    for i in 0..N {
        write(store.path.join(format!("many/f{i:03}")), b"x");
    }
    let mut m = Mount::new(1);
    m.lowers[0] = store.path.clone();
    m.mount();
    write(m.path("upper_file"), b"upper");
    // The directory is known to the kernel, its names are not: each stat is a LOOKUP, and
    // lookups of different names in one directory run in parallel. Held open, the directory
    // and the upper file keep their names in the kernel whatever the memory pressure: a
    // dropped dentry of `many` would make every stat below wait in the kernel for the one
    // LOOKUP of `many` (which needs the stopped layer), so no request would pass the cap.
    let held = (
        fs::File::open(m.path("many")).unwrap(),
        fs::File::open(m.path("upper_file")).unwrap(),
    );
    let brick = g.brick_pid();
    sh(&format!("kill -STOP {brick}"));
    std::thread::sleep(Duration::from_millis(1200)); // GlusterFS' own caches expire
    let lookups: Vec<_> = (0..N)
        .map(|i| {
            let p = m.path(&format!("many/f{i:03}"));
            std::thread::spawn(move || {
                fs::symlink_metadata(p).map_or_else(|e| e.raw_os_error().unwrap_or(-1), |_| 0)
            })
        })
        .collect();
    // The pool doubles every 200 ms while all workers are stuck, to 64: without the cap the
    // layer would take them all, and nothing would be served until GlusterFS gives up (42 s).
    std::thread::sleep(Duration::from_secs(3));
    let (tx, rx) = std::sync::mpsc::channel();
    let upper = m.path("upper_file");
    std::thread::spawn(move || {
        let t = Instant::now();
        let _ = tx.send((fs::read(upper).ok(), t.elapsed()));
    });
    let served = rx.recv_timeout(Duration::from_secs(3));
    let refused = lookups.iter().filter(|l| l.is_finished()).count();
    sh(&format!("kill -CONT {brick}"));
    let (data, took) = served.expect("the upper layer was not served: every worker is stuck");
    assert_eq!(data.as_deref(), Some(&b"upper"[..]));
    assert!(took < Duration::from_secs(2), "upper file took {took:?}");
    assert!(refused > 0 && refused < N, "{refused} lookups ended early");
    let results: Vec<i32> = lookups.into_iter().map(|l| l.join().unwrap()).collect();
    assert!(
        results.iter().all(|&e| e == 0 || e == libc::EIO),
        "{results:?}"
    );
    // Served again once the store answers, no remount.
    let start = Instant::now();
    while fs::symlink_metadata(m.path("many/f099")).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the layer did not come back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(held); // an open file would keep the daemon after the unmount
    let log = m.unmount();
    assert!(
        log.contains("further requests on it fail with EIO at once"),
        "{log}"
    );
    drop(g);
}

/// `lower_timeout=`: a request waiting on a stopped GlusterFS layer is answered EIO after the
/// timeout; while one waits that long the layer counts as down and further requests on it fail
/// at once (instead of taking more threads); the upper layer is served throughout; when the
/// brick continues, the layer is served again without a remount.
#[test]
fn lower_timeout_answers_eio_for_a_stopped_layer_which_comes_back() {
    let Some(g) = Gluster::new() else { return };
    let store = g.store.as_ref().unwrap();
    for i in 0..4 {
        write(store.path.join(format!("f{i}")), format!("file {i}"));
    }
    let mut m = Mount::new(2);
    m.lowers[0] = store.path.clone();
    write(m.lower(1).join("below"), b"below");
    m.extra.push("lower_timeout=2".into());
    m.mount();
    write(m.path("upper_file"), b"upper");
    let _ = fs::metadata(m.path("f0")).unwrap();
    let brick = g.brick_pid();
    sh(&format!("kill -STOP {brick}"));
    // The open of a known name reaches the daemon, which opens the file on the stopped layer.
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let first = errno_of(fs::read(m.path("f0")));
    let waited = t.elapsed();
    let t = Instant::now();
    let second = errno_of(fs::metadata(m.path("f1")));
    let at_once = t.elapsed();
    let upper = fs::read(m.path("upper_file"));
    sh(&format!("kill -CONT {brick}"));
    assert_eq!(first, libc::EIO);
    if !(waited >= Duration::from_millis(1500) && waited < Duration::from_secs(6)) {
        panic!("answered after {waited:?}; daemon log:\n{}", m.unmount());
    }
    assert_eq!(second, libc::EIO);
    assert!(
        at_once < Duration::from_millis(500),
        "a down layer took {at_once:?}"
    );
    assert_eq!(upper.unwrap(), b"upper");
    // Served again once the store answers (the stuck lookup returns, the layer is up).
    let start = Instant::now();
    loop {
        match fs::read(m.path("f2")) {
            Ok(b) => {
                assert_eq!(b, b"file 2");
                break;
            }
            Err(e) => assert!(
                start.elapsed() < Duration::from_secs(30),
                "the layer did not come back: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(counter(&m, "lower_timeouts"), 1);
    m.unmount();
}

/// A directory of a lower layer replaced on the shared store by another client (a layer
/// unpacked again, say): the store answers ESTALE for the descriptor the daemon keeps of the
/// old directory, which the daemon drops and opens again — the mount shows the new directory
/// at once, no error. When the layer's root itself is replaced, which no reopen mends, the
/// mount answers EIO and the log names the layer and the path.
#[test]
fn a_lower_directory_replaced_by_another_client_of_glusterfs_is_opened_again() {
    let Some(mut g) = Gluster::new() else { return };
    let other = g.other_client().join("layer");
    let layer = g.store.as_ref().unwrap().path.join("layer");
    write(layer.join("d/f"), b"old\n");
    write(layer.join("d/sub/g"), b"g");
    let mut m = Mount::new(1);
    m.lowers[0] = layer.clone();
    // The kernel keeps entries, attributes and listings of lower-only directories for
    // `lower_cache`: a layer changed on its store shows once they expire.
    m.extra = opts(&["lower_cache=0.5"]);
    m.mount();
    // The daemon opens (and keeps) the lower directories d and d/sub.
    assert_eq!(fs::read(m.path("d/f")).unwrap(), b"old\n");
    assert_eq!(names(m.path("d")), ["f", "sub"]);
    assert_eq!(fs::read(m.path("d/sub/g")).unwrap(), b"g");

    fs::remove_dir_all(other.join("d")).unwrap();
    write(other.join("d/f"), b"new\n");
    write(other.join("d/h"), b"h");
    write(other.join("d/sub/g"), b"G");
    // (GlusterFS' client caches attributes for 1 s itself: the daemon may get the old
    // directory's mtime until then.)
    std::thread::sleep(Duration::from_millis(1600));
    assert_eq!(names(m.path("d")), ["f", "h", "sub"]);
    assert_eq!(fs::read(m.path("d/h")).unwrap(), b"h");
    assert_eq!(fs::read(m.path("d/f")).unwrap(), b"new\n");
    assert_eq!(fs::read(m.path("d/sub/g")).unwrap(), b"G");
    assert!(
        fs::symlink_metadata(m.path("d/none"))
            .is_err_and(|e| e.raw_os_error() == Some(libc::ENOENT))
    );
    assert!(
        counter(&m, "stale_retries") > 0,
        "no ESTALE was met: the test tests nothing"
    );

    fs::remove_dir_all(&other).unwrap();
    write(other.join("z"), b"z");
    assert_eq!(errno_of(fs::symlink_metadata(m.path("z"))), libc::EIO);
    let log = m.unmount();
    assert!(
        log.contains(&format!("'{}': '' is stale on its store", layer.display())),
        "{log}"
    );
}

/// Podman with an additional image store on a GlusterFS volume: an image imported into a store
/// on the volume; a second storage root on this machine lists it (read-only) through
/// `additionalimagestores` and runs a container from it on mosaicfs — its lower layer on the
/// volume — that writes into an image file (block-level: one block in the upper layer); the
/// container is committed and the committed image runs with the change.
#[test]
fn podman_runs_images_of_an_additional_store_on_glusterfs() {
    if !have("podman") || !have("runc") || !have("busybox") {
        println!("podman on GlusterFS skipped: install podman, runc and busybox-static");
        return;
    }
    let Some(g) = Gluster::new() else { return };
    let volume = g.store.as_ref().unwrap().path.clone();
    let dir = store_dir();
    let d = dir.path();
    let rootfs = d.join("rootfs");
    write(rootfs.join("data/f"), b"image data\n");
    write(rootfs.join("data/big"), pattern(4 << 20, 21));
    fs::create_dir_all(rootfs.join("bin")).unwrap();
    // Image files are old, as in real images: containers/storage's diff takes an mtime with
    // nanoseconds 0 (a tar's) as truncated and compares seconds only, so a write within the
    // second of the import would go unseen by `podman commit` on any storage driver.
    sh(&format!(
        "cp \"$(command -v busybox)\" {0}/bin/busybox && for c in sh cat echo dd od stat; do ln -s busybox {0}/bin/$c; done \
         && find {0} -exec touch -h -d '2024-01-01 00:00:00' {{}} + && tar -C {0} -cf {1}/rootfs.tar .",
        rootfs.display(),
        d.display()
    ));
    let conf = |name: &str, body: String| {
        let p = d.join(name);
        fs::write(&p, body).unwrap();
        p
    };
    let overlay = format!("[storage.options.overlay]\nmount_program = \"{BIN}\"\n");
    let store_conf = conf(
        "store.conf",
        format!(
            "[storage]\ndriver = \"overlay\"\ngraphroot = \"{}/store\"\nrunroot = \"{}/run-store\"\n{overlay}",
            volume.display(),
            d.display()
        ),
    );
    let node_conf = conf(
        "node.conf",
        format!(
            "[storage]\ndriver = \"overlay\"\ngraphroot = \"{0}/root\"\nrunroot = \"{0}/run-node\"\n\
             [storage.options]\nadditionalimagestores = [\"{1}/store\"]\n{overlay}\
             mountopt = \"lower_timeout=30\"\n",
            d.display(),
            volume.display()
        ),
    );
    let podman = |conf: &Path, args: &str| {
        let out = Command::new("sh")
            .args([
                "-c",
                &format!(
                    "podman --runtime runc --cgroup-manager cgroupfs --events-backend file {args}"
                ),
            ])
            .env("CONTAINERS_STORAGE_CONF", conf)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "podman {args}: {text}");
        text
    };
    let run = "--network none --ulimit nofile=20000:20000 --ulimit nproc=32768:32768";
    podman(
        &store_conf,
        &format!("import {}/rootfs.tar localhost/shared:1", d.display()),
    );
    let images = podman(
        &node_conf,
        "images --format '{{.Repository}}:{{.Tag}} {{.ReadOnly}}'",
    );
    assert!(images.contains("localhost/shared:1 true"), "{images}");
    let out = podman(
        &node_conf,
        &format!(
            "run --name w {run} localhost/shared:1 sh -c 'echo more >> /data/f; \
             dd if=/dev/zero of=/data/big bs=1 count=3 seek=1000000 conv=notrunc 2>/dev/null; cat /data/f'"
        ),
    );
    assert!(out.contains("image data\nmore"), "{out}");
    let lower = podman(
        &node_conf,
        "inspect w --format '{{.GraphDriver.Data.LowerDir}}'",
    );
    assert!(
        lower
            .trim()
            .starts_with(&format!("{}/store/", volume.display())),
        "{lower}"
    );
    let upper = podman(
        &node_conf,
        "inspect w --format '{{.GraphDriver.Data.UpperDir}}'",
    );
    let big = PathBuf::from(upper.trim()).join("data/big");
    assert!(
        allocated(&big) <= 64 << 10,
        "the image file was copied whole"
    );
    // The README's storage.conf: `mountopt` reaches the mount program.
    let merged = podman(&node_conf, "mount w");
    let daemons = sh("pgrep -af mosaicfs");
    assert!(
        daemons
            .lines()
            .any(|l| l.contains(merged.trim()) && l.contains("lower_timeout=30")),
        "{}: {daemons}",
        merged.trim()
    );
    podman(&node_conf, "umount w");
    podman(&node_conf, "commit -q w localhost/derived:1");
    let out = podman(
        &node_conf,
        &format!(
            "run --rm {run} localhost/derived:1 sh -c 'cat /data/f; \
             dd if=/data/big bs=1 skip=1000000 count=3 2>/dev/null | od -An -tx1'"
        ),
    );
    assert!(
        out.contains("image data\nmore") && out.contains("00 00 00"),
        "{out}"
    );
    for conf in [&node_conf, &store_conf] {
        let _ = Command::new("sh")
            .args(["-c", "podman rm -af; podman rmi -af"])
            .env("CONTAINERS_STORAGE_CONF", conf)
            .output();
    }
    drop(g);
}
