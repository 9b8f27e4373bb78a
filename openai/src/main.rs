//! `leanstream-openai --bus system --listen unix:/run/leanstream/openai.sock`: see docs/openai.md.
//!
//! Prints `listening on ADDRESS` on stdout once it serves. Exit status: 0 after SIGTERM/SIGINT,
//! 1 when it cannot listen or reach the bus, 2 for bad arguments.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use leanstream_openai::{cli::Args, listen, server};

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    // Before the runtime's threads exist: binding the Unix socket changes the umask briefly.
    let bound = match listen::bind(&args.listen) {
        Ok(bound) => bound,
        Err(e) => {
            eprintln!("leanstream-openai: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match server::runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("leanstream-openai: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let address = bound.describe();
    let created = bound.created_file();
    let served = runtime.block_on(async {
        let identities = server::connect(&args.bus, args.share_identity)
            .await
            .map_err(|e| e.to_string())?;
        println!("listening on {address}");
        let _ = std::io::stdout().flush();
        tracing::info!(
            "serving the OpenAI API on {address} for leanstreamd on the {} bus",
            args.bus
        );
        server::serve(bound, identities, server::signalled())
            .await
            .map_err(|e| format!("serving on {address}: {e}"))
    });
    if let Some(path) = created {
        let _ = std::fs::remove_file(path);
    }
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leanstream-openai: {e}");
            ExitCode::FAILURE
        }
    }
}
