//! A fork-join thread pool tuned for the engine's rhythm: a forward pass is a few hundred short
//! parallel regions (one per matmul group or attention), each a few tens of microseconds, with
//! single-threaded glue between them. General pools wake sleeping workers through the OS for
//! every region; here workers spin briefly on an epoch counter and only park when idle for
//! longer, so a region costs well under a microsecond to start while an idle engine burns no CPU.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker spins waiting for the next region before it parks.
const SPIN_FOR: Duration = Duration::from_micros(200);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Bumped once per region; workers run the job when they see a new value.
    epoch: AtomicU64,
    /// The current region's job, lifetime-erased. Only read between an epoch bump and the
    /// caller observing `pending == 0`, while the caller keeps the closure alive.
    job: UnsafeCell<Option<*const Job>>,
    /// Workers that have not yet finished the current region.
    pending: AtomicUsize,
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the thread holding `&ThreadPool` inside `run`, before the
// epoch bump (Release) and read by workers after observing it (Acquire); `run` does not return
// until every worker has signalled completion, so no read outlives the write's validity.
unsafe impl Sync for Shared {}
// SAFETY: the raw job pointer is only dereferenced under the protocol described above.
unsafe impl Send for Shared {}

/// A fixed set of threads (the caller counts as thread 0) that run one closure together.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises concurrent `run` calls from different threads.
    gate: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("threads", &self.threads()).finish()
    }
}

impl ThreadPool {
    /// A pool of `threads` threads in all (at least 1; the calling thread is one of them).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            panicked: Mutex::new(None),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("pdmesh-compute-{index}"))
                    .spawn(move || worker(&shared, index))
                    .expect("spawning a compute thread (out of OS threads?)")
            })
            .collect();
        Self { shared, workers, gate: Mutex::new(()) }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(thread_index)` once on every thread of the pool and returns when all are done.
    /// A panic in any thread is re-raised here after the others finish.
    pub fn run<F: Fn(usize) + Sync>(&self, f: F) {
        if self.workers.is_empty() {
            f(0);
            return;
        }
        let _gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let job: *const (dyn Fn(usize) + Sync + '_) = &f;
        // SAFETY: erasing the lifetime is sound because we wait below for every worker to finish
        // with the pointer before `f` goes out of scope; the gate keeps other callers out.
        let job: *const Job = unsafe { std::mem::transmute(job) };
        // SAFETY: no worker reads `job` until it sees the epoch bump below.
        unsafe { *self.shared.job.get() = Some(job) };
        self.shared.pending.store(self.workers.len(), Ordering::Relaxed);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        if self.shared.sleeping.load(Ordering::SeqCst) > 0 {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while self.shared.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker is done with the job; clear it so nothing dangles.
        unsafe { *self.shared.job.get() = None };
        if let Err(p) = mine {
            resume_unwind(p);
        }
        let theirs = self.shared.panicked.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = theirs {
            resume_unwind(p);
        }
    }

    /// Splits `0..n` into one contiguous range per thread and runs `f(range)` on each.
    pub fn for_ranges<F: Fn(std::ops::Range<usize>) + Sync>(&self, n: usize, f: F) {
        let t = self.threads();
        if t == 1 || n <= 1 {
            f(0..n);
            return;
        }
        self.run(|i| {
            let r = split(n, t, i);
            if !r.is_empty() {
                f(r);
            }
        });
    }
}

/// The `i`-th of `parts` near-equal contiguous pieces of `0..n`.
pub fn split(n: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let lo = n * i / parts;
    let hi = n * (i + 1) / parts;
    lo..hi
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let now = shared.epoch.load(Ordering::Acquire);
            if now != seen || shared.shutdown.load(Ordering::Acquire) {
                seen = now;
                break;
            }
            spins += 1;
            if spins.is_multiple_of(64) && start.elapsed() > SPIN_FOR {
                let guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
                shared.sleeping.fetch_add(1, Ordering::SeqCst);
                let guard = shared
                    .wake
                    .wait_while(guard, |_| {
                        shared.epoch.load(Ordering::SeqCst) == seen
                            && !shared.shutdown.load(Ordering::SeqCst)
                    })
                    .unwrap_or_else(|e| e.into_inner());
                shared.sleeping.fetch_sub(1, Ordering::SeqCst);
                drop(guard);
            } else {
                std::hint::spin_loop();
            }
        }
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: the epoch bump we just observed (Acquire) happened after the job was stored,
        // and the caller keeps it alive until we decrement `pending`.
        let job = unsafe { *shared.job.get() };
        if let Some(job) = job {
            // SAFETY: see above; the pointer is valid for the duration of this region.
            let job = unsafe { &*job };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| job(index))) {
                *shared.panicked.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
            }
        }
        shared.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A raw pointer that threads of one region may write through at disjoint indices.
#[derive(Debug, Clone, Copy)]
pub struct SharedMut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: users only write disjoint elements from different threads (documented on `slice`).
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(s: &mut [T]) -> Self {
        Self { ptr: s.as_mut_ptr(), len: s.len() }
    }

    /// A mutable view of `range`.
    ///
    /// # Safety
    /// No two live views handed out from the same `SharedMut` may overlap, and the original
    /// slice must outlive them (true within one `ThreadPool::run`).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "SharedMut range out of bounds");
        // SAFETY: bounds checked above; disjointness is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// Writes one element.
    ///
    /// # Safety
    /// No other thread may access element `i` during the region.
    #[inline(always)]
    pub unsafe fn write(&self, i: usize, v: T) {
        assert!(i < self.len, "SharedMut index out of bounds");
        // SAFETY: bounds checked above; exclusivity is the caller's contract.
        unsafe { self.ptr.add(i).write(v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_thread_runs_each_region() {
        let pool = ThreadPool::new(3);
        let hits = AtomicUsize::new(0);
        for _ in 0..1000 {
            pool.run(|_| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 3000);
    }

    #[test]
    fn ranges_cover_exactly_once() {
        let pool = ThreadPool::new(2);
        for n in [0usize, 1, 2, 3, 17, 1000] {
            let mut v = vec![0u8; n];
            let out = SharedMut::new(&mut v);
            pool.for_ranges(n, |r| {
                // SAFETY: ranges from `split` are disjoint.
                for x in unsafe { out.slice(r) } {
                    *x += 1;
                }
            });
            assert!(v.iter().all(|&x| x == 1), "n={n}");
        }
    }

    #[test]
    fn wakes_after_parking() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN_FOR * 5);
        let hits = AtomicUsize::new(0);
        pool.run(|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn worker_panic_reaches_caller_and_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(|i| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let hits = AtomicUsize::new(0);
        pool.run(|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }
}
