//! `leanstream bench --memory-cap`: each engine decodes the same prompts from the same model
//! file inside a real memory cgroup capped at each size, cold (page cache dropped first), one
//! child process per prompt so that nothing of one row is left in the next.
//!
//! Rows ([`Engine`]): LeanStream (`leanstream run --memory-budget CAP`: the memory planner fits
//! the model into the cap and streams what does not fit) as `unified` (FFN layers may stream by
//! neuron where that is faster), `unified-nospec` (the same without speculative decoding),
//! `planned-dense` (`--placement dense`: the baseline `unified` must never lose to) and the
//! sparse-policy presets (`--sparse-policy`), and, with
//! `--peer-llama DIR`, llama.cpp's `llama-completion` (memory-mapped weights, the kernel's page
//! cache decides what stays). For each: decode tokens/s, completed or killed (OOM) or timed out,
//! the cgroup's peak memory, bytes read from storage per decoded token, and for LeanStream the
//! plan's prediction next to it (bytes per token, the storage-bound tokens/s at the disk's
//! measured bandwidth, the tokens sampled per decode pass and the drafts' acceptance).
//!
//! With `runs` > 1 every row runs that many times, interleaved (each run goes through every cap
//! and engine before the next starts, so that a disk that slows down or a neighbour that wakes
//! up lands on every row alike), and the table shows the median run.

mod cgroup;
mod child;
mod peer;
mod report;
mod speculation;
mod tally;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use leanstream_engine::bench::disk::{self, ProbeOptions};
use leanstream_engine::pipeline::Policy;
use leanstream_engine::plan::Floor;
use serde::Serialize;

pub use cgroup::{MemoryCgroup, drop_caches};
use child::run_capped;
use speculation::Passes;
use tally::{Decoded, Tally, medians, row_summary};

/// A cap: bytes, or a share of the reference file's size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Cap {
    Bytes(u64),
    Share(f64),
}

/// Parses `60%` or a size (`60MB`, `64MiB`).
pub fn parse_cap(s: &str) -> Result<Cap, String> {
    match s.trim().strip_suffix('%') {
        Some(p) => {
            let v: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("`{s}` is not a percentage"))?;
            if !(v > 0.0 && v <= 1000.0) {
                return Err(format!("`{s}` is outside (0 %, 1000 %]"));
            }
            Ok(Cap::Share(v / 100.0))
        }
        None => leanstream_engine::plan::parse_bytes(s).map(Cap::Bytes),
    }
}

impl Cap {
    pub fn bytes(self, reference: u64) -> u64 {
        match self {
            Cap::Bytes(b) => b,
            Cap::Share(f) => (f * reference as f64) as u64,
        }
    }
}

/// The O_DIRECT bandwidth probe of the model file ([`leanstream_engine::bench::disk::probe`]).
#[derive(Clone, Debug)]
pub struct DiskProbe {
    pub path: PathBuf,
    pub options: ProbeOptions,
}

impl DiskProbe {
    /// The file's whole-range read bandwidth now, bytes/s.
    pub fn measure(&self) -> anyhow::Result<f64> {
        let len = std::fs::metadata(&self.path)
            .with_context(|| format!("reading {}", self.path.display()))?
            .len();
        Ok(disk::probe(&self.path, 0..len, &self.options)?.bytes_per_s)
    }
}

/// One LeanStream row of the capped bench. Every engine but `unified-nospec` runs with
/// `leanstream run`'s default `--speculate auto`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Engine {
    /// `unified`: the memory plan with placement `auto` and the `leanstream` policy for sparse
    /// layers.
    Unified,
    /// `unified-nospec`: `unified` with `--speculate off` (one token per decode pass), the
    /// baseline of the "× no spec" column.
    UnifiedNoSpec,
    /// `planned-dense`: the memory plan with placement `dense`: no FFN layer streams by neuron.
    PlannedDense,
    /// A sparse policy's name: placement `auto` with that policy (a preset or an ablation
    /// step).
    Policy(String),
}

impl Engine {
    pub fn name(&self) -> &str {
        match self {
            Engine::Unified => "unified",
            Engine::UnifiedNoSpec => "unified-nospec",
            Engine::PlannedDense => "planned-dense",
            Engine::Policy(p) => p,
        }
    }
}

/// Parses `unified`, `unified-nospec`, `planned-dense` or a sparse policy's name.
pub fn parse_engine(s: &str) -> Result<Engine, String> {
    match s.trim() {
        "unified" => Ok(Engine::Unified),
        "unified-nospec" => Ok(Engine::UnifiedNoSpec),
        "planned-dense" => Ok(Engine::PlannedDense),
        p => Policy::named(p)
            .map(|_| Engine::Policy(p.to_string()))
            .map_err(|e| format!("{e}, or `unified`, `unified-nospec` or `planned-dense`")),
    }
}

/// What the capped bench runs.
#[derive(Clone, Debug)]
pub struct CappedConfig {
    /// The file LeanStream serves (GGUF or `.lsm`).
    pub model: PathBuf,
    /// The GGUF llama.cpp runs and percentages refer to (default: `model`).
    pub gguf: PathBuf,
    pub caps: Vec<Cap>,
    /// LeanStream's rows at each cap (llama.cpp's is added with `peer_llama`).
    pub engines: Vec<Engine>,
    /// Times each row runs, interleaved; the table shows the median run.
    pub runs: usize,
    pub prompts: Vec<String>,
    pub tokens: usize,
    pub context: usize,
    pub threads: usize,
    /// llama.cpp's `bin` directory (with `llama-completion`).
    pub peer_llama: Option<PathBuf>,
    /// A row's child that runs longer is killed and the row marked `timeout`.
    pub row_timeout: Duration,
    /// Probes the disk's O_DIRECT read bandwidth before each LeanStream row, for that row's
    /// storage-bound tokens/s: the development VM's disk varies by 2× within one bench (it slows
    /// after gigabytes of reads), so one probe at the start does not describe the later rows.
    pub disk_probe: Option<DiskProbe>,
    /// Held-out text scored under each cap (`leanstream perplexity`), and how many of its
    /// tokens; 0 skips the scoring.
    pub heldout: PathBuf,
    pub heldout_tokens: usize,
}

/// How a row's child ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Completed,
    Killed,
    Timeout,
    Failed,
}

/// One engine under one cap.
#[derive(Clone, Debug, Serialize)]
pub struct CappedRow {
    pub engine: String,
    pub cap_bytes: u64,
    pub outcome: Outcome,
    /// Decode tokens/s over all prompts (0 unless completed).
    pub decode_tokens_per_s: f64,
    /// Decode tokens/s of every run of the row, in run order (the median is above).
    pub runs_tokens_per_s: Vec<f64>,
    pub peak_cgroup_bytes: Option<u64>,
    /// Bytes read from storage per decoded token: LeanStream's own count of its weight reads
    /// after the prefill; for llama.cpp the child's block input (all threads, loading included)
    /// over its decoded tokens.
    pub read_bytes_per_token: f64,
    /// The plan's bytes read per token (LeanStream only).
    pub predicted_read_bytes_per_token: Option<f64>,
    /// The disk's O_DIRECT read bandwidth probed just before the row (LeanStream only).
    pub disk_bytes_per_s: Option<f64>,
    /// The plan's storage-bound tokens/s at that bandwidth (LeanStream only).
    pub predicted_bound_tok_s: Option<f64>,
    pub tokens_decoded: u64,
    /// Tokens sampled per decode pass over all prompts (1.0 without speculation; LeanStream
    /// only).
    pub tokens_per_pass: Option<f64>,
    /// Accepted ÷ drafted tokens over all prompts and draft kinds, or `None` when nothing was
    /// drafted (LeanStream only).
    pub draft_acceptance: Option<f64>,
    /// Held-out perplexity under the cap ÷ the fully loaded model's, less 1 (LeanStream only).
    pub nll_delta: Option<f64>,
    /// The plan's floor by part and its resident weights, in bytes (LeanStream only).
    pub plan_floor: Option<Floor>,
    pub plan_resident_bytes: Option<u64>,
    /// What went wrong, when not completed (the child's last stderr line).
    pub note: Option<String>,
}

/// LeanStream's child for one prompt.
fn leanstream_command(
    cfg: &CappedConfig,
    engine: &Engine,
    cap: u64,
    prompt: &str,
) -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe().context("finding this executable")?);
    cmd.args(["run", "--json", "--model"])
        .arg(&cfg.model)
        .args(["--prompt", prompt])
        .args(["--max-tokens", &cfg.tokens.to_string()])
        .args(["--memory-budget", &cap.to_string()])
        .args(["--context", &cfg.context.to_string()])
        .args(["--threads", &cfg.threads.to_string()])
        .args(["--backend", "cpu"]);
    match engine {
        Engine::Unified => cmd.args(["--placement", "auto"]),
        Engine::UnifiedNoSpec => cmd.args(["--placement", "auto", "--speculate", "off"]),
        Engine::PlannedDense => cmd.args(["--placement", "dense"]),
        Engine::Policy(p) => cmd.args(["--placement", "auto", "--sparse-policy", p]),
    };
    Ok(cmd)
}

/// `leanstream perplexity` of the held-out text, under `budget` when given.
fn perplexity_command(cfg: &CappedConfig, budget: Option<u64>) -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe().context("finding this executable")?);
    cmd.args(["perplexity", "--json", "--model"])
        .arg(&cfg.model)
        .arg("--file")
        .arg(&cfg.heldout)
        .args(["--tokens", &cfg.heldout_tokens.to_string()])
        .args(["--window", &cfg.context.to_string()])
        .args(["--threads", &cfg.threads.to_string()]);
    if let Some(b) = budget {
        cmd.args(["--memory-budget", &b.to_string()]);
    }
    Ok(cmd)
}

fn parse_ppl(stdout: &str) -> Option<f64> {
    let line = stdout.lines().rev().find(|l| l.starts_with('{'))?;
    serde_json::from_str::<serde_json::Value>(line).ok()?["ppl"].as_f64()
}

/// The `leanstream run --json` object a child printed.
fn run_json(stdout: &str) -> Option<serde_json::Value> {
    let line = stdout.lines().rev().find(|l| l.starts_with('{'))?;
    serde_json::from_str(line).ok()
}

/// What a child decoded (with its decode passes and drafts), and its plan's bytes per token,
/// from `leanstream run --json`.
fn parse_leanstream(stdout: &str) -> Option<(Decoded, Option<f64>)> {
    let v = run_json(stdout)?;
    let s = &v["stats"];
    // The first generated token comes from the prefill; decode is the rest.
    let tokens = s["generated_tokens"].as_u64()?.saturating_sub(1);
    let tps = s["decode_tokens_per_s"].as_f64()?;
    let predicted = v["plan"]["read_bytes_per_token"].as_f64();
    let decoded = Decoded {
        tokens,
        seconds: tokens as f64 / tps,
        read_bytes_per_token: v["read_bytes_per_token"]["total"].as_f64(),
        passes: Passes::from_run_json(&v, tokens),
    };
    (tps > 0.0).then_some((decoded, predicted))
}

/// Runs every engine under every cap; `progress` gets a line per child.
pub fn run(cfg: &CappedConfig, progress: &mut dyn FnMut(&str)) -> anyhow::Result<Vec<CappedRow>> {
    if cfg.prompts.is_empty() {
        bail!("no prompts");
    }
    let reference = std::fs::metadata(&cfg.gguf)
        .with_context(|| format!("reading {}", cfg.gguf.display()))?
        .len();
    let llama = match &cfg.peer_llama {
        Some(dir) => Some(peer::Llama::find(dir)?),
        None => None,
    };
    let scoring = cfg.heldout_tokens > 1;
    let reference_ppl = if scoring {
        progress("held-out perplexity of the fully loaded model (the reference)");
        let out = perplexity_command(cfg, None)?
            .output()
            .context("running leanstream perplexity")?;
        let ppl = parse_ppl(&String::from_utf8_lossy(&out.stdout));
        if ppl.is_none() {
            bail!(
                "the reference perplexity failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        ppl
    } else {
        None
    };
    let mut rows = Vec::new();
    for run_index in 0..cfg.runs.max(1) {
        let run_note = if cfg.runs > 1 {
            format!(" (run {} of {})", run_index + 1, cfg.runs)
        } else {
            String::new()
        };
        for &cap in &cfg.caps {
            let cap = cap.bytes(reference);
            // Held-out perplexity once per cap: the plan scores dense, whatever the engine.
            let nll = match reference_ppl.filter(|_| run_index == 0) {
                Some(reference) => {
                    progress(&format!(
                        "leanstream at {} MB, held-out perplexity",
                        cap / 1_000_000
                    ));
                    let mut cmd = perplexity_command(cfg, Some(cap))?;
                    let run = run_capped(&mut cmd, cap, cfg.row_timeout)?;
                    parse_ppl(&run.stdout).map(|p| p / reference - 1.0)
                }
                None => None,
            };
            for engine in &cfg.engines {
                let mut row = leanstream_row(cfg, engine, cap, &run_note, progress)?;
                if engine == &cfg.engines[0] {
                    row.nll_delta = nll;
                }
                rows.push(row);
            }
            if let Some(llama) = &llama {
                let mut peer = Tally::new("llama.cpp", cap);
                for (i, p) in cfg.prompts.iter().enumerate() {
                    progress(&format!(
                        "llama.cpp at {} MB, prompt {}{run_note}",
                        cap / 1_000_000,
                        i + 1
                    ));
                    let mut cmd = llama.command(&cfg.gguf, p, cfg.tokens, cfg.context, cfg.threads);
                    let run = run_capped(&mut cmd, cap, cfg.row_timeout)?;
                    let parsed =
                        peer::parse_timings(&run.stderr).map(|(tokens, seconds)| Decoded {
                            tokens,
                            seconds,
                            read_bytes_per_token: None,
                            passes: None,
                        });
                    peer.add(&run, parsed);
                }
                let row = peer.finish();
                progress(&row_summary(&row));
                rows.push(row);
            }
        }
    }
    Ok(medians(rows))
}

/// One LeanStream engine under one cap: a child per prompt.
fn leanstream_row(
    cfg: &CappedConfig,
    engine: &Engine,
    cap: u64,
    run_note: &str,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<CappedRow> {
    let mut ours = Tally::new(engine.name(), cap);
    ours.row.disk_bytes_per_s = cfg
        .disk_probe
        .as_ref()
        .map(DiskProbe::measure)
        .transpose()?;
    for (i, p) in cfg.prompts.iter().enumerate() {
        progress(&format!(
            "{} at {} MB, prompt {}{run_note}",
            engine.name(),
            cap / 1_000_000,
            i + 1
        ));
        let mut cmd = leanstream_command(cfg, engine, cap, p)?;
        let run = run_capped(&mut cmd, cap, cfg.row_timeout)?;
        if let Some(plan) = run_json(&run.stdout).map(|v| v["plan"].clone()) {
            ours.row.plan_floor = serde_json::from_value(plan["floor"].clone()).ok();
            ours.row.plan_resident_bytes = plan["resident_weight_bytes"].as_u64();
        }
        let parsed = parse_leanstream(&run.stdout);
        if let Some((_, Some(pred))) = &parsed {
            ours.row.predicted_read_bytes_per_token = Some(*pred);
            ours.row.predicted_bound_tok_s = ours
                .row
                .disk_bytes_per_s
                .filter(|_| *pred > 0.0)
                .map(|bw| bw / pred);
        }
        ours.add(&run, parsed.map(|(d, _)| d));
    }
    let row = ours.finish();
    progress(&row_summary(&row));
    Ok(row)
}

pub use report::{floors, json, svg, table};

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> CappedConfig {
        CappedConfig {
            model: "m.gguf".into(),
            gguf: "m.gguf".into(),
            caps: vec![Cap::Share(0.6)],
            engines: vec![Engine::Unified, Engine::UnifiedNoSpec],
            runs: 1,
            prompts: vec!["p".into()],
            tokens: 32,
            context: 256,
            threads: 2,
            peer_llama: None,
            row_timeout: Duration::from_secs(60),
            disk_probe: None,
            heldout: "h.txt".into(),
            heldout_tokens: 0,
        }
    }

    /// The child's arguments after `flag`, if it has that flag.
    fn arg_after(engine: &Engine, flag: &str) -> Option<String> {
        let cmd = leanstream_command(&config(), engine, 1000, "p").unwrap();
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let at = args.iter().position(|a| a == flag)?;
        args.get(at + 1).cloned()
    }

    #[test]
    fn only_unified_nospec_turns_speculation_off_in_its_child() {
        let nospec = parse_engine("unified-nospec").unwrap();
        assert_eq!(arg_after(&nospec, "--speculate").as_deref(), Some("off"));
        assert_eq!(arg_after(&nospec, "--placement").as_deref(), Some("auto"));
        for e in ["unified", "planned-dense", "on-demand"] {
            assert_eq!(
                arg_after(&parse_engine(e).unwrap(), "--speculate"),
                None,
                "{e}"
            );
        }
    }

    #[test]
    fn a_childs_json_gives_its_tokens_per_pass_and_drafts() {
        let out = concat!(
            "generated text\n",
            r#"{"stats":{"generated_tokens":11,"decode_tokens_per_s":5.0},"#,
            r#""read_bytes_per_token":{"total":100.0},"speculation":{"mode":"auto","on":true,"#,
            r#""tokens_per_pass":2.5,"passes":4,"verify_passes":3,"drafts":["#,
            r#"{"kind":"forced","drafted":2,"accepted":2},"#,
            r#"{"kind":"lookup","drafted":6,"accepted":4}]}}"#,
        );
        let (d, _) = parse_leanstream(out).unwrap();
        assert_eq!(d.tokens, 10);
        let p = d.passes.unwrap();
        assert_eq!(p.tokens_per_pass(), 2.5);
        assert_eq!(p.acceptance(), Some(0.75));
    }

    #[test]
    fn engines_parse_by_name_and_unknown_names_list_the_known_ones() {
        assert_eq!(parse_engine("unified"), Ok(Engine::Unified));
        assert_eq!(parse_engine("unified-nospec"), Ok(Engine::UnifiedNoSpec));
        assert_eq!(Engine::UnifiedNoSpec.name(), "unified-nospec");
        assert_eq!(parse_engine("planned-dense"), Ok(Engine::PlannedDense));
        assert_eq!(
            parse_engine("refined-load"),
            Ok(Engine::Policy("refined-load".into()))
        );
        let e = parse_engine("sparse").unwrap_err();
        assert!(
            e.contains("on-demand") && e.contains("planned-dense") && e.contains("unified-nospec"),
            "{e}"
        );
    }
}
