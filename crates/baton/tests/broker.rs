//! The broker core through the real binary: serve, run, status, limit, the
//! native protocol's error handling, and token recovery after kill -9.

mod common;

use baton_client::Error;
use common::*;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn two_hundred_runs_never_exceed_four_jobs() {
    let broker = RunningBroker::start(4);
    let log = broker.dir.path().join("jobs.log");
    let job = logged_job(&log, "0.02");
    let children: Vec<_> = (0..200)
        // Plain commands: no jobserver, so every grant is a command's own.
        .map(|_| {
            broker
                .run(&["--jobserver-style", "none", "--", "sh", "-c", &job])
                .stdout(Stdio::null())
                .spawn_guarded()
                .expect("spawn baton run")
        })
        .collect();
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 200, "every job ran");
    assert!(max <= 4, "{max} jobs overlapped under a limit of 4");
    assert!(
        max >= 2,
        "the limit allowed parallelism (saw at most {max} at once)"
    );
    broker.assert_all_free();
    let s = broker.status();
    assert_eq!(s.totals.granted, 200);
    assert_eq!(
        s.totals.reclaimed, 0,
        "baton run gives its token back itself"
    );
}

#[test]
fn a_freed_token_goes_to_the_longest_waiter() {
    let broker = RunningBroker::start(1);
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut threads = Vec::new();
    for i in 0..5 {
        let mut c = broker.client(&format!("waiter {i}"));
        let tx = tx.clone();
        threads.push(std::thread::spawn(move || {
            c.acquire(1).unwrap();
            tx.send(i).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            c.release(1).unwrap();
        }));
        // Queue them one after another, in a known order.
        wait_for(Duration::from_secs(5), "the waiter to queue", || {
            broker.status().waiters.len() == i + 1
        });
    }
    holder.release(1).unwrap();
    let order: Vec<_> = (0..5)
        .map(|_| rx.recv_timeout(Duration::from_secs(30)).expect("a grant"))
        .collect();
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
    threads.into_iter().for_each(|t| t.join().unwrap());
    broker.assert_all_free();
}

#[test]
fn kill_9_of_holders_gives_their_tokens_to_the_waiter() {
    let broker = RunningBroker::start(2);
    let mut holders: Vec<_> = (0..2)
        .map(|_| {
            broker
                .run(&["--jobserver-style", "none", "--", "sleep", "600"])
                .spawn_guarded()
                .unwrap()
        })
        .collect();
    let sleepers: Vec<u32> = holders
        .iter()
        .map(|h| running_command(h.id(), "sleep"))
        .collect();
    assert_eq!(broker.status().held, 2);
    let socket = broker.socket.clone();
    let waiter = std::thread::spawn(move || {
        let mut c = baton_client::Client::connect(&socket, "waiter").unwrap();
        c.acquire(2).unwrap();
        c
    });
    wait_for(Duration::from_secs(10), "the waiter to queue", || {
        broker.status().waiters.len() == 1
    });
    for h in &mut holders {
        h.kill().unwrap(); // SIGKILL
    }
    let mut waiter = join_within(
        waiter,
        Duration::from_secs(30),
        "the waiter to get the killed holders' tokens",
    );
    let s = broker.status();
    assert_eq!(
        (s.totals.reclaimed, s.held, s.holders.len()),
        (2, 2, 1),
        "the waiter holds both reclaimed tokens: {s:#?}"
    );
    waiter.release(2).unwrap();
    holders.iter_mut().for_each(|h| drop(h.wait()));
    // CMD must not outlive baton run holding nothing.
    wait_for(
        Duration::from_secs(20),
        "the commands to die with baton run",
        || sleepers.iter().all(|&p| !pid_alive(p)),
    );
    broker.assert_all_free();
}

#[test]
fn status_json_has_the_documented_keys() {
    // A gate, so that the gates' fields are there to check.
    let broker = RunningBroker::start_with(3, &["--max-load", "100000"]);
    let mut holder = broker.client("holder");
    holder.acquire(2).unwrap();
    let mut waiter = broker
        .run(&["--jobserver-style", "none", "--tokens", "2", "--", "true"])
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "a waiter", || {
        broker.status().waiters.len() == 1
    });
    // The connections of earlier STATUS calls may not be reaped yet when
    // the next one is answered (the broker sees the new request before the
    // old hang-up), so wait for the count to settle at the three open now:
    // the holder, the waiting `baton run` and this STATUS itself.
    let mut v = serde_json::Value::Null;
    wait_for(
        Duration::from_secs(10),
        "the client count to settle",
        || {
            v = serde_json::from_str(&broker_status_json(&broker)).unwrap();
            v["totals"]["clients"].as_u64() == Some(3)
        },
    );
    let documented = documented_status_fields();
    assert!(
        documented.len() >= 17,
        "the table in docs/protocol.md was not found: {documented:?}"
    );
    for (path, kind) in &documented {
        let value =
            json_at(&v, path).unwrap_or_else(|| panic!("{path} is documented but missing: {v:#}"));
        let ok = match kind.as_str() {
            "number" => value.is_number(),
            "string" => value.is_string(),
            "array" => value.is_array(),
            other => panic!("{path}: undocumented type {other}"),
        };
        assert!(ok, "{path} is not a {kind}: {value}");
    }
    assert_eq!(
        (v["version"].as_u64(), v["broker_pid"].as_u64()),
        (Some(1), Some(broker.pid() as u64))
    );
    assert_eq!(
        (v["limit"].as_u64(), v["free"].as_u64(), v["held"].as_u64()),
        (Some(3), Some(1), Some(2))
    );
    let holder_row = &v["holders"][0];
    assert_eq!(
        (holder_row["pid"].as_u64(), holder_row["tokens"].as_u64()),
        (Some(std::process::id() as u64), Some(2))
    );
    assert_eq!(
        (
            holder_row["command"].as_str(),
            holder_row["transport"].as_str()
        ),
        (Some("holder"), Some("socket"))
    );
    assert!(holder_row["since"].as_f64().unwrap() > 1.7e9);
    let waiter_row = &v["waiters"][0];
    assert_eq!(
        (waiter_row["pid"].as_u64(), waiter_row["tokens"].as_u64()),
        (Some(waiter.id() as u64), Some(2))
    );
    assert_eq!(
        (
            waiter_row["command"].as_str(),
            waiter_row["transport"].as_str()
        ),
        (Some("baton run -- true"), Some("socket"))
    );
    let totals = &v["totals"];
    assert_eq!(
        [
            &totals["granted"],
            &totals["released"],
            &totals["reclaimed"],
            &totals["waits"],
            &totals["clients"]
        ]
        .map(|t| t.as_u64()),
        [2, 0, 0, 1, 3].map(Some),
        "{totals}"
    );
    holder.release(2).unwrap();
    assert!(waiter.wait().unwrap().success());
    broker.assert_all_free();
}

/// The STATUS fields docs/protocol.md documents, with their types: the
/// rows of its table (`holders[].pid` …), and the keys its `waiters` row
/// lists for each waiter.
fn documented_status_fields() -> Vec<(String, String)> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/protocol.md"
    ))
    .unwrap();
    let mut fields = Vec::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let [_, field, kind, meaning, _] = cells[..] else {
            continue;
        };
        let Some(field) = field.strip_prefix('`').and_then(|f| f.strip_suffix('`')) else {
            continue;
        };
        if !["number", "string", "array"].contains(&kind) {
            continue;
        }
        fields.push((field.to_owned(), kind.to_owned()));
        if field == "waiters" {
            for key in meaning.split('`').skip(1).step_by(2) {
                let kind = if ["command", "transport"].contains(&key) {
                    "string"
                } else {
                    "number"
                };
                fields.push((format!("waiters[].{key}"), kind.to_owned()));
            }
        }
    }
    fields
}

/// `holders[].pid` in `v`: an array step takes its first element.
fn json_at<'a>(v: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
    path.split('.')
        .try_fold(v, |v, key| match key.strip_suffix("[]") {
            Some(array) => v.get(array)?.get(0),
            None => v.get(key),
        })
}

fn broker_status_json(broker: &RunningBroker) -> String {
    broker.cli(&["status", "--json"])
}

#[test]
fn human_status_lists_holders_and_waiters() {
    let broker = RunningBroker::start(1);
    let mut holder = broker.client("the-holder");
    holder.acquire(1).unwrap();
    let mut waiter = broker
        .run(&["--jobserver-style", "none", "--", "true"])
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(5), "a waiter", || {
        broker.status().waiters.len() == 1
    });
    let out = baton()
        .args(["status", "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("limit 1  free 0"), "{text}");
    assert!(
        text.contains("HOLDERS") && text.contains("the-holder"),
        "{text}"
    );
    assert!(
        text.contains("WAITERS") && text.contains("baton run -- true"),
        "{text}"
    );
    holder.release(1).unwrap();
    assert!(waiter.wait().unwrap().success());
}

#[test]
fn run_exits_with_the_commands_status() {
    let broker = RunningBroker::start(2);
    let code = |args: &[&str]| {
        broker
            .run(args)
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .code()
    };
    assert_eq!(code(&["--", "sh", "-c", "exit 7"]), Some(7));
    assert_eq!(code(&["--", "sh", "-c", "kill -9 $$"]), Some(128 + 9));
    assert_eq!(code(&["--", "no-such-command-anywhere"]), Some(127));
    assert_eq!(code(&["--", "/etc/passwd"]), Some(126));
    assert_eq!(code(&["--tokens", "2", "--", "true"]), Some(0));
    broker.assert_all_free();
}

#[test]
fn run_sets_baton_socket_for_the_command() {
    let broker = RunningBroker::start(1);
    let out = broker
        .run(&["--", "sh", "-c", "echo $BATON_SOCKET"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        broker.socket.to_str().unwrap()
    );
}

#[test]
fn kill_9_of_baton_run_kills_its_command_and_frees_its_token() {
    let broker = RunningBroker::start(1);
    let mut run = broker.run(&["--", "sleep", "600"]).spawn_guarded().unwrap();
    let sleeper = running_command(run.id(), "sleep");
    run.kill().unwrap();
    run.wait().unwrap();
    wait_for(
        Duration::from_secs(20),
        "the orphaned command to die",
        || !pid_alive(sleeper),
    );
    wait_for(Duration::from_secs(20), "the token to come back", || {
        broker.status().free == 1
    });
    assert_eq!(broker.status().totals.reclaimed, 1);
}

#[test]
fn sigterm_to_baton_run_reaches_the_command() {
    let broker = RunningBroker::start(1);
    let mut run = broker.run(&["--", "sleep", "600"]).spawn_guarded().unwrap();
    running_command(run.id(), "sleep");
    unsafe { libc::kill(run.id() as i32, libc::SIGTERM) };
    assert_eq!(
        wait_timeout(&mut run, Duration::from_secs(20))
            .unwrap()
            .code(),
        Some(128 + libc::SIGTERM)
    );
    broker.assert_all_free();
}

#[test]
fn over_release_is_refused_and_the_pool_never_grows() {
    let broker = RunningBroker::start(2);
    let mut c = broker.client("greedy");
    c.acquire(1).unwrap();
    match c.release(2) {
        Err(Error::Refused { code, .. }) => assert_eq!(code.as_str(), "over-release"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let s = broker.status();
    assert_eq!((s.limit, s.free, s.held), (2, 1, 1));
    c.release(1).unwrap(); // the connection is still usable
    broker.assert_all_free();
}

#[test]
fn more_than_the_limit_is_refused_not_queued_forever() {
    let broker = RunningBroker::start(2);
    let mut c = broker.client("c");
    assert!(matches!(c.acquire(3), Err(Error::Refused { .. })));
    assert!(matches!(c.acquire(0), Err(Error::Refused { .. })));
    c.acquire(2).unwrap();
    assert!(
        matches!(c.acquire(1), Err(Error::Refused { .. })),
        "held + asked may not exceed the limit"
    );
    assert!(!c.try_acquire(1).is_ok_and(|x| x));
}

/// One line read from a raw connection, with a hang guard.
fn raw_line(s: &UnixStream) -> String {
    use std::io::BufRead;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut line = String::new();
    let _ = std::io::BufReader::new(s).read_line(&mut line);
    line
}

/// A client that connected and went before the broker accepted it (a
/// readiness probe, a killed build) must not keep a live newcomer out at
/// `--max-clients`. The broker is stopped while the three connect, so it
/// accepts the gone one first, with its end of file not yet read.
#[test]
fn a_client_gone_before_it_was_accepted_does_not_keep_a_newcomer_out() {
    let mut broker = RunningBroker::start_with(1, &["--max-clients", "2"]);
    let pid = nix::unistd::Pid::from_raw(broker.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    drop(UnixStream::connect(&broker.socket).unwrap());
    let live: Vec<UnixStream> = (0..2)
        .map(|_| UnixStream::connect(&broker.socket).unwrap())
        .collect();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    for mut s in &live {
        s.write_all(b"HELLO 1 live\n").unwrap();
        let line = raw_line(s);
        assert!(
            line.starts_with("OK 1 "),
            "a live client was answered {line:?}"
        );
    }
    // The maximum still holds for live ones.
    let mut third = UnixStream::connect(&broker.socket).unwrap();
    let _ = third.write_all(b"HELLO 1 third\n");
    assert_eq!(
        raw_line(&third),
        "ERR full the broker serves its maximum of 2 clients\n"
    );
    drop(live);
    drop(third);
    // Their ends of file reach the broker in its own time: until it has
    // read them it is rightly full, so a newcomer is let in only then.
    drop(common::connect_once_a_seat_frees(&broker.socket, "after"));
    broker.wait_all_free();
    let (status, _) = broker.stop_with(libc::SIGTERM);
    assert!(status.success());
}

/// A client that hangs up with replies it never read is closed like any
/// other: its token comes back, and the broker serves on.
#[test]
fn a_client_that_hangs_up_on_unread_replies_is_closed_and_others_served() {
    let broker = RunningBroker::start(1);
    let mut gone = UnixStream::connect(&broker.socket).unwrap();
    gone.write_all(b"HELLO 1 gone\nACQUIRE 1\n").unwrap();
    wait_for(Duration::from_secs(10), "its token to be granted", || {
        broker.status().held == 1
    });
    drop(gone);
    broker.wait_all_free();
    let mut next = broker.client("next");
    next.acquire(1).unwrap();
    next.release(1).unwrap();
    broker.assert_all_free();
}

/// Raw bytes, for what the client library would never send.
fn raw_exchange(broker: &RunningBroker, bytes: &[u8]) -> String {
    let mut s = UnixStream::connect(&broker.socket).unwrap();
    s.write_all(bytes).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out); // ends when the broker closes
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn malformed_and_oversized_requests_get_an_error_and_lose_nothing() {
    let broker = RunningBroker::start(3);
    let mut bystander = broker.client("bystander");
    bystander.acquire(1).unwrap();

    let cases: [(&[u8], &str); 6] = [
        (b"HELLO 1 bad\nACQUIRE 1\nFROB 3\n", "ERR malformed"),
        (b"HELLO 1 bad\nACQUIRE 1\nACQUIRE -4\n", "ERR malformed"),
        (b"HELLO 1 bad\nACQUIRE 1\n\xff\xfe\xfd\n", "ERR malformed"),
        (b"ACQUIRE 1\n", "ERR hello"),
        (b"HELLO 9\n", "ERR version"),
        (&[b'x'; 10_000], "ERR too-long"),
    ];
    for (bytes, expected) in cases {
        let reply = raw_exchange(&broker, bytes);
        assert!(
            reply.lines().last().unwrap_or("").starts_with(expected),
            "{bytes:?} got {reply:?}"
        );
    }
    // Pipelining while ACQUIRE waits is a protocol error, too.
    let mut hog = broker.client("hog");
    hog.acquire(2).unwrap();
    let reply = raw_exchange(&broker, b"HELLO 1 w\nACQUIRE 1\nSTATUS\n");
    assert!(
        reply.ends_with("ERR busy only CANCEL is allowed while ACQUIRE waits\n"),
        "{reply:?}"
    );
    hog.release(2).unwrap();

    let s = broker.status();
    assert_eq!(
        (s.free, s.held),
        (2, 1),
        "only the bystander holds a token: {s:#?}"
    );
    bystander.release(1).unwrap();
    broker.assert_all_free();
}

#[test]
fn cancel_withdraws_a_pending_acquire() {
    let broker = RunningBroker::start(1);
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    let mut session = RawSession::open(&broker, "w");
    session.send("ACQUIRE 1\nCANCEL\nSTATUS\n");
    assert_eq!(session.line(), "CANCELLED 1");
    let status = session.status();
    assert_eq!(
        status["waiters"].as_array().map(Vec::len),
        Some(0),
        "the request is withdrawn: {status}"
    );
    assert_eq!(
        (
            status["held"].as_u64(),
            status["totals"]["granted"].as_u64()
        ),
        (Some(1), Some(1)),
        "{status}"
    );
    // The release now goes nowhere: nobody waits.
    holder.release(1).unwrap();
    broker.assert_all_free();
}

/// The grant is filed by another client's RELEASE and the CANCEL read in
/// the same round of the broker's loop (both sent while the broker is
/// stopped): the client must read GRANTED before CANCELLED 0, or it would
/// take the grant for a stray reply and never give the token back.
#[test]
fn a_cancel_that_loses_the_race_to_a_grant_is_answered_after_it() {
    let broker = RunningBroker::start(1);
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    let mut waiter = RawSession::open(&broker, "w");
    waiter.send("ACQUIRE 1\n");
    wait_for(Duration::from_secs(30), "the ACQUIRE to queue", || {
        broker.status().waiters.len() == 1
    });
    let signal = |sig| assert_eq!(unsafe { libc::kill(broker.pid() as i32, sig) }, 0);
    signal(libc::SIGSTOP);
    holder
        .send(&baton_core::protocol::Request::Release(1))
        .unwrap();
    waiter.send("CANCEL\n");
    signal(libc::SIGCONT);
    assert_eq!(
        holder.read_reply().unwrap(),
        baton_core::protocol::Reply::Released { tokens: 1, held: 0 }
    );
    assert_eq!(
        (waiter.line(), waiter.line()),
        ("GRANTED 1 1".to_owned(), "CANCELLED 0".to_owned())
    );
    waiter.send("RELEASE 1\n");
    assert_eq!(waiter.line(), "RELEASED 1 0");
    broker.assert_all_free();
}

/// A connection speaking the protocol by hand, for what the client library
/// would never send; a reply that does not come within many seconds fails.
struct RawSession(std::io::BufReader<UnixStream>);

impl RawSession {
    /// Connects as `label` ([`hello_as`]).
    fn open(broker: &RunningBroker, label: &str) -> Self {
        let stream = hello_as(&broker.socket, label);
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        RawSession(std::io::BufReader::new(stream))
    }

    fn send(&mut self, text: &str) {
        self.0.get_mut().write_all(text.as_bytes()).unwrap();
    }

    /// The next reply line, without its newline; "" at the end.
    fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut line = String::new();
        self.0.read_line(&mut line).expect("a reply within 30 s");
        line.trim_end_matches('\n').to_owned()
    }

    /// A `STATUS <bytes>` reply's JSON.
    fn status(&mut self) -> serde_json::Value {
        let head = self.line();
        let bytes: usize = head
            .strip_prefix("STATUS ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("not a STATUS reply: {head}"));
        let mut body = vec![0u8; bytes + 1];
        self.0.read_exact(&mut body).unwrap();
        assert_eq!(body.pop(), Some(b'\n'));
        serde_json::from_slice(&body).unwrap()
    }
}

#[test]
fn errors_say_what_to_do() {
    let dir = TempDir::new("errors");
    let missing = dir.path().join("nothing-here");
    let out = baton()
        .args(["status", "--socket"])
        .arg(&missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("no broker at") && err.contains("baton serve --jobs"),
        "{err}"
    );

    let file = dir.path().join("plain-file");
    std::fs::write(&file, "").unwrap();
    let out = baton()
        .args(["status", "--socket"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a socket"));
    let out = baton()
        .args(["serve", "--jobs", "1", "--socket"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not a socket: refusing to replace it")
    );

    for bad in ["0", "many", "-3"] {
        let out = baton().args(["serve", "--jobs", bad]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "--jobs {bad}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--jobs"));
    }
}

#[test]
fn permission_denied_is_reported_as_such() {
    // Needs a second user: run the client as nobody with setpriv (util-linux).
    if !can_act_as_another_user() {
        return;
    }
    let broker = RunningBroker::start(1);
    let out = Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            baton_bin(),
            "status",
            "--socket",
        ])
        .arg(&broker.socket)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("permission denied"), "{err}");
}

#[test]
fn a_second_broker_is_refused_and_a_stale_socket_replaced() {
    let mut broker = RunningBroker::start(1);
    let out = baton()
        .args(["serve", "--jobs", "1", "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already running"));

    // kill -9 leaves the socket file behind, with nobody answering.
    let (status, _) = broker.stop_with(libc::SIGKILL);
    assert!(!status.success());
    assert!(std::fs::metadata(&broker.socket)
        .unwrap()
        .file_type()
        .is_socket());
    // Refused there (ECONNREFUSED), as good as no socket at all.
    let stop = baton()
        .args(["stop", "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap();
    assert_eq!(stop.status.code(), Some(3), "{}", text(&stop.stderr));
    assert!(
        text(&stop.stderr).starts_with("baton: no broker at "),
        "{}",
        text(&stop.stderr)
    );
    let mut again = baton()
        .args(["serve", "--jobs", "1", "--socket"])
        .arg(&broker.socket)
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(5), "the new broker", || {
        baton_client::Client::connect(&broker.socket, "p").is_ok()
    });
    unsafe { libc::kill(again.id() as i32, libc::SIGTERM) };
    assert!(again.wait().unwrap().success());
}

/// `Token::release` gives back its one token, once: the client's other
/// token stays held, in its books and the broker's.
#[test]
fn a_token_released_by_hand_gives_back_its_token_once() {
    let broker = RunningBroker::start(3);
    let mut c = broker.client("two tokens");
    c.acquire(1).unwrap();
    c.token().unwrap().release().unwrap();
    assert_eq!(c.held(), 1);
    assert_eq!((broker.status().held, broker.status().free), (1, 2));
    drop(c.token().unwrap());
    assert_eq!(c.held(), 1);
    c.release(1).unwrap();
    broker.assert_all_free();
}

/// The time and level a broker log line starts with, if it has them:
/// `2026-11-25T17:20:41.123Z INFO baton: ...`.
fn stamp_and_level(line: &str) -> Option<(std::time::SystemTime, &str)> {
    let mut words = line.splitn(4, ' ');
    let (time, level, tag) = (words.next()?, words.next()?, words.next()?);
    let millis = time.strip_suffix('Z')?.rsplit_once('.')?.1;
    let well_formed = time.len() == "2026-11-25T17:20:41.123Z".len()
        && millis.len() == 3
        && ["INFO", "WARN", "ERROR", "DEBUG"].contains(&level)
        && tag == "baton:";
    well_formed
        .then(|| Some((humantime::parse_rfc3339(time).ok()?, level)))
        .flatten()
}

/// Every line of the broker's log says when (RFC 3339, UTC, to the
/// millisecond, within the broker's life) and how serious it is; a broker
/// that cannot start says why as an ERROR line.
#[test]
fn every_log_line_has_an_rfc3339_utc_time_and_a_level() {
    let before = std::time::SystemTime::now() - Duration::from_millis(1);
    let mut broker = RunningBroker::start(1);
    let refused = baton()
        .args(["serve", "--jobs", "1", "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap();
    let (status, log) = broker.stop_with(libc::SIGTERM);
    assert!(status.success(), "{log}");
    let after = std::time::SystemTime::now();
    let refused = String::from_utf8_lossy(&refused.stderr).into_owned();
    let mut levels = Vec::new();
    for line in log.lines().chain(refused.lines()) {
        let (at, level) = stamp_and_level(line)
            .unwrap_or_else(|| panic!("no RFC 3339 time and level at the start of: {line}"));
        assert!(
            before <= at && at <= after,
            "{line}: not within the test's run"
        );
        levels.push((level, line));
    }
    let has = |level: &str, text: &str| {
        levels
            .iter()
            .any(|&(l, line)| l == level && line.contains(text))
    };
    assert!(has("INFO", "serving 1 token at"), "{log}");
    assert!(has("INFO", "stopping on SIGTERM"), "{log}");
    assert!(has("ERROR", "already running"), "{refused}");
}

#[test]
fn socket_is_private_and_removed_on_sigterm_and_sigint() {
    for (signal, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let mut broker = RunningBroker::start(1);
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&broker.socket), 0o600);
        assert_eq!(mode(broker.socket.parent().unwrap()), 0o700);
        let (status, log) = broker.stop_with(signal);
        assert!(status.success(), "{log}");
        assert!(!broker.socket.exists(), "the socket is removed");
        assert!(log.contains(&format!("stopping on {name}:")), "{log}");
        // Its readiness probe was accepted like any client: without a word.
        assert!(!log.contains("cannot accept"), "{log}");
    }
}

#[test]
fn a_broker_restarted_on_the_same_socket_has_every_token() {
    let mut broker = RunningBroker::start(2);
    let mut c = broker.client("survivor");
    c.acquire(2).unwrap();
    broker.stop_with(libc::SIGTERM);
    assert!(matches!(c.release(1), Err(Error::Disconnected)));
    // The same socket path, as a service manager would restart it.
    let mut again = RunningBroker::start_at(&broker, 2, &[]);
    let mut reconnected = again.client("survivor again");
    // A clean stop removed its socket, so the new broker has no dead
    // predecessor whose builds might still hold tokens: no reclaim grace
    // (docs/protocol.md, HOLD), every token grantable at once. A broker
    // that took the restart for a crash would find nothing to grant.
    assert!(
        reconnected.try_acquire(2).unwrap(),
        "the restarted broker did not grant both tokens at once: {:#?}",
        reconnected.status().unwrap()
    );
    let s = reconnected.status().unwrap();
    assert!(
        s.gates.iter().all(|g| g.name != "reclaim"),
        "a reclaim grace after a clean stop: {s:#?}"
    );
    assert_eq!((s.free, s.held), (0, 2), "{s:#?}");
    reconnected.release(2).unwrap();
    drop(reconnected);
    let (status, log) = again.stop_with(libc::SIGTERM);
    assert!(status.success(), "{log}");
}

#[test]
fn raising_the_limit_by_k_wakes_exactly_k_waiters() {
    let broker = RunningBroker::start(1);
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    let waiters: Vec<_> = (0..6)
        .map(|_| {
            broker
                .run(&["--jobserver-style", "none", "--", "sleep", "600"])
                .spawn_guarded()
                .unwrap()
        })
        .collect();
    wait_for(Duration::from_secs(10), "six waiters", || {
        broker.status().waiters.len() == 6
    });
    let out = baton()
        .args(["limit", "4", "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "limit 1 -> 4");
    wait_for(Duration::from_secs(5), "three grants", || {
        broker.status().held == 4
    });
    let s = broker.status();
    assert_eq!((s.waiters.len(), s.free), (3, 0));
    for mut w in waiters {
        w.kill().unwrap();
        w.wait().unwrap();
    }
}

/// The pid of `pid`'s child once it runs `program` (past fork and exec:
/// before that, the child is a copy of its parent, or a probe such as
/// `make --version`).
fn running_command(pid: u32, program: &str) -> u32 {
    let comm = |p: u32| std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
    let mut found = None;
    wait_for(
        Duration::from_secs(20),
        &format!("{program} to run under pid {pid}"),
        || {
            found = children(pid)
                .into_iter()
                .find(|&c| comm(c).trim() == program);
            found.is_some()
        },
    );
    found.unwrap()
}

/// `members` clients, each taking and giving back a token `rounds` times;
/// every acquisition must be granted once, and every token come back.
fn run_ring(broker: &RunningBroker, members: u64, rounds: u64) {
    let threads: Vec<_> = (0..members)
        .map(|i| {
            let mut c = broker.client(&format!("ring member {i}"));
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    c.acquire(1).unwrap();
                    c.release(1).unwrap();
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(
        broker.status().totals.granted,
        members * rounds,
        "every acquisition was granted once"
    );
    broker.assert_all_free();
}

#[test]
fn a_fast_ring_is_served_whole_and_the_broker_then_sleeps() {
    // A wide window, so the broker surely spins while the ring runs.
    let broker = RunningBroker::start_with(1, &["--no-fuse", "--spin-us", "2000"]);
    run_ring(&broker, 4, 500);
    // Idle now: a loop that kept spinning would burn the whole second.
    let before = cpu_ticks(broker.pid());
    std::thread::sleep(Duration::from_secs(1));
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    let used = cpu_ticks(broker.pid()) - before;
    assert!(
        used * 10 < ticks_per_s,
        "an idle broker used {used} of {ticks_per_s} ticks in a second"
    );
}

#[test]
fn serve_refuses_a_spin_window_out_of_range() {
    let out = baton()
        .args(["serve", "--jobs", "1", "--spin-us", "20000"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--spin-us") && err.contains("0..=10000"),
        "unclear error: {err}"
    );
}

/// The broker's two ways to send a reply and sleep: in one io_uring call
/// (the default where the kernel has it) and in two system calls.
const SEND_PATHS: [&[&str]; 2] = [
    &["--no-fuse", "--spin-us", "0"],
    &["--no-fuse", "--spin-us", "0", "--no-io-uring"],
];

/// Checks, once a test is done, that the broker sent through the path
/// `flags` ask for: io_uring by default (a skip where the kernel refuses
/// it, since both runs then take the same path), writes with
/// `--no-io-uring`, and that the ring never failed on the way.
fn assert_send_path(broker: &RunningBroker, flags: &[&str]) {
    let log = broker.log();
    let through_ring = log.contains("replies go out through io_uring");
    if flags.contains(&"--no-io-uring") {
        assert!(
            !through_ring,
            "{flags:?}: used io_uring when told not to: {log}"
        );
    } else if log.contains("no io_uring here") {
        skip(
            Missing::IoUring,
            &format!("the kernel refuses io_uring, so the default send path was not tested: {log}"),
        );
    } else {
        assert!(
            through_ring,
            "{flags:?}: the default path did not say it uses io_uring: {log}"
        );
        assert!(
            !log.contains("io_uring failed"),
            "{flags:?}: fell back to writes: {log}"
        );
    }
}

#[test]
fn both_send_paths_serve_a_busy_ring_whole() {
    for flags in SEND_PATHS {
        let broker = RunningBroker::start_with(2, flags);
        run_ring(&broker, 6, 300);
        assert_send_path(&broker, flags);
    }
}

#[test]
fn a_raise_wakes_more_waiters_than_one_send_batch_holds() {
    // 100 grants at once: more than the 63 the io_uring call takes.
    for flags in SEND_PATHS {
        let broker = RunningBroker::start_with(1, flags);
        let mut holder = broker.client("holder");
        holder.acquire(1).unwrap();
        let waiters: Vec<_> = (0..100)
            .map(|i| {
                let mut c = broker.client(&format!("waiter {i}"));
                let (queued_tx, queued_rx) = std::sync::mpsc::channel();
                let thread = std::thread::spawn(move || {
                    queued_tx.send(()).unwrap();
                    c.acquire(1).unwrap();
                    c
                });
                queued_rx.recv().unwrap();
                thread
            })
            .collect();
        wait_for(Duration::from_secs(10), "100 waiters", || {
            broker.status().waiters.len() == 100
        });
        let out = baton()
            .args(["limit", "101", "--socket"])
            .arg(&broker.socket)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{flags:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut granted: Vec<_> = waiters
            .into_iter()
            .map(|t| join_within(t, Duration::from_secs(60), "every waiter to be served"))
            .collect();
        assert_eq!(broker.status().held, 101, "{flags:?}");
        granted.iter_mut().for_each(|c| c.release(1).unwrap());
        holder.release(1).unwrap();
        broker.assert_all_free();
        assert_send_path(&broker, flags);
    }
}

#[test]
fn a_client_that_reads_late_gets_every_reply_in_order() {
    // Its replies overflow the socket: sends that would block wait for it,
    // even once it has shut down its writing side.
    for flags in SEND_PATHS {
        let broker = RunningBroker::start_with(1, flags);
        let mut s = UnixStream::connect(&broker.socket).unwrap();
        let rounds = 2000;
        let mut text = String::from("HELLO 1 slow reader\n");
        // Each round changes what the next STATUS shows, so order shows.
        (0..rounds).for_each(|_| text.push_str("TRY 1\nRELEASE 1\nSTATUS\n"));
        s.write_all(text.as_bytes()).unwrap();
        // The replies pile up; then the client says it has no more to ask
        // and reads only once the broker has seen that (as `nc -N` would).
        wait_for(
            Duration::from_secs(30),
            "every request to be served",
            || broker.status().totals.granted == rounds,
        );
        s.shutdown(std::net::Shutdown::Write).unwrap();
        wait_for(
            Duration::from_secs(30),
            "the broker to see the shutdown",
            || broker.status().totals.clients == 1,
        );
        let mut out = String::new();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.read_to_string(&mut out).unwrap();
        // Each round: its TRY's and RELEASE's replies, then `STATUS <bytes>`
        // and the JSON on a line of its own.
        let lines: Vec<_> = out.lines().collect();
        assert!(lines[0].starts_with("OK 1 "), "{flags:?}: {}", lines[0]);
        assert_eq!(
            lines.len(),
            4 * rounds as usize + 1,
            "{flags:?}: a reply for every request"
        );
        for (round, reply) in lines[1..].chunks(4).enumerate() {
            assert_eq!(
                reply[..2],
                ["GRANTED 1 1", "RELEASED 1 0"],
                "{flags:?}: round {round}"
            );
            assert_eq!(
                reply[2],
                format!("STATUS {}", reply[3].len()),
                "{flags:?}: a reply whole"
            );
            let status: serde_json::Value = serde_json::from_str(reply[3]).unwrap();
            assert_eq!(
                status["totals"]["granted"].as_u64(),
                Some(round as u64 + 1),
                "{flags:?}: replies out of order"
            );
        }
        broker.assert_all_free();
    }
}

#[test]
fn a_client_that_shuts_down_its_writing_side_gives_its_tokens_back_and_gets_its_replies() {
    let broker = RunningBroker::start(2);
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    let mut s = UnixStream::connect(&broker.socket).unwrap();
    // One token granted, then a wait for two more that can never come.
    s.write_all(b"HELLO 1 half-closer\nACQUIRE 1\nSTATUS\n")
        .unwrap();
    wait_for(Duration::from_secs(5), "the half-closer's token", || {
        broker.status().held == 2
    });
    s.write_all(b"ACQUIRE 1\n").unwrap();
    wait_for(Duration::from_secs(5), "the half-closer to wait", || {
        broker.status().waiters.len() == 1
    });
    s.shutdown(std::net::Shutdown::Write).unwrap();
    wait_for(
        Duration::from_secs(5),
        "its token back and its wait withdrawn",
        || {
            let status = broker.status();
            (status.held, status.waiters.len()) == (1, 0)
        },
    );
    let mut out = String::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_to_string(&mut out).unwrap();
    let lines: Vec<_> = out.lines().collect();
    assert!(
        lines[0].starts_with("OK 1 ")
            && lines[1] == "GRANTED 1 1"
            && lines[2].starts_with("STATUS "),
        "{out}"
    );
    assert_eq!(lines.len(), 4, "nothing after the STATUS body: {out}");
    holder.release(1).unwrap();
    broker.assert_all_free();
}

/// A client waiting in ACQUIRE on its own thread; joining gives it back.
fn queued_acquire(
    broker: &RunningBroker,
    label: &str,
    tokens: u32,
) -> std::thread::JoinHandle<baton_client::Client> {
    let before = broker.status().waiters.len();
    let mut c = broker.client(label);
    let thread = std::thread::spawn(move || {
        c.acquire(tokens).unwrap();
        c
    });
    wait_for(
        Duration::from_secs(20),
        &format!("{label} to queue"),
        || broker.status().waiters.len() == before + 1,
    );
    thread
}

#[test]
fn a_lowered_limit_drains_before_anyone_is_served() {
    let broker = RunningBroker::start(4);
    let mut holder = broker.client("holder");
    holder.acquire(4).unwrap();
    let waiter = queued_acquire(&broker, "waiter", 1);
    let out = set_limit(&broker, 2);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "limit 4 -> 2");
    let s = broker.status();
    assert_eq!(
        (s.limit, s.held, s.free),
        (2, 4, 0),
        "held above the limit while it drains: {s:#?}"
    );
    // Each release retires a token until fewer than the limit are held.
    for held in [3, 2] {
        holder.release(1).unwrap();
        let s = broker.status();
        assert_eq!(
            (s.held, s.free, s.waiters.len()),
            (held, 0, 1),
            "served while {held} held under a limit of 2: {s:#?}"
        );
    }
    holder.release(1).unwrap();
    let mut waiter = join_within(waiter, Duration::from_secs(30), "the waiter to be served");
    let s = broker.status();
    assert_eq!((s.held, s.free, s.waiters.len()), (2, 0, 0), "{s:#?}");
    // A limit below what a waiting request asks is refused, and changes nothing.
    let big = queued_acquire(&broker, "big", 2);
    let out = set_limit(&broker, 1);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("range") || err.contains("waiting"), "{err}");
    assert_eq!(broker.status().limit, 2);
    holder.release(1).unwrap();
    waiter.release(1).unwrap();
    join_within(big, Duration::from_secs(30), "the big request to be served")
        .release(2)
        .unwrap();
    let s = broker.status();
    assert_eq!(s.totals.granted, s.totals.released, "{s:#?}");
    broker.assert_all_free();
}

#[test]
fn a_client_killed_while_queued_never_gets_the_token() {
    let broker = RunningBroker::start(1);
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    let mut doomed = broker
        .run(&["--jobserver-style", "none", "--", "true"])
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(20), "the doomed run to queue", || {
        broker.status().waiters.len() == 1
    });
    let live = queued_acquire(&broker, "live", 1);
    doomed.kill().unwrap();
    doomed.wait().unwrap();
    wait_for(
        Duration::from_secs(20),
        "the dead waiter to leave the queue",
        || broker.status().waiters.len() == 1,
    );
    holder.release(1).unwrap();
    let mut live = join_within(
        live,
        Duration::from_secs(30),
        "the live waiter to be served",
    );
    let s = broker.status();
    assert_eq!(
        (s.held, s.holders.len(), s.holders[0].command.as_str()),
        (1, 1, "live"),
        "{s:#?}"
    );
    assert_eq!(
        (s.totals.granted, s.totals.reclaimed),
        (2, 0),
        "the dead waiter was never granted: {s:#?}"
    );
    live.release(1).unwrap();
    broker.assert_all_free();
}

#[test]
fn protocol_edges_get_the_documented_answers() {
    let broker = RunningBroker::start(2);
    // HELLO twice is fatal.
    let reply = raw_exchange(&broker, b"HELLO 1 a\nHELLO 1 b\n");
    assert!(
        reply
            .lines()
            .nth(1)
            .is_some_and(|l| l.starts_with("ERR hello")),
        "{reply:?}"
    );
    // \r\n ends a line as \n does, and is not part of the label.
    let mut crlf = RawSession::open(&broker, "crlf\r");
    crlf.send("ACQUIRE 1\r\nSTATUS\r\n");
    assert_eq!(crlf.line(), "GRANTED 1 1");
    let status = crlf.status();
    assert_eq!(status["holders"][0]["command"], "crlf", "{status}");
    // A label over 200 bytes is refused, though the line is under 256.
    let long = format!("HELLO 1 {}\n", "x".repeat(201));
    let reply = raw_exchange(&broker, long.as_bytes());
    assert!(reply.starts_with("ERR malformed"), "{reply:?}");
    // TRY never jumps the queue: with a token free, it is BUSY behind a waiter.
    let waiter = queued_acquire(&broker, "waits for two", 2);
    let mut tryer = RawSession::open(&broker, "tryer");
    tryer.send("TRY 1\n");
    assert_eq!(tryer.line(), "BUSY 1");
    crlf.send("RELEASE 1\n");
    assert_eq!(crlf.line(), "RELEASED 1 0");
    let mut waiter = join_within(waiter, Duration::from_secs(30), "the waiter to be served");
    waiter.release(2).unwrap();
    broker.assert_all_free();
}

/// A client that asks for far more replies than it reads is no longer read
/// from once 1 MiB of them wait (docs/protocol.md): the broker serves the
/// others meanwhile, and when the client reads at last it gets every reply,
/// in order, as the broker reads on.
#[test]
fn a_client_that_never_reads_is_paused_past_1_mib_and_served_in_full_when_it_reads() {
    const ASKED: usize = 10_000;
    let broker = RunningBroker::start(1);
    let mut hog = RawSession::open(&broker, "reads late");
    hog.send("ACQUIRE 1\n");
    assert_eq!(hog.line(), "GRANTED 1 1");
    // Some 3 MB of replies, asked for in 70 kB, which the socket's buffers
    // take whole: the broker stops reading them past 1 MiB unsent.
    hog.send(&"STATUS\n".repeat(ASKED));
    let mut other = broker.client("other");
    assert_eq!(other.status().unwrap().held, 1, "the others are served");
    assert!(!other.try_acquire(1).unwrap(), "the hog keeps its token");
    for _ in 0..ASKED {
        hog.status();
    }
    drop(hog);
    wait_for(Duration::from_secs(10), "the hog's token back", || {
        broker.status().free == 1
    });
    broker.assert_all_free();
}

/// ^C on a terminal signals the whole foreground group, baton run and its
/// command alike: the command sees it (one SIGINT counted; a second one
/// from baton run is caught only when it comes after the first was
/// handled, since a pending signal absorbs its twin). A SIGHUP or a
/// SIGINT sent to baton run alone (a supervisor's, a CI timeout's) is
/// forwarded. baton run runs here as the session leader of a
/// pseudo-terminal, as in a shell.
#[test]
fn a_terminal_sigint_reaches_the_command_and_sighup_is_forwarded() {
    use std::os::unix::process::CommandExt;
    let broker = RunningBroker::start(1);
    let dir = TempDir::new("tty");
    let (ready, counts) = (dir.path().join("ready"), dir.path().join("counts"));
    let script = "import signal, sys, time\n\
        seen = {'INT': 0, 'HUP': 0}\n\
        def note(name):\n\
        \x20   seen[name] += 1\n\
        \x20   open(sys.argv[2], 'w').write('INT=%d HUP=%d' % (seen['INT'], seen['HUP']))\n\
        signal.signal(signal.SIGINT, lambda *_: note('INT'))\n\
        signal.signal(signal.SIGHUP, lambda *_: note('HUP'))\n\
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n\
        open(sys.argv[1], 'w').close()\n\
        while True: time.sleep(1)\n";
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty fills in two new descriptors.
    assert_eq!(
        unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        },
        0
    );
    let mut cmd = broker.run(&["--jobserver-style", "none", "--", "python3", "-c", script]);
    cmd.arg(&ready).arg(&counts);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            libc::ioctl(slave, libc::TIOCSCTTY, 0);
            for fd in 0..3 {
                libc::dup2(slave, fd);
            }
            Ok(())
        });
    }
    // Its own session's leader, so its own group's.
    let mut run = Guarded::of_group_leader(cmd.spawn().unwrap());
    unsafe { libc::close(slave) };
    wait_for(
        Duration::from_secs(30),
        "the command to set its handlers",
        || ready.exists(),
    );
    // ^C, as typed: the terminal sends SIGINT to baton run and python.
    let counted = |text: &str| std::fs::read_to_string(&counts).is_ok_and(|c| c == text);
    assert_eq!(
        unsafe { libc::write(master, b"\x03".as_ptr().cast(), 1) },
        1
    );
    wait_for(Duration::from_secs(30), "the command to see ^C", || {
        counted("INT=1 HUP=0")
    });
    unsafe { libc::kill(run.id() as i32, libc::SIGHUP) };
    wait_for(Duration::from_secs(30), "the command to get SIGHUP", || {
        !counted("INT=1 HUP=0")
    });
    // Sent by a process, not typed: the command gets it from baton run.
    unsafe { libc::kill(run.id() as i32, libc::SIGINT) };
    wait_for(Duration::from_secs(30), "the command to get SIGINT", || {
        counted("INT=2 HUP=1")
    });
    // Forwarded last, after any second SIGINT baton run would have sent.
    unsafe { libc::kill(run.id() as i32, libc::SIGTERM) };
    let status = wait_timeout(&mut run, Duration::from_secs(30));
    unsafe { libc::close(master) };
    assert!(status.is_some(), "baton run did not end on SIGTERM");
    assert_eq!(
        std::fs::read_to_string(&counts).unwrap_or_default(),
        "INT=2 HUP=1"
    );
    broker.assert_all_free();
}
