//! baton: a token broker for build parallelism.
//!
//! One process owns a pool of job slots and hands each freed slot to exactly
//! one waiter, oldest first, so nobody is woken to find nothing. See
//! README.md and docs/.

//!
//! This crate is only the command line: the clap definitions, dispatch,
//! rendering and exit codes. The broker is `baton-broker`, the jobserver
//! bridge `baton-jobserver`, the experiments `baton-bench` (ARCHITECTURE.md).

mod config;
mod man;
mod shell_init;
mod status;
mod top;

use anyhow::Context;
use baton_broker::{FuseMode, FuseOptions, LogLevel, ServeOptions};
use baton_core::gates::GateConfig;
use baton_core::paths::socket_path;
use baton_jobserver::{Autostart, LazyAutostart, RunOptions};
use clap::{CommandFactory, Parser, Subcommand};
use config::Config;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "baton",
    version,
    about = "A token broker for build parallelism: each freed job slot wakes exactly one waiter",
    long_about = "baton owns a pool of job slots (tokens) and hands each freed token to exactly one \
waiter, the one that has waited longest. It knows who holds what, so the tokens of a client that \
dies come back at once, and one limit holds across any number of concurrent builds.\n\n\
Run commands under it; the first `baton run` starts a broker if none is running \
(or start one yourself: baton serve --jobs 8):\n\n  \
baton run -- ./build.sh\n  \
baton status\n\n\
Setting up (config file, systemd, shell integration): docs/setup.md.",
    after_help = "The broker's socket is --socket, else $BATON_SOCKET, else $XDG_RUNTIME_DIR/baton/socket, \
else /tmp/baton-$UID/socket."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the broker in the foreground until SIGTERM or SIGINT.
    Serve {
        /// How many tokens the pool holds: the machine-wide job limit
        /// [default: the config file's jobs, else the number of CPUs].
        #[arg(short, long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=i64::from(baton_core::MAX_LIMIT)))]
        jobs: Option<u32>,
        /// Socket to listen on.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Log every connection.
        #[arg(short, long, conflicts_with = "quiet")]
        verbose: bool,
        /// Log only warnings.
        #[arg(short, long)]
        quiet: bool,
        /// Do not mount the FUSE token files (builds then use the FIFO bridge).
        #[arg(long)]
        no_fuse: bool,
        /// Benchmark control: wake every poller of the FUSE files per freed
        /// token, as a pipe does.
        #[arg(long, hide = true, conflicts_with = "no_fuse")]
        fuse_notify_all: bool,
        /// How long the FUSE token file may hold a poll before answering
        /// "not ready", for builds that poll the file alone (GNU make >= 4.4,
        /// cargo; `baton run` marks their files): a held poll wakes once,
        /// readable, when a token comes, or at once on a signal. A poll's own
        /// timeout can run over by this much. 0 never holds (docs/fuse.md,
        /// "Held polls").
        #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=600_000), conflicts_with = "no_fuse")]
        fuse_hold_ms: u64,
        /// If this broker is killed, its FUSE mount waits this long for a new
        /// broker at the socket to take it over; then it goes, and builds
        /// blocked reading their token files fail (ENOTCONN) instead of
        /// hanging for good (docs/fuse.md, "When the broker dies").
        #[arg(long, value_name = "SECS", default_value_t = baton_broker::FUSE_ORPHAN_GRACE.as_secs(), value_parser = clap::value_parser!(u64).range(1..=86_400), conflicts_with = "no_fuse")]
        fuse_orphan_grace: u64,
        /// While messages arrive close together and a CPU is left free by the
        /// jobs holding tokens, look for the next one for up to US
        /// microseconds before sleeping: saves the broker a context switch
        /// per message while tokens change hands quickly. 0 never spins; nor
        /// does a single CPU (docs/benchmarks.md, "The adaptive spin").
        #[arg(long, value_name = "US", default_value_t = 100, value_parser = clap::value_parser!(u64).range(0..=10_000))]
        spin_us: u64,
        /// Write replies, then sleep, in two system calls, even where
        /// io_uring could do both in one (which saves the broker a context
        /// switch per grant; docs/benchmarks.md, "One system call"). For
        /// comparison, or if io_uring misbehaves here.
        #[arg(long)]
        no_io_uring: bool,
        #[command(flatten)]
        gates: GateArgs,
        /// How long a newly granted job counts as young for the memory
        /// gate: about the time your jobs take to reach most of their
        /// memory [default: the config file's mem-settle, else 1000].
        #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=600_000))]
        mem_settle: Option<u64>,
        /// When available memory falls below half of --min-mem-available:
        /// `pause` stops the most recently started job (SIGSTOP, its whole
        /// process tree) and lets it go on (SIGCONT) once another has
        /// finished and memory is back, so the build slows down instead of
        /// losing a job to the OOM killer. Never the last running job
        /// [default: the config file's on-memory-pressure, else nothing].
        #[arg(long, value_enum, value_name = "WHAT", requires = "min_mem_available")]
        on_memory_pressure: Option<OnMemoryPressure>,
        /// Stop after SECS with no clients at all (what brokers started by
        /// `baton run` do; the config file's idle-timeout).
        #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
        idle_timeout: Option<u64>,
        /// At most N connections at once; more are turned away with
        /// `ERR full`. Each costs the broker a file descriptor.
        #[arg(long, value_name = "N", default_value_t = baton_broker::MAX_CLIENTS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
        max_clients: usize,
        #[command(flatten)]
        cluster: ClusterArgs,
        /// Take over from the broker serving this socket, with everything
        /// it holds (clients, waiters, the FUSE mount), so that no build
        /// notices: upgrade baton in place with the new binary.
        #[arg(long)]
        replace: bool,
        /// When a broker died at this socket (its socket file is left,
        /// nobody answers): grant nothing new for MS milliseconds, while
        /// its builds, which may still run jobs on its tokens, re-attach
        /// and say what they hold (`baton run` looks every 200 ms). 0 does
        /// not wait, and the limit may be exceeded until they are back.
        #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=600_000))]
        reclaim_grace: u64,
        /// Serve the broker's figures over HTTP at ADDR (IP:PORT, e.g.
        /// 127.0.0.1:9464), as `GET /metrics` in the Prometheus text
        /// format; port 0 takes a free port, named in the log
        /// (docs/metrics.md).
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<std::net::SocketAddr>,
        /// Also serve this uid (repeatable), e.g. a CI runner's or a
        /// rootless container's mapped uid: its own builds and `status`,
        /// never the limit, the gates or stopping the broker. The socket
        /// must be where it can reach it (--socket; docs/containers.md)
        /// [default: the config file's allow-uid].
        #[arg(long, value_name = "UID", value_parser = clap::value_parser!(u32).range(0..i64::from(u32::MAX)))]
        allow_uid: Vec<u32>,
        /// Also serve the members of GROUP (a name or a gid; repeatable),
        /// by their gid or supplementary groups, as --allow-uid does; with
        /// this one group alone the socket file is given to it, mode 0660
        /// [default: the config file's allow-group].
        #[arg(long, value_name = "GROUP")]
        allow_group: Vec<String>,
    },
    /// Run CMD holding tokens from the broker, with a GNU jobserver (MAKEFLAGS)
    /// fed from the pool; every token goes back when CMD ends.
    #[command(
        after_help = "Run make without -j: `baton run -- make`. A make given -jN on its own command \
line ignores the jobserver and starts its own.\n\n\
baton run exits with CMD's exit status (128 + signal if CMD was killed; 127 if CMD was not found, \
126 if it could not be run). If baton run is killed, the broker takes its tokens back and CMD is \
killed too.\n\n\
With no broker at the socket, baton run starts one in the background (jobs from the config file, \
else one per CPU; it stops after idle-timeout seconds without clients; its log is broker.log beside \
the socket). BATON_NO_AUTOSTART=1 turns that off."
    )]
    Run {
        /// Socket of the broker.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Tokens to hold for CMD itself the whole time it runs (1 is a
        /// build's own job slot, the one make never writes back).
        #[arg(short, long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        tokens: u32,
        /// How CMD finds its GNU jobserver (docs/jobserver.md).
        #[arg(long, value_enum, default_value = "auto", value_name = "STYLE")]
        jobserver_style: baton_jobserver::Style,
        /// At most this many tokens for the whole build, CMD's own included.
        #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..))]
        max: Option<u32>,
        /// Say which jobserver form CMD gets, and why, before it starts.
        #[arg(long)]
        explain: bool,
        /// Run even if --jobserver-style names a form that a tool found in
        /// the build cannot read (make 4.3 under fifo, gcc 12's LTO, ninja
        /// under fuse, a Python driver under pipe).
        #[arg(long)]
        force: bool,
        /// The build's name in `baton status` (default: the command line),
        /// such as a CI job's or a container's.
        #[arg(long, value_name = "NAME", env = "BATON_NAME")]
        name: Option<String>,
        /// The build's share of a busy pool, against other builds' weights
        /// [default: the config file's weight, else 1].
        #[arg(long, value_name = "W", value_parser = clap::value_parser!(u32).range(1..=i64::from(baton_core::MAX_WEIGHT)))]
        weight: Option<u32>,
        /// The command and its arguments.
        #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
        command: Vec<OsString>,
    },
    /// Show the limit, free tokens, holders and waiters of a running broker.
    Status {
        /// Socket of the broker.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Print one JSON document (fields in docs/protocol.md).
        #[arg(long)]
        json: bool,
        /// Print the figures in the Prometheus text format, for
        /// node_exporter's textfile collector (docs/metrics.md).
        #[arg(long, conflicts_with = "json")]
        prometheus: bool,
    },
    /// Watch the builds live: who holds how many tokens, who waits and for
    /// how long, and the pool's use over the last minutes. Keys: q quits,
    /// +/- change the limit, arrows select a build, s sorts, ? helps.
    Top {
        /// Socket of the broker.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
    /// Change the limit or the gates of a running broker. Raising the limit
    /// by K wakes exactly K waiters; lowering it retires tokens as their
    /// holders give them back.
    #[command(
        after_help = "Examples:\n  baton limit 12\n  baton limit --min-mem-available 2G --max-load 8\n  baton limit --max-load off"
    )]
    Limit {
        /// The new limit; with no JOBS and no gate option, print the
        /// limit and the gates.
        #[arg(value_parser = clap::value_parser!(u32).range(1..=i64::from(baton_core::MAX_LIMIT)))]
        jobs: Option<u32>,
        /// Socket of the broker.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        #[command(flatten)]
        gates: GateArgs,
    },
    /// Stop the broker as SIGTERM would: it grants nothing more, closes
    /// its connections and removes its files; running builds carry on with
    /// the tokens they hold and re-attach to the next broker at the socket.
    #[command(
        after_help = "Exit status: 0 when a broker stopped, 3 when none answered at the socket (nothing to stop), 1 on any other error."
    )]
    Stop {
        /// Socket of the broker.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
    /// Re-run published wake-up experiments: baton beside pipes, semaphores,
    /// futexes and condition variables, measured in the same run.
    Bench(baton_bench::BenchArgs),
    /// Show the settings in effect and where each comes from (the config
    /// file, $XDG_CONFIG_HOME/baton/config.toml, or a default).
    Config,
    /// Print lines for a shell profile after which plain make, ninja, cargo
    /// and cmake --build run under the broker's limit:
    /// eval "$(baton shell-init bash)".
    #[command(
        after_help = "For builds started without such a shell (scripts, IDEs, CI steps): \
baton shell-init --wrappers writes make, ninja, cargo and cmake wrappers into \
~/.local/share/baton/bin, which the package's /etc/profile.d/baton.sh (baton shell-init \
--profile) puts first on PATH at login (docs/setup.md, \"Builds started without a shell\")."
    )]
    ShellInit {
        /// The shell to write for.
        #[arg(value_enum, required_unless_present_any = ["wrappers", "profile"])]
        shell: Option<shell_init::Shell>,
        /// Write wrapper scripts for make, ninja, cargo and cmake into DIR
        /// [default: $XDG_DATA_HOME/baton/bin, else ~/.local/share/baton/bin].
        #[arg(long, value_name = "DIR", num_args = 0..=1, conflicts_with_all = ["shell", "profile"])]
        wrappers: Option<Option<PathBuf>>,
        /// Print the lines for /etc/profile.d that put the wrappers first on
        /// PATH.
        #[arg(long, conflicts_with = "shell")]
        profile: bool,
    },
    /// Print the completion script for SHELL (e.g. baton completions bash >
    /// ~/.local/share/bash-completion/completions/baton).
    Completions {
        /// The shell to write for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the manual pages, baton.1 and one per subcommand
    /// (baton-run.1, ...), into DIR: baton man ~/.local/share/man/man1.
    /// Without DIR, print baton.1 (roff).
    Man {
        /// The directory to write the pages into (made if missing).
        #[arg(value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

/// A pool shared with other brokers through etcd (docs/cluster.md).
#[derive(clap::Args, Debug)]
#[command(
    next_help_heading = "Cluster pool: one limit across machines, kept in etcd (docs/cluster.md)"
)]
struct ClusterArgs {
    /// Join a cluster pool kept in etcd at these endpoints: every job
    /// then needs a cluster token too [default: the config file's
    /// [cluster], when --jobs is not given].
    #[arg(long, value_name = "URL[,URL...]", value_delimiter = ',', requires_all = ["cluster_pool", "cluster_jobs"])]
    etcd: Vec<String>,
    /// The cluster pool's name; brokers with the same name share its limit.
    #[arg(long, value_name = "NAME", requires = "etcd", value_parser = parse_pool_name)]
    cluster_pool: Option<String>,
    /// Tokens in the cluster pool, across every broker of the pool.
    #[arg(long, value_name = "N", requires = "etcd", value_parser = clap::value_parser!(u32).range(1..=i64::from(baton_core::MAX_LIMIT)))]
    cluster_jobs: Option<u32>,
    /// How long after this broker dies its cluster tokens come back.
    #[arg(long, value_name = "SECS", default_value_t = baton_core::cluster::DEFAULT_TTL.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    cluster_ttl: u64,
    /// How long spare cluster tokens are kept for builds here that ask
    /// again, while no other broker waits.
    #[arg(long, value_name = "MS", default_value_t = baton_core::cluster::DEFAULT_LINGER.as_millis() as u64, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    cluster_linger_ms: u64,
    /// Benchmark control: waiting brokers all watch every token slot
    /// instead of queueing (the herd the queue avoids).
    #[arg(long, hide = true, requires = "etcd")]
    cluster_watch_all: bool,
}

impl ClusterArgs {
    fn config(self) -> Option<baton_core::cluster::Config> {
        let (pool, jobs) = (self.cluster_pool?, self.cluster_jobs?);
        Some(baton_core::cluster::Config {
            endpoints: self.etcd,
            pool,
            jobs,
            ttl: Duration::from_secs(self.cluster_ttl),
            linger: Duration::from_millis(self.cluster_linger_ms),
            watch_all: self.cluster_watch_all,
        })
    }
}

fn parse_pool_name(text: &str) -> Result<String, String> {
    baton_core::cluster::check_pool_name(text).map(|()| text.to_string())
}

/// The gates (docs/adaptive.md). In `baton limit`, `off` removes one.
#[derive(clap::Args, Debug, Default)]
#[command(
    next_help_heading = "Gates: hold new tokens back while the machine is short (docs/adaptive.md)"
)]
struct GateArgs {
    /// Grant no new token while available memory (the lower of
    /// MemAvailable and the broker's memory cgroup's room) is below SIZE
    /// (e.g. 2G, 512M, 1.5G). Jobs granted a moment ago count at the
    /// memory jobs were seen to take.
    #[arg(long, value_name = "SIZE", value_parser = parse_size_setting, allow_hyphen_values = true)]
    min_mem_available: Option<Setting>,
    /// Grant no new token while memory pressure (PSI some avg10) is above
    /// PCT percent.
    #[arg(long, value_name = "PCT", value_parser = parse_setting, allow_hyphen_values = true)]
    max_mem_pressure: Option<Setting>,
    /// Grant no new token while more than LOAD tasks are runnable
    /// (averaged over the last second).
    #[arg(long, value_name = "LOAD", value_parser = parse_setting, allow_hyphen_values = true)]
    max_load: Option<Setting>,
    /// However closed the gates, never hold back tokens while fewer than N
    /// are held: a build always makes progress [default: 1].
    #[arg(long, value_name = "N", value_parser = parse_setting, allow_hyphen_values = true)]
    min_jobs: Option<Setting>,
}

/// What `baton serve --on-memory-pressure` does.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum OnMemoryPressure {
    /// Only hold new tokens back.
    Nothing,
    /// Also stop the newest job until memory is back.
    Pause,
}

/// A gate's threshold, or None for `off`.
type Setting = Option<f64>;

impl GateArgs {
    /// (protocol name, setting) for each option given.
    fn settings(&self) -> Vec<(&'static str, Setting)> {
        [
            ("mem-available", self.min_mem_available),
            ("mem-pressure", self.max_mem_pressure),
            ("load", self.max_load),
            ("min-jobs", self.min_jobs),
        ]
        .into_iter()
        .filter_map(|(name, setting)| setting.map(|s| (name, s)))
        .collect()
    }

    fn config(&self) -> anyhow::Result<GateConfig> {
        self.settings()
            .into_iter()
            .try_fold(GateConfig::default(), |c, (name, value)| {
                c.with(name, value).map_err(anyhow::Error::msg)
            })
    }
}

/// The gates of `baton serve`: its options, else the config file's (when
/// it was read), else none.
fn serve_gates(
    cli: &GateArgs,
    mem_settle: Option<u64>,
    on_memory_pressure: Option<OnMemoryPressure>,
    file: Option<&Config>,
) -> anyhow::Result<GateConfig> {
    let given = cli.settings();
    let mut config = cli.config()?;
    let (file_settle, file_pause) = file.map_or((None, false), Config::settle_and_pause);
    for (name, value) in file.map(Config::gate_settings).unwrap_or_default() {
        if !given.iter().any(|(n, _)| *n == name) {
            config = config.with(name, Some(value)).map_err(anyhow::Error::msg)?;
        }
    }
    Ok(GateConfig {
        settle: mem_settle
            .or(file_settle)
            .map_or(baton_core::gates::DEFAULT_SETTLE, Duration::from_millis),
        pause: on_memory_pressure.map_or(file_pause, |w| w == OnMemoryPressure::Pause),
        ..config
    })
}

fn parse_size_setting(text: &str) -> Result<Setting, String> {
    if text == "off" {
        return Ok(None);
    }
    baton_core::gates::parse_size(text).map(|bytes| Some(bytes as f64))
}

fn parse_setting(text: &str) -> Result<Setting, String> {
    match text {
        "off" => Ok(None),
        _ => match text.parse::<f64>() {
            Ok(v) if v.is_finite() && v >= 0.0 => Ok(Some(v)),
            _ => Err(format!("invalid value '{text}': expected a number, or off")),
        },
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch(cli.command) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("baton: {}", error_chain(&e));
            ExitCode::from(1)
        }
    }
}

fn dispatch(command: Cmd) -> anyhow::Result<u8> {
    match command {
        Cmd::Serve {
            jobs,
            socket,
            verbose,
            quiet,
            no_fuse,
            fuse_notify_all,
            fuse_hold_ms,
            fuse_orphan_grace,
            spin_us,
            no_io_uring,
            gates,
            mem_settle,
            on_memory_pressure,
            idle_timeout,
            max_clients,
            cluster,
            replace,
            reclaim_grace,
            metrics_listen,
            allow_uid,
            allow_group,
        } => {
            let log_level = if quiet {
                LogLevel::Warn
            } else if verbose {
                LogLevel::Debug
            } else {
                LogLevel::Info
            };
            let mode = if fuse_notify_all {
                FuseMode::NotifyAll
            } else {
                FuseMode::OneAtATime
            };
            let fuse = (!no_fuse).then_some(FuseOptions {
                mode,
                hold: Duration::from_millis(fuse_hold_ms),
                orphan_grace: Duration::from_secs(fuse_orphan_grace),
            });
            // The file is read only when it is needed: a broker started as
            // another user need not be able to read the caller's home.
            // Given --jobs, it may still name who else is served: read
            // leniently then (a bad line warns and admits nobody more).
            let file = if jobs.is_none() {
                Some(Config::load()?)
            } else {
                None
            };
            let lenient = (file.is_none() && (allow_uid.is_empty() || allow_group.is_empty()))
                .then(Config::load_lenient);
            let from_file = file.as_ref().or(lenient.as_ref());
            let allow_uids = match allow_uid.is_empty() {
                true => from_file.map(Config::allow_uids).unwrap_or_default(),
                false => allow_uid,
            };
            let allow_groups = match allow_group.is_empty() {
                true => from_file.map(Config::allow_groups).unwrap_or_default(),
                false => allow_group,
            };
            let gates = serve_gates(&gates, mem_settle, on_memory_pressure, file.as_ref())?;
            let jobs = jobs.unwrap_or_else(|| {
                file.as_ref()
                    .expect("read when --jobs is not given")
                    .jobs(None)
                    .value
            });
            let cluster = cluster
                .config()
                .or_else(|| file.as_ref().and_then(Config::cluster));
            let idle_timeout = idle_timeout.map(Duration::from_secs);
            let reclaim_grace = Duration::from_millis(reclaim_grace);
            // Why a broker stops goes into its log, as an ERROR line
            // with its time; a bad command line or config file above is
            // the user's to read, plainly, before any broker exists.
            let served = baton_broker::serve(ServeOptions {
                jobs,
                socket,
                fuse,
                spin_us,
                io_uring: !no_io_uring,
                log_level,
                gates,
                idle_timeout,
                max_clients,
                cluster,
                replace,
                reclaim_grace,
                metrics_listen,
                allow_uids,
                allow_groups,
            });
            if let Err(e) = served {
                baton_broker::log_fatal(&error_chain(&e));
                return Ok(1);
            }
        }
        Cmd::Run {
            socket,
            tokens,
            jobserver_style,
            max,
            explain,
            force,
            name,
            weight,
            command,
        } => {
            // Read once, and only where needed: to start a broker, or for
            // the default weight.
            let config = if autostart_enabled() || weight.is_none() {
                Some(Config::load_lenient())
            } else {
                None
            };
            let weight = weight.unwrap_or_else(|| {
                config
                    .as_ref()
                    .expect("read when --weight is not given")
                    .weight()
                    .value
            });
            let autostart = config.filter(|_| autostart_enabled()).map(|config| {
                let socket = socket.clone();
                Box::new(move || autostart(socket.as_deref(), &config)) as LazyAutostart
            });
            let code = baton_jobserver::run(RunOptions {
                socket,
                tokens,
                max,
                style: jobserver_style,
                name,
                weight,
                command,
                explain,
                autostart,
                force,
            })?;
            return Ok(u8::try_from(code).unwrap_or(1));
        }
        Cmd::Status {
            socket,
            json,
            prometheus,
        } => status::print_status(&socket_path(socket), json, prometheus)?,
        Cmd::Top { socket } => top::run(&socket_path(socket))?,
        Cmd::Limit {
            jobs,
            socket,
            gates,
        } => status::set_limit(&socket_path(socket), jobs, &gates.settings())?,
        Cmd::Stop { socket } => return status::stop(&socket_path(socket)),
        Cmd::Bench(args) => baton_bench::run(args)?,
        Cmd::Config => emit(config::describe(&Config::load()?, autostart_enabled()).as_bytes())?,
        Cmd::ShellInit {
            shell: Some(shell), ..
        } => emit(shell_init::script(shell, &std::env::current_exe()?).as_bytes())?,
        Cmd::ShellInit {
            wrappers: Some(dir),
            ..
        } => {
            let dir = dir.unwrap_or_else(shell_init::default_wrapper_dir);
            for path in shell_init::write_wrappers(&dir, &std::env::current_exe()?)
                .with_context(|| format!("cannot write the wrappers into {}", dir.display()))?
            {
                println!("{}", path.display());
            }
        }
        Cmd::ShellInit { .. } => emit(shell_init::profile_snippet().as_bytes())?,
        Cmd::Completions { shell } => {
            let mut text = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "baton", &mut text);
            emit(&text)?;
        }
        Cmd::Man { dir: None } => emit(&man::top_page(Cli::command())?)?,
        Cmd::Man { dir: Some(dir) } => {
            let pages = man::write_pages(Cli::command(), &dir)
                .with_context(|| format!("cannot write the manual pages into {}", dir.display()))?;
            for page in pages {
                println!("{}", page.display());
            }
        }
    }
    Ok(0)
}

/// Writes generated text to stdout. A reader that stops early (`baton man
/// | head`) is no error: the text was only ever for it.
fn emit(text: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        result => result,
    }
}

/// How `baton run` starts a broker when none answers: this same binary,
/// serving the same socket with the config file's limit, and stopping
/// once idle (the caller skips it when BATON_NO_AUTOSTART is set).
fn autostart(socket: Option<&Path>, config: &Config) -> anyhow::Result<Autostart> {
    let mut args: Vec<OsString> = vec![
        "serve".into(),
        "--jobs".into(),
        config.jobs(None).value.to_string().into(),
    ];
    if let Some(timeout) = config.idle_duration() {
        args.extend([
            "--idle-timeout".into(),
            timeout.as_secs().to_string().into(),
        ]);
    }
    if let Some(cluster) = config.cluster() {
        args.extend(cluster_options(&cluster).into_iter().map(OsString::from));
    }
    args.extend(config.gate_options().into_iter().map(OsString::from));
    // Without --socket the broker finds the same path as we do (the
    // environment is the same) and may make its default directory private.
    if let Some(socket) = socket {
        // The broker starts in /, not here.
        args.extend([
            "--socket".into(),
            std::path::absolute(socket)?.into_os_string(),
        ]);
    }
    Ok(Autostart {
        program: std::env::current_exe()?,
        args,
        announce: unusual_socket_note(socket),
    })
}

/// "started a broker at PATH (not the default DEFAULT)" when `--socket` or
/// $BATON_SOCKET name a socket other than the usual one: a typo there
/// would otherwise start a second pool, with a second limit, in silence.
fn unusual_socket_note(socket: Option<&Path>) -> Option<String> {
    let chosen = std::path::absolute(socket_path(socket.map(Path::to_path_buf))).ok()?;
    let standard = baton_core::paths::standard_socket_path();
    (chosen != standard).then(|| {
        format!(
            "started a broker at {} (not the default {})",
            chosen.display(),
            standard.display()
        )
    })
}

/// The options of `baton serve` that join `cluster`.
fn cluster_options(cluster: &baton_core::cluster::Config) -> Vec<String> {
    vec![
        format!("--etcd={}", cluster.endpoints.join(",")),
        format!("--cluster-pool={}", cluster.pool),
        format!("--cluster-jobs={}", cluster.jobs),
        format!("--cluster-ttl={}", cluster.ttl.as_secs()),
        format!("--cluster-linger-ms={}", cluster.linger.as_millis()),
    ]
}

/// BATON_NO_AUTOSTART set to anything but "" or "0" turns auto-start off.
fn autostart_enabled() -> bool {
    std::env::var_os("BATON_NO_AUTOSTART").is_none_or(|v| v.is_empty() || v == "0")
}

/// `outer: inner: innermost`, without repeating a cause already quoted.
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_gate_options() -> GateArgs {
        GateArgs {
            min_mem_available: None,
            max_mem_pressure: None,
            max_load: None,
            min_jobs: None,
        }
    }

    /// `baton serve`'s gates: each option given wins over the config
    /// file's (`off` included), the file's fill in what the options leave
    /// out, and with neither the defaults stand.
    #[test]
    fn each_serve_option_wins_over_the_files_gate_and_the_file_fills_the_rest() {
        let file = Config::from_text(
            "mem-settle = 600000\non-memory-pressure = \"pause\"\nmax-load = 3.0\n\
             max-mem-pressure = 20.0\nmin-jobs = 2\nmin-mem-available = \"1G\"\n",
        );
        let from_file = serve_gates(&no_gate_options(), None, None, Some(&file)).unwrap();
        assert_eq!(
            from_file,
            GateConfig {
                min_mem_available: Some(1 << 30),
                max_mem_pressure: Some(20.0),
                max_load: Some(3.0),
                min_jobs: 2,
                settle: Duration::from_millis(600_000),
                pause: true,
            }
        );
        let options = GateArgs {
            min_mem_available: Some(None),
            max_mem_pressure: None,
            max_load: Some(Some(5.0)),
            min_jobs: Some(Some(4.0)),
        };
        let given = serve_gates(
            &options,
            Some(1),
            Some(OnMemoryPressure::Nothing),
            Some(&file),
        )
        .unwrap();
        assert_eq!(
            given,
            GateConfig {
                min_mem_available: None,
                max_mem_pressure: Some(20.0),
                max_load: Some(5.0),
                min_jobs: 4,
                settle: Duration::from_millis(1),
                pause: false,
            }
        );
        let neither = serve_gates(&no_gate_options(), None, None, None).unwrap();
        assert_eq!(neither, GateConfig::default());
    }

    /// The broker `baton run` starts for itself is the one the config file
    /// describes: its limit, idle timeout, cluster pool (seconds and
    /// milliseconds as the options take them) and gates, on the socket
    /// asked for, made absolute (the broker starts in /).
    #[test]
    fn an_autostarted_broker_is_given_the_config_files_settings_as_options() {
        let config = Config::from_text(
            "jobs = 6\nidle-timeout = 90\nmax-load = 4.5\nmin-jobs = 2\n\
             [cluster]\netcd = [\"http://127.0.0.1:2379\", \"http://127.0.0.1:2381\"]\n\
             pool = \"ci\"\njobs = 16\nttl = 20\nlinger-ms = 250\n",
        );
        let socket = Path::new("here/baton.sock");
        let started = autostart(Some(socket), &config).unwrap();
        let absolute = std::env::current_dir().unwrap().join(socket);
        let expected: Vec<OsString> = [
            "serve",
            "--jobs",
            "6",
            "--idle-timeout",
            "90",
            "--etcd=http://127.0.0.1:2379,http://127.0.0.1:2381",
            "--cluster-pool=ci",
            "--cluster-jobs=16",
            "--cluster-ttl=20",
            "--cluster-linger-ms=250",
            "--max-load=4.5",
            "--min-jobs=2",
            "--socket",
        ]
        .into_iter()
        .map(OsString::from)
        .chain([absolute.clone().into_os_string()])
        .collect();
        assert_eq!(started.args, expected);
        let note = started
            .announce
            .expect("a socket other than the default is said");
        assert!(note.contains(&absolute.display().to_string()), "{note}");
    }

    /// An idle timeout of 0 (never) and no socket asked for add nothing.
    #[test]
    fn an_autostarted_broker_without_an_idle_timeout_or_a_socket_gets_neither() {
        let config = Config::from_text("jobs = 3\nidle-timeout = 0\n");
        let started = autostart(None, &config).unwrap();
        assert_eq!(started.args, ["serve", "--jobs", "3"]);
    }

    /// A gate's threshold: a number at or above 0, or `off`.
    #[test]
    fn a_gate_setting_is_a_finite_number_not_below_0_or_off() {
        assert_eq!(parse_setting("off"), Ok(None));
        assert_eq!(parse_setting("0"), Ok(Some(0.0)));
        assert_eq!(parse_setting("2.5"), Ok(Some(2.5)));
        for bad in ["-1", "NaN", "inf", "two", ""] {
            let refused = parse_setting(bad).unwrap_err();
            assert!(refused.contains(&format!("'{bad}'")), "{bad}: {refused}");
        }
    }

    /// An error's causes follow it once each: one the message already
    /// quotes is not said twice.
    #[test]
    fn an_error_chain_says_each_cause_once() {
        let quoted = anyhow::anyhow!("no such file")
            .context("cannot read /etc/x: no such file")
            .context("starting the broker");
        assert_eq!(
            error_chain(&quoted),
            "starting the broker: cannot read /etc/x: no such file"
        );
    }
}
