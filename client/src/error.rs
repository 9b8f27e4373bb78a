//! The client library's error type: transport failures, the daemon's named errors, and
//! token-stream protocol violations.

use zbus::DBusError;

use crate::contract::LeanStreamError;

/// Result of a client call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The `--bus` string is neither `system`, `session` nor a D-Bus address.
    #[error("invalid bus {bus:?} (expected system, session or a D-Bus address): {reason}")]
    InvalidBus { bus: String, reason: String },
    /// The bus itself cannot be reached.
    #[error("cannot connect to the {bus} bus: {source}")]
    Connect {
        /// The bus as `--bus` names it: `system`, `session` or the address.
        bus: String,
        #[source]
        source: zbus::Error,
    },
    /// The bus is there but nobody owns `io.github.leanstream.LeanStream1` on it.
    #[error("leanstreamd is not on the bus: {message}")]
    NotRunning { message: String },
    /// A named error from the daemon (`io.github.leanstream.LeanStream1.Error.*`), either as a
    /// method reply or as the `error` event that ends a token stream. Never the `ZBus` variant.
    #[error("{}: {}", .0.meaning(), daemon_message(.0))]
    Daemon(LeanStreamError),
    /// Any other D-Bus failure (an unexpected error name, a broken connection, a wire-type
    /// mismatch between client and daemon versions).
    #[error("D-Bus call failed: {0}")]
    DBus(zbus::Error),
    /// The blocking client could not start its runtime thread.
    #[error("cannot start the blocking client's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// Reading the token-stream fd failed.
    #[error("reading the token stream: {0}")]
    StreamIo(#[source] std::io::Error),
    /// A token-stream line is not a [`crate::contract::StreamEvent`].
    #[error("malformed token-stream line {line:?}: {source}")]
    Protocol {
        line: String,
        #[source]
        source: serde_json::Error,
    },
    /// The token stream reached EOF before its `done` or `error` event (the daemon died or
    /// dropped the generation).
    #[error("the token stream ended without a done event (after {tokens} tokens)")]
    Truncated { tokens: usize },
}

impl Error {
    /// True when the daemon could not be reached at all (no bus, or no daemon on it), as opposed
    /// to the daemon refusing a request.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Error::Connect { .. } | Error::NotRunning { .. })
    }

    /// The daemon's named error, when this is one.
    pub fn daemon_error(&self) -> Option<&LeanStreamError> {
        match self {
            Error::Daemon(e) => Some(e),
            _ => None,
        }
    }
}

/// The human message the daemon attached to a named error (empty when it sent none).
pub fn daemon_message(e: &LeanStreamError) -> &str {
    e.description().unwrap_or("")
}

/// Bus names whose error replies mean "nobody serves this name".
const UNREACHABLE_NAMES: [&str; 2] = [
    "org.freedesktop.DBus.Error.ServiceUnknown",
    "org.freedesktop.DBus.Error.NameHasNoOwner",
];

impl From<zbus::Error> for Error {
    /// Sorts a zbus error into the daemon's named errors, "daemon not running", or transport.
    fn from(e: zbus::Error) -> Error {
        let unreachable = match &e {
            zbus::Error::MethodError(name, msg, _) => UNREACHABLE_NAMES
                .contains(&name.as_str())
                .then(|| msg.clone().unwrap_or_else(|| name.to_string())),
            zbus::Error::FDO(fdo) => {
                let name = fdo.name();
                UNREACHABLE_NAMES
                    .contains(&name.as_str())
                    .then(|| fdo.description().unwrap_or(name.as_str()).to_owned())
            }
            _ => None,
        };
        if let Some(message) = unreachable {
            return Error::NotRunning { message };
        }
        match LeanStreamError::from(e) {
            LeanStreamError::ZBus(e) => Error::DBus(e),
            named => Error::Daemon(named),
        }
    }
}

/// The contract error for a stream `error` event's `name` (without the prefix). An unknown name
/// (a newer daemon) becomes `Internal` with the name kept in the message.
pub fn stream_error(name: &str, message: &str) -> LeanStreamError {
    let message = message.to_owned();
    match name {
        "ModelNotFound" => LeanStreamError::ModelNotFound(message),
        "InvalidArgument" => LeanStreamError::InvalidArgument(message),
        "OverBudget" => LeanStreamError::OverBudget(message),
        "Busy" => LeanStreamError::Busy(message),
        "AccessDenied" => LeanStreamError::AccessDenied(message),
        "InvalidModel" => LeanStreamError::InvalidModel(message),
        "Cancelled" => LeanStreamError::Cancelled(message),
        "Internal" => LeanStreamError::Internal(message),
        other => LeanStreamError::Internal(format!("{other}: {message}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_error_names_map_to_variants() {
        assert!(matches!(
            stream_error("Cancelled", "stopped"),
            LeanStreamError::Cancelled(m) if m == "stopped"
        ));
        assert!(matches!(
            stream_error("OverBudget", "x"),
            LeanStreamError::OverBudget(_)
        ));
        assert!(matches!(
            stream_error("Weird", "x"),
            LeanStreamError::Internal(m) if m == "Weird: x"
        ));
    }

    #[test]
    fn daemon_errors_display_meaning_and_message() {
        let e = Error::Daemon(LeanStreamError::ModelNotFound("no model 'foo'".into()));
        assert_eq!(
            e.to_string(),
            "no such model in the daemon's model directory: no model 'foo'"
        );
        assert!(!e.is_unreachable());
    }

    #[test]
    fn fdo_service_unknown_means_not_running() {
        let e = Error::from(zbus::Error::FDO(Box::new(
            zbus::fdo::Error::ServiceUnknown("The name is not activatable".into()),
        )));
        assert!(e.is_unreachable(), "{e:?}");
    }
}
