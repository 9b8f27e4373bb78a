//! Bench output: a text table, the rows as JSON, and an SVG plot of tokens/s and cache miss
//! ratio against the budget, one line per mode.

use std::fmt::Write as _;

use super::BenchRow;

fn pct(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

fn num(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

/// The rows as an aligned text table. Sizes: MiB = 2^20 bytes, MB = 10^6 bytes.
pub fn table(rows: &[BenchRow]) -> String {
    let header = [
        "mode",
        "budget",
        "tok/s",
        "rss MiB",
        "read/tok KiB",
        "miss",
        "redundant",
        "io wait",
        "recall",
        "agree",
        "nll Δ",
        "miss/tok MiB",
        "io MB/s",
        "disk MB/s",
        "disk busy",
        "bound tok/s",
    ];
    let cells: Vec<[String; 16]> = rows
        .iter()
        .map(|r| {
            [
                r.mode.clone(),
                pct(r.ffn_budget),
                format!("{:.1}", r.decode_tokens_per_s),
                format!("{:.1}", r.peak_rss_bytes as f64 / (1 << 20) as f64),
                format!("{:.1}", r.bytes_read_per_token / 1024.0),
                pct(r.cache_miss_ratio),
                pct(r.redundant_read_fraction),
                pct(r.io_wait_fraction),
                pct(r.predictor_recall),
                pct(Some(r.greedy_agreement)),
                format!("{:+.2}%", r.nll_delta * 100.0),
                num(r.missing_bytes_per_token.map(|b| b / (1 << 20) as f64)),
                num(r.io_bytes_per_s.map(|b| b / 1e6)),
                num(r.disk_bandwidth.map(|b| b / 1e6)),
                pct(r.disk_busy_share),
                num(r.storage_bound_tok_s),
            ]
        })
        .collect();
    let mut width = header.map(str::len);
    for row in &cells {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[String]| {
        for (i, (c, w)) in cells.iter().zip(width).enumerate() {
            if i == 0 {
                let _ = write!(out, "{c:<w$}");
            } else {
                let _ = write!(out, "  {c:>w$}");
            }
        }
        out.push('\n');
    };
    line(&mut out, &header.map(String::from));
    for row in &cells {
        line(&mut out, row);
    }
    out
}

/// The rows as pretty JSON (an array of objects, fields as in [`BenchRow`]).
pub fn json(rows: &[BenchRow]) -> String {
    serde_json::to_string_pretty(rows).expect("bench rows always serialise")
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// An SVG with two panels, decode tokens/s and cache miss ratio against the FFN budget. Modes
/// with a budget are lines with markers; modes without one (`dense`, `mmap`) are dashed
/// horizontal lines in the tokens/s panel.
pub fn svg(rows: &[BenchRow], title: &str) -> String {
    let (w, h, pad) = (460.0, 300.0, 55.0);
    let mut modes: Vec<&str> = Vec::new();
    for r in rows {
        if !modes.contains(&r.mode.as_str()) {
            modes.push(&r.mode);
        }
    }
    let max_budget = rows
        .iter()
        .filter_map(|r| r.ffn_budget)
        .fold(0.0f64, f64::max)
        .max(0.05);
    let max_tps = rows
        .iter()
        .map(|r| r.decode_tokens_per_s)
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.1;
    let mut s = String::new();
    let total_w = 2.0 * w + 20.0;
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{}" font-family="sans-serif" font-size="12">"#,
        h + 40.0 + 18.0 * modes.len().div_ceil(3) as f64
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="18" text-anchor="middle" font-size="14">{}</text>"#,
        total_w / 2.0,
        escape(title)
    );
    type Panel = (&'static str, f64, fn(&BenchRow) -> Option<f64>);
    let panels: [Panel; 2] = [
        ("decode tokens/s", max_tps, |r| Some(r.decode_tokens_per_s)),
        ("cache miss ratio", 1.0, |r| r.cache_miss_ratio),
    ];
    for (p, (label, y_max, value)) in panels.iter().enumerate() {
        let x0 = p as f64 * (w + 20.0) + pad;
        let (y0, pw, ph) = (30.0 + h - pad, w - pad - 15.0, h - pad - 20.0);
        let px = |b: f64| x0 + b / max_budget * pw;
        let py = |v: f64| y0 - v / y_max * ph;
        let _ = writeln!(
            s,
            r#"<g><line x1="{x0}" y1="{y0}" x2="{}" y2="{y0}" stroke="black"/><line x1="{x0}" y1="{y0}" x2="{x0}" y2="{}" stroke="black"/>"#,
            x0 + pw,
            y0 - ph
        );
        for i in 0..=4 {
            let (b, v) = (max_budget * i as f64 / 4.0, y_max * i as f64 / 4.0);
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{:.0}%</text><text x="{}" y="{}" text-anchor="end">{}</text>"#,
                px(b),
                y0 + 15.0,
                b * 100.0,
                x0 - 4.0,
                py(v) + 4.0,
                if *y_max > 2.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.2}")
                }
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">FFN cache budget</text><text x="{}" y="{}" text-anchor="middle" transform="rotate(-90 {} {})">{label}</text></g>"#,
            x0 + pw / 2.0,
            y0 + 32.0,
            x0 - 40.0,
            y0 - ph / 2.0,
            x0 - 40.0,
            y0 - ph / 2.0
        );
        for (m, mode) in modes.iter().enumerate() {
            let color = COLORS[m % COLORS.len()];
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.mode == *mode)
                .filter_map(|r| Some((r.ffn_budget?, value(r)?)))
                .filter(|(_, v)| v.is_finite())
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            if pts.is_empty() {
                if let Some(v) = rows
                    .iter()
                    .find(|r| r.mode == *mode && r.ffn_budget.is_none())
                    .and_then(value)
                    .filter(|_| p == 0)
                {
                    let _ = writeln!(
                        s,
                        r#"<line x1="{x0}" y1="{y}" x2="{}" y2="{y}" stroke="{color}" stroke-dasharray="5,4"/>"#,
                        x0 + pw,
                        y = py(v)
                    );
                }
                continue;
            }
            let path: Vec<String> = pts
                .iter()
                .map(|&(b, v)| format!("{:.1},{:.1}", px(b), py(v)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                path.join(" ")
            );
            for &(b, v) in &pts {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                    px(b),
                    py(v)
                );
            }
        }
    }
    for (m, mode) in modes.iter().enumerate() {
        let (x, y) = (
            pad + (m % 3) as f64 * 280.0,
            h + 45.0 + 18.0 * (m / 3) as f64,
        );
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{}" width="14" height="4" fill="{}"/><text x="{}" y="{y}">{}</text>"#,
            y - 6.0,
            COLORS[m % COLORS.len()],
            x + 20.0,
            escape(mode)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// `s` as SVG/XML text.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mode: &str, budget: Option<f64>, tps: f64, miss: Option<f64>) -> BenchRow {
        BenchRow {
            mode: mode.into(),
            ffn_budget: budget,
            decode_tokens_per_s: tps,
            cache_miss_ratio: miss,
            ..BenchRow::default()
        }
    }

    #[test]
    fn table_has_a_line_per_row_and_aligned_columns() {
        let rows = [
            row("dense", None, 96.0, None),
            row("leanstream", Some(0.2), 41.5, Some(0.12)),
        ];
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[2].starts_with("leanstream"));
        assert!(
            lines[2].contains("20.0%") && lines[2].contains("41.5") && lines[2].contains("12.0%")
        );
        assert_eq!(lines[1].chars().count(), lines[2].chars().count());
        assert!(lines[0].ends_with("bound tok/s"), "{}", lines[0]);
        // dense has no I/O figures; the cache-backed row has all of them.
        let tail: Vec<&str> = lines[1].split_whitespace().rev().take(5).collect();
        assert_eq!(tail, ["-"; 5], "{}", lines[1]);
    }

    #[test]
    fn the_disk_columns_show_throughput_share_and_bound() {
        let r = BenchRow {
            missing_bytes_per_token: Some(3.0 * (1 << 20) as f64),
            io_bytes_per_s: Some(465e6),
            disk_bandwidth: Some(930e6),
            disk_busy_share: Some(0.5),
            storage_bound_tok_s: Some(295.6),
            ..row("on-demand", Some(0.1), 12.0, Some(0.4))
        };
        let t = table(&[r]);
        let last = t.lines().nth(1).unwrap();
        let tail: Vec<&str> = last.split_whitespace().rev().take(5).collect();
        assert_eq!(tail, ["295.6", "50.0%", "930.0", "465.0", "3.0"], "{last}");
    }

    #[test]
    fn json_round_trips_rows() {
        let mut r = row("prefetch", Some(0.5), 10.0, Some(0.3));
        r.disk_busy_share = Some(0.8);
        r.storage_bound_tok_s = Some(12.5);
        let rows = vec![r];
        let back: Vec<BenchRow> = serde_json::from_str(&json(&rows)).unwrap();
        assert_eq!(back, rows);
    }

    #[test]
    fn svg_draws_a_line_per_budgeted_mode_and_a_dashed_reference() {
        let rows = [
            row("dense", None, 96.0, None),
            row("on-demand", Some(0.1), 10.0, Some(0.6)),
            row("on-demand", Some(0.2), 20.0, Some(0.4)),
        ];
        let s = svg(&rows, "a & b");
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<polyline").count(), 2, "tok/s and miss panels");
        assert_eq!(s.matches("stroke-dasharray").count(), 1);
        assert!(s.contains("a &amp; b"));
    }
}
