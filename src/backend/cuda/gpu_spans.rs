//! [`GpuSpans`]: the GPU's own time for each dense operation of a step,
//! for the engine's timeline. The host only queues work on the compute
//! stream, so a host span says how long the queueing took, not the GPU's
//! work; where a timeline records, each of [`super::CudaOps`]' operations
//! also records a CUDA event before and after its work on the compute
//! stream, and when the operations end (the forward and backward of a
//! micro-batch) the events' times go onto the timeline on a thread named
//! `gpu` (category `"gpu"`). The events are read against one recorded
//! when the stream was idle, at a known host instant.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use strata_tiers::Timeline;

use super::gpu_error;
use crate::EngineError;

/// The most spans kept between two flushes; later ones are not recorded
/// (a forward and backward of the largest preset makes about 2 000).
const MAX_GPU_SPANS: usize = 1 << 14;

/// The thread GPU spans are shown on.
const GPU_THREAD: &str = "gpu";

/// Events around each operation's work on one stream, since an anchor.
pub(super) struct GpuSpans {
    stream: Arc<CudaStream>,
    timeline: Arc<Timeline>,
    anchor: CudaEvent,
    anchor_at: Instant,
    spans: Mutex<Vec<Recorded>>,
}

struct Recorded {
    name: &'static str,
    start: CudaEvent,
    end: CudaEvent,
}

/// An operation's span, its end recorded when dropped.
pub(super) struct GpuSpan<'a> {
    spans: &'a GpuSpans,
    name: &'static str,
    start: Option<CudaEvent>,
}

impl GpuSpans {
    /// Waits for `stream` to be idle and records the anchor.
    pub fn new(stream: &Arc<CudaStream>, timeline: Arc<Timeline>) -> Result<Self, EngineError> {
        let fail = |e| gpu_error("a timing event on the compute stream", e);
        stream.synchronize().map_err(fail)?;
        let anchor = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(fail)?;
        anchor.synchronize().map_err(fail)?;
        Ok(Self {
            stream: Arc::clone(stream),
            timeline,
            anchor,
            anchor_at: Instant::now(),
            spans: Mutex::new(Vec::new()),
        })
    }

    /// A span named `name` of the work queued from now until it is dropped.
    pub fn start(&self, name: &'static str) -> GpuSpan<'_> {
        GpuSpan {
            spans: self,
            name,
            start: self.event(),
        }
    }

    /// An event recorded on the stream now; `None` where the driver
    /// refuses one (the span is then left out: the stream's next
    /// operation reports the driver's error).
    fn event(&self) -> Option<CudaEvent> {
        self.stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .ok()
    }

    /// Waits for the recorded spans' work and puts each on the timeline.
    pub fn flush(&self) -> Result<(), EngineError> {
        let spans = std::mem::take(&mut *self.spans.lock().unwrap_or_else(|p| p.into_inner()));
        let since_anchor = |event: &CudaEvent| -> Result<Instant, EngineError> {
            let ms = self
                .anchor
                .elapsed_ms(event)
                .map_err(|e| gpu_error("reading a timing event", e))?;
            Ok(self.anchor_at + Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
        };
        for span in spans {
            let at = (since_anchor(&span.start)?, since_anchor(&span.end)?);
            self.timeline.record_on(GPU_THREAD, "gpu", span.name, at);
        }
        Ok(())
    }
}

impl Drop for GpuSpan<'_> {
    fn drop(&mut self) {
        let Some(start) = self.start.take() else {
            return;
        };
        let Some(end) = self.spans.event() else {
            return;
        };
        let mut spans = self.spans.spans.lock().unwrap_or_else(|p| p.into_inner());
        if spans.len() < MAX_GPU_SPANS {
            spans.push(Recorded {
                name: self.name,
                start,
                end,
            });
        }
    }
}
