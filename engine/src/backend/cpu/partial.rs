//! Sums split over the compute team with one partial sum per chunk, added in a fixed order so that
//! the result never depends on scheduling: the neuron-major down projection
//! ([`down_neurons`]) and the reduction under the pipeline's chunk kernels ([`partial_sums`]).

use super::{Disjoint, Kernels, add_inplace, for_each_chunk};
use crate::model::QRows;

/// Splits the units `0..n` into contiguous groups of `ceil(n / parts)` units, where
/// `parts = partials.len() / d` (one partial sum of `d` values per group), and computes the groups
/// on the compute team: each group's partial sum is zeroed, then `unit(i, acc)` adds unit `i`'s
/// share for the group's units in ascending order. Returns the partial sums of the non-empty
/// groups, `(groups, d)` in group order (empty when `n == 0`), for the caller to add up in that
/// order. The grouping depends on `n`, `d` and `partials.len()` only, so the sums are the same on
/// every run.
///
/// Panics if `partials` holds fewer than `d` values or `d == 0` (a caller's sizing invariant).
pub fn partial_sums(
    n: usize,
    d: usize,
    partials: &mut [f32],
    unit: impl Fn(usize, &mut [f32]) + Sync,
) -> &[f32] {
    let parts = partials.len() / d;
    assert!(
        parts > 0,
        "partials hold {} values, need {d}",
        partials.len()
    );
    let per = n.div_ceil(parts).max(1);
    let used = n.div_ceil(per);
    let shared = Disjoint::new(&mut partials[..used * d]);
    for_each_chunk(n, per, |r| {
        let p = r.start / per;
        // SAFETY: `for_each_chunk` hands out each range of `per` units once, so group `p` alone
        // writes partial sum `p`.
        let acc = unsafe { shared.range(p * d..(p + 1) * d) };
        acc.fill(0.0);
        for i in r {
            unit(i, acc);
        }
    });
    &partials[..used * d]
}

/// `out = Σ_i h_i · column_i` over the neurons with `h_i != 0`, for a down matrix stored
/// neuron-major (`m`: `(n_ff, d_model)`, row `i` the down column of neuron `i`). The neurons are
/// split as [`partial_sums`] does over `partials` (`n_parts * d_model` values of scratch); the
/// partial sums are added in group order, so the result is the same for the same number of parts.
///
/// Panics unless `h.len() == m.rows`, `out.len() == m.cols` and `partials` holds at least one
/// partial sum (callers size them from the validated model).
pub fn down_neurons(k: &Kernels, m: &QRows, h: &[f32], partials: &mut [f32], out: &mut [f32]) {
    assert_eq!(h.len(), m.rows, "activations vs down columns");
    assert_eq!(out.len(), m.cols, "output vs down column length");
    let d = out.len();
    let sums = partial_sums(h.len(), d, partials, |i, acc| {
        if h[i] != 0.0 {
            k.axpy(m.dtype, m.row(i), h[i], acc);
        }
    });
    let Some((first, rest)) = sums.split_at_checked(d) else {
        out.fill(0.0);
        return;
    };
    out.copy_from_slice(first);
    for part in rest.chunks_exact(d) {
        add_inplace(out, part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TensorBytes;
    use crate::quant::DType;

    /// Neuron-major f32 down columns, `(rows, cols)`.
    fn columns(rows: &[Vec<f32>]) -> QRows {
        let bytes: Vec<u8> = rows
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        QRows::contiguous(
            DType::F32,
            rows.len(),
            rows[0].len(),
            TensorBytes::from_vec(bytes),
        )
        .expect("whole f32 rows")
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn partial_sums_run_contiguous_groups_in_ascending_order_and_return_only_used_ones() {
        // Each unit shifts its index in as a decimal digit, so a sum spells its units in order.
        let digits = |i: usize, acc: &mut [f32]| acc[0] = acc[0] * 10.0 + i as f32;
        let mut partials = vec![f32::NAN; 4];
        assert_eq!(
            partial_sums(10, 1, &mut partials, digits),
            [12.0, 345.0, 678.0, 9.0]
        );
        let mut partials = vec![f32::NAN; 4];
        assert_eq!(partial_sums(2, 1, &mut partials, digits), [0.0, 1.0]);
        assert!(partial_sums(0, 1, &mut partials, digits).is_empty());
    }

    #[test]
    fn down_neurons_skips_zero_activations_and_adds_the_parts_in_order() {
        let k = Kernels::best();
        let cols: Vec<Vec<f32>> = (0..7)
            .map(|i| (0..4).map(|j| 0.1 * (i * 4 + j) as f32 - 1.3).collect())
            .collect();
        let mut poisoned = cols.clone();
        poisoned[4] = vec![f32::NAN; 4]; // neuron 4 is inactive: its column must not be read
        let m = columns(&poisoned);
        let h = [0.7, -1.1, 0.3, 2.5, 0.0, -0.9, 1.7];
        let serial = |range: std::ops::Range<usize>| {
            let mut acc = vec![0.0f32; 4];
            for i in range.filter(|&i| h[i] != 0.0) {
                k.axpy(DType::F32, m.row(i), h[i], &mut acc);
            }
            acc
        };

        let mut out = [f32::NAN; 4];
        down_neurons(k, &m, &h, &mut [0.0; 4], &mut out);
        assert_eq!(bits(&out), bits(&serial(0..7)));

        // Three parts: neurons 0..3, 3..6 and 6..7, summed in that order.
        let mut want = serial(0..3);
        add_inplace(&mut want, &serial(3..6));
        add_inplace(&mut want, &serial(6..7));
        down_neurons(k, &m, &h, &mut [0.0; 3 * 4], &mut out);
        assert_eq!(bits(&out), bits(&want));
        assert!(out.iter().all(|v| v.is_finite()));
    }
}
