//! The teacher of on-policy distillation: what scores the student's sampled
//! tokens. Either a local model (a Hugging Face directory or GGUF file, with
//! an optional PEFT adapter) run in process by its own engine, or any server
//! that returns prompt logprobs for token ids.
//!
//! Logprobs are compared token by token, so the teacher must tokenize
//! exactly as the student does: a local teacher's vocabulary (added and
//! special tokens included) must equal the student's, and an endpoint must
//! tokenize a probe text (every special token of the student in it) to the
//! same ids. A mismatch is refused before the first step.
//!
//! The endpoint request is the OpenAI completions API with a token-id
//! prompt, `echo` and `logprobs`, which `temper serve` and vLLM both answer
//! with the prompt's logprobs:
//!
//! ```json
//! POST /v1/completions
//! {"model": "teacher", "prompt": [1, 2, 3], "max_tokens": 1, "echo": true,
//!  "logprobs": 0, "temperature": 1.0}
//! → choices[0].logprobs.token_logprobs = [null, lp(2 | 1), lp(3 | 1 2), lp(generated)]
//! ```

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value};
use temper_engine::{Engine, EngineError};
use temper_model::{LoadOptions, Pretrained, Tokenizer};

use crate::datum::TrainSeq;
use crate::error::{Result, RlError};
use crate::plan::TeacherSource;

/// A loaded, checked teacher.
pub enum Teacher {
    /// In process: its own engine and the sampler weights it scores with.
    Local {
        /// The engine holding the teacher.
        engine: Engine,
        /// The teacher's sampler key in it.
        sampler: String,
    },
    /// A server answering `/v1/completions` with prompt logprobs.
    Endpoint {
        /// HTTP client.
        client: reqwest::Client,
        /// Base URL.
        url: String,
        /// Model name on the server.
        model: String,
        /// Bearer token.
        api_key: Option<String>,
    },
}

impl Teacher {
    /// Load the teacher of `source` and check that it tokenizes as
    /// `student` does.
    pub async fn load(source: &TeacherSource, student: &Tokenizer) -> Result<Self> {
        match source {
            TeacherSource::Local {
                path,
                adapter,
                precision,
            } => {
                let opts = LoadOptions {
                    precision: *precision,
                    ..LoadOptions::default()
                };
                let (path, adapter) = (path.clone(), adapter.clone());
                let teacher = tokio::task::spawn_blocking(move || {
                    Ok::<_, RlError>(Arc::new(Pretrained::load(&path, &opts)?))
                })
                .await
                .map_err(|source| RlError::Blocking {
                    what: "loading the teacher",
                    source,
                })??;
                same_vocabulary(student, &teacher.tokenizer, &teacher.dir)?;
                let engine = Engine::new();
                let sampler = "teacher".to_string();
                let e = engine.clone();
                let key = sampler.clone();
                tokio::task::spawn_blocking(move || -> Result<()> {
                    e.add_base_model("teacher", teacher).wait()?;
                    match adapter {
                        Some(dir) => {
                            let run = e.create_lora_run_from_peft("teacher", dir).wait()?;
                            e.save_weights_for_sampler(&run, &key).wait()?;
                        }
                        None => e.add_base_sampler("teacher", &key).wait()?,
                    }
                    Ok(())
                })
                .await
                .map_err(|source| RlError::Blocking {
                    what: "loading the teacher",
                    source,
                })??;
                Ok(Teacher::Local { engine, sampler })
            }
            TeacherSource::Endpoint {
                url,
                model,
                api_key_env,
            } => {
                let api_key = match api_key_env {
                    Some(var) => Some(std::env::var(var).map_err(|_| {
                        RlError::Config(format!(
                            "distill.teacher.api_key_env names {var}, which is not set"
                        ))
                    })?),
                    None => None,
                };
                let teacher = Teacher::Endpoint {
                    client: reqwest::Client::new(),
                    url: url.clone(),
                    model: model.clone(),
                    api_key,
                };
                teacher.check_endpoint_tokenizer(student).await?;
                Ok(teacher)
            }
        }
    }

    /// The teacher's logprobs of each sequence's tokens `1..` at the
    /// temperature the sequence was sampled at (so both sides of the KL are
    /// the same tempered distributions).
    pub async fn score(&self, seqs_d: &[TrainSeq]) -> Result<Vec<Vec<f32>>> {
        let each = seqs_d
            .iter()
            .map(|s| self.logprobs(s.tokens(), s.temperature()));
        futures::future::try_join_all(each).await
    }

    /// Logprobs of `tokens[1..]` at `temperature`.
    pub async fn logprobs(&self, tokens: &[u32], temperature: f64) -> Result<Vec<f32>> {
        match self {
            Teacher::Local { engine, sampler } => Ok(engine
                .compute_logprobs(sampler, tokens.to_vec(), temperature)
                .await
                .map_err(|e: EngineError| RlError::Sampler(format!("the teacher: {e}")))?),
            Teacher::Endpoint { .. } => {
                let body = json!({
                    "prompt": tokens, "max_tokens": 1, "echo": true, "logprobs": 0,
                    "temperature": temperature,
                });
                let out: Completion = self.complete(body).await?;
                let lps = out.token_logprobs()?;
                // [null, prompt 1.., generated...]: keep the prompt's.
                let got: Option<Vec<f32>> = lps
                    .get(1..tokens.len())
                    .and_then(|l| l.iter().copied().collect());
                got.ok_or_else(|| {
                    RlError::Sampler(format!(
                        "the teacher endpoint returned {} logprobs (with nulls) for a prompt of {} tokens; \
                         it must echo the prompt's logprobs",
                        lps.len(),
                        tokens.len()
                    ))
                })
            }
        }
    }

    /// POST `/v1/completions` with `body` (the model added).
    async fn complete(&self, mut body: Value) -> Result<Completion> {
        let Teacher::Endpoint {
            client,
            url,
            model,
            api_key,
        } = self
        else {
            return Err(RlError::Sampler("not an endpoint teacher".into()));
        };
        body["model"] = json!(model);
        let mut req = client.post(format!("{url}/v1/completions")).json(&body);
        if let Some(k) = api_key {
            req = req.bearer_auth(k);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| RlError::Sampler(format!("the teacher endpoint {url}: {e}")))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| RlError::Sampler(format!("the teacher endpoint {url}: {e}")))?;
        if !status.is_success() {
            return Err(RlError::Sampler(format!(
                "the teacher endpoint {url} answered {status}: {text}"
            )));
        }
        serde_json::from_str(&text).map_err(|e| {
            RlError::Sampler(format!(
                "the teacher endpoint {url} answered a malformed completion ({e}): {text}"
            ))
        })
    }

    /// The endpoint must tokenize a probe text (with every added token of
    /// the student's tokenizer in it) to the student's ids.
    async fn check_endpoint_tokenizer(&self, student: &Tokenizer) -> Result<()> {
        let probe = probe_text(student);
        let want = student.encode(&probe, true)?;
        let body = json!({
            "prompt": probe, "max_tokens": 1, "temperature": 0.0,
            "return_token_ids": true,
        });
        let out = self.complete(body).await?;
        let got = out
            .choices
            .first()
            .and_then(|c| c.prompt_token_ids.clone())
            .ok_or_else(|| {
                RlError::Config(
                    "the teacher endpoint returned no prompt_token_ids for \"return_token_ids\": \
                     true, so its tokenizer cannot be checked against the student's"
                        .into(),
                )
            })?;
        if got != want {
            let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            return Err(mismatch(format!(
                "the endpoint tokenizes a probe text to {} ids, the student to {}; first \
                 difference at position {at}: teacher {:?}, student {:?}",
                got.len(),
                want.len(),
                got.get(at),
                want.get(at)
            )));
        }
        Ok(())
    }
}

#[derive(Deserialize)]
struct Completion {
    choices: Vec<CompletionChoice>,
}

#[derive(Deserialize)]
struct CompletionChoice {
    logprobs: Option<CompletionLogprobs>,
    prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Deserialize)]
struct CompletionLogprobs {
    token_logprobs: Vec<Option<f32>>,
}

impl Completion {
    fn token_logprobs(self) -> Result<Vec<Option<f32>>> {
        self.choices
            .into_iter()
            .next()
            .and_then(|c| c.logprobs)
            .map(|l| l.token_logprobs)
            .ok_or_else(|| {
                RlError::Sampler("the teacher endpoint returned a choice without logprobs".into())
            })
    }
}

/// A text that exercises the tokenizer: words, digits, whitespace,
/// non-ASCII, and every added (special) token.
fn probe_text(tok: &Tokenizer) -> String {
    let mut added: Vec<String> = tok
        .inner()
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(_, t)| t.content)
        .collect();
    added.sort();
    format!(
        "Distillation probe: 12 + 30 = 42.\n\t<answer>42</answer>  ünïcödé 東京 😀 {}",
        added.join(" x ")
    )
}

fn mismatch(detail: String) -> RlError {
    RlError::Config(format!(
        "the teacher's tokenizer differs from the student's ({detail}); distillation compares \
         logprobs token by token, so the teacher must use the student's tokenizer"
    ))
}

/// A local teacher's vocabulary (added and special tokens included) and
/// its BOS/EOS must be the student's.
fn same_vocabulary(student: &Tokenizer, teacher: &Tokenizer, teacher_dir: &Path) -> Result<()> {
    let (s, t): (HashMap<String, u32>, HashMap<String, u32>) = (
        student.inner().get_vocab(true),
        teacher.inner().get_vocab(true),
    );
    let dir = teacher_dir.display();
    if s.len() != t.len() {
        return Err(mismatch(format!(
            "{dir} has {} tokens, the student {}",
            t.len(),
            s.len()
        )));
    }
    let mut differ: Vec<(&String, &u32)> = s
        .iter()
        .filter(|&(k, v)| t.get(k.as_str()) != Some(v))
        .collect();
    differ.sort();
    if let Some((token, id)) = differ.first() {
        return Err(mismatch(format!(
            "{} of {} tokens differ, e.g. {token:?} is {id} for the student and {} in {dir}",
            differ.len(),
            s.len(),
            t.get(*token)
                .map_or("absent".to_string(), |i| i.to_string())
        )));
    }
    if (student.bos_token(), student.eos_token()) != (teacher.bos_token(), teacher.eos_token()) {
        return Err(mismatch(format!(
            "BOS/EOS {:?}/{:?} in {dir}, {:?}/{:?} for the student",
            teacher.bos_token(),
            teacher.eos_token(),
            student.bos_token(),
            student.eos_token()
        )));
    }
    Ok(())
}
