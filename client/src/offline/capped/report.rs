//! The capped bench's output: a table with both engines side by side per cap, the rows as JSON,
//! and an SVG of decode tokens/s against the cap (log scale: the engines differ by orders of
//! magnitude under tight caps).

use std::fmt::Write as _;

use leanstream_engine::bench::report::escape;

use super::{CappedRow, Engine, Outcome};
use crate::table::{Align, render};

fn mb(b: u64) -> String {
    format!("{:.0}", b as f64 / 1e6)
}

/// The rows as an aligned table, with each LeanStream row's tokens/s ÷ `planned-dense`'s,
/// `unified-nospec`'s and llama.cpp's at the same cap, and its tokens per decode pass and draft
/// acceptance.
pub fn table(rows: &[CappedRow]) -> String {
    let header = [
        "cap MB",
        "engine",
        "outcome",
        "tok/s",
        "runs",
        "× dense",
        "× no spec",
        "× llama",
        "tok/pass",
        "accept",
        "peak MiB",
        "read/tok MiB",
        "plan read/tok MiB",
        "disk MB/s",
        "plan bound tok/s",
        "nll Δ",
    ];
    let nospec = Engine::UnifiedNoSpec.name();
    // The completed row of `engine` at `cap`: its tokens/s.
    let tps_of = |engine: &str, cap: u64| {
        rows.iter()
            .find(|r| r.engine == engine && r.cap_bytes == cap && r.outcome == Outcome::Completed)
            .map(|r| r.decode_tokens_per_s)
    };
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let ratio = |to: Option<f64>, own: &str| match to {
                Some(t) if r.engine != own && r.engine != "llama.cpp" => {
                    format!("{:.2}", r.decode_tokens_per_s / t.max(1e-9))
                }
                _ => "-".to_string(),
            };
            let runs: Vec<String> = r
                .runs_tokens_per_s
                .iter()
                .map(|t| format!("{t:.2}"))
                .collect();
            vec![
                mb(r.cap_bytes),
                r.engine.clone(),
                format!("{:?}", r.outcome).to_lowercase(),
                format!("{:.2}", r.decode_tokens_per_s),
                runs.join(" "),
                ratio(tps_of("planned-dense", r.cap_bytes), "planned-dense"),
                ratio(tps_of(nospec, r.cap_bytes), nospec),
                ratio(tps_of("llama.cpp", r.cap_bytes), "llama.cpp"),
                r.tokens_per_pass
                    .filter(|_| r.outcome == Outcome::Completed)
                    .map_or("-".into(), |t| format!("{t:.2}")),
                r.draft_acceptance
                    .filter(|_| r.outcome == Outcome::Completed)
                    .map_or("-".into(), |a| format!("{:.0}%", a * 100.0)),
                r.peak_cgroup_bytes.map_or("-".into(), |b| {
                    format!("{:.1}", b as f64 / (1 << 20) as f64)
                }),
                format!("{:.1}", r.read_bytes_per_token / (1 << 20) as f64),
                r.predicted_read_bytes_per_token
                    .map_or("-".into(), |b| format!("{:.1}", b / (1 << 20) as f64)),
                r.disk_bytes_per_s
                    .map_or("-".into(), |b| format!("{:.0}", b / 1e6)),
                r.predicted_bound_tok_s
                    .map_or("-".into(), |t| format!("{t:.1}")),
                r.nll_delta
                    .map_or("-".into(), |d| format!("{:+.2}%", d * 100.0)),
            ]
        })
        .collect();
    let header: Vec<(&str, Align)> = header
        .iter()
        .map(|&h| match h {
            "engine" | "outcome" | "runs" => (h, Align::Left),
            _ => (h, Align::Right),
        })
        .collect();
    render(&header, &cells)
}

/// What LeanStream's plan held besides streamed weights at each cap: the floor by part and
/// the resident weights, in MiB.
pub fn floors(rows: &[CappedRow]) -> String {
    let mut s = String::new();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    for (r, f) in rows.iter().filter_map(|r| Some((r, r.plan_floor?))) {
        let _ = writeln!(
            s,
            "plan at {} MB: runtime {:.1} + tokenizer {:.1} + tables {:.1} + session and KV {:.1} + ring {:.1} MiB, resident weights {:.1} MiB",
            mb(r.cap_bytes),
            mib(f.runtime),
            mib(f.tokenizer),
            mib(f.tables),
            mib(f.session),
            mib(f.ring),
            mib(r.plan_resident_bytes.unwrap_or(0)),
        );
    }
    s
}

/// The rows as pretty JSON.
pub fn json(rows: &[CappedRow]) -> String {
    serde_json::to_string_pretty(rows).unwrap_or_else(|_| "[]".into())
}

/// Decode tokens/s (log scale) against the cap, one line per engine; killed and timed-out rows
/// are drawn as crosses on the axis.
pub fn svg(rows: &[CappedRow], title: &str) -> String {
    let (w, h, left, bottom, top, right) = (640.0, 400.0, 60.0, 50.0, 40.0, 140.0);
    let caps: Vec<u64> = rows.iter().map(|r| r.cap_bytes).collect();
    let (cmin, cmax) = (
        *caps.iter().min().unwrap_or(&0) as f64,
        *caps.iter().max().unwrap_or(&1) as f64,
    );
    let tps: Vec<f64> = rows
        .iter()
        .map(|r| r.decode_tokens_per_s)
        .filter(|t| *t > 0.0)
        .collect();
    let lo = tps
        .iter()
        .cloned()
        .fold(f64::INFINITY, f64::min)
        .min(1.0)
        .log10()
        .floor()
        - 0.0;
    let hi = tps
        .iter()
        .cloned()
        .fold(1.0, f64::max)
        .log10()
        .ceil()
        .max(lo + 1.0);
    let x = |c: f64| left + (c - cmin) / (cmax - cmin).max(1.0) * (w - left - right);
    let y =
        |t: f64| h - bottom - (t.max(10f64.powf(lo)).log10() - lo) / (hi - lo) * (h - top - bottom);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="20" font-size="14">{}</text>"#,
        escape(title)
    );
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        h - bottom,
        w - right,
        h - bottom
    );
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>"#,
        h - bottom
    );
    for e in (lo as i32)..=(hi as i32) {
        let t = 10f64.powi(e);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            left - 6.0,
            y(t) + 4.0,
            t
        );
    }
    let mut seen = Vec::new();
    for &c in &caps {
        if !seen.contains(&c) {
            seen.push(c);
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
                x(c as f64),
                h - bottom + 16.0,
                mb(c)
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">memory cap (MB)</text>"#,
        (left + w - right) / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">decode tokens/s</text>"#,
        h / 2.0,
        h / 2.0
    );
    let colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let mut engines: Vec<&str> = Vec::new();
    for r in rows {
        if !engines.contains(&r.engine.as_str()) {
            engines.push(&r.engine);
        }
    }
    for (i, e) in engines.iter().enumerate() {
        let colour = colours[i % colours.len()];
        let mut pts: Vec<&CappedRow> = rows.iter().filter(|r| r.engine == *e).collect();
        pts.sort_by_key(|r| r.cap_bytes);
        let line: Vec<String> = pts
            .iter()
            .filter(|r| r.outcome == Outcome::Completed)
            .map(|r| {
                format!(
                    "{:.1},{:.1}",
                    x(r.cap_bytes as f64),
                    y(r.decode_tokens_per_s)
                )
            })
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            line.join(" ")
        );
        for r in &pts {
            let (px, py) = (x(r.cap_bytes as f64), y(r.decode_tokens_per_s));
            if r.outcome == Outcome::Completed {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{px:.1}" cy="{py:.1}" r="3" fill="{colour}"/>"#
                );
            } else {
                let _ = writeln!(
                    s,
                    r#"<text x="{px:.1}" y="{:.1}" fill="{colour}" text-anchor="middle">×</text>"#,
                    h - bottom - 4.0
                );
            }
        }
        let ly = top + 20.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"/>"#,
            w - right + 10.0,
            w - right + 30.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            w - right + 36.0,
            ly + 4.0,
            escape(e)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use leanstream_engine::plan::Floor;

    fn row(engine: &str, cap: u64, tps: f64, outcome: Outcome) -> CappedRow {
        CappedRow {
            engine: engine.into(),
            cap_bytes: cap,
            outcome,
            decode_tokens_per_s: tps,
            runs_tokens_per_s: vec![tps],
            peak_cgroup_bytes: Some(cap / 2),
            read_bytes_per_token: 1e6,
            predicted_read_bytes_per_token: None,
            disk_bytes_per_s: None,
            predicted_bound_tok_s: None,
            tokens_decoded: 10,
            tokens_per_pass: None,
            draft_acceptance: None,
            nll_delta: None,
            plan_floor: None,
            plan_resident_bytes: None,
            note: None,
        }
    }

    #[test]
    fn the_table_divides_by_planned_dense_and_llama_at_the_same_cap() {
        let mut rows = [
            row("unified", 60_000_000, 20.0, Outcome::Completed),
            row("planned-dense", 60_000_000, 8.0, Outcome::Completed),
            row("llama.cpp", 60_000_000, 2.0, Outcome::Completed),
            row("unified", 40_000_000, 9.0, Outcome::Completed),
            row("llama.cpp", 40_000_000, 0.0, Outcome::Killed),
        ];
        rows[0].nll_delta = Some(0.0125);
        let t = table(&rows);
        let cols =
            |i: usize| -> Vec<&str> { t.lines().nth(i).unwrap().split_whitespace().collect() };
        assert!(cols(1).last() == Some(&"+1.25%"), "{t}");
        // cap, engine, outcome, tok/s, runs, × dense, × no spec, × llama
        assert_eq!(cols(1)[5..8], ["2.50", "-", "10.00"], "{t}");
        assert_eq!(cols(2)[5..8], ["-", "-", "4.00"], "{t}");
        assert_eq!(cols(4)[5..8], ["-", "-", "-"], "{t}");
        assert!(cols(5).contains(&"killed"), "{t}");
        let svg = svg(&rows, "t");
        assert_eq!(svg.matches("<circle").count(), 4);
        assert!(svg.contains('×'));
    }

    #[test]
    fn the_table_divides_by_unified_nospec_at_the_same_cap_and_shows_passes_and_acceptance() {
        let mut rows = [
            row("unified", 60_000_000, 15.0, Outcome::Completed),
            row("unified-nospec", 60_000_000, 10.0, Outcome::Completed),
            row("planned-dense", 60_000_000, 5.0, Outcome::Completed),
            row("llama.cpp", 60_000_000, 2.0, Outcome::Completed),
            row("unified", 40_000_000, 9.0, Outcome::Completed),
            row("unified-nospec", 30_000_000, 3.0, Outcome::Completed),
        ];
        rows[0].tokens_per_pass = Some(1.6);
        rows[0].draft_acceptance = Some(0.6);
        rows[1].tokens_per_pass = Some(1.0);
        rows[2].tokens_per_pass = Some(1.25);
        rows[2].draft_acceptance = Some(0.5);
        rows[4].tokens_per_pass = Some(1.0);
        let t = table(&rows);
        let cols =
            |i: usize| -> Vec<&str> { t.lines().nth(i).unwrap().split_whitespace().collect() };
        assert!(t.lines().next().unwrap().contains("× no spec"), "{t}");
        // cap, engine, outcome, tok/s, runs, × dense, × no spec, × llama, tok/pass, accept
        assert_eq!(
            cols(1)[5..10],
            ["3.00", "1.50", "7.50", "1.60", "60%"],
            "{t}"
        );
        assert_eq!(cols(2)[5..10], ["2.00", "-", "5.00", "1.00", "-"], "{t}");
        assert_eq!(cols(3)[5..10], ["-", "0.50", "2.50", "1.25", "50%"], "{t}");
        assert_eq!(cols(4)[5..10], ["-", "-", "-", "-", "-"], "{t}");
        // No `unified-nospec` row at 40 MB: nothing to divide by.
        assert_eq!(cols(5)[5..10], ["-", "-", "-", "1.00", "-"], "{t}");
        let j: serde_json::Value = serde_json::from_str(&json(&rows)).unwrap();
        assert_eq!(j[0]["tokens_per_pass"], 1.6);
        assert_eq!(j[0]["draft_acceptance"], 0.6);
        assert!(j[1]["draft_acceptance"].is_null());
    }

    #[test]
    fn the_floor_footer_gives_each_part_of_the_rows_that_planned() {
        let mut rows = [
            row("leanstream", 60_000_000, 20.0, Outcome::Completed),
            row("llama.cpp", 60_000_000, 2.0, Outcome::Completed),
        ];
        rows[0].plan_floor = Some(Floor {
            runtime: 12 << 20,
            tokenizer: 7 << 20,
            tables: 1 << 19,
            session: 6 << 20,
            ring: 3 << 20,
            ..Floor::default()
        });
        rows[0].plan_resident_bytes = Some(30 << 20);
        assert_eq!(
            floors(&rows),
            "plan at 60 MB: runtime 12.0 + tokenizer 7.0 + tables 0.5 + session and KV 6.0 + \
             ring 3.0 MiB, resident weights 30.0 MiB\n"
        );
    }
}
