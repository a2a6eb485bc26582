//! Just enough of POSIX threads' mutex and condition variable for the
//! broadcast scenario: the futex requeue problem is about glibc's pthread_cond_broadcast, so
//! the real thing is measured, not Rust's own futex-based Condvar.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

/// A pthread mutex guarding a `T`.
pub struct Mutex<T> {
    raw: UnsafeCell<libc::pthread_mutex_t>,
    data: UnsafeCell<T>,
}

// SAFETY: the data is only reached through a guard, which holds the mutex.
unsafe impl<T: Send> Sync for Mutex<T> {}
unsafe impl<T: Send> Send for Mutex<T> {}

impl<T> Mutex<T> {
    pub fn new(data: T) -> Self {
        Mutex {
            raw: UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER),
            data: UnsafeCell::new(data),
        }
    }

    pub fn lock(&self) -> Guard<'_, T> {
        // SAFETY: an initialised mutex that does not move while borrowed.
        unsafe { libc::pthread_mutex_lock(self.raw.get()) };
        Guard { mutex: self }
    }
}

pub struct Guard<'a, T> {
    mutex: &'a Mutex<T>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the mutex.
        unsafe { &*self.mutex.data.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the mutex, and is borrowed mutably.
        unsafe { &mut *self.mutex.data.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: this guard locked it.
        unsafe { libc::pthread_mutex_unlock(self.mutex.raw.get()) };
    }
}

/// A pthread condition variable.
pub struct Cond {
    raw: UnsafeCell<libc::pthread_cond_t>,
}

// SAFETY: condition variables exist to be shared between threads.
unsafe impl Sync for Cond {}
unsafe impl Send for Cond {}

impl Default for Cond {
    fn default() -> Self {
        Cond {
            raw: UnsafeCell::new(libc::PTHREAD_COND_INITIALIZER),
        }
    }
}

impl Cond {
    /// Waits for a signal (or a spurious wake-up), the guard's mutex
    /// released meanwhile and held again on return.
    pub fn wait<T>(&self, guard: &mut Guard<'_, T>) {
        // SAFETY: the guard holds this mutex; both live at fixed addresses.
        unsafe { libc::pthread_cond_wait(self.raw.get(), guard.mutex.raw.get()) };
    }

    pub fn signal(&self) {
        // SAFETY: an initialised condition variable.
        unsafe { libc::pthread_cond_signal(self.raw.get()) };
    }

    pub fn broadcast(&self) {
        // SAFETY: an initialised condition variable.
        unsafe { libc::pthread_cond_broadcast(self.raw.get()) };
    }
}
