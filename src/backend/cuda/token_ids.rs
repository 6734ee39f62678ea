//! A batch's token ids on the GPU ([`DeviceIds`]): its rows of S + 1 ids go
//! up once (with a loss mask's bits, where it has one) and split there into
//! inputs and next-token targets (`split_token_rows`). The embedding's
//! forward gathers the inputs' rows; its backward orders the inputs by id
//! on the device (`token_order`, a merge sort) and sums each id's rows in token order, as
//! the cpu loop does. Documents packed apart send a bit a token, set where
//! one begins, and `document_starts` finds every token's start for the
//! attention. Only the ids and those bits cross PCIe.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::dense::threads;
use super::{gpu_error, CudaBackend};
use crate::backend::{token_order_merge_widths, TOKEN_RUN};
use crate::math::attention::AttnShape;
use crate::model::TokenRows;
use crate::EngineError;

/// A batch's T inputs and their T targets (`math::IGNORED_TARGET` where no
/// loss) in GPU memory.
pub struct DeviceIds {
    pub(super) inputs: CudaSlice<u32>,
    pub(super) targets: CudaSlice<u32>,
}

impl CudaBackend {
    /// The inputs and targets of `rows`, split on the GPU from one upload
    /// of the rows' ids (and of the loss mask's bits).
    pub(super) fn token_ids_device(&self, rows: TokenRows<'_>) -> Result<DeviceIds, EngineError> {
        let s = rows.seq_len;
        assert!(s > 0 && rows.tokens.len().is_multiple_of(s + 1));
        let t = rows.tokens.len() / (s + 1) * s;
        let mut ids = DeviceIds {
            inputs: self.alloc::<u32>(t)?,
            targets: self.alloc::<u32>(t)?,
        };
        if t == 0 {
            return Ok(ids);
        }
        let tokens = self.upload_u32(rows.tokens)?;
        let (mask, has_mask) = match rows.mask_words() {
            Some(words) => (self.upload_u32(&words)?, 1u32),
            None => (self.alloc::<u32>(1)?, 0u32),
        };
        let (t32, s32) = (t as u32, s as u32);
        let mut launch = self.stream.launch_builder(&self.dense.split_token_rows);
        launch.arg(&tokens).arg(&mask).arg(&has_mask);
        launch.arg(&mut ids.inputs).arg(&mut ids.targets);
        launch.arg(&t32).arg(&s32);
        // SAFETY: the rows hold t/s·(s + 1) ids, so token i's position and
        // the next lie in them; with has_mask 1 the mask holds a bit for
        // each position; inputs and targets hold t u32; one thread a token.
        unsafe { launch.launch(threads(t)) }.map_err(|e| gpu_error("split_token_rows", e))?;
        Ok(ids)
    }

    /// `math::embedding_forward` on the GPU: the rows of `table` (V × d)
    /// for `inputs`, each < V (checked by the caller on the host's copy).
    pub(super) fn embedding_forward_device(
        &self,
        table: &CudaSlice<f32>,
        inputs: &CudaSlice<u32>,
        d: usize,
    ) -> Result<CudaSlice<f32>, EngineError> {
        let n = inputs.len();
        let mut h = self.zeros(n * d)?;
        if n == 0 {
            return Ok(h);
        }
        let (n32, d32, one) = (n as u32, d as u32, 1u32);
        let mut launch = self.stream.launch_builder(&self.dense.gather_rows);
        launch.arg(table).arg(inputs).arg(&mut h);
        launch.arg(&n32).arg(&d32).arg(&one);
        // SAFETY: every input < V (the caller's check), so each row read
        // lies in the V·d table; h holds n·d f32; one thread an element.
        unsafe { launch.launch(threads(n * d)) }.map_err(|e| gpu_error("gather_rows", e))?;
        Ok(h)
    }

    /// The tokens' stable order by id (each id's tokens in token order), a
    /// permutation of 0..t: runs of [`TOKEN_RUN`] ordered alone, then
    /// merged in pairs, a launch a width ([`token_order_merge_widths`]),
    /// each token placed by a binary search in its partner run: 1.0 M
    /// compares at 8 192 tokens rather than t² = 67 M.
    fn token_order(&self, inputs: &CudaSlice<u32>) -> Result<CudaSlice<u32>, EngineError> {
        let t = inputs.len();
        let mut order = self.alloc::<u32>(t)?;
        let (t32, run) = (t as u32, TOKEN_RUN as u32);
        let mut launch = self.stream.launch_builder(&self.dense.token_order_runs);
        launch.arg(inputs).arg(&mut order).arg(&t32).arg(&run);
        // SAFETY: inputs and order hold t u32; each thread writes its own
        // rank, a distinct position of its run.
        unsafe { launch.launch(threads(t)) }.map_err(|e| gpu_error("token_order_runs", e))?;
        let mut merged = self.alloc::<u32>(t)?;
        for width in token_order_merge_widths(t) {
            let width32 = width as u32;
            let mut launch = self.stream.launch_builder(&self.dense.token_order_merge);
            launch.arg(inputs).arg(&order).arg(&mut merged);
            launch.arg(&t32).arg(&width32);
            // SAFETY: inputs, order and merged hold t u32, order a
            // permutation of 0..t sorted in runs of `width`; each thread
            // writes its token's distinct place in its pair of runs.
            unsafe { launch.launch(threads(t)) }.map_err(|e| gpu_error("token_order_merge", e))?;
            std::mem::swap(&mut order, &mut merged);
        }
        Ok(order)
    }

    /// `math::embedding_backward` on the GPU: `dtable` (V × d) += the rows
    /// of `dh` (inputs × d) at their ids, each < V (checked by the
    /// caller), every element summed in token order as the cpu does.
    pub(super) fn embedding_backward_device(
        &self,
        dtable: &mut CudaSlice<f32>,
        dh: &CudaSlice<f32>,
        inputs: &CudaSlice<u32>,
        d: usize,
    ) -> Result<(), EngineError> {
        let t = inputs.len();
        if t == 0 {
            return Ok(());
        }
        let order = self.token_order(inputs)?;
        let (t32, d32) = (t as u32, d as u32);
        let mut launch = self.stream.launch_builder(&self.dense.embedding_backward);
        launch.arg(dtable).arg(dh).arg(inputs).arg(&order);
        launch.arg(&t32).arg(&d32);
        // SAFETY: order is a permutation of 0..t (`token_order`'s), so each
        // dh row read lies in its t·d; each id < V (the caller's check), so
        // every written row lies in the V·d table, one run a row.
        unsafe { launch.launch(threads(t * d)) }.map_err(|e| gpu_error("embedding_backward", e))?;
        Ok(())
    }

    /// `TokenRows::inputs_targets` on the GPU, for the kernel checks.
    pub fn token_ids_host(&self, rows: TokenRows<'_>) -> Result<(Vec<u32>, Vec<u32>), EngineError> {
        self.bind()?;
        let ids = self.token_ids_device(rows)?;
        let t = ids.inputs.len();
        let (mut inputs, mut targets) = (vec![0u32; t], vec![0u32; t]);
        for (dev, host) in [(&ids.inputs, &mut inputs), (&ids.targets, &mut targets)] {
            self.stream
                .memcpy_dtoh(dev, host.as_mut_slice())
                .map_err(|e| gpu_error("a download", e))?;
        }
        Ok((inputs, targets))
    }

    /// `math::embedding_backward` on the GPU, on host slices.
    pub fn embedding_backward_host(
        &self,
        dtable: &mut [f32],
        dh: &[f32],
        tokens: &[u32],
        d: usize,
    ) -> Result<(), EngineError> {
        self.bind()?;
        let (mut table, dh) = (self.upload(dtable)?, self.upload(dh)?);
        let inputs = self.upload_u32(tokens)?;
        self.embedding_backward_device(&mut table, &dh, &inputs, d)?;
        self.download(&table, dtable)
    }

    /// The tokens' stable order by id on the GPU, for the kernel checks.
    pub fn token_order_host(&self, tokens: &[u32]) -> Result<Vec<u32>, EngineError> {
        self.bind()?;
        let order = self.token_order(&self.upload_u32(tokens)?)?;
        let mut host = vec![0u32; tokens.len()];
        self.download_values(&order, &mut host)?;
        Ok(host)
    }

    /// Every token's document start: `starts`, or 0 (one document a
    /// sequence), on the GPU. Only a bit a token goes up, set where a
    /// document begins, and `document_starts` finds each token's start
    /// from them.
    pub(super) fn attention_starts(
        &self,
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<CudaSlice<u32>, EngineError> {
        let t = shape.tokens();
        let mut device = self.alloc::<u32>(t)?;
        let Some(starts) = starts else {
            return Ok(device);
        };
        assert_eq!(starts.len(), t, "a start a token");
        let s = shape.seq_len;
        let mut words = vec![0u32; t.div_ceil(32)];
        for (i, _) in starts
            .iter()
            .enumerate()
            .filter(|&(i, &q)| q as usize == i % s)
        {
            words[i / 32] |= 1 << (i % 32);
        }
        let begins = self.upload_u32(&words)?;
        let (t32, s32) = (t as u32, s as u32);
        let mut launch = self.stream.launch_builder(&self.dense.document_starts);
        launch.arg(&begins).arg(&mut device).arg(&t32).arg(&s32);
        // SAFETY: begins holds a bit for each of the t tokens, every row's
        // first set (its start is 0, as every row's first token's is), so
        // no thread reads before its row; starts holds t u32; one thread
        // a token.
        unsafe { launch.launch(threads(t)) }.map_err(|e| gpu_error("document_starts", e))?;
        Ok(device)
    }

    /// `attention_starts` brought back, for the kernel checks.
    pub fn attention_starts_host(
        &self,
        starts: &[u32],
        shape: &AttnShape,
    ) -> Result<Vec<u32>, EngineError> {
        self.bind()?;
        let device = self.attention_starts(Some(starts), shape)?;
        let mut host = vec![0u32; starts.len()];
        self.download_values(&device, &mut host)?;
        Ok(host)
    }
}
