//! The commands that talk to `leanstreamd` over D-Bus (`models`, `load`, `unload`, `generate`,
//! `chat`, `status`, `counters`), and how their errors are reported.

use std::process::ExitCode;

use clap::Subcommand;
use leanstream::contract::ERROR_PREFIX;
use leanstream::{Bus, Client, Error};
use zbus::DBusError;

mod generate;
mod status;

/// Exit status when the daemon cannot be reached (no bus, or no daemon on it).
pub const EXIT_UNREACHABLE: u8 = 3;
/// Exit status for every other failure (the daemon refused, a stream broke).
pub const EXIT_FAILURE: u8 = 1;
/// Exit status when a constrained generation (`--json-schema`, `--grammar`) stopped before its
/// grammar was complete: the text was printed, but it may not parse.
pub const EXIT_INCOMPLETE: u8 = 4;

#[derive(Subcommand, Debug)]
pub enum DaemonCommand {
    /// List the models in the daemon's model directory.
    Models {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Load a model into the daemon: pinned until `unload`, or with `--keep-alive`.
    Load {
        name: String,
        /// Instead of pinning it, keep it loaded this many seconds without sessions (counted
        /// from now, and again from each last session's close; 1..=604800, -1 = pin).
        #[arg(long, allow_hyphen_values = true)]
        keep_alive: Option<i64>,
    },
    /// Unload a model (fails while it has sessions).
    Unload { name: String },
    /// Generate text through the daemon, streaming it to stdout. The prompt goes in as one user
    /// message in the model's chat template; `--raw` sends it as is.
    Generate(generate::GenerateArgs),
    /// Chat interactively: reads lines from stdin; `/exit` or EOF ends.
    Chat(generate::ChatArgs),
    /// Show the memory budget by model, session and client.
    Status {
        /// Print the memory report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show the daemon's counters: calls and refusals, generations and tokens, time to first
    /// token per class, model loads.
    Counters {
        /// Print the counters as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Runs one daemon command on `bus` and turns its outcome into an exit status, printing errors.
pub fn run(bus: &Bus, command: DaemonCommand) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("leanstream: error: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    match runtime.block_on(dispatch(bus, command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("{}", describe(&e, bus));
            ExitCode::from(exit_code(&e))
        }
    }
}

async fn dispatch(bus: &Bus, command: DaemonCommand) -> anyhow::Result<()> {
    let client = Client::connect(bus).await?;
    match command {
        DaemonCommand::Models { json } => status::models(&client, json).await,
        DaemonCommand::Load {
            name,
            keep_alive: None,
        } => Ok(client.load(&name).await?),
        DaemonCommand::Load {
            name,
            keep_alive: Some(seconds),
        } => Ok(client.load_for(&name, seconds).await?),
        DaemonCommand::Unload { name } => Ok(client.unload(&name).await?),
        DaemonCommand::Generate(args) => generate::generate(&client, args).await,
        DaemonCommand::Chat(args) => generate::chat(&client, args).await,
        DaemonCommand::Status { json } => status::status(&client, json).await,
        DaemonCommand::Counters { json } => status::counters(&client, json).await,
    }
}

fn client_error(e: &anyhow::Error) -> Option<&Error> {
    e.downcast_ref::<Error>()
}

/// The exit status for an error.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    if e.is::<generate::CutShort>() {
        return EXIT_INCOMPLETE;
    }
    match client_error(e) {
        Some(c) if c.is_unreachable() => EXIT_UNREACHABLE,
        _ => EXIT_FAILURE,
    }
}

/// The error as the user reads it: plain meaning, the daemon's message (each cause once), the
/// error name, and what to do when the daemon is unreachable. Ends with a newline.
pub fn describe(e: &anyhow::Error, bus: &Bus) -> String {
    let mut out = format!("leanstream: error: {}\n", crate::error_text(e));
    match client_error(e) {
        Some(Error::Daemon(named)) => {
            let name = named.name();
            let short = name
                .as_str()
                .strip_prefix(ERROR_PREFIX)
                .map(|s| s.trim_start_matches('.'))
                .unwrap_or(name.as_str());
            out.push_str(&format!("  (D-Bus error {short})\n"));
        }
        Some(Error::Connect { .. }) => {
            // zbus's message names the address it tried; name it here when it does not.
            let at = match bus.resolved_address() {
                Some(address) if !out.contains(&address) => format!(" at {address}"),
                _ => String::new(),
            };
            out.push_str(&format!(
                "hint: is the {bus} bus running{at}, with leanstreamd on it? Start them, or \
                 reach another bus with {}.\n",
                other_buses(bus)
            ));
        }
        Some(c) if c.is_unreachable() => {
            let start = match bus {
                Bus::System => "systemctl start leanstreamd".to_owned(),
                other => format!("leanstreamd --bus {other}"),
            };
            out.push_str(&format!(
                "hint: is leanstreamd running on the {bus} bus? Start it ({start}) or reach \
                 another bus with {}.\n",
                other_buses(bus)
            ));
        }
        _ => {}
    }
    out
}

/// The `--bus` values other than `bus`, for hints.
fn other_buses(bus: &Bus) -> &'static str {
    match bus {
        Bus::System => "--bus session or --bus ADDRESS",
        Bus::Session => "--bus system or --bus ADDRESS",
        Bus::Address(_) => "--bus system or --bus session",
    }
}

#[cfg(test)]
mod tests {
    use leanstream::contract::LeanStreamError;

    use super::*;

    #[test]
    fn daemon_errors_name_meaning_message_and_name() {
        let e = anyhow::Error::from(Error::Daemon(LeanStreamError::OverBudget(
            "needs 64 MiB, 10 MiB free".into(),
        )));
        assert_eq!(
            describe(&e, &Bus::System),
            "leanstream: error: the daemon's memory budget cannot fit this: needs 64 MiB, 10 MiB free\n  (D-Bus error OverBudget)\n"
        );
        assert_eq!(exit_code(&e), EXIT_FAILURE);
    }

    #[test]
    fn unreachable_daemon_gets_a_hint_and_its_own_code() {
        let e = anyhow::Error::from(Error::NotRunning {
            message: "The name is not activatable".into(),
        });
        let text = describe(&e, &Bus::Session);
        assert!(
            text.contains("is leanstreamd running on the session bus?"),
            "{text}"
        );
        assert!(text.contains("--bus system"), "{text}");
        assert_eq!(exit_code(&e), EXIT_UNREACHABLE);
    }

    #[test]
    fn a_missing_bus_names_the_address_once_and_what_to_do() {
        let bus = Bus::Address("unix:path=/nonexistent/socket".into());
        let os = std::io::Error::from_raw_os_error(libc::ENOENT);
        let once = os.to_string();
        let e = anyhow::Error::from(Error::Connect {
            bus: bus.to_string(),
            source: zbus::Error::InputOutput(std::sync::Arc::new(os)),
        });
        let text = describe(&e, &bus);
        assert_eq!(text.matches(&once).count(), 1, "{text}");
        assert!(
            text.contains(
                "hint: is the unix:path=/nonexistent/socket bus running, with leanstreamd on it?"
            ),
            "{text}"
        );
        assert!(text.contains("--bus system or --bus session"), "{text}");
        assert_eq!(exit_code(&e), EXIT_UNREACHABLE);
    }

    #[test]
    fn other_errors_are_plain_failures() {
        let e = anyhow::anyhow!("several models to choose from (a, b); pass --model NAME");
        assert_eq!(exit_code(&e), EXIT_FAILURE);
        assert!(!describe(&e, &Bus::System).contains("hint"));
    }
}
