//! Support shared by the test suites of every crate in the workspace.

pub mod gpu;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::model::gguf::{TinyArch, TinyLlama};
use crate::model::{load_imported, lsm};
use crate::quant::DType;

/// Path of the real test model (SmolLM2-135M-Instruct, Q4_1 GGUF): `$LEANSTREAM_TEST_MODEL`, or
/// `models/SmolLM2-135M-Instruct.Q4_1.gguf` at the workspace root, where `scripts/fetch-model`
/// puts it. Tests need the real model and must fail, not skip, without it: this panics with the
/// fix when the file is missing.
pub fn real_model() -> PathBuf {
    let path = std::env::var_os("LEANSTREAM_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.is_file(),
        "the real test model is missing at {}: run scripts/fetch-model (or set LEANSTREAM_TEST_MODEL)",
        path.display()
    );
    path
}

/// Path of the second real test model (Gemma-3-270M, Q4_K_M GGUF): `$LEANSTREAM_GEMMA_MODEL`,
/// or `models/gemma-3-270m-q4_k_m.gguf` at the workspace root, where `scripts/fetch-model` puts
/// it. Panics with the fix when the file is missing, like [`real_model`].
pub fn gemma_model() -> PathBuf {
    let path = std::env::var_os("LEANSTREAM_GEMMA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/gemma-3-270m-q4_k_m.gguf")
        });
    assert!(
        path.is_file(),
        "the Gemma test model is missing at {}: run scripts/fetch-model (or set \
         LEANSTREAM_GEMMA_MODEL)",
        path.display()
    );
    path
}

/// The real model ([`real_model`]) converted to `.lsm` with default chunking and down columns
/// in `down_dtype`, once per process and down type. F16 columns compute what the GGUF computes
/// to f16 rounding, so the tests that hold a `.lsm` to the GGUF's fixtures use them; the default
/// q8_0 changes the story prompt's 13th greedy token and costs about 1 % held-out perplexity on
/// 256 tokens.
///
/// The file is `smollm2-<type>.lsm` in the `test-models` folder of the target directory the
/// running test binary sits in (`<target>/<profile>/deps/<binary>`), written under a temporary
/// name and renamed into place: every run converts anew (no stale file after a format change),
/// concurrent binaries never see half a file, and a run leaves one file per type behind, not a
/// 140 MB temporary directory per test binary in `/tmp` (a static is never dropped, so a
/// `TempDir` held by one would never be removed). Panics with the reason when conversion fails.
pub fn real_lsm(down_dtype: DType) -> PathBuf {
    static CONVERTED: Mutex<Vec<(DType, PathBuf)>> = Mutex::new(Vec::new());
    let mut converted = CONVERTED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = converted.iter().find(|(t, _)| *t == down_dtype) {
        return path.clone();
    }
    let dir = test_models_dir();
    let out = dir.join(format!("smollm2-{down_dtype}.lsm"));
    let partial = dir.join(format!(
        "smollm2-{down_dtype}.lsm.{}.partial",
        std::process::id()
    ));
    let opts = lsm::ConvertOptions {
        down_dtype,
        ..Default::default()
    };
    let written = load_imported(&real_model())
        .and_then(|model| lsm::convert(&model, &partial, &opts, &mut |_, _| {}))
        .and_then(|_report| {
            std::fs::rename(&partial, &out).map_err(|source| crate::Error::Io {
                path: out.clone(),
                source,
            })
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&partial);
        panic!("converting the real model to {}: {e}", out.display());
    }
    converted.push((down_dtype, out.clone()));
    out
}

/// `<target>/test-models` for a binary at `<target>/<profile>/deps/<binary>` (made if missing);
/// the system's temporary directory for a binary elsewhere.
fn test_models_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe
        .ancestors()
        .nth(3)
        .filter(|_| exe.parent().is_some_and(|d| d.ends_with("deps")))
        .map(|target| target.join("test-models"))
        .unwrap_or_else(|| std::env::temp_dir().join("leanstream-test-models"));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!("creating {}: {e}", dir.display());
    }
    dir
}

/// Writes the tiny Llama of `seed` as a Q4_1 GGUF at `gguf`, then converts it with 16-neuron
/// chunks (8 chunks per layer) into `out`: the small `.lsm` the format, calibration and daemon
/// tests share.
pub fn tiny_lsm(seed: u64, gguf: &Path, out: &Path) -> crate::Result<()> {
    tiny_lsm_of(TinyArch::Llama, seed, gguf, out)
}

/// [`tiny_lsm`] of another flavour (Gemma 3's GeGLU, post-norms and sliding window, …).
pub fn tiny_lsm_of(arch: TinyArch, seed: u64, gguf: &Path, out: &Path) -> crate::Result<()> {
    TinyLlama::with_arch(seed, arch).write_gguf(gguf, DType::Q4_1)?;
    let opts = lsm::ConvertOptions {
        chunk_neurons: Some(16),
        ..Default::default()
    };
    lsm::convert(&load_imported(gguf)?, out, &opts, &mut |_, _| {})?;
    Ok(())
}

/// Pipeline options for tests: the exact path, sparsity off (no predictor: every chunk of every
/// layer is computed), two I/O threads, chunk verification on, a cache of `cache_bytes`.
pub fn exact_options(
    mode: crate::pipeline::Mode,
    cache_bytes: usize,
) -> crate::pipeline::ExecutorOptions {
    crate::pipeline::ExecutorOptions {
        mode,
        policy: None,
        cache_bytes,
        io_threads: 2,
        io_gap_bytes: crate::io::DEFAULT_MAX_GAP_BYTES,
        precision: crate::backend::cpu::Precision::Exact,
        predictor: None,
        verify_chunks: true,
    }
}

/// The smallest budget whose plan for `model` with sessions of `context` tokens `wanted`
/// accepts, scanning up from the floor in pages: a test's way to get a plan of a given shape.
pub fn budget_for(
    model: &crate::forward::Model,
    context: usize,
    wanted: impl Fn(&crate::plan::Plan) -> bool,
) -> u64 {
    use crate::plan::{Floor, Plan};
    let floor = Floor::of(model, context, crate::kv::KvType::default());
    let mut b = floor.total();
    loop {
        if let Ok(p) = Plan::in_pieces(&model.weights, b, floor, model.piece_bytes)
            && wanted(&p)
        {
            return b;
        }
        b += 4096;
        assert!(b < floor.total() + (64 << 20), "no budget gives that plan");
    }
}
