//! Data requests: open, create's open, read, write, truncate, fallocate, lseek, fsync, flush,
//! release — what the kernel asks of a file's contents, on the open-file state of file/mod.rs.
//! (The types an open file is made of live in file/mod.rs, below the inode table; these
//! requests, like dir.rs' and attr.rs', are `impl Overlay` blocks above it.)
//!
//! May call (dev/callgraph.py --check keeps it so): completion, copy_up, fileattr, overlay, passthrough, sources, upper_meta.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::fs::FallocateFlags;

use crate::error::{Error, Result, errno};
use crate::file::data::WriteMode;
use crate::file::{Backing, DataRef, FileData, IoMode, OpenFile, Opened};
use crate::handles::Handle;
use crate::inode::{Ino, Node};
use crate::layers::UPPER;
use crate::options::PassthroughPolicy;
use crate::overlay::fileattr::{Change, FS_APPEND_FL};
use crate::overlay::{Caller, Overlay};
use crate::upper::ReadData;
use crate::upper::UpperFile;

impl OpenFile {
    /// Whether a write by an unprivileged caller would have to clear set-id bits or file
    /// capabilities of this complete upper file. `privs` reads its mode and capability name.
    fn has_privs_to_kill(&self, privs: &PrivsOf) -> bool {
        let data = self.read_data();
        let Some(f) = data.written_past_daemon() else {
            return false;
        };
        // Set-group-id without group execute goes too when the writer is outside the group,
        // which only the daemon's write path can tell (`kill_privs`).
        let setid = privs
            .mode(f)
            .map_or(true, |mode| mode & (libc::S_ISUID | libc::S_ISGID) != 0);
        setid || !matches!(f.get_xattr(privs.capability), Ok(None))
    }
}

/// The open flag execve(2) opens its program with (the kernel's `__FMODE_EXEC`, passed on in
/// FUSE_OPEN; never an open(2) flag, which the kernel masks off).
const FMODE_EXEC: i32 = 0x20;

/// How long an open of a retired inode waits for its last passthrough handle's RELEASE before
/// it fails with ESTALE. The RELEASE of a handle closed before the open is already queued and
/// takes microseconds to serve; the wait is long only when a reader really holds the inode
/// bound (a passthrough reader of the lower file still open while the file is reopened
/// through /proc/self/fd), where no answer but ESTALE is right.
const RELEASE_PATIENCE: Duration = Duration::from_millis(500);

impl Overlay {
    /// The data of `file`, its lower file opened if that was deferred (`FileData::Unopened`).
    /// The store is called without the file's lock held; of two threads opening at once, one
    /// keeps its descriptor. Past the descriptor reserve's line the lower file is not kept
    /// open: it serves the one caller and closes (a lookup's transient descriptor, in effect),
    /// so that a read never fails for want of descriptors held by other files.
    fn opened_data<'a>(&self, file: &'a OpenFile) -> Result<DataRef<'a>> {
        loop {
            let data = file.read_data();
            let Some((layer, path)) = data.unopened() else {
                return Ok(DataRef::Held(data));
            };
            let path = path.to_path_buf();
            drop(data);
            let src = FileData::Lower(self.open_lower_source(layer, &path)?);
            if self.fd_reserve.check(&src, false).is_err() {
                return Ok(DataRef::Transient(src));
            }
            let mut data = file.write_data();
            if data.unopened().is_some() {
                *data = src;
            }
        }
    }

    /// The shared open state of `node`, opened if no handle has it yet.
    pub fn open_file(&self, node: &Arc<Node>) -> Result<Arc<OpenFile>> {
        self.open_file_as(node, false)
    }

    /// `open_file` for an open that may write (`writer`), which the descriptor reserve counts
    /// as a partial file's.
    pub(super) fn open_file_as(&self, node: &Arc<Node>, writer: bool) -> Result<Arc<OpenFile>> {
        let copied_up = {
            let st = node.state();
            if let Some(f) = st.open.upgrade() {
                return Ok(f);
            }
            st.upper && st.has_origin
        };
        // Only a copied-up file can be partial and wait in the completion queue (whose lock is
        // the mount's: lower files and files made in the upper layer never take it here).
        if let Some(f) = copied_up
            .then(|| self.completer.find(node.st_ino()))
            .flatten()
        {
            let mut st = node.state();
            if let Some(g) = st.open.upgrade() {
                return Ok(g);
            }
            st.open = Arc::downgrade(&f);
            return Ok(f);
        }
        let data = self.open_data(node)?;
        self.fd_reserve.check(&data, writer)?;
        let partial = data.is_partial();
        let mut st = node.state();
        if let Some(f) = st.open.upgrade() {
            return Ok(f);
        }
        let f = Arc::new(OpenFile::new(node.st_ino(), data));
        st.open = Arc::downgrade(&f);
        drop(st);
        if partial {
            self.register_partial(&f);
        }
        Ok(f)
    }

    /// Makes `data` the open state of `node` (an O_TMPFILE, which has no path to open by).
    pub(super) fn adopt_open_file(&self, node: &Node, data: FileData) -> Arc<OpenFile> {
        let f = Arc::new(OpenFile::new(node.st_ino(), data));
        node.state().open = Arc::downgrade(&f);
        f
    }

    /// open(2) of a regular file. `O_TRUNC` truncates here (FUSE_ATOMIC_O_TRUNC), before the
    /// file's data is looked at: a lower or partial file becomes an empty complete upper file
    /// without copying anything, and the open is served by passthrough. `kill_privs`: the
    /// caller lacks CAP_FSETID, so the truncation clears set-id bits and capabilities, as the
    /// VFS does for local files. One piece: how the handle does I/O (passthrough or the
    /// daemon) is decided from everything checked before it, in order.
    pub fn open(&self, ino: Ino, flags: i32, kill_privs: Option<&Caller>) -> Result<Opened> {
        let node = self.node(ino)?;
        let acc = flags & libc::O_ACCMODE;
        let writable = acc != libc::O_RDONLY;
        let truncate = flags & libc::O_TRUNC != 0;
        let exec = flags & FMODE_EXEC != 0;
        if writable || truncate {
            self.check_writable()?;
        }
        if node.kind() != libc::S_IFREG {
            return Err(errno(libc::EINVAL));
        }
        // In a daemon that took over a mount whose files pass through, a node id an earlier
        // daemon gave the kernel may be bound to a backing file this one cannot match
        // (takeover.rs): the kernel looks the name up again and opens the object under a node
        // id of this daemon's (`InodeTable::fresh_file_ids`). Not a second identity no daemon
        // opened: the one before may have died between its lookup and its open, inside the
        // kernel's single retry after the ESTALE of an open before it.
        if self.inodes.fresh_files()
            && node.from_before(self.inodes.first_alias())
            && !(node.is_alias() && self.inodes.never_opened(node.ino))
        {
            if let Some(primary) = self.inodes.get(node.st_ino()) {
                self.inodes.retire(&primary);
            }
            return Err(errno(libc::ESTALE));
        }
        if node.is_alias() {
            self.inodes.mark_opened(&node);
        }
        // Immutable and append-only files (fileattr.rs): checked before anything changes.
        let append_only = if writable || truncate {
            let append = flags & libc::O_APPEND != 0 && !truncate;
            self.check_change(&node, Change::Write { append })? & FS_APPEND_FL != 0
        } else {
            false
        };
        // The kernel refuses a writer of a running program (ETXTBSY) before it sends OPEN, but
        // open(O_RDONLY | O_TRUNC) reaches here first and is refused only after this OPEN has
        // truncated (FUSE_ATOMIC_O_TRUNC): the program would lose its text to an open that
        // then fails. A local file system truncates nothing there. (Writable opens are the
        // kernel's to judge: the RELEASE of a program that has just exited may still be on
        // its way here, and `cp` over it must not fail.)
        if truncate && !writable && node.state().rare().executing > 0 {
            return Err(errno(libc::ETXTBSY));
        }
        let file = if truncate {
            // Truncated to 0, the file is complete: no partial file for the reserve to count.
            let file = self.truncate(&node, 0)?;
            if let Some(caller) = kill_privs {
                self.kill_privs(&node, &file, caller)?;
            }
            file
        } else {
            self.open_file_as(&node, writable)?
        };
        // Whether this handle could read the file (and so map it), or appends: not one a
        // marked partial file may pass through to (`DataKind::MarkedPartial`).
        let readable = acc != libc::O_WRONLY || flags & libc::O_APPEND != 0;
        let mut by_events = false;
        let mut due_now = false;
        if writable {
            // Copied up at open, as overlayfs does: whoever looks at the upper layer after an
            // open for writing finds the file there (a partial file with no blocks: no data).
            self.ensure_upper(&node, &file)?;
            // A writer that cannot map the file passes through to its sparse upper file, told of
            // every first touch by pre-content events (file/partial/precontent.rs): no copy, and no
            // request per read or write. Not with O_APPEND (`readable`): the kernel reports an
            // appending write's range at the file position before it moves to the end, so the block
            // the write lands in (the last, which may still read the lower file) would not be
            // filled first. Nor on a second identity (made for a handle that could not share the
            // first's passthrough binding): its readers could not be given a third.
            by_events = !readable && !node.is_alias() && self.serve_by_events(&file);
            // Written before, or opened for writing before: in sustained use (completion
            // follows use, file/complete.rs). Only opens that returned a handle count: one the
            // kernel retries after ESTALE (`rebind`) is the same open.
            let reopened = file.writer_opens.load(std::sync::atomic::Ordering::Relaxed) > 0
                || file.has_blocks_of_its_own();
            if reopened {
                file.reopened
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            if !by_events {
                self.complete_at_open(&file)?;
            }
            // Copied up and still partial, the file holds more descriptors than when the
            // reserve saw it (its upper and its lower file). Refused, it leaves the completion
            // queue, so that its descriptors go with this open.
            if let Err(e) = self.fd_reserve.check(&file.read_data(), true) {
                self.completer.forget(&file);
                return Err(e);
            }
            if !by_events {
                // Served through the daemon: due in the background now.
                due_now =
                    reopened && file.is_partial() && self.config.completion.on_reopen_below > 0;
            }
        }
        let policy = if writable && file.has_privs_to_kill(&self.privs_of()) {
            // A passthrough write reaches the upper file as the daemon, which would keep the
            // set-id bits and capabilities an unprivileged writer must clear: such writes go
            // through the daemon (`kill_privs`), as kernel overlayfs clears them itself.
            PassthroughPolicy::Off
        } else if append_only {
            // Each write must be seen to append (`write`).
            PassthroughPolicy::Off
        } else if self.may_pass_through().is_err() {
            // Rootless, or no passthrough in the kernel: no backing-file ioctl to be refused.
            PassthroughPolicy::Off
        } else if !writable && self.lower_on_store(&node) {
            PassthroughPolicy::Upper
        } else {
            self.config.passthrough
        };
        // An open of a retired inode cannot be retried under a new one: one that finds it
        // bound waits for the RELEASE that may be on its way (`NodeIo::begin`).
        let patience = if node.is_retired() {
            RELEASE_PATIENCE
        } else {
            Duration::ZERO
        };
        let Some(io) = node.io().begin(
            file.kind(),
            writable,
            readable,
            policy,
            node.is_alias(),
            patience,
        ) else {
            return Err(self.rebind(&node));
        };
        let node_two_identities = node.has_two_identities();
        let marked = file.is_marked();
        // Only a partial file can have copy-after-write blocks for FLUSH to fill: a complete
        // one (every file a container makes) never becomes partial again. But a reader and
        // writer that passes through may map the file shared and write it by page faults,
        // which change the layer file's times without FUSE hearing of it: its close sends
        // FLUSH, whose answer has the kernel drop the attributes it cached (`flush`;
        // xfstests generic/080, 215). A write-only handle cannot be mapped (untar's opens).
        let mappable = acc == libc::O_RDWR && io == crate::file::IoMode::Passthrough;
        let flushes = writable && (self.caw.is_some() && file.is_partial() || mappable);
        if exec {
            node.state().rare_mut().executing += 1;
        }
        if writable {
            file.writer_opens
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // Under the writeback cache the kernel appends: it sends each write at the end of the
        // file as it knows it, which may lie past the layer file's end while pages are dirty.
        let writeback = self.writeback_cache();
        let fh = self.handles.insert(Handle {
            file,
            node,
            append: flags & libc::O_APPEND != 0 && !writeback,
            append_only,
            writable,
            sync: flags & (libc::O_SYNC | libc::O_DSYNC) != 0,
            exec,
            io: Mutex::new(io),
        });
        // Writers passing through change the upper file under the daemon's cached readers
        // (`by_events`): their pages are dropped at each open, close-to-open consistency.
        let keep_cache = !node_two_identities && !by_events && !marked;
        if due_now {
            // Last: the completion worker takes the file's lock, which this open needed.
            self.completer.nudge();
        }
        Ok(Opened {
            fh,
            io,
            flushes,
            keep_cache,
            direct: writeback && append_only,
        })
    }

    /// Whether `node` is a lower-only object of a layer on a shared store's client (FUSE or a
    /// network file system, `Layer::on_store`). A read-only open of such a file is served by
    /// the daemon with the page cache kept across opens, not passed through: passed through,
    /// reads hit the client's page cache, which glusterfs' FUSE client (for one) drops at
    /// every open, so every open read the file from the store again; the layer never
    /// changes, so mosaicfs' own cache stays right (bench/stores.sh: 1,000 small files read
    /// a second time in about half the time).
    fn lower_on_store(&self, node: &Node) -> bool {
        self.lower_only_layer(node).is_some_and(|l| l.on_store)
    }

    /// Makes a small partial file complete before a writable open of it returns that the
    /// pre-content events do not serve (a readable open, or a mount without them), so that
    /// the open can use passthrough and no later read or write of it needs the daemon
    /// (`copy_whole=`: the copy costs about what a partial file's first write costs). No
    /// larger file is ever copied within an open: one in sustained use is completed in the
    /// background (file/complete.rs).
    ///
    /// The copy is a partial file filled and made durable before its mark goes (file/complete.rs),
    /// so a crash at any point leaves a valid file.
    fn complete_at_open(&self, file: &OpenFile) -> Result<()> {
        let limit = self
            .config
            .completion
            .copy_whole(self.passthrough_serves().is_ok());
        let small = limit > 0 && file.bytes_to_copy().is_some_and(|n| n <= limit);
        if small && file.is_partial() {
            self.complete_file(file)?;
            if !file.is_partial() {
                self.stats.completions_at_open.add(1);
            }
        }
        Ok(())
    }

    /// Serves the writers of partial file `file` by passthrough with pre-content events, if
    /// this mount has them. A failure falls back to the daemon path, said once in the log.
    fn serve_by_events(&self, file: &Arc<OpenFile>) -> bool {
        let Ok(events) = &self.precontent else {
            return false;
        };
        match file.serve_by_events(events) {
            Ok(served) => served,
            Err(e) => {
                static SAID: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    log::warn!(
                        "a partial file's writer goes through the daemon: marking its upper \
                         file for pre-content events failed: {e}"
                    );
                }
                false
            }
        }
    }

    /// The inode's registration for passthrough of handle `fh`, made with `register` on first
    /// use and shared by the inode's handles. When it cannot be made, the handle goes through
    /// the daemon instead: its new I/O mode is the error.
    pub fn passthrough_backing(
        &self,
        fh: u64,
        register: impl FnOnce(std::os::fd::BorrowedFd<'_>) -> std::io::Result<Backing>,
    ) -> std::result::Result<Backing, IoMode> {
        let refused = |why: String| {
            log::debug!("passthrough refused, serving through the daemon: {why}");
            self.passthrough_refused(fh).unwrap_or(IoMode::Cached)
        };
        let Ok(h) = self.handle(fh) else {
            return Err(refused("handle gone".into()));
        };
        h.node
            .io()
            .backing(
                &h.file,
                |fd| {
                    let b = register(fd).inspect_err(|e| {
                        if e.raw_os_error() == Some(libc::EPERM) {
                            self.passthrough_not_permitted();
                        }
                    })?;
                    self.stats.backings.add(1);
                    Ok(b)
                },
                || std::io::Error::other("the file was copied up meanwhile"),
            )
            .map_err(|e| refused(e.to_string()))
    }

    /// The kernel did not take the backing file: handle `fh` goes through the daemon instead.
    fn passthrough_refused(&self, fh: u64) -> Result<IoMode> {
        let h = self.handle(fh)?;
        let mut io = h.io.lock().unwrap_or_else(|e| e.into_inner());
        h.node.io().end(*io);
        let kind = h.file.kind();
        let alias = h.node.is_alias();
        *io = match h.node.io().begin(
            kind,
            h.writable,
            true,
            PassthroughPolicy::Off,
            alias,
            Duration::ZERO,
        ) {
            Some(io) => io,
            None => return Err(self.rebind(&h.node)),
        };
        Ok(*io)
    }

    /// An open found the kernel inode bound to a backing file it may not use (see `IoMode`):
    /// retires the node id, so that the kernel's retry of the open on ESTALE looks the name up
    /// again and gets a new one.
    fn rebind(&self, node: &Node) -> Error {
        if self.inodes.retire(node) {
            self.stats.rebinds.add(1);
            return errno(libc::ESTALE);
        }
        log::info!(
            "open of inode {} refused: its kernel inode is read through passthrough",
            node.st_ino()
        );
        errno(libc::ETXTBSY)
    }

    pub fn release(&self, fh: u64) {
        if let Some(h) = self.handles.remove(fh) {
            let file = h.file.clone();
            drop(h);
            let native = self.passthrough_serves().is_ok();
            self.completer
                .release(file, &self.config.completion, native);
        }
    }

    fn handle(&self, fh: u64) -> Result<Arc<Handle>> {
        self.handles.get(fh).ok_or_else(|| errno(libc::EBADF))
    }

    /// Makes handle `fh` of inode `ino` known again when an earlier daemon of this mount
    /// opened it (takeover.rs): the kernel's requests on the file carry its open flags
    /// (`flags`: READ's and WRITE's; the access a request needs, for the others), and the
    /// file's state is on disk, so opening the file again with them gives the same handle.
    /// Served through the daemon: the kernel sends data requests only for a handle that does
    /// not pass through. Nothing to do for this daemon's own handles (a shift and a compare).
    pub fn adopt_handle(&self, fh: u64, ino: Ino, flags: i32) -> Result<()> {
        if !self.handles.is_inherited(fh) || self.handles.get(fh).is_some() {
            return Ok(());
        }
        let node = self.node(ino)?;
        if node.kind() != libc::S_IFREG {
            return Err(errno(libc::EBADF));
        }
        let acc = flags & libc::O_ACCMODE;
        let writable = acc != libc::O_RDONLY;
        let readable = acc != libc::O_WRONLY || flags & libc::O_APPEND != 0;
        let file = self.open_file_as(&node, writable)?;
        if writable {
            self.ensure_upper(&node, &file)?;
        }
        let io = node
            .io()
            .begin(
                file.kind(),
                writable,
                readable,
                PassthroughPolicy::Off,
                node.is_alias(),
                Duration::ZERO,
            )
            .ok_or_else(|| {
                Error::with_context(
                    libc::EIO,
                    "a handle opened before the takeover cannot be served: its inode is bound \
                     to a passthrough backing file now",
                )
            })?;
        let exec = flags & FMODE_EXEC != 0;
        if exec {
            node.state().rare_mut().executing += 1;
        }
        let handle = Handle {
            file,
            node,
            append: flags & libc::O_APPEND != 0 && !self.writeback_cache(),
            // The kernel checked the append-only flag at the open, and this handle appends.
            append_only: false,
            writable,
            sync: flags & (libc::O_SYNC | libc::O_DSYNC) != 0,
            exec,
            io: Mutex::new(io),
        };
        // Two requests of one handle at once: the other one's stays (this one drops, undone).
        self.handles.insert_at(fh, handle);
        self.stats.handles_adopted.add(1);
        Ok(())
    }

    /// Whether `fh` is a handle an earlier daemon of this mount opened and this one has not
    /// made known again.
    pub fn is_unknown_inherited(&self, fh: u64) -> bool {
        self.handles.is_inherited(fh) && self.handles.get(fh).is_none()
    }

    /// A directory handle an earlier daemon of this mount opened, made known again.
    pub fn adopt_dir_handle(&self, fh: u64, ino: Ino) {
        if fh != 0 && self.dirs.is_inherited(fh) && self.dirs.get(fh).is_none() {
            self.dirs.insert_at(fh, crate::handles::DirHandle { ino });
        }
    }

    /// Reads `size` bytes at `off` and hands them to `reply` (fewer only at end of file), for
    /// the kernel: a memory upper's file hands over its filestore mapping (`ReadData::Mapped`),
    /// other files go into a buffer each thread reuses, never zeroed — no allocation and at most
    /// one copy on the daemon's read path.
    pub fn read<R>(
        &self,
        fh: u64,
        off: u64,
        size: u32,
        reply: impl FnOnce(Result<ReadData<'_>>) -> R,
    ) -> R {
        match self.handle(fh) {
            Ok(h) => self.read_data(&h.file, off, size, true, reply),
            Err(e) => reply(Err(e)),
        }
    }

    /// `read` on an open file rather than a handle, as bytes (in-process readers: export.rs).
    pub fn read_file<R>(
        &self,
        file: &OpenFile,
        off: u64,
        size: u32,
        reply: impl FnOnce(Result<&[u8]>) -> R,
    ) -> R {
        self.read_data(file, off, size, false, |r| match r {
            Ok(ReadData::Bytes(b)) => reply(Ok(b)),
            Ok(ReadData::Mapped(_)) => unreachable!("asked for bytes"),
            Err(e) => reply(Err(e)),
        })
    }

    /// `read`'s work: `mapped` lets a memory file answer with iovecs into its filestore.
    fn read_data<R>(
        &self,
        file: &OpenFile,
        off: u64,
        size: u32,
        mapped: bool,
        reply: impl FnOnce(Result<ReadData<'_>>) -> R,
    ) -> R {
        self.stats.reads.add(1);
        self.stats.read_bytes.add(size as u64);
        if mapped {
            file.served_one(); // a kernel request: completion's sustained-use rule
        }
        match self.opened_data(file) {
            Ok(data) => data.read(off, size, mapped, reply),
            Err(e) => reply(Err(e)),
        }
    }

    /// Makes the file behind `h` writable in the upper layer: a metadata-only copy-up.
    fn ensure_upper(&self, node: &Node, file: &OpenFile) -> Result<()> {
        if file.is_lower() {
            self.copy_up(node)?;
            self.refresh_open(node)?;
        }
        Ok(())
    }

    /// Writes through handle `fh`; `appending`: its file flags have O_APPEND now (fcntl may
    /// have changed them since the open). `kill_privs`: the writer lacks CAP_FSETID, so set-id
    /// bits and file capabilities go, as the VFS would do (FUSE_HANDLE_KILLPRIV_V2).
    /// `at_offset`: write at `off` even through a handle that appends — a write the kernel
    /// sends again after a daemon ended without answering it (takeover.rs): the kernel chose
    /// `off` as the end of the file when it sent the write the first time, so writing there
    /// again is the same write, where appending would append it twice.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &self,
        fh: u64,
        off: u64,
        data: &[u8],
        appending: bool,
        at_offset: bool,
        kill_privs: Option<&Caller>,
    ) -> Result<u32> {
        let h = self.handle(fh)?;
        if h.append_only && !appending {
            // The kernel checks this at fcntl(F_SETFL) on a local file system (fileattr.rs).
            return Err(errno(libc::EPERM));
        }
        if let Some(caller) = kill_privs {
            self.kill_privs(&h.node, &h.file, caller)?;
        }
        self.stats.writes.add(1);
        self.stats.write_bytes.add(data.len() as u64);
        self.check_writable()?;
        self.ensure_upper(&h.node, &h.file)?;
        h.file.served_one();
        let mode = WriteMode {
            append: h.append && !at_offset,
            sync: h.sync && !self.config.skip_fsync,
        };
        let pending = h.file.write_data().write(off, data, mode)?;
        if let Some(caw) = &self.caw {
            self.stats.blocks_deferred.add(pending.len() as u64);
            if !pending.is_empty() {
                self.need_caw_workers();
            }
            caw.schedule(&h.file, &pending);
        }
        Ok(data.len() as u32)
    }

    /// copy_file_range(2) between two files of the mount: read through one handle and written
    /// through the other on the daemon's write path. Served here, not left to the kernel's
    /// fallback, because that fallback splices into a passthrough file's backing file, which
    /// raises no pre-content event: bytes would land in a partial file's holes unfilled.
    /// Returns the bytes copied (fewer at the end of the source).
    pub fn copy_range(
        &self,
        fh_in: u64,
        off_in: u64,
        fh_out: u64,
        off_out: u64,
        len: u64,
        kill_privs: Option<&Caller>,
    ) -> Result<u32> {
        const CHUNK: u64 = 1 << 20;
        // An immutable destination (fileattr.rs), made so since it was opened: the kernel
        // checks this in `generic_copy_file_checks` on a local file system.
        self.check_change(&self.handle(fh_out)?.node, Change::Write { append: false })?;
        let src = self.handle(fh_in)?;
        let len = len.min(u32::MAX as u64 & !(CHUNK - 1));
        let mut done = 0u64;
        while done < len {
            let want = (len - done).min(CHUNK) as u32;
            let bytes =
                self.read_file(&src.file, off_in + done, want, |r| r.map(|b| b.to_vec()))?;
            if bytes.is_empty() {
                break;
            }
            self.write(fh_out, off_out + done, &bytes, false, false, kill_privs)?;
            done += bytes.len() as u64;
            if bytes.len() < want as usize {
                break;
            }
        }
        Ok(done as u32)
    }

    /// Clears set-user-id, set-group-id and file capabilities of a file being written or
    /// truncated by an unprivileged caller, as the VFS does for local files
    /// (`setattr_should_drop_suidgid`): set-group-id goes when the file is group-executable,
    /// or when `caller` is not in the file's group. The kernel's cached
    /// attributes are dropped when the mode changed (`attrs_changed_behind`).
    pub(super) fn kill_privs(&self, node: &Node, file: &OpenFile, caller: &Caller) -> Result<()> {
        // A lower file is copied up (metadata only) only if it has set-id bits to clear.
        let lower_has_setid = match self.opened_data(file)?.lower() {
            Some(src) => Some(src.stat()?.mode & (libc::S_ISUID | libc::S_ISGID) != 0),
            None => None,
        };
        match lower_has_setid {
            Some(false) => return Ok(()),
            Some(true) => self.ensure_upper(node, file)?,
            None => {}
        }
        let f = match file.read_data().upper() {
            Some(f) => f.try_clone()?,
            None => return Err(errno(libc::EIO)),
        };
        let privs = self.privs_of();
        let before = privs.mode(&f)?;
        let mut mode = before;
        mode &= !libc::S_ISUID;
        if mode & libc::S_ISGID != 0
            && (mode & libc::S_IXGRP != 0
                || !in_group(caller, self.getattr_of(node).map(|a| a.gid)))
        {
            mode &= !libc::S_ISGID;
        }
        if mode != before {
            if self.upper_overrides() {
                let mut v = self
                    .override_at(UPPER, f.view(), None)
                    .ok_or_else(|| errno(libc::EIO))?;
                v.mode = mode;
                self.set_override(&f.object()?, None, &v, libc::S_IFREG)?;
            } else {
                f.chmod(mode)?;
            }
            self.attrs_changed_behind(node.ino);
        }
        let capability = privs.capability;
        match f.remove_xattr(capability) {
            Ok(()) => Ok(()),
            Err(e) if e.is(libc::ENODATA) || e.is(libc::EOPNOTSUPP) => Ok(()),
            // A daemon without CAP_SETFCAP (an unprivileged mount) may not even try; it is
            // only an error if there is a capability to remove.
            Err(e) if e.is(libc::EPERM) || e.is(libc::EACCES) => match f.get_xattr(capability) {
                Ok(None) => Ok(()),
                _ => Err(e),
            },
            Err(e) => Err(e),
        }
    }

    /// Sets the size of `node`, copying up as little as that needs. Returns the file's open
    /// state, for what the caller does next with it.
    pub fn truncate(&self, node: &Arc<Node>, size: u64) -> Result<Arc<OpenFile>> {
        self.check_writable()?;
        if !node.state().upper {
            self.copy_up_with(node, size == 0)?;
        }
        let file = self.open_file(node)?;
        self.ensure_upper(node, &file)?;
        file.write_data().set_size(size, &self.layers.xattr)?;
        Ok(file)
    }

    /// fallocate(2) on the handle `fh`. `kill_privs`: the caller is unprivileged, so set-id
    /// bits and file capabilities go as on a write (FUSE_HANDLE_KILLPRIV_V2 leaves that to the
    /// daemon, and FALLOCATE carries no flag for it; xfstests generic/683-685, 688).
    pub fn fallocate(
        &self,
        fh: u64,
        off: u64,
        len: u64,
        mode: i32,
        kill_privs: Option<&Caller>,
    ) -> Result<()> {
        let h = self.handle(fh)?;
        self.check_writable()?;
        let mode = FallocateFlags::from_bits(mode as _).ok_or_else(|| errno(libc::EOPNOTSUPP))?;
        let change = match mode.difference(FallocateFlags::KEEP_SIZE).is_empty() {
            true => Change::Write { append: true },
            false => Change::Modify,
        };
        self.check_change(&h.node, change)?;
        if let Some(caller) = kill_privs {
            self.kill_privs(&h.node, &h.file, caller)?;
        }
        self.ensure_upper(&h.node, &h.file)?;
        h.file
            .write_data()
            .fallocate(mode, off, len, &self.layers.xattr)
    }

    /// close(2) of a descriptor: pending copy-after-write blocks of the file go to disk. An
    /// unmount does not wait for the daemon, so anything still only in memory when the last
    /// descriptor closes could be missed by whatever mounts the layers next (podman commit).
    /// A writable passthrough handle may have written the layer file behind the daemon's back:
    /// shared mappings change its times at each first write fault, which FUSE never hears of,
    /// so the kernel drops the inode's cached attributes (xfstests generic/080 and 215: stat
    /// after a mapped write showed the old mtime and ctime).
    pub fn flush(&self, fh: u64) -> Result<()> {
        let h = self.handle(fh)?;
        h.file.flush_pending()?;
        if h.writable && h.io() == crate::file::IoMode::Passthrough {
            self.attrs_changed_behind(h.node.ino);
        }
        Ok(())
    }

    /// SEEK_DATA and SEEK_HOLE on the merged content (other whences are the kernel's).
    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> Result<i64> {
        self.seek_file(&self.handle(fh)?.file, offset, whence)
    }

    /// `lseek` on an open file rather than a handle.
    pub fn seek_file(&self, file: &OpenFile, offset: i64, whence: i32) -> Result<i64> {
        if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE {
            return Err(errno(libc::EINVAL));
        }
        // No data or hole lies before the start: ENXIO, as on ext4 and kernel overlayfs.
        let off = u64::try_from(offset).map_err(|_| errno(libc::ENXIO))?;
        Ok(self.opened_data(file)?.seek(off, whence)? as i64)
    }

    pub fn fsync(&self, fh: u64, datasync: bool) -> Result<()> {
        self.stats.fsyncs.add(1);
        if self.config.skip_fsync {
            // volatile: the data is in the page cache of the upper file system, as after any
            // write; only durability is given up. Pending blocks still reach that cache.
            return self.handle(fh)?.file.flush_pending();
        }
        let h = self.handle(fh)?;
        if h.file.write_data().sync(datasync)? {
            self.stats.fsyncs_to_disk.add(1);
        }
        Ok(())
    }

    pub fn fsyncdir(&self, ino: Ino) -> Result<()> {
        if self.config.skip_fsync || !self.layers.has_upper {
            return Ok(());
        }
        let node = self.node(ino)?;
        if !node.state().upper {
            return Ok(());
        }
        self.upper_fd(&node)?.sync()
    }
}

/// Where the privileges a write by an unprivileged caller clears are kept: the mode (on the
/// inode, or in the upper layer's owner-and-mode xattr) and the file capability's xattr name.
pub struct PrivsOf<'a> {
    overlay: &'a Overlay,
    in_xattr: bool,
    capability: &'static str,
}

impl PrivsOf<'_> {
    /// Permission, set-id and sticky bits of the upper file `f`.
    fn mode(&self, f: &UpperFile) -> Result<u32> {
        if self.in_xattr
            && let Some(v) = self.overlay.override_at(UPPER, f.view(), None)
        {
            return Ok(v.mode);
        }
        Ok(f.stat()?.mode & 0o7777)
    }
}

impl Overlay {
    pub(super) fn privs_of(&self) -> PrivsOf<'_> {
        PrivsOf {
            overlay: self,
            in_xattr: self.upper_overrides(),
            capability: self.config.xattr_permissions.capability_name(),
        }
    }
}

impl Overlay {
    /// Writes the copy-after-write blocks an earlier daemon of this mount left pending
    /// (file/partial/arena.rs) into their files, each as a synchronous write, before this
    /// daemon serves a request. A block is let go only once written, so a daemon killed in
    /// the middle leaves the rest to the next one.
    pub fn replay_pending(&self) {
        let Some(arena) = &self.arena else { return };
        if self.takeovers() > 0 {
            let left = arena.left();
            if !left.is_empty() {
                log::info!(
                    "writing {} copy-after-write blocks the daemon before left pending",
                    left.len()
                );
            }
            for left in left {
                let written = self.node(left.owner.number).and_then(|node| {
                    let file = self.open_file_as(&node, true)?;
                    file.write_left(&left)
                });
                match written {
                    Ok(()) => self.stats.blocks_filled.add(1),
                    Err(e) => log::error!(
                        "bytes written into block {} of inode {} before the daemon ended \
                         cannot be written into the file ({e}): they are lost",
                        left.block,
                        left.owner.number
                    ),
                }
                arena.forget_left(left.slot);
            }
        }
        arena.replayed();
    }

    /// Starts the copy-after-write workers (`caw_workers=0`: blocks are filled only when
    /// something needs them, at fsync, truncate, completion or close).
    pub(super) fn start_caw_workers(self: &Arc<Self>) {
        let Some(caw) = self.caw.clone() else { return };
        for i in 0..self.config.caw_workers {
            let me = self.clone();
            let caw = caw.clone();
            let _ = std::thread::Builder::new()
                .name(format!("mosaicfs-caw-{i}"))
                .spawn(move || {
                    while let Some((file, blk)) = caw.next() {
                        let Some(file) = file.upgrade() else { continue };
                        // A panic (logged by the hook) loses this job only: the block stays
                        // pending, and close, fsync or unmount fill it.
                        let filled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            file.fill_pending(blk)
                        }));
                        let Ok(filled) = filled else { continue };
                        match filled {
                            Ok(true) => me.stats.blocks_filled.add(1),
                            Ok(false) => {}
                            Err(e) => log::warn!(
                                "copy-after-write of inode {} block {blk}: {e}",
                                file.ino()
                            ),
                        }
                    }
                });
        }
    }
}

/// Whether `caller` is in group `gid` (the object's, when it could be read): its fsgid or one
/// of its supplementary groups, as the kernel's `in_group_p`. A caller whose groups cannot be
/// read (it is gone) counts as outside: clearing set-group-id is the safe side.
fn in_group(caller: &Caller, gid: Result<u32>) -> bool {
    let Ok(gid) = gid else { return false };
    if caller.gid == gid {
        return true;
    }
    std::fs::read_to_string(format!("/proc/{}/status", caller.pid)).is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("Groups:"))
            .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
    })
}
