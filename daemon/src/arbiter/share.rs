//! Splitting free bytes among neuron caches.

/// Splits `free` bytes among claims `wants`, in proportion to each claim, exactly.
///
/// Returns one grant per claim with `grant[i] <= wants[i]` and
/// `sum(grant) == min(free, sum(wants))`. When the claims do not all fit, each grant is within one
/// byte of `free * wants[i] / sum(wants)`: the bytes that flooring leaves over go to the largest
/// fractional parts (ties to the earlier claim), so nothing stays free while a claim is unmet.
pub(super) fn proportional(free: u64, wants: &[u64]) -> Vec<u64> {
    let total: u128 = wants.iter().map(|&w| u128::from(w)).sum();
    if total <= u128::from(free) {
        return wants.to_vec();
    }
    // Here free < total, so every quotient below is < wants[i] and fits in u64.
    let free_wide = u128::from(free);
    let mut grants = Vec::with_capacity(wants.len());
    let mut remainders = Vec::with_capacity(wants.len());
    for (i, &want) in wants.iter().enumerate() {
        let scaled = free_wide * u128::from(want);
        grants.push(u64::try_from(scaled / total).unwrap_or(want));
        remainders.push((scaled % total, i));
    }
    let granted: u64 = grants.iter().sum();
    let left = free - granted;
    // Fewer bytes are left than claims with a non-zero remainder; each gets at most one.
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in remainders
        .iter()
        .take(usize::try_from(left).unwrap_or(usize::MAX))
    {
        grants[i] += 1;
    }
    grants
}

#[cfg(test)]
mod tests {
    use super::proportional;
    use proptest::prelude::*;

    #[test]
    fn everything_fits() {
        assert_eq!(proportional(100, &[10, 20, 0]), vec![10, 20, 0]);
    }

    #[test]
    fn splits_in_proportion() {
        assert_eq!(proportional(30, &[10, 20]), vec![10, 20]);
        assert_eq!(proportional(15, &[10, 20]), vec![5, 10]);
        assert_eq!(proportional(0, &[10, 20]), vec![0, 0]);
        // 10 * 1/3 = 3.33 each: the leftover byte goes to the first claim.
        assert_eq!(proportional(10, &[7, 7, 7]), vec![4, 3, 3]);
        // A zero claim never gets a leftover byte.
        assert_eq!(proportional(1, &[0, 3]), vec![0, 1]);
    }

    #[test]
    fn huge_claims_do_not_overflow() {
        let g = proportional(u64::MAX - 1, &[u64::MAX, u64::MAX]);
        assert_eq!(
            g.iter().map(|&x| u128::from(x)).sum::<u128>(),
            u128::from(u64::MAX - 1)
        );
    }

    proptest! {
        #[test]
        fn grants_are_bounded_exact_and_fair(
            free in 0u64..10_000,
            wants in prop::collection::vec(0u64..5_000, 0..6),
        ) {
            let grants = proportional(free, &wants);
            prop_assert_eq!(grants.len(), wants.len());
            let total: u64 = wants.iter().sum();
            prop_assert_eq!(grants.iter().sum::<u64>(), free.min(total));
            for (&g, &w) in grants.iter().zip(&wants) {
                prop_assert!(g <= w);
                if total > free {
                    // Within one byte of the exact share free * w / total.
                    let exact = u128::from(free) * u128::from(w);
                    let scaled = u128::from(g) * u128::from(total);
                    prop_assert!(scaled + u128::from(total) > exact && scaled < exact + u128::from(total));
                }
            }
        }
    }
}
