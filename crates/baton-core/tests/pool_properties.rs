//! Random sequences of connect / acquire / try-acquire / release / cancel /
//! disconnect / set-limit, checking after every step that no token is
//! created or lost, that grants go to the oldest request first, that
//! nobody waits while their tokens are free, and that every refusal was
//! justified.

mod support;

use baton_core::{Acquired, ClientId, Grant, Pool};
use proptest::prelude::*;
use std::collections::{HashMap, VecDeque};

#[derive(Debug, Clone)]
enum Op {
    Connect,
    Acquire { client: usize, tokens: u32 },
    TryAcquire { client: usize, tokens: u32 },
    Release { client: usize, tokens: u32 },
    Cancel { client: usize },
    Disconnect { client: usize },
    SetLimit(u32),
    Hold { client: usize, tokens: u32 },
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
        1 => (0..8usize, 1..4u32).prop_map(|(client, tokens)| Op::Hold { client, tokens }),
    ]
}

/// A model of what each client should hold, kept independently of the pool
/// from the results the pool reports.
struct Model {
    limit: u32,
    clients: Vec<ClientId>,
    held: HashMap<ClientId, u32>,
    waiting: HashMap<ClientId, u32>,
    /// Pending requests, oldest first.
    queue: VecDeque<ClientId>,
    granted: u64,
    released: u64,
    reclaimed: u64,
}

impl Model {
    fn new(limit: u32) -> Self {
        Model {
            limit,
            clients: Vec::new(),
            held: HashMap::new(),
            waiting: HashMap::new(),
            queue: VecDeque::new(),
            granted: 0,
            released: 0,
            reclaimed: 0,
        }
    }

    fn pick(&self, i: usize) -> Option<ClientId> {
        (!self.clients.is_empty()).then(|| self.clients[i % self.clients.len()])
    }

    fn held_total(&self) -> u32 {
        self.held.values().sum()
    }

    /// Free tokens: what the limit leaves beside the holdings (none while
    /// a lowered limit drains).
    fn free(&self) -> u32 {
        self.limit.saturating_sub(self.held_total())
    }

    fn grant(&mut self, client: ClientId, tokens: u32) {
        *self.held.entry(client).or_default() += tokens;
        self.granted += u64::from(tokens);
    }

    fn enqueue(&mut self, client: ClientId, tokens: u32) {
        self.waiting.insert(client, tokens);
        self.queue.push_back(client);
    }

    fn withdraw(&mut self, client: ClientId) -> u32 {
        self.queue.retain(|&c| c != client);
        self.waiting.remove(&client).unwrap_or(0)
    }

    /// Grants must answer the oldest requests, in order, and go on while
    /// the next one's tokens are free.
    fn apply_grants(&mut self, grants: &[Grant]) {
        for g in grants {
            assert_eq!(
                self.queue.pop_front(),
                Some(g.client),
                "a grant skipped an older request: {g:?}"
            );
            let waited = self.waiting.remove(&g.client);
            assert_eq!(
                waited,
                Some(g.tokens),
                "a grant must answer that client's pending request"
            );
            self.grant(g.client, g.tokens);
        }
        if let Some(head) = self.queue.front() {
            assert!(
                self.waiting[head] > self.free(),
                "the oldest request waits although its tokens are free"
            );
        }
    }
}

fn check(pool: &Pool<()>, model: &Model) {
    pool.assert_invariants();
    for &c in &model.clients {
        assert_eq!(
            pool.held_by(c),
            model.held.get(&c).copied().unwrap_or(0),
            "holdings of {c:?}"
        );
    }
    let held = model.held_total();
    assert_eq!(
        (pool.limit(), pool.held(), pool.free()),
        (model.limit, held, model.free()),
        "a token was created or lost"
    );
    assert_eq!(pool.waiting(), model.queue.len());
    let queue: Vec<ClientId> = pool.queue().map(|(c, _, _)| c).collect();
    assert_eq!(queue, Vec::from(model.queue.clone()), "the queue's order");
    let t = pool.totals();
    assert_eq!(
        (t.granted, t.released, t.reclaimed),
        (model.granted, model.released, model.reclaimed),
        "totals"
    );
    assert_eq!(
        t.granted,
        t.released + t.reclaimed + u64::from(held),
        "granted = released + reclaimed + held"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: support::cases(2000), ..ProptestConfig::default() })]

    #[test]
    fn tokens_are_never_created_or_lost(limit in 1..6u32, ops in prop::collection::vec(op(), 1..120)) {
        let mut pool = Pool::new(limit).unwrap();
        let mut model = Model::new(limit);
        for op in ops {
            match op {
                Op::Connect => model.clients.push(pool.connect(())),
                Op::Acquire { client, tokens } => {
                    let Some(c) = model.pick(client) else { continue };
                    if model.waiting.contains_key(&c) { continue } // one request at a time, like a socket client
                    let could_have_now = model.queue.is_empty() && model.free() >= tokens;
                    match pool.acquire(c, 0, tokens) {
                        Ok(Acquired::Granted) => {
                            prop_assert!(could_have_now, "granted past the queue or beyond the free tokens");
                            model.grant(c, tokens);
                        }
                        Ok(Acquired::Queued) => {
                            prop_assert!(!could_have_now, "queued although the tokens were free");
                            model.enqueue(c, tokens);
                        }
                        Err(_) => prop_assert!(model.held.get(&c).copied().unwrap_or(0) + tokens > model.limit, "a valid acquire was refused"),
                    }
                }
                Op::TryAcquire { client, tokens } => {
                    let Some(c) = model.pick(client) else { continue };
                    let could_have_now = model.queue.is_empty() && model.free() >= tokens;
                    let within_limit = model.held.get(&c).copied().unwrap_or(0) + model.waiting.get(&c).copied().unwrap_or(0) + tokens <= model.limit;
                    match pool.try_acquire(c, tokens) {
                        Ok(true) => {
                            prop_assert!(could_have_now, "TRY jumped the queue or took tokens that were not free");
                            model.grant(c, tokens);
                        }
                        // Past the limit with what it holds and waits for:
                        // "not now" (a lowered limit), never granted.
                        Ok(false) => prop_assert!(!could_have_now || !within_limit, "TRY refused free tokens"),
                        Err(_) => prop_assert!(false, "TRY of {} was refused: past the limit is BUSY", tokens),
                    }
                }
                Op::Release { client, tokens } => {
                    let Some(c) = model.pick(client) else { continue };
                    let held = model.held.get(&c).copied().unwrap_or(0);
                    match pool.release(c, tokens) {
                        Ok(grants) => {
                            prop_assert!(tokens <= held);
                            *model.held.get_mut(&c).unwrap() -= tokens;
                            model.released += u64::from(tokens);
                            model.apply_grants(&grants);
                        }
                        Err(_) => prop_assert!(tokens > held, "a valid release was refused"),
                    }
                }
                Op::Cancel { client } => {
                    let Some(c) = model.pick(client) else { continue };
                    let (tokens, grants) = pool.cancel(c, 0);
                    prop_assert_eq!(tokens, model.withdraw(c));
                    model.apply_grants(&grants);
                }
                Op::Disconnect { client } => {
                    let Some(c) = model.pick(client) else { continue };
                    disconnect(&mut pool, &mut model, c)?;
                }
                Op::SetLimit(limit) => {
                    let refusable = model.waiting.values().any(|&w| w > limit);
                    match pool.set_limit(limit) {
                        Ok(grants) => {
                            prop_assert!(!refusable, "a limit below a waiting request was accepted");
                            model.limit = limit;
                            model.apply_grants(&grants);
                        }
                        Err(_) => prop_assert!(refusable, "a valid limit change was refused"),
                    }
                }
                Op::Hold { client, tokens } => {
                    let Some(c) = model.pick(client) else { continue };
                    let all_held: u32 = model.held.values().sum();
                    match pool.hold(c, tokens) {
                        // Tokens a predecessor granted: counted even past the
                        // limit (the pool drains), never created.
                        Ok(()) => {
                            prop_assert!(all_held + tokens <= baton_core::MAX_LIMIT, "held past the pool's bound");
                            model.grant(c, tokens);
                        }
                        Err(_) => prop_assert!(all_held + tokens > baton_core::MAX_LIMIT, "a valid HOLD was refused"),
                    }
                }
            }
            check(&pool, &model);
        }
        // Everyone leaves: every token is back, whatever happened before.
        for c in model.clients.clone() {
            disconnect(&mut pool, &mut model, c)?;
            check(&pool, &model);
        }
        prop_assert_eq!(pool.free(), pool.limit());
        prop_assert_eq!(pool.held(), 0);
    }
}

fn disconnect(pool: &mut Pool<()>, model: &mut Model, c: ClientId) -> Result<(), TestCaseError> {
    let (held, grants) = pool.disconnect(c);
    let had = model.held.remove(&c).unwrap_or(0);
    prop_assert_eq!(held, had);
    model.reclaimed += u64::from(had);
    model.withdraw(c);
    model.clients.retain(|&x| x != c);
    model.apply_grants(&grants);
    Ok(())
}
