//! The precision of the weights that the matmuls read: `f32`, or `bf16`
//! (weights stored in bf16, matmul inputs rounded to bf16, every product
//! summed in f32; norms, attention, softmax and LoRA stay f32).

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};

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
        }
    }
}

static DEFAULT: AtomicU8 = AtomicU8::new(0);

/// Set the precision [`crate::LoadOptions::default`] uses in this process:
/// the binary's global `--dtype`, so every command and every model a
/// command loads (trainer, sampler, server) agree.
pub fn set_default_precision(p: Precision) {
    DEFAULT.store(p as u8, Ordering::Relaxed);
}

/// The process's default precision (see [`set_default_precision`]; `f32`
/// unless set).
pub fn default_precision() -> Precision {
    match DEFAULT.load(Ordering::Relaxed) {
        0 => Precision::F32,
        _ => Precision::Bf16,
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Precision {
    type Err = ModelError;

    /// `f32`, `bf16`, or `auto` (see [`Precision::auto`]).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "auto" => Ok(Self::auto()),
            other => Err(ModelError::InvalidInput(format!(
                "dtype {other:?}: expected \"f32\", \"bf16\" or \"auto\""
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_names_and_refuses_others() {
        assert_eq!("f32".parse::<Precision>().unwrap(), Precision::F32);
        assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::Bf16);
        assert_eq!("auto".parse::<Precision>().unwrap(), Precision::auto());
        let e = "fp16".parse::<Precision>().unwrap_err().to_string();
        assert!(e.contains("\"f32\", \"bf16\" or \"auto\""), "{e}");
    }
}
