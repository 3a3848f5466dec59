//! Checkpoint tensors from `model.safetensors` or a sharded
//! `model.safetensors.index.json` (memory-mapped), or from a GGUF file
//! (dequantised as read, or its quantized matrices kept as blocks), with
//! shape checks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use crate::formats::gguf::GgufFile;
use crate::kernels::QuantWeight;

/// A weight matrix as loaded: a tensor, or GGUF blocks kept quantized.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// A dense tensor in the checkpoint's dtype.
    Dense(Tensor),
    /// Quantized blocks (see [`QuantWeight`]).
    Quant(QuantWeight),
}

enum Source {
    Safetensors(MmapedSafetensors),
    Gguf(GgufFile),
}

/// The tensors of one checkpoint: safetensors files or a GGUF file, always
/// named as in a Hugging Face checkpoint.
pub struct Checkpoint {
    files: Source,
    desc: String,
    dtype: DType,
    device: Device,
    /// Keep a GGUF's quantized matrices in their blocks (`--dtype gguf`).
    keep_quantized: bool,
}

impl Checkpoint {
    /// Open the weights of a Hugging Face model directory. Tensors are cast to
    /// `dtype` on `device` as they are read.
    pub fn open(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let paths = shard_paths(dir)?;
        let desc = paths
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect::<Vec<_>>()
            .join(", ");
        // SAFETY: the files are mapped read-only; like every safetensors
        // reader we assume nobody truncates them while the model is loaded.
        let files = unsafe { MmapedSafetensors::multi(&paths) }
            .map_err(|e| ModelError::bad(dir, format!("safetensors: {e}")))?;
        Ok(Self {
            files: Source::Safetensors(files),
            desc,
            dtype,
            device: device.clone(),
            keep_quantized: false,
        })
    }

    /// The tensors of a GGUF file, dequantised to `dtype` on `device` as
    /// they are read.
    pub fn from_gguf(file: GgufFile, dtype: DType, device: &Device) -> Self {
        Self {
            desc: file.path().display().to_string(),
            files: Source::Gguf(file),
            dtype,
            device: device.clone(),
            keep_quantized: false,
        }
    }

    /// Keep the quantized matrices of a GGUF file in their blocks (see
    /// [`Checkpoint::get_matrix`]); safetensors and off-CPU loads ignore it.
    pub fn keep_quantized(mut self, keep: bool) -> Self {
        self.keep_quantized = keep && self.device.is_cpu();
        self
    }

    /// A linear layer's weight `name` `[out, in]`: its quantized blocks when
    /// kept (a GGUF matrix in a [`crate::kernels::QuantFormat`] and
    /// [`Checkpoint::keep_quantized`]), else the tensor as [`Checkpoint::get`].
    pub fn get_matrix(&self, name: &str, expected: &[usize]) -> Result<Matrix> {
        if let (Source::Gguf(g), true) = (&self.files, self.keep_quantized) {
            if let Some(q) = g.quant_tensor(name)? {
                let (out, inp) = q.dims();
                if [out, inp] != expected {
                    return Err(ModelError::ShapeMismatch {
                        name: name.to_string(),
                        expected: expected.to_vec(),
                        actual: vec![out, inp],
                    });
                }
                return Ok(Matrix::Quant(q));
            }
        }
        Ok(Matrix::Dense(self.get(name, expected)?))
    }

    /// Whether the checkpoint has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        match &self.files {
            Source::Safetensors(f) => f.get(name).is_ok(),
            Source::Gguf(g) => g.contains(name),
        }
    }

    /// Load `name`, checking it has shape `expected`.
    pub fn get(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let files = match &self.files {
            Source::Safetensors(f) => f,
            Source::Gguf(g) => {
                let t = g.tensor(name, self.dtype, &self.device)?;
                if t.dims() != expected {
                    return Err(ModelError::ShapeMismatch {
                        name: name.to_string(),
                        expected: expected.to_vec(),
                        actual: t.dims().to_vec(),
                    });
                }
                return Ok(t);
            }
        };
        let view = files.get(name).map_err(|_| ModelError::MissingTensor {
            name: name.to_string(),
            source_desc: self.desc.clone(),
        })?;
        if view.shape() != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                actual: view.shape().to_vec(),
            });
        }
        let t = files.load(name, &self.device)?;
        Ok(t.to_dtype(self.dtype)?)
    }
}

/// The files to map: the shards named by the index, or the single file.
fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::bad(&index, e))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::bad(&index, "no weight_map object"))?;
        let names: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        let mut paths = Vec::new();
        for n in names {
            let p = dir.join(n);
            if !p.exists() {
                return Err(ModelError::MissingFile {
                    path: p,
                    hint: "listed in model.safetensors.index.json".into(),
                });
            }
            paths.push(p);
        }
        return Ok(paths);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(ModelError::MissingFile {
        path: single,
        hint: "expected model.safetensors or model.safetensors.index.json (PyTorch .bin checkpoints are not supported; convert them with save_pretrained(safe_serialization=True))".into(),
    })
}
