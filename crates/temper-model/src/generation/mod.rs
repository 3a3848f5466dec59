//! Generation and scoring: the sampler, the token rules it and the server
//! share, the training forward's per-token logprobs, and top alternatives.

pub mod decode;
pub mod logprobs;
pub mod sampling;
pub(crate) mod top_logprobs;
