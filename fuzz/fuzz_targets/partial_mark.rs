#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    mosaicfs::fuzzing::partial_mark(data);
});
