//! Unit tests, one or more per rule of the arbiter.

use super::*;

const MIB: u64 = 1 << 20;

fn arbiter(budget_mib: u64) -> Arbiter {
    Arbiter::new(budget_mib * MIB)
}

fn open(arb: &mut Arbiter, id: u64, model: &str, mib: u64) {
    arb.open_session(id, model, mib * MIB, CacheClass::Normal)
        .unwrap();
}

#[test]
fn load_reserves_weights_and_fills_the_cache() {
    let mut arb = arbiter(100);
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
    let mut arb = arbiter(100);
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
    let mut arb = arbiter(100);
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
    let ticket = arb.drop_model("a").unwrap();
    arb.dropped(ticket);
    assert_eq!(arb.reserved_bytes(), 0);
}

#[test]
fn load_shrinks_other_caches_to_fit() {
    let mut arb = arbiter(100);
    arb.load_model("a", 40 * MIB, 0, 60 * MIB).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(60 * MIB));
    arb.load_model("b", 30 * MIB, 0, 0).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(30 * MIB));
    assert_eq!(arb.used_bytes(), 100 * MIB);
    let ticket = arb.drop_model("b").unwrap();
    assert_eq!(
        arb.cache_bytes("a"),
        Some(30 * MIB),
        "b's memory is not free yet"
    );
    arb.dropped(ticket);
    assert_eq!(arb.cache_bytes("a"), Some(60 * MIB));
}

#[test]
fn caches_shrink_when_a_session_opens_and_grow_back_when_it_closes() {
    let mut arb = arbiter(100);
    arb.load_model("a", 20 * MIB, 10 * MIB, 70 * MIB).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(70 * MIB));
    let before = arb.clone();

    open(&mut arb, 1, "a", 30);
    assert_eq!(arb.cache_bytes("a"), Some(50 * MIB));
    assert_eq!(arb.used_bytes(), 100 * MIB);

    arb.close_session(1).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(70 * MIB));
    assert_eq!(arb, before);
}

#[test]
fn a_session_is_refused_only_when_minimum_caches_leave_no_room() {
    let mut arb = arbiter(100);
    arb.load_model("a", 20 * MIB, 10 * MIB, 70 * MIB).unwrap();
    open(&mut arb, 1, "a", 30);
    let before = arb.clone();

    let err = arb
        .open_session(2, "a", 41 * MIB, CacheClass::Interactive)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "session 2 on model `a` needs 41 MiB, 40 MiB free of a 100 MiB budget"
    );
    assert!(matches!(
        err,
        ArbiterError::OverBudget { needed, available, .. }
            if needed == 41 * MIB && available == 40 * MIB
    ));
    // The running session, though of lower priority, is never evicted.
    assert_eq!(arb, before);

    // Exactly what is left once the cache is at its minimum fits.
    open(&mut arb, 2, "a", 40);
    assert_eq!(arb.cache_bytes("a"), Some(10 * MIB));
    assert_eq!(arb.used_bytes(), 100 * MIB);
}

#[test]
fn bad_session_requests_change_nothing() {
    let mut arb = arbiter(100);
    arb.load_model("a", 10 * MIB, 0, 0).unwrap();
    open(&mut arb, 1, "a", 1);
    let before = arb.clone();
    let p = CacheClass::Normal;
    assert_eq!(
        arb.open_session(1, "a", 0, p),
        Err(ArbiterError::SessionAlreadyOpen(1))
    );
    assert_eq!(
        arb.open_session(2, "zz", 0, p),
        Err(ArbiterError::UnknownModel("zz".into()))
    );
    assert_eq!(arb.close_session(9), Err(ArbiterError::UnknownSession(9)));
    assert!(matches!(
        arb.open_session(2, "a", u64::MAX, p),
        Err(ArbiterError::OverBudget { .. })
    ));
    assert_eq!(arb, before);
}

#[test]
fn a_model_with_sessions_cannot_be_dropped() {
    let mut arb = arbiter(100);
    arb.load_model("a", 10 * MIB, 0, 0).unwrap();
    open(&mut arb, 1, "a", 1);
    open(&mut arb, 2, "a", 1);
    let before = arb.clone();
    let err = arb.drop_model("a").unwrap_err();
    assert_eq!(
        err,
        ArbiterError::ModelInUse {
            model: "a".into(),
            sessions: 2
        }
    );
    assert_eq!(err.wire_name(), "Busy");
    assert_eq!(arb, before);

    arb.close_session(1).unwrap();
    assert!(arb.drop_model("a").is_err());
    arb.close_session(2).unwrap();
    let ticket = arb.drop_model("a").unwrap();
    assert_eq!(arb.cache_bytes("a"), None);
    assert_eq!(arb.used_bytes(), 10 * MIB, "held until it is dropped");
    arb.dropped(ticket);
    assert_eq!(arb.used_bytes(), 0);
    let err = arb.drop_model("a").unwrap_err();
    assert_eq!(err, ArbiterError::UnknownModel("a".into()));
    assert_eq!(err.wire_name(), "ModelNotFound");
}

#[test]
fn higher_priority_models_fill_their_caches_first() {
    let mut arb = arbiter(100);
    arb.load_model("a", 10 * MIB, 0, 50 * MIB).unwrap();
    arb.load_model("b", 10 * MIB, 0, 50 * MIB).unwrap();
    // Both idle: same tier, equal wishes, equal shares of 80 MiB.
    assert_eq!(arb.cache_bytes("a"), Some(40 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(40 * MIB));

    let p = |arb: &mut Arbiter, id, model, prio| {
        arb.open_session(id, model, 0, prio).unwrap();
    };
    arb.open_session(1, "b", 20 * MIB, CacheClass::Interactive)
        .unwrap();
    assert_eq!(arb.cache_bytes("b"), Some(50 * MIB));
    assert_eq!(arb.cache_bytes("a"), Some(10 * MIB));

    // A background session lifts `a` above idle, not above `b`.
    p(&mut arb, 2, "a", CacheClass::Background);
    assert_eq!(arb.cache_bytes("b"), Some(50 * MIB));
    // An interactive one puts both in the same tier.
    p(&mut arb, 3, "a", CacheClass::Interactive);
    assert_eq!(arb.cache_bytes("a"), Some(30 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(30 * MIB));
    // `b` goes idle and yields: `a` fills first, `b` gets the rest of the 80 MiB.
    arb.close_session(1).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(50 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(30 * MIB));
    // A new session takes its bytes from the lowest tier first.
    p(&mut arb, 4, "b", CacheClass::Background);
    arb.open_session(5, "a", 30 * MIB, CacheClass::Normal)
        .unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(50 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(0));
}

#[test]
fn a_tier_splits_in_proportion_to_each_wish_above_its_minimum() {
    let mut arb = arbiter(100);
    arb.load_model("a", 30 * MIB, 10 * MIB, 40 * MIB).unwrap();
    arb.load_model("b", 30 * MIB, 10 * MIB, 20 * MIB).unwrap();
    // 20 MiB free for wishes of 30 and 10 MiB above the minimums.
    assert_eq!(arb.cache_bytes("a"), Some(25 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(15 * MIB));
}

#[test]
fn the_report_lists_every_figure() {
    let mut arb = arbiter(100);
    arb.load_model("a", 20 * MIB, 5 * MIB, 30 * MIB).unwrap();
    arb.open_session(7, "a", 12 * MIB, CacheClass::Background)
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
            dropping: vec![],
            sessions: vec![SessionUsage {
                id: 7,
                model: "a".into(),
                bytes: 12 * MIB,
                class: CacheClass::Background,
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
    let mut arb = arbiter(100);
    arb.load_model("a", 10 * MIB, 0, 50 * MIB).unwrap();
    arb.check_invariants().unwrap();
    let mut broken = arb.clone();
    broken.models.get_mut("a").unwrap().cache_bytes = 91 * MIB;
    assert!(broken.check_invariants().is_err());
    let mut idle = arb.clone();
    idle.models.get_mut("a").unwrap().cache_bytes = 20 * MIB;
    assert!(idle.check_invariants().unwrap_err().contains("free"));
}

#[test]
fn a_dropped_model_holds_its_bytes_until_it_is_gone_while_its_name_loads_again() {
    let mut arb = arbiter(100);
    arb.load_model("a", 30 * MIB, 0, 20 * MIB).unwrap();
    arb.load_model("b", 10 * MIB, 0, 40 * MIB).unwrap();
    assert_eq!(arb.cache_bytes("a"), Some(20 * MIB));
    assert_eq!(arb.cache_bytes("b"), Some(40 * MIB));
    let ticket = arb.drop_model("a").unwrap();
    // Its weights and the cache it was granted stay counted.
    let held = DroppingUsage {
        ticket,
        name: "a".into(),
        bytes: 50 * MIB,
    };
    assert_eq!(arb.report().dropping, [held]);
    assert_eq!(arb.used_bytes(), 100 * MIB);
    // The name is free at once, within what is really free: 100 - 50 - 10 MiB.
    let before = arb.clone();
    assert!(matches!(
        arb.load_model("a", 41 * MIB, 0, 0),
        Err(ArbiterError::OverBudget { available, .. }) if available == 40 * MIB
    ));
    assert_eq!(arb, before);
    arb.load_model("a", 10 * MIB, 0, 0).unwrap();
    assert_eq!(
        arb.cache_bytes("b"),
        Some(30 * MIB),
        "b's cache yields to the new load"
    );
    arb.dropped(ticket);
    assert_eq!(
        arb.cache_bytes("b"),
        Some(40 * MIB),
        "and grows back once a is gone"
    );
    assert_eq!(arb.report().dropping, []);
    assert_eq!(arb.used_bytes(), 60 * MIB);
    // A ticket ends once.
    let after = arb.clone();
    arb.dropped(ticket);
    assert_eq!(arb, after);
}
