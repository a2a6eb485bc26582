//! The wait-time histogram and the utilization ring against the plain
//! computations they stand for: a sorted list of every value, and the
//! integral of tokens held over time.

use baton_core::metrics::{Histogram, Utilization};
use proptest::prelude::*;

/// The nearest-rank percentile of the values themselves.
fn exact(sorted: &[u64], q: f64) -> u64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).max(1);
    sorted[rank - 1]
}

fn values() -> impl Strategy<Value = Vec<u64>> {
    // Short waits and long ones, as a broker sees them (microseconds).
    prop::collection::vec(prop_oneof![0u64..50, 0u64..5_000_000, any::<u64>()], 1..300)
}

proptest! {
    #[test]
    fn a_percentile_is_the_true_one_or_at_most_an_eighth_above_it(values in values(), q in 0.0f64..=1.0) {
        let mut h = Histogram::default();
        values.iter().for_each(|&v| h.record(v));
        let mut sorted: Vec<u64> = values.iter().map(|&v| v.min((1 << 40) - 1)).collect();
        sorted.sort_unstable();
        let truth = exact(&sorted, q);
        let got = h.percentile(q).unwrap();
        prop_assert!(got >= truth, "p{q}: {got} below the true {truth}");
        prop_assert!(got <= truth + truth / 8, "p{q}: {got} more than 1/8 above the true {truth}");
        prop_assert_eq!(h.percentile(1.0), sorted.last().copied());
        prop_assert_eq!(h.count(), values.len() as u64);
    }

    #[test]
    fn percentiles_never_decrease_with_the_fraction(values in values(), a in 0.0f64..=1.0, b in 0.0f64..=1.0) {
        let mut h = Histogram::default();
        values.iter().for_each(|&v| h.record(v));
        let (lo, hi) = (a.min(b), a.max(b));
        prop_assert!(h.percentile(lo) <= h.percentile(hi));
    }

    /// Levels held for random stretches: the slots' means add up to the
    /// integral of what was held, and each lies between the least and the
    /// most held in its slot.
    #[test]
    fn the_slots_add_up_to_the_tokens_held_over_time(steps in prop::collection::vec((1u64..40, 0u32..64), 1..200), width in 1u64..20) {
        let capacity = 10_000;
        let mut u = Utilization::new(width, capacity);
        let (mut now, mut held, mut integral) = (0u64, 0u32, 0u128);
        let mut levels = Vec::new(); // (from, to, held)
        for &(dt, next) in &steps {
            u.advance(now + dt, held);
            levels.push((now, now + dt, held));
            integral += u128::from(held) * u128::from(dt);
            now += dt;
            held = next;
        }
        let samples = u.samples(now, held);
        prop_assert_eq!(samples.len() as u64, now / width);
        let covered: u128 = levels.iter().map(|&(from, to, h)| u128::from(h) * u128::from(to.min(now / width * width).saturating_sub(from))).sum();
        let total: f64 = samples.iter().map(|&m| f64::from(m) * width as f64).sum();
        prop_assert!((total - covered as f64).abs() <= 1e-3 * (covered as f64).max(1.0), "slots hold {total}, levels {covered} (of {integral})");
        for (i, &mean) in samples.iter().enumerate() {
            let (start, end) = (i as u64 * width, (i as u64 + 1) * width);
            let inside: Vec<u32> = levels.iter().filter(|&&(from, to, _)| from < end && to > start).map(|&(_, _, h)| h).collect();
            let (lo, hi) = (*inside.iter().min().unwrap() as f32, *inside.iter().max().unwrap() as f32);
            prop_assert!(mean >= lo - 1e-3 && mean <= hi + 1e-3, "slot {i}: mean {mean} outside [{lo}, {hi}]");
        }
    }

    #[test]
    fn the_ring_never_holds_more_than_its_capacity(steps in prop::collection::vec((0u64..10_000, 0u32..8), 1..100), capacity in 1usize..50) {
        let mut u = Utilization::new(7, capacity);
        let mut now = 0;
        for &(dt, held) in &steps {
            now += dt;
            u.advance(now, held);
            prop_assert!(u.samples(now, held).len() <= capacity);
        }
    }
}
