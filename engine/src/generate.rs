//! The generation loop: prefill the prompt, then sample token by token until a stop condition.
//! [`Stepper`] is the loop's state between forward passes, resumable; [`generate`] drives one
//! on a single session, the daemon's scheduler drives many.

pub mod speculate;
mod stepper;

pub use speculate::{DraftKind, SpeculateMode, Speculation, SpeculationStats};
pub use stepper::{Emitted, Next, Stepper, StopRules};

use std::time::{Duration, Instant};

// The trait the loop drives lives with the forward passes that implement it; callers of the
// loop find it here too.
pub use crate::forward::Decode;

use crate::Result;
use crate::constrain::Constraint;
use crate::forward::Model;
use crate::sample::{Sampler, SamplerConfig};

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
