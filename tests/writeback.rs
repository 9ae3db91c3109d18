//! The kernel's writeback cache (`writeback=auto`: on wherever nothing passes through — rootless,
//! a kernel without passthrough, `passthrough=off`): written data waits in the kernel's page
//! cache and reaches the daemon later, gathered, at offsets the kernel chose.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};

use common::*;

fn mount_with(options: &[&str], files: &[(&str, &[u8])]) -> Mount {
    let mut m = Mount::new(1);
    for (name, data) in files {
        write(m.lower(0).join(name), data);
    }
    m.extra = opts(options);
    m.mount();
    m
}

#[test]
fn small_writes_reach_the_daemon_gathered() {
    let m = mount_with(&["passthrough=off", "writeback=auto"], &[]);
    assert!(status(&m).contains("writeback cache: on"), "{}", status(&m));
    let mut want = Vec::new();
    let mut f = fs::File::create(m.path("log")).unwrap();
    for i in 0..2000 {
        let line = format!("line {i:05} of the log\n");
        f.write_all(line.as_bytes()).unwrap();
        want.extend_from_slice(line.as_bytes());
    }
    drop(f);
    // 2,000 write(2) calls of 22 bytes, 44 KB: the kernel sends a few page-sized writes.
    let writes = requests(&m, "WRITE");
    assert!(
        writes < 100,
        "{writes} WRITE requests for 2,000 small writes"
    );
    assert_eq!(fs::read(m.path("log")).unwrap(), want);
    assert_eq!(fs::read(m.upper.join("log")).unwrap_or(want.clone()), want);
}

/// Off by default: it costs a file's every close after a write, and every unlink and rename,
/// a round trip more (docs/PERFORMANCE.md).
#[test]
fn without_it_every_write_is_a_request() {
    let m = mount_with(&["passthrough=off"], &[]);
    assert!(
        status(&m).contains("writeback cache: off"),
        "{}",
        status(&m)
    );
    let mut f = fs::File::create(m.path("log")).unwrap();
    for _ in 0..200 {
        f.write_all(b"twenty-two bytes each\n").unwrap();
    }
    drop(f);
    let writes = requests(&m, "WRITE");
    assert!(writes >= 200, "{writes} WRITE requests for 200 writes");
    assert_eq!(fs::metadata(m.path("log")).unwrap().len(), 200 * 22);
}

/// O_APPEND is the kernel's under the writeback cache: it sends each write at the end of the
/// file as it knows it, which lies past the layer file's end while earlier appends wait in its
/// page cache. A daemon that appended at its own end would write them twice over.
#[test]
fn appends_land_where_the_kernel_put_them() {
    let base = pattern(10_000, 3);
    let mut m = mount_with(
        &["passthrough=off", "writeback=auto", "copy_whole=0"],
        &[("log", &base)],
    );
    let mut want = base.clone();
    let mut a = fs::OpenOptions::new()
        .append(true)
        .open(m.path("log"))
        .unwrap();
    let mut b = fs::OpenOptions::new()
        .append(true)
        .open(m.path("log"))
        .unwrap();
    for i in 0..300 {
        let (f, line) = if i % 2 == 0 {
            (&mut a, format!("a{i}\n"))
        } else {
            (&mut b, format!("bb{i}\n"))
        };
        f.write_all(line.as_bytes()).unwrap();
        want.extend_from_slice(line.as_bytes());
    }
    assert_eq!(a.metadata().unwrap().len(), want.len() as u64);
    drop((a, b));
    assert!(fs::read(m.path("log")).unwrap() == want, "merged view");
    m.remount();
    assert!(fs::read(m.path("log")).unwrap() == want, "after a remount");
}

/// A write covering part of a page the kernel does not hold makes it read the page through
/// the writer's handle, write-only as it is; the rest of the page keeps the lower bytes.
#[test]
fn a_write_only_handle_fills_the_pages_it_writes_in_part() {
    let base = pattern(3 << 20, 5);
    let mut m = mount_with(
        &["passthrough=off", "writeback=auto", "copy_whole=0"],
        &[("img", &base)],
    );
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("img"))
        .unwrap();
    let mut want = base.clone();
    for off in [1usize, 4097, 1 << 20, (3 << 20) - 3] {
        f.write_all_at(b"XYZ", off as u64).unwrap();
        want[off..off + 3].copy_from_slice(b"XYZ");
    }
    drop(f);
    assert!(requests(&m, "READ") > 0, "no page was read to be filled");
    m.remount();
    assert!(fs::read(m.path("img")).unwrap() == want);
    let stored = stored_bytes(&m, "img");
    assert!(
        stored <= 64 << 10,
        "{stored} bytes stored: block-level copy-up as ever"
    );
}

/// The kernel keeps size and times while its pages are dirty, and sends the times at close:
/// what a stat showed before is what the layer holds after a remount.
#[test]
fn sizes_and_times_the_kernel_kept_reach_the_layer() {
    let mut m = mount_with(
        &["passthrough=off", "writeback=auto", "copy_whole=0"],
        &[("f", b"lower")],
    );
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    f.write_all_at(&pattern(100_000, 9), 50_000).unwrap();
    let seen = f.metadata().unwrap();
    assert_eq!(seen.len(), 150_000);
    drop(f);
    m.remount();
    let after = fs::metadata(m.path("f")).unwrap();
    assert_eq!(after.len(), 150_000);
    assert_eq!(
        (after.mtime(), after.mtime_nsec()),
        (seen.mtime(), seen.mtime_nsec()),
        "the write's time, as the kernel kept it"
    );
}

/// Unprivileged mounts (a user namespace: no FUSE passthrough) have it when asked for.
#[test]
fn a_rootless_mount_has_it_when_asked() {
    if !runs_on_disk_upper_only() {
        return;
    }
    let (d, p) = layer_dirs();
    let bin = env!("CARGO_BIN_EXE_mosaicfs");
    let script = format!(
        "set -e; {bin} -o lowerdir={p}/l,upperdir={p}/u,workdir={p}/w,writeback=auto {p}/m; \
         printf one > {p}/m/f; printf two >> {p}/m/f; \
         {bin} status {p}/m > {p}/status; cat {p}/m/f > {p}/content; umount {p}/m"
    );
    run(std::process::Command::new("unshare").args(["-Urm", "sh", "-c", &script]));
    let status = fs::read_to_string(d.path().join("status")).unwrap();
    assert!(status.contains("writeback cache: on"), "{status}");
    assert_eq!(
        fs::read_to_string(d.path().join("content")).unwrap(),
        "onetwo"
    );
    assert_eq!(fs::read_to_string(d.path().join("u/f")).unwrap(), "onetwo");
}

/// SEEK_DATA and SEEK_HOLE see what the kernel holds, not only what the daemon has: the
/// kernel asks without writing its pages back, so a mount under the writeback cache lets it
/// answer from its own size.
#[test]
fn seeking_data_finds_what_the_kernel_holds() {
    let m = mount_with(&["passthrough=off", "writeback=auto"], &[]);
    let f = fs::File::create(m.path("sparse")).unwrap();
    f.write_all_at(b"data past a hole", 1 << 20).unwrap();
    let data = rustix::fs::seek(&f, rustix::fs::SeekFrom::Data(0))
        .expect("SEEK_DATA finds the data just written");
    assert!(data <= 1 << 20, "data found at {data}");
    let hole = rustix::fs::seek(&f, rustix::fs::SeekFrom::Hole(1 << 20)).unwrap();
    assert!(hole >= (1 << 20) + 16, "a hole at {hole}, inside the data");
}
