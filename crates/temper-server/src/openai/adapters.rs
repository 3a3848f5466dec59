//! `/v1/models` and vLLM's `/v1/load_lora_adapter` /
//! `/v1/unload_lora_adapter`.

use std::sync::PoisonError;

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::error::OpenAiError;
use super::protocol::{parse_body, LoadLoraRequest, UnloadLoraRequest};

use super::state::OpenAiState;

pub(super) async fn list_models(State(s): State<OpenAiState>) -> Result<Json<Value>, OpenAiError> {
    let base = &s.inner.cfg.model_name;
    let len = s.inner.cfg.scheduler.max_model_len;
    let mut data = vec![json!({
        "id": base, "object": "model", "created": s.inner.created, "owned_by": "temper",
        "root": base, "parent": null,
        "max_model_len": len, "version": 0,
    })];
    let table = s
        .inner
        .adapters
        .read()
        .unwrap_or_else(PoisonError::into_inner);
    let mut names: Vec<&String> = table.keys().collect();
    names.sort();
    for n in names {
        let a = &table[n];
        data.push(json!({
            "id": n, "object": "model", "created": s.inner.created, "owned_by": "temper",
            "root": n, "parent": base, "max_model_len": len, "version": a.version,
        }));
    }
    Ok(Json(json!({"object": "list", "data": data})))
}

pub(super) async fn load_lora(
    State(s): State<OpenAiState>,
    body: Bytes,
) -> Result<Json<Value>, OpenAiError> {
    let req: LoadLoraRequest = parse_body(&body)?;
    let dir = s.adapter_dir_in_roots(&req.lora_path)?;
    let st = s.clone();
    let name = req.lora_name.clone();
    let version = tokio::task::spawn_blocking(move || st.load_adapter(&name, &dir))
        .await
        .map_err(|e| OpenAiError::Internal(format!("adapter load task: {e}")))??;
    Ok(Json(json!({
        "lora_name": req.lora_name, "lora_path": req.lora_path, "version": version,
        "status": if version == 1 { "loaded" } else { "swapped" },
    })))
}

pub(super) async fn unload_lora(
    State(s): State<OpenAiState>,
    body: Bytes,
) -> Result<Json<Value>, OpenAiError> {
    let req: UnloadLoraRequest = parse_body(&body)?;
    let removed = s
        .inner
        .adapters
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&req.lora_name);
    match removed {
        Some(a) => Ok(Json(json!({
            "lora_name": req.lora_name, "version": a.version, "status": "unloaded",
        }))),
        None => Err(OpenAiError::NotFound(format!(
            "no LoRA adapter named {:?} is loaded",
            req.lora_name
        ))),
    }
}
