//! Fast-path clients killed with SIGKILL at random points, in real
//! processes sharing one sealed memfd and sleeping in real futexes
//! (docs/fastpath.md, "When a client dies"). This test plays the broker:
//! it makes the region, starts the clients, kills one at a random moment,
//! repairs its seat among the others' steps, gives the tokens it took back
//! to the queue, and starts a new client on the seat.
//!
//! Counted two ways: from the region and the broker's hands (every token
//! lent is in exactly one place, and all are free at the end), and from
//! the jobs themselves: each client sets its bit in a shared word while
//! it runs a job, and fails the test if it ever finds more bits than
//! tokens lent. A killed client's job dies with it, and the broker clears
//! its bit. And nobody sleeps forever: every live client keeps making
//! progress after every kill and repair.

use baton_client::fastpath::{Futexes, Mapping};
use baton_core::fastpath::words::SlotWord;
use baton_core::fastpath::{Acquired, Books, Refused, Ring, Seat};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

const LENT: u32 = 3;
const CLIENTS: usize = 6;
/// Kills in one run: the issue asks for hundreds.
const KILLS: usize = 200;

/// The jobs' shared words: which seats run a job, each client's count of
/// jobs done (its progress), and a violation flag.
const RUNNING: usize = 0;
const VIOLATION: usize = 1;
const DONE: usize = 8;

/// A client process: maps the region (descriptor 3) and the jobs' words
/// (descriptor 4) and runs jobs on `seat` until it is killed. The test
/// binary runs it in its children (`BATON_FASTPATH_SEAT`).
fn client(seat: &str) -> ! {
    let seat = Seat(seat.parse().unwrap());
    // SAFETY: the parent put them there, open, for this process.
    let (region, jobs) = unsafe { (BorrowedFd::borrow_raw(3), BorrowedFd::borrow_raw(4)) };
    let region = Mapping::map(region).unwrap();
    let jobs = Jobs::map(jobs);
    let ring = region.ring();
    let host = Futexes { tell: |_| {} };
    let bit = 1u64 << seat.0;
    loop {
        match ring.acquire(seat, &host, None) {
            Ok(Acquired::Token) => {}
            // A client stopped a lap behind holds a slot: a real client
            // would ask the socket; this one tries again.
            Err(Refused::Full) => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            other => panic!("{seat:?}: {other:?}"),
        }
        let before = jobs.word(RUNNING).fetch_or(bit, SeqCst);
        if (before | bit).count_ones() > LENT {
            jobs.word(VIOLATION).store(before | bit, SeqCst);
        }
        std::hint::spin_loop();
        jobs.word(RUNNING).fetch_and(!bit, SeqCst);
        ring.release(seat, &host).unwrap();
        jobs.word(DONE + usize::from(seat.0)).fetch_add(1, SeqCst);
    }
}

/// The jobs' words: a shared anonymous page the clients inherit by
/// descriptor, as the region.
struct Jobs {
    mapping: Mapping,
    fd: Option<OwnedFd>,
}

impl Jobs {
    fn new() -> Self {
        // A region of its own layout is the quickest sealed shared page.
        let (mapping, fd) = Mapping::create(8, 8, 0).unwrap();
        Jobs {
            mapping,
            fd: Some(fd),
        }
    }

    fn map(fd: BorrowedFd) -> Self {
        Jobs {
            mapping: Mapping::map(fd).unwrap(),
            fd: None,
        }
    }

    /// Word `i` of the region's last seat lines: no ring runs on this
    /// region, so they are free for the test's use.
    fn word(&self, i: usize) -> &AtomicU64 {
        let words = self.mapping.words();
        &words[words.len() - 32 + i]
    }
}

fn start_client(seat: usize, region: &OwnedFd, jobs: &Jobs) -> Child {
    let (region, jobs) = (region.as_raw_fd(), jobs.fd.as_ref().unwrap().as_raw_fd());
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "clients_killed_at_random_points_lose_and_create_no_token",
        ])
        .env("BATON_FASTPATH_SEAT", seat.to_string())
        .stdout(Stdio::null());
    // SAFETY: fcntl, prctl and dup2 are async-signal-safe. Copies above 10
    // first, so that neither lands on the other; dup2's copies, at 3 and
    // 4 where the client looks, are not closed on exec.
    unsafe {
        command.pre_exec(move || {
            let (r, j) = (
                libc::fcntl(region, libc::F_DUPFD, 10),
                libc::fcntl(jobs, libc::F_DUPFD, 10),
            );
            // A test that fails half-way leaves no client behind.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if r < 0 || j < 0 || libc::dup2(r, 3) < 0 || libc::dup2(j, 4) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    command.spawn().expect("start a fast-path client")
}

/// Waits until every client's count of jobs done has moved on: nobody
/// sleeps forever.
fn wait_for_progress(jobs: &Jobs, ring: &Ring, in_hand: &mut u32, kill: usize) {
    let before: Vec<u64> = (0..CLIENTS)
        .map(|s| jobs.word(DONE + s).load(SeqCst))
        .collect();
    let start = Instant::now();
    for (seat, &done) in before.iter().enumerate() {
        while jobs.word(DONE + seat).load(SeqCst) == done {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "after kill {kill}, the client on seat {seat} made no progress for a minute:\n{}",
                dump(ring)
            );
            std::thread::sleep(Duration::from_millis(1));
            tend(ring, in_hand);
        }
    }
}

/// The ring's slots and records, for a failure's message.
fn dump(ring: &Ring) -> String {
    let slots = (0..ring.capacity()).map(|i| {
        let word = SlotWord::unpack(ring.slot_word(i).load(SeqCst));
        format!("slot {i}: {word:?}\n")
    });
    let records = (0..CLIENTS).map(|s| format!("seat {s}: {:?}\n", ring.record(Seat(s as u16))));
    let hints = format!(
        "tail {} serve {}\n",
        ring.hint_word(baton_core::fastpath::ring::TAIL),
        ring.hint_word(baton_core::fastpath::ring::SERVE)
    );
    std::iter::once(hints).chain(slots).chain(records).collect()
}

/// The broker's repair of `seat`, among the live clients' steps, then
/// its usual round.
fn repair(ring: &Ring, seat: usize, in_hand: &mut u32) {
    let host = Futexes { tell: |_| {} };
    while ring
        .repair_step(Seat(seat as u16), in_hand, &host)
        .unwrap()
        .is_some()
    {}
    tend(ring, in_hand);
}

/// What the broker does when a client tells it that it returned a token
/// (a release that met a full ring): it collects what every client
/// returned and gives what it holds to the queue. These clients cannot
/// tell, so the test tends the ring whenever it waits.
fn tend(ring: &Ring, in_hand: &mut u32) {
    let host = Futexes { tell: |_| {} };
    for s in 0..CLIENTS {
        ring.collect_step(Seat(s as u16), in_hand).unwrap();
    }
    while *in_hand > 0 {
        match ring.regrant_step(in_hand, &host) {
            Ok(Some(_)) => {}
            Ok(None) => panic!("no barrier, yet {in_hand} token(s) could not be given"),
            // A client stopped a lap behind: the broker tries again at
            // its next round.
            Err(Refused::Full) => return,
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn clients_killed_at_random_points_lose_and_create_no_token() {
    if let Ok(seat) = std::env::var("BATON_FASTPATH_SEAT") {
        client(&seat);
    }
    let (region, fd) = Mapping::create(64, CLIENTS, LENT).unwrap();
    let ring = region.ring();
    let jobs = Jobs::new();
    let mut clients: Vec<Child> = (0..CLIENTS).map(|s| start_client(s, &fd, &jobs)).collect();
    let mut in_hand = 0;
    let mut dice = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(std::process::id());
    let mut roll = |n: u64| {
        dice ^= dice << 13;
        dice ^= dice >> 7;
        dice ^= dice << 17;
        dice % n
    };
    for kill in 0..KILLS {
        let seat = roll(CLIENTS as u64) as usize;
        let until = Instant::now() + Duration::from_micros(roll(2_000));
        while Instant::now() < until {
            tend(&ring, &mut in_hand);
            std::thread::yield_now();
        }
        // SAFETY: our own child, by pid.
        unsafe { libc::kill(clients[seat].id() as i32, libc::SIGKILL) };
        clients[seat].wait().unwrap();
        // Its job died with it.
        jobs.word(RUNNING).fetch_and(!(1 << seat), SeqCst);
        repair(&ring, seat, &mut in_hand);
        clients[seat] = start_client(seat, &fd, &jobs);
        assert_eq!(
            jobs.word(VIOLATION).load(SeqCst),
            0,
            "more jobs than tokens ran"
        );
        if kill % 20 == 0 {
            wait_for_progress(&jobs, &ring, &mut in_hand, kill);
        }
    }
    wait_for_progress(&jobs, &ring, &mut in_hand, KILLS);
    for (seat, client) in clients.iter_mut().enumerate() {
        let _ = client.kill();
        client.wait().unwrap();
        jobs.word(RUNNING).fetch_and(!(1 << seat), SeqCst);
        repair(&ring, seat, &mut in_hand);
    }
    assert_eq!(in_hand, 0, "every token taken back went to the queue");
    let violation = jobs.word(VIOLATION).load(SeqCst);
    assert_eq!(
        violation, 0,
        "seats {violation:#b} ran jobs at once on {LENT} tokens"
    );
    let (snapshot, _) = ring.snapshot().unwrap();
    let books = Books {
        lent: LENT,
        in_hand,
        ..Books::default()
    };
    let audit = snapshot.audit(&books);
    assert!(audit.balanced(), "{audit:?}");
    assert_eq!(snapshot.free(), LENT, "every token is free again");
    let done: u64 = (0..CLIENTS).map(|s| jobs.word(DONE + s).load(SeqCst)).sum();
    assert!(done > KILLS as u64, "the clients ran {done} jobs in all");
}
