#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    mosaicfs::fuzzing::stat_override(data);
});
