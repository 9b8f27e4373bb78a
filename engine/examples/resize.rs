//! Times elastic neuron-cache resizes and the decode speed at each size: a cache of 50 % of the
//! streamed FFN, shrunk to 5 %, grown back to 50 %, with a few tokens generated at each size.
//!
//! `cargo run --release -p leanstream-engine --example resize -- MODEL [MODE] [TOKENS]`
//!
//! `MODEL` is a `.lsm` file (calibrated or not: an uncalibrated one runs with sparsity off) or a
//! `.gguf`, converted first to a `.lsm` beside the system's temporary files. `MODE` is one of
//! `on-demand`, `prefetch`, `leanstream` (default); `TOKENS` per size defaults to 16. Prints the
//! time of each resize, the cache's resident pages after it (`mincore`), and tok/s per size.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::Session;
use leanstream_engine::kv::KvType;
use leanstream_engine::model::lsm::PredictorKind;
use leanstream_engine::model::{load_imported, lsm};
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, SparseModel};
use leanstream_engine::sample::argmax;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(model) = args.next().map(PathBuf::from) else {
        bail!("usage: resize MODEL [MODE] [TOKENS]");
    };
    let mode: Mode = args
        .next()
        .unwrap_or_else(|| "leanstream".into())
        .parse()
        .map_err(anyhow::Error::msg)?;
    let tokens: usize = args.next().map_or(Ok(16), |t| t.parse())?;
    if !mode.uses_cache() {
        bail!("{mode} has no neuron cache to resize");
    }
    let path = if model.extension().is_some_and(|e| e == "gguf") {
        let out = std::env::temp_dir().join("leanstream-resize-example.lsm");
        if !out.exists() {
            eprintln!("converting {} to {}", model.display(), out.display());
            lsm::convert(
                &load_imported(&model)?,
                &out,
                &lsm::ConvertOptions::default(),
                &mut |_, _| {},
            )?;
        }
        out
    } else {
        model
    };
    let sm = SparseModel::open(&path, false).with_context(|| path.display().to_string())?;
    let calibrated = sm.sparsity > 0.0;
    let streamed = sm.layout.streamed_bytes();
    let share = |p: usize| streamed * p / 100;
    let exec = Executor::new(
        &sm,
        ExecutorOptions {
            mode,
            policy: None,
            cache_bytes: share(50),
            io_threads: 4,
            io_gap_bytes: leanstream_engine::io::DEFAULT_MAX_GAP_BYTES,
            precision: Precision::Fast,
            predictor: calibrated.then_some(PredictorKind::LowRank),
            verify_chunks: true,
        },
    )?;
    let mut exec = exec;
    println!(
        "{}: {mode}, sparsity {}, streamed FFN {} MiB, floor {} KiB",
        path.display(),
        if calibrated { "calibrated" } else { "off" },
        streamed >> 20,
        exec.cache_floor_bytes() >> 10
    );
    let mut session = Session::new(
        Arc::clone(&sm.model),
        512,
        Precision::Fast,
        KvType::default(),
    )?;
    let mut next = argmax(session.forward_batch(&[1, 2, 3])?);
    decode(&mut session, &mut exec, &mut next, tokens)?; // warm the cache at 50 %
    let tok_s = decode(&mut session, &mut exec, &mut next, tokens)?;
    report("50 %", &exec, tok_s);
    for (label, p) in [("5 %", 5), ("50 %", 50)] {
        let t = Instant::now();
        let held = exec.resize_cache(share(p))?;
        let took = t.elapsed();
        println!(
            "resize to {label}: {:.3} ms, holds {} KiB",
            took.as_secs_f64() * 1e3,
            held >> 10
        );
        let tok_s = decode(&mut session, &mut exec, &mut next, tokens)?;
        report(label, &exec, tok_s);
    }
    Ok(())
}

/// Generates `n` greedy tokens through `exec`; returns tok/s.
fn decode(
    session: &mut Session,
    exec: &mut Executor,
    next: &mut u32,
    n: usize,
) -> anyhow::Result<f64> {
    let t = Instant::now();
    for _ in 0..n {
        *next = argmax(session.forward_with(*next, exec)?);
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

fn report(label: &str, exec: &Executor, tok_s: f64) {
    let resident = match exec {
        Executor::Streaming(e) => e.cache().measured_resident_bytes().unwrap_or(0),
        Executor::Mmap(_) => 0,
    };
    println!(
        "at {label}: {tok_s:.1} tok/s, cache {} KiB, resident {} KiB",
        exec.cache_bytes() >> 10,
        resident >> 10
    );
}
