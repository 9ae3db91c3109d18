//! Where the log goes. In the foreground (`-f`, `-d`, the offline commands): standard error.
//! A daemon in the background has its standard streams on /dev/null, so from the moment it
//! detaches it logs to the file `log_file=` names, or else to the system log through /dev/log
//! (what syslog(3) does: one datagram per line, facility daemon), or nowhere when neither is
//! there. The level is `MOSAICFS_LOG` (`debug`, `info`, `warn`), debug with `-d`, else warn.
//! At debug the transport's lines (fuser's: one for every request) are logged too.

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use crate::error::Result;

const SYSLOG_SOCKET: &str = "/dev/log";
/// syslog's facility "daemon" (3), shifted as the priority field wants it.
const FACILITY_DAEMON: u8 = 3 << 3;

enum Sink {
    Stderr,
    Syslog(UnixDatagram),
    File(std::fs::File),
    Nowhere,
}

struct DaemonLogger {
    level: log::LevelFilter,
    sink: Mutex<Sink>,
}

static LOGGER: OnceLock<DaemonLogger> = OnceLock::new();

/// Logs to standard error at the level `MOSAICFS_LOG` or `debug` asks for.
pub fn init(debug: bool) {
    let level = match std::env::var("MOSAICFS_LOG").ok().as_deref() {
        Some("debug") => log::LevelFilter::Debug,
        Some("info") => log::LevelFilter::Info,
        Some("warn") => log::LevelFilter::Warn,
        _ if debug => log::LevelFilter::Debug,
        _ => log::LevelFilter::Warn,
    };
    let logger = LOGGER.get_or_init(|| DaemonLogger {
        level,
        sink: Mutex::new(Sink::Stderr),
    });
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
}

/// Opens the file of `log_file=` for appending: done before the daemon detaches, so that a
/// path it cannot write fails the mount with a message instead of losing the log.
pub fn open_log_file(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| {
            crate::message!(
                "log_file='{}': cannot open it for appending ({e}): name a file the daemon may write",
                path.display()
            )
        })
}

/// The daemon is detaching from its standard streams: log to `file`, or the system log.
pub fn to_background(file: Option<std::fs::File>) {
    let Some(logger) = LOGGER.get() else { return };
    let sink = match file {
        Some(f) => Sink::File(f),
        None => match syslog_socket() {
            Some(s) => Sink::Syslog(s),
            None => Sink::Nowhere,
        },
    };
    *logger.sink.lock().unwrap_or_else(|e| e.into_inner()) = sink;
}

/// Non-blocking: a system logger that stops reading must not stall the requests that log (a
/// line that finds its queue full is dropped).
fn syslog_socket() -> Option<UnixDatagram> {
    let s = UnixDatagram::unbound().ok()?;
    s.connect(SYSLOG_SOCKET).ok()?;
    s.set_nonblocking(true).ok()?;
    Some(s)
}

/// syslog's severity for a level.
fn severity(level: log::Level) -> u8 {
    match level {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

impl log::Log for DaemonLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= self.level
    }

    fn log(&self, r: &log::Record<'_>) {
        // The transport's own lines (fuser's) at debug only: its line for every request is what
        // `-d` promises; its warnings are about things the daemon reports itself (an unmount
        // already done by the user comes back as "Failed to umount filesystem").
        let ours = r.target().starts_with("mosaicfs")
            || (self.level >= log::LevelFilter::Debug && r.target().starts_with("fuser"));
        if !self.enabled(r.metadata()) || !ours {
            return;
        }
        let level = r.level().as_str().to_lowercase();
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *sink {
            // Not eprintln!, which panics when nobody reads standard error any more.
            Sink::Stderr => {
                let _ = writeln!(std::io::stderr(), "mosaicfs: {level}: {}", r.args());
            }
            Sink::File(f) => {
                let _ = writeln!(
                    f,
                    "{} mosaicfs[{}]: {level}: {}",
                    utc_now(),
                    std::process::id(),
                    r.args()
                );
            }
            Sink::Syslog(s) => {
                let line = format!(
                    "<{}>mosaicfs[{}]: {level}: {}",
                    FACILITY_DAEMON | severity(r.level()),
                    std::process::id(),
                    r.args()
                );
                match s.send(line.as_bytes()) {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    // The system logger restarted: one new connection, then give up on this line.
                    Err(_) => {
                        if let Some(again) = syslog_socket() {
                            let _ = again.send(line.as_bytes());
                            *s = again;
                        }
                    }
                }
            }
            Sink::Nowhere => {}
        }
    }

    fn flush(&self) {}
}

/// The time now as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_timestamps_are_formatted() {
        let t = super::utc_now();
        assert_eq!(t.len(), 20, "{t}");
        assert!(
            t.starts_with("20") && t.ends_with('Z') && &t[10..11] == "T",
            "{t}"
        );
    }
}
