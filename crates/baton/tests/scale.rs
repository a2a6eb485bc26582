//! Many clients connected at once: every one of them is granted a token
//! in turn through a queue as deep as they are many, and every token is
//! back at the end. The figures (the broker's resident memory) are printed.
//!
//! The test suite connects 1,000 (the debug broker's pool is slow to
//! build with ten times that); scripts/soak runs it with
//! `BATON_SCALE_CLIENTS=10000` against the release build, for the figures
//! in docs/benchmarks.md.

mod common;

use common::{hello_as, rss_kib, Missing, RunningBroker};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

fn clients() -> usize {
    std::env::var("BATON_SCALE_CLIENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000)
}
/// Descriptors this test needs beside its clients' (cargo's, the broker's
/// pipes), with room.
const SPARE_FDS: u64 = 128;

/// Raises this process's open-file limit to its hard limit (the broker,
/// our child, inherits the hard limit and raises its own); false, with the
/// skip recorded, if even that is too low.
fn enough_files(needed: u64) -> bool {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct we pass.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    if lim.rlim_max < needed {
        let reason = format!(
            "needs {needed} open files, the hard limit is {} (raise it: ulimit -Hn {needed})",
            lim.rlim_max
        );
        common::skip(Missing::FileLimit, &reason);
        return false;
    }
    lim.rlim_cur = lim.rlim_max;
    assert_eq!(
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) },
        0,
        "raising the open-file limit"
    );
    true
}

/// A client speaking the protocol on a bare socket: a `Client` each would
/// cost this test 10,000 read buffers.
fn hello(socket: &std::path::Path, i: usize) -> UnixStream {
    hello_as(socket, &format!("scale-{i}"))
}

/// Waits for readable clients with epoll: 10,000 descriptors are too many
/// to poll() in turn.
struct Ready(i32);

impl Ready {
    fn new(clients: &[UnixStream]) -> Self {
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(epoll >= 0, "epoll_create1");
        for (i, c) in clients.iter().enumerate() {
            let mut event = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: i as u64,
            };
            // SAFETY: epoll and the client's descriptor are open; the event is ours.
            assert_eq!(
                unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, c.as_raw_fd(), &mut event) },
                0,
                "epoll_ctl"
            );
        }
        Ready(epoll)
    }

    /// Indices of readable clients; waits at most a second.
    fn wait(&self) -> Vec<usize> {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        // SAFETY: the buffer holds as many events as we say.
        let n = unsafe { libc::epoll_wait(self.0, events.as_mut_ptr(), events.len() as i32, 1000) };
        events[..n.max(0) as usize]
            .iter()
            .map(|e| e.u64 as usize)
            .collect()
    }
}

impl Drop for Ready {
    fn drop(&mut self) {
        unsafe { libc::close(self.0) };
    }
}

fn reply(client: &mut UnixStream) -> String {
    // One short reply is in flight per client at a time: it arrives whole.
    let mut buf = [0u8; 64];
    let n = client.read(&mut buf).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn many_connected_clients_are_each_granted_in_turn() {
    let n = clients();
    if !enough_files(n as u64 + SPARE_FDS) {
        return;
    }
    let broker = RunningBroker::start_with(4, &["--quiet"]);
    let (rss_before, _) = rss_kib(broker.pid());
    let started = Instant::now();
    let mut clients: Vec<UnixStream> = (0..n).map(|i| hello(&broker.socket, i)).collect();
    let connected = started.elapsed();
    for c in &mut clients {
        c.write_all(b"ACQUIRE 1\n").unwrap();
    }

    // Every client holds its token a moment and gives it back; the broker
    // grants the next waiter. Hang guard: no grant for 60 s.
    let ready = Ready::new(&clients);
    let (mut granted, mut released, mut last_progress) = (0, 0, Instant::now());
    while released < n {
        assert!(
            last_progress.elapsed() < Duration::from_secs(60),
            "no grant for 60 s: {granted} granted, {released} released"
        );
        for i in ready.wait() {
            let line = reply(&mut clients[i]);
            match line.split(' ').next() {
                Some("GRANTED") => {
                    granted += 1;
                    clients[i].write_all(b"RELEASE 1\n").unwrap();
                }
                Some("RELEASED") => released += 1,
                _ => panic!("client {i} got {line:?}"),
            }
            last_progress = Instant::now();
        }
    }
    let flowed = started.elapsed() - connected;
    let (rss, peak) = rss_kib(broker.pid());
    eprintln!(
        "{n} clients: connected in {connected:.2?}, {granted} grants in {flowed:.2?}; broker RSS {rss_before} KiB idle, {rss} KiB with them, peak {peak} KiB"
    );
    assert_eq!(granted, n, "every client was granted once");
    broker.assert_all_free();
    assert!(
        clients.iter_mut().all(|c| c.write_all(b"TRY 1\n").is_ok()),
        "the broker dropped a client"
    );
    drop(ready);
    drop(clients);
    broker.assert_all_free();
}

/// One reply may be longer than the broker's bound on unsent output (1
/// MiB, which cuts off clients that do not read): a STATUS listing
/// thousands of waiting clients with long labels reaches the client that
/// asked for it, whole.
#[test]
fn a_status_longer_than_the_unsent_bound_reaches_its_reader() {
    const WAITERS: usize = 5_000;
    if !enough_files(WAITERS as u64 + SPARE_FDS) {
        return;
    }
    let broker = RunningBroker::start_with(1, &["--quiet"]);
    let mut holder = broker.client("the holder of the one token");
    holder.acquire(1).unwrap();
    let long = "w".repeat(180);
    let mut waiters: Vec<UnixStream> = (0..WAITERS)
        .map(|i| hello_as(&broker.socket, &format!("{long}-{i}")))
        .collect();
    for w in &mut waiters {
        w.write_all(b"ACQUIRE 1\n").unwrap();
    }
    wait_for_waiters(&broker, WAITERS);
    // Asked for, and read only once the broker has written what the
    // socket takes and kept the rest (a reader as slow as a loaded
    // machine makes one): part of the reply waits in our socket, and the
    // broker watches its end for room to write more.
    let epolls = epoll_fds(broker.pid());
    // The status read above may still be leaving: nothing stuck before we
    // ask, or the wait below would prove nothing.
    common::wait_for(
        Duration::from_secs(60),
        "the broker to have no output waiting",
        || !waits_to_write(broker.pid(), &epolls),
    );
    let mut reader = hello_as(&broker.socket, "a slow reader");
    reader.write_all(b"STATUS\n").unwrap();
    common::wait_for(
        Duration::from_secs(60),
        "the broker to fill the reader's socket and keep the rest",
        || unread(&reader) > 0 && waits_to_write(broker.pid(), &epolls),
    );
    let mut reader = BufReader::new(reader);
    let mut head = String::new();
    reader.read_line(&mut head).unwrap();
    let length: usize = head
        .trim()
        .strip_prefix("STATUS ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("got {head:?}"));
    assert!(
        length > 3 << 19,
        "the status must be longer than the bound and the socket's buffers: {length} bytes"
    );
    let mut json = vec![0u8; length];
    reader
        .read_exact(&mut json)
        .unwrap_or_else(|e| panic!("the broker cut the reply short: {e}"));
    let status: baton_core::status::Status = serde_json::from_slice(&json).unwrap();
    assert_eq!(status.waiters.len(), WAITERS);
    drop(waiters);
    holder.release(1).unwrap();
    broker.assert_all_free();
}

/// Bytes waiting to be read in `stream`'s socket.
fn unread(stream: &UnixStream) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int to the pointer given.
    let r = unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(r, 0, "FIONREAD: {}", std::io::Error::last_os_error());
    n as usize
}

/// The descriptors of process `pid` that are epoll instances.
fn epoll_fds(pid: u32) -> Vec<String> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap();
    let epolls: Vec<String> = fds
        .flatten()
        .filter(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|to| to.as_os_str() == "anon_inode:[eventpoll]")
        })
        .map(|fd| fd.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!epolls.is_empty(), "the broker {pid} has no epoll");
    epolls
}

/// Whether one of process `pid`'s epolls watches a descriptor for room to
/// write (EPOLLOUT in its fdinfo): the broker asks for that only while a
/// connection's output is stuck.
fn waits_to_write(pid: u32, epolls: &[String]) -> bool {
    epolls.iter().any(|fd| {
        std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
            .unwrap_or_default()
            .lines()
            .filter(|line| line.starts_with("tfd:"))
            .filter_map(|line| {
                let mask = line
                    .split_whitespace()
                    .skip_while(|w| *w != "events:")
                    .nth(1)?;
                u32::from_str_radix(mask, 16).ok()
            })
            .any(|mask| mask & libc::EPOLLOUT as u32 != 0)
    })
}

fn wait_for_waiters(broker: &RunningBroker, n: usize) -> baton_core::status::Status {
    let started = Instant::now();
    loop {
        let status = broker.status();
        if status.waiters.len() == n {
            return status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} of {n} waiting after a minute",
            status.waiters.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
