//! Layers served lazily by a layer store (`--layer-store DIR`): a FUSE file system such as
//! stargz-snapshotter's `stargz-store` that shows each layer of an image, fetched from the
//! registry a chunk at a time on first read, as `DIR/base64(IMAGE REF)/LAYER DIGEST/diff` — the
//! layout containers/storage reads as an "additional layer store".
//!
//! containerd unpacks an image by preparing a snapshot per layer with the label
//! `containerd.io/snapshot.ref` (the name the committed layer will have) and, when the client
//! asks for it, labels naming the image and the layer. When the store has that layer, the
//! snapshotter commits a snapshot of that name whose layer is the store's tree and answers the
//! prepare with "already exists": containerd then neither fetches nor unpacks the layer. The
//! containers' own layers stay mosaicfs mounts with the store's trees below, so a first write
//! into an image file copies the block it lands in, and the store fetches the chunk holding
//! that block, not the file.
//!
//! The store counts users of a layer: creating `use` in the layer's directory takes one (the
//! store answers ENOENT and counts it), removing the directory gives it back.

use std::collections::HashMap;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

/// The name containerd gives the committed snapshot of the layer being unpacked.
pub const TARGET_LABEL: &str = "containerd.io/snapshot.ref";
/// Set on a snapshot whose layer a layer store serves (as containerd's remote snapshotters do).
pub const REMOTE_LABEL: &str = "containerd.io/snapshot/remote";

/// The labels naming the image and the layer: stargz-snapshotter's, which `ctr-remote image
/// rpull` sets, then the CRI plugin's (containerd's `disable_snapshot_annotations = false`) and
/// nerdctl's.
const IMAGE_LABELS: [&str; 2] = [
    "containerd.io/snapshot/remote/stargz.reference",
    "containerd.io/snapshot/cri.image-ref",
];
const LAYER_LABELS: [&str; 2] = [
    "containerd.io/snapshot/remote/stargz.digest",
    "containerd.io/snapshot/cri.layer-digest",
];

pub struct LayerStore {
    root: PathBuf,
}

/// A layer the store has: its directory there (what `use` and the removal go to).
pub struct RemoteLayer {
    pub dir: PathBuf,
}

impl RemoteLayer {
    /// The layer's tree: what the snapshot's `fs` points at.
    pub fn tree(&self) -> PathBuf {
        self.dir.join("diff")
    }
}

impl LayerStore {
    pub fn new(root: PathBuf) -> LayerStore {
        LayerStore { root }
    }

    /// The layer the labels of a prepare name, when they name one and the store has it; taken
    /// into use. None sends the prepare the ordinary way (containerd fetches the layer).
    pub fn find(&self, labels: &HashMap<String, String>) -> Option<RemoteLayer> {
        let first = |names: &[&str]| names.iter().find_map(|n| labels.get(*n)).cloned();
        let (image, digest) = (first(&IMAGE_LABELS)?, first(&LAYER_LABELS)?);
        if !is_digest(&digest) {
            eprintln!(
                "mosaicfs-snapshotter: layer label {digest:?} is not a digest: unpacking it instead"
            );
            return None;
        }
        let dir = self.root.join(base64(image.as_bytes())).join(&digest);
        // The store resolves the layer (reads the image's manifest and the layer's table of
        // contents from the registry) at this first look-up.
        match fs::metadata(dir.join("diff")) {
            Ok(st) if st.is_dir() => {}
            Ok(_) => return None,
            Err(e) => {
                eprintln!(
                    "mosaicfs-snapshotter: the layer store has no layer {digest} of {image} ({e}): \
                     containerd fetches and unpacks it"
                );
                return None;
            }
        }
        // The store counts this create and answers it with ENOENT.
        match fs::File::create(dir.join("use")) {
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Ok(_) => {}
            Err(e) => {
                eprintln!(
                    "mosaicfs-snapshotter: cannot take layer {} into use ({e}): unpacking it instead",
                    dir.display()
                );
                return None;
            }
        }
        Some(RemoteLayer { dir })
    }
}

/// Gives back a layer taken with [`LayerStore::find`]: the store forgets it once no one uses it.
pub fn release(tree: &Path) {
    let Some(dir) = tree.parent() else { return };
    match fs::remove_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => eprintln!(
            "mosaicfs-snapshotter: cannot release layer {} in the layer store: {e}",
            dir.display()
        ),
    }
}

fn is_digest(s: &str) -> bool {
    s.split_once(':').is_some_and(|(algorithm, hex)| {
        !algorithm.is_empty()
            && algorithm.bytes().all(|b| b.is_ascii_alphanumeric())
            && !hex.is_empty()
            && hex.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// Standard base64 with padding, as the store names an image's directory.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (*b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_standard_one() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(
            base64(b"127.0.0.1:43795/lazy/test:1"),
            "MTI3LjAuMC4xOjQzNzk1L2xhenkvdGVzdDox"
        );
    }

    #[test]
    fn a_layer_the_store_has_is_found_and_taken_into_use() {
        let root = tempfile::tempdir().unwrap();
        let digest = "sha256:0123abcd";
        let dir = root.path().join(base64(b"reg/img:1")).join(digest);
        fs::create_dir_all(dir.join("diff")).unwrap();
        let store = LayerStore::new(root.path().to_path_buf());
        let labels = |image: &str, layer: &str| {
            HashMap::from([
                (IMAGE_LABELS[1].to_string(), image.to_string()),
                (LAYER_LABELS[1].to_string(), layer.to_string()),
            ])
        };
        let found = store
            .find(&labels("reg/img:1", digest))
            .expect("the store has it");
        assert_eq!(found.tree(), dir.join("diff"));
        // A plain directory keeps the file; the store answers ENOENT and counts instead.
        assert!(dir.join("use").exists(), "use was created");
        assert!(
            store.find(&labels("reg/img:2", digest)).is_none(),
            "another image"
        );
        assert!(
            store.find(&labels("reg/img:1", "../../etc")).is_none(),
            "not a digest"
        );
        assert!(
            store.find(&HashMap::new()).is_none(),
            "no labels: unpacked as before"
        );
    }
}
