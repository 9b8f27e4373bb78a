//! Tests of [`UringIo`] on the kernel's ring with real files (the behaviour shared with the pool
//! is tested on both engines in `pool::tests`), and of [`open_engine_with`]'s choice.

use std::path::Path;
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::io::pool::tests::{collect, pattern};
use crate::io::{AlignedBuf, DirectFile, MemReader, PAGE, ReadTarget};

/// A file of `pattern(len)` in a temp dir on the worktree's disk (not /tmp, which may be tmpfs
/// without O_DIRECT), opened with O_DIRECT.
fn direct_file(dir: &Path, len: usize) -> (Arc<DirectFile>, Vec<u8>) {
    let data = pattern(len);
    let path = dir.join("model.lsm");
    std::fs::write(&path, &data).expect("write");
    let file = DirectFile::open(&path).expect("open");
    assert!(file.is_direct(), "the worktree's disk accepts O_DIRECT");
    (Arc::new(file), data)
}

fn disk_tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).expect("tempdir on disk")
}

/// Submits a read of `len` bytes at file `offset` into `arena[at..]`.
fn submit_at(
    io: &dyn IoEngine,
    arena: &mut AlignedBuf,
    id: u64,
    offset: u64,
    len: usize,
    at: usize,
) {
    assert!(at + len <= arena.len());
    // SAFETY: the range lies inside the arena, which every test declares before the engine (so
    // it outlives the reads) and reads only after the completion.
    let target = unsafe { ReadTarget::new(arena.as_mut_ptr().add(at), len) };
    let req = ReadRequest {
        id,
        offset,
        target,
        priority: 1.0,
        check: None,
    };
    // SAFETY: as above.
    unsafe { io.submit(req) };
}

#[test]
fn many_small_direct_reads_at_depth_32_return_the_files_bytes() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // 500 reads of 4..64 KiB, apart by holes of 0..3 pages (some merge, some bridge a hole), in
    // shuffled order.
    let mut reads: Vec<(u64, usize)> = Vec::new();
    let mut end = 0;
    for _ in 0..500 {
        let offset = end + rng.random_range(0..4u64) * PAGE as u64;
        let len = rng.random_range(1..=16usize) * PAGE;
        reads.push((offset, len));
        end = offset + len as u64;
    }
    reads.shuffle(&mut rng);
    let dir = disk_tempdir();
    let (file, data) = direct_file(dir.path(), end as usize);
    let mut arena = AlignedBuf::zeroed(reads.len() * 16 * PAGE).expect("arena");
    let io = UringIo::new(file, 32, IoOptions::default()).expect("io_uring");
    assert_eq!(io.depth(), 32);
    for (id, &(offset, len)) in reads.iter().enumerate() {
        submit_at(&io, &mut arena, id as u64, offset, len, id * 16 * PAGE);
    }
    let done = collect(&io, reads.len());
    for c in &done {
        let (offset, len) = reads[c.id as usize];
        assert!(c.result.is_ok(), "{c:?}");
        assert_eq!(c.bytes, len);
        let got = &arena.as_slice()[c.id as usize * 16 * PAGE..][..len];
        assert!(got == &data[offset as usize..][..len], "read {}", c.id);
    }
    let s = io.stats();
    let total: usize = reads.iter().map(|r| r.1).sum();
    assert_eq!((s.requests, s.failures, s.retries), (500, 0, 0), "{s:?}");
    assert_eq!(s.bytes, total as u64);
    assert!(
        s.syscalls >= 1 && s.syscalls + s.coalesced >= 500 && s.busy_ns > 0,
        "{s:?}"
    );
    assert_eq!(io.pending(), 0);
}

#[test]
fn merged_direct_reads_bridge_holes_through_the_shared_scratch() {
    let dir = disk_tempdir();
    let (file, data) = direct_file(dir.path(), 3072 * PAGE);
    let mut arena = AlignedBuf::zeroed(2048 * PAGE + 64 * PAGE).expect("arena");
    let opts = IoOptions {
        max_gap_bytes: 2 * PAGE,
        ..IoOptions::default()
    };
    let io = UringIo::new(file, 1, opts).expect("io_uring");
    // An 8 MiB read keeps the one slot busy while every second page after it is queued.
    submit_at(&io, &mut arena, 1000, 0, 2048 * PAGE, 0);
    for i in 0..64u64 {
        let page = 2048 + 2 * i;
        submit_at(
            &io,
            &mut arena,
            i,
            page * PAGE as u64,
            PAGE,
            (2048 + i as usize) * PAGE,
        );
    }
    let done = collect(&io, 65);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert!(arena.as_slice()[..2048 * PAGE] == data[..2048 * PAGE]);
    for i in 0..64 {
        let page = 2048 + 2 * i;
        let got = &arena.as_slice()[(2048 + i) * PAGE..][..PAGE];
        assert!(got == &data[page * PAGE..][..PAGE], "page {page}");
    }
    let s = io.stats();
    assert!(s.gap_bytes > 0 && s.coalesced > 0, "{s:?}");
    assert_eq!(s.gap_bytes % PAGE as u64, 0);
}

#[test]
fn a_direct_read_past_the_end_is_a_short_read_after_its_retries() {
    let dir = disk_tempdir();
    let (file, _) = direct_file(dir.path(), 10 * PAGE + 100);
    let mut arena = AlignedBuf::zeroed(2 * PAGE).expect("arena");
    let io = UringIo::new(file, 4, IoOptions::default()).expect("io_uring");
    submit_at(&io, &mut arena, 7, 9 * PAGE as u64, 2 * PAGE, 0);
    let done = collect(&io, 1);
    match &done[0].result {
        Err(Error::ShortRead { offset, len }) => assert_eq!((*offset, *len), (9 * 4096, 2 * PAGE)),
        other => panic!("expected a short read, got {other:?}"),
    }
    let s = io.stats();
    assert_eq!((s.failures, s.retries), (1, 3), "{s:?}");
}

#[test]
fn a_read_the_kernel_refuses_fails_with_the_errno_after_its_retries() {
    let dir = disk_tempdir();
    let (file, _) = direct_file(dir.path(), 4 * PAGE);
    let mut arena = AlignedBuf::zeroed(PAGE).expect("arena");
    let io = UringIo::new(file, 4, IoOptions::default()).expect("io_uring");
    // O_DIRECT at an offset that is not block-aligned: EINVAL from the kernel.
    submit_at(&io, &mut arena, 3, 100, PAGE, 0);
    let done = collect(&io, 1);
    match &done[0].result {
        Err(Error::Read {
            offset: 100,
            attempts: 4,
            source,
            ..
        }) => assert_eq!(source.raw_os_error(), Some(libc::EINVAL)),
        other => panic!("expected EINVAL after 4 attempts, got {other:?}"),
    }
    assert_eq!(io.stats().syscalls, 4);
}

#[test]
fn dropping_with_reads_in_flight_waits_for_them() {
    let dir = disk_tempdir();
    let (file, data) = direct_file(dir.path(), 1024 * PAGE);
    let mut arena = AlignedBuf::zeroed(1024 * PAGE).expect("arena");
    let io = UringIo::new(file, 8, IoOptions::default()).expect("io_uring");
    for i in 0..256u64 {
        let at = (i as usize * 4 + 4) % 1024 * PAGE;
        submit_at(&io, &mut arena, i, at as u64, PAGE, at);
    }
    drop(io);
    // Whatever was read is the file's; nothing is read into the arena any more.
    let snapshot = arena.as_slice().to_vec();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(arena.as_slice() == &snapshot[..]);
    for page in snapshot
        .chunks(PAGE)
        .enumerate()
        .filter(|(_, p)| p.iter().any(|&b| b != 0))
    {
        assert!(page.1 == &data[page.0 * PAGE..][..PAGE], "page {}", page.0);
    }
}

#[test]
fn construction_checks_its_arguments() {
    let mem: Arc<dyn ReadAt> = Arc::new(MemReader::new(vec![0u8; 10]));
    let no_fd = UringIo::new(Arc::clone(&mem), 8, IoOptions::default());
    assert!(matches!(
        no_fd,
        Err(Error::InvalidArgument { arg: "reader", .. })
    ));
    let dir = disk_tempdir();
    let (file, _) = direct_file(dir.path(), PAGE);
    let zero = UringIo::new(file.clone(), 0, IoOptions::default());
    assert!(matches!(
        zero,
        Err(Error::InvalidArgument { arg: "depth", .. })
    ));
    let huge = UringIo::new(file, usize::MAX, IoOptions::default()).expect("clamped");
    assert_eq!(huge.depth(), MAX_DEPTH);
}

/// Whether this kernel lets this process use io_uring (tests of the choice accept either).
fn uring_available(file: &Arc<DirectFile>) -> bool {
    UringIo::new(file.clone(), 1, IoOptions::default()).is_ok()
}

#[test]
fn open_engine_chooses_io_uring_for_a_file_and_the_pool_otherwise() {
    let opts = IoOptions::default;
    let dir = disk_tempdir();
    let (file, data) = direct_file(dir.path(), 8 * PAGE);
    let uring = uring_available(&file);
    if !uring {
        eprintln!("note: io_uring is refused here; only the fallback is tested");
    }
    let chosen = |backend, reader: Arc<dyn ReadAt>| {
        open_engine_with(backend, reader, 16, 2, opts()).map(|(_, b)| b)
    };
    let mem: Arc<dyn ReadAt> = Arc::new(MemReader::new(data));
    let expect_auto = if uring {
        IoBackend::Uring
    } else {
        IoBackend::Pool
    };
    assert_eq!(
        chosen(IoBackend::Auto, file.clone()).expect("auto"),
        expect_auto
    );
    assert_eq!(
        chosen(IoBackend::Pool, file.clone()).expect("pool"),
        IoBackend::Pool
    );
    assert_eq!(
        chosen(IoBackend::Auto, mem.clone()).expect("no fd"),
        IoBackend::Pool
    );
    assert!(
        chosen(IoBackend::Uring, mem.clone()).is_err(),
        "forced, no fallback"
    );
    assert_eq!(chosen(IoBackend::Uring, file.clone()).is_ok(), uring);
    assert!(open_engine_with(IoBackend::Auto, file.clone(), 0, 2, opts()).is_err());
    assert!(open_engine_with(IoBackend::Auto, file.clone(), 16, 0, opts()).is_err());
    // The engine open_engine returns reads.
    let mut arena = AlignedBuf::zeroed(PAGE).expect("arena");
    let io = open_engine(file, 4, 2, opts()).expect("open");
    submit_at(&*io, &mut arena, 1, 3 * PAGE as u64, PAGE, 0);
    assert!(collect(&*io, 1)[0].result.is_ok());
    assert!(arena.as_slice() == &pattern(8 * PAGE)[3 * PAGE..4 * PAGE]);
}

#[test]
fn the_backend_override_parses_pool_uring_and_auto() {
    assert_eq!(IoBackend::parse("pool"), Some(IoBackend::Pool));
    assert_eq!(IoBackend::parse(" URING\n"), Some(IoBackend::Uring));
    assert_eq!(IoBackend::parse("io_uring"), Some(IoBackend::Uring));
    assert_eq!(IoBackend::parse("auto"), Some(IoBackend::Auto));
    assert_eq!(IoBackend::parse(""), Some(IoBackend::Auto));
    assert_eq!(IoBackend::parse("threads"), None);
}
