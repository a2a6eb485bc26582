//! The pile's proof (docs/fastpath.md, "The pile"): every interleaving of
//! a few clients' steps, the real machines of `baton_core::fastpath::pile`
//! on real atomic words, with the futex calls modelled (a wait blocks only
//! if the bell still carries the sequence it was given; a wake unblocks one
//! sleeper, any one), any client killed at any step and the broker's repair
//! running among the others' steps.
//!
//! Checked in every state: every token word is one a correct party writes,
//! and no live client is named by more words than it believes it holds.
//! Checked in every state with nothing left to do: nobody sleeps (no wake-up
//! was lost), every token is back on the pile (none lost, none made: the
//! words are the tokens), no wake-up's mark is left standing, and the
//! bell counts no sleeper (but one too many if a client died between
//! counting itself and marking its record, which costs rings, not tokens).
//!
//! A depth-first search over whole states (the words' values and each
//! machine), each visited once. A violation fails with the moves that
//! reached it.

mod support;

use baton_core::fastpath::pile::{
    self, Acquire, AcquireAt, Acquired, Pile, Release, Released, Repair, Step,
};
use baton_core::fastpath::Seat;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

/// What a client does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Doing {
    /// Between operations.
    Idle,
    Acquiring(Acquire),
    /// On its way into `futex_wait` with this sequence: the kernel has not
    /// compared the bell yet, and others may step first.
    Entering(Acquire, u32),
    /// Asleep in `futex_wait` inside its acquire.
    Asleep(Acquire),
    Releasing(Release),
    /// Its step asked for `futex_wake`: the next move says whom it woke.
    WakingInAcquire(Acquire),
    WakingInRelease(Release),
    /// Killed; its steps stop where they were.
    Dead,
    /// Its script is over.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Client {
    doing: Doing,
    /// The token it believes it holds.
    held: Option<usize>,
    /// Acquire-and-release rounds left.
    rounds: u8,
    /// Its acquires may time out while asleep.
    timed: bool,
    /// It acquires with TRY: never waits.
    try_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct State {
    words: Vec<u64>,
    clients: Vec<Client>,
    repair: Option<Repair>,
    /// The repair's step asked for `futex_wake`.
    repair_waking: bool,
    kills: u8,
    /// A client died between counting itself and marking its record.
    overcounted: bool,
}

/// One scheduler choice.
#[derive(Debug, Clone, Copy)]
enum Move {
    Step(usize),
    /// A step asked for a wake: it woke this sleeper, or nobody.
    StepWaking(usize, Option<usize>),
    TimeOut(usize),
    Kill(usize),
    Repair,
    RepairWaking(Option<usize>),
}

struct Model {
    tokens: usize,
    seats: usize,
    words: Vec<AtomicU64>,
}

impl Model {
    fn new(tokens: usize, seats: usize) -> Model {
        let words = (0..pile::words_for(tokens, seats))
            .map(|_| AtomicU64::new(0))
            .collect::<Vec<_>>();
        Pile::init(&words, tokens, seats, tokens).expect("layout");
        Model {
            tokens,
            seats,
            words,
        }
    }

    /// The first state: the clients' scripts, the tokens some start with.
    fn start(&self, clients: &[Client], kills: u8) -> State {
        for (c, client) in clients.iter().enumerate() {
            if let Some(i) = client.held {
                let first_token = pile::words_for(0, 0);
                self.words[first_token + i].store(pile::holder(Seat(c as u16)), SeqCst);
            }
        }
        State {
            words: self.snapshot(),
            clients: clients.to_vec(),
            repair: None,
            repair_waking: false,
            kills,
            overcounted: false,
        }
    }

    fn pile(&self) -> Pile<'_> {
        Pile::attach(&self.words).expect("attached")
    }

    fn load(&self, state: &State) {
        for (word, &value) in self.words.iter().zip(&state.words) {
            word.store(value, SeqCst);
        }
    }

    fn snapshot(&self) -> Vec<u64> {
        self.words.iter().map(|w| w.load(SeqCst)).collect()
    }

    fn sleepers(state: &State) -> Vec<usize> {
        (0..state.clients.len())
            .filter(|&c| matches!(state.clients[c].doing, Doing::Asleep(_)))
            .collect()
    }

    /// Every move from `state`.
    fn moves(&self, state: &State) -> Vec<Move> {
        let mut moves = Vec::new();
        let wakes = |moves: &mut Vec<Move>, make: &dyn Fn(Option<usize>) -> Move| {
            let sleepers = Model::sleepers(state);
            if sleepers.is_empty() {
                moves.push(make(None));
            }
            moves.extend(sleepers.into_iter().map(|s| make(Some(s))));
        };
        for (c, client) in state.clients.iter().enumerate() {
            match client.doing {
                Doing::Dead | Doing::Done => continue,
                Doing::Asleep(_) => {
                    if client.timed {
                        moves.push(Move::TimeOut(c));
                    }
                }
                Doing::WakingInAcquire(_) | Doing::WakingInRelease(_) => {
                    wakes(&mut moves, &|s| Move::StepWaking(c, s))
                }
                _ => moves.push(Move::Step(c)),
            }
            if state.kills > 0 {
                moves.push(Move::Kill(c));
            }
        }
        if state.repair_waking {
            wakes(&mut moves, &Move::RepairWaking);
        } else if state.repair.is_some() {
            moves.push(Move::Repair);
        }
        moves
    }

    /// The state after `mv`, or the violation it makes.
    fn apply(&self, state: &State, mv: Move) -> Result<State, String> {
        self.load(state);
        let pile = self.pile();
        let mut next = state.clone();
        match mv {
            Move::Step(c) => self.step_client(&pile, &mut next, c)?,
            Move::StepWaking(c, woken) => {
                if let Some(s) = woken {
                    wake(&mut next, s);
                }
                let client = &mut next.clients[c];
                client.doing = match client.doing {
                    Doing::WakingInAcquire(mut op) => {
                        op.woke(woken.is_some());
                        Doing::Acquiring(op)
                    }
                    Doing::WakingInRelease(mut op) => {
                        op.woke(woken.is_some());
                        Doing::Releasing(op)
                    }
                    _ => unreachable!("a waking client"),
                };
            }
            Move::TimeOut(c) => {
                let Doing::Asleep(mut op) = next.clients[c].doing else {
                    unreachable!()
                };
                op.waited(true, false);
                next.clients[c].doing = Doing::Acquiring(op);
            }
            Move::Kill(c) => {
                let client = &mut next.clients[c];
                if let Doing::Acquiring(op) = client.doing {
                    // Counted in the bell, its record not (or no longer)
                    // marked: the repair cannot know to take it out.
                    if matches!(op.at(), AcquireAt::Mark { .. } | AcquireAt::Uncount { .. }) {
                        next.overcounted = true;
                    }
                }
                client.doing = Doing::Dead;
                next.kills -= 1;
                next.repair = Some(Repair::new(Seat(c as u16)));
            }
            Move::Repair => {
                let mut repair = next.repair.expect("a repair runs");
                match repair.step(&pile) {
                    Step::Done(_) => next.repair = None,
                    Step::Wake => {
                        next.repair_waking = true;
                        next.repair = Some(repair);
                    }
                    _ => next.repair = Some(repair),
                }
            }
            Move::RepairWaking(woken) => {
                let mut repair = next.repair.expect("a repair runs");
                if let Some(s) = woken {
                    wake(&mut next, s);
                }
                repair.woke(woken.is_some());
                next.repair = Some(repair);
                next.repair_waking = false;
            }
        }
        next.words = self.snapshot();
        self.check(&next)?;
        self.check_quiet(&next)?;
        Ok(next)
    }

    fn step_client(&self, pile: &Pile, state: &mut State, c: usize) -> Result<(), String> {
        let client = &mut state.clients[c];
        let seat = Seat(c as u16);
        match client.doing {
            Doing::Idle if client.held.is_some() => {
                client.doing = Doing::Releasing(Release::new(seat, client.held.unwrap()))
            }
            Doing::Idle if client.rounds == 0 => client.doing = Doing::Done,
            Doing::Idle => client.doing = Doing::Acquiring(Acquire::new(seat, client.try_only)),
            Doing::Acquiring(mut op) => match op.step(pile) {
                Step::Busy => client.doing = Doing::Acquiring(op),
                Step::Wait(seq) => client.doing = Doing::Entering(op, seq),
                Step::Wake => client.doing = Doing::WakingInAcquire(op),
                Step::Done(Ok(Acquired::Token(i))) => {
                    client.held = Some(i);
                    client.doing = Doing::Idle;
                }
                Step::Done(Ok(Acquired::TimedOut)) | Step::Done(Err(pile::Refused::Busy)) => {
                    client.rounds -= 1;
                    client.doing = Doing::Idle;
                }
                Step::Done(Err(e)) => return Err(format!("client {c}'s acquire: {e}")),
            },
            Doing::Releasing(mut op) => match op.step(pile) {
                Step::Busy => client.doing = Doing::Releasing(op),
                Step::Wake => client.doing = Doing::WakingInRelease(op),
                Step::Done(Ok(Released::Piled)) => {
                    client.held = None;
                    client.rounds -= 1;
                    client.doing = Doing::Idle;
                }
                Step::Done(other) => return Err(format!("client {c}'s release: {other:?}")),
                Step::Wait(_) => return Err("a release waited".into()),
            },
            Doing::Entering(mut op, seq) => {
                // futex_wait: sleeps only if the word still says `seq`.
                if pile.bell_word().seq == seq {
                    client.doing = Doing::Asleep(op);
                } else {
                    op.waited(false, false);
                    client.doing = Doing::Acquiring(op);
                }
            }
            Doing::Asleep(_)
            | Doing::WakingInAcquire(_)
            | Doing::WakingInRelease(_)
            | Doing::Dead
            | Doing::Done => unreachable!("not a step move"),
        }
        Ok(())
    }

    /// The moves to a violation, each with what it did to the bell and to
    /// the client it moved.
    fn replay(&self, clients: &[Client], kills: u8, path: &[Move]) -> String {
        let model = Model::new(self.tokens, self.seats);
        let mut state = model.start(clients, kills);
        let mut out = String::new();
        for &mv in path {
            state = model.apply(&state, mv).expect("replayed");
            let who = match mv {
                Move::Step(c) | Move::StepWaking(c, _) | Move::TimeOut(c) | Move::Kill(c) => {
                    format!("{:?}", state.clients[c].doing)
                }
                Move::Repair | Move::RepairWaking(_) => format!("{:?}", state.repair),
            };
            model.load(&state);
            let tokens: Vec<_> = (0..self.tokens)
                .map(|i| model.pile().token_word(i))
                .collect();
            out += &format!(
                "{mv:?}: {who}\n    bell {:?} tokens {tokens:?}\n",
                model.pile().bell_word()
            );
        }
        out
    }

    /// What must hold in every state.
    fn check(&self, state: &State) -> Result<(), String> {
        let pile = self.pile();
        let mut named = vec![0usize; self.seats];
        for i in 0..self.tokens {
            match pile.token_word(i) {
                pile::TokenWord::Free => {}
                pile::TokenWord::Held { seat, recalled } => {
                    if recalled {
                        return Err(format!("token {i} recalled, and nobody recalls"));
                    }
                    named[usize::from(seat.0)] += 1;
                }
                other => return Err(format!("token {i}'s word: {other:?}")),
            }
        }
        for (c, client) in state.clients.iter().enumerate() {
            let believes = match client.doing {
                Doing::Dead => continue,
                Doing::Acquiring(op)
                | Doing::Entering(op, _)
                | Doing::Asleep(op)
                | Doing::WakingInAcquire(op) => usize::from(op.taken().is_some()),
                Doing::Releasing(op) | Doing::WakingInRelease(op) => {
                    let giving = matches!(op.at(), pile::ReleaseAt::Give | pile::ReleaseAt::Recall);
                    if giving && pile.token_word(op.token()) == pile::TokenWord::Free {
                        return Err(format!(
                            "client {c} gives back token {}, which is free",
                            op.token()
                        ));
                    }
                    usize::from(giving)
                }
                _ => usize::from(client.held.is_some()),
            };
            if named[c] != believes {
                return Err(format!(
                    "client {c} is named by {} token words and believes it holds {believes}",
                    named[c]
                ));
            }
        }
        Ok(())
    }

    /// When nothing is in flight (every live client between operations or
    /// asleep, no repair running), no token may lie free while somebody
    /// sleeps: that sleeper's wake-up was lost, and it would wait for an
    /// unrelated release.
    fn check_quiet(&self, state: &State) -> Result<(), String> {
        let quiet = state.repair.is_none()
            && state.clients.iter().all(|c| {
                matches!(
                    c.doing,
                    Doing::Idle | Doing::Done | Doing::Dead | Doing::Asleep(_)
                )
            });
        let sleeper = Model::sleepers(state).first().copied();
        let pile = self.pile();
        let free = (0..self.tokens).find(|&i| pile.token_word(i) == pile::TokenWord::Free);
        match (quiet, sleeper, free) {
            (true, Some(c), Some(i)) => Err(format!(
                "token {i} lies free while client {c} sleeps, with nothing in flight"
            )),
            _ => Ok(()),
        }
    }

    /// What must hold once nothing is left to do.
    fn check_end(&self, state: &State) -> Result<(), String> {
        self.load(state);
        let pile = self.pile();
        if let Some(c) = Model::sleepers(state).first() {
            return Err(format!("client {c} sleeps for ever (a lost wake-up)"));
        }
        for i in 0..self.tokens {
            if pile.token_word(i) != pile::TokenWord::Free {
                return Err(format!("token {i} is not back: {:?}", pile.token_word(i)));
            }
        }
        let bell = pile.bell_word();
        if bell.pending {
            return Err("a wake-up's mark is left standing".into());
        }
        let allowed = u32::from(state.overcounted);
        if bell.sleepers > allowed {
            return Err(format!("the bell counts {} sleepers", bell.sleepers));
        }
        Ok(())
    }
}

fn wake(state: &mut State, s: usize) {
    let Doing::Asleep(mut op) = state.clients[s].doing else {
        unreachable!("woke a sleeper")
    };
    op.waited(false, false);
    state.clients[s].doing = Doing::Acquiring(op);
}

/// Explores every state from clients with these scripts; returns how many
/// states, or the first violation with the moves to it.
fn explore(tokens: usize, clients: &[Client], kills: u8) -> Result<usize, String> {
    let model = Model::new(tokens, clients.len());
    let start = model.start(clients, kills);
    // Depth first, one frame per state on the current path: the moves
    // that led here are the frames' own, so a violation can be replayed.
    let mut seen = HashSet::new();
    seen.insert(start.clone());
    let first = model.moves(&start);
    let mut frames = vec![(start, first, None::<Move>)];
    while let Some((state, moves, _)) = frames.last_mut() {
        let Some(mv) = moves.pop() else {
            frames.pop();
            continue;
        };
        let (state, path) = (state.clone(), || {
            frames.iter().filter_map(|f| f.2).collect::<Vec<_>>()
        });
        let next = model
            .apply(&state, mv)
            .map_err(|e| format!("{e}\n{}then {mv:?}", model.replay(clients, kills, &path())))?;
        // Every step moves a machine on or changes a word: one that does
        // neither would spin in place for as long as nobody else moves.
        if next == state && matches!(mv, Move::Step(_) | Move::Repair) {
            return Err(format!(
                "{mv:?} changed nothing: it would spin\n{}",
                model.replay(clients, kills, &path())
            ));
        }
        if !seen.insert(next.clone()) {
            continue;
        }
        let moves = model.moves(&next);
        if moves.iter().all(|m| matches!(m, Move::Kill(_))) {
            let mut to = path();
            to.push(mv);
            model
                .check_end(&next)
                .map_err(|e| format!("{e}\n{}", model.replay(clients, kills, &to)))?;
        }
        frames.push((next, moves, Some(mv)));
    }
    Ok(seen.len())
}

fn client(rounds: u8) -> Client {
    Client {
        doing: Doing::Idle,
        held: None,
        rounds,
        timed: false,
        try_only: false,
    }
}

/// A client that starts holding token `i` and only gives it back.
fn holding(i: usize) -> Client {
    Client {
        held: Some(i),
        ..client(1)
    }
}

fn timed(rounds: u8) -> Client {
    Client {
        timed: true,
        ..client(rounds)
    }
}

fn trying(rounds: u8) -> Client {
    Client {
        try_only: true,
        ..client(rounds)
    }
}

fn explored(tokens: usize, clients: &[Client], kills: u8) -> usize {
    // Under a mutation run, the first violation ends the binary: the other
    // explorations would take their whole time for nothing.
    support::fail_fast();
    match explore(tokens, clients, kills) {
        Ok(states) => {
            eprintln!(
                "{tokens} token(s), {} clients, {kills} kill(s): {states} states",
                clients.len()
            );
            states
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn one_token_three_clients_no_wake_up_is_lost_and_every_token_comes_back() {
    assert!(explored(1, &[client(2), client(1), client(1)], 0) > 1000);
}

#[test]
fn two_tokens_three_clients_no_wake_up_is_lost_and_every_token_comes_back() {
    assert!(explored(2, &[client(1), client(1), client(1)], 0) > 1000);
}

#[test]
fn a_client_killed_at_any_step_leaves_a_pile_the_repair_makes_whole() {
    assert!(explored(1, &[client(1), client(1), client(1)], 1) > 1000);
    assert!(explored(2, &[client(1), client(1), client(1)], 1) > 1000);
}

#[test]
fn timed_and_try_acquires_leave_nothing_behind() {
    assert!(explored(1, &[timed(1), client(1), trying(1)], 1) > 1000);
}

#[test]
fn two_tokens_freed_under_one_wake_up_both_reach_a_sleeper() {
    // Two sleepers while two tokens are held: a wake-up in flight when
    // both come back, so its sleeper must pass the second on.
    assert!(explored(2, &[holding(0), holding(1), client(1), client(1)], 0) > 1000);
}
