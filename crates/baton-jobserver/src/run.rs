//! `baton run -- CMD`: hold tokens from the broker while CMD runs, and give
//! CMD a GNU jobserver fed from the pool (see the crate's docs).
//!
//! Every token of the build belongs to this process's connection, so if it
//! is killed the broker takes them back; CMD gets SIGKILL through the
//! parent-death signal, and the jobs it leaves behind keep their tokens
//! until they end: they carry `BATON_RUN_PID` for the broker to find them
//! (docs/jobserver.md, "When `baton run` is killed").

use crate::autostart::{self, LazyAutostart};
use crate::build_file::{self, BuildFile};
use crate::choice::{self, Choice};
use crate::probe::Probes;
use crate::{
    bmake, log, makeflags, polls_its_jobserver_alone, reads_its_jobserver, submakes, Feeder, Fifo,
    Style,
};
use anyhow::{bail, Context, Result};
use baton_client::{Client, Error as ClientError};
use baton_core::paths::socket_path;
use baton_core::protocol::RUN_PID_VAR;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use std::ffi::OsString;
use std::io::ErrorKind;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// What `baton run` was asked to do.
pub struct RunOptions {
    /// The broker's socket; None: `baton_core::paths::default_socket_path`.
    pub socket: Option<PathBuf>,
    /// Held for CMD itself the whole time (1: make's implicit slot).
    pub tokens: u32,
    /// At most this many tokens for the whole build, implicit ones included.
    pub max: Option<u32>,
    /// How CMD finds its jobserver.
    pub style: Style,
    /// The build's name in status; None: the command line.
    pub name: Option<String>,
    /// The build's share of a busy pool, against other builds' weights.
    pub weight: u32,
    /// CMD and its arguments.
    pub command: Vec<OsString>,
    /// Say on stderr which jobserver form the build gets, and why.
    pub explain: bool,
    /// How to start a broker if none answers; None: fail instead.
    pub autostart: Option<LazyAutostart>,
    /// Run with an explicit style that a tool found in the build cannot
    /// read (a warning instead of a refusal).
    pub force: bool,
}

/// Runs the command under the broker; returns the exit code `baton run`
/// should exit with (CMD's, or 128 + the signal that killed it; 127 and
/// 126 when it could not be started).
///
/// # Errors
/// No broker answers, the broker refuses the request, or the jobserver
/// cannot be set up.
pub fn run(opts: RunOptions) -> Result<i32> {
    // The FUSE file has no per-build cap: --max needs the bridge.
    if opts.style == Style::Fuse && opts.max.is_some() {
        bail!("--max works with the pipe and fifo styles, not with fuse");
    }
    let socket = absolute(&socket_path(opts.socket.clone()));
    let probes = Probes::open(Some(baton_core::paths::probes_path(&socket)));
    if let Some(why) = choice::unusable(&probes, &opts.command, opts.style) {
        match opts.force {
            true => log::warn(format_args!("{why}; running anyway, as --force asked")),
            false => bail!(why),
        }
    }
    if opts.tokens == 1 && is_a_job_of_a_baton_build(&socket) {
        return Ok(run_in_the_outer_build(&opts.command));
    }
    let label = label(&opts.command);
    let (mut client, max) = first_tokens(&opts, &socket, &label)?;

    let forwarded = forwarded_signals();
    forwarded.thread_block().context("cannot block signals")?;
    let signals = SignalFd::with_flags(&forwarded, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)?;

    // After the signals are blocked: a stop signal sent now waits for CMD,
    // as it would once CMD runs (the tools asked for their versions start
    // with the mask cleared).
    let (tree, bmake_version) = look_at_the_tools(&probes, &opts.command);
    let is_bmake = bmake_version.is_some();
    probes.save();
    let choice = choice::choose(&tree);
    if !is_bmake {
        refuse_unreadable_style(&opts, &tree, &mut client)?;
    }
    let left_behind = match opts.style {
        Style::Auto if !is_bmake => &choice.left_behind[..],
        _ => &[],
    };
    for warning in choice.warnings.iter().chain(left_behind) {
        log::warn(format_args!("{warning}"));
    }

    let mut command = Command::new(&opts.command[0]);
    command
        .args(&opts.command[1..])
        .env("BATON_SOCKET", &socket)
        .env(RUN_PID_VAR, std::process::id().to_string());
    let cap = choice::Cap {
        tokens: max,
        given: opts.max.is_some(),
    };
    let mut fuse_file = None;
    let style = choice::form(opts.style, choice.style, is_bmake, cap, || {
        fuse_file = build_file::create(&socket, &label)?;
        anyhow::Ok(fuse_file.is_some())
    })?;
    let Some(style) = style else {
        give_back(&mut client);
        bail!(
            "the broker at {} has no FUSE mount we may use (it was started with --no-fuse, FUSE is not available \
             there, or its mount is not visible or not open to this user, as in a container: docs/containers.md): \
             use --jobserver-style fifo",
            socket.display()
        );
    };
    let polls_it_alone = !is_bmake && polls_its_jobserver_alone(&opts.command);
    let setup = Setup {
        socket: &socket,
        jobs: max,
        bmake: is_bmake,
        polls_it_alone,
    };
    let jobserver = set_up_jobserver(&mut command, &setup, style, fuse_file)?;
    if opts.explain {
        match &bmake_version {
            Some(version) => explain_bmake(&opts, version, &jobserver),
            None => explain(&opts, &choice, &jobserver, max),
        }
    }
    let (mut feeder, pipe_ends, build_file) = match jobserver {
        Jobserver::None => (None, None, None),
        Jobserver::Bridge {
            fifo, pipe_ends, ..
        } => {
            let eager = is_bmake || reads_its_jobserver(&opts.command);
            (
                Some(Feeder::new(fifo, max - opts.tokens, eager)),
                pipe_ends,
                None,
            )
        }
        // The broker serves the file itself; we only keep it until the end.
        Jobserver::Fuse { file, ends, .. } => (None, ends, Some(file)),
    };
    let build = (opts.weight, opts.name.clone().unwrap_or_default());
    let build_file_path = build_file.as_ref().map(|f| f.path().to_path_buf());
    let mut broker = BrokerLink {
        client,
        alive: true,
        socket,
        build_file: build_file_path,
        label,
        build,
        reattach: Reattach::new(),
    };
    // Fill the FIFO before the build starts: ninja reads its first wave of
    // tokens in one burst as it starts, and takes no more after finding it
    // empty until a job of its own ends.
    if let Some(f) = feeder.as_mut() {
        if let Err(e) = f.step(&mut broker.client) {
            broker.lost(&e);
        }
    }
    let child = match spawn_tied_to_us(&mut command, forwarded) {
        Ok(child) => child,
        Err(e) => {
            broker.give_back_all(feeder);
            return Ok(report_spawn_error(&opts.command[0], e));
        }
    };
    drop(pipe_ends); // the child has its copies
    let submakes = (!is_bmake && style != Style::None).then(|| submakes::watch(child.id()));
    let status = supervise(child, &signals, broker, feeder)?;
    for line in submakes.map(submakes::Watch::finish).unwrap_or_default() {
        log::warn(format_args!("{line}"));
    }
    Ok(exit_code(status))
}

/// Joins the broker as a new build and waits for CMD's own tokens; returns
/// the connection and the build's cap. A broker that goes away while we
/// wait (killed, or replaced) costs the build nothing: we wait for the
/// next one at the socket, as builds that hold tokens re-attach (#32).
fn first_tokens(opts: &RunOptions, socket: &Path, label: &str) -> Result<(Client, u32)> {
    let mut reattach = Reattach::new();
    loop {
        let mut client = autostart::connect(socket, label, opts.autostart.as_ref())?;
        client.start_build(opts.weight, opts.name.as_deref().unwrap_or(""))?;
        let max = opts.max.unwrap_or(client.limit());
        if max < opts.tokens {
            bail!(
                "--max {max} is below --tokens {}: the build could never start",
                opts.tokens
            );
        }
        match client.acquire(opts.tokens) {
            Ok(()) => return Ok((client, max)),
            Err(ClientError::Disconnected | ClientError::Io { .. }) => {}
            Err(e) => return Err(e).context("waiting for tokens"),
        }
        if reattach.first_time("gone") {
            log::warn(format_args!(
                "the broker at {} went away while we waited for our first token; waiting for the next one",
                socket.display()
            ));
        }
        match opts.autostart {
            // The next connect starts one if nobody has meanwhile.
            Some(_) => {
                reattach.failed(true);
                std::thread::sleep(reattach.backoff);
            }
            None => wait_for_a_broker(socket, &mut reattach),
        }
    }
}

/// Sleeps until something answers at the socket again, backing off.
fn wait_for_a_broker(socket: &Path, reattach: &mut Reattach) {
    loop {
        reattach.failed(true);
        std::thread::sleep(reattach.backoff);
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            return;
        }
    }
}

/// Refuses (giving our tokens back) an explicit `--jobserver-style` that
/// a tool found in the build cannot read; under `--force`, says why and
/// goes on.
fn refuse_unreadable_style(
    opts: &RunOptions,
    tree: &choice::Tree,
    client: &mut Client,
) -> Result<()> {
    let Some(why) = choice::unreadable(tree, opts.style) else {
        return Ok(());
    };
    let style = format!("{:?}", opts.style).to_lowercase();
    let why = format!("--jobserver-style {style} cannot serve this build: {why}");
    if opts.force {
        log::warn(format_args!("{why}; running anyway, as --force asked"));
        return Ok(());
    }
    give_back(client);
    bail!("{why}. Use --jobserver-style auto, which chooses from the tools found (--force runs it anyway)")
}

/// What `choice` finds of the build's tools, and bmake's version if CMD is
/// bmake. Usually every answer is remembered and they are read in turn;
/// else the probes run side by side, and the build waits for the slowest.
fn look_at_the_tools(probes: &Probes, command: &[OsString]) -> (choice::Tree, Option<String>) {
    let program = Path::new(&command[0]);
    let in_turn = || {
        (
            choice::inspect_in_turn(probes, command),
            bmake::version(probes, program),
        )
    };
    probes.recalled(in_turn).unwrap_or_else(|| {
        std::thread::scope(|s| {
            let bmake = s.spawn(|| bmake::version(probes, program));
            let tree = choice::inspect(probes, command);
            (tree, bmake.join().expect("the bmake probe does not panic"))
        })
    })
}

/// What the build was given as its jobserver, kept while it runs.
enum Jobserver {
    None,
    /// A FIFO fed by this process; for the pipe style, the descriptors the
    /// child inherits (closed in the parent once it has started).
    /// `form` says what the build got, for --explain.
    Bridge {
        fifo: Fifo,
        pipe_ends: Option<(OwnedFd, OwnedFd)>,
        form: &'static str,
    },
    /// A token file on the broker's FUSE mount, served by the broker; for
    /// bmake, two descriptors opened on it that the child inherits.
    Fuse {
        file: BuildFile,
        ends: Option<(OwnedFd, OwnedFd)>,
        form: &'static str,
    },
}

impl Jobserver {
    /// The form the build got, for --explain.
    fn form(&self) -> &'static str {
        match self {
            Jobserver::None => "none",
            Jobserver::Bridge { form, .. } | Jobserver::Fuse { form, .. } => form,
        }
    }

    /// The descriptors the child inherits, if it gets its jobserver so.
    fn ends(&self) -> Option<&(OwnedFd, OwnedFd)> {
        match self {
            Jobserver::Bridge { pipe_ends, .. } => pipe_ends.as_ref(),
            Jobserver::Fuse { ends, .. } => ends.as_ref(),
            Jobserver::None => None,
        }
    }
}

/// What the jobserver is set up with.
struct Setup<'a> {
    socket: &'a Path,
    /// The build's cap, written as MAKEFLAGS's `-jN`.
    jobs: u32,
    /// CMD is bmake: it gets bmake's own form (`-J R,W -j N`).
    bmake: bool,
    /// CMD polls its jobserver and nothing beside it (GNU make, cargo):
    /// the FUSE file may hold its polls.
    polls_it_alone: bool,
}

/// Says which form the build got and why, one line each.
fn explain(opts: &RunOptions, choice: &Choice, jobserver: &Jobserver, tokens: u32) {
    if opts.style != Style::Auto {
        log::warn(format_args!(
            "jobserver: {}, as --jobserver-style asked",
            jobserver.form()
        ));
        return;
    }
    log::warn(format_args!("jobserver: {} (auto)", jobserver.form()));
    for why in &choice.why {
        log::warn(format_args!("  because {why}"));
    }
    if choice.style == Style::Fuse && !matches!(jobserver, Jobserver::Fuse { .. }) {
        let reason = if opts.max.is_some() {
            "--max needs the bridge".to_string()
        } else if !choice::fuse_pays(tokens) {
            format!(
                "{tokens} tokens: below {} a FIFO's herd costs less than the file's round trips",
                choice::FUSE_FROM_TOKENS
            )
        } else {
            "the broker has no FUSE mount".to_string()
        };
        log::warn(format_args!("  not fuse: {reason}"));
    }
}

/// --explain for bmake: it reads only its own form, whatever else the
/// build may run, so GNU make's and gcc's versions do not enter into it.
fn explain_bmake(opts: &RunOptions, version: &str, jobserver: &Jobserver) {
    let program = Path::new(&opts.command[0]);
    let path = crate::probe::find(program).unwrap_or_else(|| program.to_path_buf());
    let bmake = if version.is_empty() {
        format!("bmake ({})", path.display())
    } else {
        format!("bmake {version} ({})", path.display())
    };
    if opts.style != Style::Auto {
        log::warn(format_args!(
            "jobserver: {}, as --jobserver-style asked, for {bmake}",
            jobserver.form()
        ));
        return;
    }
    log::warn(format_args!("jobserver: {} (auto)", jobserver.form()));
    log::warn(format_args!(
        "  because {bmake} reads only its own -J R,W form"
    ));
    log::warn(format_args!(
        "  because bmake takes a token only if one is already in the pipe, so the build's FIFO keeps every token \
         it may use waiting there (docs/jobserver.md, bmake)"
    ));
}

/// Sets up the jobserver of `style` (`choice::form` decided it, and made
/// the build's FUSE file if it is the file) and points MAKEFLAGS and
/// CARGO_MAKEFLAGS at it.
fn set_up_jobserver(
    command: &mut Command,
    setup: &Setup,
    style: Style,
    fuse_file: Option<BuildFile>,
) -> Result<Jobserver> {
    let socket = setup.socket;
    let (jobserver, auth) = match style {
        Style::None | Style::Auto => return Ok(Jobserver::None),
        Style::Fuse => match fuse_file {
            // bmake takes descriptors: the read end non-blocking, as in its
            // own pipe. A freed token still wakes one of its sub-makes.
            Some(file) if setup.bmake => {
                let (read, write) = file.open_ends()?;
                for fd in [&read, &write] {
                    inheritable(fd)?;
                }
                let auth = format!("{},{}", read.as_raw_fd(), write.as_raw_fd());
                let form = "fuse (bmake's -J R,W, both opened on the broker's FUSE mount)";
                (
                    Jobserver::Fuse {
                        file,
                        ends: Some((read, write)),
                        form,
                    },
                    auth,
                )
            }
            Some(file) => {
                if setup.polls_it_alone {
                    file.hold_polls();
                }
                let auth = format!("fifo:{}", file.path().display());
                (
                    Jobserver::Fuse {
                        file,
                        ends: None,
                        form: "fuse (fifo:PATH on the broker's FUSE mount)",
                    },
                    auth,
                )
            }
            None => unreachable!("choice::form gives the file only once it is made"),
        },
        Style::Pipe => {
            let mut fifo = Fifo::create(&crate::fifo::dir_for(socket))?;
            let (read, write) = fifo.open_pipe_ends()?;
            for fd in [&read, &write] {
                inheritable(fd)?;
            }
            let form = if setup.bmake {
                bmake::make_non_blocking(&read)
                    .context("cannot make the jobserver's read end non-blocking")?;
                fifo.sort_bmake_returns();
                "pipe (bmake's -J R,W: R on the build's FIFO, W a pipe only baton reads)"
            } else {
                "pipe (R,W)"
            };
            let auth = format!("{},{}", read.as_raw_fd(), write.as_raw_fd());
            (
                Jobserver::Bridge {
                    fifo,
                    pipe_ends: Some((read, write)),
                    form,
                },
                auth,
            )
        }
        Style::Fifo if setup.bmake => {
            let mut fifo = Fifo::create(&crate::fifo::dir_for(socket))?;
            let (read, write) = fifo.open_both_ends()?;
            for fd in [&read, &write] {
                inheritable(fd)?;
            }
            fifo.sort_bmake_returns();
            let auth = format!("{},{}", read.as_raw_fd(), write.as_raw_fd());
            let form = "fifo (bmake's -J R,W, both opened on the build's FIFO)";
            (
                Jobserver::Bridge {
                    fifo,
                    pipe_ends: Some((read, write)),
                    form,
                },
                auth,
            )
        }
        Style::Fifo => {
            let fifo = Fifo::create(&crate::fifo::dir_for(socket))?;
            let auth = format!("fifo:{}", fifo.path().display());
            (
                Jobserver::Bridge {
                    fifo,
                    pipe_ends: None,
                    form: "fifo (fifo:PATH)",
                },
                auth,
            )
        }
    };
    for var in ["MAKEFLAGS", "CARGO_MAKEFLAGS"] {
        let inherited = std::env::var(var).ok();
        command.env(var, makeflags(inherited.as_deref(), setup.jobs, &auth));
    }
    if let (true, Some((read, write))) = (setup.bmake, jobserver.ends()) {
        let inherited = std::env::var("MAKEFLAGS").ok();
        command.env(
            "MAKEFLAGS",
            bmake::makeflags(
                inherited.as_deref(),
                read.as_raw_fd(),
                write.as_raw_fd(),
                setup.jobs,
            ),
        );
    }
    Ok(jobserver)
}

fn inheritable(fd: &OwnedFd) -> Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty()))
        .context("cannot pass the jobserver descriptors on")?;
    Ok(())
}

/// How often a build that lost its broker looks for a new one at the
/// same socket: a restarted broker is found within about this long.
const REATTACH_EVERY: Duration = Duration::from_millis(200);

/// The longest wait between tries of a broker that answers but refuses
/// us: the tries back off, so a refusal never becomes a storm of them.
const REATTACH_AT_MOST_EVERY: Duration = Duration::from_secs(5);

/// When to try the socket again after losing the broker, and what we
/// said about it: each refusal is said once, not once per try.
struct Reattach {
    next_try: std::time::Instant,
    backoff: Duration,
    last_said: Option<String>,
}

impl Reattach {
    fn new() -> Self {
        Reattach {
            next_try: std::time::Instant::now(),
            backoff: REATTACH_EVERY,
            last_said: None,
        }
    }

    fn due(&self) -> bool {
        std::time::Instant::now() >= self.next_try
    }

    /// A try failed: the next waits longer, up to [`REATTACH_AT_MOST_EVERY`].
    fn failed(&mut self, backoff: bool) {
        if backoff {
            self.backoff = (self.backoff * 2).min(REATTACH_AT_MOST_EVERY);
        }
        self.next_try = std::time::Instant::now() + self.backoff;
    }

    /// Whether `message` is new: said once, however often the try fails.
    fn first_time(&mut self, message: &str) -> bool {
        let new = self.last_said.as_deref() != Some(message);
        self.last_said = Some(message.to_string());
        new
    }
}

/// Our connection to the broker, and whether it still answers.
struct BrokerLink {
    client: Client,
    alive: bool,
    socket: PathBuf,
    /// The build's FUSE token file, if its tokens come from one.
    build_file: Option<PathBuf>,
    /// What a new broker is told when we re-attach: our HELLO label, and
    /// the build's weight and name.
    label: String,
    build: (u32, String),
    reattach: Reattach,
}

impl BrokerLink {
    /// Says once that the broker is gone; from then on the build runs on
    /// the tokens it has.
    fn lost(&mut self, e: &ClientError) {
        if self.alive {
            self.alive = false;
            let outlook = if self.build_file.is_some() {
                "the build's FUSE token file waits for a broker to start there again (docs/fuse.md)"
            } else {
                "the build goes on with the tokens it has, uncounted until a broker starts there again"
            };
            log::warn(format_args!(
                "lost the broker at {} ({e}); {outlook}",
                self.socket.display()
            ));
        }
    }

    /// The build is over: every token it has goes back, and its FIFO goes.
    /// CMD was killed (`kill -9` of make, the OOM killer): the jobs it
    /// started may run on, re-parented, holding tokens no reader will
    /// write back. Giving everything back would let other builds start
    /// jobs beside them, past the limit. So the connection closes holding
    /// what it holds, as if we had been killed ourselves: the broker keeps
    /// as many tokens as the build's processes (found by [`RUN_PID_VAR`])
    /// still run jobs, and takes back the rest at once (#32). What the
    /// build is not using goes back first: a sub-make left running would
    /// read it, and the broker keeps all a build holds while one lives.
    fn leave_to_the_broker(&mut self, mut feeder: Option<Feeder>) {
        if let Some(f) = feeder.as_mut().filter(|_| self.alive) {
            // A broker lost just now takes all back as the connection
            // closes anyway: nothing more to say.
            let _ = f.give_back_unused(&mut self.client);
        }
        drop(feeder); // removes the FIFO
    }

    fn give_back_all(&mut self, mut feeder: Option<Feeder>) {
        if self.alive {
            // RELEASE may not follow a pending ACQUIRE: withdraw it first.
            let withdrawn = feeder
                .as_mut()
                .map_or(Ok(()), |f| f.withdraw(&mut self.client));
            if withdrawn.is_ok() {
                give_back(&mut self.client);
            }
        }
        drop(feeder); // removes the FIFO
    }
}

impl BrokerLink {
    /// Once the broker is lost: if a new one answers at the socket, joins
    /// it as the same build and tells it what we hold (HOLD), so that it
    /// counts our tokens and feeds the build again.
    fn reattach(&mut self, feeder: Option<&mut Feeder>) {
        if !self.reattach.due() {
            return;
        }
        let Ok(mut client) = Client::connect(&self.socket, &self.label) else {
            self.reattach.failed(false);
            return;
        };
        let held = self.client.held();
        let joined = client
            .start_build(self.build.0, &self.build.1)
            .and_then(|_| if held > 0 { client.hold(held) } else { Ok(()) });
        if let Err(e) = joined {
            let said = e.to_string();
            if self.reattach.first_time(&said) {
                log::warn(format_args!(
                    "a new broker answers at {} but refused us ({said}); the build goes on uncounted, \
                     trying again every few seconds",
                    self.socket.display()
                ));
            }
            self.reattach.failed(true);
            return;
        }
        self.reattach = Reattach::new();
        log::warn(format_args!(
            "re-attached to the new broker at {}, holding {held} token(s)",
            self.socket.display()
        ));
        // The new broker does not know the file's name: sub-makes that
        // open it by name need it back.
        if let Some(path) = &self.build_file {
            if let Err(e) = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
            {
                log::warn(format_args!(
                    "cannot make {} again ({e}): sub-makes that open it will fail",
                    path.display()
                ));
            }
        }
        self.client = client;
        self.alive = true;
        if let Some(f) = feeder {
            f.reattached();
        }
    }
}

/// Starts CMD with the signal mask restored and the parent-death signal set,
/// so that CMD dies with us however we die.
fn spawn_tied_to_us(command: &mut Command, blocked: SigSet) -> std::io::Result<Child> {
    crate::sys::tie_to_us(command, blocked);
    command.spawn()
}

/// Waits for CMD to end: forwards stop signals, feeds the jobserver, and
/// notices (once) if the broker goes away.
fn supervise(
    mut child: Child,
    signals: &SignalFd,
    mut broker: BrokerLink,
    mut feeder: Option<Feeder>,
) -> Result<ExitStatus> {
    let pidfd = crate::sys::pidfd_open(child.id())
        .context("pidfd_open failed (Linux 5.3 or later is needed)")?;
    loop {
        if broker.alive && broker.client.has_buffered_reply() {
            on_broker_readable(&mut broker, feeder.as_mut());
            continue;
        }
        let client_fd = broker.client.as_fd();
        let mut fds = vec![
            PollFd::new(pidfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        // A lost broker's socket stays out of the set: poll reports its
        // hang-up whatever events are asked for, and would never sleep.
        if broker.alive {
            fds.push(PollFd::new(client_fd, PollFlags::POLLIN));
        }
        let feeder_at = fds.len();
        if let Some(f) = &feeder {
            fds.extend(
                f.event_fds()
                    .into_iter()
                    .map(|fd| PollFd::new(fd, PollFlags::POLLIN)),
            );
        }
        let idle = feeder.as_ref().and_then(|f| f.idle_timeout());
        let timeout = match broker.alive {
            true => idle.map_or(PollTimeout::NONE, poll_timeout),
            false => poll_timeout(idle.map_or(REATTACH_EVERY, |d| d.min(REATTACH_EVERY))),
        };
        match poll(&mut fds, timeout) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).context("poll failed"),
        }
        let ready = |i: usize| {
            fds.get(i)
                .and_then(|f| f.revents())
                .is_some_and(|r| !r.is_empty())
        };
        let (child_done, got_signal) = (ready(0), ready(1));
        let broker_event = broker.alive && ready(2);
        let fifo_event = (feeder_at..fds.len()).any(ready);
        drop(fds);
        if got_signal {
            forward_signals(signals, child.id());
        }
        if !broker.alive && !child_done {
            broker.reattach(feeder.as_mut());
        }
        if broker_event {
            on_broker_readable(&mut broker, feeder.as_mut());
        }
        if let Some(f) = feeder.as_mut() {
            if fifo_event {
                f.on_fifo_event();
            }
            if broker.alive {
                if let Err(e) = f.tend(&mut broker.client) {
                    broker.lost(&e);
                }
            }
        }
        if child_done {
            let status = child
                .wait()
                .context("cannot collect the command's status")?;
            if let Some(stray) = feeder.as_ref().map(Feeder::stray_total).filter(|&n| n > 0) {
                log::warn(format_args!(
                    "{stray} stray byte(s) were taken out of the build's jobserver in all"
                ));
            }
            if status.signal().is_some() {
                broker.leave_to_the_broker(feeder);
            } else {
                broker.give_back_all(feeder);
            }
            return Ok(status);
        }
    }
}

fn on_broker_readable(broker: &mut BrokerLink, feeder: Option<&mut Feeder>) {
    let result = match feeder {
        Some(f) if f.is_waiting() => f.on_answer(broker.client.read_reply()),
        // Nothing is pending, so anything readable is the end.
        _ => Err(ClientError::Disconnected),
    };
    if let Err(e) = result {
        broker.lost(&e);
    }
}

fn poll_timeout(d: Duration) -> PollTimeout {
    PollTimeout::try_from(d.as_millis().min(60_000) as i32 + 1).unwrap_or(PollTimeout::MAX)
}

/// Returns our tokens explicitly, so the broker counts them as released
/// rather than reclaimed. If this fails the broker reclaims them anyway
/// when our connection closes.
fn give_back(client: &mut Client) {
    let held = client.held();
    if held > 0 {
        let _ = client.release(held);
    }
}

/// Signals someone sent to `baton run` go on to CMD. Terminal signals
/// (SIGINT, SIGQUIT from the keyboard) already reach CMD through its
/// process group, so those are not sent twice.
fn forward_signals(signals: &SignalFd, child: u32) {
    while let Ok(Some(info)) = signals.read_signal() {
        let from_kernel = info.ssi_code == libc::SI_KERNEL;
        let is_terminal_signal = matches!(info.ssi_signo as i32, libc::SIGINT | libc::SIGQUIT);
        if from_kernel && is_terminal_signal {
            continue;
        }
        crate::sys::signal(child, info.ssi_signo as i32);
    }
}

fn forwarded_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        set.add(s);
    }
    set
}

/// A shell's exit codes: 127 not found, 126 found but not runnable.
fn report_spawn_error(program: &OsString, e: std::io::Error) -> i32 {
    let name = program.to_string_lossy();
    match e.kind() {
        ErrorKind::NotFound => {
            log::warn(format_args!("{name}: command not found"));
            127
        }
        _ => {
            log::warn(format_args!("{name}: cannot run: {e}"));
            126
        }
    }
}

/// CMD's exit code, or 128 + the signal that killed it.
fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn label(command: &[OsString]) -> String {
    let words: Vec<_> = command.iter().map(|w| w.to_string_lossy()).collect();
    format!("baton run -- {}", words.join(" "))
}

/// Whether we run as a job of a build that a `baton run` of this broker
/// feeds: it set BATON_SOCKET to this socket for its command, and a make
/// under it started us as a recipe (MAKEFLAGS names a jobserver, even a
/// `-2,-2` one for a recipe make keeps it from). Such a job already holds
/// a slot of the pool: asking for another would wait on our own build,
/// forever when the limit is 1.
fn is_a_job_of_a_baton_build(socket: &Path) -> bool {
    let outer = std::env::var_os("BATON_SOCKET").map(|s| absolute(Path::new(&s)));
    let under_jobserver =
        std::env::var("MAKEFLAGS").is_ok_and(|flags| flags.contains("--jobserver-auth="));
    outer.as_deref() == Some(socket) && under_jobserver
}

/// Runs CMD in the job slot we were started in, with the outer build's
/// jobserver (MAKEFLAGS as inherited); returns the code to exit with.
fn run_in_the_outer_build(command: &[OsString]) -> i32 {
    let err = Command::new(&command[0]).args(&command[1..]).exec();
    report_spawn_error(&command[0], err)
}

/// CMD may change directory; the socket path it inherits must still work.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_waits_a_millisecond_past_the_deadline_and_a_minute_at_most() {
        let ms = |d: Duration| poll_timeout(d).as_millis();
        // Rounded up: a wake-up before the deadline would find nothing due.
        assert_eq!(ms(Duration::ZERO), Some(1));
        assert_eq!(ms(Duration::from_micros(49_900)), Some(50));
        assert_eq!(ms(Duration::from_millis(200)), Some(201));
        assert_eq!(ms(Duration::from_secs(3600)), Some(60_001));
    }

    #[test]
    fn the_exit_code_is_cmd_s_or_128_and_the_signal_that_killed_it() {
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(2 << 8)), 2);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGTERM)), 143);
    }

    #[test]
    fn a_command_that_cannot_start_exits_as_a_shell_s_would() {
        let not_found = std::io::Error::from(ErrorKind::NotFound);
        assert_eq!(report_spawn_error(&"nosuch".into(), not_found), 127);
        let denied = std::io::Error::from(ErrorKind::PermissionDenied);
        assert_eq!(report_spawn_error(&"./notes.txt".into(), denied), 126);
    }

    #[test]
    fn a_build_is_labelled_by_its_command_line() {
        assert_eq!(
            label(&["make".into(), "-C".into(), "src".into()]),
            "baton run -- make -C src"
        );
    }

    #[test]
    fn only_signals_sent_to_baton_run_are_forwarded() {
        let set = forwarded_signals();
        for s in [
            Signal::SIGTERM,
            Signal::SIGINT,
            Signal::SIGHUP,
            Signal::SIGQUIT,
        ] {
            assert!(set.contains(s), "{s}");
        }
        for s in [Signal::SIGCHLD, Signal::SIGUSR1, Signal::SIGPIPE] {
            assert!(!set.contains(s), "{s}");
        }
    }

    #[test]
    fn re_attaching_backs_off_twice_as_long_each_refusal_up_to_five_seconds() {
        let mut r = Reattach::new();
        assert!(r.due(), "the first try is at once");
        let before = std::time::Instant::now();
        r.failed(false);
        assert_eq!(r.backoff, REATTACH_EVERY, "no broker yet: no backoff");
        assert!(r.next_try >= before + REATTACH_EVERY, "the next try waits");
        r.failed(true);
        assert_eq!(r.backoff, REATTACH_EVERY * 2);
        r.failed(true);
        assert_eq!(r.backoff, REATTACH_EVERY * 4);
        for _ in 0..10 {
            r.failed(true);
        }
        let before = std::time::Instant::now();
        r.failed(true);
        assert_eq!(r.backoff, REATTACH_AT_MOST_EVERY);
        assert!(r.next_try >= before + REATTACH_AT_MOST_EVERY);
    }

    #[test]
    fn each_refusal_is_said_once_however_often_it_comes() {
        let mut r = Reattach::new();
        assert!(r.first_time("refused: weight"));
        assert!(!r.first_time("refused: weight"));
        assert!(r.first_time("refused: name"));
        assert!(r.first_time("refused: weight"), "said again after another");
    }

    #[test]
    fn the_socket_path_cmd_inherits_is_absolute() {
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            absolute(Path::new("run/baton.sock")),
            cwd.join("run/baton.sock")
        );
        assert_eq!(
            absolute(Path::new("/run/b.sock")),
            PathBuf::from("/run/b.sock")
        );
    }

    #[test]
    fn a_re_attach_is_tried_only_once_due() {
        let mut r = Reattach::new();
        r.next_try = std::time::Instant::now() + Duration::from_secs(3600);
        assert!(!r.due());
        r.next_try = std::time::Instant::now();
        assert!(r.due());
    }
}
