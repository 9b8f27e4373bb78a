//! `leanstreamd`: the D-Bus service. The service itself is built in its own issue; until then this
//! binary only reports that it is not available, so the workspace layout is final.

mod arbiter;

fn main() -> std::process::ExitCode {
    eprintln!(
        "leanstreamd {}: the D-Bus service is not built yet; use `leanstream run` for offline inference",
        env!("CARGO_PKG_VERSION")
    );
    std::process::ExitCode::FAILURE
}
