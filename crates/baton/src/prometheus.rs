//! `baton status --prometheus`: the status document in the Prometheus text
//! exposition format (version 0.0.4, as node_exporter's textfile collector
//! reads it; prometheus.io/docs/instrumenting/exposition_formats). Every
//! metric is listed in docs/metrics.md.

use baton_client::Status;
use std::fmt::Write;

/// The whole exposition: the pool, then each build, then each gate.
pub fn render(s: &Status) -> String {
    let mut out = Exposition::default();
    out.family(
        "baton_limit",
        "gauge",
        "How many tokens exist.",
        &[("", s.limit.into())],
    );
    out.family(
        "baton_free",
        "gauge",
        "Tokens nobody holds.",
        &[("", s.free.into())],
    );
    out.family(
        "baton_held",
        "gauge",
        "Tokens held, over all holders.",
        &[("", s.held.into())],
    );
    out.family(
        "baton_waiting_requests",
        "gauge",
        "Requests waiting for tokens.",
        &[("", s.waiters.len() as f64)],
    );
    out.family(
        "baton_clients",
        "gauge",
        "Clients connected.",
        &[("", s.totals.clients as f64)],
    );
    out.family(
        "baton_granted_total",
        "counter",
        "Tokens granted since the broker started.",
        &[("", s.totals.granted as f64)],
    );
    out.family(
        "baton_released_total",
        "counter",
        "Tokens given back by their holders.",
        &[("", s.totals.released as f64)],
    );
    out.family(
        "baton_reclaimed_total",
        "counter",
        "Tokens taken back from clients that went away holding them.",
        &[("", s.totals.reclaimed as f64)],
    );
    out.family(
        "baton_waits_total",
        "counter",
        "Requests that had to wait.",
        &[("", s.totals.waits as f64)],
    );
    render_builds(s, &mut out);
    render_gates(s, &mut out);
    out.text
}

fn render_builds(s: &Status, out: &mut Exposition) {
    let labels: Vec<String> = s
        .builds
        .iter()
        .map(|b| {
            format!(
                "build=\"{}\",id=\"{}\",pid=\"{}\"",
                escape(&b.name),
                b.id,
                b.pid
            )
        })
        .collect();
    let per_build = |value: &dyn Fn(&baton_core::status::Build) -> f64| -> Vec<(String, f64)> {
        s.builds
            .iter()
            .zip(&labels)
            .map(|(b, l)| (format!("{{{l}}}"), value(b)))
            .collect()
    };
    out.labelled(
        "baton_build_weight",
        "gauge",
        "The build's weight: its share of a busy pool.",
        &per_build(&|b| b.weight.into()),
    );
    out.labelled(
        "baton_build_held",
        "gauge",
        "Tokens the build's clients hold.",
        &per_build(&|b| b.held.into()),
    );
    out.labelled(
        "baton_build_waiting",
        "gauge",
        "Tokens the build's clients wait for.",
        &per_build(&|b| b.waiting.into()),
    );
    out.labelled(
        "baton_build_grants_total",
        "counter",
        "Tokens granted to the build.",
        &per_build(&|b| b.grants as f64),
    );
    out.labelled(
        "baton_build_token_seconds_total",
        "counter",
        "Tokens held by the build times seconds.",
        &per_build(&|b| b.token_seconds),
    );
    let mut waits = Vec::new();
    for (b, l) in s.builds.iter().zip(&labels) {
        for (q, value) in [("0.5", b.wait_ms_p50), ("0.99", b.wait_ms_p99)] {
            if let Some(ms) = value {
                waits.push((format!("{{{l},quantile=\"{q}\"}}"), ms / 1000.0));
            }
        }
        waits.push((format!("_sum{{{l}}}"), b.wait_ms_total / 1000.0));
        waits.push((format!("_count{{{l}}}"), b.waits as f64));
    }
    out.labelled(
        "baton_build_wait_seconds",
        "summary",
        "How long the build's requests waited for tokens (0 when granted at once).",
        &waits,
    );
}

fn render_gates(s: &Status, out: &mut Exposition) {
    let label = |name: &str| format!("{{gate=\"{}\"}}", escape(name));
    let open: Vec<_> = s
        .gates
        .iter()
        .map(|g| (label(&g.name), f64::from(u8::from(g.open))))
        .collect();
    let value: Vec<_> = s
        .gates
        .iter()
        .filter_map(|g| Some((label(&g.name), g.value?)))
        .collect();
    let threshold: Vec<_> = s
        .gates
        .iter()
        .map(|g| (label(&g.name), g.threshold))
        .collect();
    out.labelled(
        "baton_gate_open",
        "gauge",
        "Whether the gate lets new tokens out (1) or holds them back (0).",
        &open,
    );
    out.labelled(
        "baton_gate_value",
        "gauge",
        "The gate's last reading: bytes, percent or runnable tasks.",
        &value,
    );
    out.labelled(
        "baton_gate_threshold",
        "gauge",
        "The gate's threshold, in the same unit.",
        &threshold,
    );
}

#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    /// A metric family without labels.
    fn family(&mut self, name: &str, kind: &str, help: &str, samples: &[(&str, f64)]) {
        let samples: Vec<(String, f64)> = samples
            .iter()
            .map(|&(suffix, v)| (suffix.to_string(), v))
            .collect();
        self.labelled(name, kind, help, &samples);
    }

    /// A family whose samples are `name` + suffix (labels, or `_sum{…}`);
    /// nothing at all when it has no samples.
    fn labelled(&mut self, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
        if samples.is_empty() {
            return;
        }
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (suffix, value) in samples {
            let _ = writeln!(self.text, "{name}{suffix} {value}");
        }
    }
}

/// A label value as the format quotes it: backslash, double quote and
/// line feed escaped.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_escape_what_the_format_requires() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn a_family_without_samples_is_left_out() {
        let mut out = Exposition::default();
        out.labelled("baton_gate_open", "gauge", "h", &[]);
        assert_eq!(out.text, "");
    }
}
