//! Neuron reordering so that neurons often active together share chunks, and the measure of its
//! effect: chunks a token touches (reads, when nothing is cached) per layer.

/// Per layer, the neurons sorted by activation frequency, most frequent first (ties keep their
/// order): new stored neuron `k` is old stored neuron `order[l][k]`. Hot neurons fill the first
/// chunks and cold ones the last, so a token's active set spans fewer chunks and the cache can
/// hold whole hot chunks.
pub fn by_frequency(freq: &[Vec<f32>]) -> Vec<Vec<u32>> {
    freq.iter()
        .map(|f| {
            let mut order: Vec<u32> = (0..f.len() as u32).collect();
            order.sort_by(|&a, &b| f[b as usize].total_cmp(&f[a as usize]));
            order
        })
        .collect()
}

/// Sum over the tokens of `h` (`(tokens, n_ff)`) of the number of chunks of `chunk_neurons` that
/// hold at least one active neuron ([`crate::sparsity::is_active`] at `thr`), with neurons laid
/// out in `order` (new position `k` holds neuron `order[k]`; `None` keeps the current order).
pub fn chunks_touched(
    h: &[f32],
    n_ff: usize,
    thr: f32,
    chunk_neurons: usize,
    order: Option<&[u32]>,
) -> u64 {
    let mut pos: Vec<usize> = (0..n_ff).collect();
    if let Some(order) = order {
        for (k, &i) in order.iter().enumerate() {
            pos[i as usize] = k;
        }
    }
    let mut seen = vec![false; n_ff.div_ceil(chunk_neurons)];
    let mut total = 0u64;
    for row in h.chunks_exact(n_ff) {
        seen.fill(false);
        for (i, v) in row.iter().enumerate() {
            if crate::sparsity::is_active(*v, thr) {
                seen[pos[i] / chunk_neurons] = true;
            }
        }
        total += seen.iter().filter(|&&s| s).count() as u64;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequency_order_puts_hot_neurons_first() {
        let order = by_frequency(&[vec![0.1, 0.9, 0.5, 0.9]]);
        assert_eq!(order, vec![vec![1, 3, 2, 0]]);
    }

    #[test]
    fn reordering_co_active_neurons_touches_fewer_chunks() {
        // Neurons 0 and 3 are always active together; chunks of 2.
        let h = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0];
        assert_eq!(chunks_touched(&h, 4, 0.5, 2, None), 4);
        assert_eq!(chunks_touched(&h, 4, 0.5, 2, Some(&[0, 3, 1, 2])), 2);
    }
}
