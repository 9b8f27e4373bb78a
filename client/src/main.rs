//! `leanstream`: the LeanStream command line. Offline tools (`run`, `perplexity`, `convert`) run the
//! engine in-process and need the default `offline` feature; the daemon commands talk D-Bus.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[cfg(feature = "offline")]
mod offline;

#[derive(Parser, Debug)]
#[command(
    name = "leanstream",
    version,
    about = "LeanStream on-device LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text in-process (no daemon).
    #[cfg(feature = "offline")]
    Run(offline::run::RunArgs),
    /// Teacher-forced perplexity of a text file.
    #[cfg(feature = "offline")]
    Perplexity(offline::perplexity::PerplexityArgs),
    /// Convert a GGUF file or safetensors directory into a LeanStream `.lsm` file.
    #[cfg(feature = "offline")]
    Convert(offline::convert::ConvertArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        #[cfg(feature = "offline")]
        Command::Run(args) => offline::run::run(args),
        #[cfg(feature = "offline")]
        Command::Perplexity(args) => offline::perplexity::run(args),
        #[cfg(feature = "offline")]
        Command::Convert(args) => offline::convert::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leanstream: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
