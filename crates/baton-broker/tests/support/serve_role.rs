// Each includer uses what it needs of these.
#![allow(dead_code)]

//! The broker as a test binary serves it (`baton_testkit::harness`): this
//! binary started again in the `serve` role calls [`baton_broker::serve`]
//! on its main thread, as `baton serve` does. Shared by this crate's
//! tests/served.rs and baton-jobserver's tests, which need a broker
//! without the baton binary.

use baton_broker::{serve, FuseOptions, LogLevel, ServeOptions, MAX_CLIENTS};
use baton_core::gates::GateConfig;
use baton_testkit::harness::{role_command, spec_lines};
use baton_testkit::{RunningBroker, TempDir};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Serves as `baton serve` would with the options of `spec` (`key=value`
/// lines: jobs, socket, io_uring, max_clients, replace, idle_ms, metrics,
/// fuse, orphan_ms, reclaim_ms, min_mem, pause, max_load, max_pressure, log, allow_uid, allow_group),
/// then
/// exits as it does: 0 after a clean stop, 1 with
/// the reason logged.
pub fn serve_here(spec: &str) -> ! {
    let mut opts = ServeOptions {
        jobs: 2,
        socket: None,
        fuse: None,
        spin_us: 0,
        io_uring: false,
        log_level: LogLevel::Debug,
        max_clients: MAX_CLIENTS,
        gates: GateConfig::default(),
        idle_timeout: None,
        cluster: None,
        replace: false,
        reclaim_grace: Duration::ZERO,
        metrics_listen: None,
        allow_uids: Vec::new(),
        allow_groups: Vec::new(),
    };
    for (key, value) in spec_lines(spec) {
        match key {
            "jobs" => opts.jobs = value.parse().unwrap(),
            // Before the broker starts: it reads the period once.
            "audit_ms" => std::env::set_var("BATON_FASTPATH_AUDIT_MS", value),
            "socket" => opts.socket = Some(value.into()),
            "io_uring" => opts.io_uring = value == "1",
            "max_clients" => opts.max_clients = value.parse().unwrap(),
            "replace" => opts.replace = value == "1",
            "idle_ms" => opts.idle_timeout = Some(Duration::from_millis(value.parse().unwrap())),
            "metrics" => opts.metrics_listen = Some(value.parse().unwrap()),
            "fuse" => opts.fuse = Some(FuseOptions::default()),
            "fuse_hold_ms" => {
                opts.fuse.get_or_insert_with(FuseOptions::default).hold =
                    Duration::from_millis(value.parse().unwrap())
            }
            "min_mem" => opts.gates.min_mem_available = Some(value.parse().unwrap()),
            "pause" => opts.gates.pause = value == "1",
            "allow_uid" => opts.allow_uids.push(value.parse().unwrap()),
            "allow_group" => opts.allow_groups.push(value.to_string()),
            "log" => {
                opts.log_level = match value {
                    "warn" => LogLevel::Warn,
                    "info" => LogLevel::Info,
                    "debug" => LogLevel::Debug,
                    other => panic!("log level {other}"),
                }
            }
            "max_load" => opts.gates.max_load = Some(value.parse().unwrap()),
            "max_pressure" => opts.gates.max_mem_pressure = Some(value.parse().unwrap()),
            // How long a killed broker's mount waits for the next broker.
            "orphan_ms" => {
                let fuse = opts.fuse.get_or_insert_with(FuseOptions::default);
                fuse.orphan_grace = Duration::from_millis(value.parse().unwrap());
            }
            "reclaim_ms" => opts.reclaim_grace = Duration::from_millis(value.parse().unwrap()),
            "no_memfd" => refuse_memfd_create(),
            other => panic!("the serve role: unknown key {other}"),
        }
    }
    match serve(opts) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            baton_broker::log_fatal(&format!("{e:#}"));
            std::process::exit(1)
        }
    }
}

/// This binary, set to serve at `socket` with `spec` (besides the socket).
pub fn serve_command(socket: &Path, spec: &str) -> Command {
    role_command("serve", &format!("socket={}\n{spec}", socket.display()))
}

/// A broker of `jobs` tokens served by this binary with `spec`, in a
/// temporary directory; stopped by pid when dropped.
pub fn served(jobs: u32, spec: &str) -> RunningBroker {
    let dir = TempDir::new("served");
    let socket = dir.path().join("run").join("socket");
    let command = serve_command(&socket, &format!("jobs={jobs}\n{spec}"));
    RunningBroker::start_command(command, dir, socket)
}

/// Another broker at `socket` served by this binary with `spec`, logging
/// in a directory of its own.
pub fn served_at(socket: &Path, spec: &str) -> RunningBroker {
    let dir = TempDir::new("served-again");
    RunningBroker::start_command(serve_command(socket, spec), dir, socket.to_path_buf())
}

/// Makes memfd_create(2) fail with ENOSYS in this process and the threads
/// it starts, as a kernel older than 3.17 answers it: this machine's
/// kernel cannot be made old, but a seccomp filter (seccomp(2)) makes the
/// kernel itself refuse the call. x86-64 only (the filter names its
/// system call number).
#[cfg(target_arch = "x86_64")]
fn refuse_memfd_create() {
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const ARCH: u32 = 4; // offsetof(struct seccomp_data, arch)
    const NR: u32 = 0; // offsetof(struct seccomp_data, nr)
    let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let (load, jeq, ret) = (
        libc::BPF_LD | libc::BPF_W | libc::BPF_ABS,
        libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
        libc::BPF_RET | libc::BPF_K,
    );
    let filter = [
        op(load, 0, 0, ARCH),
        op(jeq, 1, 0, AUDIT_ARCH_X86_64),
        op(ret, 0, 0, libc::SECCOMP_RET_ALLOW),
        op(load, 0, 0, NR),
        op(jeq, 0, 1, libc::SYS_memfd_create as u32),
        op(ret, 0, 0, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        op(ret, 0, 0, libc::SECCOMP_RET_ALLOW),
    ];
    let program = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: prctl(2) with a filter program that outlives the call (the
    // kernel copies it).
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        let installed = libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &program as *const libc::sock_fprog,
        );
        assert_eq!(installed, 0, "{}", std::io::Error::last_os_error());
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn refuse_memfd_create() {
    panic!("the serve role refuses memfd_create on x86-64 only");
}
