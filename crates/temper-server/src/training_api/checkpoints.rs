//! Checkpoints: `save_weights`, `load_weights` (including served PEFT
//! adapters), `save_weights_for_sampler`, and the checked paths they use.

use std::path::PathBuf;

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::futures::FutureState;
use super::state::{ApiState, Sampler, TrainModel, PEFT_ADAPTER_PREFIX};
use super::wire::parse;
use crate::error::ApiError;

/// A checkpoint name must be one plain path segment.
fn checkpoint_name(name: &str) -> std::result::Result<&str, String> {
    if name.is_empty()
        || name.len() > 255
        || name.contains(['/', '\\', '\0'])
        || name == "."
        || name == ".."
    {
        Err(format!(
            "invalid checkpoint name {name:?} (one path segment of at most 255 bytes: no '/', '\\', NUL, '.' or '..')"
        ))
    } else {
        Ok(name)
    }
}

/// A model id as a directory name: server-issued ids are
/// `sess-…:train:N`; anything else (absolute paths, `..`) is refused.
fn model_segment(id: &str) -> std::result::Result<&str, String> {
    let plain = id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':' | '.'));
    if id.is_empty() || id.len() > 255 || !plain || id == "." || id == ".." {
        Err(format!("invalid model id {id:?} in a checkpoint path"))
    } else {
        Ok(id)
    }
}

/// `{root}/{model_id}/{kind}/{name}`, every client-given part checked to be
/// one plain segment, so the result is always inside `root`.
pub(super) fn checkpoint_dir(
    root: &std::path::Path,
    model_id: &str,
    kind: &str,
    name: &str,
) -> std::result::Result<PathBuf, String> {
    let dir = root
        .join(model_segment(model_id)?)
        .join(kind)
        .join(checkpoint_name(name)?);
    // Belt and braces: no segment above can leave the root.
    if dir.starts_with(root) && dir.components().count() == root.components().count() + 3 {
        Ok(dir)
    } else {
        Err(format!(
            "checkpoint path for {model_id:?}/{name:?} leaves the checkpoint directory"
        ))
    }
}

/// `tinker://{model_id}/{kind}/{name}` → its parts.
pub(super) fn parse_tinker_path(
    path: &str,
) -> std::result::Result<(String, String, String), String> {
    let rest = path
        .strip_prefix("tinker://")
        .ok_or_else(|| format!("checkpoint path {path:?} must start with tinker://"))?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        [model, kind, name] if !model.is_empty() && !name.is_empty() => Ok((
            model_segment(model)?.to_string(),
            kind.to_string(),
            checkpoint_name(name)?.to_string(),
        )),
        _ => Err(format!(
            "checkpoint path {path:?} must be tinker://MODEL_ID/KIND/NAME"
        )),
    }
}

#[derive(Deserialize)]
struct SaveWeights {
    model_id: String,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default)]
    sampling_session_seq_id: Option<i64>,
    /// tinker's `save_state(..., overwrite=False)`: replacing a checkpoint
    /// (only ever one of this model's own) must be asked for.
    #[serde(default)]
    overwrite: bool,
}

pub(super) async fn save_weights(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: SaveWeights = parse(&body)?;
    let resp = s.dedupe(&r.model_id, r.seq_id, || {
        let prepared = (|| {
            let (run, _, _) = s.model(&r.model_id)?;
            let name = checkpoint_name(r.path.as_deref().unwrap_or_default())?.to_string();
            let dir = checkpoint_dir(&s.0.config.checkpoint_dir, &r.model_id, "weights", &name)?;
            if dir.exists() && !r.overwrite {
                return Err(format!(
                    "checkpoint tinker://{}/weights/{name} exists; save under another name or pass overwrite=True",
                    r.model_id
                ));
            }
            Ok::<_, String>((run, name, dir))
        })();
        let request_id = match prepared {
            Err(e) => s.failed_future(e),
            Ok((run, name, dir)) => {
                let path = format!("tinker://{}/weights/{name}", r.model_id);
                let pending = s.0.engine.save_state(&run, dir);
                s.spawn_future(async move {
                    pending.await?;
                    Ok(FutureState::Json(
                        json!({"type": "save_weights", "path": path}),
                    ))
                })
            }
        };
        json!({"request_id": request_id, "model_id": r.model_id})
    });
    Ok(Json(resp))
}

#[derive(Deserialize)]
struct LoadWeights {
    #[serde(default)]
    model_id: Option<String>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    model_seq_id: Option<i64>,
    path: String,
    #[serde(default)]
    optimizer: bool,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default)]
    base_model: Option<String>,
}

/// `create_training_client_from_state("tinker://adapters/peft/NAME")`: a new
/// LoRA run starting from a served PEFT adapter — its rank, alpha, targets
/// and weights.
fn load_peft_adapter(
    s: &ApiState,
    r: &LoadWeights,
    target: String,
    name: &str,
) -> Result<Json<Value>, ApiError> {
    let adapters = &s.0.config.adapters;
    let adapter = adapters.get(name).cloned().ok_or_else(|| {
        ApiError::NotFound(format!(
            "no adapter {name:?} is served (temper api serve --adapter NAME=DIR); served: {:?}",
            adapters.keys().collect::<Vec<_>>()
        ))
    })?;
    if r.optimizer {
        return Err(ApiError::BadRequest(
            "a PEFT adapter has no optimizer state: use create_training_client_from_state".into(),
        ));
    }
    if s.model(&target).is_ok() {
        return Err(ApiError::BadRequest(format!(
            "{target} exists: a PEFT adapter starts a new training client (create_training_client_from_state)"
        )));
    }
    let base = match (&r.base_model, s.0.bases.len()) {
        (Some(b), _) => b.clone(),
        (None, 1) => {
            s.0.bases
                .keys()
                .next()
                .cloned()
                .ok_or_else(|| ApiError::Internal("no base model is served".into()))?
        }
        (None, _) => {
            return Err(ApiError::BadRequest(
                "several base models are served: pass base_model".into(),
            ))
        }
    };
    if !s.0.bases.contains_key(&base) {
        return Err(ApiError::NotFound(format!("unknown base_model {base:?}")));
    }
    let resp = s.dedupe(&target, r.seq_id.or(Some(-1)), || {
        let created =
            s.0.engine
                .create_lora_run_from_peft(&base, adapter.dir.clone());
        let (st, mid, path) = (s.clone(), target.clone(), r.path.clone());
        let request_id = s.spawn_future(async move {
            let run = created.await?;
            st.tables().models.insert(
                mid.clone(),
                TrainModel {
                    run,
                    base,
                    rank: adapter.rank,
                },
            );
            Ok(FutureState::Json(
                json!({"type": "load_weights", "path": path, "model_id": mid}),
            ))
        });
        json!({"request_id": request_id, "model_id": target})
    });
    Ok(Json(resp))
}

pub(super) async fn load_weights(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: LoadWeights = parse(&body)?;
    let target = match (&r.model_id, &r.session_id, r.model_seq_id) {
        (Some(m), _, _) => m.clone(),
        (None, Some(sess), Some(n)) => {
            s.known_session(sess)?;
            format!("{sess}:train:{n}")
        }
        _ => {
            return Err(ApiError::BadRequest(
                "load_weights needs model_id, or session_id and model_seq_id".into(),
            ))
        }
    };
    if let Some(name) = r.path.strip_prefix(PEFT_ADAPTER_PREFIX) {
        return load_peft_adapter(&s, &r, target, name);
    }
    let resp = s.dedupe(&target, r.seq_id.or(Some(-1)), || {
        let prepared = (|| {
            let (src_model, kind, name) = parse_tinker_path(&r.path)?;
            if kind != "weights" {
                return Err(format!("load_weights needs a training checkpoint (…/weights/…), got {kind}"));
            }
            let dir = checkpoint_dir(&s.0.config.checkpoint_dir, &src_model, "weights", &name)?;
            if !dir.join("state.json").exists() {
                return Err(format!("no checkpoint at {}", r.path));
            }
            Ok::<_, String>((src_model, dir))
        })();
        let request_id = match prepared {
            Err(e) => s.failed_future(e),
            Ok((src_model, dir)) => {
                let st = s.clone();
                let (target, path, optimizer) = (target.clone(), r.path.clone(), r.optimizer);
                match s.model(&target) {
                    Ok((run, _, _)) => {
                        let pending = s.0.engine.load_state(&run, dir, optimizer);
                        s.spawn_future(async move {
                            pending.await?;
                            Ok(FutureState::Json(json!({"type": "load_weights", "path": path, "model_id": target})))
                        })
                    }
                    // Create-via-load: a new run shaped like the checkpoint (from its
                    // own state.json, so this works after a restart too), then load.
                    Err(_) => match s.checkpoint_shape(&dir, &src_model, r.base_model.as_deref()) {
                        Ok((base, cfg)) => {
                            let rank = cfg.rank;
                            let created = s.0.engine.create_lora_run(&base, cfg, 0);
                            s.spawn_future(async move {
                                let run = created.await?;
                                st.0.engine.load_state(&run, dir, optimizer).await?;
                                st.tables().models.insert(target.clone(), TrainModel { run, base, rank });
                                Ok(FutureState::Json(json!({"type": "load_weights", "path": path, "model_id": target})))
                            })
                        }
                        Err(e) => s.failed_future(e),
                    },
                }
            }
        };
        json!({"request_id": request_id, "model_id": target})
    });
    Ok(Json(resp))
}

pub(super) async fn save_weights_for_sampler(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: SaveWeights = parse(&body)?;
    let resp = s.dedupe(&r.model_id, r.seq_id, || {
        let session = r
            .model_id
            .split(":train:")
            .next()
            .unwrap_or_default()
            .to_string();
        let prepared = (|| {
            let (run, base, _) = s.model(&r.model_id)?;
            match (&r.path, r.sampling_session_seq_id) {
                (Some(name), _) => {
                    let name = checkpoint_name(name)?;
                    let path = format!("tinker://{}/sampler_weights/{name}", r.model_id);
                    Ok::<_, String>((
                        run,
                        base,
                        path.clone(),
                        json!({"type": "save_weights_for_sampler", "path": path}),
                        None,
                    ))
                }
                (None, Some(n)) => {
                    let sid = format!("{session}:sample:{n}");
                    let key = format!("tinker://{}/sampler_weights/{sid}", r.model_id);
                    Ok((
                        run,
                        base,
                        key,
                        json!({"type": "save_weights_for_sampler", "sampling_session_id": sid}),
                        Some(sid),
                    ))
                }
                (None, None) => {
                    Err("save_weights_for_sampler needs path or sampling_session_seq_id".into())
                }
            }
        })();
        let request_id = match prepared {
            Err(e) => s.failed_future(e),
            Ok((run, base, key, result, session_id)) => {
                let pending = s.0.engine.save_weights_for_sampler(&run, &key);
                let st = s.clone();
                s.spawn_future(async move {
                    pending.await?;
                    if let Some(sid) = session_id {
                        st.tables().samplers.insert(
                            sid,
                            Sampler {
                                key: key.clone(),
                                base,
                                model_path: Some(key),
                            },
                        );
                    }
                    Ok(FutureState::Json(result))
                })
            }
        };
        json!({"request_id": request_id, "model_id": r.model_id})
    });
    Ok(Json(resp))
}
