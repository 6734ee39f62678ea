//! The NCCL calls `NcclComm` makes, through cudarc's bindings (libnccl is
//! loaded at run time): a communicator that is aborted if it is dropped
//! unfinished, and grouped sends and receives of bytes on a stream.

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::{result, sys};

/// Why an NCCL call failed, as NCCL names it.
pub fn describe(e: &result::NcclError) -> String {
    format!("{:?}", e.0)
}

/// Whether a libnccl can be loaded (cudarc panics on a call without one).
pub fn library_present() -> bool {
    // SAFETY: only tries to open the library by its names; nothing of it
    // is called.
    unsafe { sys::is_culib_present() }
}

/// Whether the CUDA driver's library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// A fresh id for a communicator (rank 0 makes it, every rank joins it).
pub fn unique_id() -> Result<[u8; 128], String> {
    let id = result::get_uniqueid().map_err(|e| describe(&e))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's communicator. Dropped, it is destroyed once finished, or
/// aborted (which ends its peers' waits on it) where a collective failed.
pub struct RawComm {
    comm: sys::ncclComm_t,
    pub failed: bool,
}

// SAFETY: an NCCL communicator may be used from any one thread at a time;
// `NcclComm` holds it by `&mut self` for every call.
unsafe impl Send for RawComm {}

impl RawComm {
    /// Joins the communicator `id` as `rank` of `size`, on the current
    /// thread's CUDA context (blocks until every rank has joined).
    pub fn join(id: &[u8; 128], size: usize, rank: usize) -> Result<Self, String> {
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm = MaybeUninit::uninit();
        let (size, rank) = (size as i32, rank as i32);
        // SAFETY: `comm` is written by a successful call before it is read.
        unsafe { result::comm_init_rank(comm.as_mut_ptr(), size, id, rank) }
            .map_err(|e| describe(&e))?;
        Ok(Self {
            // SAFETY: the call above succeeded, so it wrote the handle.
            comm: unsafe { comm.assume_init() },
            failed: false,
        })
    }

    /// Queues on `stream`, as one group, a send of each `(ptr, bytes,
    /// peer)` of `sends` and a receive of each of `recvs`.
    ///
    /// # Safety
    /// Every pointer is a device allocation of at least its bytes on this
    /// communicator's GPU that stays alive, and is neither read (receives)
    /// nor written (sends) by other work, until the stream has run the
    /// group.
    pub unsafe fn group(
        &self,
        stream: CUstream,
        sends: &[(u64, usize, usize)],
        recvs: &[(u64, usize, usize)],
    ) -> Result<(), String> {
        let u8s = sys::ncclDataType_t::ncclUint8;
        let s = stream as sys::cudaStream_t;
        result::group_start().map_err(|e| describe(&e))?;
        let mut queued = Ok(());
        for &(ptr, bytes, peer) in sends {
            // SAFETY: the caller's promise on `ptr`.
            let r = unsafe {
                result::send(ptr as *const c_void, bytes, u8s, peer as i32, self.comm, s)
            };
            queued = queued.and(r.map(|_| ()));
        }
        for &(ptr, bytes, peer) in recvs {
            // SAFETY: the caller's promise on `ptr`.
            let r =
                unsafe { result::recv(ptr as *mut c_void, bytes, u8s, peer as i32, self.comm, s) };
            queued = queued.and(r.map(|_| ()));
        }
        let ended = result::group_end();
        queued.map_err(|e| describe(&e))?;
        ended.map(|_| ()).map_err(|e| describe(&e))
    }

    /// An error NCCL found while the queued work ran (a peer gone, a
    /// transport failure), if any.
    pub fn async_error(&self) -> Option<String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the handle is live; `state` is written by the call.
        let asked = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        match (asked, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => None,
            (sys::ncclResult_t::ncclSuccess, s) => Some(format!("{s:?}")),
            (a, _) => Some(format!("{a:?} asking for the communicator's state")),
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the handle is live and dropped once; abort does not wait
        // for work that cannot finish, destroy waits for what was queued.
        unsafe {
            let _ = if self.failed {
                result::comm_abort(self.comm)
            } else {
                result::comm_destroy(self.comm)
            };
        }
    }
}
