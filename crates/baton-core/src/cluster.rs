//! The cluster link's decisions: how many cluster tokens a broker holds,
//! when it gives spares back, and how many local grants they allow.
//!
//! A broker in a cluster pool (docs/cluster.md) grants a local token only
//! with a cluster token under it. The link takes cluster tokens one at a
//! time while local demand exceeds what it holds, and gives spares back when
//! another broker waits or once they have lingered. The pool enforces the
//! result as an admission cap. The broker measures, the link talks to etcd;
//! nothing here does either.

use std::time::Duration;

/// What `baton serve --etcd` was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// etcd endpoints, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// The pool's name: its keys live under `/baton/NAME/`.
    pub pool: String,
    /// The pool's limit across every broker.
    pub jobs: u32,
    /// The lease's time to live: how long after a broker dies its tokens
    /// come back.
    pub ttl: Duration,
    /// How long spare tokens are kept for local builds that ask again.
    pub linger: Duration,
    /// Benchmark control: waiting brokers skip the queue and all watch
    /// every token slot, the herd the queue avoids (`baton bench cluster`).
    pub watch_all: bool,
}

/// Checks a pool's name: it becomes part of etcd keys (`/baton/NAME/`).
///
/// # Errors
/// The name is empty, too long, or has other than letters, digits, `-`,
/// `_` and `.`.
pub fn check_pool_name(name: &str) -> Result<(), String> {
    let fits = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 100 || !name.chars().all(fits) {
        return Err(format!(
            "cluster pool name {name:?}: use 1 to 100 letters, digits, '-', '_' or '.'"
        ));
    }
    Ok(())
}

/// The lease's time to live unless told otherwise.
pub const DEFAULT_TTL: Duration = Duration::from_secs(5);
/// How long spares linger unless told otherwise.
pub const DEFAULT_LINGER: Duration = Duration::from_millis(200);

/// What the local pool needs, as the broker sees it now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Local {
    /// Tokens held by local clients.
    pub held: u32,
    /// Tokens the local queue waits for.
    pub waiting: u32,
    /// The local pool's limit (`--jobs`).
    pub limit: u32,
}

impl Local {
    /// Cluster tokens the local pool needs: one under every token held,
    /// and one for every token waited for, up to what the local limit
    /// could ever grant at once.
    pub fn wanted(&self) -> u32 {
        self.held
            .max(self.held.saturating_add(self.waiting).min(self.limit))
    }
}

/// The link's state as it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Situation {
    /// What the local pool needs.
    pub local: Local,
    /// Cluster tokens this broker holds.
    pub held: u32,
    /// Whether another broker waits for a cluster token.
    pub others_waiting: bool,
    /// How long this broker has held more than it needs (zero if not).
    pub spare_for: Duration,
    /// How long spares are kept for local builds that ask again.
    pub linger: Duration,
}

/// What the link does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Take one more cluster token (queue for it).
    Take,
    /// Give this many cluster tokens back.
    Give(u32),
    /// Keep the spares; decide again after this long.
    Linger(Duration),
    /// Holds what it needs: wait for the local demand to change.
    Hold,
}

/// The next step: take while short, give spares back when others wait or
/// the linger is over, and never give back a token the local pool uses or
/// waits for.
pub fn step(s: Situation) -> Step {
    let wanted = s.local.wanted();
    if wanted > s.held {
        return Step::Take;
    }
    let spare = s.held - wanted;
    if spare == 0 {
        Step::Hold
    } else if s.others_waiting || s.spare_for >= s.linger {
        Step::Give(spare)
    } else {
        Step::Linger(s.linger - s.spare_for)
    }
}

/// Whether the broker's hold on its cluster tokens is sure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contact {
    /// etcd answers: the tokens are ours.
    Reachable,
    /// etcd does not answer, but the lease cannot have expired yet: the
    /// tokens are still ours, but no new one can be taken.
    Unsure,
    /// The lease may have expired: the tokens may be someone else's.
    Lost,
}

impl Contact {
    /// As `baton status` shows it.
    pub fn name(self) -> &'static str {
        match self {
            Contact::Reachable => "reachable",
            Contact::Unsure => "unreachable",
            Contact::Lost => "lost",
        }
    }

    /// The contact [`Contact::name`] names; anything else is `Lost`.
    pub fn from_name(name: &str) -> Contact {
        [Contact::Reachable, Contact::Unsure]
            .into_iter()
            .find(|c| c.name() == name)
            .unwrap_or(Contact::Lost)
    }
}

/// How many local tokens may be held for new grants to happen: the
/// cluster tokens held while they are surely ours, none once they may not
/// be. (A cap never takes back what is held: running jobs go on.)
pub fn admission_cap(held: u32, contact: Contact) -> u32 {
    match contact {
        Contact::Reachable | Contact::Unsure => held,
        Contact::Lost => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn situation(held_local: u32, waiting: u32, held: u32) -> Situation {
        Situation {
            local: Local {
                held: held_local,
                waiting,
                limit: 4,
            },
            held,
            others_waiting: false,
            spare_for: Duration::ZERO,
            linger: Duration::from_millis(200),
        }
    }

    #[test]
    fn pool_names_stay_inside_their_prefix() {
        assert!(check_pool_name("licences-2.x_y").is_ok());
        assert!(check_pool_name(&"x".repeat(100)).is_ok(), "100 is allowed");
        for bad in ["", "a/b", "a b", "é", &"x".repeat(101)] {
            assert!(check_pool_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_waiter_at_the_cap_takes_one() {
        assert_eq!(step(situation(2, 1, 2)), Step::Take);
    }

    #[test]
    fn wanting_stops_at_the_local_limit() {
        assert_eq!(step(situation(3, 5, 4)), Step::Hold);
    }

    #[test]
    fn a_spare_lingers_then_goes() {
        let s = situation(1, 0, 2);
        assert_eq!(step(s), Step::Linger(Duration::from_millis(200)));
        let lingered = Situation {
            spare_for: Duration::from_millis(50),
            ..s
        };
        assert_eq!(step(lingered), Step::Linger(Duration::from_millis(150)));
        assert_eq!(
            step(Situation {
                spare_for: Duration::from_millis(200),
                ..s
            }),
            Step::Give(1)
        );
        assert_eq!(
            step(Situation {
                others_waiting: true,
                ..s
            }),
            Step::Give(1)
        );
    }

    #[test]
    fn after_a_lost_lease_running_jobs_are_covered_first() {
        // Local jobs hold 3, the new lease holds nothing: take 3 before any grant.
        assert_eq!(step(situation(3, 1, 0)), Step::Take);
        assert_eq!(admission_cap(0, Contact::Reachable), 0);
    }

    #[test]
    fn contacts_are_named_as_status_shows_them_and_read_back() {
        let names: Vec<_> = [Contact::Reachable, Contact::Unsure, Contact::Lost]
            .into_iter()
            .map(|c| (c, c.name()))
            .collect();
        assert_eq!(
            names,
            [
                (Contact::Reachable, "reachable"),
                (Contact::Unsure, "unreachable"),
                (Contact::Lost, "lost")
            ]
        );
        for (contact, name) in names {
            assert_eq!(Contact::from_name(name), contact);
        }
        assert_eq!(Contact::from_name("anything else"), Contact::Lost);
    }

    #[test]
    fn a_lost_lease_admits_nothing() {
        assert_eq!(admission_cap(3, Contact::Unsure), 3);
        assert_eq!(admission_cap(3, Contact::Lost), 0);
    }
}
