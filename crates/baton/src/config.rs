//! The config file, `$XDG_CONFIG_HOME/baton/config.toml` (else
//! `~/.config/baton/config.toml`): the defaults of `baton serve` and of the
//! brokers `baton run` starts. Options on the command line win.
//!
//! `baton config` and `baton serve` refuse a file that does not parse,
//! names a key we do not know, or gives a value out of range, naming the
//! file, line and key. `baton run` only needs the file to start a broker,
//! and a typo must not break every build: it warns about each bad line,
//! with the same words, and goes on without it ([`Config::load_lenient`]).

use anyhow::{bail, Result};
use baton_core::gates::GateConfig;
use serde::Deserialize;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;
use toml::Spanned;

/// How long a broker `baton run` started waits with no clients before it
/// stops, when the file does not say.
const DEFAULT_IDLE_TIMEOUT_SECS: u64 = 600;
const DEFAULT_WEIGHT: u32 = 1;
/// Far beyond any sensible share; keeps the arithmetic of shares small.
const MAX_WEIGHT: u32 = 1000;

/// The keys a config file may hold. Unknown keys are refused, so a typo
/// is an error rather than a setting silently ignored. The gates' keys are
/// the `baton serve` options of the same name (docs/adaptive.md).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileValues {
    jobs: Option<Spanned<u32>>,
    idle_timeout: Option<Spanned<u64>>,
    weight: Option<Spanned<u32>>,
    min_mem_available: Option<Spanned<String>>,
    max_mem_pressure: Option<Spanned<f64>>,
    max_load: Option<Spanned<f64>>,
    min_jobs: Option<Spanned<u32>>,
    mem_settle: Option<Spanned<u64>>,
    on_memory_pressure: Option<Spanned<String>>,
    cluster: Option<Spanned<ClusterValues>>,
    allow_uid: Option<Spanned<Vec<u32>>>,
    allow_group: Option<Spanned<Vec<GroupValue>>>,
}

/// A group in `allow-group`: a name or a gid.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum GroupValue {
    Id(u32),
    Name(String),
}

impl fmt::Display for GroupValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupValue::Id(gid) => write!(f, "{gid}"),
            GroupValue::Name(name) => write!(f, "{name}"),
        }
    }
}

/// The `[cluster]` table: a pool shared with other brokers through etcd
/// (docs/cluster.md), as `baton serve --etcd` takes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct ClusterValues {
    etcd: Vec<String>,
    pool: String,
    jobs: u32,
    ttl: Option<u64>,
    linger_ms: Option<u64>,
}

/// The config file as read (or its absence).
#[derive(Debug)]
pub struct Config {
    path: PathBuf,
    found: bool,
    text: String,
    values: FileValues,
}

/// Where an effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    CommandLine,
    File { line: usize },
    Cpus,
    Default,
}

/// A value and where it came from.
#[derive(Debug, Clone)]
pub struct Setting<T> {
    pub value: T,
    pub source: Source,
}

impl Config {
    /// Reads the config file at its usual place; a missing file is an
    /// empty config.
    ///
    /// # Errors
    /// The file cannot be read, or is not a valid config.
    pub fn load() -> Result<Config> {
        Config::load_from(config_path())
    }

    /// [`Config::load`] for `baton run`: each bad line is a warning on
    /// stderr (file, line, key, what is wrong) and is left out; a file that
    /// cannot be read is a warning and the defaults.
    pub fn load_lenient() -> Config {
        Config::load_lenient_from(config_path(), |warning| {
            eprintln!("baton: warning: {warning}")
        })
    }

    fn load_lenient_from(path: PathBuf, mut warn: impl FnMut(String)) -> Config {
        let empty = |path: PathBuf| Config {
            path,
            found: false,
            text: String::new(),
            values: FileValues::default(),
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return empty(path),
            Err(e) => {
                warn(format!(
                    "cannot read the config file {}: {e}; using the defaults",
                    path.display()
                ));
                return empty(path);
            }
        };
        // Each round leaves out the line the error names (blank, so that
        // the lines after keep their numbers), until the rest is good.
        let mut kept = text.clone();
        for _ in 0..=text.lines().count() {
            match Config::parse(path.clone(), kept.clone()) {
                Ok(config) => return config,
                Err(bad) => {
                    warn(format!(
                        "{}: {}; the line is ignored (baton config checks the file)",
                        bad.place, bad.message
                    ));
                    match bad.line {
                        Some(line) => kept = blank_line(&kept, line),
                        None => break,
                    }
                }
            }
        }
        empty(path)
    }

    fn load_from(path: PathBuf) -> Result<Config> {
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Config::parse(path, text)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Config {
                path,
                found: false,
                text: String::new(),
                values: FileValues::default(),
            }),
            Err(e) => bail!("cannot read the config file {}: {e}", path.display()),
        }
    }

    /// A config read from `text`, for the tests of the options it backs.
    #[cfg(test)]
    pub(crate) fn from_text(text: &str) -> Config {
        Config::parse(PathBuf::from("config.toml"), text.to_string()).expect("a valid config")
    }

    fn parse(path: PathBuf, text: String) -> Result<Config, BadConfig> {
        let values: FileValues = match toml::from_str(&text) {
            Ok(values) => values,
            Err(e) => return Err(bad_config(&path, &text, e.span(), e.message().trim())),
        };
        let config = Config {
            path,
            found: true,
            text,
            values,
        };
        config.check_ranges()?;
        Ok(config)
    }

    fn check_ranges(&self) -> Result<(), BadConfig> {
        self.check_gates()?;
        self.check_allowed()?;
        if let Some(jobs) = &self.values.jobs {
            if !(1..=baton_core::MAX_LIMIT).contains(jobs.get_ref()) {
                let message = format!("jobs must be between 1 and {}", baton_core::MAX_LIMIT);
                return Err(bad_config(
                    &self.path,
                    &self.text,
                    Some(jobs.span()),
                    &message,
                ));
            }
        }
        if let Some(cluster) = &self.values.cluster {
            if let Err(message) = check_cluster(cluster.get_ref()) {
                return Err(bad_config(
                    &self.path,
                    &self.text,
                    Some(cluster.span()),
                    &message,
                ));
            }
        }
        if let Some(weight) = &self.values.weight {
            if !(1..=MAX_WEIGHT).contains(weight.get_ref()) {
                let message = format!("weight must be between 1 and {MAX_WEIGHT}");
                return Err(bad_config(
                    &self.path,
                    &self.text,
                    Some(weight.span()),
                    &message,
                ));
            }
        }
        Ok(())
    }

    /// `allow-uid` holds real uids, and `allow-group` groups that exist.
    fn check_allowed(&self) -> Result<(), BadConfig> {
        let bad = |span: Range<usize>, message: String| {
            bad_config(&self.path, &self.text, Some(span), &message)
        };
        if let Some(uids) = &self.values.allow_uid {
            if uids.get_ref().contains(&u32::MAX) {
                return Err(bad(
                    uids.span(),
                    format!("allow-uid: {} is not a uid (-1)", u32::MAX),
                ));
            }
        }
        if let Some(groups) = &self.values.allow_group {
            for group in groups.get_ref() {
                if let GroupValue::Name(name) = group {
                    baton_broker::resolve_group(name).map_err(|e| {
                        bad(
                            groups.span(),
                            e.replacen("--allow-group", "allow-group:", 1),
                        )
                    })?;
                }
            }
        }
        Ok(())
    }

    /// The other users `baton serve` admits (`allow-uid`).
    pub fn allow_uids(&self) -> Vec<u32> {
        self.values
            .allow_uid
            .as_ref()
            .map(|v| v.get_ref().clone())
            .unwrap_or_default()
    }

    /// The groups whose members `baton serve` admits (`allow-group`), as
    /// `--allow-group` takes them.
    pub fn allow_groups(&self) -> Vec<String> {
        self.values
            .allow_group
            .as_ref()
            .map(|v| v.get_ref().iter().map(ToString::to_string).collect())
            .unwrap_or_default()
    }

    /// Each gate the file sets must be one `baton serve` would take.
    fn check_gates(&self) -> Result<(), BadConfig> {
        let v = &self.values;
        let bad = |span: Range<usize>, message: String| {
            bad_config(&self.path, &self.text, Some(span), &message)
        };
        if let Some(size) = &v.min_mem_available {
            baton_core::gates::parse_size(size.get_ref()).map_err(|e| bad(size.span(), e))?;
        }
        for (name, value) in [("mem-pressure", &v.max_mem_pressure), ("load", &v.max_load)] {
            if let Some(value) = value {
                GateConfig::default()
                    .with(name, Some(*value.get_ref()))
                    .map_err(|e| bad(value.span(), e))?;
            }
        }
        if let Some(n) = &v.min_jobs {
            GateConfig::default()
                .with("min-jobs", Some(f64::from(*n.get_ref())))
                .map_err(|e| bad(n.span(), e))?;
        }
        if let Some(ms) = v
            .mem_settle
            .as_ref()
            .filter(|ms| !(1..=600_000).contains(ms.get_ref()))
        {
            return Err(bad(
                ms.span(),
                "mem-settle must be between 1 and 600000 (milliseconds)".into(),
            ));
        }
        if let Some(what) = &v.on_memory_pressure {
            if !["nothing", "pause"].contains(&what.get_ref().as_str()) {
                return Err(bad(
                    what.span(),
                    "on-memory-pressure is \"nothing\" or \"pause\"".into(),
                ));
            }
            if v.min_mem_available.is_none() {
                return Err(bad(
                    what.span(),
                    "on-memory-pressure needs min-mem-available".into(),
                ));
            }
        }
        Ok(())
    }

    /// The gates the file sets, as `baton serve` options
    /// (`--max-load=8`), for the brokers `baton run` starts.
    pub fn gate_options(&self) -> Vec<String> {
        let v = &self.values;
        let mut options = Vec::new();
        let mut add = |name: &str, value: Option<String>| {
            if let Some(value) = value {
                options.push(format!("--{name}={value}"));
            }
        };
        add(
            "min-mem-available",
            v.min_mem_available.as_ref().map(|s| s.get_ref().clone()),
        );
        add(
            "max-mem-pressure",
            v.max_mem_pressure.as_ref().map(|s| s.get_ref().to_string()),
        );
        add(
            "max-load",
            v.max_load.as_ref().map(|s| s.get_ref().to_string()),
        );
        add(
            "min-jobs",
            v.min_jobs.as_ref().map(|s| s.get_ref().to_string()),
        );
        add(
            "mem-settle",
            v.mem_settle.as_ref().map(|s| s.get_ref().to_string()),
        );
        add(
            "on-memory-pressure",
            v.on_memory_pressure.as_ref().map(|s| s.get_ref().clone()),
        );
        options
    }

    /// The gate thresholds the file sets, by protocol name, as
    /// [`GateConfig::with`] takes them.
    pub fn gate_settings(&self) -> Vec<(&'static str, f64)> {
        let v = &self.values;
        let size = v
            .min_mem_available
            .as_ref()
            .and_then(|s| baton_core::gates::parse_size(s.get_ref()).ok());
        [
            ("mem-available", size.map(|b| b as f64)),
            (
                "mem-pressure",
                v.max_mem_pressure.as_ref().map(|s| *s.get_ref()),
            ),
            ("load", v.max_load.as_ref().map(|s| *s.get_ref())),
            (
                "min-jobs",
                v.min_jobs.as_ref().map(|s| f64::from(*s.get_ref())),
            ),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name, value?)))
        .collect()
    }

    /// The file's `mem-settle` (ms) and whether `on-memory-pressure` is
    /// `pause`.
    pub fn settle_and_pause(&self) -> (Option<u64>, bool) {
        let v = &self.values;
        (
            v.mem_settle.as_ref().map(|s| *s.get_ref()),
            v.on_memory_pressure
                .as_ref()
                .is_some_and(|s| s.get_ref() == "pause"),
        )
    }

    /// The file's path, and whether it exists.
    pub fn path(&self) -> (&Path, bool) {
        (&self.path, self.found)
    }

    /// The pool's limit: `cli`, else the file's `jobs`, else the number of
    /// CPUs.
    pub fn jobs(&self, cli: Option<u32>) -> Setting<u32> {
        let cpus = || {
            std::thread::available_parallelism()
                .map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
        };
        self.pick(cli, &self.values.jobs)
            .unwrap_or_else(|| Setting {
                value: cpus().min(baton_core::MAX_LIMIT),
                source: Source::Cpus,
            })
    }

    /// How long a broker `baton run` started stays with no clients, in
    /// seconds; 0: until stopped.
    pub fn idle_timeout(&self) -> Setting<u64> {
        self.pick(None, &self.values.idle_timeout)
            .unwrap_or(Setting {
                value: DEFAULT_IDLE_TIMEOUT_SECS,
                source: Source::Default,
            })
    }

    /// [`Config::idle_timeout`] as the broker takes it.
    pub fn idle_duration(&self) -> Option<Duration> {
        Some(self.idle_timeout().value)
            .filter(|&secs| secs > 0)
            .map(Duration::from_secs)
    }

    /// A build's share of the pool relative to others (fair shares).
    pub fn weight(&self) -> Setting<u32> {
        self.pick(None, &self.values.weight).unwrap_or(Setting {
            value: DEFAULT_WEIGHT,
            source: Source::Default,
        })
    }

    /// The cluster pool the file's `[cluster]` table names, if any.
    pub fn cluster(&self) -> Option<baton_core::cluster::Config> {
        let c = self.values.cluster.as_ref()?.get_ref();
        Some(baton_core::cluster::Config {
            endpoints: c.etcd.clone(),
            pool: c.pool.clone(),
            jobs: c.jobs,
            ttl: c
                .ttl
                .map_or(baton_core::cluster::DEFAULT_TTL, Duration::from_secs),
            linger: c
                .linger_ms
                .map_or(baton_core::cluster::DEFAULT_LINGER, Duration::from_millis),
            watch_all: false,
        })
    }

    fn pick<T: Copy>(&self, cli: Option<T>, file: &Option<Spanned<T>>) -> Option<Setting<T>> {
        if let Some(value) = cli {
            return Some(Setting {
                value,
                source: Source::CommandLine,
            });
        }
        file.as_ref().map(|v| Setting {
            value: *v.get_ref(),
            source: Source::File {
                line: line_of(&self.text, v.span().start),
            },
        })
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::CommandLine => write!(f, "command line"),
            Source::File { line } => write!(f, "config file, line {line}"),
            Source::Cpus => write!(f, "the number of CPUs"),
            Source::Default => write!(f, "default"),
        }
    }
}

/// `baton config`: each setting in effect, and where it came from.
pub fn describe(config: &Config, autostart: bool) -> String {
    let (path, found) = config.path();
    let file = if found {
        String::new()
    } else {
        " (no such file: defaults in effect)".to_string()
    };
    let (socket, socket_from) = baton_core::paths::default_socket();
    let jobs = config.jobs(None);
    let idle = config.idle_timeout();
    let weight = config.weight();
    let autostart = if autostart {
        "on"
    } else {
        "off (BATON_NO_AUTOSTART is set)"
    };
    let rows = [
        (
            "config file",
            format!("{}{file}", path.display()),
            String::new(),
        ),
        (
            "socket",
            socket.display().to_string(),
            socket_from.to_string(),
        ),
        ("jobs", jobs.value.to_string(), jobs.source.to_string()),
        (
            "idle-timeout",
            format!("{} s", idle.value),
            idle.source.to_string(),
        ),
        (
            "weight",
            weight.value.to_string(),
            weight.source.to_string(),
        ),
        ("autostart", autostart.to_string(), String::new()),
    ];
    let mut rows = rows.to_vec();
    let allowed = |what: Vec<String>| match what.is_empty() {
        true => "none".to_string(),
        false => what.join(", "),
    };
    rows.push((
        "allow-uid",
        allowed(config.allow_uids().iter().map(u32::to_string).collect()),
        source_of(
            config,
            config.values.allow_uid.as_ref().map(|v| v.span().start),
        ),
    ));
    rows.push((
        "allow-group",
        allowed(config.allow_groups()),
        source_of(
            config,
            config.values.allow_group.as_ref().map(|v| v.span().start),
        ),
    ));
    let value_width = rows
        .iter()
        .filter(|(_, _, from)| !from.is_empty())
        .map(|(_, value, _)| value.len())
        .max()
        .unwrap_or(0);
    rows.iter()
        .map(|(name, value, from)| match from.is_empty() {
            true => format!("{name:<13} {value}\n"),
            false => format!("{name:<13} {value:<value_width$}  ({from})\n"),
        })
        .collect()
}

/// Where a value of the file came from: its line, or the default.
fn source_of(config: &Config, start: Option<usize>) -> String {
    start
        .map_or(Source::Default, |start| Source::File {
            line: line_of(&config.text, start),
        })
        .to_string()
}

fn check_cluster(c: &ClusterValues) -> Result<(), String> {
    baton_core::cluster::check_pool_name(&c.pool)?;
    if c.etcd.is_empty() {
        return Err(
            "cluster.etcd must name at least one etcd endpoint, e.g. [\"http://127.0.0.1:2379\"]"
                .into(),
        );
    }
    if !(1..=baton_core::MAX_LIMIT).contains(&c.jobs) {
        return Err(format!(
            "cluster.jobs must be between 1 and {}",
            baton_core::MAX_LIMIT
        ));
    }
    if c.ttl.is_some_and(|t| !(1..=3600).contains(&t)) {
        return Err("cluster.ttl must be between 1 and 3600 seconds".into());
    }
    if c.linger_ms.is_some_and(|l| l > 60_000) {
        return Err("cluster.linger-ms must be at most 60000".into());
    }
    Ok(())
}

/// `$XDG_CONFIG_HOME/baton/config.toml`, else `$HOME/.config/baton/config.toml`.
fn config_path() -> PathBuf {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(&std::env::var_os("HOME").unwrap_or_default()).join(".config")
        });
    base.join("baton").join("config.toml")
}

/// What is wrong with the config file, and where.
#[derive(Debug)]
pub struct BadConfig {
    /// The line at fault, if the error names one.
    line: Option<usize>,
    /// `bad config file PATH, line N, key K`.
    place: String,
    /// What is wrong.
    message: String,
}

impl fmt::Display for BadConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} (fix the file, or remove it to use the defaults)",
            self.place, self.message
        )
    }
}

impl std::error::Error for BadConfig {}

/// `bad config file PATH, line N, key K: what is wrong (what to do)`.
fn bad_config(path: &Path, text: &str, span: Option<Range<usize>>, message: &str) -> BadConfig {
    let message = message.lines().next().unwrap_or(message).to_string();
    let Some(span) = span else {
        return BadConfig {
            line: None,
            place: format!("bad config file {}", path.display()),
            message,
        };
    };
    let line = line_of(text, span.start);
    let key = match key_on_line(text, line) {
        Some(key) => format!(", key {key}"),
        None => String::new(),
    };
    BadConfig {
        line: Some(line),
        place: format!("bad config file {}, line {line}{key}", path.display()),
        message,
    }
}

/// `text` with its 1-based line `line` emptied.
fn blank_line(text: &str, line: usize) -> String {
    text.split_inclusive('\n')
        .enumerate()
        .map(|(i, l)| match i + 1 == line {
            true if l.ends_with('\n') => "\n",
            true => "",
            false => l,
        })
        .collect()
}

/// The 1-based line holding byte `offset`.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The key a `key = value` line sets, if the line is one.
fn key_on_line(text: &str, line: usize) -> Option<&str> {
    let (key, _) = text.lines().nth(line - 1)?.split_once('=')?;
    let key = key.trim();
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    bare.then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config> {
        Ok(Config::parse(
            PathBuf::from("/home/u/.config/baton/config.toml"),
            text.to_string(),
        )?)
    }

    fn error(text: &str) -> String {
        format!("{:#}", parse(text).unwrap_err())
    }

    #[test]
    fn allowed_uids_and_groups_by_name_or_gid() {
        let config = parse("allow-uid = [1234, 100000]\nallow-group = [\"root\", 4242]\n").unwrap();
        assert_eq!(config.allow_uids(), vec![1234, 100000]);
        assert_eq!(config.allow_groups(), vec!["root", "4242"]);
        let none = parse("jobs = 2\n").unwrap();
        assert!(none.allow_uids().is_empty() && none.allow_groups().is_empty());
    }

    #[test]
    fn config_shows_who_else_the_broker_admits_and_from_where() {
        let shown = describe(
            &parse("jobs = 2\nallow-group = [\"root\"]\n").unwrap(),
            true,
        );
        assert!(shown.contains("allow-uid     none"), "{shown}");
        let group = shown
            .lines()
            .find(|l| l.starts_with("allow-group"))
            .unwrap();
        assert!(
            group.contains("root") && group.contains("config file, line 2"),
            "{shown}"
        );
    }

    #[test]
    fn a_bad_allowed_user_or_group_names_file_line_and_key() {
        let typo = error("jobs = 2\nallow_uid = [1234]\n");
        assert!(
            typo.contains("line 2") && typo.contains("allow_uid"),
            "{typo}"
        );
        let group = error("allow-group = [\"no-such-group-here\"]\n");
        assert!(
            group.contains("line 1") && group.contains("no such group"),
            "{group}"
        );
        let uid = error("allow-uid = [\"ci\"]\n");
        assert!(uid.contains("line 1") && uid.contains("allow-uid"), "{uid}");
        let minus = error("allow-uid = [4294967295]\n");
        assert!(minus.contains("not a uid"), "{minus}");
    }

    #[test]
    fn values_and_where_they_came_from() {
        let config = parse("# mine\njobs = 6\n\nidle-timeout = 30\n").unwrap();
        let jobs = config.jobs(None);
        assert_eq!((jobs.value, jobs.source), (6, Source::File { line: 2 }));
        let idle = config.idle_timeout();
        assert_eq!((idle.value, idle.source), (30, Source::File { line: 4 }));
        assert_eq!(config.weight().source, Source::Default);
    }

    #[test]
    fn the_command_line_wins() {
        let config = parse("jobs = 6\n").unwrap();
        let jobs = config.jobs(Some(3));
        assert_eq!((jobs.value, jobs.source), (3, Source::CommandLine));
    }

    #[test]
    fn without_a_file_jobs_is_the_number_of_cpus() {
        let config = parse("").unwrap();
        assert_eq!(config.jobs(None).source, Source::Cpus);
        assert_eq!(config.idle_timeout().value, DEFAULT_IDLE_TIMEOUT_SECS);
    }

    #[test]
    fn idle_timeout_zero_means_never() {
        assert_eq!(parse("idle-timeout = 0\n").unwrap().idle_duration(), None);
        assert_eq!(
            parse("").unwrap().idle_duration(),
            Some(Duration::from_secs(DEFAULT_IDLE_TIMEOUT_SECS))
        );
    }

    #[test]
    fn a_typo_names_file_line_and_key() {
        let e = error("jobs = 4\njbos = 8\n");
        assert!(e.starts_with("bad config file /home/u/.config/baton/config.toml, line 2, key jbos: unknown field `jbos`"), "{e}");
    }

    #[test]
    fn a_negative_value_names_file_line_and_key() {
        let e = error("\nidle-timeout = -5\n");
        assert!(
            e.starts_with(
                "bad config file /home/u/.config/baton/config.toml, line 2, key idle-timeout: "
            ),
            "{e}"
        );
    }

    #[test]
    fn a_line_that_is_not_toml_names_file_and_line() {
        let e = error("jobs = 4\nthis is not toml\n");
        assert!(
            e.starts_with("bad config file /home/u/.config/baton/config.toml, line 2: "),
            "{e}"
        );
    }

    #[test]
    fn a_value_out_of_range_names_file_line_and_key() {
        let e = error("jobs = 0\n");
        assert!(e.starts_with("bad config file /home/u/.config/baton/config.toml, line 1, key jobs: jobs must be between 1 and"), "{e}");
        let e = error("weight = 0\n");
        assert!(
            e.contains("line 1, key weight: weight must be between 1 and 1000"),
            "{e}"
        );
    }

    #[test]
    fn a_cluster_table_gives_the_pool_with_defaults() {
        let config = parse(
            "jobs = 4\n[cluster]\netcd = [\"http://127.0.0.1:2379\"]\npool = \"ci\"\njobs = 6\n",
        )
        .unwrap();
        let cluster = config.cluster().unwrap();
        assert_eq!(
            (cluster.pool.as_str(), cluster.jobs, cluster.ttl),
            ("ci", 6, baton_core::cluster::DEFAULT_TTL)
        );
        assert_eq!(config.jobs(None).value, 4);
        assert!(parse("").unwrap().cluster().is_none());
    }

    #[test]
    fn a_bad_cluster_table_names_what_is_wrong() {
        let e = error("[cluster]\netcd = []\npool = \"ci\"\njobs = 6\n");
        assert!(e.contains("at least one etcd endpoint"), "{e}");
        let e = error("[cluster]\netcd = [\"http://e:2379\"]\npool = \"a/b\"\njobs = 6\n");
        assert!(e.contains("cluster pool name"), "{e}");
        let e = error("[cluster]\netcd = [\"http://e:2379\"]\npool = \"ci\"\n");
        assert!(e.contains("missing field `jobs`"), "{e}");
    }

    #[test]
    fn a_value_of_the_wrong_type_is_refused() {
        let e = error("jobs = \"eight\"\n");
        assert!(e.contains("line 1, key jobs:"), "{e}");
    }
}
