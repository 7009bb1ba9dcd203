//! Thinking modes and their per-request resolution (interfaces.md §2.1).

use crate::protocol::THINK_MAX_MIN_CONTEXT;
use serde_json::Value;
use std::fmt;

/// Effective thinking mode of one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThinkMode {
    /// Prompt ends with `</think>`: direct answer.
    None,
    /// Prompt ends with `<think>` (the default).
    #[default]
    High,
    /// High plus the Think-Max prefix after BOS.
    Max,
}

impl ThinkMode {
    /// True for High and Max.
    pub fn thinking(self) -> bool {
        self != ThinkMode::None
    }
}

/// Requested reasoning effort.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effort {
    None,
    High,
    Max,
}

/// A request field that could not be understood (the server answers 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ThinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for ThinkError {}

/// Parses an effort name: `max`; `xhigh`/`high`/`medium`/`low`/`minimal` (all High);
/// `none`. Unknown names are an error naming `field`.
pub fn parse_effort(field: &str, name: &str) -> Result<Effort, ThinkError> {
    match name {
        "max" => Ok(Effort::Max),
        "xhigh" | "high" | "medium" | "low" | "minimal" => Ok(Effort::High),
        "none" => Ok(Effort::None),
        other => Err(ThinkError {
            field: field.to_string(),
            message: format!("unknown reasoning effort {other:?}"),
        }),
    }
}

/// Accumulates a request's thinking controls, field by field, then resolves the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkControls {
    pub enabled: bool,
    pub effort: Effort,
    /// Whether a field that counts as an explicit on/off control was present.
    pub explicit: bool,
}

impl Default for ThinkControls {
    fn default() -> Self {
        ThinkControls {
            enabled: true,
            effort: Effort::High,
            explicit: false,
        }
    }
}

/// Result of [`ThinkControls::resolve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkResolution {
    pub mode: ThinkMode,
    /// Max was requested but the context is below [`THINK_MAX_MIN_CONTEXT`]: degraded to High
    /// (the CLI prints a warning, the server only logs it).
    pub max_downgraded: bool,
}

impl ThinkControls {
    /// `thinking` (chat/completions/messages): `true`/`false`, or an object whose `type` is
    /// `enabled`/`disabled` (other types, e.g. `adaptive`, and `budget_tokens` change
    /// nothing). Any value, even `null`, counts as explicit; other JSON types are ignored
    /// as in ds4. A non-string `type` is an error.
    pub fn apply_thinking(&mut self, v: &Value) -> Result<(), ThinkError> {
        self.explicit = true;
        match v {
            Value::Bool(b) => self.enabled = *b,
            Value::Object(o) => match o.get("type") {
                Some(Value::String(t)) if t == "enabled" => self.enabled = true,
                Some(Value::String(t)) if t == "disabled" => self.enabled = false,
                Some(Value::String(_)) | None => {}
                Some(_) => {
                    return Err(ThinkError {
                        field: "thinking.type".into(),
                        message: "must be a string".into(),
                    });
                }
            },
            _ => {}
        }
        Ok(())
    }

    /// `think` (chat/completions): a bool, explicit.
    pub fn apply_think(&mut self, on: bool) {
        self.explicit = true;
        self.enabled = on;
    }

    /// `reasoning_effort` / `output_config.effort`: sets the effort, not explicit.
    /// `null` leaves it unchanged; a non-string is an error.
    pub fn apply_effort(&mut self, field: &str, v: &Value) -> Result<(), ThinkError> {
        match v {
            Value::Null => Ok(()),
            Value::String(s) => {
                self.effort = parse_effort(field, s)?;
                Ok(())
            }
            _ => Err(ThinkError {
                field: field.to_string(),
                message: "must be a string".into(),
            }),
        }
    }

    /// Responses `reasoning.effort`: sets the effort and, when non-null, counts as explicit
    /// (`none` disables thinking through the effort).
    pub fn apply_responses_effort(&mut self, v: &Value) -> Result<(), ThinkError> {
        if !v.is_null() {
            self.explicit = true;
            self.enabled = true;
        }
        self.apply_effort("reasoning.effort", v)
    }

    /// Resolves the mode: the `deepseek-chat` / `deepseek-reasoner` model aliases apply only
    /// without an explicit control; Max needs `ctx_size >= 393216`.
    pub fn resolve(&self, model: Option<&str>, ctx_size: u64) -> ThinkResolution {
        let mut enabled = self.enabled;
        if !self.explicit {
            match model {
                Some("deepseek-chat") => enabled = false,
                Some("deepseek-reasoner") => enabled = true,
                _ => {}
            }
        }
        let mode = match (enabled, self.effort) {
            (false, _) | (_, Effort::None) => ThinkMode::None,
            (true, Effort::Max) => ThinkMode::Max,
            (true, Effort::High) => ThinkMode::High,
        };
        if mode == ThinkMode::Max && ctx_size < THINK_MAX_MIN_CONTEXT {
            return ThinkResolution {
                mode: ThinkMode::High,
                max_downgraded: true,
            };
        }
        ThinkResolution {
            mode,
            max_downgraded: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const BIG: u64 = 393_216;

    #[test]
    fn defaults_and_aliases() {
        let c = ThinkControls::default();
        assert_eq!(c.resolve(None, BIG).mode, ThinkMode::High);
        assert_eq!(c.resolve(Some("deepseek-chat"), BIG).mode, ThinkMode::None);
        assert_eq!(
            c.resolve(Some("deepseek-reasoner"), BIG).mode,
            ThinkMode::High
        );
        // chat: reasoning_effort is not explicit, so the alias wins.
        let mut c = ThinkControls::default();
        c.apply_effort("reasoning_effort", &json!("high")).unwrap();
        assert_eq!(c.resolve(Some("deepseek-chat"), BIG).mode, ThinkMode::None);
        // responses: reasoning.effort is explicit.
        let mut c = ThinkControls::default();
        c.apply_responses_effort(&json!("high")).unwrap();
        assert_eq!(c.resolve(Some("deepseek-chat"), BIG).mode, ThinkMode::High);
        let mut c = ThinkControls::default();
        c.apply_responses_effort(&json!("none")).unwrap();
        assert_eq!(c.resolve(None, BIG).mode, ThinkMode::None);
    }

    #[test]
    fn thinking_field_forms() {
        for (v, on) in [
            (json!(false), false),
            (json!(true), true),
            (json!({"type":"disabled"}), false),
            (json!({"type":"enabled","budget_tokens":5}), true),
            (json!({"type":"adaptive"}), true),
            (json!(null), true),
        ] {
            let mut c = ThinkControls::default();
            c.apply_thinking(&v).unwrap();
            assert!(c.explicit);
            // explicit control beats the deepseek-chat alias
            assert_eq!(
                c.resolve(Some("deepseek-chat"), BIG).mode.thinking(),
                on,
                "{v}"
            );
        }
        let mut c = ThinkControls::default();
        assert!(c.apply_thinking(&json!({"type": 3})).is_err());
        // Unknown types leave an earlier choice alone.
        let mut c = ThinkControls::default();
        c.apply_think(false);
        c.apply_thinking(&json!({"type":"adaptive"})).unwrap();
        assert!(!c.enabled);
    }

    #[test]
    fn effort_names_and_max_gate() {
        for (n, e) in [
            ("max", Effort::Max),
            ("xhigh", Effort::High),
            ("minimal", Effort::High),
            ("none", Effort::None),
        ] {
            assert_eq!(parse_effort("reasoning_effort", n).unwrap(), e);
        }
        let err = parse_effort("reasoning_effort", "ultra").unwrap_err();
        assert!(err.to_string().contains("reasoning_effort") && err.to_string().contains("ultra"));
        let mut c = ThinkControls::default();
        c.apply_effort("reasoning_effort", &json!("max")).unwrap();
        assert_eq!(
            c.resolve(None, BIG),
            ThinkResolution {
                mode: ThinkMode::Max,
                max_downgraded: false
            }
        );
        assert_eq!(
            c.resolve(None, BIG - 1),
            ThinkResolution {
                mode: ThinkMode::High,
                max_downgraded: true
            }
        );
        c.apply_effort("reasoning_effort", &json!(null)).unwrap();
        assert_eq!(c.effort, Effort::Max);
        c.apply_think(false);
        assert_eq!(c.resolve(None, BIG).mode, ThinkMode::None);
    }
}
