//! `baton status` and `baton limit`: ask a running broker.

use anyhow::Result;
use baton_client::{Client, Status};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub fn print_status(socket: &Path, json: bool) -> Result<()> {
    let status = Client::connect(socket, "baton status")?.status()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render(&status, now()));
    }
    Ok(())
}

pub fn set_limit(socket: &Path, limit: u32) -> Result<()> {
    let old = Client::connect(socket, "baton limit")?.set_limit(limit)?;
    println!("limit {old} -> {limit}");
    Ok(())
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
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
        out.push_str(&format!("\n{title}\n{:>8} {:>6} {:>8} {:<9} COMMAND\n", "PID", "TOKENS", "FOR", "VIA"));
        for (pid, tokens, since, via, command) in rows {
            out.push_str(&format!("{pid:>8} {tokens:>6} {:>7.1}s {via:<9} {command}\n", (now - since).max(0.0)));
        }
    };
    rows("HOLDERS", s.holders.iter().map(|h| (h.pid, h.tokens, h.since, h.transport.as_str(), h.command.as_str())).collect(), &mut out);
    rows("WAITERS", s.waiters.iter().map(|w| (w.pid, w.tokens, w.since, w.transport.as_str(), w.command.as_str())).collect(), &mut out);
    render_builds(s, &mut out);
    out
}

/// Builds that hold or wait for tokens, with their use of the pool so far.
fn render_builds(s: &Status, out: &mut String) {
    let active: Vec<_> = s.builds.iter().filter(|b| b.held + b.waiting > 0).collect();
    if active.is_empty() {
        return;
    }
    out.push_str(&format!("
BUILDS
{:>8} {:>6} {:>6} {:>7} {:>8} {:>12} NAME
", "PID", "WEIGHT", "HELD", "WAITING", "GRANTS", "TOKEN-TIME"));
    for b in active {
        out.push_str(&format!(
            "{:>8} {:>6} {:>6} {:>7} {:>8} {:>11.1}s {}\n",
            b.pid, b.weight, b.held, b.waiting, b.grants, b.token_seconds, b.name
        ));
    }
}
