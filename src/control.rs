//! The control socket of a live mount: `mosaicfs status MNT [--json|--prometheus]` reads its
//! counters, and `mosaicfs export MNT` the layer (export.rs).
//!
//! One Unix socket per mount at `DIR/MAJ-MIN.sock`, named after the mount's device number so a
//! client finds it from the mount point alone. `DIR` is `/run/mosaicfs` for root, and for any
//! other user (rootless Podman's daemons too) `$XDG_RUNTIME_DIR/mosaicfs`, or
//! `/run/user/UID/mosaicfs`, or `/tmp/mosaicfs-run-UID` where no runtime dir exists; a client
//! looks in each. A client writes one line naming the format (`text`, `json` or `prometheus`;
//! nothing means text) and gets one report; the socket is served by one thread and never
//! touches the hot path.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::control_socket::mount_device;
use crate::control_socket::{ask_socket, connect, own_socket_dir, socket_dirs, socket_name};
use crate::error::Result;
use crate::options::Format;
use crate::overlay::Overlay;

/// The report a status request gets.
pub fn report(overlay: &Overlay, mountpoint: &Path) -> String {
    let layers: Vec<String> = (1..=overlay.layers().lower_count())
        .map(|i| overlay.layers().layer(i as u16).path.display().to_string())
        .collect();
    let mut r = format!("mount: {}\n", mountpoint.display());
    if let Some(lineage) = overlay.lineage() {
        r += &lineage.describe();
    }
    if overlay.layers().has_upper {
        r += &format!("upper: {}\n", overlay.layers().layer(0).path.display());
        r += &match MemoryFigures::of(overlay) {
            None => "upper store: disk\n".to_string(),
            Some(m) => format!(
                "upper store: memory, {} objects, {} bytes of file data{}\n\
                 upper durability: {}\n",
                m.objects,
                m.data_bytes,
                m.limit_bytes
                    .map_or(String::new(), |l| format!(" of size={l}")),
                match m.changes_pending {
                    None => "none (filestore=memory: the layer ends with the mount)".to_string(),
                    Some(pending) => format!(
                        "journal {} bytes; changes since the last image or journal entry: {}",
                        m.journal_bytes,
                        if pending {
                            "yes (durable at the next fsync, 'mosaicfs sync' or unmount)"
                        } else {
                            "none"
                        }
                    ),
                }
            ),
        };
    }
    r += &format!("lower: {}\n", layers.join(":"));
    r += &format!(
        "transport: {}{}\n",
        overlay.transport(),
        match fuser::requests_piped() {
            Some(true) =>
                ", requests read through pipes (one the kernel hands over as the daemon \
                       dies goes to the next daemon)",
            Some(false) =>
                ", requests read from the device, not through pipes (the log says \
                 why)",
            None => "",
        }
    );
    r += &match overlay.precontent() {
        Ok(pc) => format!(
            "partial files' writers: passthrough, filled on first touch (pre-content events; \
             readable opens through the daemon); {}\n",
            pc.summary()
        ),
        Err(why) => format!("partial files' writers: through the daemon ({why})\n"),
    };
    r += &format!(
        "block size: {} (sparse files: {})\npassthrough: {}\nwriteback cache: {}\n",
        overlay.sparse().block,
        if overlay.sparse().sparse {
            "yes"
        } else {
            "no, whole-file copy-up"
        },
        match overlay.may_pass_through() {
            Ok(()) => format!("{:?}", overlay.config().passthrough),
            Err(why) => format!("none ({why})"),
        },
        if overlay.writeback_cache() {
            "on (the kernel gathers writes and owns files' sizes and times)"
        } else {
            "off"
        }
    );
    if overlay.layers().has_upper {
        let clones: Vec<String> = (1..=overlay.layers().lower_count())
            .filter(|&i| overlay.reflinks_from(i as u16))
            .map(|i| overlay.layers().layer(i as u16).path.display().to_string())
            .collect();
        r += &format!(
            "copy-up by clone (reflink) from: {}\n",
            if clones.is_empty() {
                "none (partial files)".to_string()
            } else {
                clones.join(":")
            }
        );
    }
    let (inodes, handles) = overlay.open_counts();
    let mem = crate::sys::memory_use();
    r += &format!(
        "memory: {} KiB resident; heap {} KiB in use, {} KiB freed and kept by the allocator, \
         {} KiB in mappings of their own\n",
        mem.resident / 1024,
        mem.heap_in_use / 1024,
        mem.heap_free / 1024,
        mem.mapped / 1024
    );
    r += &format!("FUSE workers: {}\n", crate::sys::fuse_workers());
    r += &format!(
        "inodes known: {}\nopen handles: {}\ncomplete files served by passthrough: {}\n\
         partial files open or waiting for completion: {}\n",
        inodes,
        handles,
        match overlay.passthrough_serves() {
            Ok(()) => "yes".to_string(),
            Err(why) => format!("no ({why})"),
        },
        overlay.completer().queued()
    );
    for line in overlay
        .completer()
        .describe(&overlay.config().completion, overlay.passthrough_serves())
    {
        r += &format!("  {line}\n");
    }
    if let Some(pending) = overlay.caw_pending_bytes() {
        r += &format!("copy-after-write pending: {pending} bytes\n");
    }
    r += &overlay.stats().summary();
    r.push('\n');
    r
}

impl Format {
    fn word(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Json => "json",
            Format::Prometheus => "prometheus",
        }
    }
}

/// The figures every format reports beyond the text report's prose.
struct Figures {
    partial_files: u64,
    blocks_present: u64,
    blocks_total: u64,
    bytes_not_copied: u64,
    caw_pending: u64,
    fds_open: u64,
    fds_limit: u64,
}

/// What `mosaicfs status` tells of a memory upper.
struct MemoryFigures {
    objects: u64,
    data_bytes: u64,
    limit_bytes: Option<u64>,
    journal_bytes: u64,
    /// Changes a crash would lose (not yet in the image or journal); `None`: never written.
    changes_pending: Option<bool>,
}

impl MemoryFigures {
    fn of(overlay: &Overlay) -> Option<MemoryFigures> {
        let m = overlay.layers().memory.as_ref()?;
        let block = crate::memory_upper::BLOCK;
        Some(MemoryFigures {
            // The layer's root and what lies below it; the work root is the daemon's own.
            objects: (m.node_count() as u64).saturating_sub(1),
            data_bytes: m.live_blocks() * block,
            limit_bytes: m.size_limit().map(|l| l * block),
            journal_bytes: m.journal_bytes(),
            changes_pending: m.changes_pending(),
        })
    }
}

fn figures(overlay: &Overlay) -> Figures {
    let (partial_files, blocks_present, blocks_total) = overlay.completer().totals();
    let fds_open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    let fds_limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    Figures {
        partial_files,
        blocks_present,
        blocks_total,
        bytes_not_copied: (blocks_total - blocks_present) * overlay.sparse().block,
        caw_pending: overlay.caw_pending_bytes().unwrap_or(0) as u64,
        fds_open,
        fds_limit,
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out += "\\\"",
            '\\' => out += "\\\\",
            c if (c as u32) < 0x20 => out += &format!("\\u{:04x}", c as u32),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The report as one JSON object.
pub fn report_json(overlay: &Overlay, mountpoint: &Path) -> String {
    let f = figures(overlay);
    let lower: Vec<String> = (1..=overlay.layers().lower_count())
        .map(|i| json_str(&overlay.layers().layer(i as u16).path.display().to_string()))
        .collect();
    let upper = if overlay.layers().has_upper {
        json_str(&overlay.layers().layer(0).path.display().to_string())
    } else {
        "null".into()
    };
    let upper_store = match MemoryFigures::of(overlay) {
        None => "{\"kind\": \"disk\"}".to_string(),
        Some(m) => format!(
            "{{\"kind\": \"memory\", \"objects\": {}, \"data_bytes\": {}, \"size_limit_bytes\": {}, \
             \"journal_bytes\": {}, \"changes_pending\": {}}}",
            m.objects,
            m.data_bytes,
            m.limit_bytes.map_or("null".into(), |l| l.to_string()),
            m.journal_bytes,
            m.changes_pending.map_or("null".into(), |p| p.to_string())
        ),
    };
    let counters: Vec<String> = overlay
        .stats()
        .counters()
        .iter()
        .map(|(k, v)| format!("{}: {v}", json_str(k)))
        .collect();
    let requests: Vec<String> = overlay
        .stats()
        .requests
        .figures()
        .iter()
        .map(|op| {
            let hist: Vec<String> = op
                .buckets
                .iter()
                .map(|(le, n)| match le {
                    Some(le) => format!("[{le}, {n}]"),
                    None => format!("[null, {n}]"),
                })
                .collect();
            format!(
                "{}: {{\"count\": {}, \"total_us\": {}, \"le_us_cumulative\": [{}]}}",
                json_str(op.name),
                op.count,
                op.total_ns / 1000,
                hist.join(", ")
            )
        })
        .collect();
    let errors: Vec<String> = crate::stats::errors()
        .iter()
        .map(|(e, n)| format!("{}: {n}", json_str(&crate::stats::errno_name(*e))))
        .collect();
    let (inodes, handles) = overlay.open_counts();
    format!(
        "{{\"mount\": {}, \"upper\": {upper}, \"upper_store\": {upper_store}, \"lower\": [{}], \"transport\": {}, \"block_size\": {}, \
         \"passthrough\": {}, \"writeback_cache\": {}, \"inodes\": {}, \"open_handles\": {}, \
         \"partial_files\": {{\"queued\": {}, \"blocks_present\": {}, \"blocks_total\": {}, \
         \"bytes_not_copied\": {}}}, \"copy_after_write_pending_bytes\": {}, \
         \"descriptors\": {{\"open\": {}, \"limit\": {}}}, \"counters\": {{{}}}, \
         \"requests\": {{{}}}, \"errors\": {{{}}}}}\n",
        json_str(&mountpoint.display().to_string()),
        lower.join(", "),
        json_str(overlay.transport()),
        overlay.sparse().block,
        json_str(&format!("{:?}", overlay.config().passthrough)),
        overlay.writeback_cache(),
        inodes,
        handles,
        f.partial_files,
        f.blocks_present,
        f.blocks_total,
        f.bytes_not_copied,
        f.caw_pending,
        f.fds_open,
        f.fds_limit,
        counters.join(", "),
        requests.join(", "),
        errors.join(", ")
    )
}

/// The report in Prometheus' text exposition format.
pub fn report_prometheus(overlay: &Overlay) -> String {
    let f = figures(overlay);
    let mut r = String::new();
    let mut gauge = |name: &str, help: &str, v: u64| {
        r += &format!(
            "# HELP mosaicfs_{name} {help}\n# TYPE mosaicfs_{name} gauge\nmosaicfs_{name} {v}\n"
        );
    };
    gauge(
        "partial_files",
        "Partial files the daemon holds: open, or due for completion.",
        f.partial_files,
    );
    if let Some(m) = MemoryFigures::of(overlay) {
        gauge(
            "memory_upper_objects",
            "Objects of the memory upper layer (upper=memory).",
            m.objects,
        );
        gauge(
            "memory_upper_data_bytes",
            "Bytes of file data the memory upper layer holds in its filestore.",
            m.data_bytes,
        );
        gauge(
            "memory_upper_journal_bytes",
            "Bytes of the memory upper's journal (replayed and folded at the next mount).",
            m.journal_bytes,
        );
        if let Some(pending) = m.changes_pending {
            gauge(
                "memory_upper_changes_pending",
                "1 while the memory upper has changes a crash would lose (none since the last \
                 image or journal entry: 0).",
                pending as u64,
            );
        }
    }
    gauge(
        "partial_blocks_present",
        "Blocks of those partial files in the upper layer.",
        f.blocks_present,
    );
    gauge(
        "bytes_not_copied",
        "Bytes of those partial files still read from lower layers: what block-level copy-up did not copy.",
        f.bytes_not_copied,
    );
    gauge(
        "copy_after_write_pending_bytes",
        "Bytes of written blocks waiting to be filled.",
        f.caw_pending,
    );
    gauge(
        "descriptors_open",
        "File descriptors the daemon holds.",
        f.fds_open,
    );
    gauge(
        "descriptors_limit",
        "The daemon's RLIMIT_NOFILE.",
        f.fds_limit,
    );
    for (k, v) in overlay.stats().counters() {
        r += &format!("# TYPE mosaicfs_{k}_total counter\nmosaicfs_{k}_total {v}\n");
    }
    r += "# HELP mosaicfs_request_duration_seconds FUSE requests by opcode: time from dispatch to reply in the daemon.\n";
    r += "# TYPE mosaicfs_request_duration_seconds histogram\n";
    for op in overlay.stats().requests.figures() {
        for (le, n) in &op.buckets {
            let le = le.map_or("+Inf".to_string(), |us| format!("{:e}", us as f64 / 1e6));
            r += &format!(
                "mosaicfs_request_duration_seconds_bucket{{op=\"{}\",le=\"{le}\"}} {n}\n",
                op.name
            );
        }
        r += &format!(
            "mosaicfs_request_duration_seconds_sum{{op=\"{0}\"}} {1}\nmosaicfs_request_duration_seconds_count{{op=\"{0}\"}} {2}\n",
            op.name,
            op.total_ns as f64 / 1e9,
            op.count
        );
    }
    r += "# HELP mosaicfs_errors_total Requests answered with an error, by errno.\n# TYPE mosaicfs_errors_total counter\n";
    for (e, n) in crate::stats::errors() {
        r += &format!(
            "mosaicfs_errors_total{{errno=\"{}\"}} {n}\n",
            crate::stats::errno_name(e)
        );
    }
    r
}

/// Binds the control socket of the mount on device `dev` (MAJ:MIN), through which `mosaicfs
/// status` and the other tools reach the daemon. `None` (logged) where there is no place for
/// one: the mount works without it.
pub fn bind(overlay: &Overlay, dev: &str) -> Option<Listener> {
    let Some(dir) = own_socket_dir() else {
        log::info!(
            "no directory for a control socket (tried {:?}); 'mosaicfs status' will not reach \
             this mount",
            socket_dirs()
        );
        return None;
    };
    let path = dir.join(socket_name(dev));
    // Tests only (`MOSAICFS_TEST_SLOW_CONTROL=ms`): the socket comes that much after the mount,
    // the window a tool run right after a foreground mount falls into.
    if let Some(ms) = std::env::var("MOSAICFS_TEST_SLOW_CONTROL")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    // Held until the socket is bound: an exiting daemon of an earlier mount on the same device
    // number checks and removes its own socket under the same lock (overlay.rs).
    let locked = crate::overlay::lock_socket_dir(&dir);
    let _ = std::fs::remove_file(&path); // left by a daemon that was killed
    let bound = UnixListener::bind(&path);
    drop(locked);
    let listener = match bound {
        Ok(l) => l,
        Err(e) => {
            log::info!(
                "no control socket at {}: {e}; 'mosaicfs status' will not reach this mount",
                path.display()
            );
            return None;
        }
    };
    // Its owner only: the socket hands out the layer's contents (export).
    use std::os::unix::fs::PermissionsExt;
    if let Err(e) = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)) {
        log::info!("control socket {}: {e}; not served", path.display());
        return None;
    }
    let meta = std::fs::metadata(&path).ok()?;
    let Ok(dup) = listener.try_clone() else {
        return None;
    };
    overlay.set_control_socket(crate::overlay::ControlSocket {
        path,
        ino: std::os::unix::fs::MetadataExt::ino(&meta),
        listener: dup.into(),
    });
    Some(Listener(listener))
}

/// A bound control socket, served by `Listener::serve`.
pub struct Listener(UnixListener);

impl Listener {
    /// Answers the socket's requests in a thread of its own until the daemon exits.
    pub fn serve(self, overlay: Arc<Overlay>, mountpoint: PathBuf) {
        let listener = self.0;
        let _ = std::thread::Builder::new()
            .name("mosaicfs-control".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    match conn {
                        Ok(conn) => answer(conn, &overlay, &mountpoint),
                        // Shut down at the daemon's exit (`Overlay::shutdown`).
                        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                        Err(_) => continue,
                    }
                }
            });
    }
}

/// Answers one request on the control socket.
fn answer(mut conn: UnixStream, overlay: &Arc<Overlay>, mountpoint: &Path) {
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_millis(500)));
    let mut asked = Vec::new();
    let _ = (&mut conn).take(8192).read_to_end(&mut asked);
    let out = match asked.trim_ascii() {
        b"upgrade" => match overlay.lineage().map(|l| l.binary.clone()) {
            Some(binary) => handed_over(overlay.hand_over(&binary)),
            None => "error: this daemon does not know its binary\n".into(),
        },
        upgrade if upgrade.starts_with(b"upgrade ") => {
            use std::os::unix::ffi::OsStrExt;
            let binary = std::ffi::OsStr::from_bytes(&upgrade[b"upgrade ".len()..]);
            handed_over(overlay.hand_over(Path::new(binary)))
        }
        b"export" => {
            // Long: its own thread, so status requests are still answered.
            let _ = conn.set_read_timeout(None);
            let ov = overlay.clone();
            let _ = std::thread::Builder::new()
                .name("mosaicfs-export".into())
                .spawn(move || crate::export::serve(&ov, conn));
            return;
        }
        b"json" => report_json(overlay, mountpoint),
        b"sync" => match overlay.sync_layer() {
            Ok(()) => "ok\n".into(),
            Err(e) => format!("error: {e}\n"),
        },
        b"prometheus" => report_prometheus(overlay),
        _ => report(overlay, mountpoint),
    };
    let _ = conn.write_all(out.as_bytes());
}

/// The answer to an upgrade request.
fn handed_over(r: Result<()>) -> String {
    match r {
        Ok(()) => "ok\n".into(),
        Err(e) => format!("error: {e}\n"),
    }
}

/// Serves the Prometheus text of the mount over HTTP (`metrics=ADDR`) until the daemon exits:
/// `GET /metrics` (or `/`), one request per connection, one connection at a time — a scrape
/// every few seconds needs no more, and a client that stalls is dropped after two seconds.
pub fn serve_metrics(overlay: Arc<Overlay>, listener: std::net::TcpListener) {
    let _ = std::thread::Builder::new()
        .name("mosaicfs-metrics".into())
        .spawn(move || serve_http(&listener, || report_prometheus(&overlay)));
}

/// Answers HTTP GETs of /metrics on `listener` with `body()`, one connection at a time.
fn serve_http(listener: &std::net::TcpListener, body: impl Fn() -> String) {
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let limit = Some(std::time::Duration::from_secs(2));
        let _ = conn.set_read_timeout(limit);
        let _ = conn.set_write_timeout(limit);
        let mut request = Vec::new();
        let mut buf = [0u8; 1024];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&buf[..n]),
            }
        }
        let line = request.split(|&c| c == b'\n').next().unwrap_or_default();
        let mut words = line.split(|&c| c == b' ');
        let (method, path) = (words.next(), words.next());
        let (status, body) = match (method, path) {
            (Some(b"GET"), Some(b"/metrics" | b"/")) => ("200 OK", body()),
            (Some(b"GET"), _) => ("404 Not Found", "metrics are at /metrics\n".into()),
            _ => ("405 Method Not Allowed", "only GET\n".into()),
        };
        let _ = conn.write_all(
            format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        );
    }
}

/// `mosaicfs metrics --listen ADDR`: one scrape target for every mosaicfs mount of the host
/// (of this mount namespace): each scrape asks every live mount's daemon, and each series
/// carries a `mount` label with its mount point. Serves until killed.
pub fn serve_all_metrics(addr: std::net::SocketAddr) -> Result<()> {
    let listener = std::net::TcpListener::bind(addr).map_err(|e| {
        crate::message!("metrics --listen {addr}: cannot listen there ({e}): pick a free port")
    })?;
    serve_http(&listener, all_mounts_prometheus);
    Ok(())
}

/// The Prometheus text of every live mosaicfs mount, merged: each metric's HELP and TYPE once,
/// then its samples from every mount, labelled with the mount point.
pub fn all_mounts_prometheus() -> String {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut order: Vec<String> = Vec::new();
    let mut families: std::collections::HashMap<String, (Vec<String>, Vec<String>)> =
        std::collections::HashMap::new();
    let mut answered = 0;
    for l in info.lines().filter(|l| l.contains(" - fuse.mosaicfs ")) {
        let f: Vec<&str> = l.split(' ').collect();
        let (Some(dev), Some(mnt)) = (f.get(2), f.get(4)) else {
            continue;
        };
        // The device from mountinfo, never a stat of the mount point: a mount whose daemon
        // hangs must not hang the scrape (its socket times out instead).
        let Some(text) = ask_socket(dev, "prometheus") else {
            continue;
        };
        answered += 1;
        let label = format!(
            "mount=\"{}\"",
            prometheus_escape(&crate::sys::unescape_mountinfo(mnt).to_string_lossy())
        );
        let mut family = String::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# ") {
                let mut w = rest.splitn(3, ' ');
                let (_, name) = (w.next(), w.next().unwrap_or_default());
                family = name.to_string();
                let entry = families.entry(family.clone()).or_insert_with(|| {
                    order.push(family.clone());
                    Default::default()
                });
                if !entry.0.iter().any(|h| h == line) && entry.0.len() < 2 {
                    entry.0.push(line.to_string());
                }
                continue;
            }
            if line.is_empty() {
                continue;
            }
            let labelled = match line.find('{') {
                Some(i) if line[i + 1..].starts_with('}') => {
                    format!("{}{{{label}}}{}", &line[..i], &line[i + 2..])
                }
                Some(i) => format!("{}{{{label},{}", &line[..i], &line[i + 1..]),
                None => match line.split_once(' ') {
                    Some((name, value)) => format!("{name}{{{label}}} {value}"),
                    None => continue,
                },
            };
            let entry = families.entry(family.clone()).or_insert_with(|| {
                order.push(family.clone());
                Default::default()
            });
            entry.1.push(labelled);
        }
    }
    let mut out = format!(
        "# HELP mosaicfs_mounts_answered Live mosaicfs mounts whose daemon answered this scrape.\n\
         # TYPE mosaicfs_mounts_answered gauge\nmosaicfs_mounts_answered {answered}\n"
    );
    for name in order {
        let (heads, samples) = &families[&name];
        for line in heads.iter().chain(samples) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// A label value as Prometheus' text format writes it.
fn prometheus_escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `mosaicfs sync MNT`: makes the mount's memory upper durable as it is now (an image).
pub fn sync(mountpoint: &Path) -> Result<()> {
    let mut conn = connect(mountpoint, "sync")?;
    let mut out = String::new();
    conn.read_to_string(&mut out).map_err(|e| e.to_string())?;
    match out.trim_end() {
        "ok" => Ok(()),
        "" => Err(crate::message!(
            "the daemon of '{}' closed the connection without an answer (it is shutting down?)",
            mountpoint.display()
        )),
        e => Err(crate::message!(
            "'{}': {}: check the upper dir's file system (full? read-only?) and run sync again",
            mountpoint.display(),
            e.trim_start_matches("error: ")
        )),
    }
}

/// `mosaicfs upgrade MNT [--binary PATH]`: has a new daemon, from `binary` or the path the
/// serving one was started from, take the live mount over (takeover.rs). Checks that the binary
/// runs first, then waits until the new daemon answers; what it says of it.
pub fn upgrade(mountpoint: &Path, binary: Option<&Path>) -> Result<String> {
    let before = status(mountpoint, Format::Text)?;
    let field = |report: &str, line: &str, key: &str| -> Option<String> {
        let l = report.lines().find(|l| l.starts_with(line))?;
        let at = l.find(key)? + key.len();
        Some(l[at..].split([',', ';']).next()?.trim().to_string())
    };
    let old_pid = field(&before, "daemon:", "pid ");
    let Some(daemons) = field(&before, "restart:", "daemons before this one: ") else {
        return Err(crate::message!(
            "the daemon of '{}' is too old to be upgraded in place: unmount the mount and mount \
             it again",
            mountpoint.display()
        ));
    };
    let binary = match binary {
        Some(b) => b.to_path_buf(),
        None => PathBuf::from(field(&before, "daemon:", "binary ").unwrap_or_default()),
    };
    let version = std::process::Command::new(&binary)
        .arg("--version")
        .output()
        .map_err(|e| crate::message!("cannot run '{}': {e}", binary.display()))?;
    let said = String::from_utf8_lossy(&version.stdout).into_owned();
    if !version.status.success() || !said.starts_with("mosaicfs") {
        return Err(crate::message!(
            "'{} --version' did not answer as mosaicfs does ({}): not upgrading to it",
            binary.display(),
            said.lines().next().unwrap_or("no output")
        ));
    }
    let asked = format!("upgrade {}", binary.display());
    let mut conn = connect(mountpoint, &asked)?;
    let started = std::time::Instant::now();
    let mut out = String::new();
    conn.read_to_string(&mut out).map_err(|e| e.to_string())?;
    if let Some(e) = out.trim_end().strip_prefix("error: ") {
        return Err(e.into());
    }
    // The new daemon answers once it serves; until then the socket is gone or the old one's.
    let deadline = std::time::Duration::from_secs(60);
    loop {
        if let Ok(now) = status(mountpoint, Format::Text)
            && field(&now, "restart:", "daemons before this one: ").as_ref() != Some(&daemons)
        {
            return Ok(format!(
                "{}: daemon pid {} (version {}) took over from pid {} in {:.1} ms\n",
                mountpoint.display(),
                field(&now, "daemon:", "pid ").unwrap_or_default(),
                field(&now, "daemon:", "version ").unwrap_or_default(),
                old_pid.unwrap_or_default(),
                started.elapsed().as_secs_f64() * 1000.0
            ));
        }
        if started.elapsed() > deadline {
            return Err(crate::message!(
                "no new daemon answers for '{}' after {} s: see the system log (the holder \
                 says why)",
                mountpoint.display(),
                deadline.as_secs()
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// `mosaicfs status MNT`: the report of the mount at `mountpoint`, in `format`.
pub fn status(mountpoint: &Path, format: Format) -> Result<String> {
    let mut conn = connect(mountpoint, format.word())?;
    let mut out = String::new();
    conn.read_to_string(&mut out).map_err(|e| e.to_string())?;
    Ok(out)
}
