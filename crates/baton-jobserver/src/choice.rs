//! What `auto` gives a build: a form every jobserver client the build may
//! start can read, and the one its top-level tool reads best, chosen once
//! for the whole build before it starts (docs/jobserver.md has the table).
//!
//! `inspect` looks at what can be seen from outside (the command, the make
//! and C compiler on PATH, their versions); `choose` is the pure rule.

use crate::probe::Probes;
use crate::Style;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

/// A tool found before the build, with its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    pub version: Version,
}

/// `major.minor.patch`, as the tool printed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.2 {
            0 => write!(f, "{}.{}", self.0, self.1),
            patch => write!(f, "{}.{}.{patch}", self.0, self.1),
        }
    }
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.version, self.path.display())
    }
}

/// The tool that reads the build's MAKEFLAGS first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Top {
    /// GNU make.
    Make(Found),
    /// ninja; None when it did not say its version.
    Ninja {
        path: PathBuf,
        version: Option<Version>,
    },
    Cargo,
    /// A Python program (pip, `python -m build`, meson, SCons, a script
    /// whose `#!` names python): its subprocesses start with Python's
    /// default `close_fds=True`, so inherited descriptors never reach the
    /// tools it runs.
    Python(PathBuf),
    /// cmake with another generator, a script, anything else.
    Other,
}

/// What `auto` saw before the build started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    pub top: Top,
    /// The GNU make a script or build script runs: `$MAKE`, else `make` on
    /// PATH.
    pub make: Option<Found>,
    /// The C compiler (`$CC`, else `cc` on PATH) if it is gcc.
    pub gcc: Option<Found>,
    /// The build's ninja file, or the makefile a top-level make reads,
    /// asks for link-time optimisation (`-flto`).
    pub lto: bool,
    /// The build's ninja file runs `make` (an external project, say), or
    /// a cargo build's build scripts are seen to (see [`cargo_runs_make`]).
    pub build_runs_make: bool,
    /// `-jN` (or `-j`, `--jobs`) on the top-level tool's own command line.
    pub forced_jobs: Option<String>,
}

/// The form for the build, why, and what no form can fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub style: Style,
    pub why: Vec<String>,
    pub warnings: Vec<String>,
    /// Readers that `style` leaves without a jobserver, where no form
    /// serves them: said only when `auto` chose `style`.
    pub left_behind: Vec<String>,
}

/// GNU make reads `fifo:` from 4.4 on; gcc's lto-wrapper from 13 on;
/// ninja is a jobserver client from 1.13 on.
const MAKE_FIFO: Version = Version(4, 4, 0);
const GCC_FIFO: Version = Version(13, 0, 0);
const NINJA_CLIENT: Version = Version(1, 13, 0);

/// From how many tokens the FUSE file costs less than the FIFO bridge.
/// A freed token wakes every sub-make polling a FIFO, and at most about
/// as many sub-makes wait as there are tokens (each runs on one), so the
/// FIFO's herd grows with the limit while the file's cost per token (a
/// few requests, each a round trip to the broker) does not. Measured on
/// the 16 × 16 × 20 make tree (docs/benchmarks.md): at 16 tokens the FIFO
/// bridge costs what make's own does and the file 1.5× its switches and
/// 1.04× its CPU; from 64 up the file costs fewer switches (0.36× at 512).
pub const FUSE_FROM_TOKENS: u32 = 32;

/// Whether `auto` gives a build of `tokens` the FUSE file where it would
/// (see [`FUSE_FROM_TOKENS`]); below, the FIFO bridge.
pub fn fuse_pays(tokens: u32) -> bool {
    tokens >= FUSE_FROM_TOKENS
}

/// The form a build gets, decided here alone (the rest only sets it up):
/// what `--jobserver-style` asked for (`requested`), what [`choose`]
/// found the tree's tools read (`chosen`), bmake's own form (`is_bmake`:
/// the FIFO, from which bmake takes only what is already there), the
/// build's cap (the FUSE file has none of its own, and below
/// [`FUSE_FROM_TOKENS`] the FIFO's herd costs less), and whether the
/// broker's FUSE file serves us (`fuse_serves`, asked only when the answer
/// would be the file: it makes the build's file). `Ok(None)`: the file was
/// asked for by name and does not serve, which the caller refuses in
/// words; `auto` falls back to the FIFO.
pub fn form<E>(
    requested: Style,
    chosen: Style,
    is_bmake: bool,
    cap: Cap,
    fuse_serves: impl FnOnce() -> Result<bool, E>,
) -> Result<Option<Style>, E> {
    let style = match requested {
        Style::Auto if is_bmake => Style::Fifo,
        Style::Auto => match chosen {
            Style::Fuse if cap.given || !fuse_pays(cap.tokens) => Style::Fifo,
            style => style,
        },
        style => style,
    };
    if style != Style::Fuse || fuse_serves()? {
        return Ok(Some(style));
    }
    Ok((requested == Style::Auto).then_some(Style::Fifo))
}

/// A build's cap: `--max` if given, else the pool's limit.
#[derive(Debug, Clone, Copy)]
pub struct Cap {
    pub tokens: u32,
    /// `--max` was given.
    pub given: bool,
}

/// Why a `style` asked for by name cannot work for the command, if it
/// cannot, known from the command alone before the build asks for tokens:
/// GNU make older than 4.4 stops with "internal error: invalid
/// --jobserver-auth string" on `fifo:`, which both the fifo and the fuse
/// styles hand it. (The whole tree is looked at later: [`unreadable`].)
pub fn unusable(probes: &Probes, command: &[OsString], style: Style) -> Option<String> {
    let program = Path::new(&command[0]);
    let name = program.file_name()?.to_string_lossy();
    if !matches!(style, Style::Fifo | Style::Fuse) || !is_make_name(&name) {
        return None;
    }
    let make = gnu_make(probes, program).filter(|m| m.version < Version(4, 4, 0))?;
    Some(format!(
        "GNU make {} cannot open a fifo: jobserver (only make 4.4 and later can): use --jobserver-style pipe or auto \
         (--force runs it anyway)",
        make.version
    ))
}

/// The pure rule: see docs/jobserver.md, "How `auto` chooses".
pub fn choose(tree: &Tree) -> Choice {
    let rw_only = rw_only_readers(tree);
    let mut why = Vec::new();
    let mut warnings = Vec::new();
    let mut left_behind = Vec::new();
    let style = match &tree.top {
        Top::Ninja {
            path,
            version: Some(v),
        } if *v >= NINJA_CLIENT && tree.build_runs_make && !rw_only.is_empty() => {
            why.push(format!(
                "ninja {v} ({}) reads both forms (R,W with a warning, and slower)",
                path.display()
            ));
            why.push("build.ninja runs make".to_string());
            pipe_if_needed(&rw_only, &mut why, Style::Fifo)
        }
        Top::Ninja {
            path,
            version: Some(v),
        } if *v >= NINJA_CLIENT => {
            why.push(format!(
                "ninja {v} ({}) reads fifo: best (R,W only with a warning, and slower)",
                path.display()
            ));
            if let (Some(gcc), true) = (&tree.gcc, tree.lto) {
                if gcc.version < GCC_FIFO {
                    warnings.push(format!(
                        "gcc {gcc} reads only the R,W jobserver form, not ninja's fifo: its -flto=auto links \
                         will run their own LTRANS jobs past the limit (use --jobserver-style pipe)"
                    ));
                }
            }
            Style::Fifo
        }
        Top::Ninja { path, version } => {
            let version = version.map_or("of unknown version".to_string(), |v| v.to_string());
            warnings.push(format!(
                "ninja {version} ({}) is no jobserver client: it runs its own jobs past baton's limit \
                 (use ninja 1.13 or later, e.g. pip install ninja)",
                path.display()
            ));
            pipe_if_needed(&rw_only, &mut why, Style::Fifo)
        }
        Top::Make(make) if make.version < MAKE_FIFO => {
            why.push(format!("make {make} reads only R,W"));
            Style::Pipe
        }
        Top::Make(make) => {
            why.push(format!("make {make} reads both forms"));
            pipe_if_needed(&rw_only, &mut why, Style::Fuse)
        }
        Top::Cargo => {
            why.push("cargo reads both forms".to_string());
            pipe_if_needed(&rw_only, &mut why, Style::Fuse)
        }
        Top::Python(path) => {
            why.push(format!(
                "{} is a Python program: Python's subprocess closes inherited descriptors \
                 (close_fds=True), so R,W would not reach the tools it runs; fifo:PATH does",
                path.display()
            ));
            left_behind = lost_under_python(tree, path);
            Style::Fifo
        }
        Top::Other => pipe_if_needed(&rw_only, &mut why, Style::Fifo),
    };
    if let Some(jobs) = &tree.forced_jobs {
        warnings.push(forced_jobs_warning(&tree.top, jobs));
    }
    Choice {
        style,
        why,
        warnings,
        left_behind,
    }
}

/// Why a `--jobserver-style` asked for cannot serve a tool found in the
/// build's tree, if it cannot: what `auto` would have avoided, stated so
/// that the build is refused before it breaks or overshoots in silence.
pub fn unreadable(tree: &Tree, style: Style) -> Option<String> {
    if let (Top::Python(driver), Style::Pipe) = (&tree.top, style) {
        return Some(format!(
            "{} is a Python program, which closes inherited descriptors (close_fds=True): \
             the ninja or make it runs finds no R,W jobserver (ninja: \"Invalid file \
             descriptors\", then its own jobs past the limit; make: one job at a time)",
            driver.display()
        ));
    }
    if !matches!(style, Style::Fifo | Style::Fuse) {
        return None;
    }
    let old_make = tree.make.as_ref().filter(|m| m.version < MAKE_FIFO);
    let make_runner = match &tree.top {
        Top::Cargo if tree.build_runs_make => Some("the crate's build scripts run"),
        Top::Ninja { .. } if tree.build_runs_make => Some("build.ninja runs"),
        _ => None,
    };
    if let (Some(make), Some(runner)) = (old_make, make_runner) {
        return Some(format!(
            "make {make}, which {runner}, reads only R,W: it stops with \
             \"internal error: invalid --jobserver-auth string\" on fifo:"
        ));
    }
    if let (Some(gcc), true) = (tree.gcc.as_ref().filter(|g| g.version < GCC_FIFO), tree.lto) {
        return Some(format!(
            "gcc {gcc} reads only R,W and the build links with -flto: each link's lto-wrapper \
             ignores fifo: and runs its own LTRANS jobs past the limit"
        ));
    }
    match &tree.top {
        Top::Ninja { path, version } if style == Style::Fuse => Some(format!(
            "ninja{} ({}) wants a real FIFO: on the FUSE file it prints \
             \"Not a fifo path\" and runs its own jobs past the limit",
            version.map_or(String::new(), |v| format!(" {v}")),
            path.display()
        )),
        _ => None,
    }
}

/// Clients the build may start that read only `R,W`, each with why.
fn rw_only_readers(tree: &Tree) -> Vec<String> {
    let mut readers = Vec::new();
    if let Some(make) = tree.make.as_ref().filter(|m| m.version < MAKE_FIFO) {
        readers.push(format!(
            "make {make}, which scripts and build scripts run, reads only R,W"
        ));
    }
    if let Some(gcc) = tree.gcc.as_ref().filter(|g| g.version < GCC_FIFO) {
        readers.push(format!("gcc {gcc}: its lto-wrapper reads only R,W"));
    }
    readers
}

/// What the readers of `R,W` only will do under a Python driver's
/// `fifo:`: no form serves them there (their descriptors would be closed).
fn lost_under_python(tree: &Tree, driver: &Path) -> Vec<String> {
    let driver = driver.display();
    let mut warnings = Vec::new();
    if let Some(make) = tree.make.as_ref().filter(|m| m.version < MAKE_FIFO) {
        warnings.push(format!(
            "make {make} reads only R,W: if {driver} runs it, it stops with \
             \"invalid --jobserver-auth string\" on fifo: (--jobserver-style pipe --force runs it \
             one job at a time instead, and gives everything else {driver} runs no jobserver)"
        ));
    }
    if let Some(gcc) = tree.gcc.as_ref().filter(|g| g.version < GCC_FIFO) {
        warnings.push(format!(
            "gcc {gcc} reads only R,W, which cannot reach it past {driver}: its -flto=auto links \
             run their own LTRANS jobs past the limit (gcc 13 reads fifo:)"
        ));
    }
    warnings
}

fn pipe_if_needed(rw_only: &[String], why: &mut Vec<String>, otherwise: Style) -> Style {
    if rw_only.is_empty() {
        why.push(
            "no client that reads only R,W was found (make on PATH or $MAKE, $CC or cc)"
                .to_string(),
        );
        if otherwise == Style::Fuse {
            why.push("the FUSE file wakes one waiter per token".to_string());
        }
        return otherwise;
    }
    why.extend(rw_only.iter().cloned());
    Style::Pipe
}

fn forced_jobs_warning(top: &Top, jobs: &str) -> String {
    let tool = match top {
        Top::Make(make) => format!("make {make}"),
        Top::Ninja {
            path,
            version: Some(v),
        } => format!("ninja {v} ({})", path.display()),
        Top::Ninja {
            path,
            version: None,
        } => format!("ninja ({})", path.display()),
        Top::Cargo | Top::Python(_) | Top::Other => "the command".to_string(),
    };
    format!("{tool} was given {jobs} on its own command line: it ignores baton's jobserver and runs that many jobs past the limit (drop {jobs})")
}

/// Looks at the command and the tools it will find, without running the
/// build.
pub fn inspect(probes: &Probes, command: &[OsString]) -> Tree {
    // Each probe runs a program (the command, make, cc twice): in threads
    // of their own they delay the build's start by the slowest of them,
    // not by their sum.
    std::thread::scope(|s| {
        let make = s.spawn(|| gnu_make(probes, &make_program()));
        let gcc = s.spawn(|| gcc(probes, &c_compiler()));
        let (top, forced_jobs, lto, build_runs_make) = inspect_command(probes, command);
        let make = make.join().expect("the make probe does not panic");
        let gcc = gcc.join().expect("the cc probe does not panic");
        Tree {
            top,
            make,
            gcc,
            lto,
            build_runs_make,
            forced_jobs,
        }
    })
}

/// [`inspect`] one probe after the other: for answers already known
/// (`Probes::recalled`), where threads would cost more than they save.
pub fn inspect_in_turn(probes: &Probes, command: &[OsString]) -> Tree {
    let (top, forced_jobs, lto, build_runs_make) = inspect_command(probes, command);
    Tree {
        top,
        make: gnu_make(probes, &make_program()),
        gcc: gcc(probes, &c_compiler()),
        lto,
        build_runs_make,
        forced_jobs,
    }
}

/// The make a build's recipes run: `$MAKE`, else `make`.
fn make_program() -> PathBuf {
    std::env::var_os("MAKE").map_or(PathBuf::from("make"), PathBuf::from)
}

/// The command's own tool, a `-j` it forces, and, for ninja, whether its
/// build file uses LTO or runs make.
fn inspect_command(probes: &Probes, command: &[OsString]) -> (Top, Option<String>, bool, bool) {
    let args: Vec<String> = command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let (top, forced_jobs, dir) = match cmake_build_dir(&args) {
        Some(dir) => (
            cmake_make_program(&dir).map_or(Top::Other, |p| top_for(probes, &p)),
            None,
            dir,
        ),
        None => {
            let top = top_for(probes, Path::new(&args[0]));
            let forced = matches!(top, Top::Make(_) | Top::Ninja { .. })
                .then(|| forced_jobs(&args[1..]))
                .flatten();
            (top, forced, dir_arg(&args[1..]))
        }
    };
    let ninja_file = match top {
        Top::Ninja { .. } => std::fs::read_to_string(dir.join("build.ninja")).unwrap_or_default(),
        _ => String::new(),
    };
    let lto = match top {
        Top::Make(_) => makefile(&args[1..]).contains("-flto"),
        _ => ninja_file.contains("-flto"),
    };
    let build_runs_make = match top {
        Top::Cargo => cargo_runs_make(&dir_arg(&args[1..])),
        _ => runs_make(&ninja_file),
    };
    (top, forced_jobs, lto, build_runs_make)
}

fn top_for(probes: &Probes, program: &Path) -> Top {
    let name = program
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if name == "ninja" {
        return Top::Ninja {
            path: program.to_path_buf(),
            version: version_line(probes, program, &["--version"]).and_then(|l| parse_version(&l)),
        };
    }
    if name == "cargo" {
        return Top::Cargo;
    }
    if is_python_name(&name) || has_python_shebang(program) {
        return Top::Python(resolve(program));
    }
    match is_make_name(&name)
        .then(|| gnu_make(probes, program))
        .flatten()
    {
        Some(make) => Top::Make(make),
        None => Top::Other,
    }
}

/// `python`, `python3`, `python3.11`, `pypy3`.
fn is_python_name(name: &str) -> bool {
    ["python", "pypy"].iter().any(|stem| {
        name.strip_prefix(stem)
            .is_some_and(|v| v.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
    })
}

/// Whether `program` (found on PATH) is a script whose `#!` line runs
/// Python: pip, meson, scons, pyproject-build and every console script
/// pip installs.
fn has_python_shebang(program: &Path) -> bool {
    use std::io::Read;
    let Some(file) = crate::probe::find(program).and_then(|p| std::fs::File::open(p).ok()) else {
        return false;
    };
    let mut first = [0u8; 256];
    let Ok(n) = file.take(first.len() as u64).read(&mut first) else {
        return false;
    };
    let line = first[..n].split(|b| *b == b'\n').next().unwrap_or_default();
    line.starts_with(b"#!")
        && String::from_utf8_lossy(&line[2..])
            .split_whitespace()
            .filter_map(|w| Path::new(w).file_name())
            .any(|w| is_python_name(&w.to_string_lossy()))
}

pub fn is_make_name(name: &str) -> bool {
    // make, gmake, gnumake and the like; not cmake, not bmake.
    name.ends_with("make") && !name.ends_with("cmake") && !name.ends_with("bmake")
}

/// GNU make at `program`, with its version; None for any other make.
pub(crate) fn gnu_make(probes: &Probes, program: &Path) -> Option<Found> {
    let line = version_line(probes, program, &["--version"])?;
    let version = parse_version(line.strip_prefix("GNU Make ")?)?;
    Some(Found {
        path: resolve(program),
        version,
    })
}

/// The compiler `$CC` names (past a launcher such as ccache), else `cc`.
fn c_compiler() -> PathBuf {
    PathBuf::from(compiler_in(&std::env::var("CC").unwrap_or_default()))
}

fn compiler_in(cc: &str) -> &str {
    let is_launcher = |w: &&str| {
        matches!(
            Path::new(w).file_name().and_then(|n| n.to_str()),
            Some("ccache" | "sccache" | "distcc")
        )
    };
    cc.split_whitespace()
        .find(|w| !is_launcher(w))
        .unwrap_or("cc")
}

/// gcc at `program` (whatever it is called), with its version: clang
/// prints no FSF copyright line, other GNU programs no -dumpfullversion.
fn gcc(probes: &Probes, program: &Path) -> Option<Found> {
    if !probes
        .ask(program, &["--version"])?
        .stdout
        .contains("Free Software Foundation")
    {
        return None;
    }
    let version = parse_version(&version_line(probes, program, &["-dumpfullversion"])?)?;
    Some(Found {
        path: resolve(program),
        version,
    })
}

fn version_line(probes: &Probes, program: &Path, args: &[&str]) -> Option<String> {
    probes
        .ask(program, args)?
        .stdout
        .lines()
        .next()
        .map(str::to_string)
}

/// The leading `1.13.2` of `1.13.2.git.kitware…`, `4.3`, `12.2.0`.
fn parse_version(text: &str) -> Option<Version> {
    let mut parts = text
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some(Version(major, minor, patch))
}

/// Where the program is on PATH, for messages.
fn resolve(program: &Path) -> PathBuf {
    crate::probe::find(program).unwrap_or_else(|| program.to_path_buf())
}

/// `cmake --build DIR …` → DIR.
fn cmake_build_dir(args: &[String]) -> Option<PathBuf> {
    let name = Path::new(&args[0])
        .file_name()?
        .to_string_lossy()
        .into_owned();
    if name != "cmake" {
        return None;
    }
    let at = args.iter().position(|a| a == "--build")?;
    args.get(at + 1).map(PathBuf::from)
}

/// The tool a CMake build directory was generated for.
fn cmake_make_program(dir: &Path) -> Option<PathBuf> {
    let cache = std::fs::read_to_string(dir.join("CMakeCache.txt")).ok()?;
    cache
        .lines()
        .find_map(|l| l.strip_prefix("CMAKE_MAKE_PROGRAM:"))
        .and_then(|l| l.split_once('='))
        .map(|(_, p)| PathBuf::from(p))
}

/// The text of the makefile make reads first (`-f FILE`, else GNUmakefile,
/// makefile or Makefile in `-C DIR` or here); empty if there is none.
fn makefile(args: &[String]) -> String {
    let dir = dir_arg(args);
    let named = args
        .iter()
        .position(|a| a == "-f" || a == "--file")
        .and_then(|i| args.get(i + 1))
        .map(|f| vec![dir.join(f)]);
    let candidates = named.unwrap_or_else(|| {
        ["GNUmakefile", "makefile", "Makefile"]
            .iter()
            .map(|f| dir.join(f))
            .collect()
    });
    candidates
        .iter()
        .find_map(|f| std::fs::read_to_string(f).ok())
        .unwrap_or_default()
}

/// Crates that run make in their build scripts: openssl-src and the
/// jemalloc ones run it themselves, `autotools` runs configure and make,
/// `cmake` builds with the "Unix Makefiles" generator unless told
/// otherwise.
const CRATES_RUNNING_MAKE: [&str; 6] = [
    "cmake",
    "autotools",
    "openssl-src",
    "make-cmd",
    "jemalloc-sys",
    "tikv-jemalloc-sys",
];

/// Whether a cargo build in `dir` is seen to run make from a build script:
/// a `build.rs` of its own that names make (`Command::new("make")`), or a
/// crate of [`CRATES_RUNNING_MAKE`] in its Cargo.lock. A dependency's own
/// build script is seen only through the lock file.
fn cargo_runs_make(dir: &Path) -> bool {
    let lock = std::fs::read_to_string(dir.join("Cargo.lock")).unwrap_or_default();
    let locked = CRATES_RUNNING_MAKE
        .iter()
        .any(|c| lock.contains(&format!("name = \"{c}\"\n")));
    locked
        || build_scripts(dir, 3)
            .iter()
            .any(|script| names_make(script))
}

/// The text of every `build.rs` in `dir`, down to `depth` directories,
/// leaving out target directories and hidden ones.
fn build_scripts(dir: &Path, depth: u32) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut scripts = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && depth > 0 && name != "target" && !name.starts_with('.') {
            scripts.extend(build_scripts(&entry.path(), depth - 1));
        } else if name == "build.rs" {
            scripts.extend(std::fs::read_to_string(entry.path()));
        }
    }
    scripts
}

/// Whether Rust source names make as a program: `"make"`, `"gmake"`,
/// `"/usr/bin/make"`, not `"cmake"`.
fn names_make(source: &str) -> bool {
    source.match_indices("make\"").any(|(at, _)| {
        let before = source[..at].trim_end_matches('g');
        before.ends_with('"') || before.ends_with('/')
    })
}

/// make's or ninja's `-C DIR`, else the current directory.
fn dir_arg(args: &[String]) -> PathBuf {
    let dir = args
        .iter()
        .position(|a| a == "-C")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str);
    let attached = args
        .iter()
        .find_map(|a| a.strip_prefix("-C").filter(|d| !d.is_empty()));
    PathBuf::from(dir.or(attached).unwrap_or("."))
}

/// Whether a command in `text` runs `make` (`make`, `/usr/bin/make`,
/// `&& make install`), not `cmake` or `-E make_directory`.
fn runs_make(text: &str) -> bool {
    text.match_indices("make").any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + 4..].chars().next();
        before.is_none_or(|c| c.is_whitespace() || "/;&|(".contains(c))
            && after.is_none_or(|c| c.is_whitespace() || c == ';')
    })
}

/// `-j`, `-j8`, `-j 8`, `--jobs`, `--jobs=8` among the tool's own arguments
/// (before a `--`).
pub(crate) fn forced_jobs(args: &[String]) -> Option<String> {
    let mut words = args.iter().take_while(|a| *a != "--");
    while let Some(word) = words.next() {
        if word == "--jobs" || word.starts_with("--jobs=") {
            return Some(word.clone());
        }
        if let Some(n) = word.strip_prefix("-j") {
            if n.is_empty() {
                // make's -j takes an optional separate number.
                let next = words
                    .next()
                    .filter(|w| w.bytes().all(|b| b.is_ascii_digit()));
                return Some(next.map_or("-j".to_string(), |n| format!("-j {n}")));
            }
            if n.bytes().all(|b| b.is_ascii_digit()) {
                return Some(word.clone());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `form` with the FUSE file answering `serves`; what it decided, and
    /// whether it asked the file.
    fn decide(
        requested: Style,
        chosen: Style,
        is_bmake: bool,
        cap: (u32, bool),
        serves: bool,
    ) -> (Option<Style>, bool) {
        let mut asked = false;
        let cap = Cap {
            tokens: cap.0,
            given: cap.1,
        };
        let style = form(requested, chosen, is_bmake, cap, || {
            asked = true;
            Ok::<_, ()>(serves)
        })
        .unwrap();
        (style, asked)
    }

    #[test]
    fn auto_gives_what_the_tools_read_the_file_only_where_it_pays_and_serves() {
        let big = (FUSE_FROM_TOKENS, false);
        for chosen in [Style::Pipe, Style::Fifo] {
            assert_eq!(
                decide(Style::Auto, chosen, false, big, true),
                (Some(chosen), false)
            );
        }
        assert_eq!(
            decide(Style::Auto, Style::Fuse, false, big, true),
            (Some(Style::Fuse), true)
        );
        assert_eq!(
            decide(Style::Auto, Style::Fuse, false, big, false),
            (Some(Style::Fifo), true),
            "no mount we may use: the FIFO"
        );
        assert_eq!(
            decide(
                Style::Auto,
                Style::Fuse,
                false,
                (FUSE_FROM_TOKENS - 1, false),
                true
            ),
            (Some(Style::Fifo), false),
            "below FUSE_FROM_TOKENS the FIFO costs less"
        );
        assert_eq!(
            decide(Style::Auto, Style::Fuse, false, (64, true), true),
            (Some(Style::Fifo), false),
            "--max needs the bridge: the file has no per-build cap"
        );
        for chosen in [Style::Pipe, Style::Fuse] {
            assert_eq!(
                decide(Style::Auto, chosen, true, big, true),
                (Some(Style::Fifo), false),
                "bmake gets its own form, from the FIFO"
            );
        }
    }

    #[test]
    fn a_form_asked_by_name_is_given_or_refused_never_changed() {
        for (requested, bmake) in [
            (Style::Pipe, false),
            (Style::Fifo, true),
            (Style::None, false),
        ] {
            assert_eq!(
                decide(requested, Style::Fuse, bmake, (2, true), true),
                (Some(requested), false)
            );
        }
        for bmake in [false, true] {
            assert_eq!(
                decide(Style::Fuse, Style::Pipe, bmake, (2, false), true),
                (Some(Style::Fuse), true)
            );
            assert_eq!(
                decide(Style::Fuse, Style::Pipe, bmake, (2, false), false),
                (None, true),
                "fuse asked for and not served: refused, not a FIFO"
            );
        }
        let failed = form(
            Style::Fuse,
            Style::Fuse,
            false,
            Cap {
                tokens: 64,
                given: false,
            },
            || Err("EACCES"),
        );
        assert_eq!(
            failed,
            Err("EACCES"),
            "making the file failed: said, not hidden"
        );
    }

    fn found(path: &str, v: Version) -> Option<Found> {
        Some(Found {
            path: path.into(),
            version: v,
        })
    }

    fn tree(top: Top) -> Tree {
        let (make, gcc) = (
            found("/usr/bin/make", Version(4, 4, 1)),
            found("/usr/bin/cc", Version(13, 2, 0)),
        );
        Tree {
            top,
            make,
            gcc,
            lto: false,
            build_runs_make: false,
            forced_jobs: None,
        }
    }

    fn ninja(v: Version) -> Top {
        Top::Ninja {
            path: "/bin/ninja".into(),
            version: Some(v),
        }
    }

    /// gcc 13.0.0 is the first whose lto-wrapper reads the fifo form:
    /// with it, no top and no explicit style hears of gcc at all, and
    /// one version below, each does.
    #[test]
    fn gcc_13_0_0_reads_the_fifo_and_the_last_gcc_12_does_not() {
        let tops = [
            Top::Make(found("/m", Version(4, 4, 1)).unwrap()),
            ninja(Version(1, 13, 2)),
            Top::Python("/usr/bin/meson".into()),
        ];
        for top in tops {
            for (gcc, old) in [(Version(13, 0, 0), false), (Version(12, 99, 99), true)] {
                let t = Tree {
                    gcc: found("/usr/bin/cc", gcc),
                    lto: true,
                    ..tree(top.clone())
                };
                let choice = choose(&t);
                let said: Vec<&String> = choice
                    .why
                    .iter()
                    .chain(&choice.warnings)
                    .chain(&choice.left_behind)
                    .filter(|w| w.contains("gcc "))
                    .collect();
                assert_eq!(!said.is_empty(), old, "{top:?} with gcc {gcc}: {choice:?}");
                let refused = unreadable(&t, Style::Fifo);
                assert_eq!(
                    refused.as_ref().is_some_and(|r| r.contains("gcc ")),
                    old,
                    "{top:?} with gcc {gcc}: {refused:?}"
                );
            }
        }
    }

    #[test]
    fn the_fuse_file_pays_from_32_tokens() {
        assert!(!fuse_pays(1) && !fuse_pays(16) && !fuse_pays(31));
        assert!(fuse_pays(32) && fuse_pays(512));
    }

    #[test]
    fn make_4_4_gets_fuse_unless_a_reader_of_r_w_only_is_found() {
        let make44 = Top::Make(found("/m", Version(4, 4, 1)).unwrap());
        assert_eq!(choose(&tree(make44.clone())).style, Style::Fuse);
        let with_gcc12 = Tree {
            gcc: found("/usr/bin/cc", Version(12, 2, 0)),
            ..tree(make44.clone())
        };
        let choice = choose(&with_gcc12);
        assert_eq!(choice.style, Style::Pipe);
        assert!(
            choice.why.iter().any(|w| w.contains("gcc 12.2 ")),
            "{choice:?}"
        );
        let with_make43 = Tree {
            make: found("/usr/bin/make", Version(4, 3, 0)),
            ..tree(make44)
        };
        assert_eq!(choose(&with_make43).style, Style::Pipe);
    }

    #[test]
    fn make_4_3_and_cargo_beside_make_4_3_get_pipe() {
        assert_eq!(
            choose(&tree(Top::Make(found("/m", Version(4, 3, 0)).unwrap()))).style,
            Style::Pipe
        );
        assert_eq!(choose(&tree(Top::Cargo)).style, Style::Fuse);
        let cargo = Tree {
            make: found("/usr/bin/make", Version(4, 3, 0)),
            ..tree(Top::Cargo)
        };
        assert_eq!(choose(&cargo).style, Style::Pipe);
    }

    #[test]
    fn ninja_1_13_keeps_fifo_even_beside_make_4_3_and_gcc_12() {
        let old_tools = Tree {
            make: found("/usr/bin/make", Version(4, 3, 0)),
            gcc: found("/usr/bin/cc", Version(12, 2, 0)),
            ..tree(ninja(Version(1, 13, 2)))
        };
        let choice = choose(&old_tools);
        assert_eq!(choice.style, Style::Fifo);
        assert!(
            choice.warnings.is_empty(),
            "no LTO, nothing to warn about: {choice:?}"
        );
        let choice = choose(&Tree {
            lto: true,
            ..old_tools
        });
        assert_eq!(choice.warnings.len(), 1);
        assert!(
            choice.warnings[0].contains("gcc 12.2 ")
                && choice.warnings[0].contains("--jobserver-style pipe"),
            "{choice:?}"
        );
    }

    #[test]
    fn ninja_that_runs_make_4_3_gets_pipe() {
        let runs_make43 = Tree {
            make: found("/usr/bin/make", Version(4, 3, 0)),
            build_runs_make: true,
            ..tree(ninja(Version(1, 13, 2)))
        };
        assert_eq!(choose(&runs_make43).style, Style::Pipe);
        assert_eq!(
            choose(&Tree {
                make: found("/m", Version(4, 4, 1)),
                ..runs_make43
            })
            .style,
            Style::Fifo
        );
        assert!(
            runs_make("  command = cd /x && make install")
                && runs_make("command = /usr/bin/make -C ext\n")
        );
        assert!(
            !runs_make("command = /usr/bin/cmake -E make_directory out && cmake --build .")
                && !runs_make("CMAKE_MAKE_PROGRAM")
        );
    }

    #[test]
    fn old_ninja_and_forced_jobs_are_warned_about() {
        let choice = choose(&tree(ninja(Version(1, 11, 1))));
        assert_eq!(choice.warnings.len(), 1);
        assert!(
            choice.warnings[0].contains("ninja 1.11.1 (/bin/ninja) is no jobserver client"),
            "{choice:?}"
        );
        let forced = Tree {
            forced_jobs: Some("-j8".into()),
            ..tree(Top::Make(found("/m", Version(4, 3, 0)).unwrap()))
        };
        let choice = choose(&forced);
        assert!(
            choice.warnings[0].starts_with("make 4.3 (/m) was given -j8"),
            "{choice:?}"
        );
    }

    #[test]
    fn other_commands_get_fifo_or_pipe() {
        assert_eq!(choose(&tree(Top::Other)).style, Style::Fifo);
        let beside_gcc12 = Tree {
            gcc: found("/usr/bin/cc", Version(12, 2, 0)),
            ..tree(Top::Other)
        };
        assert_eq!(choose(&beside_gcc12).style, Style::Pipe);
    }

    #[test]
    fn versions_and_job_flags_parse() {
        assert_eq!(
            parse_version("1.13.2.git.kitware.jobserver-pipe-1"),
            Some(Version(1, 13, 2))
        );
        assert_eq!(parse_version("4.3"), Some(Version(4, 3, 0)));
        assert_eq!(parse_version("x"), None);
        let words = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(forced_jobs(&words("-s -j8 all")), Some("-j8".into()));
        assert_eq!(forced_jobs(&words("-j 3 all")), Some("-j 3".into()));
        assert_eq!(forced_jobs(&words("-j all")), Some("-j".into()));
        assert_eq!(forced_jobs(&words("--jobs=2")), Some("--jobs=2".into()));
        assert_eq!(forced_jobs(&words("-s all -- -j8")), None);
        assert_eq!(forced_jobs(&words("-k JOBS=-jx")), None);
    }

    #[test]
    fn the_compiler_is_found_past_a_launcher() {
        assert_eq!(compiler_in(""), "cc");
        assert_eq!(compiler_in("gcc-12 -std=c99"), "gcc-12");
        assert_eq!(compiler_in("/usr/bin/ccache gcc"), "gcc");
        assert_eq!(compiler_in("sccache"), "cc");
    }

    #[test]
    fn python_drivers_get_fifo_and_a_warning_for_each_reader_left_behind() {
        let pip = Top::Python("/venv/bin/pip".into());
        let choice = choose(&tree(pip.clone()));
        assert_eq!(choice.style, Style::Fifo);
        assert!(choice.why[0].contains("close_fds=True"), "{choice:?}");
        assert!(choice.left_behind.is_empty(), "{choice:?}");
        let old_tools = Tree {
            make: found("/usr/bin/make", Version(4, 3, 0)),
            gcc: found("/usr/bin/cc", Version(12, 2, 0)),
            ..tree(pip)
        };
        let choice = choose(&old_tools);
        assert_eq!(choice.style, Style::Fifo);
        assert_eq!(choice.left_behind.len(), 2, "{choice:?}");
        assert!(choice.left_behind[0].starts_with("make 4.3 (/usr/bin/make)"));
        assert!(choice.left_behind[1].starts_with("gcc 12.2 (/usr/bin/cc)"));
    }

    #[test]
    fn python_names() {
        assert!(
            is_python_name("python") && is_python_name("python3.11") && is_python_name("pypy3")
        );
        assert!(!is_python_name("python-config") && !is_python_name("pip"));
    }

    #[test]
    fn explicit_path_forms_are_refused_where_a_tool_found_cannot_read_them() {
        let old_make = found("/usr/bin/make", Version(4, 3, 0));
        let cargo = Tree {
            make: old_make.clone(),
            build_runs_make: true,
            ..tree(Top::Cargo)
        };
        for style in [Style::Fifo, Style::Fuse] {
            assert!(unreadable(&cargo, style).is_some_and(|w| w.contains("make 4.3")));
        }
        assert_eq!(unreadable(&cargo, Style::Pipe), None);
        // No build script seen to run make: a pure Rust build reads fifo:.
        let pure = Tree {
            build_runs_make: false,
            ..cargo.clone()
        };
        assert_eq!(unreadable(&pure, Style::Fifo), None);
        // make 4.4 runs itself as $(MAKE): the make on PATH is no reader.
        let make44 = Top::Make(found("/m", Version(4, 4, 1)).unwrap());
        let beside = Tree {
            make: old_make,
            ..tree(make44.clone())
        };
        assert_eq!(unreadable(&beside, Style::Fifo), None);
        let lto = Tree {
            gcc: found("/usr/bin/cc", Version(12, 2, 0)),
            lto: true,
            ..tree(make44)
        };
        assert!(unreadable(&lto, Style::Fuse).is_some_and(|w| w.contains("gcc 12.2")));
        let pip = tree(Top::Python("/venv/bin/pip".into()));
        assert!(unreadable(&pip, Style::Pipe).is_some_and(|w| w.contains("close_fds=True")));
        assert_eq!(unreadable(&pip, Style::Fifo), None);
        let ninja = tree(ninja(Version(1, 13, 2)));
        assert!(unreadable(&ninja, Style::Fuse).is_some_and(|w| w.contains("real FIFO")));
        assert_eq!(unreadable(&ninja, Style::Fifo), None);
    }

    #[test]
    fn build_scripts_that_name_make() {
        assert!(names_make(r#"Command::new("make").arg("-C")"#));
        assert!(names_make(r#"Command::new("/usr/bin/make")"#) && names_make(r#"("gmake")"#));
        assert!(!names_make(r#"Command::new("cmake")"#) && !names_make("// make it so"));
    }

    #[test]
    fn make_names() {
        assert!(is_make_name("make") && is_make_name("gmake") && is_make_name("gnumake"));
        assert!(!is_make_name("cmake") && !is_make_name("ninja") && !is_make_name("bmake"));
    }

    /// GNU make 4.4 prints "GNU Make 4.4": exactly the first version that
    /// reads `fifo:`, wherever `auto` and the refusals look at a make.
    #[test]
    fn make_4_4_0_counts_as_a_fifo_reader_everywhere() {
        let make440 = found("/usr/bin/make", Version(4, 4, 0));
        let top = choose(&tree(Top::Make(make440.clone().unwrap())));
        assert_eq!(top.style, Style::Fuse, "{top:?}");
        let beside = Tree {
            make: make440.clone(),
            ..tree(Top::Other)
        };
        assert_eq!(choose(&beside).style, Style::Fifo);
        let cargo = Tree {
            make: make440.clone(),
            build_runs_make: true,
            ..tree(Top::Cargo)
        };
        assert_eq!(unreadable(&cargo, Style::Fifo), None);
        let pip = Tree {
            make: make440,
            ..tree(Top::Python("/venv/bin/pip".into()))
        };
        assert!(choose(&pip).left_behind.is_empty());
    }

    #[test]
    fn ninja_is_refused_fifo_for_an_old_make_only_if_build_ninja_runs_make() {
        let runs_make43 = Tree {
            make: found("/usr/bin/make", Version(4, 3, 0)),
            build_runs_make: true,
            ..tree(ninja(Version(1, 13, 2)))
        };
        assert!(unreadable(&runs_make43, Style::Fifo)
            .is_some_and(|w| w.contains("make 4.3") && w.contains("build.ninja runs")));
        let no_make = Tree {
            build_runs_make: false,
            ..runs_make43
        };
        assert_eq!(unreadable(&no_make, Style::Fifo), None);
    }

    #[test]
    fn only_a_fuse_choice_is_explained_by_its_one_wake_up_per_token() {
        let wakes = |tree: Tree| {
            choose(&tree)
                .why
                .iter()
                .any(|w| w.contains("wakes one waiter per token"))
        };
        assert!(wakes(tree(Top::Cargo)));
        assert!(wakes(tree(Top::Make(
            found("/m", Version(4, 4, 1)).unwrap()
        ))));
        assert!(!wakes(tree(Top::Other)));
        assert!(!wakes(tree(ninja(Version(1, 11, 1)))));
    }

    /// Fake tools for `inspect`: a GNU make 4.4, a ninja 1.13.0 and a gcc
    /// 12.2 that answer as the real ones do.
    const MAKE44: &str = "echo 'GNU Make 4.4'; echo 'Built for x86_64-pc-linux-gnu'";
    const NINJA113: &str = "echo 1.13.0";
    const GCC12: &str = "case \"$1\" in
--version) echo 'gcc (Debian 12.2.0-14) 12.2.0'
  echo 'Copyright (C) 2022 Free Software Foundation, Inc.';;
-dumpfullversion) echo 12.2.0;;
esac";

    fn args(words: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
        words.iter().map(|w| w.as_ref().to_owned()).collect()
    }

    #[test]
    fn ninja_s_build_file_is_read_for_lto_and_make() {
        let scratch = crate::tests::Scratch::new("inspect-ninja");
        let ninja = scratch.tool("ninja", NINJA113);
        let build = scratch.0.join("build");
        scratch.file(
            "build/build.ninja",
            "rule cc\n  command = gcc -flto=auto -c $in\n\
             rule ext\n  command = cd ext && make install\n",
        );
        let probes = Probes::open(None);
        let (top, forced, lto, runs_make) =
            inspect_command(&probes, &args(&[&ninja, &"-C", &build, &"-j8"]));
        assert_eq!(
            top,
            Top::Ninja {
                path: ninja.clone(),
                version: Some(Version(1, 13, 0))
            }
        );
        assert_eq!(forced.as_deref(), Some("-j8"));
        assert!(lto, "build.ninja compiles with -flto");
        assert!(runs_make, "build.ninja runs make");
        // Without -C it reads the build.ninja here, which has neither.
        let (_, forced, lto, runs_make) = inspect_command(&probes, &args(&[&ninja]));
        assert_eq!((forced, lto, runs_make), (None, false, false));
    }

    #[test]
    fn make_s_makefile_is_read_for_lto() {
        let scratch = crate::tests::Scratch::new("inspect-make");
        let make = scratch.tool("make", MAKE44);
        let dir = scratch.0.join("src");
        scratch.file("src/Makefile", "CFLAGS += -O2 -flto=auto\nall:\n");
        let probes = Probes::open(None);
        let (top, forced, lto, _) =
            inspect_command(&probes, &args(&[&make, &"-C", &dir, &"-j", &"4"]));
        assert_eq!(
            top,
            Top::Make(Found {
                path: make.clone(),
                version: Version(4, 4, 0)
            })
        );
        assert_eq!(forced.as_deref(), Some("-j 4"));
        assert!(lto, "the Makefile links with -flto");
        scratch.file("plain/Makefile", "all:\n");
        let (_, _, lto, _) =
            inspect_command(&probes, &args(&[&make, &"-C", &scratch.0.join("plain")]));
        assert!(!lto);
    }

    #[test]
    fn cargo_s_lock_file_is_read_for_crates_that_run_make() {
        let scratch = crate::tests::Scratch::new("inspect-cargo");
        scratch.file(
            "Cargo.lock",
            "[[package]]\nname = \"openssl-src\"\nversion = \"300.3.1\"\n",
        );
        let probes = Probes::open(None);
        let (top, _, _, runs_make) =
            inspect_command(&probes, &args(&[&"cargo", &"-C", &scratch.0, &"build"]));
        assert_eq!(top, Top::Cargo);
        assert!(runs_make, "openssl-src runs make");
    }

    #[test]
    fn the_top_tool_is_told_by_name_then_by_shebang() {
        let scratch = crate::tests::Scratch::new("top-for");
        let probes = Probes::open(None);
        let ninja = scratch.tool("ninja", NINJA113);
        assert!(
            matches!(top_for(&probes, &ninja), Top::Ninja { version: Some(v), .. } if v == Version(1, 13, 0))
        );
        assert_eq!(top_for(&probes, Path::new("cargo")), Top::Cargo);
        // Named python: no need to look inside (here, nothing to look in).
        let python = scratch.0.join("python3.12");
        assert_eq!(top_for(&probes, &python), Top::Python(python.clone()));
        let pip = scratch.file("pip", "#!/venv/bin/python3.12\nimport pip\n");
        assert_eq!(top_for(&probes, &pip), Top::Python(pip.clone()));
        let env = scratch.file("meson", "#!/usr/bin/env python3\n");
        assert_eq!(top_for(&probes, &env), Top::Python(env.clone()));
        let script = scratch.file("build.sh", "#!/bin/sh\n# runs python3 setup.py\n");
        assert_eq!(top_for(&probes, &script), Top::Other);
        let make = scratch.tool("make", MAKE44);
        assert!(matches!(top_for(&probes, &make), Top::Make(m) if m.version == Version(4, 4, 0)));
    }

    #[test]
    fn gcc_is_told_from_clang_by_its_copyright_line() {
        let scratch = crate::tests::Scratch::new("gcc");
        let probes = Probes::open(None);
        let cc = scratch.tool("cc", GCC12);
        assert_eq!(
            gcc(&probes, &cc),
            Some(Found {
                path: cc.clone(),
                version: Version(12, 2, 0)
            })
        );
        let clang = scratch.tool(
            "clang",
            "echo 'Debian clang version 14.0.6'; echo 'Target: x86_64-pc-linux-gnu'",
        );
        assert_eq!(gcc(&probes, &clang), None);
        assert_eq!(gcc(&probes, &scratch.0.join("missing")), None);
    }

    #[test]
    fn tools_found_on_path_are_named_by_where_they_are() {
        let sh = resolve(Path::new("sh"));
        assert!(sh.is_absolute() && sh.ends_with("sh"), "{}", sh.display());
        let missing = Path::new("no-such-tool-baton");
        assert_eq!(resolve(missing), missing);
    }

    #[test]
    fn cmake_build_leads_to_the_tool_its_cache_names() {
        let words = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(
            cmake_build_dir(&words("/usr/bin/cmake --build out -j 4")),
            Some(PathBuf::from("out"))
        );
        assert_eq!(
            cmake_build_dir(&words("cmake -S . --build b2")),
            Some(PathBuf::from("b2"))
        );
        assert_eq!(cmake_build_dir(&words("cmake -S . -B out")), None);
        assert_eq!(cmake_build_dir(&words("cmake --build")), None);
        assert_eq!(cmake_build_dir(&words("ninja --build out")), None);

        let scratch = crate::tests::Scratch::new("cmake");
        let ninja = scratch.tool("ninja", NINJA113);
        let out = scratch.0.join("out");
        scratch.file(
            "out/CMakeCache.txt",
            &format!(
                "CMAKE_BUILD_TYPE:STRING=Release\nCMAKE_MAKE_PROGRAM:FILEPATH={}\n",
                ninja.display()
            ),
        );
        scratch.file("out/build.ninja", "rule ld\n  command = gcc -flto $in\n");
        assert_eq!(cmake_make_program(&out), Some(ninja.clone()));
        assert_eq!(cmake_make_program(&scratch.0), None, "no cache");
        let probes = Probes::open(None);
        let (top, forced, lto, _) =
            inspect_command(&probes, &args(&[&"cmake", &"--build", &out, &"--", &"-j8"]));
        assert_eq!(
            top,
            Top::Ninja {
                path: ninja,
                version: Some(Version(1, 13, 0))
            }
        );
        assert_eq!(forced, None);
        assert!(lto, "the build.ninja in the build directory is read");
    }

    #[test]
    fn the_makefile_read_is_the_one_make_would_read() {
        let scratch = crate::tests::Scratch::new("makefile");
        let dir = scratch.0.display().to_string();
        scratch.file("Makefile", "capital\n");
        let words = |s: &[&str]| s.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        assert_eq!(makefile(&words(&["-C", &dir])), "capital\n");
        scratch.file("makefile", "lower\n");
        assert_eq!(makefile(&words(&["-C", &dir])), "lower\n");
        scratch.file("GNUmakefile", "gnu\n");
        assert_eq!(makefile(&words(&["-C", &dir])), "gnu\n");
        scratch.file("other.mk", "named\n");
        assert_eq!(makefile(&words(&["-C", &dir, "-f", "other.mk"])), "named\n");
        assert_eq!(
            makefile(&words(&["-C", &dir, "--file", "other.mk", "all"])),
            "named\n"
        );
        assert_eq!(makefile(&words(&["-C", &dir, "-f", "missing.mk"])), "");
        assert_eq!(
            makefile(&words(&[
                "-C",
                &scratch.0.join("none").display().to_string()
            ])),
            ""
        );
    }

    #[test]
    fn cargo_runs_make_when_its_lock_or_a_build_script_says_so() {
        let scratch = crate::tests::Scratch::new("cargo-make");
        let locked = scratch.0.join("locked");
        scratch.file(
            "locked/Cargo.lock",
            "[[package]]\nname = \"jemalloc-sys\"\nversion = \"0.5.4\"\n",
        );
        assert!(cargo_runs_make(&locked));
        let script = scratch.0.join("script");
        scratch.file("script/Cargo.lock", "[[package]]\nname = \"cc\"\n");
        scratch.file(
            "script/crates/ext/build.rs",
            "fn main() { Command::new(\"make\").status(); }",
        );
        assert!(cargo_runs_make(&script));
        let pure = scratch.0.join("pure");
        scratch.file("pure/Cargo.lock", "[[package]]\nname = \"cmake-parser\"\n");
        scratch.file("pure/build.rs", "fn main() { Command::new(\"cmake\"); }");
        scratch.file("pure/target/debug/build.rs", "Command::new(\"make\")");
        assert!(!cargo_runs_make(&pure));
        assert!(!cargo_runs_make(&scratch.0.join("missing")));
    }

    #[test]
    fn recipes_run_the_make_on_path_when_make_is_not_set() {
        // This machine's make (scripts/test needs a GNU make on PATH).
        let probes = Probes::open(None);
        let make = gnu_make(&probes, &make_program());
        assert!(make.is_some(), "no GNU make as $MAKE or on PATH");
        if std::env::var_os("MAKE").is_none() {
            assert_eq!(make_program(), PathBuf::from("make"));
        }
    }

    #[test]
    fn build_scripts_are_looked_for_three_directories_down_and_no_further() {
        let scratch = crate::tests::Scratch::new("build-depth");
        let runs_make = "fn main() { Command::new(\"make\").status(); }";
        scratch.file("deep/a/b/c/d/build.rs", runs_make);
        assert!(!cargo_runs_make(&scratch.0.join("deep")), "four down");
        scratch.file("deep/a/b/c/build.rs", runs_make);
        assert!(cargo_runs_make(&scratch.0.join("deep")), "three down");
    }

    #[test]
    fn dash_c_is_followed_attached_or_apart() {
        let words = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(dir_arg(&words("-C sub all")), PathBuf::from("sub"));
        assert_eq!(dir_arg(&words("-k -Csub all")), PathBuf::from("sub"));
        assert_eq!(dir_arg(&words("-k all")), PathBuf::from("."));
    }
}
