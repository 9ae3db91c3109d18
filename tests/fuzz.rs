//! The fuzz targets (src/fuzzing.rs) on any toolchain: every input of the corpus in
//! fuzz/corpus/, then a few thousand seeded mutations of it per target. The seeds fuzz/seed.sh
//! wrote must be accepted (a seed the decoder refuses fuzzes nothing); no input may panic.
//! Coverage-guided runs for minutes, with a nightly toolchain: fuzz/run.sh.
//! `MOSAICFS_FUZZ_ROUNDS` sets the mutations per target (default 3,000).

use std::path::{Path, PathBuf};

use mosaicfs::fuzzing::TARGETS;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// The corpus of `target`, by name; libFuzzer names what it adds by a 40-digit SHA-1.
fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(corpus_dir(target))
        .unwrap_or_else(|e| panic!("fuzz/corpus/{target}: {e} (fuzz/seed.sh writes it)"))
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

fn found_by_fuzzer(name: &str) -> bool {
    name.len() == 40 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

/// xorshift64*: the same mutations on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One to four edits of `input`: flipped bits, interesting values, bytes inserted, removed or
/// repeated, a cut, or a piece of `other`.
fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    const INTERESTING: [u64; 8] = [0, 1, 0x7f, 0xff, 0xffff, 0xffff_ffff, 1 << 63, u64::MAX];
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(8) {
            0 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] = rng.next() as u8;
            }
            2 => {
                let value = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                let n = [1, 2, 4, 8][rng.below(4)];
                let end = (at + n).min(v.len());
                v.splice(at..end, value[..n].iter().copied());
            }
            3 => {
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(at..at, bytes);
            }
            4 if at < v.len() => {
                let end = (at + 1 + rng.below(32)).min(v.len());
                v.drain(at..end);
            }
            5 if at < v.len() => {
                let end = (at + 1 + rng.below(64)).min(v.len());
                let piece = v[at..end].to_vec();
                v.splice(at..at, piece);
            }
            6 => v.truncate(at),
            _ if !other.is_empty() => {
                let from = rng.below(other.len());
                let end = (from + 1 + rng.below(64)).min(other.len());
                let to = (at + rng.below(16)).min(v.len());
                v.splice(at..to, other[from..end].iter().copied());
            }
            _ => {}
        }
    }
    v
}

#[test]
fn every_decoder_of_layer_data_takes_its_corpus_and_mutations_without_a_panic() {
    let rounds: usize = std::env::var("MOSAICFS_FUZZ_ROUNDS").map_or(3000, |v| v.parse().unwrap());
    for &(target, run) in TARGETS {
        let corpus = corpus(target);
        assert!(!corpus.is_empty(), "fuzz/corpus/{target} is empty");
        for (name, input) in &corpus {
            let accepted = run(input);
            assert!(
                accepted || found_by_fuzzer(name),
                "{target}: the seed {name} is refused (run fuzz/seed.sh again?)"
            );
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ target.len() as u64);
        let mut accepted = 0;
        for round in 0..rounds {
            let (name, input) = &corpus[rng.below(corpus.len())];
            let other = &corpus[rng.below(corpus.len())].1;
            let input = mutate(&mut rng, input, other);
            let result = std::panic::catch_unwind(|| run(&input));
            match result {
                Ok(true) => accepted += 1,
                Ok(false) => {}
                Err(_) => {
                    let saved = std::env::temp_dir().join(format!("mosaicfs-fuzz-{target}"));
                    std::fs::write(&saved, &input).unwrap();
                    panic!(
                        "{target}: round {round}, a mutation of {name} panicked; the input is in {} \
                         (replay: cargo +nightly fuzz run {target} {})",
                        saved.display(),
                        saved.display()
                    );
                }
            }
        }
        eprintln!(
            "{target}: {} inputs of the corpus, {rounds} mutations, {accepted} accepted",
            corpus.len()
        );
    }
}
