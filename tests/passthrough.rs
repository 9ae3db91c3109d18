//! FUSE passthrough: files wholly in one layer are read and written by the kernel directly.
//! The daemon's request counters prove that no READ or WRITE reached it.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;

use common::*;

#[test]
fn complete_upper_files_never_send_reads_or_writes_to_the_daemon() {
    let mut m = Mount::with(|_| {});
    let data = vec![7u8; 4 << 20];
    fs::write(m.path("new"), &data).unwrap();
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("new"))
        .unwrap();
    f.write_all_at(b"patch", 100).unwrap();
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    assert_eq!(&back[100..105], b"patch");
    drop(f);
    assert_eq!(fs::read(m.path("new")).unwrap().len(), 4 << 20);
    let log = m.unmount();
    assert_eq!(served(&log, "read"), 0, "{log}");
    assert_eq!(served(&log, "write"), 0, "{log}");
    assert!(served(&log, "passthrough") >= 3, "{log}");
}

#[test]
fn partial_files_and_writes_to_lower_files_go_through_the_daemon() {
    let mut m = Mount::with(|l| write(l.join("f"), vec![1u8; 1 << 20]));
    fs::OpenOptions::new()
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .write_all_at(b"x", 5)
        .unwrap();
    let got = fs::read(m.path("f")).unwrap();
    assert_eq!(got[5], b'x');
    let log = m.unmount();
    assert!(served(&log, "write") >= 1, "{log}");
    assert!(
        served(&log, "read") >= 1,
        "partial file reads merge in the daemon: {log}"
    );
}

#[test]
fn with_passthrough_all_lower_reads_skip_the_daemon_and_writers_wait_for_readers() {
    let mut m = Mount::new(1);
    write(m.lower(0).join("big"), vec![3u8; 8 << 20]);
    m.extra = vec!["passthrough=all".into()];
    m.mount();
    let mut reader = fs::File::open(m.path("big")).unwrap();
    let mut all = Vec::new();
    reader.read_to_end(&mut all).unwrap();
    assert_eq!(all.len(), 8 << 20);
    let e = fs::OpenOptions::new()
        .write(true)
        .open(m.path("big"))
        .unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::ETXTBSY),
        "a writer while a passthrough reader is open"
    );
    drop(reader);
    let mut w = fs::OpenOptions::new()
        .append(true)
        .open(m.path("big"))
        .unwrap();
    w.write_all(b"tail").unwrap();
    drop(w);
    assert_eq!(fs::metadata(m.path("big")).unwrap().len(), (8 << 20) + 4);
    let log = m.unmount();
    assert_eq!(
        served(&log, "read"),
        0,
        "the 8 MiB read passed through: {log}"
    );
    assert!(served(&log, "passthrough") >= 1, "{log}");
}

#[test]
fn with_passthrough_off_everything_goes_through_the_daemon() {
    let mut m = Mount::new(1);
    m.extra = vec!["passthrough=off".into()];
    m.mount();
    fs::write(m.path("new"), vec![1u8; 1 << 20]).unwrap();
    // A fresh mount has no cached pages: the read reaches the daemon.
    m.remount();
    assert_eq!(fs::read(m.path("new")).unwrap().len(), 1 << 20);
    let log = m.unmount();
    assert!(served(&log, "read") > 0, "{log}");
    assert_eq!(served(&log, "passthrough"), 0, "{log}");
}
