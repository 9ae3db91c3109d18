//! The command: parse options, check the layers, mount, serve until unmounted.
//!
//! Without `-f` the command mounts, answers the kernel's INIT and binds the control socket
//! itself, then forks once, before any thread exists: the parent exits 0 with the mount live,
//! which is what containers/storage and mount(8) wait for, and the child serves it. Whatever
//! can fail the mount fails it before the fork, with its reason; only the pre-content guardian
//! starts after it, and then the parent waits for the child's word (`mount`).

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::Result;
use crate::fuse::MosaicFs;
use crate::layers::{LayerStack, MemorySpec};
use crate::memory_upper::ChangeLogPlace;
use crate::options::{self, Command, Options};
use crate::overlay::{Config, Overlay};

/// Arguments as mount(8) passes them to a `mount.fuse.mosaicfs` helper, reduced to ours.
fn strip_mount_helper_flags(args: Vec<OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("-n") | Some("-s") | Some("-v") | Some("-i") => {}
            Some("-t") | Some("-N") => {
                it.next();
            }
            _ => out.push(a),
        }
    }
    out
}

pub fn main() -> i32 {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args
        .first()
        .is_some_and(|a| a == crate::file::partial::precontent::GUARDIAN_COMMAND)
    {
        return crate::file::partial::precontent::guardian_main(&args[1..]);
    }
    if args
        .first()
        .is_some_and(|a| a == crate::takeover::HOLDER_COMMAND)
    {
        return crate::takeover::holder_main();
    }
    limit_malloc_arenas();
    keep_malloc_thresholds();
    // How this daemon was started, for the daemons that may take its mount over.
    let started_as = (
        std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into()),
        args.clone(),
    );
    let args = strip_mount_helper_flags(args);
    let opts = match options::parse_args(args) {
        Ok(Command::Help(None)) => {
            print!("{}", crate::help::mount_help(options::USAGE));
            return 0;
        }
        Ok(Command::Help(Some(cmd))) => {
            print!("{}", crate::help::command_help(&cmd).unwrap_or_default());
            return 0;
        }
        Ok(Command::Version) => {
            println!("mosaicfs version {}", env!("CARGO_PKG_VERSION"));
            println!("fuse-overlayfs compatible; FUSE library: fuser 0.18");
            return 0;
        }
        Ok(Command::Mount(o)) => o,
        Ok(Command::Complete(t)) => {
            crate::logging::init(false);
            return crate::tools::complete(&t);
        }
        Ok(Command::Fsck(t)) => {
            crate::logging::init(false);
            return crate::tools::fsck(&t);
        }
        Ok(Command::Export(a)) => {
            crate::logging::init(false);
            return crate::export::run(&a);
        }
        Ok(Command::Remount(o)) => return remount(&o),
        Ok(Command::Upgrade(mnt, binary)) => {
            return match crate::control::upgrade(&mnt, binary.as_deref()) {
                Ok(report) => {
                    print!("{report}");
                    0
                }
                Err(e) => {
                    eprintln!("mosaicfs: {e}");
                    1
                }
            };
        }
        Ok(Command::Sync(mnt)) => {
            return match crate::control::sync(&mnt) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("mosaicfs: {e}");
                    1
                }
            };
        }
        Ok(Command::Metrics(addr)) => {
            crate::logging::init(false);
            return match crate::control::serve_all_metrics(addr) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("mosaicfs: {e}");
                    1
                }
            };
        }
        Ok(Command::Status(mnt, format)) => {
            return match crate::control::status(&mnt, format) {
                Ok(report) => {
                    print!("{report}");
                    0
                }
                Err(e) => {
                    eprintln!("mosaicfs: {e}");
                    1
                }
            };
        }
        Err(e) => {
            eprintln!("mosaicfs: {e}");
            return 2;
        }
    };
    exec_without_malloc_cache();
    crate::logging::init(opts.debug);
    for w in &opts.warnings {
        eprintln!("mosaicfs: warning: {w}");
    }
    match mount(*opts, started_as) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("mosaicfs: {e}");
            1
        }
    }
}

/// Remounting changes only the kernel's mount flags; the daemon serving the mount stays.
fn remount(opts: &Options) -> i32 {
    let flags = if opts.read_only {
        rustix::mount::MountFlags::RDONLY
    } else {
        rustix::mount::MountFlags::empty()
    };
    // The kernel answers EBUSY while an unlinked file's last RELEASE is still in flight to the
    // daemon (FUSE releases asynchronously): give those a moment to finish.
    let mut tries = 0;
    let result = loop {
        match rustix::mount::mount_remount(&opts.mountpoint, flags, "") {
            Err(rustix::io::Errno::BUSY) if opts.read_only && tries < 40 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            r => break r,
        }
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!(
                "mosaicfs: cannot remount '{}': {e}",
                opts.mountpoint.display()
            );
            1
        }
    }
}

/// Whether an error from a FUSE mount says its connection is gone: ENOTCONN for a request
/// made after the connection ended; ECONNABORTED or, over io_uring, ECANCELED for one that
/// was waiting when it ended (the daemon's last hold on /dev/fuse went while the request was
/// queued: over io_uring the ring is torn down a moment after the daemon is reaped).
fn connection_gone(errno: i32) -> bool {
    matches!(errno, libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED)
}

fn check_mountpoint(opts: &Options) -> Result<()> {
    // statfs reaches the daemon of a FUSE mount there (stat may be answered from the
    // kernel's cache): it fails when that daemon is gone or going (`connection_gone`).
    let dead =
        rustix::fs::statfs(&opts.mountpoint).is_err_and(|e| connection_gone(e.raw_os_error()));
    let seen = if dead {
        Err(std::io::Error::from_raw_os_error(libc::ENOTCONN))
    } else {
        std::fs::metadata(&opts.mountpoint)
    };
    match seen {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(crate::message!(
            "mount point '{}' is not a directory",
            opts.mountpoint.display()
        )),
        Err(e) if e.raw_os_error().is_some_and(connection_gone) => Err(crate::message!(
            "mount point '{0}' holds a dead FUSE mount (its daemon exited or was killed): \
             unmount it first ('umount {0}', or 'umount -l {0}' while it is busy)",
            opts.mountpoint.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(crate::message!(
            "mount point '{}' does not exist: create it first",
            opts.mountpoint.display()
        )),
        Err(e) => Err(crate::message!(
            "mount point '{}' cannot be used: {e}",
            opts.mountpoint.display()
        )),
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard one: open files through the mount each hold a
/// descriptor or two of the daemon's (file/mod.rs, `FdReserve`).
fn raise_nofile_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current != lim.maximum {
        lim.current = lim.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, lim) {
            log::info!("cannot raise RLIMIT_NOFILE to its hard limit: {e}");
        }
    }
}

/// `started_as`: the binary and the arguments, for the daemons that may take the mount over.
fn mount(opts: Options, started_as: (std::path::PathBuf, Vec<OsString>)) -> Result<()> {
    // A daemon a mount's holder started to take over its connection (takeover.rs).
    let inherited = crate::takeover::Inherited::from_env()?;
    if inherited.is_none() {
        check_mountpoint(&opts)?;
    }
    crate::sys::set_noatime(opts.noatime);
    if opts.noatime || opts.strictatime || opts.nodiratime {
        use crate::sys::{
            AtimeMode, MOUNT_ATTR_NOATIME, MOUNT_ATTR_RELATIME, MOUNT_ATTR_STRICTATIME,
        };
        let atime = match (opts.noatime, opts.strictatime) {
            (true, _) => MOUNT_ATTR_NOATIME,
            (_, true) => MOUNT_ATTR_STRICTATIME,
            _ => MOUNT_ATTR_RELATIME,
        };
        let _ = crate::layers::ATIME_MODE.set(AtimeMode {
            atime,
            nodiratime: opts.nodiratime,
        });
    }
    // Opened now: a file the daemon cannot write fails the mount, not the log later.
    let log_file = opts
        .log_file
        .as_deref()
        .map(crate::logging::open_log_file)
        .transpose()?;
    crate::fault::init()?;
    // Bound before anything else: an address in use fails the mount, not a thread later.
    // An address in use is no reason to refuse a mount: containers/storage passes one mount
    // option to every container, and only the first gets the port ('mosaicfs metrics' serves
    // them all). Any other failure is a wrong address.
    let metrics = match opts
        .metrics
        .map(|addr| (addr, std::net::TcpListener::bind(addr)))
    {
        None => None,
        Some((_, Ok(l))) => Some(l),
        Some((addr, Err(e))) if e.kind() == std::io::ErrorKind::AddrInUse => {
            eprintln!(
                "mosaicfs: warning: metrics={addr}: in use (by another mount with the same \
                 options?); this mount serves no endpoint of its own: run \
                 'mosaicfs metrics --listen ADDR' for one endpoint for all mounts"
            );
            None
        }
        Some((addr, Err(e))) => {
            return Err(crate::message!(
                "metrics={addr}: cannot listen there ({e}): pick a free local port"
            ));
        }
    };
    raise_nofile_limit();
    let mut inherited = inherited;
    let memory_spec = (opts.upper_kind == options::UpperKind::Memory).then(|| MemorySpec {
        filestore: opts.filestore.clone().unwrap_or_default(),
        size_limit: opts.size_limit,
        change_log: change_log_place(&opts, inherited.as_mut()),
    });
    let mut layers = LayerStack::open(
        &opts.lowerdirs,
        opts.upperdir.as_deref(),
        opts.workdir.as_deref(),
        opts.read_only,
        opts.xattr_permissions,
        crate::layers::WorkLock::Wait(crate::layers::MOUNT_LOCK_WAIT),
        memory_spec.as_ref(),
    )?;
    layers.add_data_layers(&opts.datadirs)?;
    layers.follow_redirects = opts.redirect_dir.follows();
    let uring = match &inherited {
        Some(_) => false,
        // Surviving the daemon over io_uring when it is only `auto`.
        None if opts.restart == options::Switch::On && opts.uring == options::Uring::Auto => false,
        None => use_uring(&opts, &layers)?,
    };
    let change_log = memory_spec
        .as_ref()
        .is_some_and(|s| !matches!(s.change_log, ChangeLogPlace::Off));
    let restart = crate::takeover::plan(&opts, uring, change_log);
    if let (Err(why), options::Switch::On) = (&restart, opts.restart) {
        return Err(crate::message!(
            "restart=on: this mount cannot survive its daemon: {why}"
        ));
    }
    let mut config = Config::from_options(&opts);
    config.pending_arena = inherited
        .as_mut()
        .and_then(|i| i.arena.take())
        .map(Arc::new);
    config.precontent_kept = inherited
        .as_mut()
        .and_then(|i| i.events.take())
        .map(Arc::new);
    config.survives = restart == Ok(crate::takeover::Survival::Always) && !opts.foreground;
    if inherited.is_some()
        && config.pending_arena.is_none()
        && restart == Ok(crate::takeover::Survival::Always)
    {
        // A holder that keeps no pending blocks (its binary is older than this one's): a
        // write that returned would die with this daemon. A partial block is filled before its
        // write returns instead.
        config.caw_memory = None;
    }
    let overlay = Overlay::new(layers, config)?;
    if overlay.layers().work.is_some() && !overlay.sparse().sparse {
        eprintln!(
            "mosaicfs: warning: the upper file system does not report holes in sparse files; \
             files are copied up whole (block-level copy-up needs ext4, xfs, btrfs or tmpfs)"
        );
    }
    let overlay = Arc::new(overlay);
    let takeovers = inherited.as_ref().map_or(0, |i| i.takeovers);
    let (mut started, channel) = match inherited {
        Some(inherited) => {
            let survival = restart.clone().unwrap_or(crate::takeover::Survival::Always);
            let channel = crate::takeover::Channel::new(inherited.channel, &survival);
            let started = resume(overlay, &opts, inherited.fuse, &inherited.init)?;
            (started, Some(channel))
        }
        None => match start(overlay, &opts, uring, restart.is_ok())? {
            Some(started) => (started, None),
            None => {
                log::info!(
                    "'{}' was unmounted before the kernel's first request: nothing to serve",
                    opts.mountpoint.display()
                );
                return Ok(());
            }
        },
    };
    // The kernel's INIT request, replayed by every daemon: a holder started later needs it.
    let init = started.session.init_request().to_vec();
    // The kernel's part, known once INIT was seen.
    let restart = restart.and_then(|survival| match started.overlay.kernel_resends() {
        true => Ok(survival),
        false => Err(
            "the kernel cannot resend the requests a daemon leaves unanswered \
                      (FUSE_NOTIFY_RESEND, Linux 6.9+)"
                .to_string(),
        ),
    });
    if let (Err(why), options::Switch::On, 0) = (&restart, opts.restart, takeovers) {
        return Err(crate::message!(
            "restart=on: this mount cannot survive its daemon: {why}"
        ));
    }
    let mut notify: Option<OwnedFd> = None;
    let mut channel = channel;
    if !opts.foreground && channel.is_none() {
        // The mount is live: it answers as soon as the child serves. Only the pre-content
        // guardian (partial_passthrough) can still fail in the child; the parent waits for
        // the child only then, and else exits at once (it never unmounts: the child owns the
        // session now).
        let pipe = if started.overlay.precontent().is_ok() {
            Some(rustix::pipe::pipe().map_err(|e| crate::message!("pipe: {e}"))?)
        } else {
            None
        };
        match crate::sys::fork().map_err(|e| crate::message!("fork: {e}"))? {
            Some(_child) => {
                std::mem::forget(started);
                return match pipe {
                    Some((r, w)) => {
                        drop(w);
                        wait_for_child(r)
                    }
                    None => Ok(()),
                };
            }
            None => {
                let _ = rustix::process::setsid();
                notify = pipe.map(|(r, w)| {
                    drop(r);
                    w
                });
                if let Ok(survival) = &restart {
                    // This process becomes the mount's holder; the daemon goes on in a child.
                    let w = crate::takeover::split_off_holder(
                        std::os::fd::AsFd::as_fd(&started.session),
                        started.overlay.pending_arena(),
                        change_log_fd(&started.overlay),
                        held_events(&started.overlay, &opts).as_ref(),
                        &init,
                        &started_as.0,
                        &started_as.1,
                    )?;
                    channel = Some(crate::takeover::Channel::new(w, survival));
                }
            }
        }
    }
    let crash_ends = match &restart {
        Ok(crate::takeover::Survival::UpgradeOnly(why)) => Some(why.clone()),
        _ => None,
    };
    let holder = match (&channel, restart) {
        (Some(_), _) => Ok(Arc::new(std::sync::atomic::AtomicI32::new(
            rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get()),
        ))),
        (None, Ok(_)) => Err("no holder process".to_string()),
        (None, Err(why)) => Err(why),
    };
    let holder_pid = holder.as_ref().ok().cloned();
    started.overlay.set_lineage(crate::overlay::Lineage {
        takeovers,
        holder,
        crash_ends,
        binary: started_as.0.clone(),
    });
    if takeovers == 0 && !opts.read_only {
        // Records of removed files of a mount before this one: its daemons are gone with it.
        started.overlay.clear_orphans();
    }
    if !opts.read_only {
        started.overlay.empty_memory_work(takeovers > 0);
        if takeovers > 0 {
            started.overlay.note_left_records();
        }
    }
    started.overlay.start_request_records();
    if channel.is_some() {
        started.overlay.start_alias_records();
        if started.overlay.fresh_file_ids() {
            // The kernel's names lead to the old daemons' inodes, which may be bound to their
            // backing files: every one is looked up again, and finds a node id of this daemon's.
            if let Err(e) = started.session.notifier().inc_epoch() {
                log::warn!("cannot have the kernel look every name up again: {e}");
            }
        }
    }
    if let Some(channel) = channel {
        // The mount stays when this daemon's session ends: the next daemon serves it.
        started.session.keep_mounted();
        let stopper = started.session.stopper();
        let channel = Arc::new(channel);
        match (
            holder_pid,
            std::os::fd::AsFd::as_fd(&started.session).try_clone_to_owned(),
        ) {
            (Some(pid), Ok(fuse)) => crate::takeover::keep_a_holder(
                channel.clone(),
                crate::takeover::HolderSpec {
                    fuse,
                    arena: started
                        .overlay
                        .pending_arena()
                        .and_then(|a| a.try_clone_to_owned().ok()),
                    changes: change_log_fd(&started.overlay)
                        .and_then(|a| a.try_clone_to_owned().ok()),
                    events: held_events(&started.overlay, &opts),
                    takeovers,
                    init,
                    binary: started_as.0.clone(),
                    args: started_as.1.clone(),
                },
                pid,
            ),
            (None, _) => {}
            (_, Err(e)) => log::warn!("cannot watch the mount's holder ({e})"),
        }
        started.overlay.on_handover(move |binary| {
            channel.hand_over_to(binary)?;
            let stopper = stopper.clone();
            std::thread::Builder::new()
                .name("mosaicfs-handover".into())
                .spawn(move || stopper.stop())
                .map_err(|e| crate::message!("cannot stop serving: {e}"))?;
            Ok(())
        });
    }
    let result = serve(started, &opts, &mut notify, metrics, log_file);
    if let (Err(e), Some(w)) = (&result, notify) {
        let mut f = std::fs::File::from(w);
        let _ = f.write_all(e.to_string().as_bytes());
    }
    result
}

/// The pre-content group and table for the mount's holder to keep, if this mount has them.
/// Whether a memory upper keeps a change log for the daemon that takes the mount over after a
/// crash (memory_upper/changes.rs): the one the holder kept (`inherited`), else a new one —
/// none where no daemon will take over, nor when a holder of a binary from before keeps none.
fn change_log_place(
    opts: &Options,
    inherited: Option<&mut crate::takeover::Inherited>,
) -> ChangeLogPlace {
    let survives = opts.restart != options::Switch::Off
        && !opts.foreground
        && opts.filestore != Some(options::FilestorePlace::Anonymous);
    match inherited {
        _ if !survives => ChangeLogPlace::Off,
        Some(i) => i
            .changes
            .take()
            .map_or(ChangeLogPlace::Off, |fd| ChangeLogPlace::Kept(Arc::new(fd))),
        None => ChangeLogPlace::New,
    }
}

/// The memory upper's change log, for the holder to keep.
fn change_log_fd(overlay: &Overlay) -> Option<std::os::fd::BorrowedFd<'_>> {
    overlay.layers().memory.as_ref()?.change_log()
}

fn held_events(overlay: &Overlay, opts: &Options) -> Option<crate::takeover::HeldEvents> {
    let (group, table) = overlay.precontent_kept()?;
    let held = crate::takeover::HeldEvents {
        group: group.try_clone_to_owned().ok()?,
        table: table.try_clone_to_owned().ok()?,
        work: overlay.precontent_work()?.to_path_buf(),
        mount: crate::sys::mount_id(&opts.mountpoint).ok()?,
    };
    Some(held)
}

/// Whether the session asks the kernel for io_uring (`uring=`): `on` fails the mount when the
/// kernel cannot give it, `auto` takes it when it can.
///
/// Two guarantees of lower_wait.rs need the /dev/fuse worker pool, so `auto` keeps /dev/fuse
/// for them and `on` refuses them: `lower_timeout=` answers a request before its worker,
/// which io_uring cannot (the reply goes through the worker's ring entry); and a layer on a
/// store's client that stops answering must not take every worker — over io_uring a request
/// waits for an entry of its CPU's queue, and requests queued behind stuck entries move only
/// when one of those entries answers (entries added later take new requests, not queued ones).
fn use_uring(opts: &Options, layers: &LayerStack) -> Result<bool> {
    let kernel = fuser::uring_enabled();
    let on_store = layers.lower_ids().find(|&l| layers.layer(l).on_store);
    match opts.uring {
        options::Uring::Off => Ok(false),
        options::Uring::Auto => {
            Ok(kernel == Some(true) && opts.lower_timeout.is_none() && on_store.is_none())
        }
        options::Uring::On if opts.lower_timeout.is_some() => Err(
            "uring=on cannot serve lower_timeout= (a request over io_uring is answered only by \
             its worker): use uring=auto, which keeps /dev/fuse then, or drop lower_timeout"
                .into(),
        ),
        options::Uring::On if on_store.is_some() => Err(crate::message!(
            "uring=on: lower layer '{}' is on a network or FUSE store, and a store that stops \
             answering would hold up every request queued behind it over io_uring; use \
             uring=auto, which keeps /dev/fuse then",
            layers.layer(on_store.unwrap_or_default()).path.display()
        )),
        options::Uring::On => match kernel {
            Some(true) => Ok(true),
            Some(false) => Err(crate::message!(
                "uring=on: FUSE over io_uring is off in this kernel; turn it on as root with \
                 'echo Y > {}', or mount with uring=auto",
                fuser::URING_ENABLE_PARAMETER
            )),
            None => Err(
                "uring=on: this kernel has no FUSE over io_uring (Linux 6.14+ with \
                 CONFIG_FUSE_IO_URING); mount with uring=auto or uring=off"
                    .into(),
            ),
        },
    }
}

fn wait_for_child(r: OwnedFd) -> Result<()> {
    let mut f = std::fs::File::from(r);
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    match buf.as_slice() {
        [0] => Ok(()),
        [] => Err("the mount daemon exited before the mount was live".into()),
        msg => Err(String::from_utf8_lossy(msg).into_owned().into()),
    }
}

/// Keeps the lower layers' down flags current (lower_wait.rs): a layer is down while one
/// request has waited on it for `lower_timeout=` — each such request is answered EIO; the
/// worker stays blocked until the store answers, and its late reply finds no request and is
/// dropped — or while so many workers are stuck on it that only a reserve of the pool is left.
fn spawn_lower_watchdog(
    watch: fuser::RequestWatch,
    limits: crate::lower_wait::Limits,
    overlay: Arc<Overlay>,
) {
    use std::time::Duration;
    crate::lower_wait::watch(limits);
    // While threads wait on a layer, quick enough to flag it suspect (`STUCK`) before the
    // doubling pool fills with it; an idle mount wakes four times a second.
    let busy_tick = limits
        .timeout
        .map_or(Duration::from_millis(50), |t| t / 4)
        .clamp(Duration::from_millis(10), Duration::from_millis(50));
    let idle_tick = Duration::from_millis(250).min(limits.timeout.map_or(Duration::MAX, |t| t / 4));
    let _ = std::thread::Builder::new()
        .name("mosaicfs-lower-watch".into())
        .spawn(move || {
            let mut answered: std::collections::HashSet<u64> = Default::default();
            let mut saturated: Vec<crate::layers::LayerId> = Vec::new();
            let mut tick = idle_tick;
            loop {
                std::thread::sleep(tick);
                let found = crate::lower_wait::overdue(limits);
                tick = if found.waiting > 0 { busy_tick } else { idle_tick };
                for &layer in &found.saturated {
                    if !saturated.contains(&layer) {
                        log::warn!(
                            "{} requests wait on lower layer '{}', one for over {:.2} s: further \
                             requests on it fail with EIO at once until it answers again, so \
                             that the rest of the mount keeps worker threads (lower_timeout= \
                             bounds each wait)",
                            limits.saturated,
                            overlay.layers().layer(layer).path.display(),
                            limits.stuck.as_secs_f64()
                        );
                    }
                }
                for &layer in &saturated {
                    if !found.saturated.contains(&layer) {
                        log::info!(
                            "lower layer '{}' answers again",
                            overlay.layers().layer(layer).path.display()
                        );
                    }
                }
                saturated = found.saturated;
                let late = found.late;
                let busy = watch.busy();
                answered.retain(|u| busy.iter().any(|b| b.unique == *u));
                for (tid, layer, waited) in late {
                    let Some(req) = busy.iter().find(|b| b.thread == tid) else {
                        continue; // a background thread (completion), not a request
                    };
                    if !answered.insert(req.unique) {
                        continue;
                    }
                    let what = if layer == crate::lower_wait::DATA {
                        "a lower file's data".to_string()
                    } else {
                        format!("lower layer '{}'", overlay.layers().layer(layer).path.display())
                    };
                    log::warn!(
                        "a request has waited {:.1} s on {what}: answered EIO (lower_timeout={:.1}); \
                         requests on that layer fail at once until it answers again",
                        waited.as_secs_f64(),
                        limits.timeout.unwrap_or_default().as_secs_f64()
                    );
                    match watch.answer(req, fuser::Errno::EIO) {
                        Ok(()) => overlay.stats().lower_timeouts.add(1),
                        // Answered meanwhile by its worker.
                        Err(e) => log::info!("the EIO answer was not taken: {e}"),
                    }
                }
            }
        });
}

/// The most FUSE worker threads a mount grows to (see `fuser_config`).
const MAX_WORKERS: usize = 64;

/// The session's settings; `uring`: ask the kernel for io_uring (`use_uring`).
/// `restartable`: the mount may be taken over by another daemon (takeover.rs), so every
/// worker reads the one descriptor the holder keeps (no clones).
fn fuser_config(opts: &Options, uring: bool, restartable: bool) -> fuser::Config {
    use fuser::MountOption as M;
    let mut mo = vec![
        M::FSName(opts.fsname.clone()),
        M::CUSTOM("subtype=mosaicfs".into()),
    ];
    if opts.default_permissions {
        mo.push(M::DefaultPermissions);
    }
    mo.push(if opts.read_only { M::RO } else { M::RW });
    mo.push(if opts.suid { M::Suid } else { M::NoSuid });
    mo.push(if opts.dev { M::Dev } else { M::NoDev });
    mo.push(if opts.exec { M::Exec } else { M::NoExec });
    if opts.noatime {
        mo.push(M::NoAtime);
    }
    if opts.sync {
        mo.push(M::Sync);
    }
    if opts.dirsync {
        mo.push(M::DirSync);
    }
    let mut cfg = fuser::Config::default();
    cfg.mount_options = mo;
    cfg.acl = if opts.allow_other && rustix::process::geteuid().is_root() {
        fuser::SessionACL::All
    } else {
        fuser::SessionACL::Owner
    };
    cfg.n_threads = Some(opts.threads);
    // One worker at mount; more while requests wait for one (an idle mount holds one).
    cfg.min_threads = Some(1);
    // While every worker is stuck on one request (a lower layer on a network store that
    // stopped answering), more workers serve the rest of the mount; `threaded=0` keeps one.
    if opts.threads > 1 {
        cfg.max_threads = Some(MAX_WORKERS.max(opts.threads));
    }
    // Workers added that way leave once the pool has had idle ones for a while (30 s; the
    // tests shorten it with `MOSAICFS_TEST_RETIRE_AFTER_MS`).
    cfg.retire_after = std::env::var("MOSAICFS_TEST_RETIRE_AFTER_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map(std::time::Duration::from_millis);
    // Workers added by demand leave again once the mount has been quiet for a while (5 s;
    // `MOSAICFS_TEST_SHRINK_AFTER_MS` in the tests): an idle mount holds one.
    cfg.shrink_after = std::env::var("MOSAICFS_TEST_SHRINK_AFTER_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map(std::time::Duration::from_millis);
    cfg.clone_fd = !restartable;
    // A request the kernel hands a daemon as it is killed goes to the next one (fuser's
    // request_pipe.rs).
    cfg.request_pipe = restartable;
    cfg.uring = uring;
    cfg
}

/// The mount as the command leaves it before it goes to the background: mounted, the
/// kernel's INIT answered, the control socket bound. No thread runs yet, so that the command
/// can fork.
struct Started {
    session: fuser::Session<MosaicFs>,
    overlay: Arc<Overlay>,
    control: Option<crate::control::Listener>,
}

/// Why this process cannot use /dev/fuse, when that is why a mount failed: the mount's own
/// error names the mount point, while the call that failed was the device's open.
fn fuse_device_problem() -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let e = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .err()?;
    Some(match e.kind() {
        std::io::ErrorKind::NotFound => "/dev/fuse does not exist: load the fuse module \
             (modprobe fuse) or, in a container, pass the device in (--device /dev/fuse)"
            .to_string(),
        _ => format!(
            "cannot open /dev/fuse ({e}; its mode is {:o}): a FUSE mount needs read and write \
             access to it; distributions ship it as 0666 (as root: chmod 0666 /dev/fuse)",
            std::fs::metadata("/dev/fuse").map_or(0, |m| m.permissions().mode() & 0o7777)
        ),
    })
}

/// Mounts and does all that can fail the mount without a thread: what fails here fails the
/// command with its reason. `None`: mounted, then unmounted before the kernel's INIT request
/// was read (a container that ended at once, a quick `umount`): the end its unmounter asked
/// for, not a failure of the mount.
fn start(
    overlay: Arc<Overlay>,
    opts: &Options,
    uring: bool,
    restartable: bool,
) -> Result<Option<Started>> {
    let fs = filesystem(&overlay, opts, restartable);
    let under = crate::sys::device_of(&opts.mountpoint);
    let config = fuser_config(opts, uring, restartable);
    let session = match fuser::Session::new(fs, &opts.mountpoint, &config) {
        Ok(session) => session,
        Err(e)
            if e.get_ref()
                .is_some_and(|e| e.is::<fuser::UnmountedDuringHandshake>()) =>
        {
            return Ok(None);
        }
        Err(e) => {
            return Err(match fuse_device_problem() {
                Some(problem) => {
                    crate::message!("cannot mount on '{}': {problem}", opts.mountpoint.display())
                }
                None => crate::message!("cannot mount on '{}': {e}", opts.mountpoint.display()),
            });
        }
    };
    if opts.uring == options::Uring::On && session.transport() != "io_uring" {
        return Err(crate::message!(
            "uring=on: the kernel did not offer io_uring when '{}' was mounted; check '{}'",
            opts.mountpoint.display(),
            fuser::URING_ENABLE_PARAMETER
        ));
    }
    // The new mount's device: the mount point's as the kernel knows it without asking this
    // daemon (`device_of`), once it differs from the directory's below the mount. Else
    // (a kernel that asks anyway) the newest mount there in /proc/self/mountinfo.
    let device = crate::sys::device_of(&opts.mountpoint).filter(|d| Some(d) != under.as_ref());
    Ok(Some(connected(session, overlay, opts, device)))
}

/// Takes over the connection `fuse` of a live mount whose daemon ended (takeover.rs): the
/// kernel's INIT request `init` is replayed, not answered, and the requests the old daemon
/// left unanswered are queued again. Nothing here may ask the mount anything: no daemon
/// answers it until this one serves.
fn resume(overlay: Arc<Overlay>, opts: &Options, fuse: OwnedFd, init: &[u8]) -> Result<Started> {
    let fs = filesystem(&overlay, opts, true);
    let config = fuser_config(opts, false, true);
    let acl = config.acl;
    let session = fuser::Session::resume(fs, fuse, acl, config, init).map_err(|e| {
        crate::message!(
            "cannot take over the mount on '{}': {e}",
            opts.mountpoint.display()
        )
    })?;
    Ok(connected(session, overlay, opts, None))
}

/// The file system a session serves.
/// `piped`: workers read requests through pipes (a mount that survives its daemon).
fn filesystem(overlay: &Arc<Overlay>, opts: &Options, piped: bool) -> MosaicFs {
    overlay.arm_workers();
    log_panics();
    MosaicFs {
        core: overlay.clone(),
        max_write: opts.max_write,
        piped,
        panic_on_lookup: std::env::var_os("MOSAICFS_TEST_PANIC"),
        hang_on_lookup: std::env::var_os("MOSAICFS_TEST_HANG"),
        hang_after_write: std::env::var_os("MOSAICFS_TEST_HANG_WRITE").map(|v| {
            use std::os::unix::ffi::OsStringExt;
            v.into_vec()
        }),
        hang_after_change: std::env::var_os("MOSAICFS_TEST_HANG_CHANGE"),
        slow_release: test_pause("MOSAICFS_TEST_SLOW_RELEASE"),
        late_forget: test_pause("MOSAICFS_TEST_LATE_FORGET"),
        no_opendir: false,
    }
}

/// A pause the tests ask for in milliseconds in the variable `name`.
fn test_pause(name: &str) -> Option<std::time::Duration> {
    let ms = std::env::var(name).ok()?.parse().ok()?;
    Some(std::time::Duration::from_millis(ms))
}

/// What a mounted or taken-over session needs before it serves: the kernel's notifications,
/// the transport, the read-ahead and the control socket (`device`: the mount's device number,
/// else the newest mount at the mount point in /proc/self/mountinfo).
fn connected(
    session: fuser::Session<MosaicFs>,
    overlay: Arc<Overlay>,
    opts: &Options,
    device: Option<String>,
) -> Started {
    let notifier = session.notifier();
    overlay.on_attrs_changed(move |ino, data| {
        // Offset -1: attributes only, the cached pages stay; 0: from the start, every page
        // (a directory's cached listing). ENOENT: the kernel holds no inode for it, so nothing
        // is cached.
        let offset = if data { 0 } else { -1 };
        let _ = notifier.inval_inode(fuser::INodeNo(ino), offset, 0);
    });
    overlay.set_transport(session.transport());
    let device = device.or_else(|| crate::control::mount_device(&opts.mountpoint));
    let control = device.and_then(|dev| {
        set_read_ahead(&dev, opts.read_ahead_kb);
        crate::control::bind(&overlay, &dev)
    });
    Started {
        session,
        overlay,
        control,
    }
}

/// Starts the daemon's threads, then serves until the mount goes away.
fn serve(
    started: Started,
    opts: &Options,
    notify: &mut Option<OwnedFd>,
    metrics: Option<std::net::TcpListener>,
    log_file: Option<std::fs::File>,
) -> Result<()> {
    let Started {
        session,
        overlay,
        control,
    } = started;
    if !opts.foreground && session.transport() == "io_uring" {
        prefer_own_autogroup();
    }
    // Mounted: the guardian learns the mount it guards (file/partial/precontent.rs). No partial
    // file is opened before the session runs.
    overlay.start_precontent(&opts.mountpoint)?;
    crate::sys::detach_on_signals(&opts.mountpoint);
    // A layer on a store's client is watched even without a timeout: one that stops answering
    // must not take every worker (lower_wait.rs).
    let on_store = overlay
        .layers()
        .lower_ids()
        .any(|l| overlay.layers().layer(l).on_store);
    if opts.lower_timeout.is_some() || on_store && opts.threads > 1 {
        let workers = MAX_WORKERS.max(opts.threads);
        let limits = crate::lower_wait::Limits {
            timeout: opts.lower_timeout,
            stuck: crate::lower_wait::STUCK,
            saturated: workers - (workers / 4).max(2),
        };
        spawn_lower_watchdog(session.request_watch(), limits, overlay.clone());
    }
    if let Some(control) = control {
        control.serve(overlay.clone(), opts.mountpoint.clone());
    }
    if let Some(listener) = metrics {
        crate::control::serve_metrics(overlay.clone(), listener);
    }
    if let Some(w) = notify.take() {
        // Closing the pipe after the byte lets the waiting parent exit.
        let mut f = std::fs::File::from(w);
        let _ = f.write_all(&[0]);
        drop(f);
    }
    if !opts.foreground {
        crate::logging::to_background(log_file);
        detach_stdio();
    }
    // Before any request is served, resent ones included; once the log goes where it is read.
    overlay.serve_precontent()?;
    overlay.replay_pending();
    let result = session.run();
    log::debug!("session ended");
    // Pending blocks reach the disk on every way out, not only through FUSE's destroy.
    overlay.shutdown();
    log::debug!("shut down");
    result.map_err(|e| crate::message!("FUSE session ended: {e}"))
}

/// The panic policy (docs/ROBUSTNESS.md): a panic in a request ends that request with EIO and
/// the mount goes on serving (fuser dispatches each request under `catch_unwind`; the
/// background workers catch per job). The panic is logged here, with where it happened.
fn log_panics() {
    std::panic::set_hook(Box::new(|info| {
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        let at = info
            .location()
            .map_or(String::new(), |l| format!(" at {}:{}", l.file(), l.line()));
        let thread = std::thread::current();
        log::error!(
            "bug: thread {} panicked{at}: {what}; the request it served failed with EIO and \
             the mount goes on (please report this with the log)",
            thread.name().unwrap_or("?")
        );
    }));
}

/// Raises the readahead of the mount's FUSE bdi. The kernel's 128 KiB means one READ round
/// trip per 128 KiB of a sequential read through the daemon; 4 MiB reads an untouched lower file
/// about three times faster (docs/KERNEL-NOTES.md). Best effort: sysfs may be read-only here.
fn set_read_ahead(dev: &str, kb: u32) {
    if kb == 0 {
        return;
    }
    let path = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    if let Err(e) = std::fs::write(&path, kb.to_string()) {
        log::info!(
            "cannot set {path} to {kb}: {e}; sequential reads through the daemon stay slower"
        );
    }
}

/// Gives glibc's malloc one arena, unless `MALLOC_ARENA_MAX` in the environment says
/// otherwise. glibc's default is eight per CPU, and the daemon's workers, each freeing nodes
/// another allocated, left memory spread over an arena each: 100,000 inodes looked up, 2,000
/// files made and removed and the caches dropped, four times over, held 61-93 MiB after each
/// walk and 20-54 MiB after each drop with the default, 45-62 and 18-23 with two arenas. And
/// `malloc_trim` gives back the top of the first arena only: with two, a churning daemon's
/// RSS after each minute's `drop_caches` swung between 9.0 and 13.8 MiB with the same 1.3 MiB
/// in use, by what the second arena's top held; with one, 8.8-9.7 (bench/soak.py). Untar and
/// rm -rf by one process or two at once took the same time with one arena or two: the
/// per-thread caches serve most allocations without an arena's lock (docs/PERFORMANCE.md,
/// "Memory per inode").
fn limit_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    // SAFETY: mallopt only sets a tunable of the allocator, before any thread but this one
    // exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// The glibc tunables that turn its per-thread malloc cache off and let a thread's stack go
/// when the thread ends (`exec_without_malloc_cache`).
const NO_MALLOC_CACHE: &str = "glibc.malloc.tcache_count=0:glibc.pthread.stack_cache_size=0";

/// Starts this program again, same arguments, with glibc's per-thread malloc cache (tcache)
/// off, unless it is off already or `GLIBC_TUNABLES` sets it some other way. Each worker's
/// cache keeps up to seven freed chunks of every size, and nothing but the worker itself can
/// empty it: after the kernel forgot 100,000 nodes, the chunks the workers' caches held sat
/// on a megabyte of heap pages that neither `free` nor `malloc_trim` could give back (RSS
/// 1.59x idle; without the cache 1.27x). The cache saves an uncontended lock per allocation,
/// which measured nothing against a round trip through the kernel (docs/PERFORMANCE.md,
/// "Memory per inode"). Likewise glibc keeps the stacks of ended threads for new ones, each
/// with a few resident pages: the workers a burst added and the pool let go (vendored fuser
/// `shrink`) left 12-16 KiB each. glibc reads its tunables only when a program starts, hence the exec:
/// a millisecond at mount, before anything is opened. Where it fails (no /proc), the daemon
/// runs with the cache, which costs memory, never correctness.
fn exec_without_malloc_cache() {
    let tunables = std::env::var_os("GLIBC_TUNABLES").unwrap_or_default();
    if tunables
        .to_string_lossy()
        .contains("glibc.malloc.tcache_count")
    {
        return;
    }
    let mut value = tunables;
    if !value.is_empty() {
        value.push(":");
    }
    value.push(NO_MALLOC_CACHE);
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| "mosaicfs".into());
    use std::os::unix::process::CommandExt;
    let _ = std::process::Command::new("/proc/self/exe")
        .arg0(arg0)
        .args(args)
        .env("GLIBC_TUNABLES", value)
        .exec();
}

/// Fixes glibc's thresholds for mapping a block of its own and for giving the top of an arena
/// back at their defaults (128 KiB). glibc raises both each time a block it mapped is freed,
/// up to that block's size and twice it: one big directory listing freed (a 100,000-entry
/// snapshot maps 3 MB) let every arena keep 6 MB at its top from then on, which `malloc_trim`
/// does not return for arenas other than the first. A daemon that walked 100,000 files and had
/// them forgotten held 4.8, 9.2, 6.5 and 6.9 MiB in four rounds, the second arena 0.6-4.7 MiB
/// of it (docs/PERFORMANCE.md, "Memory per inode").
fn keep_malloc_thresholds() {
    const DEFAULT: libc::c_int = 128 * 1024;
    // SAFETY: as above: tunables set before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, DEFAULT);
        libc::mallopt(libc::M_TRIM_THRESHOLD, DEFAULT);
    }
}

/// Gives the daemon's scheduler autogroup a nice of -10, over io_uring and in the background.
/// A daemon in the background has an autogroup of its own (it called setsid), weighed like any
/// session. Over io_uring a request's worker is pinned to its caller's CPU and the caller waits
/// for it there; at nice 0 the caller's wake-up of the worker does not preempt, and a null
/// round trip took 38-40 us against 29-34 us at -10 (the same as a daemon in its caller's own
/// session, `-f`). Over /dev/fuse the opposite held (63-76 us at 0, 147-170 us at -10: an
/// unpinned worker that preempts its caller costs a switch each way), so it is left alone
/// there. docs/PERFORMANCE.md has the measurements. Best effort: needs CAP_SYS_NICE and a
/// kernel with autogroups.
fn prefer_own_autogroup() {
    if let Err(e) = std::fs::write("/proc/self/autogroup", "-10") {
        log::info!("cannot raise the daemon's autogroup (/proc/self/autogroup): {e}");
    }
}

/// Points stdin, stdout and stderr at /dev/null: a daemon in the background keeps no terminal
/// or pipe of the command that started it open.
fn detach_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let _ = rustix::stdio::dup2_stdin(&null);
        let _ = rustix::stdio::dup2_stdout(&null);
        let _ = rustix::stdio::dup2_stderr(&null);
    }
}
