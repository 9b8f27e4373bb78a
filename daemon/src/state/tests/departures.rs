//! Clients that leave the bus, in both orders against their requests: nothing they got is
//! left behind, and nothing is given to a client that is gone.

use super::*;

/// Nothing left: no session served or in the ledger, no model loaded, no byte used.
async fn nothing_left(d: &Daemon) {
    d.until("an empty ledger", |r| {
        r.sessions.is_empty() && r.models.is_empty() && r.used_bytes == 0
    })
    .await;
    assert_eq!(d.port.served(), BTreeSet::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_its_request_is_refused_and_gets_nothing() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "");
    d.join(":1.1", 1000, false);
    d.leave(":1.1", true);
    assert_eq!(refused(d.open(":1.1", "tiny").await), "AccessDenied");
    // The name has no owner before the bus reports the departure: refused all the same.
    d.join(":1.2", 1000, false);
    d.leave(":1.2", false);
    assert_eq!(refused(d.open(":1.2", "tiny").await), "AccessDenied");
    assert_eq!(
        refused(d.load(":1.2", "tiny", KeepAlive::Forever).await),
        "AccessDenied"
    );
    nothing_left(&d).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_after_its_request_loses_its_sessions_even_mid_generation() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "");
    d.join(":1.1", 1000, false);
    let idle = d.open(":1.1", "tiny").await.unwrap();
    let busy = d.open(":1.1", "tiny").await.unwrap();
    let stream = d
        .generate(":1.1", busy, 200, Priority::Interactive)
        .await
        .unwrap();
    assert_eq!(d.port.served(), BTreeSet::from([idle, busy]));
    d.leave(":1.1", true);
    // Everything it held is freed, and its stream ends (a reader could still be reading it).
    nothing_left(&d).await;
    let events = read_events(stream).await;
    assert!(ids(&events).len() <= 200, "{events:?}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_its_model_loads_leaves_nothing_behind() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "");
    d.join(":1.1", 1000, false);
    let (open, ()) = tokio::join!(d.open(":1.1", "tiny"), async { d.leave(":1.1", true) });
    // Three orders: the departure came first (refused), the waiting open was forgotten with it
    // (its reply dropped), or the open was served just before the departure was handled, which
    // then closed the session. Whichever: the session is not served, nothing is held.
    if let Ok(id) = open {
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.port.served().contains(&id) {
            assert!(Instant::now() < deadline, "session {id} still served");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    nothing_left(&d).await;
    d.stop().await;
}
