//! Checksum verification on the I/O threads: a chunk read wrong once is read again and accepted,
//! read wrong twice fails with an error naming it, and a file that ends early is a short read.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::tests::{ENGINES, Engine, Gate, collect, pattern, slot, wait_until};
use super::*;
use crate::io::{AlignedBuf, ChunkCheck, Fault, FaultKind, FaultyReader, MemReader, PAGE};
use crate::io::{ReadRequest, ReadTarget};

/// Submits a read of file page `page` into slot `page` (4 pages per slot) that must hash to what
/// `data` holds there, as chunk `page` of layer 2.
fn submit_checked(io: &dyn IoEngine, arena: &mut AlignedBuf, data: &[u8], page: usize) {
    assert!((page + 1) * 4 * PAGE <= arena.len());
    // SAFETY: slot `page` lies inside the arena; every test declares the arena before the pool,
    // so it outlives the pool's workers, and reads the slot only after its completion.
    let target = unsafe { ReadTarget::new(arena.as_mut_ptr().add(page * 4 * PAGE), PAGE) };
    let req = ReadRequest {
        id: page as u64,
        offset: (page * PAGE) as u64,
        target,
        priority: 1.0,
        check: Some(ChunkCheck {
            crc32: crc32fast::hash(&data[page * PAGE..][..PAGE]),
            layer: 2,
            chunk: page,
        }),
    };
    // SAFETY: as above: the target stays valid and untouched until the completion.
    unsafe { io.submit(req) };
}

/// Reads page 5 alone on `engine` through `faults` with `opts`.
fn read_page5(
    engine: Engine,
    faults: Vec<Fault>,
    opts: IoOptions,
) -> (Completion, IoStats, Vec<u8>, AlignedBuf) {
    let data = pattern(16 * PAGE);
    let faulty = FaultyReader::new(Arc::new(MemReader::new(data.clone())), faults);
    let mut arena = AlignedBuf::zeroed(8 * 4 * PAGE).expect("arena");
    let io = engine.open(Arc::new(faulty), 1, opts);
    submit_checked(&*io, &mut arena, &data, 5);
    let done = collect(&*io, 1).pop().expect("one completion");
    let stats = io.stats();
    drop(io);
    (done, stats, data, arena)
}

#[test]
fn a_chunk_read_wrong_once_is_read_again_and_accepted() {
    for engine in ENGINES {
        let corrupt_once = Fault::on_call(0, FaultKind::Corrupt);
        let (done, s, data, arena) = read_page5(engine, vec![corrupt_once], IoOptions::default());
        assert!(done.result.is_ok(), "{done:?}");
        assert_eq!(done.bytes, PAGE);
        assert_eq!(slot(&arena, 5, 1), &data[5 * PAGE..][..PAGE]);
        assert_eq!((s.checksum_mismatches, s.retries, s.failures), (1, 1, 0));
        assert_eq!(s.bytes, PAGE as u64);
    }
}

#[test]
fn a_chunk_read_wrong_twice_fails_with_a_checksum_error_naming_it() {
    for engine in ENGINES {
        a_chunk_read_wrong_twice_on(engine);
    }
}

fn a_chunk_read_wrong_twice_on(engine: Engine) {
    let always = Fault::every(1, FaultKind::Corrupt);
    let (done, s, data, _) = read_page5(engine, vec![always], IoOptions::default());
    let expected = crc32fast::hash(&data[5 * PAGE..][..PAGE]);
    match done.result {
        Err(Error::ChunkChecksum {
            layer: 2,
            chunk: 5,
            expected: e,
            found,
            ..
        }) => {
            assert_eq!(e, expected);
            assert_ne!(found, expected);
        }
        other => panic!("expected a checksum error for chunk 5 of layer 2, got {other:?}"),
    }
    assert_eq!(done.bytes, 0);
    assert_eq!((s.checksum_mismatches, s.retries, s.failures), (2, 1, 1));
    assert_eq!(
        s.bytes, 0,
        "a chunk that failed its check delivered no bytes"
    );
}

#[test]
fn with_verification_off_a_corrupted_chunk_is_delivered_as_read() {
    for engine in ENGINES {
        let opts = IoOptions {
            verify_chunks: false,
            ..IoOptions::default()
        };
        let faults = vec![Fault::every(1, FaultKind::Corrupt)];
        let (done, s, data, arena) = read_page5(engine, faults, opts);
        assert!(done.result.is_ok(), "{done:?}");
        assert_eq!(slot(&arena, 5, 1)[0], !data[5 * PAGE]);
        assert_eq!(s.checksum_mismatches, 0);
    }
}

#[test]
fn a_file_that_ends_inside_a_chunk_is_a_short_read_naming_the_offset() {
    for engine in ENGINES {
        let data = pattern(16 * PAGE);
        let cut = MemReader::new(data[..5 * PAGE + 100].to_vec());
        let mut arena = AlignedBuf::zeroed(8 * 4 * PAGE).expect("arena");
        let io = engine.open(Arc::new(cut), 1, IoOptions::default());
        submit_checked(&*io, &mut arena, &data, 5);
        let done = collect(&*io, 1).pop().expect("one completion");
        match &done.result {
            Err(Error::ShortRead { offset, len }) => assert_eq!((*offset, *len), (5 * 4096, PAGE)),
            other => panic!("expected a short read, got {other:?}"),
        }
        assert_eq!(io.stats().checksum_mismatches, 0);
    }
}

#[test]
fn a_corrupted_chunk_of_a_merged_read_is_read_again_alone_and_its_neighbours_are_not() {
    for engine in ENGINES {
        corrupted_chunk_of_a_merged_read_on(engine);
    }
}

fn corrupted_chunk_of_a_merged_read_on(engine: Engine) {
    let data = pattern(64 * PAGE);
    // The merged read of pages 0..10 comes back with page 0's first byte flipped.
    let faulty = FaultyReader::new(
        Arc::new(MemReader::new(data.clone())),
        vec![Fault::on_call(1, FaultKind::Corrupt)],
    );
    let gate = Gate::new(Arc::new(faulty));
    let mut arena = AlignedBuf::zeroed(16 * 4 * PAGE).expect("arena");
    let io = engine.open(gate.clone(), 1, IoOptions::default());
    submit_checked(&*io, &mut arena, &data, 12);
    wait_until("the first read to block", || {
        gate.started.load(Ordering::SeqCst) == 1
    });
    for p in 0..10 {
        submit_checked(&*io, &mut arena, &data, p);
    }
    gate.open();
    let done = collect(&*io, 11);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    for p in 0..10 {
        assert_eq!(slot(&arena, p, 1), &data[p * PAGE..][..PAGE], "page {p}");
    }
    let s = io.stats();
    // Page 12, the merged read of 0..10, then page 0 alone.
    assert_eq!((s.checksum_mismatches, s.retries, s.coalesced), (1, 1, 9));
    assert_eq!(gate.finished.load(Ordering::SeqCst), 3);
}
