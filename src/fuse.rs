//! The FUSE adapter: decodes each request, calls the overlay core, encodes the reply.
//! No overlay logic lives here.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
    WriteFlags,
};

use crate::error::Error;
use crate::file::{IoMode, Opened};
use crate::overlay::SetAttr;
use crate::overlay::{Caller, Overlay};
use crate::resend::Before;
use crate::sys::{Attr, Time};
use crate::upper::ReadData;

pub struct MosaicFs {
    pub core: Arc<Overlay>,
    pub max_write: Option<u32>,
    /// Workers read requests through pipes (`fuser::Config::request_pipe`): a mount that
    /// survives its daemon. The default `max_write` is then the biggest a pipe holds.
    pub piped: bool,
    /// A name whose lookup panics, from `MOSAICFS_TEST_PANIC`: how the tests check the panic
    /// policy (daemon.rs, `log_panics`) on a real mount.
    pub panic_on_lookup: Option<std::ffi::OsString>,
    /// A name whose lookup the first daemon of a mount never answers, from
    /// `MOSAICFS_TEST_HANG`: how the tests kill a daemon while it holds a request
    /// (takeover.rs: the next daemon must answer it).
    pub hang_on_lookup: Option<std::ffi::OsString>,
    /// Data whose WRITE the first daemon of a mount carries out and never answers, from
    /// `MOSAICFS_TEST_HANG_WRITE` (a prefix): how the tests kill a daemon between a write
    /// and its answer (takeover.rs: the resent write must not be done twice).
    pub hang_after_write: Option<Vec<u8>>,
    /// A name whose creation, removal or rename (to it) the first daemon of a mount carries
    /// out and never answers, from `MOSAICFS_TEST_HANG_CHANGE`: how the tests kill a daemon
    /// between a change and its answer (resend.rs: the resent request must not be done twice,
    /// nor a failed one pass); `before-done:NAME` holds it before it is recorded as done.
    pub hang_after_change: Option<std::ffi::OsString>,
    /// How long each RELEASE waits before it is served, from `MOSAICFS_TEST_SLOW_RELEASE`
    /// (milliseconds): how the tests make a RELEASE still on its way when the next open comes.
    pub slow_release: Option<Duration>,
    /// How long the FORGETs of non-directories wait, from `MOSAICFS_TEST_LATE_FORGET`
    /// (milliseconds), a batch's directories forgotten first: how the tests make a node's
    /// FORGET still on its way when its parent's has been taken (by_number.rs `revive`).
    pub late_forget: Option<Duration>,
    /// The kernel sends no OPENDIR or RELEASEDIR once one OPENDIR was answered ENOSYS
    /// (FUSE_NO_OPENDIR_SUPPORT): set in `init` when it can (readdir.rs says why it pays).
    pub no_opendir: bool,
}

fn errno(e: Error) -> Errno {
    crate::stats::count_error(e.errno());
    if let Some(ctx) = e.context() {
        log::warn!("{ctx}: {}", std::io::Error::from_raw_os_error(e.errno()));
    }
    Errno::from_i32(e.errno())
}

fn caller(req: &Request, umask: u32) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
        umask,
    }
}

fn time(t: (i64, u32)) -> SystemTime {
    if t.0 >= 0 {
        UNIX_EPOCH + Duration::new(t.0 as u64, t.1)
    } else {
        UNIX_EPOCH - Duration::from_secs(t.0.unsigned_abs()) + Duration::from_nanos(t.1 as u64)
    }
}

fn file_type(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

/// The kernel's `new_encode_dev` form of a device number, as FUSE carries it.
fn encode_dev(rdev: u64) -> u32 {
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)
}

fn decode_dev(rdev: u32) -> u64 {
    let major = (rdev & 0xfff00) >> 8;
    let minor = (rdev & 0xff) | ((rdev >> 12) & 0xfff00);
    libc::makedev(major, minor)
}

fn fuse_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: time(a.atime),
        mtime: time(a.mtime),
        ctime: time(a.ctime),
        crtime: time(a.ctime),
        kind: file_type(a.mode),
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink.min(u32::MAX as u64) as u32,
        uid: a.uid,
        gid: a.gid,
        rdev: encode_dev(a.rdev),
        blksize: a.blksize.max(4096),
        flags: 0,
        nodeid: 0,
    }
}

/// The attributes an entry reply carries for `node`: its node id (which may differ from the
/// inode number `stat` shows, see `InodeTable::retire`) and `a`.
fn entry_attr(node: &crate::inode::Node, a: &Attr) -> FileAttr {
    FileAttr {
        nodeid: node.ino,
        ..fuse_attr(a)
    }
}

fn set_time(t: Option<TimeOrNow>) -> Option<Time> {
    t.map(|t| match t {
        TimeOrNow::Now => Time::Now,
        TimeOrNow::SpecificTime(st) => match st.duration_since(UNIX_EPOCH) {
            Ok(d) => Time::At(d.as_secs() as i64, d.subsec_nanos()),
            Err(e) => {
                let d = e.duration();
                let (mut s, mut n) = (-(d.as_secs() as i64), d.subsec_nanos());
                if n > 0 {
                    s -= 1;
                    n = 1_000_000_000 - n;
                }
                Time::At(s, n)
            }
        },
    })
}

/// Whether the kernel sends `req` again: a daemon before this one read it and ended without
/// answering (FUSE_NOTIFY_RESEND, takeover.rs), and may have done it. (Requests that change
/// the tree know more: `changing`.)
fn resent(req: &Request) -> bool {
    const FUSE_UNIQUE_RESEND: u64 = 1 << 63;
    req.unique().0 & FUSE_UNIQUE_RESEND != 0
}

/// A removal that the daemon before did (`Before::Done`) is not done again; one it may have
/// done (`may_be_done`) and that finds nothing to remove did what was asked.
fn removed(
    before: Before,
    remove: impl FnOnce() -> crate::error::Result<()>,
) -> crate::error::Result<()> {
    if before == Before::Done {
        return Ok(());
    }
    match remove() {
        Err(e) if e.is(libc::ENOENT) && before.may_be_done() => Ok(()),
        r => r,
    }
}

/// Replies to a request that returns nothing but success or an errno.
fn done(reply: ReplyEmpty, r: crate::error::Result<()>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    }
}

fn fopen_flags(io: IoMode, opened: &Opened) -> FopenFlags {
    // FLUSH (sent on every close) fills copy-after-write blocks, which only a handle that
    // writes through the daemon can leave, and after a writer passing through drops the
    // attributes the kernel cached (`Opened::flushes`); POSIX locks are the kernel's own here.
    // (Under the writeback cache the kernel sends FLUSH at every close whatever this says.)
    let mut flags = if opened.flushes {
        FopenFlags::empty()
    } else {
        FopenFlags::FOPEN_NOFLUSH
    };
    if opened.direct {
        flags |= FopenFlags::FOPEN_DIRECT_IO;
    }
    match io {
        // All changes to the data go through this mount: cached pages never go stale, unless
        // the object has a second kernel inode (`Opened::keep_cache`).
        IoMode::Cached if opened.keep_cache => flags | FopenFlags::FOPEN_KEEP_CACHE,
        IoMode::Cached | IoMode::Passthrough => flags,
    }
}

impl MosaicFs {
    /// The inode's backing registration for passthrough, made with `open_backing` on first use.
    /// When the kernel refuses it, the handle falls back to the daemon path (its I/O mode is
    /// returned as the error).
    fn backing(
        &self,
        fh: u64,
        open_backing: impl FnOnce(std::os::fd::BorrowedFd<'_>) -> std::io::Result<BackingId>,
    ) -> Result<crate::file::Backing, IoMode> {
        self.core
            .passthrough_backing(fh, |fd| Ok(Arc::new(open_backing(fd)?) as _))
    }

    /// Replies to create or tmpfile: the new entry and its open handle, with passthrough when
    /// the handle has it.
    fn created(
        &self,
        reply: ReplyCreate,
        r: crate::error::Result<(Arc<crate::inode::Node>, Attr, Opened)>,
    ) {
        let (node, attr, opened) = match r {
            Ok(v) => v,
            Err(e) => return reply.error(errno(e)),
        };
        let (ttl, attr, generation, fh) = (
            self.ttl(),
            entry_attr(&node, &attr),
            Generation(node.generation()),
            FileHandle(opened.fh),
        );
        if opened.io == IoMode::Passthrough {
            match self.backing(opened.fh, |fd| reply.open_backing(fd)) {
                Ok(b) => {
                    self.core.stats().opens_passthrough.add(1);
                    let id = b
                        .downcast_ref::<BackingId>()
                        .expect("only BackingIds are stored");
                    let flags = fopen_flags(IoMode::Passthrough, &opened);
                    return reply.created_passthrough(&ttl, &attr, generation, fh, flags, id);
                }
                Err(io) => {
                    let flags = fopen_flags(io, &opened);
                    return reply.created(&ttl, &attr, generation, fh, flags);
                }
            }
        }
        self.core.stats().opens_daemon.add(1);
        reply.created(&ttl, &attr, generation, fh, fopen_flags(opened.io, &opened))
    }

    /// Makes handle `fh` known again when an earlier daemon of this mount opened it
    /// (takeover.rs); `flags` are its open flags, or the access the request needs.
    fn adopt(&self, fh: FileHandle, ino: INodeNo, flags: i32) -> Result<(), Errno> {
        self.core.adopt_handle(fh.0, ino.0, flags).map_err(errno)
    }

    fn ttl(&self) -> Duration {
        self.core.config().timeout
    }

    /// The cache time for `node`: longer for an object only lower layers hold (`lower_cache=`).
    fn ttl_of(&self, node: &crate::inode::Node) -> Duration {
        if node.state().upper {
            self.core.config().timeout
        } else {
            self.core.config().lower_cache
        }
    }

    /// After a change of the extended attribute `name` of `ino`: an ACL decides access, as
    /// the mode does (`setattr`).
    fn xattr_changed(&self, ino: INodeNo, name: &OsStr) {
        if name.as_encoded_bytes().starts_with(b"system.posix_acl_") {
            self.core.access_changed(ino.0);
        }
    }

    /// A creation that the daemon before did (`Before::Done`) answers with what is there;
    /// one it may have done (`may_be_done`) and that finds its name taken made it.
    fn made(
        &self,
        before: Before,
        parent: INodeNo,
        name: &OsStr,
        make: impl FnOnce() -> crate::error::Result<(Arc<crate::inode::Node>, Attr)>,
    ) -> crate::error::Result<(Arc<crate::inode::Node>, Attr)> {
        if before == Before::Done {
            return self.core.lookup(parent.0, name);
        }
        match make() {
            Err(e) if e.is(libc::EEXIST) && before.may_be_done() => {
                self.core.lookup(parent.0, name)
            }
            r => r,
        }
    }

    /// Carries out `op`, a request that changes the tree at `name`, recorded while it runs
    /// (resend.rs): `op` is told what a daemon before did of it, if it is sent again, and its
    /// outcome is recorded before `answer` sends it.
    fn changing<T>(
        &self,
        req: &Request,
        name: &OsStr,
        op: impl FnOnce(Before) -> crate::error::Result<T>,
        answer: impl FnOnce(crate::error::Result<T>),
    ) {
        self.changing_noted(req, name, |slot| op(slot.before()), answer)
    }

    /// The object numbers at `name` in `parent` and at `newname` in `newparent`, if both names
    /// are there.
    fn objects_at(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
    ) -> Option<[u64; 2]> {
        let number = |dir, name| {
            let (node, _) = self.core.lookup(dir, name).ok()?;
            let number = node.st_ino();
            self.core.forget(node.ino, 1);
            Some(number)
        };
        Some([number(parent, name)?, number(newparent, newname)?])
    }

    /// `changing`, with `op` given the request's slot in the record: what a daemon before
    /// noted of it, and where to note what tells whether it was done (`Slot::note`).
    fn changing_noted<T>(
        &self,
        req: &Request,
        name: &OsStr,
        op: impl FnOnce(&crate::resend::Slot) -> crate::error::Result<T>,
        answer: impl FnOnce(crate::error::Result<T>),
    ) {
        let slot = self.core.request_starts(req.unique().0);
        let r = op(&slot);
        // Tests only: no allocation, nothing but one load, where the variable is not set.
        let hang = |when: &str| {
            let Some(wanted) = self.hang_after_change.as_deref() else {
                return;
            };
            let wanted = wanted.as_encoded_bytes();
            let held = wanted.strip_prefix(when.as_bytes()) == Some(name.as_encoded_bytes());
            if held && self.core.takeovers() == 0 {
                log::warn!(
                    "MOSAICFS_TEST_HANG_CHANGE: holding the answer to a change of {name:?} {when}"
                );
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
        };
        hang("before-done:");
        slot.finish(r.is_ok());
        hang("");
        answer(r);
    }

    fn entry(&self, reply: ReplyEntry, r: crate::error::Result<(Arc<crate::inode::Node>, Attr)>) {
        match r {
            Ok((node, attr)) => reply.entry(
                &self.ttl(),
                &entry_attr(&node, &attr),
                Generation(node.generation()),
            ),
            Err(e) => reply.error(errno(e)),
        }
    }
}

impl Filesystem for MosaicFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // HANDLE_KILLPRIV_V2: the daemon clears set-id bits on writes (io.rs `open` and
        // `kill_privs`), which spares a GETXATTR(security.capability) round trip before every
        // write.
        let mut wanted = InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_EXPORT_SUPPORT
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2
            // open(O_TRUNC) truncates in OPEN (io.rs `open`): no SETATTR after it, and a
            // lower or partial file opened with O_TRUNC is passthrough at once.
            | InitFlags::FUSE_ATOMIC_O_TRUNC
            // Tells which ACL changes clear the set-group-ID bit (`setxattr_ext`).
            | InitFlags::FUSE_SETXATTR_EXT
            // The kernel keeps a symlink's target in its page cache: a target never changes
            // under one inode (a new symlink is a new inode, a copy-up copies the target).
            | InitFlags::FUSE_CACHE_SYMLINKS;
        if self.core.config().acl {
            // DONT_MASK: the kernel hands over the mode unmasked with the umask, and the
            // creation applies the umask only where the parent has no default ACL (the upper
            // file system does that with the worker's umask; the memory store in acl.rs).
            // Masked by the kernel, a default ACL's group bits were cut by the umask.
            wanted |= InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK;
        }
        let offered = config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH);
        self.core
            .set_passthrough(offered, crate::sys::admin_of_initial_namespace());
        match self.core.may_pass_through() {
            Ok(()) => {
                wanted |= InitFlags::FUSE_PASSTHROUGH;
                let _ = config.set_max_stack_depth(self.core.layers().stack_depth());
            }
            Err(why)
                if self.core.config().passthrough != crate::options::PassthroughPolicy::Off =>
            {
                log::info!(
                    "no FUSE passthrough, every read and write goes through the daemon: {why}"
                )
            }
            Err(_) => {}
        }
        // Where nothing passes through and `writeback=` asks, the kernel keeps written data in
        // its page cache and sends it later in large writes, as for a local file system
        // (io.rs `open` and `write` follow what that changes: reads through write-only
        // handles, O_APPEND).
        let writeback_offered = config
            .capabilities()
            .contains(InitFlags::FUSE_WRITEBACK_CACHE);
        if self.core.set_writeback(writeback_offered) {
            wanted |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        self.core
            .set_kernel_resends(config.capabilities().contains(InitFlags::FUSE_HAS_RESEND));
        let _ = config.add_capabilities(wanted & config.capabilities());
        self.no_opendir = config
            .capabilities()
            .contains(InitFlags::FUSE_NO_OPENDIR_SUPPORT);
        // 1 MiB, or what a pipe of the system's largest size holds (1,016 KiB where that is
        // 1 MiB): a WRITE must fit a worker's pipe whole. The 8 KiB less cost nothing measurable
        // (docs/ROBUSTNESS.md, "A daemon that ends").
        let default = match self.piped {
            true => fuser::largest_piped_write().min(1 << 20),
            false => 1 << 20,
        };
        let _ = config.set_max_write(self.max_write.unwrap_or(default).max(4096));
        let _ = config.set_max_background(64);
        // Counted before the reply leaves: whoever sees a reply sees its request counted.
        let requests = self.core.stats().requests.clone();
        if !fuser::on_request_served(Box::new(move |op, took| requests.record(op, took))) {
            log::warn!("request metrics already go to another mount of this process");
        }
        // Injected faults (tests) count from the first request on, past the mount's probes.
        crate::fault::arm();
        Ok(())
    }

    fn destroy(&mut self) {
        self.core.shutdown();
    }

    fn unmounted(&self) {
        self.core.stop_threads();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if self.panic_on_lookup.as_deref() == Some(name) {
            panic!("injected by MOSAICFS_TEST_PANIC");
        }
        if self.hang_on_lookup.as_deref() == Some(name) && self.core.takeovers() == 0 {
            log::warn!("MOSAICFS_TEST_HANG: holding the lookup of {name:?}");
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        match self.core.lookup(parent.0, name) {
            Ok((node, attr)) => reply.entry(
                &self.ttl_of(&node),
                &entry_attr(&node, &attr),
                Generation(node.generation()),
            ),
            Err(e) if e.is(libc::ENOENT) => {
                // A negative entry the kernel may cache: nothing appears here behind its back.
                let a = fuse_attr(&Attr::default());
                reply.entry(&self.ttl(), &a, Generation(0))
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        if let Some(pause) = self.late_forget
            && !self.core.node(ino.0).is_ok_and(|n| n.is_dir())
        {
            std::thread::sleep(pause);
        }
        self.core.forget(ino.0, nlookup);
        self.core.forgets_done();
    }

    fn batch_forget(&self, _req: &Request, nodes: &[fuser::ForgetOne]) {
        if let Some(pause) = self.late_forget {
            let is_dir =
                |n: &&fuser::ForgetOne| self.core.node(n.nodeid().0).is_ok_and(|n| n.is_dir());
            let (dirs, others): (Vec<_>, Vec<_>) = nodes.iter().partition(is_dir);
            for n in dirs {
                self.core.forget(n.nodeid().0, n.nlookup());
            }
            std::thread::sleep(pause);
            for n in others {
                self.core.forget(n.nodeid().0, n.nlookup());
            }
            return self.core.forgets_done();
        }
        for n in nodes {
            self.core.forget(n.nodeid().0, n.nlookup());
        }
        self.core.forgets_done();
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self
            .core
            .node(ino.0)
            .and_then(|node| Ok((self.core.getattr_of(&node)?, self.ttl_of(&node))))
        {
            Ok((a, ttl)) => reply.attr(&ttl, &fuse_attr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// statx beyond the basic fields: the birth time, where the layer's file system has one.
    /// (Not the attributes — immutable, append-only…: `fuse_do_statx` drops them from the
    /// reply, docs/KERNEL-NOTES.md.)
    fn statx(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: Option<FileHandle>,
        mask: u32,
        reply: fuser::ReplyStatx,
    ) {
        let found = self.core.node(ino.0).and_then(|node| {
            let attr = self.core.getattr_of(&node)?;
            let btime = if mask & libc::STATX_BTIME != 0 {
                self.core.birth_time_of(&node).unwrap_or(None)
            } else {
                None
            };
            Ok((attr, btime, self.ttl_of(&node)))
        });
        match found {
            Ok((a, btime, ttl)) => {
                let btime = btime.map(time);
                reply.statx(&ttl, &fuse_attr(&a), btime)
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let written = fh.is_some()
            && (atime.is_some() || mtime.is_some())
            && (mode, uid, gid, size) == (None, None, None, None);
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: set_time(atime),
            mtime: set_time(mtime),
            ctime: set_time(ctime.map(TimeOrNow::SpecificTime)),
            written,
        };
        let r = self.core.setattr(ino.0, set, &caller(req, 0));
        if mode.is_some() {
            self.core.access_changed(ino.0);
        }
        match r {
            Ok(a) => reply.attr(&self.ttl(), &fuse_attr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.core.readlink(ino.0) {
            Ok(t) => reply.data(t.as_encoded_bytes()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        self.changing(
            req,
            name,
            |before| {
                self.made(before, parent, name, || {
                    let dev = decode_dev(rdev);
                    self.core
                        .mknod(parent.0, name, mode, dev, &caller(req, umask))
                })
            },
            |r| self.entry(reply, r),
        )
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        self.changing(
            req,
            name,
            |before| {
                self.made(before, parent, name, || {
                    self.core.mkdir(parent.0, name, mode, &caller(req, umask))
                })
            },
            |r| self.entry(reply, r),
        )
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.changing(
            req,
            name,
            |before| removed(before, || self.core.unlink(parent.0, name)),
            |r| done(reply, r),
        )
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.changing(
            req,
            name,
            |before| removed(before, || self.core.rmdir(parent.0, name)),
            |r| done(reply, r),
        )
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        self.changing(
            req,
            link_name,
            |before| {
                self.made(before, parent, link_name, || {
                    self.core
                        .symlink(parent.0, link_name, target, &caller(req, 0))
                })
            },
            |r| self.entry(reply, r),
        )
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        let rename = |slot: &crate::resend::Slot| {
            let before = slot.before();
            if before == Before::Done {
                return Ok(());
            }
            if exchange && (slot.recorded() || before.may_be_done()) {
                // An exchange looks the same done or not: the objects at the two names tell.
                let now = self.objects_at(parent.0, name, newparent.0, newname);
                if before.may_be_done()
                    && let (Some([a, b]), Some(now)) = (slot.noted(), now)
                    && a != b
                    && now == [b, a]
                {
                    return Ok(());
                }
                if let Some(now) = now {
                    slot.note(now);
                }
            }
            let r = self.core.rename(
                parent.0,
                name,
                newparent.0,
                newname,
                flags.bits(),
                &caller(req, 0),
            );
            // Maybe done before: the name is gone and the new one is there.
            match r {
                Err(e) if e.is(libc::ENOENT) && before.may_be_done() => {
                    match self.core.lookup(newparent.0, newname) {
                        Ok((node, _)) => {
                            self.core.forget(node.ino, 1);
                            Ok(())
                        }
                        Err(_) => Err(e),
                    }
                }
                r => r,
            }
        };
        self.changing_noted(req, newname, rename, |r| done(reply, r))
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        self.changing(
            req,
            newname,
            |before| {
                self.made(before, newparent, newname, || {
                    self.core.link(ino.0, newparent.0, newname)
                })
            },
            |r| self.entry(reply, r),
        )
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // fuser does not pass FUSE_OPEN_KILL_SUIDGID: the caller's uid stands in for
        // CAP_FSETID, as for a truncating setattr (attr.rs).
        let kill_privs = (req.uid() != 0).then(|| caller(req, 0));
        let opened = match self.core.open(ino.0, flags.0, kill_privs.as_ref()) {
            Ok(o) => o,
            Err(e) => return reply.error(errno(e)),
        };
        let fh = FileHandle(opened.fh);
        if opened.io == IoMode::Passthrough {
            match self.backing(opened.fh, |fd| reply.open_backing(fd)) {
                Ok(b) => {
                    self.core.stats().opens_passthrough.add(1);
                    let id = b
                        .downcast_ref::<BackingId>()
                        .expect("only BackingIds are stored");
                    let flags = fopen_flags(IoMode::Passthrough, &opened);
                    return reply.opened_passthrough(fh, flags, id);
                }
                Err(io) => {
                    return reply.opened(fh, fopen_flags(io, &opened));
                }
            }
        }
        self.core.stats().opens_daemon.add(1);
        reply.opened(fh, fopen_flags(opened.io, &opened))
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if let Err(e) = self.adopt(fh, ino, flags.0) {
            return reply.error(e);
        }
        self.core.read(fh.0, offset, size, |r| match r {
            Ok(ReadData::Bytes(data)) => reply.data(data),
            Ok(ReadData::Mapped(parts)) => {
                if let Err(e) = reply.data_mapped(parts) {
                    log::error!(
                        "read of node {}: the memory upper's filestore could not be read where \
                         the file's blocks are ({e}): was it truncated or replaced under the \
                         daemon? Answered EIO. Unmount, and restore the upper dir from a copy \
                         if its files matter",
                        ino.0
                    );
                }
            }
            Err(e) => reply.error(errno(e)),
        });
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // The writeback cache's writes carry no open flags: any writable handle of the inode.
        let open_flags = if write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) {
            libc::O_RDWR
        } else {
            flags.0
        };
        if let Err(e) = self.adopt(fh, ino, open_flags) {
            return reply.error(e);
        }
        let kill_privs = write_flags
            .contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID)
            .then(|| caller(req, 0));
        let appending = flags.0 & libc::O_APPEND != 0;
        match self.core.write(
            fh.0,
            offset,
            data,
            appending,
            resent(req),
            kill_privs.as_ref(),
        ) {
            Ok(_)
                if self
                    .hang_after_write
                    .as_deref()
                    .is_some_and(|p| data.starts_with(p))
                    && self.core.takeovers() == 0 =>
            {
                log::warn!("MOSAICFS_TEST_HANG_WRITE: holding the answer to a write done");
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let adopted = self
            .adopt(fh_in, ino_in, libc::O_RDONLY)
            .and_then(|()| self.adopt(fh_out, ino_out, libc::O_WRONLY));
        if let Err(e) = adopted {
            return reply.error(e);
        }
        let kill_privs = (req.uid() != 0).then(|| caller(req, 0));
        match self.core.copy_range(
            fh_in.0,
            offset_in,
            fh_out.0,
            offset_out,
            len,
            kill_privs.as_ref(),
        ) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // A handle an earlier daemon opened holds nothing for its close to finish here.
        if self.core.is_unknown_inherited(fh.0) {
            return reply.ok();
        }
        done(reply, self.core.flush(fh.0))
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if let Some(pause) = self.slow_release {
            std::thread::sleep(pause);
        }
        self.core.release(fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        if let Err(e) = self.adopt(fh, ino, libc::O_RDONLY) {
            return reply.error(e);
        }
        done(reply, self.core.fsync(fh.0, datasync))
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.no_opendir {
            // Zero-message OPENDIR from now on: READDIR comes with handle 0, and the kernel
            // caches every listing (FOPEN_CACHE_DIR) until the directory changes.
            return reply.error(Errno::ENOSYS);
        }
        match self.core.opendir(ino.0) {
            Ok((fh, cacheable)) => {
                let flags = if cacheable {
                    FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE
                } else {
                    FopenFlags::empty()
                };
                reply.opened(FileHandle(fh), flags)
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let r = self.core.readdir(ino.0, fh.0, offset, |e, next| {
            reply.add(INodeNo(e.ino), next, file_type(e.kind), e.name)
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let r = self
            .core
            .readdirplus(ino.0, fh.0, offset, |e, next, found| match found {
                Some((node, attr)) => reply.add(
                    INodeNo(e.ino),
                    next,
                    e.name,
                    &self.ttl_of(node),
                    &entry_attr(node, attr),
                    Generation(node.generation()),
                ),
                None => {
                    // No attributes: nodeid 0 tells the kernel to take only the name.
                    let mut a = fuse_attr(&Attr::default());
                    a.ino = INodeNo(0);
                    a.kind = file_type(e.kind);
                    reply.add(
                        INodeNo(e.ino),
                        next,
                        e.name,
                        &Duration::ZERO,
                        &a,
                        Generation(0),
                    )
                }
            });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.core.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        done(reply, self.core.fsyncdir(ino.0))
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.core.statfs() {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setxattr_ext(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        setxattr_flags: u32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        // The daemon sets the ACL with its own credentials, which keep the set-group-ID bit:
        // the kernel says when the caller's would not have (FUSE_SETXATTR_EXT).
        let kill_sgid = setxattr_flags & fuser::FUSE_SETXATTR_ACL_KILL_SGID != 0;
        let r = self.core.setxattr(ino.0, name, value, flags, kill_sgid);
        self.xattr_changed(ino, name);
        done(reply, r)
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.core.getxattr(ino.0, name) {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() <= size as usize => reply.data(&v),
            Ok(_) => reply.error(Errno::ERANGE),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.core.listxattr(ino.0) {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() <= size as usize => reply.data(&v),
            Ok(_) => reply.error(Errno::ERANGE),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Inode flags: `lsattr`/`chattr` (FS_IOC_GETFLAGS/SETFLAGS) and `xfs_io -c chattr`
    /// (FS_IOC_FSGETXATTR/FSSETXATTR); fileattr.rs. The kernel sends these on a handle it
    /// opens for the purpose, after its own checks of ownership and CAP_LINUX_IMMUTABLE.
    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
        const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
        const FS_IOC32_GETFLAGS: u32 = 0x8004_6601;
        const FS_IOC32_SETFLAGS: u32 = 0x4004_6602;
        use crate::sys::{FS_IOC_FSGETXATTR, FS_IOC_FSSETXATTR, FsXattr};
        match cmd {
            FS_IOC_GETFLAGS | FS_IOC32_GETFLAGS if out_size >= 4 => {
                match self.core.inode_flags(ino.0) {
                    Ok(flags) => reply.ioctl(0, &flags.to_ne_bytes()),
                    Err(e) => reply.error(errno(e)),
                }
            }
            FS_IOC_SETFLAGS | FS_IOC32_SETFLAGS if in_data.len() >= 4 => {
                let flags = u32::from_ne_bytes(in_data[..4].try_into().expect("4 bytes"));
                match self.core.set_inode_flags(ino.0, flags) {
                    Ok(()) => reply.ioctl(0, &[]),
                    Err(e) => reply.error(errno(e)),
                }
            }
            FS_IOC_FSGETXATTR if out_size as usize >= std::mem::size_of::<FsXattr>() => {
                match self.core.fs_xattr(ino.0) {
                    Ok(fsx) => reply.ioctl(0, &fsx),
                    Err(e) => reply.error(errno(e)),
                }
            }
            FS_IOC_FSSETXATTR => match FsXattr::try_from(in_data) {
                Ok(fsx) => match self.core.set_fs_xattr(ino.0, &fsx) {
                    Ok(()) => reply.ioctl(0, &[]),
                    Err(e) => reply.error(errno(e)),
                },
                Err(_) => reply.error(Errno::EINVAL),
            },
            _ => reply.error(Errno::ENOTTY),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = self.core.removexattr(ino.0, name);
        self.xattr_changed(ino, name);
        done(reply, r)
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        match self.core.getattr(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        // Done before: the file is there, and this open is of it.
        let reopen = || {
            self.core.lookup(parent.0, name).and_then(|(node, attr)| {
                let flags = flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC);
                match self.core.open(node.ino, flags, None) {
                    Ok(opened) => Ok((node, attr, opened)),
                    Err(e) => {
                        self.core.forget(node.ino, 1);
                        Err(e)
                    }
                }
            })
        };
        let create = |before: Before| {
            if before == Before::Done {
                return reopen();
            }
            match self
                .core
                .create(parent.0, name, mode, flags, &caller(req, umask))
            {
                Err(e) if e.is(libc::EEXIST) && before.may_be_done() => reopen(),
                r => r,
            }
        };
        self.changing(req, name, create, |r| self.created(reply, r))
    }

    fn tmpfile(
        &self,
        req: &Request,
        parent: INodeNo,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let r = self
            .core
            .tmpfile(parent.0, mode, flags, &caller(req, umask));
        self.created(reply, r)
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        if let Err(e) = self.adopt(fh, ino, libc::O_RDONLY) {
            return reply.error(e);
        }
        if self.core.writeback_cache() {
            // The kernel asks SEEK_DATA and SEEK_HOLE without writing back the pages it holds
            // dirty: the layer file's holes may be where it holds data. ENOSYS has it answer
            // from its own size (all data, a hole at the end), for every later seek too.
            return reply.error(Errno::ENOSYS);
        }
        match self.core.lseek(fh.0, offset, whence) {
            Ok(pos) => reply.offset(pos),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if let Err(e) = self.adopt(fh, ino, libc::O_WRONLY) {
            return reply.error(e);
        }
        // Root is taken to hold CAP_FSETID, as for the set-id bits of new files.
        let kill_privs = (req.uid() != 0).then(|| caller(req, 0));
        let r = self
            .core
            .fallocate(fh.0, offset, length, mode, kill_privs.as_ref());
        done(reply, r)
    }
}
