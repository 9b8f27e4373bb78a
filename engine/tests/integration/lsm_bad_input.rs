//! A damaged, truncated or foreign `.lsm` file gives an error naming the file and the problem.

use std::path::{Path, PathBuf};

use leanstream_engine::model::gguf::TinyLlama;
use leanstream_engine::model::{TensorBytes, load, load_imported, lsm};
use leanstream_engine::quant::DType;
use leanstream_engine::testing;

fn tiny_lsm(dir: &Path) -> PathBuf {
    let out = dir.join("tiny.lsm");
    testing::tiny_lsm(9, &dir.join("tiny.gguf"), &out).expect("tiny .lsm");
    out
}

/// Writes `bytes` to a new file and returns the error message of loading it.
fn load_error(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write");
    let err = load(&path)
        .expect_err("loading a damaged file must fail")
        .to_string();
    assert!(err.contains(name), "error does not name the file: {err}");
    err
}

#[test]
fn each_kind_of_damage_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = std::fs::read(tiny_lsm(dir.path())).expect("read");
    let header = lsm::LsmFile::parse(Path::new("x"), TensorBytes::from_vec(good.clone()))
        .expect("the good file parses")
        .header;

    let mut bad = good.clone();
    bad[0] = b'X';
    let e = load_error(dir.path(), "magic.lsm", &bad);
    assert!(e.contains("unknown magic"), "{e}");

    let mut bad = good.clone();
    bad[8..12].copy_from_slice(&2u32.to_le_bytes());
    let e = load_error(dir.path(), "version.lsm", &bad);
    assert!(e.contains("version 2"), "{e}");

    let mut bad = good.clone();
    bad[lsm::PREAMBLE_LEN + 10] ^= 0x20;
    let e = load_error(dir.path(), "header.lsm", &bad);
    assert!(e.contains("header checksum"), "{e}");

    let mut bad = good.clone();
    bad[header.resident.offset as usize + 100] ^= 1;
    let e = load_error(dir.path(), "resident.lsm", &bad);
    assert!(e.contains("resident section checksum"), "{e}");

    let ffn = &header.ffn;
    let at = (header.streamed.offset + ffn.layer_offsets[1]) as usize + ffn.chunk_bytes + 7;
    let mut bad = good.clone();
    bad[at] ^= 0x80;
    let e = load_error(dir.path(), "chunk.lsm", &bad);
    assert!(e.contains("FFN layer 1 chunk 1 checksum"), "{e}");

    for cut in [
        10,
        lsm::PREAMBLE_LEN + 5,
        header.resident.offset as usize + 1,
        good.len() - 1,
    ] {
        let e = load_error(dir.path(), "truncated.lsm", &good[..cut]);
        assert!(
            e.contains("truncated") || e.contains("too short") || e.contains("unknown magic"),
            "cut at {cut}: {e}"
        );
    }
}

#[test]
fn parsing_never_panics_on_mutations() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = std::fs::read(tiny_lsm(dir.path())).expect("read");
    let header_end = lsm::PREAMBLE_LEN + 4096;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..300 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut bytes = good.clone();
        let at = (seed as usize) % header_end.min(bytes.len());
        bytes[at] = (seed >> 32) as u8;
        if seed.is_multiple_of(5) {
            bytes.truncate((seed >> 40) as usize % good.len());
        }
        let _ = lsm::LsmFile::parse(Path::new("m.lsm"), TensorBytes::from_vec(bytes));
    }
}

#[test]
fn a_failed_conversion_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("tiny.gguf");
    TinyLlama::new(1)
        .write_gguf(&src, DType::Q8_0)
        .expect("write gguf");
    let imported = load_imported(&src).expect("import");
    let out = dir.path().join("out.lsm");
    let opts = lsm::ConvertOptions {
        chunk_neurons: Some(0),
        ..Default::default()
    };
    let e = lsm::convert(&imported, &out, &opts, &mut |_, _| {})
        .expect_err("chunk 0")
        .to_string();
    assert!(e.contains("chunk_neurons"), "{e}");
    let missing_dir = dir.path().join("no/such/dir/out.lsm");
    assert!(lsm::convert(&imported, &missing_dir, &Default::default(), &mut |_, _| {}).is_err());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["tiny.gguf"], "conversion left files behind");
    let lsm_path = tiny_lsm(dir.path());
    let e = load_imported(&lsm_path)
        .expect_err("a .lsm is not a convert source")
        .to_string();
    assert!(e.contains("already a .lsm"), "{e}");
}
