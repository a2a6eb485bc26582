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
//! A spin is only worth it while a CPU it takes would otherwise sit idle,
//! with another left for the client that sends the next message. Each held
//! token is a job that wants a CPU, and so is each client just replied to;
//! the loop spins only while those fit beside it on the machine's CPUs. A
//! build that holds as many tokens as there are CPUs therefore never spins
//! (its jobs need them), a ring passing one token on two CPUs does, and a
//! single CPU never does. When a spin is preempted anyway, some task wanted
//! its CPU (other clients running, a busy machine): the loop then sits out
//! the next waits without spinning, twice as many after each preempted
//! spin (up to `MAX_SIT_OUT`), and half as many again after each spin that
//! paid off undisturbed, as Ethernet backs off after a collision.

use std::time::Duration;

/// The counter's top; the loop spins from `SPIN_FROM` up.
const CONFIDENT: u8 = 3;
const SPIN_FROM: u8 = 2;
/// The most waits sat out after a preempted spin.
const MAX_SIT_OUT: u32 = 1024;

/// Whether the next wait starts with a spin, learnt from the waits before.
#[derive(Debug, Clone)]
pub struct SpinPolicy {
    window: Duration,
    cpus: usize,
    /// 0..=CONFIDENT: how strongly recent waits say the next is short.
    confidence: u8,
    /// Waits left to sit out after a preempted spin.
    sitting_out: u32,
    /// How many the next preempted spin makes it sit out.
    backoff: u32,
}

impl SpinPolicy {
    /// `window`: the longest spin; zero never spins. `cpus`: how many the
    /// broker and its clients share.
    pub fn new(window: Duration, cpus: usize) -> Self {
        SpinPolicy {
            window,
            cpus,
            confidence: 0,
            sitting_out: 0,
            backoff: 1,
        }
    }

    /// A window of `us` microseconds on the CPUs this process may use.
    pub fn for_this_machine(us: u64) -> Self {
        Self::new(
            Duration::from_micros(us),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        )
    }

    /// How long to look for events before sleeping: the window while
    /// recent waits have mostly ended within it and the broker fits beside
    /// the `busy` clients that want a CPU (jobs holding tokens, clients
    /// just replied to) and the next sender, else nothing. `busy` is asked
    /// for only when the waits say spin.
    pub fn spin_for(&self, busy: impl FnOnce() -> usize) -> Duration {
        if self.window.is_zero() || self.confidence < SPIN_FROM || self.sitting_out > 0 {
            return Duration::ZERO;
        }
        // At least one client must run to send the next message.
        if busy().max(1) < self.cpus {
            self.window
        } else {
            Duration::ZERO
        }
    }

    /// How long the wait that just ended took, spin included, and whether
    /// the loop spun and, if so, was preempted meanwhile.
    pub fn waited(&mut self, waited: Duration, spun: bool, preempted: bool) {
        let short = !self.window.is_zero() && waited <= self.window;
        self.sitting_out = self.sitting_out.saturating_sub(1);
        if preempted {
            self.sitting_out = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_SIT_OUT);
        } else if spun && short {
            self.backoff = (self.backoff / 2).max(1);
        }
        self.confidence = if short {
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

    const CPUS: usize = 2;

    fn after(waits: &[Duration]) -> Duration {
        let mut policy = SpinPolicy::new(WINDOW, CPUS);
        for &w in waits {
            policy.waited(w, false, false);
        }
        policy.spin_for(|| 1)
    }

    #[test]
    fn spins_only_after_two_short_waits_in_a_row() {
        assert_eq!(after(&[]), Duration::ZERO, "nothing learnt yet");
        assert_eq!(after(&[SHORT]), Duration::ZERO);
        assert_eq!(after(&[SHORT, SHORT]), WINDOW);
        assert_eq!(
            after(&[WINDOW, WINDOW]),
            WINDOW,
            "a wait of exactly the window would have been caught"
        );
    }

    #[test]
    fn short_gaps_now_and_then_never_start_a_spin() {
        let alternating: Vec<Duration> = (0..20)
            .map(|i| if i % 2 == 0 { SHORT } else { LONG })
            .collect();
        let mut policy = SpinPolicy::new(WINDOW, CPUS);
        for w in alternating {
            policy.waited(w, false, false);
            assert_eq!(policy.spin_for(|| 1), Duration::ZERO);
        }
    }

    #[test]
    fn a_fast_ring_spins_through_one_late_wake_up_but_not_two() {
        assert_eq!(after(&[SHORT, SHORT, SHORT, LONG]), WINDOW);
        assert_eq!(after(&[SHORT, SHORT, SHORT, LONG, LONG]), Duration::ZERO);
        assert_eq!(
            after(&[SHORT, SHORT, SHORT, LONG, LONG, SHORT]),
            WINDOW,
            "back as soon as gaps shrink"
        );
    }

    #[test]
    fn a_zero_window_never_spins() {
        let mut policy = SpinPolicy::new(Duration::ZERO, CPUS);
        for _ in 0..4 {
            policy.waited(Duration::ZERO, false, false);
        }
        assert_eq!(policy.spin_for(|| 0), Duration::ZERO);
    }

    #[test]
    fn no_spin_while_busy_clients_want_every_cpu() {
        let mut policy = SpinPolicy::new(WINDOW, CPUS);
        (0..3).for_each(|_| policy.waited(SHORT, false, false));
        assert_eq!(policy.spin_for(|| 0), WINDOW);
        assert_eq!(
            policy.spin_for(|| 1),
            WINDOW,
            "one busy client, one spare CPU"
        );
        assert_eq!(policy.spin_for(|| 2), Duration::ZERO);
        assert_eq!(policy.spin_for(|| 8), Duration::ZERO);
    }

    #[test]
    fn one_cpu_never_spins() {
        let mut policy = SpinPolicy::new(WINDOW, 1);
        (0..3).for_each(|_| policy.waited(SHORT, false, false));
        assert_eq!(policy.spin_for(|| 0), Duration::ZERO);
    }

    #[test]
    fn each_preempted_spin_sits_out_twice_as_many_waits() {
        let mut policy = SpinPolicy::new(WINDOW, CPUS);
        (0..3).for_each(|_| policy.waited(SHORT, false, false));
        let mut sat_out = Vec::new();
        for _ in 0..4 {
            policy.waited(SHORT, true, true);
            let mut waits = 0;
            while policy.spin_for(|| 1).is_zero() {
                policy.waited(SHORT, false, false);
                waits += 1;
            }
            sat_out.push(waits);
        }
        assert_eq!(sat_out, [1, 2, 4, 8]);
        // Undisturbed spins that catch their message earn it back.
        (0..3).for_each(|_| policy.waited(SHORT, true, false));
        policy.waited(SHORT, true, true);
        assert!(policy.spin_for(|| 1).is_zero());
        policy.waited(SHORT, false, false);
        policy.waited(SHORT, false, false);
        assert_eq!(
            policy.spin_for(|| 1),
            WINDOW,
            "backoff 16 halved three times is 2"
        );
    }

    /// After a spin that paid off undisturbed, the next preempted one sits
    /// out half as many waits as the one before it, not one.
    #[test]
    fn a_spin_that_paid_off_halves_the_sit_out() {
        let mut p = SpinPolicy::new(WINDOW, CPUS);
        p.waited(SHORT, false, false);
        p.waited(SHORT, false, false);
        for _ in 0..4 {
            p.waited(SHORT, true, true);
        }
        // Sitting out 8 waits, backing off 16; a spin pays off: back to 8.
        p.waited(SHORT, true, false);
        for _ in 0..7 {
            p.waited(SHORT, false, false);
        }
        assert_eq!(p.spin_for(|| 1), WINDOW);
        p.waited(SHORT, true, true);
        for _ in 0..7 {
            p.waited(SHORT, false, false);
            assert_eq!(p.spin_for(|| 1), Duration::ZERO, "sitting out 8");
        }
        p.waited(SHORT, false, false);
        assert_eq!(p.spin_for(|| 1), WINDOW);
    }
}
