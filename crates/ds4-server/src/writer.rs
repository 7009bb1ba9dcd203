//! A background thread for the disk KV cache's writes. Writing a checkpoint (serialising the
//! snapshot, `fsync`, the rename) took 0.6-1.0 s for a 16k-token session on the H200 host (85-140
//! MiB), and the worker used to do it between prefill steps, so a coding agent's cold turn
//! waited 1.3 of its 3.0 s to the first token on two of them. The worker now takes the snapshot
//! (the state must not move under it) and hands the write over; the GPU goes on meanwhile.
//!
//! Ordering and memory: jobs run one at a time in submission order; the worker waits for the
//! writer to be idle before taking the next snapshot ([`Writer::wait_idle`]), so no more than
//! one snapshot is in host memory at a time, as before; it also waits before every disk lookup
//! and before acknowledging a shutdown, so a lookup sees every checkpoint stored before it and
//! a clean shutdown leaves nothing unwritten. Dropping the writer finishes its queue.

use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Jobs submitted and not yet finished, with a condition to wait on.
type Pending = Arc<(Mutex<usize>, Condvar)>;

pub(crate) struct Writer {
    tx: Option<mpsc::Sender<Job>>,
    pending: Pending,
    thread: Option<JoinHandle<()>>,
}

/// Counts a job finished when dropped.
struct Finished(Pending);

impl Drop for Finished {
    fn drop(&mut self) {
        let (n, cv) = &*self.0;
        let mut n = n.lock().unwrap_or_else(|e| e.into_inner());
        *n -= 1;
        cv.notify_all();
    }
}

impl Writer {
    pub(crate) fn new(name: &str) -> Writer {
        let (tx, rx) = mpsc::channel::<Job>();
        let pending: Pending = Arc::new((Mutex::new(0), Condvar::new()));
        let p = pending.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for job in rx {
                    let _done = Finished(p.clone());
                    // A job that panics (a bug: writes report their errors) has printed its
                    // message; the thread goes on with the next.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })
            .ok();
        Writer {
            tx: thread.as_ref().map(|_| tx),
            pending,
            thread,
        }
    }

    /// Runs `job` on the writer thread after those submitted before it; on the caller's
    /// thread when the writer thread could not start or has ended.
    pub(crate) fn submit(&self, job: impl FnOnce() + Send + 'static) {
        *self.pending.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let job: Job = Box::new(job);
        let job = match &self.tx {
            Some(tx) => match tx.send(job) {
                Ok(()) => return,
                Err(mpsc::SendError(job)) => job,
            },
            None => job,
        };
        let _done = Finished(self.pending.clone());
        job();
    }

    /// Blocks until every submitted job has finished.
    pub(crate) fn wait_idle(&self) {
        let (n, cv) = &*self.pending;
        let mut n = n.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = cv.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.tx.take()); // ends the thread's loop once the queue is done
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn submit_returns_before_the_job_finishes_and_wait_idle_waits_for_it() {
        let w = Writer::new("test-writer");
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        w.submit(move || {
            go_rx.recv().unwrap(); // held until the test lets it go
            l.lock().unwrap().push(1);
        });
        let l = log.clone();
        w.submit(move || l.lock().unwrap().push(2));
        // Both submitted while the first job is blocked: nothing has run yet.
        assert!(log.lock().unwrap().is_empty());
        let done = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|s| {
            s.spawn(|| {
                w.wait_idle();
                done.store(1, Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(done.load(Ordering::SeqCst), 0, "wait_idle returned early");
            go_tx.send(()).unwrap();
        });
        assert_eq!(done.load(Ordering::SeqCst), 1);
        assert_eq!(*log.lock().unwrap(), [1, 2], "jobs ran out of order");
    }

    #[test]
    fn dropping_the_writer_finishes_its_queue() {
        let n = Arc::new(AtomicUsize::new(0));
        {
            let w = Writer::new("test-writer");
            for _ in 0..5 {
                let n = n.clone();
                w.submit(move || {
                    std::thread::sleep(Duration::from_millis(10));
                    n.fetch_add(1, Ordering::SeqCst);
                });
            }
        }
        assert_eq!(n.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn a_panicking_job_does_not_hang_later_waits() {
        let w = Writer::new("test-writer");
        w.submit(|| panic!("a failing write (expected in this test)"));
        w.wait_idle();
        let n = Arc::new(AtomicUsize::new(0));
        let m = n.clone();
        w.submit(move || {
            m.fetch_add(1, Ordering::SeqCst);
        });
        w.wait_idle();
        assert_eq!(
            n.load(Ordering::SeqCst),
            1,
            "the job after the panic did not run"
        );
    }
}
