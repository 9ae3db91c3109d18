//! The control socket of a live mount: `mosaicfs status MNT` reads its counters.
//!
//! One Unix socket per mount at `/run/mosaicfs/MAJ-MIN.sock`, named after the mount's device
//! number so a client finds it from the mount point alone. A connection gets one plain-text
//! report and is closed; the socket is served by one thread and never touches the hot path.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::overlay::Overlay;

const DIR: &str = "/run/mosaicfs";

fn socket_path(dev: &str) -> PathBuf {
    Path::new(DIR).join(format!("{}.sock", dev.replace(':', "-")))
}

/// The MAJ:MIN of the newest mount at `mountpoint`, from /proc/self/mountinfo (never stat(2):
/// a daemon asking about its own mount before it serves requests would wait for itself).
pub fn mount_device(mountpoint: &Path) -> Option<String> {
    let want = std::fs::canonicalize(mountpoint).ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 4 && Path::new(f[4]) == want).then(|| f[2].to_string())
    })
}

/// The report a status request gets.
pub fn report(overlay: &Overlay, mountpoint: &Path) -> String {
    let layers: Vec<String> = (1..=overlay.layers.lower_count())
        .map(|i| overlay.layers.layer(i as u16).path.display().to_string())
        .collect();
    let mut r = format!("mount: {}\n", mountpoint.display());
    if overlay.layers.has_upper {
        r += &format!("upper: {}\n", overlay.layers.layer(0).path.display());
    }
    r += &format!("lower: {}\n", layers.join(":"));
    r += &format!(
        "block size: {} (sparse files: {})\npassthrough: {:?}\n",
        overlay.sparse.block,
        if overlay.sparse.sparse {
            "yes"
        } else {
            "no, whole-file copy-up"
        },
        overlay.config.passthrough
    );
    if overlay.layers.has_upper {
        let clones: Vec<String> = (1..=overlay.layers.lower_count())
            .filter(|&i| overlay.reflinks_from(i as u16))
            .map(|i| overlay.layers.layer(i as u16).path.display().to_string())
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
    r += &format!(
        "inodes known: {}\nopen handles: {}\npartial files waiting for completion: {}\n",
        overlay.inodes.len(),
        overlay.handles.len(),
        overlay.completer.queued()
    );
    for line in overlay.completer.describe(&overlay.config.completion) {
        r += &format!("  {line}\n");
    }
    if let Some(caw) = &overlay.caw {
        r += &format!("copy-after-write pending: {} bytes\n", caw.pending_bytes());
    }
    r += &overlay.stats.summary();
    r.push('\n');
    r
}

/// Serves status requests for the mount on device `dev` until the daemon exits.
pub fn serve(overlay: Arc<Overlay>, mountpoint: PathBuf) {
    let Some(dev) = mount_device(&mountpoint) else {
        return;
    };
    let path = socket_path(&dev);
    let _ = std::fs::create_dir_all(DIR);
    let _ = std::fs::remove_file(&path); // left by a daemon that was killed
    let listener = match UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) => {
            log::info!(
                "no control socket at {}: {e}; 'mosaicfs status' will not reach this mount",
                path.display()
            );
            return;
        }
    };
    *overlay
        .control_socket
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(path);
    let _ = std::thread::Builder::new()
        .name("mosaicfs-control".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let _ = conn.write_all(report(&overlay, &mountpoint).as_bytes());
            }
        });
}

/// `mosaicfs status MNT`: the report of the mount at `mountpoint`.
pub fn status(mountpoint: &Path) -> Result<String, String> {
    let dev = mount_device(mountpoint)
        .ok_or_else(|| format!("'{}' is not a mount point", mountpoint.display()))?;
    let path = socket_path(&dev);
    let mut conn = UnixStream::connect(&path).map_err(|e| {
        format!(
            "no mosaicfs daemon answers for '{}' ({}: {e}); is it a mosaicfs mount?",
            mountpoint.display(),
            path.display()
        )
    })?;
    let mut out = String::new();
    conn.read_to_string(&mut out).map_err(|e| e.to_string())?;
    Ok(out)
}
