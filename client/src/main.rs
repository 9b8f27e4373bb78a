//! `leanstream`: the LeanStream command line. The daemon commands (`models`, `load`, `unload`,
//! `generate`, `chat`, `status`) talk D-Bus to `leanstreamd`; the offline tools (`run`,
//! `perplexity`, `convert`, `export-gguf`, `calibrate`, `bench`, `synth`) run the engine
//! in-process and need the default `offline` feature.
//!
//! Exit status: 0 success, 1 failure, 2 bad arguments, 3 the daemon cannot be reached, 4 a
//! constrained `generate` (`--json-schema`, `--grammar`) stopped before its grammar was complete.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use leanstream::Bus;

mod daemon_cmds;
#[cfg(feature = "offline")]
mod offline;
mod table;

#[derive(Parser, Debug)]
#[command(
    name = "leanstream",
    version,
    about = "LeanStream on-device LLM inference"
)]
struct Cli {
    /// Bus of the daemon: `system`, `session`, or a D-Bus address (`unix:path=...`).
    #[arg(long, global = true, default_value = "system", value_parser = parse_bus)]
    bus: Bus,
    #[command(subcommand)]
    command: Command,
}

fn parse_bus(s: &str) -> Result<Bus, String> {
    s.parse().map_err(|e: leanstream::Error| e.to_string())
}

#[derive(Subcommand, Debug)]
enum Command {
    #[command(flatten)]
    Daemon(daemon_cmds::DaemonCommand),
    /// Generate text in-process (no daemon).
    #[cfg(feature = "offline")]
    Run(offline::run::RunArgs),
    /// Show what a memory budget keeps resident and streams, and what it reads per token.
    #[cfg(feature = "offline")]
    Plan(offline::plan::PlanArgs),
    /// Teacher-forced perplexity of a text file.
    #[cfg(feature = "offline")]
    Perplexity(offline::perplexity::PerplexityArgs),
    /// Convert a GGUF file or safetensors directory into a LeanStream `.lsm` file.
    #[cfg(feature = "offline")]
    Convert(offline::convert::ConvertArgs),
    /// Write the weights of a `.lsm` file as a GGUF file llama.cpp loads (same weights; the FFN
    /// down matrix is re-encoded as rows).
    #[cfg(feature = "offline")]
    ExportGguf(offline::export_gguf::ExportGgufArgs),
    /// Compare the pipeline modes (dense, mmap, on-demand, prefetch, leanstream) at several
    /// neuron-cache budgets.
    #[cfg(feature = "offline")]
    Bench(offline::bench::BenchArgs),
    /// Calibrate a `.lsm` file: activation thresholds, neuron statistics, predictors.
    #[cfg(feature = "offline")]
    Calibrate(offline::calibrate::CalibrateArgs),
    /// Write a synthetic `.lsm` file with a real model's shapes (e.g. Llama-2-7B) and seeded
    /// random weights with planted activation statistics, for scale runs.
    #[cfg(feature = "offline")]
    Synth(offline::synth::SynthArgs),
}

fn main() -> ExitCode {
    #[cfg(feature = "offline")]
    leanstream_engine::alloc::configure();
    let cli = Cli::parse();
    match cli.command {
        Command::Daemon(command) => daemon_cmds::run(&cli.bus, command),
        #[cfg(feature = "offline")]
        Command::Run(args) => offline_exit(offline::run::run(args)),
        #[cfg(feature = "offline")]
        Command::Plan(args) => offline_exit(offline::plan::run(args)),
        #[cfg(feature = "offline")]
        Command::Perplexity(args) => offline_exit(offline::perplexity::run(args)),
        #[cfg(feature = "offline")]
        Command::Convert(args) => offline_exit(offline::convert::run(args)),
        #[cfg(feature = "offline")]
        Command::ExportGguf(args) => offline_exit(offline::export_gguf::run(args)),
        #[cfg(feature = "offline")]
        Command::Bench(args) => offline_exit(offline::bench::run(args)),
        #[cfg(feature = "offline")]
        Command::Calibrate(args) => offline_exit(offline::calibrate::run(args)),
        #[cfg(feature = "offline")]
        Command::Synth(args) => offline_exit(offline::synth::run(args)),
    }
}

#[cfg(feature = "offline")]
fn offline_exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leanstream: error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, `error: cause: cause`, each cause once. Many errors
/// print their source in their own message as well as returning it from `source()` (zbus's
/// I/O error, this crate's `Connect`), so a cause whose text the line already holds is left out.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_printed_once() {
        let os = std::io::Error::from_raw_os_error(libc::ENOENT);
        let once = os.to_string();
        let transport = zbus::Error::InputOutput(std::sync::Arc::new(os));
        let e = anyhow::Error::from(leanstream::Error::Connect {
            bus: "unix:path=/nonexistent/socket".into(),
            source: transport,
        });
        let text = error_text(&e);
        assert_eq!(text.matches(&once).count(), 1, "{text}");
        assert!(text.starts_with("cannot connect to the unix:path=/nonexistent/socket bus"));
        // Causes that the message does not hold are kept, in order.
        let e = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(error_text(&e), "outer: middle: inner");
    }
}
