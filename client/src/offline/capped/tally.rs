//! Folding children into rows: a row per engine and cap from its prompts' children, and the
//! median row of interleaved runs.

use super::child::ChildRun;
use super::speculation::Passes;
use super::{CappedRow, Outcome};

/// Sums the prompts' children of one engine under one cap into a row.
pub(super) struct Tally {
    pub(super) row: CappedRow,
    decode_s: f64,
    /// The completed children's decode passes and drafts, where they report them.
    passes: Option<Passes>,
}

impl Tally {
    pub(super) fn new(engine: &str, cap: u64) -> Tally {
        Tally {
            row: CappedRow {
                engine: engine.to_string(),
                cap_bytes: cap,
                outcome: Outcome::Completed,
                decode_tokens_per_s: 0.0,
                runs_tokens_per_s: Vec::new(),
                peak_cgroup_bytes: None,
                read_bytes_per_token: 0.0,
                predicted_read_bytes_per_token: None,
                disk_bytes_per_s: None,
                predicted_bound_tok_s: None,
                tokens_decoded: 0,
                tokens_per_pass: None,
                draft_acceptance: None,
                nll_delta: None,
                plan_floor: None,
                plan_resident_bytes: None,
                note: None,
            },
            decode_s: 0.0,
            passes: None,
        }
    }

    /// Adds one child: its decode figures when it completed (tokens, seconds, and the bytes it
    /// read while decoding where it counts them; else its block input is taken).
    pub(super) fn add(&mut self, run: &ChildRun, decode: Option<Decoded>) {
        let r = &mut self.row;
        r.peak_cgroup_bytes = r.peak_cgroup_bytes.max(run.peak);
        match (run.outcome, decode) {
            (Outcome::Completed, Some(d)) => {
                r.tokens_decoded += d.tokens;
                self.decode_s += d.seconds;
                r.read_bytes_per_token += d
                    .read_bytes_per_token
                    .map_or(run.read_bytes as f64, |b| b * d.tokens as f64);
                if let Some(p) = d.passes {
                    self.passes.get_or_insert_with(Passes::default).add(p);
                }
            }
            (outcome, _) => {
                if r.outcome == Outcome::Completed {
                    r.outcome = if outcome == Outcome::Completed {
                        Outcome::Failed
                    } else {
                        outcome
                    };
                    r.note = run
                        .stderr
                        .lines()
                        .rev()
                        .find(|l| !l.trim().is_empty())
                        .map(str::to_string);
                }
            }
        }
    }

    pub(super) fn finish(mut self) -> CappedRow {
        let r = &mut self.row;
        if r.outcome == Outcome::Completed {
            r.decode_tokens_per_s = r.tokens_decoded as f64 / self.decode_s.max(1e-9);
            r.runs_tokens_per_s = vec![r.decode_tokens_per_s];
            r.read_bytes_per_token /= r.tokens_decoded.max(1) as f64;
            r.tokens_per_pass = self.passes.map(|p| p.tokens_per_pass());
            r.draft_acceptance = self.passes.and_then(|p| p.acceptance());
        } else {
            r.read_bytes_per_token = 0.0;
            r.runs_tokens_per_s = vec![0.0];
        }
        self.row
    }
}

/// What a completed child decoded.
pub(crate) struct Decoded {
    pub tokens: u64,
    pub seconds: f64,
    /// Storage bytes per decoded token by the engine's own count, where it keeps one.
    pub read_bytes_per_token: Option<f64>,
    /// Decode passes and drafts, where the engine reports them (LeanStream only).
    pub passes: Option<Passes>,
}

/// One row per (cap, engine) from `runs` runs of each: the median run by decode tokens/s (its
/// bytes read, tokens per pass and draft acceptance with it), with every run's tokens/s, the
/// highest peak, in the order rows first appear.
pub(super) fn medians(all: Vec<CappedRow>) -> Vec<CappedRow> {
    let mut groups: Vec<Vec<CappedRow>> = Vec::new();
    for row in all {
        match groups
            .iter_mut()
            .find(|g| g[0].cap_bytes == row.cap_bytes && g[0].engine == row.engine)
        {
            Some(g) => g.push(row),
            None => groups.push(vec![row]),
        }
    }
    groups
        .into_iter()
        .map(|g| {
            let runs: Vec<f64> = g.iter().map(|r| r.decode_tokens_per_s).collect();
            let peak = g.iter().filter_map(|r| r.peak_cgroup_bytes).max();
            let nll = g.iter().find_map(|r| r.nll_delta);
            let mut sorted = g;
            sorted.sort_by(|a, b| a.decode_tokens_per_s.total_cmp(&b.decode_tokens_per_s));
            let mut row = sorted.swap_remove(sorted.len() / 2);
            row.runs_tokens_per_s = runs;
            row.peak_cgroup_bytes = peak;
            row.nll_delta = nll;
            row
        })
        .collect()
}

/// One line on a finished row, for the progress log.
pub(super) fn row_summary(r: &CappedRow) -> String {
    let mib = |b: f64| b / (1 << 20) as f64;
    format!(
        "  {} at {} MB: {:?}, {:.3} tok/s, {:.1} MiB read per token (plan {}), peak {} MiB",
        r.engine,
        r.cap_bytes / 1_000_000,
        r.outcome,
        r.decode_tokens_per_s,
        mib(r.read_bytes_per_token),
        r.predicted_read_bytes_per_token
            .map_or("-".into(), |b| format!("{:.1}", mib(b))),
        r.peak_cgroup_bytes
            .map_or("-".into(), |b| format!("{:.0}", mib(b as f64))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_of(engine: &str, cap: u64, tps: f64, peak: u64) -> CappedRow {
        let mut t = Tally::new(engine, cap);
        t.row.tokens_decoded = 10;
        t.row.peak_cgroup_bytes = Some(peak);
        t.decode_s = 10.0 / tps;
        t.finish()
    }

    #[test]
    fn interleaved_runs_fold_into_the_median_run_of_each_row_in_first_seen_order() {
        let all = vec![
            run_of("unified", 100, 3.0, 50),
            run_of("planned-dense", 100, 1.0, 60),
            run_of("unified", 100, 9.0, 70),
            run_of("planned-dense", 100, 2.0, 40),
            run_of("unified", 100, 4.0, 55),
            run_of("planned-dense", 100, 1.5, 45),
        ];
        let rows = medians(all);
        let names: Vec<&str> = rows.iter().map(|r| r.engine.as_str()).collect();
        assert_eq!(names, ["unified", "planned-dense"]);
        assert!((rows[0].decode_tokens_per_s - 4.0).abs() < 1e-9);
        assert!((rows[1].decode_tokens_per_s - 1.5).abs() < 1e-9);
        assert_eq!(rows[0].runs_tokens_per_s.len(), 3);
        assert!((rows[0].runs_tokens_per_s[1] - 9.0).abs() < 1e-9);
        assert_eq!(rows[0].peak_cgroup_bytes, Some(70));
    }

    fn child(outcome: Outcome) -> ChildRun {
        ChildRun {
            outcome,
            stdout: String::new(),
            stderr: "out of memory\n".into(),
            read_bytes: 0,
            peak: Some(10),
        }
    }

    fn decoded(tokens: u64, passes: f64, drafted: u64, accepted: u64) -> Decoded {
        Decoded {
            tokens,
            seconds: 1.0,
            read_bytes_per_token: Some(0.0),
            passes: Some(Passes {
                passes,
                sampled: tokens as f64,
                drafted,
                accepted,
            }),
        }
    }

    #[test]
    fn a_row_sums_its_prompts_passes_and_drafts_and_the_median_run_keeps_its_own() {
        let mut t = Tally::new("unified", 100);
        t.add(&child(Outcome::Completed), Some(decoded(30, 20.0, 16, 10)));
        t.add(&child(Outcome::Completed), Some(decoded(10, 10.0, 4, 0)));
        let row = t.finish();
        assert!((row.tokens_per_pass.unwrap() - 40.0 / 30.0).abs() < 1e-9);
        assert_eq!(row.draft_acceptance, Some(0.5));

        let mut t = Tally::new("unified-nospec", 100);
        t.add(&child(Outcome::Completed), Some(decoded(30, 30.0, 0, 0)));
        let row = t.finish();
        assert_eq!(
            (row.tokens_per_pass, row.draft_acceptance),
            (Some(1.0), None)
        );

        let mut t = Tally::new("unified", 100);
        t.add(&child(Outcome::Completed), Some(decoded(30, 20.0, 16, 10)));
        t.add(&child(Outcome::Killed), None);
        let row = t.finish();
        assert_eq!((row.tokens_per_pass, row.draft_acceptance), (None, None));

        let with = |tps: f64, per_pass: f64| {
            let mut r = run_of("unified", 100, tps, 1);
            r.tokens_per_pass = Some(per_pass);
            r
        };
        let rows = medians(vec![with(3.0, 1.2), with(9.0, 1.9), with(4.0, 1.5)]);
        assert_eq!(rows[0].tokens_per_pass, Some(1.5));
    }
}
