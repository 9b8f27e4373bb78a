//! Wiring: logging, the bus connection, startup order and shutdown.
//!
//! Startup order: the scheduler's admission and worker threads start and signal ready; the
//! connection is built and the Manager object and the session directory served; the state owner
//! and the client watcher start; only then is the
//! bus name requested, so no call can arrive before everything is up. Shutdown (SIGTERM, SIGINT,
//! or the injected future in tests): the state owner cancels every generation (streams end with
//! `Cancelled`) and stops the scheduler, the name is released, and the process exits 0.

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use futures_lite::StreamExt;
use leanstream::contract::{BUS_NAME, MANAGER_PATH};
use tokio::sync::{mpsc, oneshot};
use zbus::fdo::{RequestNameFlags, RequestNameReply};

use crate::calls::Calls;
use crate::catalog::Catalog;
use crate::config::Params;
use crate::counters::Counters;
use crate::directory;
use crate::request::{Request, ask};
use crate::scheduler::{Scheduler, SessionBudget};
use crate::service::{Manager, Shared};
use crate::state::{Budget, BusPort, Inbox, State};
use crate::typed::Typed;

/// Depth of the request channel between the D-Bus objects and the state owner.
const REQUEST_QUEUE: usize = 64;

/// Logs to journald when the process runs under systemd (or the journal socket exists), to
/// stderr otherwise. `RUST_LOG` filters (default `info`).
pub fn init_logging() {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let journal = std::env::var_os("JOURNAL_STREAM").is_some()
        || std::path::Path::new("/run/systemd/journal/socket").exists();
    let registry = tracing_subscriber::registry().with(filter);
    if journal && let Ok(layer) = tracing_journald::layer() {
        let _ = registry.with(layer).try_init();
        return;
    }
    let _ = registry
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .try_init();
}

/// Runs the daemon until SIGTERM or SIGINT.
pub fn main(params: Params, bus: &str) -> anyhow::Result<()> {
    if params.compute_threads > 0 {
        leanstream_engine::set_compute_threads(params.compute_threads)
            .map_err(anyhow::Error::msg)
            .context("setting the compute threads")?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
            }
        };
        run(params, bus, shutdown).await
    })
}

async fn connect(bus: &str) -> anyhow::Result<zbus::connection::Builder<'static>> {
    Ok(match bus {
        "system" => zbus::connection::Builder::system()?,
        "session" => zbus::connection::Builder::session()?,
        address => zbus::connection::Builder::address(address)
            .with_context(|| format!("bad bus address {address:?}"))?,
    })
}

/// Serves until `shutdown` completes, then cancels everything and releases the name.
pub async fn run(
    params: Params,
    bus: &str,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let params = Arc::new(params);
    tracing::info!(
        "leanstreamd {}: models in {}, budget {} bytes, backend {}, {:?} precision, max {} \
         sessions, default mode {} ({} per-model settings), {} I/O threads per streamed model",
        env!("CARGO_PKG_VERSION"),
        params.model_dir.display(),
        params.budget_bytes,
        params.backend.name(),
        params.precision,
        params.max_sessions,
        params.engine.mode,
        params.models.len(),
        params.io_threads,
    );
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (tx, rx) = mpsc::channel(REQUEST_QUEUE);
    let (internal_tx, internal_rx) = mpsc::unbounded_channel();
    let (departures_tx, departures_rx) = mpsc::unbounded_channel();
    let (loaded_tx, loaded_rx) = tokio::sync::watch::channel(Default::default());
    let budget = || -> Box<dyn SessionBudget> { Box::new(Budget(internal_tx.clone())) };
    let engine = Scheduler::start(events_tx, budget).context("starting the scheduler's threads")?;
    let counters = Counters::default();
    let shared = Shared {
        tx: tx.clone(),
        params: Arc::clone(&params),
        calls: Calls::default(),
        counters: counters.clone(),
    };
    let manager = Manager {
        shared: shared.clone(),
        catalog: Catalog::new(params.model_dir.clone(), loaded_rx),
    };
    let conn = connect(bus)
        .await?
        .serve_at(MANAGER_PATH, Typed::new(manager))?
        .build()
        .await
        .with_context(|| format!("connecting to the {bus} bus"))?;
    directory::serve(&conn)
        .await
        .context("serving the session directory")?;
    let port = BusPort::new(conn.clone(), shared).await;
    let state = State::new(
        Arc::clone(&params),
        port,
        internal_tx,
        engine.tx.clone(),
        loaded_tx,
        counters,
    );
    let inbox = Inbox {
        events: events_rx,
        departures: departures_rx,
        internal: internal_rx,
        requests: rx,
    };
    let state_task = tokio::spawn(state.run(inbox));
    // Subscribe to NameOwnerChanged before anyone can reach us.
    let changes = zbus::fdo::DBusProxy::new(&conn)
        .await?
        .receive_name_owner_changed()
        .await
        .context("watching clients (NameOwnerChanged)")?;
    let watcher = tokio::spawn(watch_clients(changes, departures_tx));

    let reply = conn
        .request_name_with_flags(BUS_NAME, RequestNameFlags::DoNotQueue.into())
        .await
        .with_context(|| format!("requesting the bus name {BUS_NAME}"))?;
    if !matches!(
        reply,
        RequestNameReply::PrimaryOwner | RequestNameReply::AlreadyOwner
    ) {
        anyhow::bail!("the bus name {BUS_NAME} is owned by another process ({reply:?})");
    }
    tracing::info!("serving {BUS_NAME} on the {bus} bus");
    // Under systemd (`Type=notify`): ready now, and alive for as long as the watchdog's pings
    // come back. Without a notify socket these do nothing.
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!("telling systemd the daemon is ready: {e}");
    }
    let watchdog =
        sd_notify::watchdog_enabled().map(|every| tokio::spawn(watchdog(tx.clone(), every)));

    shutdown.await;
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    if let Some(w) = watchdog {
        w.abort();
    }
    let (done_tx, done_rx) = oneshot::channel();
    if tx.send(Request::Shutdown { reply: done_tx }).await.is_ok() {
        let _ = done_rx.await;
    }
    watcher.abort();
    let _ = state_task.await;
    // The scheduler flushes the final `Cancelled` events (for at most a second) and exits.
    let joined = tokio::task::spawn_blocking(move || engine.thread.join()).await;
    if !matches!(joined, Ok(Ok(()))) {
        tracing::error!("the scheduler thread panicked");
    }
    if let Err(e) = conn.release_name(BUS_NAME).await {
        tracing::warn!("releasing {BUS_NAME}: {e}");
    }
    tracing::info!("stopped");
    Ok(())
}

/// Tells systemd's watchdog the daemon is alive, at least twice per `every` (`WatchdogSec`),
/// for as long as a ping through the state owner and both scheduler threads comes back within a
/// quarter of it. A hung part stops the pings, and systemd restarts the service.
async fn watchdog(tx: mpsc::Sender<Request>, every: std::time::Duration) {
    let quarter = every / 4;
    loop {
        let ping = ask(&tx, |reply| Request::Ping { reply });
        match tokio::time::timeout(quarter, ping).await {
            Ok(Ok(())) => {
                if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]) {
                    tracing::warn!("watchdog: {e}");
                }
            }
            Ok(Err(e)) => tracing::error!("watchdog: no answer from the scheduler: {e}"),
            Err(_) => tracing::error!("watchdog: no answer within {quarter:?}"),
        }
        tokio::time::sleep(quarter).await;
    }
}

/// Reports every unique name that leaves the bus, so that its sessions are dropped at once.
///
/// The channel is unbounded on purpose: zbus stops reading the socket once a signal stream it
/// feeds has a full queue, so this loop must never wait. A bounded channel here deadlocked the
/// daemon: the state owner, busy with a full request queue, awaited a bus reply (`NameHasOwner`)
/// that the connection could no longer read because this stream was not being drained. A
/// departure is a few bytes per client that ever connected, and the state owner handles them
/// before requests.
async fn watch_clients(
    mut stream: zbus::fdo::NameOwnerChangedStream,
    departures: mpsc::UnboundedSender<String>,
) {
    while let Some(signal) = stream.next().await {
        let Ok(args) = signal.args() else { continue };
        if args.name().starts_with(':')
            && args.new_owner().is_none()
            && departures.send(args.name().to_string()).is_err()
        {
            return;
        }
    }
}
