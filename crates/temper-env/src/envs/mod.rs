//! Built-in procedural environments: seeded, unlimited rows, each with a
//! difficulty knob in its arguments.

mod code_python;
mod procedural;
mod wordle;

use serde_json::Value;

use crate::{Env, EnvError};

pub use procedural::countdown_valid;
pub use wordle::feedback as wordle_feedback;

/// Names of the built-in environments.
pub const BUILTIN_ENVS: &[&str] = &[
    "arithmetic",
    "reverse-text",
    "alphabet-sort",
    "countdown",
    "calculator-tools",
    "wordle",
    "code-python",
];

/// Build a built-in environment; `None` when `name` is not one.
pub fn builtin(name: &str, args: &Value) -> Option<Result<Env, EnvError>> {
    Some(match name {
        "arithmetic" => procedural::arithmetic(args),
        "reverse-text" => procedural::reverse_text(args),
        "alphabet-sort" => procedural::alphabet_sort(args),
        "countdown" => procedural::countdown(args),
        "calculator-tools" => procedural::calculator_tools(args),
        "wordle" => wordle::build(args),
        "code-python" => code_python::build(args),
        _ => return None,
    })
}

/// Five-letter English words: Wordle secrets and text material.
pub(crate) const WORDS: &[&str] = &[
    "apple", "beach", "brain", "bread", "brick", "brush", "candy", "chain", "chair", "chalk",
    "charm", "chess", "chest", "cloud", "coast", "crane", "cream", "crown", "dance", "dream",
    "drink", "eagle", "earth", "flame", "float", "flour", "focus", "frame", "fruit", "ghost",
    "giant", "glass", "globe", "grape", "grass", "green", "heart", "horse", "house", "juice",
    "knife", "lemon", "light", "lunar", "magic", "maple", "march", "metal", "money", "mouse",
    "music", "night", "noble", "ocean", "olive", "opera", "paint", "paper", "party", "peach",
    "pearl", "piano", "pilot", "plant", "plate", "point", "power", "pride", "queen", "quiet",
    "radio", "raven", "river", "robin", "rocky", "round", "royal", "salad", "sauce", "scale",
    "shade", "sheep", "shell", "shine", "shirt", "skate", "slate", "smile", "smoke", "snake",
    "solar", "sound", "space", "spice", "spoon", "sport", "stamp", "steam", "stone", "storm",
    "sugar", "sweet", "table", "tiger", "toast", "torch", "tower", "track", "train", "trend",
    "truck", "union", "vivid", "voice", "waste", "water", "whale", "wheat", "world", "zebra",
];
