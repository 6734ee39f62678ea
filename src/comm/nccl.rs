//! [`NcclComm`]: GPU ranks as processes over NCCL (feature `nccl`), one
//! GPU a rank, started by `strata launch --comm nccl`, torchrun or a batch
//! system (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`: [`World`]).
//!
//! Rank 0 makes NCCL's unique id and hands it to the others through the
//! TCP rendezvous at `MASTER_ADDR:MASTER_PORT` ([`rendezvous`]); every
//! rank then joins the communicator on its GPU. Every collective is NCCL's
//! grouped sends and receives on the communicator's stream, in two rounds:
//! a header to every peer (which collective, how many bytes follow), so
//! that ranks whose collectives are out of step are named instead of
//! exchanging the wrong bytes, then the payloads. The all-to-all of
//! variable sizes is the second round as it is; the all-gather sends the
//! same rows to everyone; the all-reduce is a reduce-scatter (each rank
//! sums one slice of the buffer, rank 0's values first, then 1's, …) and
//! an all-gather of the sums, so its result is the bits of every other
//! [`Comm`] of strata on every rank, where NCCL's own all-reduce sums in
//! the order its ring or tree happens to take.
//!
//! The engine's collectives move host buffers: each round copies what
//! this rank sends to the GPU, and what it receives back. No wait is
//! unbounded: a round polls its completion, and fails, aborting the
//! communicator, when NCCL reports an error (a peer that died) or when it
//! has not finished within the timeout given to [`NcclComm::join`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::{rendezvous, Comm, CommError, World};

mod sys;

/// A header's bytes: the collective, the bytes that follow to this peer,
/// and the whole buffer's length (the all-reduce's, which every rank must
/// share).
const HEADER: usize = 24;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    AllToAll = 1,
    AllGather = 2,
    AllReduce = 3,
    Barrier = 4,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllToAll => "all_to_all",
            Kind::AllGather => "all_gather",
            Kind::AllReduce => "all_reduce",
            Kind::Barrier => "barrier",
        }
    }

    fn from_code(code: u32) -> Option<Kind> {
        [
            Kind::AllToAll,
            Kind::AllGather,
            Kind::AllReduce,
            Kind::Barrier,
        ]
        .into_iter()
        .find(|k| *k as u32 == code)
    }
}

/// One rank's endpoint over NCCL.
pub struct NcclComm {
    raw: sys::RawComm,
    stream: Arc<CudaStream>,
    /// The rounds' device buffers (what this rank sends, what it
    /// receives), reused: each as large as the largest round so far.
    sending: CudaSlice<u8>,
    receiving: CudaSlice<u8>,
    rank: usize,
    size: usize,
    timeout: Duration,
}

fn init(why: impl std::fmt::Display) -> CommError {
    CommError::Init {
        why: why.to_string(),
    }
}

impl NcclComm {
    /// Joins the ranks of `world` on GPU `gpu`: rank 0 makes NCCL's id and
    /// hands it out at `MASTER_ADDR:MASTER_PORT`, then every rank joins the
    /// communicator. `timeout` bounds the rendezvous and, after it, every
    /// collective's wait for its peers.
    pub fn join(world: &World, gpu: usize, timeout: Duration) -> Result<Self, CommError> {
        if !sys::driver_present() {
            return Err(init(
                "no CUDA driver (libcuda) could be loaded: NCCL's ranks run on GPUs; run CPU \
                 ranks over MPI",
            ));
        }
        if !sys::library_present() {
            return Err(init(
                "no libnccl could be loaded: put a directory with libnccl.so on \
                 LD_LIBRARY_PATH (a system NCCL has one; for NVIDIA's nvidia-nccl-cu13 wheel, \
                 link libnccl.so to the wheel's lib/libnccl.so.2), or run the ranks over MPI",
            ));
        }
        let ctx = CudaContext::new(gpu).map_err(|e| init(format!("GPU {gpu}: {e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| init(format!("a stream on GPU {gpu}: {e:?}")))?;
        let id = match world.rank {
            0 => sys::unique_id().map_err(|e| init(format!("NCCL's unique id: {e}")))?,
            _ => [0; 128],
        };
        let got = rendezvous(world, || id.to_vec(), timeout)?;
        let id: [u8; 128] = got.try_into().map_err(|got: Vec<u8>| {
            init(format!(
                "rank 0 handed out {} bytes, where NCCL's id has 128",
                got.len()
            ))
        })?;
        ctx.bind_to_thread()
            .map_err(|e| init(format!("GPU {gpu}: {e:?}")))?;
        let raw = sys::RawComm::join(&id, world.size, world.rank)
            .map_err(|e| init(format!("ncclCommInitRank on GPU {gpu}: {e}")))?;
        let buffer = || {
            stream
                .alloc_zeros::<u8>(1)
                .map_err(|e| init(format!("a buffer on GPU {gpu}: {e:?}")))
        };
        let (sending, receiving) = (buffer()?, buffer()?);
        Ok(Self {
            raw,
            sending,
            receiving,
            stream,
            rank: world.rank,
            size: world.size,
            timeout,
        })
    }

    /// Sends `sends[p]` to rank p and returns what each rank sent here,
    /// `inbound[p]` bytes from rank p; this rank's own part is copied.
    fn round(&mut self, sends: &[&[u8]], inbound: &[usize]) -> Result<Vec<Vec<u8>>, CommError> {
        if self.raw.failed {
            return Err(CommError::Nccl {
                why: "the communicator was aborted after an earlier failure".into(),
            });
        }
        let me = self.rank;
        let others = |p: &usize| *p != me;
        let out: Vec<u8> = (0..self.size)
            .filter(others)
            .flat_map(|p| sends[p].iter().copied())
            .collect();
        let total_in: usize = (0..self.size).filter(others).map(|p| inbound[p]).sum();
        let failed = |what: &str, e: cudarc::driver::DriverError| CommError::Nccl {
            why: format!("{what} on the communicator's GPU: {e:?}"),
        };
        grow(&self.stream, &mut self.sending, out.len()).map_err(|e| failed("a send buffer", e))?;
        grow(&self.stream, &mut self.receiving, total_in)
            .map_err(|e| failed("a receive buffer", e))?;
        let (dev_out, dev_in) = (&mut self.sending, &mut self.receiving);
        self.stream
            .memcpy_htod(&out, &mut dev_out.slice_mut(0..out.len()))
            .map_err(|e| failed("copying the sends", e))?;
        {
            let stream = Arc::clone(&self.stream);
            let (out_ptr, _out_done) = dev_out.device_ptr(&stream);
            let (in_ptr, _in_done) = dev_in.device_ptr_mut(&stream);
            let (mut sent, mut received) = (Vec::new(), Vec::new());
            let (mut at_out, mut at_in) = (0u64, 0u64);
            for p in (0..self.size).filter(others) {
                if !sends[p].is_empty() {
                    sent.push((out_ptr + at_out, sends[p].len(), p));
                }
                if inbound[p] > 0 {
                    received.push((in_ptr + at_in, inbound[p], p));
                }
                at_out += sends[p].len() as u64;
                at_in += inbound[p] as u64;
            }
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| failed("binding the context", e))?;
            // SAFETY: every pointer lies within the send or receive buffer
            // (the offsets sum the lengths before it, and `grow` made each
            // hold its total), which live, and are touched by nothing else,
            // until `wait` below has seen the stream run the group.
            unsafe {
                self.raw
                    .group(stream.cu_stream(), &sent, &received)
                    .map_err(|why| CommError::Nccl { why })?;
            }
        }
        self.wait()?;
        let got = self
            .stream
            .clone_dtoh(&self.receiving.slice(0..total_in))
            .map_err(|e| failed("copying what arrived", e))?;
        let mut at = 0;
        Ok((0..self.size)
            .map(|p| {
                if p == me {
                    return sends[p].to_vec();
                }
                let part = got[at..at + inbound[p]].to_vec();
                at += inbound[p];
                part
            })
            .collect())
    }

    /// Waits for the stream to run what was queued, at most the timeout;
    /// an error NCCL reports, or the timeout, aborts the communicator.
    fn wait(&mut self) -> Result<(), CommError> {
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| CommError::Nccl {
                why: format!("an event on the communicator's stream: {e:?}"),
            })?;
        let deadline = Instant::now() + self.timeout;
        loop {
            // Complete is not succeeded: a transfer that failed has ended.
            let complete = done.is_complete();
            if let Some(why) = self.raw.async_error() {
                self.raw.failed = true;
                return Err(CommError::Nccl {
                    why: format!("{why} (a peer stopped, or its link failed)"),
                });
            }
            if complete {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.raw.failed = true;
                return Err(CommError::TimedOut {
                    secs: self.timeout.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// A collective: headers to every peer, checked, then `sends`.
    fn collective(
        &mut self,
        kind: Kind,
        sends: &[&[u8]],
        whole: usize,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        if sends.len() != self.size {
            return Err(CommError::WrongCount {
                what: kind.name(),
                got: sends.len(),
                ranks: self.size,
            });
        }
        let headers: Vec<[u8; HEADER]> = sends
            .iter()
            .map(|s| {
                let mut h = [0u8; HEADER];
                h[..4].copy_from_slice(&(kind as u32).to_le_bytes());
                h[8..16].copy_from_slice(&(s.len() as u64).to_le_bytes());
                h[16..].copy_from_slice(&(whole as u64).to_le_bytes());
                h
            })
            .collect();
        let refs: Vec<&[u8]> = headers.iter().map(|h| &h[..]).collect();
        let got = self.round(&refs, &vec![HEADER; self.size])?;
        let mut inbound = Vec::with_capacity(self.size);
        for (peer, h) in got.iter().enumerate() {
            let code = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
            let theirs = Kind::from_code(code);
            if theirs != Some(kind) {
                return Err(CommError::OutOfStep {
                    peer,
                    expected: kind.name(),
                    got: theirs.map_or("an unknown collective", Kind::name),
                });
            }
            let their_whole = u64::from_le_bytes(h[16..].try_into().expect("8 bytes"));
            if kind == Kind::AllReduce && their_whole != whole as u64 {
                return Err(CommError::OutOfStep {
                    peer,
                    expected: "all_reduce of equal lengths",
                    got: "a buffer of another length",
                });
            }
            inbound.push(u64::from_le_bytes(h[8..16].try_into().expect("8 bytes")) as usize);
        }
        self.round(sends, &inbound)
    }
}

/// Makes `buf` hold at least `bytes` (never shrinking it).
fn grow(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<u8>,
    bytes: usize,
) -> Result<(), cudarc::driver::DriverError> {
    if buf.len() < bytes {
        *buf = stream.alloc_zeros::<u8>(bytes)?;
    }
    Ok(())
}

/// The slice of a buffer of `len` values that rank `r` of `n` sums.
fn slice_of(len: usize, r: usize, n: usize) -> std::ops::Range<usize> {
    r * len / n..(r + 1) * len / n
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError> {
        let refs: Vec<&[u8]> = sends.iter().map(|s| bytemuck::cast_slice(s)).collect();
        let got = self.collective(Kind::AllToAll, &refs, 0)?;
        Ok(got
            .iter()
            .map(|b| bytemuck::pod_collect_to_vec(b))
            .collect())
    }

    fn all_gather_u32(&mut self, mine: Vec<u32>) -> Result<Vec<Vec<u32>>, CommError> {
        let bytes: &[u8] = bytemuck::cast_slice(&mine);
        let refs = vec![bytes; self.size];
        let got = self.collective(Kind::AllGather, &refs, 0)?;
        Ok(got
            .iter()
            .map(|b| bytemuck::pod_collect_to_vec(b))
            .collect())
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let (n, me, len) = (self.size, self.rank, buf.len());
        if n == 1 {
            return Ok(());
        }
        // Each rank's slice of every rank's buffer to the rank that sums it.
        let refs: Vec<&[u8]> = (0..n)
            .map(|r| bytemuck::cast_slice(&buf[slice_of(len, r, n)]))
            .collect();
        let parts = self.collective(Kind::AllReduce, &refs, len)?;
        let mine = slice_of(len, me, n);
        let mut sum: Vec<f32> = bytemuck::pod_collect_to_vec(&parts[0]);
        for part in &parts[1..] {
            let part: Vec<f32> = bytemuck::pod_collect_to_vec(part);
            // Rank 0's value first, then 1's, …: the same additions everywhere.
            sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
        }
        debug_assert_eq!(sum.len(), mine.len());
        // Every rank's sums to every rank.
        let sum_bytes: &[u8] = bytemuck::cast_slice(&sum);
        let sums = self.collective(Kind::AllReduce, &vec![sum_bytes; n], len)?;
        for (r, part) in sums.iter().enumerate() {
            let values: Vec<f32> = bytemuck::pod_collect_to_vec(part);
            buf[slice_of(len, r, n)].copy_from_slice(&values);
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.collective(Kind::Barrier, &vec![&[][..]; self.size], 0)
            .map(|_| ())
    }
}
