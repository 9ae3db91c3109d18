//! Links the functions the daemon runs once mounted next to each other (src/hot.ld, made by
//! dev/hotcode.py), so that an idle daemon maps a few hundred KiB of its program rather than
//! nearly all of it (docs/PERFORMANCE.md, "Idle mounts"). The script only orders sections
//! (`INSERT BEFORE .text` into the linker's default script): GNU ld and lld take it; a linker
//! that does not (mold) builds with `MOSAICFS_NO_HOT_LD=1`, at the cost of that memory only.

fn main() {
    println!("cargo:rerun-if-changed=src/hot.ld");
    println!("cargo:rerun-if-env-changed=MOSAICFS_NO_HOT_LD");
    let linux = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux");
    if linux && std::env::var_os("MOSAICFS_NO_HOT_LD").is_none() {
        let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
        println!("cargo:rustc-link-arg-bin=mosaicfs=-Wl,-T,{dir}/src/hot.ld");
    }
}
