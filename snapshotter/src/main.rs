//! mosaicfs-snapshotter: a containerd proxy snapshotter whose active snapshots are mosaicfs
//! mounts, so that containerd (ctr, nerdctl, the CRI plugin of Kubernetes, BuildKit) gets
//! block-level copy-up. containerd talks to it over gRPC on a unix socket (`proxy_plugins` in
//! its config); it keeps its metadata in `ROOT/metadata.redb` and the layers under
//! `ROOT/snapshots/`.

mod error;
mod filter;
mod remote;
mod service;
mod snapshots;
mod store;

use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use containerd_snapshots::tonic::transport::Server;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

const USAGE: &str = "\
usage: mosaicfs-snapshotter [--address SOCKET] [--root DIR] [--layer-store DIR]

A containerd proxy snapshotter: active snapshots mount as mosaicfs overlays (fuse3.mosaicfs,
made by mount.fuse3 running `mosaicfs` from containerd's PATH), with their parents as lower
layers. Runs in the foreground until SIGTERM or SIGINT.

  --address SOCKET  the unix socket containerd connects to
                    (default /run/mosaicfs-snapshotter/mosaicfs-snapshotter.sock)
  --root DIR        where snapshots and their metadata live
                    (default /var/lib/mosaicfs-snapshotter); on a file system with xattrs
  --mount-options OPTS
                    more mosaicfs options for every mount, comma-separated (e.g.
                    copy_whole=4M,partial_passthrough=auto; see mosaicfs(1))
  --layer-store DIR take image layers lazily from the layer store mounted at DIR
                    (stargz-store's layout: DIR/base64(image)/DIGEST/diff) when a pull
                    names them (`ctr-remote image rpull`, or the CRI plugin with
                    disable_snapshot_annotations = false) instead of unpacking them
  -h, --help        this text
  -V, --version     the version

containerd's config (/etc/containerd/config.toml):

  [proxy_plugins.mosaicfs]
    type = \"snapshot\"
    address = \"/run/mosaicfs-snapshotter/mosaicfs-snapshotter.sock\"

then `ctr run --snapshotter mosaicfs ...`, `nerdctl --snapshotter mosaicfs ...`, or for
Kubernetes `snapshotter = \"mosaicfs\"` in [plugins.\"io.containerd.grpc.v1.cri\".containerd].";

struct Args {
    address: PathBuf,
    root: PathBuf,
    mount_options: Vec<String>,
    layer_store: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        address: "/run/mosaicfs-snapshotter/mosaicfs-snapshotter.sock".into(),
        root: "/var/lib/mosaicfs-snapshotter".into(),
        mount_options: Vec::new(),
        layer_store: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or(format!("{flag} needs a value (see --help)"))
        };
        match flag.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "-V" | "--version" => {
                println!("mosaicfs-snapshotter {}", env!("CARGO_PKG_VERSION"));
                std::process::exit(0);
            }
            "--address" | "-a" => args.address = value()?.into(),
            "--root" | "-r" => args.root = value()?.into(),
            "--mount-options" | "-o" => {
                let opts = value()?;
                for o in opts.split(',').filter(|o| !o.is_empty()) {
                    let key = o.split('=').next().unwrap_or_default();
                    if ["lowerdir", "upperdir", "workdir"].contains(&key) {
                        return Err(format!(
                            "--mount-options: {key} is the snapshotter's to set"
                        ));
                    }
                    args.mount_options.push(o.to_string());
                }
            }
            "--layer-store" => args.layer_store = Some(value()?.into()),
            _ => return Err(format!("unknown argument {arg:?} (see --help)")),
        }
    }
    if args.address.is_relative()
        || args.root.is_relative()
        || args.layer_store.as_ref().is_some_and(|p| p.is_relative())
    {
        return Err(
            "--address, --root and --layer-store take absolute paths (containerd resolves them \
             from elsewhere)"
                .into(),
        );
    }
    Ok(args)
}

/// containerd runs `mount.fuse3 mosaicfs TARGET -o ... -t mosaicfs`, which runs `mosaicfs`:
/// without them every Prepare would succeed and every container start fail.
fn check_binaries() -> Result<(), String> {
    let path = std::env::var("PATH").unwrap_or_default();
    let find = |name: &str| {
        path.split(':')
            .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
            .map(|d| Path::new(d).join(name))
            .find(|p| {
                fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            })
    };
    if find("mosaicfs").is_none() {
        return Err(format!(
            "no mosaicfs binary in PATH ({path}): containerd mounts active snapshots with mount.fuse3, \
             which runs `mosaicfs`; install it (make install puts it in /usr/local/bin) or add its \
             directory to the PATH of containerd and of this snapshotter"
        ));
    }
    if find("mount.fuse3").is_none() {
        return Err("no mount.fuse3: containerd mounts fuse3.mosaicfs snapshots with it; install the fuse3 package".into());
    }
    Ok(())
}

/// The root must take the xattrs mosaicfs keeps in its layers (whiteouts, partial-file marks,
/// copied-up metadata), and only one snapshotter may use it.
fn open_root(root: &Path) -> Result<fs::File, String> {
    fs::create_dir_all(root)
        .map_err(|e| format!("cannot create the root {}: {e}", root.display()))?;
    let lock_path = root.join("lock");
    let mut lock = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| format!("cannot open {}: {e}", lock_path.display()))?;
    // SAFETY: flock on a descriptor this function owns; no memory is involved.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = fs::read_to_string(&lock_path).unwrap_or_default();
        return Err(format!(
            "the root {} is in use by another mosaicfs-snapshotter (pid {}): stop it, or give this one \
             its own --root",
            root.display(),
            holder.trim()
        ));
    }
    lock.set_len(0)
        .and_then(|()| writeln!(lock, "{}", std::process::id()))
        .ok();
    let probe = root.join(".xattr-probe");
    fs::write(&probe, b"")
        .map_err(|e| format!("cannot write in the root {}: {e}", root.display()))?;
    let c = CString::new(probe.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    let name = if is_root() {
        c"trusted.mosaicfs.probe"
    } else {
        c"user.mosaicfs.probe"
    };
    // SAFETY: both strings are NUL-terminated and live across the call; the value is 1 byte.
    let rc = unsafe { libc::lsetxattr(c.as_ptr(), name.as_ptr(), b"1".as_ptr().cast(), 1, 0) };
    let err = std::io::Error::last_os_error();
    let _ = fs::remove_file(&probe);
    if rc != 0 {
        return Err(format!(
            "the root {} is on a file system without {} xattrs ({err}): mosaicfs keeps whiteouts, \
             partial-file marks and copied-up metadata in the layers' xattrs; choose a --root on ext4, \
             xfs, btrfs or tmpfs",
            root.display(),
            name.to_str()
                .unwrap_or_default()
                .split('.')
                .next()
                .unwrap_or_default()
        ));
    }
    Ok(lock)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A socket another process answers on is in use: say so rather than take it over. A socket
/// nobody answers on is a leftover of a killed snapshotter, and goes.
fn bind(address: &Path) -> Result<UnixListener, String> {
    if let Ok(st) = fs::symlink_metadata(address) {
        if !st.file_type().is_socket() {
            return Err(format!(
                "{} exists and is not a socket: choose another --address",
                address.display()
            ));
        }
        if UnixStream::connect(address).is_ok() {
            return Err(format!(
                "{} is in use: another process serves it (another snapshotter?); stop it or choose \
                 another --address",
                address.display()
            ));
        }
        fs::remove_file(address)
            .map_err(|e| format!("cannot remove the stale {}: {e}", address.display()))?;
    }
    if let Some(dir) = address.parent() {
        fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let listener = UnixListener::bind(address)
        .map_err(|e| format!("cannot listen on {}: {e}", address.display()))?;
    fs::set_permissions(address, fs::Permissions::from_mode(0o660)).ok();
    Ok(listener)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("mosaicfs-snapshotter: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    check_binaries()?;
    let _lock = open_root(&args.root)?;
    let mut snapshots = snapshots::Snapshots::open(&args.root, args.mount_options.clone())
        .map_err(|e| e.to_string())?;
    if let Some(store) = &args.layer_store {
        if !store.is_dir() {
            return Err(format!(
                "--layer-store {}: no such directory; start the layer store (e.g. stargz-store \
                 {0}) first",
                store.display()
            ));
        }
        snapshots = snapshots.with_layer_store(store.clone());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(async {
        // Caught from before the socket is bound: a client may stop the snapshotter the
        // moment it connects, and an uncaught SIGTERM would kill it without the cleanup.
        use tokio::signal::unix::{SignalKind, signal};
        let signals = signal(SignalKind::terminate())
            .and_then(|term| Ok((term, signal(SignalKind::interrupt())?)))
            .map_err(|e| format!("cannot catch SIGTERM and SIGINT: {e}"))?;
        let listener = bind(&args.address)?;
        eprintln!(
            "mosaicfs-snapshotter: serving {} on {}",
            args.root.display(),
            args.address.display()
        );
        let service = containerd_snapshots::server(Arc::new(service::Service(Arc::new(snapshots))));
        let shutdown = async {
            let (mut term, mut int) = signals;
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        };
        let served = Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
            .await;
        let _ = fs::remove_file(&args.address);
        served.map_err(|e| format!("serving {}: {e}", args.address.display()))
    })
}
