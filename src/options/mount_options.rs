//! `-o` mount options: splitting the option string, each option's value, and the checks that
//! look at several options together.

use super::*;

/// Splits an option string at commas that are neither quoted nor escaped, keeping escapes in
/// place for the value parser.
pub(super) fn split_options(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                cur.push(c);
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out.into_iter().filter(|o| !o.is_empty()).collect()
}

/// Removes quotes and escapes from a value; with `split_colon`, unescaped colons separate items.
fn unescape(value: &str, split_colon: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            '"' => quoted = !quoted,
            ':' if split_colon && !quoted => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out
}

fn parse_bool(name: &str, value: Option<&str>) -> Result<bool> {
    match value.map(|v| v.to_ascii_lowercase()) {
        None => Ok(true),
        Some(v) => match v.as_str() {
            "1" | "on" | "yes" | "true" | "y" => Ok(true),
            "0" | "off" | "no" | "false" | "n" => Ok(false),
            _ => Err(crate::message!(
                "option '{name}' takes 0/1 or on/off, not '{v}'"
            )),
        },
    }
}

fn parse_num<T: std::str::FromStr>(name: &str, value: Option<&str>) -> Result<T> {
    let v = value.ok_or_else(|| crate::message!("option '{name}' needs a value: {name}=N"))?;
    v.parse::<T>()
        .map_err(|_| crate::message!("option '{name}' takes a number, not '{v}'"))
}

/// A size in bytes, with an optional K, M or G suffix (powers of 1024).
fn parse_size(name: &str, value: Option<&str>) -> Result<u64> {
    let v =
        value.ok_or_else(|| crate::message!("option '{name}' needs a size: {name}=N[K|M|G]"))?;
    let (digits, shift) = match v.as_bytes().last().map(u8::to_ascii_uppercase) {
        Some(b'K') => (&v[..v.len() - 1], 10),
        Some(b'M') => (&v[..v.len() - 1], 20),
        Some(b'G') => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| {
            crate::message!("option '{name}' takes a size such as 4096, 512K or 1M, not '{v}'")
        })
}

impl Options {
    /// Applies one `-o` option. One piece: one arm per option name, so that every option
    /// fuse-overlayfs accepts can be found in one place.
    pub(super) fn apply(&mut self, opt: &str) -> Result<()> {
        let (name, value) = match opt.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (opt, None),
        };
        let need = |v: Option<&str>| -> Result<String> {
            let v =
                v.ok_or_else(|| crate::message!("option '{name}' needs a value: {name}=..."))?;
            Ok(unescape(v, false).concat())
        };
        match name {
            "lowerdir" => {
                let v = value.ok_or("option 'lowerdir' needs a value: lowerdir=DIR[:DIR...]")?;
                let parts = unescape(v, true);
                // `::` (an empty part) starts the data-only layers, as in kernel overlayfs.
                let split = parts.iter().position(|p| p.is_empty()).unwrap_or(parts.len());
                let dirs = |ps: &[String]| -> Vec<PathBuf> {
                    ps.iter().filter(|p| !p.is_empty()).map(PathBuf::from).collect()
                };
                self.lowerdirs = dirs(&parts[..split]);
                self.datadirs = dirs(&parts[split..]);
                if self.lowerdirs.is_empty() {
                    return Err(match self.datadirs.is_empty() {
                        true => "option 'lowerdir' names no directory".into(),
                        false => "option 'lowerdir' names only data-only layers (after '::'): \
                                  at least one regular lower layer must come first"
                            .into(),
                    });
                }
            }
            "metacopy" => self.metacopy = Some(parse_bool(name, value)?),
            "verity" => {
                self.verity = match value {
                    Some("off") => Verity::Off,
                    Some("on") => Verity::On,
                    Some("require") => Verity::Require,
                    _ => return Err("option 'verity' takes off, on or require".into()),
                }
            }
            "upperdir" => self.upperdir = Some(PathBuf::from(need(value)?)),
            "workdir" => self.workdir = Some(PathBuf::from(need(value)?)),
            "uidmapping" => self.uid_map = IdMap::parse(&need(value)?).map_err(|e| crate::message!("uidmapping: {e}"))?,
            "gidmapping" => self.gid_map = IdMap::parse(&need(value)?).map_err(|e| crate::message!("gidmapping: {e}"))?,
            "squash_to_root" => {
                self.squash_uid = Some(0);
                self.squash_gid = Some(0);
            }
            "squash_to_uid" => self.squash_uid = Some(parse_num(name, value)?),
            "squash_to_gid" => self.squash_gid = Some(parse_num(name, value)?),
            "static_nlink" => self.static_nlink = parse_bool(name, value)?,
            "noacl" => self.acl = !parse_bool(name, value)?,
            "acl" => self.acl = parse_bool(name, value)?,
            "noxattrs" => {
                self.xattrs = !parse_bool(name, value)?;
                if !self.xattrs {
                    self.acl = false;
                }
            }
            "timeout" | "entry_timeout" | "attr_timeout" => {
                let secs: f64 = parse_num(name, value)?;
                if !(0.0..=86400.0 * 365.0).contains(&secs) {
                    return Err(crate::message!("option '{name}' must be between 0 and one year"));
                }
                self.timeout = Duration::from_secs_f64(secs);
                self.timeout_given = true;
            }
            "threaded" => {
                if !parse_bool(name, value)? {
                    self.threads = 1;
                }
            }
            "fsync" => self.skip_fsync = !parse_bool(name, value)?,
            "reflink" => self.reflink = parse_bool(name, value)?,
            "partial_passthrough" => self.partial_passthrough = Switch::parse(name, value)?,
            "writeback" => self.writeback = Switch::parse(name, value)?,
            "restart" => self.restart = Switch::parse(name, value)?,
            "volatile" => self.skip_fsync = true,
            "max_write" => self.max_write = Some(parse_num(name, value)?),
            "fsname" => self.fsname = need(value)?,
            "remount" => self.remount = true,
            "copy_after_write" => {
                self.caw_always = value == Some("always");
                let on = self.caw_always
                    || parse_bool(name, value).map_err(|_| {
                        crate::message!(
                            "option 'copy_after_write' takes 1 (defer blocks the lower layer must \
                             read from disk), always (defer every block) or 0, not '{}'",
                            value.unwrap_or_default()
                        )
                    })?;
                if on {
                    self.caw_memory.get_or_insert(64 << 20);
                } else {
                    self.caw_memory = None;
                }
            }
            "caw_memory" => {
                // A size like every other (64M, 1G); a bare number is MiB, as it always was.
                let bare = value.is_some_and(|v| v.bytes().all(|b| b.is_ascii_digit()));
                let bytes = if bare {
                    parse_num::<u64>(name, value)?.checked_mul(1 << 20).ok_or_else(|| {
                        format!("option '{name}' is too large")
                    })?
                } else {
                    parse_size(name, value)?
                };
                self.caw_memory = Some(bytes as usize);
            }
            "read_ahead_kb" => self.read_ahead_kb = parse_num(name, value)?,
            "lower_cache" => {
                let secs: f64 = parse_num(name, value)?;
                if !(0.0..=86400.0 * 365.0).contains(&secs) {
                    return Err(crate::message!("option '{name}' must be between 0 and one year"));
                }
                self.lower_cache = Some(Duration::from_secs_f64(secs));
            }
            "lower_timeout" => {
                let secs: f64 = parse_num(name, value)?;
                if !(0.0..=86400.0).contains(&secs) {
                    return Err("option 'lower_timeout' takes seconds between 0 (no timeout) and one day".into());
                }
                self.lower_timeout = (secs > 0.0).then(|| Duration::from_secs_f64(secs));
            }
            "metrics" => {
                let v = need(value)?;
                self.metrics = Some(v.parse().map_err(|_| {
                    crate::message!(
                        "option 'metrics' takes an address and port such as 127.0.0.1:9101, not '{v}'"
                    )
                })?);
            }
            "log_file" => self.log_file = Some(PathBuf::from(need(value)?)),
            "caw_workers" => {
                let n: usize = parse_num(name, value)?;
                if n > 64 {
                    return Err("option 'caw_workers' takes 0 to 64 threads".into());
                }
                self.caw_workers = n;
            }
            "complete_after" => {
                let secs: f64 = parse_num(name, value)?;
                if !(0.0..=86400.0 * 365.0).contains(&secs) {
                    return Err("option 'complete_after' takes seconds between 0 (never) and one year".into());
                }
                self.completion.after_idle = (secs > 0.0).then(|| Duration::from_secs_f64(secs));
            }
            "copy_whole" => self.completion.at_open_below = Some(parse_size(name, value)?),
            "complete_busy" => self.completion.busy = Switch::parse(name, value)?,
            "complete_on_reopen" => self.completion.on_reopen_below = parse_size(name, value)?,
            "complete_ratio" => {
                let pct: f64 = parse_num(name, value)?;
                if !(0.0..=100.0).contains(&pct) {
                    return Err("option 'complete_ratio' takes a percentage from 0 (never) to 100".into());
                }
                self.completion.ratio = pct / 100.0;
            }
            "uring" => {
                self.uring = Uring::parse(value).map_err(|e| crate::message!("option 'uring' {e}"))?;
            }
            "upper" => {
                self.upper_kind = match need(value)?.as_str() {
                    "disk" => UpperKind::Disk,
                    "memory" => UpperKind::Memory,
                    v => return Err(crate::message!("option 'upper' takes disk or memory, not '{v}'")),
                }
            }
            "filestore" => self.filestore = Some(FilestorePlace::parse(&need(value)?)?),
            "size" => {
                let bytes = parse_size(name, value)?;
                if bytes < 1 << 20 {
                    return Err("option 'size' takes at least 1M (a size such as 512M or 4G)".into());
                }
                self.size_limit = Some(bytes);
            }
            "passthrough" => {
                use self::PassthroughPolicy as P;
                self.passthrough = match value.map(|v| v.to_ascii_lowercase()).as_deref() {
                    None | Some("upper") | Some("1") | Some("on") => P::Upper,
                    Some("all") => P::All,
                    Some("off") | Some("0") => P::Off,
                    Some(v) => return Err(crate::message!("option 'passthrough' takes upper, all or off, not '{v}'")),
                };
            }
            "ro" => self.read_only = true,
            "rw" => self.read_only = false,
            "allow_other" | "allow_root" => self.allow_other = true,
            "default_permissions" => self.default_permissions = true,
            "suid" => self.suid = true,
            "nosuid" => self.suid = false,
            "dev" => self.dev = true,
            "nodev" => self.dev = false,
            "exec" => self.exec = true,
            "noexec" => self.exec = false,
            "noatime" => (self.noatime, self.strictatime) = (true, false),
            "strictatime" => (self.noatime, self.strictatime) = (false, true),
            "atime" | "relatime" => (self.noatime, self.strictatime) = (false, false),
            "nodiratime" => self.nodiratime = true,
            "diratime" => self.nodiratime = false,
            "lazytime" => {}
            "sync" => self.sync = true,
            "async" => self.sync = false,
            "dirsync" => self.dirsync = true,
            "debug" => {
                self.debug = true;
                self.foreground = true;
            }
            // Inode numbers are always stable and unique (see inode/mod.rs), whatever is asked.
            "redirect_dir" => {
                self.redirect_dir = match value {
                    Some("on") => RedirectDir::On,
                    Some("follow") | Some("off") => RedirectDir::Follow,
                    Some("nofollow") => RedirectDir::NoFollow,
                    _ => {
                        return Err(
                            "option 'redirect_dir' takes on, follow, off or nofollow".into()
                        );
                    }
                }
            }
            "xino" | "fast_ino" | "index" | "userxattr" => {}
            // The kernel's own FUSE mount options, which mount(8) repeats on a remount.
            "user_id" | "group_id" | "rootmode" | "fd" => {}
            // Options that only mount(8) or fstab read.
            "defaults" | "auto" | "noauto" | "user" | "users" | "nouser" | "nofail" | "_netdev" | "owner" => {}
            _ if name.starts_with("x-") || name.starts_with("comment=") => {}
            // Options of libfuse's high-level API that have no meaning for a low-level daemon.
            "use_ino" | "readdir_ino" | "hard_remove" | "big_writes" | "kernel_cache" | "auto_cache"
            | "nonempty" | "max_read" | "negative_timeout" | "subtype" | "blkdev" | "blksize"
            | "clone_fd" | "max_idle_threads" | "max_threads" | "splice_read" | "splice_write"
            | "splice_move" | "no_splice_read" | "no_splice_write" | "no_splice_move" => {}
            "context" | "fscontext" | "defcontext" | "rootcontext" => {
                need(value)?;
                self.warn(format!(
                    "option '{name}' is accepted but SELinux labels are not applied by mosaicfs; it is ignored"
                ));
            }
            "ino32_t" => self.warn("option 'ino32_t' is ignored: inode numbers are 64-bit".into()),
            "plugins" => {
                self.warn("option 'plugins' is ignored: mosaicfs has no layer plugins".into())
            }
            "xattr_permissions" => {
                self.xattr_permissions =
                    crate::stat_override::XattrPermissions::parse(&need(value)?)?
            }
            "auto_unmount" => self.warn(
                "option 'auto_unmount' is ignored: unmount with 'umount MNT' or 'fusermount3 -u MNT'".into(),
            ),
            _ => {
                return Err(crate::message!(
                    "unknown mount option '{opt}': see 'mosaicfs --help' and the README option table"
                ));
            }
        }
        Ok(())
    }

    fn warn(&mut self, w: String) {
        if !self.warnings.contains(&w) {
            self.warnings.push(w);
        }
    }
}

/// The options of a memory upper (`upper=memory`) that must go with it, or not with it.
pub(super) fn check_memory_upper(opts: &Options) -> Result<()> {
    if opts.upper_kind == UpperKind::Disk {
        return match (&opts.filestore, opts.size_limit) {
            (Some(_), _) => {
                Err("option 'filestore' is for a memory upper: add upper=memory".into())
            }
            (_, Some(_)) => Err("option 'size' is for a memory upper: add upper=memory".into()),
            _ => Ok(()),
        };
    }
    if opts.upperdir.is_none() {
        // No upper layer at all (a read-only mount of image layers: containers/storage passes
        // storage.conf's mountopt to those too): nothing for the option to change.
        return Ok(());
    }
    if opts.read_only {
        return Err(
            "upper=memory cannot be mounted read-only: its daemon writes the layer's image at \
             unmount; mount it read-write (nothing changes unless written)"
                .into(),
        );
    }
    if opts.xattr_permissions.key().is_some() {
        return Err(
            "xattr_permissions= is for a disk upper whose daemon may not chown; a memory upper \
             keeps owners and modes itself: drop xattr_permissions"
                .into(),
        );
    }
    Ok(())
}
