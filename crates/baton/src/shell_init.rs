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
