//! Fault injection: every change mosaicfs makes to the upper layer passes one check here
//! (`check`, at the top of each changing call of the upper seam, upper.rs), so a test can make
//! any step of a copy-up, rename or write fail and see what the mount shows afterwards, on the
//! disk store and the memory store alike.
//!
//! `MOSAICFS_FAULT=OP:N[+][:ERRNO][,OP:N...]` in the daemon's environment fails the N-th call of
//! OP (counted from the first FUSE request; mount-time probes do not count) with ERRNO — EIO
//! unless one of EIO, ENOSPC, EDQUOT, EPERM, EROFS is given — and, with `+`, every later one.
//! OP: mkdir, mknod, symlink, link, unlink, rename, create, setxattr, removexattr, chown,
//! chmod, utimens, truncate, fallocate, write (pwrite and FICLONE), fsync (and fdatasync).
//! Without the variable, `check` is two loads of values set once. A test that drives the core
//! in-process sets and clears its rules with `set` and `clear`.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Result, errno};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Mkdir,
    Mknod,
    Symlink,
    Link,
    Unlink,
    Rename,
    /// A rename that leaves a whiteout at the old name (RENAME_WHITEOUT): its own operation,
    /// so that a test can refuse it (EINVAL) as a file system without it does.
    RenameWhiteout,
    Create,
    SetXattr,
    RemoveXattr,
    Chown,
    Chmod,
    Utimens,
    Truncate,
    Fallocate,
    Write,
    Fsync,
}

const OPS: [(&str, Op); 17] = [
    ("mkdir", Op::Mkdir),
    ("mknod", Op::Mknod),
    ("symlink", Op::Symlink),
    ("link", Op::Link),
    ("unlink", Op::Unlink),
    ("rename", Op::Rename),
    ("rename_whiteout", Op::RenameWhiteout),
    ("create", Op::Create),
    ("setxattr", Op::SetXattr),
    ("removexattr", Op::RemoveXattr),
    ("chown", Op::Chown),
    ("chmod", Op::Chmod),
    ("utimens", Op::Utimens),
    ("truncate", Op::Truncate),
    ("fallocate", Op::Fallocate),
    ("write", Op::Write),
    ("fsync", Op::Fsync),
];

/// The names of the operations a rule may fail, as MOSAICFS_FAULT writes them (for sweeps).
pub fn op_names() -> impl Iterator<Item = &'static str> {
    OPS.iter().map(|(name, _)| *name)
}

const ERRNOS: [(&str, i32); 6] = [
    ("EIO", libc::EIO),
    ("EINVAL", libc::EINVAL),
    ("ENOSPC", libc::ENOSPC),
    ("EDQUOT", libc::EDQUOT),
    ("EPERM", libc::EPERM),
    ("EROFS", libc::EROFS),
];

struct Rule {
    op: Op,
    n: u64,
    onward: bool,
    errno: i32,
    calls: AtomicU64,
}

static RULES: OnceLock<Vec<Rule>> = OnceLock::new();
/// Calls count once the mount serves requests.
static ARMED: AtomicBool = AtomicBool::new(false);

/// Reads `MOSAICFS_FAULT`; an error names what is wrong with it.
pub fn init() -> Result<()> {
    let Ok(spec) = std::env::var("MOSAICFS_FAULT") else {
        return Ok(());
    };
    let rules = parse(&spec)?;
    log::warn!("fault injection on: MOSAICFS_FAULT={spec}");
    let _ = RULES.set(rules);
    Ok(())
}

/// From now on, calls count (the mount is up).
pub fn arm() {
    ARMED.store(true, Ordering::Relaxed);
}

fn parse(spec: &str) -> Result<Vec<Rule>> {
    let bad = |part: &str, why: &str| {
        crate::message!("MOSAICFS_FAULT: '{part}' {why}: write OP:N[+][:ERRNO], e.g. rename:2:EIO")
    };
    let mut rules = Vec::new();
    for part in spec.split(',').filter(|p| !p.is_empty()) {
        let mut fields = part.split(':');
        let name = fields.next().unwrap_or_default();
        let op = OPS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, op)| *op)
            .ok_or_else(|| bad(part, "names no operation"))?;
        let count = fields.next().ok_or_else(|| bad(part, "has no count"))?;
        let (count, onward) = match count.strip_suffix('+') {
            Some(c) => (c, true),
            None => (count, false),
        };
        let n: u64 = count
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| bad(part, "needs a count from 1"))?;
        let errno = match fields.next() {
            None => libc::EIO,
            Some(e) => ERRNOS
                .iter()
                .find(|(name, _)| *name == e)
                .map(|(_, v)| *v)
                .ok_or_else(|| bad(part, "names an errno not offered"))?,
        };
        if fields.next().is_some() {
            return Err(bad(part, "has too many fields"));
        }
        rules.push(Rule {
            op,
            n,
            onward,
            errno,
            calls: AtomicU64::new(0),
        });
    }
    Ok(rules)
}

/// Rules set in-process by a test that drives the overlay core without a mount (`set`).
static SET: std::sync::RwLock<Vec<Rule>> = std::sync::RwLock::new(Vec::new());
static ANY_SET: AtomicBool = AtomicBool::new(false);

/// Replaces the in-process rules with `spec` (MOSAICFS_FAULT's syntax), armed at once: for
/// tests that drive the core in-process (tests/core.rs), one sweep point after another.
pub fn set(spec: &str) -> Result<()> {
    let rules = parse(spec)?;
    let mut set = SET.write().unwrap_or_else(|e| e.into_inner());
    *set = rules;
    ANY_SET.store(!set.is_empty(), Ordering::SeqCst);
    ARMED.store(true, Ordering::SeqCst);
    Ok(())
}

/// Removes the in-process rules (`set`).
pub fn clear() {
    let mut set = SET.write().unwrap_or_else(|e| e.into_inner());
    set.clear();
    ANY_SET.store(false, Ordering::SeqCst);
}

/// Whether this change of the upper layer is to fail (fault injection), and how.
#[inline]
pub fn check(op: Op) -> Result<()> {
    if ANY_SET.load(Ordering::Relaxed) {
        check_rules(&SET.read().unwrap_or_else(|e| e.into_inner()), op)?;
    }
    match RULES.get() {
        None => Ok(()),
        Some(rules) => check_rules(rules, op),
    }
}

#[cold]
fn check_rules(rules: &[Rule], op: Op) -> Result<()> {
    if !ARMED.load(Ordering::Relaxed) {
        return Ok(());
    }
    for r in rules.iter().filter(|r| r.op == op) {
        let call = r.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if call == r.n || (r.onward && call > r.n) {
            log::warn!("fault injection: {op:?} call {call} fails");
            return Err(errno(r.errno));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_is_parsed_or_refused_with_the_reason() {
        let r = parse("rename:2,write:3+:ENOSPC").unwrap();
        assert_eq!(
            (r[0].op, r[0].n, r[0].onward, r[0].errno),
            (Op::Rename, 2, false, libc::EIO)
        );
        assert_eq!(
            (r[1].op, r[1].n, r[1].onward, r[1].errno),
            (Op::Write, 3, true, libc::ENOSPC)
        );
        for (spec, why) in [
            ("frobnicate:1", "names no operation"),
            ("rename", "has no count"),
            ("rename:0", "count from 1"),
            ("rename:1:EWHAT", "errno not offered"),
            ("rename:1:EIO:x", "too many fields"),
        ] {
            let e = parse(spec).err().unwrap().to_string();
            assert!(e.contains(why), "{spec}: {e}");
        }
    }
}
