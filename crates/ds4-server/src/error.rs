//! Errors in each protocol's own shape (interfaces.md §1.9). Anthropic endpoints use
//! Anthropic's envelope (`{"type":"error","error":{…}}`) — an *Opportunity* over ds4,
//! which sent the OpenAI shape everywhere; the official SDKs map both by status code.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// Which error envelope to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    OpenAi,
    Anthropic,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub proto: Proto,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    /// (n_prompt_tokens, n_ctx) for context-length errors.
    pub counts: Option<(usize, usize)>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            proto: Proto::OpenAi,
            param: None,
            code: None,
            counts: None,
        }
    }
    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn proto(mut self, p: Proto) -> Self {
        self.proto = p;
        self
    }
    pub fn context_length(n_prompt: usize, n_ctx: usize, param: &'static str) -> Self {
        ApiError {
            param: Some(param),
            code: Some("context_length_exceeded"),
            counts: Some((n_prompt, n_ctx)),
            ..Self::bad(format!(
                "Prompt has {n_prompt} tokens, but the configured context size is {n_ctx} tokens"
            ))
        }
    }

    fn kind(&self) -> &'static str {
        let s = self.status.as_u16();
        match (self.proto, s) {
            (Proto::Anthropic, 401) => "authentication_error",
            (Proto::Anthropic, 404) => "not_found_error",
            (Proto::Anthropic, 413) => "request_too_large",
            (Proto::Anthropic, 503) => "overloaded_error",
            (Proto::Anthropic, 500..) => "api_error",
            (Proto::Anthropic, _) => "invalid_request_error",
            (Proto::OpenAi, 401) => "authentication_error",
            (Proto::OpenAi, 500..) => "server_error",
            (Proto::OpenAi, _) => "invalid_request_error",
        }
    }

    pub fn body(&self) -> Value {
        let mut e = json!({"message": self.message, "type": self.kind()});
        if self.proto == Proto::Anthropic {
            e = json!({"type": self.kind(), "message": self.message});
        } else {
            if let Some(p) = self.param {
                e["param"] = json!(p);
            }
            if let Some(c) = self.code {
                e["code"] = json!(c);
            }
        }
        if let Some((n, c)) = self.counts {
            e["n_prompt_tokens"] = json!(n);
            e["n_ctx"] = json!(c);
        }
        match self.proto {
            Proto::OpenAi => json!({ "error": e }),
            Proto::Anthropic => json!({"type": "error", "error": e}),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        crate::json_response(self.status, &self.body())
    }
}
