//! io_uring with a bounded queue depth, and registered (fixed) buffers for
//! the host tier's region.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use io_uring::{opcode, types, IoUring};

use super::{HostRegion, OnReadComplete, ReadOp, RecordDevice, RegionLease, WriteOp};
use crate::TierError;

/// Resubmissions of one op after EINTR / EAGAIN / a short transfer. Each
/// resubmission either moves bytes or follows a transient error; a disk
/// that makes no progress in this many tries is reported, not retried forever.
const RETRIES_MAX: u32 = 64;
/// Largest buffer io_uring registers as one fixed buffer.
const FIXED_BUFFER_BYTES_MAX: usize = 1 << 30;

/// The ring and everything a batch needs, under one lock (so batches,
/// registration and unregistration are ordered by it alone). The vectors
/// keep their capacity from batch to batch: a batch allocates nothing once
/// they have grown to its size.
struct Ring {
    ring: IoUring,
    /// Registered fixed buffers: (start address, length).
    fixed: Vec<(usize, usize)>,
    /// Keeps the registered region mapped while the kernel holds it.
    lease: Option<RegionLease>,
    /// Bytes done and retries so far, per op of the current batch.
    progress: Vec<(usize, u32)>,
    /// Ops to resubmit (transient error or short transfer).
    queue: Vec<usize>,
    /// Ops completed since the last round of `on_complete` calls.
    completed: Vec<usize>,
    /// (op, result) of the completions reaped in one round.
    reaped: Vec<(usize, i32)>,
}

pub struct UringFile {
    file: File,
    ring: Mutex<Ring>,
    depth: u32,
    direct: bool,
}

/// A line saying why io_uring was not used, naming the likely cause.
pub(crate) fn refusal_note(e: &std::io::Error) -> String {
    let cause = match e.raw_os_error() {
        Some(libc::EPERM) => "not permitted: a seccomp filter (containers often block io_uring) \
                              or sysctl kernel.io_uring_disabled"
            .to_string(),
        Some(libc::ENOSYS) => "this kernel has no io_uring (Linux 5.1+ needed)".to_string(),
        Some(libc::ENOMEM) => format!(
            "not enough locked memory for the ring (memlock limit {}, see `ulimit -l`)",
            crate::sys::memlock_limit()
        ),
        _ => "refused by the kernel".to_string(),
    };
    format!("io_uring unavailable ({e}: {cause}); using pread/pwrite")
}

impl UringFile {
    pub fn new(file: File, queue_depth: u32) -> std::io::Result<Self> {
        let depth = queue_depth.clamp(1, 4096);
        let ring = IoUring::new(depth.next_power_of_two())?;
        Ok(Self {
            file,
            ring: Mutex::new(Ring {
                ring,
                fixed: Vec::new(),
                lease: None,
                progress: Vec::with_capacity(depth as usize * 4),
                queue: Vec::with_capacity(depth as usize),
                completed: Vec::with_capacity(depth as usize),
                reaped: Vec::with_capacity(depth as usize),
            }),
            depth,
            direct: false,
        })
    }

    pub(crate) fn with_direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    pub fn queue_depth(&self) -> u32 {
        self.depth
    }

    /// Registers `region` as fixed buffers, so reads and writes into it
    /// skip the kernel's per-op page pinning. The ring holds a lease on the
    /// region until it is unregistered, so the memory outlives the
    /// registration.
    pub fn register_region(&self, region: &HostRegion) -> std::io::Result<()> {
        let lease = region.lease();
        let (ptr, len) = (lease.as_ptr(), lease.len());
        let mut iovecs = Vec::new();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(FIXED_BUFFER_BYTES_MAX);
            iovecs.push(libc::iovec {
                iov_base: ptr.wrapping_add(at).cast(),
                iov_len: n,
            });
            at += n;
        }
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: every iovec lies inside the region, whose lease the ring
        // keeps (below) until the buffers are unregistered.
        unsafe { ring.ring.submitter().register_buffers(&iovecs)? };
        ring.fixed = iovecs
            .iter()
            .map(|v| (v.iov_base as usize, v.iov_len))
            .collect();
        ring.lease = Some(lease);
        Ok(())
    }

    fn fixed_index(fixed: &[(usize, usize)], addr: usize, len: usize) -> Option<u16> {
        fixed
            .iter()
            .position(|&(start, n)| addr >= start && addr + len <= start + n)
            .map(|i| i as u16)
    }

    /// Runs one batch: each op is (offset, address, length); `write` picks
    /// the direction. Returns after every submitted op has completed.
    fn run(
        &self,
        write: bool,
        ops: &[(u64, *mut u8, usize)],
        on_complete: &mut dyn FnMut(usize) -> Result<(), TierError>,
    ) -> Result<(), TierError> {
        let mut guard = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let Ring {
            ring,
            fixed,
            progress,
            queue,
            completed,
            reaped,
            lease: _,
        } = &mut *guard;
        progress.clear();
        progress.resize(ops.len(), (0, 0));
        queue.clear();
        completed.clear();
        let mut batch = Batch {
            ops,
            write,
            fd: types::Fd(self.file.as_raw_fd()),
            fixed,
            depth: self.depth,
            progress,
            queue,
            next: 0,
            in_flight: 0,
            done: 0,
            first_error: None,
        };
        while batch.done < ops.len() {
            batch.fill(ring);
            if batch.in_flight == 0 {
                break; // only after an error: nothing left in flight
            }
            if batch.submit_and_wait(ring).is_err() {
                continue; // interrupted before it waited: submit again
            }
            batch.reap(ring, reaped, completed);
            // Keep the disk busy while the completed ops are checked; a
            // failed submit leaves the entries queued for the next one.
            if batch.fill(ring) {
                let _ = ring.submit();
            }
            for i in completed.drain(..) {
                if batch.first_error.is_some() {
                    break;
                }
                if let Err(e) = on_complete(i) {
                    batch.first_error = Some(e);
                }
            }
        }
        assert_eq!(
            batch.in_flight, 0,
            "every submitted op is reaped before returning"
        );
        match batch.first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A wait a signal interrupted.
struct Interrupted;

/// One batch in flight on the ring: its ops (offset, address, length),
/// how far each has got, and the ops waiting to be submitted again.
struct Batch<'a> {
    ops: &'a [(u64, *mut u8, usize)],
    write: bool,
    fd: types::Fd,
    /// The ring's registered buffers: (start address, length).
    fixed: &'a [(usize, usize)],
    /// Ops in flight at most.
    depth: u32,
    /// Bytes done and retries so far, per op.
    progress: &'a mut Vec<(usize, u32)>,
    /// Ops to submit again (transient error or short transfer).
    queue: &'a mut Vec<usize>,
    /// The first op never submitted yet.
    next: usize,
    in_flight: u32,
    /// Ops finished: every byte moved, or failed.
    done: usize,
    first_error: Option<TierError>,
}

impl Batch<'_> {
    fn op_name(&self) -> &'static str {
        if self.write {
            "write"
        } else {
            "read"
        }
    }

    /// Tops the ring up to `depth` ops in flight, those to submit again
    /// first, until an op has failed; true if it pushed any.
    fn fill(&mut self, ring: &mut IoUring) -> bool {
        let mut pushed = false;
        while self.first_error.is_none() && self.in_flight < self.depth {
            let i = if let Some(i) = self.queue.pop() {
                i
            } else if self.next < self.ops.len() {
                self.next += 1;
                self.next - 1
            } else {
                break;
            };
            self.push(ring, i);
            self.in_flight += 1;
            pushed = true;
        }
        pushed
    }

    /// Queues op `i`'s remaining bytes on the ring.
    fn push(&self, ring: &mut IoUring, i: usize) {
        let (offset, ptr, len) = self.ops[i];
        let at = self.progress[i].0;
        // SAFETY: at < len, so the pointer stays inside op i's buffer.
        let ptr = unsafe { ptr.add(at) };
        let n = (len - at) as u32;
        let off = offset + at as u64;
        let fd = self.fd;
        let fixed = UringFile::fixed_index(self.fixed, ptr as usize, n as usize);
        let entry = match (self.write, fixed) {
            (false, Some(b)) => opcode::ReadFixed::new(fd, ptr, n, b).offset(off).build(),
            (false, None) => opcode::Read::new(fd, ptr, n).offset(off).build(),
            (true, Some(b)) => opcode::WriteFixed::new(fd, ptr, n, b).offset(off).build(),
            (true, None) => opcode::Write::new(fd, ptr, n).offset(off).build(),
        };
        // SAFETY: (1) op i's buffer is lent for the whole batch and `run`
        // reaps every submitted op before returning, errors included;
        // (2) ≤ depth ops in flight in a ring of ≥ depth entries: it fits.
        unsafe { ring.submission().push(&entry.user_data(i as u64)) }
            .expect("ring has room for depth entries");
    }

    /// Submits what is queued and waits for a completion; `Err` if a
    /// signal interrupted the call. A failed submit is the batch's error
    /// (nothing new went in; what is in flight is still reaped).
    fn submit_and_wait(&mut self, ring: &mut IoUring) -> Result<(), Interrupted> {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => return Err(Interrupted),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => {
                let error = TierError::io(self.op_name(), self.ops[0].0, e);
                self.first_error.get_or_insert(error);
            }
        }
        Ok(())
    }

    /// Takes every completion the ring holds: each op done goes to
    /// `completed`, each to retry back on the queue, the first failure to
    /// the batch's error.
    fn reap(
        &mut self,
        ring: &mut IoUring,
        reaped: &mut Vec<(usize, i32)>,
        completed: &mut Vec<usize>,
    ) {
        reaped.clear();
        reaped.extend(
            ring.completion()
                .map(|c| (c.user_data() as usize, c.result())),
        );
        for &(i, result) in reaped.iter() {
            self.in_flight -= 1;
            let retry_allowed = self.first_error.is_none();
            let len = self.ops[i].2;
            match completion(
                result,
                self.write,
                &mut self.progress[i],
                len,
                retry_allowed,
            ) {
                Completion::Done => {
                    self.done += 1;
                    completed.push(i);
                }
                Completion::Again => self.queue.push(i),
                Completion::Failed(e) => {
                    let error = TierError::io(self.op_name(), self.ops[i].0, e);
                    self.first_error.get_or_insert(error);
                    self.done += 1;
                }
            }
        }
    }
}

/// What one completion means for its op.
#[derive(Debug)]
enum Completion {
    /// Every byte of the op is done.
    Done,
    /// Submit the rest again (an interrupted op, or a short transfer).
    Again,
    Failed(std::io::Error),
}

/// A completion of `result` (bytes moved, or −errno) for an op of `len`
/// bytes, whose `progress` (bytes done, retries taken) it moves on. A
/// transient error (EINTR, EAGAIN) or a short transfer is retried up to
/// `RETRIES_MAX` times while `retry_allowed` (no op of the batch has
/// failed); a read of 0 bytes is the file's end.
fn completion(
    result: i32,
    write: bool,
    progress: &mut (usize, u32),
    len: usize,
    retry_allowed: bool,
) -> Completion {
    let may_retry = retry_allowed && progress.1 < RETRIES_MAX;
    if result < 0 {
        let errno = -result;
        if may_retry && (errno == libc::EINTR || errno == libc::EAGAIN) {
            progress.1 += 1;
            return Completion::Again;
        }
        return Completion::Failed(std::io::Error::from_raw_os_error(errno));
    }
    if result == 0 && !write {
        return Completion::Failed(std::io::ErrorKind::UnexpectedEof.into());
    }
    progress.0 += result as usize;
    if progress.0 >= len {
        Completion::Done
    } else if may_retry {
        progress.1 += 1;
        Completion::Again
    } else {
        let e = std::io::Error::new(std::io::ErrorKind::WriteZero, "no progress");
        Completion::Failed(e)
    }
}

impl RecordDevice for UringFile {
    fn engine(&self) -> &'static str {
        "io_uring"
    }

    /// A batch holds the ring from its first submission to its last reap.
    fn one_batch_at_a_time(&self) -> bool {
        true
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Result<(), TierError> {
        let raw: Vec<(u64, *mut u8, usize)> = ops
            .iter_mut()
            .map(|op| (op.offset, op.buf.as_mut_ptr(), op.buf.len()))
            .collect();
        self.run(false, &raw, &mut |_| Ok(()))
    }

    fn read_batch_each<'b>(
        &self,
        ops: &mut [ReadOp<'b>],
        on_complete: &mut OnReadComplete<'_, 'b>,
    ) -> Result<(), TierError> {
        let raw: Vec<(u64, *mut u8, usize)> = ops
            .iter_mut()
            .map(|op| (op.offset, op.buf.as_mut_ptr(), op.buf.len()))
            .collect();
        // Op i's completion has been reaped when this is called, so the
        // kernel no longer writes its buffer, which moves out to the caller.
        self.run(false, &raw, &mut |i| on_complete(i, ops[i].take_bytes()))
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Result<(), TierError> {
        // The kernel only reads a write's buffer; the cast does not make it writable.
        let raw: Vec<(u64, *mut u8, usize)> = ops
            .iter()
            .map(|op| (op.offset, op.buf.as_ptr().cast_mut(), op.buf.len()))
            .collect();
        self.run(true, &raw, &mut |_| Ok(()))
    }

    fn register_buffers(&self, region: &HostRegion) -> bool {
        self.unregister_buffers();
        self.register_region(region).is_ok()
    }

    fn unregister_buffers(&self) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if !ring.fixed.is_empty() {
            let _ = ring.ring.submitter().unregister_buffers();
            ring.fixed.clear();
        }
        ring.lease = None;
    }

    fn sync(&self) -> Result<(), TierError> {
        super::file_sync(&self.file)
    }

    fn len_bytes(&self) -> Result<u64, TierError> {
        super::file_len(&self.file)
    }

    fn set_len_bytes(&self, bytes: u64) -> Result<(), TierError> {
        super::file_set_len(&self.file, bytes)
    }

    fn reserve_len_bytes(&self, bytes: u64) -> Result<bool, TierError> {
        super::file_reserve_len(&self.file, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(c: &Completion) -> &'static str {
        match c {
            Completion::Done => "done",
            Completion::Again => "again",
            Completion::Failed(_) => "failed",
        }
    }

    #[test]
    fn a_completion_finishes_retries_or_fails_its_op() {
        // Whole, then in two parts.
        let mut p = (0, 0);
        assert_eq!(kind(&completion(4096, false, &mut p, 4096, true)), "done");
        let mut p = (0, 0);
        assert_eq!(kind(&completion(1024, true, &mut p, 4096, true)), "again");
        assert_eq!(p, (1024, 1));
        assert_eq!(kind(&completion(3072, true, &mut p, 4096, true)), "done");
        // Interrupted: retried, its bytes not counted.
        let mut p = (0, 0);
        assert_eq!(
            kind(&completion(-libc::EINTR, false, &mut p, 8, true)),
            "again"
        );
        assert_eq!(
            kind(&completion(-libc::EAGAIN, false, &mut p, 8, true)),
            "again"
        );
        assert_eq!(p, (0, 2));
        // Not once another op has failed, nor past the retries.
        assert_eq!(
            kind(&completion(-libc::EINTR, false, &mut p, 8, false)),
            "failed"
        );
        let mut p = (0, RETRIES_MAX);
        assert_eq!(kind(&completion(4, true, &mut p, 8, true)), "failed");
        // A real error, and a read at the file's end.
        let mut p = (0, 0);
        match completion(-libc::EIO, false, &mut p, 8, true) {
            Completion::Failed(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO)),
            other => panic!("{other:?}"),
        }
        match completion(0, false, &mut p, 8, true) {
            Completion::Failed(e) => assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof),
            other => panic!("{other:?}"),
        }
        // A write of nothing is a short write: retried until the retries end.
        let mut p = (0, 0);
        for _ in 0..RETRIES_MAX {
            assert_eq!(kind(&completion(0, true, &mut p, 8, true)), "again");
        }
        assert_eq!(kind(&completion(0, true, &mut p, 8, true)), "failed");
    }
}
