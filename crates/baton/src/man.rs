//! `baton man`: manual pages from the clap definitions (clap_mangen), one
//! for baton and one per subcommand (`baton-run.1`, ...), each with the
//! environment it reads, the files it uses, and pages to see also.

use clap::Command;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The environment variables baton reads, and for which commands ("" is
/// every command that finds a broker).
const ENVIRONMENT: &[(&str, &[&str], &str)] = &[
    (
        "BATON_SOCKET",
        &[],
        "The broker's socket when --socket is not given. baton run sets it (absolute) for the \
command it runs, so that everything under it finds the same broker.",
    ),
    (
        "XDG_RUNTIME_DIR",
        &[],
        "Without --socket or BATON_SOCKET, the socket is $XDG_RUNTIME_DIR/baton/socket; without \
it, /tmp/baton-$UID/socket.",
    ),
    (
        "BATON_NO_AUTOSTART",
        &["run", "config"],
        "Set to anything but empty or 0: baton run starts no broker when none answers, and \
fails instead.",
    ),
    (
        "XDG_CONFIG_HOME",
        &["run", "serve", "config"],
        "The config file is $XDG_CONFIG_HOME/baton/config.toml, else \
$HOME/.config/baton/config.toml.",
    ),
    (
        "HOME",
        &["run", "serve", "config"],
        "Where the config file is when XDG_CONFIG_HOME is not set.",
    ),
    (
        "MAKEFLAGS",
        &["run", "shell-init"],
        "baton run sets MAKEFLAGS and CARGO_MAKEFLAGS for the command it runs (its GNU \
jobserver). A baton run whose MAKEFLAGS already names a jobserver, under a baton run of the \
same socket, runs its command under that jobserver; the shell-init wrappers then call the \
tool directly.",
    ),
    (
        "MAKE",
        &["run"],
        "The make a build's recipes run (default make): baton run looks at its version to choose \
the jobserver style (--jobserver-style auto).",
    ),
    (
        "CC",
        &["run"],
        "The C compiler (default cc): baton run looks at it to choose the jobserver style.",
    ),
    (
        "LISTEN_FDS",
        &["serve"],
        "With LISTEN_PID, a listening socket passed by systemd (socket activation): baton serve \
serves it instead of binding its own.",
    ),
];

/// The files baton uses, and for which commands ([] is every one).
const FILES: &[(&str, &[&str], &str)] = &[
    (
        "$XDG_CONFIG_HOME/baton/config.toml",
        &["run", "serve", "config"],
        "The config file: jobs, idle-timeout, weight, the gates, a [cluster] table. baton config \
shows it; baton run only warns about a bad line, baton serve and baton config refuse it.",
    ),
    (
        "$XDG_RUNTIME_DIR/baton/socket",
        &[],
        "The broker's socket (mode 0600), else /tmp/baton-$UID/socket. Its directory is the \
broker's private directory (mode 0700), which holds the rest.",
    ),
    (
        "<socket>.lock",
        &["serve", "stop"],
        "Held by the broker serving the socket, so that two never serve one path.",
    ),
    (
        "broker.log",
        &["run", "serve", "stop"],
        "Beside the socket: the log of a broker baton run started (moved to broker.log.old past \
1 MiB). The only file a broker that stops cleanly leaves.",
    ),
    (
        "fuse/",
        &["run", "serve"],
        "Beside the socket: the FUSE token files the broker mounts.",
    ),
    (
        "probes",
        &["run"],
        "Beside the socket: what baton run learnt of build tools' jobserver support.",
    ),
    (
        "<socket>.autostart, <socket>.handover, <socket>.fuse-keeper",
        &["run", "serve"],
        "The lock baton run takes while it starts a broker; where a successor asks the broker \
for its state (serve --replace); where a killed broker's FUSE mount waits for the next.",
    ),
];

/// Writes baton.1 and one page per subcommand into `dir`; returns their
/// paths.
pub fn write_pages(cli: Command, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut cli = cli.disable_help_subcommand(true);
    cli.build();
    let pages = pages(&cli);
    let names: Vec<String> = pages.iter().map(|(name, _, _)| name.clone()).collect();
    let mut written = Vec::new();
    for (name, command, sub) in &pages {
        let path = dir.join(format!("{name}.1"));
        let mut file = std::fs::File::create(&path)?;
        file.write_all(&page(command, sub, &names)?)?;
        written.push(path);
    }
    Ok(written)
}

/// The top-level page alone, for `baton man` with no directory.
pub fn top_page(cli: Command) -> std::io::Result<Vec<u8>> {
    let mut cli = cli.disable_help_subcommand(true);
    cli.build();
    let names: Vec<String> = pages(&cli).into_iter().map(|(name, _, _)| name).collect();
    page(&cli, "", &names)
}

/// (page name, command, subcommand name) for baton and each visible
/// subcommand, depth first.
fn pages(cli: &Command) -> Vec<(String, Command, String)> {
    let mut pages = vec![("baton".to_string(), cli.clone(), String::new())];
    fn walk(
        prefix: &str,
        command: &Command,
        top: &str,
        pages: &mut Vec<(String, Command, String)>,
    ) {
        for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
            let name = format!("{prefix}-{}", sub.get_name());
            let top = if top.is_empty() { sub.get_name() } else { top };
            pages.push((name.clone(), sub.clone(), top.to_string()));
            walk(&name, sub, top, pages);
        }
    }
    walk("baton", cli, "", &mut pages);
    pages
}

/// One page: clap_mangen's sections, then ENVIRONMENT, FILES and SEE ALSO
/// for `sub` (the top-level subcommand it belongs to; "" for baton).
fn page(command: &Command, sub: &str, names: &[String]) -> std::io::Result<Vec<u8>> {
    let man = clap_mangen::Man::new(command.clone())
        .source(format!("baton {}", env!("CARGO_PKG_VERSION")))
        .manual("baton manual");
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    if command.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut out)?;
    }
    if command.get_subcommands().any(|s| !s.is_hide_set()) {
        man.render_subcommands_section(&mut out)?;
    }
    if command.get_after_help().is_some() || command.get_after_long_help().is_some() {
        man.render_extra_section(&mut out)?;
    }
    out.extend(definitions("ENVIRONMENT", ENVIRONMENT, sub).into_bytes());
    out.extend(definitions("FILES", FILES, sub).into_bytes());
    out.extend(see_also(command, names).into_bytes());
    if command.get_version().is_some() {
        man.render_version_section(&mut out)?;
    }
    Ok(ascii_only(&out).into_bytes())
}

/// Non-ASCII characters (µ, dashes in the help texts) as roff's `\[uXXXX]`,
/// which every roff reads whatever its input encoding.
fn ascii_only(page: &[u8]) -> String {
    String::from_utf8_lossy(page)
        .chars()
        .map(|c| match c.is_ascii() {
            true => c.to_string(),
            false => format!("\\[u{:04X}]", u32::from(c)),
        })
        .collect()
}

/// A section of `.TP` entries: those for every command, and those for
/// `sub` (all of them on the top-level page).
fn definitions(title: &str, entries: &[(&str, &[&str], &str)], sub: &str) -> String {
    let mut roff = format!(".SH {title}\n");
    for (name, commands, text) in entries {
        if sub.is_empty() || commands.is_empty() || commands.contains(&sub) {
            roff.push_str(&format!(
                ".TP\n\\fB{}\\fR\n{}\n",
                escape(name),
                escape(text)
            ));
        }
    }
    roff
}

/// baton(1) and the pages of the same family that were generated: the
/// parent's and the subcommands'.
fn see_also(command: &Command, names: &[String]) -> String {
    let own = command
        .get_display_name()
        .unwrap_or(command.get_name())
        .to_string();
    let related: Vec<&String> = names
        .iter()
        .filter(|name| {
            **name != own
                && (*name == "baton"
                    || own.starts_with(&format!("{name}-"))
                    || (name.starts_with(&format!("{own}-"))
                        && !name[own.len() + 1..].contains('-')))
        })
        .collect();
    let list: Vec<String> = related
        .iter()
        .map(|name| format!("\\fB{}\\fR(1)", escape(name)))
        .collect();
    format!(".SH \"SEE ALSO\"\n{}\n", list.join(", "))
}

/// Text as roff reads it: backslashes doubled, hyphens minus signs, and
/// no line starting with a control character.
fn escape(text: &str) -> String {
    let text = text.replace('\\', "\\e").replace('-', "\\-");
    match text.starts_with(['.', '\'']) {
        true => format!("\\&{text}"),
        false => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// The `.TP` names of section `title` of the page of `name`.
    fn entries(name: &str, title: &str) -> Vec<String> {
        let mut cli = crate::Cli::command().disable_help_subcommand(true);
        cli.build();
        let pages = pages(&cli);
        let names: Vec<String> = pages.iter().map(|(n, _, _)| n.clone()).collect();
        let (_, command, sub) = pages.iter().find(|(n, _, _)| n == name).unwrap();
        let text = String::from_utf8(page(command, sub, &names).unwrap()).unwrap();
        let section = text.split(&format!(".SH {title}\n")).nth(1).unwrap();
        let section = section.split(".SH ").next().unwrap();
        section
            .split(".TP\n\\fB")
            .skip(1)
            .filter_map(|entry| Some(entry.split_once("\\fR")?.0.replace("\\-", "-")))
            .collect()
    }

    /// A subcommand's page lists what every command reads (the socket's
    /// variables: `baton stop` finds its broker by them too) beside what
    /// it reads alone, and not what only other commands read.
    #[test]
    fn a_subcommands_page_lists_what_every_command_reads_and_its_own() {
        let stop = entries("baton-stop", "ENVIRONMENT");
        assert_eq!(stop, ["BATON_SOCKET", "XDG_RUNTIME_DIR"], "{stop:?}");
        let run = entries("baton-run", "ENVIRONMENT");
        for wanted in [
            "BATON_SOCKET",
            "XDG_RUNTIME_DIR",
            "BATON_NO_AUTOSTART",
            "MAKEFLAGS",
        ] {
            assert!(run.contains(&wanted.to_string()), "{wanted} not in {run:?}");
        }
        assert!(!run.contains(&"LISTEN_FDS".to_string()), "{run:?}");
        let files = entries("baton-stop", "FILES");
        assert_eq!(
            files,
            [
                "$XDG_RUNTIME_DIR/baton/socket",
                "<socket>.lock",
                "broker.log"
            ],
            "{files:?}"
        );
    }
}
