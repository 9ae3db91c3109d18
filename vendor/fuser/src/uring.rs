//! mosaicfs patch: FUSE requests carried over io_uring instead of read(2)/writev(2) on
//! /dev/fuse (Linux 6.14+, `CONFIG_FUSE_IO_URING`, module parameter `fuse.enable_uring`).
//!
//! Written from the kernel's interface (Documentation/filesystems/fuse/fuse-io-uring.rst,
//! include/uapi/linux/fuse.h, fs/fuse/dev_uring.c). The protocol, per ring entry:
//!
//! - the server hands the kernel a header buffer (`ReqHeader`) and a payload buffer of at
//!   least the connection's largest payload, with an `IORING_OP_URING_CMD` SQE (128-byte
//!   SQE) on the /dev/fuse descriptor, command `REGISTER`, naming the queue (one per possible
//!   CPU; a request goes to the queue of the CPU its caller runs on). Once every queue has an
//!   entry, the kernel sends requests through the rings and no longer through read(2);
//! - a request arrives as the completion of that command: `fuse_in_header` in
//!   `in_out`, the opcode's fixed argument in `op_in`, the rest (names, write data) in the
//!   payload buffer, its length and the request's id in `ring_ent`;
//! - the server writes `fuse_out_header` into `in_out` and the reply's arguments into the
//!   payload buffer, and sends `COMMIT_AND_FETCH` with the id: one io_uring_enter both answers
//!   the request and waits for the next one.
//!
//! FORGET, INTERRUPT and notifications still use /dev/fuse, so a session over io_uring keeps one
//! /dev/fuse reader.
//!
//! Here each worker thread owns one ring with one entry and serves the requests of that entry
//! one at a time, as a /dev/fuse worker serves what it reads: a request that blocks holds one
//! entry of its queue, and the others go on. The pool grows by adding entries (workers).

use std::io;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::os::fd::BorrowedFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::sync::Condvar;
use std::sync::Mutex;

/// Where the kernel says whether FUSE may use io_uring.
pub const ENABLE_PARAMETER: &str = "/sys/module/fuse/parameters/enable_uring";

/// Whether the kernel has FUSE over io_uring (`Some`) and whether it is switched on.
pub fn kernel_enabled() -> Option<bool> {
    let s = std::fs::read_to_string(ENABLE_PARAMETER).ok()?;
    Some(matches!(s.trim(), "Y" | "y" | "1"))
}

/// The number of queues the kernel makes: one per possible CPU (`num_possible_cpus`).
pub(crate) fn queue_count() -> usize {
    let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let mut n = 0;
    for part in possible.trim().split(',').filter(|p| !p.is_empty()) {
        let mut ends = part.split('-').map(|x| x.parse::<usize>().unwrap_or(0));
        let first = ends.next().unwrap_or(0);
        let last = ends.next().unwrap_or(first);
        n += last.saturating_sub(first) + 1;
    }
    n.max(1)
}

const FUSE_IN_HEADER_SZ: usize = 40;
const FUSE_OUT_HEADER_SZ: usize = 16;
const IN_OUT_HEADER_SZ: usize = 128;
const OP_IN_OUT_SZ: usize = 128;
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_ent_in_out`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct EntInOut {
    flags: u64,
    commit_id: u64,
    payload_sz: u32,
    padding: u32,
    reserved: u64,
}

/// `struct fuse_uring_req_header`: the header buffer of one entry.
#[repr(C, align(64))]
struct ReqHeader {
    in_out: [u8; IN_OUT_HEADER_SZ],
    op_in: [u8; OP_IN_OUT_SZ],
    ent: EntInOut,
}

// io_uring ABI (include/uapi/linux/io_uring.h).
const IORING_SETUP_SQE128: u32 = 1 << 10;
const IORING_SETUP_SINGLE_ISSUER: u32 = 1 << 12;
const IORING_SETUP_DEFER_TASKRUN: u32 = 1 << 13;
const IORING_ENTER_GETEVENTS: u32 = 1;
const IORING_ENTER_REGISTERED_RING: u32 = 1 << 4;
const IORING_REGISTER_RING_FDS: u32 = 20;
const IORING_OP_URING_CMD: u8 = 46;
const IORING_OFF_SQ_RING: libc::off_t = 0;
const IORING_OFF_CQ_RING: libc::off_t = 0x800_0000;
const IORING_OFF_SQES: libc::off_t = 0x1000_0000;
const SQE_SIZE: usize = 128;

#[repr(C)]
#[derive(Default)]
struct SqringOffsets {
    head: u32,
    tail: u32,
    ring_mask: u32,
    ring_entries: u32,
    flags: u32,
    dropped: u32,
    array: u32,
    resv1: u32,
    user_addr: u64,
}

#[repr(C)]
#[derive(Default)]
struct CqringOffsets {
    head: u32,
    tail: u32,
    ring_mask: u32,
    ring_entries: u32,
    overflow: u32,
    cqes: u32,
    flags: u32,
    resv1: u32,
    user_addr: u64,
}

#[repr(C)]
#[derive(Default)]
struct Params {
    sq_entries: u32,
    cq_entries: u32,
    flags: u32,
    sq_thread_cpu: u32,
    sq_thread_idle: u32,
    features: u32,
    wq_fd: u32,
    resv: [u32; 3],
    sq_off: SqringOffsets,
    cq_off: CqringOffsets,
}

/// A shared mapping of the ring, unmapped on drop.
struct Map {
    ptr: *mut u8,
    len: usize,
}

impl Map {
    fn new(fd: BorrowedFd<'_>, len: usize, offset: libc::off_t) -> io::Result<Map> {
        // SAFETY: a fresh shared mapping of the io_uring descriptor; checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Map {
            ptr: ptr.cast(),
            len,
        })
    }

    /// # Safety
    /// `offset` is inside the mapping and aligned for `T`.
    unsafe fn at<T>(&self, offset: u32) -> *mut T {
        debug_assert!((offset as usize) < self.len);
        unsafe { self.ptr.add(offset as usize).cast() }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A minimal io_uring with 128-byte SQEs, used by one thread for one command at a time.
struct Ring {
    // The mappings go before the descriptor (fields drop in order).
    sq: Map,
    cq: Map,
    sqes: Map,
    sq_off: SqringOffsets,
    cq_off: CqringOffsets,
    /// Held, never read: the ring lives while its descriptor is open.
    _fd: OwnedFd,
    /// How `io_uring_enter` names the ring: its index among the thread's registered rings
    /// (`IORING_REGISTER_RING_FDS`), so that no enter looks the descriptor up, or else `fd`.
    enter_fd: i32,
    enter_flags: u32,
}

/// `struct io_uring_rsrc_update`.
#[repr(C)]
struct RsrcUpdate {
    offset: u32,
    resv: u32,
    data: u64,
}

/// `io_uring_register(2)` on `ring`.
fn register(ring: BorrowedFd<'_>, op: u32, arg: *const libc::c_void, n: u32) -> io::Result<i64> {
    // SAFETY: `arg` points at `n` items of the layout `op` takes, alive for the call.
    let r = unsafe { libc::syscall(libc::SYS_io_uring_register, ring.as_raw_fd(), op, arg, n) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

// SAFETY: the ring is used by the one thread that owns it; the raw pointers are into its own
// mappings.
unsafe impl Send for Ring {}

/// A completion: the command's result.
struct Cqe {
    res: i32,
}

impl Ring {
    fn new() -> io::Result<Ring> {
        let mut p = Params {
            // One thread submits to and waits on the ring, and it takes a request only while
            // it waits: the kernel's task work for it (a request arriving) may wait until then
            // instead of interrupting the thread.
            flags: IORING_SETUP_SQE128 | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
            ..Default::default()
        };
        // SAFETY: io_uring_setup with a valid parameter block.
        let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 2u32, &mut p as *mut Params) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor, owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let sq_len = p.sq_off.array as usize + p.sq_entries as usize * 4;
        let cq_len = p.cq_off.cqes as usize + p.cq_entries as usize * 16;
        let sq = Map::new(fd.as_fd(), sq_len, IORING_OFF_SQ_RING)?;
        let cq = Map::new(fd.as_fd(), cq_len, IORING_OFF_CQ_RING)?;
        let sqes = Map::new(
            fd.as_fd(),
            p.sq_entries as usize * SQE_SIZE,
            IORING_OFF_SQES,
        )?;
        // Registered for the calling thread, the one that uses the ring (Linux 5.18+; without
        // it the plain descriptor serves): each enter then skips a descriptor lookup.
        let mut slot = RsrcUpdate {
            offset: u32::MAX,
            resv: 0,
            data: fd.as_raw_fd() as u64,
        };
        let slot_ptr = (&mut slot as *mut RsrcUpdate).cast();
        let (enter_fd, enter_flags) =
            match register(fd.as_fd(), IORING_REGISTER_RING_FDS, slot_ptr, 1) {
                Ok(1) => (slot.offset as i32, IORING_ENTER_REGISTERED_RING),
                _ => (fd.as_raw_fd(), 0),
            };
        Ok(Ring {
            sq,
            cq,
            sqes,
            sq_off: p.sq_off,
            cq_off: p.cq_off,
            _fd: fd,
            enter_fd,
            enter_flags,
        })
    }

    /// Queues `sqe` and enters the kernel: submits it and, with `wait`, waits for one
    /// completion and returns it.
    fn submit(&mut self, sqe: &[u8; SQE_SIZE], wait: bool) -> io::Result<Option<Cqe>> {
        use std::sync::atomic::{AtomicU32, Ordering};
        // SAFETY: offsets from the kernel's parameter block into our mappings; the SQ tail and
        // CQ head are ours to write, the others the kernel's (atomics for the shared words).
        unsafe {
            let tail = &*self.sq.at::<AtomicU32>(self.sq_off.tail);
            let mask = *self.sq.at::<u32>(self.sq_off.ring_mask);
            let t = tail.load(Ordering::Relaxed);
            let idx = t & mask;
            std::ptr::copy_nonoverlapping(
                sqe.as_ptr(),
                self.sqes.ptr.add(idx as usize * SQE_SIZE),
                SQE_SIZE,
            );
            *self.sq.at::<u32>(self.sq_off.array).add(idx as usize) = idx;
            tail.store(t.wrapping_add(1), Ordering::Release);
        }
        loop {
            let (min, flags) = if wait {
                (1u32, IORING_ENTER_GETEVENTS)
            } else {
                (0, 0)
            };
            // SAFETY: io_uring_enter on our ring.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_uring_enter,
                    self.enter_fd,
                    1u32,
                    min,
                    flags | self.enter_flags,
                    std::ptr::null::<libc::c_void>(),
                    0usize,
                )
            };
            if r >= 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
            // Interrupted before anything was submitted (a count is returned otherwise,
            // even when the wait was cut short): the entry is still queued, enter again.
        }
        if !wait {
            return Ok(None);
        }
        self.wait().map(Some)
    }

    /// The next completion, waiting for it if there is none yet.
    fn wait(&mut self) -> io::Result<Cqe> {
        use std::sync::atomic::{AtomicU32, Ordering};
        loop {
            // SAFETY: as in `submit`.
            unsafe {
                let head = &*self.cq.at::<AtomicU32>(self.cq_off.head);
                let tail = &*self.cq.at::<AtomicU32>(self.cq_off.tail);
                let mask = *self.cq.at::<u32>(self.cq_off.ring_mask);
                let h = head.load(Ordering::Relaxed);
                if h != tail.load(Ordering::Acquire) {
                    let cqe = self.cq.at::<u8>(self.cq_off.cqes).add((h & mask) as usize * 16);
                    let res = std::ptr::read_unaligned(cqe.add(8).cast::<i32>());
                    head.store(h.wrapping_add(1), Ordering::Release);
                    return Ok(Cqe { res });
                }
            }
            // SAFETY: io_uring_enter on our ring, waiting only.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_uring_enter,
                    self.enter_fd,
                    0u32,
                    1u32,
                    IORING_ENTER_GETEVENTS | self.enter_flags,
                    std::ptr::null::<libc::c_void>(),
                    0usize,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(e);
                }
            }
        }
    }
}

/// Keeps the calling thread on CPU `qid`: the kernel queues a request on the queue of the CPU
/// its caller runs on, so the entry's thread answers it there, without waking another CPU.
/// Best effort: a CPU that is offline or outside the cpuset leaves the thread where it was.
pub(crate) fn pin_to_queue_cpu(qid: u16) {
    use nix::sched::{CpuSet, sched_setaffinity};
    let mut set = CpuSet::new();
    if set.set(qid as usize).is_ok() {
        let _ = sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

/// Room before the payload for the request's header and fixed argument, so that a request
/// is one contiguous slice for the parser without copying its payload.
const PREFIX: usize = FUSE_IN_HEADER_SZ + OP_IN_OUT_SZ;

/// One ring entry of one queue, served by the thread that owns it.
pub(crate) struct RingEntry {
    ring: Ring,
    header: Box<ReqHeader>,
    /// `PREFIX` bytes, then the payload buffer registered with the kernel.
    buf: crate::read_buf::MappedBuf,
    iov: Box<[libc::iovec; 2]>,
    /// The /dev/fuse descriptor. Not a fixed file of the ring: the ring would hold the file
    /// (and with it the kernel's passthrough backing files) until its asynchronous teardown,
    /// after the daemon has exited, and the upper layer's file system would stay busy.
    dev: i32,
    qid: u16,
    /// Where the current request starts in `buf`, and where it ends.
    request: (usize, usize),
}

/// How an entry's wait for a request ended.
pub(crate) enum Fetched {
    /// A request: its bytes are `RingEntry::request()`.
    Request,
    /// The connection is gone (unmounted, aborted): the worker ends.
    Ended,
}

impl RingEntry {
    /// An entry for queue `qid` of the connection `dev`, with a payload buffer of `payload`
    /// bytes (at least the kernel's `max_payload_sz`). Not registered yet: `fetch` does that.
    pub(crate) fn new(dev: BorrowedFd<'_>, qid: u16, payload: usize) -> io::Result<RingEntry> {
        let ring = Ring::new()?;
        let mut header = Box::new(ReqHeader {
            in_out: [0; IN_OUT_HEADER_SZ],
            op_in: [0; OP_IN_OUT_SZ],
            ent: EntInOut::default(),
        });
        let mut buf = crate::read_buf::MappedBuf::new(PREFIX + payload);
        let iov = Box::new([
            libc::iovec {
                iov_base: (&mut *header as *mut ReqHeader).cast(),
                iov_len: std::mem::size_of::<ReqHeader>(),
            },
            libc::iovec {
                // SAFETY: inside `buf`, which is never reallocated.
                iov_base: unsafe { buf.as_mut_ptr().add(PREFIX) }.cast(),
                iov_len: payload,
            },
        ]);
        Ok(RingEntry {
            ring,
            header,
            buf,
            iov,
            dev: dev.as_raw_fd(),
            qid,
            request: (0, 0),
        })
    }

    fn command(&self, cmd_op: u32, commit_id: u64) -> [u8; SQE_SIZE] {
        let mut sqe = [0u8; SQE_SIZE];
        sqe[0] = IORING_OP_URING_CMD;
        sqe[4..8].copy_from_slice(&self.dev.to_ne_bytes());
        sqe[8..12].copy_from_slice(&cmd_op.to_ne_bytes());
        sqe[16..24].copy_from_slice(&(self.iov.as_ptr() as u64).to_ne_bytes());
        sqe[24..28].copy_from_slice(&2u32.to_ne_bytes());
        // struct fuse_uring_cmd_req in the command area (offset 48).
        sqe[56..64].copy_from_slice(&commit_id.to_ne_bytes());
        sqe[64..66].copy_from_slice(&self.qid.to_ne_bytes());
        sqe
    }

    /// Registers the entry (`commit` is `None`) or answers request `commit` with the reply
    /// put in by `set_reply`, then waits for the next request.
    pub(crate) fn fetch(&mut self, commit: Option<u64>) -> io::Result<Fetched> {
        let sqe = match commit {
            None => self.command(CMD_REGISTER, 0),
            Some(id) => self.command(CMD_COMMIT_AND_FETCH, id),
        };
        let cqe = self.ring.submit(&sqe, true)?.expect("waited for a completion");
        if cqe.res < 0 {
            return match -cqe.res {
                libc::ENOTCONN | libc::ECANCELED | libc::ECONNABORTED | libc::ENODEV => {
                    Ok(Fetched::Ended)
                }
                e => Err(io::Error::from_raw_os_error(e)),
            };
        }
        let ent = self.header.ent;
        let h = &self.header.in_out[..FUSE_IN_HEADER_SZ];
        let len = u32::from_ne_bytes(h[0..4].try_into().unwrap()) as usize;
        let payload = ent.payload_sz as usize;
        let arg0 = len
            .checked_sub(FUSE_IN_HEADER_SZ + payload)
            .filter(|a| *a <= OP_IN_OUT_SZ && PREFIX + payload <= self.buf.len())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("io_uring FUSE request of {len} bytes with a payload of {payload}"),
                )
            })?;
        let start = PREFIX - FUSE_IN_HEADER_SZ - arg0;
        self.buf[start..start + FUSE_IN_HEADER_SZ].copy_from_slice(h);
        self.buf[start + FUSE_IN_HEADER_SZ..PREFIX].copy_from_slice(&self.header.op_in[..arg0]);
        self.request = (start, PREFIX + payload);
        Ok(Fetched::Request)
    }

    /// The request `fetch` received, as /dev/fuse would have delivered it.
    pub(crate) fn request(&self) -> &[u8] {
        &self.buf[self.request.0..self.request.1]
    }

    /// Where the reply to the current request may be written in place: the out-header and the
    /// payload buffer, if the request has no payload of its own (it ends at `PREFIX`).
    pub(crate) fn reply_area(&mut self) -> Option<ReplyArea> {
        (self.request.1 <= PREFIX).then(|| ReplyArea {
            header: self.header.in_out.as_mut_ptr(),
            // SAFETY: inside `buf`, which is never reallocated.
            payload: unsafe { self.buf.as_mut_ptr().add(PREFIX) },
            cap: self.buf.len() - PREFIX,
        })
    }

    /// The reply was written in place (`ReplyArea`), with `payload` bytes.
    pub(crate) fn set_reply_in_place(&mut self, payload: usize) {
        self.header.ent.payload_sz = payload as u32;
    }

    /// Puts a reply (`fuse_out_header` and arguments, as written to /dev/fuse) into the
    /// entry's buffers. A reply larger than the payload buffer becomes EIO.
    pub(crate) fn set_reply(&mut self, reply: &[u8]) {
        let payload = reply.len().saturating_sub(FUSE_OUT_HEADER_SZ);
        if reply.len() < FUSE_OUT_HEADER_SZ || PREFIX + payload > self.buf.len() {
            let unique = self.header.ent.commit_id;
            let mut h = [0u8; FUSE_OUT_HEADER_SZ];
            h[0..4].copy_from_slice(&(FUSE_OUT_HEADER_SZ as u32).to_ne_bytes());
            h[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            h[8..16].copy_from_slice(&unique.to_ne_bytes());
            self.header.in_out[..FUSE_OUT_HEADER_SZ].copy_from_slice(&h);
            self.header.ent.payload_sz = 0;
            return;
        }
        self.header.in_out[..FUSE_OUT_HEADER_SZ].copy_from_slice(&reply[..FUSE_OUT_HEADER_SZ]);
        self.buf[PREFIX..PREFIX + payload].copy_from_slice(&reply[FUSE_OUT_HEADER_SZ..]);
        self.header.ent.payload_sz = payload as u32;
    }

    /// Answers request `commit` without waiting for another (the session is ending).
    pub(crate) fn commit_only(&mut self, commit: u64) -> io::Result<()> {
        let sqe = self.command(CMD_COMMIT_AND_FETCH, commit);
        self.ring.submit(&sqe, false).map(|_| ())
    }

    pub(crate) fn qid(&self) -> u16 {
        self.qid
    }
}

/// Where a request's reply goes when it came over io_uring: written in place into the entry's
/// buffers when the worker armed the slot with a `ReplyArea`, else kept here until the worker
/// copies it in (`RingEntry::set_reply`); either way the worker commits it. A reply may be
/// sent from another thread; the worker waits for it.
#[derive(Debug, Default)]
pub(crate) struct ReplySlot {
    reply: Mutex<SlotState>,
    sent: Condvar,
}

#[derive(Debug, Default)]
struct SlotState {
    sent: bool,
    /// The worker waits for a reply sent from another thread: wake it (only then, a wake-up
    /// is a futex call).
    waiting: bool,
    /// Where the reply to the request being served may be written in place.
    area: Option<ReplyArea>,
    /// The reply went in place, with this many payload bytes.
    in_place: Option<usize>,
    bytes: Vec<u8>,
}

/// An entry's out-header and payload buffer, handed to the reply of a request that has no
/// payload of its own (`RingEntry::reply_area`): nothing the handler still reads lies there,
/// and the worker does not touch the entry until the reply is sent. Saves a copy of every
/// reply's payload (a READ's data).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReplyArea {
    header: *mut u8,
    payload: *mut u8,
    cap: usize,
}

// SAFETY: the area is written by whichever thread sends the reply, under the slot's lock,
// while the owning worker waits for it (`ReplySlot::take`).
unsafe impl Send for ReplyArea {}

/// What `ReplySlot::take` hands the worker.
pub(crate) enum Taken<'a> {
    /// The reply, to copy into the entry.
    Bytes(&'a [u8]),
    /// The reply is in the entry already, with this many payload bytes.
    InPlace(usize),
}

impl ReplySlot {
    /// Before a request is served: where its reply may be written in place (`None`: here).
    pub(crate) fn arm(&self, area: Option<ReplyArea>) {
        self.reply.lock().unwrap_or_else(|e| e.into_inner()).area = area;
    }

    pub(crate) fn send(&self, data: &[io::IoSlice<'_>]) -> io::Result<()> {
        self.put(data, false)
    }

    /// `send` for parts the daemon must not touch (`ReplySender::send_mapped`): the kernel
    /// copies them into the reply with `process_vm_readv` on this process, so a part it cannot
    /// read fails the copy with EFAULT instead of raising SIGBUS. Nothing is sent then.
    pub(crate) fn send_copied_by_kernel(&self, data: &[io::IoSlice<'_>]) -> io::Result<()> {
        self.put(data, true)
    }

    fn put(&self, data: &[io::IoSlice<'_>], by_kernel: bool) -> io::Result<()> {
        let mut r = self.reply.lock().unwrap_or_else(|e| e.into_inner());
        if r.sent {
            return Err(io::Error::other("a second reply to one io_uring request"));
        }
        let total: usize = data.iter().map(|d| d.len()).sum();
        let in_place = r.area.filter(|a| {
            data.first().is_some_and(|h| h.len() == FUSE_OUT_HEADER_SZ)
                && total - FUSE_OUT_HEADER_SZ <= a.cap
        });
        match in_place {
            Some(a) => {
                let payload = total - FUSE_OUT_HEADER_SZ;
                let dst = [
                    libc::iovec { iov_base: a.header.cast(), iov_len: FUSE_OUT_HEADER_SZ },
                    libc::iovec { iov_base: a.payload.cast(), iov_len: payload },
                ];
                copy_into(&dst, data, by_kernel)?;
                r.in_place = Some(payload);
            }
            None => {
                r.bytes.clear();
                r.bytes.reserve(total);
                let dst = [libc::iovec {
                    iov_base: r.bytes.spare_capacity_mut().as_mut_ptr().cast(),
                    iov_len: total,
                }];
                copy_into(&dst, data, by_kernel)?;
                // SAFETY: `copy_into` wrote all `total` bytes.
                unsafe { r.bytes.set_len(total) };
            }
        }
        r.sent = true;
        if r.waiting {
            self.sent.notify_all();
        }
        Ok(())
    }

    /// Waits for the reply, hands it to `f`, and makes the slot ready for the next request.
    pub(crate) fn take(&self, f: impl FnOnce(Taken<'_>)) {
        let mut r = self.reply.lock().unwrap_or_else(|e| e.into_inner());
        while !r.sent {
            r.waiting = true;
            r = self.sent.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        match r.in_place.take() {
            Some(n) => f(Taken::InPlace(n)),
            None => f(Taken::Bytes(&r.bytes)),
        }
        r.sent = false;
        r.waiting = false;
        r.area = None;
        if r.bytes.capacity() > 1 << 20 {
            r.bytes = Vec::new();
        }
    }
}

/// Copies the bytes of `src` into `dst`, which holds exactly as many: with `memcpy`, or, if
/// `by_kernel`, with `process_vm_readv` on this process (EFAULT where a part of `src` cannot be
/// read, nothing of it ever touched by the daemon).
fn copy_into(dst: &[libc::iovec], src: &[io::IoSlice<'_>], by_kernel: bool) -> io::Result<()> {
    let total: usize = src.iter().map(|d| d.len()).sum();
    if by_kernel {
        if src.len() > 1024 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: `dst` is writable memory of `total` bytes; the kernel reads `src` (an
        // `IoSlice` is an `iovec`), in this process.
        let n = unsafe {
            libc::process_vm_readv(
                libc::getpid(),
                dst.as_ptr(),
                dst.len() as libc::c_ulong,
                src.as_ptr().cast(),
                src.len() as libc::c_ulong,
                0,
            )
        };
        return match n {
            n if n < 0 => Err(io::Error::last_os_error()),
            n if n as usize != total => Err(io::Error::from_raw_os_error(libc::EFAULT)),
            _ => Ok(()),
        };
    }
    let mut out = dst.iter().map(|d| (d.iov_base.cast::<u8>(), d.iov_len));
    let (mut at, mut room) = out.next().unwrap_or((std::ptr::null_mut(), 0));
    for part in src {
        let mut part: &[u8] = part;
        while !part.is_empty() {
            while room == 0 {
                (at, room) = out.next().expect("dst holds as many bytes as src");
            }
            let n = room.min(part.len());
            // SAFETY: `at` has `room` writable bytes, which never overlap `src`.
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), at, n) };
            // SAFETY: still within the same `dst` iovec.
            at = unsafe { at.add(n) };
            room -= n;
            part = &part[n..];
        }
    }
    Ok(())
}
