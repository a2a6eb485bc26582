//! The broker's figures for Prometheus: the status document rendered in the
//! Prometheus text format (version 0.0.4) by the prometheus-client crate,
//! and the small HTTP endpoint `baton serve --metrics-listen` serves it on.
//! `baton status --prometheus` prints the same rendering, so both give the
//! same series; docs/metrics.md lists every one.
//!
//! Series are meant not to churn: no pid label (a pid changes at every
//! restart of a build's driver and says nothing a scraper can aggregate);
//! a build's series carry its name and the broker's id for it, which stays
//! the same for the build's whole life.

use crate::broker::Broker;
use crate::log;
use crate::mailbox::Mailbox;
use baton_core::status::{Build, Status};
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The `Content-Type` of what [`render`] returns.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;
type FloatCounter = Counter<f64, AtomicU64>;

/// The whole exposition: the pool, then each build, then each gate.
pub fn render(s: &Status) -> String {
    let mut registry = Registry::default();
    render_pool(s, &mut registry);
    render_builds(&s.builds, &mut registry);
    render_gates(s, &mut registry);
    let mut text = String::new();
    prometheus_text::encode(&mut text, &registry).expect("writing to a String cannot fail");
    text
}

fn render_pool(s: &Status, registry: &mut Registry) {
    let gauges = [
        ("baton_limit", "How many tokens exist", s.limit.into()),
        ("baton_free", "Tokens nobody holds", s.free.into()),
        ("baton_held", "Tokens held, over all holders", s.held.into()),
        (
            "baton_waiting_requests",
            "Requests waiting for tokens",
            s.waiters.len() as f64,
        ),
        (
            "baton_clients",
            "Clients connected",
            s.totals.clients as f64,
        ),
    ];
    for (name, help, value) in gauges {
        let gauge = FloatGauge::default();
        gauge.set(value);
        registry.register(name, help, gauge);
    }
    // Registered without `_total`: the encoder appends it to counters.
    let counters = [
        (
            "baton_granted",
            "Tokens granted since the broker started",
            s.totals.granted,
        ),
        (
            "baton_released",
            "Tokens given back by their holders",
            s.totals.released,
        ),
        (
            "baton_reclaimed",
            "Tokens taken back from clients that went away holding them",
            s.totals.reclaimed,
        ),
        ("baton_waits", "Requests that had to wait", s.totals.waits),
        (
            "baton_fastpath_repairs",
            "Fast-path seats repaired as their clients left (docs/fastpath.md)",
            s.totals.fastpath_repairs,
        ),
        (
            "baton_fastpath_mismatches",
            "Fast-path audits that found a region's tokens differ from the books, twice in a row",
            s.totals.fastpath_mismatches,
        ),
    ];
    for (name, help, value) in counters {
        let counter = Counter::<u64>::default();
        counter.inc_by(value);
        registry.register(name, help, counter);
    }
}

fn build_labels(b: &Build) -> Labels {
    vec![
        ("build".to_string(), b.name.clone()),
        ("id".to_string(), b.id.to_string()),
    ]
}

fn render_builds(builds: &[Build], registry: &mut Registry) {
    let gauge = |registry: &mut Registry, name: &str, help: &str, value: fn(&Build) -> f64| {
        let family = Family::<Labels, FloatGauge>::default();
        for b in builds {
            family.get_or_create(&build_labels(b)).set(value(b));
        }
        registry.register(name, help, family);
    };
    let counter = |registry: &mut Registry, name: &str, help: &str, value: fn(&Build) -> f64| {
        let family = Family::<Labels, FloatCounter>::default();
        for b in builds {
            family.get_or_create(&build_labels(b)).inc_by(value(b));
        }
        registry.register(name, help, family);
    };
    gauge(
        registry,
        "baton_build_weight",
        "The build's weight: its share of a busy pool",
        |b| b.weight.into(),
    );
    gauge(
        registry,
        "baton_build_held",
        "Tokens the build's clients hold",
        |b| b.held.into(),
    );
    gauge(
        registry,
        "baton_build_waiting",
        "Tokens the build's clients wait for",
        |b| b.waiting.into(),
    );
    counter(
        registry,
        "baton_build_grants",
        "Tokens granted to the build",
        |b| b.grants as f64,
    );
    counter(
        registry,
        "baton_build_token_seconds",
        "Tokens held by the build times seconds",
        |b| b.token_seconds,
    );
    counter(
        registry,
        "baton_build_waits",
        "The build's requests for tokens (ACQUIRE), those granted at once included",
        |b| b.waits as f64,
    );
    counter(
        registry,
        "baton_build_wait_seconds",
        "How long the build's requests waited for tokens, summed",
        |b| b.wait_ms_total / 1000.0,
    );
    // prometheus-client has no summary type: the two quantiles the broker
    // keeps are gauges, labelled as a summary's would be.
    let quantiles = Family::<Labels, FloatGauge>::default();
    for b in builds {
        for (q, value) in [("0.5", b.wait_ms_p50), ("0.99", b.wait_ms_p99)] {
            if let Some(ms) = value {
                let mut labels = build_labels(b);
                labels.push(("quantile".to_string(), q.to_string()));
                quantiles.get_or_create(&labels).set(ms / 1000.0);
            }
        }
    }
    registry.register(
        "baton_build_wait_quantile_seconds",
        "How long the build's requests waited for tokens, at the quantile (0 when granted at once)",
        quantiles,
    );
}

fn render_gates(s: &Status, registry: &mut Registry) {
    let label = |name: &str| vec![("gate".to_string(), name.to_string())];
    let open = Family::<Labels, FloatGauge>::default();
    let value = Family::<Labels, FloatGauge>::default();
    let threshold = Family::<Labels, FloatGauge>::default();
    for g in &s.gates {
        open.get_or_create(&label(&g.name))
            .set(f64::from(u8::from(g.open)));
        if let Some(v) = g.value {
            value.get_or_create(&label(&g.name)).set(v);
        }
        threshold.get_or_create(&label(&g.name)).set(g.threshold);
    }
    registry.register(
        "baton_gate_open",
        "Whether the gate lets new tokens out (1) or holds them back (0)",
        open,
    );
    registry.register(
        "baton_gate_value",
        "The gate's last reading: bytes, percent or runnable tasks",
        value,
    );
    registry.register(
        "baton_gate_threshold",
        "The gate's threshold, in the same unit",
        threshold,
    );
}

/// Answers `GET /metrics` on `listener` from a thread of its own, one
/// request at a time, each connection closed after its answer. The figures
/// are read by one errand to the event loop (crate::mailbox), as a STATUS
/// reads them, but connect no client: a scrape is not a build.
///
/// A hand-written loop rather than an HTTP crate: one path, one method, no
/// keep-alive, no body to read; what a scraper sends fits in a few lines.
pub(crate) fn serve_http(listener: TcpListener, mailbox: Mailbox<Broker>) -> io::Result<()> {
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let status = || mailbox.ask(|broker| broker.status_now());
            for stream in listener.incoming() {
                let result = stream.and_then(|stream| answer(stream, &status));
                if let Err(e) = result {
                    log::debug(format_args!("metrics: a request failed: {e}"));
                    if e.raw_os_error() == Some(libc::EMFILE) {
                        // Out of descriptors: let clients go before trying again.
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
        .map(drop)
}

/// The longest request head we read; a scraper's is a few hundred bytes.
const MAX_HEAD: usize = 8192;
/// A client that sends nothing for this long is dropped, so that it does
/// not hold up the scrapes behind it.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Answers one request; `status` reads the figures (None: the broker is
/// stopping).
fn answer(mut stream: TcpStream, status: &dyn Fn() -> Option<Status>) -> io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let head = read_head(&mut stream)?;
    let request_line = head.lines().next().unwrap_or_default();
    let mut words = request_line.split(' ');
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => match status() {
            Some(status) => ("200 OK", CONTENT_TYPE, render(&status)),
            None => (
                "503 Service Unavailable",
                "text/plain; charset=utf-8",
                "baton is stopping\n".to_string(),
            ),
        },
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            format!("baton serves its metrics at /metrics, not at {path}\n"),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            format!("baton answers GET /metrics, not {method}\n"),
        ),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nAllow: GET, HEAD\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    if method != "HEAD" {
        stream.write_all(body.as_bytes())?;
    }
    stream.flush()
}

/// The request line and headers, up to the blank line that ends them.
fn read_head(stream: &mut TcpStream) -> io::Result<String> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() > MAX_HEAD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "request head over 8 KiB",
            ));
        }
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_and_no_pid_is_labelled() {
        let build = Build {
            id: 7,
            name: "a\"b\\c\nd".to_string(),
            pid: 4242,
            weight: 1,
            held: 2,
            waiting: 0,
            grants: 2,
            token_seconds: 0.5,
            since: 0.0,
            waits: 1,
            wait_ms_total: 0.0,
            wait_ms_p50: Some(0.0),
            wait_ms_p99: Some(0.0),
            running: None,
            stray: 0,
            uid: None,
            cgroup: None,
        };
        let mut registry = Registry::default();
        render_builds(&[build], &mut registry);
        let mut text = String::new();
        prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"baton_build_held{build="a\"b\\c\nd",id="7"} 2"#),
            "{text}"
        );
        assert!(!text.contains("4242"), "{text}");
    }

    fn lines(text: &str) -> Vec<&str> {
        text.lines().filter(|l| !l.starts_with('#')).collect()
    }

    #[test]
    fn the_pool_gauges_and_counters_follow_the_status() {
        let mut broker = Broker::new(4).unwrap();
        let meta = |pid| {
            crate::broker::ClientMeta::new(pid, "make".into(), crate::broker::Transport::Socket)
        };
        let (a, b) = (broker.connect(meta(1)), broker.connect(meta(2)));
        broker.acquire(a, 1, 3).unwrap();
        broker.release(a, 1).unwrap();
        broker.acquire(b, 1, 4).unwrap();
        broker.fast_counts().repairs = 2;
        broker.fast_counts().mismatches = 1;
        let text = render(&broker.status());
        let lines = lines(&text);
        for want in [
            "baton_limit 4.0",
            "baton_free 2.0",
            "baton_held 2.0",
            "baton_waiting_requests 1.0",
            "baton_clients 2.0",
            "baton_granted_total 3",
            "baton_released_total 1",
            "baton_reclaimed_total 0",
            "baton_waits_total 1",
            "baton_fastpath_repairs_total 2",
            "baton_fastpath_mismatches_total 1",
        ] {
            assert!(lines.contains(&want), "{want} not in\n{text}");
        }
    }

    #[test]
    fn a_builds_wait_is_counted_in_seconds() {
        let build = Build {
            id: 3,
            name: "b".to_string(),
            pid: 1,
            weight: 2,
            held: 1,
            waiting: 4,
            grants: 5,
            token_seconds: 1.25,
            since: 0.0,
            waits: 6,
            wait_ms_total: 1500.0,
            wait_ms_p50: Some(250.0),
            wait_ms_p99: Some(1000.0),
            running: None,
            stray: 0,
            uid: None,
            cgroup: None,
        };
        let mut registry = Registry::default();
        render_builds(&[build], &mut registry);
        let mut text = String::new();
        prometheus_text::encode(&mut text, &registry).unwrap();
        let lines = lines(&text);
        for want in [
            r#"baton_build_weight{build="b",id="3"} 2.0"#,
            r#"baton_build_waiting{build="b",id="3"} 4.0"#,
            r#"baton_build_grants_total{build="b",id="3"} 5.0"#,
            r#"baton_build_token_seconds_total{build="b",id="3"} 1.25"#,
            r#"baton_build_waits_total{build="b",id="3"} 6.0"#,
            r#"baton_build_wait_seconds_total{build="b",id="3"} 1.5"#,
            r#"baton_build_wait_quantile_seconds{build="b",id="3",quantile="0.5"} 0.25"#,
            r#"baton_build_wait_quantile_seconds{build="b",id="3",quantile="0.99"} 1.0"#,
        ] {
            assert!(lines.contains(&want), "{want} not in\n{text}");
        }
    }

    /// One request to the metrics endpoint over loopback TCP: the whole
    /// answer, as the scraper reads it.
    fn ask(broker: &mut Broker, request: &str) -> String {
        let now = broker.status_now();
        let status = || Some(now.clone());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.write_all(request.as_bytes()).unwrap();
        let (server, _) = listener.accept().unwrap();
        answer(server, &status).unwrap();
        let mut reply = String::new();
        client.read_to_string(&mut reply).unwrap();
        reply
    }

    #[test]
    fn the_endpoint_answers_get_and_head_at_metrics_404_elsewhere_and_405_to_others() {
        let broker = &mut Broker::new(3).unwrap();
        let got = ask(broker, "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n");
        assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
        assert!(got.contains("\nbaton_limit 3.0\n"), "{got}");
        let head = ask(broker, "HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "no body: {head}");
        let other = ask(broker, "GET /other HTTP/1.1\n\n");
        assert!(other.starts_with("HTTP/1.1 404 Not Found\r\n"), "{other}");
        let post = ask(broker, "POST /metrics HTTP/1.1\r\n\r\n");
        assert!(
            post.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{post}"
        );
    }

    /// A request head that arrives in pieces is read to its blank line,
    /// in either line ending; one past 8 KiB is refused unanswered.
    #[test]
    fn a_request_head_is_read_whole_and_no_longer_than_8_kib() {
        for (first, rest) in [
            ("GET /met", "rics HTTP/1.1\r\nHost: a\r\n\r\n"),
            ("GET /met", "rics HTTP/1.1\nHost: a\n\n"),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (mut server, _) = listener.accept().unwrap();
            client.write_all(first.as_bytes()).unwrap();
            let reader = std::thread::spawn(move || read_head(&mut server).unwrap());
            // The rest only once the first piece had time to be read alone.
            std::thread::sleep(Duration::from_millis(50));
            client.write_all(rest.as_bytes()).unwrap();
            assert_eq!(reader.join().unwrap(), format!("{first}{rest}"));
        }
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let endless = format!("GET /metrics HTTP/1.1\r\n{}", "X-Pad: y\r\n".repeat(1000));
        client.write_all(endless.as_bytes()).unwrap();
        let refused = read_head(&mut server).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::InvalidData, "{refused}");
    }

    /// 8 KiB is the most read, not the first length refused: a head of
    /// exactly 8192 bytes, ended by the client's close, is read whole.
    #[test]
    fn a_request_head_of_exactly_8_kib_is_read() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let line = "GET /metrics HTTP/1.1\r\n";
        let head = format!("{line}{}", "X".repeat(MAX_HEAD - line.len()));
        client.write_all(head.as_bytes()).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(read_head(&mut server).unwrap(), head);
    }

    #[test]
    fn the_gates_are_gauges_labelled_by_name() {
        let mut broker = Broker::new(2).unwrap();
        broker.set_gate("load", Some(64.0)).unwrap();
        broker.observe(baton_core::gates::Reading {
            runnable: Some(3.0),
            ..Default::default()
        });
        let text = render(&broker.status_now());
        let lines = lines(&text);
        for want in [
            r#"baton_gate_open{gate="load"} 1.0"#,
            r#"baton_gate_value{gate="load"} 3.0"#,
            r#"baton_gate_threshold{gate="load"} 64.0"#,
        ] {
            assert!(lines.contains(&want), "{want} not in\n{text}");
        }
    }
}
