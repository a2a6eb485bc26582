//! The pool under any sequence of calls, with builds, weights, a moving
//! clock, limit changes and admission caps: its invariants hold after every
//! step, every client holds what its grants add up to, and when everyone
//! has gone every token is free.
#![no_main]

use arbitrary::Arbitrary;
use baton_core::{Acquired, ClientId, Grant, Pool};
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

#[derive(Debug, Arbitrary)]
enum Op {
    Connect,
    ConnectBeside { peer: u8 },
    SetWeight { client: u8, weight: u8 },
    Advance { by: u16 },
    Acquire { client: u8, tag: u8, tokens: u8 },
    TryAcquire { client: u8, tokens: u8 },
    Release { client: u8, tokens: u8 },
    Cancel { client: u8, tag: u8 },
    Disconnect { client: u8 },
    SetLimit { limit: u8 },
    SetCap { cap: Option<u8> },
}

#[derive(Debug, Arbitrary)]
struct Input {
    limit: u8,
    ops: Vec<Op>,
}

/// What each client holds and waits for, from what the pool reported.
#[derive(Default)]
struct Books {
    clients: Vec<ClientId>,
    held: HashMap<ClientId, u32>,
    waiting: HashMap<(ClientId, u64), u32>,
}

impl Books {
    fn pick(&self, i: u8) -> Option<ClientId> {
        (!self.clients.is_empty()).then(|| self.clients[usize::from(i) % self.clients.len()])
    }

    fn granted(&mut self, grants: Vec<Grant>) {
        for g in grants {
            let asked = self.waiting.remove(&(g.client, g.tag));
            assert_eq!(asked, Some(g.tokens), "a grant answers no request: {g:?}");
            *self.held.entry(g.client).or_default() += g.tokens;
        }
    }
}

fuzz_target!(|input: Input| {
    let Ok(mut pool) = Pool::<()>::new(u32::from(input.limit)) else {
        return;
    };
    let mut books = Books::default();
    let mut now = 0u64;
    for op in input.ops {
        apply(&mut pool, &mut books, &mut now, op);
        pool.assert_invariants();
        for &c in &books.clients {
            assert_eq!(
                pool.held_by(c),
                books.held.get(&c).copied().unwrap_or(0),
                "client {c:?} holds other than its grants add up to"
            );
        }
    }
    for c in std::mem::take(&mut books.clients) {
        pool.disconnect(c);
    }
    pool.assert_invariants();
    assert_eq!(
        (pool.free(), pool.held(), pool.waiting()),
        (pool.limit(), 0, 0),
        "tokens missing after everyone left"
    );
});

fn apply(pool: &mut Pool<()>, books: &mut Books, now: &mut u64, op: Op) {
    let small = |n: u8| u32::from(n % 12);
    match op {
        Op::Connect => books.clients.push(pool.connect(())),
        Op::ConnectBeside { peer } => {
            let id = match books.pick(peer) {
                Some(p) => pool.connect_beside(p, ()),
                None => pool.connect(()),
            };
            books.clients.push(id);
        }
        Op::SetWeight { client, weight } => {
            if let Some(c) = books.pick(client) {
                let _ = pool.set_weight(c, u32::from(weight));
            }
        }
        Op::Advance { by } => {
            *now += u64::from(by);
            books.granted(pool.advance(*now));
        }
        Op::Acquire {
            client,
            tag,
            tokens,
        } => {
            let Some(c) = books.pick(client) else { return };
            let (tag, tokens) = (u64::from(tag % 4), small(tokens));
            match pool.acquire(c, tag, tokens) {
                Ok(Acquired::Granted) => *books.held.entry(c).or_default() += tokens,
                Ok(Acquired::Queued) => assert!(
                    books.waiting.insert((c, tag), tokens).is_none(),
                    "a duplicate tag was queued"
                ),
                Err(_) => {}
            }
        }
        Op::TryAcquire { client, tokens } => {
            let Some(c) = books.pick(client) else { return };
            let tokens = small(tokens);
            if pool.try_acquire(c, tokens) == Ok(true) {
                *books.held.entry(c).or_default() += tokens;
            }
        }
        Op::Release { client, tokens } => {
            let Some(c) = books.pick(client) else { return };
            let tokens = small(tokens);
            let held = books.held.get(&c).copied().unwrap_or(0);
            match pool.release(c, tokens) {
                Ok(grants) => {
                    assert!(tokens <= held, "gave back {tokens} of {held}");
                    books.held.insert(c, held - tokens);
                    books.granted(grants);
                }
                Err(_) => assert!(
                    tokens == 0 || tokens > held,
                    "a release of {tokens} of {held} was refused"
                ),
            }
        }
        Op::Cancel { client, tag } => {
            let Some(c) = books.pick(client) else { return };
            let tag = u64::from(tag % 4);
            let (tokens, grants) = pool.cancel(c, tag);
            assert_eq!(
                tokens,
                books.waiting.remove(&(c, tag)).unwrap_or(0),
                "cancel withdrew another count than was waiting"
            );
            books.granted(grants);
        }
        Op::Disconnect { client } => {
            let Some(c) = books.pick(client) else { return };
            let (held, grants) = pool.disconnect(c);
            assert_eq!(
                held,
                books.held.remove(&c).unwrap_or(0),
                "a departing client gave back other than it held"
            );
            books.waiting.retain(|&(w, _), _| w != c);
            books.clients.retain(|&k| k != c);
            books.granted(grants);
        }
        Op::SetLimit { limit } => {
            if let Ok(grants) = pool.set_limit(u32::from(limit % 16)) {
                books.granted(grants);
            }
        }
        Op::SetCap { cap } => books.granted(pool.set_admission_cap(cap.map(|c| u32::from(c % 16)))),
    }
}
