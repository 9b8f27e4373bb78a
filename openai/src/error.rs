//! Errors in OpenAI's shape, `{"error":{"message","type","param","code"}}`, with their HTTP
//! status, and the mapping from the daemon's named errors.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use leanstream::contract::LeanStreamError;
use serde::Serialize;

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `permission_error`, `rate_limit_error`,
    /// `server_error`, …
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A short machine-readable code (`model_not_found`, `busy`, the daemon's error name…).
    pub code: Option<String>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400: the request is malformed or a field is invalid.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::invalid(message).with_param(param)
    }

    /// 403: the caller's identity cannot be carried to the daemon.
    pub fn identity(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "permission_error", message)
            .with_code("identity_unavailable")
    }

    /// 503: the daemon (or its bus) cannot be reached.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            .with_code("daemon_unavailable")
    }

    /// 404 for a path the endpoint does not serve.
    pub fn no_route(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route {path}"),
        )
        .with_code("unknown_url")
    }

    pub fn with_param(mut self, param: &str) -> ApiError {
        self.param = Some(param.to_owned());
        self
    }

    pub fn with_code(mut self, code: &str) -> ApiError {
        self.code = Some(code.to_owned());
        self
    }

    /// The JSON body, `{"error":{...}}`.
    pub fn body(&self) -> serde_json::Value {
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code.as_deref(),
            },
        };
        serde_json::to_value(body).unwrap_or_default()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl From<leanstream::Error> for ApiError {
    /// The daemon's named errors by meaning: bad input 400, unknown model 404, limits 429,
    /// access 403; an unreachable daemon 503; anything else 500.
    fn from(e: leanstream::Error) -> ApiError {
        let message = e.to_string();
        if e.is_unreachable() {
            return ApiError::unavailable(message);
        }
        let Some(named) = e.daemon_error() else {
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
                .with_code("internal_error");
        };
        let (status, kind, code) = match named {
            LeanStreamError::ModelNotFound(_) => {
                return ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
                    .with_param("model")
                    .with_code("model_not_found");
            }
            LeanStreamError::InvalidArgument(_) => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_argument",
            ),
            LeanStreamError::Busy(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "busy"),
            LeanStreamError::OverBudget(_) => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "over_budget",
            ),
            LeanStreamError::AccessDenied(_) => {
                (StatusCode::FORBIDDEN, "permission_error", "access_denied")
            }
            LeanStreamError::InvalidModel(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "invalid_model",
            ),
            LeanStreamError::Cancelled(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "cancelled",
            ),
            LeanStreamError::Internal(_) | LeanStreamError::ZBus(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal_error",
            ),
        };
        ApiError::new(status, kind, message).with_code(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_of(e: LeanStreamError) -> (u16, Option<String>) {
        let api = ApiError::from(leanstream::Error::Daemon(e));
        (api.status.as_u16(), api.code)
    }

    #[test]
    fn daemon_errors_map_to_statuses() {
        let s = String::new;
        assert_eq!(status_of(LeanStreamError::ModelNotFound(s())).0, 404);
        assert_eq!(status_of(LeanStreamError::InvalidArgument(s())).0, 400);
        assert_eq!(status_of(LeanStreamError::Busy(s())).0, 429);
        assert_eq!(status_of(LeanStreamError::OverBudget(s())).0, 429);
        assert_eq!(status_of(LeanStreamError::AccessDenied(s())).0, 403);
        assert_eq!(status_of(LeanStreamError::Internal(s())).0, 500);
        assert_eq!(status_of(LeanStreamError::Cancelled(s())).0, 500);
        let gone = ApiError::from(leanstream::Error::NotRunning {
            message: "no owner".into(),
        });
        assert_eq!(gone.status.as_u16(), 503);
    }

    #[test]
    fn body_has_openai_shape() {
        let body = ApiError::invalid_param("n", "n must be 1").body();
        assert_eq!(
            body,
            serde_json::json!({"error": {"message": "n must be 1",
                "type": "invalid_request_error", "param": "n", "code": null}})
        );
    }
}
