//! When a broker started on demand has had nobody to serve for long enough
//! to stop: the decision, fed with what the broker sees and when.

use std::time::{Duration, Instant};

/// Counts how long the pool has had no clients at all.
#[derive(Debug, Clone)]
pub struct IdleTimer {
    timeout: Duration,
    since: Option<Instant>,
}

impl IdleTimer {
    /// A timer that expires after `timeout` without a client.
    pub fn new(timeout: Duration) -> Self {
        IdleTimer {
            timeout,
            since: None,
        }
    }

    /// Notes that `clients` were connected at `now`; true once nobody has
    /// been for the whole timeout. Any client starts the count again.
    pub fn expired(&mut self, clients: usize, now: Instant) -> bool {
        if clients > 0 {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert(now);
        now.duration_since(since) >= self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn expires_after_the_timeout_without_clients() {
        let t0 = Instant::now();
        let mut timer = IdleTimer::new(MINUTE);
        assert!(!timer.expired(0, t0));
        assert!(!timer.expired(0, t0 + MINUTE / 2));
        assert!(timer.expired(0, t0 + MINUTE));
    }

    #[test]
    fn a_client_starts_the_count_again() {
        let t0 = Instant::now();
        let mut timer = IdleTimer::new(MINUTE);
        assert!(!timer.expired(0, t0));
        assert!(!timer.expired(1, t0 + MINUTE / 2));
        assert!(!timer.expired(0, t0 + MINUTE));
        assert!(!timer.expired(0, t0 + MINUTE + MINUTE / 2 - Duration::from_secs(1)));
        assert!(timer.expired(0, t0 + 2 * MINUTE));
    }

    #[test]
    fn never_expires_while_someone_is_connected() {
        let t0 = Instant::now();
        let mut timer = IdleTimer::new(Duration::ZERO);
        assert!(!timer.expired(3, t0 + MINUTE));
        assert!(timer.expired(0, t0 + MINUTE));
    }
}
