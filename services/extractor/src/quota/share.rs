//! Pure share arithmetic: a replica's part of a fleet-wide limit, a tenant's part of a
//! replica's allowance.

/// This replica's part of `limit` when `live` (sorted ids, including `me`) share it:
/// an even split, the remainder to the lowest ranks, so the parts sum to `limit`.
pub fn share(limit: u32, live: &[String], me: &str) -> u32 {
    let n = live.len().max(1) as u32;
    let rank = live.iter().position(|id| id == me).unwrap_or(live.len()) as u32;
    if rank >= n {
        return 0;
    }
    limit / n + u32::from(rank < limit % n)
}

/// A tenant's part of this replica's `allowance` on the key: its `weight` against the
/// total weight of the tenants that want calls (running or waiting), rounded up, at
/// least one while there is any allowance, and at most `cap`.
pub fn fair_share(allowance: u32, weight: u32, active_weight: u32, cap: Option<u32>) -> u32 {
    let total = u64::from(active_weight.max(weight).max(1));
    let fair = (u64::from(allowance) * u64::from(weight.max(1))).div_ceil(total) as u32;
    let fair = fair.max(u32::from(allowance > 0)).min(allowance);
    cap.map_or(fair, |c| fair.min(c))
}

/// The live replicas after a read of the heartbeats that found `fresh` live, given the
/// ranks before (`live`) and those the read before missed (`missing`): sorted ranks, and
/// the replicas this read missed for the first time. A replica drops out only when two
/// reads in a row miss it: one read alone (its heartbeat written late, or a listing that
/// missed its key while it was written) would hand its share to the others while its
/// calls still run.
pub fn ranks(
    live: &[String],
    missing: &std::collections::BTreeSet<String>,
    mut fresh: Vec<String>,
) -> (Vec<String>, std::collections::BTreeSet<String>) {
    let first_miss: std::collections::BTreeSet<String> =
        live.iter().filter(|id| !fresh.contains(*id) && !missing.contains(*id)).cloned().collect();
    fresh.extend(first_miss.iter().cloned());
    fresh.sort();
    fresh.dedup();
    (fresh, first_miss)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("r{i}")).collect()
    }

    #[test]
    fn shares_sum_to_the_limit() {
        for limit in 0..10u32 {
            for n in 1..6 {
                let live = ids(n);
                let total: u32 = live.iter().map(|me| share(limit, &live, me)).sum();
                assert_eq!(total, limit, "limit {limit} over {n}");
            }
        }
        let live = ids(3);
        assert_eq!([share(2, &live, "r0"), share(2, &live, "r1"), share(2, &live, "r2")], [1, 1, 0]);
        assert_eq!(share(8, &ids(1), "r0"), 8);
        // Not (yet) among the live: no share.
        assert_eq!(share(8, &live, "zz"), 0);
    }

    #[test]
    fn a_replica_drops_out_of_the_ranks_only_when_two_reads_in_a_row_miss_it() {
        let live = ids(3);
        // Missed once: still ranked, and remembered as missed.
        let (ranks_1, missing_1) = ranks(&live, &Default::default(), vec!["r0".into(), "r2".into()]);
        assert_eq!(ranks_1, ids(3));
        assert_eq!(missing_1.iter().collect::<Vec<_>>(), ["r1"]);
        // Back in the next read: nothing changes.
        let (ranks_2, missing_2) = ranks(&ranks_1, &missing_1, ids(3));
        assert_eq!((ranks_2, missing_2.len()), (ids(3), 0));
        // Missed twice in a row (killed): it drops out.
        let (ranks_3, missing_3) = ranks(&ranks_1, &missing_1, vec!["r2".into(), "r0".into()]);
        assert_eq!(ranks_3, vec!["r0".to_string(), "r2".to_string()]);
        assert!(missing_3.is_empty());
        // A new replica joins at once.
        let (ranks_4, _) = ranks(&ranks_3, &missing_3, vec!["r0".into(), "r2".into(), "r3".into()]);
        assert_eq!(ranks_4, ["r0", "r2", "r3"]);
    }

    #[test]
    fn tenants_share_a_replica_allowance_by_weight() {
        // Alone, a tenant takes it all.
        assert_eq!(fair_share(4, 1, 1, None), 4);
        // Two equal tenants: half each.
        assert_eq!(fair_share(4, 1, 2, None), 2);
        // Weights 3:1 of 4 calls.
        assert_eq!((fair_share(4, 3, 4, None), fair_share(4, 1, 4, None)), (3, 1));
        // Rounded up, never below one call while there is any allowance.
        assert_eq!(fair_share(3, 1, 2, None), 2);
        assert_eq!(fair_share(1, 1, 5, None), 1);
        assert_eq!(fair_share(0, 1, 1, None), 0);
        // A tenant's cap holds.
        assert_eq!(fair_share(8, 1, 1, Some(2)), 2);
    }
}
