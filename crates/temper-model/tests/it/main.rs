//! Integration tests of temper-model, one module per topic.

mod common;
mod golden;
mod loading;
mod sampling;
mod training;
