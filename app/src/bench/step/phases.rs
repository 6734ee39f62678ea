//! Where in a step the SSD sat idle, from the step's timeline: the forward
//! (from the step's start to the end of the last forward expert loop
//! before the backward's first), the turn (from there to the first
//! backward expert loop: the head, the loss, the last layer's combine) and
//! the backward (from there to the step's end, the naive schedule's
//! updates included). The I/O-only step I exceeds the disk's own time by
//! what falls idle here; at the token count where compute and I/O balance,
//! the expert-wise step's speed-up over the naive one is about
//! 1 + S / I (S the naive step's disk time), so this says which idle time
//! keeps it from 2.

use std::time::Duration;

use serde::Serialize;
use strata_tiers::timeline::covered;
use strata_tiers::TimelineEvent;

/// A step's phases and the SSD's idle time in each, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepPhases {
    pub forward_s: f64,
    pub turn_s: f64,
    pub backward_s: f64,
    pub ssd_idle_forward_s: f64,
    pub ssd_idle_turn_s: f64,
    pub ssd_idle_backward_s: f64,
}

impl StepPhases {
    /// The phases of the one step `events` hold (a `"step"` span, expert
    /// loops named `"forward"` / `"backward"`, `"ssd"` calls); `None` where
    /// they hold no step or it ran no backward expert loop.
    pub fn of(events: &[TimelineEvent]) -> Option<Self> {
        let step = events.iter().find(|e| e.category == "step")?;
        let loops = |name: &'static str| {
            events
                .iter()
                .filter(move |e| e.category == "experts" && e.name == name)
        };
        let turn_end = loops("backward").map(|e| e.start).min()?;
        let turn_start = loops("forward")
            .filter(|e| e.start < turn_end)
            .map(TimelineEvent::end)
            .max()
            .unwrap_or(step.start)
            .min(turn_end);
        let ssd: Vec<&TimelineEvent> = events.iter().filter(|e| e.category == "ssd").collect();
        let idle = |from: Duration, to: Duration| {
            let to = to.max(from);
            (to - from - covered(&ssd, from, to)).as_secs_f64()
        };
        let span = |from: Duration, to: Duration| to.saturating_sub(from).as_secs_f64();
        Some(Self {
            forward_s: span(step.start, turn_start),
            turn_s: span(turn_start, turn_end),
            backward_s: span(turn_end, step.end()),
            ssd_idle_forward_s: idle(step.start, turn_start),
            ssd_idle_turn_s: idle(turn_start, turn_end),
            ssd_idle_backward_s: idle(turn_end, step.end()),
        })
    }

    /// The per-field mean of `all`; `None` where it is empty.
    pub fn mean(all: &[StepPhases]) -> Option<Self> {
        if all.is_empty() {
            return None;
        }
        let n = all.len() as f64;
        let m = |f: fn(&StepPhases) -> f64| all.iter().map(f).sum::<f64>() / n;
        Some(Self {
            forward_s: m(|p| p.forward_s),
            turn_s: m(|p| p.turn_s),
            backward_s: m(|p| p.backward_s),
            ssd_idle_forward_s: m(|p| p.ssd_idle_forward_s),
            ssd_idle_turn_s: m(|p| p.ssd_idle_turn_s),
            ssd_idle_backward_s: m(|p| p.ssd_idle_backward_s),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(
        category: &'static str,
        name: &'static str,
        from_ms: u64,
        to_ms: u64,
    ) -> TimelineEvent {
        TimelineEvent {
            category,
            name: name.into(),
            thread: "main".into(),
            start: Duration::from_millis(from_ms),
            duration: Duration::from_millis(to_ms - from_ms),
            detail: String::new(),
        }
    }

    #[test]
    fn phases_split_the_step_at_the_expert_loops() {
        let events = vec![
            event("experts", "forward", 10, 20),
            event("ssd", "read", 12, 30),
            event("experts", "forward", 40, 50),
            event("ssd", "read", 45, 55),
            event("experts", "backward", 80, 90),
            event("ssd", "write", 85, 95),
            event("experts", "backward", 100, 110),
            event("step", "step", 0, 120),
        ];
        let p = StepPhases::of(&events).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(p.forward_s, 0.050), "{p:?}");
        assert!(close(p.turn_s, 0.030), "{p:?}");
        assert!(close(p.backward_s, 0.040), "{p:?}");
        // Forward: busy 12–30 and 45–50 of 0–50.
        assert!(close(p.ssd_idle_forward_s, 0.027), "{p:?}");
        // Turn: busy 50–55 of 50–80.
        assert!(close(p.ssd_idle_turn_s, 0.025), "{p:?}");
        // Backward: busy 85–95 of 80–120.
        assert!(close(p.ssd_idle_backward_s, 0.030), "{p:?}");
        let mean = StepPhases::mean(&[p, StepPhases::default()]).unwrap();
        assert!(close(mean.turn_s, 0.015), "{mean:?}");
        assert_eq!(StepPhases::mean(&[]), None);
    }

    #[test]
    fn no_step_or_no_backward_gives_no_phases() {
        assert_eq!(StepPhases::of(&[event("experts", "forward", 0, 5)]), None);
        let no_backward = [
            event("step", "step", 0, 10),
            event("experts", "forward", 0, 5),
        ];
        assert_eq!(StepPhases::of(&no_backward), None);
    }
}
