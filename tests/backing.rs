//! Partial files on the upper file systems container storage uses: XFS and btrfs (loop images),
//! besides the ext4 and tmpfs of the other tests. A seeded run of unaligned writes and reads
//! against a model, with copy-after-write on and lazy, then a remount. Where the lower layer
//! shares the file system, copy-up clones the lower file instead (reflink).

mod common;

use std::fs;
use std::os::unix::fs::FileExt;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn check_on(fs_type: &str, mkfs: &str) {
    let dir = tempfile::Builder::new()
        .prefix("mosaicfs-backing")
        .tempdir_in("/var/tmp")
        .unwrap();
    let p = dir.path();
    for d in ["lower", "mnt"] {
        fs::create_dir(p.join(d)).unwrap();
    }
    let up = LoopFs::new(mkfs, 512 << 20);
    let mut rng = StdRng::seed_from_u64(99);
    let mut base = vec![0u8; 3 << 20];
    rng.fill(&mut base[..]);
    write(p.join("lower/f"), &base);
    for workers in [2, 0] {
        let (u, w) = (
            up.path.join(format!("u{workers}")),
            up.path.join(format!("w{workers}")),
        );
        fs::create_dir(&u).unwrap();
        fs::create_dir(&w).unwrap();
        let opts = format!(
            "lowerdir={},upperdir={},workdir={},caw_workers={workers},complete_after=0,complete_ratio=0",
            p.join("lower").display(),
            u.display(),
            w.display()
        );
        let mut m = Mount::new(0);
        m.mnt = p.join("mnt");
        m.mount_with(&opts);
        let mut model = base.clone();
        for i in 0..1500 {
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(m.path("f"))
                .unwrap();
            let mut off = rng.gen_range(0..model.len() + 5000);
            if rng.gen_bool(0.5) {
                off = (off / 4096 * 4096 + rng.gen_range(0..7)).saturating_sub(3);
            }
            let mut data = vec![0u8; rng.gen_range(1..9000)];
            rng.fill(&mut data[..]);
            f.write_all_at(&data, off as u64).unwrap();
            if model.len() < off + data.len() {
                model.resize(off + data.len(), 0);
            }
            model[off..off + data.len()].copy_from_slice(&data);
            if i % 100 == 99 {
                assert!(
                    fs::read(m.path("f")).unwrap() == model,
                    "{fs_type}: mismatch after {i} writes"
                );
            }
        }
        m.unmount();
        assert!(fs::metadata(u.join("f")).unwrap().len() == model.len() as u64);
        m.mount_with(&opts);
        assert!(
            fs::read(m.path("f")).unwrap() == model,
            "{fs_type}: mismatch after remount"
        );
        m.unmount();
    }
}

#[test]
fn partial_files_on_an_xfs_upper() {
    if !runs_on_disk_upper_only() {
        return;
    }
    check_on("xfs", "mkfs.xfs -q -f");
}

#[test]
fn partial_files_on_a_btrfs_upper() {
    if !runs_on_disk_upper_only() {
        return;
    }
    check_on("btrfs", "mkfs.btrfs -q -f");
}

/// Lower and upper on one XFS or btrfs: opening a lower file for writing clones it (O(1)), the
/// open itself is served by passthrough, no write reaches the daemon, and the upper file is
/// complete (no partial mark) and shares the lower file's extents. `reflink=0` keeps the
/// partial file.
fn clones_on(mkfs: &str) {
    use std::os::unix::fs::MetadataExt;
    let lfs = LoopFs::new(mkfs, 512 << 20);
    let mut m = Mount::new_in(&lfs.path, 1);
    let mut rng = StdRng::seed_from_u64(7);
    let mut base = vec![0u8; 64 << 20];
    rng.fill(&mut base[..]);
    write(m.lower(0).join("f"), &base);
    let mut g = base[..1 << 20].to_vec();
    write(m.lower(0).join("g"), &g);
    m.mount();
    let free = || {
        rustix::fs::sync();
        let st = rustix::fs::statvfs(&lfs.path).unwrap();
        st.f_bfree * st.f_bsize
    };
    let free_before = free();
    write_at(m.path("f"), 1000, b"changed");
    base[1000..1007].copy_from_slice(b"changed");
    assert!(
        fs::read(m.path("f")).unwrap() == base,
        "{mkfs}: content after the write"
    );
    let up = m.upper.join("f");
    assert!(
        get_xattr(&up, "trusted.mosaicfs.partial").is_none(),
        "{mkfs}: a clone is complete, yet it carries a partial mark"
    );
    assert!(
        fs::read(&up).unwrap() == base,
        "{mkfs}: the upper file is not the whole file"
    );
    assert_eq!(fs::metadata(&up).unwrap().size(), base.len() as u64);
    // Shared extents: far less than the file's 64 MiB came out of the free space.
    let used = free_before.saturating_sub(free());
    assert!(
        used < 8 << 20,
        "{mkfs}: the copy-up took {used} bytes of space"
    );
    let status = sh(&format!("{BIN} status {}", m.mnt.display()));
    assert!(
        status.contains(&format!(
            "copy-up by clone (reflink) from: {}",
            m.lower(0).display()
        )),
        "{mkfs}: {status}"
    );
    let log = m.unmount();
    assert_eq!(served(&log, "reflinks"), 1, "{mkfs}: {log}");
    assert_eq!(
        served(&log, "write"),
        0,
        "{mkfs}: writes went through the daemon: {log}"
    );
    assert_eq!(served(&log, "passthrough"), 2, "{mkfs}: {log}");
    m.extra.push("reflink=0".into());
    m.extra.push("copy_whole=0".into());
    m.mount();
    write_at(m.path("g"), 10, b"x");
    assert!(get_xattr(&m.upper.join("g"), "trusted.mosaicfs.partial").is_some());
    let log = m.unmount();
    assert_eq!(served(&log, "reflinks"), 0, "{mkfs}: {log}");
    m.extra.clear();
    m.mount();
    assert!(
        fs::read(m.path("f")).unwrap() == base,
        "{mkfs}: content after a remount"
    );
    g[10] = b'x';
    let got = fs::read(m.path("g")).unwrap();
    assert!(
        got == g,
        "{mkfs}: partial file after a remount: {} bytes, first difference at {:?}",
        got.len(),
        got.iter().zip(&g).position(|(a, b)| a != b)
    );
    m.unmount();
    // That upper layer, partial file and all, as the top lower layer of a new mount: its raw
    // bytes are not g's content, so copy-up must not clone them.
    let mut n = Mount::new_in(&lfs.path, 0);
    n.lowers = vec![m.upper.clone(), m.lower(0).to_path_buf()];
    n.mount();
    write_at(n.path("g"), 20, b"y");
    g[20] = b'y';
    assert!(
        fs::read(n.path("g")).unwrap() == g,
        "{mkfs}: copy-up of a lower partial file"
    );
    let log = n.unmount();
    assert_eq!(
        served(&log, "reflinks"),
        0,
        "{mkfs}: cloned a partial file: {log}"
    );
    n.mount();
    assert!(
        fs::read(n.path("g")).unwrap() == g,
        "{mkfs}: after a remount"
    );
    n.unmount();
}

#[test]
fn copy_up_clones_lower_files_on_one_xfs() {
    if !runs_on_disk_upper_only() {
        return;
    }
    clones_on("mkfs.xfs -q -f -m reflink=1");
}

#[test]
fn copy_up_clones_lower_files_on_one_btrfs() {
    if !runs_on_disk_upper_only() {
        return;
    }
    clones_on("mkfs.btrfs -q -f");
}
