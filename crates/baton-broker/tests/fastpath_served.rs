//! The fast path served for real (docs/fastpath.md): a broker running
//! `baton_broker::serve` in a process of its own (this binary in the
//! `serve` role), and clients of `baton_client` that ask it for a seat and
//! pass tokens in the region it shares with them. Counted from the jobs
//! themselves (a lock per running job, which the kernel drops when its
//! process dies) and from the broker's books.
//!
//! The clients of one test join one build: the test's own process says
//! BUILD on a connection it keeps, and the broker puts every later
//! connection of it and of its children in that build, as `baton run`
//! does for a build's processes. A region serves one build.

#[path = "support/serve_role.rs"]
mod serve_role;

use baton_client::Client;
use baton_testkit::harness::{self, role_command, spec_lines};
use baton_testkit::{join_within, wait_for, RunningBroker, TempDir};
use serve_role::{served, served_at};
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

/// How long a test waits for what must happen at once, before it fails
/// rather than hangs (a hang guard, not a timing check).
const PATIENCE: Duration = Duration::from_secs(20);

fn main() {
    match harness::role() {
        Some((role, spec)) if role == "job" => job_here(&spec),
        Some((_, spec)) => serve_role::serve_here(&spec),
        None => {}
    }
    let tests: &[(&str, fn())] = &[
        (
            "threads_pass_tokens_in_the_region_without_waking_the_broker",
            threads_pass_tokens_in_the_region_without_waking_the_broker,
        ),
        (
            "clients_killed_at_random_moments_never_run_more_jobs_than_the_limit_nor_lose_a_token",
            clients_killed_at_random_moments_never_run_more_jobs_than_the_limit_nor_lose_a_token,
        ),
        (
            "another_build_that_waits_closes_the_region_and_is_served_in_turn",
            another_build_that_waits_closes_the_region_and_is_served_in_turn,
        ),
        (
            "a_lowered_limit_closes_the_region_until_it_holds_no_more",
            a_lowered_limit_closes_the_region_until_it_holds_no_more,
        ),
        (
            "a_try_of_two_with_a_seat_takes_two_or_none",
            a_try_of_two_with_a_seat_takes_two_or_none,
        ),
        #[cfg(target_arch = "x86_64")]
        (
            "a_kernel_without_memfd_leaves_every_client_on_the_socket",
            a_kernel_without_memfd_leaves_every_client_on_the_socket,
        ),
        (
            "a_waiter_whose_broker_is_killed_gives_up_instead_of_sleeping_forever",
            a_waiter_whose_broker_is_killed_gives_up_instead_of_sleeping_forever,
        ),
        (
            "a_client_whose_broker_is_killed_still_counts_what_it_took_in_the_region",
            a_client_whose_broker_is_killed_still_counts_what_it_took_in_the_region,
        ),
        (
            "a_successor_books_what_fast_path_clients_hold_on_their_connections",
            a_successor_books_what_fast_path_clients_hold_on_their_connections,
        ),
        (
            "garbage_in_a_record_is_found_logged_and_its_clients_dropped_to_the_socket",
            garbage_in_a_record_is_found_logged_and_its_clients_dropped_to_the_socket,
        ),
        (
            "a_release_of_more_than_is_held_with_a_seat_gives_back_nothing",
            a_release_of_more_than_is_held_with_a_seat_gives_back_nothing,
        ),
        (
            "pile_threads_pass_tokens_without_waking_the_broker",
            || threads_pass_tokens_in(PILE),
        ),
        (
            "pile_clients_killed_at_random_moments_never_run_more_jobs_than_the_limit_nor_lose_a_token",
            || clients_killed_at_random_moments_in(PILE),
        ),
        (
            "pile_another_build_that_waits_closes_the_pile_and_is_served_in_turn",
            || another_build_that_waits_in(PILE),
        ),
        (
            "pile_a_lowered_limit_closes_the_pile_until_it_holds_no_more",
            || a_lowered_limit_in(PILE),
        ),
        (
            "pile_a_waiter_whose_broker_is_killed_gives_up_instead_of_sleeping_forever",
            || a_waiter_whose_broker_is_killed_in(PILE),
        ),
        (
            "pile_a_successor_books_what_pile_clients_hold_on_their_connections",
            || a_successor_books_in(PILE),
        ),
        (
            "pile_a_forged_token_word_is_found_logged_and_its_clients_dropped_to_the_socket",
            a_forged_token_word_is_found_logged_and_its_clients_dropped_to_the_socket,
        ),
        (
            "pile_another_build_is_served_while_the_piles_clients_keep_taking_its_token",
            another_build_is_served_while_the_piles_clients_keep_taking_its_token,
        ),
        (
            "pile_a_pile_whose_last_client_leaves_says_so_to_a_mapping_left_open",
            a_pile_whose_last_client_leaves_says_so_to_a_mapping_left_open,
        ),
        (
            "pile_a_build_keeps_the_layout_its_first_fast_path_client_chose",
            a_build_keeps_the_layout_its_first_fast_path_client_chose,
        ),
    ];
    std::process::exit(harness::run(tests));
}

/// A connection that starts a build: the test's later connections, and
/// its children's, join it.
fn build_root(broker: &RunningBroker) -> Client {
    let mut root = broker.client("fast-path test");
    root.start_build(1, "fast-path test").expect("BUILD");
    root
}

/// The layouts FASTPATH names: the FIFO ring, and the pile.
const RING: u32 = baton_core::protocol::FASTPATH_VERSION;
const PILE: u32 = baton_core::protocol::FASTPATH_PILE;

/// A broker for a test of `layout`. A pile's is audited once an hour, not
/// once a second: every move the broker makes for a pile must come from
/// a client's nudge or another client's request, and one that waited
/// for the audit clock instead fails the test by its hang guard.
fn served_for(layout: u32, jobs: u32) -> RunningBroker {
    served(
        jobs,
        if layout == PILE {
            "audit_ms=3600000"
        } else {
            ""
        },
    )
}

fn fast_client(broker: &RunningBroker, label: &str) -> Client {
    fast_client_in(broker, label, RING)
}

/// Asks for a seat in a region of `layout`.
fn enable(client: &mut Client, layout: u32) -> baton_client::Result<Result<(), String>> {
    if layout == PILE {
        client.enable_fastpath_pile()
    } else {
        client.enable_fastpath()
    }
}

fn fast_client_in(broker: &RunningBroker, label: &str, layout: u32) -> Client {
    let mut client = broker.client(label);
    enable(&mut client, layout)
        .expect("FASTPATH answered")
        .expect("a seat for the broker's own user");
    assert!(client.uses_fastpath());
    client
}

/// The next reply, or a failure (not a hang) if none comes in time.
fn reply_within(client: &mut Client) -> baton_client::Result<baton_core::protocol::Reply> {
    if !client.has_buffered_reply() {
        let mut fd = libc::pollfd {
            fd: client.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let ready = unsafe { libc::poll(&mut fd, 1, PATIENCE.as_millis() as i32) };
        assert_eq!(ready, 1, "no reply within {PATIENCE:?}");
    }
    client.read_reply()
}

/// Context switches of every thread of `pid`: how often it slept.
fn switches(pid: u32) -> u64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the broker's threads");
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("status")).ok())
        .flat_map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Waits until the broker's serving thread sleeps in epoll_wait(2): every
/// event before now (a STATUS connection's close, say) has been served,
/// and only a new one wakes it. A test then knows that what the broker
/// does next was caused by what the test does next, not by a round a
/// STATUS left behind.
fn quiet(broker: &RunningBroker) {
    let wchan = format!("/proc/{}/wchan", broker.pid());
    wait_for(PATIENCE, "the broker to sleep in epoll_wait", || {
        std::fs::read_to_string(&wchan).is_ok_and(|w| w.contains("epoll_wait"))
    });
}

/// The holders STATUS lists, by label, and the pool's (held, free).
fn books(broker: &RunningBroker) -> (u32, u32) {
    let s = broker.status();
    (s.held, s.free)
}

fn threads_pass_tokens_in_the_region_without_waking_the_broker() {
    threads_pass_tokens_in(RING)
}

fn threads_pass_tokens_in(layout: u32) {
    const THREADS: usize = 6;
    const ROUNDS: u32 = 400;
    let broker = served_for(layout, 3);
    let _root = build_root(&broker);
    let clients: Vec<Client> = (0..THREADS)
        .map(|i| fast_client_in(&broker, &format!("t{i}"), layout))
        .collect();
    let running = Arc::new(AtomicU32::new(0));
    let most = Arc::new(AtomicU32::new(0));
    let before = switches(broker.pid());
    let threads: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let (running, most) = (running.clone(), most.clone());
            std::thread::spawn(move || {
                for _ in 0..ROUNDS {
                    client.acquire(1).unwrap();
                    let now = running.fetch_add(1, SeqCst) + 1;
                    most.fetch_max(now, SeqCst);
                    std::thread::yield_now();
                    running.fetch_sub(1, SeqCst);
                    client.release(1).unwrap();
                }
                assert_eq!(client.held(), 0);
                client
            })
        })
        .collect();
    let clients: Vec<Client> = threads
        .into_iter()
        .map(|t| join_within(t, PATIENCE, "a client thread"))
        .collect();
    let woken = switches(broker.pid()) - before;
    assert!(
        most.load(SeqCst) <= 3,
        "{} jobs ran at once on 3 tokens",
        most.load(SeqCst)
    );
    let operations = u64::from(ROUNDS) * THREADS as u64 * 2;
    assert!(
        woken * 10 < operations,
        "the broker slept and woke {woken} times for {operations} acquires and releases"
    );
    // The region holds the tokens lent to it (free there) while clients
    // are seated, and gives them back with its last client.
    let status = broker.status();
    assert_eq!(status.held, 3, "lent to the region: {status:#?}");
    drop(clients);
    wait_for(PATIENCE, "the region's tokens back in the pool", || {
        books(&broker) == (0, 3)
    });
}

/// A POSIX record lock on the whole of `file` (fcntl(2), `F_SETLKW`):
/// `F_WRLCK` to take it, waiting, or `F_UNLCK` to drop it. The kernel
/// drops a dying process's record locks as it closes its descriptors, at
/// once; an flock(2) lock goes only when its file is released, which on
/// exit comes after the socket's release more often than not (measured
/// while porting this test to C: still held when the broker saw the
/// connection close in 1,789 of 2,000 deaths, against 0 for record
/// locks), and a count would see a dead job beside the one that took its
/// token.
fn record_lock(file: &File, kind: i32) {
    let lock = libc::flock {
        l_type: kind as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    // SAFETY: a valid descriptor and a flock struct for the call.
    let done = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLKW, &lock) };
    assert_eq!(
        done,
        0,
        "fcntl(F_SETLKW): {}",
        std::io::Error::last_os_error()
    );
}

/// Whether another process holds a record lock on `file` (`F_GETLK`).
fn locked_by_another(file: &File) -> bool {
    let mut lock = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    // SAFETY: a valid descriptor and a flock struct the call fills.
    let done = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETLK, &mut lock) };
    assert_eq!(
        done,
        0,
        "fcntl(F_GETLK): {}",
        std::io::Error::last_os_error()
    );
    lock.l_type != libc::F_UNLCK as libc::c_short
}

/// A client process of the kill test: runs jobs one token at a time
/// until killed, each under a record lock of its own, which the kernel
/// drops when the process dies, and counts the jobs running at once from
/// the others' locks. A job's lock is taken and dropped only under the
/// scan lock, which the count is taken under too: no job starts or ends
/// during a count but by a death, which only lowers it, so a count never
/// sees one job twice.
fn job_here(spec: &str) -> ! {
    let mut dir = None;
    let (mut socket, mut index, mut limit) = (None, 0usize, 0u32);
    let (mut jobs, mut layout) = (0usize, RING);
    for (key, value) in spec_lines(spec) {
        match key {
            "dir" => dir = Some(std::path::PathBuf::from(value)),
            "socket" => socket = Some(std::path::PathBuf::from(value)),
            "index" => index = value.parse().unwrap(),
            "limit" => limit = value.parse().unwrap(),
            "jobs" => jobs = value.parse().unwrap(),
            "layout" => layout = value.parse().unwrap(),
            other => panic!("unknown key {other}"),
        }
    }
    let dir = dir.expect("dir=");
    let open = |name: &str| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(name))
            .unwrap()
    };
    let scan = open("scan");
    let locks: Vec<File> = (0..jobs).map(|j| open(&format!("job-{j}"))).collect();
    let mut progress = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("progress"))
        .unwrap();
    let mut client = Client::connect(socket.expect("socket="), "job").unwrap();
    enable(&mut client, layout).unwrap().unwrap();
    loop {
        if client.acquire(1).is_err() {
            std::process::exit(0);
        }
        record_lock(&scan, libc::F_WRLCK);
        record_lock(&locks[index], libc::F_WRLCK);
        let others = (0..jobs)
            .filter(|&j| j != index && locked_by_another(&locks[j]))
            .count();
        let running = 1 + others as u32;
        if running > limit {
            let _ = std::fs::write(
                dir.join("over"),
                format!("{running} jobs on {limit} tokens"),
            );
            std::process::exit(3);
        }
        record_lock(&scan, libc::F_UNLCK);
        progress.write_all(b".").unwrap();
        record_lock(&scan, libc::F_WRLCK);
        record_lock(&locks[index], libc::F_UNLCK);
        record_lock(&scan, libc::F_UNLCK);
        if client.release(1).is_err() {
            std::process::exit(0);
        }
    }
}

fn clients_killed_at_random_moments_never_run_more_jobs_than_the_limit_nor_lose_a_token() {
    clients_killed_at_random_moments_in(RING)
}

fn clients_killed_at_random_moments_in(layout: u32) {
    const JOBS: usize = 5;
    const KILLS: usize = 300;
    let broker = served_for(layout, 2);
    let _root = build_root(&broker);
    let dir = TempDir::new("fastpath-kill");
    for j in 0..JOBS {
        File::create(dir.path().join(format!("job-{j}"))).unwrap();
    }
    File::create(dir.path().join("progress")).unwrap();
    File::create(dir.path().join("scan")).unwrap();
    let spawn = |index: usize| {
        let spec = format!(
            "dir={}\nsocket={}\nindex={index}\nlimit=2\njobs={JOBS}\nlayout={layout}",
            dir.path().display(),
            broker.socket.display()
        );
        role_command("job", &spec).spawn().expect("a job client")
    };
    let mut children: Vec<_> = (0..JOBS).map(spawn).collect();
    let progress = || {
        std::fs::metadata(dir.path().join("progress"))
            .unwrap()
            .len()
    };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(std::process::id());
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for kill in 0..KILLS {
        let before = progress();
        std::thread::sleep(Duration::from_micros(next() % 15_000));
        let victim = (next() % JOBS as u64) as usize;
        children[victim].kill().unwrap();
        children[victim].wait().unwrap();
        assert!(
            !dir.path().join("over").exists(),
            "after {kill} kills: {}",
            std::fs::read_to_string(dir.path().join("over")).unwrap_or_default()
        );
        children[victim] = spawn(victim);
        if kill % 20 == 19 {
            wait_for(PATIENCE, "the clients to go on running jobs", || {
                progress() > before
            });
        }
    }
    for child in &mut children {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    assert!(!dir.path().join("over").exists());
    wait_for(PATIENCE, "every token back in the pool", || {
        books(&broker) == (0, 2)
    });
    let log = broker.log();
    let wrong: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("fast path"))
        .collect();
    assert!(
        wrong.is_empty(),
        "the broker found something wrong: {wrong:#?}"
    );
}

fn another_build_that_waits_closes_the_region_and_is_served_in_turn() {
    another_build_that_waits_in(RING)
}

fn another_build_that_waits_in(layout: u32) {
    use baton_core::protocol::{Reply, Request};
    let broker = served_for(layout, 2);
    // Another build: connected before the test says BUILD, so not in it.
    let mut other = broker.client("other");
    let root = build_root(&broker);
    let mut a = fast_client_in(&broker, "a", layout);
    let mut b = fast_client_in(&broker, "b", layout);
    a.acquire(1).unwrap();
    b.acquire(1).unwrap();
    other.send(&Request::Acquire(1)).unwrap();
    wait_for(PATIENCE, "the other build to wait", || {
        broker.status().builds.iter().any(|b| b.waiting > 0)
    });
    // a's release meets the barrier: the token goes back to the broker,
    // which grants it to the other build, not to a's own.
    quiet(&broker);
    a.release(1).unwrap();
    assert!(matches!(
        reply_within(&mut other).unwrap(),
        Reply::Granted { tokens: 1, held: 1 }
    ));
    // Nobody else waits now: a waits in the region, and the other build's
    // token, once back, is lent to the region and reaches it.
    let waiter = std::thread::spawn(move || {
        a.acquire(1).unwrap();
        a
    });
    other.release(1).unwrap();
    let mut a = join_within(waiter, PATIENCE, "a's acquire");
    assert_eq!((a.held(), b.held(), other.held()), (1, 1, 0));
    a.release(1).unwrap();
    b.release(1).unwrap();
    drop((a, b, root));
    wait_for(PATIENCE, "every token back", || books(&broker) == (0, 2));
}

fn a_lowered_limit_closes_the_region_until_it_holds_no_more() {
    a_lowered_limit_in(RING)
}

fn a_lowered_limit_in(layout: u32) {
    let broker = served_for(layout, 3);
    let _root = build_root(&broker);
    let mut a = fast_client_in(&broker, "a", layout);
    a.acquire(1).unwrap();
    a.acquire(1).unwrap();
    broker.client("admin").set_limit(1).unwrap();
    // The free token left the region at once; the two held come back
    // one by one, and the first is retired, not lent again.
    wait_for(PATIENCE, "the free token out of the region", || {
        books(&broker) == (2, 0)
    });
    quiet(&broker);
    a.release(1).unwrap();
    wait_for(PATIENCE, "the first token retired", || {
        books(&broker) == (1, 0)
    });
    assert!(
        !a.try_acquire(1).unwrap(),
        "nothing is free at the new limit"
    );
    a.release(1).unwrap();
    // Back under the limit: the region opens and is lent the one token.
    wait_for(PATIENCE, "the region to lend the token", || {
        a.try_acquire(1).unwrap()
    });
    assert!(!a.try_acquire(1).unwrap(), "one token at limit 1");
    a.release(1).unwrap();
}

/// Only `try_acquire(1)` goes through the region: a TRY of two is the
/// socket's, which grants both or neither (the region may hold the free
/// ones), never one of them.
fn a_try_of_two_with_a_seat_takes_two_or_none() {
    let broker = served(3, "");
    let _root = build_root(&broker);
    let mut a = fast_client(&broker, "a");
    wait_for(PATIENCE, "the region to lend a token", || {
        a.try_acquire(1).unwrap()
    });
    a.release(1).unwrap(); // back into the region, free there
    let took = a.try_acquire(2).unwrap();
    assert_eq!(
        a.held(),
        if took { 2 } else { 0 },
        "a TRY of two holds two or none"
    );
    if took {
        a.release(2).unwrap();
    }
    assert_eq!(a.held(), 0);
    drop(a);
    wait_for(PATIENCE, "every token back", || books(&broker) == (0, 3));
}

/// Where the broker cannot make a region (a kernel before 3.17 has no
/// memfd_create; here the kernel refuses it through a seccomp filter), a
/// client is told so and stays on the socket, where everything works.
#[cfg(target_arch = "x86_64")]
fn a_kernel_without_memfd_leaves_every_client_on_the_socket() {
    let broker = served(2, "no_memfd=1");
    let _root = build_root(&broker);
    let mut client = broker.client("no memfd");
    let refusal = client
        .enable_fastpath()
        .expect("FASTPATH answered")
        .expect_err("no seat without memfd_create");
    assert!(refusal.contains("memfd_create"), "{refusal}");
    assert!(!client.uses_fastpath());
    client.acquire(1).unwrap();
    client.acquire(1).unwrap();
    let status = broker.status();
    let mine: Vec<_> = status
        .holders
        .iter()
        .filter(|h| h.command == "no memfd")
        .map(|h| (h.tokens, h.transport.as_str()))
        .collect();
    assert_eq!(mine, [(2, "socket")], "{status:#?}");
    client.release(2).unwrap();
    assert_eq!(broker.status().free, 2);
}

fn a_waiter_whose_broker_is_killed_gives_up_instead_of_sleeping_forever() {
    a_waiter_whose_broker_is_killed_in(RING)
}

fn a_waiter_whose_broker_is_killed_in(layout: u32) {
    let mut broker = served_for(layout, 1);
    let _root = build_root(&broker);
    let mut a = fast_client_in(&broker, "a", layout);
    let mut b = fast_client_in(&broker, "b", layout);
    a.acquire(1).unwrap();
    let waiter = std::thread::spawn(move || b.acquire(1));
    // b sleeps in the region: nothing tells the broker.
    std::thread::sleep(Duration::from_millis(100));
    broker.stop_with(libc::SIGKILL);
    let (done_tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || done_tx.send(waiter.join().unwrap()));
    let outcome = done.recv_timeout(PATIENCE).expect("the waiter gave up");
    assert!(outcome.is_err(), "no broker, no token: {outcome:?}");
    assert!(a.release(1).is_err(), "a's broker is gone too");
}

/// A client whose broker is killed while it holds a token taken in the
/// region still counts it once it finds the region dead: `held()` is what
/// it tells the next broker it holds (HOLD, as `baton run` re-attaching
/// does), and a count that forgot the region's tokens would let that
/// broker grant them again while they are in use.
fn a_client_whose_broker_is_killed_still_counts_what_it_took_in_the_region() {
    let mut broker = served(2, "");
    let _root = build_root(&broker);
    let mut a = fast_client(&broker, "a");
    a.acquire(1).unwrap();
    broker.stop_with(libc::SIGKILL);
    assert!(a.release(1).is_err(), "no broker to give it back to");
    assert!(!a.uses_fastpath(), "the region's broker is gone");
    assert_eq!(a.held(), 1, "the token is still a's");
}

fn a_successor_books_what_fast_path_clients_hold_on_their_connections() {
    a_successor_books_in(RING)
}

fn a_successor_books_in(layout: u32) {
    let mut old = served_for(layout, 3);
    let _root = build_root(&old);
    let mut a = fast_client_in(&old, "a", layout);
    a.acquire(1).unwrap();
    a.acquire(1).unwrap();
    // STATUS reads the region: a holds two, the third is free there.
    let status = old.status();
    let mut held: Vec<_> = status
        .holders
        .iter()
        .map(|h| (h.command.clone(), h.tokens))
        .collect();
    held.sort();
    let build = status.holders[0].build;
    let free = if layout == PILE {
        format!("[fast path of build {build}: free on its pile]")
    } else {
        format!("[fast path of build {build}: free in its region]")
    };
    assert_eq!(held, [(free, 1), ("a".to_string(), 2)], "{status:#?}");
    assert_eq!((status.held, status.free), (3, 0));
    let new = served_at(&old.socket, "jobs=9\nreplace=1");
    assert!(old.wait_exit(PATIENCE).success(), "{}", old.log());
    let status = new.status();
    let held: Vec<_> = status
        .holders
        .iter()
        .map(|h| (h.command.as_str(), h.tokens))
        .collect();
    assert_eq!(held, [("a", 2)], "{status:#?}");
    assert_eq!(a.held(), 2);
    a.release(1).unwrap();
    assert!(!a.uses_fastpath(), "the region died with the old broker");
    a.release(1).unwrap();
    assert_eq!(a.held(), 0);
    new.wait_all_free();
}

fn garbage_in_a_record_is_found_logged_and_its_clients_dropped_to_the_socket() {
    use baton_client::fastpath::Mapping;
    use baton_core::fastpath::words::RecordWord;
    use baton_core::fastpath::Seat;
    let broker = served(2, "");
    let _root = build_root(&broker);
    let mut honest = fast_client(&broker, "honest");
    honest.acquire(1).unwrap();
    // A client of our own that writes into its record what no correct
    // client writes: it holds 7 tokens of 2.
    let stream = std::os::unix::net::UnixStream::connect(&broker.socket).unwrap();
    let mut writer = stream.try_clone().unwrap();
    writer.write_all(b"HELLO 1 garbage\nFASTPATH 1\n").unwrap();
    let mut hello = [0u8; 1];
    let mut first = String::new();
    while !first.ends_with('\n') {
        std::io::Read::read_exact(&mut &stream, &mut hello).unwrap();
        first.push(hello[0] as char);
    }
    let (line, fd) = baton_client::fastpath::receive_with_fd(&stream).unwrap();
    let seat: u16 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let region = Mapping::map(std::os::fd::AsFd::as_fd(&fd.expect("the region"))).unwrap();
    let garbage = RecordWord {
        held: 7,
        ..RecordWord::default()
    };
    region
        .ring()
        .record_word(Seat(seat))
        .store(garbage.pack(), SeqCst);
    // Nobody wakes the broker now (the honest client's region is open):
    // its audit clock does, once a second while a region exists.
    wait_for(PATIENCE, "the audit to find it", || {
        broker.log().contains("fast path: a region counts")
    });
    assert!(
        broker
            .log()
            .contains("every client of it is dropped to the socket path"),
        "{}",
        broker.log()
    );
    let mut late = broker.client("late");
    let refused = late.enable_fastpath().unwrap();
    assert!(refused.is_err(), "the build gets no region again");
    // The honest client's token was booked on its connection: it gives
    // it back over the socket, and goes on there.
    honest.release(1).unwrap();
    assert!(!honest.uses_fastpath(), "dropped to the socket");
    assert_eq!(books(&broker), (0, 2), "every token back in the pool");
    honest.acquire(1).unwrap();
    honest.release(1).unwrap();
    assert_eq!(broker.status().totals.fastpath_mismatches, 1);
    drop((stream, writer, region));
}

/// RELEASE of more than a connection holds is refused whole (docs/
/// protocol.md, `over-release`): nothing is given back. With a seat, the
/// tokens held in the region must not go back before the broker refuses
/// the rest (as libbaton's baton_release checks first): a caller told
/// "refused" still holds, and still counts, what it held.
fn a_release_of_more_than_is_held_with_a_seat_gives_back_nothing() {
    let broker = served(2, "");
    let _root = build_root(&broker);
    let mut a = fast_client(&broker, "a");
    a.acquire(1).unwrap();
    match a.release(2) {
        Err(baton_client::Error::Refused { code, .. }) => {
            assert_eq!(code, baton_core::protocol::ErrorCode::OverRelease)
        }
        other => panic!("RELEASE 2 with one token held: {other:?}"),
    }
    assert_eq!(a.held(), 1, "refused: the token is still a's");
    let holders: Vec<_> = broker
        .status()
        .holders
        .iter()
        .filter(|h| h.command == "a")
        .map(|h| h.tokens)
        .collect();
    assert_eq!(holders, [1], "the region still says a holds it");
    a.release(1).unwrap();
    assert_eq!(a.held(), 0);
    // The region lends the pool's free tokens while it lives: it goes
    // with its last client.
    drop(a);
    broker.wait_all_free();
}

/// A client of our own that writes into a token word of the pile what no
/// correct client writes: the audit finds it, logs it, and drops the
/// pile's clients to the socket with what its words say they hold; the
/// build gets no region again, and nothing is lost.
fn a_forged_token_word_is_found_logged_and_its_clients_dropped_to_the_socket() {
    let broker = served(2, "");
    let _root = build_root(&broker);
    let mut honest = fast_client_in(&broker, "honest", PILE);
    honest.acquire(1).unwrap();
    let mut forger = fast_client_in(&broker, "forger", PILE);
    // The forger's own mapping of the pile, as any client of it has.
    let (stream, region) = raw_pile_seat(&broker, "forger");
    // Every token word of the pile, lent or not: the one honest holds is
    // left alone, the others get a word no correct client writes.
    let pile = region.pile();
    let mine = baton_core::fastpath::pile::TokenWord::Held {
        seat: baton_core::fastpath::Seat(0),
        recalled: false,
    };
    let forged: usize = (0..pile.tokens())
        .filter(|&i| pile.token_word(i) != mine)
        .map(|i| region.words()[16 + i].store(u64::MAX, SeqCst))
        .count();
    assert_eq!(forged, 1, "one of the two tokens is not honest's");
    // A client that finds no token sleeps on the pile (almost always before
    // the audit, which comes within a second): when the pile ends it must
    // wake, see the broker gone from it, and wait on the socket instead.
    let mut sleeper = fast_client_in(&broker, "sleeper", PILE);
    let asleep = std::thread::spawn(move || sleeper.acquire(1).map(|()| sleeper));
    wait_for(PATIENCE, "the audit to find it", || {
        broker
            .log()
            .contains("fast path: a pile holds a token word no correct client writes")
    });
    let mut late = broker.client("late");
    assert!(
        late.enable_fastpath_pile().unwrap().is_err(),
        "the build gets no region again"
    );
    let mut sleeper = join_within(asleep, PATIENCE, "the sleeper's acquire").unwrap();
    assert_eq!(sleeper.held(), 1, "served over the socket");
    assert!(!sleeper.uses_fastpath());
    sleeper.release(1).unwrap();
    // Honest's token was booked on its connection: it gives it back over
    // the socket, and goes on there.
    honest.release(1).unwrap();
    assert!(!honest.uses_fastpath(), "dropped to the socket");
    assert_eq!(books(&broker), (0, 2), "every token back in the pool");
    honest.acquire(1).unwrap();
    forger.acquire(1).unwrap();
    assert!(!forger.uses_fastpath());
    assert_eq!(books(&broker), (2, 0));
    honest.release(1).unwrap();
    forger.release(1).unwrap();
    assert_eq!(broker.status().totals.fastpath_mismatches, 1);
    drop((stream, region));
}

/// A connection in raw protocol with a seat in its build's pile, and the
/// pile mapped as a client maps it (its words, for a test to write or
/// read as no library would).
fn raw_pile_seat(
    broker: &RunningBroker,
    label: &str,
) -> (
    std::os::unix::net::UnixStream,
    baton_client::fastpath::Mapping,
) {
    let stream = std::os::unix::net::UnixStream::connect(&broker.socket).unwrap();
    let hello = format!("HELLO 1 {label}\nFASTPATH 2\n");
    (&stream).write_all(hello.as_bytes()).unwrap();
    let mut byte = [0u8; 1];
    let mut first = String::new();
    while !first.ends_with('\n') {
        std::io::Read::read_exact(&mut &stream, &mut byte).unwrap();
        first.push(byte[0] as char);
    }
    let (line, fd) = baton_client::fastpath::receive_with_fd(&stream).unwrap();
    assert!(line.starts_with("FASTPATH "), "{line}");
    let fd = fd.expect("the pile");
    let region = baton_client::fastpath::Mapping::map(std::os::fd::AsFd::as_fd(&fd)).unwrap();
    assert!(region.is_pile());
    (stream, region)
}

/// The broker lets go of a pile's liveness word when its last client
/// leaves: whoever still maps it (a process that inherited the mapping
/// would) sees no broker there, instead of waiting on it for ever.
fn a_pile_whose_last_client_leaves_says_so_to_a_mapping_left_open() {
    let broker = served_for(PILE, 1);
    let _root = build_root(&broker);
    let (stream, region) = raw_pile_seat(&broker, "last");
    assert!(region.broker_alive());
    drop(stream);
    wait_for(PATIENCE, "the broker to let go of the pile", || {
        !region.broker_alive()
    });
    broker.wait_all_free();
}

/// A build's first fast-path client chooses its layout: a client of the
/// build asking for the other is told so and stays on the socket, where
/// its tokens come from the same pool.
fn a_build_keeps_the_layout_its_first_fast_path_client_chose() {
    let broker = served(2, "");
    let _root = build_root(&broker);
    let mut piled = fast_client_in(&broker, "piled", PILE);
    let mut ringed = broker.client("ringed");
    let refused = ringed.enable_fastpath().unwrap().unwrap_err();
    assert!(refused.contains("FASTPATH 2"), "{refused}");
    assert!(!ringed.uses_fastpath());
    piled.acquire(1).unwrap();
    ringed.acquire(1).unwrap();
    assert_eq!(books(&broker), (2, 0));
    piled.release(1).unwrap();
    ringed.release(1).unwrap();
    drop(piled);
    broker.wait_all_free();
}

/// One token, and two clients of a pile taking it in turn as fast as they
/// can: there is nearly always somebody asleep on the pile, so a token
/// the pile's clients put back would be taken again at once. Another
/// build that asks is still served: the closed pile recalls the token,
/// and its holder's release hands it to the broker, which is told. The
/// broker is never woken by its audit clock here (once an hour).
fn another_build_is_served_while_the_piles_clients_keep_taking_its_token() {
    use baton_core::protocol::{Reply, Request};
    let broker = served_for(PILE, 1);
    let mut other = broker.client("other");
    let root = build_root(&broker);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churners: Vec<_> = (0..2)
        .map(|i| {
            let mut client = fast_client_in(&broker, &format!("churn{i}"), PILE);
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(SeqCst) {
                    client.acquire(1).unwrap();
                    client.release(1).unwrap();
                    rounds += 1;
                }
                (client, rounds)
            })
        })
        .collect();
    for turn in 0..20 {
        other.send(&Request::Acquire(1)).unwrap();
        match reply_within(&mut other).unwrap() {
            Reply::Granted { tokens: 1, held: 1 } => {}
            reply => panic!("turn {turn}: {reply:?}"),
        }
        other.release(1).unwrap();
    }
    stop.store(true, SeqCst);
    let rounds: Vec<u64> = churners
        .into_iter()
        .map(|t| {
            let (client, rounds) = join_within(t, PATIENCE, "a churning client");
            assert_eq!(client.held(), 0);
            rounds
        })
        .collect();
    // Not each: in a pile a client can be passed over for as long as
    // another keeps coming back (docs/fastpath.md, "The pile").
    assert!(
        rounds.iter().sum::<u64>() > 0,
        "the pile's clients took turns"
    );
    drop(root);
    broker.wait_all_free();
}
