//! The engine thread every worker node runs, written once: it owns the node's core (its
//! engine and everything the engine's state depends on), takes commands from the async side
//! through a bounded channel, and steps the core whenever there is work. Between steps it
//! drains every waiting command (so KV writes never wait behind more than one step), frees
//! what expired or lost its client, and publishes the core's counts.
//!
//! A core that panics takes its thread down, and the node with it: `died` is cancelled, which
//! takes the node out of the mesh at once (see `node::serve`), the outputs it held are dropped,
//! which ends every in-flight request with a status naming the node, and new calls find the
//! command channel closed.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Longest the idle thread sleeps before checking leases and closed outputs again.
const IDLE_TICK: Duration = Duration::from_millis(20);

/// Most commands queued for an engine thread.
pub const COMMAND_QUEUE: usize = 64;

/// What an engine thread drives.
pub trait Core: Send + 'static {
    type Command: Send + 'static;
    type Counts: Copy + Send + 'static;

    fn handle(&mut self, cmd: Self::Command, now: Instant);
    /// Ends what expired or lost its client; returns when something expires next.
    fn sweep(&mut self, now: Instant) -> Option<Instant>;
    /// Whether a step would do anything.
    fn has_work(&mut self) -> bool;
    fn step(&mut self, now: Instant);
    /// Whether nothing is in flight: the thread ends once this holds and no command can come.
    fn is_idle(&self) -> bool;
    fn counts(&self) -> Self::Counts;
}

/// Test-only fault injection (none in production).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The core panics at this step (counted from 1).
    pub panic_at_step: Option<u64>,
    /// Each step waits this long first: a slow engine, so a test can act mid-request.
    pub step_delay: Duration,
}

/// Starts the engine thread. It runs until every command sender is dropped and nothing is in
/// flight, or until the core panics (then `died` is cancelled).
pub fn spawn<C: Core>(
    name: &str,
    core: C,
    rx: mpsc::Receiver<C::Command>,
    counts: Arc<Mutex<C::Counts>>,
    died: CancellationToken,
    faults: Faults,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let rt = tokio::runtime::Handle::current();
    let thread = name.to_string();
    std::thread::Builder::new().name(name.into()).spawn(move || {
        let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
            run(core, rx, &rt, &counts, faults);
        }));
        if let Err(panic) = ran {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            tracing::error!(thread, "the engine thread died ({why}); leaving the mesh");
            died.cancel();
        }
    })
}

fn run<C: Core>(
    mut core: C,
    mut rx: mpsc::Receiver<C::Command>,
    rt: &tokio::runtime::Handle,
    counts: &Mutex<C::Counts>,
    faults: Faults,
) {
    let mut open = true;
    let mut steps = 0u64;
    loop {
        let now = Instant::now();
        let next = core.sweep(now);
        if !core.has_work() {
            if !open && core.is_idle() {
                break;
            }
            let wait = next.map_or(IDLE_TICK, |d| d.saturating_duration_since(now)).min(IDLE_TICK);
            if open {
                match rt.block_on(async { tokio::time::timeout(wait, rx.recv()).await }) {
                    Ok(Some(cmd)) => core.handle(cmd, Instant::now()),
                    Ok(None) => open = false,
                    Err(_) => {}
                }
            } else {
                std::thread::sleep(wait);
            }
        }
        while open {
            match rx.try_recv() {
                Ok(cmd) => core.handle(cmd, Instant::now()),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        if core.has_work() {
            steps += 1;
            if faults.panic_at_step == Some(steps) {
                panic!("fault injection: the engine panics at step {steps}");
            }
            if !faults.step_delay.is_zero() {
                std::thread::sleep(faults.step_delay);
            }
            core.step(Instant::now());
        }
        *counts.lock().expect("counts lock is never poisoned") = core.counts();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts steps until told to stop; `work` steps are pending.
    struct Counter {
        work: u32,
        handled: u32,
        stepped: u32,
    }

    impl Core for Counter {
        type Command = u32;
        type Counts = (u32, u32);
        fn handle(&mut self, cmd: u32, _: Instant) {
            self.handled += 1;
            self.work += cmd;
        }
        fn sweep(&mut self, _: Instant) -> Option<Instant> {
            None
        }
        fn has_work(&mut self) -> bool {
            self.work > 0
        }
        fn step(&mut self, _: Instant) {
            self.work -= 1;
            self.stepped += 1;
        }
        fn is_idle(&self) -> bool {
            self.work == 0
        }
        fn counts(&self) -> (u32, u32) {
            (self.handled, self.stepped)
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_thread_works_off_every_command_then_ends() {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let counts = Arc::new(Mutex::new((0, 0)));
        let died = CancellationToken::new();
        let core = Counter { work: 0, handled: 0, stepped: 0 };
        let t = spawn("test", core, rx, Arc::clone(&counts), died.clone(), Faults::default())
            .expect("spawns");
        for n in [3, 4] {
            tx.send(n).await.expect("sent");
        }
        drop(tx);
        tokio::task::spawn_blocking(move || t.join()).await.expect("joined").expect("no panic");
        assert_eq!(*counts.lock().expect("lock"), (2, 7));
        assert!(!died.is_cancelled());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_core_marks_the_node_dead_and_closes_its_channel() {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let died = CancellationToken::new();
        let core = Counter { work: 0, handled: 0, stepped: 0 };
        let faults = Faults { panic_at_step: Some(2), ..Faults::default() };
        let t = spawn("test", core, rx, Arc::new(Mutex::new((0, 0))), died.clone(), faults)
            .expect("spawns");
        tx.send(5).await.expect("sent");
        tokio::time::timeout(Duration::from_secs(5), died.cancelled()).await.expect("died");
        tokio::task::spawn_blocking(move || t.join()).await.expect("joined").expect("caught");
        assert!(tx.send(1).await.is_err(), "nobody takes commands any more");
    }
}
