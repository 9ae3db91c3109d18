use crate::session::MAX_WRITE_SIZE;

/// Size of the buffer for reading a request from the kernel. Since the kernel may send
/// up to `MAX_WRITE_SIZE` bytes in a write request, we use that value plus some extra space.
const BUFFER_SIZE: usize = MAX_WRITE_SIZE + 4096;

/// A buffer for one request from the kernel, page-aligned (so aligned for
/// `fuse_in_header`).
///
/// mosaicfs patch: the buffer is an anonymous mapping of its own rather than a zeroed
/// `Vec`. A worker's 16 MiB buffer in the allocator's heap was cleared page by page whenever
/// it reused freed heap memory (calloc), and grew the heap past the arenas' 64 MiB regions:
/// resident memory that only WRITEs of that size need. A mapping's pages stay untouched, and
/// so not resident, until a request fills them.
#[derive(Debug)]
pub(crate) struct FuseReadBuf {
    ptr: std::ptr::NonNull<u8>,
}

// SAFETY: the mapping is owned by this value alone, like a `Vec`'s memory.
unsafe impl Send for FuseReadBuf {}

impl FuseReadBuf {
    /// Creates a new `FuseReadBuf` of `BUFFER_SIZE` bytes.
    pub(crate) fn new() -> Self {
        // SAFETY: a fresh private anonymous mapping, unmapped in `drop`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BUFFER_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(
            ptr != libc::MAP_FAILED,
            "cannot map a FUSE request buffer: {}",
            std::io::Error::last_os_error()
        );
        Self {
            ptr: std::ptr::NonNull::new(ptr.cast()).expect("mmap gave a null pointer"),
        }
    }

    /// The whole buffer (zeroed by the kernel where never written).
    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is BUFFER_SIZE bytes, readable and writable, and borrowed
        // mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), BUFFER_SIZE) }
    }
}

impl Drop for FuseReadBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer borrowed.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), BUFFER_SIZE);
        }
    }
}
