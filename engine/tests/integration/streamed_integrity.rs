//! Every streaming mode (`on-demand`, `prefetch`, `leanstream`) on seeded tiny `.lsm` files whose
//! streamed section goes bad after the model was opened: a corrupted byte, a file cut short, or
//! another model's file in its place each end the generation with a named error, never with
//! tokens computed from the wrong bytes, and a bad chunk never stays in the cache.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use leanstream_engine::Error;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::Session;
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::{Executor, Mode, SparseModel};

const STREAMING: [Mode; 3] = [Mode::OnDemand, Mode::Prefetch, Mode::LeanStream];
const TOKENS: [u32; 4] = [1, 40, 41, 42];

/// A tiny `.lsm` of `seed` in `dir` (on the build's disk, which accepts O_DIRECT).
fn tiny(dir: &Path, seed: u64, name: &str) -> PathBuf {
    let gguf = dir.join(format!("{name}.gguf"));
    let lsm = dir.join(format!("{name}.lsm"));
    leanstream_engine::testing::tiny_lsm(seed, &gguf, &lsm).unwrap();
    lsm
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Every chunk computed (no predictor), the whole FFN fits in the cache.
fn executor(sm: &Arc<SparseModel>, mode: Mode) -> Executor {
    let opts = leanstream_engine::testing::exact_options(mode, sm.layout.streamed_bytes());
    Executor::new(sm, opts).unwrap()
}

/// The logits of the last of `TOKENS` in a fresh session, or the first error.
fn run(sm: &SparseModel, exec: &mut Executor) -> leanstream_engine::Result<Vec<f32>> {
    let mut s = Session::new(Arc::clone(&sm.model), 16, Precision::Exact, KvType::F32)?;
    let mut last = Vec::new();
    for &t in &TOKENS {
        last = s.forward_with(t, exec)?.to_vec();
    }
    Ok(last)
}

fn write_at(path: &Path, at: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

fn read_at(path: &Path, at: u64, n: usize) -> Vec<u8> {
    let mut f = std::fs::File::open(path).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    let mut b = vec![0; n];
    f.read_exact(&mut b).unwrap();
    b
}

#[test]
fn one_corrupted_byte_in_a_streamed_chunk_is_a_checksum_error_and_is_not_cached() {
    let dir = tempdir();
    for mode in STREAMING {
        let path = tiny(dir.path(), 3, &format!("corrupt-{mode}"));
        let sm = SparseModel::open(&path, false).unwrap();
        let mut exec = executor(&sm, mode);
        let clean = run(&sm, &mut exec).unwrap();

        let at = sm.layout.file_offset(sm.layout.id(1, 3)) + 77;
        let good = read_at(&path, at, 1);
        write_at(&path, at, &[!good[0]]);
        let mut exec = executor(&sm, mode); // a cold cache: the chunk must be read again
        match run(&sm, &mut exec) {
            Err(Error::ChunkChecksum {
                path: p,
                layer: 1,
                chunk: 3,
                expected,
                found,
            }) => {
                assert_eq!(p, path, "{mode}");
                assert_ne!(expected, found, "{mode}");
            }
            other => panic!("{mode}: expected a checksum error for layer 1 chunk 3, got {other:?}"),
        }
        assert_eq!(
            exec.stats().tokens,
            1,
            "{mode}: the first token ended the run"
        );

        // Repaired, the same pipeline reads the chunk again (it was not kept) and agrees (up to
        // the order in which arriving chunks are summed).
        write_at(&path, at, &good);
        let repaired = run(&sm, &mut exec).unwrap();
        let diff = clean
            .iter()
            .zip(&repaired)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(diff < 1e-4, "{mode}: logits differ by {diff}");
    }
}

#[test]
fn a_file_cut_inside_the_streamed_section_is_a_short_read_not_a_panic() {
    let dir = tempdir();
    for mode in STREAMING {
        let path = tiny(dir.path(), 4, &format!("cut-{mode}"));
        let sm = SparseModel::open(&path, false).unwrap();
        let last = sm
            .layout
            .file_offset(sm.layout.id(sm.layout.n_layers - 1, 0));
        assert!(
            last > sm.layout.file_offset(0),
            "the cut leaves earlier layers whole"
        );
        // Halfway through the last layer's first chunk.
        let cut = last + sm.layout.chunk_bytes as u64 / 2;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let mut exec = executor(&sm, mode);
        let l = sm.layout.n_layers - 1;
        match run(&sm, &mut exec) {
            Err(Error::ChunkRead {
                layer,
                chunk,
                source,
                ..
            }) if layer == l => {
                let at = sm.layout.file_offset(sm.layout.id(l, chunk));
                assert!(
                    matches!(*source, Error::ShortRead { offset, .. } if offset == at),
                    "{mode}: {source}"
                );
            }
            other => panic!("{mode}: expected a short read in layer {l}, got {other:?}"),
        }
    }
}

#[test]
fn another_models_file_in_place_of_the_loaded_one_is_a_checksum_error() {
    let dir = tempdir();
    for mode in STREAMING {
        for replace in ["overwritten", "renamed"] {
            let path = tiny(dir.path(), 5, &format!("{replace}-{mode}"));
            let other = tiny(dir.path(), 6, &format!("{replace}-{mode}-other"));
            let len = |p: &Path| std::fs::metadata(p).unwrap().len();
            assert_eq!(len(&path), len(&other), "two tiny models of one shape");
            let sm = SparseModel::open(&path, false).unwrap();
            if replace == "overwritten" {
                std::fs::copy(&other, &path).unwrap(); // same inode, new bytes
            } else {
                std::fs::rename(&other, &path).unwrap(); // a new file at the path
            }
            let mut exec = executor(&sm, mode);
            let err = run(&sm, &mut exec).unwrap_err();
            assert!(
                matches!(err, Error::ChunkChecksum { layer: 0, .. }),
                "{mode}, {replace}: {err}"
            );
        }
    }
}
