//! POSIX ACL inheritance (what ext4 does in the kernel's `posix_acl_create`), for objects made
//! in the memory upper and for objects built in the work dir, away from their parent's ACL: a
//! directory's default ACL becomes a new object's access ACL, its permissions cut by the mode
//! asked for, and a new directory's default ACL too; the object's mode then follows from that
//! ACL and the umask plays no part. Without a default ACL the umask applies. ACLs are kept as
//! the xattrs the kernel hands a file system (`system.posix_acl_access`,
//! `system.posix_acl_default`, format version 2).

use crate::error::{Result, errno};

pub const ACCESS: &str = "system.posix_acl_access";
pub const DEFAULT: &str = "system.posix_acl_default";

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const GROUP_OBJ: u16 = 0x04;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

/// What a new object gets: its mode (type bits kept) and the ACL xattrs to store.
#[derive(Debug, PartialEq, Eq)]
pub struct Inherited {
    pub mode: u32,
    pub access: Option<Vec<u8>>,
    pub default: Option<Vec<u8>>,
}

/// A new object's mode and ACLs, from the `mode` asked for (with its type bits), the `umask`
/// and the parent's default ACL, if any.
pub fn inherit(mode: u32, umask: u32, parent_default: Option<&[u8]>) -> Result<Inherited> {
    let Some(default) = parent_default.filter(|d| !d.is_empty()) else {
        return Ok(Inherited {
            mode: mode & !(umask & 0o777),
            access: None,
            default: None,
        });
    };
    let mut entries = decode(default)?;
    let kind = mode & libc::S_IFMT;
    // posix_acl_create_masq: each base entry cut by the matching mode bits; with a mask, the
    // mask takes the group bits and the owning group keeps its own.
    let has_mask = entries.iter().any(|e| e.0 == MASK);
    let mut new_mode = mode & !0o777;
    for e in entries.iter_mut() {
        let bits = match e.0 {
            USER_OBJ => (mode >> 6) & 7,
            MASK => (mode >> 3) & 7,
            GROUP_OBJ if !has_mask => (mode >> 3) & 7,
            OTHER => mode & 7,
            _ => continue,
        } as u16;
        e.1 &= bits;
        match e.0 {
            USER_OBJ => new_mode |= u32::from(e.1) << 6,
            MASK => new_mode |= u32::from(e.1) << 3,
            GROUP_OBJ if !has_mask => new_mode |= u32::from(e.1) << 3,
            OTHER => new_mode |= u32::from(e.1),
            _ => {}
        }
    }
    // Only the three base entries: the mode says it all, and no access ACL is stored.
    let extended = entries.len() > 3;
    Ok(Inherited {
        mode: new_mode,
        access: extended.then(|| encode(&entries)),
        default: (kind == libc::S_IFDIR).then(|| default.to_vec()),
    })
}

/// An access ACL set on an object of mode `mode` (what ext4 does through the kernel's
/// `posix_acl_update_mode`): the permission bits follow the ACL — the group bits are the
/// mask's when there is one — and an ACL of the three base entries only, which the mode says
/// all of, is not kept. The new mode, and the xattr value to keep, if any.
pub fn set_access(value: &[u8], mode: u32) -> Result<(u32, Option<Vec<u8>>)> {
    let entries = decode(value)?;
    let has_mask = entries.iter().any(|e| e.0 == MASK);
    let mut new_mode = mode & !0o777;
    for e in &entries {
        let perm = u32::from(e.1 & 7);
        match e.0 {
            USER_OBJ => new_mode |= perm << 6,
            MASK => new_mode |= perm << 3,
            GROUP_OBJ if !has_mask => new_mode |= perm << 3,
            OTHER => new_mode |= perm,
            _ => {}
        }
    }
    Ok((new_mode, (entries.len() > 3).then(|| value.to_vec())))
}

/// The access ACL `value` after a chmod to `mode` (the kernel's `posix_acl_chmod`): the
/// owner's, the mask's (else the owning group's) and other's entries take the new bits.
pub fn chmod(value: &[u8], mode: u32) -> Result<Vec<u8>> {
    let mut entries = decode(value)?;
    let has_mask = entries.iter().any(|e| e.0 == MASK);
    for e in entries.iter_mut() {
        match e.0 {
            USER_OBJ => e.1 = ((mode >> 6) & 7) as u16,
            MASK => e.1 = ((mode >> 3) & 7) as u16,
            GROUP_OBJ if !has_mask => e.1 = ((mode >> 3) & 7) as u16,
            OTHER => e.1 = (mode & 7) as u16,
            _ => {}
        }
    }
    Ok(encode(&entries))
}

/// (tag, perm, id) entries of an ACL xattr; EINVAL for anything the kernel would not have
/// written.
fn decode(b: &[u8]) -> Result<Vec<(u16, u16, u32)>> {
    if b.len() < 4 || !(b.len() - 4).is_multiple_of(8) {
        return Err(errno(libc::EINVAL));
    }
    if u32::from_le_bytes(b[..4].try_into().unwrap()) != VERSION {
        return Err(errno(libc::EINVAL));
    }
    let entries: Vec<_> = b[4..]
        .chunks(8)
        .map(|c| {
            (
                u16::from_le_bytes([c[0], c[1]]),
                u16::from_le_bytes([c[2], c[3]]),
                u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            )
        })
        .collect();
    for base in [USER_OBJ, GROUP_OBJ, OTHER] {
        if entries.iter().filter(|e| e.0 == base).count() != 1 {
            return Err(errno(libc::EINVAL));
        }
    }
    Ok(entries)
}

fn encode(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut out = VERSION.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        out.extend_from_slice(&tag.to_le_bytes());
        out.extend_from_slice(&perm.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const USER: u16 = 0x02;
    const GROUP: u16 = 0x08;
    const UNDEFINED: u32 = u32::MAX;

    fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        encode(entries)
    }

    /// What ext4 makes of the same default ACL and modes, compared with `inherit`: the mode
    /// and both ACL xattrs, for files and directories.
    #[test]
    fn inheritance_matches_the_kernel() {
        let defaults = [
            acl(&[
                (USER_OBJ, 7, UNDEFINED),
                (GROUP_OBJ, 5, UNDEFINED),
                (OTHER, 0, UNDEFINED),
            ]),
            acl(&[
                (USER_OBJ, 7, UNDEFINED),
                (USER, 6, 1234),
                (GROUP_OBJ, 5, UNDEFINED),
                (GROUP, 7, 99),
                (MASK, 7, UNDEFINED),
                (OTHER, 1, UNDEFINED),
            ]),
            acl(&[
                (USER_OBJ, 6, UNDEFINED),
                (GROUP_OBJ, 7, UNDEFINED),
                (MASK, 3, UNDEFINED),
                (OTHER, 7, UNDEFINED),
            ]),
        ];
        let tmp = tempfile::tempdir().unwrap();
        let mut probed = false;
        for (i, default) in defaults.iter().enumerate() {
            let dir = tmp.path().join(format!("d{i}"));
            std::fs::create_dir(&dir).unwrap();
            match rustix::fs::setxattr(&dir, DEFAULT, default, rustix::fs::XattrFlags::empty()) {
                Ok(()) => probed = true,
                // No ACLs where the tests run: nothing to compare with.
                Err(rustix::io::Errno::NOTSUP) => return,
                Err(e) => panic!("{e}"),
            }
            for mode in [0o777, 0o755, 0o640, 0o600, 0o070, 0o000] {
                for is_dir in [false, true] {
                    let p = dir.join(format!("o{mode:o}{is_dir}"));
                    let kind = if is_dir {
                        std::fs::DirBuilder::new()
                            .mode_set(mode)
                            .create(&p)
                            .unwrap();
                        libc::S_IFDIR
                    } else {
                        let fd = rustix::fs::open(
                            &p,
                            rustix::fs::OFlags::CREATE | rustix::fs::OFlags::WRONLY,
                            rustix::fs::Mode::from_raw_mode(mode),
                        )
                        .unwrap();
                        drop(fd);
                        libc::S_IFREG
                    };
                    let real_mode = std::fs::metadata(&p).unwrap().permissions().mode();
                    let got = |name: &str| {
                        let mut buf = vec![0u8; 256];
                        rustix::fs::getxattr(&p, name, &mut buf[..])
                            .ok()
                            .map(|n| buf[..n].to_vec())
                    };
                    // Any umask: a default ACL makes the kernel ignore it.
                    let want = inherit(kind | mode, 0o077, Some(default)).unwrap();
                    assert_eq!(
                        want.mode, real_mode,
                        "default {i}, mode {mode:o}, dir {is_dir}"
                    );
                    assert_eq!(
                        want.access,
                        got(ACCESS),
                        "access, default {i}, mode {mode:o}"
                    );
                    assert_eq!(
                        want.default,
                        got(DEFAULT),
                        "default, default {i}, mode {mode:o}"
                    );
                }
            }
        }
        assert!(probed);
    }

    /// What ext4 makes of an access ACL set on a file, and of a chmod after it, compared with
    /// `set_access` and `chmod`.
    #[test]
    fn access_acls_and_chmod_match_the_kernel() {
        let acls = [
            acl(&[
                (USER_OBJ, 6, UNDEFINED),
                (GROUP_OBJ, 4, UNDEFINED),
                (OTHER, 0, UNDEFINED),
            ]),
            acl(&[
                (USER_OBJ, 6, UNDEFINED),
                (USER, 4, 4321),
                (GROUP_OBJ, 0, UNDEFINED),
                (MASK, 4, UNDEFINED),
                (OTHER, 0, UNDEFINED),
            ]),
            acl(&[
                (USER_OBJ, 7, UNDEFINED),
                (GROUP_OBJ, 5, UNDEFINED),
                (GROUP, 7, 99),
                (MASK, 7, UNDEFINED),
                (OTHER, 1, UNDEFINED),
            ]),
        ];
        let tmp = tempfile::tempdir().unwrap();
        let got = |p: &std::path::Path| {
            let mut buf = vec![0u8; 256];
            rustix::fs::getxattr(p, ACCESS, &mut buf[..])
                .ok()
                .map(|n| buf[..n].to_vec())
        };
        for (i, value) in acls.iter().enumerate() {
            for mode in [0o600, 0o755, 0o000] {
                let p = tmp.path().join(format!("f{i}-{mode:o}"));
                std::fs::write(&p, b"").unwrap();
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
                match rustix::fs::setxattr(&p, ACCESS, value, rustix::fs::XattrFlags::empty()) {
                    Ok(()) => {}
                    Err(rustix::io::Errno::NOTSUP) => return,
                    Err(e) => panic!("{e}"),
                }
                let real = std::fs::metadata(&p).unwrap().permissions().mode();
                let (want, kept) = set_access(value, libc::S_IFREG | mode).unwrap();
                assert_eq!(want, real, "acl {i} on mode {mode:o}");
                assert_eq!(kept, got(&p), "acl {i} kept, mode {mode:o}");
                let Some(kept) = kept else { continue };
                for new in [0o640, 0o017] {
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(new)).unwrap();
                    assert_eq!(
                        Some(chmod(&kept, new).unwrap()),
                        got(&p),
                        "acl {i}, chmod {new:o}"
                    );
                }
            }
        }
    }

    #[test]
    fn without_a_default_acl_the_umask_applies() {
        let got = inherit(libc::S_IFREG | 0o666, 0o022, None).unwrap();
        assert_eq!(
            got,
            Inherited {
                mode: libc::S_IFREG | 0o644,
                access: None,
                default: None
            }
        );
    }

    #[test]
    fn a_damaged_default_acl_is_refused() {
        for bad in [
            vec![1, 0, 0, 0],
            vec![2, 0, 0, 0, 1, 0, 7, 0],
            acl(&[(USER_OBJ, 7, 0)]),
        ] {
            assert!(inherit(libc::S_IFREG | 0o644, 0, Some(&bad)).is_err());
        }
    }

    trait ModeSet {
        fn mode_set(&mut self, mode: u32) -> &mut Self;
    }
    impl ModeSet for std::fs::DirBuilder {
        fn mode_set(&mut self, mode: u32) -> &mut Self {
            std::os::unix::fs::DirBuilderExt::mode(self, mode)
        }
    }
}
