//! `temper export`: a training run or a LoRA adapter, out in the formats
//! serving stacks run — a merged Hugging Face directory, a PEFT adapter, or a
//! GGUF file (llama.cpp / Ollama / LM Studio) with tokenizer and chat template.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use temper_engine::{RunKind, TrainingRun};
use temper_model::{
    save_gguf, save_hf, GgufQuant, LoadOptions, LoraAdapter, LoraConfig, Pretrained, Target,
};

/// Output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A Hugging Face directory with the adapter merged (safetensors,
    /// config, tokenizer, chat template).
    Hf,
    /// The LoRA adapter in PEFT's layout (vLLM, PEFT, transformers).
    Peft,
    /// One GGUF file with the adapter merged, tokenizer and chat template.
    Gguf,
}

/// Arguments of `temper export`.
#[derive(Args)]
pub struct ExportArgs {
    /// A run directory (`temper train rl|sft` output), a PEFT adapter
    /// directory, a checkpoint state directory (state.json), or a model
    /// (directory or GGUF) to convert.
    input: PathBuf,
    /// Output format.
    #[arg(long, value_enum)]
    format: Format,
    /// Where to write: a directory (hf, peft) or a file (gguf).
    #[arg(long)]
    out: PathBuf,
    /// GGUF tensor type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,
    /// q2_k, q3_k, q4_k, q5_k, q6_k, q4_k_m.
    #[arg(long, default_value = "f16")]
    quant: String,
    /// The base model (directory or GGUF); default: the one the adapter or
    /// checkpoint names.
    #[arg(long)]
    base: Option<PathBuf>,
}

/// What the input holds.
enum Trained {
    Adapter(PathBuf),
    State(PathBuf),
    /// A model itself (directory or GGUF): a plain format conversion.
    Model,
}

fn resolve(input: &Path) -> Result<Trained> {
    if temper_model::is_gguf(input) || input.join("config.json").is_file() {
        return Ok(Trained::Model);
    }
    if input.join("adapter_config.json").is_file() {
        return Ok(Trained::Adapter(input.to_path_buf()));
    }
    if input.join("adapter").join("adapter_config.json").is_file() {
        return Ok(Trained::Adapter(input.join("adapter")));
    }
    if input.join("state.json").is_file() {
        return Ok(Trained::State(input.to_path_buf()));
    }
    let latest = input.join("checkpoints").join("latest.json");
    if latest.is_file() {
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&latest).with_context(|| latest.display().to_string())?,
        )
        .with_context(|| latest.display().to_string())?;
        let Some(state) = v.get("state_path").and_then(|s| s.as_str()) else {
            bail!("{} names no state_path", latest.display());
        };
        let state = PathBuf::from(state);
        if state.join("state.json").is_file() {
            return Ok(Trained::State(state));
        }
        bail!(
            "{} points at {}, which is not a local checkpoint (a remote trainer's? export it there)",
            latest.display(),
            state.display()
        );
    }
    bail!(
        "{} is not a run directory (adapter/ or checkpoints/latest.json), a PEFT adapter (adapter_config.json) or a checkpoint (state.json)",
        input.display()
    )
}

fn json_field(path: &Path, key: &str) -> Result<Option<String>> {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(path).with_context(|| path.display().to_string())?,
    )
    .with_context(|| path.display().to_string())?;
    Ok(v.get(key).and_then(|s| s.as_str()).map(str::to_string))
}

/// Load, merge, write.
pub fn run(args: ExportArgs) -> Result<()> {
    let quant: GgufQuant = args.quant.parse()?;
    let trained = resolve(&args.input)?;
    let (meta, key) = match &trained {
        Trained::Adapter(d) => (d.join("adapter_config.json"), "base_model_name_or_path"),
        Trained::State(d) => (d.join("state.json"), "base_model"),
        Trained::Model => (args.input.clone(), ""),
    };
    let base_path = match args.base.clone() {
        Some(b) => b,
        None if matches!(trained, Trained::Model) => args.input.clone(),
        None => match json_field(&meta, key)? {
            Some(b) if Path::new(&b).exists() => PathBuf::from(b),
            Some(b) => bail!(
                "{} names base model {b:?}, which is not here; pass --base",
                meta.display()
            ),
            None => bail!("{} names no base model; pass --base", meta.display()),
        },
    };
    let base = Arc::new(
        Pretrained::load(&base_path, &f32_weights())
            .with_context(|| format!("loading base model {}", base_path.display()))?,
    );
    let adapter: Option<LoraAdapter> = match &trained {
        Trained::Model => None,
        Trained::Adapter(d) => Some(
            LoraAdapter::load_peft(d, &base.config, base.model.dtype(), base.model.device())
                .with_context(|| format!("loading adapter {}", d.display()))?,
        ),
        Trained::State(d) => {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(d.join("state.json"))?)?;
            let kind: RunKind = serde_json::from_value(v["kind"].clone())
                .with_context(|| format!("{}: kind", d.join("state.json").display()))?;
            match kind {
                RunKind::Full => {
                    let mut run = TrainingRun::full(base.clone())?;
                    run.load_state(d, false)?;
                    let tmp = tempdir_near(&args.out)?;
                    run.export_model(&tmp)?;
                    let full = Pretrained::load(&tmp, &f32_weights())?;
                    let r = write(&args, &base, &full.model, None, quant);
                    std::fs::remove_dir_all(&tmp).ok();
                    return r;
                }
                RunKind::Lora {
                    rank,
                    alpha,
                    targets,
                } => {
                    let targets = targets
                        .iter()
                        .map(|t| Target::from_name(t).with_context(|| format!("LoRA target {t}")))
                        .collect::<Result<Vec<_>>>()?;
                    let cfg = LoraConfig {
                        rank,
                        alpha,
                        targets,
                        use_rslora: false,
                    };
                    let mut run = TrainingRun::lora(base.clone(), cfg, 0)?;
                    run.load_state(d, false)?;
                    let tmp = tempdir_near(&args.out)?;
                    run.export_peft(&tmp)?;
                    let a = LoraAdapter::load_peft(
                        &tmp,
                        &base.config,
                        base.model.dtype(),
                        base.model.device(),
                    );
                    std::fs::remove_dir_all(&tmp).ok();
                    Some(a?)
                }
            }
        }
    };
    let merged = match &adapter {
        Some(a) => base.model.merge_lora(a)?,
        None => base.model.clone(),
    };
    write(&args, &base, &merged, adapter.as_ref(), quant)
}

fn tempdir_near(out: &Path) -> Result<PathBuf> {
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let tmp = parent.join(format!(".temper-export-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    Ok(tmp)
}

fn write(
    args: &ExportArgs,
    base: &Pretrained,
    model: &temper_model::Model,
    adapter: Option<&LoraAdapter>,
    quant: GgufQuant,
) -> Result<()> {
    match args.format {
        Format::Hf => save_hf(base, model, &args.out)?,
        Format::Peft => match adapter {
            Some(a) => a.save_peft(&args.out, &base.dir.display().to_string())?,
            None => bail!("no LoRA adapter to export (the input is a model or a full-parameter run); use --format hf or gguf"),
        },
        Format::Gguf => {
            if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)?;
            }
            save_gguf(base, model, &args.out, quant)?
        }
    }
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// Export reads f32 weights whatever `--dtype` says: its output precision is
/// `--quant`, and merging an adapter into bf16-rounded weights would lose
/// bits for nothing.
fn f32_weights() -> LoadOptions {
    LoadOptions {
        precision: temper_model::Precision::F32,
        ..LoadOptions::default()
    }
}
