//! fanotify pre-content events (file/partial/precontent.rs): a marked file's reads and writes
//! wait until the daemon has filled the range they touch.

use super::*;

/// `FAN_PRE_ACCESS` (Linux 6.14): every read or write of a marked file's range waits for the
/// listener's answer. Not in libc's constants yet.
const FAN_PRE_ACCESS: u64 = 0x0010_0000;
/// The event's range record (`FAN_EVENT_INFO_TYPE_RANGE`).
const FAN_EVENT_INFO_TYPE_RANGE: u8 = 6;

/// One pre-content event: the accessed file, opened by the kernel for the listener (a
/// descriptor whose own reads and writes raise no event), the process that waits, and the
/// range it touches.
pub struct AccessEvent {
    pub fd: OwnedFd,
    pub pid: i32,
    pub range: Option<(u64, u64)>,
}

/// A fanotify group of the pre-content class, its event descriptors opened read-write.
pub fn pre_content_group(cloexec: bool) -> Result<OwnedFd> {
    let flags = libc::FAN_CLASS_PRE_CONTENT
        | libc::FAN_UNLIMITED_QUEUE
        | if cloexec { libc::FAN_CLOEXEC } else { 0 };
    let event_flags = (libc::O_RDWR | libc::O_LARGEFILE | libc::O_CLOEXEC) as u32;
    // SAFETY: plain system call; the descriptor it returns is owned below.
    let fd = unsafe { libc::fanotify_init(flags, event_flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `fd` was just returned by fanotify_init and is owned by nobody else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Adds (or removes) a pre-access mark on the inode of the open file `file`.
pub fn mark_pre_access(group: BorrowedFd<'_>, file: BorrowedFd<'_>, add: bool) -> Result<()> {
    let how = if add {
        libc::FAN_MARK_ADD
    } else {
        libc::FAN_MARK_REMOVE
    };
    // SAFETY: a null path marks the object `file` refers to; both descriptors are borrowed
    // for the call.
    let r = unsafe {
        libc::fanotify_mark(
            group.as_raw_fd(),
            how,
            FAN_PRE_ACCESS,
            file.as_raw_fd(),
            std::ptr::null(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

/// Reads the events waiting on `group` (blocks until there is one), into `buf`'s capacity.
pub fn read_access_events(group: BorrowedFd<'_>, buf: &mut Vec<u8>) -> Result<Vec<AccessEvent>> {
    buf.resize(64 * 1024, 0);
    let n = loop {
        match rustix::io::read(group, &mut buf[..]) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let meta_len = std::mem::size_of::<libc::fanotify_event_metadata>();
    let mut events = Vec::new();
    let mut at = 0;
    while at + meta_len <= n {
        // SAFETY: the kernel wrote whole records; `read_unaligned` copes with any alignment.
        let m: libc::fanotify_event_metadata =
            unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
        let len = m.event_len as usize;
        if len < meta_len || at + len > n {
            break;
        }
        let mut range = None;
        let mut info = at + m.metadata_len as usize;
        while info + 4 <= at + len {
            let kind = buf[info];
            let info_len = u16::from_ne_bytes([buf[info + 2], buf[info + 3]]) as usize;
            if info_len == 0 {
                break;
            }
            if kind == FAN_EVENT_INFO_TYPE_RANGE && info + 24 <= at + len {
                let word = |o: usize| {
                    u64::from_ne_bytes(buf[info + o..info + o + 8].try_into().unwrap_or([0; 8]))
                };
                range = Some((word(8), word(16)));
            }
            info += info_len;
        }
        if m.fd >= 0 {
            events.push(AccessEvent {
                // SAFETY: the kernel installed this descriptor for us with the event.
                fd: unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(m.fd) },
                pid: m.pid,
                range,
            });
        }
        at += len;
    }
    Ok(events)
}

/// A read-write descriptor of the file `file` is of, whose own reads and writes raise no
/// fanotify event, whatever marks its inode carries: the kind the kernel opens a fanotify
/// event's file with, for the listener. Had through a notification group of its own, told of
/// one open of the file. A daemon that takes a mount over reaches so the upper files its
/// predecessor marked: a descriptor opened after the mark would raise events on the daemon's
/// own fills, which it answers only once its reader runs.
pub fn open_unwatched(file: BorrowedFd<'_>) -> Result<OwnedFd> {
    let flags = libc::FAN_CLASS_NOTIF | libc::FAN_CLOEXEC | libc::FAN_NONBLOCK;
    let event_flags = (libc::O_RDWR | libc::O_LARGEFILE | libc::O_CLOEXEC) as u32;
    // SAFETY: plain system call; the descriptor it returns is owned below.
    let fd = unsafe { libc::fanotify_init(flags, event_flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `fd` was just returned by fanotify_init and is owned by nobody else.
    let group = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: a null path marks the object `file` refers to; both descriptors are borrowed.
    let r = unsafe {
        libc::fanotify_mark(
            group.as_raw_fd(),
            libc::FAN_MARK_ADD,
            libc::FAN_OPEN,
            file.as_raw_fd(),
            std::ptr::null(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    drop(reopen(file, OFlags::RDONLY | OFlags::CLOEXEC)?);
    let mut buf = Vec::new();
    read_access_events(group.as_fd(), &mut buf)?
        .into_iter()
        .next()
        .map(|ev| ev.fd)
        .ok_or_else(|| {
            crate::error::Error::with_context(
                libc::EIO,
                "no fanotify event for an open of the file",
            )
        })
}

/// Answers the event whose descriptor number is `fd`: allowed, or refused with `errno` (which
/// the waiting caller's read or write returns).
pub fn answer_access(group: BorrowedFd<'_>, fd: i32, deny_with: Option<i32>) -> Result<()> {
    let response = match deny_with {
        None => libc::FAN_ALLOW,
        // FAN_DENY_ERRNO (Linux 6.14): the errno rides in the top byte.
        Some(e) => libc::FAN_DENY | ((e as u32 & 0xff) << 24),
    };
    let r = libc::fanotify_response { fd, response };
    // SAFETY: `r` is a plain struct of the size the kernel reads.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&r as *const libc::fanotify_response).cast::<u8>(),
            std::mem::size_of::<libc::fanotify_response>(),
        )
    };
    rustix::io::write(group, bytes)?;
    Ok(())
}

/// Whether `[off, off + len)` of `fd` holds a hole before end of file.
pub fn has_hole(fd: BorrowedFd<'_>, off: u64, len: u64) -> Result<bool> {
    let hole = match rustix::fs::seek(fd, rustix::fs::SeekFrom::Hole(off)) {
        Ok(h) => h,
        Err(rustix::io::Errno::NXIO) => return Ok(false), // at or past the end
        Err(e) => return Err(e.into()),
    };
    if hole >= off.saturating_add(len) {
        return Ok(false);
    }
    // SEEK_HOLE reports the end of file as a hole.
    Ok(hole < fstat(fd)?.size)
}
