//! The offline commands on real layers: `mosaicfs complete` makes an upper layer written by
//! mosaicfs one that kernel overlayfs and fuse-overlayfs show the same tree from; `mosaicfs
//! fsck` finds and repairs what a mount would trip over.

mod common;

use std::collections::hash_map::DefaultHasher;
use std::fs;
use std::hash::{Hash, Hasher};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::*;

/// Everything a user sees of a tree, per path: type, mode, owner, size, mtime and link count of
/// files, a hash of the content, the link target, and every xattr with its value.
fn snapshot(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let m = fs::symlink_metadata(&p).unwrap();
            let mut xattrs = list_xattr(&p);
            xattrs.sort();
            let xattrs: Vec<String> = xattrs
                .iter()
                .map(|k| format!("{k}={:?}", get_xattr(&p, k)))
                .collect();
            let what = if m.is_dir() {
                todo.push(p.clone());
                "dir".to_string()
            } else if m.file_type().is_symlink() {
                format!("link -> {}", fs::read_link(&p).unwrap().display())
            } else if m.is_file() {
                let mut h = DefaultHasher::new();
                fs::read(&p).unwrap().hash(&mut h);
                format!(
                    "file size {} mtime {}.{} nlink {} data {:x}",
                    m.len(),
                    m.mtime(),
                    m.mtime_nsec(),
                    m.nlink(),
                    h.finish()
                )
            } else {
                format!("special {:o} rdev {}", m.mode() & libc::S_IFMT, m.rdev())
            };
            out.push(format!(
                "{rel}: {what} mode {:o} owner {}:{} xattrs {xattrs:?}",
                m.mode() & 0o7777,
                m.uid(),
                m.gid()
            ));
        }
    }
    out.sort();
    out
}

fn tool(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn layer_args(m: &Mount, work: bool) -> Vec<String> {
    let lowers: Vec<String> = m.lowers.iter().map(|l| l.display().to_string()).collect();
    let mut a = vec![
        format!("--lowerdir={}", lowers.join(":")),
        format!("--upperdir={}", m.upper.display()),
    ];
    if work {
        a.push(format!("--workdir={}", m.work.display()));
    }
    a
}

fn run_tool(cmd: &str, m: &Mount, extra: &[&str]) -> (i32, String) {
    let mut args = vec![cmd.to_string()];
    args.extend(layer_args(m, true));
    args.extend(extra.iter().map(|s| s.to_string()));
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let out = tool(&a);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// A lower layer and the changes a container makes over it, through a mosaicfs mount: a
/// partial write, a chown (metadata-only copy-up), a renamed lower directory (a redirect),
/// new files in it, a deletion, an xattr, a hard link, a new directory.
fn container_changes(m: &mut Mount) {
    let l = m.lower(0).to_path_buf();
    write(l.join("big"), pattern(8 << 20, 1));
    write(l.join("chowned"), pattern(2 << 20, 2));
    write(l.join("d/a"), pattern(3 << 20, 3));
    write(l.join("d/sub/b"), b"bee");
    write(l.join("d/sub/old"), b"removed in the renamed directory");
    write(l.join("gone"), b"to be deleted");
    write(l.join("x"), pattern(1 << 20, 4));
    std::os::unix::fs::symlink("d/a", l.join("link")).unwrap();
    m.mount();
    write_at(m.path("big"), 1 << 20, b"written by the container");
    std::os::unix::fs::chown(m.path("chowned"), Some(1234), Some(5678)).unwrap();
    fs::set_permissions(m.path("chowned"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::rename(m.path("d"), m.path("e")).unwrap();
    write(m.path("e/new"), b"new in a renamed directory");
    write_at(m.path("e/sub/b"), 0, b"B");
    fs::remove_file(m.path("e/sub/old")).unwrap();
    fs::remove_file(m.path("gone")).unwrap();
    set_xattr(&m.path("x"), "user.k", b"v");
    fs::hard_link(m.path("e/a"), m.path("hard")).unwrap();
    fs::create_dir(m.path("newdir")).unwrap();
    write(m.path("newdir/f"), b"f");
}

/// Every xattr of mosaicfs' own left anywhere in the upper layer, and the guard of a partial
/// file (`overlay.metacopy`), which would make kernel overlayfs refuse a complete file.
fn own_xattrs(upper: &Path) -> Vec<String> {
    let mut left = Vec::new();
    let mut todo = vec![upper.to_path_buf()];
    while let Some(d) = todo.pop() {
        for k in list_xattr(&d) {
            if is_own(&k) {
                left.push(format!("{}: {k}", d.display()));
            }
        }
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if fs::symlink_metadata(&p).unwrap().is_dir() {
                todo.push(p);
            } else {
                for k in list_xattr(&p) {
                    if is_own(&k) {
                        left.push(format!("{}: {k}", p.display()));
                    }
                }
            }
        }
    }
    left
}

fn is_own(key: &str) -> bool {
    key.contains("mosaicfs.") || key.ends_with("overlay.metacopy")
}

/// Mounts the layers of `m` with another overlay (`kind`: "overlay" or "fuse-overlayfs", with
/// a fresh work dir of its own and the `extra` options), runs `look` on its mount point, and
/// unmounts it.
fn with_peer<T>(kind: &str, m: &Mount, extra: &str, look: impl FnOnce(&Path) -> T) -> T {
    let work = m.dir.path().join(format!("work-{kind}"));
    let mnt = m.dir.path().join(format!("mnt-{kind}"));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).unwrap();
    fs::create_dir_all(&mnt).unwrap();
    let lowers: Vec<String> = m.lowers.iter().map(|l| l.display().to_string()).collect();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}{extra}",
        lowers.join(":"),
        m.upper.display(),
        work.display()
    );
    if kind == "overlay" {
        sh(&format!(
            "mount -t overlay overlay -o {opts} {}",
            mnt.display()
        ));
    } else {
        sh(&format!("fuse-overlayfs -o {opts} {}", mnt.display()));
    }
    let seen = look(&mnt);
    sh(&format!("umount {}", mnt.display()));
    seen
}

/// The snapshot of what another overlay (`with_peer`) shows of the layers of `m`.
fn snapshot_with(kind: &str, m: &Mount, extra: &str) -> Vec<String> {
    with_peer(kind, m, extra, snapshot)
}

#[test]
fn complete_makes_a_layer_kernel_overlayfs_and_fuse_overlayfs_show_as_mosaicfs_did() {
    if !runs_on_disk_upper_only() {
        return;
    }
    for (mode, peer, peer_opts) in [
        ("--redirects=kernel", "overlay", ",redirect_dir=on"),
        ("--redirects=copy", "fuse-overlayfs", ""),
    ] {
        let mut m = Mount::new(1);
        container_changes(&mut m);
        let seen = snapshot(&m.mnt);
        m.unmount();
        assert!(get_xattr(&m.upper.join("big"), "trusted.mosaicfs.partial").is_some());
        assert!(get_xattr(&m.upper.join("e"), "trusted.mosaicfs.redirect").is_some());
        assert!(
            allocated(&m.upper.join("big")) < 1 << 20,
            "the partial file holds only its written block"
        );

        let (status, out) = run_tool("fsck", &m, &[]);
        assert_eq!(status, 0, "a layer mosaicfs wrote is clean: {out}");

        let (status, out) = run_tool("complete", &m, &[mode]);
        assert_eq!(status, 0, "{mode}: {out}");
        assert!(out.contains("partial files made whole"), "{out}");
        assert_eq!(own_xattrs(&m.upper), Vec::<String>::new(), "{mode}");
        assert!(allocated(&m.upper.join("big")) >= 8 << 20, "big is whole");
        if mode == "--redirects=kernel" {
            assert_eq!(
                get_xattr(&m.upper.join("e"), "trusted.overlay.redirect").as_deref(),
                Some(&b"/d"[..])
            );
        } else {
            assert!(m.upper.join("e/a").exists(), "the lower tree was copied in");
            assert_eq!(
                get_xattr(&m.upper.join("e"), "trusted.overlay.opaque").as_deref(),
                Some(&b"y"[..])
            );
        }

        // fuse-overlayfs counts the links of a hard-linked upper file by the names it has
        // looked up so far (1 for the second name here); kernel overlayfs and mosaicfs report
        // the upper inode's count.
        let peer_sees = |snap: Vec<String>| -> Vec<String> {
            if peer == "fuse-overlayfs" {
                snap.iter().map(|l| without(l, "nlink")).collect()
            } else {
                snap
            }
        };
        assert_eq!(
            peer_sees(snapshot_with(peer, &m, peer_opts)),
            peer_sees(seen.clone()),
            "{peer} shows the tree mosaicfs showed ({mode})"
        );
        if mode == "--redirects=copy" {
            // Without redirects left, kernel overlayfs reads it too.
            assert_eq!(
                snapshot_with("overlay", &m, ""),
                seen,
                "kernel overlayfs ({mode})"
            );
        }
        m.mount();
        assert_eq!(snapshot(&m.mnt), seen, "mosaicfs still reads it ({mode})");
        m.unmount();
        let (status, out) = run_tool("complete", &m, &[mode]);
        assert_eq!(status, 0, "a second run has nothing to do: {out}");
        assert!(
            out.contains(" 0 partial files made whole, 0 redirects"),
            "{out}"
        );
    }
}

/// The bytes kernel overlayfs gives for `rel` over the layers of `m` mounted with `extra`
/// options: `Err(errno)` when it refuses the file.
fn kernel_overlayfs_reads(m: &Mount, rel: &str, extra: &str) -> Result<Vec<u8>, i32> {
    with_peer("overlay", m, extra, |mnt| {
        fs::read(mnt.join(rel)).map_err(|e| e.raw_os_error().unwrap_or(0))
    })
}

#[test]
fn kernel_overlayfs_refuses_a_partial_file_instead_of_reading_zeros() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(8 << 20, 5);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    write(m.lower(0).join("chowned"), &base);
    m.mount();
    write_at(m.path("f"), 4_000_000, b"x");
    std::os::unix::fs::chown(m.path("chowned"), Some(7), Some(7)).unwrap();
    m.unmount();
    let mut want = base.clone();
    want[4_000_000] = b'x';
    // Every way kernel overlayfs can be mounted on these layers: right bytes or an error.
    for extra in ["", ",metacopy=on", ",redirect_dir=follow", ",userxattr"] {
        for (rel, content) in [("f", &want), ("chowned", &base)] {
            match kernel_overlayfs_reads(&m, rel, extra) {
                Ok(bytes) => assert!(
                    bytes == *content,
                    "kernel overlayfs ({extra}) read wrong bytes of {rel}: {} of {} differ",
                    bytes
                        .iter()
                        .zip(content.iter())
                        .filter(|(a, b)| a != b)
                        .count(),
                    content.len()
                ),
                Err(errno) => assert!(
                    errno == libc::EPERM || errno == libc::EIO,
                    "{rel} ({extra}): errno {errno}"
                ),
            }
        }
    }
    assert_eq!(
        kernel_overlayfs_reads(&m, "f", "").map(|_| ()),
        Err(libc::EPERM),
        "refused, not read"
    );
    // What the README says to run before switching: then kernel overlayfs reads the file.
    let (status, out) = run_tool("complete", &m, &[]);
    assert_eq!(status, 0, "{out}");
    for extra in ["", ",metacopy=on"] {
        assert!(
            kernel_overlayfs_reads(&m, "f", extra).unwrap() == want,
            "{extra}"
        );
        assert!(
            kernel_overlayfs_reads(&m, "chowned", extra).unwrap() == base,
            "{extra}"
        );
    }
}

/// What fuse-overlayfs 1.x does with the layers of `m` (the upper, or the upper as the top
/// lower layer under a fresh upper): `Ok(bytes of rel)` when it mounts, `Err(its stderr)` when
/// it refuses.
fn fuse_overlayfs_reads(m: &Mount, rel: &str, upper_as_lower: bool) -> Result<Vec<u8>, String> {
    let d = m.dir.path().join("fuse-overlayfs");
    let _ = fs::remove_dir_all(&d);
    for sub in ["work", "mnt", "upper"] {
        fs::create_dir_all(d.join(sub)).unwrap();
    }
    let lowers: Vec<String> = m.lowers.iter().map(|l| l.display().to_string()).collect();
    let (lowerdir, upperdir) = if upper_as_lower {
        (
            format!("{}:{}", m.upper.display(), lowers.join(":")),
            d.join("upper"),
        )
    } else {
        (lowers.join(":"), m.upper.clone())
    };
    let out = Command::new("fuse-overlayfs")
        .arg("-o")
        .arg(format!(
            "lowerdir={lowerdir},upperdir={},workdir={}",
            upperdir.display(),
            d.join("work").display()
        ))
        .arg(d.join("mnt"))
        .output()
        .expect("fuse-overlayfs (tests/deps.sh installs it)");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let bytes = fs::read(d.join("mnt").join(rel));
    sh(&format!("umount {}", d.join("mnt").display()));
    Ok(bytes.unwrap())
}

#[test]
fn fuse_overlayfs_refuses_a_layer_with_partial_files_instead_of_reading_zeros() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let base = pattern(8 << 20, 7);
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), &base);
    write(m.lower(0).join("g"), &base);
    m.mount();
    write_at(m.path("f"), 4_000_000, b"x");
    m.unmount();
    let mut want = base.clone();
    want[4_000_000] = b'x';
    // Without the layer's guard fuse-overlayfs 1.x mounts and reads the holes as zeros.
    for upper_as_lower in [false, true] {
        match fuse_overlayfs_reads(&m, "f", upper_as_lower) {
            Ok(bytes) => panic!(
                "fuse-overlayfs (upper as lower: {upper_as_lower}) mounted the layer: {} of {} bytes of f wrong",
                bytes.iter().zip(&want).filter(|(a, b)| a != b).count(),
                want.len()
            ),
            Err(why) => assert!(
                why.contains("cannot read upper dir: Numerical result out of range"),
                "{why}"
            ),
        }
    }
    // A layer written before the guard: fsck reports it, --repair adds it back.
    sh(&format!(
        "setfattr -x user.fuseoverlayfs.opaque {}",
        m.upper.display()
    ));
    let (status, out) = run_tool("fsck", &m, &[]);
    assert_eq!(status, 4, "{out}");
    assert!(
        out.contains("upper /: holds partial files but not user.fuseoverlayfs.opaque"),
        "{out}"
    );
    assert_eq!(run_tool("fsck", &m, &["--repair"]).0, 1);
    assert!(
        fuse_overlayfs_reads(&m, "f", false).is_err(),
        "guarded again"
    );
    // What the README says to run before switching: then fuse-overlayfs mounts and reads it.
    let (status, out) = run_tool("complete", &m, &[]);
    assert_eq!(status, 0, "{out}");
    assert_eq!(get_xattr(&m.upper, "user.fuseoverlayfs.opaque"), None);
    for upper_as_lower in [false, true] {
        assert!(fuse_overlayfs_reads(&m, "f", upper_as_lower).unwrap() == want);
    }
    // The next partial file guards the layer again; the merged view never shows the guard.
    m.mount();
    write_at(m.path("f"), 0, b"y");
    assert_eq!(
        get_xattr(&m.upper, "user.fuseoverlayfs.opaque"),
        None,
        "f is whole"
    );
    write_at(m.path("g"), 0, b"y");
    assert!(
        get_xattr(&m.upper, "user.fuseoverlayfs.opaque").is_some(),
        "g is partial"
    );
    assert_eq!(get_xattr(&m.mnt, "user.fuseoverlayfs.opaque"), None);
    m.unmount();
    assert!(fuse_overlayfs_reads(&m, "g", false).is_err());
}

#[test]
fn fsck_finds_a_partial_file_without_its_guard_and_repair_adds_it() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), pattern(8 << 20, 6));
    m.mount();
    write_at(m.path("f"), 4096, b"y");
    m.unmount();
    assert_eq!(run_tool("fsck", &m, &[]).0, 0);
    // As a layer written before partial files were guarded.
    for key in [
        "trusted.overlay.metacopy",
        "trusted.overlay.redirect",
        "user.overlay.metacopy",
    ] {
        assert!(get_xattr(&m.upper.join("f"), key).is_some(), "{key} set");
        sh(&format!(
            "setfattr -x {key} {}",
            m.upper.join("f").display()
        ));
    }
    assert!(
        kernel_overlayfs_reads(&m, "f", "").is_ok(),
        "unguarded: read (wrongly)"
    );
    let (status, out) = run_tool("fsck", &m, &[]);
    assert_eq!(status, 4, "{out}");
    assert!(
        out.contains("upper /f: a partial file without trusted.overlay.metacopy"),
        "{out}"
    );
    let (status, out) = run_tool("fsck", &m, &["--repair"]);
    assert_eq!(status, 1, "repaired: {out}");
    assert_eq!(run_tool("fsck", &m, &[]).0, 0);
    assert_eq!(
        kernel_overlayfs_reads(&m, "f", "").map(|_| ()),
        Err(libc::EPERM)
    );
}

/// `line` without the value of `field` (the word after it).
fn without(line: &str, field: &str) -> String {
    let mut words: Vec<&str> = line.split(' ').collect();
    if let Some(i) = words.iter().position(|w| *w == field) {
        words.drain(i..(i + 2).min(words.len()));
    }
    words.join(" ")
}

/// A kill while a block is being written back leaves that file's mtime at the time of the kill
/// (a write to the upper file sets it; the fill puts it back only after the write), which
/// docs/FORMAT.md states; everything else is exact.
#[test]
fn complete_killed_and_run_again_gives_the_same_layer() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let no_mtime =
        |snap: Vec<String>| -> Vec<String> { snap.iter().map(|l| without(l, "mtime")).collect() };
    let mut m = Mount::new(1);
    for i in 0..4 {
        write(m.lower(0).join(format!("f{i}")), pattern(48 << 20, i));
    }
    m.mount();
    for i in 0..4 {
        write_at(m.path(&format!("f{i}")), 4096 * (i + 1), b"changed");
    }
    let seen = snapshot(&m.mnt);
    m.unmount();
    for delay_ms in [30, 150] {
        let mut args = vec!["complete".to_string()];
        args.extend(layer_args(&m, true));
        let mut child = Command::new(BIN).args(&args).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill();
        child.wait().unwrap();
        // Whatever the kill interrupted, the layer mounts and shows the same tree.
        m.mount();
        assert_eq!(
            no_mtime(snapshot(&m.mnt)),
            no_mtime(seen.clone()),
            "after a kill at {delay_ms} ms"
        );
        m.unmount();
    }
    let (status, out) = run_tool("complete", &m, &[]);
    assert_eq!(status, 0, "{out}");
    assert_eq!(own_xattrs(&m.upper), Vec::<String>::new());
    assert_eq!(no_mtime(snapshot_with("overlay", &m, "")), no_mtime(seen));
}

#[test]
fn fsck_reports_each_problem_with_its_path_and_repairs_what_it_can() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    write(m.lower(0).join("big"), pattern(4 << 20, 9));
    fs::create_dir(m.lower(0).join("dir")).unwrap();
    m.mount();
    write_at(m.path("big"), 8192, b"x");
    fs::rename(m.path("dir"), m.path("moved")).unwrap();
    m.unmount();
    let mark = get_xattr(&m.upper.join("big"), "trusted.mosaicfs.partial").unwrap();
    assert_eq!(run_tool("fsck", &m, &[]).0, 0);

    // What mounts ignore anyway, and what a crash leaves: found, and repaired.
    set_xattr(
        &m.upper.join("big"),
        "trusted.mosaicfs.origin",
        b"not a number",
    );
    set_xattr(
        &m.upper.join("moved"),
        "trusted.mosaicfs.redirect",
        b"a/../b",
    );
    write(m.work.join("mosaicfs-work/copyup-1-2"), b"left by a crash");
    // A crash between the `.wh.` whiteout and the move of a removal (where whiteouts are
    // `.wh.` files, dir.rs makes the whiteout first): the whiteout beside its name.
    write(m.upper.join(".wh.big"), b"");
    write(m.upper.join(".wh.gone"), b"");
    let (status, out) = run_tool("fsck", &m, &[]);
    assert_eq!(status, 4, "{out}");
    assert!(
        out.contains("upper /.wh.big: a whiteout beside \"big\""),
        "{out}"
    );
    assert!(
        !out.contains(".wh.gone"),
        "a whiteout alone is no problem: {out}"
    );
    assert!(
        out.contains("upper /big: trusted.mosaicfs.origin is not a number"),
        "{out}"
    );
    assert!(
        out.contains("upper /moved: trusted.mosaicfs.redirect 'a/../b'"),
        "{out}"
    );
    assert!(
        out.contains("work mosaicfs-work/copyup-1-2: left by an operation"),
        "{out}"
    );
    assert!(out.contains("4 problems (run with --repair"), "{out}");
    let (status, out) = run_tool("fsck", &m, &["--repair"]);
    assert_eq!(status, 1, "all repaired: {out}");
    assert_eq!(run_tool("fsck", &m, &[]).0, 0);
    assert!(!m.work.join("mosaicfs-work/copyup-1-2").exists());
    assert!(!m.upper.join(".wh.big").exists() && m.upper.join(".wh.gone").exists());
    assert_eq!(
        get_xattr(&m.upper.join("big"), "trusted.mosaicfs.partial"),
        Some(mark.clone()),
        "repair leaves the mark"
    );

    // A damaged mark: reported, never guessed at.
    set_xattr(
        &m.upper.join("big"),
        "trusted.mosaicfs.partial",
        b"v2\ngarbage",
    );
    let (status, out) = run_tool("fsck", &m, &["--repair"]);
    assert_eq!(status, 4, "{out}");
    assert!(
        out.contains("upper /big: damaged partial-file mark"),
        "{out}"
    );
    assert_eq!(
        get_xattr(&m.upper.join("big"), "trusted.mosaicfs.partial").as_deref(),
        Some(&b"v2\ngarbage"[..])
    );

    // A lower file that changed under the partial file.
    set_xattr(&m.upper.join("big"), "trusted.mosaicfs.partial", &mark);
    write_at(m.lower(0).join("big"), 0, b"changed below");
    let (status, out) = run_tool("fsck", &m, &[]);
    assert_eq!(status, 4, "{out}");
    assert!(out.contains("upper /big: its lower file"), "{out}");
    assert!(
        out.contains("changed since the partial file was made"),
        "{out}"
    );
}

#[test]
fn the_tools_refuse_layers_a_mount_is_using_and_bad_arguments() {
    let mut m = Mount::with(|l| write(l.join("f"), b"f"));
    for cmd in ["fsck", "complete"] {
        let started = std::time::Instant::now();
        let (status, out) = run_tool(cmd, &m, &[]);
        assert_eq!(status, 8, "{cmd}: {out}");
        let serving = format!(
            "is in use by the mosaicfs daemon serving '{}' (PID {} ",
            m.mnt.display(),
            m.pid()
        );
        assert!(out.contains(&serving), "{out}");
        assert!(out.contains("unmount it first"), "{out}");
        // A live mount is no reason to wait: it will not go away by itself.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{cmd} waited"
        );
    }
    m.unmount();
    if !disk_upper() {
        // fsck and complete are for disk layers (tests/memory.rs checks what fsck says).
        return;
    }
    assert_eq!(run_tool("fsck", &m, &[]).0, 0);
    let out = tool(&["complete", "--upperdir=/nonexistent"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--lowerdir=DIR"));
    let mut args = vec!["complete".to_string()];
    args.extend(layer_args(&m, false));
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let out = tool(&a);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--workdir=DIR is needed"));
    let missing: PathBuf = m.dir.path().join("missing");
    let out = tool(&[
        "fsck",
        &format!("--lowerdir={}", missing.display()),
        &format!("--upperdir={}", m.upper.display()),
    ]);
    assert_eq!(out.status.code(), Some(8));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not exist"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `umount` returns before the daemon has written back and let go of the work dir: a tool run
/// right after it waits for the daemon instead of failing ("is in use"), and one kept waiting
/// by another process says which.
#[test]
fn the_tools_wait_for_a_daemon_that_is_letting_go_after_umount() {
    if !disk_upper() {
        return;
    }
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), pattern(8 << 20, 8));
    for round in 0..20 {
        m.mount();
        write_at(m.path("f"), round * 4096, b"w");
        write(m.path(&format!("new{round}")), b"n");
        let daemon = m.take_daemon();
        sh(&format!("umount {}", m.mnt.display()));
        let cmd = if round % 2 == 0 { "fsck" } else { "complete" };
        let (status, out) = run_tool(cmd, &m, &[]);
        assert_eq!(status, 0, "round {round}: {cmd} right after umount: {out}");
        let out = daemon.wait_with_output().unwrap();
        assert!(out.status.success(), "round {round}");
    }
    // Another process holds the lock for a moment: the tool names it, waits, then runs.
    let lock = m.work.join("mosaicfs-work");
    let holder = std::process::Command::new("flock")
        .arg(&lock)
        .args(["sleep", "1.5"])
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (status, out) = run_tool("fsck", &m, &[]);
    assert_eq!(status, 0, "{out}");
    assert!(
        out.contains(&format!("is still used by PID {} 'flock ", holder.id())),
        "{out}"
    );
    assert!(out.contains("waiting up to 15 s"), "{out}");
    let _ = holder.wait_with_output();
}

/// Two file systems made alike give their work dirs the same inode number: a mount waiting for
/// the process that holds its own work dir's lock must not blame the daemon of a live mount of
/// the other one (an xfstests cycle mount of the scratch overlay failed at once, "in use by
/// the mosaicfs daemon serving .../test", while its own previous daemon was still exiting).
#[test]
fn a_mount_waits_for_its_own_lock_holder_not_a_daemon_on_a_look_alike_file_system() {
    let base = tempfile::tempdir().unwrap();
    let (a_dir, b_dir) = (base.path().join("a"), base.path().join("b"));
    fs::create_dir(&a_dir).unwrap();
    fs::create_dir(&b_dir).unwrap();
    let a_fs = Tmpfs::mount(&a_dir, "16m");
    let b_fs = Tmpfs::mount(&b_dir, "16m");
    // The same steps on both: the same inode numbers.
    let mut a = Mount::new_in(&a_dir, 1);
    let mut b = Mount::new_in(&b_dir, 1);
    b.mount();
    b.unmount();
    a.mount();
    let lock = b.work.join("mosaicfs-work");
    let ino = |p: &Path| fs::metadata(p).unwrap().ino();
    assert_eq!(
        ino(&lock),
        ino(&a.work.join("mosaicfs-work")),
        "the premise: fresh tmpfs number their inodes alike"
    );
    let holder = std::process::Command::new("flock")
        .arg(&lock)
        .args(["sleep", "1"])
        .spawn()
        .unwrap();
    let holder_pid = holder.id();
    std::thread::sleep(std::time::Duration::from_millis(200));
    b.mount();
    let _ = holder.wait_with_output();
    write(b.path("f"), b"b");
    let said = b.unmount();
    assert!(
        said.contains(&format!("is still used by PID {holder_pid} 'flock ")),
        "{said}"
    );
    assert!(!said.contains(&format!("PID {}", a.pid())), "{said}");
    a.unmount();
    drop((a, b));
    a_fs.unmount().unwrap();
    b_fs.unmount().unwrap();
}

/// `mosaicfs status --json` and `--prometheus`: requests by opcode with their times, errors by
/// errno, partial files and the blocks block-level copy-up did not copy.
#[test]
fn status_reports_metrics_as_json_and_prometheus_text() {
    let m = Mount::with(|l| {
        write(l.join("big"), pattern(4 << 20, 5));
        write(l.join("d/f"), b"f");
    });
    // Held open: the partial files counted are those the daemon holds.
    let open = fs::OpenOptions::new()
        .write(true)
        .open(m.path("big"))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&open, b"x", 8192).unwrap();
    let _ = fs::metadata(m.path("d/f"));
    assert_eq!(errno_of(fs::remove_dir(m.path("d"))), libc::ENOTEMPTY);
    let mnt = m.mnt.display().to_string();
    let out = tool(&["status", &mnt, "--json"]);
    assert!(out.status.success());
    let json = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        json.starts_with('{') && json.trim_end().ends_with('}'),
        "{json}"
    );
    assert!(json.contains("\"LOOKUP\": {\"count\": "), "{json}");
    assert!(json.contains("\"ENOTEMPTY\": 1"), "{json}");
    assert!(
        json.contains("\"blocks_present\": 1, \"blocks_total\": 1024"),
        "{json}"
    );
    assert!(
        json.contains(&format!("\"bytes_not_copied\": {}", 1023 * 4096)),
        "{json}"
    );
    let out = tool(&["status", "--prometheus", &mnt]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("mosaicfs_errors_total{errno=\"ENOTEMPTY\"} 1"),
        "{text}"
    );
    assert!(text.contains("mosaicfs_partial_files 1"), "{text}");
    // Buckets are cumulative and end at the count.
    let bucket = |l: &str| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap();
    let lookups: Vec<u64> = text
        .lines()
        .filter(|l| l.starts_with("mosaicfs_request_duration_seconds_bucket{op=\"LOOKUP\""))
        .map(bucket)
        .collect();
    assert!(lookups.windows(2).all(|w| w[0] <= w[1]), "{text}");
    let count = text
        .lines()
        .find(|l| l.starts_with("mosaicfs_request_duration_seconds_count{op=\"LOOKUP\"}"))
        .map(bucket)
        .unwrap();
    assert!(count >= 2 && lookups.last() == Some(&count), "{text}");
}

fn layers_py() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/export/layers.py")
}

/// `mosaicfs export`: the upper layer as an OCI layer tar, from the live mount and from the
/// unmounted dirs, byte for byte the same; applied over the lower layer (by an independent
/// reader, Python's tarfile) it gives exactly the tree the mount showed; GNU tar reads it too,
/// and the file with holes stays sparse.
#[test]
fn export_gives_the_merged_view_as_an_oci_layer_live_and_offline() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    let l = m.lower(0).to_path_buf();
    write(l.join("holes"), b"");
    sh(&format!(
        "truncate -s 64M {0} && printf data | dd of={0} bs=1 seek=30000000 conv=notrunc status=none",
        l.join("holes").display()
    ));
    write(l.join("opaque/old"), b"old");
    write(l.join("linked"), b"two names");
    fs::hard_link(l.join("linked"), l.join("linked2")).unwrap();
    container_changes(&mut m);
    write_at(m.path("holes"), 50_000_000, b"more data");
    fs::remove_dir_all(m.path("opaque")).unwrap();
    write(m.path("opaque/new"), b"new");
    let long_dir = "d".repeat(90);
    let long_file = "f".repeat(120);
    write(m.path(&format!("{long_dir}/{long_file}")), b"a long name");
    std::os::unix::fs::symlink("t".repeat(200), m.path("longlink")).unwrap();
    sh(&format!("mkfifo {}", m.path("fifo").display()));
    sh(&format!("mknod {} c 1 3", m.path("null").display()));
    write(m.path("bigid"), b"id");
    std::os::unix::fs::chown(m.path("bigid"), Some(3_000_000), Some(3_000_001)).unwrap();
    std::os::unix::fs::chown(m.path("linked2"), Some(7), None).unwrap();
    set_xattr(&m.path("newdir"), "user.dir", b"attr");

    let dir = m.dir.path().to_path_buf();
    let live = dir.join("live.tar");
    let out = tool(&[
        "export",
        m.mnt.to_str().unwrap(),
        "-o",
        live.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("1 sparse files"), "{said}");
    assert!(said.contains("2 hard links"), "{said}");
    m.unmount();
    let offline = |extra: &[&str]| {
        let mut args = vec!["export".to_string(), "-q".into()];
        args.extend(layer_args(&m, false));
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = Command::new(BIN).args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stderr.is_empty(),
            "-q: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let listing = |tar: &[u8]| {
        let path = dir.join("listing.tar");
        fs::write(&path, tar).unwrap();
        sh(&format!("tar --full-time -tvf {}", path.display()))
    };
    let (a, b) = (offline(&[]), fs::read(&live).unwrap());
    assert!(
        a == b,
        "offline and live exports differ:\n{}\n{}",
        listing(&a),
        listing(&b)
    );
    let gz = dir.join("layer.tar.gz");
    let work = format!("--workdir={}", m.work.display());
    let mut args = vec![work.as_str(), "-o", gz.to_str().unwrap()];
    offline(&args);
    let gunzipped = Command::new("gzip").arg("-dc").arg(&gz).output().unwrap();
    assert!(gunzipped.stdout == fs::read(&live).unwrap());
    let zst = dir.join("layer.tar.zst");
    args[2] = zst.to_str().unwrap();
    offline(&args);
    let out = Command::new("python3")
        .args(["-c", "import sys; sys.exit(0 if open(sys.argv[1],'rb').read(4) == b'\\x28\\xb5\\x2f\\xfd' else 1)"])
        .arg(&zst)
        .status()
        .unwrap();
    assert!(out.success(), "not a zstd frame");
    // Exporting changed nothing: the layer is clean. (Compared after the exports: a lookup
    // through the mount links a copied-up hard link's lower name into the upper layer.)
    assert_eq!(run_tool("fsck", &m, &[]).0, 0);
    m.mount();
    let lower_tar = dir.join("lower.tar");
    sh(&format!(
        "tar --xattrs --xattrs-include='*' -cf {} -C {} .",
        lower_tar.display(),
        l.display()
    ));
    let mnt = m.mnt.clone();
    let check = |tar: &Path| {
        let out = Command::new("python3")
            .arg(layers_py())
            .args(["compare-dir", mnt.to_str().unwrap()])
            .args([&lower_tar, tar])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    check(&live);
    // Without the changes the check fails: it is not vacuous.
    let bare = Command::new("python3")
        .arg(layers_py())
        .args(["compare-dir", m.mnt.to_str().unwrap()])
        .arg(&lower_tar)
        .output()
        .unwrap();
    assert!(!bare.status.success());
    // GNU tar extracts it, the file with holes sparse.
    let ext = dir.join("extracted");
    fs::create_dir(&ext).unwrap();
    sh(&format!(
        "tar --xattrs --xattrs-include='user.*' -xpf {} -C {}",
        live.display(),
        ext.display()
    ));
    assert_eq!(
        fs::read(ext.join("holes")).unwrap(),
        fs::read(m.path("holes")).unwrap()
    );
    assert!(allocated(&ext.join("holes")) < 1 << 20);
    assert_eq!(
        fs::read_link(ext.join("longlink")).unwrap(),
        PathBuf::from("t".repeat(200))
    );
    assert_eq!(fs::metadata(ext.join("bigid")).unwrap().uid(), 3_000_000);
    assert_eq!(
        get_xattr(&ext.join("x"), "user.k").as_deref(),
        Some(&b"v"[..])
    );
}

/// An export reads a big file a megabyte at a time: under a 256 MiB address-space limit it
/// exports a 1 GiB partial file (10 GiB measured by hand: docs/PERFORMANCE.md).
#[test]
fn export_memory_stays_bounded_for_a_big_file() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let mut m = Mount::new(1);
    sh(&format!(
        "head -c 1G /dev/urandom > {}",
        m.lower(0).join("big").display()
    ));
    m.mount();
    write_at(m.path("big"), 1 << 29, b"changed");
    m.unmount();
    // A null device of the test's own: an output that is not a regular file is written in
    // place, never replaced by a renamed temporary file (which once replaced /dev/null).
    let null = m.dir.path().join("null");
    sh(&format!("mknod {} c 1 3", null.display()));
    let mut args = vec![
        "--as=268435456".to_string(),
        BIN.to_string(),
        "export".into(),
        "-q".into(),
        "-o".into(),
        null.display().to_string(),
    ];
    args.extend(layer_args(&m, false));
    let out = Command::new("prlimit").args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    use std::os::unix::fs::FileTypeExt;
    assert!(fs::metadata(&null).unwrap().file_type().is_char_device());
}

#[test]
fn export_refuses_bad_arguments_and_a_layer_in_use_and_leaves_no_partial_archive() {
    let mut m = Mount::with(|l| write(l.join("f"), b"f"));
    let archive = m.dir.path().join("out.tar");
    let (status, out) = run_tool("export", &m, &["-o", archive.to_str().unwrap()]);
    assert_eq!(status, 1, "{out}");
    assert!(
        out.contains("is in use") && out.contains("mosaicfs export MOUNTPOINT"),
        "{out}"
    );
    m.unmount();
    for (args, says) in [
        (vec!["export"], "nothing to export"),
        (vec!["export", "/a", "/b"], "unexpected argument"),
        (vec!["export", "--bogus"], "unknown argument"),
        (
            vec!["export", "--gzip", "--zstd", "/mnt"],
            "choose one compression",
        ),
        (vec!["export", "--lowerdir=/l"], "no upper layer given"),
        (
            vec!["export", "-o", "/tmp/layer.tar.xz", "/mnt"],
            "names .xz compression, which export does not write",
        ),
    ] {
        let out = tool(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(says) && err.contains("usage:"),
            "{args:?}: {err}"
        );
    }
    let out = tool(&[
        "export",
        m.dir.path().to_str().unwrap(),
        "-o",
        archive.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a mount point"));
    let missing = m.dir.path().join("missing");
    let out = tool(&[
        "export",
        &format!("--lowerdir={}", m.lower(0).display()),
        &format!("--upperdir={}", missing.display()),
        "-o",
        archive.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    // Neither the archive nor its temporary file is left behind.
    assert_eq!(
        names(m.dir.path())
            .iter()
            .filter(|n| n.contains("out.tar"))
            .count(),
        0
    );
}

fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// `metrics=ADDR`: the daemon serves the Prometheus text over HTTP; an address it cannot
/// listen on fails the mount with a line saying so.
#[test]
fn metrics_option_serves_prometheus_text_over_http() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let mut m = Mount::new(1);
    write(m.lower(0).join("f"), pattern(4 << 20, 6));
    m.extra.push(format!("metrics={addr}"));
    m.mount();
    // Read-write: served by the daemon, so that a WRITE request is counted (a write-only
    // writer would pass through). Held open: the partial files counted are those the daemon
    // holds.
    let open = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&open, b"L", 8192).unwrap();
    let page = http_get(&addr, "/metrics");
    assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
    assert!(
        page.contains("Content-Type: text/plain; version=0.0.4"),
        "{page}"
    );
    assert!(
        page.contains("mosaicfs_request_duration_seconds_count{op=\"WRITE\"}"),
        "{page}"
    );
    assert!(page.contains("mosaicfs_partial_files 1"), "{page}");
    assert!(http_get(&addr, "/nothing").starts_with("HTTP/1.1 404"));
    // A request is counted before its reply leaves the daemon: a scrape right after each
    // mkdir returns counts it (it once raced the count and missed the series).
    for i in 1..=300 {
        fs::create_dir(m.path(&format!("d{i}"))).unwrap();
        let page = http_get(&addr, "/metrics");
        assert!(
            page.contains(&format!(
                "mosaicfs_request_duration_seconds_count{{op=\"MKDIR\"}} {i}\n"
            )),
            "mkdir {i} not counted when it returned: {page}"
        );
    }
    // A second mount asking for the same address (Podman passes one mountopt to every
    // container) mounts, without an endpoint of its own, and says so.
    let mut other = Mount::new(1);
    let opts = format!("{},metrics={addr}", other.options());
    let out = tool(&["-o", &opts, other.mnt.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!("metrics={addr}: in use")) && err.contains("mosaicfs metrics"),
        "{err}"
    );
    assert!(is_mounted(&other.mnt));
    write(other.path("f"), b"second");

    // One endpoint for every mount, each series labelled with its mount point.
    let port2 = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let all = format!("127.0.0.1:{port2}");
    let mut server = Command::new(BIN)
        .args(["metrics", "--listen", &all])
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let page = loop {
        match std::net::TcpStream::connect(&all) {
            Ok(_) => break http_get(&all, "/metrics"),
            Err(_) if start.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("metrics --listen {all}: {e}"),
        }
    };
    let _ = server.kill();
    let _ = server.wait();
    assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
    for mount in [&m.mnt, &other.mnt] {
        let series = format!(
            "mosaicfs_request_duration_seconds_count{{mount=\"{}\",op=\"LOOKUP\"}}",
            mount.display()
        );
        assert!(page.contains(&series), "{series} in {page}");
    }
    assert!(page.contains(&format!(
        "mosaicfs_partial_files{{mount=\"{}\"}} 1",
        m.mnt.display()
    )));
    assert_eq!(
        page.matches("# TYPE mosaicfs_request_duration_seconds histogram")
            .count(),
        1,
        "each family's TYPE once: {page}"
    );
    let answered: u64 = page
        .lines()
        .find_map(|l| l.strip_prefix("mosaicfs_mounts_answered "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(answered >= 2, "{page}");
    // Mounted in the background, not by `Mount`: unmounted here.
    sh(&format!("umount {}", other.mnt.display()));

    // A malformed address still fails the mount.
    let out = tool(&[
        "-o",
        &format!("{},metrics=localhost", other.options()),
        other.mnt.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("takes an address and port"));
    other.extra.clear();
    drop(open);
    m.unmount();
}

/// Requests of opcode `op` the mount has served (`status --json`).
fn served_requests(m: &Mount, op: &str) -> u64 {
    let out = tool(&["status", m.mnt.to_str().unwrap(), "--json"]);
    let json = String::from_utf8_lossy(&out.stdout).into_owned();
    json.split(&format!("\"{op}\": {{\"count\": "))
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .map_or(0, |n| n.parse().unwrap())
}

/// Upper objects stay in the kernel's cache for `timeout=`, 60 s by default, as fuse-overlayfs'
/// entries do (kernel overlayfs has no timeout at all): with the old default of 1 s, `git status`
/// of a 2,000-file clone a few seconds after the last took 2.5x fuse-overlayfs' time, every
/// file looked up again.
#[test]
fn upper_objects_stay_cached_past_a_second_by_default() {
    let mut m = Mount::new(1);
    m.mount();
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/u"), b"upper").unwrap();
    // Held open, so that the kernel keeps the names and the inode whatever the memory
    // pressure: what is measured is the timeout, not the reclaim.
    let held = fs::File::open(m.path("d/u")).unwrap();
    let _ = fs::metadata(m.path("d/u")).unwrap();
    let asked = |m: &Mount| served_requests(m, "LOOKUP") + served_requests(m, "GETATTR");
    let before = asked(&m);
    std::thread::sleep(Duration::from_millis(1300));
    let _ = fs::metadata(m.path("d/u")).unwrap();
    assert_eq!(asked(&m), before, "the stat went to the daemon");
    drop(held); // an open file would keep the daemon after the unmount
    m.unmount();
}

/// Entries and attributes of lower-only objects stay in the kernel's cache for `lower_cache=`
/// past `timeout=`: a second stat after the timeout looks nothing up.
#[test]
fn lower_only_objects_stay_cached_for_lower_cache() {
    for (extra, cached) in [
        ("timeout=1,lower_cache=60", true),
        ("timeout=60,lower_cache=0.5", false),
    ] {
        let mut m = Mount::new(1);
        write(m.lower(0).join("f"), b"lower");
        m.extra.push(extra.into());
        m.mount();
        // Held open: the kernel keeps the name whatever the memory pressure, and only its
        // timeout sends it back to the daemon.
        let held = fs::File::open(m.path("f")).unwrap();
        let _ = fs::metadata(m.path("f")).unwrap();
        // (The root, an upper directory, has its attributes fetched again after 1 s: LOOKUPs
        // alone tell whether the kernel went back to the daemon for the name.)
        let before = served_requests(&m, "LOOKUP");
        std::thread::sleep(Duration::from_millis(1300));
        let _ = fs::metadata(m.path("f")).unwrap();
        let after = served_requests(&m, "LOOKUP");
        assert_eq!(
            after == before,
            cached,
            "{extra:?}: {before} then {after} requests"
        );
        drop(held);
        m.unmount();
    }
}

/// A daemon binds its control socket just after its mount appears: `mosaicfs status` run in
/// that window (right after a foreground mount) waits for the socket instead of saying no
/// daemon answers (seen on a busy machine; here the window is widened to 600 ms).
#[test]
fn status_right_after_a_foreground_mount_waits_for_the_control_socket() {
    let mut m = Mount::new(1);
    m.env
        .push(("MOSAICFS_TEST_SLOW_CONTROL".into(), "600".into()));
    m.mount();
    let out = tool(&["status", m.mnt.to_str().unwrap()]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("mount: "),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
