//! The model's forwards of a step: one packed prefill over chunks of queued
//! prompts, one batched decode over the running sequences (per adapter).

use temper_model::candle_core::{DType, Tensor};
use temper_model::{KvCache, Segment};

use super::{BatchLoop, Seq};
use crate::scheduler::job::Event;
use crate::scheduler::unwind::unwinding;

impl BatchLoop {
    /// One packed forward over the chunks `(index, tokens)` of queued
    /// prompts (all under one adapter), each appended to its cache; the
    /// logits after the last token of every prompt that is now complete.
    pub(super) fn prefill_chunks(
        &mut self,
        chunks: &[(usize, usize)],
    ) -> temper_model::Result<Vec<(usize, Vec<f32>)>> {
        let model = self.model.clone();
        let model = &model.model;
        let adapter = chunks
            .first()
            .and_then(|&(i, _)| self.prefilling[i].what.adapter());
        let lora = adapter.as_ref().map(|a| &a.lora);
        let mut ids: Vec<u32> = Vec::new();
        let mut last_rows: Vec<(usize, u32)> = Vec::new();
        for &(i, take) in chunks {
            let p = &self.prefilling[i];
            let from = p.cache.len();
            ids.extend_from_slice(&p.input[from..from + take]);
            if from + take == p.input.len() {
                last_rows.push((i, (ids.len() - 1) as u32));
            }
        }
        let mut segs: Vec<Segment<'_>> = Vec::with_capacity(chunks.len());
        let mut cursor = self.prefilling.iter_mut().enumerate();
        for &(i, take) in chunks {
            // `chunks` is sorted by index, so one pass finds every cache.
            let Some((_, p)) = cursor.find(|(j, _)| *j == i) else {
                return Err(temper_model::ModelError::InvalidInput(
                    "prefill chunks out of order".into(),
                ));
            };
            segs.push(Segment {
                len: take,
                cache: Some(&mut p.cache),
            });
        }
        #[cfg(feature = "fault-hooks")]
        crate::scheduler::fault::check_prefill(&ids);
        let hidden = model.forward_hidden(&ids, &mut segs, lora)?;
        drop(segs);
        if last_rows.is_empty() {
            return Ok(Vec::new());
        }
        let idx: Vec<u32> = last_rows.iter().map(|&(_, r)| r).collect();
        let rows = hidden.index_select(&Tensor::new(idx.as_slice(), model.device())?, 0)?;
        let logits = model
            .logits(&rows)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        Ok(last_rows.iter().map(|&(i, _)| i).zip(logits).collect())
    }

    /// One packed decode forward per adapter over every running sequence.
    pub(super) fn decode(&mut self) {
        if self.running.is_empty() {
            return;
        }
        self.metrics.batch_size.observe(self.running.len() as f64);
        let mut keys: Vec<usize> = Vec::new();
        for s in &self.running {
            let k = s.job.adapter_key();
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let model = self.model.clone();
        let mut failed: Vec<(usize, String)> = Vec::new();
        for key in keys {
            let mut group: Vec<&mut Seq> = self
                .running
                .iter_mut()
                .filter(|s| s.job.adapter_key() == key)
                .collect();
            let adapter = group.first().and_then(|s| s.job.adapter.clone());
            let lora = adapter.as_ref().map(|a| &a.lora);
            let ids: Vec<u32> = group
                .iter()
                .map(|s| s.tokens.last().copied().unwrap_or(0))
                .collect();
            // A panic fails this adapter's sequences only: the forward
            // wrote nothing but their caches, which are dropped with them.
            let result = unwinding("decode step", || -> temper_model::Result<Vec<Vec<f32>>> {
                let mut caches: Vec<&mut KvCache> =
                    group.iter_mut().map(|s| &mut s.cache).collect();
                let hidden = model.model.forward_decode(&ids, &mut caches, lora)?;
                Ok(model
                    .model
                    .logits(&hidden)?
                    .to_dtype(DType::F32)?
                    .to_vec2::<f32>()?)
            });
            match result {
                Ok(rows) => {
                    for (s, row) in group.into_iter().zip(rows) {
                        s.logits = row;
                    }
                }
                Err(e) => {
                    tracing::error!("{e}");
                    failed.push((key, e));
                }
            }
        }
        for (key, msg) in failed {
            let mut keep = Vec::with_capacity(self.running.len());
            for s in std::mem::take(&mut self.running) {
                if s.job.adapter_key() == key {
                    let _ = s.job.events.send(Event::Failed(msg.clone()));
                } else {
                    keep.push(s);
                }
            }
            self.running = keep;
        }
    }
}
