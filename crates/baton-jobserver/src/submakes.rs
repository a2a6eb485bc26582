//! Sub-makes that force their own `-jN` (`$(MAKE) -j4 -C sub`, or
//! `$(MAKE) $(MFLAGS)` where MFLAGS carries `-j2`): GNU make then prints
//! "-jN forced in submake: resetting jobserver mode" and runs a private
//! pool of N past baton's limit. No jobserver form can stop it, so
//! `baton run` watches the build's process tree while it runs and says at
//! the end, one line per such make, where it ran and how far past the limit.
//!
//! The tree is walked from the command's pid through
//! `/proc/PID/task/TID/children` (Linux 3.5, `CONFIG_PROC_CHILDREN`), so a
//! look reads only the build's own processes; without that file nothing is
//! seen and nothing is said.

use crate::choice;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the tree is looked at: a sub-make that starts a pool of its
/// own lives for its jobs, so it is seen; its jobs at once are a sample.
/// A look costs about 27 µs per process of the build (0.9 ms for a make
/// of 16 jobs, 33 processes; debug build): a build of 1,000 processes
/// costs about 5% of one CPU at this pace.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// At most this many sub-makes are named at the end; the rest are counted.
const NAMED: usize = 5;

/// A make seen with `-j` on its own command line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Forced {
    command: String,
    cwd: PathBuf,
    jobs: String,
    /// The most jobs (child processes) it was seen running at once.
    most: usize,
}

/// The watcher of one build's tree, running beside it.
pub struct Watch {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<BTreeMap<u32, Forced>>,
}

/// Starts looking at the tree under `root` (the build's command, which is
/// left out: a `-j` there is warned about before the build starts).
pub fn watch(root: u32) -> Watch {
    let (stop, stopped) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let mut seen = BTreeMap::new();
        loop {
            look(root, &mut seen);
            match stopped.recv_timeout(LOOK_EVERY) {
                Err(RecvTimeoutError::Timeout) => continue,
                _ => return seen,
            }
        }
    });
    Watch { stop, thread }
}

impl Watch {
    /// Stops watching; returns one line for each sub-make that forced its
    /// own jobs, for the end of the build.
    pub fn finish(self) -> Vec<String> {
        let _ = self.stop.send(());
        let seen = self.thread.join().unwrap_or_default();
        report(seen.into_values().collect())
    }
}

fn report(forced: Vec<Forced>) -> Vec<String> {
    let mut lines: Vec<String> = forced.iter().take(NAMED).map(line).collect();
    if forced.len() > NAMED {
        lines.push(format!(
            "and {} more sub-makes forced their own -j",
            forced.len() - NAMED
        ));
    }
    lines
}

/// The sub-make's own job slot is the token of the recipe that started it;
/// every other job it ran at once took no token: it ran outside the limit.
fn line(f: &Forced) -> String {
    format!(
        "a sub-make forced {jobs} and ignored the jobserver: `{command}` in {cwd} ran up to {most} \
         job(s) at once, {past} of them on no token of the pool (drop {jobs} from its command line \
         or MFLAGS)",
        jobs = f.jobs,
        command = f.command,
        cwd = f.cwd.display(),
        most = f.most,
        past = f.most.saturating_sub(1),
    )
}

/// One look at the tree: every make under `root` with `-j` on its command
/// line is noted, with the most jobs seen under it so far.
fn look(root: u32, seen: &mut BTreeMap<u32, Forced>) {
    let parent_words = words(root);
    let mut stack: Vec<(u32, Vec<String>)> = children(root)
        .into_iter()
        .map(|pid| (pid, parent_words.clone()))
        .collect();
    while let Some((pid, parent_words)) = stack.pop() {
        let args = words(pid);
        // A child forked but not yet exec'd still shows its parent's
        // command line: it is no make of its own.
        if args == parent_words {
            continue;
        }
        let kids = children(pid);
        if let Some(mut forced) = forced_make(pid, &args, kids.len()) {
            // The latest directory: a make seen just after it started has
            // not yet gone to its -C DIR.
            if let Some(before) = seen.get(&pid) {
                forced.most = forced.most.max(before.most);
            }
            seen.insert(pid, forced);
        }
        stack.extend(kids.into_iter().map(|kid| (kid, args.clone())));
    }
}

fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|text| {
            text.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// The process's command line, word by word (empty once it is gone).
fn words(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect()
}

/// The process `pid` running `args`, if it is a make given `-j` on its
/// own command line.
fn forced_make(pid: u32, args: &[String], jobs_running: usize) -> Option<Forced> {
    let name = Path::new(args.first()?).file_name()?.to_string_lossy();
    if !choice::is_make_name(&name) {
        return None;
    }
    let jobs = choice::forced_jobs(&args[1..])?;
    Some(Forced {
        command: args.join(" "),
        cwd: std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_default(),
        jobs,
        most: jobs_running,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_forced_sub_make_is_one_line_and_many_are_counted() {
        let forced = |i: usize| Forced {
            command: "make -j4 -C sub".into(),
            cwd: PathBuf::from(format!("/b/sub{i}")),
            jobs: "-j4".into(),
            most: 4,
        };
        let lines = report(vec![forced(0)]);
        assert_eq!(
            lines,
            ["a sub-make forced -j4 and ignored the jobserver: `make -j4 -C sub` in /b/sub0 ran up \
              to 4 job(s) at once, 3 of them on no token of the pool (drop -j4 from its command \
              line or MFLAGS)"]
        );
        let lines = report((0..7).map(forced).collect());
        assert_eq!(lines.len(), NAMED + 1);
        assert_eq!(lines[NAMED], "and 2 more sub-makes forced their own -j");
    }

    #[test]
    fn five_forced_sub_makes_are_all_named_and_no_more_counted() {
        let forced = Forced {
            command: "make -j4".into(),
            cwd: PathBuf::from("/b"),
            jobs: "-j4".into(),
            most: 2,
        };
        let lines = report(vec![forced; NAMED]);
        assert_eq!(lines.len(), NAMED);
        assert!(lines.iter().all(|l| l.starts_with("a sub-make forced -j4")));
    }

    /// A real tree: a shell (the build's command) runs a "make" (sh under
    /// that name) given `-j4`, which runs two jobs at once.
    #[test]
    fn a_make_forcing_its_own_jobs_is_found_in_the_build_s_tree() {
        use std::os::unix::process::CommandExt;
        let scratch = crate::tests::Scratch::new("submakes");
        let make = scratch.0.join("make");
        std::os::unix::fs::symlink("/bin/sh", &make).unwrap();
        let script = format!("{} -c 'sleep 60 & sleep 60 & wait' -j4; :", make.display());
        let mut build = std::process::Command::new("sh")
            .args(["-c", &script])
            .current_dir(&scratch.0)
            .process_group(0)
            .spawn()
            .unwrap();
        let root = build.id();
        // Until the make runs both jobs (a minute at most, should the
        // machine be that busy).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let ready = loop {
            let makes: Vec<u32> = children(root)
                .into_iter()
                .filter(|&pid| words(pid).first().is_some_and(|w| w.ends_with("/make")))
                .collect();
            if makes.iter().any(|&pid| {
                children(pid)
                    .into_iter()
                    .filter(|&job| words(job).first().is_some_and(|w| w == "sleep"))
                    .count()
                    == 2
            }) {
                break true;
            }
            if std::time::Instant::now() > deadline {
                break false;
            }
            std::thread::yield_now();
        };
        let lines = ready.then(|| watch(root).finish());
        // The process group we started.
        nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(root as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        build.wait().unwrap();
        assert!(ready, "the tree never ran");
        let lines = lines.unwrap();
        assert_eq!(lines.len(), 1, "{lines:?}");
        let expected = format!(
            "a sub-make forced -j4 and ignored the jobserver: `{} -c sleep 60 & sleep 60 & wait -j4` \
             in {} ran up to 2 job(s) at once, 1 of them on no token of the pool",
            make.display(),
            scratch.0.display()
        );
        assert!(lines[0].starts_with(&expected), "{}", lines[0]);
    }
}
