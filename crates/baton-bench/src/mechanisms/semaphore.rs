//! Semaphores: POSIX (unnamed, process-shared, in shared memory) and
//! System V (the kernel's semaphore arrays, as in sembench).

use super::{Pool, Tokens};
use crate::sys::{self, SharedMemory};
use anyhow::{Context, Result};
use std::cell::UnsafeCell;

/// A `sem_t` that lives in memory shared across fork.
struct SemCell(UnsafeCell<libc::sem_t>);

impl Default for SemCell {
    fn default() -> Self {
        // SAFETY: sem_t is plain data; sem_init gives it meaning.
        SemCell(UnsafeCell::new(unsafe { std::mem::zeroed() }))
    }
}

// SAFETY: a process-shared semaphore is made to be used from many threads
// and processes at once; all access goes through sem_* calls.
unsafe impl Sync for SemCell {}

pub struct Posix {
    sem: SharedMemory<SemCell>,
}

impl Posix {
    pub fn new(tokens: u32) -> Result<Self> {
        let sem = SharedMemory::<SemCell>::new(1)?;
        // SAFETY: initialising the zeroed sem_t in place, shared (pshared=1).
        sys::check(unsafe { libc::sem_init(sem[0].0.get(), 1, tokens) }).context("sem_init")?;
        Ok(Posix { sem })
    }

    fn sem(&self) -> *mut libc::sem_t {
        self.sem[0].0.get()
    }
}

impl Drop for Posix {
    fn drop(&mut self) {
        // SAFETY: every process that used it has exited.
        unsafe { libc::sem_destroy(self.sem()) };
    }
}

impl Pool for Posix {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        Ok(Box::new(self))
    }
}

impl Tokens for &Posix {
    fn acquire(&mut self, n: u32) -> Result<()> {
        for _ in 0..n {
            // SAFETY: an initialised semaphore, alive as long as self.
            sys::retry(|| unsafe { libc::sem_wait(self.sem()) }).context("sem_wait")?;
        }
        Ok(())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        for _ in 0..n {
            // SAFETY: as in acquire.
            sys::check(unsafe { libc::sem_post(self.sem()) }).context("sem_post")?;
        }
        Ok(())
    }
}

pub struct Sysv {
    id: libc::c_int,
}

impl Sysv {
    pub fn new(tokens: u32) -> Result<Self> {
        // SAFETY: semget/semctl take plain integers.
        let id = sys::check(unsafe { libc::semget(libc::IPC_PRIVATE, 1, libc::IPC_CREAT | 0o600) })
            .context("semget")?;
        let sem = Sysv { id };
        sys::check(unsafe { libc::semctl(id, 0, libc::SETVAL, tokens as libc::c_int) })
            .context("semctl SETVAL")?;
        Ok(sem)
    }

    /// One semop adding `delta` (waiting, if negative, until it can).
    fn add(&self, delta: i32) -> Result<()> {
        let mut op = libc::sembuf {
            sem_num: 0,
            sem_op: delta as libc::c_short,
            sem_flg: 0,
        };
        // SAFETY: one sembuf on this stack frame.
        sys::retry(|| unsafe { libc::semop(self.id, &mut op, 1) }).context("semop")?;
        Ok(())
    }
}

impl Drop for Sysv {
    fn drop(&mut self) {
        // SAFETY: removes the set this value created; its users have exited.
        unsafe { libc::semctl(self.id, 0, libc::IPC_RMID) };
    }
}

impl Pool for Sysv {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        Ok(Box::new(self))
    }
}

impl Tokens for &Sysv {
    fn acquire(&mut self, n: u32) -> Result<()> {
        self.add(-(n as i32))
    }

    fn release(&mut self, n: u32) -> Result<()> {
        self.add(n as i32)
    }
}
