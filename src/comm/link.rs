//! A modeled link between ranks: [`ModeledLink`] wraps a [`Comm`] so that
//! each collective takes at least the time a link of a given bandwidth and
//! latency would, so that what a slower interconnect does to a step (and
//! what sending fewer rows saves) can be measured on one machine. The
//! results are the wrapped communicator's, bit for bit.
//!
//! Each rank has a full-duplex link of `bytes_per_s` each way: a
//! collective takes `latency` plus the larger of the bytes this rank sends
//! and receives over the bandwidth. The all-reduce is costed as a ring's,
//! 2 (n − 1) / n of the buffer each way.
//!
//! A rank has one link, however many endpoints it drives: endpoints made
//! with [`ModeledLink::sharing`] queue their transfers on one clock, so a
//! collective on a second endpoint (the dense gradient's buckets, reduced
//! while the backward's all-to-alls run) waits for the link to be free
//! instead of finding a second link of its own.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Comm, CommError};

/// A link's bandwidth (bytes a second, each way) and per-collective latency.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub bytes_per_s: f64,
    pub latency: Duration,
}

impl Link {
    /// A link of `gb_per_s` GB/s (10⁹ bytes) and `latency_us` µs, or why
    /// not.
    pub fn new(gb_per_s: f64, latency_us: f64) -> Result<Self, String> {
        if !(gb_per_s.is_finite() && gb_per_s > 0.0) {
            return Err(format!("a link of {gb_per_s} GB/s: give a positive rate"));
        }
        if !(latency_us.is_finite() && latency_us >= 0.0) {
            return Err(format!("a latency of {latency_us} µs: give 0 or more"));
        }
        Ok(Self {
            bytes_per_s: gb_per_s * 1e9,
            latency: Duration::from_secs_f64(latency_us * 1e-6),
        })
    }

    /// How long moving `out` bytes out and `inn` bytes in takes.
    pub fn time(&self, out: usize, inn: usize) -> Duration {
        self.latency + Duration::from_secs_f64(out.max(inn) as f64 / self.bytes_per_s)
    }
}

/// A [`Comm`] over a modeled link (none: the wrapped one as it is).
pub struct ModeledLink<C> {
    inner: C,
    link: Option<Link>,
    /// When the rank's link is next free: shared by its endpoints.
    free_at: Arc<Mutex<Instant>>,
    /// Time spent in collectives, modeled waits included.
    pub comm_time: Duration,
}

impl<C: Comm> ModeledLink<C> {
    pub fn new(inner: C, link: Option<Link>) -> Self {
        Self {
            inner,
            link,
            free_at: Arc::new(Mutex::new(Instant::now())),
            comm_time: Duration::ZERO,
        }
    }

    /// `inner` over the same link as `other` (the same rank's): a transfer
    /// starts when both endpoints' earlier transfers have ended.
    pub fn sharing<D>(inner: C, other: &ModeledLink<D>) -> Self {
        Self {
            inner,
            link: other.link,
            free_at: Arc::clone(&other.free_at),
            comm_time: Duration::ZERO,
        }
    }

    /// The wrapped endpoint.
    pub fn into_inner(self) -> C {
        self.inner
    }

    /// Runs `f`, then waits until the link has carried `bytes` (out, in):
    /// from when it started, or from when the link was next free if a
    /// transfer of another endpoint still held it.
    fn timed<T>(
        &mut self,
        f: impl FnOnce(&mut C) -> Result<T, CommError>,
        bytes: impl FnOnce(&T) -> (usize, usize),
    ) -> Result<T, CommError> {
        let start = Instant::now();
        let out = f(&mut self.inner)?;
        if let Some(link) = self.link {
            let (sent, received) = bytes(&out);
            let until = {
                let mut free_at = self.free_at.lock().unwrap_or_else(|p| p.into_inner());
                *free_at = start.max(*free_at) + link.time(sent, received);
                *free_at
            };
            let now = Instant::now();
            if until > now {
                std::thread::sleep(until - now);
            }
        }
        self.comm_time += start.elapsed();
        Ok(out)
    }
}

impl<C: Comm> Comm for ModeledLink<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_to_all(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError> {
        let me = self.rank();
        let others = |bufs: &[Vec<f32>]| -> usize {
            bufs.iter()
                .enumerate()
                .filter(|&(j, _)| j != me)
                .map(|(_, b)| b.len() * 4)
                .sum()
        };
        let sent = others(&sends);
        self.timed(|c| c.all_to_all(sends), |got| (sent, others(got)))
    }

    fn all_gather_u32(&mut self, mine: Vec<u32>) -> Result<Vec<Vec<u32>>, CommError> {
        let (me, bytes) = (self.rank(), mine.len() * 4);
        let peers = self.size() - 1;
        self.timed(
            |c| c.all_gather_u32(mine),
            |got| {
                let received = got
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != me)
                    .map(|(_, b)| b.len() * 4)
                    .sum();
                (bytes * peers, received)
            },
        )
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let n = self.size();
        let ring = 2 * (n - 1) * buf.len() * 4 / n.max(1);
        self.timed(|c| c.all_reduce_sum(buf), |_| (ring, ring))
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.timed(|c| c.barrier(), |_| (0, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::super::InProcessComm;
    use super::*;

    #[test]
    fn a_modeled_collective_takes_the_link_s_time_and_gives_the_same_values() {
        // 4 MB each way at 1 GB/s with 1 ms latency: at least 5 ms.
        let link = Link::new(1.0, 1000.0).unwrap();
        let (times, values): (Vec<Duration>, Vec<Vec<Vec<f32>>>) = std::thread::scope(|s| {
            let handles: Vec<_> = InProcessComm::endpoints(2)
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let mut c = ModeledLink::new(c, Some(link));
                        let me = c.rank() as f32;
                        let sends = vec![vec![me; 1 << 20], vec![me + 10.0; 1 << 20]];
                        let got = c.all_to_all(sends).unwrap();
                        (c.comm_time, got)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).unzip()
        });
        for t in &times {
            assert!(*t >= Duration::from_millis(5), "{t:?}");
        }
        assert_eq!(values[0][1][0], 1.0); // rank 1's to rank 0
        assert_eq!(values[1][0][0], 10.0); // rank 0's to rank 1
        assert_eq!(values[1][1][0], 11.0); // rank 1's own
    }

    #[test]
    fn endpoints_sharing_a_link_queue_on_it() {
        // Per rank, an all-to-all of 4 MB out and an all-reduce of 4 MB
        // (a ring's 4 MB each way, 2 ranks) at once, at 0.1 GB/s: 42 ms
        // each, one after the other on the rank's one link.
        let link = Link::new(0.1, 0.0).unwrap();
        let mains = InProcessComm::endpoints(2);
        let seconds = InProcessComm::endpoints(2);
        let took: Vec<Duration> = std::thread::scope(|s| {
            let handles: Vec<_> = mains
                .into_iter()
                .zip(seconds)
                .map(|(main, second)| {
                    s.spawn(move || {
                        let mut main = ModeledLink::new(main, Some(link));
                        let mut second = ModeledLink::sharing(second, &main);
                        let start = Instant::now();
                        std::thread::scope(|s| {
                            s.spawn(|| {
                                let mut buf = vec![1.0f32; 1 << 20];
                                second.all_reduce_sum(&mut buf).unwrap();
                                assert_eq!(buf[0], 2.0);
                            });
                            let me = main.rank();
                            let mut sends = vec![Vec::new(); 2];
                            sends[1 - me] = vec![0.5f32; 1 << 20];
                            main.all_to_all(sends).unwrap();
                        });
                        start.elapsed()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for t in took {
            assert!(t >= Duration::from_millis(80), "{t:?}");
        }
    }

    #[test]
    fn the_link_costs_what_a_rank_moves_and_refuses_what_cannot_be() {
        let link = Link::new(10.0, 5.0).unwrap();
        assert_eq!(link.time(0, 0), Duration::from_micros(5));
        assert_eq!(link.time(10_000, 20_000), Duration::from_micros(7));
        assert!(Link::new(0.0, 1.0).unwrap_err().contains("0 GB/s"));
        assert!(Link::new(1.0, -1.0).unwrap_err().contains("-1 µs"));
        // No link: the collective as it is.
        let mut c = ModeledLink::new(InProcessComm::endpoints(1).remove(0), None);
        let mut buf = [1.0f32, 2.0];
        c.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(buf, [1.0, 2.0]);
    }
}
