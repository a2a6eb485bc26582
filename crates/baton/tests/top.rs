//! `baton top` in a real terminal (tmux), and the figures behind it:
//! `baton status --json`'s builds against what the test's builds hold,
//! `--prometheus` through the reference Python parser, and the broker's
//! memory with a thousand clients.

mod common;

use baton_core::protocol::Request;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Long enough for anything on a loaded machine; only a hang guard.
const GUARD: Duration = Duration::from_secs(30);

/// A tmux server of the test's own (its own socket, no config file),
/// killed when dropped.
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    /// One detached session of `width` × `height` running `command` (a
    /// shell command line).
    fn start(dir: &Path, width: u16, height: u16, command: &str) -> Self {
        let tmux = Tmux {
            socket: dir.join("tmux.sock"),
        };
        let ok = tmux
            .cmd(&[
                "new-session",
                "-d",
                "-x",
                &width.to_string(),
                "-y",
                &height.to_string(),
                command,
            ])
            .status()
            .expect("run tmux (scripts/test installs it)");
        assert!(ok.success(), "tmux new-session failed");
        tmux
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("tmux");
        c.arg("-S")
            .arg(&self.socket)
            .args(["-f", "/dev/null"])
            .args(args);
        c
    }

    fn keys(&self, keys: &str) {
        assert!(
            self.cmd(&["send-keys", keys]).status().unwrap().success(),
            "tmux send-keys {keys}"
        );
    }

    fn resize(&self, width: u16, height: u16) {
        assert!(self
            .cmd(&[
                "resize-window",
                "-x",
                &width.to_string(),
                "-y",
                &height.to_string()
            ])
            .status()
            .unwrap()
            .success());
    }

    /// The pane's text as it is on screen now.
    fn screen(&self) -> String {
        String::from_utf8(self.cmd(&["capture-pane", "-p"]).output().unwrap().stdout).unwrap()
    }

    /// Waits until the screen satisfies `cond`; returns it.
    fn wait_screen(&self, what: &str, mut cond: impl FnMut(&str) -> bool) -> String {
        let mut last = String::new();
        let start = Instant::now();
        while start.elapsed() < GUARD {
            last = self.screen();
            if cond(&last) {
                return last;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("timed out waiting for {what}; the screen:\n{last}");
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]).status();
    }
}

/// The HELD column of the build named `name` in top's table, if shown.
fn held_on_screen(screen: &str, name: &str) -> Option<u32> {
    screen.lines().find_map(|line| {
        let cells: Vec<&str> = line
            .trim_matches(|c: char| c == '│' || c.is_whitespace())
            .split_whitespace()
            .collect();
        (cells.first() == Some(&name))
            .then(|| cells.get(2)?.parse().ok())
            .flatten()
    })
}

/// `baton top` in tmux, writing its exit status to `rc` when it ends.
fn top_in_tmux(dir: &Path, socket: &Path, rc: &Path) -> Tmux {
    let command = format!(
        "'{}' top --socket '{}'; echo $? > '{}'; sleep 600",
        baton_bin(),
        socket.display(),
        rc.display()
    );
    Tmux::start(dir, 110, 36, &command)
}

/// A named build that holds exactly `tokens` until it is dropped (SIGTERM
/// by pid: baton run passes it on and gives every token back).
struct HoldingBuild(Guarded);

impl HoldingBuild {
    fn start(broker: &RunningBroker, name: &str, tokens: u32) -> Self {
        let t = tokens.to_string();
        let child = broker
            .run(&["--name", name, "-t", &t, "--max", &t, "--", "sleep", "600"])
            .stdout(Stdio::null())
            .spawn_guarded()
            .expect("start baton run");
        HoldingBuild(child)
    }
}

impl Drop for HoldingBuild {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = wait_timeout(&mut self.0, GUARD);
    }
}

/// Waits until the broker's builds named in `want` hold those tokens.
fn wait_for_holdings(broker: &RunningBroker, want: &[(&str, u32)]) {
    wait_for(GUARD, "the builds to hold their tokens", || {
        let s = broker.status();
        want.iter()
            .all(|&(name, held)| s.builds.iter().any(|b| b.name == name && b.held == held))
    });
}

fn wait_until_all_free(broker: &RunningBroker) {
    wait_for(GUARD, "every token to come back", || {
        let s = broker.status();
        s.free == s.limit && s.held == 0
    });
    broker.assert_all_free();
}

#[test]
fn top_shows_both_builds_raises_the_limit_survives_a_resize_and_quits_with_0() {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("top");
    {
        let _alpha = HoldingBuild::start(&broker, "alpha", 2);
        let _beta = HoldingBuild::start(&broker, "beta", 1);
        wait_for_holdings(&broker, &[("alpha", 2), ("beta", 1)]);
        let rc = dir.path().join("rc");
        let tmux = top_in_tmux(dir.path(), &broker.socket, &rc);
        tmux.wait_screen("alpha holding 2 and beta 1 on screen", |s| {
            held_on_screen(s, "alpha") == Some(2) && held_on_screen(s, "beta") == Some(1)
        });

        tmux.keys("+");
        wait_for(GUARD, "the limit to be 5", || broker.status().limit == 5);
        tmux.wait_screen("the new limit and how to undo it", |s| {
            s.contains("limit 5 ") && s.contains("limit 4 -> 5 (undo: -, or baton limit 4)")
        });

        tmux.resize(50, 14);
        let narrow = tmux.wait_screen("the narrow layout, whole", |s| {
            s.lines().all(|l| l.chars().count() <= 50)
                && s.starts_with("baton top")
                && s.contains("limit 5 ")
                && s.contains("NAME")
        });
        assert_headers_whole(&narrow);
        tmux.keys("-");
        wait_for(GUARD, "the limit back at 4", || broker.status().limit == 4);
        tmux.wait_screen("the undo of the undo, whole in 50 columns", |s| {
            let joined = s.split_whitespace().collect::<Vec<_>>().join(" ");
            joined.contains("limit 5 -> 4 (undo: +, or baton limit 5)")
        });
        tmux.resize(110, 36);
        tmux.wait_screen("both builds again after the resize", |s| {
            held_on_screen(s, "alpha") == Some(2) && held_on_screen(s, "beta") == Some(1)
        });

        tmux.keys("q");
        wait_for(GUARD, "top to exit", || {
            rc.exists() && !std::fs::read_to_string(&rc).unwrap().is_empty()
        });
        assert_eq!(
            std::fs::read_to_string(&rc).unwrap().trim(),
            "0",
            "top's exit status"
        );
    }
    wait_until_all_free(&broker);
}

/// Every word of the builds table's header line is a whole header.
fn assert_headers_whole(screen: &str) {
    const WORDS: [&str; 10] = [
        "NAME", "WEIGHT", "HELD", "JOBS", "WAITING", "GRANTS", "WAIT", "p50", "p99", "RUNNING",
    ];
    let header = screen
        .lines()
        .find(|l| l.contains("NAME"))
        .unwrap_or_else(|| panic!("no table header on screen:\n{screen}"));
    let words: Vec<&str> = header
        .split(|c: char| c.is_whitespace() || c == '│')
        .filter(|w| !w.is_empty())
        .collect();
    assert!(
        words.contains(&"HELD") && words.iter().all(|w| WORDS.contains(w)),
        "a header is cut: {header:?}\n{screen}"
    );
}

/// Before any broker answers at the socket, top says there is none there
/// (not that one went away); with one that has no builds, the holders
/// panel says why it is empty; once it stops, top says it is gone.
#[test]
fn top_tells_no_broker_yet_from_broker_gone_and_explains_an_empty_panel() {
    let dir = TempDir::new("top-never");
    let socket = dir.path().join("later/socket");
    let rc = dir.path().join("rc");
    let tmux = top_in_tmux(dir.path(), &socket, &rc);
    let screen = tmux.wait_screen("no broker at the path", |s| {
        s.contains(&format!("no broker at {}", socket.display()))
    });
    assert!(!screen.contains("broker gone"), "{screen}");

    let log = std::fs::File::create(dir.path().join("broker.log")).unwrap();
    let mut broker = baton()
        .args(["serve", "--jobs", "2", "--no-fuse", "--socket"])
        .arg(&socket)
        .stderr(log)
        .spawn_guarded()
        .expect("start a broker");
    let screen = tmux.wait_screen("the broker, with no builds", |s| {
        s.contains("limit 2 ") && s.contains("no build holds or waits for tokens")
    });
    assert!(!screen.contains("holders of -"), "{screen}");

    unsafe { libc::kill(broker.id() as i32, libc::SIGTERM) };
    wait_timeout(&mut broker, GUARD).expect("the broker stops");
    tmux.wait_screen("broker gone", |s| s.contains("broker gone, retrying"));
    tmux.keys("q");
    wait_for(GUARD, "top to exit", || {
        std::fs::read_to_string(&rc).is_ok_and(|s| s.trim() == "0")
    });
}

#[test]
fn top_says_the_broker_is_gone_and_reconnects_to_its_successor() {
    let mut broker = RunningBroker::start(3);
    let dir = TempDir::new("top-restart");
    let rc = dir.path().join("rc");
    let tmux = top_in_tmux(dir.path(), &broker.socket, &rc);
    tmux.wait_screen("the first broker's limit", |s| s.contains("limit 3 "));

    broker.stop_with(libc::SIGTERM);
    tmux.wait_screen("broker gone", |s| s.contains("broker gone, retrying"));

    let log = std::fs::File::create(dir.path().join("second.log")).unwrap();
    let mut second = baton()
        .args(["serve", "--jobs", "7", "--socket"])
        .arg(&broker.socket)
        .stderr(log)
        .spawn_guarded()
        .expect("start the second broker");
    let screen = tmux.wait_screen("the second broker's limit", |s| {
        s.contains("limit 7 ") && !s.contains("broker gone")
    });
    assert!(
        screen.contains(&format!("broker pid {}", second.id())),
        "{screen}"
    );

    tmux.keys("q");
    wait_for(GUARD, "top to exit", || {
        std::fs::read_to_string(&rc).is_ok_and(|s| s.trim() == "0")
    });
    unsafe { libc::kill(second.id() as i32, libc::SIGTERM) };
    wait_timeout(&mut second, GUARD).expect("the second broker stops");
}

#[test]
fn top_without_a_terminal_refuses_and_points_at_status_json() {
    let broker = RunningBroker::start(2);
    let out = baton()
        .args(["top", "--socket"])
        .arg(&broker.socket)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("baton: ") && err.contains("baton status --json"),
        "{err}"
    );
    assert!(
        out.stdout.is_empty(),
        "nothing drawn: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Two named builds holding known counts, a native client holding 1 and
/// another that waits for it: at that quiet moment, every build's entry
/// says what it holds and waits for, and the holders of each add up to it.
#[test]
fn status_json_builds_hold_what_the_builds_really_hold() {
    let broker = RunningBroker::start(4);
    {
        let _alpha = HoldingBuild::start(&broker, "alpha", 2);
        let _beta = HoldingBuild::start(&broker, "beta", 1);
        wait_for_holdings(&broker, &[("alpha", 2), ("beta", 1)]);
        let mut holder = broker.client("native holder");
        holder.acquire(1).unwrap();
        let waiter = std::thread::spawn({
            let socket = broker.socket.clone();
            move || {
                let mut c = baton_client::Client::connect(&socket, "native waiter").unwrap();
                c.acquire(1).unwrap();
                c.release(1).unwrap();
                c
            }
        });
        wait_for(GUARD, "the waiter to queue", || {
            broker.status().waiters.len() == 1
        });

        let json = baton()
            .args(["status", "--json", "--socket"])
            .arg(&broker.socket)
            .output()
            .unwrap();
        assert!(json.status.success());
        let s: baton_client::Status = serde_json::from_slice(&json.stdout).unwrap();
        let by_name = |name: &str| {
            s.builds
                .iter()
                .find(|b| b.name == name)
                .unwrap_or_else(|| panic!("no build {name}: {s:#?}"))
        };
        let held_waiting = |name: &str| (by_name(name).held, by_name(name).waiting);
        assert_eq!(
            [
                held_waiting("alpha"),
                held_waiting("beta"),
                held_waiting("native holder"),
                held_waiting("native waiter")
            ],
            [(2, 0), (1, 0), (1, 0), (0, 1)]
        );
        for b in &s.builds {
            let held: u32 = s
                .holders
                .iter()
                .filter(|h| h.build == b.id)
                .map(|h| h.tokens)
                .sum();
            assert_eq!(held, b.held, "the holders of {} hold what it holds", b.name);
        }
        assert_eq!(by_name("alpha").weight, 1);
        let holder_build = by_name("native holder");
        assert_eq!(
            (
                holder_build.waits,
                holder_build.wait_ms_p50,
                holder_build.wait_ms_p99
            ),
            (1, Some(0.0), Some(0.0)),
            "granted at once"
        );
        assert_eq!(
            by_name("native waiter").wait_ms_p50,
            None,
            "no ACQUIRE answered yet"
        );

        // The waiter waits at least as long as the holder keeps its token
        // after the waiter is seen queued.
        let queued = Instant::now();
        std::thread::sleep(Duration::from_millis(200));
        holder.release(1).unwrap();
        let held_back = queued.elapsed().as_secs_f64() * 1000.0;
        let waiter = join_within(waiter, GUARD, "the waiter's grant");
        let s = broker.status();
        let w = s
            .builds
            .iter()
            .find(|b| b.name == "native waiter")
            .expect("still connected");
        assert_eq!(w.waits, 1);
        assert!(
            w.wait_ms_p99.unwrap() >= 200.0 && w.wait_ms_total >= 200.0,
            "waited {:?} ms, held back {held_back:.0} ms",
            w.wait_ms_p99
        );
        drop(waiter);
    }
    wait_until_all_free(&broker);
}

type Samples = Vec<(String, serde_json::Map<String, serde_json::Value>, f64)>;

/// `baton status --prometheus`, read by prometheus_client's own text
/// parser (the reference client library's): every sample, as JSON.
fn parse_prometheus(text: &[u8]) -> Samples {
    python_samples(&["-c", PARSE_SAMPLES], text)
}

/// Prints every sample of the exposition on stdin as JSON.
const PARSE_SAMPLES: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append([s.name, s.labels, s.value])
print(json.dumps(out))
"#;

/// GET `url` with Python's own HTTP client, checks the answer is the
/// Prometheus text format, and parses it as [`parse_prometheus`] does.
fn scrape(url: &str) -> Samples {
    let script = r#"
import json, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
with urllib.request.urlopen(sys.argv[1], timeout=30) as r:
    kind = r.headers["Content-Type"]
    assert kind.startswith("text/plain; version=0.0.4"), kind
    text = r.read().decode()
out = []
for family in text_string_to_metric_families(text):
    for s in family.samples:
        out.append([s.name, s.labels, s.value])
print(json.dumps(out))
"#;
    python_samples(&["-c", script, url], b"")
}

fn python_samples(args: &[&str], text: &[u8]) -> Samples {
    let mut child = Command::new(python())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), text).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client refused the exposition: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(text)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn status_prometheus_parses_with_the_reference_parser() {
    let broker = RunningBroker::start_with(4, &["--max-load", "1000"]);
    {
        let _alpha = HoldingBuild::start(&broker, "alpha \"quoted\"", 2);
        wait_for_holdings(&broker, &[("alpha \"quoted\"", 2)]);
        let out = baton()
            .args(["status", "--prometheus", "--socket"])
            .arg(&broker.socket)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let samples = parse_prometheus(&out.stdout);
        let value = |name: &str, label: Option<(&str, &str)>| sample(&samples, name, label);
        assert_eq!(value("baton_limit", None), 4.0);
        assert_eq!(value("baton_held", None), 2.0);
        assert_eq!(
            value("baton_build_held", Some(("build", "alpha \"quoted\""))),
            2.0
        );
        assert_eq!(
            value(
                "baton_build_grants_total",
                Some(("build", "alpha \"quoted\""))
            ),
            2.0
        );
        assert!(
            value(
                "baton_build_waits_total",
                Some(("build", "alpha \"quoted\""))
            ) >= 1.0
        );
        assert_eq!(
            value(
                "baton_build_wait_quantile_seconds",
                Some(("quantile", "0.5"))
            ),
            0.0,
            "alpha's ACQUIRE was granted at once"
        );
        assert_eq!(value("baton_gate_open", Some(("gate", "load"))), 1.0);
        assert_eq!(
            value("baton_gate_threshold", Some(("gate", "load"))),
            1000.0
        );
    }
    wait_until_all_free(&broker);
}

/// The value of the first sample named `name` (with the label, if given).
fn sample(samples: &Samples, name: &str, label: Option<(&str, &str)>) -> f64 {
    samples
        .iter()
        .find(|(n, labels, _)| {
            n == name
                && label.is_none_or(|(k, v)| labels.get(k).and_then(|x| x.as_str()) == Some(v))
        })
        .map(|s| s.2)
        .unwrap_or_else(|| panic!("no sample {name} {label:?} in {samples:?}"))
}

/// The distinct values of label `key` over all samples.
fn label_values(samples: &Samples, key: &str) -> std::collections::BTreeSet<String> {
    samples
        .iter()
        .filter_map(|(_, labels, _)| Some(labels.get(key)?.as_str()?.to_string()))
        .collect()
}

/// `serve --metrics-listen` on a free port: two scrapes over HTTP, read
/// by the reference parser, give what the builds hold, with no pid label,
/// and neither they nor `baton status --prometheus` show up as a build.
#[test]
fn metrics_endpoint_serves_what_builds_hold_and_scrapes_are_not_builds() {
    let broker = RunningBroker::start_with(4, &["--metrics-listen", "127.0.0.1:0"]);
    let mut url = String::new();
    wait_for(GUARD, "the broker to log its metrics address", || {
        let log = broker.log();
        url = log
            .split_whitespace()
            .find(|w| w.starts_with("http://") && w.ends_with("/metrics"))
            .unwrap_or_default()
            .to_string();
        !url.is_empty()
    });
    {
        let _alpha = HoldingBuild::start(&broker, "alpha", 3);
        wait_for_holdings(&broker, &[("alpha", 3)]);
        let builds_before: Vec<u64> = broker.status().builds.iter().map(|b| b.id).collect();
        let first = scrape(&url);
        let second = scrape(&url);
        for samples in [&first, &second] {
            assert_eq!(sample(samples, "baton_limit", None), 4.0);
            assert_eq!(sample(samples, "baton_held", None), 3.0);
            assert_eq!(sample(samples, "baton_free", None), 1.0);
            assert_eq!(
                sample(samples, "baton_build_held", Some(("build", "alpha"))),
                3.0
            );
            assert_eq!(
                sample(
                    samples,
                    "baton_build_grants_total",
                    Some(("build", "alpha"))
                ),
                3.0
            );
            assert_eq!(
                label_values(samples, "build"),
                ["alpha".to_string()].into(),
                "only the build that holds tokens is a build: {samples:?}"
            );
            assert!(
                samples
                    .iter()
                    .all(|(_, labels, _)| !labels.contains_key("pid")),
                "no pid label: {samples:?}"
            );
        }
        assert_eq!(
            label_values(&first, "id"),
            label_values(&second, "id"),
            "a build keeps its series from one scrape to the next"
        );
        let out = baton()
            .args(["status", "--prometheus", "--socket"])
            .arg(&broker.socket)
            .output()
            .unwrap();
        assert!(out.status.success());
        assert_eq!(
            label_values(&parse_prometheus(&out.stdout), "build"),
            ["alpha".to_string()].into(),
            "baton status --prometheus is not a build either"
        );
        let builds_after: Vec<u64> = broker.status().builds.iter().map(|b| b.id).collect();
        assert_eq!(builds_before, builds_after, "the scrapes started no build");
    }
    wait_until_all_free(&broker);
}

/// `serve --replace` with the same `--metrics-listen` takes the port over
/// from the broker it replaces (both listen on it for a moment), while a
/// broker at another socket is refused that port.
#[test]
fn a_replacing_broker_takes_over_the_metrics_port() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = free.local_addr().unwrap().to_string();
    drop(free);
    let url = format!("http://{addr}/metrics");
    let mut broker = RunningBroker::start_with(3, &["--metrics-listen", &addr]);
    assert_eq!(sample(&scrape(&url), "baton_limit", None), 3.0);

    let elsewhere = TempDir::new("metrics-elsewhere");
    let refused = baton()
        .args(["serve", "--jobs", "1", "--no-fuse", "--socket"])
        .arg(elsewhere.path().join("socket"))
        .args(["--metrics-listen", &addr])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains(&format!("cannot serve metrics at {addr}")),
        "{err}"
    );

    let log = broker.dir.path().join("successor.log");
    let mut successor = broker
        .successor(3, &["--metrics-listen", &addr])
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn_guarded()
        .expect("start the successor");
    broker.wait_exit(GUARD);
    let successor_log = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_for(GUARD, "the successor to serve metrics", || {
        successor_log().contains(&format!("metrics at {url}"))
    });
    assert_eq!(
        sample(&scrape(&url), "baton_limit", None),
        3.0,
        "{}",
        successor_log()
    );
    unsafe { libc::kill(successor.id() as i32, libc::SIGTERM) };
    wait_timeout(&mut successor, GUARD).expect("the successor stops");
}

/// A thousand clients, each a build of its own with a wait histogram: 4
/// hold a token, the rest wait. The broker's peak resident memory stays
/// under 20 MB while they do and while STATUS lists them all.
/// BATON_TEST_RSS_SECS=610 keeps them there (a token changing hands every
/// second) until the utilization ring is full: docs/metrics.md records
/// such a run.
#[test]
fn the_broker_stays_under_20_mb_with_a_thousand_clients() {
    raise_open_file_limit();
    let spawned = Instant::now();
    let broker = RunningBroker::start(4);
    let ready = Instant::now();
    let mut clients: Vec<baton_client::Client> = (0..1000)
        .map(|i| broker.client(&format!("client {i}")))
        .collect();
    for c in &mut clients {
        c.send(&Request::Acquire(1)).unwrap();
    }
    wait_for(Duration::from_secs(120), "996 waiters", || {
        broker.status().waiters.len() == 996
    });
    // From here on every token is held (a release below is granted again
    // at once): the seconds that begin after this read 4.
    let all_held = broker.status().utilization.held.len();
    let hold_for = std::env::var("BATON_TEST_RSS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::ZERO, Duration::from_secs);
    let start = Instant::now();
    let mut rounds = 0;
    while start.elapsed() < hold_for {
        // The oldest holder gives its token back; the next waiter gets it.
        clients[rounds].read_reply().unwrap();
        clients[rounds].release(1).unwrap();
        rounds += 1;
        std::thread::sleep(Duration::from_secs(1));
    }
    // A whole second with every token held, the ring's last.
    wait_for(
        Duration::from_secs(30),
        "a whole second of history with every token held",
        || broker.status().utilization.held.len() >= (all_held + 2).min(600),
    );
    let before_status = ready.elapsed();
    let s = broker.status();
    let broker_age = spawned.elapsed();
    // An earlier status client's close may still be on its way: count ours.
    assert_eq!(
        s.builds
            .iter()
            .filter(|b| b.name.starts_with("client "))
            .count(),
        1000,
        "each client a build of its own"
    );
    // One mean per second the broker has run, up to ten minutes' worth.
    let ring = s.utilization.held.len() as u64;
    assert!(
        (before_status.as_secs().min(600)..=broker_age.as_secs().min(600)).contains(&ring),
        "the ring has the broker's {} seconds, not {ring}",
        before_status.as_secs()
    );
    assert_eq!(
        s.utilization.held.last(),
        Some(&4.0),
        "the last whole second had every token held: {:?}",
        s.utilization.held
    );
    let (rss, peak) = rss_kib(broker.pid());
    eprintln!(
        "broker with 1000 clients, {} s of history ({} s run): VmRSS {rss} KiB, VmHWM {peak} KiB",
        s.utilization.held.len(),
        start.elapsed().as_secs()
    );
    assert!(peak < 20 * 1024, "the broker's peak RSS is {peak} KiB");
    drop(clients);
    wait_until_all_free(&broker);
}

/// A thousand sockets need more than the usual soft limit of 1024.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the struct given.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
}
