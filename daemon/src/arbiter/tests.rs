//! Unit tests, one or more per rule of the arbiter.

use super::*;

const MIB: u64 = 1 << 20;

fn arbiter(budget_mib: u64, max_sessions: usize) -> Arbiter {
    Arbiter::new(ArbiterConfig {
        budget_bytes: budget_mib * MIB,
        max_sessions,
    })
}

fn open(arb: &mut Arbiter, id: u64, model: &str, client: &str, mib: u64) {
    arb.open_session(SessionId(id), model, client, mib * MIB, Priority::Normal)
        .unwrap();
}

#[test]
fn load_reserves_weights_and_fills_the_cache() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 60 * MIB, 10 * MIB, 30 * MIB).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(30 * MIB));
    assert_eq!(arb.used_bytes(), 90 * MIB);
    assert_eq!(arb.reserved_bytes(), 70 * MIB);
    assert_eq!(arb.available_bytes(), 30 * MIB);
    // The dense engine has no cache.
    arb.load_model("dense", 5 * MIB, 0, 0).unwrap();
    assert_eq!(arb.cache_bytes("dense"), Some(0));
    assert_eq!(arb.used_bytes(), 95 * MIB);
}

#[test]
fn refused_load_changes_nothing_and_names_the_figures() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 60 * MIB, 10 * MIB, 30 * MIB).unwrap();
    let before = arb.clone();
    let err = arb
        .load_model("b", 25 * MIB, 10 * MIB, 10 * MIB)
        .unwrap_err();
    assert_eq!(
        err,
        ArbiterError::OverBudget {
            what: "loading model `b` (25 MiB resident + 10 MiB minimum cache)".into(),
            needed: 35 * MIB,
            available: 30 * MIB,
            budget: 100 * MIB,
        }
    );
    assert_eq!(
        err.to_string(),
        "loading model `b` (25 MiB resident + 10 MiB minimum cache) needs 35 MiB, 30 MiB free \
         of a 100 MiB budget"
    );
    assert_eq!(err.wire_name(), "OverBudget");
    assert_eq!(arb, before);

    for err in [
        arb.load_model("a", MIB, 0, 0).unwrap_err(),
        arb.load_model("c", MIB, 2 * MIB, MIB).unwrap_err(),
    ] {
        assert_eq!(err.wire_name(), "InvalidArgument", "{err}");
        assert_eq!(arb, before);
    }
}

#[test]
fn a_model_grows_its_reservation_by_shrinking_caches_or_is_refused_unchanged() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 60 * MIB, 10 * MIB, 30 * MIB).unwrap();
    arb.grow_resident("a", 15 * MIB).unwrap();
    assert_eq!(arb.reserved_bytes(), 85 * MIB);
    assert_eq!(
        arb.cache_bytes("a"),
        Some(25 * MIB),
        "the cache shrank to make room"
    );
    let before = arb.clone();
    let err = arb.grow_resident("a", 16 * MIB).unwrap_err();
    assert!(matches!(err, ArbiterError::OverBudget { .. }), "{err}");
    assert_eq!(arb, before);
    assert!(matches!(
        arb.grow_resident("nosuch", MIB),
        Err(ArbiterError::UnknownModel(_))
    ));
    // What it drops again goes back to its cache (at most what it holds).
    arb.shrink_resident("a", 10 * MIB).unwrap();
    assert_eq!(arb.reserved_bytes(), 75 * MIB);
    assert_eq!(arb.cache_bytes("a"), Some(30 * MIB), "the cache grew back");
    assert!(matches!(
        arb.shrink_resident("nosuch", MIB),
        Err(ArbiterError::UnknownModel(_))
    ));
    arb.grow_resident("a", 5 * MIB).unwrap();
    // What a model grew by is freed with it.
    arb.unload_model("a").unwrap();
    assert_eq!(arb.reserved_bytes(), 0);
}

#[test]
fn load_shrinks_other_caches_to_fit() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 40 * MIB, 0, 60 * MIB).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(60 * MIB));
    arb.load_model("b", 30 * MIB, 0, 0).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(30 * MIB));
    assert_eq!(arb.used_bytes(), 100 * MIB);
    arb.unload_model("b").unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(60 * MIB));
}

#[test]
fn caches_shrink_when_a_session_opens_and_grow_back_when_it_closes() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 20 * MIB, 10 * MIB, 70 * MIB).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(70 * MIB));
    let before = arb.clone();

    open(&mut arb, 1, "a", ":1.1", 30);
    assert_eq!(arb.cache_bytes("a"), Some(50 * MIB));
    assert_eq!(arb.used_bytes(), 100 * MIB);

    arb.close_session(SessionId(1)).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(70 * MIB));
    assert_eq!(arb, before);
}

#[test]
fn a_session_is_refused_only_when_minimum_caches_leave_no_room() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 20 * MIB, 10 * MIB, 70 * MIB).unwrap();
    open(&mut arb, 1, "a", ":1.1", 30);
    let before = arb.clone();

    let err = arb
        .open_session(SessionId(2), "a", ":1.2", 41 * MIB, Priority::Interactive)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "session 2 on model `a` for client `:1.2` needs 41 MiB, 40 MiB free of a 100 MiB budget"
    );
    assert!(matches!(
        err,
        ArbiterError::OverBudget { needed, available, .. }
            if needed == 41 * MIB && available == 40 * MIB
    ));
    // The running session, though of lower priority, is never evicted.
    assert_eq!(arb, before);

    // Exactly what is left once the cache is at its minimum fits.
    open(&mut arb, 2, "a", ":1.2", 40);
    assert_eq!(arb.cache_bytes("a"), Some(10 * MIB));
    assert_eq!(arb.used_bytes(), 100 * MIB);
}

#[test]
fn bad_session_requests_change_nothing() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 10 * MIB, 0, 0).unwrap();
    open(&mut arb, 1, "a", ":1.1", 1);
    let before = arb.clone();
    let p = Priority::Normal;
    assert_eq!(
        arb.open_session(SessionId(1), "a", ":1.2", 0, p),
        Err(ArbiterError::SessionAlreadyOpen(SessionId(1)))
    );
    assert_eq!(
        arb.open_session(SessionId(2), "zz", ":1.2", 0, p),
        Err(ArbiterError::UnknownModel("zz".into()))
    );
    assert_eq!(
        arb.close_session(SessionId(9)),
        Err(ArbiterError::UnknownSession(SessionId(9)))
    );
    assert!(matches!(
        arb.open_session(SessionId(2), "a", ":1.2", u64::MAX, p),
        Err(ArbiterError::OverBudget { .. })
    ));
    assert_eq!(arb, before);
}

#[test]
fn client_gone_frees_everything_of_that_client() {
    let mut arb = arbiter(100, 8);
    arb.load_model("a", 10 * MIB, 5 * MIB, 50 * MIB).unwrap();
    arb.load_model("b", 10 * MIB, 0, 20 * MIB).unwrap();
    let mut only_other = arb.clone();
    open(&mut only_other, 2, "b", ":1.2", 7);

    open(&mut arb, 3, "b", ":1.1", 10);
    open(&mut arb, 2, "b", ":1.2", 7);
    open(&mut arb, 1, "a", ":1.1", 20);
    assert_eq!(
        arb.report().clients,
        vec![
            ClientUsage {
                client: ":1.1".into(),
                sessions: 2,
                bytes: 30 * MIB
            },
            ClientUsage {
                client: ":1.2".into(),
                sessions: 1,
                bytes: 7 * MIB
            },
        ]
    );

    assert_eq!(arb.client_gone(":1.1"), vec![SessionId(1), SessionId(3)]);
    assert_eq!(arb, only_other);
    assert_eq!(arb.session(SessionId(1)), None);
    assert!(arb.session(SessionId(2)).is_some());

    // A client without sessions changes nothing.
    assert_eq!(arb.client_gone(":1.1"), vec![]);
    assert_eq!(arb.client_gone(":1.9"), vec![]);
    assert_eq!(arb, only_other);
}

#[test]
fn unload_is_refused_while_the_model_has_sessions() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 10 * MIB, 0, 0).unwrap();
    open(&mut arb, 1, "a", ":1.1", 1);
    open(&mut arb, 2, "a", ":1.2", 1);
    let before = arb.clone();
    let err = arb.unload_model("a").unwrap_err();
    assert_eq!(
        err,
        ArbiterError::ModelInUse {
            model: "a".into(),
            sessions: 2
        }
    );
    assert_eq!(err.wire_name(), "Busy");
    assert_eq!(arb, before);

    arb.close_session(SessionId(1)).unwrap();
    assert!(arb.unload_model("a").is_err());
    arb.client_gone(":1.2");
    arb.unload_model("a").unwrap();
    assert!(!arb.is_loaded("a"));
    assert_eq!(arb.used_bytes(), 0);
    let err = arb.unload_model("a").unwrap_err();
    assert_eq!(err, ArbiterError::UnknownModel("a".into()));
    assert_eq!(err.wire_name(), "ModelNotFound");
}

#[test]
fn the_session_limit_counts_every_client() {
    let mut arb = arbiter(100, 2);
    arb.load_model("a", 10 * MIB, 0, 0).unwrap();
    open(&mut arb, 1, "a", ":1.1", 1);
    open(&mut arb, 2, "a", ":1.2", 1);
    let before = arb.clone();
    let err = arb
        .open_session(SessionId(3), "a", ":1.3", 0, Priority::Interactive)
        .unwrap_err();
    assert_eq!(err, ArbiterError::TooManySessions { limit: 2 });
    assert_eq!(err.wire_name(), "Busy");
    assert_eq!(arb, before);
    arb.close_session(SessionId(1)).unwrap();
    open(&mut arb, 3, "a", ":1.3", 1);
    assert_eq!(arb.session_count(), 2);
}

#[test]
fn higher_priority_models_fill_their_caches_first() {
    let mut arb = arbiter(100, 8);
    arb.load_model("a", 10 * MIB, 0, 50 * MIB).unwrap();
    arb.load_model("b", 10 * MIB, 0, 50 * MIB).unwrap();
    // Both idle: same tier, equal wishes, equal shares of 80 MiB.
    assert_eq!(arb.cache_bytes("a"), Some(40 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(40 * MIB));

    let p = |arb: &mut Arbiter, id, model, prio| {
        arb.open_session(SessionId(id), model, ":1.1", 0, prio)
            .unwrap();
    };
    arb.open_session(SessionId(1), "b", ":1.1", 20 * MIB, Priority::Interactive)
        .unwrap();
    assert_eq!(arb.cache_bytes("b"), Some(50 * MIB));
    assert_eq!(arb.cache_bytes("a"), Some(10 * MIB));

    // A background session lifts `a` above idle, not above `b`.
    p(&mut arb, 2, "a", Priority::Background);
    assert_eq!(arb.cache_bytes("b"), Some(50 * MIB));
    // An interactive one puts both in the same tier.
    p(&mut arb, 3, "a", Priority::Interactive);
    assert_eq!(arb.cache_bytes("a"), Some(30 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(30 * MIB));
    // `b` goes idle and yields: `a` fills first, `b` gets the rest of the 80 MiB.
    arb.close_session(SessionId(1)).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(50 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(30 * MIB));
    // A new session takes its bytes from the lowest tier first.
    p(&mut arb, 4, "b", Priority::Background);
    arb.open_session(SessionId(5), "a", ":1.2", 30 * MIB, Priority::Normal)
        .unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(50 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(0));
}

#[test]
fn a_tier_splits_in_proportion_to_each_wish_above_its_minimum() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 30 * MIB, 10 * MIB, 40 * MIB).unwrap();
    arb.load_model("b", 30 * MIB, 10 * MIB, 20 * MIB).unwrap();
    // 20 MiB free for wishes of 30 and 10 MiB above the minimums.
    assert_eq!(arb.cache_bytes("a"), Some(25 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(15 * MIB));
}

#[test]
fn the_report_lists_every_figure() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 20 * MIB, 5 * MIB, 30 * MIB).unwrap();
    arb.open_session(SessionId(7), "a", ":1.4", 12 * MIB, Priority::Background)
        .unwrap();
    assert_eq!(
        arb.report(),
        UsageReport {
            budget_bytes: 100 * MIB,
            used_bytes: 62 * MIB,
            models: vec![ModelUsage {
                name: "a".into(),
                resident_bytes: 20 * MIB,
                cache_bytes: 30 * MIB,
                min_cache_bytes: 5 * MIB,
                wanted_cache_bytes: 30 * MIB,
                sessions: 1,
            }],
            sessions: vec![SessionUsage {
                id: SessionId(7),
                model: "a".into(),
                client: ":1.4".into(),
                bytes: 12 * MIB,
                priority: Priority::Background,
            }],
            clients: vec![ClientUsage {
                client: ":1.4".into(),
                sessions: 1,
                bytes: 12 * MIB,
            }],
        }
    );
}

#[test]
fn bytes_read_like_people_write_them() {
    let cases = [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (12 * MIB, "12 MiB"),
        (7 * MIB / 2, "3.5 MiB"),
        (512 * MIB, "512 MiB"),
        (3 << 30, "3 GiB"),
        (u64::MAX, "16.0 EiB"),
    ];
    for (n, text) in cases {
        assert_eq!(Bytes(n).to_string(), text);
    }
}

#[test]
fn check_invariants_catches_a_broken_state() {
    let mut arb = arbiter(100, 4);
    arb.load_model("a", 10 * MIB, 0, 50 * MIB).unwrap();
    arb.check_invariants().unwrap();
    let mut broken = arb.clone();
    broken.models.get_mut("a").unwrap().cache_bytes = 91 * MIB;
    assert!(broken.check_invariants().is_err());
    let mut idle = arb.clone();
    idle.models.get_mut("a").unwrap().cache_bytes = 20 * MIB;
    assert!(idle.check_invariants().unwrap_err().contains("free"));
}
