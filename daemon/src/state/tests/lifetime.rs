//! How long models stay: `keep_alive`, `preload`, holds, and unloading a model that has a
//! generation running.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unused_model_stays_for_its_keep_alive_then_unloads() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "[engine]\nkeep_alive = 1");
    d.join(":1.1", 1000, false);
    let id = d.open(":1.1", "tiny").await.unwrap();
    let report = d.ledger().await;
    assert_eq!(report.models[0].unload_in_seconds, -1, "in use: {report:?}");
    d.close(":1.1", id).await.unwrap();
    let closed = Instant::now();
    let report = d.ledger().await;
    assert_eq!(
        report.models.len(),
        1,
        "kept after its last session: {report:?}"
    );
    assert!(
        (0..=1).contains(&report.models[0].unload_in_seconds),
        "{report:?}"
    );
    d.until("the model unloaded", |r| {
        r.models.is_empty() && r.used_bytes == 0
    })
    .await;
    assert!(
        closed.elapsed() >= Duration::from_secs(1),
        "not before its keep_alive"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preloaded_model_loads_at_start_and_stays_until_it_is_unloaded() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "[models.tiny]\npreload = true");
    d.until("the preload", |r| r.models.iter().any(|m| m.name == "tiny"))
        .await;
    d.join(":1.1", 1000, false);
    let id = d.open(":1.1", "tiny").await.unwrap();
    d.close(":1.1", id).await.unwrap();
    // With keep_alive 0 an unpinned model would go now; the preload pins it.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let report = d.ledger().await;
    assert_eq!(report.models.len(), 1, "{report:?}");
    assert_eq!(report.models[0].unload_in_seconds, -1);
    // The daemon's own hold: another user may not give it up, an administrator may.
    assert_eq!(refused(d.unload(":1.1", "tiny").await), "AccessDenied");
    d.unload(ADMIN, "tiny").await.unwrap();
    d.until("the model unloaded", |r| {
        r.models.is_empty() && r.used_bytes == 0
    })
    .await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_generating_is_not_unloaded_and_goes_once_its_sessions_close() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "");
    d.join(":1.1", 1000, false);
    d.load(":1.1", "tiny", KeepAlive::Forever).await.unwrap();
    let id = d.open(":1.1", "tiny").await.unwrap();
    let stream = d
        .generate(":1.1", id, 32, Priority::Interactive)
        .await
        .unwrap();
    assert_eq!(refused(d.unload(":1.1", "tiny").await), "Busy");
    let events = read_events(stream).await;
    assert_eq!(
        ids(&events).len(),
        32,
        "the generation ran to its end: {events:?}"
    );
    assert_eq!(
        refused(d.unload(":1.1", "tiny").await),
        "Busy",
        "its session is open"
    );
    d.close(":1.1", id).await.unwrap();
    let pinned = d.ledger().await;
    assert_eq!(pinned.models.len(), 1, "the hold keeps it: {pinned:?}");
    d.unload(":1.1", "tiny").await.unwrap();
    d.until("the model unloaded", |r| {
        r.models.is_empty() && r.used_bytes == 0
    })
    .await;
    assert_eq!(refused(d.unload(":1.1", "tiny").await), "ModelNotFound");
    d.stop().await;
}
