//! What one replica holds of one of the key's buckets: a slice of the fleet's budget,
//! taken in one compare-and-set and spent here call by call without another (as
//! Doorman's clients lease capacity from its server and spend it locally). The fleet's
//! bucket (`bucket`, on `QUOTA_<R>`) is charged when a slice is taken, so the budget
//! stays exact across the fleet: no replica spends what it did not take. What a call
//! does not use goes back into the slice; a slice lapses `SPAN` after it was taken, and
//! what it still holds goes back to the fleet's bucket with the next take. A dead
//! replica's slice lapses by itself: the fleet's bucket refills as it always does.
//!
//! A slice is sized by what this replica spends: its spend over one `SPAN`, at least one
//! call, at most the bucket's refill over a second. The provider may see a slice's calls
//! up to `SPAN` after the fleet's bucket was charged for them; what that shift can add
//! to a burst is at most what the live replicas hold.
//!
//! Pure: the time is given.

/// How long a slice may be spent: also the span of spend it is sized for.
pub const SPAN_MS: u64 = 4_000;

/// This replica's slice of one bucket, and its spend.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slice {
    /// Units held (negative: used beyond what was reserved, owed to the fleet's bucket).
    pub units: f64,
    /// When it lapses.
    pub until_ms: u64,
    /// Units spent from slices since `since_ms`.
    spent: f64,
    since_ms: u64,
    /// Units per millisecond this replica spends, smoothed over the takes.
    rate: f64,
    /// Until when the fleet's bucket said it cannot give the next slice, and the
    /// bucket's capacity then (a new limit asks again at once).
    refused_until_ms: u64,
    refused_capacity: u64,
}

impl Slice {
    /// Spends `cost` if the slice holds that much and has not lapsed.
    pub fn spend(&mut self, cost: u64, now_ms: u64) -> bool {
        if now_ms >= self.until_ms || self.units < cost as f64 {
            return false;
        }
        self.units -= cost as f64;
        self.spent += cost as f64;
        true
    }

    /// Gives back what a call did not use (`units`; negative when it used more than it
    /// reserved).
    pub fn give_back(&mut self, units: f64) {
        self.units += units;
        self.spent -= units.min(self.spent);
    }

    /// The provider said the bucket is empty: what the slice holds is not there.
    pub fn empty(&mut self) {
        self.units = self.units.min(0.0);
    }

    /// What to take from the fleet's bucket for a call of `cost`: this replica's spend
    /// over a `SPAN`, at least the call, at most `most` (the bucket's refill over a
    /// second, or the call when that is less).
    pub fn wanted(&self, cost: u64, most: f64, now_ms: u64) -> u64 {
        let rate = self.rate_at(now_ms);
        let want = (rate * SPAN_MS as f64).ceil().min(most.floor());
        (want as u64).max(cost)
    }

    fn rate_at(&self, now_ms: u64) -> f64 {
        let elapsed = now_ms.saturating_sub(self.since_ms);
        if elapsed == 0 {
            return self.rate;
        }
        let now = self.spent / elapsed.max(100) as f64;
        if self.rate == 0.0 { now } else { (self.rate + now) / 2.0 }
    }

    /// What goes back to the fleet's bucket with a take: everything the slice holds
    /// (what is left of it is less than the call that needs the take, or it lapsed)
    /// and any debt. The slice is left empty until the take is done (`taken`), or the
    /// units come back (`give_back`) when it fails.
    pub fn hand_back(&mut self) -> f64 {
        std::mem::take(&mut self.units)
    }

    /// The fleet's bucket, of `capacity`, refused a take until `until_ms`: no take is
    /// asked for before, while the limit stays.
    pub fn refused_until(&mut self, until_ms: u64, capacity: u64) {
        self.refused_until_ms = until_ms;
        self.refused_capacity = capacity;
    }

    /// How long until a take may be asked for again of the bucket at `capacity`, if it
    /// refused one.
    pub fn refused_for(&self, now_ms: u64, capacity: u64) -> Option<std::time::Duration> {
        (now_ms < self.refused_until_ms && capacity == self.refused_capacity)
            .then(|| std::time::Duration::from_millis(self.refused_until_ms - now_ms))
    }

    /// `took` units were taken at `now_ms`: a new slice of them, and the spend so far
    /// folded into the rate.
    pub fn taken(&mut self, took: u64, now_ms: u64) {
        self.rate = self.rate_at(now_ms);
        self.spent = 0.0;
        self.since_ms = now_ms;
        self.units += took as f64;
        self.until_ms = now_ms + SPAN_MS;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_is_spent_until_it_is_short_or_lapses() {
        let mut s = Slice::default();
        assert!(!s.spend(1, 0), "nothing taken yet");
        s.taken(10, 1_000);
        assert_eq!(s.until_ms, 1_000 + SPAN_MS);
        assert!(s.spend(4, 1_100) && s.spend(4, 1_200));
        assert!(!s.spend(4, 1_300), "2 left, 4 asked");
        assert!(s.spend(2, 1_300));
        s.give_back(3.0);
        assert!(!s.spend(3, 1_000 + SPAN_MS), "lapsed, though it holds 3");
        assert_eq!(s.hand_back(), 3.0);
        assert_eq!(s.units, 0.0);
    }

    #[test]
    fn a_slice_is_sized_by_what_the_replica_spends() {
        let mut s = Slice::default();
        // First take: no spend known, one call.
        assert_eq!(s.wanted(5, 1_000.0, 0), 5);
        s.taken(30, 0);
        // 20 units a second for a second: 80 over a span of four.
        for t in 0..20 {
            assert!(s.spend(1, t * 50), "{t}");
        }
        assert_eq!(s.wanted(1, 1_000.0, 1_000), 80);
        // What a call gave back was not spent.
        s.give_back(10.0);
        assert_eq!(s.wanted(1, 1_000.0, 1_000), 40);
        // Never more than the bucket's refill over a span, never less than the call.
        assert_eq!(s.wanted(1, 12.0, 1_000), 12);
        assert_eq!(s.wanted(50, 12.0, 1_000), 50);
    }

    #[test]
    fn usage_beyond_the_reservation_is_a_debt_handed_back_with_the_next_take() {
        let mut s = Slice::default();
        s.taken(2, 0);
        assert!(s.spend(2, 10));
        s.give_back(-3.0);
        assert!(!s.spend(1, 20));
        assert_eq!(s.hand_back(), -3.0, "owed to the fleet's bucket");
        // A 429 says the bucket is empty: held units go, a debt stays.
        s.taken(5, 30);
        s.empty();
        assert_eq!(s.units, 0.0);
    }

    #[test]
    fn after_a_refused_take_none_is_asked_for_until_the_bucket_can_have_it() {
        let mut s = Slice::default();
        assert_eq!(s.refused_for(0, 20), None);
        s.refused_until(1_500, 20);
        assert_eq!(s.refused_for(1_000, 20), Some(std::time::Duration::from_millis(500)));
        assert_eq!(s.refused_for(1_500, 20), None);
        // A new limit (a larger tier learned) asks again at once.
        assert_eq!(s.refused_for(1_000, 40), None);
    }
}
