//! Adaptive spinning before the event loop sleeps.
//!
//! A broker that sleeps between every two messages pays one context switch
//! per message, on top of the client's own. When tokens change hands faster
//! than a wake-up costs (a token passed around a ring, a build of many tiny
//! jobs), the next message is usually due within microseconds, so the loop
//! first looks for it without sleeping, as an adaptive mutex spins on an
//! owner about to let go.
//!
//! Whether to spin is predicted the way a CPU predicts a branch, with a
//! two-bit saturating counter: a wait that ended within the window counts
//! up, a longer one counts down, and the loop spins while the count is in
//! its upper half. Short gaps must therefore come in a row before the loop
//! spins, so a build whose tokens change hands every few milliseconds, with
//! now and then two releases close together, does not spin; and a fast ring
//! keeps spinning through one late wake-up on a busy machine. Each wasted
//! spin costs at most the window.
//!
//! On one CPU nobody else can run while the broker spins, so it never does.

use std::time::Duration;

/// The counter's top; the loop spins from `SPIN_FROM` up.
const CONFIDENT: u8 = 3;
const SPIN_FROM: u8 = 2;

/// Whether the next wait starts with a spin, learnt from the waits before.
#[derive(Debug, Clone)]
pub struct SpinPolicy {
    window: Duration,
    /// 0..=CONFIDENT: how strongly recent waits say the next is short.
    confidence: u8,
}

impl SpinPolicy {
    /// `window`: the longest spin; zero never spins.
    pub fn new(window: Duration) -> Self {
        SpinPolicy { window, confidence: 0 }
    }

    /// A window of `us` microseconds where more than one CPU can run the
    /// clients meanwhile; none on a single CPU.
    pub fn for_this_machine(us: u64) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new(if cpus > 1 { Duration::from_micros(us) } else { Duration::ZERO })
    }

    /// How long to look for events before sleeping: the window while
    /// recent waits have mostly ended within it, else nothing.
    pub fn spin_for(&self) -> Duration {
        if self.confidence >= SPIN_FROM {
            self.window
        } else {
            Duration::ZERO
        }
    }

    /// How long the wait that just ended took, spin included.
    pub fn waited(&mut self, waited: Duration) {
        self.confidence = if !self.window.is_zero() && waited <= self.window {
            (self.confidence + 1).min(CONFIDENT)
        } else {
            self.confidence.saturating_sub(1)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_micros(50);
    const SHORT: Duration = Duration::from_micros(10);
    const LONG: Duration = Duration::from_millis(3);

    fn after(waits: &[Duration]) -> Duration {
        let mut policy = SpinPolicy::new(WINDOW);
        for &w in waits {
            policy.waited(w);
        }
        policy.spin_for()
    }

    #[test]
    fn spins_only_after_two_short_waits_in_a_row() {
        assert_eq!(after(&[]), Duration::ZERO, "nothing learnt yet");
        assert_eq!(after(&[SHORT]), Duration::ZERO);
        assert_eq!(after(&[SHORT, SHORT]), WINDOW);
        assert_eq!(after(&[WINDOW, WINDOW]), WINDOW, "a wait of exactly the window would have been caught");
    }

    #[test]
    fn short_gaps_now_and_then_never_start_a_spin() {
        let alternating: Vec<Duration> = (0..20).map(|i| if i % 2 == 0 { SHORT } else { LONG }).collect();
        let mut policy = SpinPolicy::new(WINDOW);
        for w in alternating {
            policy.waited(w);
            assert_eq!(policy.spin_for(), Duration::ZERO);
        }
    }

    #[test]
    fn a_fast_ring_spins_through_one_late_wake_up_but_not_two() {
        assert_eq!(after(&[SHORT, SHORT, SHORT, LONG]), WINDOW);
        assert_eq!(after(&[SHORT, SHORT, SHORT, LONG, LONG]), Duration::ZERO);
        assert_eq!(after(&[SHORT, SHORT, SHORT, LONG, LONG, SHORT]), WINDOW, "back as soon as gaps shrink");
    }

    #[test]
    fn a_zero_window_never_spins() {
        let mut policy = SpinPolicy::new(Duration::ZERO);
        for _ in 0..4 {
            policy.waited(Duration::ZERO);
        }
        assert_eq!(policy.spin_for(), Duration::ZERO);
    }
}
