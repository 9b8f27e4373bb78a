//! Score cut-offs for a target recall, and recall / fetch-fraction bookkeeping.

/// The largest cut-off `c` such that at least `recall` of `active_scores` are `>= c`: the
/// `(1 - recall)` quantile of the scores of the neurons that were active. Reorders the slice.
/// Returns `f32::NEG_INFINITY` (fetch everything) for an empty slice or `recall >= 1`.
pub fn cutoff_for_recall(active_scores: &mut [f32], recall: f32) -> f32 {
    if active_scores.is_empty() || recall >= 1.0 {
        return f32::NEG_INFINITY;
    }
    let misses = ((1.0 - recall.max(0.0)) as f64 * active_scores.len() as f64).floor() as usize;
    let k = misses.min(active_scores.len() - 1);
    let (_, c, _) = active_scores.select_nth_unstable_by(k, f32::total_cmp);
    *c
}

/// Counts, over many token-layers, how many active neurons a cut-off fetches and how many neurons
/// it fetches in all.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RecallCounter {
    /// Neurons that were active.
    pub active: u64,
    /// Active neurons whose score reached the cut-off.
    pub hit: u64,
    /// Neurons whose score reached the cut-off.
    pub fetched: u64,
    /// Neurons scored.
    pub total: u64,
}

impl RecallCounter {
    /// Adds one token-layer: `scores[i]` against `cutoff`, `active(i)` the truth.
    pub fn add(&mut self, scores: &[f32], cutoff: f32, active: impl Fn(usize) -> bool) {
        for (i, &s) in scores.iter().enumerate() {
            let (a, f) = (active(i), s >= cutoff);
            self.active += u64::from(a);
            self.fetched += u64::from(f);
            self.hit += u64::from(a && f);
        }
        self.total += scores.len() as u64;
    }

    /// Fraction of active neurons fetched (1 when nothing was active).
    pub fn recall(&self) -> f64 {
        if self.active == 0 {
            1.0
        } else {
            self.hit as f64 / self.active as f64
        }
    }

    /// Fraction of all neurons fetched.
    pub fn fetch_fraction(&self) -> f64 {
        self.fetched as f64 / self.total.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cutoff_reaches_the_recall_asked_for() {
        let mut s: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let c = cutoff_for_recall(&mut s, 0.95);
        assert_eq!(c, 5.0);
        let kept = (0..100).filter(|&i| i as f32 >= c).count();
        assert_eq!(kept, 95);
        assert_eq!(cutoff_for_recall(&mut [], 0.9), f32::NEG_INFINITY);
        assert_eq!(cutoff_for_recall(&mut [1.0], 1.0), f32::NEG_INFINITY);
    }

    #[test]
    fn counter_counts_hits_and_fetches() {
        let mut r = RecallCounter::default();
        r.add(&[0.1, 0.9, 0.5, 0.7], 0.5, |i| i == 1 || i == 0);
        assert_eq!((r.active, r.hit, r.fetched, r.total), (2, 1, 3, 4));
        assert_eq!(r.recall(), 0.5);
        assert_eq!(r.fetch_fraction(), 0.75);
    }
}
