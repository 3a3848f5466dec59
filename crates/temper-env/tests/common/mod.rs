//! A scripted chat model: answers from a list, records what it was asked.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::Mutex;

use async_trait::async_trait;
use temper_env::{
    ChatModel, ChatRequest, FunctionCall, Message, ModelCallError, ModelTurn, TokenTrace, ToolCall,
    Usage,
};

pub struct Scripted {
    replies: Mutex<VecDeque<Result<ModelTurn, ModelCallError>>>,
    pub seen: Mutex<Vec<ChatRequest>>,
}

impl Scripted {
    pub fn new(replies: Vec<Result<ModelTurn, ModelCallError>>) -> Self {
        Scripted {
            replies: Mutex::new(replies.into()),
            seen: Mutex::new(Vec::new()),
        }
    }
    pub fn texts(texts: &[&str]) -> Self {
        Scripted::new(texts.iter().map(|t| Ok(say(t))).collect())
    }
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.seen.lock().unwrap().clone()
    }
}

#[async_trait]
impl ChatModel for Scripted {
    async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
        self.seen.lock().unwrap().push(req);
        self.replies
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_else(|| Err(ModelCallError::Other("script exhausted".into())))
    }
}

pub fn say(text: &str) -> ModelTurn {
    ModelTurn {
        message: Message::assistant(text),
        finish_reason: "stop".into(),
        usage: Usage {
            prompt_tokens: 10,
            completion_tokens: 6,
        },
        trace: None,
    }
}

pub fn call_tools(calls: &[(&str, &str)]) -> ModelTurn {
    let mut m = Message::assistant("");
    m.content = None;
    m.tool_calls = Some(
        calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| ToolCall {
                id: format!("call_{i}"),
                kind: "function".into(),
                function: FunctionCall {
                    name: name.to_string(),
                    arguments: args.to_string(),
                },
            })
            .collect(),
    );
    ModelTurn {
        message: m,
        finish_reason: "tool_calls".into(),
        usage: Usage {
            prompt_tokens: 10,
            completion_tokens: 6,
        },
        trace: Some(TokenTrace {
            prompt_ids: vec![9],
            completion_ids: vec![1, 2, 3],
            logprobs: vec![-0.1, -0.2, -0.3],
            version: 0,
            temperature: 1.0,
        }),
    }
}
