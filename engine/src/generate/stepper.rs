//! A resumable generation: everything between two forward passes (sampler, stop rules,
//! detokeniser, timings), with the forward passes left to the caller. [`super::generate`] drives
//! one to its end on one session; the daemon's scheduler drives many at once, interleaving their
//! passes and batching them across sessions. Both therefore sample, stop and time alike.
//!
//! The caller asks [`Stepper::next`] what is due and answers it:
//!
//! ```text
//! Next::Prefill(rest)    run the first n tokens of `rest` (n ≥ 1) → Stepper::prefilled(n, logits, c)
//! Next::Emit(id)         hand token `id` out                      → Stepper::emit(tokenizer)
//! Next::Forward(tokens)  run `tokens` in one pass, every row's    → Stepper::forwarded(rows, c)
//!                        logits kept                                 = kept; rewind to start + kept
//! Next::Draft(id, n)     run `id` and up to n - 1 tokens the       → Stepper::drafted(fed, rows, c)
//!                        session drafts from its shortlist           = kept; rewind as above
//! Next::Done(reason)     the generation is over; rewind to         Stepper::kv_tokens()
//! ```
//!
//! A token is emitted before its own forward pass is asked for, so a caller that writes it out
//! at [`Stepper::emit`] hands every token out the moment it exists. `tokens[0]` of a forward
//! pass is the token emitted last; with [`Speculation`] on, drafts follow it (see
//! [`super::speculate`]): [`Stepper::forwarded`] samples the rows in order, keeps the drafts
//! the samples agree with and says how many of the pass's positions the session keeps; the
//! caller rewinds the session to the pass's start plus that. The tokens it sampled go out one
//! [`Next::Emit`] at a time. The grammar constraint `c`, when there is one, is the caller's (it
//! outlives the generation: the CLI asks it afterwards whether the text is complete) and is
//! passed to each sampling call.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::speculate::{Draft, DraftKind, Speculation};
use super::{GenerationStats, StopReason, sample_next};
use crate::constrain::Constraint;
use crate::sample::{Sampler, SamplerConfig};
use crate::tokenizer::{TextStream, Tokenizer};
use crate::{Error, Result};

/// When a generation stops, besides a cancel.
#[derive(Clone, Debug, Default)]
pub struct StopRules {
    /// Most tokens generated (the end-of-sequence token included).
    pub max_tokens: usize,
    /// Ids that end the generation (the tokenizer's end-of-sequence ids); the id is emitted
    /// first, without text.
    pub eos: Vec<u32>,
    /// The generation ends once the emitted text contains any of these (checked only when
    /// [`Stepper::emit`] is given the tokenizer).
    pub strings: Vec<String>,
}

/// What the caller must do next (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next<'a> {
    /// Prompt tokens not yet in the KV cache, in order.
    Prefill(&'a [u32]),
    /// Token `id` was sampled and goes out next.
    Emit(u32),
    /// The token emitted last (first), then any draft tokens: one pass over all of them is due.
    Forward(&'a [u32]),
    /// The token emitted last, then up to `n - 1` tokens the session drafts from its
    /// shortlist as it runs ([`crate::generate::Decode::forward_shortlist`]).
    Draft(u32, usize),
    /// The generation is over.
    Done(StopReason),
}

/// One emitted token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Emitted {
    pub id: u32,
    /// The text this token completes (empty for an end-of-sequence id, for bytes still waiting
    /// for the rest of their character, or when no tokenizer was given).
    pub text: String,
    /// Why the generation ended with this token, if it did.
    pub stop: Option<StopReason>,
}

/// The state of one generation between forward passes. See the module docs for the protocol.
#[derive(Debug)]
pub struct Stepper {
    /// Tokens to feed before the first sample.
    prompt: Vec<u32>,
    /// How many of `prompt` are in the KV cache.
    fed: usize,
    /// Positions free in the session's context when the generation started.
    room: usize,
    rules: StopRules,
    sampler: Sampler,
    /// Tokens the repetition penalty and the lookup drafts see: what the session held, the
    /// prompt, then every sampled token (emitted or waiting to be).
    history: Vec<u32>,
    /// Generated ids, emitted ones only.
    ids: Vec<u32>,
    /// Sampled ids waiting to go out, in order.
    ready: VecDeque<u32>,
    /// The next forward pass: the token emitted last, then the drafts.
    pass: Vec<u32>,
    /// Where `pass`'s drafts come from, and when the pass was asked for; for a shortlist
    /// draft, how many tokens the pass may run.
    pass_kind: DraftKind,
    pass_rows: usize,
    asked: Option<Instant>,
    speculation: Option<Speculation>,
    /// The grammar's forced tokens after the last sampled one, as a draft.
    forced: Vec<u32>,
    state: State,
    /// Emitted text, kept only when there are stop strings to look for.
    text: String,
    detok: TextStream,
    started: Instant,
    /// When the first token was sampled (the end of prefill).
    first_sampled: Option<Instant>,
    ended: Option<Instant>,
    stats: GenerationStats,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Prefilling,
    /// Sampled tokens wait in `ready`.
    Sampled,
    /// Everything sampled went out; `pass` is due.
    Emitted,
    Done(StopReason),
}

impl Stepper {
    /// A generation of `prompt` on a session whose KV cache already holds `seen` (what the
    /// repetition penalty sees before the prompt) and has `room` positions free.
    ///
    /// Errors (before any work) if the prompt is empty, does not fit in `room`, or the sampler
    /// settings are invalid.
    pub fn new(
        prompt: &[u32],
        seen: &[u32],
        room: usize,
        sampler: SamplerConfig,
        vocab: usize,
        rules: StopRules,
    ) -> Result<Stepper> {
        if prompt.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "prompt",
                reason: "is empty".into(),
            });
        }
        if prompt.len() > room {
            return Err(Error::InvalidArgument {
                arg: "prompt",
                reason: format!(
                    "{} tokens do not fit in the context ({room} tokens free)",
                    prompt.len()
                ),
            });
        }
        let mut history = Vec::with_capacity(seen.len() + prompt.len() + rules.max_tokens);
        history.extend_from_slice(seen);
        history.extend_from_slice(prompt);
        Ok(Stepper {
            prompt: prompt.to_vec(),
            fed: 0,
            room,
            sampler: Sampler::new(sampler, vocab)?,
            history,
            ids: Vec::with_capacity(rules.max_tokens),
            ready: VecDeque::new(),
            pass: Vec::new(),
            pass_kind: DraftKind::Lookup,
            pass_rows: 1,
            asked: None,
            speculation: None,
            forced: Vec::new(),
            state: State::Prefilling,
            text: String::new(),
            detok: TextStream::default(),
            started: Instant::now(),
            first_sampled: None,
            ended: None,
            stats: GenerationStats::default(),
            rules,
        })
    }

    /// Turns speculative decoding on for this generation (see [`super::speculate`]).
    pub fn speculate(mut self, speculation: Speculation) -> Stepper {
        self.speculation = Some(speculation);
        self
    }

    /// What is due now.
    pub fn next(&self) -> Next<'_> {
        match self.state {
            State::Prefilling => Next::Prefill(&self.prompt[self.fed..]),
            State::Sampled => Next::Emit(self.ready[0]),
            State::Emitted if self.pass_kind == DraftKind::Shortlist && self.pass_rows > 1 => {
                Next::Draft(self.pass[0], self.pass_rows)
            }
            State::Emitted => Next::Forward(&self.pass),
            State::Done(reason) => Next::Done(reason),
        }
    }

    /// The first `n` tokens of [`Next::Prefill`] went through the model; `logits` are the last
    /// one's. After the last piece of the prompt the first token is sampled from them.
    ///
    /// Panics unless a prefill of at least `n` tokens was due (a broken protocol).
    pub fn prefilled(
        &mut self,
        n: usize,
        logits: &mut [f32],
        constraint: Option<&mut Constraint>,
    ) -> Result<()> {
        assert!(
            self.state == State::Prefilling && n >= 1 && self.fed + n <= self.prompt.len(),
            "Stepper::prefilled({n}) with {:?}, {} of {} prompt tokens fed",
            self.state,
            self.fed,
            self.prompt.len()
        );
        self.fed += n;
        self.stats.prompt_tokens = self.fed;
        if self.fed < self.prompt.len() {
            return Ok(());
        }
        if self.rules.max_tokens == 0 {
            self.stats.prefill = self.started.elapsed();
            self.end(StopReason::MaxTokens);
            return Ok(());
        }
        let mut constraint = constraint;
        self.sample(logits, constraint.as_deref_mut())?;
        self.note_forced(constraint);
        let now = Instant::now();
        self.stats.prefill = now - self.started;
        self.first_sampled = Some(now);
        self.state = State::Sampled;
        Ok(())
    }

    /// Hands the sampled token out and applies the stop rules. With `tokenizer`, the token's text
    /// is decoded incrementally (whole characters only) and the stop strings are checked.
    ///
    /// Panics unless [`Next::Emit`] was due.
    pub fn emit(&mut self, tokenizer: Option<&Tokenizer>) -> Result<Emitted> {
        let (State::Sampled, Some(id)) = (self.state, self.ready.pop_front()) else {
            panic!("Stepper::emit with {:?}", self.state);
        };
        let eos = self.rules.eos.contains(&id);
        // The end-of-sequence token is reported by id but is not part of the text: a chat
        // client keeps the text as the reply.
        let text = match tokenizer {
            Some(tok) if !eos => self.detok.push(tok, id)?.unwrap_or_default(),
            _ => String::new(),
        };
        self.ids.push(id);
        if !self.rules.strings.is_empty() {
            self.text.push_str(&text);
        }
        let stop = if eos {
            Some(StopReason::Eos)
        } else if self.rules.strings.iter().any(|s| self.text.contains(s)) {
            Some(StopReason::StopString)
        } else if self.ids.len() >= self.rules.max_tokens {
            Some(StopReason::MaxTokens)
        } else if self.prompt.len() + self.ids.len() > self.room {
            // The emitted token's forward pass would need a position past the context.
            Some(StopReason::ContextFull)
        } else {
            None
        };
        match stop {
            Some(reason) => self.end(reason),
            None if self.ready.is_empty() => self.ask_pass(id),
            None => {}
        }
        Ok(Emitted { id, text, stop })
    }

    /// Everything sampled went out, the last being `id`: the next pass runs it and whatever the
    /// speculation drafts after it, within the room left in the context and the generation.
    fn ask_pass(&mut self, id: u32) {
        self.pass.clear();
        self.pass.push(id);
        self.pass_rows = 1;
        if let Some(spec) = self.speculation.as_mut() {
            // The pass writes at positions fed..fed + len; it samples up to len tokens.
            let fed = self.prompt.len() + self.ids.len() - 1;
            let room = self.room.saturating_sub(fed).saturating_sub(1);
            let left = self.rules.max_tokens.saturating_sub(self.ids.len() + 1);
            match spec.draft(&self.history, &self.forced, room.min(left)) {
                Draft::Tokens(kind, drafts) => {
                    self.pass_kind = kind;
                    self.pass.extend(drafts);
                }
                Draft::Shortlist(n) => {
                    self.pass_kind = DraftKind::Shortlist;
                    self.pass_rows = n + 1;
                }
            }
        }
        self.asked = Some(Instant::now());
        self.state = State::Emitted;
    }

    /// The pass of [`Next::Forward`]'s tokens ran; `rows` holds each one's logits, in order
    /// (one row when no token was drafted). Samples the rows in order while each sample agrees
    /// with the draft after it; returns how many of the pass's positions the session keeps
    /// (the token emitted last and the accepted drafts): the caller rewinds to the pass's
    /// start plus that.
    ///
    /// Panics unless [`Next::Forward`] was due, or if `rows` is not one row per token.
    pub fn forwarded(
        &mut self,
        rows: &mut [f32],
        constraint: Option<&mut Constraint>,
    ) -> Result<usize> {
        assert!(
            !matches!(self.next(), Next::Draft(..)),
            "Stepper::forwarded when a shortlist draft was due"
        );
        self.verify(rows, constraint)
    }

    /// The pass of [`Next::Draft`] ran the tokens `fed` (the token emitted last, then what the
    /// session drafted) and `rows` holds each one's logits: as [`Stepper::forwarded`].
    ///
    /// Panics unless [`Next::Draft`] was due and `fed` starts with its token and is at most its
    /// length.
    pub fn drafted(
        &mut self,
        fed: &[u32],
        rows: &mut [f32],
        constraint: Option<&mut Constraint>,
    ) -> Result<usize> {
        let Next::Draft(token, n) = self.next() else {
            panic!("Stepper::drafted with {:?}", self.state);
        };
        assert!(
            fed.first() == Some(&token) && fed.len() <= n,
            "Stepper::drafted: {fed:?} for a draft of {n} after {token}"
        );
        self.pass.clear();
        self.pass.extend_from_slice(fed);
        self.verify(rows, constraint)
    }

    /// Samples the rows of the pass of `self.pass` in order while each sample agrees with the
    /// draft after it; returns how many positions the session keeps.
    fn verify(&mut self, rows: &mut [f32], constraint: Option<&mut Constraint>) -> Result<usize> {
        let n = self.pass.len();
        assert!(
            self.state == State::Emitted && n > 0 && rows.len().is_multiple_of(n),
            "Stepper::forwarded with {:?}, {} values for {n} tokens",
            self.state,
            rows.len(),
        );
        let width = rows.len() / n;
        let mut constraint = constraint;
        let mut kept = 0;
        for (i, row) in rows.chunks_exact_mut(width).enumerate() {
            let id = self.sample(row, constraint.as_deref_mut())?;
            kept = i + 1;
            let agrees = self.pass.get(i + 1) == Some(&id);
            let last = self.rules.eos.contains(&id)
                || self.ids.len() + self.ready.len() >= self.rules.max_tokens;
            if !agrees || last {
                break;
            }
        }
        if let (Some(spec), Some(asked)) = (self.speculation.as_mut(), self.asked) {
            spec.observe(self.pass_kind, n - 1, kept - 1, asked.elapsed());
        }
        self.pass_rows = 1;
        self.note_forced(constraint);
        self.state = State::Sampled;
        Ok(kept)
    }

    /// Cuts the due forward pass to its first `n` tokens (at least one: the token emitted last
    /// always stays), dropping the drafts after them: what a caller does when its pass has room
    /// for fewer rows than were drafted (a scheduler sharing one pass between sessions). The
    /// dropped drafts count as neither drafted nor rejected.
    ///
    /// Panics unless [`Next::Forward`] is due.
    pub fn trim_pass(&mut self, n: usize) {
        assert!(
            self.state == State::Emitted,
            "Stepper::trim_pass with {:?}",
            self.state
        );
        self.pass.truncate(n.max(1));
    }

    /// How many tokens of this generation the session's KV cache holds at its end, as plain
    /// decoding leaves it: the prompt fed and every emitted token but the last (whose pass never
    /// ran). A speculating caller rewinds the session to its start plus this once it is done:
    /// accepted drafts past a stop are forgotten.
    pub fn kv_tokens(&self) -> usize {
        self.fed + self.ids.len().saturating_sub(1)
    }

    /// The speculation's counts, when it is on.
    pub fn speculation(&self) -> Option<&super::SpeculationStats> {
        self.speculation.as_ref().map(Speculation::stats)
    }

    /// Keeps the grammar's forced tokens after what was just sampled, as the next draft.
    fn note_forced(&mut self, constraint: Option<&mut Constraint>) {
        self.forced.clear();
        if let (Some(_), Some(c)) = (&self.speculation, constraint) {
            self.forced = c.forced_tokens();
        }
    }

    /// Ends the generation now (a cancel, an error) unless it is over already.
    pub fn end(&mut self, reason: StopReason) {
        if !matches!(self.state, State::Done(_)) {
            self.state = State::Done(reason);
            self.ended = Some(Instant::now());
        }
    }

    /// The emitted ids.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Timings and counts so far: prefill from [`Stepper::new`] to the first sample, decode from
    /// there to the end (or to now).
    pub fn stats(&self) -> GenerationStats {
        let mut stats = self.stats.clone();
        stats.generated_tokens = self.ids.len();
        stats.speculation = self.speculation().cloned();
        if let Some(first) = self.first_sampled {
            let end = self.ended.unwrap_or_else(Instant::now);
            stats.decode = end.saturating_duration_since(first);
        }
        stats
    }

    /// Samples the next token from `logits` and queues it to go out.
    fn sample(&mut self, logits: &mut [f32], constraint: Option<&mut Constraint>) -> Result<u32> {
        let mut spent = Duration::ZERO;
        let id = sample_next(
            &mut self.sampler,
            constraint,
            logits,
            &self.history,
            Some(&mut spent),
        )?;
        self.stats.constraint += spent;
        self.history.push(id);
        self.ready.push_back(id);
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{Speculation, SpeculationStats};
    use crate::tokenizer::fixtures::byte_level_vocab;

    const VOCAB: usize = 300;

    /// Logits whose greedy choice is `id`.
    fn peak(id: u32) -> Vec<f32> {
        let mut l = vec![0.0; VOCAB];
        l[id as usize] = 10.0;
        l
    }

    fn rules(max_tokens: usize) -> StopRules {
        StopRules {
            max_tokens,
            eos: vec![2],
            strings: Vec::new(),
        }
    }

    fn stepper(prompt: &[u32], room: usize, rules: StopRules) -> Stepper {
        Stepper::new(prompt, &[], room, SamplerConfig::default(), VOCAB, rules)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Drives `s` to its end; the model "predicts" `script[i]` after the i-th forward pass
    /// (prompt pieces of `piece` tokens). Returns the emitted ids and the stop reason.
    fn drive(s: &mut Stepper, piece: usize, script: &[u32]) -> (Vec<u32>, StopReason) {
        let mut out = Vec::new();
        let mut passes = 0;
        loop {
            match s.next() {
                Next::Prefill(rest) => {
                    let n = rest.len().min(piece);
                    let done = n == rest.len();
                    let mut l = peak(if done { script[0] } else { 0 });
                    s.prefilled(n, &mut l, None)
                        .unwrap_or_else(|e| panic!("{e}"));
                    passes += usize::from(done);
                }
                Next::Emit(id) => {
                    let e = s.emit(None).unwrap_or_else(|e| panic!("{e}"));
                    assert_eq!(e.id, id);
                    out.push(id);
                }
                Next::Forward(_) => {
                    let mut l = peak(script[passes]);
                    passes += 1;
                    s.forwarded(&mut l, None).unwrap_or_else(|e| panic!("{e}"));
                }
                Next::Done(reason) => return (out, reason),
                Next::Draft(..) => unreachable!("no shortlist"),
            }
        }
    }

    #[test]
    fn the_prompt_is_fed_in_the_pieces_the_caller_chooses_then_tokens_alternate_with_passes() {
        let mut s = stepper(&[5, 6, 7, 8, 9], 64, rules(3));
        assert_eq!(s.next(), Next::Prefill(&[5, 6, 7, 8, 9]));
        s.prefilled(2, &mut peak(0), None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.next(), Next::Prefill(&[7, 8, 9]));
        s.prefilled(3, &mut peak(40), None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.next(), Next::Emit(40));
        let e = s.emit(None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((e.id, e.stop), (40, None));
        // The emitted token's own forward pass comes after it went out.
        assert_eq!(s.next(), Next::Forward(&[40]));
        s.forwarded(&mut peak(41), None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.next(), Next::Emit(41));
        assert_eq!(s.stats().prompt_tokens, 5);
    }

    #[test]
    fn each_stop_rule_ends_the_generation_with_its_reason() {
        // max_tokens
        let (ids, why) = drive(&mut stepper(&[5, 6], 64, rules(3)), 32, &[10, 11, 12, 13]);
        assert_eq!((ids, why), (vec![10, 11, 12], StopReason::MaxTokens));
        // eos is emitted, then the generation ends
        let (ids, why) = drive(&mut stepper(&[5, 6], 64, rules(9)), 1, &[10, 2, 12]);
        assert_eq!((ids, why), (vec![10, 2], StopReason::Eos));
        // context: 2 prompt tokens + 3 generated fill a room of 4 (the third has no position
        // for its forward pass)
        let (ids, why) = drive(&mut stepper(&[5, 6], 4, rules(9)), 32, &[10, 11, 12, 13]);
        assert_eq!((ids, why), (vec![10, 11, 12], StopReason::ContextFull));
        // max_tokens 0: nothing is sampled
        let (ids, why) = drive(&mut stepper(&[5], 4, rules(0)), 32, &[10]);
        assert_eq!((ids, why), (vec![], StopReason::MaxTokens));
    }

    #[test]
    fn a_cancel_ends_the_generation_and_keeps_what_went_out() {
        let mut s = stepper(&[5], 64, rules(9));
        s.prefilled(1, &mut peak(10), None)
            .unwrap_or_else(|e| panic!("{e}"));
        s.emit(None).unwrap_or_else(|e| panic!("{e}"));
        s.end(StopReason::Cancelled);
        assert_eq!(s.next(), Next::Done(StopReason::Cancelled));
        // A later end does not overwrite the first reason.
        s.end(StopReason::Eos);
        assert_eq!(s.next(), Next::Done(StopReason::Cancelled));
        assert_eq!(s.ids(), &[10]);
        assert_eq!(s.stats().generated_tokens, 1);
    }

    #[test]
    fn a_stop_string_spanning_tokens_ends_the_generation_and_text_comes_out_whole() {
        let tok = Tokenizer::from_gguf(&byte_level_vocab("smollm", &[]))
            .unwrap_or_else(|e| panic!("{e}"));
        let ids = tok.encode("ab\u{e9}cd").unwrap_or_else(|e| panic!("{e}"));
        let vocab = tok.vocab_size();
        let rules = StopRules {
            max_tokens: 99,
            eos: tok.specials().eos.clone(),
            strings: vec!["\u{e9}c".into()],
        };
        let mut s = Stepper::new(&[ids[0]], &[], 64, SamplerConfig::default(), vocab, rules)
            .unwrap_or_else(|e| panic!("{e}"));
        let logits = |id: u32| {
            let mut l = vec![0.0; vocab];
            l[id as usize] = 10.0;
            l
        };
        s.prefilled(1, &mut logits(ids[0]), None)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut texts = Vec::new();
        let mut stop = None;
        for &next in &ids[1..] {
            let e = s.emit(Some(&tok)).unwrap_or_else(|e| panic!("{e}"));
            texts.push(e.text);
            if e.stop.is_some() {
                stop = e.stop;
                break;
            }
            s.forwarded(&mut logits(next), None)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        // "é" is two byte tokens: the first gives no text, the second the whole character.
        assert_eq!(texts, ["a", "b", "", "\u{e9}", "c"]);
        assert_eq!(stop, Some(StopReason::StopString));
        assert_eq!(s.next(), Next::Done(StopReason::StopString));
    }

    #[test]
    fn a_prompt_that_is_empty_or_longer_than_the_room_is_refused() {
        let new = |prompt: &[u32], room| {
            Stepper::new(prompt, &[], room, SamplerConfig::default(), VOCAB, rules(4))
        };
        assert!(new(&[], 8).is_err());
        assert!(new(&[1, 2, 3], 2).is_err());
        assert!(new(&[1, 2], 2).is_ok());
    }

    /// A model over ids 10..14 whose next token after `prev` is its successor (mod 4) with
    /// probability 0.7 and each other id with 0.1.
    fn markov(prev: u32) -> Vec<f32> {
        let mut l = vec![f32::NEG_INFINITY; VOCAB];
        for i in 0..4u32 {
            let p: f32 = if i == (prev + 1 - 10) % 4 { 0.7 } else { 0.1 };
            l[10 + i as usize] = p.ln();
        }
        l
    }

    /// `n` tokens sampled with `seed` from [`markov`], with or without speculation (lookup
    /// drafts are plentiful: four ids repeat); and the speculation's counts.
    fn sample_markov(n: usize, seed: u64, speculate: bool) -> (Vec<u32>, SpeculationStats) {
        let cfg = SamplerConfig {
            temperature: 1.0,
            seed,
            ..SamplerConfig::default()
        };
        let mut s = Stepper::new(&[10, 11], &[], 1 << 20, cfg, VOCAB, rules(n))
            .unwrap_or_else(|e| panic!("{e}"));
        if speculate {
            s = s.speculate(Speculation::new(4));
        }
        s.prefilled(2, &mut markov(11), None)
            .unwrap_or_else(|e| panic!("{e}"));
        loop {
            match s.next() {
                Next::Emit(_) => {
                    s.emit(None).unwrap_or_else(|e| panic!("{e}"));
                }
                Next::Forward(tokens) => {
                    let mut rows: Vec<f32> = tokens.iter().flat_map(|&t| markov(t)).collect();
                    let kept = s
                        .forwarded(&mut rows, None)
                        .unwrap_or_else(|e| panic!("{e}"));
                    assert!(kept >= 1);
                }
                Next::Done(_) => break,
                Next::Prefill(_) | Next::Draft(..) => unreachable!(),
            }
        }
        let spec = s.speculation().cloned().unwrap_or_default();
        (s.ids().to_vec(), spec)
    }

    #[test]
    fn speculative_sampling_keeps_the_models_distribution_and_the_seeded_output() {
        let n = 6000;
        let (ids, spec) = sample_markov(n, 7, true);
        assert!(
            spec.verify_passes > 100 && spec.accepted[1] > 100,
            "{spec:?}"
        );
        // With the same seed, plain decoding samples the same ids.
        assert_eq!(ids, sample_markov(n, 7, false).0);
        // And they follow the model: 70 % of transitions go to the successor.
        let hits = ids
            .windows(2)
            .filter(|w| w[1] - 10 == (w[0] + 1 - 10) % 4)
            .count() as f64;
        let m = (n - 1) as f64;
        let sigma = (m * 0.7 * 0.3).sqrt();
        assert!((hits - 0.7 * m).abs() < 4.0 * sigma, "{hits} of {m}");
    }

    #[test]
    #[should_panic(expected = "Stepper::forwarded")]
    fn a_forward_pass_before_the_token_went_out_is_a_broken_protocol() {
        let mut s = stepper(&[5], 64, rules(9));
        s.prefilled(1, &mut peak(10), None)
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = s.forwarded(&mut peak(11), None);
    }
}
