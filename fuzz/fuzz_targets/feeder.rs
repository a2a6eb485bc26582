//! The feeder's rules (`plan`) under any sequence of what a build, the
//! pool and other builds do: the build never has more tokens lent than
//! `--max` allows, a plan never takes out of the FIFO more than is there,
//! gives back more than is spare or tops up past the cap, and every token
//! lent is accounted for (in the FIFO, in the return pipe, or in use).
//!
//! The feeder's side is played as `Feeder::step` and `carry_out` do it,
//! over counts instead of a real FIFO and broker connection.
#![no_main]

use arbitrary::Arbitrary;
use baton_jobserver::fuzzing::{plan, should_look, spare, Plan, Seen, Wanted};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Event {
    /// The build reads a byte from the FIFO to start a job.
    Read,
    /// A job ends: its byte goes back into the FIFO (`fifo:` clients) or
    /// the return pipe (the pipe style).
    Finish { to_return_pipe: bool },
    /// A client writes a byte it never read.
    WriteExtra { to_return_pipe: bool },
    /// The feeder steps; `look` is what `WANTED` would answer.
    Step { due: bool, others: u8, free: u8 },
    /// The pool grants the pending `ACQUIRE 1`.
    Grant,
}

#[derive(Debug, Arbitrary)]
struct Input {
    max_lent: u8,
    pool_free: u8,
    events: Vec<Event>,
}

/// What the feeder and the build hold, in tokens and bytes.
#[derive(Debug, Default)]
struct World {
    max_lent: u32,
    /// Bytes in the FIFO and in the return pipe.
    queued: u32,
    returned: u32,
    /// Pool tokens lent to the build (the feeder's count).
    lent: u32,
    /// Bytes the build's jobs took and have not written back.
    in_use: u32,
    /// Bytes the build made up (written without a read), and bytes the
    /// feeder threw away.
    extra: u32,
    discarded: u32,
    pending: bool,
    contended: bool,
    pool_free: u32,
}

impl World {
    fn seen(&self, wanted: Option<Wanted>) -> Seen {
        Seen {
            queued: self.queued,
            returned: self.returned,
            lent: self.lent,
            pending: self.pending,
            max_lent: self.max_lent,
            wanted,
        }
    }

    /// Takes up to `n` bytes out, return pipe first (as `Fifo::take`).
    fn take(&mut self, n: u32) -> u32 {
        let from_pipe = n.min(self.returned);
        let from_fifo = (n - from_pipe).min(self.queued);
        self.returned -= from_pipe;
        self.queued -= from_fifo;
        from_pipe + from_fifo
    }

    fn step(&mut self, due: bool, others: u32, free: u32) {
        // A token written back while the feeder queues: it cancels; the
        // grant may win that race (it comes before CANCELLED).
        if self.pending && spare(self.seen(None)) > 0 {
            self.pending = false;
        }
        let mut seen = self.seen(None);
        if should_look(seen, due, self.contended) {
            self.contended = others > 0;
            seen = self.seen(Some(Wanted {
                others,
                free: free.min(self.pool_free),
            }));
        }
        let p = plan(seen);
        check_plan(seen, p);
        self.carry_out(p);
    }

    fn carry_out(&mut self, p: Plan) {
        self.discarded += self.take(p.discard);
        let given = self.take(p.give_back);
        self.lent -= given;
        self.pool_free += given;
        let recycled = p.recycle.min(self.returned);
        self.returned -= recycled;
        self.queued += recycled;
        let room = self.max_lent - self.lent;
        if self.pending {
            return;
        }
        let got = p.top_up.min(room).min(self.pool_free);
        self.lend(got);
        if got == 0 && p.ask && room > 0 && self.queued + self.returned == 0 {
            self.pending = true;
        }
    }

    fn lend(&mut self, tokens: u32) {
        self.pool_free -= tokens;
        self.lent += tokens;
        self.queued += tokens;
    }

    fn apply(&mut self, event: Event) {
        match event {
            Event::Read if self.queued > 0 => {
                self.queued -= 1;
                self.in_use += 1;
            }
            Event::Finish { to_return_pipe } if self.in_use > 0 => {
                self.in_use -= 1;
                self.write_byte(to_return_pipe);
            }
            Event::WriteExtra { to_return_pipe } if self.extra < 64 => {
                self.extra += 1;
                self.write_byte(to_return_pipe);
            }
            Event::Step { due, others, free } => {
                self.step(due, u32::from(others % 8), u32::from(free))
            }
            Event::Grant if self.pending && self.pool_free > 0 => {
                self.pending = false;
                self.lend(1);
            }
            _ => {}
        }
    }

    fn write_byte(&mut self, to_return_pipe: bool) {
        if to_return_pipe {
            self.returned += 1;
        } else {
            self.queued += 1;
        }
    }
}

fn check_plan(seen: Seen, p: Plan) {
    let bytes = seen.queued + seen.returned;
    assert!(
        p.discard + p.give_back + p.recycle <= bytes,
        "{p:?} takes out more than the {bytes} bytes there: {seen:?}"
    );
    assert!(
        p.give_back <= spare(seen),
        "{p:?} gives back more than is spare: {seen:?}"
    );
    assert!(
        p.recycle <= seen.returned,
        "{p:?} recycles more than the return pipe has: {seen:?}"
    );
    assert!(
        p.discard == bytes - spare(seen),
        "{p:?} keeps bytes the build made up, or throws away tokens: {seen:?}"
    );
    let lent_after = seen.lent - p.give_back;
    assert!(
        lent_after + p.top_up <= seen.max_lent,
        "{p:?} tops up past the cap: {seen:?}"
    );
    if let Some(w) = seen.wanted {
        assert!(
            p.give_back <= w.others,
            "{p:?} gives back more than others wait for: {seen:?}"
        );
        assert!(
            p.top_up == 0 || w.others == 0,
            "{p:?} takes free tokens while others wait: {seen:?}"
        );
    }
    assert!(
        !(p.ask && seen.pending),
        "{p:?} asks again while a request waits: {seen:?}"
    );
}

fuzz_target!(|input: Input| {
    let mut world = World {
        max_lent: u32::from(input.max_lent % 16),
        pool_free: u32::from(input.pool_free % 16),
        ..World::default()
    };
    let tokens = world.pool_free;
    for event in input.events {
        world.apply(event);
        assert!(
            world.lent <= world.max_lent,
            "lent {} past --max {}: {world:?}",
            world.lent,
            world.max_lent
        );
        // Every byte is a token lent or one the build made up: none is
        // created, none lost.
        assert_eq!(
            world.queued + world.returned + world.in_use + world.discarded,
            world.lent + world.extra,
            "bytes created or lost: {world:?}"
        );
        assert!(
            world.discarded <= world.extra,
            "a lent token was thrown away: {world:?}"
        );
        assert_eq!(
            world.pool_free + world.lent,
            tokens,
            "tokens created or lost between the pool and the build: {world:?}"
        );
    }
});
