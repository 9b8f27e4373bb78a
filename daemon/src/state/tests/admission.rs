//! Admission: the daemon's session limit, each user's (over all its connections), the models
//! a user may hold, and who may drive a session.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_and_each_user_limit_sessions_over_all_their_connections() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let limits = "[limits]\nmax_sessions = 3\nmax_sessions_per_client = 2";
    let d = Daemon::start(fixture, limits);
    // Alice has two connections, Bob and Carol one each.
    d.join(":1.1", 1000, false);
    d.join(":1.2", 1000, false);
    d.join(":1.3", 1001, false);
    d.join(":1.4", 1002, false);
    let a1 = d.open(":1.1", "tiny").await.unwrap();
    d.open(":1.2", "tiny").await.unwrap();
    assert_eq!(
        refused(d.open(":1.1", "tiny").await),
        "Busy",
        "Alice's third"
    );
    assert_eq!(
        refused(d.open(":1.2", "tiny").await),
        "Busy",
        "on her other connection"
    );
    d.open(":1.3", "tiny").await.unwrap();
    assert_eq!(
        refused(d.open(":1.4", "tiny").await),
        "Busy",
        "the daemon's fourth"
    );
    assert_eq!(d.ledger().await.sessions.len(), 3);
    assert_eq!(d.port.served().len(), 3);
    // A closed session makes room, for anyone.
    d.close(":1.1", a1).await.unwrap();
    d.open(":1.4", "tiny").await.unwrap();
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_waiting_for_their_model_count_against_the_limit() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "[limits]\nmax_sessions = 1");
    d.join(":1.1", 1000, false);
    d.join(":1.2", 1001, false);
    // Both arrive while the model loads: the second is counted with the first, which waits.
    let (a, b) = tokio::join!(d.open(":1.1", "tiny"), d.open(":1.2", "tiny"));
    assert!(a.is_ok(), "{a:?}");
    assert_eq!(refused(b), "Busy");
    assert_eq!(d.ledger().await.sessions.len(), 1);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_holds_at_most_its_limit_of_models() {
    let fixture = Fixture::new();
    fixture.gguf("a");
    fixture.gguf("b");
    let d = Daemon::start(fixture, "[limits]\nmax_pins_per_client = 1");
    d.join(":1.1", 1000, false);
    d.join(":1.2", 1000, false);
    d.load(":1.1", "a", KeepAlive::Forever).await.unwrap();
    // Holding what it holds is free; another model is one too many, on any connection.
    d.load(":1.2", "a", KeepAlive::Forever).await.unwrap();
    assert_eq!(
        refused(d.load(":1.2", "b", KeepAlive::Forever).await),
        "Busy"
    );
    d.unload(":1.1", "a").await.unwrap();
    d.until("a unloaded", |r| r.models.iter().all(|m| m.name != "a"))
        .await;
    d.load(":1.1", "b", KeepAlive::Forever).await.unwrap();
    let report = d.ledger().await;
    let names: Vec<&str> = report.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["b"]);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_sessions_owner_drives_it_and_only_an_administrator_asks_for_realtime() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "");
    d.join(":1.1", 1000, false);
    d.join(":1.2", 1001, false);
    let id = d.open(":1.1", "tiny").await.unwrap();
    let normal = Priority::Interactive;
    for other in [":1.2", ADMIN] {
        assert_eq!(
            refused(d.generate(other, id, 4, normal).await),
            "AccessDenied"
        );
        assert_eq!(refused(d.close(other, id).await), "AccessDenied");
    }
    let realtime = d.generate(":1.1", id, 4, Priority::Realtime).await;
    assert_eq!(refused(realtime), "AccessDenied");
    let events = read_events(d.generate(":1.1", id, 4, normal).await.unwrap()).await;
    assert_eq!(ids(&events).len(), 4, "{events:?}");
    // An administrator may ask for realtime on its own session.
    let mine = d.open(ADMIN, "tiny").await.unwrap();
    let events = read_events(
        d.generate(ADMIN, mine, 4, Priority::Realtime)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(ids(&events).len(), 4, "{events:?}");
    assert_eq!(refused(d.close(":1.1", 999).await), "InvalidArgument");
    d.stop().await;
}
