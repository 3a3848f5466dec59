//! The seam between harnesses and models: [`ChatModel`].

use async_trait::async_trait;

use crate::{ChatRequest, ModelCallError, ModelTurn};

/// A chat model. Harnesses talk to models only through this trait, so the
/// same environment runs against an OpenAI-compatible endpoint
/// ([`crate::openai::OpenAiChatModel`]) or an in-process engine (the RL
/// trainer's implementation).
///
/// ```
/// use async_trait::async_trait;
/// use temper_env::{ChatModel, ChatRequest, Message, ModelCallError, ModelTurn, Usage};
///
/// /// Always answers "42".
/// struct FortyTwo;
///
/// #[async_trait]
/// impl ChatModel for FortyTwo {
///     async fn chat(&self, _req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
///         Ok(ModelTurn {
///             message: Message::assistant("<answer>42</answer>"),
///             finish_reason: "stop".into(),
///             usage: Usage::default(),
///             trace: None,
///         })
///     }
/// }
/// ```
#[async_trait]
pub trait ChatModel: Send + Sync {
    /// One chat completion. Implementations retry what they can; the error
    /// they return ends the rollout and is recorded on it.
    async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError>;
}

#[async_trait]
impl<T: ChatModel + ?Sized> ChatModel for std::sync::Arc<T> {
    async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
        (**self).chat(req).await
    }
}
