//! Gates: whether the machine can take one more job now.
//!
//! The pool decides *who* gets a token; the gates decide *whether* a free
//! token may be handed out at all, from what the broker measured: available
//! memory, memory pressure (PSI), and the run queue. A closed gate never
//! takes a token back; it only stops new grants, and never below
//! `min_jobs` tokens held, so a build always makes progress.
//!
//! Admission alone cannot see a job that was granted a moment ago and has
//! not yet grown: eight tokens granted in the same millisecond all see the
//! same free memory. So the memory gate also counts what *young* jobs
//! (granted less than [`GateConfig::settle`] ago) are expected to take, and
//! learns that expectation from the machine: how far available memory fell
//! while each grant was young, per token granted. The estimate follows a
//! larger figure at once and a smaller one slowly. Until it has measured
//! one grant, it admits one young job at a time. docs/adaptive.md explains
//! the choice.
//!
//! With `--on-memory-pressure pause`, the gates also decide which running
//! jobs to stop while memory is short, and when a stopped one goes on
//! ([`Gates::pause_action`], [`jobs_to_pause`]).
//!
//! Nothing here reads a file or a clock: the broker passes readings and
//! times in, so every rule is tested on its own.

use std::time::Duration;

/// What the user asked the gates to keep.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GateConfig {
    /// Grant nothing while available memory is below this many bytes.
    pub min_mem_available: Option<u64>,
    /// Grant nothing while memory pressure (PSI `some avg10`, percent) is
    /// above this.
    pub max_mem_pressure: Option<f64>,
    /// Grant nothing while the run queue (runnable tasks) is above this.
    pub max_load: Option<f64>,
    /// Never hold back tokens while fewer than this many are held.
    pub min_jobs: u32,
    /// How long a newly granted job counts as young: the time a job needs
    /// to show the memory it will use.
    pub settle: Duration,
    /// `--on-memory-pressure pause`: while available memory is below
    /// `min_mem_available`, stop (SIGSTOP) the jobs that still grow but the
    /// first started, rather than let the OOM killer pick one.
    pub pause: bool,
}

/// How long a new job counts as young unless told otherwise: compilers and
/// linkers show most of their memory within their first second.
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(1);

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            min_mem_available: None,
            max_mem_pressure: None,
            max_load: None,
            min_jobs: 1,
            settle: DEFAULT_SETTLE,
            pause: false,
        }
    }
}

impl GateConfig {
    /// Whether any gate is configured (the broker measures nothing if not).
    pub fn any(&self) -> bool {
        self.min_mem_available.is_some()
            || self.max_mem_pressure.is_some()
            || self.max_load.is_some()
    }

    /// The configuration with one threshold changed, by the names of the
    /// protocol's `GATE` request; `None` turns that gate off (`min-jobs`:
    /// back to 1).
    ///
    /// # Errors
    /// An unknown name, or a value out of range, with what is expected.
    pub fn with(mut self, name: &str, value: Option<f64>) -> Result<Self, String> {
        let positive = |v: f64| {
            if v > 0.0 && v.is_finite() {
                Ok(v)
            } else {
                Err(format!("{name} must be above 0"))
            }
        };
        match name {
            "mem-available" => {
                self.min_mem_available = value.map(positive).transpose()?.map(|v| v as u64)
            }
            "mem-pressure" => {
                self.max_mem_pressure = value
                    .map(|v| {
                        if (0.0..=100.0).contains(&v) {
                            Ok(v)
                        } else {
                            Err("mem-pressure is a percentage: 0 to 100".to_string())
                        }
                    })
                    .transpose()?
            }
            "load" => self.max_load = value.map(positive).transpose()?,
            "min-jobs" => {
                self.min_jobs = match value {
                    None => 1,
                    Some(v) if v >= 1.0 && v.fract() == 0.0 && v <= f64::from(u32::MAX) => v as u32,
                    Some(_) => {
                        return Err("min-jobs must be a whole number, at least 1".to_string())
                    }
                }
            }
            _ => return Err(format!("unknown gate {name:?}")),
        }
        Ok(self)
    }

    /// The threshold `GATE <name>` reports.
    pub fn value_of(&self, name: &str) -> Option<f64> {
        match name {
            "mem-available" => self.min_mem_available.map(|v| v as f64),
            "mem-pressure" => self.max_mem_pressure,
            "load" => self.max_load,
            "min-jobs" => Some(f64::from(self.min_jobs)),
            _ => None,
        }
    }
}

/// One measurement of the machine. A `None` is a figure this machine does
/// not offer (no PSI on an old kernel): its gate stays open.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Reading {
    /// Bytes of memory available to new jobs.
    pub mem_available: Option<u64>,
    /// PSI memory `some avg10`, percent.
    pub mem_pressure: Option<f64>,
    /// Runnable tasks now.
    pub runnable: Option<f64>,
}

/// The three gates, in the order `baton status` lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateKind {
    /// `--min-mem-available`.
    MemAvailable,
    /// `--max-mem-pressure`.
    MemPressure,
    /// `--max-load`.
    Load,
}

impl GateKind {
    /// The name in `baton status` and its JSON.
    pub fn name(self) -> &'static str {
        match self {
            GateKind::MemAvailable => "mem-available",
            GateKind::MemPressure => "mem-pressure",
            GateKind::Load => "load",
        }
    }
}

/// One gate as `baton status` shows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateView {
    /// Which gate.
    pub kind: GateKind,
    /// Whether it lets new tokens out.
    pub open: bool,
    /// The last reading (bytes, percent or tasks); None if not measured.
    pub value: Option<f64>,
    /// The configured threshold, in the same unit.
    pub threshold: f64,
    /// Since when it has been closed (the broker's clock, as passed in).
    pub closed_since: Option<Duration>,
}

/// The gates' state: the configuration, the last reading, what was learned
/// about the jobs' memory, and the young grants.
#[derive(Debug, Clone)]
pub struct Gates {
    config: GateConfig,
    reading: Reading,
    /// Expected memory of one job, learned; None until measured.
    per_job: Option<u64>,
    /// Available memory while no token was held: the machine without jobs.
    idle_available: Option<u64>,
    /// Grants still young, oldest first.
    young: Vec<YoungGrant>,
    pauses: Pauses,
    closed_since: [Option<Duration>; 3],
}

impl Gates {
    /// Gates with nothing measured yet.
    pub fn new(config: GateConfig) -> Self {
        Gates {
            config,
            reading: Reading::default(),
            per_job: None,
            idle_available: None,
            young: Vec::new(),
            pauses: Pauses::default(),
            closed_since: [None; 3],
        }
    }

    /// The configuration.
    pub fn config(&self) -> GateConfig {
        self.config
    }

    /// Changes the configuration at `now` (`baton limit`); what was
    /// learned stays.
    pub fn set_config(&mut self, config: GateConfig, now: Duration) {
        self.config = config;
        self.note_closed(now);
    }

    /// The memory one job is expected to take, once measured.
    pub fn per_job(&self) -> Option<u64> {
        self.per_job
    }

    /// Takes a new reading, made at `now` while `held` tokens were held.
    pub fn observe(&mut self, reading: Reading, held: u32, now: Duration) {
        self.reading = reading;
        let out_of_danger = matches!((reading.mem_available, self.config.min_mem_available), (Some(a), Some(min)) if a >= min);
        if out_of_danger {
            self.pauses.last_stop_available = None;
        }
        if let Some(available) = reading.mem_available {
            for grant in &mut self.young {
                grant.lowest = Some(grant.lowest.map_or(available, |l| l.min(available)));
            }
        }
        self.settle(now);
        if let Some(available) = reading.mem_available {
            self.learn_from_all(available, held);
        }
        self.note_closed(now);
    }

    /// Remembers since when each gate has been closed.
    fn note_closed(&mut self, now: Duration) {
        for kind in [
            GateKind::MemAvailable,
            GateKind::MemPressure,
            GateKind::Load,
        ] {
            let open = self.is_open(kind);
            let slot = &mut self.closed_since[kind as usize];
            *slot = if open {
                None
            } else {
                Some(slot.unwrap_or(now))
            };
        }
    }

    /// Notes `tokens` granted at `now`: they are young jobs until settled.
    pub fn granted(&mut self, tokens: u32, now: Duration) {
        let available = self.reading.mem_available;
        self.young.push(YoungGrant {
            at: now,
            tokens,
            available,
            lowest: available,
        });
    }

    /// How many tokens may be held in all right now, given `held` and the
    /// width of the request served next: at least `min_jobs`, and no more
    /// than `held` while any gate is closed. None: no gate is configured,
    /// so no cap.
    ///
    /// The gates count jobs, a request may ask for several at once: with
    /// nothing held, the next request passes whole, or one wider than the
    /// slow start's first step, or than `min_jobs`, would wait for ever.
    pub fn allowance(
        &mut self,
        held: u32,
        next_request: Option<u32>,
        now: Duration,
    ) -> Option<u32> {
        if !self.config.any() {
            return None;
        }
        self.settle(now);
        // Stopped jobs need their room back first: nothing new while any
        // is stopped.
        let open = self.pauses.stopped == 0
            && self.is_open(GateKind::MemPressure)
            && self.is_open(GateKind::Load);
        let extra = if open { self.memory_room(held) } else { 0 };
        let whole_request = if held == 0 {
            next_request.unwrap_or(0)
        } else {
            0
        };
        Some(
            held.saturating_add(extra)
                .max(self.config.min_jobs)
                .max(whole_request),
        )
    }

    /// Jobs stopped by `--on-memory-pressure pause` now.
    pub fn stopped(&self) -> u32 {
        self.pauses.stopped
    }

    /// What `--on-memory-pressure pause` wants done after the last reading,
    /// with `running` the jobs that run (not stopped).
    ///
    /// - While available memory is below `--min-mem-available`, stop every
    ///   job that still grows but the one that started first
    ///   (see [`jobs_to_pause`]), never leaving fewer than `min_jobs`
    ///   running; when none is seen growing, the newest job as memory
    ///   crosses that line and each time it falls by a further eighth of
    ///   the threshold.
    /// - Let a stopped job go on once a job has finished since the last
    ///   stop or resume and memory is back above the threshold: never more
    ///   than one per freed slot. With nothing running, one goes on
    ///   whatever the memory: the build must make progress. Once the pause
    ///   or the memory gate is turned off, every stopped job goes on.
    pub fn pause_action(&self, running: &[JobMemory]) -> PauseAction {
        let stopped = self.pauses.stopped > 0;
        let (Some(min), Some(available), true) = (
            self.config.min_mem_available,
            self.reading.mem_available,
            self.config.pause,
        ) else {
            return if stopped {
                PauseAction::Resume
            } else {
                PauseAction::Nothing
            };
        };
        let count = u32::try_from(running.len()).unwrap_or(u32::MAX);
        if available < min {
            let falling = self
                .pauses
                .last_stop_available
                .is_none_or(|last| available.saturating_add(min / 8) <= last);
            let stoppable = count.saturating_sub(self.config.min_jobs) as usize;
            let picks: Vec<usize> = jobs_to_pause(running, falling)
                .into_iter()
                .take(stoppable)
                .collect();
            if !picks.is_empty() {
                return PauseAction::Pause(picks);
            }
        }
        if stopped && (count == 0 || count < self.pauses.running_since && available >= min) {
            PauseAction::Resume
        } else {
            PauseAction::Nothing
        }
    }

    /// The broker stopped `jobs` of the `running` jobs that
    /// [`Gates::pause_action`] was shown.
    pub fn did_pause(&mut self, jobs: u32, running: u32) {
        self.pauses.stopped += jobs;
        self.pauses.last_stop_available = self.reading.mem_available;
        self.pauses.running_since = running.saturating_sub(jobs);
    }

    /// The broker let one stopped job go on beside the `running` jobs that
    /// [`Gates::pause_action`] was shown.
    pub fn did_resume(&mut self, running: u32) {
        self.pauses.stopped = self.pauses.stopped.saturating_sub(1);
        self.pauses.running_since = running.saturating_add(1);
    }

    /// Whether memory should be measured often: while jobs are stopped, or
    /// memory is below the threshold with pausing on (a job that grows can
    /// take the rest within a few tenths of a second).
    pub fn urgent(&self) -> bool {
        self.pauses.stopped > 0 || (self.config.pause && !self.is_open(GateKind::MemAvailable))
    }

    /// Every configured gate, for `baton status`.
    pub fn views(&self) -> Vec<GateView> {
        let c = self.config;
        let r = self.reading;
        let to_f64 = |v: Option<u64>| v.map(|v| v as f64);
        [
            c.min_mem_available
                .map(|t| (GateKind::MemAvailable, to_f64(r.mem_available), t as f64)),
            c.max_mem_pressure
                .map(|t| (GateKind::MemPressure, r.mem_pressure, t)),
            c.max_load.map(|t| (GateKind::Load, r.runnable, t)),
        ]
        .into_iter()
        .flatten()
        .map(|(kind, value, threshold)| GateView {
            kind,
            open: self.is_open(kind),
            value,
            threshold,
            closed_since: self.closed_since[kind as usize],
        })
        .collect()
    }

    /// Whether one gate lets tokens out on the last reading. A gate whose
    /// figure this machine does not offer stays open.
    pub fn is_open(&self, kind: GateKind) -> bool {
        let (c, r) = (self.config, self.reading);
        match kind {
            GateKind::MemAvailable => match (c.min_mem_available, r.mem_available) {
                (Some(min), Some(available)) => available >= min,
                _ => true,
            },
            GateKind::MemPressure => match (c.max_mem_pressure, r.mem_pressure) {
                (Some(max), Some(pressure)) => pressure <= max,
                _ => true,
            },
            GateKind::Load => match (c.max_load, r.runnable) {
                (Some(max), Some(runnable)) => runnable <= max,
                _ => true,
            },
        }
    }

    /// How many more jobs the memory gate admits now, `held` being held:
    /// the room above the threshold, less what young jobs are expected to
    /// take, in jobs of the learned size (one young job at a time before
    /// anything is learned); and, like TCP's slow start, no more young jobs
    /// than settled ones, so that admissions at most double per settle
    /// time while the estimate catches up with what the jobs really take.
    fn memory_room(&self, held: u32) -> u32 {
        let (Some(min), Some(available)) =
            (self.config.min_mem_available, self.reading.mem_available)
        else {
            return u32::MAX;
        };
        let young: u32 = self.young.iter().map(|g| g.tokens).sum();
        let settled = held.saturating_sub(young);
        let slow_start = settled.max(1).saturating_sub(young);
        let room = match self.per_job {
            None => u32::from(available >= min && young == 0),
            Some(per_job) => {
                let room = available
                    .saturating_sub(u64::from(young).saturating_mul(per_job))
                    .saturating_sub(min);
                u32::try_from(room / per_job.max(1)).unwrap_or(u32::MAX)
            }
        };
        room.min(slow_start)
    }

    /// Grants older than the settle time are no longer young: each tells
    /// how much memory its jobs took (how far available memory fell while
    /// it was young, per token), and that updates the estimate.
    fn settle(&mut self, now: Duration) {
        let settle = self.config.settle;
        let (settled, young): (Vec<_>, Vec<_>) = self
            .young
            .drain(..)
            .partition(|g| now.saturating_sub(g.at) >= settle);
        self.young = young;
        for grant in settled {
            if let (Some(before), Some(lowest)) = (grant.available, grant.lowest) {
                self.learn(before.saturating_sub(lowest) / u64::from(grant.tokens.max(1)));
            }
        }
    }

    /// What all settled holders take together, per token, is a floor for
    /// the estimate: it catches jobs that grew after their grant settled.
    /// (It counts a build's own slot as a job, so alone it would be low.)
    fn learn_from_all(&mut self, available: u64, held: u32) {
        if held == 0 {
            self.idle_available = Some(available);
            return;
        }
        let settled = held.saturating_sub(self.young.iter().map(|g| g.tokens).sum());
        if let (Some(idle), true) = (self.idle_available, settled > 0) {
            let per_token = idle.saturating_sub(available) / u64::from(held);
            if self.per_job.is_some_and(|p| per_token > p) {
                self.per_job = Some(per_token);
            }
        }
    }

    /// A larger figure is taken at once, so that one big job is enough to
    /// slow admissions down; a smaller one only moves the estimate an
    /// eighth of the way, so that a quiet moment does not invite a burst.
    fn learn(&mut self, measured: u64) {
        self.per_job = Some(match self.per_job {
            Some(old) if measured < old => old - (old - measured) / 8,
            _ => measured,
        });
    }
}

/// What `--on-memory-pressure pause` did so far.
#[derive(Debug, Clone, Copy, Default)]
struct Pauses {
    /// Jobs stopped now.
    stopped: u32,
    /// Available memory at the last stop, until memory is out of danger.
    last_stop_available: Option<u64>,
    /// Jobs running right after the last stop or resume: fewer since means
    /// one finished and freed its slot.
    running_since: u32,
}

/// What the pause policy wants done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PauseAction {
    /// Stop these jobs (indices into the running jobs passed in), with
    /// SIGSTOP.
    Pause(Vec<usize>),
    /// Let the stopped job that started first go on (SIGCONT).
    Resume,
    /// Neither.
    Nothing,
}

/// A running job as the pause policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobMemory {
    /// When it started (any clock that orders jobs).
    pub started: u64,
    /// Bytes resident now, its whole process tree.
    pub resident: u64,
    /// Bytes resident a moment ago (the broker looks back a tenth of a
    /// second), if it was seen then.
    pub resident_before: Option<u64>,
}

/// Growth between two looks below which a job counts as steady: a
/// process's bookkeeping moves its resident size by a few pages.
pub const GROWTH: u64 = 1 << 20;

impl JobMemory {
    /// Whether it grew by at least [`GROWTH`] since `resident_before`.
    pub fn growing(&self) -> bool {
        self.resident_before
            .is_some_and(|before| self.resident >= before.saturating_add(GROWTH))
    }
}

/// Which jobs to stop while memory is nearly gone, newest first: every job
/// still growing but the one that started first. Stopping a job that no
/// longer grows saves nothing (a stopped job keeps its memory); the memory
/// left can carry one growing job, and the first started is the furthest
/// along. When none is seen growing but memory still `falling`, the
/// newest job.
pub fn jobs_to_pause(jobs: &[JobMemory], falling: bool) -> Vec<usize> {
    let mut growing: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].growing()).collect();
    if growing.is_empty() {
        return if falling {
            (0..jobs.len())
                .max_by_key(|&i| jobs[i].started)
                .into_iter()
                .collect()
        } else {
            Vec::new()
        };
    }
    growing.sort_by_key(|&i| std::cmp::Reverse(jobs[i].started));
    growing.pop();
    growing
}

/// Tokens granted together, while they are young.
#[derive(Debug, Clone, Copy)]
struct YoungGrant {
    at: Duration,
    tokens: u32,
    /// Available memory when they were granted.
    available: Option<u64>,
    /// The lowest available memory seen since.
    lowest: Option<u64>,
}

/// Parses a size such as `2G`, `512M`, `1.5G`, `4096` (bytes; K, M, G, T
/// are powers of 1024, an optional `B` or `iB` after them is accepted).
///
/// # Errors
/// Anything else, zero or negative, with a message saying what is expected.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let expected = || {
        format!("invalid size '{text}': expected a positive number of bytes with an optional K, M, G or T suffix (e.g. 2G, 512M, 1.5G)")
    };
    let lower = t.to_ascii_lowercase();
    let body = lower.trim_end_matches("ib").trim_end_matches('b');
    let (number, unit) = match body.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&body[..i], c),
        _ => (body, ' '),
    };
    let shift = match unit {
        ' ' => 0,
        'k' => 10,
        'm' => 20,
        'g' => 30,
        't' => 40,
        _ => return Err(expected()),
    };
    let value: f64 = number.trim().parse().map_err(|_| expected())?;
    if !value.is_finite() || value <= 0.0 {
        return Err(format!("invalid size '{text}': it must be above zero"));
    }
    let bytes = value * (1u64 << shift) as f64;
    if bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(expected());
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const SETTLE: Duration = Duration::from_millis(500);

    fn memory_gate(min: u64) -> Gates {
        Gates::new(GateConfig {
            min_mem_available: Some(min),
            settle: SETTLE,
            ..GateConfig::default()
        })
    }

    fn at(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    fn mem(available: u64) -> Reading {
        Reading {
            mem_available: Some(available),
            ..Reading::default()
        }
    }

    #[test]
    fn no_gate_no_cap() {
        let mut g = Gates::new(GateConfig::default());
        g.observe(mem(0), 1, at(0));
        assert_eq!(g.allowance(5, None, at(0)), None);
    }

    #[test]
    fn any_one_gate_is_a_gate() {
        let only = |config: GateConfig| config.any();
        assert!(!only(GateConfig::default()));
        assert!(only(GateConfig {
            min_mem_available: Some(MIB),
            ..GateConfig::default()
        }));
        assert!(only(GateConfig {
            max_mem_pressure: Some(10.0),
            ..GateConfig::default()
        }));
        assert!(only(GateConfig {
            max_load: Some(2.0),
            ..GateConfig::default()
        }));
    }

    #[test]
    fn with_nothing_held_the_next_request_passes_whole() {
        let mut g = memory_gate(300 * MIB);
        g.observe(mem(1000 * MIB), 0, at(0));
        assert_eq!(g.allowance(0, Some(3), at(0)), Some(3));
        g.granted(3, at(0));
        assert_eq!(
            g.allowance(3, Some(2), at(1)),
            Some(3),
            "with tokens held, the slow start holds it back"
        );
    }

    #[test]
    fn before_learning_one_young_job_at_a_time() {
        let mut g = memory_gate(300 * MIB);
        g.observe(mem(1000 * MIB), 1, at(0));
        assert_eq!(g.allowance(0, None, at(0)), Some(1));
        g.granted(1, at(0));
        // Eight requests in the same millisecond: still only the one.
        assert_eq!(g.allowance(1, None, at(1)), Some(1));
    }

    #[test]
    fn learns_the_job_size_and_leaves_the_threshold_free() {
        let mut g = memory_gate(200 * MIB);
        g.observe(mem(1000 * MIB), 1, at(0));
        g.granted(1, at(0));
        g.observe(mem(760 * MIB), 1, at(100));
        g.observe(mem(750 * MIB), 1, at(300));
        assert_eq!(
            g.allowance(1, None, at(300)),
            Some(1),
            "still young: nothing learned"
        );
        g.observe(mem(750 * MIB), 1, at(600));
        assert_eq!(g.per_job(), Some(250 * MIB));
        // 750 - 200 leaves room for two more jobs of 250, but with one
        // settled job, slow start admits one young one.
        assert_eq!(g.allowance(1, None, at(600)), Some(2));
        // With two settled (the build's own slot and the job), both.
        assert_eq!(g.allowance(2, None, at(600)), Some(4));
        g.granted(2, at(600));
        // Young jobs count at the learned size before they show: no room.
        g.observe(mem(740 * MIB), 1, at(650));
        assert_eq!(g.allowance(4, None, at(650)), Some(4));
    }

    #[test]
    fn young_jobs_never_outnumber_settled_ones_however_much_room_is_left() {
        // Slow start: admissions at most double per settle time, so that
        // a job size learned too small (jobs that grow late) lets no burst
        // in. Here memory has room for 88 more jobs of the learned size.
        let mut g = memory_gate(100 * MIB);
        g.observe(mem(1000 * MIB), 0, at(0));
        g.granted(2, at(0));
        g.observe(mem(980 * MIB), 2, at(600));
        assert_eq!(g.per_job(), Some(10 * MIB));
        assert_eq!(
            g.allowance(2, None, at(600)),
            Some(4),
            "two settled: two young"
        );
        g.granted(2, at(600));
        assert_eq!(
            g.allowance(4, None, at(601)),
            Some(4),
            "two young beside two settled: none more until they settle"
        );
        assert_eq!(
            g.allowance(4, None, at(1100)),
            Some(8),
            "all four settled: four young"
        );
    }

    #[test]
    fn a_smaller_job_lowers_the_estimate_slowly() {
        let mut g = memory_gate(100 * MIB);
        g.observe(mem(1000 * MIB), 1, at(0));
        g.granted(1, at(0));
        g.observe(mem(200 * MIB), 1, at(600));
        assert_eq!(g.per_job(), Some(800 * MIB));
        g.granted(1, at(600));
        g.observe(mem(200 * MIB), 1, at(1200));
        assert_eq!(
            g.per_job(),
            Some(700 * MIB),
            "a job that took nothing moves it by an eighth"
        );
    }

    #[test]
    fn closed_memory_gate_holds_at_min_jobs_and_never_revokes() {
        let mut g = memory_gate(500 * MIB);
        g.observe(mem(100 * MIB), 1, at(0));
        assert!(!g.is_open(GateKind::MemAvailable));
        assert_eq!(
            g.allowance(4, None, at(0)),
            Some(4),
            "what is held stays held"
        );
        assert_eq!(g.allowance(0, None, at(0)), Some(1), "one job always runs");
    }

    #[test]
    fn pressure_and_load_gates_close_above_their_threshold() {
        let config = GateConfig {
            max_mem_pressure: Some(10.0),
            max_load: Some(3.0),
            min_jobs: 1,
            settle: SETTLE,
            ..GateConfig::default()
        };
        let mut g = Gates::new(config);
        g.observe(
            Reading {
                mem_pressure: Some(5.0),
                runnable: Some(2.0),
                ..Reading::default()
            },
            1,
            at(0),
        );
        assert_eq!(g.allowance(2, None, at(0)), Some(u32::MAX));
        g.observe(
            Reading {
                mem_pressure: Some(25.0),
                runnable: Some(2.0),
                ..Reading::default()
            },
            1,
            at(10),
        );
        assert_eq!(g.allowance(2, None, at(10)), Some(2));
        assert_eq!(g.views()[0].closed_since, Some(at(10)));
        g.observe(
            Reading {
                mem_pressure: Some(1.0),
                runnable: Some(7.0),
                ..Reading::default()
            },
            1,
            at(20),
        );
        assert_eq!(g.allowance(2, None, at(20)), Some(2));
        assert!(g.views()[0].open && !g.views()[1].open);
    }

    #[test]
    fn each_gate_is_open_at_its_threshold_and_closed_just_past_it() {
        let config = GateConfig {
            min_mem_available: Some(1000),
            max_mem_pressure: Some(10.0),
            max_load: Some(3.0),
            min_jobs: 1,
            settle: SETTLE,
            ..GateConfig::default()
        };
        let reading = |available, pressure, runnable| Reading {
            mem_available: Some(available),
            mem_pressure: Some(pressure),
            runnable: Some(runnable),
        };
        let open = |r: Reading| {
            let mut g = Gates::new(config);
            g.observe(r, 1, at(0));
            [
                GateKind::MemAvailable,
                GateKind::MemPressure,
                GateKind::Load,
            ]
            .map(|k| g.is_open(k))
        };
        assert_eq!(
            open(reading(1000, 10.0, 3.0)),
            [true; 3],
            "at the threshold"
        );
        assert_eq!(
            open(reading(999, 10.5, 3.5)),
            [false; 3],
            "just past the threshold"
        );
    }

    #[test]
    fn a_figure_the_machine_lacks_leaves_its_gate_open() {
        let config = GateConfig {
            max_mem_pressure: Some(10.0),
            min_jobs: 1,
            settle: SETTLE,
            ..GateConfig::default()
        };
        let mut g = Gates::new(config);
        g.observe(Reading::default(), 0, at(0));
        assert!(g.is_open(GateKind::MemPressure));
        assert_eq!(g.views()[0].value, None);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert!(parse_size("0.5").is_err(), "less than a byte");
        assert_eq!(parse_size("1"), Ok(1), "one byte is a size");
        for negative in ["-1", "-2G", "0"] {
            let said = parse_size(negative).unwrap_err();
            assert!(said.contains("above zero"), "{negative}: {said}");
        }
        assert!(parse_size("16777216T").is_err(), "past 64 bits");
        for bad in ["-1", "abc", "0", "", "1.5X", "G", "nan"] {
            assert!(parse_size(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn gate_settings_by_name() {
        let c = GateConfig::default()
            .with("mem-available", Some(2e9))
            .unwrap()
            .with("load", Some(3.0))
            .unwrap();
        assert_eq!(
            (c.min_mem_available, c.max_load),
            (Some(2_000_000_000), Some(3.0))
        );
        assert_eq!(c.with("load", None).unwrap().max_load, None);
        assert_eq!(c.with("min-jobs", Some(2.0)).unwrap().min_jobs, 2);
        for (name, value) in [
            ("mem-available", 0.0),
            ("mem-pressure", 101.0),
            ("load", 0.0),
            ("min-jobs", 0.0),
            ("min-jobs", 1.5),
            ("nope", 1.0),
        ] {
            assert!(
                c.with(name, Some(value)).is_err(),
                "{name} {value} accepted"
            );
        }
    }

    #[test]
    fn every_gate_setting_reads_back_as_it_was_set() {
        let settings = [
            ("mem-available", 2e9),
            ("mem-pressure", 40.0),
            ("load", 3.5),
            ("min-jobs", 2.0),
        ];
        let mut c = GateConfig::default();
        for (name, value) in settings {
            c = c.with(name, Some(value)).unwrap();
        }
        for (name, value) in settings {
            assert_eq!(c.value_of(name), Some(value), "{name}");
        }
        assert_eq!(c.value_of("nope"), None);
        let off = c.with("mem-pressure", None).unwrap();
        assert_eq!(off.value_of("mem-pressure"), None);
        assert_eq!(
            c.with("min-jobs", None).unwrap().value_of("min-jobs"),
            Some(1.0)
        );
    }

    #[test]
    fn gates_are_named_as_status_shows_them() {
        let names = [
            GateKind::MemAvailable,
            GateKind::MemPressure,
            GateKind::Load,
        ]
        .map(GateKind::name);
        assert_eq!(names, ["mem-available", "mem-pressure", "load"]);
    }

    #[test]
    fn before_learning_a_build_holding_a_token_may_add_one_job() {
        let mut g = memory_gate(300 * MIB);
        g.observe(mem(1000 * MIB), 1, at(0));
        assert_eq!(g.allowance(1, None, at(0)), Some(2), "room, nothing young");
        g.observe(mem(200 * MIB), 1, at(0));
        assert_eq!(g.allowance(1, None, at(0)), Some(1), "below the threshold");
    }

    #[test]
    fn the_estimate_is_the_fall_per_token_taken_up_at_once_lowered_by_eighths() {
        let mut g = memory_gate(100 * MIB);
        g.observe(mem(1000 * MIB), 2, at(0));
        g.granted(2, at(0));
        g.observe(mem(600 * MIB), 2, at(600));
        assert_eq!(g.per_job(), Some(200 * MIB), "400 MiB over two tokens");
        // Room for (600 - 100) / 200 = 2 more, as slow start allows.
        assert_eq!(g.allowance(2, None, at(600)), Some(4));
        g.granted(1, at(600));
        g.observe(mem(200 * MIB), 3, at(1200));
        assert_eq!(g.per_job(), Some(400 * MIB), "a larger job counts at once");
        g.granted(1, at(1200));
        g.observe(mem(0), 4, at(1800));
        assert_eq!(
            g.per_job(),
            Some(375 * MIB),
            "a job of 200 moves an estimate of 400 an eighth of the way"
        );
    }

    #[test]
    fn room_is_counted_in_whole_jobs_of_the_learned_size() {
        let mut g = memory_gate(100 * MIB);
        g.observe(mem(1000 * MIB), 4, at(0));
        g.granted(4, at(0));
        g.observe(mem(200 * MIB), 4, at(600));
        assert_eq!(g.per_job(), Some(200 * MIB));
        g.observe(mem(500 * MIB), 4, at(700));
        // 500 - 100 leaves room for two jobs of 200; slow start allows 4.
        assert_eq!(g.allowance(4, None, at(700)), Some(6));
    }

    #[test]
    fn the_floor_is_what_every_holder_takes_together_per_token() {
        let mut g = memory_gate(100 * MIB);
        g.observe(mem(1000 * MIB), 0, at(0));
        g.granted(2, at(0));
        g.observe(mem(900 * MIB), 2, at(600));
        assert_eq!(g.per_job(), Some(50 * MIB));
        g.observe(mem(400 * MIB), 2, at(700));
        assert_eq!(
            g.per_job(),
            Some(300 * MIB),
            "600 MiB fallen over two tokens"
        );
    }

    #[test]
    fn with_every_holder_young_the_floor_learns_nothing() {
        let mut g = memory_gate(100 * MIB);
        g.observe(mem(1000 * MIB), 0, at(0));
        g.granted(1, at(0));
        g.observe(mem(900 * MIB), 1, at(600));
        assert_eq!(g.per_job(), Some(100 * MIB));
        g.granted(2, at(600));
        // Only young grants beyond the first; a fall now is theirs, not
        // yet a floor for the estimate.
        g.observe(mem(100 * MIB), 2, at(700));
        assert_eq!(g.per_job(), Some(100 * MIB));
    }

    #[test]
    fn a_job_that_grows_after_it_settled_raises_the_estimate() {
        let mut g = memory_gate(100 * MIB);
        g.observe(mem(1000 * MIB), 0, at(0));
        g.granted(1, at(0));
        // The job started slowly: nothing shows while it is young.
        g.observe(mem(990 * MIB), 1, at(600));
        assert_eq!(g.per_job(), Some(10 * MIB));
        // Then it grows: 400 MiB for the one token held.
        g.observe(mem(600 * MIB), 1, at(700));
        assert_eq!(g.per_job(), Some(400 * MIB));
    }

    fn job(started: u64, mib: u64, mib_before: Option<u64>) -> JobMemory {
        JobMemory {
            started,
            resident: mib * MIB,
            resident_before: mib_before.map(|m| m * MIB),
        }
    }

    #[test]
    fn every_growing_job_but_the_first_started_is_paused_newest_first() {
        let jobs = [
            job(1, 400, Some(300)),
            job(2, 150, Some(100)),
            job(3, 50, Some(50)),
            job(4, 60, Some(40)),
        ];
        assert_eq!(
            jobs_to_pause(&jobs, false),
            [3, 1],
            "job 3 does not grow, job 1 may"
        );
        let crawling = [job(1, 400, Some(300)), job(2, 50, Some(50))];
        assert_eq!(
            jobs_to_pause(&crawling, true),
            Vec::<usize>::new(),
            "one grows: it may, alone"
        );
        let unseen = [job(1, 400, None), job(2, 50, None)];
        assert_eq!(
            jobs_to_pause(&unseen, true),
            [1],
            "none seen growing, memory falls: the newest"
        );
        assert_eq!(jobs_to_pause(&unseen, false), Vec::<usize>::new());
        let page = JobMemory {
            resident: 50 * MIB + 4096,
            ..job(2, 50, Some(50))
        };
        assert!(!page.growing(), "a page is no growth");
    }

    fn pausing(min: u64) -> Gates {
        Gates::new(GateConfig {
            min_mem_available: Some(min),
            pause: true,
            ..GateConfig::default()
        })
    }

    #[test]
    fn pause_stops_growing_jobs_while_memory_is_short_never_the_last() {
        let mut g = pausing(400 * MIB);
        let growing = [
            job(1, 300, Some(200)),
            job(2, 200, Some(100)),
            job(3, 100, Some(50)),
        ];
        g.observe(mem(450 * MIB), 3, at(0));
        assert_eq!(
            g.pause_action(&growing),
            PauseAction::Nothing,
            "above the threshold: all may grow"
        );
        g.observe(mem(350 * MIB), 3, at(10));
        assert_eq!(g.pause_action(&growing), PauseAction::Pause(vec![2, 1]));
        g.did_pause(2, 3);
        assert_eq!(
            g.allowance(3, None, at(10)),
            Some(3),
            "nothing new while a job is stopped"
        );
        let steady = [job(1, 300, Some(300)), job(2, 200, Some(200))];
        g.observe(mem(340 * MIB), 3, at(20));
        assert_eq!(
            g.pause_action(&steady),
            PauseAction::Nothing,
            "no job grows, memory steadied: the running jobs fit"
        );
        g.observe(mem(290 * MIB), 3, at(30));
        assert_eq!(
            g.pause_action(&steady),
            PauseAction::Pause(vec![1]),
            "fell by another eighth of the threshold"
        );
        let mut strict = pausing(400 * MIB);
        strict.set_config(
            GateConfig {
                min_jobs: 2,
                ..strict.config()
            },
            at(0),
        );
        strict.observe(mem(10 * MIB), 3, at(0));
        assert_eq!(
            strict.pause_action(&growing),
            PauseAction::Pause(vec![2]),
            "never below --min-jobs running"
        );
        assert_eq!(
            strict.pause_action(&growing[..1]),
            PauseAction::Nothing,
            "the last running job is never stopped"
        );
    }

    #[test]
    fn memory_exactly_at_the_threshold_pauses_nothing() {
        let mut g = pausing(400 * MIB);
        let growing = [job(1, 300, Some(200)), job(2, 200, Some(100))];
        g.observe(mem(400 * MIB), 2, at(0));
        assert_eq!(g.pause_action(&growing), PauseAction::Nothing);
        g.observe(mem(400 * MIB - 1), 2, at(10));
        assert_eq!(g.pause_action(&growing), PauseAction::Pause(vec![1]));
    }

    #[test]
    fn memory_is_watched_closely_only_while_pausing_may_be_needed() {
        let mut g = pausing(400 * MIB);
        g.observe(mem(500 * MIB), 2, at(0));
        assert!(!g.urgent(), "above the threshold");
        g.observe(mem(300 * MIB), 2, at(10));
        assert!(g.urgent(), "below it, pausing on");
        let mut no_pause = memory_gate(400 * MIB);
        no_pause.observe(mem(300 * MIB), 2, at(10));
        assert!(!no_pause.urgent(), "below it, but nothing would be paused");
        g.did_pause(1, 2);
        g.observe(mem(500 * MIB), 1, at(20));
        assert!(g.urgent(), "a job is stopped, whatever the memory");
        g.did_resume(1);
        assert!(!g.urgent(), "none stopped, memory back");
    }

    /// `n` jobs that do not grow.
    fn steady(n: u64) -> Vec<JobMemory> {
        (0..n).map(|i| job(i, 100, Some(100))).collect()
    }

    #[test]
    fn a_stopped_job_goes_on_once_another_finished_and_memory_is_back() {
        let mut g = pausing(400 * MIB);
        g.observe(mem(150 * MIB), 3, at(0));
        g.did_pause(1, 3);
        g.observe(mem(500 * MIB), 3, at(10));
        assert_eq!(
            g.pause_action(&steady(2)),
            PauseAction::Nothing,
            "memory is back, but no job finished"
        );
        g.observe(mem(300 * MIB), 3, at(20));
        assert_eq!(
            g.pause_action(&steady(1)),
            PauseAction::Nothing,
            "a job finished, but memory is below the threshold"
        );
        g.observe(mem(450 * MIB), 3, at(30));
        assert_eq!(g.pause_action(&steady(1)), PauseAction::Resume);
        g.did_resume(1);
        assert_eq!(g.stopped(), 0);
        assert_eq!(g.pause_action(&steady(2)), PauseAction::Nothing);
    }

    #[test]
    fn stopped_jobs_go_on_one_per_job_that_finishes() {
        let mut g = pausing(400 * MIB);
        g.observe(mem(150 * MIB), 4, at(0));
        g.did_pause(2, 4);
        g.observe(mem(500 * MIB), 4, at(10));
        assert_eq!(
            g.pause_action(&steady(2)),
            PauseAction::Nothing,
            "memory is back, none finished"
        );
        assert_eq!(g.pause_action(&steady(1)), PauseAction::Resume);
        g.did_resume(1);
        assert_eq!(
            g.pause_action(&steady(2)),
            PauseAction::Nothing,
            "the one that went on runs: none finished since"
        );
        assert_eq!(
            g.pause_action(&steady(1)),
            PauseAction::Resume,
            "another finished"
        );
        g.did_resume(1);
        assert_eq!(g.stopped(), 0);
    }

    #[test]
    fn with_nothing_running_a_stopped_job_goes_on_whatever_the_memory() {
        let mut g = pausing(400 * MIB);
        g.observe(mem(150 * MIB), 2, at(0));
        g.did_pause(1, 2);
        g.observe(mem(10 * MIB), 1, at(10));
        assert_eq!(g.pause_action(&steady(0)), PauseAction::Resume);
    }

    #[test]
    fn turning_the_memory_gate_off_lets_every_stopped_job_go_on() {
        let mut g = pausing(400 * MIB);
        g.observe(mem(150 * MIB), 3, at(0));
        g.did_pause(1, 3);
        g.set_config(
            GateConfig {
                min_mem_available: None,
                ..g.config()
            },
            at(10),
        );
        assert_eq!(g.pause_action(&steady(2)), PauseAction::Resume);
        let off = Gates::new(GateConfig {
            min_mem_available: Some(400 * MIB),
            ..GateConfig::default()
        });
        assert_eq!(
            off.pause_action(&steady(3)),
            PauseAction::Nothing,
            "only with --on-memory-pressure pause"
        );
    }
}
