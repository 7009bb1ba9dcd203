//! `DS4_GPU_PROFILE=1`: device time per op, from events recorded around each backend op on the
//! stream (no syncs inside a step; the events are read at the end of each step). The table is
//! printed to stderr when the backend is dropped: where the time of a step goes, by op.

use super::GpuBackend;
use crate::runtime::Event;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

#[derive(Default)]
pub(crate) struct Prof {
    pending: Mutex<Vec<(String, Event, Event)>>,
    spare: Mutex<Vec<Event>>,
    /// name → (ms of device time, calls)
    totals: Mutex<HashMap<String, (f64, u64)>>,
    steps: Mutex<(u64, f64)>,
    last: Mutex<Option<Instant>>,
}

/// Records the end event of one op when dropped.
pub(crate) struct ProfGuard<'a> {
    b: &'a GpuBackend,
    name: String,
    start: Event,
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
        let start = self.event(p)?;
        self.note(self.gpu.runtime().event_record(start, self.stream))?;
        Some(ProfGuard {
            b: self,
            name: name(),
            start,
        })
    }

    /// Read the events of the finished step into the totals.
    pub(crate) fn prof_collect(&self) {
        let Some(p) = self.prof.as_ref() else { return };
        let rt = self.gpu.runtime();
        let _ = rt.synchronize();
        let pending = std::mem::take(&mut *p.pending.lock().unwrap());
        let mut totals = p.totals.lock().unwrap();
        let mut spare = p.spare.lock().unwrap();
        for (name, a, b) in pending {
            if let Ok(ms) = rt.event_elapsed_ms(a, b) {
                let t = totals.entry(name).or_default();
                t.0 += ms as f64;
                t.1 += 1;
            }
            spare.push(a);
            spare.push(b);
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
        v.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let all: f64 = v.iter().map(|x| x.1 .0).sum();
        let (steps, wall) = *p.steps.lock().unwrap();
        eprintln!("# GPU op profile (DS4_GPU_PROFILE=1): device ms per op, summed over the run");
        eprintln!(
            "# {steps} steps between checks, {:.3} ms wall per step (profiling adds event records)",
            if steps > 0 { wall / steps as f64 } else { 0.0 }
        );
        eprintln!(
            "# {:<34} {:>8} {:>11} {:>7} {:>10}",
            "op", "calls", "total ms", "share", "avg us"
        );
        for (name, (ms, n)) in v {
            eprintln!(
                "# {:<34} {:>8} {:>11.3} {:>6.1}% {:>10.2}",
                name,
                n,
                ms,
                100.0 * ms / all.max(1e-9),
                1e3 * ms / *n as f64
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
                p.pending
                    .lock()
                    .unwrap()
                    .push((std::mem::take(&mut self.name), self.start, end));
            }
        }
    }
}
