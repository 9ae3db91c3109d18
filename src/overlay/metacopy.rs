//! Kernel overlayfs' metadata-only lower files (`metacopy=on`), data-only lower layers
//! (`lowerdir=A:B::DATA1::DATA2`, Linux 6.5) and their fs-verity digests (`verity=`, Linux
//! 6.6): the layer forms composefs images use — a metadata layer (an EROFS image, say) whose
//! regular files carry `overlay.metacopy` and an absolute `overlay.redirect` to their data in a
//! content-addressed directory, with a block-level writable layer on top.
//!
//! A lower regular file with `overlay.metacopy` holds metadata only (mosaicfs' own partial
//! files carry that xattr too, as a guard against kernel overlayfs: their mark says where their
//! data is, and they are not read this way). Its data is the regular file at its
//! `overlay.redirect` — an absolute path, or a sibling's name; without one, its own path — in
//! the layers below it, the data-only layers last; that file may itself be metadata-only.
//! A lookup records where the data is (`LowerRef::data`), and every reader of a lower file's
//! bytes takes them from there (`open_lower_data`, copy-up, partial-file marks). Data-only
//! layers are never looked up by name: their names do not show.
//!
//! `overlay.metacopy`'s value is empty, or the kernel's `struct ovl_metacopy`: version (0),
//! length, flags, digest algorithm (FS_VERITY_HASH_ALG_*, 0 for none), digest. With
//! `verity=on` a digest, where there is one, must match the data file's fs-verity
//! measurement; with `verity=require` every metadata-only file needs one. A data file without
//! fs-verity, a digest that differs, or a missing digest under `require` fails the open with
//! EIO, as kernel overlayfs fails it. (docs/FORMAT.md "Kernel overlayfs' metadata-only files".)
//!
//! Touches: lower layers (read only), the options' `metacopy` and `verity`.
//!
//! May call (dev/callgraph.py --check keeps it so): overlay.

use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result, errno};
use crate::inode::LowerData;
use crate::layers::LayerId;
use crate::options::Verity;
use crate::overlay::Overlay;
use crate::overlay::namei::Redirect;
use crate::sys;
use crate::upper::LayerDir;

/// Metadata-only files followed one to the next, at most (kernel overlayfs has one per layer).
const CHAIN_MAX: usize = 64;

fn eio(msg: String) -> Error {
    log::error!("{msg}");
    Error::with_context(libc::EIO, msg)
}

/// The digest in an `overlay.metacopy` value: `None` for an empty value or algorithm 0.
pub(crate) fn parse_metacopy(value: &[u8], path: &Path) -> Result<Option<(u8, Vec<u8>)>> {
    if value.is_empty() {
        return Ok(None);
    }
    let bad = |why: &str| {
        eio(format!(
            "metadata-only file '{}': its overlay.metacopy xattr is damaged ({why}); rebuild \
             the layer (mkcomposefs, or kernel overlayfs with metacopy=on)",
            path.display()
        ))
    };
    if value.len() < 4 {
        return Err(bad("shorter than its 4-byte header"));
    }
    let (version, len, algorithm) = (value[0], value[1] as usize, value[3]);
    if version != 0 {
        return Err(bad(&format!("version {version}, not 0")));
    }
    if len != value.len() {
        return Err(bad(&format!("says {len} bytes, has {}", value.len())));
    }
    Ok((algorithm != 0).then(|| (algorithm, value[4..].to_vec())))
}

impl Overlay {
    fn overlay_xattr(&self, name: &str) -> String {
        format!("{}overlay.{name}", self.layers.xattr.prefix)
    }

    /// Where the data of the regular file found at `path` in lower layer `layer` is, when it
    /// is a metadata-only file and those are followed; `None` for a file with its own data.
    pub(crate) fn lower_data(&self, layer: LayerId, path: &Path) -> Result<Option<Arc<LowerData>>> {
        if !self.config.metacopy {
            return Ok(None);
        }
        let (metacopy_key, redirect_key) = (
            self.overlay_xattr("metacopy"),
            self.overlay_xattr("redirect"),
        );
        let (mut layer, mut path) = (layer, path.to_owned());
        let mut digest = None;
        for step in 0..CHAIN_MAX {
            let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
                return Err(errno(libc::EINVAL));
            };
            let meta = self.in_lower_dir(layer, parent, |dir| {
                let dir = LayerDir::from(dir);
                let Some(value) = dir.get_xattr(Some(name), &metacopy_key)? else {
                    return Ok(None);
                };
                if dir
                    .get_xattr(Some(name), &self.layers.xattr.partial)?
                    .is_some()
                {
                    return Ok(None);
                }
                Ok(Some((value, dir.get_xattr(Some(name), &redirect_key)?)))
            })?;
            let Some((value, redirect)) = meta else {
                return Ok((step > 0).then(|| {
                    Arc::new(LowerData {
                        layer,
                        path,
                        digest,
                    })
                }));
            };
            if step == 0 {
                digest = parse_metacopy(&value, &path)?;
            }
            let target = match redirect.as_deref().map(Redirect::parse) {
                None => path.clone(),
                Some(Some(Redirect::Absolute(p))) => p,
                Some(Some(Redirect::Sibling(other))) => parent.join(other),
                Some(None) => {
                    return Err(eio(format!(
                        "metadata-only file '{}' in layer {layer}: its overlay.redirect {:?} \
                         names no path a layer can hold",
                        path.display(),
                        String::from_utf8_lossy(redirect.as_deref().unwrap_or_default())
                    )));
                }
            };
            let below = self.layers.lower_ids().chain(self.layers.data_ids());
            let found = below
                .filter(|&l| l > layer)
                .find(|&l| self.is_regular_in(l, &target));
            let Some(found) = found else {
                return Err(eio(format!(
                    "metadata-only file '{}' in layer {layer}: its data '{}' is in no layer \
                     below it (data-only layers included): give the layer that holds it \
                     (lowerdir=...::DATA)",
                    path.display(),
                    target.display()
                )));
            };
            (layer, path) = (found, target);
        }
        Err(eio(format!(
            "metadata-only file '{}': more than {CHAIN_MAX} metadata-only files lead to its data",
            path.display()
        )))
    }

    fn is_regular_in(&self, layer: LayerId, path: &Path) -> bool {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return false;
        };
        self.in_lower_dir(layer, parent, |dir| sys::stat_opt(dir, name))
            .is_ok_and(|a| a.is_some_and(|a| a.is_reg()))
    }

    /// Checks the data file `fd` of `data` against the digest its metadata asks for.
    pub(crate) fn check_verity(&self, data: &LowerData, fd: std::os::fd::BorrowedFd) -> Result<()> {
        let want = match (self.config.verity, &data.digest) {
            (Verity::Off, _) | (Verity::On, None) => return Ok(()),
            (Verity::Require, None) => {
                return Err(eio(format!(
                    "data file '{}' (layer {}): its metadata-only file carries no fs-verity \
                     digest, and verity=require asks for one",
                    data.path.display(),
                    data.layer
                )));
            }
            (_, Some(want)) => want,
        };
        let got = match sys::measure_verity(fd) {
            Ok(got) => got,
            Err(e) if e.is(libc::ENODATA) || e.is(libc::ENOTTY) || e.is(libc::EOPNOTSUPP) => {
                return Err(eio(format!(
                    "data file '{}' (layer {}) has no fs-verity, but its metadata-only file \
                     carries a digest: enable verity on it (fsverity enable) or mount with \
                     verity=off",
                    data.path.display(),
                    data.layer
                )));
            }
            Err(e) => return Err(e),
        };
        if got != *want {
            return Err(eio(format!(
                "data file '{}' (layer {}) does not match the fs-verity digest of its \
                 metadata-only file: it was changed or replaced",
                data.path.display(),
                data.layer
            )));
        }
        Ok(())
    }

    /// The `stat` of the data file of a metadata-only lower file (what a partial-file mark
    /// made from it must name).
    pub(crate) fn lower_data_attr(&self, data: &LowerData) -> Result<sys::Attr> {
        Ok(self.lower_entry(data.layer, &data.path)?.2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metacopy_values_are_read_as_the_kernel_writes_them() {
        let p = Path::new("f");
        assert_eq!(parse_metacopy(b"", p).unwrap(), None);
        let mut v = vec![0, 36, 0, 1];
        v.extend([7u8; 32]);
        assert_eq!(parse_metacopy(&v, p).unwrap(), Some((1, vec![7u8; 32])));
        assert_eq!(parse_metacopy(&[0, 4, 0, 0], p).unwrap(), None);
        for bad in [&[0u8, 4, 0][..], &[1, 4, 0, 0], &[0, 9, 0, 1, 1]] {
            assert!(parse_metacopy(bad, p).unwrap_err().is(libc::EIO), "{bad:?}");
        }
    }
}
