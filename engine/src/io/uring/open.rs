//! [`open_engine`]: io_uring where the kernel allows it, the thread pool elsewhere, and the
//! `LEANSTREAM_IO` override that forces either (to test the fallback and to compare the two).

use std::sync::Arc;

use super::super::engine::{IoEngine, IoOptions};
use super::super::pool::ThreadPoolIo;
use super::super::read::ReadAt;
use super::{UringIo, checked_depth};
use crate::{Error, Result};

/// The environment variable [`open_engine`] reads: `pool`, `uring` or `auto` (the default).
pub const IO_BACKEND_ENV: &str = "LEANSTREAM_IO";

/// Which [`IoEngine`] to open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoBackend {
    /// [`UringIo`] if the reader has a file descriptor and the kernel allows io_uring, else
    /// [`ThreadPoolIo`].
    Auto,
    /// [`ThreadPoolIo`] always.
    Pool,
    /// [`UringIo`] or an error: no silent fallback, so a benchmark measures what it asked for.
    Uring,
}

impl IoBackend {
    /// `pool`, `uring` or `auto` (any case, surrounding blanks ignored); `None` otherwise.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(IoBackend::Auto),
            "pool" => Some(IoBackend::Pool),
            "uring" | "io_uring" => Some(IoBackend::Uring),
            _ => None,
        }
    }

    /// The backend `LEANSTREAM_IO` names; [`IoBackend::Auto`] when it is unset, and (with a
    /// warning) when it names none.
    pub fn from_env() -> Self {
        let Ok(value) = std::env::var(IO_BACKEND_ENV) else {
            return IoBackend::Auto;
        };
        IoBackend::parse(&value).unwrap_or_else(|| {
            tracing::warn!("{IO_BACKEND_ENV}={value:?} is not pool, uring or auto; using auto");
            IoBackend::Auto
        })
    }
}

/// Opens the I/O engine for `reader` that [`IoBackend::from_env`] asks for: by default
/// [`UringIo`] with `depth` reads in flight where io_uring is available, else [`ThreadPoolIo`]
/// with `threads` threads. Logs its choice and the reason once, at info.
///
/// Errors: those of the engine's constructor (`depth` or `threads` 0 is an error whichever
/// engine is chosen), and io_uring's refusal when `LEANSTREAM_IO=uring`.
pub fn open_engine(
    reader: Arc<dyn ReadAt>,
    depth: usize,
    threads: usize,
    opts: IoOptions,
) -> Result<Box<dyn IoEngine>> {
    open_engine_with(IoBackend::from_env(), reader, depth, threads, opts).map(|(engine, _)| engine)
}

/// [`open_engine`] with the backend given rather than read from the environment. Returns the
/// engine and the backend it is ([`IoBackend::Pool`] or [`IoBackend::Uring`]).
pub fn open_engine_with(
    backend: IoBackend,
    reader: Arc<dyn ReadAt>,
    depth: usize,
    threads: usize,
    opts: IoOptions,
) -> Result<(Box<dyn IoEngine>, IoBackend)> {
    checked_depth(depth)?;
    if threads == 0 {
        // Checked whichever engine is chosen, so that a bad setting fails everywhere alike.
        return Err(Error::InvalidArgument {
            arg: "threads",
            reason: "the I/O pool needs at least one thread".into(),
        });
    }
    let pool = |reader, opts, why: &str| -> Result<(Box<dyn IoEngine>, IoBackend)> {
        let engine = ThreadPoolIo::new(reader, threads, opts)?;
        tracing::info!("I/O engine: thread pool of {threads} threads ({why})");
        Ok((Box::new(engine), IoBackend::Pool))
    };
    let uring = |engine: UringIo, why: &str| -> (Box<dyn IoEngine>, IoBackend) {
        tracing::info!(
            "I/O engine: io_uring, {} reads in flight ({why})",
            engine.depth()
        );
        (Box::new(engine), IoBackend::Uring)
    };
    match backend {
        IoBackend::Pool => pool(reader, opts, &format!("{IO_BACKEND_ENV}=pool")),
        IoBackend::Uring => Ok(uring(
            UringIo::new(reader, depth, opts)?,
            &format!("{IO_BACKEND_ENV}=uring"),
        )),
        IoBackend::Auto => match UringIo::new(Arc::clone(&reader), depth, opts.clone()) {
            Ok(engine) => Ok(uring(engine, "available")),
            Err(e) => pool(reader, opts, &format!("io_uring unavailable: {e}")),
        },
    }
}
