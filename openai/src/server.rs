//! Serving: the router on the bound socket until SIGTERM or SIGINT, then a bounded drain.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use leanstream::Bus;
use tokio::sync::watch;

use crate::identity::Identities;
use crate::listen::{Bound, Peer, TcpPeers, UnixPeers};
use crate::routes::{App, router};

/// How long requests still running at shutdown may take before the endpoint exits anyway
/// (their sessions then close with its bus connections).
pub const DRAIN: Duration = Duration::from_secs(10);

/// The endpoint's async runtime: one thread. The work per token is a few microseconds (read a
/// line from the daemon's pipe, write a chunk to the socket), so one thread serves many
/// streams, and on a small machine it takes the least from the daemon's compute threads (one
/// wake-up per token, no work stealing between idle workers). Connecting as another user runs
/// on threads of its own (`identity`).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// Connects to the daemon's bus as this process's user; fails when the bus cannot be reached.
pub async fn connect(bus: &Bus, share_identity: bool) -> leanstream::Result<Identities> {
    Identities::connect(bus, share_identity).await
}

/// Serves HTTP on `bound` until `shutdown` completes, then lets running requests finish for at
/// most [`DRAIN`]. Must run inside a tokio runtime.
pub async fn serve(
    bound: Bound,
    identities: Identities,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tracing::info!("{}", identities.describe());
    let app = router(Arc::new(App { identities }));
    let service = app.into_make_service_with_connect_info::<Peer>();
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let server = match bound {
        Bound::Tcp(l) => {
            l.set_nonblocking(true)?;
            let listener = TcpPeers(tokio::net::TcpListener::from_std(l)?);
            tokio::spawn(
                axum::serve(listener, service)
                    .with_graceful_shutdown(stopped)
                    .into_future(),
            )
        }
        Bound::Unix(l, _) => {
            l.set_nonblocking(true)?;
            let listener = UnixPeers(tokio::net::UnixListener::from_std(l)?);
            tokio::spawn(
                axum::serve(listener, service)
                    .with_graceful_shutdown(stopped)
                    .into_future(),
            )
        }
    };
    tokio::pin!(server);
    tokio::select! {
        joined = &mut server => return joined.map_err(std::io::Error::other)?,
        () = shutdown => {}
    }
    tracing::info!("shutting down: finishing running requests (at most {DRAIN:?})");
    let _ = stop_tx.send(true);
    match tokio::time::timeout(DRAIN, &mut server).await {
        Ok(joined) => joined.map_err(std::io::Error::other)?,
        Err(_) => {
            tracing::warn!("requests still running after {DRAIN:?}: exiting anyway");
            server.abort();
            Ok(())
        }
    }
}

/// Completes at SIGTERM or SIGINT.
pub async fn signalled() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot watch SIGTERM/SIGINT");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
