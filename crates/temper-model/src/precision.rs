//! The precision of the weights that the matmuls read: `f32`, `bf16`
//! (weights stored in bf16, matmul inputs rounded to bf16, every product
//! summed in f32; norms, attention, softmax and LoRA stay f32), or `gguf`
//! (a GGUF's quantized matrices kept in their blocks, f32 arithmetic).

use std::fmt;
use std::str::FromStr;

use crate::error::{ModelError, Result};
use crate::kernels::bf16_dot_available;

/// The matmul weight precision: the `--dtype` of commands and configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 weights and f32 matmuls (the golden tests' precision).
    #[default]
    F32,
    /// bf16 weights and matmul inputs, f32 sums: half the weight memory and
    /// bytes read per token; with `avx512_bf16`, twice the multiply-adds
    /// per instruction.
    Bf16,
    /// A GGUF's Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K and Q6_K matrices kept in
    /// their blocks and dequantized to f32 in the matmul (`kernels::quant`):
    /// the same bits as `f32` on the same file, at the file's size in memory. Every other
    /// weight (and every weight of a safetensors checkpoint) is `f32`.
    Gguf,
}

impl Precision {
    /// `bf16` where the CPU has the bf16 dot-product instruction, else `f32`.
    pub fn auto() -> Self {
        if bf16_dot_available() {
            Self::Bf16
        } else {
            Self::F32
        }
    }

    /// The name commands take and print.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Gguf => "gguf",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Precision {
    type Err = ModelError;

    /// `f32`, `bf16`, `gguf`, or `auto` (see [`Precision::auto`]).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "gguf" => Ok(Self::Gguf),
            "auto" => Ok(Self::auto()),
            other => Err(ModelError::InvalidInput(format!(
                "dtype {other:?}: expected \"f32\", \"bf16\", \"gguf\" or \"auto\""
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_four_names_and_refuses_others() {
        assert_eq!("f32".parse::<Precision>().unwrap(), Precision::F32);
        assert_eq!("gguf".parse::<Precision>().unwrap(), Precision::Gguf);
        assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::Bf16);
        assert_eq!("auto".parse::<Precision>().unwrap(), Precision::auto());
        let e = "fp16".parse::<Precision>().unwrap_err().to_string();
        assert!(e.contains("\"f32\", \"bf16\", \"gguf\" or \"auto\""), "{e}");
    }
}
