//! `leanstream synth`: writes a **synthetic** `.lsm` file with the shapes of a real model (e.g.
//! Llama-2-7B) whose weights are **seeded random values with planted activation statistics**, not
//! a trained model. It exists to exercise the streaming pipeline at a realistic scale (a file
//! several times larger than the cache budget) on a machine that cannot calibrate a 7B model.
//! Text generated from it is meaningless; its quality figures (perplexity, agreement) are too.
//!
//! What is planted, so that the sparse pipeline behaves like on a calibrated sparse model:
//!
//! - **Residual stream.** Every token embedding is `cos θ·√d·ĉ + sin θ·n_t` (`ĉ` one unit
//!   direction shared by all tokens, `n_t` seeded noise of unit variance); attention and FFN
//!   outputs are kept small (`ATTN_OUT`, `FFN_OUT` of the stream's RMS), so every layer's
//!   normalised input stays close to that form. The output head is orthogonal to `ĉ`, so greedy
//!   decoding walks through varied tokens instead of repeating one.
//! - **Gate rows** = planted low-rank part + noise: along `ĉ` a per-neuron bias (the constant
//!   part of the gate pre-activation), in `rank − 1` further orthonormal directions a random
//!   token-varying part of scale `σ`, plus noise `η·σ` outside the predictor's reach. The
//!   per-neuron biases follow [`plant`]'s probit-normal model: activation frequencies are skewed
//!   (`skew`: hot and cold neurons) and average to `1 − sparsity`.
//! - **Up rows** are `±1` along `ĉ` (5 % spread), so `|h| = |silu(gate·x)·(up·x)|` crosses the
//!   threshold about when the gate does. **Down columns** are small seeded noise.
//! - **Neuron order**: hot neurons first (stored order is sorted by planted frequency, as
//!   `calibrate` (which reorders by default) leaves a real model), so hot neurons share chunks.
//! - **Calibration section** (no dense calibration run): thresholds `silu(τ)`; per-neuron planted
//!   frequencies and simulated mean `|h|`; the **low-rank predictor is the planted subspace**
//!   (`v` = the planted directions, `us` = the projections of the stored, Q4-rounded gate rows
//!   on them), with cut-offs set for the target recall by simulating the planted distribution.
//!   `heldout_recall` and `heldout_fetch_fraction` in the file are those simulated figures; the
//!   bench measures the real ones. Per neuron, the probability that the predictor selects it
//!   (`select.{l}`, exact under the planted model: [`plant::p_abs_silu_at_least`]), and per layer
//!   a simulated quality cost (`quality_cost`: relative error of the FFN output run sparsely,
//!   down columns taken as independent).
//! - **Token correlation** (optional, [`SynthOptions::token_correlation`], module [`carry`]):
//!   attention planted so that the token-varying residual stream is an AR(1) process across
//!   positions, for a target carry-over of active neurons between consecutive tokens. Only the
//!   attention tensors change; the per-token statistics, and so the calibration section, are
//!   those of the independent model.
//!
//! What is not realistic: without token correlation, consecutive tokens' activations are
//! independent given the neurons' frequencies (real models carry over 82–85 % of active neurons;
//! here the expected carry-over is `E[p²]/E[p]`, reported by [`SynthReport::carry_over`]); with
//! it, the first positions of a context and the first layer(s) fall short of the target (see
//! [`carry`]); every layer has the same statistics.
//!
//! Writing streams: one tensor or one FFN layer (~100 MB for 7B) is in memory at a time; rows
//! are generated in parallel (rayon), each from its own seeded stream, so the file depends on
//! the seed only.
//!
//! Dependencies point one way: this generator uses the format (`super`) and the leaf
//! [`crate::sparsity`] (cut-offs, recall counting), never `crate::predict`: the planted low-rank
//! predictor is written as tensors and a [`PredictorMeta`] that `predict::load` reads back.

mod carry;
mod plant;
mod vocab;
mod weights;

use std::path::Path;

use rayon::prelude::*;

use self::carry::Carry;
use self::plant::{LayerSim, Plant, Rng, simulate_layer};
pub use self::vocab::SynthTokenizer;
use self::weights::{
    Basis, FFN_OUT, LayerPlan, NeuronOut, RowKind, SIN_THETA, TAG_BETA, TAG_DIR, TAG_SIM,
    directions, resident_tensor, resident_tensors, unit,
};
use super::calibration::{
    CalDType, CalTensor, CalTensorEntry, Calibration, PredictorKind, PredictorMeta,
};
use super::write::{Out, align_up, commit};
use super::{DownError, FfnLayout, Header, PREAMBLE_LEN, Section, TensorEntry};
use crate::model::{Architecture, FfnActivation, ModelConfig, RopeStyle};
use crate::quant::DType;
use crate::{Error, Result};

/// Model dimensions of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthShape {
    pub name: &'static str,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab_size: usize,
    pub context_length: usize,
}

impl SynthShape {
    /// Llama-2-7B: 32 layers, d 4096, FFN 11008, 32 heads (no GQA), vocabulary 32000.
    pub const LLAMA_7B: SynthShape = SynthShape {
        name: "llama-7b",
        n_layers: 32,
        d_model: 4096,
        n_ff: 11008,
        n_heads: 32,
        n_kv_heads: 32,
        vocab_size: 32000,
        context_length: 4096,
    };
    /// SmolLM2-135M: 30 layers, d 576, FFN 1536, 9 heads / 3 KV heads, vocabulary 49152 (the
    /// GPU device check generates it where the real file cannot travel).
    pub const SMOLLM2_135M: SynthShape = SynthShape {
        name: "smollm2-135m",
        n_layers: 30,
        d_model: 576,
        n_ff: 1536,
        n_heads: 9,
        n_kv_heads: 3,
        vocab_size: 49152,
        context_length: 2048,
    };
    /// For tests: 2 layers, d 128, FFN 512, 4 heads / 2 KV heads, the 128-token tiny vocabulary.
    pub const TINY: SynthShape = SynthShape {
        name: "tiny",
        n_layers: 2,
        d_model: 128,
        n_ff: 512,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: 128,
        context_length: 256,
    };
    /// Every shape, by name.
    pub const ALL: [SynthShape; 3] = [
        SynthShape::LLAMA_7B,
        SynthShape::SMOLLM2_135M,
        SynthShape::TINY,
    ];

    /// The model config (Llama: SwiGLU, RMSNorm eps 1e-5, RoPE base 10000 on adjacent pairs as in
    /// GGUF, untied output head).
    pub fn config(&self) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            n_layers: self.n_layers,
            d_model: self.d_model,
            n_ff: self.n_ff,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.d_model / self.n_heads,
            vocab_size: self.vocab_size,
            context_length: self.context_length,
            rope_base: 10000.0,
            rope_style: RopeStyle::AdjacentPairs,
            rms_eps: 1e-5,
            activation: FfnActivation::Silu,
            tied_embeddings: false,
            ..ModelConfig::without_features()
        }
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub shape: SynthShape,
    pub seed: u64,
    /// Target share of inactive neuron-tokens (`|h|` below the threshold), in (0, 1). Default 0.4.
    pub sparsity: f32,
    /// Spread of the neurons' activation propensities (probit scale): 0 makes every neuron
    /// equally likely to fire, 1.5 (default) gives a strongly hot/cold population.
    pub skew: f32,
    /// Planted gate noise outside the predictor's subspace, relative to the part inside it.
    /// Default 0.25 (Q4 rounding adds to it; the effective figure is in the report).
    pub noise: f32,
    /// Rank of the planted subspace = rank of the low-rank predictor. Default 48.
    pub rank: usize,
    /// Neurons per 4 KiB-aligned chunk. Default 32.
    pub chunk_neurons: usize,
    /// Storage type of every matrix but the down columns: `Q4_0` (default) or `Q4_1`.
    pub weight_dtype: DType,
    /// Storage type of the down columns: `Q8_0` (default, what `convert --down-type q8_0`
    /// writes), `F16`, `Q5_0` or `Q4_0`.
    pub down_dtype: DType,
    /// Recall the predictor's cut-offs are set for. Default 0.95.
    pub target_recall: f32,
    /// Simulated tokens per layer for the cut-offs and statistics. Default 32.
    pub sim_tokens: usize,
    /// Target carry-over of active neurons from one token to the next, planted through attention
    /// (see `synth/carry.rs`); 0 (default) keeps consecutive tokens independent, and the file
    /// exactly as without the option.
    pub token_correlation: f32,
}

impl SynthOptions {
    /// Defaults for `shape` (rank 16 and 8-neuron chunks for the tiny shape).
    pub fn new(shape: SynthShape) -> SynthOptions {
        let tiny = shape == SynthShape::TINY;
        SynthOptions {
            shape,
            seed: 0,
            sparsity: 0.4,
            skew: 1.5,
            noise: 0.25,
            rank: if tiny { 16 } else { 48 },
            chunk_neurons: if tiny { 8 } else { 32 },
            weight_dtype: DType::Q4_0,
            down_dtype: DType::Q8_0,
            target_recall: 0.95,
            sim_tokens: 32,
            token_correlation: 0.0,
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |arg: &'static str, reason: String| Err(Error::InvalidArgument { arg, reason });
        let s = &self.shape;
        if !(self.sparsity > 0.0 && self.sparsity < 1.0) {
            return bad("sparsity", format!("{} is outside (0, 1)", self.sparsity));
        }
        if !(0.0..=5.0).contains(&self.skew) || !(0.0..=5.0).contains(&self.noise) {
            return bad("skew", "skew and noise must lie in [0, 5]".into());
        }
        if self.rank < 2 || self.rank > s.d_model / 2 {
            return bad(
                "rank",
                format!("{} is outside 2..={}", self.rank, s.d_model / 2),
            );
        }
        if self.chunk_neurons == 0 || self.chunk_neurons > 4096 {
            return bad(
                "chunk_neurons",
                format!("{} is outside 1..=4096", self.chunk_neurons),
            );
        }
        if !matches!(self.weight_dtype, DType::Q4_0 | DType::Q4_1) {
            return bad(
                "weight_dtype",
                format!("{} is not q4_0 or q4_1", self.weight_dtype),
            );
        }
        if !matches!(
            self.down_dtype,
            DType::Q8_0 | DType::F16 | DType::Q5_0 | DType::Q4_0
        ) {
            return bad(
                "down_dtype",
                format!("{} is not q8_0, f16, q5_0 or q4_0", self.down_dtype),
            );
        }
        if !(0.0..1.0).contains(&self.token_correlation) {
            return bad(
                "token_correlation",
                format!(
                    "{} is outside [0, 1) (a carry-over target; 0 = independent tokens)",
                    self.token_correlation
                ),
            );
        }
        if !(self.target_recall > 0.0 && self.target_recall < 1.0) || self.sim_tokens < 2 {
            return bad(
                "target_recall",
                "target recall must lie in (0, 1) and sim_tokens be >= 2".into(),
            );
        }
        s.config()
            .validate()
            .map_err(|reason| Error::InvalidArgument {
                arg: "shape",
                reason,
            })
    }
}

/// What [`synthesize`] wrote.
#[derive(Clone, Debug)]
pub struct SynthReport {
    pub file_bytes: u64,
    pub resident_bytes: u64,
    pub streamed_bytes: u64,
    pub calibration_bytes: u64,
    pub chunk_bytes: usize,
    /// Ids of the tokenizer written (the donor's, cut to the shape's vocabulary).
    pub tokenizer_vocab: usize,
    /// Effective unpredictable gate noise (planted noise and Q4 rounding), relative to `σ`.
    pub effective_noise: f64,
    /// Simulated over all layers on held-out simulated tokens: share of neuron-tokens inactive,
    /// predictor recall and fetch fraction at the stored cut-offs.
    pub sim_sparsity: f64,
    pub sim_recall: f64,
    pub sim_fetch_fraction: f64,
    /// Expected share of a token's active neurons active on the next (independent) token.
    pub carry_over: f64,
    /// With `token_correlation`: the latent lag-1 correlation planted in the residual stream,
    /// and the expected carry-over it gives under the planted model (0 and [`Self::carry_over`]
    /// without).
    pub token_correlation: f64,
    pub planned_carry_over: f64,
    /// The layers whose attention transforms directions, and how many each (0 without).
    pub correlated_layers: usize,
    pub directions_per_layer: usize,
    /// What a dense forward pass over text measured on the written file, when the caller ran one
    /// (`leanstream synth` does, through `calibrate::measure_activity`; this module does not run
    /// the engine).
    pub measured: Option<MeasuredActivity>,
}

/// Activity measured by running the engine's dense forward pass over text on a written model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MeasuredActivity {
    /// Tokens run, and how many leading ones were left out of the figures (warm-up).
    pub tokens: usize,
    pub skipped: usize,
    /// Per layer and pooled: of the neurons active on a token, the share also active on the next.
    pub carry_over_by_layer: Vec<f64>,
    pub carry_over: f64,
    /// `E[f²] / E[f]` of the measured per-neuron frequencies: the carry-over of independent
    /// tokens with the same frequencies.
    pub independent_carry_over: f64,
    /// Share of neuron-tokens inactive at the stored thresholds.
    pub sparsity: f64,
    /// The default predictor at its stored cut-offs: recall of active neurons, fetch fraction.
    pub recall: f64,
    pub fetch_fraction: f64,
}

/// The calibration metadata with the tensor directory filled in (every tensor's name, type and
/// shape is known before any value) and the widest placeholders for what is not known yet, so
/// that the header's serialised size bounds the final one.
fn calibration_skeleton(opts: &SynthOptions) -> Calibration {
    let (n_layers, n_ff, d, r) = (
        opts.shape.n_layers,
        opts.shape.n_ff,
        opts.shape.d_model,
        opts.rank,
    );
    let wide = -f32::MAX;
    let entry =
        |name: String, l: usize, f16: bool, shape: Vec<usize>, neuron_major: bool| CalTensorEntry {
            name,
            dtype: if f16 { CalDType::F16 } else { CalDType::F32 },
            shape,
            layer: Some(l),
            neuron_major,
            offset: u64::MAX,
            len: u64::MAX,
        };
    Calibration {
        target_sparsity: opts.sparsity,
        tokens: 0,
        text_source: format!(
            "synthetic: planted statistics, simulated over {} tokens per layer (seed {})",
            opts.sim_tokens, opts.seed
        ),
        thresholds: vec![wide; n_layers],
        section: Some(PLACEHOLDER),
        // The order in which `synthesize` writes them.
        tensors: (0..n_layers)
            .flat_map(|l| {
                [
                    entry(format!("freq.{l}"), l, false, vec![n_ff], true),
                    entry(format!("mean_abs_h.{l}"), l, false, vec![n_ff], true),
                    entry(format!("lowrank.{l}.v"), l, true, vec![r, d], false),
                    entry(format!("lowrank.{l}.us"), l, true, vec![n_ff, r], true),
                    entry(
                        format!("lowrank.{l}.mean_abs_u"),
                        l,
                        false,
                        vec![n_ff],
                        true,
                    ),
                    entry(
                        PredictorKind::LowRank.selection_tensor(l),
                        l,
                        false,
                        vec![n_ff],
                        true,
                    ),
                ]
            })
            .chain([CalTensorEntry {
                layer: None,
                ..entry(
                    PredictorKind::LowRank.quality_cost_tensor(),
                    0,
                    false,
                    vec![n_layers],
                    false,
                )
            }])
            .collect(),
        predictors: vec![PredictorMeta {
            kind: Some(PredictorKind::LowRank),
            rank: r,
            bits: 0,
            stages: 0,
            bytes: usize::MAX,
            target_recall: opts.target_recall,
            cutoffs: vec![wide; n_layers],
            heldout_recall: wide,
            heldout_fetch_fraction: wide,
            heldout_us_per_layer: 0.0,
        }],
        heldout_ppl_dense: 0.0,
        heldout_ppl_thresholded: 0.0,
        quality_cost_source: QUALITY_COST_SIMULATED.into(),
    }
}

/// [`Calibration::quality_cost_source`] of a synthetic model.
const QUALITY_COST_SIMULATED: &str = "synthetic: simulated on the planted distribution, relative \
     RMS error of the FFN output with activations under the threshold and neurons under the \
     cut-off left out, down columns taken as independent (sqrt(sum of missed h² / sum of h²))";

/// A section not yet written.
const PLACEHOLDER: Section = Section {
    offset: u64::MAX,
    len: u64::MAX,
    crc32: u32::MAX,
};

/// `(rows, values per row)` of a tensor shape; a vector is one row.
fn rows_cols(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&cols, rows)) => (rows.iter().product(), cols),
        None => (0, 0),
    }
}

/// Writes a synthetic model to `dst` (through `DST.partial`, renamed when complete), calling
/// `progress(bytes_written, bytes_total)` as sections are written.
pub fn synthesize(
    dst: &Path,
    opts: &SynthOptions,
    tokenizer: &SynthTokenizer,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport> {
    opts.check()?;
    let shape = &opts.shape;
    let config = shape.config();
    let (tokenizer_json, tokenizer_vocab) = tokenizer.fitted(shape.vocab_size)?;
    let (d, n_ff, k, r) = (shape.d_model, shape.n_ff, opts.chunk_neurons, opts.rank);
    let wd = opts.weight_dtype;
    let row_bytes = |t: DType| t.row_bytes(d).expect("checked: whole blocks");
    let bundle_bytes = 2 * row_bytes(wd) + row_bytes(opts.down_dtype);
    let chunk_bytes = align_up((k * bundle_bytes) as u64) as usize;
    let chunks = n_ff.div_ceil(k);
    let basis = Basis {
        c: unit(
            (0..d)
                .map({
                    let mut rng = Rng::new(opts.seed, TAG_DIR, 0, 0);
                    move |_| rng.flat()
                })
                .collect(),
        ),
    };

    // Effective unpredictable noise: planted noise plus the rounding of sample gate rows.
    let probe_plan = LayerPlan {
        opts,
        basis: &basis,
        layer: usize::MAX,
        directions: directions(opts.seed, usize::MAX, r, &basis.c),
        bias: vec![2.0; 64.min(n_ff)],
        plant: Plant::new(f64::from(opts.sparsity), f64::from(opts.skew), 0.0),
        down_scale: 0.0,
    };
    let mut scratch = (vec![0f32; d], Vec::new(), vec![0u8; bundle_bytes]);
    let round2 = (0..probe_plan.bias.len())
        .map(|i| {
            probe_plan
                .neuron(i, &mut scratch.2, &mut scratch.0, &mut scratch.1)
                .round_err2
        })
        .sum::<f64>()
        / probe_plan.bias.len() as f64;
    let eta = (f64::from(opts.noise).powi(2) + SIN_THETA * SIN_THETA * round2).sqrt();
    let plant = Plant::new(f64::from(opts.sparsity), f64::from(opts.skew), eta);
    // Down columns: one FFN output of RMS FFN_OUT with the expected number of active neurons,
    // each |h| ~ silu(tau + sigma) ~ 3.
    let down_scale =
        (FFN_OUT / ((1.0 - f64::from(opts.sparsity)) * n_ff as f64 * 9.0).sqrt()) as f32;

    // Token correlation: planted attention (and Q/K biases, appended so that every other
    // tensor keeps its RNG stream).
    let carry = Carry::new(opts, &config, &plant, &basis.c)?;
    let mut resident = resident_tensors(&config, wd);
    if let Some(cr) = &carry {
        resident.extend(
            cr.bias_tensors()
                .into_iter()
                .map(|(name, n)| (name, DType::F32, vec![n], RowKind::Ones)),
        );
    }
    let correlation = carry.as_ref().map_or(String::new(), |cr| {
        format!(
            "; token correlation: attention carries the token-varying residual stream over as \
             AR(1) with lag-1 correlation {:.4} for a carry-over target of {}",
            cr.rho, opts.token_correlation
        )
    });

    let mut header = Header {
        config: config.clone(),
        tokenizer_json,
        tokenizer_vocab: None,
        special_tokens: tokenizer.specials.clone(),
        chat_template: tokenizer.chat_template.clone(),
        source: format!(
            "synthetic {} (seed {}; seeded random weights with planted activation statistics; \
             tokenizer: {}){correlation}",
            shape.name, opts.seed, tokenizer.source
        ),
        resident: PLACEHOLDER,
        streamed: PLACEHOLDER,
        tensors: resident
            .iter()
            .map(|(name, dtype, shape, _)| TensorEntry {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                offset: u64::MAX,
                len: u64::MAX,
            })
            .collect(),
        ffn: FfnLayout {
            chunk_neurons: k,
            gate_dtype: wd,
            up_dtype: wd,
            down_dtype: opts.down_dtype,
            bundle_bytes,
            chunk_bytes,
            layer_offsets: vec![u64::MAX; shape.n_layers],
            chunk_crc32: vec![vec![u32::MAX; chunks]; shape.n_layers],
            permutation: Vec::new(),
            down_error: DownError::default(),
        },
        calibration: Some(calibration_skeleton(opts)),
    };
    let json_err = |e: serde_json::Error| Error::invalid_file(dst, e.to_string());
    // Floats may serialise up to two characters wider than the placeholder: leave slack.
    let reserve = serde_json::to_vec(&header).map_err(json_err)?.len() + 4096;

    let resident_estimate: u64 = resident
        .iter()
        .map(|(_, t, s, _)| {
            let (rows, cols) = rows_cols(s);
            (rows * t.row_bytes(cols).unwrap_or(0)) as u64
        })
        .sum();
    let total = resident_estimate + (chunk_bytes * chunks * shape.n_layers) as u64;

    let partial = dst.with_extension("lsm.partial");
    let mut out = Out::create(&partial)?;
    let mut sim_total = crate::sparsity::RecallCounter::default();
    let mut sim_sparsity = 0.0;
    let mut all_freqs: Vec<f32> = Vec::with_capacity(n_ff * shape.n_layers);
    let result = (|| -> Result<SynthReport> {
        out.pad_to(align_up((PREAMBLE_LEN + reserve) as u64))?;
        let mut done = 0u64;

        let res_start = out.pos;
        let mut crc = crc32fast::Hasher::new();
        for (id, (entry, (_, dtype, tshape, kind))) in
            header.tensors.iter_mut().zip(&resident).enumerate()
        {
            let (rows, cols) = rows_cols(tshape);
            let planted = carry
                .as_ref()
                .and_then(|cr| cr.tensor(&entry.name, *dtype, rows, cols));
            let bytes = planted.unwrap_or_else(|| {
                resident_tensor(opts.seed, id as u64, kind, *dtype, rows, cols, &basis)
            });
            (entry.offset, entry.len) = out.write_tensor(res_start, &bytes, &mut crc)?;
            done += bytes.len() as u64;
            progress(done, total);
        }
        header.resident = out.section_since(res_start, crc);

        out.pad_to(align_up(out.pos))?;
        let str_start = out.pos;
        let mut section_crc = crc32fast::Hasher::new();
        let mut cal: Vec<CalTensor> = Vec::with_capacity(6 * shape.n_layers + 1);
        let mut thresholds = Vec::with_capacity(shape.n_layers);
        let mut cutoffs = Vec::with_capacity(shape.n_layers);
        let mut quality = Vec::with_capacity(shape.n_layers);
        let mut buf = vec![0u8; chunks * chunk_bytes];
        for l in 0..shape.n_layers {
            let mut rng = Rng::new(opts.seed, TAG_BETA, l as u64, 0);
            let plan = LayerPlan {
                opts,
                basis: &basis,
                layer: l,
                directions: directions(opts.seed, l, r, &basis.c),
                bias: plant
                    .betas(&mut rng, n_ff)
                    .iter()
                    .map(|b| plant.tau + plant.sigma * b)
                    .collect(),
                plant,
                down_scale,
            };
            let neurons: Vec<NeuronOut> = buf
                .par_chunks_mut(chunk_bytes)
                .enumerate()
                .flat_map_iter(|(ci, chunk)| {
                    chunk.fill(0);
                    let (mut row, mut bytes) = (vec![0f32; d], Vec::with_capacity(bundle_bytes));
                    let range = ci * k..((ci + 1) * k).min(n_ff);
                    range
                        .enumerate()
                        .map(|(j, i)| {
                            let dst = &mut chunk[j * bundle_bytes..(j + 1) * bundle_bytes];
                            plan.neuron(i, dst, &mut row, &mut bytes)
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            let crcs: Vec<u32> = buf.par_chunks(chunk_bytes).map(crc32fast::hash).collect();
            header.ffn.layer_offsets[l] = out.pos - str_start;
            header.ffn.chunk_crc32[l] = crcs;
            section_crc.update(&buf);
            out.write(&buf)?;

            // Statistics from the stored rows.
            let bias: Vec<f64> = neurons.iter().map(|n| n.bias).collect();
            let mean_abs_u: Vec<f32> = neurons.iter().map(|n| n.mean_abs_u).collect();
            let mut sim_rng = Rng::new(opts.seed, TAG_SIM, l as u64, 0);
            let sim: LayerSim = simulate_layer(
                &plant,
                &bias,
                &mean_abs_u,
                opts.sim_tokens,
                opts.target_recall,
                &mut sim_rng,
            );
            sim_total.active += sim.recall.active;
            sim_total.hit += sim.recall.hit;
            sim_total.fetched += sim.recall.fetched;
            sim_total.total += sim.recall.total;
            sim_sparsity += sim.sparsity / shape.n_layers as f64;
            let freq: Vec<f32> = bias
                .iter()
                .map(|b| plant.frequency((b - plant.tau) / plant.sigma) as f32)
                .collect();
            all_freqs.extend_from_slice(&freq);
            thresholds.push(plant.threshold());
            cutoffs.push(sim.cutoff);
            let us: Vec<f32> = neurons.iter().flat_map(|n| n.us.iter().copied()).collect();
            cal.extend([
                CalTensor::f32(format!("freq.{l}"), Some(l), vec![n_ff], &freq).neuron_major(),
                CalTensor::f32(
                    format!("mean_abs_h.{l}"),
                    Some(l),
                    vec![n_ff],
                    &sim.mean_abs_h,
                )
                .neuron_major(),
                CalTensor::f16(
                    format!("lowrank.{l}.v"),
                    Some(l),
                    vec![r, d],
                    &plan.directions,
                ),
                CalTensor::f16(format!("lowrank.{l}.us"), Some(l), vec![n_ff, r], &us)
                    .neuron_major(),
                CalTensor::f32(
                    format!("lowrank.{l}.mean_abs_u"),
                    Some(l),
                    vec![n_ff],
                    &mean_abs_u,
                )
                .neuron_major(),
                CalTensor::f32(
                    PredictorKind::LowRank.selection_tensor(l),
                    Some(l),
                    vec![n_ff],
                    &sim.selection,
                )
                .neuron_major(),
            ]);
            quality.push(sim.output_error as f32);
            done += buf.len() as u64;
            progress(done, total);
        }
        header.streamed = out.section_since(str_start, section_crc);
        cal.push(CalTensor::f32(
            PredictorKind::LowRank.quality_cost_tensor(),
            None,
            vec![shape.n_layers],
            &quality,
        ));

        out.pad_to(align_up(out.pos))?;
        let cal_start = out.pos;
        let mut crc = crc32fast::Hasher::new();
        let meta = header
            .calibration
            .as_mut()
            .expect("set above: the header carries calibration");
        assert_eq!(
            cal.len(),
            meta.tensors.len(),
            "one tensor per directory entry"
        );
        for (t, e) in cal.iter().zip(&mut meta.tensors) {
            assert_eq!(t.name, e.name, "calibration tensors in directory order");
            (e.offset, e.len) = out.write_tensor(cal_start, &t.bytes, &mut crc)?;
        }
        meta.section = Some(out.section_since(cal_start, crc));
        meta.thresholds = thresholds;
        let p = &mut meta.predictors[0];
        p.cutoffs = cutoffs;
        p.bytes = shape.n_layers * (2 * r * d + 2 * n_ff * r + 4 * n_ff);
        p.heldout_recall = sim_total.recall() as f32;
        p.heldout_fetch_fraction = sim_total.fetch_fraction() as f32;

        let json = serde_json::to_vec(&header).map_err(json_err)?;
        assert!(json.len() <= reserve, "header outgrew its reservation");
        let file_bytes = out.pos;
        out.finish(&json)?;
        Ok(SynthReport {
            file_bytes,
            resident_bytes: header.resident.len,
            streamed_bytes: header.streamed.len,
            calibration_bytes: file_bytes - cal_start,
            chunk_bytes,
            tokenizer_vocab,
            effective_noise: eta,
            sim_sparsity,
            sim_recall: sim_total.recall(),
            sim_fetch_fraction: sim_total.fetch_fraction(),
            carry_over: Plant::carry_over(&all_freqs),
            token_correlation: carry.as_ref().map_or(0.0, |cr| cr.rho),
            planned_carry_over: carry
                .as_ref()
                .map_or_else(|| Plant::carry_over(&all_freqs), |cr| cr.planned_carry_over),
            correlated_layers: carry.as_ref().map_or(0, |cr| cr.active_layers),
            directions_per_layer: carry.as_ref().map_or(0, |cr| cr.per_layer),
            measured: None,
        })
    })();
    commit(&partial, dst, result)
}

#[cfg(test)]
mod carry_tests;
#[cfg(test)]
mod tests;
