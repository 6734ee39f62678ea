//! The device tier: a byte-budgeted arena of equal slots on the compute
//! device, filled and drained by asynchronous copies that complete through
//! events. [`CpuDeviceArena`] is the implementation for the cpu backend:
//! device memory is host memory, and copies run on an upload thread and a
//! download thread (the two copy streams of a GPU).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::io::AlignedBuf;
use crate::{ReadGuard, TierError};

/// Host bytes a copy reads; dropped (e.g. unpinning a host slot) once the
/// copy has completed.
pub trait HostBytes: Send + 'static {
    fn bytes(&self) -> &[u8];
}

/// Host bytes a copy fills; handed back by [`Download::wait`].
pub trait HostBytesMut: Send + 'static {
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl HostBytes for ReadGuard {
    fn bytes(&self) -> &[u8] {
        self.compute()
    }
}

impl HostBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl HostBytesMut for Vec<u8> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl HostBytes for AlignedBuf {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
}

impl HostBytesMut for AlignedBuf {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

#[derive(Default)]
struct EventState {
    done: bool,
    error: Option<String>,
}

/// Completion of one asynchronous copy.
#[derive(Clone)]
pub struct CopyEvent {
    state: Arc<(Mutex<EventState>, Condvar)>,
}

impl CopyEvent {
    pub(crate) fn new() -> Self {
        Self {
            state: Arc::new((Mutex::new(EventState::default()), Condvar::new())),
        }
    }

    pub(crate) fn complete(&self, error: Option<String>) {
        let (m, c) = &*self.state;
        let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
        s.done = true;
        s.error = error;
        c.notify_all();
    }

    pub fn is_complete(&self) -> bool {
        let (m, _) = &*self.state;
        m.lock().unwrap_or_else(|e| e.into_inner()).done
    }

    /// Blocks until the copy is done; reports its failure.
    pub fn wait(&self) -> Result<(), TierError> {
        let (m, c) = &*self.state;
        let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
        while !s.done {
            s = c.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match &s.error {
            None => Ok(()),
            Some(message) => Err(TierError::DeviceCopy(message.clone())),
        }
    }
}

/// A download in flight; `wait` returns the filled host buffer.
pub struct Download {
    pub(crate) event: CopyEvent,
    pub(crate) dst: Arc<Mutex<Option<Box<dyn HostBytesMut>>>>,
}

impl Download {
    pub fn event(&self) -> &CopyEvent {
        &self.event
    }

    pub fn wait(self) -> Result<Box<dyn HostBytesMut>, TierError> {
        self.event.wait()?;
        let dst = self.dst.lock().unwrap_or_else(|e| e.into_inner()).take();
        Ok(dst.expect("a completed download holds its buffer"))
    }
}

/// A byte-budgeted arena of equal device slots with asynchronous copies.
/// Copies into one slot run in submission order; a slot's bytes may be
/// used by compute once the event of the last copy into it has completed.
pub trait DeviceArena: Send + Sync {
    /// `cpu`, `cuda`, ….
    fn kind(&self) -> &'static str;
    fn slot_bytes(&self) -> usize;
    fn slot_count(&self) -> usize;
    /// Copies `src` into the start of `slot` (host → device).
    fn upload_htod(&self, slot: usize, src: Box<dyn HostBytes>) -> Result<CopyEvent, TierError>;
    /// Copies the start of `slot` into `dst` (device → host).
    fn download_dtoh(&self, slot: usize, dst: Box<dyn HostBytesMut>)
        -> Result<Download, TierError>;
}

enum Copy {
    Upload {
        slot: usize,
        src: Box<dyn HostBytes>,
        event: CopyEvent,
    },
    Download {
        slot: usize,
        dst: Arc<Mutex<Option<Box<dyn HostBytesMut>>>>,
        event: CopyEvent,
    },
}

struct ArenaMemory {
    buf: AlignedBuf,
    slot_bytes: usize,
    slot_count: usize,
    /// Per slot: uploads submitted and not yet completed.
    uploads_in_flight: Box<[AtomicU32]>,
    /// Per slot: live `SlotView`s (compute reading or writing the slot).
    views: Box<[AtomicU32]>,
}

// SAFETY: a copy thread writes a slot only while its upload counter is up
// (`view` refuses then); views exist only while none is (`upload_htod`
// refuses then); downloads only read.
unsafe impl Sync for ArenaMemory {}

impl ArenaMemory {
    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        assert!(slot < self.slot_count);
        // SAFETY: slot < slot_count, and the buffer holds slot_count slots.
        unsafe {
            self.buf
                .as_slice()
                .as_ptr()
                .cast_mut()
                .add(slot * self.slot_bytes)
        }
    }
}

/// Slots of `slot_bytes` that `device_budget_bytes` holds; at least one,
/// else the budget is too small (every device tier carves its memory so).
pub(crate) fn slots_for_budget(
    device_budget_bytes: u64,
    slot_bytes: usize,
) -> Result<usize, TierError> {
    let slot_count = (device_budget_bytes / slot_bytes as u64) as usize;
    if slot_count == 0 {
        return Err(TierError::BudgetTooSmall {
            tier: "device",
            budget_bytes: device_budget_bytes,
            needed_bytes: slot_bytes as u64,
            why: "one expert's compute params",
        });
    }
    Ok(slot_count)
}

/// The cpu backend's device tier: an arena in host memory, copies on two
/// threads (upload, download) fed by bounded queues.
pub struct CpuDeviceArena {
    memory: Arc<ArenaMemory>,
    upload: Option<Sender<Copy>>,
    download: Option<Sender<Copy>>,
    threads: Vec<JoinHandle<()>>,
}

impl CpuDeviceArena {
    /// Carves `device_budget_bytes` into slots of `slot_bytes`.
    pub fn new(
        device_budget_bytes: u64,
        slot_bytes: usize,
        queue_len_max: usize,
    ) -> Result<Self, TierError> {
        assert!(slot_bytes > 0 && queue_len_max > 0);
        let slot_count = slots_for_budget(device_budget_bytes, slot_bytes)?;
        let counters = |n: usize| (0..n).map(|_| AtomicU32::new(0)).collect::<Box<[_]>>();
        let memory = Arc::new(ArenaMemory {
            buf: AlignedBuf::zeroed(slot_count * slot_bytes),
            slot_bytes,
            slot_count,
            uploads_in_flight: counters(slot_count),
            views: counters(slot_count),
        });
        let mut threads = Vec::new();
        let mut spawn = |name: &str| -> Result<Sender<Copy>, TierError> {
            let (tx, rx) = bounded::<Copy>(queue_len_max);
            let memory = Arc::clone(&memory);
            let handle = std::thread::Builder::new()
                .name(name.to_string())
                .spawn(move || copy_loop(&memory, &rx))
                .map_err(|e| TierError::IoThread(e.to_string()))?;
            threads.push(handle);
            Ok(tx)
        };
        let upload = spawn("strata-htod")?;
        let download = spawn("strata-dtoh")?;
        Ok(Self {
            memory,
            upload: Some(upload),
            download: Some(download),
            threads,
        })
    }

    /// Direct access to one slot's bytes for compute. Refused while an
    /// upload into the slot is in flight; uploads are refused while a view
    /// lives.
    pub fn view(&self, slot: usize) -> Result<SlotView<'_>, TierError> {
        let m = &*self.memory;
        if slot >= m.slot_count {
            return Err(TierError::DeviceCopy(format!("no device slot {slot}")));
        }
        if m.views[slot].fetch_add(1, Ordering::SeqCst) > 0 {
            m.views[slot].fetch_sub(1, Ordering::SeqCst);
            return Err(TierError::DeviceCopy(format!(
                "device slot {slot} is already in use"
            )));
        }
        if m.uploads_in_flight[slot].load(Ordering::SeqCst) > 0 {
            m.views[slot].fetch_sub(1, Ordering::SeqCst);
            return Err(TierError::DeviceCopy(format!(
                "device slot {slot} has an upload in flight; wait for its event first"
            )));
        }
        Ok(SlotView { arena: self, slot })
    }
}

/// Exclusive compute access to one device slot.
pub struct SlotView<'a> {
    arena: &'a CpuDeviceArena,
    slot: usize,
}

impl SlotView<'_> {
    pub fn bytes(&self) -> &[u8] {
        let m = &*self.arena.memory;
        // SAFETY: this view is the slot's only one and no upload is in
        // flight into it (checked in `view`; uploads refuse while it lives).
        unsafe { std::slice::from_raw_parts(m.slot_ptr(self.slot), m.slot_bytes) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let m = &*self.arena.memory;
        // SAFETY: as in `bytes`, and &mut self makes this access exclusive.
        unsafe { std::slice::from_raw_parts_mut(m.slot_ptr(self.slot), m.slot_bytes) }
    }
}

impl Drop for SlotView<'_> {
    fn drop(&mut self) {
        self.arena.memory.views[self.slot].fetch_sub(1, Ordering::SeqCst);
    }
}

fn copy_loop(memory: &ArenaMemory, jobs: &Receiver<Copy>) {
    while let Ok(job) = jobs.recv() {
        match job {
            Copy::Upload { slot, src, event } => {
                let bytes = src.bytes();
                let n = bytes.len().min(memory.slot_bytes);
                // SAFETY: the slot's upload counter is raised, so no view
                // exists and none can be created until it drops; uploads into
                // one slot run in order on this one thread.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), memory.slot_ptr(slot), n) };
                drop(src);
                memory.uploads_in_flight[slot].fetch_sub(1, Ordering::SeqCst);
                event.complete(None);
            }
            Copy::Download { slot, dst, event } => {
                let mut guard = dst.lock().unwrap_or_else(|e| e.into_inner());
                let out = guard
                    .as_mut()
                    .expect("a queued download has its buffer")
                    .bytes_mut();
                let n = out.len().min(memory.slot_bytes);
                // SAFETY: downloads only read the slot; a view writing it
                // concurrently would be the caller's ordering bug, which the
                // engine prevents by downloading only after compute's event.
                unsafe {
                    std::ptr::copy_nonoverlapping(memory.slot_ptr(slot), out.as_mut_ptr(), n)
                };
                drop(guard);
                event.complete(None);
            }
        }
    }
}

impl DeviceArena for CpuDeviceArena {
    fn kind(&self) -> &'static str {
        "cpu"
    }

    fn slot_bytes(&self) -> usize {
        self.memory.slot_bytes
    }

    fn slot_count(&self) -> usize {
        self.memory.slot_count
    }

    fn upload_htod(&self, slot: usize, src: Box<dyn HostBytes>) -> Result<CopyEvent, TierError> {
        let m = &*self.memory;
        if slot >= m.slot_count {
            return Err(TierError::DeviceCopy(format!("no device slot {slot}")));
        }
        if src.bytes().len() > m.slot_bytes {
            return Err(TierError::BufferSize {
                what: "an upload into a device slot",
                expected: m.slot_bytes,
                got: src.bytes().len(),
            });
        }
        m.uploads_in_flight[slot].fetch_add(1, Ordering::SeqCst);
        if m.views[slot].load(Ordering::SeqCst) > 0 {
            m.uploads_in_flight[slot].fetch_sub(1, Ordering::SeqCst);
            return Err(TierError::DeviceCopy(format!(
                "device slot {slot} is in use by compute; drop its view first"
            )));
        }
        let event = CopyEvent::new();
        let job = Copy::Upload {
            slot,
            src,
            event: event.clone(),
        };
        self.upload
            .as_ref()
            .expect("live until drop")
            .send(job)
            .map_err(|_| TierError::IoThread("the upload thread stopped".to_string()))?;
        Ok(event)
    }

    fn download_dtoh(
        &self,
        slot: usize,
        dst: Box<dyn HostBytesMut>,
    ) -> Result<Download, TierError> {
        if slot >= self.memory.slot_count {
            return Err(TierError::DeviceCopy(format!("no device slot {slot}")));
        }
        let event = CopyEvent::new();
        let dst = Arc::new(Mutex::new(Some(dst)));
        let job = Copy::Download {
            slot,
            dst: Arc::clone(&dst),
            event: event.clone(),
        };
        self.download
            .as_ref()
            .expect("live until drop")
            .send(job)
            .map_err(|_| TierError::IoThread("the download thread stopped".to_string()))?;
        Ok(Download { event, dst })
    }
}

impl Drop for CpuDeviceArena {
    fn drop(&mut self) {
        // Closing the queues ends the copy threads after the queued copies.
        self.upload.take();
        self.download.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_and_downloads_round_trip_through_events() {
        let arena = CpuDeviceArena::new(3 * 4096, 4096, 4).unwrap();
        assert_eq!((arena.slot_count(), arena.slot_bytes()), (3, 4096));
        let src: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
        let event = arena.upload_htod(2, Box::new(src.clone())).unwrap();
        event.wait().unwrap();
        assert!(event.is_complete());
        {
            let mut view = arena.view(2).unwrap();
            assert_eq!(view.bytes(), &src[..]);
            // A second view, or an upload, is refused while this one lives.
            assert!(arena.view(2).is_err());
            assert!(arena.upload_htod(2, Box::new(vec![0u8; 8])).is_err());
            view.bytes_mut()[0] = 99;
        }
        let back = arena.download_dtoh(2, Box::new(vec![0u8; 4096])).unwrap();
        let mut back = back.wait().unwrap();
        assert_eq!(back.bytes_mut()[0], 99);
        assert_eq!(&back.bytes_mut()[1..], &src[1..]);
    }

    #[test]
    fn a_budget_below_one_slot_is_a_clear_error() {
        let err = CpuDeviceArena::new(100, 4096, 4).err().unwrap();
        assert!(matches!(
            err,
            TierError::BudgetTooSmall { tier: "device", .. }
        ));
        let arena = CpuDeviceArena::new(4096, 4096, 4).unwrap();
        assert!(arena.upload_htod(0, Box::new(vec![0u8; 5000])).is_err());
        assert!(arena.upload_htod(1, Box::new(vec![0u8; 5])).is_err());
    }
}
