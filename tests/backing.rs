//! Partial files on the upper file systems container storage uses: XFS and btrfs (loop images),
//! besides the ext4 and tmpfs of the other tests. A seeded run of unaligned writes and reads
//! against a model, with copy-after-write on and lazy, then a remount.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct LoopMount(std::path::PathBuf);

impl Drop for LoopMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

fn check_on(fs_type: &str, mkfs: &str) {
    let dir = tempfile::Builder::new()
        .prefix("mosaicfs-backing")
        .tempdir_in("/var/tmp")
        .unwrap();
    let p = dir.path();
    for d in ["lower", "up", "mnt"] {
        fs::create_dir(p.join(d)).unwrap();
    }
    let img = p.join("img");
    fs::File::create(&img).unwrap().set_len(512 << 20).unwrap();
    sh(&format!("{mkfs} {} >/dev/null 2>&1", img.display()));
    sh(&format!(
        "mount -o loop {} {}",
        img.display(),
        p.join("up").display()
    ));
    let _up = LoopMount(p.join("up"));
    let mut rng = StdRng::seed_from_u64(99);
    let mut base = vec![0u8; 3 << 20];
    rng.fill(&mut base[..]);
    write(p.join("lower/f"), &base);
    for workers in [2, 0] {
        let (u, w) = (
            p.join(format!("up/u{workers}")),
            p.join(format!("up/w{workers}")),
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
    check_on("xfs", "mkfs.xfs -q -f");
}

#[test]
fn partial_files_on_a_btrfs_upper() {
    check_on("btrfs", "mkfs.btrfs -q -f");
}
