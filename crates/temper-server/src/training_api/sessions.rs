//! Sessions and training models: service capabilities, client config,
//! session create / heartbeat / finish, `create_model` and `get_info`.

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use temper_model::{LoraConfig, Target};

use super::futures::FutureState;
use super::state::{over_limit, ApiState, TrainModel, LORA_ALPHA};
use super::wire::parse;
use crate::error::ApiError;

pub(super) async fn capabilities(State(s): State<ApiState>) -> Json<Value> {
    let models: Vec<Value> =
        s.0.bases
            .values()
            .map(|b| {
                json!({
                    "model_name": b.name,
                    "max_context_length": b.model.config.max_position_embeddings,
                    "trainable": true,
                    "sampleable": true,
                })
            })
            .collect();
    Json(json!({ "supported_models": models }))
}

pub(super) async fn client_config() -> Json<Value> {
    // Plain httpx transport, strictly sequential forward_backward chunks,
    // uncompressed protobuf, no JWT exchange, no server-side custom losses.
    Json(json!({
        "pjwt_auth_enabled": false,
        "use_pyqwest_transport": false,
        "proto_compress_fwdbwd": false,
        "parallel_fwdbwd_chunks": false,
        "custom_loss_server_side": false,
        "sample_use_retrieve_futures": false,
        "sample_join_sampling_session": false,
    }))
}

pub(super) async fn create_session(State(s): State<ApiState>) -> Json<Value> {
    let id = s.next_id("sess");
    s.tables().sessions.insert(id.clone(), false);
    Json(json!({"type": "create_session", "session_id": id}))
}

#[derive(Deserialize)]
struct SessionRef {
    session_id: String,
}

pub(super) async fn heartbeat(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: SessionRef = parse(&body)?;
    match s.tables().sessions.get(&r.session_id) {
        Some(false) => Ok(Json(json!({"type": "session_heartbeat"}))),
        Some(true) => Err(ApiError::Gone(format!(
            "session {} is finished",
            r.session_id
        ))),
        None => Err(ApiError::NotFound(format!(
            "unknown session {}",
            r.session_id
        ))),
    }
}

pub(super) async fn finish_session(
    State(s): State<ApiState>,
    UrlPath(id): UrlPath<String>,
) -> Json<Value> {
    if let Some(f) = s.tables().sessions.get_mut(&id) {
        *f = true;
    }
    Json(json!({}))
}

#[derive(Deserialize)]
struct CreateModel {
    session_id: String,
    model_seq_id: i64,
    base_model: String,
    #[serde(default)]
    lora_config: Option<LoraRequest>,
}

#[derive(Deserialize)]
pub(super) struct LoraRequest {
    #[serde(default = "default_rank")]
    rank: usize,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default = "yes")]
    train_mlp: bool,
    #[serde(default = "yes")]
    train_attn: bool,
}

fn default_rank() -> usize {
    32
}
fn yes() -> bool {
    true
}

pub(super) fn lora_config(
    req: Option<&LoraRequest>,
) -> std::result::Result<(LoraConfig, u64), String> {
    let (rank, seed, mlp, attn) = match req {
        Some(l) => (l.rank, l.seed.unwrap_or(0), l.train_mlp, l.train_attn),
        None => (32, 0, true, true),
    };
    let mut targets = Vec::new();
    if attn {
        targets.extend([Target::Q, Target::K, Target::V, Target::O]);
    }
    if mlp {
        targets.extend([Target::Gate, Target::Up, Target::Down]);
    }
    if rank == 0 || targets.is_empty() {
        return Err("LoRA needs rank >= 1 and train_attn or train_mlp".into());
    }
    Ok((
        LoraConfig {
            rank,
            alpha: LORA_ALPHA,
            targets,
            use_rslora: false,
        },
        seed,
    ))
}

pub(super) async fn create_model(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: CreateModel = parse(&body)?;
    s.known_session(&r.session_id)?;
    if let Some(l) = &r.lora_config {
        let max = s.0.config.limits.max_lora_rank;
        if l.rank > max {
            return Err(over_limit(
                "lora_config.rank",
                l.rank,
                max,
                "--max-lora-rank",
            ));
        }
    }
    let model_id = format!("{}:train:{}", r.session_id, r.model_seq_id);
    let resp = s.dedupe(&model_id, Some(-1), || {
        let request_id = if !s.0.bases.contains_key(&r.base_model) {
            s.failed_future(format!(
                "unknown base_model {:?}; this server serves {:?}",
                r.base_model,
                s.0.bases.keys().collect::<Vec<_>>()
            ))
        } else {
            match lora_config(r.lora_config.as_ref()) {
                Err(e) => s.failed_future(e),
                Ok((cfg, seed)) => {
                    let rank = cfg.rank;
                    let pending = s.0.engine.create_lora_run(&r.base_model, cfg, seed);
                    let (st, mid, base) = (s.clone(), model_id.clone(), r.base_model.clone());
                    s.spawn_future(async move {
                        let run = pending.await?;
                        st.tables()
                            .models
                            .insert(mid.clone(), TrainModel { run, base, rank });
                        Ok(FutureState::Json(
                            json!({"type": "create_model", "model_id": mid}),
                        ))
                    })
                }
            }
        };
        json!({"request_id": request_id, "model_id": model_id})
    });
    Ok(Json(resp))
}

#[derive(Deserialize)]
struct ModelRef {
    model_id: String,
}

pub(super) async fn get_info(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: ModelRef = parse(&body)?;
    let (_, base, rank) = s.model(&r.model_id).map_err(ApiError::NotFound)?;
    let b =
        s.0.bases
            .get(&base)
            .ok_or_else(|| ApiError::Internal(format!("base {base} vanished")))?;
    // An absolute local directory (no ':') lets `get_tokenizer()` load offline.
    let tokenizer_id = std::fs::canonicalize(&b.model.dir)
        .unwrap_or_else(|_| b.model.dir.clone())
        .display()
        .to_string();
    Ok(Json(json!({
        "type": "get_info",
        "model_id": r.model_id,
        "model_data": {
            "arch": b.model.config.family.model_type(),
            "model_name": base,
            "tokenizer_id": tokenizer_id,
        },
        "is_lora": true,
        "lora_rank": rank,
        "model_name": base,
        "optimizer_config": {"type": "adamw"},
    })))
}
