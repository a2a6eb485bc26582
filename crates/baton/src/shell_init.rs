//! `baton shell-init SHELL`: lines for a shell profile after which plain
//! `make`, `ninja`, `cargo` and `cmake --build` typed in that shell run
//! under `baton run`, and so under the broker's limit.
//!
//! Wrapper functions, not a machine-wide jobserver in MAKEFLAGS: each
//! top-level build then holds its own implicit slot from the pool (the one
//! make never writes back), so N builds add no uncounted jobs, and the
//! broker knows each build by name and takes its tokens back if it dies.
//! Functions are not inherited by the build's own processes; a shell
//! started inside a build (MAKEFLAGS already names a jobserver) runs the
//! tools as they are, so builds never nest `baton run`.

use std::path::Path;

/// The shells `shell-init` writes for.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
}

/// The lines for `shell`, calling the `baton` at `baton`.
pub fn script(shell: Shell, baton: &Path) -> String {
    let baton = baton.to_string_lossy();
    match shell {
        Shell::Bash | Shell::Zsh => posix_script(&posix_quote(&baton)),
        Shell::Fish => fish_script(&fish_quote(&baton)),
    }
}

fn posix_script(baton: &str) -> String {
    format!(
        r#"# baton shell-init: make, ninja, cargo and cmake --build run under baton's
# limit (baton run). Inside a build, whose MAKEFLAGS already names a
# jobserver, they run as they are.
__baton_run() {{
    case " ${{MAKEFLAGS-}} " in
        *--jobserver-auth=*|*--jobserver-fds=*) command "$@" ;;
        *) {baton} run -- "$@" ;;
    esac
}}
function make {{ __baton_run make "$@"; }}
function ninja {{ __baton_run ninja "$@"; }}
function cargo {{ __baton_run cargo "$@"; }}
function cmake {{
    if [ "${{1-}}" = --build ]; then __baton_run cmake "$@"; else command cmake "$@"; fi
}}
"#
    )
}

fn fish_script(baton: &str) -> String {
    format!(
        r#"# baton shell-init: make, ninja, cargo and cmake --build run under baton's
# limit (baton run). Inside a build, whose MAKEFLAGS already names a
# jobserver, they run as they are.
function __baton_run
    if string match -q -r -- '--jobserver-(auth|fds)=' " $MAKEFLAGS "
        command $argv
    else
        {baton} run -- $argv
    end
end
function make --wraps make; __baton_run make $argv; end
function ninja --wraps ninja; __baton_run ninja $argv; end
function cargo --wraps cargo; __baton_run cargo $argv; end
function cmake --wraps cmake
    if test "$argv[1]" = --build
        __baton_run cmake $argv
    else
        command cmake $argv
    end
end
"#
    )
}

/// 'text', with each ' written as '\''.
fn posix_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// 'text', with \ and ' escaped as fish reads them inside single quotes.
fn fish_quote(text: &str) -> String {
    format!("'{}'", text.replace('\\', r"\\").replace('\'', r"\'"))
}

/// The tools the wrappers stand in for.
const WRAPPED: [&str; 4] = ["make", "ninja", "cargo", "cmake"];

/// `baton shell-init --wrappers DIR`: writes DIR/make, DIR/ninja,
/// DIR/cargo and DIR/cmake, small sh scripts that run the real tool (the
/// next one on PATH after DIR) under `baton run`, for programs that start
/// builds without a shell that read the profile: scripts, IDEs, CI steps.
/// Returns the files written.
pub fn write_wrappers(dir: &Path, baton: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    for tool in WRAPPED {
        let path = dir.join(tool);
        std::fs::write(&path, wrapper(tool, &posix_quote(&baton.to_string_lossy())))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        written.push(path);
    }
    Ok(written)
}

/// One wrapper: finds the real `tool` on PATH without the wrapper's own
/// directory, then runs it under `baton run`, or as it is inside a build
/// (MAKEFLAGS names a jobserver) or for cmake other than `--build`.
fn wrapper(tool: &str, baton: &str) -> String {
    let bypass = match tool {
        "cmake" => r#"[ "${1-}" = --build ] || exec "$real" "$@""#,
        _ => "",
    };
    format!(
        r#"#!/bin/sh
# baton shell-init --wrappers: {tool} under baton's limit (baton run), for
# builds started without an interactive shell. Inside a build, whose
# MAKEFLAGS already names a jobserver, the real {tool} runs as it is.
# The build runs with this directory off PATH: baton run, and the build's
# own tools, must find the real programs, never a wrapper again.
set -f  # PATH is split on : below, never globbed
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd -P)
real=
rest=
IFS_was=$IFS; IFS=:
for dir in $PATH; do
    [ -n "$dir" ] || dir=.
    [ "$(CDPATH= cd -- "$dir" 2>/dev/null && pwd -P)" = "$here" ] && continue
    rest=${{rest:+$rest:}}$dir
    if [ -z "$real" ] && [ -x "$dir/{tool}" ] && [ ! -d "$dir/{tool}" ]; then real=$dir/{tool}; fi
done
IFS=$IFS_was
PATH=$rest
export PATH
if [ -z "$real" ]; then
    echo "baton wrapper: no {tool} on PATH besides this wrapper ($0)" >&2
    exit 127
fi
{bypass}
case " ${{MAKEFLAGS-}} " in
    *--jobserver-auth=*|*--jobserver-fds=*) exec "$real" "$@" ;;
esac
exec {baton} run -- "$real" "$@"
"#
    )
}

/// `baton shell-init --profile`: lines for /etc/profile.d (the package
/// ships them as /etc/profile.d/baton.sh) that put a user's wrapper
/// directory first on PATH, if the user made one.
pub fn profile_snippet() -> String {
    r#"# baton: if you ran `baton shell-init --wrappers`, put its wrappers first on
# PATH so that scripts, IDEs and CI steps started from this login run make,
# ninja, cargo and cmake --build under baton's limit (docs/setup.md).
baton_wrappers="${XDG_DATA_HOME:-$HOME/.local/share}/baton/bin"
if [ -x "$baton_wrappers/make" ]; then
    case ":$PATH:" in
        *":$baton_wrappers:"*) ;;
        *) PATH="$baton_wrappers:$PATH"; export PATH ;;
    esac
fi
unset baton_wrappers
"#
    .to_string()
}

/// Where `--wrappers` writes when given no directory:
/// `$XDG_DATA_HOME/baton/bin`, else `~/.local/share/baton/bin` (the
/// directory the profile snippet looks at).
pub fn default_wrapper_dir() -> std::path::PathBuf {
    let data = std::env::var_os("XDG_DATA_HOME")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(&std::env::var_os("HOME").unwrap_or_default()).join(".local/share")
        });
    data.join("baton").join("bin")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_any_path() {
        assert_eq!(posix_quote("/a b/it's"), r"'/a b/it'\''s'");
        assert_eq!(fish_quote(r"/a\b/it's"), r"'/a\\b/it\'s'");
    }

    #[test]
    fn calls_the_baton_it_was_given() {
        for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
            assert!(script(shell, Path::new("/opt/baton/bin/baton"))
                .contains("'/opt/baton/bin/baton' run -- "));
        }
    }
}
