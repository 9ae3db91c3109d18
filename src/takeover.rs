//! A mount that outlives its daemon: a holder process keeps the FUSE connection, and when the
//! daemon serving it ends — killed, crashed, or stopped for an upgrade — starts a new one on
//! the same connection. Processes on the mount wait a moment and see no error.
//!
//! The connection lives as long as any process holds its /dev/fuse descriptor. The holder
//! (`mosaicfs __holder`, forked off when a mount goes to the background) holds the very
//! descriptor the daemon reads (the same open file: every worker reads it, none is a clone,
//! since the kernel fails the requests a clone holds when its last holder closes it), the
//! kernel's INIT request, and how the daemon was started. It waits for the daemon; when the
//! daemon has ended and the connection is still there, it starts the binary again with the same
//! arguments, passing the descriptor, the INIT request and how many daemons came before.
//!
//! The new daemon opens the layers as a remount would, replays INIT to itself without
//! answering it (`fuser::Session::resume`), and sends FUSE_NOTIFY_RESEND: the kernel queues
//! again every request the old daemon had read and not answered (Linux 6.9+). Then it serves
//! what the kernel still holds from its predecessors:
//!
//! - node ids: each is the object's merged inode number, found by number (by_number.rs) the
//!   first time a request names it (`Overlay::node`);
//! - open file handles: a handle's number carries the daemon that made it (handles.rs,
//!   `EPOCH_SHIFT`); the first request on an older one opens the file again with the flags the
//!   request carries (`Overlay::adopt_handle`). Everything a handle stands for is on disk:
//!   the upper file, its partial-file mark and present blocks;
//! - listing offsets: cookies made from names (readdir.rs), the same in every daemon;
//! - copy-after-write's pending blocks: in a memfd the holder keeps too (file/partial/arena.rs),
//!   written into their files before the new daemon serves (`Overlay::replay_pending`);
//! - pre-content events (`partial_passthrough`): the holder keeps the fanotify group, so the
//!   marks stay and accesses of holes wait, and a table of the marked files and the events in
//!   service (file/partial/served.rs), which the new daemon fills and answers before it reads
//!   an event itself (`Overlay::serve_precontent`);
//! - a memory upper's tree as it was at the last change: the image and journal hold it as of
//!   the last fsync, and a change log in a memfd the holder keeps holds the rest, which the
//!   new daemon applies as it opens the layer (memory_upper/changes.rs); a file of the layer
//!   removed while open keeps a name in the layer's work root until the kernel forgets it;
//!
//! A request in flight when the old daemon died is served again from the start. Reads and
//! writes at an offset are the same again, and an append goes where the kernel put it the
//! first time; a create, mkdir, link, removal or rename the old daemon had done is not done
//! again, as the work dir's record of requests in progress says (resend.rs, docs/ROBUSTNESS.md).
//!
//! Files passing through (root, a kernel with FUSE passthrough): a kernel inode stays bound to
//! the backing file a daemon registered while a file opened before is open, and the kernel
//! refuses any other registration of the same file with EIO. So a daemon that takes such a
//! mount over never lets the kernel open a regular file under a node id an earlier daemon gave
//! it: lookups hand out node ids of its own (`InodeTable::fresh_file_ids`), it has the kernel
//! look every name up again (FUSE_NOTIFY_INC_EPOCH, Linux 6.16+), and an OPEN of an earlier
//! id answers ESTALE, on which the kernel looks the name up again and opens the new id. Node
//! ids other than object numbers are recorded in the work dir (`mosaicfs-orphans/aliases`), so
//! that the next daemon finds their objects too. A daemon that hands over leaves its backing
//! registrations to the kernel (an OPEN answered just before names one).
//!
//! Where it is not done: `-f` (the daemon is whoever supervises it), io_uring (a queue's
//! entries belong to the ring of the daemon that made them), a memory upper whose filestore
//! is in memory too (the layer lives only in its daemon) or whose holder keeps no change log
//! (a binary from before: only a daemon that hands over is followed, see `Survival`), and a
//! mount without a work dir whose files pass through (no place for the records). `restart=`
//! and docs/ROBUSTNESS.md.
//!
//! A holder that ends with no daemon after the last, which did not exit cleanly, becomes the
//! pre-content guardian if it keeps the group (`Holder::end`).
//!
//! A holder that ends is replaced by the daemon (`keep_a_holder`): the new one waits for the
//! daemon by its pid, since it is not its parent, and starts the next daemon as before.
//!
//! Upgrading: `mosaicfs upgrade MNT` asks the daemon (control socket) to hand over. It tells the
//! holder which binary comes next, stops reading requests, answers the ones it holds, flushes,
//! and exits; the holder starts the new binary. Nothing is lost or answered twice.

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::options::{FilestorePlace, Options, PassthroughPolicy, Switch, UpperKind};

/// The hidden command the holder runs as.
pub const HOLDER_COMMAND: &str = "__holder";
/// What the holder hands a daemon it starts (hex fields, see `Inherited`).
const TAKEOVER_ENV: &str = "MOSAICFS_TAKEOVER";
/// The descriptor of the pending blocks' memfd the holder hands a daemon, if any
/// (file/partial/arena.rs).
const TAKEOVER_ARENA_ENV: &str = "MOSAICFS_TAKEOVER_ARENA";
/// The pre-content group's and table's descriptors the holder hands a daemon, if any, as
/// `GROUP,TABLE` (file/partial/served.rs).
const TAKEOVER_EVENTS_ENV: &str = "MOSAICFS_TAKEOVER_EVENTS";
/// The descriptor of a memory upper's change log the holder hands a daemon, if any
/// (memory_upper/changes.rs).
const TAKEOVER_CHANGES_ENV: &str = "MOSAICFS_TAKEOVER_CHANGES";
/// Whether the binary at `path` takes over the pre-content group a holder keeps: it names
/// `TAKEOVER_EVENTS_ENV` (a binary from before does not, and would leave the writers waiting on
/// the kept group's events for good).
pub fn takes_over_events(path: &Path) -> std::io::Result<bool> {
    use std::io::Read;
    let needle = TAKEOVER_EVENTS_ENV.as_bytes();
    let mut file = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    // The last bytes of each read are kept for the next: the name may straddle two reads.
    let mut kept = 0;
    loop {
        let n = file.read(&mut buf[kept..])?;
        if n == 0 {
            return Ok(false);
        }
        let end = kept + n;
        if buf[..end].windows(needle.len()).any(|w| w == needle) {
            return Ok(true);
        }
        kept = (needle.len() - 1).min(end);
        buf.copy_within(end - kept..end, 0);
    }
}

/// What a holder starts from (hex fields, see `holder_main`).
const HOLDER_ENV: &str = "MOSAICFS_HOLDER";
/// This many daemons in a row that exit with an error before `GOOD_AFTER` and the holder gives
/// up: one that cannot start would otherwise be started forever. The mount then ends as it
/// would without a holder. A daemon killed by a signal is always replaced (a pause of
/// `KILLED_PAUSE` first when it was killed that early, so that a loop never spins).
const MAX_FAILED_STARTS: usize = 5;
const KILLED_PAUSE: Duration = Duration::from_millis(5);
/// A daemon that ran this long was good: an upgrade that fails is taken back to it.
const GOOD_AFTER: Duration = Duration::from_secs(2);

/// How a mount outlives its daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Survival {
    /// However the daemon ends, the next one takes the mount over.
    Always,
    /// Only a daemon that hands over (`mosaicfs upgrade`) is followed by another: one that
    /// dies ends the mount, as without a holder. Why a death cannot be survived.
    UpgradeOnly(String),
}

/// Whether a mount with these options can survive its daemon, decided before it is mounted
/// (`uring`: requests will come over io_uring; `change_log`: a memory upper keeps one). The
/// kernel's part (FUSE_NOTIFY_RESEND) is known only after INIT.
pub fn plan(
    opts: &Options,
    uring: bool,
    change_log: bool,
) -> std::result::Result<Survival, String> {
    let why = if opts.restart == Switch::Off {
        "restart=off"
    } else if opts.foreground {
        "-f: the daemon runs in the foreground, under whatever started it"
    } else if uring {
        "requests come over io_uring, whose queues belong to the daemon that made them"
    } else if opts.passthrough != PassthroughPolicy::Off
        && opts.upperdir.is_none()
        && crate::sys::admin_of_initial_namespace()
    {
        "files pass through on a mount without a work dir, where the next daemon would find \
         no record of the node ids it must not reuse (passthrough=off survives)"
    } else if opts.upper_kind == UpperKind::Memory
        && opts.filestore == Some(FilestorePlace::Anonymous)
    {
        "upper=memory with filestore=memory: the layer lives only in its daemon"
    } else if opts.upper_kind == UpperKind::Memory && !change_log {
        // A daemon that hands over writes the tree's last changes to the journal first
        // (overlay.rs, at the end of serving), and the next one reads them back; one that
        // dies without a change log the holder keeps (memory_upper/changes.rs) takes with it
        // what it changed since the last fsync.
        let why = "upper=memory: the mount's holder keeps no change log of the tree (it runs \
                   a binary from before 2026-12-01)";
        if opts.restart == Switch::On {
            return Err(format!(
                "{why} (without restart=on such a mount is still upgraded in place)"
            ));
        }
        return Ok(Survival::UpgradeOnly(format!(
            "{why}: a daemon that dies ends the mount"
        )));
    } else {
        return Ok(Survival::Always);
    };
    Err(why.to_string())
}

/// What a daemon started by a holder inherits: the connection, the pipe to the holder, how
/// many daemons served the mount before it, and the kernel's INIT request.
pub struct Inherited {
    pub fuse: OwnedFd,
    pub channel: OwnedFd,
    pub takeovers: u32,
    pub init: Vec<u8>,
    /// The memfd of copy-after-write's pending blocks (file/partial/arena.rs); `None` from a
    /// holder that keeps none (a binary before 2026-12-01, or a mount without one).
    pub arena: Option<OwnedFd>,
    /// The pre-content group and its table (file/partial/served.rs), if the holder keeps them.
    pub events: Option<(OwnedFd, OwnedFd)>,
    /// A memory upper's change log (memory_upper/changes.rs), if the holder keeps one.
    pub changes: Option<OwnedFd>,
}

impl Inherited {
    /// Taken from the environment the holder set, once (the variable goes, so that nothing
    /// this daemon starts takes it for its own).
    pub fn from_env() -> Result<Option<Inherited>> {
        let Some(value) = std::env::var_os(TAKEOVER_ENV) else {
            return Ok(None);
        };
        // SAFETY: called at start, before the daemon starts any thread.
        unsafe { std::env::remove_var(TAKEOVER_ENV) };
        let fields = decode(&value);
        let bad = || crate::message!("{TAKEOVER_ENV} is set by a mount's holder, not by hand");
        let [fuse, channel, takeovers, init] = fields.as_slice() else {
            return Err(bad());
        };
        // Its own variable, which a binary from before it ignores (a downgrade still starts).
        let arena = std::env::var_os(TAKEOVER_ARENA_ENV);
        let events = std::env::var_os(TAKEOVER_EVENTS_ENV);
        let changes = std::env::var_os(TAKEOVER_CHANGES_ENV);
        // SAFETY: as above.
        unsafe {
            std::env::remove_var(TAKEOVER_ARENA_ENV);
            std::env::remove_var(TAKEOVER_EVENTS_ENV);
            std::env::remove_var(TAKEOVER_CHANGES_ENV);
        }
        let number = |f: &OsString| f.to_str().and_then(|s| s.parse::<i32>().ok());
        let fd = |f: &OsString| number(f).and_then(crate::sys::inherited_fd);
        let (Some(fuse), Some(channel), Some(takeovers)) =
            (fd(fuse), fd(channel), number(takeovers))
        else {
            return Err(bad());
        };
        let arena = arena.as_ref().and_then(fd);
        let changes = changes.as_ref().and_then(fd);
        let events = events.as_ref().and_then(|v| {
            let (g, t) = v.to_str()?.split_once(',')?;
            let fd = |n: &str| n.parse().ok().and_then(crate::sys::inherited_fd);
            Some((fd(g)?, fd(t)?))
        });
        for fd in [
            Some(&fuse),
            Some(&channel),
            arena.as_ref(),
            changes.as_ref(),
        ]
        .into_iter()
        .chain(events.iter().flat_map(|(g, t)| [Some(g), Some(t)]))
        .flatten()
        {
            let _ = rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC);
        }
        Ok(Some(Inherited {
            fuse,
            channel,
            takeovers: takeovers as u32,
            init: init.as_bytes().to_vec(),
            arena,
            events,
            changes,
        }))
    }
}

/// The daemon's end of the pipe to its holder: where it says which binary takes over, and
/// whether a daemon that dies is to be followed at all (`Survival::UpgradeOnly`).
pub struct Channel {
    end: std::sync::Mutex<std::fs::File>,
    upgrade_only: bool,
}

/// The line that tells a holder not to start another daemon after this one dies: the holder
/// reads what its daemon wrote once that daemon has ended.
const UPGRADE_ONLY: &str = "upgrade-only";

impl Channel {
    pub fn new(fd: OwnedFd, survival: &Survival) -> Channel {
        let channel = Channel {
            end: std::sync::Mutex::new(std::fs::File::from(fd)),
            upgrade_only: matches!(survival, Survival::UpgradeOnly(_)),
        };
        channel.say_what_survives();
        channel
    }

    fn say_what_survives(&self) {
        if self.upgrade_only {
            let mut end = self.end.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(e) = end.write_all(format!("{UPGRADE_ONLY}\n").as_bytes()) {
                log::warn!("cannot reach the mount's holder ({e})");
            }
        }
    }

    /// A copy of the current end, to wait on: it reports an error once the holder is gone.
    fn watch(&self) -> std::io::Result<OwnedFd> {
        self.end
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_fd()
            .try_clone_to_owned()
    }

    /// The end of the pipe to a new holder.
    fn replace(&self, fd: OwnedFd) {
        *self.end.lock().unwrap_or_else(|e| e.into_inner()) = std::fs::File::from(fd);
        self.say_what_survives();
    }

    /// Tells the holder that `binary` is to serve the mount once this daemon has ended.
    pub fn hand_over_to(&self, binary: &Path) -> Result<()> {
        let mut line = b"upgrade\t".to_vec();
        line.extend_from_slice(binary.as_os_str().as_bytes());
        line.push(b'\n');
        self.end
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write_all(&line)
            .map_err(|e| crate::message!("cannot reach the mount's holder: {e}"))
    }
}

/// Splits the holder off this process (the daemon in the background, before any thread):
/// returns in the child, which goes on as the daemon, with its end of the pipe to the holder;
/// this process becomes the holder and never returns. `args` and `binary`: how the daemon was
/// started, for the next one.
pub fn split_off_holder(
    fuse: BorrowedFd<'_>,
    arena: Option<BorrowedFd<'_>>,
    changes: Option<BorrowedFd<'_>>,
    events: Option<&HeldEvents>,
    init: &[u8],
    binary: &Path,
    args: &[OsString],
) -> Result<OwnedFd> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| crate::message!("pipe: {e}"))?;
    let Some(daemon) = crate::sys::fork().map_err(|e| crate::message!("fork: {e}"))? else {
        drop(r);
        return Ok(w);
    };
    drop(w);
    // The holder keeps what it needs past exec, without CLOEXEC; the exec drops everything
    // else the daemon had open (the layers, the work dir's lock, the control socket).
    let fuse = keep_across_exec(fuse);
    let channel = keep_across_exec(r.as_fd());
    let memfds = [arena.map(keep_across_exec), changes.map(keep_across_exec)];
    let events = events.map(|e| e.keep_across_exec());
    use std::os::unix::process::CommandExt;
    let err = holder_command(fuse, channel, memfds, events, daemon, 0, binary, init, args).exec();
    // The daemon serves on; it just will not be restarted.
    log::error!("cannot start the mount's holder: {err}; the mount ends with its daemon");
    std::process::exit(0);
}

/// The pre-content group and table a holder keeps for the next daemon (file/partial/served.rs),
/// and what it needs to guard the group when it gives the mount up: the work dir and the
/// mount's id (`mosaicfs __guardian`, file/partial/precontent.rs).
pub struct HeldEvents {
    pub group: OwnedFd,
    pub table: OwnedFd,
    pub work: PathBuf,
    pub mount: u64,
}

/// `HeldEvents` as descriptor numbers open across an exec.
struct EventsAcrossExec<'a> {
    group: i32,
    table: i32,
    work: &'a Path,
    mount: u64,
}

impl HeldEvents {
    fn keep_across_exec(&self) -> EventsAcrossExec<'_> {
        EventsAcrossExec {
            group: keep_across_exec(self.group.as_fd()),
            table: keep_across_exec(self.table.as_fd()),
            work: &self.work,
            mount: self.mount,
        }
    }
}

impl EventsAcrossExec<'_> {
    /// Closes the copies (the process they were made for has them now, or failed to start).
    fn close(&self) {
        // SAFETY: the copies `keep_across_exec` made, closed once.
        unsafe {
            libc::close(self.group);
            libc::close(self.table);
        }
    }
}

/// How a holder is started: the connection's, the pipe's, the pending blocks' and change
/// log's (`memfds`) and the pre-content group's descriptor numbers (open across the exec), the
/// daemon it waits for and how many served before it, and how to start the next one.
#[allow(clippy::too_many_arguments)]
fn holder_command(
    fuse: i32,
    channel: i32,
    memfds: [Option<i32>; 2],
    events: Option<EventsAcrossExec<'_>>,
    daemon: i32,
    takeovers: u32,
    binary: &Path,
    init: &[u8],
    args: &[OsString],
) -> std::process::Command {
    let mut fields: Vec<OsString> = vec![
        fuse.to_string().into(),
        channel.to_string().into(),
        daemon.to_string().into(),
        binary.as_os_str().to_owned(),
        OsString::from_vec(init.to_vec()),
        takeovers.to_string().into(),
        memfds[0].map_or(OsString::new(), |fd| fd.to_string().into()),
    ];
    match &events {
        Some(e) => fields.extend([
            e.group.to_string().into(),
            e.table.to_string().into(),
            e.mount.to_string().into(),
            e.work.as_os_str().to_owned(),
        ]),
        None => fields.extend([
            OsString::new(),
            OsString::new(),
            OsString::new(),
            OsString::new(),
        ]),
    }
    fields.push(memfds[1].map_or(OsString::new(), |fd| fd.to_string().into()));
    fields.extend(args.iter().cloned());
    use std::os::unix::process::CommandExt;
    let mut command = std::process::Command::new("/proc/self/exe");
    command
        .arg0("mosaicfs-holder")
        .arg(HOLDER_COMMAND)
        .env(HOLDER_ENV, encode(&fields))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    command
}

/// What a daemon needs to start a holder of its own.
pub struct HolderSpec {
    pub fuse: OwnedFd,
    /// The memfd of copy-after-write's pending blocks, if the mount has one.
    pub arena: Option<OwnedFd>,
    /// The memory upper's change log, if the mount has one.
    pub changes: Option<OwnedFd>,
    /// The pre-content group and table, if the mount serves partial files so.
    pub events: Option<HeldEvents>,
    /// Daemons before this one.
    pub takeovers: u32,
    pub init: Vec<u8>,
    pub binary: PathBuf,
    pub args: Vec<OsString>,
}

/// Keeps the mount restartable when its holder ends (killed, or an OOM kill despite its
/// score): a thread of the daemon waits on its end of the pipe to the holder, which reports an
/// error once no holder reads it, and then starts another holder — a child of the daemon, in
/// a session of its own — that waits for this daemon by its pid and restarts it as the first
/// one would. `pid` is the current holder's, as `mosaicfs status` shows it.
pub fn keep_a_holder(
    channel: std::sync::Arc<Channel>,
    spec: HolderSpec,
    pid: std::sync::Arc<std::sync::atomic::AtomicI32>,
) {
    use std::sync::atomic::Ordering;
    let watch = move || {
        // The first holder is this daemon's parent; the ones it starts are its children.
        let mut ours = false;
        loop {
            let Ok(end) = channel.watch() else { return };
            let mut fds = [rustix::event::PollFd::new(
                &end,
                rustix::event::PollFlags::empty(),
            )];
            while rustix::event::poll(&mut fds, None).is_err() {}
            drop(end);
            let old = pid.load(Ordering::Relaxed);
            if ours {
                // SAFETY: waitpid of a child this daemon started (it has ended).
                unsafe { libc::waitpid(old, std::ptr::null_mut(), 0) };
            }
            if !connected(&spec.fuse) {
                return;
            }
            match start_holder(&spec) {
                Ok((new, end)) => {
                    channel.replace(end);
                    pid.store(new, Ordering::Relaxed);
                    ours = true;
                    log::warn!(
                        "the mount's holder (pid {old}) ended: started another (pid {new}); \
                         the mount still survives its daemon"
                    );
                }
                Err(e) => {
                    log::error!(
                        "the mount's holder (pid {old}) ended and another cannot start ({e}): \
                         the mount now ends with its daemon"
                    );
                    return;
                }
            }
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("mosaicfs-holder-watch".into())
        .spawn(watch)
    {
        log::warn!("cannot watch the mount's holder ({e}): a holder that ends is not replaced");
    }
}

/// Starts a holder for this daemon: its pid and the daemon's end of the pipe to it.
fn start_holder(spec: &HolderSpec) -> std::io::Result<(i32, OwnedFd)> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let fuse = keep_across_exec(spec.fuse.as_fd());
    let read = keep_across_exec(r.as_fd());
    let memfds =
        [&spec.arena, &spec.changes].map(|m| m.as_ref().map(|f| keep_across_exec(f.as_fd())));
    let events = spec.events.as_ref().map(HeldEvents::keep_across_exec);
    let closing = events.as_ref().map(|e| (e.group, e.table));
    let mut command = holder_command(
        fuse,
        read,
        memfds,
        events,
        std::process::id() as i32,
        spec.takeovers,
        &spec.binary,
        &spec.init,
        &spec.args,
    );
    use std::os::unix::process::CommandExt;
    // SAFETY: setsid(2) is async-signal-safe; the holder leaves the daemon's session, so that
    // what ends the daemon's session or process group does not end it.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let child = command.spawn();
    // SAFETY: the copies made for the child, which has them now (or failed to start).
    unsafe {
        for fd in [Some(fuse), Some(read), memfds[0], memfds[1]]
            .into_iter()
            .chain(closing.into_iter().flat_map(|(g, t)| [Some(g), Some(t)]))
            .flatten()
        {
            libc::close(fd);
        }
    }
    Ok((child?.id() as i32, w))
}

/// A copy of `fd` that an exec keeps (no CLOEXEC); the number.
fn keep_across_exec(fd: BorrowedFd<'_>) -> i32 {
    // SAFETY: F_DUPFD of a descriptor this process holds; the copy is this process's to keep
    // until it execs, which is what it is for.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD, 3) }
}

/// The daemon the holder waits for now (for the signal handlers).
static DAEMON: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The holder: waits for the daemon, and starts the next one while the connection lives.
pub fn holder_main() -> i32 {
    let fields = std::env::var_os(HOLDER_ENV)
        .map(|v| decode(&v))
        .unwrap_or_default();
    // SAFETY: single-threaded, at start.
    unsafe { std::env::remove_var(HOLDER_ENV) };
    let number = |i: usize| -> Option<i32> { fields.get(i)?.to_str()?.parse().ok() };
    let (Some(fuse), Some(channel), Some(daemon), Some(binary), Some(init), Some(takeovers)) = (
        number(0).and_then(crate::sys::inherited_fd),
        number(1).and_then(crate::sys::inherited_fd),
        number(2),
        fields.get(3).map(PathBuf::from),
        fields.get(4).map(|f| f.as_bytes().to_vec()),
        number(5),
    ) else {
        eprintln!("mosaicfs: {HOLDER_COMMAND} is started by a mount, not by hand");
        return 2;
    };
    let arena = number(6).and_then(crate::sys::inherited_fd);
    let events = match (
        number(7).and_then(crate::sys::inherited_fd),
        number(8).and_then(crate::sys::inherited_fd),
        fields.get(9).and_then(|f| f.to_str()?.parse().ok()),
        fields.get(10).filter(|f| !f.is_empty()),
    ) {
        (Some(group), Some(table), Some(mount), Some(work)) => Some(HeldEvents {
            group,
            table,
            work: PathBuf::from(work),
            mount,
        }),
        _ => None,
    };
    let changes = number(11).and_then(crate::sys::inherited_fd);
    let args: Vec<OsString> = fields.get(12..).map(<[_]>::to_vec).unwrap_or_default();
    let mut keep = vec![fuse.as_raw_fd(), channel.as_raw_fd()];
    keep.extend(arena.as_ref().map(|a| a.as_raw_fd()));
    keep.extend(changes.as_ref().map(|a| a.as_raw_fd()));
    keep.extend(
        events
            .iter()
            .flat_map(|e| [e.group.as_raw_fd(), e.table.as_raw_fd()]),
    );
    crate::sys::close_other_fds(&keep);
    for fd in [
        Some(&fuse),
        Some(&channel),
        arena.as_ref(),
        changes.as_ref(),
    ]
    .into_iter()
    .chain(events.iter().flat_map(|e| [Some(&e.group), Some(&e.table)]))
    .flatten()
    {
        let _ = rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC);
    }
    set_name(c"mosaicfs-holder");
    // The kernel's OOM killer picks the daemon, never the few pages that keep its mount
    // alive (best effort: lowering the score needs CAP_SYS_RESOURCE).
    let _ = std::fs::write("/proc/self/oom_score_adj", "-999");
    crate::logging::init(false);
    crate::logging::to_background(None);
    DAEMON.store(daemon, std::sync::atomic::Ordering::Relaxed);
    forward_stop_signals();
    Holder {
        fuse,
        arena,
        changes,
        events,
        init,
        args,
        binary: binary.clone(),
        good: binary,
        failed_starts: 0,
        takeovers: takeovers as u32,
    }
    .run(daemon, channel)
}

struct Holder {
    fuse: OwnedFd,
    /// The memfd of copy-after-write's pending blocks (file/partial/arena.rs): what a daemon
    /// killed before it filled them leaves to the next one.
    arena: Option<OwnedFd>,
    /// A memory upper's change log (memory_upper/changes.rs): the tree a killed daemon
    /// changed since its last commit.
    changes: Option<OwnedFd>,
    /// The pre-content group and table: the events a killed daemon left wait for the next.
    events: Option<HeldEvents>,
    init: Vec<u8>,
    args: Vec<OsString>,
    /// The binary the next daemon runs.
    binary: PathBuf,
    /// The last binary whose daemon ran at least `GOOD_AFTER`.
    good: PathBuf,
    /// Daemons in a row that exited with an error before `GOOD_AFTER`.
    failed_starts: usize,
    takeovers: u32,
}

impl Holder {
    fn run(mut self, mut daemon: i32, mut channel: OwnedFd) -> i32 {
        let mut started = Instant::now();
        loop {
            let status = wait_for(daemon);
            let said = read_all(&channel);
            if !self.connected() {
                return self.end(0, &status);
            }
            let upgrade = said
                .lines()
                .filter_map(|l| l.strip_prefix("upgrade\t"))
                .next_back()
                .map(PathBuf::from);
            if upgrade.is_none() && said.lines().any(|l| l == UPGRADE_ONLY) {
                log::error!(
                    "the daemon of this mount ended ({status}) without handing over, and what \
                     it held since the last fsync went with it (upper=memory): the mount ends \
                     (its processes get ENOTCONN; unmount it and mount it again)"
                );
                return self.end(1, &status);
            }
            let ran = started.elapsed();
            let handed_over = upgrade.is_some();
            if ran >= GOOD_AFTER {
                self.good = self.binary.clone();
            }
            match upgrade {
                Some(next) => {
                    log::info!(
                        "the daemon of this mount handed over to {}: starting it",
                        next.display()
                    );
                    self.binary = next;
                }
                None if ran < GOOD_AFTER && self.binary != self.good => {
                    log::error!(
                        "the daemon from {} ended after {:.1} s ({status}): going back to {}",
                        self.binary.display(),
                        ran.as_secs_f64(),
                        self.good.display()
                    );
                    self.binary = self.good.clone();
                }
                None => log::error!(
                    "the daemon of this mount ended ({status}) while the mount lives: starting \
                     another on the same connection"
                ),
            }
            // A start failed: the daemon exited with an error before it served for long (not
            // killed, not handing over).
            let killed = status.starts_with("killed") || status == ENDED_NOT_OURS;
            let failed = !killed && !handed_over && ran < GOOD_AFTER && status != "exit status 0";
            if failed {
                self.failed_starts += 1;
            } else {
                self.failed_starts = 0;
            }
            if self.failed_starts >= MAX_FAILED_STARTS {
                log::error!(
                    "{MAX_FAILED_STARTS} daemons in a row failed to start: giving the mount up \
                     (its processes get ENOTCONN; unmount it and mount it again)"
                );
                return self.end(1, &status);
            }
            if killed && ran < GOOD_AFTER {
                std::thread::sleep(KILLED_PAUSE);
            }
            self.takeovers = self.takeovers.saturating_add(1);
            match self.start() {
                Ok((pid, r)) => {
                    daemon = pid;
                    channel = r;
                    DAEMON.store(pid, std::sync::atomic::Ordering::Relaxed);
                    started = Instant::now();
                }
                Err(e) => {
                    log::error!("cannot start {}: {e}", self.binary.display());
                    if self.binary == self.good {
                        std::thread::sleep(Duration::from_millis(500));
                    }
                    self.binary = self.good.clone();
                    // Counted as a start that ended at once: the loop waits for no one.
                    daemon = -1;
                }
            }
        }
    }

    fn connected(&self) -> bool {
        connected(&self.fuse)
    }

    /// The holder ends, with no daemon after the last (which ended with `status`). If that one
    /// did not exit cleanly (which removes every pre-content mark), writers passing through
    /// may still reach marked files: the holder becomes the group's guardian
    /// (file/partial/precontent.rs), which refuses their accesses of holes.
    fn end(self, code: i32, status: &str) -> i32 {
        let Some(events) = self.events else {
            return code;
        };
        if status == "exit status 0" {
            return code;
        }
        let Ok((r, w)) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC) else {
            return code;
        };
        // The guardian's daemon is gone already: the pipe it waits on is at its end.
        drop(w);
        let group = keep_across_exec(events.group.as_fd());
        let alive = keep_across_exec(r.as_fd());
        use std::os::unix::process::CommandExt;
        let err = std::process::Command::new("/proc/self/exe")
            .arg(crate::file::partial::precontent::GUARDIAN_COMMAND)
            .arg(group.to_string())
            .arg(alive.to_string())
            .arg(&events.work)
            .arg(events.mount.to_string())
            .exec();
        log::error!("cannot become the pre-content guardian: {err}");
        code
    }

    /// Starts the next daemon: its pid and the holder's end of the pipe to it.
    fn start(&self) -> std::io::Result<(i32, OwnedFd)> {
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        let fuse = keep_across_exec(self.fuse.as_fd());
        let write = keep_across_exec(w.as_fd());
        let arena = self.arena.as_ref().map(|a| keep_across_exec(a.as_fd()));
        let changes = self.changes.as_ref().map(|a| keep_across_exec(a.as_fd()));
        let events = self.events.as_ref().map(HeldEvents::keep_across_exec);
        let fields: Vec<OsString> = vec![
            fuse.to_string().into(),
            write.to_string().into(),
            self.takeovers.to_string().into(),
            OsString::from_vec(self.init.clone()),
        ];
        let mut command = std::process::Command::new(&self.binary);
        if let Some(fd) = arena {
            command.env(TAKEOVER_ARENA_ENV, fd.to_string());
        }
        if let Some(fd) = changes {
            command.env(TAKEOVER_CHANGES_ENV, fd.to_string());
        }
        if let Some(e) = &events {
            command.env(TAKEOVER_EVENTS_ENV, format!("{},{}", e.group, e.table));
        }
        let child = command
            .args(&self.args)
            .env(TAKEOVER_ENV, encode(&fields))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        // SAFETY: the copies made for the child, which has them now (or failed to start).
        unsafe {
            for fd in [Some(fuse), Some(write), arena, changes]
                .into_iter()
                .flatten()
            {
                libc::close(fd);
            }
        }
        if let Some(e) = &events {
            e.close();
        }
        let child = child?;
        Ok((child.id() as i32, r))
    }
}

/// Whether the connection still lives: the kernel reports an error on its device once it
/// ended (unmounted, or aborted).
fn connected(fuse: &OwnedFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        fuse,
        rustix::event::PollFlags::IN,
    )];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&zero)) {
        Ok(_) => !fds[0].revents().contains(rustix::event::PollFlags::ERR),
        Err(_) => false,
    }
}

/// How `wait_for` reports a daemon this holder did not start (a holder a daemon started in
/// place of one that ended): it ended, how is not known.
const ENDED_NOT_OURS: &str = "ended (not started by this holder)";

/// Waits for `pid` to end; how it ended, in words.
fn wait_for(pid: i32) -> String {
    if pid <= 0 {
        return "did not start".into();
    }
    let mut status = 0;
    loop {
        // SAFETY: waitpid on a child of this process.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            _ if r >= 0 => {}
            Some(libc::EINTR) => {}
            Some(libc::ECHILD) => return wait_for_other(pid),
            _ => return "not a child".into(),
        }
    }
    if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("exit status {}", libc::WEXITSTATUS(status))
    }
}

/// Waits for `pid`, a process that is not this one's child, to end (its pidfd becomes
/// readable).
fn wait_for_other(pid: i32) -> String {
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        return "did not start".into();
    };
    let Ok(pidfd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) else {
        return ENDED_NOT_OURS.into();
    };
    let mut fds = [rustix::event::PollFd::new(
        &pidfd,
        rustix::event::PollFlags::IN,
    )];
    while rustix::event::poll(&mut fds, None).is_err() {}
    ENDED_NOT_OURS.into()
}

/// Everything the daemon wrote to the pipe (it has ended: the pipe is at its end).
fn read_all(channel: &OwnedFd) -> String {
    let _ = rustix::fs::fcntl_setfl(channel, rustix::fs::OFlags::NONBLOCK);
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = rustix::io::read(channel, &mut buf) {
        out.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// SIGTERM, SIGINT and SIGHUP to the holder stop the mount as they would the daemon: passed on.
fn forward_stop_signals() {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: the action is async-signal-safe: an atomic load and kill(2).
        let _ = unsafe {
            signal_hook::low_level::register(sig, move || {
                let pid = DAEMON.load(std::sync::atomic::Ordering::Relaxed);
                if pid > 0 {
                    libc::kill(pid, sig);
                }
            })
        };
    }
}

/// The process's name as `ps` and `pkill` see it.
fn set_name(name: &std::ffi::CStr) {
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
}

/// Fields as one environment value: each in hex, separated by commas.
fn encode(fields: &[OsString]) -> OsString {
    let hex: Vec<String> = fields
        .iter()
        .map(|f| f.as_bytes().iter().map(|b| format!("{b:02x}")).collect())
        .collect();
    hex.join(",").into()
}

fn decode(value: &OsStr) -> Vec<OsString> {
    let Some(s) = value.to_str() else {
        return Vec::new();
    };
    s.split(',')
        .map(|f| {
            let bytes = (0..f.len() / 2)
                .filter_map(|i| u8::from_str_radix(f.get(2 * i..2 * i + 2)?, 16).ok())
                .collect();
            OsString::from_vec(bytes)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binary_is_searched_for_the_events_variable_across_its_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bin");
        let name = TAKEOVER_EVENTS_ENV.as_bytes();
        // Straddling the first read's end, then nowhere.
        let mut bytes = vec![0u8; (1 << 20) - 5];
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(&[0u8; 100]);
        std::fs::write(&path, &bytes).unwrap();
        assert!(takes_over_events(&path).unwrap());
        bytes.truncate((1 << 20) - 5 + name.len() - 1);
        std::fs::write(&path, &bytes).unwrap();
        assert!(!takes_over_events(&path).unwrap());
        assert!(takes_over_events(&dir.path().join("none")).is_err());
    }

    #[test]
    fn fields_survive_the_environment() {
        let fields: Vec<OsString> = vec![
            "12".into(),
            OsString::from_vec(vec![0, 1, 0xff, b',']),
            "".into(),
            "-o".into(),
            "lowerdir=/a b,upperdir=/c".into(),
        ];
        assert_eq!(decode(&encode(&fields)), fields);
    }
}
