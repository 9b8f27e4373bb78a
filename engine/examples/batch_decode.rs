//! How much one pass for several conversations gains over running them one by one: for N = 1,
//! 2, 4, 8, 16 sessions of the model, each after the same 8-token prompt, times 24 decode steps
//! through [`forward_each`] (one pass over the weights for all N) and 24 × N single-session
//! passes, and prints both rates. A benchmark, not a test.
//!
//! `cargo run --release -p leanstream-engine --example batch_decode [MODEL] [exact|fast]`
//! (MODEL defaults to `models/SmolLM2-135M-Instruct.Q4_1.gguf`).

use std::path::PathBuf;
use std::time::Instant;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session, forward_each};
use leanstream_engine::kv::KvType;

const STEPS: usize = 24;

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
    let model = Model::load(&path)?;
    println!(
        "{}: {precision:?} precision, {} compute threads, {STEPS} steps",
        path.display(),
        rayon::current_num_threads()
    );
    println!(
        "{:>3} | {:>13} | {:>13} | {:>6}",
        "N", "batched tok/s", "one by one", "gain"
    );
    for n in [1usize, 2, 4, 8, 16] {
        let mut sessions = (0..n)
            .map(|_| Session::new(model.clone(), 256, precision, KvType::F16))
            .collect::<leanstream_engine::Result<Vec<Session>>>()?;
        for s in &mut sessions {
            s.forward_batch(&[1, 2, 3, 4, 5, 6, 7, 8])?;
        }
        let tokens: Vec<&[u32]> = vec![&[42]; n];
        let start = Instant::now();
        for _ in 0..STEPS {
            let mut all: Vec<&mut Session> = sessions.iter_mut().collect();
            forward_each(&mut all, &tokens)?;
        }
        let batched = (n * STEPS) as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        for _ in 0..STEPS {
            for s in &mut sessions {
                s.forward(42)?;
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
