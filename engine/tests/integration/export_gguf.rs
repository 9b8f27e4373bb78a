//! `leanstream export-gguf`: a `.lsm` file written back as GGUF gives the same model — the same
//! logits, the same gate/up bytes and (for synthetic models, whose down values are planted to
//! survive the transposition) the same down values — and what cannot be exported is refused
//! without leaving a file behind.

use std::path::{Path, PathBuf};

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::kv::KvType;
use leanstream_engine::model::gguf::writer::partial_path;
use leanstream_engine::model::gguf::{GgufFile, GgufModel, TinyArch, TinyLlama};
use leanstream_engine::model::lsm::export::{ExportReport, export_gguf};
use leanstream_engine::model::lsm::synth::{SynthOptions, SynthShape, SynthTokenizer, synthesize};
use leanstream_engine::model::lsm::{self, LsmFile};
use leanstream_engine::model::{Down, QRows, TensorBytes, load_imported, safetensors};
use leanstream_engine::quant::DType;

/// Ids the tiny models know (vocabulary 128).
const TOKENS: [u32; 8] = [1, 40, 41, 42, 100, 7, 99, 64];

/// Logits after each of [`TOKENS`].
fn logits(path: &Path) -> Vec<Vec<f32>> {
    let model = Model::load(path).expect("load");
    let mut s = Session::new(model, 32, Precision::Exact, KvType::F32).expect("session");
    TOKENS
        .iter()
        .map(|&t| s.forward(t).expect("forward").to_vec())
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn export(lsm: &Path) -> (PathBuf, ExportReport) {
    let out = lsm.with_extension("gguf");
    let mut last = (0, 0);
    let report = export_gguf(lsm, &out, &mut |done, total| {
        assert!(done >= last.0 && done <= total, "{done} of {total}");
        last = (done, total);
    })
    .expect("export");
    assert_eq!(last.0, last.1, "progress ends at the total");
    assert!(!partial_path(&out).exists());
    assert_eq!(
        report.file_bytes,
        std::fs::metadata(&out).expect("output").len()
    );
    (out, report)
}

/// The down matrix as `d_model` rows of `n_ff` values, whatever its layout.
fn down_dense(down: &Down) -> Vec<f32> {
    let dense = |m: &QRows| {
        let mut v = vec![0f32; m.rows * m.cols];
        for (i, row) in v.chunks_exact_mut(m.cols).enumerate() {
            m.dequantize_row(i, row);
        }
        v
    };
    match down {
        Down::Rows(m) => dense(m),
        Down::Neurons(m) => {
            let cols = dense(m);
            let (n_ff, d) = (m.rows, m.cols);
            (0..d * n_ff)
                .map(|k| cols[(k % n_ff) * d + k / n_ff])
                .collect()
        }
    }
}

fn synth(dir: &Path, seed: u64, down: DType) -> PathBuf {
    let path = dir.join(format!("synth-{seed}-{down}.lsm"));
    let mut opts = SynthOptions::new(SynthShape::TINY);
    opts.seed = seed;
    opts.chunk_neurons = 1;
    opts.down_dtype = down;
    synthesize(&path, &opts, &SynthTokenizer::tiny(), &mut |_, _| {}).expect("synth");
    path
}

#[test]
fn a_synthetic_model_exports_losslessly() {
    let dir = tempfile::tempdir().expect("tempdir");
    for down in [DType::Q5_0, DType::Q8_0, DType::Q4_0, DType::F16] {
        let lsm = synth(dir.path(), 1, down);
        let (gguf, report) = export(&lsm);
        assert_eq!(report.down_max_abs_change, 0.0, "{down}: {report:?}");
        assert_eq!(report.architecture, "llama");
        assert_eq!((report.vocab, report.tokens_dropped), (128, 0));
        assert!(!report.permuted_qk);

        let (a, b) = (Model::load(&lsm).unwrap(), Model::load(&gguf).unwrap());
        let f = GgufFile::open(&gguf).unwrap();
        assert_eq!(
            f.tensor("blk.1.ffn_down.weight").unwrap().dtype(),
            Some(down)
        );
        assert_eq!(f.tensor("blk.1.ffn_down.weight").unwrap().shape, [128, 512]);
        for (la, lb) in a.weights.layers.iter().zip(&b.weights.layers) {
            assert!(matches!(lb.ffn.down, Down::Rows(_)));
            for i in 0..512 {
                assert_eq!(la.ffn.gate.row(i), lb.ffn.gate.row(i), "{down} gate {i}");
                assert_eq!(la.ffn.up.row(i), lb.ffn.up.row(i), "{down} up {i}");
            }
            assert!(
                down_dense(&la.ffn.down) == down_dense(&lb.ffn.down),
                "{down}: down values differ"
            );
        }
        let d = max_diff(&logits(&lsm), &logits(&gguf));
        assert!(
            d < 1e-4,
            "{down}: .lsm vs exported GGUF logits differ by {d}"
        );
    }
    // The comparison can fail: another seed gives other logits.
    let other = synth(dir.path(), 2, DType::Q5_0);
    let one = dir.path().join("synth-1-q5_0.gguf");
    assert!(max_diff(&logits(&other), &logits(&one)) > 1e-2);
}

#[test]
fn a_converted_model_exports_back_within_the_down_re_encoding() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("src.gguf");
    TinyLlama::new(3).write_gguf(&src, DType::Q4_1).unwrap();
    let want = logits(&src);
    let source = GgufModel::read(&src).unwrap();
    for (down, to_lsm, to_source) in [
        // Measured: q8_0 0.0056 from the .lsm (0.0064 from the GGUF), q5_0 0.042 (0.056).
        (DType::Q8_0, 0.02, 0.03),
        (DType::Q5_0, 0.1, 0.15),
        (DType::F16, 1e-4, 2e-3),
    ] {
        let lsm = dir.path().join(format!("m-{down}.lsm"));
        let opts = lsm::ConvertOptions {
            chunk_neurons: Some(7),
            down_dtype: down,
        };
        lsm::convert(&load_imported(&src).unwrap(), &lsm, &opts, &mut |_, _| {}).unwrap();
        let (gguf, report) = export(&lsm);
        let from_lsm = max_diff(&logits(&lsm), &logits(&gguf));
        let from_source = max_diff(&want, &logits(&gguf));
        eprintln!(
            "{down}: down change {:.2e} (rms {:.2e}); logits vs .lsm {from_lsm:.4}, vs source \
             {from_source:.4}",
            report.down_max_abs_change, report.down_rms_rel_change
        );
        assert!(from_lsm < to_lsm, "{down}: vs .lsm {from_lsm}");
        assert!(
            from_source < to_source,
            "{down}: vs source GGUF {from_source}"
        );
        if down == DType::F16 {
            assert_eq!(report.down_max_abs_change, 0.0);
        } else {
            assert!(report.down_max_abs_change > 0.0, "{report:?}");
        }

        // Everything but the FFN down is the source's, byte for byte; the vocabulary too.
        let out = GgufModel::read(&gguf).unwrap();
        assert_eq!(out.config, source.config);
        assert_eq!(out.vocab.tokens, source.vocab.tokens);
        assert_eq!(out.vocab.token_types, source.vocab.token_types);
        assert_eq!(out.vocab.merges, source.vocab.merges);
        assert_eq!(out.vocab.pre, source.vocab.pre);
        assert_eq!(out.chat_template, source.chat_template);
        assert_eq!(out.tensors.len(), source.tensors.len());
        for (name, t) in &source.tensors {
            let o = &out.tensors[name];
            assert_eq!(o.shape, t.shape, "{name}");
            if name.ends_with("ffn_down.weight") {
                assert_eq!(o.dtype, down, "{name}");
            } else {
                assert_eq!(o.dtype, t.dtype, "{name}");
                assert!(o.data.as_slice() == t.data.as_slice(), "{name} differs");
            }
        }
    }
}

#[test]
fn hugging_face_order_q_k_rows_are_permuted_for_llama_cpp() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tiny = TinyLlama::new(5);
    let gguf_src = dir.path().join("src.gguf");
    tiny.write_gguf(&gguf_src, DType::F32).unwrap();
    let hf = dir.path().join("hf");
    safetensors::write_tiny_dir(&hf, &tiny, DType::F32).unwrap();
    let lsm = dir.path().join("hf.lsm");
    let opts = lsm::ConvertOptions {
        chunk_neurons: Some(16),
        down_dtype: DType::F32,
    };
    lsm::convert(&load_imported(&hf).unwrap(), &lsm, &opts, &mut |_, _| {}).unwrap();
    let (gguf, report) = export(&lsm);
    assert!(report.permuted_qk);
    // The tensors are those llama.cpp's converter writes from the same weights.
    let (want, got) = (
        GgufModel::read(&gguf_src).unwrap(),
        GgufModel::read(&gguf).unwrap(),
    );
    for name in [
        "blk.0.attn_q.weight",
        "blk.1.attn_k.weight",
        "blk.0.ffn_down.weight",
    ] {
        assert!(
            want.tensors[name].data.as_slice() == got.tensors[name].data.as_slice(),
            "{name}"
        );
    }
    let d = max_diff(&logits(&gguf_src), &logits(&gguf));
    assert!(d < 1e-4, "HF-order .lsm exported vs the GGUF: {d}");
}

#[test]
fn qwen_flavours_export_and_gemma_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in [TinyArch::Qwen2, TinyArch::Qwen3] {
        let src = dir.path().join(format!("{arch:?}.gguf"));
        let lsm = dir.path().join(format!("{arch:?}.lsm"));
        TinyLlama::with_arch(4, arch)
            .write_gguf(&src, DType::Q8_0)
            .unwrap();
        let opts = lsm::ConvertOptions {
            chunk_neurons: Some(16),
            down_dtype: DType::F16,
        };
        lsm::convert(&load_imported(&src).unwrap(), &lsm, &opts, &mut |_, _| {}).unwrap();
        let (gguf, report) = export(&lsm);
        assert_eq!(report.architecture, arch.name());
        let d = max_diff(&logits(&lsm), &logits(&gguf));
        assert!(d < 1e-4, "{arch:?}: {d}");
    }
    let src = dir.path().join("gemma.gguf");
    let lsm = dir.path().join("gemma.lsm");
    leanstream_engine::testing::tiny_lsm_of(TinyArch::Gemma3, 1, &src, &lsm).unwrap();
    let out = dir.path().join("gemma-out.gguf");
    let e = export_gguf(&lsm, &out, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gemma.lsm") && e.contains("architecture `gemma3`") && e.contains("llama"),
        "{e}"
    );
    assert!(!out.exists() && !partial_path(&out).exists());
}

#[test]
fn damaged_or_foreign_input_is_refused_without_leaving_a_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lsm = dir.path().join("tiny.lsm");
    leanstream_engine::testing::tiny_lsm(9, &dir.path().join("tiny.gguf"), &lsm).unwrap();
    let good = std::fs::read(&lsm).unwrap();
    let header = LsmFile::parse(Path::new("x"), TensorBytes::from_vec(good.clone()))
        .unwrap()
        .header;
    let out = dir.path().join("out.gguf");
    let fails = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = export_gguf(&p, &out, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains(name), "the error names the input: {e}");
        assert!(!out.exists() && !partial_path(&out).exists(), "{name}");
        e
    };
    let ffn = &header.ffn;
    let mut bad = good.clone();
    bad[(header.streamed.offset + ffn.layer_offsets[1]) as usize + ffn.chunk_bytes + 3] ^= 1;
    let e = fails("chunk.lsm", &bad);
    assert!(e.contains("FFN layer 1 chunk 1 checksum mismatch"), "{e}");

    let mut bad = good.clone();
    bad[header.resident.offset as usize + 200] ^= 1;
    let e = fails("resident.lsm", &bad);
    assert!(e.contains("resident section checksum mismatch"), "{e}");

    let e = fails("short.lsm", &good[..good.len() - 5000]);
    assert!(e.contains("truncated"), "{e}");
    let e = fails(
        "tiny.gguf.lsm",
        &std::fs::read(dir.path().join("tiny.gguf")).unwrap(),
    );
    assert!(e.contains("not a LeanStream .lsm file"), "{e}");
    let e = export_gguf(&dir.path().join("missing.lsm"), &out, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing.lsm") && e.contains("No such file"),
        "{e}"
    );

    // An output in a directory that does not exist: an error naming it.
    let e = export_gguf(&lsm, &dir.path().join("no/such/dir/x.gguf"), &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("no/such/dir"), "{e}");
    // Unharmed, the same file exports.
    export(&lsm);
}

/// The real SmolLM2 `.lsm` (q8_0 down columns) exported back: the source GGUF's tokenizer,
/// its non-FFN-down tensors byte for byte, and logits within the down columns' re-encoding.
#[test]
fn real_smollm2_exports_back_to_its_gguf() {
    let lsm = leanstream_engine::testing::real_lsm(DType::Q8_0);
    let dir = tempfile::tempdir().expect("tempdir");
    let gguf = dir.path().join("smollm2.gguf");
    let report = export_gguf(&lsm, &gguf, &mut |_, _| {}).expect("export");
    assert_eq!(report.vocab, 49152);
    assert_eq!((report.tokens_dropped, report.tokens_padded), (0, 0));
    let (src, out) = (
        GgufModel::read(&leanstream_engine::testing::real_model()).unwrap(),
        GgufModel::read(&gguf).unwrap(),
    );
    assert_eq!(out.config, src.config);
    assert!(out.vocab.tokens == src.vocab.tokens && out.vocab.merges == src.vocab.merges);
    assert_eq!(out.vocab.token_types, src.vocab.token_types);
    assert_eq!(
        (out.vocab.pre.as_deref(), out.vocab.bos, out.vocab.eos),
        (src.vocab.pre.as_deref(), src.vocab.bos, src.vocab.eos)
    );
    for (name, t) in &src.tensors {
        if !name.ends_with("ffn_down.weight") {
            assert!(
                out.tensors[name].data.as_slice() == t.data.as_slice(),
                "{name}"
            );
        }
    }
    let first = |path: &Path| {
        let model = Model::load(path).unwrap();
        let ids = model
            .tokenizer
            .encode("Once upon a time, there was a little")
            .unwrap();
        let mut s = Session::new(model, 64, Precision::Exact, KvType::F32).unwrap();
        let mut last = Vec::new();
        for &t in &ids {
            last = s.forward(t).unwrap().to_vec();
        }
        (ids, last)
    };
    let (ids_lsm, from_lsm) = first(&lsm);
    let (ids_gguf, from_gguf) = first(&gguf);
    assert_eq!(ids_lsm, ids_gguf, "the exported tokenizer encodes the same");
    let d = max_diff(
        std::slice::from_ref(&from_lsm),
        std::slice::from_ref(&from_gguf),
    );
    eprintln!(
        "smollm2: down change max {:.2e} rms {:.2e}; next-token logits differ by {d:.4}",
        report.down_max_abs_change, report.down_rms_rel_change
    );
    // Measured 0.35 (down columns changed by 5.5e-3 relative RMS; logits around 17).
    assert!(d < 0.75, "next-token logits differ by {d}");
    let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b]));
    assert_eq!(argmax(&from_lsm), argmax(&from_gguf));
}
