//! A build's own token file on the broker's FUSE mount. The broker serves
//! the reads and writes (baton-broker's `fuse` module); `baton run` only
//! creates the file, names it in MAKEFLAGS and removes it at the end.

use anyhow::{Context, Result};
use baton_core::paths::fuse_mount_point;
use nix::sys::statfs::{statfs, FUSE_SUPER_MAGIC};
use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A build's token file; removed on drop.
#[derive(Debug)]
pub struct BuildFile {
    path: PathBuf,
}

impl BuildFile {
    /// What to put after `--jobserver-auth=fifo:`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Asks the broker to hold this file's polls (see
    /// [`baton_client::hold_polls`]). Either way the file works: a broker
    /// from before held polls (`ENOTSUP`) is not worth a line in the
    /// build's log, anything else is.
    pub fn hold_polls(&self) {
        match baton_client::hold_polls(&self.path) {
            Err(e) if e.raw_os_error() != Some(libc::ENOTSUP) => {
                crate::log::warn(format_args!(
                    "the broker will not hold polls of {} ({e}); the file works without",
                    self.path.display()
                ));
            }
            _ => {}
        }
    }

    /// A read end (non-blocking) and a write end on the file, for a client
    /// that takes descriptors (bmake's `-J R,W`).
    pub fn open_ends(&self) -> Result<(OwnedFd, OwnedFd)> {
        let open = |options: &mut OpenOptions| {
            options
                .open(&self.path)
                .with_context(|| format!("cannot open the token file {}", self.path.display()))
        };
        let read = open(OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK))?;
        let write = open(OpenOptions::new().write(true))?;
        Ok((read.into(), write.into()))
    }
}

impl Drop for BuildFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Makes a token file for one build in the FUSE mount of the broker at
/// `socket`, named after our pid and `label` so that `ls` and `baton
/// status` tell builds apart. None if that broker has no FUSE mount we
/// may use (the caller then uses the FIFO bridge): none at all, or one
/// closed to us. A FUSE mount without `allow_other` refuses every other
/// uid (a rootless container's, say) yet answers its statfs with the FUSE
/// magic all the same, so access(2) decides.
///
/// # Errors
/// The mount exists but the file cannot be created there.
pub fn create(socket: &Path, label: &str) -> Result<Option<BuildFile>> {
    let dir = fuse_mount_point(socket);
    if !statfs(&dir).is_ok_and(|fs| fs.filesystem_type() == FUSE_SUPER_MAGIC) {
        return Ok(None);
    }
    use nix::unistd::{access, AccessFlags};
    if access(&dir, AccessFlags::W_OK | AccessFlags::X_OK).is_err() {
        return Ok(None);
    }
    crate::sweep_left_by_dead_runs(&dir, |name| name.split_once('-')?.0.parse().ok());
    let path = dir.join(file_name(std::process::id(), label));
    let create = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
    };
    // A file of the same name was left by a killed run with our pid.
    let created = create().or_else(|e| {
        if e.kind() == ErrorKind::AlreadyExists {
            std::fs::remove_file(&path).and_then(|_| create())
        } else {
            Err(e)
        }
    });
    created.with_context(|| format!("cannot create the token file {}", path.display()))?;
    Ok(Some(BuildFile { path }))
}

/// `<pid>-<label>`, with the label reduced to characters safe in a path
/// and in MAKEFLAGS (which splits on spaces).
fn file_name(pid: u32, label: &str) -> String {
    let safe: String = label
        .chars()
        .take(80)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{pid}-{safe}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn build_file_names_are_safe_in_makeflags() {
        assert_eq!(
            super::file_name(42, "baton run -- make -C a/b"),
            "42-baton_run_--_make_-C_a_b"
        );
    }
}
