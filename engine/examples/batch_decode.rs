//! How much one pass for several conversations gains over running them one by one: for N = 1,
//! 2, 4, 8, 16 sessions of the model, each after an 8-token prompt of its own, times 24 decode
//! steps (each session feeding a token of its own) through one pass for all N and 24 × N
//! single-session passes, and prints both rates. A benchmark, not a test.
//!
//! `cargo run --release -p leanstream-engine --example batch_decode [MODEL] [exact|fast] [MODE]`
//!
//! MODEL defaults to `models/SmolLM2-135M-Instruct.Q4_1.gguf`, run dense ([`forward_each`]).
//! A calibrated `.lsm` file runs through a sparse pipeline ([`forward_each_with`]): MODE
//! `leanstream` (the default), `prefetch`, `on-demand` or `mmap`, with the low-rank predictor and
//! a neuron cache of half the streamed FFN, so that reads go on while it runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session, forward_each, forward_each_with};
use leanstream_engine::kv::KvType;
use leanstream_engine::model::lsm::PredictorKind;
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, SparseModel};

const STEPS: usize = 24;

/// How the FFN runs: the dense pass, or a sparse pipeline.
enum Ffn {
    Dense,
    Sparse(Box<Executor>),
}

impl Ffn {
    /// One pass advancing every session of `all` by its piece.
    fn together(
        &mut self,
        all: &mut [&mut Session],
        pieces: &[&[u32]],
    ) -> leanstream_engine::Result<()> {
        match self {
            Ffn::Dense => forward_each(all, pieces),
            Ffn::Sparse(exec) => forward_each_with(all, pieces, exec.as_mut()),
        }
    }

    /// One pass for `token` on `s` alone (what a scheduler without cross-session batching runs).
    fn alone(&mut self, s: &mut Session, token: u32) -> leanstream_engine::Result<()> {
        match self {
            Ffn::Dense => s.forward(token).map(|_| ()),
            Ffn::Sparse(exec) => s.forward_with(token, exec.as_mut()).map(|_| ()),
        }
    }
}

fn main() -> leanstream_engine::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().map_or_else(
        || PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    let precision = match args.next().as_deref() {
        Some("fast") => Precision::Fast,
        _ => Precision::Exact,
    };
    let (model, mut ffn, label) = if path.extension().is_some_and(|e| e == "lsm") {
        let mode: Mode = args
            .next()
            .as_deref()
            .unwrap_or("leanstream")
            .parse()
            .map_err(|reason| leanstream_engine::Error::InvalidArgument {
                arg: "MODE",
                reason,
            })?;
        let sm = SparseModel::open_for_mode(&path, mode, true)?;
        let cache_bytes = sm.layout.streamed_bytes() / 2;
        let opts = ExecutorOptions {
            mode,
            policy: None,
            cache_bytes,
            io_threads: 2,
            io_gap_bytes: leanstream_engine::io::DEFAULT_MAX_GAP_BYTES,
            precision,
            predictor: Some(PredictorKind::LowRank),
            verify_chunks: true,
        };
        let exec = Executor::new(&sm, opts)?;
        let label = format!("{mode}, cache {} MiB", cache_bytes >> 20);
        (Arc::clone(&sm.model), Ffn::Sparse(Box::new(exec)), label)
    } else {
        (Model::load(&path)?, Ffn::Dense, "dense".to_string())
    };
    println!(
        "{}: {label}, {precision:?} precision, {} compute threads, {STEPS} steps",
        path.display(),
        leanstream_engine::backend::cpu::compute_threads()
    );
    println!(
        "{:>3} | {:>13} | {:>13} | {:>6}",
        "N", "batched tok/s", "one by one", "gain"
    );
    for n in [1usize, 2, 4, 8, 16] {
        let mut sessions = (0..n)
            .map(|_| Session::new(model.clone(), 256, precision, KvType::F16))
            .collect::<leanstream_engine::Result<Vec<Session>>>()?;
        // Different conversations select different chunks in a sparse mode.
        for (i, s) in sessions.iter_mut().enumerate() {
            let prompt: Vec<u32> = (0..8).map(|k| (100 + 37 * i + 5 * k) as u32).collect();
            ffn.together(&mut [s], &[&prompt])?;
        }
        let own: Vec<[u32; 1]> = (0..n).map(|i| [(500 + 13 * i) as u32]).collect();
        let tokens: Vec<&[u32]> = own.iter().map(|t| t.as_slice()).collect();
        let start = Instant::now();
        for _ in 0..STEPS {
            let mut all: Vec<&mut Session> = sessions.iter_mut().collect();
            ffn.together(&mut all, &tokens)?;
        }
        let batched = (n * STEPS) as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        for _ in 0..STEPS {
            for (s, token) in sessions.iter_mut().zip(&own) {
                ffn.alone(s, token[0])?;
            }
        }
        let alone = (n * STEPS) as f64 / start.elapsed().as_secs_f64();
        println!(
            "{n:>3} | {batched:>13.1} | {alone:>13.1} | {:>5.2}x",
            batched / alone
        );
    }
    Ok(())
}
