//! Fair shares between builds, on a simulated clock: every build keeps
//! every one of its clients asking for a token, holds each grant for a
//! random time and asks again at once. Over a long run, each build's
//! token-time must be within 10% of its weighted share; no request waits
//! forever; no token is created or lost at any step.

mod support;

use baton_core::{Acquired, ClientId, Grant, Pool};
use proptest::prelude::*;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// How long the simulated run lasts, in ticks; holds last 1 to 20 ticks.
const RUN: u64 = 50_000;

struct Sim {
    pool: Pool<()>,
    /// When each holder gives its token back.
    releases: BinaryHeap<Reverse<(u64, ClientId)>>,
    /// Since when each waiting client waits.
    waiting_since: HashMap<ClientId, u64>,
    holds: Vec<u64>,
    next_hold: usize,
    longest_wait: u64,
}

impl Sim {
    fn hold(&mut self, now: u64, client: ClientId) {
        let d = self.holds[self.next_hold % self.holds.len()];
        self.next_hold += 1;
        self.releases.push(Reverse((now + d, client)));
    }

    fn ask(&mut self, now: u64, client: ClientId) {
        match self.pool.acquire(client, 0, 1).unwrap() {
            Acquired::Granted => self.hold(now, client),
            Acquired::Queued => {
                self.waiting_since.insert(client, now);
            }
        }
    }

    fn granted(&mut self, now: u64, grants: Vec<Grant>) {
        for g in grants {
            let since = self
                .waiting_since
                .remove(&g.client)
                .expect("a grant answers a waiting request");
            self.longest_wait = self.longest_wait.max(now - since);
            self.hold(now, g.client);
        }
    }

    fn check(&self) {
        self.pool.assert_invariants();
        assert_eq!(
            self.pool.free() + self.pool.held(),
            self.pool.limit(),
            "a token was created or lost"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: support::cases(16), ..ProptestConfig::default() })]

    #[test]
    fn every_busy_build_gets_its_weighted_share(
        limit in 2..8u32,
        weights in prop::collection::vec(1..5u32, 2..5),
        holds in prop::collection::vec(1..21u64, 1..50),
    ) {
        let mut sim = Sim { pool: Pool::new(limit).unwrap(), releases: BinaryHeap::new(), waiting_since: HashMap::new(), holds, next_hold: 0, longest_wait: 0 };
        let mut builds = Vec::new();
        for &w in &weights {
            // Enough clients that the build could use the whole pool alone
            // and still have one asking: it demands continuously.
            let first = sim.pool.connect(());
            sim.pool.set_weight(first, w).unwrap();
            let clients: Vec<_> = std::iter::once(first).chain((0..limit).map(|_| sim.pool.connect_beside(first, ()))).collect();
            builds.push((sim.pool.build_of(first).unwrap(), w, clients));
        }
        for (_, _, clients) in &builds {
            for &c in clients {
                sim.ask(0, c);
                sim.check();
            }
        }
        while let Some(Reverse((now, client))) = sim.releases.pop() {
            if now > RUN {
                break;
            }
            let grants = sim.pool.advance(now);
            sim.granted(now, grants);
            let grants = sim.pool.release(client, 1).unwrap();
            sim.granted(now, grants);
            sim.check();
            sim.ask(now, client);
            sim.check();
        }
        sim.pool.advance(RUN);

        let total_weight: u32 = weights.iter().sum();
        let used: HashMap<_, _> = sim.pool.builds().map(|b| (b.id, b.token_time as f64)).collect();
        let all: f64 = used.values().sum();
        for (id, w, _) in &builds {
            let fair = f64::from(*w) / f64::from(total_weight);
            let got = used[id] / all;
            prop_assert!((got - fair).abs() <= 0.1 * fair, "build of weight {} got {:.3} of the token-time, its share is {:.3}", w, got, fair);
        }
        // Nobody starves: a wait lasts a bounded number of holds, far below the run.
        prop_assert!(sim.longest_wait < RUN / 20, "a request waited {} ticks", sim.longest_wait);
    }
}

/// Without a clock the pool stays first come, first served between builds.
#[test]
fn without_a_clock_the_oldest_request_goes_first() {
    let mut pool = Pool::new(1).unwrap();
    let [a, b, c] = [pool.connect(()), pool.connect(()), pool.connect(())];
    pool.set_weight(c, 5).unwrap();
    pool.acquire(a, 0, 1).unwrap();
    pool.acquire(b, 0, 1).unwrap();
    pool.acquire(c, 0, 1).unwrap();
    let grants = pool.release(a, 1).unwrap();
    assert_eq!(grants[0].client, b);
}

/// A build that used less token-time goes ahead of an older request.
#[test]
fn the_build_that_used_least_goes_first() {
    let mut pool = Pool::new(2).unwrap();
    let [hog, other] = [pool.connect(()), pool.connect(())];
    let hog_too = pool.connect_beside(hog, ());
    pool.acquire(hog, 0, 1).unwrap();
    pool.acquire(other, 0, 1).unwrap();
    pool.advance(100);
    pool.release(other, 1).unwrap();
    pool.acquire(hog_too, 0, 1).unwrap();
    pool.acquire(other, 0, 1).unwrap();
    pool.advance(200);
    // hog used 200 token-ticks, other 100: other goes first though it asked later.
    let grants = pool.release(hog, 1).unwrap();
    assert_eq!(
        grants,
        vec![Grant {
            client: other,
            tag: 0,
            tokens: 1
        }]
    );
    pool.assert_invariants();
}
