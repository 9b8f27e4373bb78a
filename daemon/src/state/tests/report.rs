//! The `Memory()` report: each client sees its own sessions and the rest as one total; an
//! administrator sees everyone; the bytes are the ledger's.

use super::*;
use crate::access::OTHER_CLIENTS;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sees_its_own_sessions_and_the_others_as_one_total() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "");
    d.join(":1.1", 1000, false);
    d.join(":1.2", 1001, false);
    let mine = d.open(":1.1", "tiny").await.unwrap();
    d.open(":1.2", "tiny").await.unwrap();
    d.open(":1.2", "tiny").await.unwrap();

    let all = d.ledger().await;
    assert_eq!(all.sessions.len(), 3);
    let clients: Vec<(&str, u32)> = (all.clients.iter())
        .map(|c| (c.client.as_str(), c.sessions))
        .collect();
    assert_eq!(clients, [(":1.1", 1), (":1.2", 2)]);
    let session_bytes: u64 = all.sessions.iter().map(|s| s.bytes).sum();
    let model_bytes: u64 = (all.models.iter())
        .map(|m| m.resident_bytes + m.cache_bytes)
        .sum();
    assert_eq!(all.used_bytes, session_bytes + model_bytes);
    assert!(all.used_bytes <= all.budget_bytes);

    let alice = d.memory(":1.1").await.unwrap();
    let paths: Vec<_> = alice.sessions.iter().map(|s| s.path.clone()).collect();
    assert_eq!(paths, [path_of(mine)], "only her own session");
    let bob_bytes: u64 = (all.sessions.iter())
        .filter(|s| s.client == ":1.2")
        .map(|s| s.bytes)
        .sum();
    let others = alice
        .clients
        .iter()
        .find(|c| c.client == OTHER_CLIENTS)
        .unwrap();
    assert_eq!((others.sessions, others.bytes), (2, bob_bytes));
    assert!(
        alice.clients.iter().all(|c| c.client != ":1.2"),
        "{alice:?}"
    );
    // Models and totals are everyone's.
    assert_eq!(
        (alice.models, alice.used_bytes),
        (all.models, all.used_bytes)
    );

    // A client that has left gets nothing.
    d.leave(":1.2", true);
    assert_eq!(refused(d.memory(":1.2").await), "AccessDenied");
    d.stop().await;
}

/// The operators' counters: a model's load and each generation's class, tokens, end and time
/// to first token, as the scheduler reported them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_and_loads_are_counted() {
    let fixture = Fixture::new();
    fixture.gguf("tiny");
    let d = Daemon::start(fixture, "");
    d.join(":1.1", 1000, false);
    let id = d.open(":1.1", "tiny").await.unwrap();
    for (tokens, priority) in [(3, Priority::Interactive), (2, Priority::Background)] {
        let stream = d.generate(":1.1", id, tokens, priority).await.unwrap();
        let events = read_events(stream).await;
        assert!(
            matches!(events.last(), Some(StreamEvent::Done { .. })),
            "{events:?}"
        );
    }
    // The scheduler's report follows the stream's last event.
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.counters.snapshot().get("tokens.generated") != Some(&5) {
        assert!(Instant::now() < deadline, "{:?}", d.counters.snapshot());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let c = d.counters.snapshot();
    assert_eq!(c["model_loads.tiny"], 1);
    assert!(c.contains_key("model_load_ms.tiny"), "{c:?}");
    assert_eq!(c["generations.interactive"], 1);
    assert_eq!(c["generations.background"], 1);
    assert_eq!(c["ends.max_tokens"], 2);
    assert_eq!(c["ttft_us.interactive.count"], 1);
    assert_eq!(c["ttft_us.background.count"], 1);
    assert!(c["ttft_us.interactive.sum"] > 0);
    // The second prompt repeats the first, whose keys and values the session holds; a
    // generation computes at least its prompt's last token.
    assert!(c["tokens.prompt"] > c["tokens.prompt_cached"], "{c:?}");
    d.stop().await;
}
