//! Measures this machine's streaming read bandwidth from DRAM with all cores (or the number of
//! threads given), the ceiling for a memory-bound decode step (bytes of weights per token ÷
//! bandwidth = fastest possible token).
//!
//! `cargo run --release -p leanstream-engine --example membw [MiB per thread] [rounds] [threads]`
//! Prints the best and median of the rounds, in GB/s (10^9 bytes).

use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let mib = args.next().and_then(Result::ok).unwrap_or(512);
    let rounds = args.next().and_then(Result::ok).unwrap_or(7);
    let threads = args
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // One buffer per thread, far larger than any cache; filled so its pages are really mapped.
    let bufs: Vec<Vec<u64>> = (0..threads)
        .map(|t| vec![t as u64 + 1; mib << 17])
        .collect();
    let bytes = (threads * (mib << 20)) as f64;
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let start = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = bufs
                .iter()
                .map(|b| {
                    s.spawn(move || {
                        b.chunks_exact(8).fold(0u64, |acc, c| {
                            acc.wrapping_add(c.iter().fold(0, |a, &x| a ^ x))
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        rates.push(bytes / start.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(sums);
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "{threads} threads x {mib} MiB: read bandwidth best {:.2} GB/s, median {:.2} GB/s",
        rates[rates.len() - 1],
        rates[rates.len() / 2]
    );
}
