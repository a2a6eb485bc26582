//! What `baton top` and `baton status --prometheus` show besides the
//! pool's state: how long requests waited, and how full the pool was over
//! the last minutes. Both are bounded in memory whatever the broker's
//! uptime or traffic: a histogram of fixed buckets per build, and a ring of
//! fixed length per pool.
//!
//! Time is whatever unit the caller passes (the broker: microseconds for
//! waits, nanoseconds of a monotonic clock for utilization).

use std::collections::VecDeque;

/// Sub-buckets per power of two: 2^3 = 8, so a bucket is at most 1/8 as
/// wide as the values in it, and a percentile read from the buckets is at
/// most 12.5% above the true one (the log-linear layout of HdrHistogram).
const SUB_BITS: u32 = 3;
/// Values at or above 2^40 (in microseconds, 12.7 days) count as 2^40 - 1.
const MAX_BITS: u32 = 40;
/// 304 buckets: 8 for each power of two up to 2^40, the first 16 exact.
const BUCKETS: usize = ((MAX_BITS - SUB_BITS + 1) << SUB_BITS) as usize;
const MAX_VALUE: u64 = (1 << MAX_BITS) - 1;

/// A distribution of values (the broker: how long each ACQUIRE waited, in
/// microseconds), in log-linear buckets: 304 counters, allocated at the
/// first value, whatever the number of values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Histogram {
    counts: Vec<u64>,
    count: u64,
    sum: u64,
    max: u64,
}

impl Histogram {
    /// Counts one value.
    pub fn record(&mut self, value: u64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
        }
        let value = value.min(MAX_VALUE);
        self.counts[bucket_of(value)] += 1;
        self.count += 1;
        self.sum = self.sum.saturating_add(value);
        self.max = self.max.max(value);
    }

    /// How many values were recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Their sum (saturating).
    pub fn sum(&self) -> u64 {
        self.sum
    }

    /// The value at or below which a fraction `q` (0 to 1) of the values
    /// lie (nearest rank), rounded up to its bucket's top, never above the
    /// largest value seen; None if nothing was recorded.
    pub fn percentile(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (bucket, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(bucket_top(bucket).min(self.max));
            }
        }
        Some(self.max)
    }
}

/// The bucket of a value below 2^40: values under 8 have one each; above,
/// each power of two [2^e, 2^(e+1)) is cut into 8 equal buckets.
fn bucket_of(value: u64) -> usize {
    if value < 1 << SUB_BITS {
        return value as usize;
    }
    let e = 63 - value.leading_zeros();
    let block = e - SUB_BITS + 1;
    let within = (value >> (e - SUB_BITS)) - (1 << SUB_BITS);
    ((block << SUB_BITS) as u64 + within) as usize
}

/// The largest value that falls in `bucket`.
fn bucket_top(bucket: usize) -> u64 {
    let (block, within) = (
        bucket as u32 >> SUB_BITS,
        bucket as u64 & ((1 << SUB_BITS) - 1),
    );
    if block == 0 {
        return within;
    }
    let width_bits = block - 1;
    (((1 << SUB_BITS) + within) << width_bits) + (1 << width_bits) - 1
}

/// Mean tokens held over each of the last `capacity` slots of `width`
/// (the broker: 600 slots of one second). Fed at every change with the
/// level that held since the one before, as [`crate::Pool::advance`] is;
/// needs no timer: slots that passed without a change are filled in when
/// the next one comes, or when the samples are read.
#[derive(Debug, Clone)]
pub struct Utilization {
    width: u64,
    capacity: usize,
    /// Completed slots, oldest first: the mean held in each.
    slots: VecDeque<f32>,
    /// The time of the last call.
    at: u64,
    /// Tokens × time held in the slot `at` is in, up to `at`.
    area: u128,
}

impl Utilization {
    /// An empty history whose clock starts at 0. Its memory is allocated
    /// here, whole: `capacity` × 4 bytes.
    ///
    /// # Panics
    /// If `width` is 0.
    pub fn new(width: u64, capacity: usize) -> Self {
        assert!(width > 0, "a slot has a width");
        Utilization {
            width,
            capacity,
            slots: VecDeque::with_capacity(capacity),
            at: 0,
            area: 0,
        }
    }

    /// Time is `now`, and `held` tokens were held since the last call. A
    /// clock that goes back is taken as not having moved.
    pub fn advance(&mut self, now: u64, held: u32) {
        let now = now.max(self.at);
        let slot_end = (self.at / self.width + 1) * self.width;
        if now < slot_end {
            self.area += u128::from(held) * u128::from(now - self.at);
            self.at = now;
            return;
        }
        self.area += u128::from(held) * u128::from(slot_end - self.at);
        self.push((self.area as f64 / self.width as f64) as f32);
        let whole = (now - slot_end) / self.width;
        for _ in 0..whole.min(self.capacity as u64) {
            self.push(held as f32);
        }
        self.at = slot_end + whole * self.width;
        self.area = u128::from(held) * u128::from(now - self.at);
        self.at = now;
    }

    fn push(&mut self, mean: f32) {
        if self.slots.len() == self.capacity {
            self.slots.pop_front();
        }
        self.slots.push_back(mean);
    }

    /// The completed slots up to `now`, oldest first, with `held` tokens
    /// held since the last call; at most `capacity`.
    pub fn samples(&self, now: u64, held: u32) -> Vec<f32> {
        let mut upto = self.clone();
        upto.advance(now, held);
        upto.slots.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_values_have_exact_buckets_and_larger_ones_eight_per_power_of_two() {
        for v in 0..16 {
            assert_eq!((bucket_of(v), bucket_top(v as usize)), (v as usize, v));
        }
        assert_eq!(bucket_of(16), 16);
        assert_eq!(bucket_of(17), 16);
        assert_eq!(bucket_top(16), 17);
        assert_eq!(bucket_of(MAX_VALUE), BUCKETS - 1);
        assert_eq!(bucket_top(BUCKETS - 1), MAX_VALUE);
    }

    #[test]
    fn every_bucket_top_falls_in_its_bucket_and_the_next_value_does_not() {
        for b in 0..BUCKETS - 1 {
            assert_eq!(bucket_of(bucket_top(b)), b);
            assert_eq!(bucket_of(bucket_top(b) + 1), b + 1);
        }
    }

    #[test]
    fn an_empty_histogram_has_no_percentiles_and_takes_no_buckets() {
        let h = Histogram::default();
        assert_eq!(h.percentile(0.5), None);
        assert!(h.counts.is_empty());
    }

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut h = Histogram::default();
        (0..99).for_each(|_| h.record(3));
        h.record(1000);
        assert_eq!(
            (h.percentile(0.5), h.percentile(0.99), h.percentile(1.0)),
            (Some(3), Some(3), Some(1000))
        );
        assert_eq!((h.count(), h.sum()), (100, 99 * 3 + 1000));
    }

    #[test]
    fn a_slot_holds_the_mean_of_what_was_held_in_it() {
        let mut u = Utilization::new(10, 5);
        u.advance(4, 0);
        u.advance(10, 5); // 0 for 4, then 5 for 6: mean 3
        assert_eq!(u.samples(10, 2), vec![3.0]);
        assert_eq!(u.samples(39, 2), vec![3.0, 2.0, 2.0]);
        assert_eq!(u.samples(40, 2), vec![3.0, 2.0, 2.0, 2.0]);
    }

    #[test]
    fn the_ring_keeps_only_the_last_slots() {
        let mut u = Utilization::new(1, 3);
        u.advance(1_000_000, 7);
        assert_eq!(u.samples(1_000_000, 7), vec![7.0; 3]);
    }
}
