//! The two implementations of the upper interface held to the same answers: random
//! operations on a directory of a real file system and on a memory store, every result
//! (value or errno) compared, and the two trees compared every few steps.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rustix::fs::{Mode, OFlags, RenameFlags};

use super::*;
use crate::memory_upper::{MemoryUpper, ROOT};

fn n(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn pair() -> (tempfile::TempDir, UpperDir, UpperDir) {
    let tmp = tempfile::tempdir().unwrap();
    let fd: OwnedFd = rustix::fs::open(
        tmp.path(),
        OFlags::RDONLY | OFlags::DIRECTORY,
        Mode::empty(),
    )
    .unwrap();
    let store = rustix::fs::memfd_create("upper-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mem = Arc::new(MemoryUpper::new_volatile(store, None).unwrap());
    (
        tmp,
        UpperDir::Disk(Arc::new(fd)),
        UpperDir::Memory(mem.clone(), mem.node(ROOT).unwrap()),
    )
}

/// What a tree shows, comparable across the two: per path the kind, permission bits, link
/// count, size (files), owner, device number, target or contents, user and trusted xattrs,
/// and which 4 KiB blocks hold data.
fn describe(root: &UpperDir) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![(root.clone(), String::new())];
    while let Some((dir, path)) = todo.pop() {
        for e in dir.read_dir().unwrap() {
            let name = e.name.to_string_lossy().into_owned();
            let p = format!("{path}/{name}");
            let a = dir.stat_at(&e.name).unwrap();
            let mut xattrs: Vec<_> = dir
                .list_xattr(Some(&e.name))
                .unwrap()
                .into_iter()
                .filter(|k| {
                    let k = k.to_string_lossy();
                    k.starts_with("user.") || k.starts_with("trusted.")
                })
                .map(|k| {
                    let v = dir.get_xattr(Some(&e.name), &k.to_string_lossy()).unwrap();
                    format!("{}={v:?}", k.to_string_lossy())
                })
                .collect();
            xattrs.sort();
            let size = if a.is_dir() { 0 } else { a.size };
            let mut line = format!(
                "{p} type={:o} mode={:o} nlink={} size={size} uid={} gid={} rdev={} xattrs={xattrs:?}",
                a.file_type(),
                a.mode & 0o7777,
                a.nlink,
                a.uid,
                a.gid,
                a.rdev
            );
            if a.is_dir() {
                todo.push((dir.open_dir(&e.name).unwrap(), p));
            } else if a.is_symlink() {
                line += &format!(" -> {:?}", dir.read_link(&e.name).unwrap());
            } else if a.is_reg() {
                let f = dir.open_file(&e.name).unwrap();
                let mut data = vec![0u8; a.size as usize];
                assert_eq!(f.read_at(&mut data, 0).unwrap(), data.len());
                let sum: u64 = data
                    .iter()
                    .enumerate()
                    .map(|(i, b)| (i as u64 + 1) * *b as u64)
                    .sum();
                let blocks: Vec<u64> = (0..a.size.div_ceil(4096))
                    .filter(|k| f.seek_data(k * 4096).unwrap() == Some(k * 4096))
                    .collect();
                line += &format!(" sum={sum} data-blocks={blocks:?}");
            }
            out.push(line);
        }
    }
    out.sort();
    out
}

const NAMES: [&str; 4] = ["a", "b", "c", "d"];

/// One random operation, described, run on `root` and its subdirectories; the result as text.
fn step(rng: &mut rand::rngs::StdRng, root: &UpperDir, umask: u32) -> (String, String) {
    let pick = |rng: &mut rand::rngs::StdRng| n(NAMES[rng.gen_range(0..NAMES.len())]);
    // Work in the root or in a subdirectory "a" / "b" when there is one.
    let mut dirs = vec![("".to_string(), root.clone())];
    for sub in ["a", "b"] {
        if let Ok(d) = root.open_dir(n(sub)) {
            dirs.push((sub.to_string(), d));
        }
    }
    let (dname, dir) = dirs[rng.gen_range(0..dirs.len())].clone();
    let (d2name, dir2) = dirs[rng.gen_range(0..dirs.len())].clone();
    let name = pick(rng);
    let name2 = pick(rng);
    let c = Creation {
        mode: [0o755, 0o644, 0o600, 0o4755][rng.gen_range(0..4)],
        umask,
        uid: 0,
        gid: 0,
    };
    let show = |r: Result<()>| match r {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("errno {}", e.errno()),
    };
    let op = rng.gen_range(0..16);
    let what = format!(
        "op {op} in '{dname}' on {name:?} / '{d2name}' {name2:?} mode {:o}",
        c.mode
    );
    let result = match op {
        0 => show(dir.mkdir(name, &c)),
        1 => show(dir.mknod(
            name,
            &Creation {
                mode: libc::S_IFIFO | 0o644,
                ..c
            },
            0,
        )),
        2 => show(dir.mknod(
            name,
            &Creation {
                mode: libc::S_IFCHR,
                ..c
            },
            0,
        )),
        3 => show(dir.symlink(n("target/x"), name, &c)),
        4 => show(dir.create(name, &c).and_then(|f| f.write_at(b"created", 0))),
        5 => show(dir.unlink(name)),
        6 => show(dir.rmdir(name)),
        7 => {
            let flags = [
                RenameFlags::empty(),
                RenameFlags::NOREPLACE,
                RenameFlags::EXCHANGE,
            ][rng.gen_range(0..3)];
            show(dir.rename(name, &dir2, name2, flags))
        }
        8 => show(dir.link(name, &dir2, name2)),
        9 => show(dir.set_xattr(
            Some(name),
            n("trusted.overlay.opaque"),
            b"y",
            [0, libc::XATTR_CREATE, libc::XATTR_REPLACE][rng.gen_range(0..3)],
        )),
        10 => show(dir.remove_xattr(Some(name), n("trusted.overlay.opaque"))),
        11 => show(dir.chmod(Some(name), [0o700, 0o2755, 0o640][rng.gen_range(0..3)])),
        12 => show(dir.chown(Some(name), Some(rng.gen_range(0..3)), None)),
        _ => {
            let off = rng.gen_range(0..6 * 4096);
            let len = rng.gen_range(1..3 * 4096);
            let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ op as u8).collect();
            show(dir.open_file(name).and_then(|f| match op {
                13 => f.write_at(&data, off),
                14 => f.truncate(off),
                _ => f.punch_hole(off, len as u64),
            }))
        }
    };
    (what, result)
}

#[test]
fn memory_and_disk_give_the_same_answers() {
    let umask = {
        let old = crate::sys::set_umask(0o022);
        crate::sys::set_umask(old);
        old
    };
    for seed in 0..30u64 {
        let (_tmp, disk, mem) = pair();
        let mut r1 = rand::rngs::StdRng::seed_from_u64(seed);
        let mut r2 = rand::rngs::StdRng::seed_from_u64(seed);
        for i in 0..600 {
            let (what, on_disk) = step(&mut r1, &disk, umask);
            let (_, in_memory) = step(&mut r2, &mem, umask);
            assert_eq!(in_memory, on_disk, "seed {seed} step {i}: {what}");
            if i % 20 == 19 {
                assert_eq!(
                    describe(&mem),
                    describe(&disk),
                    "seed {seed} after step {i}"
                );
            }
        }
    }
}
