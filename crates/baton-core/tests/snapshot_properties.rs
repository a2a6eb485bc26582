//! A pool handed to a successor (`baton serve --replace`) goes through
//! JSON: after any sequence of calls, the restored pool answers every
//! further call exactly as the original does, and a snapshot whose books
//! do not balance is refused.

mod support;

use baton_core::{Acquired, ClientId, Grant, Pool, PoolError};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Connect,
    ConnectBeside(usize),
    Weight {
        client: usize,
        weight: u32,
    },
    Advance(u64),
    Acquire {
        client: usize,
        tag: u64,
        tokens: u32,
    },
    TryAcquire {
        client: usize,
        tokens: u32,
    },
    Release {
        client: usize,
        tokens: u32,
    },
    Cancel {
        client: usize,
        tag: u64,
    },
    Disconnect(usize),
    SetLimit(u32),
    Cap(Option<u32>),
    Hold {
        client: usize,
        tokens: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Connect),
        1 => (0..8usize).prop_map(Op::ConnectBeside),
        1 => (0..8usize, 1..5u32).prop_map(|(client, weight)| Op::Weight { client, weight }),
        2 => (0..1000u64).prop_map(Op::Advance),
        4 => (0..8usize, 0..3u64, 1..4u32).prop_map(|(client, tag, tokens)| Op::Acquire { client, tag, tokens }),
        1 => (0..8usize, 1..4u32).prop_map(|(client, tokens)| Op::TryAcquire { client, tokens }),
        4 => (0..8usize, 1..4u32).prop_map(|(client, tokens)| Op::Release { client, tokens }),
        1 => (0..8usize, 0..3u64).prop_map(|(client, tag)| Op::Cancel { client, tag }),
        1 => (0..8usize).prop_map(Op::Disconnect),
        1 => (1..6u32).prop_map(Op::SetLimit),
        1 => prop::option::of(0..6u32).prop_map(Op::Cap),
        1 => (0..8usize, 1..4u32).prop_map(|(client, tokens)| Op::Hold { client, tokens }),
    ]
}

/// What a call answered, for comparing two pools call by call.
#[derive(Debug, PartialEq)]
enum Outcome {
    Id(ClientId),
    Acquired(Result<Acquired, PoolError>),
    Tried(Result<bool, PoolError>),
    Grants(Result<Vec<Grant>, PoolError>),
    Freed(u32, Vec<Grant>),
    Nothing,
}

/// Applies one call; clients are picked among those connected so far, by
/// index, so that the same op means the same call on a restored copy.
fn apply(pool: &mut Pool<String>, clients: &mut Vec<ClientId>, now: &mut u64, op: &Op) -> Outcome {
    let pick = |i: usize| clients.get(i % clients.len().max(1)).copied();
    match *op {
        Op::Connect => {
            let id = pool.connect(format!("client {}", clients.len()));
            clients.push(id);
            Outcome::Id(id)
        }
        Op::ConnectBeside(peer) => match pick(peer) {
            Some(peer) => {
                let id = pool.connect_beside(peer, "beside".into());
                clients.push(id);
                Outcome::Id(id)
            }
            None => Outcome::Nothing,
        },
        Op::Weight { client, weight } => pick(client).map_or(Outcome::Nothing, |c| {
            Outcome::Tried(pool.set_weight(c, weight).map(|()| true))
        }),
        Op::Advance(dt) => {
            *now += dt;
            pool.advance(*now);
            Outcome::Nothing
        }
        Op::Acquire {
            client,
            tag,
            tokens,
        } => pick(client).map_or(Outcome::Nothing, |c| {
            Outcome::Acquired(pool.acquire(c, tag, tokens))
        }),
        Op::TryAcquire { client, tokens } => pick(client).map_or(Outcome::Nothing, |c| {
            Outcome::Tried(pool.try_acquire(c, tokens))
        }),
        Op::Release { client, tokens } => pick(client).map_or(Outcome::Nothing, |c| {
            Outcome::Grants(pool.release(c, tokens))
        }),
        Op::Cancel { client, tag } => pick(client).map_or(Outcome::Nothing, |c| {
            let (tokens, grants) = pool.cancel(c, tag);
            Outcome::Freed(tokens, grants)
        }),
        Op::Disconnect(client) => pick(client).map_or(Outcome::Nothing, |c| {
            let (tokens, grants) = pool.disconnect(c);
            Outcome::Freed(tokens, grants)
        }),
        Op::SetLimit(limit) => Outcome::Grants(pool.set_limit(limit)),
        Op::Cap(cap) => Outcome::Grants(Ok(pool.set_admission_cap(cap))),
        Op::Hold { client, tokens } => pick(client).map_or(Outcome::Nothing, |c| {
            Outcome::Tried(pool.hold(c, tokens).map(|()| true))
        }),
    }
}

fn through_json(pool: &Pool<String>) -> serde_json::Value {
    serde_json::to_value(pool).expect("a pool serializes")
}

fn from_json(value: serde_json::Value) -> Result<Pool<String>, String> {
    let pool: Pool<String> = serde_json::from_value(value).map_err(|e| e.to_string())?;
    pool.restore().map_err(|e| e.to_string())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: support::cases(1000), ..ProptestConfig::default() })]

    #[test]
    fn a_restored_pool_answers_every_call_as_the_original(
        limit in 1..6u32,
        before in prop::collection::vec(op(), 0..80),
        after in prop::collection::vec(op(), 0..80),
    ) {
        let (mut pool, mut clients, mut now) = (Pool::new(limit).unwrap(), Vec::new(), 0);
        for op in &before {
            apply(&mut pool, &mut clients, &mut now, op);
        }
        let mut restored = from_json(through_json(&pool)).expect("a live pool's snapshot is accepted");
        prop_assert_eq!(&restored, &pool);
        let (mut clients2, mut now2) = (clients.clone(), now);
        for op in &after {
            let a = apply(&mut pool, &mut clients, &mut now, op);
            let b = apply(&mut restored, &mut clients2, &mut now2, op);
            prop_assert_eq!(a, b, "after {:?}", op);
        }
        prop_assert_eq!(&restored, &pool);
        prop_assert!(restored.restore().is_ok());
    }

    #[test]
    fn a_snapshot_whose_books_do_not_balance_is_refused(
        limit in 1..6u32,
        ops in prop::collection::vec(op(), 1..80),
        extra in 1..3u64,
    ) {
        let (mut pool, mut clients, mut now) = (Pool::new(limit).unwrap(), Vec::new(), 0);
        for op in &ops {
            apply(&mut pool, &mut clients, &mut now, op);
        }
        // One more free token than the books allow: a token created.
        let mut created = through_json(&pool);
        let free = created["free"].as_u64().unwrap();
        created["free"] = (free + extra).into();
        prop_assert!(from_json(created).is_err());
        // A client holding more than the pool thinks: a token created too.
        if let Some(&first) = clients.iter().find(|c| pool.held_by(**c) > 0 || pool.meta(**c).is_some()) {
            let mut grown = through_json(&pool);
            let held = &mut grown["clients"][first.0.to_string()]["held"];
            *held = (held.as_u64().unwrap() + extra).into();
            prop_assert!(from_json(grown).is_err());
        }
    }
}
