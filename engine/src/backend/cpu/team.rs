//! The compute team: the threads every parallel region of a forward pass runs on.
//!
//! # Why a team, not fork-join
//! A decode step opens a few parallel regions per layer (the Q/K/V projections, the attention
//! heads, the output projection, gate and up, down) plus the output head: about 150 per token on
//! SmolLM2, each a few microseconds of work. As rayon fork-joins, each region pays a steal (at
//! least one `sched_yield` by an idle worker), a join wait on the slowest of a few coarse tasks,
//! and futex wake-ups once a worker has gone to sleep; and the pass itself was handed from the
//! caller to the pool and back every token. A profile at two threads put ~18 % of decode time in
//! `sched_yield`, futex calls and the scheduler. A team keeps the same threads for every region
//! and every token, the way llama.cpp's graph threads do:
//!
//! - The calling thread is member 0: it publishes a region, works on it like any other member and
//!   returns when it is done. Nothing is handed off, and a region nobody else joins in time is
//!   simply done by the caller.
//! - The other members are long-lived threads ([`threads`] − 1 of them; with one thread there are
//!   none and every region runs inline). Between regions they spin for [`SPIN`] on the region
//!   word, so a region that follows within that time (the next region of a pass, as a rule)
//!   starts without a system call; after that they park, and a new region unparks them.
//! - A region's work is `n` chunks claimed one at a time from an atomic counter (as llama.cpp's
//!   `current_chunk`), so a member that arrives late or was preempted takes fewer chunks instead
//!   of holding everyone up. The caller waits only for the chunks that were claimed, spinning
//!   first and parking after [`SPIN`].
//!
//! Which member computes a chunk never changes what it computes: the results of a region are the
//! same bits on any number of members.
//!
//! # Waiting: spin, then park
//! Spinning is `std::hint::spin_loop` on an atomic load, checked against the clock every 64
//! rounds. Sleeping is `std::thread::park`/`unpark` (a futex per thread on Linux): its token makes
//! an `unpark` that comes before the `park` count, so no wake-up is lost, and the waker only makes
//! the system call when the sleeper has said it sleeps (a flag both sides access with
//! sequentially consistent operations, the store-then-load handshake that makes one of them see
//! the other). No other primitive is needed, and no spin runs unbounded.
//!
//! # One region at a time, no nesting
//! A team serves one caller at a time: a region opened while another thread owns the team (two
//! sessions forwarding on different threads, concurrent tests) runs inline on its caller, as does
//! a region opened from inside a region (a member's chunk calling back into the team). Both give
//! the same results, more slowly; neither can deadlock.
//!
//! # Panics
//! A chunk that panics on any member does not stop the region: the other chunks still run (they
//! may borrow what the caller's closure borrows, so the caller cannot leave before they are done),
//! then the caller resumes the first panic. The members survive it and serve the next region.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long a waiting member spins before it parks: longer than the serial steps between two
/// regions of a pass (norms, RoPE, a KV write: a few microseconds), short enough that a spinning
/// member takes little from other work on a shared machine. Measured on a 2-core VM that other
/// builds kept busy (SmolLM2, fast decode, 2 threads, medians of 5 interleaved runs against the
/// rayon fork-joins this replaced): 0 µs 1.14×, 10 µs 1.13×, 30 µs 1.21×, 100 µs 0.97×,
/// 300 µs 0.83×, 1 ms 0.75×. Spinning longer keeps the team hot across tokens too (llama.cpp's
/// OpenMP threads spin for about a millisecond), which pays only where the cores are the
/// process's own.
pub const SPIN: Duration = Duration::from_micros(30);

/// Most chunks one region can have (the chunk fields of the region word are 16 bits wide).
pub const MAX_CHUNKS: usize = u16::MAX as usize;

/// A region's closure, its lifetime erased: valid while its region is open (see [`Team::run`]).
type Job = *const (dyn Fn(usize) + Sync + 'static);

thread_local! {
    /// True on a team's members and on a caller while its region runs: a region opened there runs
    /// inline.
    static IN_REGION: Cell<bool> = const { Cell::new(false) };
}

/// An atomic on a cache line of its own, so that members claiming chunks and counting them done do
/// not slow each other down through a shared line.
#[repr(align(64))]
#[derive(Default)]
struct Line<T>(T);

/// The region word: `seq << 32 | n << 16 | next`. `seq` numbers the regions (0 before the first),
/// `n` is the region's chunk count and `next` the first chunk not yet claimed. Packing the three
/// into one word lets a claim be one compare-and-swap that fails for a region that is over: it
/// succeeds only on a word that names the claimer's region and has a chunk left.
fn pack(seq: u32, n: usize, next: usize) -> u64 {
    (u64::from(seq) << 32) | ((n as u64) << 16) | next as u64
}

/// `(seq, n, next)` of a region word.
fn unpack(w: u64) -> (u32, usize, usize) {
    (
        (w >> 32) as u32,
        ((w >> 16) & 0xffff) as usize,
        (w & 0xffff) as usize,
    )
}

/// What the members share.
struct Shared {
    /// The region word (see [`pack`]).
    region: Line<AtomicU64>,
    /// Chunks of the current region finished, by any member.
    done: Line<AtomicUsize>,
    /// The current region's closure. Written by the caller only while no region is open (before
    /// it publishes the region word, after every claimed chunk is done); read by a member only
    /// after it claimed a chunk of that region.
    job: UnsafeCell<Option<Job>>,
    /// Per helper: it is parked, or about to, and needs an `unpark` for the next region.
    asleep: Vec<Line<AtomicBool>>,
    /// The caller is parked, or about to, until the region's chunks are done.
    caller_asleep: AtomicBool,
    /// The thread to unpark when `caller_asleep`: set by the caller before it sleeps, cleared
    /// when it wakes (so the team never holds a handle of a thread that has ended).
    caller: Mutex<Option<Thread>>,
    /// The first panic of the current region's chunks.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Set by [`Team`]'s drop: the helpers leave.
    stop: AtomicBool,
    /// Helper threads running (for the tests: every one ends with its team).
    alive: AtomicUsize,
}

// SAFETY: every field but `job` is `Sync`. `job` is written only by the caller that owns the team,
// while no chunk of any region can be claimed (before the region word names the new region; after
// `done` reached the old region's `n`), and read only by a member that has claimed a chunk, after
// the claim's acquire, which synchronises with the release that published the region; the
// member's release on `done` orders its read before the caller's next write. The closure it points
// to is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer in `job` is to a `Sync` closure, usable from any thread.
unsafe impl Send for Shared {}

impl Shared {
    /// Claims the next chunk of region `seq`: `Some((chunk, n))`, or `None` once the region has no
    /// chunk left or is over.
    fn claim(&self, seq: u32) -> Option<(usize, usize)> {
        let mut w = self.region.0.load(Ordering::Acquire);
        loop {
            let (s, n, next) = unpack(w);
            if s != seq || next >= n {
                return None;
            }
            // `next < n <= MAX_CHUNKS`, so `w + 1` only bumps `next`.
            match self
                .region
                .0
                .compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some((next, n)),
                Err(now) => w = now,
            }
        }
    }

    /// Claims and runs chunks of region `seq` until none is left, counting each done (a panicking
    /// one too, its payload kept for the caller).
    fn work(&self, seq: u32) {
        while let Some((chunk, n)) = self.claim(seq) {
            // SAFETY: a chunk of region `seq` is claimed and not yet counted done, so the region is
            // open: `job` holds its closure (see `Shared`'s `Sync`) and the caller of `Team::run`
            // keeps what it borrows alive until `done` reaches `n`.
            let job = unsafe { (*self.job.get()).expect("an open region has a closure") };
            // SAFETY: as above, the closure outlives this call.
            let f = unsafe { &*job };
            if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| f(chunk))) {
                let mut first = self.panic.lock().unwrap_or_else(PoisonError::into_inner);
                first.get_or_insert(payload);
            }
            if self.done.0.fetch_add(1, Ordering::SeqCst) + 1 == n
                && self.caller_asleep.load(Ordering::SeqCst)
                && self.caller_asleep.swap(false, Ordering::SeqCst)
            {
                let caller = self.caller.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(t) = caller.as_ref() {
                    t.unpark();
                }
            }
        }
    }

    /// Helper `me`'s life: wait for a region (spin, then park), work on it, repeat until the team
    /// stops.
    fn serve(&self, me: usize) {
        IN_REGION.with(|r| r.set(true));
        let mut seen = 0u32;
        loop {
            let fresh = || {
                unpack(self.region.0.load(Ordering::SeqCst)).0 != seen
                    || self.stop.load(Ordering::SeqCst)
            };
            if !spin_until(fresh) {
                let asleep = &self.asleep[me].0;
                asleep.store(true, Ordering::SeqCst);
                while !fresh() {
                    thread::park();
                }
                asleep.store(false, Ordering::SeqCst);
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            seen = unpack(self.region.0.load(Ordering::Acquire)).0;
            self.work(seen);
        }
    }
}

/// Spins until `ready()` or [`SPIN`] has passed; returns whether it is ready.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= SPIN {
            return ready();
        }
    }
}

/// A persistent team of compute threads (see the module documentation). Most code uses the
/// process's team through [`for_each_chunk`]; a `Team` of its own is for tests.
pub struct Team {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// A caller is running a region.
    owned: AtomicBool,
    /// The number of the last region published (the caller that owns the team updates it; it
    /// wraps after 2³² regions, long after any member could still hold the number from before).
    seq: AtomicU32,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("threads", &self.threads())
            .finish_non_exhaustive()
    }
}

/// Marks a team owned and the calling thread inside a region until dropped (also on a panic).
struct Owner<'t>(&'t Team);

impl Drop for Owner<'_> {
    fn drop(&mut self) {
        IN_REGION.with(|r| r.set(false));
        self.0.owned.store(false, Ordering::Release);
    }
}

impl Team {
    /// A team of `threads` members (at least one): the caller of each region and `threads - 1`
    /// helper threads, started now.
    ///
    /// Panics if the OS refuses a thread (the process cannot compute without its threads).
    pub fn new(threads: usize) -> Team {
        let helpers = threads.max(1) - 1;
        let shared = Arc::new(Shared {
            region: Line(AtomicU64::new(pack(0, 0, 0))),
            done: Line::default(),
            job: UnsafeCell::new(None),
            asleep: (0..helpers).map(|_| Line::default()).collect(),
            caller_asleep: AtomicBool::new(false),
            caller: Mutex::new(None),
            panic: Mutex::new(None),
            stop: AtomicBool::new(false),
            alive: AtomicUsize::new(helpers),
        });
        let helpers = (0..helpers)
            .map(|me| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("leanstream-compute-{}", me + 1))
                    .spawn(move || {
                        shared.serve(me);
                        shared.alive.fetch_sub(1, Ordering::SeqCst);
                    })
                    .unwrap_or_else(|e| panic!("starting a compute thread: {e}"))
            })
            .collect();
        Team {
            shared,
            helpers,
            owned: AtomicBool::new(false),
            seq: AtomicU32::new(0),
        }
    }

    /// Members of the team, the caller included.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Calls `f(i)` once for every chunk `i` in `0..n`, spread over the team's members, and
    /// returns when every call has returned. Runs every call on the calling thread when the team
    /// has one member, `n` is 1, another thread owns the team or the caller is inside a region
    /// already. If a call panics, the others still run, then the first panic is resumed here.
    ///
    /// Panics if `n` is above [`MAX_CHUNKS`].
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(
            n <= MAX_CHUNKS,
            "{n} chunks in one region (at most {MAX_CHUNKS})"
        );
        if n <= 1 || self.helpers.is_empty() || IN_REGION.with(Cell::get) || !self.own() {
            (0..n).for_each(f);
            return;
        }
        let _owner = Owner(self);
        IN_REGION.with(|r| r.set(true));
        let s = &*self.shared;
        let seq = self.seq.load(Ordering::Relaxed).wrapping_add(1);
        self.seq.store(seq, Ordering::Relaxed);
        let job: *const (dyn Fn(usize) + Sync + '_) = f;
        // SAFETY: only the lifetime bound changes. The pointer is used by members that claimed a
        // chunk of this region, and this function returns (or unwinds) only after every chunk
        // claimed is done; none can be claimed after that (the region has none left).
        let job: Job = unsafe { std::mem::transmute(job) };
        // SAFETY: this caller owns the team and the last region's chunks are all done, so no
        // member reads `job` now (see `Shared`'s `Sync`).
        unsafe { *s.job.get() = Some(job) };
        s.done.0.store(0, Ordering::Relaxed);
        s.region.0.store(pack(seq, n, 0), Ordering::SeqCst);
        for (asleep, helper) in s.asleep.iter().zip(&self.helpers) {
            if asleep.0.load(Ordering::SeqCst) && asleep.0.swap(false, Ordering::SeqCst) {
                helper.thread().unpark();
            }
        }
        s.work(seq);
        let finished = || s.done.0.load(Ordering::SeqCst) == n;
        if !spin_until(finished) {
            *s.caller.lock().unwrap_or_else(PoisonError::into_inner) = Some(thread::current());
            s.caller_asleep.store(true, Ordering::SeqCst);
            while !finished() {
                thread::park();
            }
            s.caller_asleep.store(false, Ordering::SeqCst);
            s.caller
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
        }
        // SAFETY: every chunk is done and none can be claimed: no member reads `job`.
        unsafe { *s.job.get() = None };
        let payload = s
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(payload) = payload {
            panic::resume_unwind(payload);
        }
    }

    /// Takes the team for one region; false if another caller has it.
    fn own(&self) -> bool {
        self.owned
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for helper in self.helpers.drain(..) {
            helper.thread().unpark();
            // A helper catches every panic of a chunk, so it cannot end in one.
            let _ = helper.join();
        }
    }
}

/// The compute thread count, fixed by [`set_threads`] or on first use.
static THREADS: OnceLock<usize> = OnceLock::new();

/// The process's team, started on first use.
static TEAM: OnceLock<Team> = OnceLock::new();

/// Sets the number of compute threads of the process's team (0: one per available core). Errors
/// if it was set before or the team has started (it starts with the first parallel region).
pub fn set_threads(threads: usize) -> Result<(), String> {
    let threads = if threads == 0 {
        default_threads()
    } else {
        threads
    };
    THREADS.set(threads).map_err(|_| {
        format!(
            "the compute team has {} threads already",
            THREADS.get().copied().unwrap_or(0)
        )
    })
}

/// The number of compute threads (the calling thread included): what [`set_threads`] set, else
/// one per available core. Fixes the count if it was not set.
pub fn threads() -> usize {
    *THREADS.get_or_init(default_threads)
}

/// One per core the process may run on (1 if that cannot be known).
fn default_threads() -> usize {
    thread::available_parallelism().map_or(1, |n| n.get())
}

/// The process's team.
fn team() -> &'static Team {
    TEAM.get_or_init(|| Team::new(threads()))
}

/// Calls `f(range)` for consecutive ranges of `chunk` items covering `0..n`, as one region of the
/// process's team (on the calling thread alone when `n <= chunk`). Ranges are grown if there would
/// be more than [`MAX_CHUNKS`].
pub fn for_each_chunk(n: usize, chunk: usize, f: impl Fn(Range<usize>) + Sync) {
    let chunk = chunk.max(1).max(n.div_ceil(MAX_CHUNKS));
    let count = n.div_ceil(chunk);
    team().run(count, &|c| f(c * chunk..((c + 1) * chunk).min(n)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::thread::ThreadId;

    /// Runs `n` chunks on `team` and returns how often each ran.
    fn counts(team: &Team, n: usize) -> Vec<u32> {
        let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
        team.run(n, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        hits.into_iter().map(AtomicU32::into_inner).collect()
    }

    #[test]
    fn every_chunk_runs_exactly_once_in_every_region() {
        let team = Team::new(4);
        for region in 0..3000 {
            let n = [0, 1, 2, 3, 7, 64, 257][region % 7];
            assert_eq!(counts(&team, n), vec![1; n], "region {region}");
        }
        assert_eq!(counts(&team, MAX_CHUNKS), vec![1; MAX_CHUNKS]);
    }

    #[test]
    fn a_one_thread_team_starts_no_thread_and_runs_everything_on_the_caller() {
        let team = Team::new(1);
        assert_eq!(team.threads(), 1);
        assert_eq!(team.shared.alive.load(Ordering::SeqCst), 0);
        let me = thread::current().id();
        let ran = Mutex::new(Vec::new());
        team.run(50, &|i| {
            assert_eq!(thread::current().id(), me);
            ran.lock().unwrap().push(i);
        });
        assert_eq!(ran.into_inner().unwrap(), (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn the_team_serves_thousands_of_regions_with_the_same_threads_and_ends_them_when_dropped() {
        let team = Team::new(3);
        let alive = Arc::clone(&team.shared);
        let seen = Mutex::new(HashSet::<ThreadId>::new());
        for _ in 0..5000 {
            team.run(6, &|_| {
                seen.lock().unwrap().insert(thread::current().id());
            });
        }
        // A pause long enough for every helper to park, then regions again: they wake for them.
        thread::sleep(SPIN * 20);
        assert_eq!(counts(&team, 100), vec![1; 100]);
        assert!(seen.into_inner().unwrap().len() <= 3);
        assert_eq!(alive.alive.load(Ordering::SeqCst), 2);
        drop(team);
        assert_eq!(alive.alive.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_helpers_take_part_in_a_region() {
        let team = Team::new(2);
        let me = thread::current().id();
        let others = AtomicU32::new(0);
        team.run(64, &|_| {
            thread::sleep(Duration::from_millis(1));
            if thread::current().id() != me {
                others.fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(others.into_inner() > 0, "the helper ran no chunk");
    }

    #[test]
    fn a_region_opened_inside_a_region_runs_inline_on_the_member_that_opened_it() {
        let team = Team::new(3);
        let inner = AtomicU32::new(0);
        team.run(8, &|_| {
            let outer = thread::current().id();
            team.run(5, &|_| {
                assert_eq!(thread::current().id(), outer);
                inner.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(inner.into_inner(), 8 * 5);
    }

    #[test]
    fn callers_on_several_threads_share_a_team_and_each_gets_every_chunk_once() {
        let team = Team::new(2);
        thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..500 {
                        assert_eq!(counts(&team, 33), vec![1; 33]);
                    }
                });
            }
        });
    }

    #[test]
    fn a_panic_in_a_helper_reaches_the_caller_after_every_other_chunk_ran() {
        let team = Team::new(2);
        let me = thread::current().id();
        let ran = AtomicU32::new(0);
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            team.run(64, &|_| {
                thread::sleep(Duration::from_millis(1));
                ran.fetch_add(1, Ordering::Relaxed);
                if thread::current().id() != me {
                    panic!("chunk failed on a helper");
                }
            })
        }));
        let payload = result.expect_err("the helper's panic is resumed on the caller");
        assert_eq!(
            payload.downcast_ref::<&str>(),
            Some(&"chunk failed on a helper")
        );
        assert_eq!(ran.into_inner(), 64);
        // The team survives: its next region runs whole.
        assert_eq!(counts(&team, 40), vec![1; 40]);
    }

    #[test]
    fn a_panicking_chunk_unwinds_the_caller_only_after_every_other_chunk_ran() {
        let team = Team::new(3);
        let ran = AtomicU32::new(0);
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            team.run(30, &|i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert_ne!(i, 0, "chunk 0 failed");
            })
        }));
        assert!(result.is_err());
        assert_eq!(ran.into_inner(), 30);
        assert_eq!(counts(&team, 30), vec![1; 30]);
    }

    #[test]
    fn for_each_chunk_covers_the_items_in_ranges_of_the_chunk_size() {
        let ranges = Mutex::new(Vec::new());
        for_each_chunk(10, 3, |r| ranges.lock().unwrap().push(r));
        let mut ranges = ranges.into_inner().unwrap();
        ranges.sort_by_key(|r| r.start);
        assert_eq!(ranges, [0..3, 3..6, 6..9, 9..10]);
        let covered = AtomicUsize::new(0);
        for_each_chunk(MAX_CHUNKS * 3 + 1, 1, |r| {
            covered.fetch_add(r.len(), Ordering::Relaxed);
        });
        assert_eq!(covered.into_inner(), MAX_CHUNKS * 3 + 1);
    }
}
