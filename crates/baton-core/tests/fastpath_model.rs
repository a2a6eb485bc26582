//! The fast path's proof (docs/fastpath.md, "The proof"): every
//! interleaving of a few clients' steps on the region, with any client
//! killed at any step and the broker's repair running among the others'
//! steps. In every state reached: the tokens are conserved (the region
//! and the broker's books count exactly the tokens lent), each live
//! client's record says exactly what it holds, no more tokens are held
//! than lent, nothing is attributed to a client once its repair is over,
//! and the broker's audit agrees. On every grant: first come, first
//! served. In every state with nothing left to do: every live client
//! finished (nobody sleeps forever) and every token is back.
//!
//! The checker is a breadth-first search over whole states: the region,
//! each client's program counter, the broker's books, and a ghost queue
//! (the waiting clients in the order they enqueued, kept by the checker
//! alone) that the grants are checked against. A violation fails with the
//! shortest sequence of moves that reaches it. docs/fastpath.md records
//! the state counts, and the bugs planted in the model to check that
//! these tests catch them.

mod fastpath {
    use baton_core::fastpath::{
        Books, Claim, Event, Intent, Party, Phase, Record, Region, Seat, Ticket,
    };
    use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
    use std::hash::{DefaultHasher, Hash, Hasher};

    /// One operation of a client's script.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum Op {
        /// Wait as long as it takes.
        Acquire,
        /// Wait, but a timeout may end the wait (CANCEL).
        AcquireOrGiveUp,
        /// Give one token back, if it holds one.
        Release,
    }

    use Op::{Acquire, AcquireOrGiveUp, Release};

    /// When the broker puts up its barrier (a gate closed, the limit
    /// lowered, a second build: docs/fastpath.md, "Policy").
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Policy {
        /// Never: the region stays open.
        Open,
        /// Once, at any moment, for good.
        Closes,
        /// Once, at any moment, and takes it down again at any later one.
        ClosesAndReopens,
    }

    #[derive(Debug, Clone)]
    struct Config {
        lent: u32,
        scripts: Vec<Vec<Op>>,
        /// How many clients may be killed in one run.
        kills: u8,
        policy: Policy,
    }

    impl Config {
        fn new(lent: u32, scripts: &[&[Op]], kills: u8) -> Self {
            Config {
                lent,
                scripts: scripts.iter().map(|s| s.to_vec()).collect(),
                kills,
                policy: Policy::Open,
            }
        }

        fn policy(self, policy: Policy) -> Self {
            Config { policy, ..self }
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum Life {
        Live,
        /// Killed: its steps never run again; the broker repairs.
        Killed,
        /// Dropped to the socket path after an audit: its tokens are on
        /// its connection, in the broker's books.
        OnSocket,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    struct Client {
        /// The index of the next operation of its script to start.
        next: u8,
        phase: Phase,
        life: Life,
        /// Tokens it believes it holds: the jobs it runs.
        running: u32,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum Barrier {
        Down,
        Up,
        Lifted,
    }

    /// A move of the search: whose step it is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Move {
        Step(Seat),
        TimeOut(Seat),
        Kill(Seat),
        SocketRelease(Seat),
        Broker,
        Close,
        Reopen,
    }

    impl Move {
        /// Whether nothing obliges it to happen: a kill, or the broker's
        /// policy changing. A state with only such moves left must be an
        /// end where everyone finished: otherwise someone waits for
        /// nothing.
        fn may_never_happen(self) -> bool {
            matches!(self, Move::Kill(_) | Move::Close | Move::Reopen)
        }
    }

    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    struct World {
        region: Region,
        clients: Vec<Client>,
        books: Books,
        /// Killed clients whose repair has not finished, oldest first.
        repairs: Vec<Seat>,
        kills: u8,
        /// Ghost: the clients waiting for a grant, in the order they
        /// enqueued.
        fifo: Vec<Seat>,
        barrier: Barrier,
    }

    fn seats(n: usize) -> impl Iterator<Item = Seat> {
        (0..n).map(|i| Seat(i as u16))
    }

    impl World {
        fn new(config: &Config) -> Self {
            let n = config.scripts.len();
            let client = Client {
                next: 0,
                phase: Phase::Done,
                life: Life::Live,
                running: 0,
            };
            let mut world = World {
                region: Region::new(n, config.lent),
                clients: vec![client; n],
                books: Books {
                    lent: config.lent,
                    ..Books::default()
                },
                repairs: Vec::new(),
                kills: 0,
                fifo: Vec::new(),
                barrier: Barrier::Down,
            };
            for seat in seats(n) {
                world.start_next_op(seat, config);
            }
            world
        }

        fn client(&mut self, seat: Seat) -> &mut Client {
            &mut self.clients[usize::from(seat.0)]
        }

        fn finished(&self, seat: Seat, config: &Config) -> bool {
            let client = &self.clients[usize::from(seat.0)];
            client.phase == Phase::Done
                && usize::from(client.next) == config.scripts[usize::from(seat.0)].len()
        }

        /// Between operations, the client starts its next one (a release
        /// with nothing held is skipped: its acquire gave up).
        fn start_next_op(&mut self, seat: Seat, config: &Config) {
            let script = &config.scripts[usize::from(seat.0)];
            let client = self.client(seat);
            while client.phase == Phase::Done && usize::from(client.next) < script.len() {
                let op = script[usize::from(client.next)];
                client.next += 1;
                client.phase = match op {
                    Acquire | AcquireOrGiveUp => Phase::Claim,
                    Release if client.running > 0 => Phase::Hand,
                    Release => Phase::Done,
                };
            }
        }

        fn current_op(&self, seat: Seat, config: &Config) -> Op {
            let next = self.clients[usize::from(seat.0)].next;
            config.scripts[usize::from(seat.0)][usize::from(next) - 1]
        }

        /// Every move possible from here.
        fn moves(&self, config: &Config) -> Vec<Move> {
            let mut moves = Vec::new();
            for seat in seats(self.clients.len()) {
                let client = &self.clients[usize::from(seat.0)];
                match client.life {
                    Life::Live if !self.finished(seat, config) => {
                        match client.phase {
                            Phase::Asleep(_) => {
                                if self.current_op(seat, config) == AcquireOrGiveUp {
                                    moves.push(Move::TimeOut(seat));
                                }
                            }
                            _ => moves.push(Move::Step(seat)),
                        }
                        if self.kills < config.kills {
                            moves.push(Move::Kill(seat));
                        }
                    }
                    Life::OnSocket if client.running > 0 => moves.push(Move::SocketRelease(seat)),
                    _ => {}
                }
            }
            if self.broker_step_exists() {
                moves.push(Move::Broker);
            }
            match (config.policy, self.barrier) {
                (Policy::Closes | Policy::ClosesAndReopens, Barrier::Down) => {
                    moves.push(Move::Close)
                }
                (Policy::ClosesAndReopens, Barrier::Up) => moves.push(Move::Reopen),
                _ => {}
            }
            moves
        }

        fn broker_step_exists(&self) -> bool {
            self.clone().broker_step().is_some()
        }

        /// The broker's next step, in its own fixed order: take free
        /// tokens out while the barrier stands, collect what releasers
        /// returned to it, repair the dead, give back what it holds.
        fn broker_step(&mut self) -> Option<Event> {
            let books = &mut self.books;
            if self.barrier == Barrier::Up {
                if let Some(event) = self.region.drain_step(&mut books.in_hand) {
                    return Some(event);
                }
            }
            for seat in seats(self.clients.len()) {
                if let Some(event) = self.region.collect_step(seat, &mut books.in_hand) {
                    return Some(event);
                }
            }
            while let Some(&dead) = self.repairs.first() {
                match self.region.repair_step(dead, &mut books.in_hand) {
                    Some(event) => return Some(event),
                    None => {
                        self.repairs.remove(0);
                    }
                }
            }
            self.region.regrant_step(&mut books.in_hand)
        }

        /// Plays `mv`, checking what a single move must respect.
        fn play(&mut self, mv: Move, config: &Config) -> Result<(), String> {
            let free_before = self.region.free();
            match mv {
                Move::Step(seat) => {
                    let phase = self.clients[usize::from(seat.0)].phase;
                    let (next, event) = self.region.step(seat, phase);
                    let client = self.client(seat);
                    match phase {
                        Phase::Take(_) => client.running += 1,
                        Phase::Hand => client.running -= 1,
                        _ => {}
                    }
                    client.phase = next;
                    if self.barrier == Barrier::Up && matches!(event, Event::Granted(_)) {
                        return Err(format!("{seat:?} gave a token past the broker's barrier"));
                    }
                    self.observe(Some(seat), event)?;
                    self.start_next_op(seat, config);
                }
                Move::TimeOut(seat) => {
                    let Phase::Asleep(t) = self.clients[usize::from(seat.0)].phase else {
                        unreachable!("only a sleeper times out")
                    };
                    let (next, event) = self.region.time_out(seat, t);
                    self.client(seat).phase = next;
                    self.observe(Some(seat), event)?;
                    self.start_next_op(seat, config);
                }
                Move::Kill(seat) => {
                    let client = self.client(seat);
                    client.life = Life::Killed;
                    client.running = 0;
                    self.repairs.push(seat);
                    self.kills += 1;
                }
                Move::SocketRelease(seat) => {
                    self.client(seat).running -= 1;
                    self.books.on_socket -= 1;
                    self.books.in_hand += 1;
                }
                Move::Broker => {
                    let event = self.broker_step().expect("a broker move has a step");
                    self.observe(None, event)?;
                }
                Move::Close => {
                    self.region.close();
                    self.barrier = Barrier::Up;
                }
                Move::Reopen => {
                    self.region.reopen();
                    self.barrier = Barrier::Lifted;
                }
            }
            if self.barrier == Barrier::Up && self.region.free() > free_before {
                return Err(format!("{mv:?} freed a token past the broker's barrier"));
            }
            Ok(())
        }

        fn claimer(&self, t: Ticket) -> Option<Seat> {
            match self.region.slots[t].claim {
                Claim::Claimed(Party::Seat(seat)) => Some(seat),
                _ => None,
            }
        }

        /// What the rest of the world sees of `event`: the ghost queue,
        /// checked on every grant, and the futex.
        fn observe(&mut self, actor: Option<Seat>, event: Event) -> Result<(), String> {
            match event {
                Event::Quiet | Event::Stopped => {}
                Event::Enqueued(_) => self.fifo.push(actor.expect("clients enqueue")),
                Event::ClaimedFree(t) => {
                    if let Some(first) = self.fifo.first() {
                        return Err(format!(
                            "{actor:?} took ticket {t}'s token while {first:?} waited"
                        ));
                    }
                }
                Event::Granted(t) | Event::GrantedAndWoke(t) => {
                    let to = self.claimer(t);
                    if let Some(&first) = self.fifo.first() {
                        if to != Some(first) {
                            return Err(format!(
                                "ticket {t}'s token went to {to:?}, not to {first:?}, who waited longest"
                            ));
                        }
                        self.fifo.remove(0);
                    }
                    if matches!(event, Event::GrantedAndWoke(_)) {
                        self.wake(t);
                    }
                }
                Event::Wake(t) => self.wake(t),
                Event::Cancelled(t) => {
                    let gone = self.claimer_of_cancelled(t);
                    self.fifo.retain(|&s| s != gone);
                }
            }
            Ok(())
        }

        fn claimer_of_cancelled(&self, t: Ticket) -> Seat {
            match self.region.slots[t].claim {
                Claim::Cancelled(Party::Seat(seat)) => seat,
                other => unreachable!("ticket {t} was cancelled, yet its claim is {other:?}"),
            }
        }

        /// futex_wake on slot `t`: its claimer wakes if it sleeps there.
        fn wake(&mut self, t: Ticket) {
            let Some(seat) = self.claimer(t) else { return };
            let client = self.client(seat);
            if client.phase == Phase::Asleep(t) {
                client.phase = Phase::Check(t);
            }
        }

        /// What every state must respect.
        fn check(&self, config: &Config) -> Result<(), String> {
            let counted = self.books.counted(&self.region);
            if counted != config.lent {
                return Err(format!("{counted} tokens counted, {} lent", config.lent));
            }
            let one_by_one: Vec<u32> = seats(self.region.records.len())
                .map(|seat| self.region.attributed(seat))
                .collect();
            if self.region.attributions() != one_by_one {
                return Err(format!(
                    "attributions in one pass {:?}, seat by seat {one_by_one:?}",
                    self.region.attributions()
                ));
            }
            let mut running = 0;
            let mut held = 0;
            for seat in seats(self.clients.len()) {
                let client = &self.clients[usize::from(seat.0)];
                let record = self.region.records[usize::from(seat.0)];
                held += record.held;
                match client.life {
                    Life::Live => {
                        running += client.running;
                        if record.held != client.running {
                            return Err(format!(
                                "{seat:?} runs {} jobs, its record says it holds {}",
                                client.running, record.held
                            ));
                        }
                    }
                    Life::Killed if !self.repairs.contains(&seat) => {
                        self.check_nothing_attributed(seat, "repaired")?
                    }
                    Life::OnSocket => {
                        running += client.running;
                        self.check_nothing_attributed(seat, "dropped")?
                    }
                    Life::Killed => {}
                }
            }
            if running > config.lent || held > config.lent {
                return Err(format!(
                    "{running} jobs run, {held} tokens held, {} lent",
                    config.lent
                ));
            }
            let audit = self.region.audit(&self.books);
            if !audit.balanced() {
                return Err(format!("the broker's audit finds fault: {audit:?}"));
            }
            self.check_words()
        }

        /// Every slot and record of the state fits the real region's
        /// words (`fastpath::words`) and comes back from them whole.
        fn check_words(&self) -> Result<(), String> {
            use baton_core::fastpath::words::{IntentWord, RecordWord, SlotWord};
            for (t, &slot) in self.region.slots.iter().enumerate() {
                let word = SlotWord {
                    gen: t as u32,
                    slot,
                    sleeping: false,
                };
                if SlotWord::unpack(word.pack()) != Ok(word) {
                    return Err(format!(
                        "ticket {t}'s slot {slot:?} does not survive its word"
                    ));
                }
            }
            for record in &self.region.records {
                let word = RecordWord {
                    held: u16::try_from(record.held).map_err(|_| "held past 16 bits")?,
                    returned: u8::try_from(record.returned).map_err(|_| "returned past 8 bits")?,
                    intent: match record.intent {
                        Intent::Idle => IntentWord::Idle,
                        Intent::Taking(t) => IntentWord::Taking(t as u32 & 0xff_ffff),
                        Intent::Releasing => IntentWord::Releasing,
                    },
                    changes: 0,
                };
                if RecordWord::unpack(word.pack()) != Ok(word) {
                    return Err(format!("{record:?} does not survive its word"));
                }
            }
            Ok(())
        }

        fn check_nothing_attributed(&self, seat: Seat, what: &str) -> Result<(), String> {
            let party = Party::Seat(seat);
            let record = self.region.records[usize::from(seat.0)];
            if record != Record::default()
                || self.region.claimed_by(party).is_some()
                || self.region.unacked_grant_by(party).is_some()
            {
                return Err(format!(
                    "{seat:?}, {what}, still has something in the region"
                ));
            }
            Ok(())
        }

        /// What a state with no move left but kills and policy changes must
        /// respect: nobody sleeps forever, and every token is back.
        fn check_end(&self, config: &Config) -> Result<(), String> {
            for seat in seats(self.clients.len()) {
                let client = &self.clients[usize::from(seat.0)];
                if client.life == Life::Live && !self.finished(seat, config) {
                    return Err(format!("{seat:?} never finished: {:?}", client.phase));
                }
            }
            let back = self.region.free() + self.books.in_hand;
            if back != config.lent {
                return Err(format!("{back} tokens back of {}", config.lent));
            }
            if self.barrier != Barrier::Up && self.books.in_hand > 0 {
                return Err(format!("the broker keeps {} tokens", self.books.in_hand));
            }
            Ok(())
        }
    }

    /// What a search saw.
    #[derive(Debug, Default)]
    struct Stats {
        states: usize,
        moves: usize,
        ends: usize,
        /// Kills, by the phase the client was killed in.
        kills: HashMap<String, usize>,
        /// The phases live clients were seen in.
        phases: BTreeSet<String>,
    }

    /// Every state reachable from `start`, each checked; a violation comes
    /// back with the moves that lead to it.
    fn explore(config: &Config, start: World) -> Result<Search, String> {
        let mut states = vec![start];
        let mut parent: Vec<Option<(usize, Move)>> = vec![None];
        let mut index = StateIndex::default();
        index.insert(&states, 0);
        let mut queue = VecDeque::from([0]);
        let mut stats = Stats::default();
        let failure = |states: &[World], parent: &[Option<(usize, Move)>], at, why: String| {
            format!("{why}\nafter {}", trace(states, parent, at))
        };
        states[0]
            .check(config)
            .map_err(|why| failure(&states, &parent, 0, why))?;
        while let Some(at) = queue.pop_front() {
            for client in states[at].clients.iter().filter(|c| c.life == Life::Live) {
                if client.phase != Phase::Done {
                    stats.phases.insert(phase_name(client.phase));
                }
            }
            let moves = states[at].moves(config);
            if moves.iter().all(|mv| mv.may_never_happen()) {
                stats.ends += 1;
                states[at]
                    .check_end(config)
                    .map_err(|why| failure(&states, &parent, at, why))?;
            }
            for mv in moves {
                stats.moves += 1;
                if let Move::Kill(seat) = mv {
                    let phase = states[at].clients[usize::from(seat.0)].phase;
                    *stats.kills.entry(phase_name(phase)).or_default() += 1;
                }
                let mut next = states[at].clone();
                let played = next.play(mv, config).and_then(|()| next.check(config));
                if let Err(why) = played {
                    states.push(next);
                    parent.push(Some((at, mv)));
                    return Err(failure(&states, &parent, states.len() - 1, why));
                }
                states.push(next);
                if index.insert(&states, states.len() - 1) {
                    parent.push(Some((at, mv)));
                    queue.push_back(states.len() - 1);
                } else {
                    states.pop();
                }
            }
        }
        stats.states = states.len();
        Ok(Search { stats, states })
    }

    struct Search {
        stats: Stats,
        states: Vec<World>,
    }

    /// A set of states by their index in the search's list: each state is
    /// stored once. Open addressing over the 64-bit hash.
    #[derive(Default)]
    struct StateIndex(HashMap<u64, usize>);

    impl StateIndex {
        /// Adds `states[i]`; false if an equal state is there already.
        fn insert(&mut self, states: &[World], i: usize) -> bool {
            let mut hasher = DefaultHasher::new();
            states[i].hash(&mut hasher);
            let mut key = hasher.finish();
            loop {
                match self.0.get(&key) {
                    None => {
                        self.0.insert(key, i);
                        return true;
                    }
                    Some(&j) if states[j] == states[i] => return false,
                    Some(_) => key = key.wrapping_add(1),
                }
            }
        }
    }

    fn trace(states: &[World], parent: &[Option<(usize, Move)>], mut at: usize) -> String {
        let mut moves = Vec::new();
        while let Some((from, mv)) = parent[at] {
            moves.push(format!("{mv:?}"));
            at = from;
        }
        moves.reverse();
        let end = states.last().map(|w| format!("{w:#?}")).unwrap_or_default();
        format!("{}\nin\n{end}", moves.join(", "))
    }

    fn phase_name(phase: Phase) -> String {
        let name = format!("{phase:?}");
        name.split('(').next().unwrap_or_default().to_string()
    }

    /// Explores `config` with every kill, checks that it reached at least
    /// `min_states` states and killed a client in every phase a client can
    /// be killed in, and prints what it saw.
    fn prove(name: &str, config: Config, min_states: usize) -> Stats {
        let search =
            explore(&config, World::new(&config)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let stats = search.stats;
        println!(
            "{name}: {} states, {} moves, {} ends, kills by phase {:?}",
            stats.states,
            stats.moves,
            stats.ends,
            stats.kills.iter().collect::<BTreeMap<_, _>>()
        );
        assert!(
            stats.states >= min_states,
            "{name}: only {} states",
            stats.states
        );
        if config.kills > 0 {
            for phase in &stats.phases {
                assert!(
                    stats.kills.contains_key(phase),
                    "{name}: nobody killed in {phase}"
                );
            }
        }
        stats
    }

    const ONCE: &[Op] = &[Acquire, Release];
    const TWICE: &[Op] = &[Acquire, Release, Acquire, Release];
    const PATIENT_ONCE: &[Op] = &[AcquireOrGiveUp, Release];

    #[test]
    fn one_token_three_clients_any_one_killed() {
        prove(
            "1 token, 3 clients",
            Config::new(1, &[ONCE, ONCE, ONCE], 1),
            10_000,
        );
    }

    #[test]
    fn two_tokens_three_clients_any_two_killed() {
        let config = Config::new(2, &[ONCE, ONCE, ONCE], 2);
        prove("2 tokens, 3 clients, 2 kills", config, 150_000);
    }

    #[test]
    fn one_token_two_clients_twice_each_one_once() {
        let config = Config::new(1, &[TWICE, TWICE, ONCE], 1);
        prove("1 token, 3 clients, 2 of them twice", config, 100_000);
    }

    #[test]
    fn waits_that_time_out() {
        let config = Config::new(1, &[PATIENT_ONCE, PATIENT_ONCE, ONCE], 1);
        prove("1 token, 3 clients, 2 may time out", config, 10_000);
    }

    #[test]
    fn the_barrier_goes_up_and_down_at_any_moment() {
        let config = Config::new(1, &[ONCE, ONCE, PATIENT_ONCE], 1);
        let config = config.policy(Policy::ClosesAndReopens);
        prove("1 token, 3 clients, barrier up and down", config, 200_000);
    }

    #[test]
    fn the_barrier_stays_up() {
        let config = Config::new(1, &[ONCE, ONCE, ONCE], 1).policy(Policy::Closes);
        prove("1 token, 3 clients, barrier for good", config, 50_000);
    }

    /// What a client may write into its own record by mistake: every
    /// count up to past the limit, every intent, naming every ticket.
    fn garbage(region: &Region, lent: u32) -> Vec<Record> {
        let mut intents = vec![Intent::Idle, Intent::Releasing];
        intents.extend((0..=region.slots.len()).map(Intent::Taking));
        let mut records = Vec::new();
        for held in 0..=lent + 1 {
            for &intent in &intents {
                for returned in 0..=1 {
                    records.push(Record {
                        held,
                        intent,
                        returned,
                    });
                }
            }
        }
        records
    }

    #[derive(Debug, Default)]
    struct GarbageStats {
        written: usize,
        harmless: usize,
        one_dropped: usize,
        all_dropped: usize,
        /// Distinct states right after a single drop, and all the states
        /// explored from them.
        dropped_worlds: usize,
        states_after: usize,
    }

    /// In every state where a client is between operations, it writes
    /// every garbage value into its record in turn. The broker's audit
    /// either balances, and then the garbage changed nothing the region
    /// counts for it, or it does not, and the broker's answer balances
    /// the books again, leaves nothing in the region for the clients it
    /// dropped, and (a single suspect) books on its connection exactly
    /// the tokens it runs jobs with. From there the others go on, and
    /// the dropped client gives its tokens back over the socket: every
    /// interleaving keeps the invariants and ends with every token back.
    #[test]
    fn garbage_in_a_record_is_caught_and_repaired() {
        let config = Config::new(2, &[ONCE, ONCE, ONCE], 0);
        let reachable = explore(&config, World::new(&config)).expect("the honest runs pass");
        let mut stats = GarbageStats::default();
        let mut dropped_worlds = HashSet::new();
        for world in &reachable.states {
            for seat in seats(world.clients.len()) {
                let client = &world.clients[usize::from(seat.0)];
                if !matches!(client.phase, Phase::Claim | Phase::Hand | Phase::Done) {
                    continue;
                }
                for record in garbage(&world.region, config.lent) {
                    if record == world.region.records[usize::from(seat.0)] {
                        continue;
                    }
                    stats.written += 1;
                    let mut bad = world.clone();
                    bad.region.records[usize::from(seat.0)] = record;
                    let audit = bad.region.audit(&bad.books);
                    if audit.balanced() {
                        let honest = world.region.attributed(seat);
                        assert_eq!(bad.region.attributed(seat), honest, "{record:?} passed");
                        stats.harmless += 1;
                        continue;
                    }
                    let answer = bad.region.answer(&audit, &mut bad.books);
                    for t in answer.wake {
                        bad.wake(t);
                    }
                    let after = bad.region.audit(&bad.books);
                    assert!(
                        after.balanced(),
                        "{record:?} by {seat:?}: {audit:?}, then {after:?}"
                    );
                    for &dropped in &answer.dropped {
                        bad.check_nothing_attributed(dropped, "dropped").unwrap();
                    }
                    if answer.dropped != [seat] {
                        stats.all_dropped += 1;
                        continue;
                    }
                    stats.one_dropped += 1;
                    let running = bad.clients[usize::from(seat.0)].running;
                    assert_eq!(bad.books.on_socket, running, "{record:?} by {seat:?}");
                    bad.client(seat).life = Life::OnSocket;
                    if !dropped_worlds.insert(bad.clone()) {
                        continue; // other garbage led here already
                    }
                    let rest = explore(&config, bad)
                        .unwrap_or_else(|e| panic!("{record:?} by {seat:?}, dropped: {e}"));
                    stats.states_after += rest.stats.states;
                }
            }
        }
        stats.dropped_worlds = dropped_worlds.len();
        println!("garbage: {} states, {stats:?}", reachable.states.len());
        assert!(stats.written > 5_000, "{stats:?}");
        assert!(stats.harmless > 0 && stats.all_dropped > 0, "{stats:?}");
        assert!(
            stats.one_dropped > 1_000 && stats.dropped_worlds > 500,
            "{stats:?}"
        );
        assert!(stats.states_after > 50_000, "{stats:?}");
    }
}
