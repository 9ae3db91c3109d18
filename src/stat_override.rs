//! Owners and modes kept in an xattr instead of the inode: fuse-overlayfs' `xattr_permissions`.
//!
//! A rootless daemon cannot chown files to the ids a container uses, nor may it set the
//! `security.*` xattrs (file capabilities) of its files. With `xattr_permissions=1` (an xattr
//! only a privileged daemon can write) or `=2` (an unprivileged one, what containers/storage
//! uses) the owner and mode the merged view shows live in an xattr of the upper object, chown
//! and chmod change only that xattr, and new objects carry the creator's ids in it while the
//! daemon owns the real inode. With `=2`, `security.*` and `trusted.*` xattrs of the merged view
//! are kept under `user.containers.override_NAME`: the real ones on the upper files are neither
//! shown nor changed, so a rootless container can setcap its own files.
//!
//! A layer whose root directory carries one of the keys is read this way whatever the options
//! (a layer made by fuse-overlayfs or with containers/storage's `force_mask`); the upper root
//! is given its key at mount, so the layer says so when it is stacked later. Format of the value
//! (containers/storage's): `UID:GID:MODE[:TYPE]`, ids in decimal as stored on disk, `MODE` the
//! permission bits in octal (set-id and sticky included), `TYPE` one of `file`, `dir`,
//! `symlink`, `pipe`, `socket`, `block-MAJOR-MINOR`, `char-MAJOR-MINOR` (docs/FORMAT.md).

use std::borrow::Cow;

use crate::sys::Attr;

/// Written by fuse-overlayfs with `xattr_permissions=1`.
pub const PRIVILEGED_KEY: &str = "security.fuseoverlayfs.override_stat";
/// Written by fuse-overlayfs with `xattr_permissions=2` and by containers/storage.
pub const CONTAINERS_KEY: &str = "user.containers.override_stat";
/// Written by older fuse-overlayfs versions (read only).
pub const USER_KEY: &str = "user.fuseoverlayfs.override_stat";
/// The keys a layer root is looked at for, most privileged first.
pub const KEYS: [&str; 3] = [PRIVILEGED_KEY, CONTAINERS_KEY, USER_KEY];

/// Where `security.*` and `trusted.*` xattrs of the merged view live with `xattr_permissions=2`.
const CONTAINERS_PREFIX: &[u8] = b"user.containers.override_";

/// The `xattr_permissions=` option.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum XattrPermissions {
    #[default]
    Off,
    Privileged,
    Containers,
}

impl XattrPermissions {
    pub fn parse(v: &str) -> Result<Self, String> {
        match v {
            "0" => Ok(Self::Off),
            "1" => Ok(Self::Privileged),
            "2" => Ok(Self::Containers),
            _ => Err(format!(
                "xattr_permissions={v} is not valid: use 0 (owners and modes on the inodes), 1 \
                 (in {PRIVILEGED_KEY}) or 2 (in {CONTAINERS_KEY}, for rootless containers)"
            )),
        }
    }

    /// The key this mode writes on the upper layer.
    pub fn key(self) -> Option<&'static str> {
        match self {
            Self::Off => None,
            Self::Privileged => Some(PRIVILEGED_KEY),
            Self::Containers => Some(CONTAINERS_KEY),
        }
    }

    /// Where a file capability (`security.capability` of the merged view) is stored.
    pub fn capability_name(self) -> &'static str {
        match self {
            Self::Containers => "user.containers.override_security.capability",
            _ => "security.capability",
        }
    }

    /// The name an xattr of the merged view is stored under, or `None` when the merged view may
    /// not set it (the key itself, under `=1`).
    pub fn stored_name(self, merged: &[u8]) -> Option<Cow<'_, [u8]>> {
        match self {
            Self::Off => Some(merged.into()),
            Self::Privileged => {
                (!merged.starts_with(b"security.fuseoverlayfs.")).then_some(merged.into())
            }
            Self::Containers if hidden_in_containers(merged) => {
                Some([CONTAINERS_PREFIX, merged].concat().into())
            }
            Self::Containers => Some(merged.into()),
        }
    }

    /// The merged view's name of an xattr stored on a layer, or `None` when it is hidden (the
    /// inverse of `stored_name`).
    pub fn merged_name(self, stored: &[u8]) -> Option<Cow<'_, [u8]>> {
        match self {
            Self::Off => Some(stored.into()),
            Self::Privileged => self.stored_name(stored),
            Self::Containers => match stored.strip_prefix(CONTAINERS_PREFIX) {
                Some(inner) => hidden_in_containers(inner).then_some(inner.into()),
                None => (!hidden_in_containers(stored)).then_some(stored.into()),
            },
        }
    }
}

/// Names that `=2` keeps off the layer's real namespaces: the privileged ones, and its own.
fn hidden_in_containers(name: &[u8]) -> bool {
    name.starts_with(b"security.")
        || name.starts_with(b"trusted.")
        || name.starts_with(CONTAINERS_PREFIX)
}

/// Owner, mode and (for devices kept as regular files) type of one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverrideStat {
    pub uid: u32,
    pub gid: u32,
    /// Permission, set-id and sticky bits.
    pub mode: u32,
    /// The object's type as the value names it, with its device number.
    pub kind: Option<(u32, u64)>,
}

impl OverrideStat {
    /// What an object shows when it has no value yet: its inode's owner and mode.
    pub fn of(a: &Attr) -> Self {
        OverrideStat {
            uid: a.uid,
            gid: a.gid,
            mode: a.mode & 0o7777,
            kind: None,
        }
    }

    pub fn parse(raw: &[u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(raw).map_err(|_| "not text".to_string())?;
        let text = text.trim_end_matches('\0');
        let mut parts = text.split(':');
        let mut next = |what: &str| parts.next().ok_or(format!("no {what}"));
        let uid = next("uid")?.parse().map_err(|_| "bad uid".to_string())?;
        let gid = next("gid")?.parse().map_err(|_| "bad gid".to_string())?;
        let mode = u32::from_str_radix(next("mode")?, 8).map_err(|_| "bad mode".to_string())?;
        let kind = match parts.next() {
            None => None,
            Some(t) => Some(parse_type(t).ok_or(format!("bad type '{t}'"))?),
        };
        Ok(OverrideStat {
            uid,
            gid,
            mode: mode & 0o7777,
            kind,
        })
    }

    /// The value for an object of type `kind` (its own type, unless the value names one).
    pub fn encode(&self, kind: u32) -> String {
        let (kind, rdev) = self.kind.unwrap_or((kind, 0));
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        let t = match kind {
            libc::S_IFDIR => "dir".to_string(),
            libc::S_IFLNK => "symlink".to_string(),
            libc::S_IFIFO => "pipe".to_string(),
            libc::S_IFSOCK => "socket".to_string(),
            libc::S_IFBLK => format!("block-{major}-{minor}"),
            libc::S_IFCHR => format!("char-{major}-{minor}"),
            _ => "file".to_string(),
        };
        format!("{}:{}:{:04o}:{t}", self.uid, self.gid, self.mode)
    }

    /// Shows `a` as this value says. Only a regular file may show as a device (how a device is
    /// kept where no device can be made); every other type is the inode's own, so a value can
    /// never make a directory or a symlink look like something else.
    pub fn apply(&self, a: &mut Attr) {
        a.uid = self.uid;
        a.gid = self.gid;
        let mut kind = a.file_type();
        if let Some((k, rdev)) = self.kind
            && kind == libc::S_IFREG
            && matches!(k, libc::S_IFCHR | libc::S_IFBLK)
        {
            kind = k;
            a.rdev = rdev;
        }
        a.mode = kind | self.mode;
    }
}

fn parse_type(t: &str) -> Option<(u32, u64)> {
    let device = |kind: u32, rest: &str| {
        let mut n = rest.split('-');
        let major = n.next()?.parse().ok()?;
        let minor = n.next()?.parse().ok()?;
        Some((kind, libc::makedev(major, minor)))
    };
    match t {
        "file" => Some((libc::S_IFREG, 0)),
        "dir" => Some((libc::S_IFDIR, 0)),
        "symlink" => Some((libc::S_IFLNK, 0)),
        "pipe" => Some((libc::S_IFIFO, 0)),
        "socket" => Some((libc::S_IFSOCK, 0)),
        _ => match t.split_once('-')? {
            ("block", rest) => device(libc::S_IFBLK, rest),
            ("char", rest) => device(libc::S_IFCHR, rest),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_of_containers_storage_and_fuse_overlayfs_parse() {
        let v = OverrideStat::parse(b"0:1:0755:file").unwrap();
        assert_eq!((v.uid, v.gid, v.mode), (0, 1, 0o755));
        // Older writers put the whole st_mode, type bits included, and no type field.
        let v = OverrideStat::parse(b"5:6:0100640").unwrap();
        assert_eq!((v.mode, v.kind), (0o640, None));
        let v = OverrideStat::parse(b"0:0:4755:char-1-3").unwrap();
        assert_eq!(v.kind, Some((libc::S_IFCHR, libc::makedev(1, 3))));
        assert_eq!(v.encode(libc::S_IFREG), "0:0:4755:char-1-3");
        for bad in [
            &b""[..],
            b"1:2",
            b"x:2:0644",
            b"1:2:0999",
            b"1:2:0644:door",
            b"1:2:0644:char-1",
        ] {
            assert!(OverrideStat::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_a_regular_file_can_show_as_a_device() {
        let v = OverrideStat::parse(b"1:2:0600:char-4-5").unwrap();
        let mut file = Attr {
            mode: libc::S_IFREG | 0o644,
            ..Default::default()
        };
        v.apply(&mut file);
        assert_eq!(file.mode, libc::S_IFCHR | 0o600);
        assert_eq!(file.rdev, libc::makedev(4, 5));
        let mut dir = Attr {
            mode: libc::S_IFDIR | 0o755,
            ..Default::default()
        };
        v.apply(&mut dir);
        assert_eq!(dir.mode, libc::S_IFDIR | 0o600);
    }

    #[test]
    fn containers_mode_keeps_privileged_names_under_its_prefix() {
        let m = XattrPermissions::Containers;
        for name in [
            &b"security.capability"[..],
            b"trusted.x",
            b"user.containers.override_stat",
        ] {
            let stored = m.stored_name(name).unwrap();
            assert!(stored.starts_with(CONTAINERS_PREFIX));
            assert_eq!(&*m.merged_name(&stored).unwrap(), name);
        }
        assert_eq!(&*m.stored_name(b"user.a").unwrap(), b"user.a");
        // The layer's real privileged xattrs and the key itself are not shown.
        assert!(m.merged_name(b"security.capability").is_none());
        assert!(m.merged_name(CONTAINERS_KEY.as_bytes()).is_none());
        assert_eq!(
            &*m.stored_name(b"security.capability").unwrap(),
            m.capability_name().as_bytes()
        );
        let p = XattrPermissions::Privileged;
        assert!(p.stored_name(PRIVILEGED_KEY.as_bytes()).is_none());
        assert!(p.merged_name(PRIVILEGED_KEY.as_bytes()).is_none());
        assert!(p.merged_name(b"security.capability").is_some());
    }
}
