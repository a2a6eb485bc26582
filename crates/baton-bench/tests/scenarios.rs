//! Every scenario at a reduced scale: its JSON has the documented fields,
//! and the counts add up. No timing thresholds: the machine is shared.
//!
//! This test has its own main (harness = false) because the bench forks its
//! benchmark processes, which is only sound from a single-threaded process.
//! The baton rows need the real binary: `BATON_BIN`, else the workspace's
//! target/debug/baton if built; without it they are skipped, said aloud.

use anyhow::{ensure, Context, Result};
use baton_bench::cgroup::Unusable;
use baton_testkit::{skip_as, Missing};
use clap::Parser;
use serde_json::Value;
use std::path::PathBuf;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: baton_bench::BenchArgs,
}

type Test = fn(&Harness) -> Result<()>;

const TESTS: &[(&str, Test)] = &[
    (
        "token_ring_counts_every_transfer",
        token_ring_counts_every_transfer,
    ),
    (
        "blocking_vs_polling_counts_every_acquisition",
        blocking_vs_polling_counts_every_acquisition,
    ),
    (
        "mass_poll_sweeps_waiters_and_plots",
        mass_poll_sweeps_waiters_and_plots,
    ),
    (
        "bulk_wake_counts_every_wake_up",
        bulk_wake_counts_every_wake_up,
    ),
    (
        "broadcast_counts_items_and_wake_ups",
        broadcast_counts_items_and_wake_ups,
    ),
    (
        "universe_counts_every_job_of_both_trees",
        universe_counts_every_job_of_both_trees,
    ),
    (
        "cluster_counts_grants_and_watch_events",
        cluster_counts_grants_and_watch_events,
    ),
    (
        "memory_counts_each_builds_oom_kills",
        memory_counts_each_builds_oom_kills,
    ),
    (
        "make_tree_runs_each_way_at_each_n",
        make_tree_runs_each_way_at_each_n,
    ),
    ("bad_scale_is_refused", bad_scale_is_refused),
];

fn main() {
    let harness = Harness::new();
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let (mut passed, mut failed) = (0, 0);
    for (name, test) in TESTS
        .iter()
        .filter(|(name, _)| filter.as_deref().is_none_or(|f| name.contains(f)))
    {
        match test(&harness) {
            Ok(()) => {
                println!("test {name} ... ok");
                passed += 1;
            }
            Err(e) => {
                println!("test {name} ... FAILED\n    {e:#}");
                failed += 1;
            }
        }
    }
    println!("\nscenarios: {passed} passed, {failed} failed");
    // Before exit, which runs no destructor: the temporary directory goes.
    drop(harness);
    if failed > 0 {
        std::process::exit(1);
    }
}

struct Harness {
    baton: Option<PathBuf>,
    tmp: PathBuf,
}

impl Harness {
    fn new() -> Harness {
        let baton = std::env::var_os("BATON_BIN")
            .map(PathBuf::from)
            .or_else(|| {
                let built =
                    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/baton");
                built.is_file().then_some(built)
            });
        if baton.is_none() {
            record_skip(
                Missing::Baton,
                "no baton binary (set BATON_BIN or build target/debug/baton): baton rows skipped",
            );
        }
        if !std::path::Path::new("/dev/fuse").exists() {
            record_skip(Missing::Fuse, "no /dev/fuse: baton FUSE rows skipped");
        }
        let tmp = std::env::temp_dir().join(format!("baton-bench-test-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).expect("creating a temporary directory");
        Harness { baton, tmp }
    }

    /// Runs `baton bench ARGS... --json` in this process.
    fn bench(&self, args: &[&str]) -> Result<Value> {
        let mut argv = vec!["bench".to_string()];
        argv.extend(args.iter().map(|a| a.to_string()));
        match &self.baton {
            Some(path) => argv.extend(["--baton-bin".to_string(), path.display().to_string()]),
            None => argv.push("--without-baton".to_string()),
        }
        let cli = Cli::try_parse_from(&argv)?;
        let doc = baton_bench::measure(&cli.args)?;
        check_document(&doc)?;
        Ok(doc)
    }

    /// The mechanisms a scenario must show, less baton's when it is absent.
    /// The rows a run here must have: baton's only with a baton binary,
    /// its FUSE file's only where FUSE exists (the bench skips them
    /// otherwise, with a note).
    fn expected(&self, all: &[&'static str]) -> Vec<&'static str> {
        let fuse = std::path::Path::new("/dev/fuse").exists();
        all.iter()
            .copied()
            // The fast path's ring and pile alone need no broker binary.
            .filter(|m| {
                self.baton.is_some()
                    || !m.starts_with("baton")
                    || m.starts_with("baton fast path, ring only")
                    || m.starts_with("baton fast path, pile only")
            })
            .filter(|m| fuse || !(m.starts_with("baton FUSE") || m.ends_with("(fuse)")))
            .collect()
    }
}

/// Counts the skipped rows in scripts/test's tally, under this harness's
/// name: its scenarios do not run on threads named after them.
fn record_skip(missing: Missing, reason: &str) {
    skip_as("scenarios", missing, reason);
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.tmp);
    }
}

/// The fields every document and row must have (docs/benchmarks.md).
fn check_document(doc: &Value) -> Result<()> {
    ensure!(doc["scenario"].is_string(), "no scenario in {doc}");
    ensure!(
        doc["machine"]["kernel"]
            .as_str()
            .is_some_and(|k| !k.is_empty()),
        "no kernel in {doc}"
    );
    ensure!(
        doc["machine"]["cpus"].as_u64().is_some_and(|n| n >= 1),
        "no cpus in {doc}"
    );
    let results = doc["results"].as_array().context("no results array")?;
    ensure!(!results.is_empty(), "no results");
    for row in results {
        ensure!(row["mechanism"].is_string(), "no mechanism in {row}");
        ensure!(
            row["waiters"].as_u64().is_some_and(|n| n >= 1),
            "bad waiters in {row}"
        );
        ensure!(
            row["operations"].as_u64().is_some_and(|n| n >= 1),
            "bad operations in {row}"
        );
        for key in [
            "context_switches_per_op",
            "voluntary_context_switches_per_op",
            "cpu_us_per_op",
            "wall_s",
        ] {
            ensure!(
                row[key].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0),
                "bad {key} in {row}"
            );
        }
        ensure!(row["wall_s"].as_f64() > Some(0.0), "no wall time in {row}");
    }
    Ok(())
}

fn rows<'a>(doc: &'a Value, mechanism: &str) -> Vec<&'a Value> {
    doc["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["mechanism"] == mechanism)
        .collect()
}

fn mechanisms(doc: &Value) -> Vec<String> {
    let mut names: Vec<String> = doc["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["mechanism"].as_str().map(String::from))
        .collect();
    names.dedup();
    names
}

fn u64_of(row: &Value, key: &str) -> u64 {
    row[key].as_u64().unwrap_or_default()
}

fn f64_of(row: &Value, key: &str) -> f64 {
    row[key].as_f64().unwrap_or_default()
}

fn token_ring_counts_every_transfer(h: &Harness) -> Result<()> {
    let doc = h.bench(&["token-ring", "--processes", "6", "--ops", "300"])?;
    let expected = h.expected(&[
        "pipe, blocking read",
        "pipe, poll + non-blocking read",
        "POSIX semaphore",
        "futex, FIFO hand-off",
        "SysV semaphore",
        "eventfd semaphore",
        "baton native",
        "baton native, no spin",
        "baton native, no io_uring",
        "baton fast path, ring only (no broker)",
        "baton fast path, pile only (no broker)",
        "baton fast path",
        "baton fast path, pile",
    ]);
    ensure!(
        mechanisms(&doc) == expected,
        "mechanisms {:?}",
        mechanisms(&doc)
    );
    for row in doc["results"].as_array().into_iter().flatten() {
        // Exactly the asked transfers, extra tokens notwithstanding.
        ensure!(u64_of(row, "operations") == 300, "transfers in {row}");
    }
    // baton's rows cost more than the kernel's hand-offs: a note says why.
    let says_why = doc["notes"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|n| n.as_str().is_some_and(|n| n.contains("the broker hop")));
    ensure!(
        says_why == h.baton.is_some(),
        "a note on baton's broker hop exactly when baton's rows are there: {}",
        doc["notes"]
    );
    Ok(())
}

/// Each acquisition but the last of each waiter runs a sleeping job, and a
/// sleep blocks: the counted voluntary switches must cover at least those.
fn check_job_runner_counts(row: &Value, budget: u64) -> Result<()> {
    let ops = u64_of(row, "operations");
    ensure!(
        ops == budget + u64_of(row, "waiters"),
        "acquisitions in {row}"
    );
    ensure!(
        f64_of(row, "voluntary_context_switches_per_op") * ops as f64 >= budget as f64,
        "fewer voluntary switches than sleeping jobs in {row}"
    );
    Ok(())
}

fn blocking_vs_polling_counts_every_acquisition(h: &Harness) -> Result<()> {
    let doc = h.bench(&[
        "blocking-vs-polling",
        "--waiters",
        "8",
        "--ops",
        "100",
        "--job-us",
        "200",
    ])?;
    let expected = h.expected(&[
        "pipe, blocking read",
        "pipe, poll + non-blocking read",
        "baton native",
        "baton native, poll",
        "baton fast path",
        "baton fast path, pile",
        "baton FUSE file, poll",
        "baton FUSE file, notify-all",
    ]);
    ensure!(
        mechanisms(&doc) == expected,
        "mechanisms {:?}",
        mechanisms(&doc)
    );
    doc["results"]
        .as_array()
        .into_iter()
        .flatten()
        .try_for_each(|row| check_job_runner_counts(row, 100))
}

fn mass_poll_sweeps_waiters_and_plots(h: &Harness) -> Result<()> {
    let plot = h.tmp.join("mass-poll.svg");
    let plot_arg = plot.display().to_string();
    let doc = h.bench(&[
        "mass-poll",
        "--waiters",
        "4,16",
        "--ops",
        "100",
        "--job-us",
        "200",
        "--plot",
        &plot_arg,
    ])?;
    let polled = rows(&doc, "pipe, poll + non-blocking read");
    ensure!(
        polled
            .iter()
            .map(|r| u64_of(r, "waiters"))
            .collect::<Vec<_>>()
            == [4, 16],
        "waiters swept: {polled:?}"
    );
    for mechanism in h.expected(&[
        "pipe, poll + non-blocking read",
        "POSIX semaphore",
        "futex, FIFO hand-off",
        "baton native",
        "baton native, no spin",
        "baton native, no io_uring",
        "baton native, poll",
        "baton fast path",
        "baton fast path, pile only (no broker)",
        "baton fast path, pile",
        "baton FUSE file, poll",
    ]) {
        ensure!(!rows(&doc, mechanism).is_empty(), "no {mechanism} rows");
        rows(&doc, mechanism)
            .into_iter()
            .try_for_each(|row| check_job_runner_counts(row, 100))?;
    }
    // --json and --plot together go through run(); measure() alone does not
    // plot, so draw through the same path the command uses.
    let cli = Cli::try_parse_from([
        "bench",
        "mass-poll",
        "--waiters",
        "2",
        "--ops",
        "20",
        "--job-us",
        "100",
        "--without-baton",
        "--plot",
        &plot_arg,
    ])?;
    baton_bench::run(cli.args)?;
    let svg = std::fs::read_to_string(&plot).context("reading the plot")?;
    ensure!(
        svg.contains("<svg") && svg.contains("context switches per operation"),
        "not the plot: {}",
        &svg[..svg.len().min(200)]
    );
    Ok(())
}

fn bulk_wake_counts_every_wake_up(h: &Harness) -> Result<()> {
    let doc = h.bench(&["bulk-wake", "--waiters", "6", "--wake", "3", "--ops", "300"])?;
    ensure!(
        mechanisms(&doc)
            == h.expected(&[
                "SysV semaphore",
                "futex, FUTEX_WAKE 1",
                "baton native",
                "baton native, no spin",
                "baton native, no io_uring",
                "baton fast path"
            ]),
        "mechanisms {:?}",
        mechanisms(&doc)
    );
    for row in doc["results"].as_array().into_iter().flatten() {
        ensure!(u64_of(row, "operations") == 300, "wake-ups in {row}");
        ensure!(
            row["broker_cpu_us_per_op"].is_f64() == row["broker_context_switches_per_op"].is_f64(),
            "the broker's CPU beside its switches in {row}"
        );
        // The per-waiter counts add up to the wake-ups: the fewest any
        // waiter got cannot be above the mean, the most not below it.
        let (min, max, waiters) = (
            u64_of(row, "min_per_waiter"),
            u64_of(row, "max_per_waiter"),
            u64_of(row, "waiters"),
        );
        ensure!(
            waiters == 6 && min * waiters <= 300 && max * waiters >= 300,
            "fairness columns in {row}"
        );
    }
    Ok(())
}

fn broadcast_counts_items_and_wake_ups(h: &Harness) -> Result<()> {
    let doc = h.bench(&["broadcast", "--waiters", "8", "--wake", "2", "--ops", "200"])?;
    ensure!(
        mechanisms(&doc)
            == h.expected(&[
                "pthread_cond_broadcast",
                "pthread directed hand-off",
                "baton native, limit +K"
            ]),
        "mechanisms {:?}",
        mechanisms(&doc)
    );
    for row in doc["results"].as_array().into_iter().flatten() {
        ensure!(u64_of(row, "operations") == 200, "items in {row}");
        // A waiter that finds an item posted before it went to sleep takes
        // it without a wake-up (often, on a busy machine: 0.71 per item was
        // seen beside stress-ng), so the count per item has no floor of 1;
        // that wake-ups are counted at all is what this checks.
        ensure!(
            f64_of(row, "wakeups_per_op") > 0.0,
            "no wake-ups counted in {row}"
        );
    }
    Ok(())
}

fn universe_counts_every_job_of_both_trees(h: &Harness) -> Result<()> {
    // Two rounds: the second runs under the brokers the first started,
    // which the bench checks got every token back.
    let doc = h.bench(&[
        "universe",
        "--waiters",
        "4",
        "--ops",
        "2",
        "--job-us",
        "1000",
    ])?;
    let ways = h.expected(&[
        "bmake -jN",
        "baton run (fifo)",
        "baton run (pipe)",
        "baton run (fuse)",
    ]);
    // One block of rows per tree.
    ensure!(
        mechanisms(&doc) == ways.repeat(2),
        "mechanisms {:?}",
        mechanisms(&doc)
    );
    for (shape, jobs) in [("universe", 600), ("flat", 1200)] {
        let of_shape: Vec<&Value> = doc["results"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["shape"] == shape)
            .collect();
        ensure!(of_shape.len() == ways.len(), "{shape}: {of_shape:?}");
        for row in of_shape {
            ensure!(
                u64_of(row, "operations") == jobs && u64_of(row, "waiters") == 4,
                "{shape}: {row}"
            );
            ensure!(
                u64_of(row, "csw") > 0 && f64_of(row, "user_s") > 0.0,
                "nothing counted: {row}"
            );
            // The ratios are to bmake's own row of the same shape.
            ensure!(
                row["mechanism"] != "bmake -jN" || f64_of(row, "csw_x") == 1.0,
                "{row}"
            );
            ensure!(
                row["mechanism"] != "bmake -jN" || f64_of(row, "wall_pair_x") == 1.0,
                "{row}"
            );
            ensure!(f64_of(row, "wall_pair_x") > 0.0, "no paired ratio: {row}");
        }
    }
    Ok(())
}

/// Real etcd and real brokers: every grant counted, and the queue's herd
/// figure within its design (one event to the head per freed token, one to
/// the broker behind it). One cluster token, so that three brokers contend
/// for it and wait on watches; a broker alone never waits.
fn cluster_counts_grants_and_watch_events(h: &Harness) -> Result<()> {
    if h.baton.is_none() {
        return Ok(()); // said aloud by Harness::new: no broker to measure.
    }
    let doc = h.bench(&[
        "cluster",
        "--waiters",
        "1,3",
        "--tokens",
        "1",
        "--ops",
        "20",
        "--job-us",
        "1000",
    ])?;
    ensure!(
        mechanisms(&doc)
            == [
                "etcd-queue",
                "etcd-watch-all",
                "etcd-queue",
                "etcd-watch-all"
            ],
        "mechanisms {:?}",
        mechanisms(&doc)
    );
    for row in doc["results"].as_array().into_iter().flatten() {
        ensure!(u64_of(row, "operations") == 20, "{row}");
        let events = row["watch_events_per_grant"]
            .as_f64()
            .with_context(|| format!("no watch_events_per_grant in {row}"))?;
        // A broker alone finds the token free each time it asks (its
        // client asks again only once the token is back in etcd): nothing
        // to watch. Three on one token wait for it in turn, woken by watch
        // events: most grants come after one.
        if u64_of(row, "waiters") == 1 {
            ensure!(events == 0.0, "a lone broker watched: {row}");
        } else {
            ensure!(
                events >= 0.5,
                "contended grants without watch events: {row}"
            );
        }
        ensure!(
            row["mechanism"] != "etcd-queue" || events <= 2.0,
            "the queue woke more than the head and the one behind it: {row}"
        );
        // Every grant was timed: a trip through etcd takes longer than the
        // 10 µs the columns resolve.
        ensure!(
            f64_of(row, "grant_p50_ms") > 0.0 && f64_of(row, "grant_p99_ms") > 0.0,
            "grant latencies missing: {row}"
        );
    }
    Ok(())
}

fn make_tree_runs_each_way_at_each_n(h: &Harness) -> Result<()> {
    // scripts/test names make 4.4.1 for the tests; the bench reads its own variable.
    if std::env::var_os("BATON_BENCH_MAKE44").is_none() {
        let Some(make) = std::env::var_os("BATON_TEST_MAKE44") else {
            record_skip(
                Missing::Make44,
                "make_tree: neither BATON_BENCH_MAKE44 nor BATON_TEST_MAKE44 names make 4.4.1",
            );
            return Ok(());
        };
        std::env::set_var("BATON_BENCH_MAKE44", make);
    }
    let doc = h.bench(&[
        "make-tree",
        "--waiters",
        "4,8",
        "--ops",
        "1",
        "--job-us",
        "1000",
    ])?;
    // Its fuse rows need /dev/fuse; the fifo row does not.
    let fuse = std::path::Path::new("/dev/fuse").exists();
    let all = [
        "make 4.4.1 -jN (own FIFO)",
        "baton run (fuse)",
        "baton run (fuse, notify-all)",
        "baton run (fifo)",
    ];
    let ways: Vec<&str> = h
        .expected(&all)
        .into_iter()
        .filter(|w| fuse || !w.contains("(fuse"))
        .collect();
    ensure!(
        mechanisms(&doc) == ways.repeat(2),
        "mechanisms {:?}",
        mechanisms(&doc)
    );
    for (i, row) in doc["results"].as_array().into_iter().flatten().enumerate() {
        let n = if i < ways.len() { 4 } else { 8 };
        ensure!(
            u64_of(row, "operations") == 16 * 16 * 20 && u64_of(row, "waiters") == n,
            "{row}"
        );
        ensure!(u64_of(row, "csw") > 0, "no context switches counted: {row}");
        // One round (--ops 1): each row has one build, so one load reading,
        // and its range is that one reading.
        ensure!(
            row["load_min"].is_f64() && row["load_min"] == row["load_max"],
            "the load columns are not the one build's reading: {row}"
        );
        // The ratios are to make's own row at the same N.
        ensure!(
            row["mechanism"] != ways[0] || f64_of(row, "csw_x") == 1.0,
            "{row}"
        );
        ensure!(
            row["mechanism"] == ways[0] || row["broker_context_switches_per_op"].as_f64().is_some(),
            "no broker figures: {row}"
        );
    }
    Ok(())
}

fn memory_counts_each_builds_oom_kills(h: &Harness) -> Result<()> {
    // The skip under its cause: not root, or no memory cgroup (v1 or v2).
    if let Err(why) = baton_bench::cgroup::Hierarchy::find() {
        let missing = match why {
            Unusable::NotRoot => Missing::Root,
            Unusable::NoMemoryCgroup(_) => Missing::Cgroup,
        };
        record_skip(missing, &format!("baton bench memory: {why}"));
        return Ok(());
    }
    let doc = h.bench(&[
        "memory",
        "--waiters",
        "8",
        "--ops",
        "1",
        "--tokens",
        "6",
        "--job-us",
        "300000",
    ])?;
    let ways = h.expected(&[
        "make -j8",
        "make -j3",
        "baton --jobs 8, gate 200M",
        "baton --jobs 8, gate 200M, pause",
    ]);
    ensure!(
        mechanisms(&doc) == ways,
        "mechanisms {:?}",
        mechanisms(&doc)
    );
    for row in doc["results"].as_array().into_iter().flatten() {
        ensure!(
            u64_of(row, "operations") == 6
                && row["oom_kills"].is_u64()
                && row["most_at_once"].is_u64(),
            "{row}"
        );
        if row["mechanism"] != "make -j8" {
            // What fits, and what the gate keeps fitting: every job done.
            ensure!(
                u64_of(row, "builds_ok") == 1 && u64_of(row, "oom_kills") == 0,
                "{row}"
            );
        }
    }
    ensure!(
        f64_of(&doc["results"][1], "wall_x") == 1.0,
        "ratios are to make -j3: {doc}"
    );
    Ok(())
}

fn bad_scale_is_refused(h: &Harness) -> Result<()> {
    ensure!(
        h.bench(&["bulk-wake", "--waiters", "0"]).is_err(),
        "zero waiters accepted"
    );
    if h.baton.is_some() {
        let refused = h.bench(&["bulk-wake", "--waiters", "2", "--ops", "70000"]);
        ensure!(
            refused
                .as_ref()
                .is_err_and(|e| format!("{e:#}").contains("lower --ops")),
            "more tokens than a fast-path record holds: {refused:?}"
        );
    }
    ensure!(
        h.bench(&["broadcast", "--waiters", "2", "--wake", "3"])
            .is_err(),
        "more items per round than waiters accepted"
    );
    ensure!(
        Cli::try_parse_from(["bench", "no-such-scenario"]).is_err(),
        "unknown scenario accepted"
    );
    Ok(())
}
