//! Random sequences of connect / acquire / try-acquire / release / cancel /
//! disconnect / set-limit, checking after every step that no token is
//! created or lost and that nobody waits while their tokens are free.

use baton_core::{Acquired, ClientId, Grant, Pool};
use proptest::prelude::*;
use std::collections::HashMap;

#[derive(Debug, Clone)]
enum Op {
    Connect,
    Acquire { client: usize, tokens: u32 },
    TryAcquire { client: usize, tokens: u32 },
    Release { client: usize, tokens: u32 },
    Cancel { client: usize },
    Disconnect { client: usize },
    SetLimit(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Connect),
        4 => (0..8usize, 1..4u32).prop_map(|(client, tokens)| Op::Acquire { client, tokens }),
        2 => (0..8usize, 1..4u32).prop_map(|(client, tokens)| Op::TryAcquire { client, tokens }),
        4 => (0..8usize, 1..4u32).prop_map(|(client, tokens)| Op::Release { client, tokens }),
        1 => (0..8usize).prop_map(|client| Op::Cancel { client }),
        1 => (0..8usize).prop_map(|client| Op::Disconnect { client }),
        1 => (1..6u32).prop_map(Op::SetLimit),
    ]
}

/// A model of what each client should hold, kept independently of the pool
/// from the results the pool reports.
#[derive(Default)]
struct Model {
    clients: Vec<ClientId>,
    held: HashMap<ClientId, u32>,
    waiting: HashMap<ClientId, u32>,
}

impl Model {
    fn pick(&self, i: usize) -> Option<ClientId> {
        (!self.clients.is_empty()).then(|| self.clients[i % self.clients.len()])
    }

    fn apply_grants(&mut self, grants: &[Grant]) {
        for g in grants {
            let waited = self.waiting.remove(&g.client);
            assert_eq!(waited, Some(g.tokens), "a grant must answer that client's pending request");
            *self.held.entry(g.client).or_default() += g.tokens;
        }
    }
}

fn check(pool: &Pool<()>, model: &Model) {
    pool.assert_invariants();
    for &c in &model.clients {
        assert_eq!(pool.held_by(c), model.held.get(&c).copied().unwrap_or(0), "holdings of {c:?}");
    }
    let held: u32 = model.held.values().sum();
    assert_eq!(pool.held(), held);
    if held <= pool.limit() {
        assert_eq!(pool.free() + held, pool.limit(), "a token was created or lost");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn tokens_are_never_created_or_lost(limit in 1..6u32, ops in prop::collection::vec(op(), 1..120)) {
        let mut pool = Pool::new(limit).unwrap();
        let mut model = Model::default();
        for op in ops {
            match op {
                Op::Connect => model.clients.push(pool.connect(())),
                Op::Acquire { client, tokens } => {
                    let Some(c) = model.pick(client) else { continue };
                    if model.waiting.contains_key(&c) { continue } // one request at a time, like a socket client
                    match pool.acquire(c, 0, tokens) {
                        Ok(Acquired::Granted) => *model.held.entry(c).or_default() += tokens,
                        Ok(Acquired::Queued) => { model.waiting.insert(c, tokens); }
                        Err(_) => prop_assert!(model.held.get(&c).copied().unwrap_or(0) + tokens > pool.limit()),
                    }
                }
                Op::TryAcquire { client, tokens } => {
                    let Some(c) = model.pick(client) else { continue };
                    let free_before = pool.free();
                    let queue_empty = pool.waiting() == 0;
                    match pool.try_acquire(c, tokens) {
                        Ok(true) => *model.held.entry(c).or_default() += tokens,
                        Ok(false) => prop_assert!(free_before < tokens || !queue_empty),
                        Err(_) => prop_assert!(model.held.get(&c).copied().unwrap_or(0) + model.waiting.get(&c).copied().unwrap_or(0) + tokens > pool.limit()),
                    }
                }
                Op::Release { client, tokens } => {
                    let Some(c) = model.pick(client) else { continue };
                    let held = model.held.get(&c).copied().unwrap_or(0);
                    match pool.release(c, tokens) {
                        Ok(grants) => {
                            prop_assert!(tokens <= held);
                            *model.held.get_mut(&c).unwrap() -= tokens;
                            model.apply_grants(&grants);
                        }
                        Err(_) => prop_assert!(tokens > held, "a valid release was refused"),
                    }
                }
                Op::Cancel { client } => {
                    let Some(c) = model.pick(client) else { continue };
                    let (tokens, grants) = pool.cancel(c, 0);
                    prop_assert_eq!(tokens, model.waiting.remove(&c).unwrap_or(0));
                    model.apply_grants(&grants);
                }
                Op::Disconnect { client } => {
                    let Some(c) = model.pick(client) else { continue };
                    let (held, grants) = pool.disconnect(c);
                    prop_assert_eq!(held, model.held.remove(&c).unwrap_or(0));
                    model.waiting.remove(&c);
                    model.clients.retain(|&x| x != c);
                    model.apply_grants(&grants);
                }
                Op::SetLimit(limit) => {
                    if let Ok(grants) = pool.set_limit(limit) {
                        model.apply_grants(&grants);
                    }
                }
            }
            check(&pool, &model);
        }
        // Everyone leaves: every token is back, whatever happened before.
        for c in model.clients.clone() {
            let (held, grants) = pool.disconnect(c);
            prop_assert_eq!(held, model.held.remove(&c).unwrap_or(0));
            model.waiting.remove(&c);
            model.clients.retain(|&x| x != c);
            model.apply_grants(&grants);
            check(&pool, &model);
        }
        prop_assert_eq!(pool.free(), pool.limit());
        prop_assert_eq!(pool.held(), 0);
    }
}
