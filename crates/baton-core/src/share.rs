//! Weighted fair shares of token-time between builds.
//!
//! A build is a group of clients (a `baton run` and everything under it, or
//! a native client on its own) with a weight. Each build has a virtual time:
//! the token-time it has used, divided by its weight. When tokens free up,
//! the waiting build with the least virtual time is served first, so over a
//! long window every build that keeps asking gets token-time in proportion
//! to its weight (start-time fair queueing, as in Goyal, Vin and Cheng,
//! "Start-time Fair Queueing", SIGCOMM 1996; Linux's CFS does the same with
//! its `min_vruntime`).
//!
//! A build that was idle (holding and waiting for nothing) starts again at
//! the least virtual time of the builds that are active, not below it: time
//! spent idle is not saved up as credit to crowd others out later.
//!
//! Time is whatever the caller passes to [`Shares::advance`] (the broker:
//! nanoseconds of a monotonic clock). Without it every virtual time stays
//! 0, and ties go to the oldest request: plain first come, first served.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Identifies a build. Chosen by the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BuildId(pub u64);

/// The largest weight a build may have. Far above any useful ratio; it
/// keeps virtual time arithmetic far from overflow.
pub const MAX_WEIGHT: u32 = 1000;

/// Virtual time is token-time × this / weight, so that integer division by
/// a weight keeps enough precision.
const SCALE: u128 = 1 << 20;

/// One build's books.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Build {
    pub weight: u32,
    /// Token-time used / weight, × SCALE.
    pub vtime: u128,
    /// Tokens its clients hold now.
    pub held: u32,
    /// Tokens its clients wait for now.
    pub waiting: u32,
    /// Clients that belong to it.
    pub members: u32,
    /// Tokens granted to it since it began.
    pub granted: u64,
    /// Token-time used, in the caller's time unit × tokens.
    pub token_time: u128,
    /// The sequence number of its oldest waiting request, if any.
    oldest: Option<u64>,
}

impl Build {
    pub fn is_active(&self) -> bool {
        self.held > 0 || self.waiting > 0
    }
}

/// Every build's books and the clock they were last brought up to.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Shares {
    pub builds: BTreeMap<BuildId, Build>,
    /// The builds with waiting requests, in the order they are served:
    /// least virtual time first, then oldest request. Kept in step with
    /// every change, so the next build is found without a scan (a broker
    /// may have thousands of single-client builds waiting).
    ready: BTreeSet<(u128, u64, BuildId)>,
    /// The builds holding tokens: the only ones time charges. At most as
    /// many as the limit, however many builds there are.
    #[serde(skip)]
    holding: BTreeSet<BuildId>,
    /// The active builds (holding or waiting), least virtual time first:
    /// where a waking build starts.
    #[serde(skip)]
    active: BTreeSet<(u128, BuildId)>,
    now: u64,
    next_id: u64,
}

impl Shares {
    /// A new build of weight 1 with no members yet.
    pub fn create(&mut self) -> BuildId {
        self.next_id += 1;
        let id = BuildId(self.next_id);
        self.builds.insert(
            id,
            Build {
                weight: 1,
                ..Build::default()
            },
        );
        id
    }

    pub fn get(&self, id: BuildId) -> &Build {
        &self.builds[&id]
    }

    pub fn get_mut(&mut self, id: BuildId) -> &mut Build {
        self.builds
            .get_mut(&id)
            .expect("every client's build exists")
    }

    /// Changes what a build holds or waits for, or its virtual time or
    /// oldest request, keeping the indexes in step: every change to those
    /// goes through here ([`Shares::check`] says they agree).
    pub fn update<R>(&mut self, id: BuildId, change: impl FnOnce(&mut Build) -> R) -> R {
        let b = self
            .builds
            .get_mut(&id)
            .expect("every client's build exists");
        unindex(&mut self.ready, &mut self.holding, &mut self.active, id, b);
        let out = change(b);
        index(&mut self.ready, &mut self.holding, &mut self.active, id, b);
        out
    }

    /// Rebuilds the indexes a snapshot does not carry, from the books.
    pub fn reindex(&mut self) {
        (self.holding, self.active) = self.indexes_from_books();
    }

    /// The builds holding tokens, and the active ones by virtual time, as
    /// the books say.
    fn indexes_from_books(&self) -> (BTreeSet<BuildId>, BTreeSet<(u128, BuildId)>) {
        let holding = self
            .builds
            .iter()
            .filter(|(_, b)| b.held > 0)
            .map(|(&id, _)| id)
            .collect();
        let active = self
            .builds
            .iter()
            .filter(|(_, b)| b.is_active())
            .map(|(&id, b)| (b.vtime, id))
            .collect();
        (holding, active)
    }

    /// Charges every build for the tokens it held since the last call.
    /// A clock that goes backwards charges nothing.
    /// Only the builds holding tokens are walked: no more than the
    /// limit, however many builds wait or sit idle.
    pub fn advance(&mut self, now: u64) {
        let dt = u128::from(now.saturating_sub(self.now));
        self.now = self.now.max(now);
        if dt == 0 {
            return;
        }
        let holding: Vec<BuildId> = self.holding.iter().copied().collect();
        for id in holding {
            self.update(id, |b| {
                let used = u128::from(b.held) * dt;
                b.token_time += used;
                b.vtime += used * SCALE / u128::from(b.weight);
            });
        }
    }

    /// The build's oldest waiting request is now `oldest` (None: it has
    /// none left).
    pub fn set_oldest(&mut self, id: BuildId, oldest: Option<u64>) {
        self.update(id, |b| b.oldest = oldest);
    }

    /// The build's oldest waiting request, if any.
    pub fn oldest(&self, id: BuildId) -> Option<u64> {
        self.get(id).oldest
    }

    /// Called before a build's first hold or wait after being idle: it
    /// starts no further behind than the least active build.
    pub fn wake(&mut self, id: BuildId) {
        if self.get(id).is_active() {
            return;
        }
        // An idle build is not in `active`: the first there is another's.
        if let Some(&(floor, _)) = self.active.first() {
            self.update(id, |b| b.vtime = b.vtime.max(floor));
        }
    }

    /// Whose request goes first: the waiting build with the least virtual
    /// time, a tie going to the oldest request; and that request's
    /// sequence number.
    pub fn pick(&self) -> Option<(BuildId, u64)> {
        self.ready.first().map(|&(_, seq, id)| (id, seq))
    }

    /// The order of service agrees with every build's books, and build ids
    /// are below the next one (a restored snapshot must keep both).
    pub fn check(&self) -> Result<(), &'static str> {
        let expected: BTreeSet<_> = self
            .builds
            .iter()
            .filter_map(|(&id, b)| b.oldest.map(|seq| (b.vtime, seq, id)))
            .collect();
        if expected != self.ready {
            return Err("the order of service disagrees with the builds' books");
        }
        if self.indexes_from_books() != (self.holding.clone(), self.active.clone()) {
            return Err("the builds holding or active disagree with the builds' books");
        }
        if self.builds.iter().any(|(id, b)| {
            id.0 > self.next_id || !(1..=MAX_WEIGHT).contains(&b.weight) || b.members == 0
        }) {
            return Err("a build has an id not yet given, a weight out of range, or no members");
        }
        Ok(())
    }

    /// A member left; a build without members is forgotten.
    pub fn leave(&mut self, id: BuildId) {
        let b = self.get_mut(id);
        b.members -= 1;
        if b.members == 0 {
            debug_assert!(
                b.oldest.is_none() && !b.is_active(),
                "a build without members holds and waits for nothing"
            );
            self.builds.remove(&id);
        }
    }
}

/// Takes a build out of the indexes, before a change to its books.
fn unindex(
    ready: &mut BTreeSet<(u128, u64, BuildId)>,
    holding: &mut BTreeSet<BuildId>,
    active: &mut BTreeSet<(u128, BuildId)>,
    id: BuildId,
    b: &Build,
) {
    if let Some(seq) = b.oldest {
        ready.remove(&(b.vtime, seq, id));
    }
    holding.remove(&id);
    active.remove(&(b.vtime, id));
}

/// Puts a build back into the indexes its books say, after a change.
fn index(
    ready: &mut BTreeSet<(u128, u64, BuildId)>,
    holding: &mut BTreeSet<BuildId>,
    active: &mut BTreeSet<(u128, BuildId)>,
    id: BuildId,
    b: &Build,
) {
    if let Some(seq) = b.oldest {
        ready.insert((b.vtime, seq, id));
    }
    if b.held > 0 {
        holding.insert(id);
    }
    if b.is_active() {
        active.insert((b.vtime, id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shares with builds of these (held, vtime), one member each.
    fn shares(builds: &[(u32, u128)]) -> (Shares, Vec<BuildId>) {
        let mut s = Shares::default();
        let ids = builds
            .iter()
            .map(|&(held, vtime)| {
                let id = s.create();
                s.update(id, |b| (b.held, b.vtime, b.members) = (held, vtime, 1));
                id
            })
            .collect();
        (s, ids)
    }

    #[test]
    fn time_is_charged_as_tokens_held_times_time_over_weight() {
        let (mut s, ids) = shares(&[(3, 0), (3, 0)]);
        s.get_mut(ids[1]).weight = 2;
        s.advance(10);
        assert_eq!(s.get(ids[0]).token_time, 30);
        assert_eq!(s.get(ids[0]).vtime, 30 * SCALE);
        assert_eq!(s.get(ids[1]).token_time, 30);
        assert_eq!(
            s.get(ids[1]).vtime,
            15 * SCALE,
            "twice the weight, half the time"
        );
        s.advance(4);
        assert_eq!(
            s.get(ids[0]).token_time,
            30,
            "a clock going back charges nothing"
        );
    }

    #[test]
    fn a_waking_build_starts_at_the_least_active_build_not_an_idle_one() {
        let (mut s, ids) = shares(&[(1, 100), (0, 10), (0, 0)]);
        s.wake(ids[2]);
        assert_eq!(s.get(ids[2]).vtime, 100, "the idle build's 10 is no floor");
        assert_eq!(s.get(ids[1]).vtime, 10, "only the waking build moves");
    }

    /// A build that waits and holds nothing is active: its virtual time
    /// is a floor for a waking build, and a second request of its own
    /// moves it nowhere.
    #[test]
    fn a_build_that_only_waits_is_active() {
        let (mut s, ids) = shares(&[(1, 100), (0, 10), (0, 0)]);
        s.update(ids[1], |b| b.waiting = 1);
        s.wake(ids[2]);
        assert_eq!(
            s.get(ids[2]).vtime,
            10,
            "the waiting build's 10 is the floor"
        );
        s.update(ids[2], |b| b.vtime = 50);
        s.wake(ids[1]);
        assert_eq!(
            s.get(ids[1]).vtime,
            10,
            "a waiting build is not woken again"
        );
    }

    #[test]
    fn books_out_of_range_are_refused() {
        let (s, ids) = shares(&[(1, 0)]);
        assert_eq!(s.check(), Ok(()));
        for spoil in [
            |b: &mut Build| b.weight = 0,
            |b: &mut Build| b.weight = MAX_WEIGHT + 1,
            |b: &mut Build| b.members = 0,
        ] {
            let mut spoilt = s.clone();
            spoil(spoilt.get_mut(ids[0]));
            assert!(spoilt.check().is_err(), "{:?}", spoilt.get(ids[0]));
        }
        let mut ahead = s.clone();
        ahead.next_id = 0;
        assert!(ahead.check().is_err(), "an id not yet given");
        for spoil in [
            |b: &mut Build| b.held = 0,
            |b: &mut Build| b.vtime = 9,
            |b: &mut Build| (b.held, b.waiting) = (0, 1),
        ] {
            let mut unindexed = s.clone();
            spoil(unindexed.get_mut(ids[0]));
            assert!(
                unindexed.check().is_err(),
                "changed past `update`, the indexes disagree: {:?}",
                unindexed.get(ids[0])
            );
        }
        let mut disordered = s.clone();
        disordered.get_mut(ids[0]).oldest = Some(7);
        assert!(
            disordered.check().is_err(),
            "a waiter the order does not know"
        );
    }
}
