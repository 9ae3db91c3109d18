//! Filesystem session
//!
//! A session runs a filesystem implementation while it is being mounted to a specific mount
//! point. A session begins by mounting the filesystem and ends by unmounting it. While the
//! filesystem is mounted, the session loop receives, dispatches and replies to kernel requests
//! for filesystem operations under its mount point.

use std::borrow::Cow;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::fd::BorrowedFd;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::thread::{self};

use log::debug;
use log::error;
use log::info;
use log::warn;
use nix::unistd::Uid;
use nix::unistd::geteuid;
use parking_lot::Mutex;

use crate::Errno;
use crate::Filesystem;
use crate::KernelConfig;
use crate::MountOption;
use crate::ReplyEmpty;
use crate::Request;
use crate::channel::Channel;
use crate::channel::ChannelSender;
use crate::dev_fuse::DevFuse;
use crate::ll;
use crate::ll::Operation;
use crate::ll::ResponseErrno;
use crate::ll::Version;
use crate::ll::flags::init_flags::InitFlags;
use crate::ll::fuse_abi as abi;
use crate::mnt::Mount;
use crate::mnt::mount_options::Config;
use crate::mnt::mount_options::check_option_conflicts;
use crate::notify::Notifier;
use crate::read_buf::FuseReadBuf;
use crate::request_pipe::RequestPipe;
use crate::reply::Reply;
use crate::reply::ReplyRaw;
use crate::reply::ReplySender;
use crate::request::RequestWithSender;

/// The max size of write requests from the kernel. The absolute minimum is 4k,
/// FUSE recommends at least 128k, max 16M. The FUSE default is 16M on macOS
/// and 128k on other systems.
pub(crate) const MAX_WRITE_SIZE: usize = 16 * 1024 * 1024;

#[derive(Default, Debug, Eq, PartialEq, Clone, Copy)]
/// How requests should be filtered based on the calling UID.
pub enum SessionACL {
    /// Allow requests from any user. Corresponds to the `allow_other` mount option.
    All,
    /// Allow requests from root. Corresponds to the `allow_root` mount option.
    RootAndOwner,
    /// Allow requests from the owning UID. This is FUSE's default mode of operation.
    #[default]
    Owner,
}

impl SessionACL {
    /// Returns the mount option string for kernel/fusermount/libfuse paths.
    /// Both `All` and `RootAndOwner` map to `allow_other` - the kernel only
    /// understands `allow_other`, and fuser enforces the root-only restriction internally.
    #[allow(dead_code)]
    pub(crate) fn to_mount_option(self) -> Option<&'static str> {
        match self {
            SessionACL::All | SessionACL::RootAndOwner => Some("allow_other"),
            SessionACL::Owner => None,
        }
    }
}

/// Calls `destroy` on drop.
#[derive(Debug)]
pub(crate) struct FilesystemHolder<FS: Filesystem> {
    pub(crate) fs: Option<FS>,
}

impl<FS: Filesystem> FilesystemHolder<FS> {
    fn destroy(&mut self) {
        if let Some(mut fs) = self.fs.take() {
            fs.destroy();
        }
    }
}

impl<FS: Filesystem> Drop for FilesystemHolder<FS> {
    fn drop(&mut self) {
        self.destroy();
    }
}

#[derive(Debug)]
struct UmountOnDrop {
    mount: Arc<Mutex<Option<Mount>>>,
}

impl UmountOnDrop {
    fn umount(&self) -> io::Result<()> {
        if let Some(mount) = self.mount.lock().take() {
            mount.umount()?;
        }
        Ok(())
    }
}

impl Drop for UmountOnDrop {
    fn drop(&mut self) {
        if let Err(e) = self.umount() {
            warn!("Failed to umount filesystem: {}", e);
        }
    }
}

/// The session data structure
#[derive(Debug)]
pub struct Session<FS: Filesystem> {
    /// Filesystem operation implementations. None after `destroy` called.
    pub(crate) filesystem: FilesystemHolder<FS>,
    /// Communication channel to the kernel driver
    pub(crate) ch: Channel,
    /// Handle to the mount.  Dropping this unmounts.
    mount: UmountOnDrop,
    /// Whether to restrict access to owner, root + owner, or unrestricted
    /// Used to implement `allow_root` and `auto_unmount`
    pub(crate) allowed: SessionACL,
    /// User that launched the fuser process
    pub(crate) session_owner: Uid,
    /// FUSE protocol version, as reported by the kernel.
    /// The field is set to `Some` when the init message is received.
    pub(crate) proto_version: Option<Version>,
    pub(crate) config: Config,
    /// mosaicfs patch: the workers, made here so that `request_watch` works before `run`.
    pool: Arc<WorkerPool>,
    /// mosaicfs patch: the payload buffer size of an io_uring entry, when INIT agreed on
    /// io_uring.
    uring_payload: Option<usize>,
    /// mosaicfs patch: the kernel's INIT request as it came, for a daemon that takes this
    /// connection over later (`Session::resume`), followed by the `max_write` replied
    /// (`MAX_WRITE_TAG`).
    init_request: Vec<u8>,
    /// mosaicfs patch: the `max_write` the kernel took from this connection's INIT reply, when
    /// known: the biggest WRITE a worker's pipe must hold (`Config::request_pipe`).
    max_write: Option<u32>,
}

/// mosaicfs patch: what follows the INIT request in the bytes a daemon keeps for the next one
/// (`Session::init_request`): `max_write=` and the number the INIT reply gave the kernel. A
/// daemon that takes the connection over cannot ask the kernel for it, and must know it to read
/// requests through a pipe (`request_pipe.rs`); saved bytes without it (a daemon of an older
/// version) leave its workers reading /dev/fuse.
const MAX_WRITE_TAG: &[u8] = b"max_write=";

/// The `max_write` after the INIT request in `saved`, if there.
fn saved_max_write(saved: &[u8]) -> Option<u32> {
    let len = u32::from_le_bytes(saved.get(..4)?.try_into().ok()?) as usize;
    let number = saved.get(len..)?.strip_prefix(MAX_WRITE_TAG)?;
    std::str::from_utf8(number).ok()?.parse().ok()
}

impl<FS: Filesystem> AsFd for Session<FS> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.ch.as_fd()
    }
}

impl<FS: Filesystem> Session<FS> {
    /// Create a new session by mounting the given filesystem to the given mountpoint
    /// # Errors
    /// Returns an error if the options are incorrect, or if the fuse device can't be mounted.
    pub fn new<P: AsRef<Path>>(
        filesystem: FS,
        mountpoint: P,
        options: &Config,
    ) -> io::Result<Session<FS>> {
        check_option_conflicts(options)?;

        let mountpoint = mountpoint.as_ref();
        info!("Mounting {}", mountpoint.display());
        // If AutoUnmount is requested, but not AllowRoot or AllowOther, return an error
        // because fusermount needs allow_root or allow_other to handle the auto_unmount option
        if options.mount_options.contains(&MountOption::AutoUnmount)
            && options.acl == SessionACL::Owner
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("auto_unmount requires acl != Owner, got: {:?}", options.acl),
            ));
        }
        let (file, mount) = Mount::new(mountpoint, &options.mount_options, options.acl)?;

        let ch = Channel::new(file);

        let mut session = Session {
            filesystem: FilesystemHolder {
                fs: Some(filesystem),
            },
            ch,
            mount: UmountOnDrop {
                mount: Arc::new(Mutex::new(Some(mount))),
            },
            allowed: options.acl,
            session_owner: geteuid(),
            proto_version: None,
            pool: WorkerPool::new(),
            config: options.clone(),
            uring_payload: None,
            init_request: Vec::new(),
            max_write: None,
        };

        session.handshake()?;

        Ok(session)
    }

    /// Wrap an existing /dev/fuse file descriptor. This doesn't mount the
    /// filesystem anywhere; that must be done separately.
    pub fn from_fd(
        filesystem: FS,
        fd: OwnedFd,
        acl: SessionACL,
        config: Config,
    ) -> io::Result<Self> {
        let ch = Channel::new(Arc::new(DevFuse(File::from(fd))));
        let mut session = Session {
            filesystem: FilesystemHolder {
                fs: Some(filesystem),
            },
            ch,
            mount: UmountOnDrop {
                mount: Arc::new(Mutex::new(None)),
            },
            allowed: acl,
            session_owner: geteuid(),
            proto_version: None,
            pool: WorkerPool::new(),
            config,
            uring_payload: None,
            init_request: Vec::new(),
            max_write: None,
        };

        session.handshake()?;

        Ok(session)
    }

    /// mosaicfs patch: takes over a connection another process mounted and initialized, whose
    /// /dev/fuse descriptor is `fd` and whose INIT request was `init_request`
    /// (`Session::init_request`). The file system's `init` sees that request again, so that
    /// it sets itself up as the first daemon did, but nothing is sent back: the kernel took
    /// the first daemon's reply. Then FUSE_NOTIFY_RESEND puts back in the queue every request
    /// the earlier daemon read and never answered (Linux 6.9+, `FUSE_HAS_RESEND`).
    ///
    /// Only for a connection served over /dev/fuse with every reader sharing one descriptor
    /// (no `clone_fd`): a clone's requests end with an error when its last holder closes it.
    pub fn resume(
        filesystem: FS,
        fd: OwnedFd,
        acl: SessionACL,
        config: Config,
        init_request: &[u8],
    ) -> io::Result<Self> {
        let ch = Channel::new(Arc::new(DevFuse(File::from(fd))));
        let mut session = Session {
            filesystem: FilesystemHolder {
                fs: Some(filesystem),
            },
            ch,
            mount: UmountOnDrop {
                mount: Arc::new(Mutex::new(None)),
            },
            allowed: acl,
            session_owner: geteuid(),
            proto_version: None,
            pool: WorkerPool::new(),
            config,
            uring_payload: None,
            init_request: init_request.to_vec(),
            max_write: saved_max_write(init_request),
        };
        if !session.initialize(init_request, false)? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the saved INIT request is not one this daemon can take over",
            ));
        }
        if session.uring_payload.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "a connection served over io_uring cannot be taken over",
            ));
        }
        session.notifier().resend()?;
        Ok(session)
    }

    /// mosaicfs patch: the kernel's INIT request as this session received it.
    pub fn init_request(&self) -> &[u8] {
        &self.init_request
    }

    /// mosaicfs patch: the session no longer unmounts when it ends: another daemon takes the
    /// connection over (`resume`), and the mount must stay.
    pub fn keep_mounted(&mut self) {
        if let Some(mount) = self.mount.mount.lock().take() {
            std::mem::forget(mount);
        }
    }

    /// mosaicfs patch: a way to end `run` from another thread while the mount stays: the
    /// workers finish the requests they hold and read no more (`Stopper::stop`).
    pub fn stopper(&self) -> Stopper {
        Stopper {
            pool: self.pool.clone(),
        }
    }

    /// Run the session loop in a background thread. If the returned handle is dropped,
    /// the filesystem is unmounted and the given session ends.
    pub fn spawn(self) -> io::Result<BackgroundSession> {
        let sender = self.ch.sender();
        // Take the fuse_session, so that we can unmount it
        let mount = std::mem::take(&mut *self.mount.mount.lock());
        let guard = thread::Builder::new()
            .name("fuser-bg".to_string())
            .spawn(move || self.run())?;
        Ok(BackgroundSession {
            guard,
            sender,
            mount,
        })
    }

    /// Run the session loop that receives kernel requests and dispatches them to method
    /// calls into the filesystem. This read-dispatch-loop is non-concurrent to prevent
    /// having multiple buffers (which take up much memory), but the filesystem methods
    /// may run concurrent by spawning threads.
    /// # Errors
    /// Returns any final error when the session comes to an end.
    pub fn run(self) -> io::Result<()> {
        let Session {
            filesystem,
            ch,
            mount: _do_not_umount_yet,
            allowed,
            session_owner,
            proto_version: _,
            config,
            pool,
            uring_payload,
            init_request: _,
            max_write,
        } = self;

        let n_threads = config.n_threads.unwrap_or(1);
        if config.request_pipe && uring_payload.is_none() {
            match max_write {
                Some(max_write) => pool
                    .max_write
                    .store(max_write, std::sync::atomic::Ordering::Relaxed),
                None => {
                    crate::request_pipe::cannot_pipe();
                    warn!(
                        target: "mosaicfs::transport",
                        "the daemon before this one saved no max_write with the mount's INIT \
                         (a binary before 2026-11-30): workers read /dev/fuse, and a request the \
                         kernel is handing over as the daemon is killed fails with EIO instead \
                         of going to the next daemon, until the mount is made again"
                    );
                }
            }
        }

        if !cfg!(target_os = "linux") && n_threads != 1 {
            // TODO: check whether it works on macOS/FreeBSD and enable if it works.
            return Err(io::Error::other(
                "n_threads != 1 is only supported on Linux",
            ));
        }

        if n_threads == 0 {
            return Err(io::Error::other("n_threads"));
        }

        let mut filesystem = Arc::new(filesystem);

        // mosaicfs patch: the pool of workers can grow (`Config::max_threads`). Each worker
        // publishes when its current request started; a supervisor adds a worker while all
        // of them have been on one request for `STUCK_AFTER`. Workers added beyond
        // `n_threads` leave once the pool has had idle workers for `retire_after`
        // (`WorkerPool::offer_retirement`). Every worker's handle is in `pool.handles`, joined
        // below.
        let max_threads = config.max_threads.unwrap_or(n_threads).max(n_threads);
        let retire_after = config.retire_after.unwrap_or(RETIRE_AFTER);
        pool.shrink_after_ns.store(
            config.shrink_after.unwrap_or(SHRINK_AFTER).as_nanos() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let clone_fd = config.clone_fd;
        let new_channel = move |ch: &Channel| -> io::Result<Channel> {
            if clone_fd {
                #[cfg(target_os = "linux")]
                {
                    return ch.clone_fd();
                }
                #[cfg(not(target_os = "linux"))]
                {
                    return Err(io::Error::other("clone_fd is only supported on Linux"));
                }
            }
            Ok(ch.clone())
        };
        // mosaicfs patch: over io_uring, each worker owns one entry of one queue (queues are
        // per CPU and every queue needs an entry); one /dev/fuse reader stays for FORGET and
        // INTERRUPT, which the kernel does not send through the rings.
        let ring_queues = uring_payload.map(|_| crate::uring::queue_count());
        let n_threads = ring_queues.map_or(n_threads, |q| n_threads.max(q));
        // Each queue may have to grow to the whole pool alone (every caller on one CPU).
        let max_threads = ring_queues.map_or(max_threads, |q| max_threads * q).max(n_threads);
        let worker = {
            let ch = ch.clone();
            move |template: &Channel, qid: Option<u16>| -> io::Result<WorkerKind> {
                match (qid, uring_payload) {
                    (Some(qid), Some(payload)) => Ok(WorkerKind::Ring {
                        ch: ch.clone(),
                        qid,
                        payload,
                    }),
                    _ => new_channel(template).map(WorkerKind::Dev),
                }
            }
        };
        // Over /dev/fuse the pool starts with `min_threads` workers and grows with demand up to
        // `n_threads` (`WorkerPool::demand`); every io_uring queue needs its entries at once.
        let initial = match ring_queues {
            Some(_) => n_threads,
            None => config.min_threads.unwrap_or(n_threads).clamp(1, n_threads),
        };
        pool.set_demand(if ring_queues.is_some() { 0 } else { n_threads });
        pool.floor.store(initial, std::sync::atomic::Ordering::Relaxed);
        let template = if max_threads > initial {
            // Workers added by demand are woken by a signal when they may leave (`shrink`).
            install_stop_handler();
            Some(new_channel(&ch)?)
        } else {
            None
        };
        // The groups of workers that grow on their own: a request waits for a worker of the
        // queue of its caller's CPU, so each queue must keep free entries.
        let groups: Vec<Option<u16>> =
            ring_queues.map_or(vec![None], |q| (0..q as u16).map(Some).collect());
        if ring_queues.is_some() {
            for i in 0..n_threads {
                let qid = groups[i % groups.len()];
                pool.spawn(worker(&ch, qid)?, &filesystem, allowed, session_owner)?;
            }
            pool.spawn(WorkerKind::Reader(ch), &filesystem, allowed, session_owner)?;
        } else {
            let mut channels = Vec::with_capacity(initial);
            for _ in 1..initial {
                channels.push(new_channel(&ch)?);
            }
            channels.push(ch);
            for ch in channels {
                pool.spawn(WorkerKind::Dev(ch), &filesystem, allowed, session_owner)?;
            }
        }
        let mut supervisor = None;
        if let Some(template) = template {
            let pool = pool.clone();
            let filesystem = filesystem.clone();
            let supervised = pool.clone();
            supervisor = Some(thread::Builder::new()
                .name("fuser-pool".into())
                .spawn(move || {
                    let mut last = (pool.now_ns(), 0);
                    while !pool.ended.load(std::sync::atomic::Ordering::Relaxed) {
                        // A busy pool is looked at every LOOK_EVERY; an idle one not until a
                        // worker takes a request (`supervisor_wait`): an idle mount does not
                        // wake at all.
                        let ticked = pool.supervisor_wait();
                        if pool.ended.load(std::sync::atomic::Ordering::Relaxed) {
                            break;
                        }
                        // One worker more while requests waited for one a good part of the
                        // time since the last look. A look after the supervisor slept through
                        // a quiet spell starts anew instead: a short burst (a listing at a
                        // container's start) adds no worker that every idle mount would then
                        // keep. A tick that came late because the supervisor did not get a
                        // CPU still counts: a busy host is where requests wait most (until
                        // 2026-12-01 a look more than 4 ticks after the last started anew, and
                        // under two busy loops the pool never grew).
                        let (over, now) = pool.overloaded(last);
                        if over && ticked {
                            let spawned = worker(&template, None)
                                .and_then(|w| pool.spawn(w, &filesystem, allowed, session_owner));
                            if let Err(e) = spawned {
                                warn!("cannot add a FUSE worker: {e}");
                            }
                        }
                        last = now;
                        pool.offer_retirement(retire_after);
                        pool.shrink();
                        for &group in &groups {
                            let workers = pool.workers();
                            let in_group = pool.workers_in(group);
                            if workers >= max_threads || !pool.all_stuck(group) {
                                continue;
                            }
                            // The group doubles: requests that queue behind the stuck ones
                            // (the kernel hands them out in order) wait for free workers, and
                            // one more worker per look would take seconds to reach them.
                            let mut added = 0;
                            for _ in 0..in_group.min(max_threads - workers) {
                                let beyond = pool.workers_in(group) >= pool.demand();
                                let spawned = worker(&template, group).and_then(|w| {
                                    let w = match w {
                                        WorkerKind::Dev(ch) if beyond => WorkerKind::Extra(ch),
                                        w => w,
                                    };
                                    pool.spawn(w, &filesystem, allowed, session_owner)
                                });
                                match spawned {
                                    Ok(true) => added += 1,
                                    Ok(false) => break,
                                    Err(e) => {
                                        warn!("cannot add a FUSE worker: {e}");
                                        break;
                                    }
                                }
                            }
                            if added > 0 {
                                info!(
                                    "every FUSE worker{} is busy with one request for \
                                     {STUCK_AFTER:?}: {} workers now",
                                    group.map_or(String::new(), |q| format!(" of io_uring queue {q}")),
                                    pool.workers()
                                );
                            }
                        }
                    }
                    // The supervisor holds the file system too: it must be gone before
                    // `run` takes the file system back.
                    drop(filesystem);
                })?);
            if let Some(s) = &supervisor {
                supervised.set_supervisor(s.thread().clone());
            }
        }

        let mut reply: io::Result<()> = Ok(());
        loop {
            let next = pool.handles.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some(thread) = next else { break };
            let id = thread.thread().id();
            let res = match thread.join() {
                Ok(res) => res,
                Err(_) => {
                    return Err(io::Error::other("event loop thread panicked"));
                }
            };
            if pool.was_retired(id) {
                continue;
            }
            // A worker ends only with the session: no more workers from here on.
            pool.session_over();
            if let Err(e) = res {
                if reply.is_ok() {
                    reply = Err(e);
                }
            }
        }
        // The supervisor lets go of the file system when it sees the session ended.
        pool.end();
        if let Some(supervisor) = supervisor {
            supervisor.thread().unpark();
            let _ = supervisor.join();
        }
        // Workers that left the pool were let go, not joined: each drops its hold on the file
        // system before it counts itself out.
        while pool.alive.load(std::sync::atomic::Ordering::Acquire) > 0 {
            thread::sleep(std::time::Duration::from_millis(1));
        }

        let Some(filesystem) = Arc::get_mut(&mut filesystem) else {
            return Err(io::Error::other(
                "BUG: must have one refcount for filesystem",
            ));
        };

        filesystem.destroy();

        reply
    }

    fn handshake(&mut self) -> io::Result<()> {
        let mut buf = FuseReadBuf::new();
        let buf = buf.as_mut();
        // mosaicfs patch, for the tests: a pause between the mount and the read of INIT, in
        // which a test unmounts (`UnmountedDuringHandshake`).
        if let Some(ms) = std::env::var("MOSAICFS_TEST_HANDSHAKE_PAUSE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            thread::sleep(std::time::Duration::from_millis(ms));
        }

        loop {
            // Read the init request from the kernel
            let size = match self.ch.receive_retrying(buf) {
                Ok(size) => size,
                Err(nix::errno::Errno::ENODEV) => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        UnmountedDuringHandshake,
                    ));
                }
                Err(err) => return Err(err.into()),
            };
            if self.initialize(&buf[..size], true)? {
                self.init_request = buf[..size].to_vec();
                if let Some(max_write) = self.max_write {
                    self.init_request.extend_from_slice(MAX_WRITE_TAG);
                    self.init_request
                        .extend_from_slice(max_write.to_string().as_bytes());
                }
                return Ok(());
            }
        }
    }

    /// Handles one INIT request: the file system's `init` and, when `reply`, the answer.
    /// `Ok(false)`: the kernel's ABI is newer than ours and our version was sent: another INIT
    /// follows.
    fn initialize(&mut self, bytes: &[u8], reply: bool) -> io::Result<bool> {
        {
            // Parse the request
            let request = match ll::AnyRequest::try_from(bytes) {
                Ok(request) => request,
                Err(err) => {
                    error!("{err}");
                    return Err(io::Error::new(io::ErrorKind::InvalidData, err.to_string()));
                }
            };

            // Extract the init operation
            let op = match request.operation() {
                Ok(op) => op,
                Err(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "Failed to parse FUSE operation",
                    ));
                }
            };

            let init = match op {
                ll::Operation::Init(init) => init,
                _ => {
                    error!("Received non-init FUSE operation before init: {}", request);
                    // Send error response and return error - non-init during handshake is invalid
                    <ReplyRaw as Reply>::new(
                        request.unique(),
                        ReplySender::Channel(self.ch.sender()),
                    )
                    .send_ll(&ResponseErrno(ll::Errno::EIO));
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "Received non-init FUSE operation during handshake",
                    ));
                }
            };

            let v = init.version();
            if v.0 > abi::FUSE_KERNEL_VERSION {
                // Kernel has a newer major version than we support.
                // Send our version and wait for a second INIT request with a compatible version.
                debug!(
                    "INIT: Kernel version {} > our version {}, sending our version and waiting for next init",
                    v.0,
                    abi::FUSE_KERNEL_VERSION
                );
                let response = init.reply_version_only();
                if reply {
                    <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                        .send_ll(&response);
                }
                return Ok(false);
            }

            // We don't support ABI versions before 7.6
            if v < Version(7, 6) {
                error!("Unsupported FUSE ABI version {v}");
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&ResponseErrno(ll::Errno::EPROTO));
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("Unsupported FUSE ABI version {v}"),
                ));
            }

            let mut config = KernelConfig::new(init.capabilities(), init.max_readahead(), v);

            // Call filesystem init method and give it a chance to return an error
            let Some(filesystem) = &mut self.filesystem.fs else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "Bug: filesystem must be initialized during handshake",
                ));
            };
            let res = filesystem.init(Request::ref_cast(request.header()), &mut config);
            if let Err(error) = res {
                let errno = Errno::from_i32(error.raw_os_error().unwrap_or(0));
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&ResponseErrno(errno));
                return Err(error);
            }

            // mosaicfs patch: io_uring when asked for and offered (the kernel offers it while
            // `fuse.enable_uring` is on). Each entry's payload buffer holds the largest
            // request or reply (the kernel's `max_payload_sz`).
            if self.config.uring && init.capabilities().contains(InitFlags::FUSE_OVER_IO_URING) {
                let _ = config.add_capabilities(InitFlags::FUSE_OVER_IO_URING);
                let pages = config.max_pages() as usize * page_size::get();
                self.uring_payload = Some(
                    (config.max_write as usize)
                        .max(pages)
                        .max(crate::consts::FUSE_MIN_READ_BUFFER),
                );
            }

            // Remember the ABI version supported by kernel and mark the session initialized.
            self.proto_version = Some(v);
            // mosaicfs patch: SETXATTR requests grow by `fuse_setxattr_in_ext` from now on.
            crate::ll::request::SETXATTR_EXT.store(
                config.requested.contains(InitFlags::FUSE_SETXATTR_EXT)
                    && init.capabilities().contains(InitFlags::FUSE_SETXATTR_EXT),
                std::sync::atomic::Ordering::Relaxed,
            );

            // Log capability status for debugging
            for bit in 0..64 {
                let bitflags = InitFlags::from_bits_retain(1 << bit);
                if bitflags == InitFlags::FUSE_INIT_EXT {
                    continue;
                }
                let bitflag_is_known = InitFlags::all().contains(bitflags);
                let kernel_supports = init.capabilities().contains(bitflags);
                let we_requested = config.requested.contains(bitflags);
                // On macOS, there's a clash between linux and macOS constants,
                // so we pick macOS ones (last).
                let name = if let Some((name, _)) = bitflags.iter_names().last() {
                    Cow::Borrowed(name)
                } else {
                    Cow::Owned(format!("(1 << {bit})"))
                };
                if we_requested && kernel_supports {
                    debug!("capability {name} enabled")
                } else if we_requested {
                    debug!("capability {name} not supported by kernel")
                } else if kernel_supports {
                    debug!("capability {name} not requested by client")
                } else if bitflag_is_known {
                    debug!("capability {name} not supported nor requested")
                }
            }

            // Reply with our desired version and settings.
            debug!(
                "INIT response: ABI {}.{}, flags {:#x}, max readahead {}, max write {}",
                abi::FUSE_KERNEL_VERSION,
                abi::FUSE_KERNEL_MINOR_VERSION,
                init.capabilities() & config.requested,
                config.max_readahead,
                config.max_write
            );

            if reply {
                self.max_write = Some(config.max_write);
                let response = init.reply(&config);
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&response);
            }

            Ok(true)
        }
    }

    /// Unmount the filesystem
    pub fn unmount(&mut self) -> io::Result<()> {
        self.mount.umount()
    }

    /// Returns a thread-safe object that can be used to unmount the Filesystem
    pub fn unmount_callable(&mut self) -> SessionUnmounter {
        SessionUnmounter {
            mount: self.mount.mount.clone(),
        }
    }

    /// Returns an object that can be used to send notifications to the kernel
    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.ch.sender())
    }

    /// mosaicfs patch: how requests reach the daemon: `"io_uring"` or `"/dev/fuse"`.
    pub fn transport(&self) -> &'static str {
        if self.uring_payload.is_some() {
            "io_uring"
        } else {
            "/dev/fuse"
        }
    }

    /// mosaicfs patch: what the workers are serving, and a way to answer a request early.
    pub fn request_watch(&self) -> RequestWatch {
        RequestWatch {
            pool: self.pool.clone(),
        }
    }
}

/// mosaicfs patch: a request a worker is serving.
#[derive(Debug, Clone, Copy)]
pub struct BusyRequest {
    /// The worker's thread id (gettid).
    pub thread: i32,
    /// The request's unique id.
    pub unique: u64,
    /// How long the worker has been serving it.
    pub elapsed: std::time::Duration,
}

/// mosaicfs patch: the requests the session's workers are serving, and a way to answer one
/// before its worker does. The worker's own reply, when it comes, finds no request in the
/// kernel (the write fails with ENOENT, which is logged) and is lost.
#[derive(Debug, Clone)]
pub struct RequestWatch {
    pool: Arc<WorkerPool>,
}

impl RequestWatch {
    /// The requests being served now.
    pub fn busy(&self) -> Vec<BusyRequest> {
        let now = self.pool.epoch.elapsed().as_nanos() as u64;
        self.pool
            .busy_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|w| {
                let since = w.since.load(std::sync::atomic::Ordering::Acquire);
                (since != 0).then(|| BusyRequest {
                    thread: w.thread.load(std::sync::atomic::Ordering::Relaxed),
                    unique: w.unique.load(std::sync::atomic::Ordering::Relaxed),
                    elapsed: std::time::Duration::from_nanos(now.saturating_sub(since)),
                })
            })
            .collect()
    }

    /// Answers `request` with `errno` now, on the channel its worker read it from (the
    /// kernel looks a reply up among the requests of the device it is written to).
    pub fn answer(&self, request: &BusyRequest, errno: Errno) -> io::Result<()> {
        use crate::ll::reply::Response;
        let sender = self
            .pool
            .busy_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|w| w.thread.load(std::sync::atomic::Ordering::Relaxed) == request.thread)
            .map(|w| (!w.ring).then(|| w.sender.clone()))
            .ok_or_else(|| io::Error::other("no such worker"))?
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::Unsupported,
                    "a request served over io_uring cannot be answered before its worker",
                )
            })?;
        ResponseErrno(errno).with_iovec(ll::RequestId(request.unique), |iov| sender.send(iov))
    }
}

#[derive(Debug)]
/// A thread-safe object that can be used to unmount a Filesystem
pub struct SessionUnmounter {
    mount: Arc<Mutex<Option<Mount>>>,
}

impl SessionUnmounter {
    /// Unmount the filesystem
    pub fn unmount(&mut self) -> io::Result<()> {
        if let Some(mount) = std::mem::take(&mut *self.mount.lock()) {
            mount.umount()?;
        }
        Ok(())
    }
}

/// mosaicfs patch: how long every worker must have been on one request before the pool
/// grows (`Config::max_threads`).
pub(crate) const STUCK_AFTER: std::time::Duration = std::time::Duration::from_millis(200);

/// mosaicfs patch: how long the pool must have had two idle workers or more before the workers
/// added beyond `n_threads` leave (`Config::retire_after`).
const RETIRE_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// mosaicfs patch: the time over which the pool measures how busy its workers were before
/// workers added by demand leave (`Config::shrink_after`, `WorkerPool::shrink`). Adding one
/// again costs a thread's start, some 100 us, and comes at the supervisor's next look
/// (`LOOK_EVERY`).
const SHRINK_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

/// mosaicfs patch: how soon the supervisor wakes a worker asked to leave again: one asked
/// between marking itself `READING` and entering its read took the signal before the read.
const LEAVE_AGAIN: std::time::Duration = std::time::Duration::from_millis(20);

/// mosaicfs patch: what a /dev/fuse worker is doing (`WorkerState::phase`), for `shrink` and
/// `offer_retirement`: only a worker waiting in its read may be asked to leave, so that the
/// signal that ends that read never lands in a system call a request makes (a lower layer on
/// a FUSE store answers EINTR).
const SERVING: u8 = 0;
const READING: u8 = 1;
const LEAVING: u8 = 2;

/// mosaicfs patch: how often the supervisor looks at a pool while a worker is busy: whether
/// every worker is stuck, and how busy the /dev/fuse workers were since its last look.
const LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// mosaicfs patch: the pool grows by one /dev/fuse worker when, since the supervisor's last
/// look, its workers spent at least this share (percent) of their time on requests while
/// another request waited for a worker (`WorkerPool::waited_ns`). A caller that waits for
/// each answer before it sends the next never makes a request wait, however busy it keeps
/// the worker: a sequential workload keeps one worker, warm on its CPU. Callers that queue
/// behind each other make it near 100 %.
const GROW_WAIT_PERCENT: u64 = 25;

/// mosaicfs patch: a worker's read that returns within this time found its request already
/// queued: one that must wait for a request sleeps, and the wake-up alone takes longer (on a
/// 2-CPU VM, a queued request's read took 3-5 us here, a wake-up 15 us and more).
const QUEUED_READ_NS: u64 = 10_000;

/// mosaicfs patch: below this share (percent) of the workers' time spent while a request
/// waited, over `Config::shrink_after`, a worker that every request left idle is not needed
/// (`WorkerPool::shrink`): requests did not wait for lack of it, and one more comes at the
/// next look if they do.
const QUIET_WAIT_PERCENT: u64 = 5;

/// mosaicfs patch: the session's workers, for the supervisor that grows the pool and for
/// `RequestWatch`.
#[derive(Debug)]
pub(crate) struct WorkerPool {
    handles: std::sync::Mutex<Vec<JoinHandle<io::Result<()>>>>,
    busy_since: std::sync::Mutex<Vec<Arc<WorkerState>>>,
    epoch: std::time::Instant,
    /// Set once a worker has ended: the session is over and no worker may be added.
    ended: std::sync::atomic::AtomicBool,
    /// Workers over /dev/fuse waiting for a request (`offer_retirement`).
    idle: std::sync::atomic::AtomicUsize,
    /// Nanoseconds /dev/fuse workers have spent on requests after which the worker's next
    /// read found a request queued (`QUEUED_READ_NS`), all told: time in which a request
    /// waited because every worker was busy. The supervisor adds a worker while fewer than
    /// `demand` serve /dev/fuse and requests waited `GROW_WAIT_PERCENT` of the time.
    waited_ns: std::sync::atomic::AtomicU64,
    demand: std::sync::atomic::AtomicUsize,
    supervisor: std::sync::OnceLock<thread::Thread>,
    /// The supervisor is parked with no timeout: no worker was busy when it last looked, so
    /// there is nothing to watch until one is (an idle mount does not wake at all). The first
    /// worker to take a request then wakes it (`note_busy`).
    asleep: std::sync::atomic::AtomicBool,
    /// A worker has told the file system that the mount is gone (`Filesystem::unmounted`).
    unmounted: std::sync::atomic::AtomicBool,
    /// mosaicfs patch: workers whose loop has not returned yet (`Stopper::stop` waits for 0).
    alive: std::sync::atomic::AtomicUsize,
    /// Workers added beyond `n_threads` (`WorkerKind::Extra`) still serving.
    extra: std::sync::atomic::AtomicUsize,
    /// Since when (ns since `epoch`) the supervisor has seen two idle workers or more at every
    /// look, while extra workers serve; 0 when not.
    idle_since: std::sync::atomic::AtomicU64,
    /// Workers that left (`retire`): `run` joins them without ending the session.
    retired: std::sync::Mutex<Vec<thread::ThreadId>>,
    /// /dev/fuse workers the pool keeps however quiet (`min_threads`).
    floor: std::sync::atomic::AtomicUsize,
    /// `Config::shrink_after`, in ns.
    shrink_after_ns: std::sync::atomic::AtomicU64,
    /// Since when (ns since `epoch`) `spare` counts; 0 while no worker may leave.
    shrink_since: std::sync::atomic::AtomicU64,
    /// The fewest workers a request left idle when it was taken, since `shrink_since`.
    spare: std::sync::atomic::AtomicUsize,
    /// `waited_ns` at `shrink_since`.
    shrink_waited: std::sync::atomic::AtomicU64,
    /// Workers asked to leave (`shrink`) that have not left yet.
    leaving: std::sync::atomic::AtomicUsize,
    /// The biggest WRITE of the connection when workers over /dev/fuse read requests through
    /// a pipe (`Config::request_pipe`); 0 when they read the device.
    max_write: std::sync::atomic::AtomicU32,
}

/// What one worker is doing.
#[derive(Debug)]
pub(crate) struct WorkerState {
    /// The worker's channel: a reply must go to the device (clone) the request came from.
    sender: ChannelSender,
    /// The worker serves an io_uring entry: its requests cannot be answered early.
    ring: bool,
    /// The io_uring queue of its entry.
    qid: Option<u16>,
    /// A /dev/fuse worker, which may leave when the pool is quiet (`WorkerPool::shrink`).
    shrinkable: bool,
    /// A /dev/fuse worker added beyond `n_threads` while all were stuck, which leaves when the
    /// pool no longer needs it (`WorkerPool::offer_retirement`).
    extra: bool,
    /// `SERVING`, `READING` or `LEAVING` (shrinkable and extra workers only).
    phase: std::sync::atomic::AtomicU8,
    /// When its current request was dispatched (ns since the pool's epoch, at least 1), or 0
    /// while it waits for one. Stored last (Release) when a request starts.
    since: std::sync::atomic::AtomicU64,
    unique: std::sync::atomic::AtomicU64,
    thread: std::sync::atomic::AtomicI32,
}

impl WorkerPool {
    fn new() -> Arc<WorkerPool> {
        Arc::new(WorkerPool {
            handles: std::sync::Mutex::new(Vec::new()),
            busy_since: std::sync::Mutex::new(Vec::new()),
            epoch: std::time::Instant::now(),
            ended: std::sync::atomic::AtomicBool::new(false),
            idle: std::sync::atomic::AtomicUsize::new(0),
            waited_ns: std::sync::atomic::AtomicU64::new(0),
            demand: std::sync::atomic::AtomicUsize::new(0),
            supervisor: std::sync::OnceLock::new(),
            asleep: std::sync::atomic::AtomicBool::new(false),
            unmounted: std::sync::atomic::AtomicBool::new(false),
            alive: std::sync::atomic::AtomicUsize::new(0),
            extra: std::sync::atomic::AtomicUsize::new(0),
            idle_since: std::sync::atomic::AtomicU64::new(0),
            retired: std::sync::Mutex::new(Vec::new()),
            floor: std::sync::atomic::AtomicUsize::new(1),
            shrink_after_ns: std::sync::atomic::AtomicU64::new(0),
            shrink_since: std::sync::atomic::AtomicU64::new(0),
            spare: std::sync::atomic::AtomicUsize::new(0),
            shrink_waited: std::sync::atomic::AtomicU64::new(0),
            leaving: std::sync::atomic::AtomicUsize::new(0),
            max_write: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// The supervisor's look at workers added by demand: once every request taken through
    /// `shrink_after` left two workers idle or more, as many as were never needed beyond one
    /// spare leave, down to `floor`; and the spare too when requests hardly waited for a
    /// worker (`QUIET_WAIT_PERCENT`). Only a worker waiting in its read is asked (`READING`
    /// to `LEAVING`) and woken by `STOP_SIGNAL`; one that took a request in between serves
    /// it with the signal blocked, then leaves. An idle mount holds one worker again, and
    /// every other worker's stack and request buffer go back with its thread.
    fn shrink(&self) {
        use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
        let states = self.busy_since.lock().unwrap_or_else(|e| e.into_inner());
        // One asked between its mark and its read took the signal before the read: again.
        for s in states.iter().filter(|s| s.phase.load(Acquire) == LEAVING) {
            signal_worker(s);
        }
        let dev = states.iter().filter(|s| s.shrinkable).count();
        let floor = self.floor.load(Relaxed) + self.leaving.load(Acquire);
        let beyond = dev.saturating_sub(floor);
        if beyond == 0 {
            self.shrink_since.store(0, Relaxed);
            return;
        }
        let now = (self.epoch.elapsed().as_nanos() as u64).max(1);
        let since = self.shrink_since.load(Relaxed);
        if since != 0 && now - since < self.shrink_after_ns.load(Relaxed) {
            return;
        }
        let waited = self.waited_ns.load(Acquire);
        let unneeded = if since == 0 {
            0
        } else {
            let spare = self.spare.load(Acquire);
            let waited = (waited - self.shrink_waited.load(Relaxed)) as u128;
            let window = (now - since) as u128;
            let quiet = waited * 100 < window * QUIET_WAIT_PERCENT as u128 * dev as u128;
            (if quiet { spare } else { spare.saturating_sub(1) }).min(beyond)
        };
        self.spare.store(self.idle.load(Acquire), Release);
        self.shrink_waited.store(waited, Relaxed);
        self.shrink_since.store(now, Relaxed);
        // The newest first: the oldest are the ones the pool started with.
        let asked = states
            .iter()
            .rev()
            .filter(|s| s.shrinkable)
            .filter(|s| {
                s.phase
                    .compare_exchange(READING, LEAVING, AcqRel, Acquire)
                    .is_ok()
            })
            .take(unneeded)
            .inspect(|s| {
                self.leaving.fetch_add(1, AcqRel);
                signal_worker(s);
            })
            .count();
        if asked > 0 {
            drop(states);
            // A pool gone quiet: the heap's free pages go back too (glibc's `malloc_trim`).
            // SAFETY: malloc_trim only returns free memory to the system.
            unsafe { libc::malloc_trim(0) };
        }
    }

    /// A worker asked to leave (`shrink`, `offer_retirement`) leaves: it no longer counts, and
    /// its thread is let go (detached) rather than joined at the session's end, so that its
    /// stack goes at once.
    fn leave(&self, busy: &Arc<WorkerState>) {
        use std::sync::atomic::Ordering::AcqRel;
        let me = thread::current().id();
        self.count_out(busy);
        if busy.extra {
            self.extra.fetch_sub(1, AcqRel);
        } else {
            self.leaving.fetch_sub(1, AcqRel);
        }
        let mut handles = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        // Not there when `run` is joining it already.
        if let Some(i) = handles.iter().position(|h| h.thread().id() == me) {
            drop(handles.remove(i));
        }
    }

    /// The supervisor's look at extra workers: once two or more workers have been idle at
    /// every look for `after`, as many extra workers as are idle beyond one are asked to leave.
    /// As in `shrink`, only one waiting in its read is asked (`READING` to `LEAVING`), and the
    /// signal ends that read: an extra worker blocks in its read like any other, and one that
    /// only looked now and then would stay for as long as no request came its way.
    fn offer_retirement(&self, after: std::time::Duration) {
        use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
        let extra = self.extra.load(Acquire);
        let idle = self.idle.load(Acquire);
        if extra == 0 || idle < 2 {
            self.idle_since.store(0, Relaxed);
            return;
        }
        let now = (self.epoch.elapsed().as_nanos() as u64).max(1);
        let since = self.idle_since.load(Relaxed);
        if since == 0 {
            self.idle_since.store(now, Relaxed);
            return;
        }
        if now - since < after.as_nanos() as u64 {
            return;
        }
        self.idle_since.store(now, Relaxed);
        let states = self.busy_since.lock().unwrap_or_else(|e| e.into_inner());
        states
            .iter()
            .rev()
            .filter(|s| s.extra)
            .filter(|s| {
                s.phase
                    .compare_exchange(READING, LEAVING, AcqRel, Acquire)
                    .is_ok()
            })
            .take(extra.min(idle - 1))
            .for_each(|s| signal_worker(s));
    }

    /// An idle worker that leaves (`leave`) no longer counts: `run` joins it without taking
    /// its end for the session's.
    fn count_out(&self, busy: &Arc<WorkerState>) {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(thread::current().id());
        self.busy_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|w| !Arc::ptr_eq(w, busy));
        self.idle.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }

    fn was_retired(&self, id: thread::ThreadId) -> bool {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&id)
    }

    fn set_demand(&self, n: usize) {
        self.demand.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    fn demand(&self) -> usize {
        self.demand.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set_supervisor(&self, t: thread::Thread) {
        let _ = self.supervisor.set(t);
    }

    /// A /dev/fuse worker took a request `started` (ns since `epoch`); `last` is its previous
    /// request and when the read of this one began. A read that found the request queued
    /// (`QUEUED_READ_NS`), from another caller than the last request's, means that request
    /// waited while the worker served the last: its caller did not wait for that answer.
    /// (One caller's next request comes after its answer, often before the worker is back in
    /// its read; it waited for no worker. Requests no caller waits for do not count.)
    /// Nothing wakes the supervisor here: that would cost every request of a lone caller a
    /// switch to another thread.
    fn took_request(
        &self,
        started: u64,
        request: &abi::fuse_in_header,
        last: Option<(Served, u64)>,
    ) {
        use abi::fuse_opcode::*;
        use std::sync::atomic::Ordering::AcqRel;
        let before = self.idle.fetch_sub(1, AcqRel);
        self.spare.fetch_min(before.saturating_sub(1), AcqRel);
        let Some((last, read_began)) = last else {
            return;
        };
        let unawaited = [FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_RELEASE, FUSE_RELEASEDIR, FUSE_INTERRUPT];
        let awaited = !unawaited.into_iter().any(|op| op as u32 == request.opcode);
        let read = started.saturating_sub(read_began);
        if awaited && request.pid != last.pid && read < QUEUED_READ_NS {
            self.waited_ns.fetch_add(last.took, AcqRel);
        }
    }

    /// Nanoseconds since the pool's epoch (at least 1: 0 means "not set" in its fields).
    fn now_ns(&self) -> u64 {
        (self.epoch.elapsed().as_nanos() as u64).max(1)
    }

    /// The supervisor's look at demand: whether requests waited for a worker at least
    /// `GROW_WAIT_PERCENT` of the workers' time from `last` (a look's time and `waited_ns`)
    /// to now, while fewer than `demand` serve /dev/fuse; and this look, for the next.
    fn overloaded(&self, last: (u64, u64)) -> (bool, (u64, u64)) {
        let now = self.now_ns();
        let waited = self.waited_ns.load(std::sync::atomic::Ordering::Acquire);
        let workers = self.workers_in(None);
        let (then, waited_then) = last;
        let window = now.saturating_sub(then) as u128;
        let share = waited.saturating_sub(waited_then) as u128 * 100;
        let over = workers < self.demand()
            && share >= window * GROW_WAIT_PERCENT as u128 * workers as u128;
        (over, (now, waited))
    }

    /// A worker has just marked itself busy (SeqCst, as `asleep` is read here): wakes the
    /// supervisor if it sleeps, so that a request that gets stuck is seen.
    fn note_busy(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        if self.asleep.load(SeqCst) && self.asleep.swap(false, SeqCst) {
            if let Some(t) = self.supervisor.get() {
                t.unpark();
            }
        }
    }

    /// The supervisor's wait: a tick while a worker is busy (to see it stuck, and how busy
    /// the pool is), else parked until a worker takes a request (`note_busy`), the session
    /// ends, or (while workers may leave, `shrink`) their next look is due. Whether it was a
    /// tick of a busy pool (true), not a wait through a quiet spell.
    fn supervisor_wait(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        if self.any_busy() {
            thread::park_timeout(LOOK_EVERY);
            return true;
        }
        // Extra workers to let go: a look now and then until they are gone.
        if self.extra.load(SeqCst) > 0 {
            thread::park_timeout(STUCK_AFTER);
            return false;
        }
        // Workers asked to leave, or that may leave once the pool has been quiet a while: a
        // look then (a worker that gets busy meanwhile wakes it sooner, as below).
        let look = if self.leaving.load(SeqCst) > 0 {
            Some(LEAVE_AGAIN)
        } else if self.shrink_since.load(SeqCst) != 0 {
            Some(std::time::Duration::from_nanos(self.shrink_after_ns.load(SeqCst)))
        } else {
            None
        };
        self.asleep.store(true, SeqCst);
        // Dekker with `note_busy`: a worker that marked itself busy before this fence is seen
        // below; one that marks itself after it sees `asleep` and unparks.
        std::sync::atomic::fence(SeqCst);
        if self.any_busy() {
            self.asleep.store(false, SeqCst);
            return true;
        }
        match look {
            Some(after) => thread::park_timeout(after),
            None => thread::park(),
        }
        self.asleep.store(false, SeqCst);
        false
    }

    fn request_done(&self) {
        self.idle.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    fn workers(&self) -> usize {
        self.busy_since.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn any_busy(&self) -> bool {
        self.busy_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|s| s.since.load(std::sync::atomic::Ordering::Relaxed) != 0)
    }

    /// The workers of one io_uring queue (`None`: of /dev/fuse).
    fn workers_in(&self, qid: Option<u16>) -> usize {
        self.busy_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|s| s.qid == qid)
            .count()
    }

    /// Whether every worker of the group has been on one request for `STUCK_AFTER`.
    fn all_stuck(&self, qid: Option<u16>) -> bool {
        let now = self.epoch.elapsed().as_nanos() as u64;
        let stuck = STUCK_AFTER.as_nanos() as u64;
        self.busy_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|s| s.qid == qid)
            .all(|s| {
                let t = s.since.load(std::sync::atomic::Ordering::Relaxed);
                t != 0 && now.saturating_sub(t) >= stuck
            })
    }

    fn end(&self) {
        // Under the handles' lock, which `spawn` holds: no worker is added after this.
        let _handles = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        self.ended.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The session is over (a worker read ENODEV): no worker is added, and the supervisor,
    /// woken now, ends at once rather than when `run` gets to it. The daemon's descriptors
    /// (the layers, which `umount` of a layer's file system finds busy) close only when its
    /// last thread has exited, so every thread ends as early as it can.
    fn session_over(&self) {
        self.end();
        if let Some(t) = self.supervisor.get() {
            t.unpark();
        }
    }

    /// Starts a worker, unless the session has ended (then `false`).
    fn spawn<FS: Filesystem + Send + Sync + 'static>(
        self: &Arc<Self>,
        kind: WorkerKind,
        filesystem: &Arc<FilesystemHolder<FS>>,
        allowed: SessionACL,
        session_owner: Uid,
    ) -> io::Result<bool> {
        let mut handles = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        if self.ended.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(false);
        }
        let extra = matches!(kind, WorkerKind::Extra(_));
        let shrinkable = matches!(kind, WorkerKind::Dev(_));
        let (ch, ring, tracked) = match kind {
            WorkerKind::Dev(ch) | WorkerKind::Extra(ch) => (ch, None, true),
            WorkerKind::Ring { ch, qid, payload } => (ch, Some((qid, payload)), true),
            WorkerKind::Reader(ch) => (ch, None, false),
        };
        let busy = Arc::new(WorkerState {
            sender: ch.sender(),
            ring: ring.is_some(),
            qid: ring.map(|(q, _)| q),
            shrinkable,
            extra,
            phase: Default::default(),
            since: Default::default(),
            unique: Default::default(),
            thread: Default::default(),
        });
        let mut slots = self.busy_since.lock().unwrap_or_else(|e| e.into_inner());
        let thread_name = match (ring, tracked) {
            (Some((qid, _)), _) => format!("fuser-ring{qid}-{}", slots.len()),
            (None, true) => format!("fuser-{}", slots.len()),
            (None, false) => "fuser-dev".to_string(),
        };
        let on_dev = tracked && ring.is_none();
        if on_dev {
            self.idle.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
        let event_loop = SessionEventLoop {
            thread_name: thread_name.clone(),
            filesystem: filesystem.clone(),
            ch,
            allowed,
            session_owner,
            busy: tracked.then(|| (busy.clone(), self.epoch)),
            ring,
            pool: on_dev.then(|| self.clone()),
            watch: tracked.then(|| self.clone()),
            piped_write: Some(self.max_write.load(std::sync::atomic::Ordering::Relaxed))
                .filter(|&w| on_dev && w > 0),
        };
        if extra {
            self.extra.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
        self.alive.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let pool = self.clone();
        let spawned = thread::Builder::new().name(thread_name).spawn(move || {
            let r = event_loop.run();
            // Before it counts itself out: `run` takes the file system back once none is alive.
            drop(event_loop);
            pool.alive.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            r
        });
        match spawned {
            Ok(h) => handles.push(h),
            Err(e) => {
                self.alive.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                return Err(e);
            }
        }
        if tracked {
            slots.push(busy);
        }
        Ok(true)
    }
}

/// mosaicfs patch: a request a /dev/fuse worker served, for the pool
/// (`WorkerPool::took_request`).
#[derive(Clone, Copy)]
struct Served {
    /// Nanoseconds from its read to its answer.
    took: u64,
    /// Its caller's thread.
    pid: u32,
}

/// mosaicfs patch: what a worker serves.
enum WorkerKind {
    /// Requests read from /dev/fuse (or a clone of it).
    Dev(Channel),
    /// The same, by a worker added beyond `n_threads` while all were stuck: it leaves when
    /// the pool no longer needs it (`WorkerPool::offer_retirement`).
    Extra(Channel),
    /// One io_uring entry of queue `qid`.
    Ring { ch: Channel, qid: u16, payload: usize },
    /// What io_uring does not carry (FORGET, INTERRUPT), read from /dev/fuse; not counted
    /// as a worker of the pool.
    Reader(Channel),
}

pub(crate) struct SessionEventLoop<FS: Filesystem> {
    /// Cache thread name for faster `debug!`.
    pub(crate) thread_name: String,
    pub(crate) ch: Channel,
    pub(crate) filesystem: Arc<FilesystemHolder<FS>>,
    pub(crate) allowed: SessionACL,
    pub(crate) session_owner: Uid,
    /// mosaicfs patch: where this worker says what it is busy with (`WorkerPool`).
    pub(crate) busy: Option<(Arc<WorkerState>, std::time::Instant)>,
    /// mosaicfs patch: the io_uring queue this worker serves an entry of, and the entry's
    /// payload size; `None`: it reads /dev/fuse.
    pub(crate) ring: Option<(u16, usize)>,
    /// mosaicfs patch: the pool of a /dev/fuse worker, told when it takes a request and when
    /// it is done, so that the pool grows with demand (`WorkerPool::took_request`).
    pub(crate) pool: Option<Arc<WorkerPool>>,
    /// mosaicfs patch: the pool of a worker whose busy mark the supervisor watches, told when
    /// it takes a request (`WorkerPool::note_busy`).
    pub(crate) watch: Option<Arc<WorkerPool>>,
    /// mosaicfs patch: the connection's biggest WRITE, when this worker reads requests through
    /// a pipe (`RequestPipe`).
    pub(crate) piped_write: Option<u32>,
}

/// mosaicfs patch: how long the /dev/fuse reader beside the io_uring queues waits after a
/// FORGET before it reads again. Over io_uring nearly all it reads are FORGETs, one read and
/// one wake-up each; nobody waits for them, and the kernel hands the ones queued meanwhile
/// over in one BATCH_FORGET. Metadata mix with 4 processes on 2 CPUs (bench/uring.py):
/// 74k -> 77k ops/s. An INTERRUPT arriving in the pause waits for its end.
const FORGET_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);

impl<FS: Filesystem> SessionEventLoop<FS> {
    /// Whether this is the /dev/fuse reader beside the io_uring queues (`WorkerKind::Reader`).
    fn is_side_reader(&self) -> bool {
        self.busy.is_none() && self.ring.is_none()
    }

    /// This worker saw the mount go: the pool stops growing and the file system hears of it
    /// (`Filesystem::unmounted`, once per session).
    fn session_over(&self) {
        if let Some(pool) = self.pool.as_ref().or(self.watch.as_ref()) {
            pool.session_over();
            if pool.unmounted.swap(true, std::sync::atomic::Ordering::AcqRel) {
                return;
            }
        }
        if let Some(fs) = &self.filesystem.fs {
            fs.unmounted();
        }
    }

    fn run(&self) -> io::Result<()> {
        if let Some((busy, _)) = &self.busy {
            busy.thread.store(nix::unistd::gettid().as_raw(), std::sync::atomic::Ordering::Relaxed);
        }
        match self.ring {
            Some((qid, payload)) => self.ring_loop(qid, payload),
            None => self.event_loop(),
        }
    }

    /// Dispatches one request, under the busy mark and `catch_unwind` (see `event_loop`).
    /// `last`: this worker's previous request (`Served`) and when the read of this one began
    /// (ns since the pool's epoch), for the pool; returns this one.
    fn serve(&self, req: &RequestWithSender<'_>, last: Option<(Served, u64)>) -> Option<Served> {
        let now = |epoch: &std::time::Instant| (epoch.elapsed().as_nanos() as u64).max(1);
        let mut started = 0;
        if let Some((busy, epoch)) = &self.busy {
            started = now(epoch);
            busy.unique.store(req.request.unique().0, std::sync::atomic::Ordering::Relaxed);
            busy.since.store(started, std::sync::atomic::Ordering::SeqCst);
        }
        let header = req.request.header();
        if let Some(pool) = &self.pool {
            pool.took_request(started, header, last);
        }
        if let Some(watch) = &self.watch {
            watch.note_busy();
        }
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| req.dispatch(self)));
        let mut served = None;
        if let Some((busy, epoch)) = &self.busy {
            served = Some(Served {
                took: now(epoch) - started,
                pid: header.pid,
            });
            busy.since.store(0, std::sync::atomic::Ordering::Release);
        }
        if let Some(pool) = &self.pool {
            pool.request_done();
        }
        served
    }

    /// mosaicfs patch: serves one io_uring entry of queue `qid` (uring.rs).
    fn ring_loop(&self, qid: u16, payload: usize) -> io::Result<()> {
        use crate::uring::{Fetched, ReplySlot, RingEntry, Taken};
        crate::uring::pin_to_queue_cpu(qid);
        let mut entry = RingEntry::new(self.ch.as_fd(), qid, payload)?;
        let slot = Arc::new(ReplySlot::default());
        let mut commit = None;
        loop {
            match entry.fetch(commit.take()) {
                Ok(Fetched::Request) => {}
                Ok(Fetched::Ended) => {
                    self.session_over();
                    return Ok(());
                }
                // Before INIT's reply is processed: not yet.
                Err(e) if commit.is_none() && e.raw_os_error() == Some(libc::EAGAIN) => {
                    thread::sleep(std::time::Duration::from_millis(1));
                    continue;
                }
                Err(e) if commit.is_none() => {
                    // The kernel refused the entry and went back to /dev/fuse for the
                    // whole connection: serve that instead.
                    warn!("io_uring queue {} refused an entry ({e}): serving /dev/fuse", entry.qid());
                    drop(entry);
                    return self.event_loop();
                }
                Err(e) => return Err(e),
            }
            slot.arm(entry.reply_area());
            let Some(req) = RequestWithSender::new(self.ch.sender(), Some(slot.clone()), entry.request())
            else {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "Invalid request"));
            };
            let unique = req.request.unique().0;
            let destroy = matches!(req.request.operation(), Ok(Operation::Destroy(_)));
            if destroy {
                req.reply::<ReplyEmpty>().ok();
            } else {
                self.serve(&req, None);
            }
            drop(req);
            slot.take(|reply| match reply {
                Taken::Bytes(bytes) => entry.set_reply(bytes),
                Taken::InPlace(payload) => entry.set_reply_in_place(payload),
            });
            if destroy {
                return entry.commit_only(unique);
            }
            commit = Some(unique);
        }
    }

    fn event_loop(&self) -> io::Result<()> {
        // Buffer for receiving requests from the kernel. Only one is allocated and
        // it is reused immediately after dispatching to conserve memory and allocations.
        let mut read_buf = FuseReadBuf::new();
        let pipe = self.piped_write.and_then(request_pipe);
        // mosaicfs patch: how long this worker's last request took, for the pool
        // (`WorkerPool::took_request`).
        let mut last = None;
        loop {
            // mosaicfs patch: pages a big batch of FORGETs filled are given back after it.
            let mut served = (0, false);
            let buf = read_buf.as_mut();
            // mosaicfs patch: a worker the pool may let go waits in its read as `READING`
            // (`WorkerPool::shrink`, `offer_retirement`); asked to leave there, its read ends
            // with ECANCELED. One asked just as it took a request serves that with the signal
            // blocked, then leaves.
            let shrinkable = (self.busy.as_ref().map(|(b, _)| b))
                .filter(|b| b.shrinkable || b.extra);
            if let Some(b) = shrinkable {
                b.phase.store(READING, std::sync::atomic::Ordering::SeqCst);
            }
            let asked = || {
                shrinkable.is_some_and(|b| {
                    b.phase.load(std::sync::atomic::Ordering::Acquire) == LEAVING
                })
            };
            let mut leave_after = false;
            // mosaicfs patch: when this read began, for the pool (`WorkerPool::took_request`).
            let read_began = self.busy.as_ref().map(|(_, epoch)| epoch.elapsed().as_nanos() as u64);
            // Read the next request from the given channel to kernel driver
            // The kernel driver makes sure that we get exactly one request per read
            let received = self.ch.receive_unless(pipe.as_ref(), buf, asked);
            if let (Ok(_), Some(b)) = (&received, shrinkable) {
                let was = b.phase.swap(SERVING, std::sync::atomic::Ordering::AcqRel);
                if was == LEAVING {
                    block_stop_signal();
                    leave_after = true;
                }
            }
            match received {
                Ok(size) => match RequestWithSender::new(self.ch.sender(), None, &buf[..size]) {
                    // Dispatch request
                    Some(req) => {
                        if let Ok(Operation::Destroy(_)) = req.request.operation() {
                            req.reply::<ReplyEmpty>().ok();
                            return Ok(());
                        } else {
                            // mosaicfs patch: a panic in one request ends that request, not the
                            // worker thread: its unsent reply answers EIO as it unwinds, and
                            // the thread goes on serving (the file system logs the panic).
                            let forget = matches!(
                                req.request.operation(),
                                Ok(Operation::Forget(_)) | Ok(Operation::BatchForget(_))
                            );
                            last = self.serve(&req, last.zip(read_began));
                            served = (size, forget);
                            if forget {
                                if self.is_side_reader() {
                                    thread::sleep(FORGET_PAUSE);
                                }
                            }
                        }
                    }
                    // Quit loop on illegal request
                    None => {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "Invalid request",
                        ));
                    }
                },
                // mosaicfs patch: a channel cloned with clone_fd can read ECONNABORTED instead of
                // ENODEV when the mount goes away; either way the session is over.
                Err(nix::errno::Errno::ENODEV) | Err(nix::errno::Errno::ECONNABORTED) => {
                    self.session_over();
                    return Ok(());
                }
                // mosaicfs patch: stopped for another daemon to take over (`Stopper`): this
                // worker answered what it took and ends; the mount stays.
                Err(nix::errno::Errno::ESHUTDOWN) => {
                    if let Some(pool) = self.pool.as_ref().or(self.watch.as_ref()) {
                        pool.session_over();
                    }
                    return Ok(());
                }
                // mosaicfs patch: asked to leave while waiting (`WorkerPool::shrink`).
                Err(nix::errno::Errno::ECANCELED) => leave_after = true,
                Err(err) => return Err(err.into()),
            }
            read_buf.served(served.0, served.1);
            if leave_after
                && let (Some(pool), Some(b)) = (&self.pool, shrinkable)
            {
                pool.leave(b);
                return Ok(());
            }
        }
    }
}

/// mosaicfs patch: a worker's pipe for a connection whose WRITEs carry up to `max_write` bytes;
/// `None`, said once per process, where the system allows no pipe that big.
fn request_pipe(max_write: u32) -> Option<RequestPipe> {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    RequestPipe::new(max_write)
        .inspect_err(|e| {
            if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                // Under mosaicfs' target: the daemon logs fuser's own lines at debug only.
                warn!(
                    target: "mosaicfs::transport",
                    "cannot make a pipe that holds a request of {max_write} bytes ({e}): workers \
                     read /dev/fuse instead, and a request the kernel is handing over as the \
                     daemon is killed fails with EIO instead of going to the next daemon \
                     (see /proc/sys/fs/pipe-max-size and pipe-user-pages-soft, or a smaller \
                     max_write=)"
                );
            }
        })
        .ok()
}

/// mosaicfs patch: ends a session's `run` while the mount stays, for another daemon to take
/// the connection over (`Session::resume`).
#[derive(Debug, Clone)]
pub struct Stopper {
    pool: Arc<WorkerPool>,
}

/// The signal that interrupts a worker's read of /dev/fuse when the session stops. Its
/// handler does nothing and is installed without SA_RESTART, so the read returns EINTR.
const STOP_SIGNAL: i32 = libc::SIGURG;

extern "C" fn on_stop_signal(_: libc::c_int) {}

/// Installs `STOP_SIGNAL`'s handler, which does nothing, without SA_RESTART: a worker's read
/// of /dev/fuse that the signal reaches returns EINTR.
fn install_stop_handler() {
    // SAFETY: a handler that does nothing, for a signal nothing else in the process uses
    // (SIGURG is ignored by default, so a stray one harms nothing either).
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_stop_signal as *const () as usize;
        libc::sigemptyset(&mut act.sa_mask);
        act.sa_flags = 0;
        libc::sigaction(STOP_SIGNAL, &act, std::ptr::null_mut());
    }
}

/// Sends `STOP_SIGNAL` to one worker's thread (none yet started: nothing).
fn signal_worker(worker: &WorkerState) {
    let tid = worker.thread.load(std::sync::atomic::Ordering::Relaxed);
    if tid != 0 {
        // SAFETY: tgkill to a thread of this process; one that ended gives ESRCH.
        unsafe { libc::syscall(libc::SYS_tgkill, std::process::id() as i32, tid, STOP_SIGNAL) };
    }
}

/// Blocks `STOP_SIGNAL` in this thread: a worker asked to leave just as it took a request
/// serves it without a signal that would interrupt the request's own system calls.
fn block_stop_signal() {
    // SAFETY: changes this thread's signal mask only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, STOP_SIGNAL);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

impl Stopper {
    /// Workers read no more requests: each finishes the one it holds and ends, and `run`
    /// returns once all have. A read already waiting is interrupted by a signal, sent again
    /// until every worker is gone (a worker between its check and its read would miss one).
    /// Nothing is left unanswered: a request is either read and answered, or still queued in
    /// the kernel for the next daemon. Returns when every worker has ended.
    pub fn stop(&self) {
        install_stop_handler();
        crate::channel::STOPPING.store(true, std::sync::atomic::Ordering::Release);
        self.pool.end();
        loop {
            if self.pool.alive.load(std::sync::atomic::Ordering::Acquire) == 0 {
                return;
            }
            let workers = self.pool.busy_since.lock().unwrap_or_else(|e| e.into_inner()).clone();
            workers.iter().for_each(|w| signal_worker(w));
            thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

/// mosaicfs patch: the error of `Session::new` when the mount was unmounted (or its connection
/// aborted) after the mount and before the kernel's INIT request was read: nothing was served,
/// and the mount is gone as whoever unmounted it asked.
#[derive(Debug)]
pub struct UnmountedDuringHandshake;

impl std::fmt::Display for UnmountedDuringHandshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FUSE device disconnected during handshake (unmounted before INIT was read)")
    }
}

impl std::error::Error for UnmountedDuringHandshake {}

/// The background session data structure
#[derive(Debug)]
pub struct BackgroundSession {
    /// Thread guard of the background session
    pub guard: JoinHandle<io::Result<()>>,
    /// Object for creating Notifiers for client use
    sender: ChannelSender,
    /// Ensures the filesystem is unmounted when the session ends
    mount: Option<Mount>,
}

impl BackgroundSession {
    /// Unmount the filesystem and join the background thread.
    pub fn umount_and_join(mut self) -> io::Result<()> {
        if let Some(mount) = self.mount.take() {
            mount.umount()?;
        }
        self.join()
    }

    /// Returns an object that can be used to send notifications to the kernel
    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.sender.clone())
    }

    /// Join the filesystem thread.
    pub fn join(self) -> io::Result<()> {
        self.guard
            .join()
            .map_err(|_panic: Box<dyn std::any::Any + Send>| {
                io::Error::new(
                    io::ErrorKind::Other,
                    "filesystem background thread panicked",
                )
            })?
    }
}
