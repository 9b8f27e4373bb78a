//! Fault injection through the engines: transient faults are retried, persistent ones fail only
//! their own request, `EINTR` and short reads are invisible. On [`Engine::Uring`] the faults reach
//! the ring thread as the kernel would report them (negated errno, short counts), through the
//! simulated ring.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::tests::{ENGINES, Engine, Gate, collect, pattern, slot, submit, wait_until};
use super::*;
use crate::io::{AlignedBuf, Fault, FaultKind, FaultyReader, MemReader, PAGE};

/// Pages 0..10 merged behind a blocked read, with `fault` on page 5.
fn faulty_run(engine: Engine, fault: Fault) -> (Vec<Completion>, IoStats, Vec<u8>, AlignedBuf) {
    let data = pattern(64 * PAGE);
    let faulty = FaultyReader::new(Arc::new(MemReader::new(data.clone())), vec![fault]);
    let gate = Gate::new(Arc::new(faulty));
    let mut arena = AlignedBuf::zeroed(11 * 4 * PAGE).expect("arena");
    let io = engine.open(gate.clone(), 1, IoOptions::default());
    submit(&*io, &mut arena, 100, 40, 1, 10, 0.0);
    wait_until("the first read to block", || {
        gate.started.load(Ordering::SeqCst) == 1
    });
    for p in 0..10u64 {
        submit(&*io, &mut arena, p, p, 1, p as usize, 1.0);
    }
    gate.open();
    let mut done = collect(&*io, 11);
    // The engine keeps serving after a failure.
    submit(&*io, &mut arena, 200, 30, 1, 10, 0.0);
    done.extend(collect(&*io, 1));
    let stats = io.stats();
    drop(io);
    (done, stats, data, arena)
}

#[test]
fn transient_faults_are_retried_and_succeed() {
    for engine in ENGINES {
        let page5 = 5 * PAGE as u64..6 * PAGE as u64;
        let fault = Fault::on_range(page5, FaultKind::Error(std::io::ErrorKind::Other)).times(2);
        let (done, s, data, arena) = faulty_run(engine, fault);
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
        for p in 0..10 {
            assert_eq!(slot(&arena, p, 1), &data[p * PAGE..][..PAGE]);
        }
        assert_eq!(s.failures, 0);
        // The merged read fails (fault 1), its 10 requests are re-read alone, page 5 fails once
        // more.
        assert_eq!(s.retries, 10 + 1);
    }
}

#[test]
fn persistent_fault_fails_only_its_request() {
    for engine in ENGINES {
        persistent_fault_on(engine);
    }
}

fn persistent_fault_on(engine: Engine) {
    let page5 = 5 * PAGE as u64..6 * PAGE as u64;
    let (done, s, data, arena) = faulty_run(
        engine,
        Fault::on_range(page5, FaultKind::Error(std::io::ErrorKind::Other)),
    );
    for c in &done {
        if c.id == 5 {
            let err = c.result.as_ref().expect_err("page 5 is bad");
            assert!(
                matches!(
                    err,
                    Error::Read {
                        offset: 20480,
                        attempts: 4,
                        ..
                    }
                ),
                "{err}"
            );
            assert!(err.to_string().contains("offset 20480"), "{err}");
            assert_eq!(c.bytes, 0);
        } else {
            assert!(c.result.is_ok(), "{c:?}");
        }
    }
    for p in (0..10).filter(|&p| p != 5) {
        assert_eq!(slot(&arena, p, 1), &data[p * PAGE..][..PAGE]);
    }
    assert_eq!((s.failures, s.retries), (1, 10 + 3));
}

#[test]
fn eintr_and_short_reads_are_transparent() {
    for engine in ENGINES {
        eintr_and_short_reads_on(engine);
    }
}

fn eintr_and_short_reads_on(engine: Engine) {
    let data = pattern(128 * PAGE);
    let faulty = FaultyReader::new(
        Arc::new(MemReader::new(data.clone())),
        vec![
            Fault::every(2, FaultKind::Interrupted),
            Fault::every(3, FaultKind::Short(100)),
        ],
    );
    let mut arena = AlignedBuf::zeroed(50 * 4 * PAGE).expect("arena");
    // No bridged holes: each of the 50 requests is read on its own or with exact neighbours, so
    // the faults must add syscalls beyond one per read.
    let opts = IoOptions {
        max_gap_bytes: 0,
        ..IoOptions::default()
    };
    let io = engine.open(Arc::new(faulty), 3, opts);
    for id in 0..50u64 {
        submit(&*io, &mut arena, id, (id * 37) % 120, 3, id as usize, 0.5);
    }
    let done = collect(&*io, 50);
    for c in &done {
        assert!(c.result.is_ok(), "{c:?}");
        let page = ((c.id * 37) % 120) as usize;
        assert_eq!(
            slot(&arena, c.id as usize, 3),
            &data[page * PAGE..][..3 * PAGE]
        );
    }
    let s = io.stats();
    assert_eq!((s.failures, s.retries), (0, 0));
    assert!(s.syscalls > 50);
}
