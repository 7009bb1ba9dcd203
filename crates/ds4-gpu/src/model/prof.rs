//! `DS4_GPU_PROFILE=1`: device time per op, from events recorded around each backend op on the
//! stream (no syncs inside a step; the events are read at the end of each step). The table is
//! printed to stderr when the backend is dropped: where the time of a step goes, by op.
//!
//! Columns beside the device time (all per call): `max us` (the longest window: a one-time cost
//! such as the library loading a kernel on first use shows there, not as a per-call one), `host
//! us` (from the guard's creation to its drop: the op's host work and launches, and any wait on
//! the device inside it), and `gap us` (device time from the previous op's end event to this
//! op's start event: the device idles there when the host fell behind, e.g. after a host sync;
//! a nested op's gap also holds its outer op's work before it). An op whose window is close to
//! its host time while the others' windows are far above theirs had the device waiting for the
//! host inside its window.

use super::GpuBackend;
use crate::runtime::Event;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// One finished op of the current step.
struct Pending {
    name: String,
    start: Event,
    end: Event,
    /// The end event of the op that ended last before this one started (None: the first op
    /// of the step).
    prev: Option<Event>,
    host_ms: f64,
}

/// Sums per op name over the run.
#[derive(Default)]
struct Total {
    ms: f64,
    calls: u64,
    max_ms: f64,
    host_ms: f64,
    gap_ms: f64,
}

#[derive(Default)]
pub(crate) struct Prof {
    pending: Mutex<Vec<Pending>>,
    spare: Mutex<Vec<Event>>,
    /// The end event of the op that ended last in this step (cleared when a step is read).
    last_end: Mutex<Option<Event>>,
    totals: Mutex<HashMap<String, Total>>,
    steps: Mutex<(u64, f64)>,
    last: Mutex<Option<Instant>>,
}

/// Records the end event of one op when dropped.
pub(crate) struct ProfGuard<'a> {
    b: &'a GpuBackend,
    name: String,
    start: Event,
    prev: Option<Event>,
    t0: Instant,
}

impl GpuBackend {
    fn event(&self, p: &Prof) -> Option<Event> {
        if let Some(e) = p.spare.lock().unwrap().pop() {
            return Some(e);
        }
        self.note(self.gpu.runtime().event_create())
    }

    /// Start timing op `name` (None when profiling is off).
    pub(crate) fn prof(&self, name: impl FnOnce() -> String) -> Option<ProfGuard<'_>> {
        let p = self.prof.as_ref()?;
        let t0 = Instant::now();
        let start = self.event(p)?;
        self.note(self.gpu.runtime().event_record(start, self.stream))?;
        Some(ProfGuard {
            b: self,
            name: name(),
            start,
            prev: *p.last_end.lock().unwrap(),
            t0,
        })
    }

    /// Read the events of the finished step into the totals.
    pub(crate) fn prof_collect(&self) {
        let Some(p) = self.prof.as_ref() else { return };
        let rt = self.gpu.runtime();
        let _ = rt.synchronize();
        let pending = std::mem::take(&mut *p.pending.lock().unwrap());
        *p.last_end.lock().unwrap() = None;
        let mut totals = p.totals.lock().unwrap();
        let mut spare = p.spare.lock().unwrap();
        for q in &pending {
            if let Ok(ms) = rt.event_elapsed_ms(q.start, q.end) {
                let gap = q
                    .prev
                    .and_then(|e| rt.event_elapsed_ms(e, q.start).ok())
                    .map_or(0.0, |g| g.max(0.0) as f64);
                let t = totals.entry(q.name.clone()).or_default();
                t.ms += ms as f64;
                t.calls += 1;
                t.max_ms = t.max_ms.max(ms as f64);
                t.host_ms += q.host_ms;
                t.gap_ms += gap;
            }
        }
        // Every event back to the spares only after all were read (a `prev` is another op's end).
        for q in pending {
            spare.push(q.start);
            spare.push(q.end);
        }
        let now = Instant::now();
        let mut last = p.last.lock().unwrap();
        if let Some(l) = *last {
            let mut s = p.steps.lock().unwrap();
            s.0 += 1;
            s.1 += (now - l).as_secs_f64() * 1e3;
        }
        *last = Some(now);
    }

    pub(crate) fn prof_report(&self) {
        let Some(p) = self.prof.as_ref() else { return };
        let totals = p.totals.lock().unwrap();
        let mut v: Vec<_> = totals.iter().collect();
        v.sort_by(|a, b| b.1.ms.total_cmp(&a.1.ms));
        let all: f64 = v.iter().map(|x| x.1.ms).sum();
        let gaps: f64 = v.iter().map(|x| x.1.gap_ms).sum();
        let (steps, wall) = *p.steps.lock().unwrap();
        eprintln!("# GPU op profile (DS4_GPU_PROFILE=1): device ms per op, summed over the run");
        eprintln!(
            "# {steps} steps between checks, {:.3} ms wall per step (profiling adds event records); \
             {all:.3} ms in op windows, {gaps:.3} ms between them",
            if steps > 0 { wall / steps as f64 } else { 0.0 }
        );
        eprintln!(
            "# {:<34} {:>8} {:>11} {:>7} {:>10} {:>10} {:>9} {:>9}",
            "op", "calls", "total ms", "share", "avg us", "max us", "host us", "gap us"
        );
        for (name, t) in v {
            let per = |ms: f64| 1e3 * ms / t.calls.max(1) as f64;
            eprintln!(
                "# {:<34} {:>8} {:>11.3} {:>6.1}% {:>10.2} {:>10.1} {:>9.1} {:>9.1}",
                name,
                t.calls,
                t.ms,
                100.0 * t.ms / all.max(1e-9),
                per(t.ms),
                1e3 * t.max_ms,
                per(t.host_ms),
                per(t.gap_ms)
            );
        }
    }
}

impl Drop for ProfGuard<'_> {
    fn drop(&mut self) {
        let Some(p) = self.b.prof.as_ref() else {
            return;
        };
        if let Some(end) = self.b.event(p) {
            if self
                .b
                .note(self.b.gpu.runtime().event_record(end, self.b.stream))
                .is_some()
            {
                *p.last_end.lock().unwrap() = Some(end);
                p.pending.lock().unwrap().push(Pending {
                    name: std::mem::take(&mut self.name),
                    start: self.start,
                    end,
                    prev: self.prev,
                    host_ms: self.t0.elapsed().as_secs_f64() * 1e3,
                });
            }
        }
    }
}
