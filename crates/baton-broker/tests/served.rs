//! The broker's shell, served for real by this crate alone: its event loop
//! (`socket.rs`), `serve` (`serve.rs`) and its stop, handover, idle and
//! metrics paths, driven over real Unix sockets, signals and HTTP.
//!
//! The binary's integration tests (crates/baton/tests) cover the same
//! shell through `baton serve`; these exist so that the crate's own tests,
//! which is what `scripts/mutants` runs per mutant in seconds, reach it as
//! well (docs/testing.md). The broker runs in a process of its own: this
//! test binary started again in the `serve` role (tests/support), which
//! calls [`baton_broker::serve`] on its main thread as `baton serve` does;
//! hence `harness = false` and `baton_testkit::harness`, which says why.

#[path = "support/serve_role.rs"]
mod serve_role;

use baton_testkit::harness::role_command;
use baton_testkit::{
    fuse_should_mount, harness, hello_as, pid_alive, skip, wait_for, wait_timeout, Missing,
    RunningBroker, SpawnGuarded, TempDir,
};
use serve_role::{serve_command, served, served_at};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// How long a test waits for what must happen at once, before it fails
/// rather than hangs (a hang guard, not a timing check).
const PATIENCE: Duration = Duration::from_secs(20);

fn main() {
    if let Some((_, spec)) = harness::role() {
        serve_role::serve_here(&spec);
    }
    let tests: &[(&str, fn())] = &[
        (
            "the_client_counts_each_grant_once_and_tries_up_to_the_last_free_token",
            the_client_counts_each_grant_once_and_tries_up_to_the_last_free_token,
        ),
        (
            "requests_split_anywhere_or_sent_at_once_get_the_same_replies",
            requests_split_anywhere_or_sent_at_once_get_the_same_replies,
        ),
        (
            "a_freed_token_goes_to_the_oldest_waiter_and_a_hang_up_frees_what_it_held",
            a_freed_token_goes_to_the_oldest_waiter_and_a_hang_up_frees_what_it_held,
        ),
        (
            "the_same_with_replies_sent_by_io_uring",
            the_same_with_replies_sent_by_io_uring,
        ),
        (
            "replies_before_a_waiting_acquire_leave_with_its_grant",
            replies_before_a_waiting_acquire_leave_with_its_grant,
        ),
        (
            "the_same_with_replies_sent_by_io_uring_as_the_loop_sleeps",
            the_same_with_replies_sent_by_io_uring_as_the_loop_sleeps,
        ),
        (
            "a_fatal_error_is_answered_then_closed_with_replies_sent_by_io_uring",
            a_fatal_error_is_answered_then_closed_with_replies_sent_by_io_uring,
        ),
        (
            "a_full_broker_says_so_and_serves_the_rest",
            a_full_broker_says_so_and_serves_the_rest,
        ),
        (
            "a_low_open_file_limit_caps_the_clients_and_is_logged",
            a_low_open_file_limit_caps_the_clients_and_is_logged,
        ),
        (
            "statuses_larger_than_the_socket_buffer_reach_a_late_reader_whole",
            statuses_larger_than_the_socket_buffer_reach_a_late_reader_whole,
        ),
        (
            "a_client_that_never_reads_does_not_hold_up_the_others",
            a_client_that_never_reads_does_not_hold_up_the_others,
        ),
        (
            "stop_ends_the_broker_says_who_asked_and_leaves_no_socket",
            stop_ends_the_broker_says_who_asked_and_leaves_no_socket,
        ),
        (
            "sigterm_and_sigint_each_stop_the_broker_by_name",
            sigterm_and_sigint_each_stop_the_broker_by_name,
        ),
        (
            "a_successor_takes_the_connections_their_tokens_and_their_wait",
            a_successor_takes_the_connections_their_tokens_and_their_wait,
        ),
        (
            "an_idle_broker_stops_by_itself",
            an_idle_broker_stops_by_itself,
        ),
        (
            "the_metrics_endpoint_serves_the_pool",
            the_metrics_endpoint_serves_the_pool,
        ),
        (
            "a_scrape_counts_a_builds_token_seconds_up_to_itself",
            a_scrape_counts_a_builds_token_seconds_up_to_itself,
        ),
        (
            "a_second_broker_at_a_served_socket_refuses_and_a_stale_one_is_cleared",
            a_second_broker_at_a_served_socket_refuses_and_a_stale_one_is_cleared,
        ),
        (
            "the_token_file_lends_a_byte_a_token_and_takes_back_no_more",
            the_token_file_lends_a_byte_a_token_and_takes_back_no_more,
        ),
        (
            "readers_and_pollers_of_the_file_wait_in_turn_with_the_socket",
            readers_and_pollers_of_the_file_wait_in_turn_with_the_socket,
        ),
        (
            "a_process_killed_holding_the_files_tokens_gives_them_back",
            a_process_killed_holding_the_files_tokens_gives_them_back,
        ),
        (
            "a_successor_takes_the_token_files_and_what_their_readers_hold",
            a_successor_takes_the_token_files_and_what_their_readers_hold,
        ),
        (
            "the_mount_of_a_killed_broker_is_served_by_the_next_or_cleared",
            the_mount_of_a_killed_broker_is_served_by_the_next_or_cleared,
        ),
        (
            "the_memory_gate_follows_what_its_cgroup_uses",
            the_memory_gate_follows_what_its_cgroup_uses,
        ),
        (
            "a_growing_job_is_paused_while_memory_is_short_and_resumed_after",
            a_growing_job_is_paused_while_memory_is_short_and_resumed_after,
        ),
        (
            "the_load_and_pressure_gates_read_the_machine",
            the_load_and_pressure_gates_read_the_machine,
        ),
        (
            "the_log_says_as_much_as_its_level_asks",
            the_log_says_as_much_as_its_level_asks,
        ),
        (
            "admitting_others_opens_the_socket_to_them_and_says_where_they_cannot_reach_it",
            admitting_others_opens_the_socket_to_them_and_says_where_they_cannot_reach_it,
        ),
        (
            "a_successor_of_a_broker_without_token_files_mounts_none",
            a_successor_of_a_broker_without_token_files_mounts_none,
        ),
        (
            "a_broker_started_by_socket_activation_serves_the_socket_it_is_given",
            a_broker_started_by_socket_activation_serves_the_socket_it_is_given,
        ),
        (
            "an_orphaned_builds_token_comes_back_when_its_last_job_ends",
            an_orphaned_builds_token_comes_back_when_its_last_job_ends,
        ),
        (
            "a_paused_job_goes_on_when_the_memory_gate_is_turned_off",
            a_paused_job_goes_on_when_the_memory_gate_is_turned_off,
        ),
        (
            "a_paused_job_goes_on_when_the_broker_stops",
            a_paused_job_goes_on_when_the_broker_stops,
        ),
        (
            "an_open_file_limit_that_fits_the_clients_asked_is_not_warned_of",
            an_open_file_limit_that_fits_the_clients_asked_is_not_warned_of,
        ),
        (
            "a_poll_of_a_file_marked_hold_waits_in_the_broker_and_others_in_poll",
            a_poll_of_a_file_marked_hold_waits_in_the_broker_and_others_in_poll,
        ),
        (
            "a_sleeping_poller_is_woken_by_a_freed_token_before_and_after_a_handover",
            a_sleeping_poller_is_woken_by_a_freed_token_before_and_after_a_handover,
        ),
        (
            "a_reservation_nobody_reads_passes_to_the_next_waiter",
            a_reservation_nobody_reads_passes_to_the_next_waiter,
        ),
        (
            "a_poller_holding_the_whole_pool_is_woken_by_its_own_give_back",
            a_poller_holding_the_whole_pool_is_woken_by_its_own_give_back,
        ),
        (
            "a_poll_is_answered_the_events_asked_that_hold_and_no_others",
            a_poll_is_answered_the_events_asked_that_hold_and_no_others,
        ),
        (
            "an_existing_file_is_found_by_name_and_truncating_it_succeeds",
            an_existing_file_is_found_by_name_and_truncating_it_succeeds,
        ),
        (
            "the_polls_attribute_goes_back_to_notify_and_is_sized_as_getxattr_asks",
            the_polls_attribute_goes_back_to_notify_and_is_sized_as_getxattr_asks,
        ),
        (
            "closing_a_handle_takes_its_waiting_poll_out_of_the_queue",
            closing_a_handle_takes_its_waiting_poll_out_of_the_queue,
        ),
        (
            "a_reader_left_blocked_by_a_killed_broker_ends_when_killed",
            a_reader_left_blocked_by_a_killed_broker_ends_when_killed,
        ),
        (
            "the_mount_is_batons_runs_nothing_and_a_fresh_one_clears_nothing",
            the_mount_is_batons_runs_nothing_and_a_fresh_one_clears_nothing,
        ),
        (
            "a_broker_that_hands_over_or_stops_leaves_no_keeper_behind",
            a_broker_that_hands_over_or_stops_leaves_no_keeper_behind,
        ),
        (
            "the_log_names_each_process_reclaimed_from_and_no_other",
            the_log_names_each_process_reclaimed_from_and_no_other,
        ),
        (
            "the_log_names_each_connection_closed_holding_tokens_and_no_other",
            the_log_names_each_connection_closed_holding_tokens_and_no_other,
        ),
    ];
    std::process::exit(harness::run(tests));
}

/// A connection speaking the protocol line by line.
struct Peer {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Peer {
    /// Connected, with `HELLO 1 LABEL` said and answered.
    fn hello(socket: &Path, label: &str) -> Peer {
        Peer::of(hello_as(socket, label))
    }

    fn of(stream: UnixStream) -> Peer {
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        let reader = BufReader::new(stream.try_clone().unwrap());
        Peer { stream, reader }
    }

    fn send(&mut self, line: &str) {
        self.stream
            .write_all(format!("{line}\n").as_bytes())
            .unwrap();
    }

    /// The next line, without its newline; empty at end of file.
    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("a reply in time");
        line.trim_end_matches('\n').to_string()
    }

    fn ask(&mut self, line: &str) -> String {
        self.send(line);
        self.line()
    }

    /// A STATUS reply's JSON, read whole.
    fn status(&mut self) -> serde_json::Value {
        self.send("STATUS");
        self.read_status()
    }

    fn read_status(&mut self) -> serde_json::Value {
        let head = self.line();
        let len: usize = head
            .strip_prefix("STATUS ")
            .unwrap_or_else(|| panic!("a STATUS reply, not {head:?}"))
            .parse()
            .unwrap();
        let mut body = vec![0; len + 1];
        self.reader.read_exact(&mut body).unwrap();
        assert_eq!(body.pop(), Some(b'\n'), "the document ends its line");
        serde_json::from_slice(&body).unwrap()
    }
}

/// The labels of the holders (with their tokens) and of the waiters, in
/// the broker's order.
fn holders_and_waiters(status: &serde_json::Value) -> (Vec<(String, u64)>, Vec<String>) {
    let label = |c: &serde_json::Value| c["command"].as_str().unwrap().to_string();
    let holders = status["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| (label(h), h["tokens"].as_u64().unwrap()))
        .collect();
    let waiters = status["waiters"]
        .as_array()
        .unwrap()
        .iter()
        .map(label)
        .collect();
    (holders, waiters)
}

fn broker_status(broker: &RunningBroker) -> serde_json::Value {
    Peer::hello(&broker.socket, "status").status()
}

fn wait_for_waiters(broker: &RunningBroker, n: usize) {
    wait_for(PATIENCE, &format!("{n} waiters"), || {
        broker_status(broker)["waiters"].as_array().unwrap().len() == n
    });
}

/// Every reply a connection gets to `requests` (after its HELLO) until the
/// broker closes it, with the requests written by `write`.
fn replies(socket: &Path, requests: &[&str], write: impl Fn(&mut UnixStream, &str)) -> Vec<String> {
    let mut peer = Peer::hello(socket, "split");
    let all: String = requests.iter().map(|r| format!("{r}\n")).collect();
    write(&mut peer.stream, &all);
    let mut got = Vec::new();
    loop {
        let line = peer.line();
        if line.is_empty() {
            return got;
        }
        got.push(line);
    }
}

fn requests_split_anywhere_or_sent_at_once_get_the_same_replies() {
    let broker = served(2, "");
    // The documented session's requests (docs/protocol.md), ending with a
    // malformed one, after which the broker closes the connection.
    let requests = [
        "TRY 1",
        "TRY 1",
        "TRY 1",
        "RELEASE 3",
        "RELEASE 2",
        "CANCEL",
        "FROB",
    ];
    let at_once = replies(&broker.socket, &requests, |s, all| {
        s.write_all(all.as_bytes()).unwrap()
    });
    assert_eq!(
        at_once,
        [
            "GRANTED 1 1",
            "GRANTED 1 2",
            "BUSY 0",
            "ERR over-release cannot give back 3 tokens: only 2 held",
            "RELEASED 2 0",
            "CANCELLED 0",
            "ERR malformed unknown request \"FROB\"",
        ]
    );
    broker.wait_all_free();
    let byte_by_byte = replies(&broker.socket, &requests, |s, all| {
        for b in all.as_bytes() {
            s.write_all(&[*b]).unwrap();
        }
    });
    assert_eq!(byte_by_byte, at_once);
    broker.wait_all_free();
    // Split across a line's end and inside a word, in three writes.
    let in_thirds = replies(&broker.socket, &requests, |s, all| {
        let third = all.len() / 3;
        for part in [&all[..third], &all[third..2 * third], &all[2 * third..]] {
            s.write_all(part.as_bytes()).unwrap();
            std::thread::yield_now();
        }
    });
    assert_eq!(in_thirds, at_once);
    broker.wait_all_free();
}

fn a_freed_token_goes_to_the_oldest_waiter_and_a_hang_up_frees_what_it_held() {
    oldest_waiter_first(served(1, ""));
}

fn the_same_with_replies_sent_by_io_uring() {
    // Where the kernel refuses io_uring, the broker falls back to plain
    // writes, and this repeats the test above.
    oldest_waiter_first(served(1, "io_uring=1"));
}

fn replies_before_a_waiting_acquire_leave_with_its_grant() {
    replies_wait_with_the_grant(served(1, ""));
}

fn the_same_with_replies_sent_by_io_uring_as_the_loop_sleeps() {
    replies_wait_with_the_grant(served(1, "io_uring=1"));
}

/// docs/protocol.md: a client that pipelines RELEASE and ACQUIRE is woken
/// once per token. The RELEASE's reply waits for the ACQUIRE's GRANTED
/// and both leave in one write, in order.
fn replies_wait_with_the_grant(broker: RunningBroker) {
    let mut a = Peer::hello(&broker.socket, "a");
    assert_eq!(a.ask("TRY 1"), "GRANTED 1 1");
    let mut b = Peer::hello(&broker.socket, "b");
    b.send("ACQUIRE 1");
    wait_for_waiters(&broker, 1);
    a.send("RELEASE 1\nACQUIRE 1");
    // b's grant says a's RELEASE was served; a then waits in turn.
    assert_eq!(b.line(), "GRANTED 1 1");
    wait_for_waiters(&broker, 1);
    a.stream.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let early = std::io::Read::read(&mut a.stream, &mut byte);
    assert!(
        matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the RELEASE's reply left before the ACQUIRE was granted: {early:?}"
    );
    a.stream.set_nonblocking(false).unwrap();
    assert_eq!(b.ask("RELEASE 1"), "RELEASED 1 0");
    assert_eq!(a.line(), "RELEASED 1 0");
    assert_eq!(a.line(), "GRANTED 1 1");
    assert_eq!(a.ask("RELEASE 1"), "RELEASED 1 0");
    broker.assert_all_free();
}

/// A closing connection's reply is written at once and the connection
/// closed, not left for the loop's batched send (which never closes).
fn a_fatal_error_is_answered_then_closed_with_replies_sent_by_io_uring() {
    let broker = served(1, "io_uring=1");
    let mut a = Peer::hello(&broker.socket, "a");
    assert_eq!(a.ask("TRY 1"), "GRANTED 1 1");
    let refused = a.ask("JUGGLE 3");
    assert!(refused.starts_with("ERR "), "{refused}");
    assert_eq!(a.line(), "", "the connection closes after its ERR");
    wait_for(PATIENCE, "the closed client's token back", || {
        broker_status(&broker)["holders"]
            .as_array()
            .unwrap()
            .is_empty()
    });
    broker.assert_all_free();
}

fn oldest_waiter_first(broker: RunningBroker) {
    let mut a = Peer::hello(&broker.socket, "a");
    assert_eq!(a.ask("TRY 1"), "GRANTED 1 1");
    let mut b = Peer::hello(&broker.socket, "b");
    b.send("ACQUIRE 1");
    wait_for_waiters(&broker, 1);
    let mut c = Peer::hello(&broker.socket, "c");
    c.send("ACQUIRE 1");
    wait_for_waiters(&broker, 2);
    assert_eq!(a.ask("RELEASE 1"), "RELEASED 1 0");
    assert_eq!(b.line(), "GRANTED 1 1");
    let status = broker_status(&broker);
    assert_eq!(
        holders_and_waiters(&status),
        (vec![("b".to_string(), 1)], vec!["c".to_string()]),
        "the oldest waiter alone is served"
    );
    // b hangs up holding its token: it goes to c.
    drop(b);
    assert_eq!(c.line(), "GRANTED 1 1");
    let status = broker_status(&broker);
    assert_eq!(
        holders_and_waiters(&status),
        (vec![("c".to_string(), 1)], vec![])
    );
    assert_eq!(status["totals"]["reclaimed"], 1);
    assert_eq!(c.ask("RELEASE 1"), "RELEASED 1 0");
    broker.assert_all_free();
}

fn a_full_broker_says_so_and_serves_the_rest() {
    let broker = served(2, "max_clients=2");
    let mut first = Peer::hello(&broker.socket, "first");
    let second = Peer::hello(&broker.socket, "second");
    let mut third = Peer::of(UnixStream::connect(&broker.socket).unwrap());
    let refusal = third.line();
    assert!(refusal.starts_with("ERR full "), "{refusal:?}");
    assert_eq!(third.line(), "", "the broker closes a refused connection");
    assert_eq!(first.ask("TRY 1"), "GRANTED 1 1", "the others are served");
    // A place that frees is taken by the next to come.
    drop(second);
    wait_for(PATIENCE, "a place for a newcomer", || {
        let mut peer = Peer::of(UnixStream::connect(&broker.socket).unwrap());
        peer.send("HELLO 1 newcomer");
        peer.line().starts_with("OK 1 ")
    });
    assert_eq!(first.ask("RELEASE 1"), "RELEASED 1 0");
}

fn a_low_open_file_limit_caps_the_clients_and_is_logged() {
    let dir = TempDir::new("served-nofile");
    let socket = dir.path().join("run").join("socket");
    let mut command = serve_command(&socket, "jobs=2\nmax_clients=1000");
    // SAFETY: setrlimit is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 80,
                rlim_max: 80,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let broker = RunningBroker::start_command(command, dir, socket);
    // 80 descriptors, 64 kept beside the clients: 16 clients.
    assert!(
        broker.log().contains(
            "the open-file limit (80) lets the broker serve 16 clients, not --max-clients 1000"
        ),
        "{}",
        broker.log()
    );
    let peers: Vec<Peer> = (0..16)
        .map(|i| Peer::hello(&broker.socket, &format!("c{i}")))
        .collect();
    let mut over = Peer::of(UnixStream::connect(&broker.socket).unwrap());
    assert!(over.line().starts_with("ERR full "));
    drop(peers);
}

fn statuses_larger_than_the_socket_buffer_reach_a_late_reader_whole() {
    let broker = served(1, "");
    let mut holder = Peer::hello(&broker.socket, "holder");
    assert_eq!(holder.ask("TRY 1"), "GRANTED 1 1");
    // 300 waiters with labels of 200 bytes: some 100 kB of status each.
    let label = |i: usize| format!("w{i:03}{}", "x".repeat(196));
    let mut waiters = Vec::new();
    for i in 0..300 {
        let mut w = Peer::hello(&broker.socket, &label(i));
        w.send("ACQUIRE 1");
        waiters.push(w);
    }
    wait_for_waiters(&broker, 300);
    // Four of them asked for before a byte is read: more than a Unix
    // socket's buffer holds, so most goes out as the reader drains it.
    let mut reader = Peer::hello(&broker.socket, "reader");
    for _ in 0..4 {
        reader.send("STATUS");
    }
    for _ in 0..4 {
        let (_, order) = holders_and_waiters(&reader.read_status());
        assert_eq!(order, (0..300).map(label).collect::<Vec<_>>());
    }
    // And everyone is still served, in order.
    assert_eq!(holder.ask("RELEASE 1"), "RELEASED 1 0");
    assert_eq!(waiters[0].line(), "GRANTED 1 1");
}

fn a_client_that_never_reads_does_not_hold_up_the_others() {
    let broker = served(1, "");
    let mut silent = Peer::hello(&broker.socket, "silent");
    silent.stream.set_nonblocking(true).unwrap();
    // STATUS after STATUS, never reading: the broker stops reading from it
    // once its replies pile up, and the socket fills.
    let request = b"STATUS\n".repeat(1000);
    let mut written = 0;
    let mut full = false;
    for _ in 0..200 {
        match silent.stream.write(&request) {
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                full = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(full, "wrote {written} bytes and the broker read them all");
    let mut other = Peer::hello(&broker.socket, "other");
    for _ in 0..20 {
        assert_eq!(other.ask("TRY 1"), "GRANTED 1 1");
        assert_eq!(other.ask("RELEASE 1"), "RELEASED 1 0");
    }
    drop(silent);
    wait_for(PATIENCE, "the silent client gone", || {
        broker_status(&broker)["totals"]["clients"] == 2
    });
    broker.assert_all_free();
}

fn stop_ends_the_broker_says_who_asked_and_leaves_no_socket() {
    let mut broker = served(3, "");
    let mut holder = Peer::hello(&broker.socket, "holder");
    assert_eq!(holder.ask("TRY 2"), "GRANTED 2 2");
    let mut stopper = Peer::hello(&broker.socket, "stopper");
    let pid = broker.pid();
    assert_eq!(stopper.ask("STOP"), format!("STOPPING {pid} 1 2"));
    assert_eq!(stopper.line(), "", "the broker closes the connection");
    let status = broker.wait_exit(PATIENCE);
    assert!(status.success(), "{status:?}");
    assert_eq!(holder.line(), "", "every connection closes");
    let log = broker.log();
    assert!(
        log.contains(&format!(
            "stopping on a STOP request (pid {}, baton stop): 2 of 3 tokens held by 1 client(s)",
            std::process::id()
        )),
        "{log}"
    );
    let left: Vec<_> = std::fs::read_dir(broker.socket.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

fn sigterm_and_sigint_each_stop_the_broker_by_name() {
    for (signal, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let mut broker = served(1, "");
        let mut peer = Peer::hello(&broker.socket, "peer");
        assert_eq!(peer.ask("TRY 1"), "GRANTED 1 1");
        let (status, log) = broker.stop_with(signal);
        assert!(status.success(), "{name}: {status:?}\n{log}");
        assert!(
            log.contains(&format!(
                "stopping on {name}: 1 of 1 tokens held by 1 client(s)"
            )),
            "{name}: {log}"
        );
        assert!(!broker.socket.exists(), "{name}: the socket is left");
    }
}

fn a_successor_takes_the_connections_their_tokens_and_their_wait() {
    let mut old = served(2, "");
    let mut x = Peer::hello(&old.socket, "x");
    assert_eq!(x.ask("TRY 2"), "GRANTED 2 2");
    let mut y = Peer::hello(&old.socket, "y");
    y.send("ACQUIRE 1");
    wait_for_waiters(&old, 1);
    // Half a line read before the handover is finished after it.
    x.stream.write_all(b"RELE").unwrap();
    let new = served_at(&old.socket, "jobs=9\nreplace=1");
    assert!(old.wait_exit(PATIENCE).success(), "{}", old.log());
    assert!(old.log().contains("handed over to a successor: exiting"));
    assert_eq!(x.ask("ASE 1"), "RELEASED 1 1");
    assert_eq!(y.line(), "GRANTED 1 1");
    let status = broker_status(&new);
    assert_eq!(status["broker_pid"], new.pid());
    assert_eq!(status["limit"], 2, "the limit travels, not --jobs");
    assert_eq!(
        holders_and_waiters(&status),
        (vec![("x".to_string(), 1), ("y".to_string(), 1)], vec![])
    );
    assert_eq!(x.ask("RELEASE 1"), "RELEASED 1 0");
    assert_eq!(y.ask("RELEASE 1"), "RELEASED 1 0");
    new.assert_all_free();
    assert!(
        new.log().contains("took over: serving 2 tokens"),
        "{}",
        new.log()
    );
}

fn an_idle_broker_stops_by_itself() {
    let mut broker = served(1, "idle_ms=300");
    let mut peer = Peer::hello(&broker.socket, "peer");
    assert_eq!(peer.ask("TRY 1"), "GRANTED 1 1");
    drop(peer);
    let status = broker.wait_exit(PATIENCE);
    assert!(status.success(), "{status:?}");
    let log = broker.log();
    assert!(log.contains("no clients for 0 s: stopping"), "{log}");
    assert!(log.contains("stopping on SIGTERM"), "{log}");
    assert!(!broker.socket.exists());
}

fn the_metrics_endpoint_serves_the_pool() {
    let broker = served(3, "metrics=127.0.0.1:0");
    let mut holder = Peer::hello(&broker.socket, "holder");
    assert_eq!(holder.ask("TRY 2"), "GRANTED 2 2");
    let log = broker.log();
    let address = log
        .split("metrics at http://")
        .nth(1)
        .and_then(|rest| rest.split("/metrics").next())
        .unwrap_or_else(|| panic!("no metrics address logged: {log}"));
    let mut http = std::net::TcpStream::connect(address).unwrap();
    http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = String::new();
    http.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    assert!(answer.contains("\nbaton_limit 3.0\n"), "{answer}");
    assert!(answer.contains("\nbaton_free 1.0\n"), "{answer}");
}

/// A scrape is no client: nothing else brings the books to now, so the
/// endpoint must. A build holding 2 tokens since before `held` shows at
/// least 2 token-seconds per second since then, though the broker saw no
/// request after the grant.
fn a_scrape_counts_a_builds_token_seconds_up_to_itself() {
    let broker = served(3, "metrics=127.0.0.1:0");
    let mut holder = Peer::hello(&broker.socket, "holder");
    assert_eq!(holder.ask("TRY 2"), "GRANTED 2 2");
    let held = std::time::Instant::now();
    let log = broker.log();
    let address = log
        .split("metrics at http://")
        .nth(1)
        .and_then(|rest| rest.split("/metrics").next())
        .unwrap_or_else(|| panic!("no metrics address logged: {log}"));
    let since = held.elapsed().as_secs_f64();
    let mut http = std::net::TcpStream::connect(address).unwrap();
    http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = String::new();
    http.read_to_string(&mut answer).unwrap();
    let token_seconds: f64 = answer
        .lines()
        .find(|l| l.starts_with("baton_build_token_seconds_total{build=\"holder\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no token-seconds of the holder's build: {answer}"));
    assert!(
        token_seconds > 0.0 && token_seconds >= 2.0 * since,
        "2 tokens held for more than {since} s, yet {token_seconds} token-seconds scraped: {answer}"
    );
}

fn a_second_broker_at_a_served_socket_refuses_and_a_stale_one_is_cleared() {
    let died_here = "without cleaning up: for 200 ms nothing new is granted";
    let broker = served(1, "reclaim_ms=200");
    assert!(
        !broker.log().contains(died_here),
        "a fresh path: {}",
        broker.log()
    );
    let second = serve_command(&broker.socket, "jobs=1").output().unwrap();
    assert_eq!(second.status.code(), Some(1));
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(said.contains("a broker is already running at"), "{said}");
    drop(broker);
    // A socket nobody listens on (its broker died) is cleared, and the
    // new broker grants nothing new while that broker's builds may come
    // back (the reclaim grace), and says so.
    let dir = TempDir::new("served-stale");
    let socket = dir.path().join("run").join("socket");
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    std::fs::set_permissions(
        socket.parent().unwrap(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists(), "a stale socket to clear");
    let broker = RunningBroker::start_command(
        serve_command(&socket, "jobs=1\nreclaim_ms=200"),
        dir,
        socket,
    );
    assert!(broker.log().contains(died_here), "{}", broker.log());
    let mut after = Peer::hello(&broker.socket, "after");
    assert_eq!(
        after.ask("ACQUIRE 1"),
        "GRANTED 1 1",
        "once the grace is over"
    );
}

/// A broker of `jobs` tokens with its FUSE token files, or None (the test
/// recorded as skipped) where this machine cannot mount them.
fn served_with_files(jobs: u32) -> Option<(RunningBroker, PathBuf)> {
    if !fuse_should_mount() {
        skip(
            Missing::Fuse,
            "no /dev/fuse, or neither root nor fusermount3",
        );
        return None;
    }
    let broker = served(jobs, "fuse=1");
    let mount = broker.socket.with_file_name("fuse");
    // One that could mount and did not fails: a skip would hide it.
    assert!(
        broker.log().contains("FUSE token files at"),
        "the broker did not mount: {}",
        broker.log()
    );
    Some((broker, mount))
}

/// One holder's transport and tokens, by its place in STATUS.
fn holders_by_transport(status: &serde_json::Value) -> Vec<(String, u64)> {
    status["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["transport"].as_str().unwrap().to_string(),
                h["tokens"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn open_rw(path: &Path, nonblocking: bool) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(if nonblocking { libc::O_NONBLOCK } else { 0 })
        .open(path)
        .unwrap()
}

fn xattr(path: &Path) -> std::io::Result<String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: both strings end in NUL and the buffer is as long as said.
    let n = unsafe {
        libc::getxattr(
            c_path.as_ptr(),
            c"user.baton.polls".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(String::from_utf8_lossy(&buf[..n as usize]).into_owned())
}

fn set_xattr(path: &Path, value: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: both strings end in NUL; the value is as long as said.
    let r = unsafe {
        libc::setxattr(
            c_path.as_ptr(),
            c"user.baton.polls".as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn names_in(mount: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(mount)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn the_token_file_lends_a_byte_a_token_and_takes_back_no_more() {
    let Some((broker, mount)) = served_with_files(2) else {
        return;
    };
    assert_eq!(names_in(&mount), Vec::<String>::new());
    let file = mount.join("mine");
    std::fs::File::create(&file).unwrap();
    std::fs::File::create(mount.join("other")).unwrap();
    assert_eq!(names_in(&mount), ["mine", "other"]);
    let meta = std::fs::metadata(&file).unwrap();
    assert!(meta.is_file(), "{meta:?}");
    assert!(std::fs::metadata(mount.join("absent")).is_err());
    // Polls are answered, not held, until the file says otherwise.
    assert_eq!(xattr(&file).unwrap(), "notify");
    set_xattr(&file, "hold").unwrap();
    assert_eq!(xattr(&file).unwrap(), "hold");
    assert!(
        set_xattr(&file, "sometimes").is_err(),
        "only hold or notify"
    );
    assert_eq!(xattr(&file).unwrap(), "hold");

    let mut handle = open_rw(&file, true);
    let mut byte = [0u8; 1];
    assert_eq!(handle.read(&mut byte).unwrap(), 1);
    assert_eq!(&byte, b"+");
    assert_eq!(
        holders_by_transport(&broker_status(&broker)),
        [("fuse".to_string(), 1)]
    );
    // The socket takes the other token: the file has none left to lend.
    let mut peer = Peer::hello(&broker.socket, "peer");
    assert_eq!(peer.ask("TRY 1"), "GRANTED 1 1");
    let again = handle.read(&mut byte).unwrap_err();
    assert_eq!(again.kind(), std::io::ErrorKind::WouldBlock, "{again}");
    // Two back from a process that took one: refused, nothing changes.
    let over = handle.write(b"++").unwrap_err();
    assert_eq!(over.raw_os_error(), Some(libc::ENOSPC), "{over}");
    assert_eq!(broker_status(&broker)["free"], 0);
    assert_eq!(handle.write(b"+").unwrap(), 1);
    assert_eq!(peer.ask("RELEASE 1"), "RELEASED 1 0");
    broker.assert_all_free();
    std::fs::remove_file(&file).unwrap();
    assert_eq!(names_in(&mount), ["other"]);
}

fn readers_and_pollers_of_the_file_wait_in_turn_with_the_socket() {
    let Some((broker, mount)) = served_with_files(1) else {
        return;
    };
    let file = mount.join("queue");
    std::fs::File::create(&file).unwrap();
    let mut peer = Peer::hello(&broker.socket, "peer");
    assert_eq!(peer.ask("TRY 1"), "GRANTED 1 1");
    // A blocking read waits in the broker's one queue.
    let reader = {
        let file = file.clone();
        std::thread::spawn(move || {
            let mut handle = open_rw(&file, false);
            let mut byte = [0u8; 1];
            handle.read_exact(&mut byte).unwrap();
            (handle, byte)
        })
    };
    wait_for_waiters(&broker, 1);
    assert_eq!(
        broker_status(&broker)["waiters"][0]["transport"],
        "fuse",
        "the reader waits as the file's"
    );
    assert_eq!(peer.ask("RELEASE 1"), "RELEASED 1 0");
    let (mut handle, byte) = reader.join().unwrap();
    assert_eq!(&byte, b"+");
    // A socket client now waits behind the file's holder...
    peer.send("ACQUIRE 1");
    wait_for_waiters(&broker, 1);
    // ...and a poller behind it: the token the file gives back goes to
    // the socket's waiter, the oldest, and the next to the poller.
    let poller = open_rw(&file, true);
    let mut fds = [libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&poller),
        events: libc::POLLIN,
        revents: 0,
    }];
    // SAFETY: one pollfd, as said.
    assert_eq!(
        unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) },
        0,
        "no token yet"
    );
    assert_eq!(handle.write(b"+").unwrap(), 1);
    assert_eq!(peer.line(), "GRANTED 1 1");
    assert_eq!(peer.ask("RELEASE 1"), "RELEASED 1 0");
    // SAFETY: as above; the hang guard is PATIENCE.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), 1, PATIENCE.as_millis() as i32) };
    assert_eq!(ready, 1, "the poller is told of the token");
    assert_ne!(fds[0].revents & libc::POLLIN, 0);
    let mut byte = [0u8; 1];
    assert_eq!((&poller).read(&mut byte).unwrap(), 1, "and takes it");
    assert_eq!((&poller).write(b"+").unwrap(), 1);
    broker.assert_all_free();
}

fn a_process_killed_holding_the_files_tokens_gives_them_back() {
    let Some((broker, mount)) = served_with_files(3) else {
        return;
    };
    let file = mount.join("victim");
    std::fs::File::create(&file).unwrap();
    // Takes two tokens through the file, says so, and sleeps holding them:
    // bash's `read` reads in the shell's own process, and `exec` keeps its
    // pid (the tokens are the process's).
    let mut child = Command::new("bash")
        .arg("-c")
        .arg("exec 3<>\"$0\"; read -r -N 2 taken <&3; printf %s \"$taken\"; exec sleep 60")
        .arg(&file)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut taken = [0u8; 2];
    child.stdout.take().unwrap().read_exact(&mut taken).unwrap();
    assert_eq!(&taken, b"++");
    assert_eq!(broker_status(&broker)["held"], 2);
    child.kill().unwrap();
    child.wait().unwrap();
    wait_for(PATIENCE, "the killed process's tokens back", || {
        broker_status(&broker)["free"] == 3
    });
    let status = broker_status(&broker);
    assert_eq!(status["totals"]["reclaimed"], 2);
    assert_eq!(status["holders"].as_array().unwrap().len(), 0);
}

fn a_broker_started_by_socket_activation_serves_the_socket_it_is_given() {
    let Some(activate) = [
        "/usr/bin/systemd-socket-activate",
        "/bin/systemd-socket-activate",
    ]
    .into_iter()
    .map(Path::new)
    .find(|p| p.exists()) else {
        return skip(Missing::Systemd, "no systemd-socket-activate");
    };
    let dir = TempDir::new("served-activated");
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::set_permissions(&run, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let socket = run.join("socket");
    // systemd-socket-activate binds the socket, and on the first
    // connection starts this binary in the serve role with it as
    // descriptor 3. No socket in the role's options: the one passed is
    // the one served (and a broker that ignored it would bind under this
    // test's own XDG_RUNTIME_DIR, not the user's).
    let mut command = Command::new(activate);
    harness::dies_with_its_test(&mut command);
    command
        .arg("--listen")
        .arg(&socket)
        .arg("--setenv=BATON_TEST_ROLE=serve")
        .arg("--setenv=BATON_TEST_SPEC=jobs=3")
        .arg(format!("--setenv=XDG_RUNTIME_DIR={}", dir.path().display()))
        .arg(std::env::current_exe().unwrap());
    let mut broker = RunningBroker::start_command(command, dir, socket.clone());
    let mut peer = Peer::hello(&socket, "first");
    assert_eq!(peer.ask("TRY 3"), "GRANTED 3 3");
    let status = peer.status();
    assert_eq!(
        status["broker_pid"],
        broker.pid(),
        "the activator became the broker"
    );
    assert_eq!(status["limit"], 3);
    let log = broker.log();
    assert!(
        log.contains(&format!("serving 3 tokens at {}", socket.display())),
        "{log}"
    );
    assert!(
        !broker.dir.path().join("baton").exists(),
        "the broker bound a socket of its own"
    );
    drop(peer);
    let (status, log) = broker.stop_with(libc::SIGTERM);
    assert!(status.success(), "{status:?}\n{log}");
    assert!(
        socket.exists(),
        "the socket is systemd's to remove, not ours"
    );
}

/// How many mounts this process sees at `path`.
fn mounts_at(path: &Path) -> usize {
    let path = path.to_str().unwrap();
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .filter(|line| line.split(' ').nth(1) == Some(path))
        .count()
}

fn a_successor_takes_the_token_files_and_what_their_readers_hold() {
    let Some((mut old, mount)) = served_with_files(2) else {
        return;
    };
    let file = mount.join("kept");
    std::fs::File::create(&file).unwrap();
    let mut handle = open_rw(&file, true);
    let mut byte = [0u8; 1];
    assert_eq!(handle.read(&mut byte).unwrap(), 1);
    let mut new = served_at(&old.socket, "jobs=2\nreplace=1\nfuse=1");
    assert!(old.wait_exit(PATIENCE).success(), "{}", old.log());
    // The old one exits once it has handed over; the new one says so as it
    // adopts the mount, a moment later.
    wait_for(PATIENCE, "the successor to take the files", || {
        new.log().contains("FUSE token files at") && new.log().contains("taken over")
    });
    assert_eq!(mounts_at(&mount), 1, "the same mount, not a second");
    let status = broker_status(&new);
    assert_eq!(status["broker_pid"], new.pid());
    assert_eq!(holders_by_transport(&status), [("fuse".to_string(), 1)]);
    // The reader gives its token back to the successor, on the same handle.
    assert_eq!(handle.write(b"+").unwrap(), 1);
    new.assert_all_free();
    drop(handle);
    let (status, log) = new.stop_with(libc::SIGTERM);
    assert!(status.success(), "{log}");
    assert_eq!(mounts_at(&mount), 0, "a clean stop unmounts");
}

fn the_mount_of_a_killed_broker_is_served_by_the_next_or_cleared() {
    let Some((mut first, mount)) = served_with_files(2) else {
        return;
    };
    std::fs::File::create(mount.join("before")).unwrap();
    // SAFETY: kill(2) has no memory effects.
    unsafe { libc::kill(first.pid() as i32, libc::SIGKILL) };
    first.wait_exit(PATIENCE);
    // Within its grace the mount's keeper hands it to the next broker
    // (this one's own keeper waits for nobody: a grace of 1 ms).
    let mut second = served_at(&first.socket, "jobs=2\nfuse=1\norphan_ms=1");
    assert!(
        second
            .log()
            .contains("serving the mount a killed broker left"),
        "{}",
        second.log()
    );
    assert_eq!(mounts_at(&mount), 1);
    let file = mount.join("after");
    std::fs::File::create(&file).unwrap();
    let mut byte = [0u8; 1];
    let mut handle = open_rw(&file, true);
    assert_eq!(handle.read(&mut byte).unwrap(), 1);
    assert_eq!(handle.write(b"+").unwrap(), 1);
    second.assert_all_free();
    // Killed in turn: its keeper lets the mount go at once, dead
    // (ENOTCONN); the next broker clears it and mounts afresh.
    // SAFETY: as above.
    unsafe { libc::kill(second.pid() as i32, libc::SIGKILL) };
    second.wait_exit(PATIENCE);
    wait_for(PATIENCE, "the mount let go", || {
        std::fs::metadata(&mount).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN))
    });
    let third = served_at(&first.socket, "jobs=2\nfuse=1");
    assert!(
        third.log().contains("unmounting a stale FUSE mount"),
        "{}",
        third.log()
    );
    assert_eq!(mounts_at(&mount), 1, "{}", third.log());
    let file = mount.join("afresh");
    std::fs::File::create(&file).unwrap();
    let mut handle = open_rw(&file, true);
    assert_eq!(handle.read(&mut byte).unwrap(), 1);
    assert_eq!(handle.write(b"+").unwrap(), 1);
    third.assert_all_free();
    assert_eq!(open_rw(&file, true).read(&mut byte).unwrap(), 1);
}

const MIB: u64 = 1 << 20;

/// A broker of 4 tokens with `spec`, served in a memory cgroup of 512 MiB
/// of its own; None (the skip recorded) where none can be made.
fn served_in_a_memory_cgroup(
    name: &str,
    spec: &str,
) -> Option<(baton_bench::cgroup::MemCgroup, RunningBroker)> {
    use baton_bench::cgroup::{MemCgroup, Unusable};
    let cgroup = match MemCgroup::new(&format!("served-{name}"), 512 * MIB) {
        Ok(cgroup) => cgroup,
        Err(why) => {
            let missing = match why.downcast_ref::<Unusable>() {
                Some(Unusable::NotRoot) => Missing::Root,
                _ => Missing::Cgroup,
            };
            skip(missing, &format!("{why:#}"));
            return None;
        }
    };
    let dir = TempDir::new("served-cgroup");
    let socket = dir.path().join("run").join("socket");
    let mut command = cgroup.command();
    harness::dies_with_its_test(&mut command);
    command
        .arg(std::env::current_exe().unwrap())
        .env("BATON_TEST_ROLE", "serve")
        .env(
            "BATON_TEST_SPEC",
            format!("socket={}\njobs=4\n{spec}", socket.display()),
        );
    let broker = RunningBroker::start_command(command, dir, socket);
    Some((cgroup, broker))
}

/// The `mem-available` gate's state and value, from STATUS.
fn memory_gate(broker: &RunningBroker) -> (bool, u64) {
    let status = broker_status(broker);
    let gate = status["gates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "mem-available")
        .cloned()
        .unwrap_or_else(|| panic!("no memory gate: {status}"));
    (
        gate["open"].as_bool().unwrap(),
        gate["value"].as_f64().unwrap() as u64,
    )
}

/// The broker in a memory cgroup of 512 MiB, with the gate at 256 MiB
/// free: its thread measures the cgroup while it serves, and the gate
/// closes while a process in the cgroup takes 350 MiB, and opens again
/// when it is gone.
fn the_memory_gate_follows_what_its_cgroup_uses() {
    let Some((cgroup, broker)) =
        served_in_a_memory_cgroup("gate", &format!("min_mem={}", 256 * MIB))
    else {
        return;
    };
    let (open, value) = memory_gate(&broker);
    assert!(open, "{value} bytes free of 512 MiB");
    assert!(value <= 512 * MIB && value > 256 * MIB, "{value}");
    let mut hog = cgroup.command();
    hog.args([
        "python3",
        "-c",
        "import sys, time\nb = bytearray(350 << 20)\nb[::4096] = b'x' * len(range(0, len(b), 4096))\nprint('taken', flush=True)\ntime.sleep(60)",
    ])
    .stdout(std::process::Stdio::piped());
    let mut hog = hog.spawn_guarded().unwrap();
    let mut line = String::new();
    BufReader::new(hog.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "taken\n");
    wait_for(PATIENCE, "the gate to close", || !memory_gate(&broker).0);
    hog.kill().unwrap();
    hog.reap().unwrap();
    wait_for(PATIENCE, "the gate to open again", || {
        memory_gate(&broker).0
    });
}

/// A process's state letter in /proc (T: stopped); None once it is gone.
fn state_of(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim_start().chars().next()
}

/// Starts, in `cgroup`, a build that holds 2 tokens of `broker` and runs
/// make, whose two jobs start a moment apart, write their pids (first.pid,
/// second.pid) and each grow to 200 MiB: its directory and its client.
fn start_pausing_build(
    cgroup: &baton_bench::cgroup::MemCgroup,
    broker: &RunningBroker,
    dir_name: &str,
) -> (TempDir, baton_testkit::Guarded) {
    let dir = TempDir::new(dir_name);
    let job = "import time\nb = []\nwhile len(b) < 10:\n    b.append(bytearray(b'x' * (20 << 20)))\n    time.sleep(0.05)\ntime.sleep(60)";
    std::fs::write(dir.path().join("job.py"), job).unwrap();
    std::fs::write(
        dir.path().join("Makefile"),
        "all: first second\n\
         first:\n\techo $$$$ > first.pid; exec python3 job.py\n\
         second:\n\tsleep 0.3; echo $$$$ > second.pid; exec python3 job.py\n",
    )
    .unwrap();
    let build = format!(
        "import socket, subprocess, time\n\
         s = socket.socket(socket.AF_UNIX); s.connect({socket:?})\n\
         f = s.makefile('rw')\n\
         f.write('HELLO 1 pausing\\nACQUIRE 2\\n'); f.flush()\n\
         assert f.readline().startswith('OK'), 'hello'\n\
         assert f.readline().startswith('GRANTED'), 'granted'\n\
         subprocess.run(['make', '-s', '-j2'])\n",
        socket = broker.socket.to_str().unwrap(),
    );
    let mut client = cgroup.command();
    client
        .args(["python3", "-c", &build])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .env_remove("MAKELEVEL");
    let client = client.spawn_guarded().unwrap();
    (dir, client)
}

/// `--on-memory-pressure pause` for real: a build (a client that holds 2
/// tokens) runs two jobs that grow in the broker's memory cgroup; once
/// less than the gate's 200 MiB is left, the job that grows and is not
/// the first started is stopped (SIGSTOP), and when the first ends,
/// it is resumed.
fn a_growing_job_is_paused_while_memory_is_short_and_resumed_after() {
    let spec = format!("min_mem={}\npause=1", 200 * MIB);
    let Some((cgroup, broker)) = served_in_a_memory_cgroup("pause", &spec) else {
        return;
    };
    // The build: a client that holds 2 tokens and runs make, whose two
    // jobs (children of a build tool: jobs, as the broker counts them)
    // start a moment apart and say their pids. Each takes 20 MiB every
    // 50 ms, up to 200 MiB: both together would leave less than 200 MiB
    // of 512.
    let (dir, client) = start_pausing_build(&cgroup, &broker, "served-pause");
    let pid_of = |job: &str| {
        let path = dir.path().join(format!("{job}.pid"));
        let mut pid = None;
        wait_for(PATIENCE, &format!("the {job} job"), || {
            pid = std::fs::read_to_string(&path)
                .ok()
                .and_then(|p| p.trim().parse::<u32>().ok());
            pid.is_some()
        });
        pid.unwrap()
    };
    let (first, second) = (pid_of("first"), pid_of("second"));
    let paused = std::time::Instant::now();
    while state_of(second) != Some('T') {
        assert!(
            paused.elapsed() < PATIENCE,
            "the second job was never paused: {}",
            broker.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_ne!(state_of(first), Some('T'), "the first started runs on");
    // Logged just after the signal.
    wait_for(PATIENCE, "the pause logged", || {
        broker.log().contains(&format!("paused job pid {second}"))
    });
    // SAFETY: kill(2) has no memory effects.
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    wait_for(PATIENCE, "the second job to be resumed", || {
        state_of(second).is_some_and(|s| s != 'T')
    });
    wait_for(PATIENCE, "the resume logged", || {
        broker
            .log()
            .contains(&format!("resumed job pid {second} (SIGCONT)"))
    });
    drop(client);
}

/// A gate's value from STATUS, by name.
fn gate_value(broker: &RunningBroker, name: &str) -> Option<f64> {
    let status = broker_status(broker);
    let gates = status["gates"].as_array().unwrap();
    let gate = gates
        .iter()
        .find(|g| g["name"] == name)
        .unwrap_or_else(|| panic!("no {name} gate: {status}"));
    gate["value"].as_f64()
}

/// The load gate counts runnable tasks: four spinning shells on this
/// machine show as at least two (the mean of the last readings, less the
/// reader itself). The pressure gate reads PSI where the kernel has it.
fn the_load_and_pressure_gates_read_the_machine() {
    let broker = served(2, "max_load=100000\nmax_pressure=100");
    let spinners: Vec<_> = (0..4)
        .map(|_| {
            Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn_guarded()
                .unwrap()
        })
        .collect();
    wait_for(PATIENCE, "the run queue to show the spinners", || {
        gate_value(&broker, "load").is_some_and(|v| v >= 2.0)
    });
    drop(spinners);
    if std::fs::read_to_string("/proc/pressure/memory").is_ok() {
        let pressure = gate_value(&broker, "mem-pressure");
        assert!(
            pressure.is_some_and(|p| (0.0..=100.0).contains(&p)),
            "{pressure:?}"
        );
    }
}

/// `-q` keeps warnings and errors, the default adds the events, `-v`
/// every connection; each line has its level. A broker that cannot start
/// says why, as an ERROR, at every level.
fn the_log_says_as_much_as_its_level_asks() {
    for (level, info, debug) in [
        ("warn", false, false),
        ("info", true, false),
        ("debug", true, true),
    ] {
        let mut broker = served(1, &format!("log={level}"));
        let mut peer = Peer::hello(&broker.socket, "peer");
        assert_eq!(peer.ask("TRY 1"), "GRANTED 1 1");
        drop(peer);
        let (_, log) = broker.stop_with(libc::SIGTERM);
        assert_eq!(
            log.contains(" INFO baton: serving 1 token at "),
            info,
            "{level}: {log}"
        );
        assert_eq!(
            log.contains(" INFO baton: stopping on SIGTERM"),
            info,
            "{level}: {log}"
        );
        assert_eq!(
            log.contains(" DEBUG baton: connection from pid "),
            debug,
            "{level}: {log}"
        );
    }
    // Refused at start: said as an ERROR even under -q.
    let broker = served(1, "");
    let refused = serve_command(&broker.socket, "jobs=1\nlog=warn")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains(" ERROR baton: a broker is already running at"),
        "{said}"
    );
}

/// A broker at `run/socket` in a directory made first with `mode` (and
/// `group`, if given), served with `spec`.
fn served_in_dir(mode: u32, group: Option<u32>, spec: &str) -> RunningBroker {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("served-admit");
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    if let Some(gid) = group {
        std::os::unix::fs::chown(&run, None, Some(gid)).unwrap();
    }
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(mode)).unwrap();
    let socket = run.join("socket");
    RunningBroker::start_command(
        serve_command(&socket, &format!("jobs=1\n{spec}")),
        dir,
        socket,
    )
}

fn mode_and_group(path: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).unwrap();
    (meta.mode() & 0o7777, meta.gid())
}

/// `--allow-uid` and `--allow-group` open the socket's mode to those they
/// admit (one group: 0660 and that group's; else 0666), and the broker
/// warns where the directory keeps them out; it refuses outright to admit
/// others to its private directory, which they could never reach.
fn admitting_others_opens_the_socket_to_them_and_says_where_they_cannot_reach_it() {
    if !nix::unistd::getuid().is_root() {
        return skip(Missing::Root, "chown to another group needs root");
    }
    let cannot_reach = "cannot be searched by the users --allow-uid/--allow-group admit";
    let own = served_in_dir(0o700, None, "");
    assert_eq!(mode_and_group(&own.socket).0, 0o600);
    assert!(!own.log().contains(cannot_reach));

    let uid = served_in_dir(0o700, None, "allow_uid=1234");
    assert_eq!(mode_and_group(&uid.socket).0, 0o666);
    assert!(uid.log().contains(cannot_reach), "{}", uid.log());
    let uid = served_in_dir(0o701, None, "allow_uid=1234");
    assert!(!uid.log().contains(cannot_reach), "o+x: {}", uid.log());

    let group = served_in_dir(0o710, Some(4242), "allow_group=4242");
    assert_eq!(mode_and_group(&group.socket), (0o660, 4242));
    assert!(
        !group.log().contains(cannot_reach),
        "g+x for the group: {}",
        group.log()
    );
    let other_group = served_in_dir(0o710, Some(4243), "allow_group=4242");
    assert!(
        other_group.log().contains(cannot_reach),
        "g+x, another group: {}",
        other_group.log()
    );

    // Admitting others to baton's own private directory: refused.
    let home = TempDir::new("served-admit-home");
    let refused = role_command("serve", "jobs=1\nallow_uid=1234")
        .env("XDG_RUNTIME_DIR", home.path())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(1));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("admit other users, but the socket would be in"),
        "{said}"
    );
}

/// The successor takes its predecessor's state as it is: a broker that
/// served no token files hands over none, and the successor mounts none
/// of its own (its builds use the forms they were given).
fn a_successor_of_a_broker_without_token_files_mounts_none() {
    let mut old = served(1, "");
    let mount = old.socket.with_file_name("fuse");
    let new = served_at(&old.socket, "jobs=1\nreplace=1\nfuse=1");
    assert!(old.wait_exit(PATIENCE).success());
    wait_for(PATIENCE, "the successor to serve", || {
        new.log().contains("took over")
    });
    assert!(!new.log().contains("FUSE token files at"), "{}", new.log());
    assert_eq!(mounts_at(&mount), 0);
}

// Tests written for mutants of serve.rs and gates.rs that the tests above
// did not catch (docs/testing.md, "Against every bug a tool can make").

/// A build's `baton run` (here a Python stand-in that says BUILD and holds
/// 2 tokens) is killed while one job of its build runs: the broker keeps
/// one token for that job, and gives it back once the job ends, as its
/// orphan watcher sees it go.
fn an_orphaned_builds_token_comes_back_when_its_last_job_ends() {
    let broker = served(4, "");
    let run = format!(
        "import socket, time\n\
         s = socket.socket(socket.AF_UNIX); s.connect({socket:?})\n\
         f = s.makefile('rw')\n\
         f.write('HELLO 1 run\\nBUILD 1 orphan\\nACQUIRE 2\\n'); f.flush()\n\
         for _ in range(3): print(f.readline().strip(), flush=True)\n\
         time.sleep(60)\n",
        socket = broker.socket.to_str().unwrap(),
    );
    let mut run = Command::new("python3")
        .args(["-c", &run])
        .stdout(std::process::Stdio::piped())
        .spawn_guarded()
        .unwrap();
    let mut replies = BufReader::new(run.stdout.take().unwrap());
    let mut said = String::new();
    for _ in 0..3 {
        replies.read_line(&mut said).unwrap();
    }
    assert!(said.contains("GRANTED 2 2"), "{said}");
    // The job: a process of the build (its run's pid in BATON_RUN_PID),
    // in the same session.
    let mut job = Command::new("sleep")
        .arg("60")
        .env("BATON_RUN_PID", run.id().to_string())
        .spawn_guarded()
        .unwrap();
    run.kill().unwrap();
    run.reap().unwrap();
    wait_for(PATIENCE, "the orphaned build to keep one token", || {
        let status = broker_status(&broker);
        status["free"] == 3 && status["holders"].as_array().unwrap().len() == 1
    });
    job.kill().unwrap();
    job.reap().unwrap();
    wait_for(PATIENCE, "the job's token to come back", || {
        broker_status(&broker)["free"] == 4
    });
    assert!(
        broker.log().contains("died while its build runs 1 job(s)"),
        "{}",
        broker.log()
    );
}

/// A broker in a memory cgroup with the memory gate at 200 MiB and
/// pausing on, running a build whose second job was paused (SIGSTOP) as
/// memory ran short, as `a_growing_job_is_paused_while_memory_is_short_and_resumed_after`
/// sets it up; returns the cgroup (which ends every process in it when
/// dropped), the broker, the build's client, the directory and the
/// second job's pid. None where no cgroup can be made (the skip recorded).
fn a_build_with_its_second_job_paused(
    name: &str,
) -> Option<(
    baton_bench::cgroup::MemCgroup,
    RunningBroker,
    baton_testkit::Guarded,
    TempDir,
    u32,
)> {
    let spec = format!("min_mem={}\npause=1", 200 * MIB);
    let (cgroup, broker) = served_in_a_memory_cgroup(name, &spec)?;
    let (dir, client) = start_pausing_build(&cgroup, &broker, "served-paused");
    let path = dir.path().join("second.pid");
    let mut second = None;
    wait_for(PATIENCE, "the second job", || {
        second = std::fs::read_to_string(&path)
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok());
        second.is_some()
    });
    let second = second.unwrap();
    wait_for(PATIENCE, "the second job to be paused", || {
        state_of(second) == Some('T')
    });
    Some((cgroup, broker, client, dir, second))
}

/// Turning the memory gate off (`baton limit --min-mem-available off`)
/// while a job is paused lets it go on: nothing would resume it later.
fn a_paused_job_goes_on_when_the_memory_gate_is_turned_off() {
    let Some((_cgroup, broker, _client, _dir, second)) =
        a_build_with_its_second_job_paused("gate-off")
    else {
        return;
    };
    let mut admin = Peer::hello(&broker.socket, "admin");
    assert_eq!(
        admin.ask("GATE mem-available off"),
        "GATE mem-available off"
    );
    wait_for(PATIENCE, "the paused job to go on", || {
        state_of(second).is_some_and(|s| s != 'T')
    });
}

/// A broker that stops while a job is paused lets it go on first:
/// nobody would after it is gone.
fn a_paused_job_goes_on_when_the_broker_stops() {
    let Some((_cgroup, mut broker, _client, _dir, second)) =
        a_build_with_its_second_job_paused("stop")
    else {
        return;
    };
    let (status, log) = broker.stop_with(libc::SIGTERM);
    assert!(status.success(), "{status:?}\n{log}");
    assert!(
        state_of(second).is_some_and(|s| s != 'T'),
        "the job was left stopped: {log}"
    );
}

/// An open-file limit that leaves room for exactly the clients asked for
/// caps nothing and warns of nothing: 80 descriptors, 64 kept beside the
/// clients, `--max-clients 16`.
fn an_open_file_limit_that_fits_the_clients_asked_is_not_warned_of() {
    let dir = TempDir::new("served-nofile-fits");
    let socket = dir.path().join("run").join("socket");
    let mut command = serve_command(&socket, "jobs=2\nmax_clients=16");
    // SAFETY: setrlimit is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 80,
                rlim_max: 80,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut broker = RunningBroker::start_command(command, dir, socket);
    let (_, log) = broker.stop_with(libc::SIGTERM);
    assert!(log.contains("serving 2 tokens"), "{log}");
    assert!(!log.contains("open-file limit"), "{log}");
}

/// poll(2) of one descriptor for `events`, waiting at most `timeout_ms`:
/// how many are ready (0 or 1) and what it returned.
fn poll_one(file: &std::fs::File, events: i16, timeout_ms: i32) -> (i32, i16) {
    let mut fds = [libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(file),
        events,
        revents: 0,
    }];
    // SAFETY: one pollfd, as said.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, timeout_ms) };
    (n, fds[0].revents)
}

/// A thread that opens `file` and polls it for a token with no timeout,
/// beside one end of `cancel`: it sleeps until the file's handle is woken.
/// (A poll that timed out would poll the file once more, and find a
/// token reserved for it without having been woken.)
struct SleepingPoller {
    thread: std::thread::JoinHandle<(std::fs::File, i16, bool)>,
    cancel: UnixStream,
    /// Its thread's id, once it runs.
    tid: std::sync::Arc<std::sync::atomic::AtomicI32>,
}

fn a_sleeping_poller(file: &Path) -> SleepingPoller {
    let file = file.to_path_buf();
    let (cancel, cancelled) = UnixStream::pair().unwrap();
    let tid = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let its_tid = tid.clone();
    let thread = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        its_tid.store(
            unsafe { libc::gettid() },
            std::sync::atomic::Ordering::SeqCst,
        );
        let handle = open_rw(&file, true);
        let mut fds = [&handle as &dyn std::os::fd::AsRawFd, &cancelled].map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: two pollfds, as said.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        (handle, fds[0].revents, fds[1].revents != 0)
    });
    SleepingPoller {
        thread,
        cancel,
        tid,
    }
}

impl SleepingPoller {
    /// Waits until its thread sleeps in poll(2): the broker has answered
    /// its poll of the file "not ready" (the kernel's wait channel says
    /// where a thread sleeps, proc(5)).
    fn asleep(&self) {
        wait_for(PATIENCE, "the poller to sleep in poll()", || {
            let tid = self.tid.load(std::sync::atomic::Ordering::SeqCst);
            tid != 0
                && std::fs::read_to_string(format!("/proc/self/task/{tid}/wchan"))
                    .is_ok_and(|w| w.contains("poll"))
        });
    }

    /// Where its thread sleeps in the kernel (proc(5)'s `wchan`), once it
    /// sleeps somewhere.
    fn wchan(&self) -> String {
        let mut wchan = String::new();
        wait_for(PATIENCE, "the poller to sleep", || {
            let tid = self.tid.load(std::sync::atomic::Ordering::SeqCst);
            wchan =
                std::fs::read_to_string(format!("/proc/self/task/{tid}/wchan")).unwrap_or_default();
            tid != 0 && !wchan.is_empty() && wchan != "0"
        });
        wchan
    }

    /// Its handle once woken; fails if it was not woken within PATIENCE
    /// (it is cancelled then, a hang guard).
    fn woken(mut self, what: &str) -> std::fs::File {
        let deadline = std::time::Instant::now() + PATIENCE;
        while !self.thread.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        if !self.thread.is_finished() {
            let _ = self.cancel.write_all(b"x");
        }
        let (handle, revents, cancelled) = self.thread.join().unwrap();
        assert!(!cancelled, "{what} was never woken");
        assert_eq!(revents, libc::POLLIN, "{what}");
        handle
    }
}

/// A poll of a file marked `user.baton.polls=hold` (GNU make's, cargo's)
/// waits in the broker until a token frees: its thread sleeps in the
/// kernel waiting for FUSE's answer. One of an unmarked file (bmake's,
/// whose poll also watches its job pipes) is answered "not ready" at
/// once, and its thread sleeps in poll(2).
fn a_poll_of_a_file_marked_hold_waits_in_the_broker_and_others_in_poll() {
    if !fuse_should_mount() {
        return skip(
            Missing::Fuse,
            "no /dev/fuse, or neither root nor fusermount3",
        );
    }
    // Held for a minute: longer than the test (a hang guard).
    let broker = served(1, "fuse=1\nfuse_hold_ms=60000");
    let mount = broker.socket.with_file_name("fuse");
    let (plain, held) = (mount.join("plain"), mount.join("held"));
    std::fs::File::create(&plain).unwrap();
    std::fs::File::create(&held).unwrap();
    set_xattr(&held, "hold").unwrap();
    let mut peer = Peer::hello(&broker.socket, "peer");
    assert_eq!(peer.ask("TRY 1"), "GRANTED 1 1");

    let holder = a_sleeping_poller(&held);
    wait_for_waiters(&broker, 1);
    // By the time the other poller sleeps, a poll answered at once would
    // have put the first to sleep in poll(2) as well.
    let sleeper = a_sleeping_poller(&plain);
    sleeper.asleep();
    let wchan = holder.wchan();
    assert!(
        !wchan.contains("poll"),
        "a held poll's thread sleeps in {wchan}, as if answered at once"
    );

    // The held poll is answered with the token; the other is woken once
    // it comes back.
    assert_eq!(peer.ask("RELEASE 1"), "RELEASED 1 0");
    let mut byte = [0u8; 1];
    let first = holder.woken("the held poll");
    assert_eq!((&first).read(&mut byte).unwrap(), 1);
    assert_eq!((&first).write(b"+").unwrap(), 1);
    let second = sleeper.woken("the unmarked file's poller");
    assert_eq!((&second).read(&mut byte).unwrap(), 1);
    assert_eq!((&second).write(b"+").unwrap(), 1);
    drop((first, second));
    broker.assert_all_free();
}

/// A poller sleeping on a file whose polls are not held is woken when a
/// token frees: by the broker that answered its poll (here when a socket
/// client gives the token back, with no request to the files to prompt
/// it), and by a successor that took the files over, which wakes it by
/// the kernel's poll handle.
fn a_sleeping_poller_is_woken_by_a_freed_token_before_and_after_a_handover() {
    let Some((mut old, mount)) = served_with_files(2) else {
        return;
    };
    let file = mount.join("sleepers");
    std::fs::File::create(&file).unwrap();
    let mut peer = Peer::hello(&old.socket, "peer");
    assert_eq!(peer.ask("TRY 2"), "GRANTED 2 2");
    let sleeper = a_sleeping_poller(&file);
    wait_for_waiters(&old, 1);
    assert_eq!(peer.ask("RELEASE 1"), "RELEASED 1 1");
    let mut holder = sleeper.woken("the first poller");
    let mut byte = [0u8; 1];
    assert_eq!(
        holder.read(&mut byte).unwrap(),
        1,
        "the token was kept for it"
    );

    // Another poller of this process, which holds one token, sleeps
    // behind the peer and the holder; a successor takes over.
    let sleeper = a_sleeping_poller(&file);
    wait_for_waiters(&old, 1);
    let new = served_at(&old.socket, "jobs=2\nreplace=1\nfuse=1");
    assert!(old.wait_exit(PATIENCE).success(), "{}", old.log());
    wait_for(PATIENCE, "the successor to take the files", || {
        new.log().contains("taken over")
    });
    assert_eq!(holder.write(b"+").unwrap(), 1);
    let poller = sleeper.woken("the poller the successor took");
    assert_eq!((&poller).read(&mut byte).unwrap(), 1);
    assert_eq!((&poller).write(b"+").unwrap(), 1);
    assert_eq!(peer.ask("RELEASE 1"), "RELEASED 1 0");
    new.assert_all_free();
}

/// A process that holds the whole pool through the file and polls it for
/// one more (here from another thread) is woken by its own give-back, as
/// a pipe's poller is by its own write: its wait could not be queued
/// before (it would have waited for itself).
fn a_poller_holding_the_whole_pool_is_woken_by_its_own_give_back() {
    let Some((broker, mount)) = served_with_files(1) else {
        return;
    };
    let file = mount.join("own");
    std::fs::File::create(&file).unwrap();
    let holder = open_rw(&file, true);
    let mut byte = [0u8; 1];
    assert_eq!((&holder).read(&mut byte).unwrap(), 1, "the whole pool");
    let sleeper = a_sleeping_poller(&file);
    sleeper.asleep();
    assert_eq!((&holder).write(b"+").unwrap(), 1);
    let poller = sleeper.woken("the holder's own poller");
    assert_eq!((&poller).read(&mut byte).unwrap(), 1, "kept for it");
    assert_eq!((&poller).write(b"+").unwrap(), 1);
    broker.assert_all_free();
}

/// A token reserved for a poller that never reads it passes to the next
/// waiter once the reservation runs out: the files' clock acts by itself.
fn a_reservation_nobody_reads_passes_to_the_next_waiter() {
    let Some((broker, mount)) = served_with_files(1) else {
        return;
    };
    let file = mount.join("unread");
    std::fs::File::create(&file).unwrap();
    let poller = open_rw(&file, true);
    assert_eq!(
        poll_one(&poller, libc::POLLIN, 0),
        (1, libc::POLLIN),
        "the free token, reserved for the poller"
    );
    let mut peer = Peer::hello(&broker.socket, "next");
    assert_eq!(peer.ask("ACQUIRE 1"), "GRANTED 1 1", "passed on, unread");
    let mut byte = [0u8; 1];
    let late = (&poller).read(&mut byte).unwrap_err();
    assert_eq!(late.kind(), std::io::ErrorKind::WouldBlock, "{late}");
    assert_eq!(peer.ask("RELEASE 1"), "RELEASED 1 0");
    broker.assert_all_free();
}

/// A poll is answered with what it asked that holds, and nothing more:
/// writable always (giving a token back never waits), readable once a
/// token is the poller's.
fn a_poll_is_answered_the_events_asked_that_hold_and_no_others() {
    let Some((broker, mount)) = served_with_files(1) else {
        return;
    };
    let file = mount.join("events");
    std::fs::File::create(&file).unwrap();
    let handle = open_rw(&file, true);
    assert_eq!(poll_one(&handle, libc::POLLOUT, 0), (1, libc::POLLOUT));
    assert_eq!(poll_one(&handle, libc::POLLIN, 0), (1, libc::POLLIN));
    let mut byte = [0u8; 1];
    assert_eq!((&handle).read(&mut byte).unwrap(), 1);
    assert_eq!((&handle).write(b"+").unwrap(), 1);
    broker.assert_all_free();
}

/// A name is looked up whenever the kernel asks (an exclusive create
/// always asks): an existing file cannot be created anew. Truncating one,
/// as a shell's `>` does, is accepted.
fn an_existing_file_is_found_by_name_and_truncating_it_succeeds() {
    let Some((_broker, mount)) = served_with_files(1) else {
        return;
    };
    let file = mount.join("there");
    std::fs::File::create(&file).unwrap();
    let again = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&file)
        .unwrap_err();
    assert_eq!(again.kind(), std::io::ErrorKind::AlreadyExists, "{again}");
    let handle = std::fs::File::create(&file).unwrap();
    handle.set_len(0).unwrap();
    assert_eq!(names_in(&mount), ["there"]);
}

/// getxattr(2) of the polls attribute into `size` bytes (0: asks its
/// size): the length it returned.
fn xattr_sized(path: &Path, size: usize) -> std::io::Result<usize> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut buf = vec![0u8; size];
    // SAFETY: both strings end in NUL and the buffer is as long as said.
    let n = unsafe {
        libc::getxattr(
            c_path.as_ptr(),
            c"user.baton.polls".as_ptr(),
            if size == 0 {
                std::ptr::null_mut()
            } else {
                buf.as_mut_ptr().cast()
            },
            size,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The polls attribute goes back from hold to notify, and answers a
/// question for its size, and a buffer too small, as getxattr(2) says.
fn the_polls_attribute_goes_back_to_notify_and_is_sized_as_getxattr_asks() {
    let Some((_broker, mount)) = served_with_files(1) else {
        return;
    };
    let file = mount.join("marked");
    std::fs::File::create(&file).unwrap();
    set_xattr(&file, "hold").unwrap();
    assert_eq!(xattr_sized(&file, 0).unwrap(), "hold".len());
    let small = xattr_sized(&file, 2).unwrap_err();
    assert_eq!(small.raw_os_error(), Some(libc::ERANGE), "{small}");
    set_xattr(&file, "notify").unwrap();
    assert_eq!(xattr(&file).unwrap(), "notify");
    assert_eq!(xattr_sized(&file, 0).unwrap(), "notify".len());
}

/// Closing a handle whose poll waits in the broker's queue takes that
/// wait out.
fn closing_a_handle_takes_its_waiting_poll_out_of_the_queue() {
    let Some((broker, mount)) = served_with_files(1) else {
        return;
    };
    let file = mount.join("closed");
    std::fs::File::create(&file).unwrap();
    let mut peer = Peer::hello(&broker.socket, "peer");
    assert_eq!(peer.ask("TRY 1"), "GRANTED 1 1");
    let poller = open_rw(&file, true);
    // A poll that may wait (its own timeout, 1 ms, runs out: no token
    // can come) leaves its wait in the queue.
    assert_eq!(poll_one(&poller, libc::POLLIN, 1), (0, 0));
    assert_eq!(broker_status(&broker)["waiters"][0]["transport"], "fuse");
    drop(poller);
    wait_for_waiters(&broker, 0);
    assert_eq!(peer.ask("RELEASE 1"), "RELEASED 1 0");
    broker.assert_all_free();
}

/// A reader blocked in the file when its broker was killed waits in a
/// request that broker read and never answered. The broker that takes
/// over the mount answers it EINTR when the reader gets a signal, so a
/// killed reader ends instead of hanging in the kernel.
fn a_reader_left_blocked_by_a_killed_broker_ends_when_killed() {
    let Some((mut first, mount)) = served_with_files(1) else {
        return;
    };
    let file = mount.join("stuck");
    std::fs::File::create(&file).unwrap();
    let mut peer = Peer::hello(&first.socket, "peer");
    assert_eq!(peer.ask("TRY 1"), "GRANTED 1 1");
    let mut reader = Command::new("bash")
        .arg("-c")
        .arg("exec 3<>\"$0\"; read -r -N 1 taken <&3")
        .arg(&file)
        .spawn_guarded()
        .unwrap();
    wait_for_waiters(&first, 1);
    // SAFETY: kill(2) has no memory effects.
    unsafe { libc::kill(first.pid() as i32, libc::SIGKILL) };
    first.wait_exit(PATIENCE);
    let second = served_at(&first.socket, "jobs=1\nfuse=1\norphan_ms=1");
    assert!(
        second
            .log()
            .contains("serving the mount a killed broker left"),
        "{}",
        second.log()
    );
    // SAFETY: as above; the reader is our child, not yet reaped.
    unsafe { libc::kill(reader.id() as i32, libc::SIGKILL) };
    let ended = wait_timeout(&mut reader, PATIENCE);
    assert!(
        ended.is_some(),
        "the killed reader still waits in the mount"
    );
    drop(second);
}

/// The mount is named baton's in the mount table and runs nothing: no
/// set-uid programs, no devices, no programs at all. A fresh broker finds
/// no stale mount to clear.
fn the_mount_is_batons_runs_nothing_and_a_fresh_one_clears_nothing() {
    let Some((broker, mount)) = served_with_files(1) else {
        return;
    };
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let line = mounts
        .lines()
        .find(|line| line.split(' ').nth(1) == mount.to_str())
        .unwrap_or_else(|| panic!("no mount at {}: {mounts}", mount.display()));
    let fields: Vec<&str> = line.split(' ').collect();
    assert_eq!(fields[0], "baton", "{line}");
    let options: Vec<&str> = fields[3].split(',').collect();
    for option in ["nosuid", "nodev", "noexec"] {
        assert!(options.contains(&option), "{option}: {line}");
    }
    assert!(
        !broker.log().contains("unmounting a stale FUSE mount"),
        "{}",
        broker.log()
    );
}

/// The keepers among the children of `pid` (`baton-keeper`).
fn keepers_of(pid: u32) -> Vec<u32> {
    let mut keepers = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let children =
            std::fs::read_to_string(task.unwrap().path().join("children")).unwrap_or_default();
        for child in children.split_whitespace() {
            let comm = std::fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
            if comm.trim_end() == "baton-keeper" {
                keepers.push(child.parse().unwrap());
            }
        }
    }
    keepers
}

/// The one keeper `broker` starts, once it has started it (the mount
/// comes first, its keeper a moment later).
fn one_keeper_of(broker: u32) -> Vec<u32> {
    wait_for(PATIENCE, "the broker's keeper to start", || {
        keepers_of(broker).len() == 1
    });
    keepers_of(broker)
}

/// Which of `keepers` still live; each is killed, so none outlives the test.
fn still_living(keepers: &[u32]) -> Vec<u32> {
    let living: Vec<u32> = keepers.iter().copied().filter(|&p| pid_alive(p)).collect();
    for &pid in &living {
        // SAFETY: kill(2) has no memory effects.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    living
}

/// A broker's keeper goes with it when it hands over (the successor holds
/// the mount's descriptor, and a keeper of its own) and when it stops:
/// none is left waiting for a successor that will not come.
fn a_broker_that_hands_over_or_stops_leaves_no_keeper_behind() {
    let Some((mut old, _mount)) = served_with_files(1) else {
        return;
    };
    let keepers = one_keeper_of(old.pid());
    let mut new = served_at(&old.socket, "jobs=1\nreplace=1\nfuse=1");
    if wait_timeout(&mut old.child, PATIENCE).is_none() {
        panic!(
            "no handover within {PATIENCE:?}; the old broker:\n{}\nthe successor:\n{}",
            old.log(),
            new.log()
        );
    }
    assert!(old.wait_exit(PATIENCE).success(), "{}", old.log());
    assert_eq!(
        still_living(&keepers),
        Vec::<u32>::new(),
        "the old broker's keeper"
    );
    wait_for(PATIENCE, "the successor to take the files", || {
        new.log().contains("taken over")
    });
    let keepers = one_keeper_of(new.pid());
    let (status, log) = new.stop_with(libc::SIGTERM);
    assert!(status.success(), "{log}");
    assert_eq!(
        still_living(&keepers),
        Vec::<u32>::new(),
        "the stopped broker's keeper"
    );
}

/// The log names each process whose tokens were reclaimed at its exit,
/// with how many, and no process that exited holding none.
fn the_log_names_each_process_reclaimed_from_and_no_other() {
    let Some((broker, mount)) = served_with_files(2) else {
        return;
    };
    let file = mount.join("reclaimed");
    std::fs::File::create(&file).unwrap();
    // Takes a token, gives it back, exits.
    let status = Command::new("bash")
        .arg("-c")
        .arg("exec 3<>\"$0\"; read -r -N 1 taken <&3; printf %s \"$taken\" >&3")
        .arg(&file)
        .status()
        .unwrap();
    assert!(status.success());
    // Takes both, says so, and is killed holding them.
    let mut victim = Command::new("bash")
        .arg("-c")
        .arg("exec 3<>\"$0\"; read -r -N 2 taken <&3; printf %s \"$taken\"; exec sleep 60")
        .arg(&file)
        .stdout(std::process::Stdio::piped())
        .spawn_guarded()
        .unwrap();
    let mut taken = [0u8; 2];
    victim
        .stdout
        .take()
        .unwrap()
        .read_exact(&mut taken)
        .unwrap();
    // SAFETY: kill(2) has no memory effects; the victim is not yet reaped.
    unsafe { libc::kill(victim.id() as i32, libc::SIGKILL) };
    victim.wait().unwrap();
    // The first exit came before the second, and is acted on no later.
    wait_for(PATIENCE, "the victim's tokens back", || {
        broker_status(&broker)["free"] == 2
    });
    let log = broker.log();
    let reclaimed: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("reclaimed") && line.contains("(fuse)"))
        .collect();
    assert_eq!(reclaimed.len(), 1, "{log}");
    assert!(
        reclaimed[0].contains(&format!(
            "reclaimed 2 token(s) from pid {}: it exited holding them",
            victim.id()
        )),
        "{log}"
    );
}

/// `baton_client`'s books of a connection: `held` is the broker's count
/// after each grant (not a sum of them), and `try_up_to` takes what is
/// free when that is fewer than asked, down to a single token (the
/// feeder tops a build up with it).
fn the_client_counts_each_grant_once_and_tries_up_to_the_last_free_token() {
    let broker = served(3, "");
    let mut a = broker.client("a");
    a.acquire(1).unwrap();
    assert_eq!(a.held(), 1);
    a.acquire(1).unwrap();
    assert_eq!(a.held(), 2, "two grants of one");
    let mut b = broker.client("b");
    assert_eq!(b.try_up_to(2).unwrap(), 1, "one of the two asked is free");
    assert_eq!(b.held(), 1);
    assert_eq!(b.try_up_to(2).unwrap(), 0, "none left");
    a.release(2).unwrap();
    assert_eq!(a.held(), 0);
    assert_eq!(
        b.try_up_to(3).unwrap(),
        2,
        "two of the three asked are free"
    );
    assert_eq!(b.held(), 3);
    drop((a, b));
    wait_for(PATIENCE, "every token back", || broker.status().free == 3);
}

fn the_log_names_each_connection_closed_holding_tokens_and_no_other() {
    let broker = served(2, "");
    let mut a = Peer::hello(&broker.socket, "gave-back");
    assert_eq!(a.ask("TRY 1"), "GRANTED 1 1");
    assert_eq!(a.ask("RELEASE 1"), "RELEASED 1 0");
    drop(a);
    let mut b = Peer::hello(&broker.socket, "kept-one");
    assert_eq!(b.ask("TRY 1"), "GRANTED 1 1");
    drop(b);
    wait_for(PATIENCE, "the closed client's token back", || {
        broker_status(&broker)["free"] == 2
    });
    let log = broker.log();
    let reclaimed: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("its connection closed"))
        .collect();
    assert_eq!(reclaimed.len(), 1, "{log}");
    assert!(
        reclaimed[0].contains("reclaimed 1 token(s) from pid")
            && reclaimed[0].contains("(kept-one)"),
        "{log}"
    );
    broker.assert_all_free();
}
