//! The state owner driven through a fake port, without a bus: requests go in on its channels
//! as the D-Bus objects would send them, departures as the bus watcher would report them, and
//! the fake port plays the bus driver (who a client is, whether it is still connected) and the
//! object server (which session objects are served). The scheduler and the models are real:
//! tiny seeded models from [`crate::testing::Fixture`].

#![allow(clippy::unwrap_used)]

mod admission;
mod departures;
mod lifetime;
mod report;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leanstream::contract::{LeanStreamError, MemoryReport, Priority, StreamEvent};
use tokio::sync::mpsc;
use zbus::zvariant::{OwnedFd, OwnedObjectPath};

use super::port::path_of;
use super::{Budget, Caller, Inbox, Port, State};
use crate::arbiter::SessionId;
use crate::config::KeepAlive;
use crate::counters::Counters;
use crate::request::{Request, ask};
use crate::scheduler::{GenSpec, Input, Scheduler, SessionBudget};
use crate::testing::Fixture;

/// The bus as the fake port sees it.
#[derive(Default)]
struct Bus {
    callers: BTreeMap<String, Caller>,
    served: BTreeSet<SessionId>,
}

/// A port over a bus that exists only in the test.
#[derive(Clone, Default)]
struct FakePort(Arc<Mutex<Bus>>);

impl FakePort {
    fn served(&self) -> BTreeSet<SessionId> {
        self.0.lock().unwrap().served.clone()
    }
}

impl Port for FakePort {
    async fn caller(&self, client: &str) -> Result<Caller, LeanStreamError> {
        let bus = self.0.lock().unwrap();
        (bus.callers.get(client).copied())
            .ok_or_else(|| LeanStreamError::AccessDenied(format!("client {client} has left")))
    }

    async fn serve_session(&self, id: SessionId) -> Result<OwnedObjectPath, LeanStreamError> {
        self.0.lock().unwrap().served.insert(id);
        Ok(path_of(id))
    }

    async fn withdraw_session(&self, id: SessionId) {
        self.0.lock().unwrap().served.remove(&id);
    }
}

/// The administrator every test may ask for the whole report.
const ADMIN: &str = ":1.0";

/// A state owner and a real scheduler over a fixture's models.
struct Daemon {
    fixture: Fixture,
    port: FakePort,
    requests: mpsc::Sender<Request>,
    departures: mpsc::UnboundedSender<String>,
    owner: tokio::task::JoinHandle<()>,
    scheduler: std::thread::JoinHandle<()>,
    /// The counters the state owner writes.
    counters: Counters,
}

impl Daemon {
    /// Starts over `fixture` with the configuration `toml` (besides the model directory). A
    /// model unloads at its last close unless `toml` has an `[engine]` table of its own, so
    /// that the tests see its memory come back.
    fn start(fixture: Fixture, toml: &str) -> Daemon {
        let toml = match toml.contains("[engine]") {
            true => toml.to_string(),
            false => format!("[engine]\nkeep_alive = 0\n{toml}"),
        };
        let params = Arc::new(fixture.params(&toml));
        let (events_tx, events) = mpsc::unbounded_channel();
        let (internal_tx, internal) = mpsc::unbounded_channel();
        let (departures, departures_rx) = mpsc::unbounded_channel();
        let (requests, requests_rx) = mpsc::channel(16);
        let (loaded_tx, _) = tokio::sync::watch::channel(BTreeSet::new());
        let budget = || -> Box<dyn SessionBudget> { Box::new(Budget(internal_tx.clone())) };
        let engine = Scheduler::start(events_tx, budget).unwrap();
        let port = FakePort::default();
        let counters = Counters::default();
        let state = State::new(
            params,
            port.clone(),
            internal_tx,
            engine.tx,
            loaded_tx,
            counters.clone(),
        );
        let inbox = Inbox {
            events,
            departures: departures_rx,
            internal,
            requests: requests_rx,
        };
        let owner = tokio::spawn(state.run(inbox));
        let daemon = Daemon {
            fixture,
            port,
            requests,
            departures,
            owner,
            scheduler: engine.thread,
            counters,
        };
        daemon.join(ADMIN, 0, true);
        daemon
    }

    /// Client `client` of user `user` connects.
    fn join(&self, client: &str, user: u32, admin: bool) {
        let caller = Caller { user, admin };
        let mut bus = self.port.0.lock().unwrap();
        bus.callers.insert(client.to_string(), caller);
    }

    /// Client `client` leaves the bus: its name has no owner any more, and the watcher's report
    /// of it is sent when `report` says so (the bus sends it after the name is gone).
    fn leave(&self, client: &str, report: bool) {
        self.port.0.lock().unwrap().callers.remove(client);
        if report {
            self.departures.send(client.to_string()).unwrap();
        }
    }

    async fn open(&self, client: &str, model: &str) -> Result<SessionId, LeanStreamError> {
        let file = crate::models::resolve(&self.fixture.params("").model_dir, model)?;
        let client = client.to_string();
        let path = ask(&self.requests, |reply| Request::OpenSession {
            file,
            context: 0,
            client,
            reply,
        })
        .await?;
        Ok(path.as_str().rsplit('/').next().unwrap().parse().unwrap())
    }

    async fn load(
        &self,
        client: &str,
        model: &str,
        keep_alive: KeepAlive,
    ) -> Result<(), LeanStreamError> {
        let file = crate::models::resolve(&self.fixture.params("").model_dir, model)?;
        let client = client.to_string();
        ask(&self.requests, |reply| Request::LoadModel {
            file,
            client,
            keep_alive,
            reply,
        })
        .await
    }

    async fn unload(&self, client: &str, model: &str) -> Result<(), LeanStreamError> {
        let (name, client) = (model.to_string(), client.to_string());
        ask(&self.requests, |reply| Request::UnloadModel {
            name,
            client,
            reply,
        })
        .await
    }

    async fn close(&self, client: &str, id: SessionId) -> Result<(), LeanStreamError> {
        let client = client.to_string();
        ask(&self.requests, |reply| Request::Close { id, client, reply }).await
    }

    /// Starts a greedy generation of `max_tokens` and returns its stream.
    async fn generate(
        &self,
        client: &str,
        id: SessionId,
        max_tokens: usize,
        priority: Priority,
    ) -> Result<OwnedFd, LeanStreamError> {
        let client = client.to_string();
        let spec = GenSpec::greedy(max_tokens, priority);
        let input = Input::Text("the cat sat on the".into());
        ask(&self.requests, |reply| Request::Generate {
            id,
            client,
            input,
            spec,
            reply,
        })
        .await
    }

    async fn memory(&self, client: &str) -> Result<MemoryReport, LeanStreamError> {
        let client = client.to_string();
        ask(&self.requests, |reply| Request::Memory { client, reply }).await
    }

    /// The whole report, as the administrator sees it.
    async fn ledger(&self) -> MemoryReport {
        self.memory(ADMIN).await.unwrap()
    }

    /// Waits (up to 10 s) until the whole report satisfies `done`, and returns it.
    async fn until(&self, what: &str, done: impl Fn(&MemoryReport) -> bool) -> MemoryReport {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let report = self.ledger().await;
            if done(&report) {
                return report;
            }
            assert!(
                Instant::now() < deadline,
                "waited 10 s for {what}: {report:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Shuts down and checks that nothing is left: no session served or in the ledger.
    async fn stop(self) {
        let (reply, done) = tokio::sync::oneshot::channel();
        self.requests
            .send(Request::Shutdown { reply })
            .await
            .unwrap();
        done.await.unwrap();
        self.owner.await.unwrap();
        tokio::task::spawn_blocking(move || self.scheduler.join().unwrap())
            .await
            .unwrap();
        assert_eq!(self.port.served(), BTreeSet::new());
    }
}

/// Reads a stream to its end (on a blocking thread: the writer is the scheduler's).
async fn read_events(fd: OwnedFd) -> Vec<StreamEvent> {
    tokio::task::spawn_blocking(move || {
        let mut file = std::fs::File::from(std::os::fd::OwnedFd::from(fd));
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        (text.lines())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    })
    .await
    .unwrap()
}

/// The token ids of a stream.
fn ids(events: &[StreamEvent]) -> Vec<u32> {
    (events.iter())
        .filter_map(|e| match e {
            StreamEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

/// The kind of error `r` is (the last part of its D-Bus name: `Busy`, `AccessDenied`...).
fn refused<T: std::fmt::Debug>(r: Result<T, LeanStreamError>) -> String {
    let e = r.unwrap_err();
    format!("{e:?}").split('(').next().unwrap().to_string()
}
