//! `baton status` and `baton limit`: ask a running broker.

use anyhow::Result;
use baton_client::{Client, Status};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub fn print_status(socket: &Path, json: bool, prometheus: bool) -> Result<()> {
    let mut status = Client::connect(socket, "baton status")?.status()?;
    if let Some(cluster) = &mut status.cluster {
        survey(cluster);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else if prometheus {
        print!("{}", baton_broker::metrics::render(&status));
    } else {
        print!("{}", render(&status, now()));
    }
    Ok(())
}

/// Fills in the cluster pool's brokers from etcd; says so on stderr if
/// etcd does not answer (the broker's own figures still print).
#[cfg(feature = "cluster")]
fn survey(cluster: &mut baton_core::status::Cluster) {
    match baton_cluster::survey(&cluster.endpoints, &cluster.pool) {
        Ok(brokers) => cluster.brokers = brokers,
        Err(e) => eprintln!("baton: cannot ask etcd who holds cluster pool {}: {e:#} (the broker's own figures follow)", cluster.pool),
    }
}

#[cfg(not(feature = "cluster"))]
fn survey(cluster: &mut baton_core::status::Cluster) {
    eprintln!("baton: this baton was built without cluster pools: the other brokers of pool {} are not shown", cluster.pool);
}

/// `baton limit`: the gates first, then the limit, each change printed;
/// with nothing to change, the limit and the gates as they are.
pub fn set_limit(socket: &Path, limit: Option<u32>, gates: &[(&str, Option<f64>)]) -> Result<()> {
    let mut client = Client::connect(socket, "baton limit")?;
    if limit.is_none() && gates.is_empty() {
        print!("{}", render_limit(&client.status()?));
        return Ok(());
    }
    for &(name, value) in gates {
        let now = client.set_gate(name, value)?;
        println!("gate {name} {}", show_gate(name, now));
    }
    if let Some(limit) = limit {
        let old = client.set_limit(limit)?;
        println!("limit {old} -> {limit}");
    }
    Ok(())
}

/// `baton limit` alone: the limit, then each gate's threshold.
fn render_limit(s: &Status) -> String {
    let mut out = format!("limit {}\n", s.limit);
    let gates: Vec<_> = s.gates.iter().filter(|g| g.name != "reclaim").collect();
    if gates.is_empty() {
        out.push_str("gates none (set one: baton limit --max-load N, --min-mem-available SIZE)\n");
    }
    for g in gates {
        let relation = if g.name == "mem-available" {
            "min"
        } else {
            "max"
        };
        out.push_str(&format!(
            "gate {:<13} {relation} {}\n",
            g.name,
            show_gate(&g.name, Some(g.threshold))
        ));
    }
    out
}

/// Exit status of `baton stop` when no broker answers at the socket.
pub const STOP_NO_BROKER: u8 = 3;

/// `baton stop`: asks the broker to stop as on SIGTERM, waits until it has
/// removed its files, and says what it did.
pub fn stop(socket: &Path) -> Result<u8> {
    let client = match Client::connect(socket, "baton stop") {
        Err(baton_client::Error::NoBroker { path }) => {
            eprintln!("baton: no broker at {}: nothing to stop", path.display());
            return Ok(STOP_NO_BROKER);
        }
        other => other?,
    };
    // Opened before the broker removes it: it is gone (no links left)
    // once the broker has cleaned up and is about to exit.
    let lock = std::fs::File::open(baton_core::paths::beside(socket, ".lock")).ok();
    let stopped = client.stop()?;
    wait_until_removed(lock);
    let builds = match stopped.builds {
        0 => "no build was using it".to_string(),
        n => format!(
            "{n} build{} carried on without it, holding {} token{} (they re-attach to the next broker at this socket)",
            if n == 1 { "" } else { "s" },
            stopped.held,
            if stopped.held == 1 { "" } else { "s" },
        ),
    };
    println!(
        "stopped the broker at {} (pid {}); {builds}",
        socket.display(),
        stopped.pid
    );
    Ok(0)
}

/// Waits, for a while, until the file open as `file` has no name left.
fn wait_until_removed(file: Option<std::fs::File>) {
    use std::os::unix::fs::MetadataExt;
    let Some(file) = file else { return };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while file.metadata().is_ok_and(|m| m.nlink() > 0) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A gate's threshold as people read it: sizes in MiB or GiB.
fn show_gate(name: &str, value: Option<f64>) -> String {
    match value {
        None => "off".to_string(),
        Some(bytes) if name.starts_with("mem-available") => human_bytes(bytes),
        Some(v) => format!("{}", (v * 10.0).round() / 10.0),
    }
}

fn human_bytes(bytes: f64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    if bytes >= GIB {
        format!("{:.1}G", bytes / GIB)
    } else {
        format!("{:.0}M", bytes / (1u64 << 20) as f64)
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The human-readable report.
fn render(s: &Status, now: f64) -> String {
    let mut out = format!(
        "limit {}  free {}  held {}  holders {}  waiters {}\ngranted {}  released {}  reclaimed {}  waits {}  clients {}  (broker pid {})\n",
        s.limit,
        s.free,
        s.held,
        s.holders.len(),
        s.waiters.len(),
        s.totals.granted,
        s.totals.released,
        s.totals.reclaimed,
        s.totals.waits,
        s.totals.clients,
        s.broker_pid
    );
    let rows = |title: &str, rows: Vec<(u32, u32, f64, &str, &str)>, out: &mut String| {
        if rows.is_empty() {
            return;
        }
        out.push_str(&format!(
            "\n{title}\n{:>8} {:>6} {:>8} {:<9} COMMAND\n",
            "PID", "TOKENS", "FOR", "VIA"
        ));
        for (pid, tokens, since, via, command) in rows {
            out.push_str(&format!(
                "{pid:>8} {tokens:>6} {:>7.1}s {via:<9} {command}\n",
                (now - since).max(0.0)
            ));
        }
    };
    for g in &s.gates {
        let value = g
            .value
            .map_or("n/a".to_string(), |v| show_gate(&g.name, Some(v)));
        let state = match g.closed_since {
            Some(since) => format!("CLOSED for {:.1}s", (now - since).max(0.0)),
            None if g.open => "open".to_string(),
            None => "CLOSED".to_string(),
        };
        let (relation, threshold) = if g.name == "mem-available" {
            ("min", show_gate(&g.name, Some(g.threshold)))
        } else {
            ("max", format!("{}", g.threshold))
        };
        out.push_str(&format!(
            "gate {:<13} {state:<16} now {value}  {relation} {threshold}\n",
            g.name
        ));
    }
    let holder_commands: Vec<String> = s.holders.iter().map(holder_command).collect();
    rows(
        "HOLDERS",
        s.holders
            .iter()
            .zip(&holder_commands)
            .map(|(h, command)| {
                (
                    h.pid,
                    h.tokens,
                    h.since,
                    h.transport.as_str(),
                    command.as_str(),
                )
            })
            .collect(),
        &mut out,
    );
    rows(
        "WAITERS",
        s.waiters
            .iter()
            .map(|w| {
                (
                    w.pid,
                    w.tokens,
                    w.since,
                    w.transport.as_str(),
                    w.command.as_str(),
                )
            })
            .collect(),
        &mut out,
    );
    render_builds(s, &mut out);
    if let Some(cluster) = &s.cluster {
        render_cluster(cluster, &mut out);
    }
    out
}

/// The cluster pool: what this broker holds, and who else holds or waits.
/// A holder's command line, marked when it is stopped: its tokens wait
/// with it (issue #32).
pub fn holder_command(h: &baton_core::status::Holder) -> String {
    match h.stopped {
        true => format!("[stopped] {}", h.command),
        false => h.command.clone(),
    }
}

fn render_cluster(c: &baton_core::status::Cluster, out: &mut String) {
    let elsewhere: u32 = c
        .brokers
        .iter()
        .map(|b| b.held)
        .sum::<u32>()
        .saturating_sub(c.held);
    let waiting = c.brokers.iter().filter(|b| b.waiting).count();
    out.push_str(&format!(
        "\nCLUSTER {}  limit {}  held here {}  elsewhere {elsewhere}  brokers waiting {waiting}  etcd {} ({})\n",
        c.pool,
        c.limit,
        c.held,
        c.contact,
        c.endpoints.join(",")
    ));
    if c.brokers.is_empty() {
        return;
    }
    out.push_str(&format!(
        "{:<20} {:>8} {:>6} WAITING\n",
        "HOST", "PID", "HELD"
    ));
    for b in &c.brokers {
        out.push_str(&format!(
            "{:<20} {:>8} {:>6} {}\n",
            b.host,
            b.pid,
            b.held,
            if b.waiting { "yes" } else { "no" }
        ));
    }
}

/// Where a build runs, when not as the broker does: `  (uid 100000,
/// cgroup /ci/job-7)` for another uid or a container's cgroup; empty
/// otherwise (docs/containers.md).
pub fn place(b: &baton_core::status::Build) -> String {
    let mut place = Vec::new();
    if let Some(uid) = b.uid {
        place.push(format!("uid {uid}"));
    }
    if let Some(cgroup) = &b.cgroup {
        place.push(format!("cgroup {cgroup}"));
    }
    match place.is_empty() {
        true => String::new(),
        false => format!("  ({})", place.join(", ")),
    }
}

/// Builds that hold or wait for tokens, with their use of the pool so far.
fn render_builds(s: &Status, out: &mut String) {
    let active: Vec<_> = s.builds.iter().filter(|b| b.held + b.waiting > 0).collect();
    if active.is_empty() {
        return;
    }
    out.push_str(&format!(
        "
BUILDS
{:>8} {:>6} {:>6} {:>5} {:>7} {:>8} {:>12} NAME
",
        "PID", "WEIGHT", "HELD", "JOBS", "WAITING", "GRANTS", "TOKEN-TIME"
    ));
    for b in active {
        // Jobs counted from the build's processes, beside the tokens.
        let running = b.running.map_or("-".to_string(), |n| n.to_string());
        // Rare, and a sign of a client gone wrong: said after the name.
        let stray = match b.stray {
            0 => String::new(),
            n => format!("  [{n} stray byte(s) taken out of its jobserver]"),
        };
        let place = place(b);
        out.push_str(&format!(
            "{:>8} {:>6} {:>6} {:>5} {:>7} {:>8} {:>11.1}s {}{place}{stray}\n",
            b.pid, b.weight, b.held, running, b.waiting, b.grants, b.token_seconds, b.name
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_of_another_uid_or_cgroup_says_where_it_runs() {
        let mut b: baton_core::status::Build = serde_json::from_str(
            r#"{"name":"ci","pid":7,"weight":1,"held":1,"waiting":0,"grants":1,"token_seconds":0.5}"#,
        )
        .unwrap();
        assert_eq!(place(&b), "");
        b.uid = Some(100000);
        assert_eq!(place(&b), "  (uid 100000)");
        b.cgroup = Some("/ci/job-7".into());
        assert_eq!(place(&b), "  (uid 100000, cgroup /ci/job-7)");
    }

    /// A build that only waits (starved) is listed as much as one that
    /// holds; an idle one is not.
    #[test]
    fn builds_that_hold_or_only_wait_are_listed_idle_ones_are_not() {
        let build = |name: &str, pid: u32, held: u32, waiting: u32| {
            serde_json::json!({"name": name, "pid": pid, "weight": 1, "held": held,
                "waiting": waiting, "grants": held, "token_seconds": 0.0})
        };
        let status: Status = serde_json::from_value(serde_json::json!({
            "version": 1, "broker_pid": 1, "limit": 2, "free": 0, "held": 2,
            "holders": [], "waiters": [],
            "builds": [build("holding", 10, 2, 0), build("starved", 20, 0, 1), build("idle", 30, 0, 0)],
            "totals": {"granted": 2, "released": 0, "reclaimed": 0, "waits": 1, "clients": 3},
        }))
        .unwrap();
        let shown = render(&status, 0.0);
        let names: Vec<&str> = shown
            .lines()
            .skip_while(|l| *l != "BUILDS")
            .skip(2)
            .filter_map(|l| l.split_whitespace().last())
            .collect();
        assert_eq!(names, ["holding", "starved"], "{shown}");
    }

    /// A status document with these holders, waiters and gates (JSON, as
    /// the broker sends them), everything else empty.
    fn status_with(
        holders: serde_json::Value,
        waiters: serde_json::Value,
        gates: serde_json::Value,
    ) -> Status {
        serde_json::from_value(serde_json::json!({
            "version": 1, "broker_pid": 1, "limit": 4, "free": 1, "held": 3,
            "holders": holders, "waiters": waiters, "builds": [], "gates": gates,
            "totals": {"granted": 3, "released": 0, "reclaimed": 0, "waits": 1, "clients": 3},
        }))
        .unwrap()
    }

    /// The first line is what a glance at `baton status` reads: how many
    /// hold and how many wait, each counted from its own list (two
    /// holders and one waiter here, so a swap shows).
    #[test]
    fn the_first_line_counts_holders_and_waiters_each_from_its_own_list() {
        let client = |pid: u32, tokens: u32| {
            serde_json::json!({"pid": pid, "command": "make", "tokens": tokens, "since": 0.0,
                "transport": "socket", "build": 1})
        };
        let status = status_with(
            serde_json::json!([client(10, 2), client(11, 1)]),
            serde_json::json!([client(12, 1)]),
            serde_json::json!([]),
        );
        let shown = render(&status, 0.0);
        assert!(
            shown.starts_with("limit 4  free 1  held 3  holders 2  waiters 1\n"),
            "{shown}"
        );
    }

    /// The reclaim gate is the broker's own, closed for a moment after a
    /// broker died (docs/protocol.md, `--reclaim-grace`): not a threshold
    /// anyone set, so `baton limit` alone does not list it.
    #[test]
    fn baton_limit_alone_leaves_out_the_brokers_own_reclaim_gate() {
        let gate = |name: &str, threshold: f64| serde_json::json!({"name": name, "open": false, "threshold": threshold});
        let only_reclaim = status_with(
            serde_json::json!([]),
            serde_json::json!([]),
            serde_json::json!([gate("reclaim", 1.0)]),
        );
        assert_eq!(
            render_limit(&only_reclaim),
            "limit 4\ngates none (set one: baton limit --max-load N, --min-mem-available SIZE)\n"
        );
        let with_load = status_with(
            serde_json::json!([]),
            serde_json::json!([]),
            serde_json::json!([gate("reclaim", 1.0), gate("load", 8.0)]),
        );
        assert_eq!(
            render_limit(&with_load),
            "limit 4\ngate load          max 8\n"
        );
    }

    /// In the cluster's line, "elsewhere" is what the other brokers hold:
    /// etcd's list of holders includes this broker, whose own share is
    /// "held here" and must not be counted twice.
    #[test]
    fn the_cluster_line_counts_this_brokers_tokens_here_and_not_elsewhere() {
        let cluster: baton_core::status::Cluster = serde_json::from_value(serde_json::json!({
            "pool": "ci", "endpoints": ["http://127.0.0.1:2379"], "limit": 4, "held": 1,
            "contact": "reachable",
            "brokers": [
                {"host": "here", "pid": 10, "held": 1, "waiting": false},
                {"host": "there", "pid": 20, "held": 2, "waiting": true},
            ],
        }))
        .unwrap();
        let mut shown = String::new();
        render_cluster(&cluster, &mut shown);
        assert!(
            shown.starts_with(
                "\nCLUSTER ci  limit 4  held here 1  elsewhere 2  brokers waiting 1  etcd reachable"
            ),
            "{shown}"
        );
    }
}
