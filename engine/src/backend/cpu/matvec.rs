//! Dense and gathered mat-vecs, split over the compute team in contiguous row ranges.

use std::marker::PhantomData;
use std::ops::Range;

use super::team::{self, for_each_chunk};
use super::{Kernels, Precision, Prepared, QuantizedActs, TOKEN_GROUP};
use crate::model::QRows;
use crate::quant::tiles::TILE_ROWS;

/// The fewest rows one chunk of work gets: below this a task's bookkeeping costs about as much as its
/// dot products (64 rows × 576 values of Q4_1 is ~23 KB of weights, a few microseconds).
pub const MIN_ROWS_PER_TASK: usize = 64;

/// Rows per chunk for `n` rows: about four chunks per thread for load balance, never fewer than
/// [`MIN_ROWS_PER_TASK`] rows, and a whole number of tiles (a chunk never starts inside one).
fn rows_per_task(n: usize) -> usize {
    n.div_ceil(4 * team::threads())
        .max(MIN_ROWS_PER_TASK)
        .next_multiple_of(TILE_ROWS)
}

/// `f(rows, out_chunk)` over consecutive chunks of `out` (`out_chunk` is `out[rows]`), on the
/// calling thread if `out` is small, else over the team.
fn fill(out: &mut [f32], f: impl Fn(Range<usize>, &mut [f32]) + Sync) {
    let chunk = rows_per_task(out.len());
    let shared = Disjoint::new(out);
    for_each_chunk(shared.len(), chunk, |r| {
        // SAFETY: `for_each_chunk` hands out each range once, and its ranges do not overlap.
        f(r.clone(), unsafe { shared.range(r) })
    });
}

pub(super) fn matvec(
    k: &Kernels,
    m: &QRows,
    x: &[f32],
    out: &mut [f32],
    precision: Precision,
    scratch: &mut QuantizedActs,
) {
    assert_eq!(out.len(), m.rows, "output length vs matrix rows");
    let x = k.prepare(x, precision, scratch);
    fill(out, |r, os| k.rows_dot(m, r.start, x, os));
}

/// Fills `out[k]` with row `rows[k]` of `m` against `x`. The rows are read one by one, so not
/// from a tiled matrix ([`QRows::row`] panics).
pub(super) fn matvec_rows(
    k: &Kernels,
    m: &QRows,
    rows: &[u32],
    x: &[f32],
    out: &mut [f32],
    precision: Precision,
    scratch: &mut QuantizedActs,
) {
    assert_eq!(out.len(), rows.len(), "output length vs selected rows");
    assert_eq!(x.len(), m.cols, "activations vs matrix columns");
    let listed = |r: Range<usize>| rows[r].iter().map(|&i| m.row(i as usize));
    // Types without an integer path are exact in either precision.
    if k.integer_dot(m.dtype).is_some() && precision == Precision::Fast {
        scratch.quantize_with(k, x);
        let acts = scratch.blocks();
        fill(out, |r, os| {
            k.dot_rows_q8_each(m.dtype, listed(r), &[acts], &mut [os])
        });
    } else {
        fill(out, |r, os| {
            k.dot_rows_each(m.dtype, listed(r), &[x], &mut [os])
        });
    }
}

/// Rows per work item of a fused mat-vec: 32 rows × 576 values of Q4_1 is ~12 KB of weights, a
/// couple of microseconds of work.
pub const FUSED_ROWS: usize = 32;

/// A mutable slice shared by the chunks of a parallel region, each of which writes disjoint
/// ranges (for outputs that are not split into equal chunks, or several outputs per chunk).
#[derive(Debug)]
pub struct Disjoint<'a, T = f32> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: a `Disjoint` is a `&mut [T]` split among threads, which needs `T: Send`; `range` requires
// its callers to take non-overlapping ranges, so no element is accessed by two threads.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    /// Shares `s` for disjoint writes.
    pub fn new(s: &'a mut [T]) -> Self {
        Disjoint {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: PhantomData,
        }
    }

    /// Length of the shared slice.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements in `r`. Panics if `r` is out of bounds.
    ///
    /// # Safety
    /// No two live results of `range` on the same `Disjoint` may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, r: Range<usize>) -> &mut [T] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "range {r:?} of {}",
            self.len
        );
        // SAFETY: in bounds (checked above) and, by the caller's contract, not aliased.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }
}

/// The mat-vecs of a batch in one parallel region: job `j` is a matrix and one output slice of
/// its rows per token (`outs[t]` gets `m · x_t`).
pub(super) fn fused_matvecs<'m, 'o>(
    k: &Kernels,
    x: Prepared<'_>,
    n_tokens: usize,
    jobs: impl IntoIterator<Item = (&'m QRows, Vec<&'o mut [f32]>)>,
) {
    assert!(n_tokens > 0, "a batch of no tokens");
    let jobs: Vec<_> = jobs
        .into_iter()
        .map(|(m, outs)| {
            assert_eq!(outs.len(), n_tokens, "one output per token");
            assert_eq!(x.len(), n_tokens * m.cols, "activations vs matrix columns");
            let outs: Vec<Disjoint<'_>> = outs
                .into_iter()
                .map(|out| {
                    assert_eq!(out.len(), m.rows, "output length vs matrix rows");
                    Disjoint::new(out)
                })
                .collect();
            (m, outs)
        })
        .collect();
    let counts: Vec<usize> = jobs
        .iter()
        .map(|(m, _)| m.rows.div_ceil(FUSED_ROWS))
        .collect();
    let total: usize = counts.iter().sum();
    let per_task = total.div_ceil(4 * team::threads()).max(1);
    for_each_chunk(total, per_task, |items| {
        for mut i in items {
            let mut j = 0;
            while i >= counts[j] {
                i -= counts[j];
                j += 1;
            }
            let (m, outs) = &jobs[j];
            let r = i * FUSED_ROWS..((i + 1) * FUSED_ROWS).min(m.rows);
            for t0 in (0..n_tokens).step_by(TOKEN_GROUP) {
                let t1 = (t0 + TOKEN_GROUP).min(n_tokens);
                let mut group: [&mut [f32]; TOKEN_GROUP] = Default::default();
                for (g, out) in group.iter_mut().zip(&outs[t0..t1]) {
                    // SAFETY: `for_each_chunk` hands out each item once, and distinct items of
                    // job `j` map to disjoint row ranges of each token's output.
                    *g = unsafe { out.range(r.clone()) };
                }
                let x = x.tokens(t0..t1, n_tokens);
                k.rows_dot_each(m, r.start, x, &mut group[..t1 - t0]);
            }
        }
    });
}
