//! The training API over the fixture model, and its JSON calls sent in
//! process: shared by the training API's test binaries.

use std::path::Path;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::Value;
use temper_server::training_api::{app, ApiConfig, ApiState, BaseModel};

/// The API key every training-API test sends.
pub const KEY: &str = "tml-k";

/// A training API serving the fixture model as `tiny`, checkpoints under
/// `ckpt`, delivered results kept for `grace`.
pub fn state_with_grace(ckpt: &Path, grace: Duration) -> ApiState {
    ApiState::new(
        vec![BaseModel {
            name: "tiny".into(),
            model: super::load(),
        }],
        ApiConfig {
            api_key: Some(KEY.into()),
            checkpoint_dir: ckpt.to_path_buf(),
            long_poll: Duration::from_secs(5),
            result_grace: grace,
            limits: Default::default(),
            adapters: Default::default(),
        },
    )
}

/// [`state_with_grace`] with a ten-minute grace.
pub fn state(ckpt: &Path) -> ApiState {
    state_with_grace(ckpt, Duration::from_secs(600))
}

/// Send `req` with the API key: the status and the JSON body (`Null` when
/// the body is not JSON).
pub async fn send(s: &ApiState, req: Request<Body>) -> (StatusCode, Value) {
    let (status, bytes) = super::send(&app(s.clone()), req).await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// POST `body` as JSON to `path`.
pub async fn call(s: &ApiState, path: &str, body: Value) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header("x-api-key", KEY)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    send(s, req).await
}
