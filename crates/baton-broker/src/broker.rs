//! The pool plus what the transports need around it: who each client is,
//! since when it holds or waits, and where its grants must be delivered.
//!
//! One `Broker` is shared by every transport behind a mutex. A call that
//! frees tokens returns grants; [`Broker::route`] files each under the
//! transport that owns the client, and that transport's thread is woken to
//! deliver them. Nothing here blocks or does I/O besides reading the clock.

use baton_core::gates::{GateConfig, Gates, Reading};
use baton_core::status::{self, Status};
use baton_core::{Acquired, ClientId, Grant, Pool, PoolError, Tag};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

/// Which way a client came in. Grants are routed by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// A connection to the native socket (including `baton run`).
    Socket,
    /// A process using the FUSE token file.
    Fuse,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Socket => "socket",
            Transport::Fuse => "fuse",
        }
    }
}

/// What the broker remembers about a client besides its tokens.
#[derive(Debug, Clone)]
pub struct ClientMeta {
    pub pid: u32,
    pub command: String,
    pub transport: Transport,
    /// Set when the client goes from holding nothing to holding something.
    pub holding_since: Option<SystemTime>,
    /// When each pending request started waiting.
    pub waiting_since: HashMap<Tag, SystemTime>,
}

impl ClientMeta {
    pub fn new(pid: u32, command: String, transport: Transport) -> Self {
        ClientMeta { pid, command, transport, holding_since: None, waiting_since: HashMap::new() }
    }
}

/// Tells a transport's thread that grants wait for it (see [`Broker::on_grants`]).
pub struct GrantHook(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for GrantHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrantHook")
    }
}

/// The pool with its clients' metadata and undelivered grants.
#[derive(Debug)]
pub struct Broker {
    pool: Pool<ClientMeta>,
    undelivered: HashMap<Transport, Vec<Grant>>,
    hooks: HashMap<Transport, GrantHook>,
    /// The memory and load gates (none configured: no cap).
    gates: Gates,
    /// The clock the gates' times are measured on.
    started: (Instant, SystemTime),
}

impl Broker {
    pub fn new(limit: u32) -> Result<Self, PoolError> {
        Ok(Broker {
            pool: Pool::new(limit)?,
            undelivered: HashMap::new(),
            hooks: HashMap::new(),
            gates: Gates::new(GateConfig::default()),
            started: (Instant::now(), SystemTime::now()),
        })
    }

    /// Calls `hook` whenever a call files grants for `transport`, so that
    /// whichever thread caused them, the transport's own thread learns of
    /// them. The hook runs under the broker lock: it must only wake.
    pub fn on_grants(&mut self, transport: Transport, hook: impl Fn() + Send + Sync + 'static) {
        self.hooks.insert(transport, GrantHook(Box::new(hook)));
    }

    pub fn pool(&self) -> &Pool<ClientMeta> {
        &self.pool
    }

    pub fn connect(&mut self, meta: ClientMeta) -> ClientId {
        self.pool.connect(meta)
    }

    pub fn acquire(&mut self, id: ClientId, tag: Tag, tokens: u32) -> Result<Acquired, PoolError> {
        let outcome = self.pool.acquire(id, tag, tokens)?;
        let meta = self.pool.meta_mut(id).expect("acquire checked the client");
        match outcome {
            Acquired::Granted => {
                Self::note_holding(meta);
                self.note_granted(tokens);
            }
            Acquired::Queued => {
                meta.waiting_since.insert(tag, SystemTime::now());
            }
        }
        Ok(outcome)
    }

    pub fn try_acquire(&mut self, id: ClientId, tokens: u32) -> Result<bool, PoolError> {
        let granted = self.pool.try_acquire(id, tokens)?;
        if granted {
            Self::note_holding(self.pool.meta_mut(id).expect("try_acquire checked the client"));
            self.note_granted(tokens);
        }
        Ok(granted)
    }

    /// A client that just got tokens holds since now, unless it already held
    /// some (release clears the time when it holds none).
    fn note_holding(meta: &mut ClientMeta) {
        meta.holding_since.get_or_insert_with(SystemTime::now);
    }

    /// Gives tokens back; grants that follow are routed to their transports.
    pub fn release(&mut self, id: ClientId, tokens: u32) -> Result<(), PoolError> {
        let grants = self.pool.release(id, tokens)?;
        if self.pool.held_by(id) == 0 {
            self.pool.meta_mut(id).expect("release checked the client").holding_since = None;
        }
        self.route(grants);
        Ok(())
    }

    /// Withdraws a pending request; returns the tokens it waited for.
    pub fn cancel(&mut self, id: ClientId, tag: Tag) -> u32 {
        let (tokens, grants) = self.pool.cancel(id, tag);
        if let Some(meta) = self.pool.meta_mut(id) {
            meta.waiting_since.remove(&tag);
        }
        self.route(grants);
        tokens
    }

    /// Forgets a client; returns the tokens reclaimed from it.
    pub fn disconnect(&mut self, id: ClientId) -> u32 {
        let (reclaimed, grants) = self.pool.disconnect(id);
        self.route(grants);
        reclaimed
    }

    pub fn set_limit(&mut self, limit: u32) -> Result<u32, PoolError> {
        let old = self.pool.limit();
        let grants = self.pool.set_limit(limit)?;
        self.route(grants);
        Ok(old)
    }

    /// Takes the grants waiting for delivery by one transport.
    pub fn take_grants(&mut self, transport: Transport) -> Vec<Grant> {
        self.undelivered.remove(&transport).unwrap_or_default()
    }

    /// Configures the gates (`--min-mem-available` and the others); an
    /// empty configuration removes them and lifts the cap they set.
    pub fn set_gates(&mut self, config: GateConfig) {
        let now = self.clock();
        self.gates.set_config(config, now);
        self.refresh_cap();
    }

    /// Sets one gate by its protocol name; returns its threshold now.
    ///
    /// # Errors
    /// The name or the value is not valid, in words for the client.
    pub fn set_gate(&mut self, name: &str, value: Option<f64>) -> Result<Option<f64>, String> {
        let config = self.gate_config().with(name, value)?;
        self.set_gates(config);
        Ok(config.value_of(name))
    }

    /// The gates' configuration (all off if none).
    pub fn gate_config(&self) -> GateConfig {
        self.gates.config()
    }

    /// A new measurement of the machine: the gates open or close on it.
    pub fn observe(&mut self, reading: Reading) {
        let (held, now) = (self.pool.held(), self.clock());
        self.gates.observe(reading, held, now);
        self.refresh_cap();
    }

    fn clock(&self) -> Duration {
        self.started.0.elapsed()
    }

    /// Tokens just handed out count as young jobs for the memory gate, and
    /// use up part of what it allows.
    fn note_granted(&mut self, tokens: u32) {
        if self.gates.config().any() {
            let now = self.clock();
            self.gates.granted(tokens, now);
            self.refresh_cap();
        }
    }

    /// Sets the pool's admission cap to what the gates allow now, and
    /// delivers any grants a higher cap lets through.
    fn refresh_cap(&mut self) {
        let cap = self.gates.allowance(self.pool.held(), self.started.0.elapsed());
        let grants = self.pool.set_admission_cap(cap);
        self.route(grants);
    }

    fn route(&mut self, grants: Vec<Grant>) {
        if grants.is_empty() {
            return;
        }
        let granted = grants.iter().map(|g| g.tokens).sum();
        self.file(grants);
        self.note_granted(granted);
    }

    /// Files each grant under its client's transport and wakes those.
    fn file(&mut self, grants: Vec<Grant>) {
        let now = SystemTime::now();
        let mut woken = Vec::new();
        for grant in grants {
            let meta = self.pool.meta_mut(grant.client).expect("grants go to connected clients");
            meta.waiting_since.remove(&grant.tag);
            meta.holding_since.get_or_insert(now);
            self.undelivered.entry(meta.transport).or_default().push(grant);
            if !woken.contains(&meta.transport) {
                woken.push(meta.transport);
            }
        }
        for transport in woken {
            if let Some(GrantHook(hook)) = self.hooks.get(&transport) {
                hook();
            }
        }
    }

    /// The document `STATUS` returns.
    pub fn status(&self) -> Status {
        let mut holders: Vec<_> = self
            .pool
            .clients()
            .filter(|c| c.held > 0)
            .map(|c| status::Holder {
                pid: c.meta.pid,
                command: c.meta.command.clone(),
                tokens: c.held,
                since: epoch_seconds(c.meta.holding_since.unwrap_or(SystemTime::now())),
                transport: c.meta.transport.name().to_string(),
            })
            .collect();
        holders.sort_by(|a, b| a.since.total_cmp(&b.since));
        let waiters = self
            .pool
            .queue()
            .map(|(id, tag, tokens)| {
                let meta = self.pool.meta(id).expect("waiters are connected");
                status::Waiter {
                    pid: meta.pid,
                    command: meta.command.clone(),
                    tokens,
                    since: epoch_seconds(meta.waiting_since.get(&tag).copied().unwrap_or(SystemTime::now())),
                    transport: meta.transport.name().to_string(),
                }
            })
            .collect();
        let t = self.pool.totals();
        let gates = self.gates.views().into_iter().map(|v| self.gate_status(v)).collect();
        Status {
            version: baton_core::protocol::VERSION,
            broker_pid: std::process::id(),
            limit: self.pool.limit(),
            free: self.pool.free(),
            held: self.pool.held(),
            holders,
            waiters,
            totals: status::Totals {
                granted: t.granted,
                released: t.released,
                reclaimed: t.reclaimed,
                waits: t.waits,
                clients: self.pool.clients().count() as u64,
            },
            gates,
        }
    }

    fn gate_status(&self, view: baton_core::gates::GateView) -> status::Gate {
        status::Gate {
            name: view.kind.name().to_string(),
            open: view.open,
            value: view.value,
            threshold: view.threshold,
            closed_since: view.closed_since.map(|d| epoch_seconds(self.started.1 + d)),
        }
    }
}

fn epoch_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| (d.as_secs_f64() * 1000.0).round() / 1000.0)
}
