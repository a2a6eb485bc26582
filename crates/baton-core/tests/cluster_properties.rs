//! The cluster link's steps driving a real pool: clients acquire and
//! release at random, the link follows `cluster::step` until it holds, and
//! the pool's admission cap is what the link holds. At every step no local
//! token is held without a cluster token under it, the link never holds
//! more than the local pool could use, and a local request never waits
//! while the link holds what it needs.

mod support;

use baton_core::cluster::{admission_cap, step, Contact, Local, Situation, Step};
use baton_core::{Acquired, ClientId, Pool};
use proptest::prelude::*;
use std::time::Duration;

const LINGER: Duration = Duration::from_millis(200);

#[derive(Debug, Clone)]
enum Event {
    /// Client i asks for n tokens (if it does not wait already).
    Acquire(usize, u32),
    /// Client i gives back one token (if it holds one).
    Release(usize),
    /// Client i goes away, returning what it held and withdrawing its request.
    Disconnect(usize),
    /// Time passes: spares outlive their linger.
    Linger,
    /// Another broker starts or stops waiting.
    Others(bool),
}

fn event(clients: usize, limit: u32) -> impl Strategy<Value = Event> {
    prop_oneof![
        4 => (0..clients, 1..=limit).prop_map(|(c, n)| Event::Acquire(c, n)),
        4 => (0..clients).prop_map(Event::Release),
        1 => (0..clients).prop_map(Event::Disconnect),
        1 => Just(Event::Linger),
        1 => any::<bool>().prop_map(Event::Others),
    ]
}

struct Sim {
    pool: Pool<()>,
    clients: Vec<ClientId>,
    waiting: Vec<bool>,
    cluster: u32,
    others_waiting: bool,
    spare_for: Duration,
}

impl Sim {
    fn local(&self) -> Local {
        Local {
            held: self.pool.held(),
            waiting: self.pool.queue().map(|(_, _, n)| n).sum(),
            limit: self.pool.limit(),
        }
    }

    /// Runs the link until it holds, as the broker's link thread would
    /// (one etcd round trip per Take), applying the cap after each change.
    fn settle(&mut self) {
        for _ in 0..100 {
            let s = Situation {
                local: self.local(),
                held: self.cluster,
                others_waiting: self.others_waiting,
                spare_for: self.spare_for,
                linger: LINGER,
            };
            match step(s) {
                Step::Take => self.cluster += 1,
                Step::Give(n) => {
                    assert!(
                        self.cluster - n >= self.pool.held(),
                        "gave back a cluster token under a held local token"
                    );
                    self.cluster -= n;
                    self.spare_for = Duration::ZERO;
                }
                Step::Linger(_) | Step::Hold => return,
            }
            for grant in self
                .pool
                .set_admission_cap(Some(admission_cap(self.cluster, Contact::Reachable)))
            {
                let i = self
                    .clients
                    .iter()
                    .position(|&c| c == grant.client)
                    .unwrap();
                self.waiting[i] = false;
            }
        }
        panic!("the link did not settle");
    }

    fn apply(&mut self, e: &Event) {
        match *e {
            Event::Acquire(i, n) if !self.waiting[i] => {
                let n = n.min(self.pool.limit() - self.pool.held_by(self.clients[i]));
                if n > 0 && self.pool.acquire(self.clients[i], 0, n).unwrap() == Acquired::Queued {
                    self.waiting[i] = true;
                }
            }
            Event::Release(i) if self.pool.held_by(self.clients[i]) > 0 => {
                self.note_grants(|p, c| p.release(c, 1).unwrap(), i);
            }
            Event::Disconnect(i) => {
                self.note_grants(|p, c| p.disconnect(c).1, i);
                self.waiting[i] = false;
                self.clients[i] = self.pool.connect(());
            }
            Event::Linger => self.spare_for = LINGER,
            Event::Others(waiting) => self.others_waiting = waiting,
            _ => {}
        }
    }

    fn note_grants(
        &mut self,
        f: impl FnOnce(&mut Pool<()>, ClientId) -> Vec<baton_core::Grant>,
        i: usize,
    ) {
        let grants = f(&mut self.pool, self.clients[i]);
        for grant in grants {
            let j = self
                .clients
                .iter()
                .position(|&c| c == grant.client)
                .unwrap();
            self.waiting[j] = false;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(300)))]

    #[test]
    fn local_grants_never_outrun_cluster_tokens(limit in 1u32..6, events in prop::collection::vec(event(4, 5), 1..200)) {
        let mut pool = Pool::new(limit).unwrap();
        pool.set_admission_cap(Some(0));
        let clients: Vec<_> = (0..4).map(|_| pool.connect(())).collect();
        let mut sim = Sim { pool, clients, waiting: vec![false; 4], cluster: 0, others_waiting: false, spare_for: Duration::ZERO };
        for e in &events {
            let e = match e { Event::Acquire(c, n) => Event::Acquire(*c, (*n).min(limit)), e => e.clone() };
            sim.apply(&e);
            sim.settle();
            sim.pool.assert_invariants();
            prop_assert!(sim.pool.held() <= sim.cluster, "local tokens held without cluster tokens under them");
            prop_assert!(sim.cluster <= limit, "the link holds more cluster tokens than the local pool could use");
            if sim.pool.waiting() > 0 {
                prop_assert_eq!(sim.cluster, limit.min(sim.local().wanted()), "a local request waits while the link could take more");
            }
            if sim.others_waiting {
                prop_assert_eq!(sim.cluster, sim.local().wanted(), "spares kept while another broker waits");
            }
        }
    }
}
