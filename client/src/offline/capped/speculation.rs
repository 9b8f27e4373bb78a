//! Speculative decoding in the capped bench: what each child's `leanstream run --json` says of
//! its decode passes and drafts, summed over a row's prompts into tokens per pass and draft
//! acceptance.

use serde_json::Value;

/// Decode passes, the tokens they sampled, and draft tokens proposed and accepted (all kinds
/// together), of one child or summed over a row's children.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Passes {
    /// Decode passes (one per token without speculation).
    pub passes: f64,
    /// Tokens those passes sampled (each pass samples one plus the draft tokens it accepted).
    pub sampled: f64,
    pub drafted: u64,
    pub accepted: u64,
}

impl Passes {
    /// Reads the `speculation` object of a `leanstream run --json` object that decoded
    /// `decoded` tokens; `None` when the object has none. Without speculation (`passes` null)
    /// every decoded token took a pass of its own.
    pub(crate) fn from_run_json(v: &Value, decoded: u64) -> Option<Passes> {
        let s = v.get("speculation")?;
        let per_pass = s["tokens_per_pass"].as_f64()?;
        let passes = s["passes"].as_u64().map_or(decoded as f64, |p| p as f64);
        let drafts = s["drafts"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        let sum = |key: &str| drafts.iter().filter_map(|d| d[key].as_u64()).sum::<u64>();
        Some(Passes {
            passes,
            sampled: per_pass * passes,
            drafted: sum("drafted"),
            accepted: sum("accepted"),
        })
    }

    /// Adds another child's counts.
    pub(crate) fn add(&mut self, other: Passes) {
        self.passes += other.passes;
        self.sampled += other.sampled;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
    }

    /// Tokens sampled per decode pass; 1.0 when no pass ran.
    pub(crate) fn tokens_per_pass(&self) -> f64 {
        if self.passes > 0.0 {
            self.sampled / self.passes
        } else {
            1.0
        }
    }

    /// Accepted ÷ drafted tokens, or `None` when nothing was drafted.
    pub(crate) fn acceptance(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(per_pass: f64, passes: Option<u64>, drafts: [(u64, u64); 2]) -> Value {
        json!({ "speculation": {
            "mode": "auto",
            "on": passes.is_some(),
            "tokens_per_pass": per_pass,
            "passes": passes,
            "drafts": [
                { "kind": "forced", "drafted": drafts[0].0, "accepted": drafts[0].1 },
                { "kind": "lookup", "drafted": drafts[1].0, "accepted": drafts[1].1 },
            ],
        }})
    }

    #[test]
    fn prompts_sum_into_tokens_per_pass_weighted_by_passes_and_acceptance_over_all_kinds() {
        // 20 passes at 1.5 (30 tokens) and 10 passes at 1.0 (10 tokens): 40 / 30 per pass.
        let mut p = Passes::from_run_json(&spec(1.5, Some(20), [(4, 3), (12, 7)]), 30).unwrap();
        p.add(Passes::from_run_json(&spec(1.0, Some(10), [(0, 0), (4, 0)]), 10).unwrap());
        assert!((p.tokens_per_pass() - 40.0 / 30.0).abs() < 1e-9, "{p:?}");
        assert_eq!((p.drafted, p.accepted), (20, 10));
        assert_eq!(p.acceptance(), Some(0.5));
    }

    #[test]
    fn without_speculation_every_token_is_a_pass_and_acceptance_is_none() {
        let p = Passes::from_run_json(&spec(1.0, None, [(0, 0), (0, 0)]), 31).unwrap();
        assert_eq!(p.passes, 31.0);
        assert_eq!(p.tokens_per_pass(), 1.0);
        assert_eq!(p.acceptance(), None);
        assert_eq!(Passes::from_run_json(&json!({ "stats": {} }), 31), None);
        assert_eq!(Passes::default().tokens_per_pass(), 1.0);
    }
}
