//! Runs the bench: one cold run per mode and budget.

use std::sync::Arc;
use std::time::Instant;

use super::disk::{self, DiskBandwidth, ProbeOptions};
use super::{BenchConfig, BenchRow};
use crate::backend::select::Backend;
use crate::forward::{Decode, FfnExecutor, Model};
use crate::model::lsm::LsmFile;
use crate::pipeline::{
    Executor, ExecutorOptions, Mode, PipelineStats, Policy, SparseModel, open_decoder,
};
use crate::process;
use crate::sample::argmax;
use crate::{Error, Result};

/// What one run produced besides its row: the generated ids (for agreement) and the held-out
/// perplexity (for `nll_delta`).
struct RunOutput {
    row: BenchRow,
    generated: Vec<Vec<u32>>,
}

/// One pipeline to drive: the dense forward pass (CPU or GPU), or a session plus a sparse FFN.
struct Runner {
    decoder: Box<dyn Decode>,
    exec: Option<Executor>,
}

impl Runner {
    /// The runner of `backend` for `model`, with room for `ctx` tokens.
    fn new(
        backend: Backend,
        model: &Arc<Model>,
        ctx: usize,
        precision: crate::backend::cpu::Precision,
        mut exec: Option<Executor>,
    ) -> Result<Runner> {
        let decoder = open_decoder(
            backend,
            model,
            ctx,
            precision,
            crate::kv::KvType::default(),
            exec.as_mut(),
        )?;
        Ok(Runner { decoder, exec })
    }

    fn step(&mut self, token: u32) -> Result<&mut [f32]> {
        match &mut self.exec {
            Some(e) => self.decoder.forward_with(token, e as &mut dyn FfnExecutor),
            None => self.decoder.forward(token),
        }
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<u32> {
        let logits = match &mut self.exec {
            Some(e) => {
                let (last, rest) = tokens.split_last().expect("prompts are never empty");
                for &t in rest {
                    self.decoder.forward_with(t, e)?;
                }
                self.decoder.forward_with(*last, e)?
            }
            None => self.decoder.forward_batch(tokens)?,
        };
        Ok(argmax(logits))
    }

    fn stats(&self) -> PipelineStats {
        self.exec.as_ref().map(Executor::stats).unwrap_or_default()
    }
}

/// Runs every configured mode and budget, calling `progress` with a line per run. `dense` always
/// runs first (and is reported only if asked for) because the others are compared with it.
pub fn run(cfg: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<Vec<BenchRow>> {
    if cfg.prompts.is_empty() || cfg.tokens == 0 {
        return Err(Error::InvalidArgument {
            arg: "prompts",
            reason: "need at least one prompt and one token to decode".into(),
        });
    }
    if cfg.backend == Backend::Cuda && cfg.modes.contains(&Mode::Mmap) {
        return Err(Error::InvalidArgument {
            arg: "modes",
            reason: "mmap has no CUDA path; leave it out of --modes or use --backend cpu".into(),
        });
    }
    /// A mode, its budget, and the ablation step it runs (if any).
    type Planned = (Mode, Option<f64>, Option<(&'static str, Policy)>);
    let mut plan: Vec<Planned> = Vec::new();
    for &mode in &cfg.modes {
        if mode.uses_cache() {
            plan.extend(cfg.budgets.iter().map(|&b| (mode, Some(b), None)));
        } else if mode != Mode::Dense {
            plan.push((mode, None, None));
        }
    }
    if let Some(b) = cfg.ablation_budget {
        for step in Policy::ablation() {
            plan.push((Mode::LeanStream, Some(b), Some(step)));
        }
    }
    let disk = if cfg.disk_probe && plan.iter().any(|p| p.0.uses_cache()) {
        progress("disk probe");
        Some(probe_disk(cfg)?)
    } else {
        None
    };
    progress("dense (reference)");
    let dense = run_one(cfg, Mode::Dense, None, None, None)?;
    let mut rows = Vec::new();
    if cfg.modes.contains(&Mode::Dense) {
        rows.push(dense.row.clone());
    }
    for (mode, budget, ablation) in plan {
        let name = match ablation {
            Some((step, _)) => format!("leanstream[{step}]"),
            None => mode.name().to_string(),
        };
        progress(&match budget {
            Some(b) => format!("{name} at {:.0} % FFN budget", b * 100.0),
            None => name.clone(),
        });
        let mut out = run_one(cfg, mode, budget, ablation.map(|a| a.1), Some(&dense))?;
        out.row.mode = name;
        if let Some(bw) = disk.as_ref().filter(|_| mode.uses_cache()) {
            let r = &mut out.row;
            r.disk_bandwidth = Some(bw.bytes_per_s);
            r.disk_busy_share = r.io_bytes_per_s.map(|io| io / bw.bytes_per_s);
            r.storage_bound_tok_s = r
                .missing_bytes_per_token
                .filter(|&m| m > 0.0)
                .map(|m| bw.bytes_per_s / m);
        }
        rows.push(out.row);
    }
    Ok(rows)
}

/// Probes the disk on the model file's streamed section, at the I/O pool's queue depth.
pub fn probe_disk(cfg: &BenchConfig) -> Result<DiskBandwidth> {
    let f = LsmFile::parse(&cfg.model, crate::model::map_file(&cfg.model)?)?;
    let s = &f.header.streamed;
    let opts = ProbeOptions {
        queue_depth: cfg.io_threads.max(1),
        ..ProbeOptions::default()
    };
    disk::probe(&cfg.model, s.offset..s.offset + s.len, &opts)
}

fn run_one(
    cfg: &BenchConfig,
    mode: Mode,
    budget: Option<f64>,
    policy: Option<Policy>,
    dense: Option<&RunOutput>,
) -> Result<RunOutput> {
    process::drop_page_cache(&cfg.model);
    process::reset_peak_rss();
    let mut chunk_bytes = 0usize;
    let (model, exec) = if mode == Mode::Dense {
        (Model::load(&cfg.model)?, None)
    } else {
        let sm = SparseModel::open_for_mode(&cfg.model, mode, true)?;
        chunk_bytes = sm.layout.chunk_bytes;
        let cache_bytes = budget.map_or(0, |b| (b * sm.layout.streamed_bytes() as f64) as usize);
        let exec = Executor::new(
            &sm,
            ExecutorOptions {
                mode,
                policy,
                cache_bytes,
                io_threads: cfg.io_threads,
                io_gap_bytes: cfg.io_gap_bytes,
                precision: cfg.precision,
                predictor: Some(cfg.predictor),
                verify_chunks: cfg.verify_chunks,
            },
        )?;
        (Arc::clone(&sm.model), Some(exec))
    };
    let tok = &model.tokenizer;
    let prompts: Vec<Vec<u32>> = cfg
        .prompts
        .iter()
        .map(|p| tok.encode(p))
        .collect::<Result<_>>()?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let ctx = (longest + cfg.tokens + 1).max(cfg.heldout_tokens + 1);
    let mut runner = Runner::new(cfg.backend, &model, ctx, cfg.precision, exec)?;

    let (mut decode_s, mut prefill_s, mut prefill_tokens) = (0.0, 0.0, 0usize);
    let (mut decoded, mut read_bytes) = (0u64, 0u64);
    let mut stats = PipelineStats::default();
    let mut generated = Vec::new();
    for p in &prompts {
        if p.is_empty() {
            continue;
        }
        runner.decoder.reset();
        let t = Instant::now();
        let mut next = runner.prefill(p)?;
        prefill_s += t.elapsed().as_secs_f64();
        prefill_tokens += p.len();
        let (before, read_before) = (runner.stats(), process::storage_read_bytes());
        let mut ids = vec![next];
        let t = Instant::now();
        for _ in 1..cfg.tokens {
            next = argmax(runner.step(next)?);
            ids.push(next);
        }
        decode_s += t.elapsed().as_secs_f64();
        read_bytes += process::storage_read_bytes().saturating_sub(read_before);
        stats.add(&runner.stats().since(&before));
        decoded += cfg.tokens.saturating_sub(1) as u64;
        generated.push(ids);
    }
    let peak_rss_bytes = process::peak_rss_bytes();

    // Held-out perplexity and recall: teacher-forced, untimed.
    if let Some(e) = &mut runner.exec {
        e.reset_stats();
        e.measure_recall(true);
    }
    let held = tok.encode(&cfg.heldout)?;
    let held = &held[..held.len().min(cfg.heldout_tokens + 1)];
    runner.decoder.reset();
    let mut nll = 0.0f64;
    for pair in held.windows(2) {
        nll += crate::generate::token_nll(runner.step(pair[0])?, pair[1]);
    }
    let perplexity = (nll / held.len().saturating_sub(1).max(1) as f64).exp();
    let recall_stats = runner.stats();

    let sparse = runner.exec.is_some();
    let cache = runner.exec.as_ref().is_some_and(|e| e.cache_bytes() > 0);
    let per_token_neurons = (model.weights.config.n_ff * model.weights.config.n_layers) as f64;
    let agreement = dense.map_or(1.0, |d| agreement(&d.generated, &generated));
    let row = BenchRow {
        mode: mode.name().to_string(),
        backend: cfg.backend.name().to_string(),
        device_bytes: runner.decoder.device_bytes(),
        ffn_budget: budget,
        decode_tokens_per_s: decoded as f64 / decode_s.max(1e-9),
        prefill_tokens_per_s: prefill_tokens as f64 / prefill_s.max(1e-9),
        peak_rss_bytes,
        bytes_read_per_token: read_bytes as f64 / decoded.max(1) as f64,
        cache_miss_ratio: cache.then(|| stats.miss_ratio()),
        redundant_read_fraction: cache.then(|| stats.redundant_fraction()),
        io_wait_fraction: cache.then(|| stats.io_wait_ns as f64 * 1e-9 / decode_s.max(1e-9)),
        predictor_recall: sparse.then(|| recall_stats.recall()),
        greedy_agreement: agreement,
        nll_delta: dense.map_or(0.0, |d| perplexity / d.row.perplexity - 1.0),
        perplexity,
        cache_bytes: cache.then(|| runner.exec.as_ref().map_or(0, |e| e.cache_bytes() as u64)),
        computed_fraction: sparse.then(|| {
            stats.computed_neurons as f64 / (stats.tokens.max(1) as f64 * per_token_neurons)
        }),
        tokens_decoded: decoded,
        io_bytes_per_s: cache.then(|| stats.bytes_read as f64 / decode_s.max(1e-9)),
        missing_bytes_per_token: cache
            .then(|| (stats.misses * chunk_bytes as u64) as f64 / stats.tokens.max(1) as f64),
        // Filled in by `run` from the one disk probe.
        disk_bandwidth: None,
        disk_busy_share: None,
        storage_bound_tok_s: None,
    };
    Ok(RunOutput { row, generated })
}

/// Share of positions where two runs generated the same token.
fn agreement(reference: &[Vec<u32>], run: &[Vec<u32>]) -> f64 {
    let (mut same, mut total) = (0usize, 0usize);
    for (a, b) in reference.iter().zip(run) {
        total += a.len().max(b.len());
        same += a.iter().zip(b).filter(|(x, y)| x == y).count();
    }
    if total == 0 {
        1.0
    } else {
        same as f64 / total as f64
    }
}
