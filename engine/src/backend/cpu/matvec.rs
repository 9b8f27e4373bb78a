//! Dense and gathered mat-vecs, split over the rayon pool in contiguous row ranges.

use rayon::prelude::*;

use super::{Kernels, Precision, QuantizedActs, dtype_index, row_prefix};
use crate::model::QRows;

/// The fewest rows one rayon task gets: below this a task's bookkeeping costs about as much as its
/// dot products (64 rows × 576 values of Q4_1 is ~23 KB of weights, a few microseconds).
pub const MIN_ROWS_PER_TASK: usize = 64;

/// Rows per task for `n` rows: about four tasks per thread for load balance, never fewer than
/// [`MIN_ROWS_PER_TASK`] rows.
fn rows_per_task(n: usize) -> usize {
    n.div_ceil(4 * rayon::current_num_threads())
        .max(MIN_ROWS_PER_TASK)
}

/// `out[k] = f(k)` for every `k`, on the calling thread if `out` is small, else over the pool.
fn fill(out: &mut [f32], f: impl Fn(usize) -> f32 + Sync) {
    let chunk = rows_per_task(out.len());
    if chunk >= out.len() {
        out.iter_mut().enumerate().for_each(|(k, o)| *o = f(k));
    } else {
        out.par_chunks_mut(chunk).enumerate().for_each(|(c, os)| {
            let base = c * chunk;
            os.iter_mut()
                .enumerate()
                .for_each(|(j, o)| *o = f(base + j));
        });
    }
}

/// Fills `out[k]` with the dot product of row `row_of(k)` of `m` with `x`.
fn run(
    k: &Kernels,
    m: &QRows,
    x: &[f32],
    out: &mut [f32],
    precision: Precision,
    scratch: &mut QuantizedActs,
    row_of: impl Fn(usize) -> usize + Sync,
) {
    assert_eq!(x.len(), m.cols, "activations vs matrix columns");
    let i = dtype_index(m.dtype);
    // Float rows have no integer path: they are exact in either precision.
    if precision == Precision::Exact || i < 3 {
        let dot = k.dot[i];
        fill(out, |r| {
            dot(row_prefix(m.dtype, m.row(row_of(r)), x.len()), x)
        });
    } else {
        scratch.quantize_with(k, x);
        let dot = k.dot_q8[i - 3];
        let acts = scratch.blocks();
        fill(out, |r| {
            dot(row_prefix(m.dtype, m.row(row_of(r)), x.len()), acts)
        });
    }
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
    run(k, m, x, out, precision, scratch, |r| r);
}

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
    run(k, m, x, out, precision, scratch, |r| rows[r] as usize);
}
