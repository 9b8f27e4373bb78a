//! Reads of model chunks straight into cache slots, never through the page cache.
//!
//! - [`aligned`]: [`PAGE`], `align_up`/`align_down`, [`AlignedBuf`] (owned 4 KiB-aligned memory);
//! - [`read`]: the [`ReadAt`] seam (one `preadv`'s worth) and the exact-read loop (`EINTR`, short
//!   reads, early end of file);
//! - [`direct`]: [`DirectFile`], `O_DIRECT` with a logged buffered fallback;
//! - [`fault`]: [`MemReader`] and [`FaultyReader`] for tests;
//! - [`queue`]: read requests (with the checksum a chunk must match) and the priority queue with
//!   its coalescing plan;
//! - [`engine`]: the [`IoEngine`] trait, requests' [`Completion`]s, [`IoStats`];
//! - [`pool`]: [`ThreadPoolIo`], the OS-thread implementation;
//! - [`uring`]: [`UringIo`], the io_uring implementation, and [`open_engine`], which picks it where
//!   the kernel allows io_uring and the pool elsewhere (`LEANSTREAM_IO=pool|uring` forces one).

pub mod aligned;
pub mod direct;
pub mod engine;
pub mod fault;
pub mod pool;
pub mod queue;
pub mod read;
pub mod uring;

pub use aligned::{AlignedBuf, PAGE, align_down, align_up, align_up_usize, is_page_aligned};
pub use direct::DirectFile;
pub use engine::{Completion, DEFAULT_MAX_GAP_BYTES, IoEngine, IoOptions, IoStats};
pub use fault::{Fault, FaultKind, FaultyReader, MemReader};
pub use pool::ThreadPoolIo;
pub use queue::{ChunkCheck, ReadRequest, ReadTarget};
pub use read::{ReadAt, ReadCounters, read_exact_at};
pub use uring::{IO_BACKEND_ENV, IoBackend, UringIo, open_engine, open_engine_with};
