//! The generation loop: prefill the prompt, then sample token by token until a stop condition.
//! [`Stepper`] is the loop's state between forward passes, resumable; [`generate`] drives one
//! on a single session, the daemon's scheduler drives many.

pub mod speculate;
mod stepper;

pub use speculate::{DraftKind, SpeculateMode, Speculation, SpeculationStats};
pub use stepper::{Emitted, Next, Stepper, StopRules};

use std::time::{Duration, Instant};

use crate::forward::{FfnExecutor, Model, Session};

/// A forward pass that decodes one conversation: the CPU [`Session`], or with feature `cuda`
/// the GPU's `backend::cuda::CudaSession`. [`generate`] and [`score`] run on either.
pub trait Decode: std::fmt::Debug {
    /// Runs `token` at the next position; returns the logits.
    fn forward(&mut self, token: u32) -> Result<&mut [f32]>;
    /// Runs `tokens` at the next positions; returns the logits of the last.
    fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]>;
    /// Tokens in the KV cache.
    fn position(&self) -> usize;
    /// Room of the KV cache, in tokens.
    fn max_context(&self) -> usize;
    /// Size of the vocabulary (the logits' length).
    fn vocab_size(&self) -> usize;
    /// Runs `token` with each layer's FFN computed by `exec` (the sparse pipelines).
    fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]>;
    /// Runs `tokens` with each layer's FFN computed by `exec`; returns the logits of the last.
    /// Token by token unless the session can pass several rows at once (the CPU session: its
    /// streamed pieces are then read once per [`crate::forward::MAX_BATCH`] tokens, not once a
    /// token).
    fn forward_batch_through(
        &mut self,
        tokens: &[u32],
        exec: &mut dyn FfnExecutor,
    ) -> Result<&mut [f32]> {
        let (last, rest) = tokens.split_last().ok_or_else(|| Error::InvalidArgument {
            arg: "tokens",
            reason: "an empty batch".into(),
        })?;
        for &t in rest {
            self.forward_with(t, exec)?;
        }
        self.forward_with(*last, exec)
    }
    /// Runs `tokens` at the next positions, each layer's FFN through `exec` when given, and
    /// writes every token's logits into `out` (one row of [`Decode::vocab_size`]-or-wider
    /// logits each, in order): a verification pass of speculative decoding. Token by token
    /// unless the session can pass several rows at once (the CPU session reads each weight,
    /// streamed or not, once for all of them).
    fn forward_rows(
        &mut self,
        tokens: &[u32],
        mut exec: Option<&mut dyn FfnExecutor>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        out.clear();
        for &t in tokens {
            let logits = match exec.as_deref_mut() {
                Some(exec) => self.forward_with(t, exec)?,
                None => self.forward(t)?,
            };
            out.extend_from_slice(logits);
        }
        Ok(())
    }
    /// The size of the shortlist of head rows this session drafts from without reading
    /// anything ([`Session::forward_shortlist`]); `None` where it has none (the default).
    fn shortlist(&self) -> Option<usize> {
        None
    }
    /// Runs `token` and up to `n - 1` tokens drafted from the shortlist after it, writing the
    /// tokens run into `fed` and every position's full logits into `out`
    /// ([`Session::forward_shortlist`]). A session without a shortlist drafts nothing: it runs
    /// `token` alone (the default).
    fn forward_shortlist(
        &mut self,
        token: u32,
        n: usize,
        fed: &mut Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let _ = n;
        fed.clear();
        fed.push(token);
        self.forward_rows(&[token], None, out)
    }
    /// Forgets every token after the first `position` (the rejected tokens of a verification
    /// pass). Errors if `position` is past [`Decode::position`].
    fn rewind(&mut self, position: usize) -> Result<()>;
    /// Forgets the conversation (what it holds stays allocated for the next one).
    fn reset(&mut self);
    /// Every byte the session holds now, host and device (KV cache and scratch; not the shared
    /// model), from its allocations.
    fn bytes(&self) -> u64;
    /// Bytes that must be allocated so that `tokens` more tokens fit after
    /// [`Decode::position`]; 0 if they already fit. The caller checks `max_context` itself.
    fn kv_growth_bytes(&self, tokens: usize) -> u64;
    /// Allocates what [`Decode::kv_growth_bytes`]`(tokens)` counts; errors if `tokens` more do
    /// not fit in the context. Forward passes grow by themselves; a scheduler calls this after
    /// reserving the bytes.
    fn grow_kv(&mut self, tokens: usize) -> Result<()>;
    /// Forgets the conversation and frees the KV memory it can give back.
    fn release_kv(&mut self);
    /// The CPU session behind this one, which [`crate::forward::forward_each`] can batch with
    /// others; `None` for any other kind (the GPU's, a wrapper).
    fn as_cpu(&mut self) -> Option<&mut Session> {
        None
    }
    /// Bytes of GPU memory held (weights, KV cache, scratch); `None` on the CPU.
    fn device_bytes(&self) -> Option<u64> {
        None
    }
}

impl Decode for Session {
    fn forward(&mut self, token: u32) -> Result<&mut [f32]> {
        Session::forward(self, token)
    }
    fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        Session::forward_batch(self, tokens)
    }
    fn position(&self) -> usize {
        Session::position(self)
    }
    fn max_context(&self) -> usize {
        Session::max_context(self)
    }
    fn vocab_size(&self) -> usize {
        self.model().weights.config.vocab_size
    }
    fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]> {
        Session::forward_with(self, token, exec)
    }
    fn forward_batch_through(
        &mut self,
        tokens: &[u32],
        exec: &mut dyn FfnExecutor,
    ) -> Result<&mut [f32]> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "tokens",
                reason: "an empty batch".into(),
            });
        }
        Session::forward_batch_with(self, tokens, exec, &mut |_, _| Ok(()))?;
        Ok(self.logits())
    }
    fn forward_rows(
        &mut self,
        tokens: &[u32],
        exec: Option<&mut dyn FfnExecutor>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        Session::forward_rows(self, tokens, exec, out)
    }
    fn rewind(&mut self, position: usize) -> Result<()> {
        Session::rewind(self, position)
    }
    fn shortlist(&self) -> Option<usize> {
        Session::shortlist(self)
    }
    fn forward_shortlist(
        &mut self,
        token: u32,
        n: usize,
        fed: &mut Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        Session::forward_shortlist(self, token, n, fed, out)
    }
    fn reset(&mut self) {
        Session::reset(self)
    }
    fn bytes(&self) -> u64 {
        Session::bytes(self)
    }
    fn kv_growth_bytes(&self, tokens: usize) -> u64 {
        Session::kv_growth_bytes(self, tokens)
    }
    fn grow_kv(&mut self, tokens: usize) -> Result<()> {
        Session::grow_kv(self, tokens)
    }
    fn release_kv(&mut self) {
        Session::release_kv(self)
    }
    fn as_cpu(&mut self) -> Option<&mut Session> {
        Some(self)
    }
}

use crate::constrain::Constraint;
use crate::sample::{Sampler, SamplerConfig};
use crate::{Error, Result};

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-sequence token (it is included in the output).
    Eos,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The output contains one of the stop strings.
    StopString,
    /// The session's context filled up.
    ContextFull,
    /// The caller asked to stop.
    Cancelled,
}

impl StopReason {
    /// Lower-case name, as the CLI's JSON and the daemon's stream spell it: `eos`,
    /// `max_tokens`, `stop_string`, `context_full` or `cancelled`.
    pub const fn name(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopString => "stop_string",
            StopReason::ContextFull => "context_full",
            StopReason::Cancelled => "cancelled",
        }
    }
}

/// Timings and counts of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time to run the prompt through the model (including the first token's logits).
    pub prefill: Duration,
    /// Time for the remaining forward passes (one per generated token after the first).
    pub decode: Duration,
    /// Time in the constraint's mask and advance, if any (already inside prefill and decode).
    pub constraint: Duration,
    /// What speculative decoding did, when it was on.
    pub speculation: Option<SpeculationStats>,
}

impl GenerationStats {
    /// Prompt tokens per second.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill)
    }

    /// Generated tokens per second, counting the forward passes of the decode phase.
    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.generated_tokens.saturating_sub(1), self.decode)
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

/// The result of [`generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    pub ids: Vec<u32>,
    pub stop: StopReason,
    pub stats: GenerationStats,
}

/// Runs `prompt` then generates up to `max_tokens` tokens, calling `on_token` with each new id as
/// soon as it is sampled; `on_token` returns `false` to stop. Stops after any of `stop_ids`.
///
/// The session continues from its current position (a chat keeps its KV cache between turns).
/// Errors before any work if the prompt is empty or does not fit in the remaining context.
pub fn generate(
    session: &mut dyn Decode,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &SamplerConfig,
    stop_ids: &[u32],
    on_token: impl FnMut(u32) -> bool,
) -> Result<Generation> {
    generate_constrained(
        session, prompt, max_tokens, sampler, stop_ids, None, None, on_token,
    )
}

/// [`generate`], with every token held to `constraint` when there is one: its mask is applied
/// to the logits before sampling and the sampled id advances it (see [`crate::constrain`]).
/// Once the grammar is complete only its end-of-sequence ids are allowed, so `stop_ids` should
/// hold them (the tokenizer's eos list). A constraint error (the parser hit a limit) ends the
/// generation with that error.
///
/// This drives a [`Stepper`] on one session: the whole prompt in one batched pass, then one
/// forward pass per token, or with `speculation` one pass per token and its drafts (the same
/// tokens; see [`speculate`]). The session ends holding what plain decoding leaves in it.
#[allow(clippy::too_many_arguments)]
pub fn generate_constrained(
    session: &mut dyn Decode,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &SamplerConfig,
    stop_ids: &[u32],
    mut constraint: Option<&mut Constraint>,
    speculation: Option<Speculation>,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Generation> {
    let rules = StopRules {
        max_tokens,
        eos: stop_ids.to_vec(),
        strings: Vec::new(),
    };
    let room = session.max_context() - session.position();
    let vocab = session.vocab_size();
    let start = session.position();
    let mut stepper = Stepper::new(prompt, &[], room, sampler.clone(), vocab, rules)?;
    if let Some(spec) = speculation {
        stepper = stepper.speculate(spec);
    }
    let (mut rows, mut fed) = (Vec::new(), Vec::new());
    let stop = loop {
        match stepper.next() {
            Next::Prefill(rest) => {
                let n = rest.len();
                let logits = session.forward_batch(rest)?;
                stepper.prefilled(n, logits, constraint.as_deref_mut())?;
            }
            Next::Emit(_) => {
                let token = stepper.emit(None)?;
                if !on_token(token.id) {
                    stepper.end(StopReason::Cancelled);
                }
            }
            Next::Forward(&[id]) => {
                let logits = session.forward(id)?;
                stepper.forwarded(logits, constraint.as_deref_mut())?;
            }
            Next::Forward(tokens) => {
                let at = session.position();
                session.forward_rows(tokens, None, &mut rows)?;
                let kept = stepper.forwarded(&mut rows, constraint.as_deref_mut())?;
                session.rewind(at + kept)?;
            }
            Next::Draft(token, n) => {
                let at = session.position();
                session.forward_shortlist(token, n, &mut fed, &mut rows)?;
                let kept = stepper.drafted(&fed, &mut rows, constraint.as_deref_mut())?;
                session.rewind(at + kept)?;
            }
            Next::Done(reason) => break reason,
        }
    };
    session.rewind(start + stepper.kv_tokens())?;
    Ok(Generation {
        ids: stepper.ids().to_vec(),
        stop,
        stats: stepper.stats(),
    })
}

/// The speculation a generation on `model` runs with under `mode`: none when `off`; with
/// `auto`, drafting at most `max_draft` tokens a pass, priced as a streaming pass when the
/// model's plan streams weights and as a resident one otherwise (where only drafts that are
/// nearly always accepted, such as a grammar's forced text, pay).
pub fn speculation_for(
    model: &Model,
    mode: SpeculateMode,
    max_draft: usize,
) -> Option<Speculation> {
    if mode == SpeculateMode::Off || max_draft == 0 {
        return None;
    }
    let streams = model.plan().is_some_and(|p| p.streams() || p.is_sparse());
    let cost = if streams {
        speculate::STREAMED_ROW_COST
    } else {
        speculate::RESIDENT_ROW_COST
    };
    let shortlist = model.plan().and_then(|p| p.shortlist_rows());
    Some(Speculation::with_row_cost(max_draft, cost).with_shortlist(shortlist))
}

/// Samples the next id from `logits`, masked by and then advancing `constraint` if any (the
/// step every generation loop takes: [`generate`] and the daemon's scheduler); adds the
/// constraint's time to `spent` when given.
pub fn sample_next(
    sampler: &mut Sampler,
    constraint: Option<&mut Constraint>,
    logits: &mut [f32],
    history: &[u32],
    spent: Option<&mut Duration>,
) -> Result<u32> {
    let Some(constraint) = constraint else {
        return Ok(sampler.sample(logits, history));
    };
    let start = Instant::now();
    constraint.mask(logits)?;
    let masked = start.elapsed();
    let id = sampler.sample(logits, history);
    let start = Instant::now();
    constraint.advance(id)?;
    if let Some(spent) = spent {
        *spent += masked + start.elapsed();
    }
    Ok(id)
}

/// Teacher-forced negative log-likelihood of `tokens` (natural log, summed) and the number of
/// predicted tokens, continuing from the session's position.
pub fn score(session: &mut dyn Decode, tokens: &[u32]) -> Result<(f64, usize)> {
    let mut nll = 0.0f64;
    let mut n = 0;
    for pair in tokens.windows(2) {
        nll += token_nll(session.forward(pair[0])?, pair[1]);
        n += 1;
    }
    Ok((nll, n))
}

/// Negative log-likelihood of `target` under `logits` (a log-softmax, computed stably).
pub fn token_nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum: f64 = logits
        .iter()
        .map(|&l| f64::from(l - max).exp())
        .sum::<f64>()
        .ln();
    log_sum - f64::from(logits[target as usize] - max)
}
