//! mosaicfs patch: reading requests through a pipe, so that a daemon killed while the kernel
//! hands it a request leaves that request to the next daemon.
//!
//! A read(2) of /dev/fuse copies the request into the reader's buffer, faulting its pages in
//! one at a time; a page fault taken while SIGKILL is pending gives up, and the kernel ends the
//! request with EIO (fs/fuse/dev.c `fuse_dev_do_read`, mm/gup.c). A splice(2) into a pipe
//! fills kernel pages instead, and the request is in the connection's processing queue before
//! any page of the daemon is touched: a daemon killed after that leaves it there, and
//! FUSE_NOTIFY_RESEND gives it to the next one. The worker then reads the pipe into its
//! buffer.
//!
//! The pipe must hold the biggest request in its slots: the kernel needs one slot for the
//! header and one per page (or piece of a page) of data, and ends a request that finds no
//! free slot with EIO (`fuse_copy_fill`). Hence `largest_write`.

use std::os::fd::AsRawFd;
use std::os::fd::OwnedFd;

use nix::errno::Errno;

const PAGE: usize = 4096;

/// The biggest SETXATTR request's payload: a 64 KiB value, its name and the header.
const LARGEST_XATTR: usize = 64 * 1024 + 256 + 64;

/// Slots a request of `max_write` bytes of data may take: the header's page, the data's pages
/// (one more where it does not start on a page boundary).
fn slots_for(max_write: usize) -> usize {
    let data = max_write.max(LARGEST_XATTR);
    1 + data.div_ceil(PAGE) + 1
}

/// The biggest `max_write` a pipe of the system's largest unprivileged size holds a WRITE of
/// (`/proc/sys/fs/pipe-max-size`, 1 MiB by default: 1,016 KiB). Pipes have a power of two
/// of slots.
pub fn largest_write() -> u32 {
    let max = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(1 << 20);
    let slots: usize = match max / PAGE {
        0 => 1,
        n => 1 << n.ilog2(),
    };
    (slots.saturating_sub(2) * PAGE).max(PAGE) as u32
}

/// How this process's workers have read requests: `UNASKED` until one has tried a pipe,
/// `PIPED` while every one that tried has its pipe, `NOT_ALL` once one could not make it.
static READ_BY: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(UNASKED);
const UNASKED: u8 = 0;
const PIPED: u8 = 1;
const NOT_ALL: u8 = 2;

/// Whether workers read requests through pipes: `None` where none was asked to, `Some(false)`
/// once one could not make its pipe (it reads /dev/fuse).
pub fn requests_piped() -> Option<bool> {
    match READ_BY.load(std::sync::atomic::Ordering::Relaxed) {
        UNASKED => None,
        read_by => Some(read_by == PIPED),
    }
}

/// Workers read /dev/fuse although asked to read through pipes (the connection's `max_write` is
/// not known).
pub(crate) fn cannot_pipe() {
    READ_BY.store(NOT_ALL, std::sync::atomic::Ordering::Relaxed);
}

/// A worker's pipe.
#[derive(Debug)]
pub(crate) struct RequestPipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Bytes one splice may move: the pipe's size.
    len: usize,
}

impl RequestPipe {
    /// A pipe that holds any request of a connection whose WRITEs carry up to `max_write`
    /// bytes; an error when the system allows no pipe that big to this process (past
    /// `pipe-max-size`, or past the user's share of pipe pages, `pipe-user-pages-soft`).
    pub(crate) fn new(max_write: u32) -> std::io::Result<RequestPipe> {
        use std::sync::atomic::Ordering::Relaxed;
        let made = Self::make(max_write);
        match made {
            Ok(_) => {
                let _ = READ_BY.compare_exchange(UNASKED, PIPED, Relaxed, Relaxed);
            }
            Err(_) => READ_BY.store(NOT_ALL, Relaxed),
        }
        made
    }

    fn make(max_write: u32) -> std::io::Result<RequestPipe> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let want = slots_for(max_write as usize) * PAGE;
        // SAFETY: F_SETPIPE_SZ on a pipe this function owns; it returns the size set.
        let len = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, want as libc::c_int) };
        if len < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(RequestPipe {
            read,
            write,
            len: len as usize,
        })
    }

    /// Takes one request from `device` into the pipe and reads it into `buffer`. Blocks like a
    /// read of the device, and fails as one (EINTR when interrupted: nothing was taken).
    pub(crate) fn receive(&self, device: &impl AsRawFd, buffer: &mut [u8]) -> nix::Result<usize> {
        // SAFETY: splice between descriptors this worker holds open, without offsets.
        let n = unsafe {
            libc::splice(
                device.as_raw_fd(),
                std::ptr::null_mut(),
                self.write.as_raw_fd(),
                std::ptr::null_mut(),
                self.len.min(buffer.len()),
                0,
            )
        };
        if n < 0 {
            return Err(Errno::last());
        }
        // The request is this worker's now (in the kernel's processing queue if it wants an
        // answer): it is read whole, whatever interrupts, so that the pipe is empty for the
        // next one.
        let n = n as usize;
        let mut got = 0;
        while got < n {
            match nix::unistd::read(&self.read, &mut buffer[got..n]) {
                Ok(0) => return Err(Errno::EPIPE),
                Ok(k) => got += k,
                Err(Errno::EINTR | Errno::EAGAIN) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }
}
