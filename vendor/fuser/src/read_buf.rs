use log::warn;
use crate::session::MAX_WRITE_SIZE;

/// Size of the buffer for reading a request from the kernel. Since the kernel may send
/// up to `MAX_WRITE_SIZE` bytes in a write request, we use that value plus some extra space.
const BUFFER_SIZE: usize = MAX_WRITE_SIZE + 4096;

/// The start of a request buffer that stays resident: the page every request's header lands
/// in (`FuseReadBuf::new`, `served`).
const KEEP: usize = 4096;

/// A buffer for one request from the kernel, page-aligned (so aligned for
/// `fuse_in_header`).
#[derive(Debug)]
pub(crate) struct FuseReadBuf {
    buffer: MappedBuf,
    /// The most bytes a request other than a batch of FORGETs filled (at least `KEEP`): what
    /// `served` keeps resident.
    served: usize,
}

impl FuseReadBuf {
    /// Creates a new `FuseReadBuf` of `BUFFER_SIZE` bytes, its first page resident.
    ///
    /// mosaicfs patch: the kernel copies a request into the pages of the reader's buffer, and
    /// when one is not resident it faults it in on a path that gives up if the reader has been
    /// sent SIGKILL — and then ends the request with EIO instead of leaving it for the next
    /// daemon to be sent again (fs/fuse/dev.c `fuse_dev_do_read`, mm/gup.c). A daemon killed
    /// while a fresh worker read its first request failed that request (the fsx model across a
    /// hundred kills saw EIO from a listing, a rename and a stat). Every request but a big
    /// WRITE or SETXATTR fits in the first page, which is kept resident from here on
    /// (`served` keeps it too).
    pub(crate) fn new() -> Self {
        let mut buffer = MappedBuf::new(BUFFER_SIZE);
        buffer.make_resident(KEEP);
        if let Some(ms) = std::env::var("MOSAICFS_TEST_HOLD_FAULT")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            hold_first_fault(&buffer, KEEP, std::time::Duration::from_millis(ms));
        }
        Self {
            buffer,
            served: KEEP,
        }
    }

    /// The whole buffer.
    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buffer
    }

    /// mosaicfs patch: a request of `used` bytes was served; `forgets` when it was a batch of
    /// FORGETs. The kernel fills a read with as many FORGETs as the buffer holds: after
    /// `drop_caches` a batch of 37,000 (600 KiB) left that much of each worker's buffer
    /// resident for the session's life, 2.4 MiB over four workers. What such a batch filled
    /// beyond the most any other request of this worker filled is given back; what the
    /// worker's own WRITEs and SETXATTRs filled stays, so that the next one lands in resident
    /// pages: one given back and faulted in again while the daemon is killed ends that
    /// request with EIO instead of leaving it to the next daemon (`new`). Only a request
    /// bigger than every one the worker served before still faults its pages in.
    pub(crate) fn served(&mut self, used: usize, forgets: bool) {
        if !forgets {
            self.served = self.served.max(used);
        } else if used > self.served {
            self.buffer.discard(self.served, used - self.served);
        }
    }
}

/// mosaicfs patch, for the tests (`MOSAICFS_TEST_HOLD_FAULT`, milliseconds): the first fault on
/// `buffer` past `from` is held `hold` (userfaultfd), and "holding a fault of a request buffer"
/// logged meanwhile: how tests/restart.rs kills a daemon while the kernel copies a request into
/// a worker's buffer, or the worker copies one there from its pipe. Needs CAP_SYS_PTRACE
/// (faults taken by the kernel).
fn hold_first_fault(buffer: &MappedBuf, from: usize, hold: std::time::Duration) {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // linux/userfaultfd.h
    const UFFD_API: u64 = 0xaa;
    const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
    const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
    const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;
    const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
    const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
    let range = [buffer.ptr.as_ptr() as u64 + from as u64, (buffer.len - from) as u64];
    // SAFETY: userfaultfd(2) makes a descriptor, owned from here on.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if fd < 0 {
        warn!(target: "mosaicfs::transport", "MOSAICFS_TEST_HOLD_FAULT: no userfaultfd: {}", std::io::Error::last_os_error());
        return;
    }
    // SAFETY: the descriptor just made.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = [UFFD_API, 0, 0];
    let mut register = [range[0], range[1], UFFDIO_REGISTER_MODE_MISSING, 0];
    // SAFETY: the ioctls' argument structures, as linux/userfaultfd.h lays them out, over a
    // range of the buffer's own mapping.
    let registered = unsafe {
        libc::ioctl(fd.as_raw_fd(), UFFDIO_API, api.as_mut_ptr()) == 0
            && libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER, register.as_mut_ptr()) == 0
    };
    if !registered {
        warn!(target: "mosaicfs::transport", "MOSAICFS_TEST_HOLD_FAULT: {}", std::io::Error::last_os_error());
        return;
    }
    std::thread::spawn(move || {
        let mut message = [0u8; 32];
        loop {
            match nix::unistd::read(&fd, &mut message) {
                Ok(32) if message[0] == UFFD_EVENT_PAGEFAULT => break,
                Err(nix::errno::Errno::EINTR) | Ok(_) => continue,
                Err(_) => return,
            }
        }
        warn!(target: "mosaicfs::transport", "holding a fault of a request buffer for {hold:?}");
        std::thread::sleep(hold);
        let mut range = range;
        // SAFETY: as above; unregistering wakes the held fault, which then maps a zero page.
        unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_UNREGISTER, range.as_mut_ptr()) };
    });
}

/// mosaicfs patch: a zeroed buffer in an anonymous mapping of its own, for the buffers a
/// worker keeps for the session's life (its request buffer, an io_uring entry's payload). As a
/// zeroed `Vec` such a buffer was `calloc`ed, which clears whatever part of a chunk it carves
/// from freed heap memory: a 16 MiB request buffer made resident that way, and the buffers
/// grew the allocator's arenas past their 64 MiB regions. A mapping's pages stay untouched,
/// and so not resident, until a request fills them.
#[derive(Debug)]
pub(crate) struct MappedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone, like a `Vec`'s memory.
unsafe impl Send for MappedBuf {}
// SAFETY: shared references only read it, like a `Vec`'s.
unsafe impl Sync for MappedBuf {}

impl MappedBuf {
    /// `len` zeroed bytes (at least one page is mapped).
    pub(crate) fn new(len: usize) -> Self {
        // SAFETY: a fresh private anonymous mapping, unmapped in `drop`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(
            ptr != libc::MAP_FAILED,
            "cannot map a FUSE buffer of {len} bytes: {}",
            std::io::Error::last_os_error()
        );
        Self {
            ptr: std::ptr::NonNull::new(ptr.cast()).expect("mmap gave a null pointer"),
            len,
        }
    }
}

impl MappedBuf {
    /// Writes to every page of the first `len` bytes, so that they are resident and writable.
    pub(crate) fn make_resident(&mut self, len: usize) {
        let len = len.min(self.len);
        for at in (0..len).step_by(4096) {
            // SAFETY: inside the mapping, borrowed mutably through `self`; a volatile write of
            // the zero already there, so that it is not optimised away.
            unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(at), 0) };
        }
    }

    /// Drops the pages of `len` bytes from `from` (page-aligned) from memory: they read as
    /// zeros until written again.
    pub(crate) fn discard(&mut self, from: usize, len: usize) {
        let page = 4096;
        let end = (from + len).min(self.len).next_multiple_of(page).min(self.len);
        let start = from.next_multiple_of(page);
        if start < end {
            // SAFETY: a range inside the mapping, borrowed mutably through `self`; the pages
            // read as zeros after MADV_DONTNEED, as they did when mapped.
            unsafe {
                libc::madvise(
                    self.ptr.as_ptr().add(start).cast(),
                    end - start,
                    libc::MADV_DONTNEED,
                );
            }
        }
    }
}

impl std::ops::Deref for MappedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes, alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for MappedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` writable bytes, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for MappedBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer borrowed.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len.max(1));
        }
    }
}

