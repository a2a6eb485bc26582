//! Asking a tool about itself (`make --version`, `cc -dumpfullversion`,
//! `bmake -V .MAKE`), remembered between runs.
//!
//! `baton run` asks up to five programs before the build starts, to choose
//! its jobserver form; with the shell integration every `make` typed pays
//! that, about as much again as a make with nothing to do. The answers
//! are kept in a file beside the broker's socket, each under the program's
//! path and arguments and the identity of the file that runs (device,
//! inode, size, modification and change times, after symbolic links), as
//! ccache's default `compiler_check = mtime` keys a compiler: an upgrade,
//! a reinstall or a switched alternative is a new file and is asked again.
//! A wrapper script whose answer changes without the script changing is
//! the one case this misses; deleting the file forgets everything.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

/// What a program printed, and whether it exited 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub ok: bool,
    pub stdout: String,
}

/// The answers known so far, and the file they are kept in.
pub struct Probes {
    file: Option<PathBuf>,
    /// Read from `file` at the first question: a run that asks nothing
    /// (a job of an outer build) never reads it.
    known: OnceLock<Mutex<Known>>,
    /// Inside [`Probes::recalled`]: questions not remembered run nothing.
    recall_only: AtomicBool,
    /// A question inside [`Probes::recalled`] was not remembered.
    missed: AtomicBool,
}

#[derive(Default)]
struct Known {
    answers: HashMap<String, Answer>,
    /// Answers asked this run, not yet in the file.
    new: bool,
}

/// The file's first line; a file without it is ignored (and replaced).
const HEADER: &str = "baton probes 1";
/// Enough for every line we look at; a program that prints more is cut.
const KEEP_BYTES: usize = 4096;

impl Probes {
    /// The answers kept in `file` (None: remember nothing). A file that is
    /// not ours alone (another owner, or writable by others) is not read:
    /// its answers choose how our builds run.
    pub fn open(file: Option<PathBuf>) -> Probes {
        Probes {
            file,
            known: OnceLock::new(),
            recall_only: AtomicBool::new(false),
            missed: AtomicBool::new(false),
        }
    }

    /// Runs `f` on remembered answers alone: None if it asked a question
    /// that would have run a program. The usual run finds every answer
    /// kept and, this way, starts no thread to ask side by side.
    pub fn recalled<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.missed.store(false, Ordering::Relaxed);
        self.recall_only.store(true, Ordering::Relaxed);
        let found = f();
        self.recall_only.store(false, Ordering::Relaxed);
        (!self.missed.load(Ordering::Relaxed)).then_some(found)
    }

    /// Runs `program args` (found on PATH as `Command` finds it), or
    /// recalls its answer; None if it cannot be run.
    pub fn ask(&self, program: &Path, args: &[&str]) -> Option<Answer> {
        let key = key(program, args);
        if let Some(answer) = key
            .as_ref()
            .and_then(|k| self.lock().answers.get(k).cloned())
        {
            return Some(answer);
        }
        // A program that is not found is not run either: no miss.
        if self.recall_only.load(Ordering::Relaxed) {
            self.missed.fetch_or(key.is_some(), Ordering::Relaxed);
            return None;
        }
        let answer = run(program, args)?;
        if let Some(key) = key {
            let mut known = self.lock();
            known.answers.insert(key, answer.clone());
            known.new = true;
        }
        Some(answer)
    }

    /// Writes the answers back if any is new (to a temporary file, then
    /// renamed: a concurrent run reads the old file or the new one).
    /// Failing to is no error: the next run asks again.
    pub fn save(&self) {
        // Nothing asked, nothing read, nothing new.
        if self.known.get().is_none() {
            return;
        }
        let known = self.lock();
        let Some(file) = self.file.as_deref().filter(|_| known.new) else {
            return;
        };
        let tmp = file.with_extension(format!("tmp-{}", std::process::id()));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(format(&known.answers).as_bytes()));
        if written.and_then(|()| std::fs::rename(&tmp, file)).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Known> {
        let known = self.known.get_or_init(|| {
            let answers = self
                .file
                .as_deref()
                .and_then(read_if_ours)
                .map(|text| parse(&text))
                .unwrap_or_default();
            Mutex::new(Known {
                answers,
                new: false,
            })
        });
        known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Runs the probe: no MAKEFLAGS or MAKELEVEL (make would read ours), no
/// input, standard error thrown away.
fn run(program: &Path, args: &[&str]) -> Option<Answer> {
    let out = Command::new(program)
        .args(args)
        .env_remove("MAKEFLAGS")
        .env_remove("MAKELEVEL")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let mut stdout = out.stdout;
    stdout.truncate(KEEP_BYTES);
    Some(Answer {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
    })
}

/// The program's path and arguments, and the identity of the file that
/// runs; None if it is not found (it is then asked every time).
fn key(program: &Path, args: &[&str]) -> Option<String> {
    let path = find(program)?;
    let m = std::fs::metadata(&path).ok()?;
    Some(format!(
        "{path:?} {args:?} {} {} {} {}.{} {}.{}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    ))
}

/// Where `Command` would find `program`: as given if it names a
/// directory, else the first executable file of that name on PATH.
pub fn find(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return Some(program.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

fn read_if_ours(file: &Path) -> Option<String> {
    let m = std::fs::metadata(file).ok()?;
    let ours = m.uid() == crate::sys::effective_uid() && m.mode() & 0o022 == 0;
    ours.then(|| std::fs::read_to_string(file).ok()).flatten()
}

/// One line an answer: hex of the key, 0 or 1, hex of what it printed.
fn format(answers: &HashMap<String, Answer>) -> String {
    let mut text = format!("{HEADER}\n");
    for (key, a) in answers {
        text.push_str(&format!(
            "{}\t{}\t{}\n",
            hex(key.as_bytes()),
            u8::from(a.ok),
            hex(a.stdout.as_bytes())
        ));
    }
    text
}

/// The answers in `text`; lines that do not parse are skipped.
fn parse(text: &str) -> HashMap<String, Answer> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return HashMap::new();
    }
    lines
        .filter_map(|line| {
            let mut fields = line.split('\t');
            let key = String::from_utf8(unhex(fields.next()?)?).ok()?;
            let ok = match fields.next()? {
                "0" => false,
                "1" => true,
                _ => return None,
            };
            let stdout = String::from_utf8(unhex(fields.next()?)?).ok()?;
            fields
                .next()
                .is_none()
                .then_some((key, Answer { ok, stdout }))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(ok: bool, stdout: &str) -> Answer {
        Answer {
            ok,
            stdout: stdout.to_string(),
        }
    }

    /// A directory of this test's own with an executable `tool` in it
    /// that runs `body` in sh.
    fn script(test: &str, body: &str) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("baton-probe-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tool = dir.join("tool");
        std::fs::write(&tool, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        (dir, tool)
    }

    #[test]
    fn recalled_answers_only_what_is_remembered() {
        let (dir, tool) = script("recall", "echo ran >> \"$0.log\"\necho answer");
        let probes = Probes::open(None);
        let ran = || {
            std::fs::read_to_string(dir.join("tool.log"))
                .unwrap_or_default()
                .lines()
                .count()
        };
        assert_eq!(
            probes.recalled(|| probes.ask(&tool, &["-v"])),
            None,
            "not yet asked: a miss"
        );
        assert_eq!(ran(), 0, "recalled runs nothing");
        assert_eq!(probes.ask(&tool, &["-v"]).unwrap().stdout, "answer\n");
        assert_eq!(
            probes.recalled(|| probes.ask(&tool, &["-v"]).map(|a| a.stdout)),
            Some(Some("answer\n".to_string()))
        );
        assert_eq!(
            probes.recalled(|| probes.ask(&dir.join("missing"), &[])),
            Some(None),
            "not found is an answer, not a miss"
        );
        assert_eq!(ran(), 1);
        assert!(
            probes.ask(&tool, &["-w"]).is_some(),
            "outside recalled, questions run again"
        );
        assert_eq!(ran(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn answers_survive_the_file() {
        let mut answers = HashMap::new();
        answers.insert(
            "\"/usr/bin/make\" [\"--version\"] 1 2 3 4.5 6.7".to_string(),
            answer(true, "GNU Make 4.3\nBuilt for x\n"),
        );
        answers.insert("tab\tand newline\n".to_string(), answer(false, ""));
        assert_eq!(parse(&format(&answers)), answers);
    }

    #[test]
    fn a_damaged_or_foreign_file_gives_no_answers() {
        let good = format!("{}\t1\t{}", hex(b"k"), hex(b"v"));
        assert_eq!(parse(&format!("{HEADER}\n{good}\n")).len(), 1);
        assert!(parse(&format!("other header\n{good}\n")).is_empty());
        for bad in [
            "zz\t1\t00",
            "6b\t2\t00",
            "6b\t1\t0",
            "6b\t1",
            "6b\t1\t00\textra",
            "",
            "6b",
        ] {
            assert!(parse(&format!("{HEADER}\n{bad}\n")).is_empty(), "{bad:?}");
        }
    }

    #[test]
    fn a_program_is_keyed_by_the_file_that_runs() {
        let (dir, tool) = script("key", "echo one");
        let before = key(&tool, &["--version"]).unwrap();
        assert_ne!(
            key(&tool, &["-V"]),
            Some(before.clone()),
            "other arguments, another key"
        );
        // Rewritten in place, as an upgrade does: same path, new size.
        std::fs::write(&tool, "#!/bin/sh\necho version two\n").unwrap();
        assert_ne!(
            key(&tool, &["--version"]),
            Some(before),
            "a changed file is asked again"
        );
        assert_eq!(key(&dir.join("missing"), &[]), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_others_may_write_is_not_read() {
        let dir = std::env::temp_dir().join(format!("baton-probe-perm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("probes");
        std::fs::write(&file, format!("{HEADER}\n")).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_if_ours(&file).is_some());
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(read_if_ours(&file).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn answers_saved_are_recalled_by_the_next_run_without_running_anything() {
        let (dir, tool) = script("save", "echo ran >> \"$0.log\"\necho 'GNU Make 4.4'");
        let file = dir.join("probes");
        let first = Probes::open(Some(file.clone()));
        first.save();
        assert!(!file.exists(), "nothing asked, nothing written");
        assert!(first.ask(&tool, &["--version"]).is_some());
        first.save();
        let next = Probes::open(Some(file.clone()));
        assert_eq!(
            next.recalled(|| next.ask(&tool, &["--version"]).map(|a| a.stdout)),
            Some(Some("GNU Make 4.4\n".to_string()))
        );
        let ran = std::fs::read_to_string(dir.join("tool.log")).unwrap();
        assert_eq!(ran.lines().count(), 1, "asked once in two runs");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
