//! Speculative decoding: read once, verify many.
//!
//! Under a memory cap a decode step is bound by the bytes it streams, and a pass over several
//! positions reads each streamed piece once for all of them. So a [`Stepper`](super::Stepper)
//! with a [`Speculation`] drafts a few tokens after the one it emitted last, from what costs no
//! read, and asks for one pass over all of them (`Next::Forward` with more than one token). It
//! then samples each position in order, exactly as plain decoding would, and keeps the drafts up
//! to the first one the sample differs from; the session forgets the positions after that.
//!
//! The draft is one token per position, so "sample, compare, stop at the first difference" is
//! the standard speculative acceptance rule for a draft distribution that puts all its mass on
//! one token (accept with probability p(draft), else sample from p without it): every emitted
//! token has the model's distribution. With a seeded sampler it is more: the sampler draws its
//! random number for the same positions in the same order, so the output is the plain output
//! token for token, greedy or not.
//!
//! Drafts ([`DraftKind`]):
//! - **forced**: the text a grammar allows as the only continuation (llguidance's forced bytes,
//!   tokenised greedily); nearly always accepted.
//! - **shortlist**: the model's own choice over its output head's resident rows, one position
//!   at a time, where the body is resident and only the rest of the head streams
//!   ([`crate::forward::Session::forward_shortlist`]); the rest of the head is then read once
//!   for all the drafted positions instead of once per token.
//! - **lookup**: the tokens that followed the last earlier occurrence of the context's final
//!   n-gram (prompt lookup decoding); pays on text that repeats its prompt or itself.
//!
//! A grammar's forced text goes first; then the shortlist where the session has one; lookup
//! otherwise.
//!
//! How many to draft: the `j`-th draft token is accepted with probability about `a^j` (`a` the
//! measured acceptance of its kind) and costs `c` of a one-token pass (an extra row's compute,
//! measured from the pass times), so drafts are kept while `a^j > c`. A kind whose acceptance
//! fell to nothing is still tried with one token every [`PROBE_EVERY`] passes, so it can
//! recover.

use std::time::Duration;

/// Whether a generation speculates: `auto` where the model streams weights (the caller decides),
/// `off` never.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpeculateMode {
    #[default]
    Auto,
    Off,
}

impl SpeculateMode {
    /// Parses `auto` or `off`.
    pub fn parse(s: &str) -> Option<SpeculateMode> {
        match s {
            "auto" => Some(SpeculateMode::Auto),
            "off" => Some(SpeculateMode::Off),
            _ => None,
        }
    }

    /// `auto` or `off`.
    pub const fn name(self) -> &'static str {
        match self {
            SpeculateMode::Auto => "auto",
            SpeculateMode::Off => "off",
        }
    }
}

/// Where a draft came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftKind {
    /// Tokens a grammar forces.
    Forced,
    /// Tokens that followed the context's last n-gram earlier on.
    Lookup,
    /// Tokens the model chose over its head's resident rows.
    Shortlist,
}

/// Number of [`DraftKind`]s (the length of the per-kind counts).
pub const KINDS: usize = 3;

impl DraftKind {
    pub const ALL: [DraftKind; KINDS] =
        [DraftKind::Forced, DraftKind::Lookup, DraftKind::Shortlist];

    /// `forced`, `lookup` or `shortlist`.
    pub const fn name(self) -> &'static str {
        match self {
            DraftKind::Forced => "forced",
            DraftKind::Lookup => "lookup",
            DraftKind::Shortlist => "shortlist",
        }
    }
}

/// Most tokens drafted after one emitted token (a pass then runs this many plus one).
pub const MAX_DRAFT: usize = 8;

/// Longest n-gram of the context a lookup draft matches, then shorter ones down to
/// [`LOOKUP_MIN_NGRAM`].
const LOOKUP_MAX_NGRAM: usize = 4;
const LOOKUP_MIN_NGRAM: usize = 2;

/// A kind the policy stopped drafting still drafts one token every this many passes.
pub const PROBE_EVERY: usize = 16;

/// What an extra row costs, as a share of a one-token pass, until passes were timed: little
/// where the pass streams weights (it waits on reads), half a pass where every weight is
/// resident (the rows' compute is what it costs).
pub const STREAMED_ROW_COST: f64 = 0.1;
pub const RESIDENT_ROW_COST: f64 = 0.5;

/// Accepted draft tokens counted before any was drafted, per kind (in [`DraftKind::ALL`]
/// order; one rejection is never counted beforehand): a grammar's forced text starts at an
/// acceptance of 0.9 (it is what the grammar allows, so the model nearly always agrees), the
/// others at one half.
const PRIOR_HITS: [f64; KINDS] = [8.0, 0.0, 0.0];

/// Weight of the past in the measured acceptance and pass times, per observation.
const DECAY: f64 = 0.95;

/// Counts of one generation's speculation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpeculationStats {
    /// Forward passes of the decode phase (with or without drafts).
    pub passes: usize,
    /// Passes that verified at least one draft token.
    pub verify_passes: usize,
    /// Draft tokens proposed, per kind (in [`DraftKind::ALL`] order).
    pub drafted: [usize; KINDS],
    /// Draft tokens accepted, per kind.
    pub accepted: [usize; KINDS],
    /// Tokens sampled by the decode phase's passes (each pass samples one plus what it accepted).
    pub sampled: usize,
}

impl SpeculationStats {
    /// Accepted ÷ drafted tokens of `kind`, or `None` if none was drafted.
    pub fn acceptance(&self, kind: DraftKind) -> Option<f64> {
        let i = kind as usize;
        (self.drafted[i] > 0).then(|| self.accepted[i] as f64 / self.drafted[i] as f64)
    }

    /// Tokens sampled per decode pass (1.0 without speculation).
    pub fn tokens_per_pass(&self) -> f64 {
        if self.passes == 0 {
            1.0
        } else {
            self.sampled as f64 / self.passes as f64
        }
    }
}

/// The state of speculation in one generation: the drafts' measured acceptance and the pass
/// cost, and the counts.
#[derive(Clone, Debug)]
pub struct Speculation {
    max_draft: usize,
    /// [`Speculation::row_cost`] until passes of two sizes were timed.
    prior_row_cost: f64,
    /// Whether the session drafts from its head's resident rows (the size of the shortlist).
    shortlist: Option<usize>,
    /// Decayed counts of accepted and rejected draft tokens, per kind.
    hits: [f64; KINDS],
    misses: [f64; KINDS],
    /// Passes since a kind last drafted, per kind.
    idle: [usize; KINDS],
    /// Per kind, decayed sums for a least-squares line of pass time over rows: Σw, Σw·n,
    /// Σw·n², Σw·t, Σw·n·t (a shortlist's row is a pass over the body; a verified row is
    /// one more row of a batched pass).
    fit: [[f64; 5]; KINDS],
    stats: SpeculationStats,
}

impl Speculation {
    /// Speculation drafting at most `max_draft` tokens a pass (capped at [`MAX_DRAFT`]; the
    /// realtime class bounds it lower for latency), for passes that stream weights.
    pub fn new(max_draft: usize) -> Speculation {
        Speculation::with_row_cost(max_draft, STREAMED_ROW_COST)
    }

    /// [`Speculation::new`], with `prior_row_cost` as the cost of a row until passes were timed.
    pub fn with_row_cost(max_draft: usize, prior_row_cost: f64) -> Speculation {
        Speculation {
            max_draft: max_draft.min(MAX_DRAFT),
            prior_row_cost,
            shortlist: None,
            hits: PRIOR_HITS,
            misses: [0.0; KINDS],
            idle: [0; KINDS],
            fit: [[0.0; 5]; KINDS],
            stats: SpeculationStats::default(),
        }
    }

    /// Drafts from the session's shortlist of `rows` head rows (see
    /// [`crate::forward::Session::forward_shortlist`]) where no grammar forces text.
    pub fn with_shortlist(mut self, rows: Option<usize>) -> Speculation {
        self.shortlist = rows;
        self
    }

    pub fn stats(&self) -> &SpeculationStats {
        &self.stats
    }

    /// The measured acceptance of `kind`'s next draft token (the prior of [`PRIOR_HITS`] before
    /// any).
    fn acceptance(&self, kind: DraftKind) -> f64 {
        let i = kind as usize;
        (self.hits[i] + 1.0) / (self.hits[i] + self.misses[i] + 2.0)
    }

    /// What one more row of `kind` adds to a pass, as a share of a one-token pass: the slope
    /// of pass time over rows divided by its value at one row, from the timed passes; the prior
    /// until passes of two different sizes were timed.
    pub fn row_cost(&self, kind: DraftKind) -> f64 {
        let [w, n, nn, t, nt] = self.fit[kind as usize];
        let var = w * nn - n * n;
        if w <= 0.0 || var <= 1e-9 * w * w {
            return self.prior_row_cost;
        }
        let slope = (w * nt - n * t) / var;
        let at_one = (t - slope * n) / w + slope;
        if at_one <= 0.0 {
            return self.prior_row_cost;
        }
        (slope / at_one).clamp(0.0, 1.0)
    }

    /// How many of `proposed` draft tokens of `kind` are worth a row each, at most `limit`.
    fn worth(&mut self, kind: DraftKind, proposed: usize, limit: usize) -> usize {
        let (a, c) = (self.acceptance(kind), self.row_cost(kind));
        let mut j = 0;
        let mut p = 1.0;
        while j < proposed.min(limit) {
            p *= a;
            if p <= c {
                break;
            }
            j += 1;
        }
        let i = kind as usize;
        if j == 0 && proposed > 0 && limit > 0 {
            self.idle[i] += 1;
            if self.idle[i] >= PROBE_EVERY {
                j = 1;
            }
        }
        if j > 0 {
            self.idle[i] = 0;
        }
        j
    }

    /// The draft after `history` (everything the model has seen and sampled, the last sampled
    /// token at the end): the grammar's `forced` tokens when there are some, else the
    /// shortlist's (only a count: the session drafts them while it runs), else a lookup in
    /// `history`; at most `limit` tokens (the room left in the context and the generation),
    /// as many as the policy finds worth a row.
    pub fn draft(&mut self, history: &[u32], forced: &[u32], limit: usize) -> Draft {
        let limit = limit.min(self.max_draft);
        if forced.is_empty() && self.shortlist.is_some() {
            let n = self.worth(DraftKind::Shortlist, self.max_draft, limit);
            return Draft::Shortlist(n);
        }
        let (kind, mut tokens) = if forced.is_empty() {
            (DraftKind::Lookup, lookup(history, self.max_draft))
        } else {
            (DraftKind::Forced, forced.to_vec())
        };
        let keep = self.worth(kind, tokens.len(), limit);
        tokens.truncate(keep);
        Draft::Tokens(kind, tokens)
    }

    /// A decode pass of `rows` positions took `took`; `kind`'s `drafted` tokens in it had
    /// `accepted` accepted (the positions sampled were `accepted + 1`).
    pub fn observe(&mut self, kind: DraftKind, drafted: usize, accepted: usize, took: Duration) {
        let i = kind as usize;
        let s = &mut self.stats;
        s.passes += 1;
        s.sampled += accepted + 1;
        if drafted > 0 {
            s.verify_passes += 1;
            s.drafted[i] += drafted;
            s.accepted[i] += accepted;
            self.hits[i] = self.hits[i] * DECAY + accepted as f64;
            self.misses[i] = self.misses[i] * DECAY + f64::from(u8::from(accepted < drafted));
        }
        let (n, t) = ((drafted + 1) as f64, took.as_secs_f64());
        for (sum, add) in self.fit[i].iter_mut().zip([1.0, n, n * n, t, n * t]) {
            *sum = *sum * DECAY + add;
        }
    }
}

/// What [`Speculation::draft`] proposes after the token emitted last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Draft {
    /// These tokens, from a grammar or a lookup (possibly none).
    Tokens(DraftKind, Vec<u32>),
    /// This many tokens from the session's shortlist, drafted while it runs.
    Shortlist(usize),
}

/// Up to `max` tokens that followed the most recent earlier occurrence of the longest final
/// n-gram of `history` that occurred before (from [`LOOKUP_MAX_NGRAM`] tokens down to
/// [`LOOKUP_MIN_NGRAM`]); empty if none did.
pub fn lookup(history: &[u32], max: usize) -> Vec<u32> {
    let len = history.len();
    for n in (LOOKUP_MIN_NGRAM..=LOOKUP_MAX_NGRAM).rev() {
        if len <= n {
            continue;
        }
        let tail = &history[len - n..];
        // The latest start `s < len - n` with `history[s..s + n] == tail`.
        if let Some(s) = (0..len - n).rev().find(|&s| &history[s..s + n] == tail) {
            let from = s + n;
            return history[from..(from + max).min(len)].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_continues_the_latest_earlier_occurrence_of_the_longest_final_ngram() {
        // "7 8 9" occurred twice before; the later one is followed by 4 5.
        let h = [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 7, 8, 9];
        assert_eq!(lookup(&h, 3), vec![4, 5, 6]);
        assert_eq!(lookup(&h, 1), vec![4]);
        // Only the bigram "2 3" matches; what follows it runs up to the end of the history.
        assert_eq!(lookup(&[1, 2, 3, 4, 9, 2, 3], 8), vec![4, 9, 2, 3]);
        // No repeated bigram: nothing (a single repeated token is not enough).
        assert!(lookup(&[1, 2, 3, 1], 4).is_empty());
        assert!(lookup(&[], 4).is_empty());
    }

    #[test]
    fn drafts_shrink_as_acceptance_falls_and_a_dead_kind_is_still_probed() {
        let mut s = Speculation::new(MAX_DRAFT);
        let h: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2].to_vec();
        let Draft::Tokens(DraftKind::Lookup, first) = s.draft(&h, &[], 8) else {
            panic!("no grammar, no shortlist: a lookup");
        };
        assert!(!first.is_empty(), "a prior of one half drafts something");
        // Every draft rejected, in passes whose time grows with rows (an extra row costs half
        // a pass): the policy stops drafting.
        for rows in [1usize, 2, 1, 3, 1, 2].into_iter().cycle().take(60) {
            let took = Duration::from_millis(10 + 5 * (rows as u64 - 1));
            s.observe(DraftKind::Lookup, rows - 1, 0, took);
        }
        let cost = s.row_cost(DraftKind::Lookup);
        assert!((cost - 0.5).abs() < 0.01, "{cost}");
        let mut probes = 0;
        for _ in 0..PROBE_EVERY {
            let Draft::Tokens(_, tokens) = s.draft(&h, &[], 8) else {
                panic!("a lookup");
            };
            probes += tokens.len();
        }
        assert_eq!(probes, 1, "one probe token per {PROBE_EVERY} passes");
        // Forced tokens are drafted whole while they are accepted.
        for _ in 0..10 {
            s.observe(DraftKind::Forced, 4, 4, Duration::from_millis(12));
        }
        let forced = Draft::Tokens(DraftKind::Forced, vec![5, 6, 7, 8]);
        assert_eq!(s.draft(&h, &[5, 6, 7, 8], 8), forced);
        // The limit (room left) bounds any draft.
        let two = Draft::Tokens(DraftKind::Forced, vec![5, 6]);
        assert_eq!(s.draft(&h, &[5, 6, 7, 8], 2), two);
        // With a shortlist, it drafts where no grammar forces text (with its own prior).
        let mut s = s.with_shortlist(Some(1000));
        assert_eq!(s.draft(&h, &[], 8), Draft::Shortlist(3), "0.5^3 > 0.1");
        assert_eq!(
            s.draft(&h, &[5, 6], 8),
            Draft::Tokens(DraftKind::Forced, vec![5, 6])
        );
        assert_eq!(s.stats().acceptance(DraftKind::Forced), Some(1.0));
        assert_eq!(s.stats().acceptance(DraftKind::Lookup), Some(0.0));
    }
}
